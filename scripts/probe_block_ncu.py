"""Probe: where the gated FFN's block path (issue 5) spends its product time, at the headline shape (M=8192,
K=2048, N=5632, bf16, ~30 heavy-tailed non-zeros per token). For row-block patterns in token order and sorted by
count (64 and 128 rows) it times the union pass, ``block_sddmm`` (up) and ``block_sparse_matmul`` (down), and with
``--ncu`` launches each kernel once between cudaProfilerStart/Stop so Nsight Compute can read its counters:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... python scripts/probe_block_ncu.py --ncu

Counting: each product does 2 * block_rows * K * sum(unions) flops and re-reads the gathered weight rows once per
row block, so its weight traffic is flops / block_rows bytes -- 64 or 128 flops per L2 byte at most."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from sparsefuse.ffn.synthetic import synthetic_ffn
from sparsefuse.sparse import compact, sddmm, spmm


def main() -> None:
    profile = "--ncu" in sys.argv
    torch.manual_seed(0)
    M, K, N, nnz = 8192, 2048, 5632, 30.0
    f = synthetic_ffn(K, N, dtype=torch.bfloat16, device="cuda")
    x = f.make_input(M, nnz)
    w_down_t = f.w_down.t()
    pre = F.linear(x, f.w_gate)
    cases = {}
    for block_rows, sort in [(64, False), (64, True), (128, True), (128, False)]:
        pattern = compact.dense_to_row_block_pattern(pre, 256, block_rows, relu=True, sort_rows=sort)
        h = sddmm.block_sddmm(pattern, pre, x, f.w_up, relu=True)
        spmm.block_sparse_matmul(h, w_down_t, out_dtype=x.dtype)
        cases[(block_rows, sort)] = (pattern, h)
    torch.cuda.synchronize()
    if profile:
        torch.cuda.profiler.start()
        for (block_rows, sort), (pattern, h) in cases.items():
            compact.dense_to_row_block_pattern(pre, 256, block_rows, relu=True, sort_rows=sort)
            sddmm.block_sddmm(pattern, pre, x, f.w_up, relu=True)
            spmm.block_sparse_matmul(h, w_down_t, out_dtype=x.dtype)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print("profiled launches, in order: for (64, token order), (64, sorted), (128, sorted), (128, token order):"
              " [count kernel (sorted only)], union, block_sddmm, block_ell_matmul")
        return
    print(torch.cuda.get_device_name(), torch.__version__)
    us = lambda fn: do_bench(fn, warmup=10, rep=100) * 1e3  # noqa: E731
    dense_flops = 2 * M * K * N
    for (block_rows, sort), (pattern, h) in cases.items():
        unions = pattern.union_sizes().double()
        flops = 2 * block_rows * K * float(unions.sum())
        t_pat = us(lambda: compact.dense_to_row_block_pattern(pre, 256, block_rows, relu=True, sort_rows=sort))
        t_up = us(lambda: sddmm.block_sddmm(pattern, pre, x, f.w_up, relu=True))
        t_down = us(lambda: spmm.block_sparse_matmul(h, w_down_t, out_dtype=x.dtype))
        print(f"rows {block_rows:3d} {'sorted' if sort else 'token order'}: unions {unions.mean() / N:.1%} of N "
              f"(max {unions.max() / N:.0%}), work {flops / dense_flops:.1%} of dense; pattern {t_pat:.1f} us, "
              f"up {t_up:.1f} us ({flops / t_up / 1e6:.0f} TFLOP/s, weight bytes {flops / block_rows / t_up / 1e6:.1f}"
              f" TB/s), down {t_down:.1f} us ({flops / t_down / 1e6:.0f} TFLOP/s)", flush=True)


if __name__ == "__main__":
    main()
