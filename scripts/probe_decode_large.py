"""Probe (large batches): skip-zeros scan launch configurations, the ELL gather alone, and a small L0 sweep against
dense cuBLAS, at the Gemma Scope 2B 65k shape. Usage: python scripts/probe_decode_large.py"""

from __future__ import annotations

import itertools

import torch

from probe_decode import acts_with_l0, time_graph
from sparsefuse.sparse import dense_to_ell, spmm
from sparsefuse.sparse.spmm import _LaunchConfig, matmul_skip_zeros, sparse_matmul


def main():
    default_cfg, default_gather = spmm._launch_config, spmm._gather_config
    for (B, F, D, l0), dtype in itertools.product([(4096, 65536, 2304, 72), (256, 65536, 768, 64)],
                                                  [torch.bfloat16, torch.float32]):  # fmt: skip
        sets = [(acts_with_l0(B, F, l0, dtype), torch.randn(F, D, device="cuda", dtype=dtype) / 16) for _ in range(3)]
        ref = sets[0][0].double() @ sets[0][1].double()
        print(f"B={B} F={F} D={D} L0={l0} {dtype}", flush=True)
        print(f"  dense same dtype {time_graph(lambda a, w: a @ w, sets):9.1f} us")
        csr = [(a.to_sparse_csr(), w) for a, w in sets]
        print(f"  sparse.mm prebuilt {time_graph(lambda c, w: torch.sparse.mm(c, w), csr):9.1f} us")
        ells = [(dense_to_ell(a, 2 * l0), w) for a, w in sets]
        for block_d, warps, block_k in [(256, 4, 32), (512, 4, 32), (256, 4, 16), (1024, 8, 32), (128, 4, 32)]:
            cfg = _LaunchConfig(block_d=block_d, block_f=1024, block_k=block_k, group=2, num_warps=warps)
            spmm._gather_config = lambda *_, cfg=cfg: cfg
            t = time_graph(lambda e, w: sparse_matmul(e, w), ells)
            print(f"  ELL gather only d{block_d} w{warps} k{block_k} {t:9.1f} us")
        for block_d, warps, block_f in [(1024, 4, 1024), (4096, 8, 1024), (4096, 8, 512), (4096, 4, 1024),
                                        (2048, 8, 1024), (4096, 16, 1024)]:  # fmt: skip
            if block_d > 2 * triton_np2(D):
                continue
            cfg = _LaunchConfig(block_d=block_d, block_f=block_f, block_k=32, group=2, num_warps=warps)
            spmm._launch_config = lambda n_out, cfg=cfg: cfg
            out = matmul_skip_zeros(*sets[0])
            err = float((out.double() - ref).abs().max() / ref.abs().max())
            print(f"  scan d{block_d} w{warps} f{block_f} {time_graph(matmul_skip_zeros, sets):9.1f} us err {err:.1e}",
                  flush=True)  # fmt: skip
        spmm._launch_config, spmm._gather_config = default_cfg, default_gather
        del sets, csr, ells
    print("L0 sweep, B=1024 F=65536 D=2304 bf16 (default configs)")
    for l0 in [72, 256, 1024, 4096]:
        sets = [(acts_with_l0(1024, 65536, l0, torch.bfloat16),
                 torch.randn(65536, 2304, device="cuda", dtype=torch.bfloat16) / 16) for _ in range(2)]  # fmt: skip
        td = time_graph(lambda a, w: a @ w, sets)
        ts = time_graph(matmul_skip_zeros, sets)
        print(f"  L0={l0:5d} dense {td:9.1f} us  scan {ts:9.1f} us  scan/dense {ts / td:.2f}", flush=True)
        del sets


def triton_np2(n):
    import triton

    return triton.next_power_of_2(n)


if __name__ == "__main__":
    main()
