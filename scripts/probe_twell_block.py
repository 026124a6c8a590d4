"""Probe: the row-block path of the gated FFN (``method="block"``, issue 5) at the paper's 1.5B shape (K=2048,
N=5632, bf16, ~30 heavy-tailed non-zeros per token) -- union sizes in token order and with the tokens sorted by their
(sampled) non-zero count, each step's time, and the whole path against dense eager and the cuBLAS gate matmul of
the same run.

Counting first: the path is the gate matmul (2 M K N flops, cuBLAS), a read of the [M, N] pre-activations for
the unions (plus one of the sampled columns when sorting), and ``2 * 2 * block_rows * K * sum(unions)`` flops of up
and down products -- the dense up/down work times the unions' share of N.

Usage: python scripts/probe_twell_block.py [--quick]"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from sparsefuse.ffn import twell as tw
from sparsefuse.ffn.synthetic import synthetic_ffn
from sparsefuse.sparse import compact, sddmm, spmm

T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def bench(fn, name, flops=None, nbytes=None):
    try:
        fn()
        torch.cuda.synchronize()
        us = do_bench(fn, warmup=10, rep=80) * 1e3
        rate = f"{flops / us / 1e6:7.1f} TFLOP/s" if flops else (f"{nbytes / us / 1e3:7.0f} GB/s" if nbytes else "")
        log(f"{name:<64s} {us:9.1f} us {rate}")
        return us
    except Exception as e:  # noqa: BLE001
        log(f"{name:<64s} FAILED {type(e).__name__}: {str(e)[:200]}")
        return float("nan")


def main():
    quick = "--quick" in sys.argv
    torch.manual_seed(0)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ceiling = 2 * 8192**3 / bench(lambda: a @ a, "bf16 8192^3 matmul (ceiling)") / 1e6
    log(f"matmul ceiling {ceiling:.0f} TFLOP/s")
    del a
    shapes = [(8192, 2048, 5632, 30.0)] if quick else [(8192, 2048, 5632, 30.0), (2048, 2048, 5632, 30.0),
                                                       (16384, 2048, 5632, 30.0), (8192, 2048, 5632, 8.0),
                                                       (8192, 2048, 5632, 128.0), (8192, 4096, 14336, 30.0)]
    for M, K, N, nnz in shapes:
        f = synthetic_ffn(K, N, dtype=torch.bfloat16, device="cuda")
        w_down_t = f.w_down.t()
        x = f.make_input(M, nnz)
        tag = f"M={M} K={K} N={N} nnz={nnz:.0f}"
        dense = bench(lambda: tw._dense_mlp(x, f.w_gate, None, f.w_up, None, w_down_t.t(), None), f"{tag} dense eager")
        gate = bench(lambda: F.linear(x, f.w_gate), f"{tag} cuBLAS gate", 2 * M * K * N)
        pre = F.linear(x, f.w_gate)
        ref = tw._dense_mlp(x.float(), f.w_gate.float(), None, f.w_up.float(), None, f.w_down.float(), None)
        plans = [tw.BlockPlan(64, 256, False), tw.BlockPlan(64, 256, True, 1.0, 0), tw.BlockPlan(64, 256, True, 0.125, 0),
                 tw.BlockPlan(64, 256, True, 0.0625, 0), tw.BlockPlan(128, 256, True, 0.125, 0)]
        if quick or (M, K, N, nnz) != shapes[0]:
            plans = [plans[0], plans[2]]
        for plan in plans:
            sample = plan.sort_sample(N)
            make = lambda: compact.dense_to_row_block_pattern(pre, plan.tile, plan.block_rows, relu=True,  # noqa: E731
                                                              sort_rows=plan.sort_rows, sort_sample=sample)
            pattern = make()
            unions = pattern.union_sizes().double()
            part_flops = 2 * plan.block_rows * K * float(unions.sum())
            log(f"{tag} {plan}: union per block mean {unions.mean():.0f} ({unions.mean() / N:.1%} of N), max "
                f"{unions.max():.0f}; up/down work = {part_flops / (2 * M * K * N):.1%} of a dense one each")
            if plan.sort_rows:
                bench(lambda: compact.count_order(pre, sample, relu=True), f"  count order ({sample} columns)",
                      nbytes=M * sample * pre.element_size())  # fmt: skip
            bench(make, "  pattern total")
            bench(lambda: sddmm.block_sddmm(pattern, pre, x, f.w_up, relu=True), "  block_sddmm (up)", part_flops)
            h = sddmm.block_sddmm(pattern, pre, x, f.w_up, relu=True)
            bench(lambda: spmm.block_sparse_matmul(h, w_down_t, out_dtype=x.dtype), "  block_sparse_matmul (down)",
                  part_flops)  # fmt: skip
            total = bench(lambda: tw._launch_block_mlp(x, f.w_gate, None, f.w_up, None, w_down_t, None, plan),
                          "  block path total")  # fmt: skip
            y, _ = tw._launch_block_mlp(x, f.w_gate, None, f.w_up, None, w_down_t, None, plan)
            rel = float((y.float() - ref).norm() / ref.norm())
            rel_dense = float((tw._dense_mlp(x, f.w_gate, None, f.w_up, None, f.w_down, None).float() - ref).norm()
                              / ref.norm())  # fmt: skip
            log(f"  -> {dense / total:.2f}x dense eager ({gate / total:.2f} of the time is the cuBLAS gate); rel err "
                f"vs fp32 {rel:.2e} (dense bf16 {rel_dense:.2e})")


if __name__ == "__main__":
    main()
