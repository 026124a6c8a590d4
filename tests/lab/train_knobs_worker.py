"""Started by ``torchrun`` in test_train_knobs.py (not a test module): the lab's knobs applied from the environment
(:func:`benchmarks.lab.train_knobs.apply`, first, as ``python -m benchmarks.lab`` does), then the distributed mode's
worker of tests/distributed, same arguments."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "distributed")]  # torchrun puts only this script's folder there

from benchmarks.lab import train_knobs  # noqa: E402

if __name__ == "__main__":
    train_knobs.apply()
    import train_bench_worker

    raise SystemExit(train_bench_worker.main(*sys.argv[1:]))
