"""Probe: can the large-batch decode gather from L2 instead of DRAM? cuSPARSE takes the same time in fp32 and bf16
at the Gemma shapes, so it is not bound by the W_dec bytes; a guess is that it walks W_dec in column slices small
enough for L2, so the ~4.5 tokens that share each feature row hit in L2. This times the library's ELL gather
(a prebuilt ELL, no compaction) over whole rows against the same gather launched slice by slice (every token's
slice j before any token's slice j + 1), and the scan restricted to the first slice (what a scan that also wrote
the ELL would cost), against cuSPARSE on a prebuilt CSR and the library's scan.
Usage: cd scripts && python probe_decode_sliced.py"""

from __future__ import annotations

import itertools

import torch

from probe_decode import acts_with_l0, time_graph
from sparsefuse.sparse import dense_to_ell, matmul_skip_zeros, sparse_matmul, spmm


def main() -> None:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(torch.cuda.get_device_name(), torch.__version__, "L2", l2 >> 20, "MiB")
    shapes = [(4096, 65536, 2304, 72, torch.bfloat16), (4096, 65536, 2304, 72, torch.float32),
              (1024, 262144, 2304, 100, torch.bfloat16), (1024, 131072, 3584, 72, torch.bfloat16),
              (1024, 32768, 2048, 100, torch.bfloat16), (256, 65536, 768, 64, torch.bfloat16)]  # fmt: skip
    for B, F, D, l0, dtype in shapes:
        per_set = B * F * dtype.itemsize + F * D * dtype.itemsize
        n_sets = max(2, min(16, (3 * l2) // per_set + 1))
        sets = [(acts_with_l0(B, F, l0, dtype), (torch.randn(F, D, device="cuda") / 16).to(dtype))
                for _ in range(n_sets)]  # fmt: skip
        ells = [(dense_to_ell(a, l0), w) for a, w in sets]
        csr = time_graph(lambda c, w: torch.sparse.mm(c, w), [(a.to_sparse_csr(), w) for a, w in sets])
        scan = time_graph(matmul_skip_zeros, sets)
        compact = time_graph(lambda a, w: dense_to_ell(a, l0), sets)
        full = time_graph(sparse_matmul, ells)
        print(f"B={B} F={F} D={D} L0={l0} {str(dtype)[6:]}: cuSPARSE {csr:7.1f} us  scan {scan:7.1f} "
              f"({csr / scan:4.2f}x)  dense_to_ell {compact:7.1f}  ELL gather, whole rows {full:7.1f}", flush=True)
        for s in [64, 128, 256, 512]:
            if s >= D:
                continue
            w_slice_mb = F * s * dtype.itemsize / 2**20

            def sliced(ell, w, s=s):
                for j in range(0, D, s):
                    sparse_matmul(ell, w[:, j : j + s])

            t_sliced = time_graph(sliced, ells)
            t_first = time_graph(lambda a, w, s=s: matmul_skip_zeros(a, w[:, :s]), sets)
            rest = t_sliced * (1 - s / D)
            print(f"  slices of {s:4d} ({w_slice_mb:5.1f} MiB of W each): ELL gather {t_sliced:7.1f} us, "
                  f"scan of slice 0 {t_first:7.1f} us; scan(slice 0) + gather(rest) ~ {t_first + rest:7.1f} us "
                  f"({csr / (t_first + rest):4.2f}x cuSPARSE)", flush=True)
        del sets, ells


def chunks() -> None:
    """The scan's chunk width, picks per step and warps at the large shapes (rows fill the GPU: no splits)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    default_config, default_warps = spmm._launch_config, spmm._scan_warps
    for B, F, D, l0, dtype in [(4096, 65536, 2304, 72, torch.bfloat16), (4096, 65536, 2304, 72, torch.float32),
                               (1024, 131072, 3584, 72, torch.bfloat16), (1024, 32768, 2048, 100, torch.bfloat16),
                               (256, 65536, 768, 64, torch.bfloat16)]:  # fmt: skip
        per_set = B * F * dtype.itemsize + F * D * dtype.itemsize
        n_sets = max(2, min(16, (3 * l2) // per_set + 1))
        sets = [(acts_with_l0(B, F, l0, dtype), (torch.randn(F, D, device="cuda") / 16).to(dtype))
                for _ in range(n_sets)]  # fmt: skip
        csr = time_graph(lambda c, w: torch.sparse.mm(c, w), [(a.to_sparse_csr(), w) for a, w in sets])
        base = time_graph(matmul_skip_zeros, sets)
        print(f"B={B} F={F} D={D} L0={l0} {str(dtype)[6:]}: cuSPARSE {csr:7.1f} us  library scan {base:7.1f} us",
              flush=True)  # fmt: skip
        results = []
        for block_f, group, warps in itertools.product([512, 1024, 2048, 4096], [1, 2, 4], [None, 8]):
            cfg = spmm._LaunchConfig(block_d=default_config(D).block_d, block_f=block_f, block_k=32,
                                     group=group, num_warps=4)  # fmt: skip
            spmm._launch_config = lambda n_out, cfg=cfg: cfg
            spmm._scan_warps = default_warps if warps is None else (lambda *_, w=warps: w)
            results.append((time_graph(matmul_skip_zeros, sets), block_f, group, warps or "default"))
        spmm._launch_config, spmm._scan_warps = default_config, default_warps
        for t, block_f, group, warps in sorted(results)[:6]:
            print(f"  f{block_f:<4d} g{group} warps {warps}: {t:7.1f} us  {csr / t:4.2f}x cuSPARSE", flush=True)
        del sets


if __name__ == "__main__":
    import sys

    chunks() if "--chunks" in sys.argv else main()
