"""Probe: two changes to the FFN block path at issue 5's headline shape (M=8192, K=2048, N=5632, bf16, ~30
heavy-tailed non-zeros per token), CUDA graphs.

1. The pattern pass: the bitmask pass used to count each token's non-zeros as well (2.7 TB/s); it now writes the
   bitmask only and ``row_keys_kernel`` popcounts the words (a sixteenth of the bytes). Times each stage.
2. The up product (``block_sddmm``): its grid had one program per (128-column chunk, block) over the whole width,
   so with unions at ~13% of N about 6 in 7 programs found nothing to do and exited. ``block_sddmm_items_kernel``
   runs a fixed grid dealt only the items with work. Times the old grid, the old grid trimmed to the largest
   union (host sync, probe only: what the empty programs cost), and the item grid at 1-4 programs per SM.

The item grid measured slower (log: benchmarks/results/probe-block-items-NVIDIA-H200.log) and was reverted; this
probe runs at the experiment commit 258623d, which has ``ITEM_PROGRAMS_PER_SM`` and the item kernels. Run from
scripts/ with PYTHONPATH=..:. on a GPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from probe_block_ceiling import graph_us, headline_case
from sparsefuse.ffn import twell
from sparsefuse.sparse import compact, sddmm, spmm


def up_grid(pattern, pre, x, w_up, out, n_chunks):
    """The per-(chunk, block) grid of block_sddmm_kernel with ``n_chunks`` chunks per block."""
    M, D = x.shape
    n_blocks, n_tiles = pattern.counts.shape
    block_c, block_d, warps, stages = sddmm._block_sddmm_blocks(D, pattern.block_rows)
    sddmm.block_sddmm_kernel[(n_chunks, n_blocks)](
        pre, pattern.indices, pattern.counts, pattern.row_order, x, w_up, x, out.values, out.indices, out.counts, M,
        D, n_tiles, pre.stride(0), x.stride(0), w_up.stride(0), TILE=pattern.tile, BLOCK_ROWS=pattern.block_rows,
        BLOCK_C=block_c, BLOCK_D=block_d, BLOCK_TILES=triton.next_power_of_2(n_tiles), HAS_ORDER=True,
        HAS_BIAS=False, RELU=True, IEEE_FP32=False, num_warps=warps, num_stages=stages)  # fmt: skip


def same(h, ref) -> str:
    return "same" if torch.equal(h.counts, ref.counts) and torch.equal(h.to_dense(), ref.to_dense()) else "DIFFERS"


def main() -> None:
    f, x, w_down_t, pre = headline_case()
    (M, K), N = x.shape, pre.shape[1]
    plan = twell.BLOCK_PLAN
    eager = graph_us(lambda: F.linear(F.relu(F.linear(x, f.w_gate)) * F.linear(x, f.w_up), f.w_down))
    gate = graph_us(lambda: F.linear(x, f.w_gate))
    paths = {}
    for per_sm in (0, 2):
        sddmm.ITEM_PROGRAMS_PER_SM = per_sm
        paths[per_sm] = graph_us(lambda: twell.twell_mlp(x, f.w_gate, f.w_up, f.w_down, method="block"))
    sddmm.ITEM_PROGRAMS_PER_SM = 2
    print(f"eager {eager:.1f} us, gate (cuBLAS) {gate:.1f} us; library block path: up on the chunk grid "
          f"{paths[0]:.1f} us ({eager / paths[0]:.2f}x), on the item grid {paths[2]:.1f} us ({eager / paths[2]:.2f}x)",
          flush=True)  # fmt: skip

    read = graph_us(lambda: pre.sum(dtype=torch.float32))
    bits_us = graph_us(lambda: compact._row_bits(pre, True))
    bits = compact._row_bits(pre, True)
    rank_us = graph_us(lambda: compact._group_rank(bits, N, compact.SORT_GROUP))
    pattern_us = graph_us(lambda: compact.dense_to_row_block_pattern(pre, plan.tile, plan.block_rows, relu=True,
                                                                     sort_rows=True))  # fmt: skip
    order = compact._group_rank(bits, N, compact.SORT_GROUP)
    ref_order = compact.torch_count_order((pre > 0) | pre.isnan())
    print(f"pattern: read of pre (torch sum) {read:.1f} us ({pre.numel() * 2 / read / 1e6:.2f} TB/s); bits pass "
          f"{bits_us:.1f} us ({pre.numel() * 2 / bits_us / 1e6:.2f} TB/s); keys + rank {rank_us:.1f} us "
          f"({'same order as torch' if torch.equal(order, ref_order) else 'ORDER DIFFERS'}); whole pattern "
          f"{pattern_us:.1f} us", flush=True)  # fmt: skip

    for rows in (64, 128):
        pattern = compact.dense_to_row_block_pattern(pre, plan.tile, rows, relu=True, sort_rows=True)
        sddmm.ITEM_PROGRAMS_PER_SM = 0
        ref = sddmm.block_sddmm(pattern, pre, x, f.w_up, relu=True)
        unions = ref.counts.double()
        block_c = sddmm._block_sddmm_blocks(K, rows)[0]
        n_chunks_all = triton.cdiv(pattern.indices.shape[1], block_c)
        n_chunks_used = triton.cdiv(int(unions.max()), block_c)
        items = int(torch.div(ref.counts + block_c - 1, block_c, rounding_mode="floor").sum())
        work = 2 * rows * K * float(unions.sum())
        print(f"\n{rows}-row blocks: {unions.numel()} blocks, unions mean {unions.mean():.0f} max {int(unions.max())}; "
              f"{items} items of {block_c} columns; one product {work / 1e9:.1f} GFLOP", flush=True)  # fmt: skip
        out = sddmm.block_sddmm(pattern, pre, x, f.w_up, relu=True)
        for label, n_chunks in [("chunk grid, whole width", n_chunks_all), ("chunk grid, trimmed", n_chunks_used)]:
            us = graph_us(lambda: up_grid(pattern, pre, x, f.w_up, out, n_chunks))
            print(f"  up, {label} ({n_chunks} x {unions.numel()} programs): {us:.1f} us "
                  f"{work / us / 1e6:.0f} TFLOP/s {same(out, ref)}", flush=True)  # fmt: skip
        for per_sm in (1, 2, 3, 4):
            sddmm.ITEM_PROGRAMS_PER_SM = per_sm
            h = sddmm.block_sddmm(pattern, pre, x, f.w_up, relu=True)
            us = graph_us(lambda: sddmm.block_sddmm(pattern, pre, x, f.w_up, relu=True))
            print(f"  up, item grid {per_sm} per SM: {us:.1f} us {work / us / 1e6:.0f} TFLOP/s {same(h, ref)}",
                  flush=True)  # fmt: skip
        sddmm.ITEM_PROGRAMS_PER_SM = 2
        down = graph_us(lambda: spmm.block_sparse_matmul(ref, w_down_t, out_dtype=x.dtype))
        print(f"  down (library, heavy first): {down:.1f} us {work / down / 1e6:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
