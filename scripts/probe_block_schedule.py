"""Probe: does launching the FFN block path's down product heaviest block first (LPT scheduling) close its tail?
Issue 5's headline shape (M=8192, K=2048, N=5632, bf16, ~30 heavy-tailed non-zeros per token), CUDA graphs.

A program of ``block_ell_matmul_kernel`` walks its row block's whole column list, and the lists vary several-fold
(64-row sorted blocks: mean 778 columns, max ~3400). Dispatched in block order, a long block that starts late runs
on alone at the end of the grid. A list-scheduling model with the real union sizes (program cost = columns + 16)
puts the in-order makespan at 1.66x the balanced one for 64-row blocks (2 programs per SM) and 1.46x for 128-row
blocks (1 per SM); longest first: 1.11x and 1.02x. The up product's programs each take 128 columns, so its work
is already even. This probe times, at 64 and 128 rows: the down product in block order and heavy first over a few
launch configurations, the up product's configurations at 128 rows, the schedule kernel alone, and the whole path.

Run from scripts/ with PYTHONPATH=..:. on a GPU; ``--sort-threshold`` times the whole path sorted and unsorted
at 1024-4096 tokens instead; ``--traffic`` times wider tiles of both products at 64 rows (heavy first); ``--pattern`` times the
pattern pass stage by stage."""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.nn.functional as F
import triton

from probe_block_ceiling import graph_us, headline_case
from sparsefuse.ffn import twell
from sparsefuse.ffn.synthetic import synthetic_ffn
from sparsefuse.sparse import compact, sddmm, spmm


def down(h, w, out, schedule, block_j, block_d, warps, stages):
    """block_ell_matmul_kernel at one launch configuration; ``schedule`` None keeps block order."""
    M, n_out = out.shape
    n_blocks = h.counts.shape[0]
    spmm.block_ell_matmul_kernel[(triton.cdiv(n_out, block_d), n_blocks)](
        h.values, h.indices, h.counts, h.row_order, schedule if schedule is not None else h.counts, w, w, out, M,
        n_out, h.values.shape[1], w.stride(0), out.stride(0), BLOCK_ROWS=h.block_rows, BLOCK_J=block_j,
        BLOCK_D=block_d, HAS_ORDER=True, HAS_SCHEDULE=schedule is not None, HAS_BIAS=False, IEEE_FP32=False,
        num_warps=warps, num_stages=stages)  # fmt: skip


def up(pattern, pre, x, w_up, out, block_c, block_d, warps, stages):
    """block_sddmm_kernel at one launch configuration (its programs' work is even: no schedule)."""
    M, D = x.shape
    n_blocks, n_tiles = pattern.counts.shape
    width = n_tiles * pattern.tile
    sddmm.block_sddmm_kernel[(triton.cdiv(width, block_c), n_blocks)](
        pre, pattern.indices, pattern.counts, pattern.row_order, x, w_up, x, out.values, out.indices, out.counts, M,
        D, n_tiles, pre.stride(0), x.stride(0), w_up.stride(0), TILE=pattern.tile, BLOCK_ROWS=pattern.block_rows,
        BLOCK_C=block_c, BLOCK_D=block_d, BLOCK_TILES=triton.next_power_of_2(n_tiles), HAS_ORDER=True,
        HAS_BIAS=False, RELU=True, IEEE_FP32=False, num_warps=warps, num_stages=stages)  # fmt: skip


