"""Probe: the row-block union pass of the gated FFN's block path (``row_block_union_kernel``) at M=8192, N=5632
bf16 (the issue's headline shape): the library kernel (one [BLOCK_ROWS, TILE] load per program) against a variant
that walks the block's rows SUB at a time, or-ing them in registers before one reduction, and against a copy of the
same pre-activations (the pass reads them once: its floor). Each variant's output is checked against the library's.
Usage: python scripts/probe_union.py"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

from sparsefuse.ffn.synthetic import synthetic_ffn
from sparsefuse.sparse import compact


@triton.jit
def union_rows_loop_kernel(dense_ptr, indices_ptr, counts_ptr, M, N, n_tiles, stride_row, TILE: tl.constexpr,
                           BLOCK_ROWS: tl.constexpr, SUB: tl.constexpr):
    tile = tl.program_id(0)
    block = tl.program_id(1)
    cols = tile * TILE + tl.arange(0, TILE)
    fired = tl.zeros([SUB, TILE], dtype=tl.int1)
    for r0 in tl.range(0, BLOCK_ROWS, SUB):
        rows = block * BLOCK_ROWS + r0 + tl.arange(0, SUB)
        v = tl.load(dense_ptr + rows[:, None].to(tl.int64) * stride_row + cols[None, :],
                    mask=(rows[:, None] < M) & (cols[None, :] < N), other=0.0)
        fired = fired | (v > 0) | (v != v)
    in_union = tl.max(fired.to(tl.int32), axis=0)
    rank = tl.cumsum(in_union, axis=0) - 1
    tl.store(indices_ptr + block.to(tl.int64) * (n_tiles * TILE) + tile * TILE + rank, cols, mask=in_union > 0)
    tl.store(counts_ptr + block * n_tiles + tile, tl.sum(in_union, axis=0))


def main():
    torch.manual_seed(0)
    print(torch.cuda.get_device_name())
    M, K, N, tile, block_rows = 8192, 2048, 5632, 256, 64
    f = synthetic_ffn(K, N, dtype=torch.bfloat16, device="cuda")
    pres = [F.linear(f.make_input(M, 30.0, seed=s), f.w_gate) for s in range(3)]  # 3 x 92 MB: past L2
    us = lambda fn: do_bench(fn, warmup=10, rep=100) * 1e3  # noqa: E731
    i = [0]

    def rotate():
        i[0] = (i[0] + 1) % len(pres)
        return pres[i[0]]

    copy = us(lambda: rotate().clone())
    print(f"copy of pre [{M}, {N}] bf16: {copy:.1f} us ({2 * M * N * 2 / copy / 1e3:.0f} GB/s)")
    ref = compact.dense_to_row_block_pattern(pres[0], tile, block_rows, relu=True)
    lib = us(lambda: compact.dense_to_row_block_pattern(rotate(), tile, block_rows, relu=True))
    print(f"library union pass: {lib:.1f} us ({M * N * 2 / lib / 1e3:.0f} GB/s read)")
    n_tiles, n_blocks = triton.cdiv(N, tile), triton.cdiv(M, block_rows)
    indices = torch.empty(n_blocks, n_tiles * tile, dtype=torch.int32, device="cuda")
    counts = torch.empty(n_blocks, n_tiles, dtype=torch.int32, device="cuda")
    for sub, warps, stages in itertools.product([8, 16, 32], [2, 4, 8], [1, 2, 3]):
        def launch(d):
            union_rows_loop_kernel[(n_tiles, n_blocks)](d, indices, counts, M, N, n_tiles, d.stride(0), TILE=tile,
                                                        BLOCK_ROWS=block_rows, SUB=sub, num_warps=warps,
                                                        num_stages=stages)
        launch(pres[0])
        ok = torch.equal(counts, ref.counts) and all(
            torch.equal(indices[b, t * tile:t * tile + c], ref.indices[b, t * tile:t * tile + c])
            for b, t, c in [(0, 0, int(ref.counts[0, 0])), (n_blocks - 1, n_tiles - 1, int(ref.counts[-1, -1]))])
        t = us(lambda: launch(rotate()))
        print(f"  rows loop SUB={sub:2d} warps={warps} stages={stages}: {t:6.1f} us ({M * N * 2 / t / 1e3:4.0f} GB/s) "
              f"{'same' if ok else 'DIFFERENT'}", flush=True)


if __name__ == "__main__":
    main()
