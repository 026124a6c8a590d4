"""Probe: the row-block path of the gated FFN (``method="block"``, issue 5) at the paper's 1.5B shape (K=2048,
N=5632, bf16, ~30 heavy-tailed non-zeros per token) -- union sizes with and without sorting the tokens, each step's
time under explicit configs, and the whole path against dense eager and the cuBLAS gate matmul of the same run.

Counting first: the path is the gate matmul (2 M K N flops, cuBLAS), two passes over the [M, N] pre-activations
(row counts, unions), and ``2 * 2 * block_rows * K * sum(unions)`` flops of up and down products -- the dense
up/down work times the unions' share of N. Usage: python scripts/probe_twell_block.py [--quick]"""

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
        first = (M, K, N, nnz) == shapes[0]
        plans = [tw.BlockPlan(64, 256, True), tw.BlockPlan(64, 256, False), tw.BlockPlan(128, 256, True),
                 tw.BlockPlan(32, 256, True), tw.BlockPlan(64, 128, True)]
        if quick or not first:
            plans = plans[:1] + plans[2:3]
        for plan in plans:
            pattern = compact.dense_to_row_block_pattern(pre, plan.tile, plan.block_rows, relu=True,
                                                         sort_rows=plan.sort_rows)  # fmt: skip
            unions = pattern.union_sizes().double()
            part_flops = 2 * plan.block_rows * K * float(unions.sum())
            log(f"{tag} {plan}: union per block mean {unions.mean():.0f} ({unions.mean() / N:.1%} of N), max "
                f"{unions.max():.0f}; up/down work = {part_flops / (2 * M * K * N):.1%} of a dense one each")
            if plan.sort_rows:
                bench(lambda: compact._chunk_starts(pre, compact._compaction_block(N), True), "  row counts",
                      nbytes=2 * M * N)  # fmt: skip
                counts = compact._chunk_starts(pre, compact._compaction_block(N), True)[1]
                bench(lambda: torch.sort(counts, stable=True), "  (torch stable sort of the counts, for scale)")
                bench(lambda: compact.dense_to_row_block_pattern(pre, plan.tile, plan.block_rows, relu=True),
                      "  pattern total, unions only (scripts/probe_union.py varies its kernel)")  # fmt: skip
            bench(lambda: compact.dense_to_row_block_pattern(pre, plan.tile, plan.block_rows, relu=True,
                                                             sort_rows=plan.sort_rows), "  pattern total (counts, sort, unions)")
            sd_cfgs = [(128, 64, 8, 4), (128, 64, 8, 3), (64, 64, 4, 4), (128, 32, 4, 4), (256, 64, 8, 3), (128, 128, 8, 3)]
            mm_cfgs = [(64, 256, 8, 4), (64, 256, 8, 3), (32, 256, 8, 4), (64, 128, 4, 4), (128, 128, 8, 3)]
            if quick or not first or plan != plans[0]:
                sd_cfgs, mm_cfgs = sd_cfgs[:1], mm_cfgs[:1]
            for cfg in sd_cfgs:
                sddmm._block_sddmm_blocks = lambda D, br, cfg=cfg: cfg
                bench(lambda: sddmm.block_sddmm(pattern, pre, x, f.w_up, relu=True), f"  block_sddmm {cfg}", part_flops)
            sddmm._block_sddmm_blocks = lambda D, br: sd_cfgs[0]
            h = sddmm.block_sddmm(pattern, pre, x, f.w_up, relu=True)
            for cfg in mm_cfgs:
                spmm._block_matmul_blocks = lambda n, cfg=cfg: cfg
                bench(lambda: spmm.block_sparse_matmul(h, w_down_t, out_dtype=x.dtype), f"  block_sparse_matmul {cfg}",
                      part_flops)  # fmt: skip
            spmm._block_matmul_blocks = lambda n: mm_cfgs[0]
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
