"""``python -m benchmarks.lab bench|check [args ...]`` from the repository root (under ``torchrun`` too): sparsefuse's
command line with the lab's workloads registered (:data:`WORKLOADS`) and :mod:`.train_knobs` applied, e.g.::

    python -m benchmarks.lab bench ffn_products --dtype bfloat16 --out benchmarks/results
    SPARSEFUSE_TRAIN_PIN_CPUS=1 torchrun --nproc_per_node 2 -m benchmarks.lab bench train --dtype bfloat16 --out OUT
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

WORKLOADS = ("ffn_products",)  # the lab's workload modules, each registering itself with sparsefuse's harness


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    if not torch.cuda.is_available():
        # set before sparsefuse is imported, as `python -m sparsefuse` does by re-executing itself, which would
        # leave the lab's workloads behind
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from sparsefuse.__main__ import main as cli

    from . import train_knobs

    for name in WORKLOADS:
        importlib.import_module(f"{__package__}.{name}")
    train_knobs.apply()
    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