def sort_threshold() -> None:
    """Whole block path with and without sorting the tokens, at the batch sizes where sorting was left off (its
    heaviest blocks left the down product a tail, which heavy-first launching now removes)."""
    default = twell.BLOCK_PLAN
    for (K, N), M, nnz in [((2048, 5632), 2048, 30.0), ((2048, 5632), 4096, 30.0), ((2048, 5632), 4096, 8.0),
                           ((4096, 14336), 2048, 30.0), ((2048, 5632), 1024, 30.0)]:  # fmt: skip
        f = synthetic_ffn(K, N, dtype=torch.bfloat16, device="cuda")
        x = f.make_input(M, nnz)
        eager = graph_us(lambda: F.linear(F.relu(F.linear(x, f.w_gate)) * F.linear(x, f.w_up), f.w_down))
        line = f"M={M} K={K} N={N} nnz={nnz:.0f}: eager {eager:.1f} us"
        for label, plan in [("token order", dataclasses.replace(default, sort_rows=False)),
                            ("sorted", dataclasses.replace(default, sort_min_tokens=0))]:  # fmt: skip
            twell.BLOCK_PLAN = plan
            us = graph_us(lambda: twell.twell_mlp(x, f.w_gate, f.w_up, f.w_down, method="block"))
            line += f", {label} {us:.1f} us ({eager / us:.2f}x)"
        twell.BLOCK_PLAN = default
        print(line, flush=True)


def pattern_stages() -> None:
    """The pattern pass stage by stage: the bits pass, the keys and group rank, the union kernel. (Until the bits
    pass dropped its counts, it was timed with them; the log holds those runs.)"""
    K, N, nnz = 2048, 5632, 30.0
    f = synthetic_ffn(K, N, dtype=torch.bfloat16, device="cuda")
    for M in (2048, 8192, 16384):
        pre = F.linear(f.make_input(M, nnz), f.w_gate)
        bits = compact._row_bits(pre, True)
        read = graph_us(lambda: pre.sum(dtype=torch.float32))
        t_bits = graph_us(lambda: compact._row_bits(pre, True))
        t_rank = graph_us(lambda: compact._group_rank(bits, N, compact.SORT_GROUP))
        t_all = graph_us(lambda: compact.dense_to_row_block_pattern(pre, 256, 64, relu=True, sort_rows=True))
        t_unsorted = graph_us(lambda: compact.dense_to_row_block_pattern(pre, 256, 64, relu=True))
        p = compact.dense_to_row_block_pattern(pre, 256, 64, relu=True, sort_rows=True)
        sweep = []
        for rows, block_c, warps in [(8, 512, 4), (4, 1024, 4), (16, 512, 4), (8, 1024, 8), (32, 256, 4),
                                     (4, 512, 2)]:  # fmt: skip
            n_chunks = triton.cdiv(N, block_c)
            b2 = torch.empty_like(bits)
            launch = lambda: compact.row_bits_kernel[(n_chunks, triton.cdiv(M, rows))](  # noqa: E731
                pre, b2, M, N, bits.shape[1], pre.stride(0), ROWS=rows, BLOCK_C=block_c, RELU=True,
                num_warps=warps)  # fmt: skip
            launch()
            same = torch.equal(b2, bits)
            sweep.append(f"{rows}x{block_c}/{warps}w {graph_us(launch):.1f}{'' if same else ' DIFFERS'}")
        print(f"  bits pass (rows x columns / warps): " + ", ".join(sweep), flush=True)
        print(f"M={M}: read of pre (torch sum) {read:.1f} us ({pre.numel() * 2 / read / 1e6:.2f} TB/s); bits pass "
              f"{t_bits:.1f} us ({pre.numel() * 2 / t_bits / 1e6:.2f} TB/s); group rank {t_rank:.1f} us; whole "
              f"pattern sorted {t_all:.1f} us (unions {p.union_sizes().double().mean() / N:.1%} of N), token order "
              f"{t_unsorted:.1f} us", flush=True)


