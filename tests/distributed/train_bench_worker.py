"""Started by ``torchrun`` in test_train_bench.py (not a test module): the ``train`` workload's distributed mode on a
tiny synthetic Llama (fp32), on the CPU over gloo or with ``cuda`` as the second argument one GPU per process over
NCCL; every case's implementations (the cases whose shape label matches the third argument, a regular expression,
as ``--shapes`` selects them) stepped as the harness would, and rank 0 writing what the rows would carry to the JSON
file named by the first argument."""

from __future__ import annotations

import json
import math
import re
import sys

import torch
import torch.distributed as dist

from sparsefuse import backend_for, planning, track_launches
from sparsefuse.bench.harness import Options
from sparsefuse.bench.workloads import train, train_setup

TINY = dict(
    hidden_size=32,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=64,
    max_position_embeddings=64,
)
STEPS = 2  # per implementation: the first one after the gradient check, and one more


def main(out_path: str, device: str = "cpu", shapes: str = "") -> int:
    train_setup.MODEL_SHAPE = TINY
    # the block step in every call: the tiny model fires 6% of its neurons, past which auto takes the dense layout
    with planning(hybrid_mlp={"dense_above": 1.0}):
        return _main(out_path, device, shapes)


def _main(out_path: str, device: str, shapes: str) -> int:
    train_setup.QUICK = ((2,), (6.0,), [(2, 16)])
    options = Options(quick=True, dtypes=(torch.float32,), device=device, log=print)
    results: dict[str, dict] = {}
    for case in train.train_cases(options):
        if not re.search(shapes, case.shape):
            continue
        (ids,) = case.make_inputs()
        rows = results.setdefault(case.shape, {})
        for impl, fn in case.impls.items():
            with track_launches() as launched:
                losses = [float(fn(ids)) for _ in range(STEPS)]
            # the note's peak memory is a collective: every rank asks for it, as the harness does
            rows[impl] = dict(
                losses=losses,
                tokens=case.tokens,
                note=case.impl_note(impl),
                method=case.method,
                launched=launched,
                backend=str(backend_for(ids).value),
            )
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(dict(world=dist.get_world_size(), rows=results), f)
    ok = all(math.isfinite(v) for rows in results.values() for row in rows.values() for v in row["losses"])
    dist.barrier()  # rank 0 has written: the group is torn down together (at exit), which gloo wants
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
