"""Probe: launch configuration of the ELL gather-accumulate (sparse_matmul on a ready ELL) at the decode's large
shapes; "library" is spmm._gather_config's choice when run. The committed log's run predates that function: the
library then launched 4 warps, 1 KiB of a W row per program (BLOCK_D = 1024 / element size) and 32 entries per step.
With more warps than a row of the [BLOCK_K, BLOCK_D] tile fills, every step's sum over the BLOCK_K rows crosses
warps through shared memory (as the scan's did: probe-decode-dtype). This sweeps warps x BLOCK_D x BLOCK_K.
CUDA graphs over rotated inputs.
Usage: cd scripts && python probe_gather_config.py"""

from __future__ import annotations

import itertools

import torch
import triton

from probe_decode import acts_with_l0, time_graph
from sparsefuse.sparse import dense_to_ell, sparse_matmul, spmm


def main() -> None:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    default = spmm._gather_config
    for B, F, D, l0, dtype in [(4096, 65536, 2304, 72, torch.bfloat16), (4096, 65536, 2304, 72, torch.float32),
                               (1024, 131072, 3584, 72, torch.bfloat16), (1024, 32768, 2048, 100, torch.bfloat16),
                               (1024, 32768, 2048, 100, torch.float32), (256, 65536, 768, 64, torch.bfloat16)]:  # fmt: skip
        per_set = B * F * dtype.itemsize + F * D * dtype.itemsize
        n_sets = max(2, min(16, (3 * l2) // per_set + 1))
        sets = [(acts_with_l0(B, F, l0, dtype), (torch.randn(F, D, device="cuda") / 16).to(dtype))
                for _ in range(n_sets)]  # fmt: skip
        ells = [(dense_to_ell(a, 2 * l0), w) for a, w in sets]
        del sets
        lib = time_graph(sparse_matmul, ells)
        results = []
        e = dtype.itemsize
        for block_d, block_k, warps in itertools.product([128 // e * 2, 256 // e * 2, 512 // e * 2, 1024 // e * 2],
                                                         [16, 32, 64], [1, 2, 4, 8]):  # fmt: skip
            cfg = spmm._LaunchConfig(block_d=block_d, block_f=1024, block_k=block_k, group=2, num_warps=warps)
            spmm._gather_config = lambda *_, cfg=cfg: cfg
            try:
                results.append((time_graph(sparse_matmul, ells), block_d, block_k, warps))
            finally:
                spmm._gather_config = default
        best = sorted(results)[:8]
        print(f"B={B} F={F} D={D} L0={l0} {str(dtype)[6:]}: library {lib:7.1f} us; best: " + ", ".join(
            f"d{d} k{k} w{w} {t:.1f}" for t, d, k, w in best), flush=True)  # fmt: skip
        print("  all: " + ", ".join(f"d{d} k{k} w{w} {t:.1f}" for t, d, k, w in sorted(results, key=lambda r: r[1:])),
              flush=True)  # fmt: skip
        del ells


if __name__ == "__main__":
    main()
