"""Probe: launch configurations of the skip-zeros decode (gather_accumulate_kernel, dense rows) against dense cuBLAS
and cuSPARSE at the SAE issue's target shapes. Prints one line per (shape, dtype, impl): median us per call under a
CUDA graph over rotated inputs (> 2x L2), and the ratio to dense fp32. Usage: python scripts/probe_decode.py"""

from __future__ import annotations

import itertools
import statistics

import torch

from sparsefuse.sparse import spmm
from sparsefuse.sparse.spmm import _LaunchConfig, matmul_skip_zeros


def acts_with_l0(B, F, l0, dtype):
    cols = torch.rand(B, F, device="cuda").argsort(dim=1)[:, :l0]
    return torch.zeros(B, F, device="cuda", dtype=dtype).scatter_(1, cols, torch.rand(B, l0, device="cuda", dtype=dtype) + 0.1)


def time_graph(fn, sets, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for args in sets[:3]:
            fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for args in sets:
            fn(*args)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(sets))
    return statistics.median(times)


def main():
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(torch.cuda.get_device_name(), "L2", l2 >> 20, "MiB")
    shapes = [(32, 65536, 768, 64), (256, 65536, 768, 64), (32, 131072, 512, 128), (4096, 65536, 2304, 72)]
    default_cfg = spmm._launch_config
    for (B, F, D, l0), dtype in itertools.product(shapes, [torch.float32, torch.bfloat16]):
        per_set = B * F * dtype.itemsize + F * D * dtype.itemsize
        n_sets = max(2, min(16, (3 * l2) // per_set + 1))
        sets = [(acts_with_l0(B, F, l0, dtype), torch.randn(F, D, device="cuda", dtype=dtype) / 16) for _ in range(n_sets)]
        ref = sets[0][0].double() @ sets[0][1].double()
        rows = {}
        rows["dense fp32"] = time_graph(lambda a, w: a.float() @ w.float(), [(a.float(), w.float()) for a, w in sets])
        rows["dense same dtype"] = time_graph(lambda a, w: a @ w, sets)
        csr = [(a.to_sparse_csr(), w) for a, w in sets]
        try:
            rows["torch.sparse.mm prebuilt csr"] = time_graph(lambda c, w: torch.sparse.mm(c, w), csr)
        except Exception as e:  # noqa: BLE001
            print("  sparse.mm:", type(e).__name__, str(e)[:100])
        blocks_d = [min(1024, triton_np2(D)), 256, 512]
        for block_f, group, block_d, warps in itertools.product([1024, 2048], [2, 4], blocks_d[:1], [4]):
            if block_d > triton_np2(D):
                continue
            cfg = _LaunchConfig(block_d=block_d, block_f=block_f, block_k=32, group=group, num_warps=warps)
            spmm._launch_config = lambda n_out, cfg=cfg: cfg
            for mult in ([2, 4, 8] if B < 1024 else [1]):
                spmm._device_programs = lambda dev, mult=mult, **_: mult * torch.cuda.get_device_properties(dev).multi_processor_count
                out = matmul_skip_zeros(*sets[0])
                err = float((out.double() - ref).abs().max() / ref.abs().max())
                t = time_graph(matmul_skip_zeros, sets)
                rows[f"skip f{block_f} g{group} d{block_d} w{warps} x{mult} err{err:.1e}"] = t
        spmm._launch_config = default_cfg
        from sparsefuse.sae import sparse_decode
        rows["fixed (ELL, max_l0=2*L0)"] = time_graph(lambda a, w: sparse_decode(a, w, method="fixed", max_l0=2 * l0), sets)
        base = rows["dense fp32"]
        best = sorted((v, k) for k, v in rows.items() if k.startswith("skip"))[:6]
        print(f"B={B} F={F} D={D} L0={l0} {dtype}")
        for k in ["dense fp32", "dense same dtype", "torch.sparse.mm prebuilt csr", "fixed (ELL, max_l0=2*L0)"]:
            if k in rows:
                print(f"  {k:48s} {rows[k]:9.2f} us  {base / rows[k]:6.2f}x")
        for v, k in best:
            print(f"  {k:48s} {v:9.2f} us  {base / v:6.2f}x")
        del sets, csr


def triton_np2(n):
    import triton
    return triton.next_power_of_2(n)


if __name__ == "__main__":
    main()