def main() -> None:
    if "--sort-threshold" in sys.argv:
        return sort_threshold()
    if "--pattern" in sys.argv:
        return pattern_stages()
    f, x, w_down_t, pre = headline_case()
    K, N = x.shape[1], pre.shape[1]
    plan = twell.BLOCK_PLAN
    eager = graph_us(lambda: F.linear(F.relu(F.linear(x, f.w_gate)) * F.linear(x, f.w_up), f.w_down))
    gate = graph_us(lambda: F.linear(x, f.w_gate))
    path = graph_us(lambda: twell.twell_mlp(x, f.w_gate, f.w_up, f.w_down, method="block"))
    print(f"eager {eager:.1f} us, gate {gate:.1f} us, library block path (heavy first) {path:.1f} us = "
          f"{eager / path:.2f}x", flush=True)

    traffic = "--traffic" in sys.argv
    down_cfgs = [(64, 256, 8, 3), (64, 128, 8, 3), (64, 128, 4, 3), (64, 128, 4, 4), (32, 128, 4, 4), (64, 64, 4, 4),
                 (128, 128, 8, 3)]  # fmt: skip
    up_cfgs = [(128, 64, 8, 4), (128, 64, 4, 4), (128, 64, 8, 3), (64, 64, 4, 4), (64, 128, 4, 3), (256, 64, 8, 3)]
    if traffic:  # wider tiles re-read x (up) and h (down) fewer times: fewer bytes through L2 per flop
        down_cfgs = [(64, 256, 8, 3), (64, 256, 8, 4), (32, 512, 8, 3), (64, 512, 8, 2), (128, 256, 8, 2)]
        up_cfgs = [(128, 64, 8, 4), (256, 64, 8, 2), (256, 32, 8, 4), (256, 32, 8, 3), (256, 64, 4, 2),
                   (128, 32, 4, 4), (128, 128, 8, 2), (512, 32, 8, 3)]  # fmt: skip
    for rows in (64,) if traffic else (64, 128):
        pattern = compact.dense_to_row_block_pattern(pre, plan.tile, rows, relu=True, sort_rows=True,
                                                     sort_sample=plan.sort_sample(N))  # fmt: skip
        h = sddmm.block_sddmm(pattern, pre, x, f.w_up, relu=True)
        unions = h.counts.double()
        work = 2 * rows * K * float(unions.sum())
        print(f"\n{rows}-row blocks: {unions.numel()} blocks, unions mean {unions.mean():.0f} max "
              f"{int(unions.max())}; one product {work / 1e9:.1f} GFLOP", flush=True)
        schedule = spmm.heavy_first_schedule(h.counts)
        assert torch.equal(h.counts[schedule.long()], h.counts.sort(descending=True).values)
        print(f"  schedule kernel {graph_us(lambda: spmm.heavy_first_schedule(h.counts)):.1f} us")
        pattern_us = graph_us(lambda: compact.dense_to_row_block_pattern(
            pre, plan.tile, rows, relu=True, sort_rows=True, sort_sample=plan.sort_sample(N)))  # fmt: skip
        print(f"  pattern {pattern_us:.1f} us")
        ref = spmm.block_sparse_matmul(h, w_down_t, out_dtype=x.dtype, heavy_first=False)
        best = {}
        for cfg in down_cfgs:
            for sched in (schedule,) if traffic else (None, schedule):
                out = torch.empty_like(ref)
                down(h, w_down_t, out, sched, *cfg)
                same = "same" if torch.equal(out, ref) else "DIFFERS"
                us = graph_us(lambda: down(h, w_down_t, out, sched, *cfg))
                key = "heavy first" if sched is not None else "block order"
                best[key] = min(best.get(key, 1e9), us)
                print(f"  down J,D,w,s={cfg} {key:>11s}: {us:7.1f} us {work / us / 1e6:5.0f} TFLOP/s {same}",
                      flush=True)
        ups = {}
        for cfg in up_cfgs:
            out = sddmm.block_sddmm(pattern, pre, x, f.w_up, relu=True)
            up(pattern, pre, x, f.w_up, out, *cfg)
            y = spmm.block_sparse_matmul(out, w_down_t, out_dtype=x.dtype)
            err = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
            same = "same" if err < 2e-2 else f"DIFFERS ({err:.2e})"
            us = graph_us(lambda: up(pattern, pre, x, f.w_up, out, *cfg))
            ups[cfg] = us
            print(f"  up C,D,w,s={cfg}: {us:7.1f} us {work / us / 1e6:5.0f} TFLOP/s {same}", flush=True)
        up_best = min(ups.values())
        for key, d in best.items():
            total = gate + pattern_us + up_best + d
            print(f"  best up {up_best:.0f} + best down ({key}) {d:.0f}: gate {gate:.0f} + pattern {pattern_us:.0f} "
                  f"+ up + down = {total:.0f} us -> {eager / total:.2f}x eager")


if __name__ == "__main__":
    main()
