"""The kernels that find a TwELL batch's heavy tokens from its counts [M, n_tiles] alone (no values read): a
heavy-first schedule for the up/down launch, and the list of tokens a second up/down launch spreads over more
programs. Launched from :mod:`.launch`."""

from __future__ import annotations

import triton
import triton.language as tl

from ..._jit import kernel


@kernel
def heavy_first_order_kernel(
    counts_ptr,
    order_ptr,
    cursors_ptr,
    M,
    n_tiles,
    heavy_min,
    SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_TILES: tl.constexpr,
):
    # order [M] (int32): a permutation of the tokens with the heavy ones (>= heavy_min stored non-zeros, or any
    # overflowed tile) at the front and the rest at the back; cursors [2] int32 (zeroed) count the two ends. Order
    # within each class depends on program timing -- it only schedules work, the results do not depend on it.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_mask = rows < M
    overflowed, many = _heavy_classes(counts_ptr, rows, row_mask, n_tiles, heavy_min, SLOTS, BLOCK_TILES)
    heavy = overflowed | many
    light = row_mask & ~heavy
    front = tl.atomic_add(cursors_ptr, tl.sum(heavy.to(tl.int32), axis=0))
    back = tl.atomic_add(cursors_ptr + 1, tl.sum(light.to(tl.int32), axis=0))
    tl.store(order_ptr + front + tl.cumsum(heavy.to(tl.int32), axis=0) - 1, rows, mask=heavy)
    tl.store(order_ptr + (M - back) - tl.cumsum(light.to(tl.int32), axis=0), rows, mask=light)


@triton.jit
def _heavy_classes(counts_ptr, rows, row_mask, n_tiles, heavy_min, SLOTS: tl.constexpr, BLOCK_TILES: tl.constexpr):
    """Two [BLOCK_M] masks over the tokens ``rows`` (counts [M, n_tiles]): those with an overflowed tile, and those
    with none but >= heavy_min stored entries."""
    tiles = tl.arange(0, BLOCK_TILES)
    counts = tl.load(
        counts_ptr + rows[:, None].to(tl.int64) * n_tiles + tiles[None, :],
        mask=row_mask[:, None] & (tiles[None, :] < n_tiles),
        other=0,
    )
    overflowed = row_mask & (tl.max(counts, axis=1) > SLOTS)
    return overflowed, row_mask & ~overflowed & (tl.sum(counts, axis=1) >= heavy_min)


@kernel
def heavy_block_counts_kernel(
    counts_ptr, block_heavy_ptr, M, n_tiles, heavy_min, SLOTS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_TILES: tl.constexpr,
):  # fmt: skip
    # block_heavy [2, cdiv(M, BLOCK_M)] int32: how many of each block's tokens have an overflowed tile (row 0) and
    # how many are heavy without one (row 1); see heavy_tokens_kernel
    b = tl.program_id(0)
    rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
    overflowed, heavy = _heavy_classes(counts_ptr, rows, rows < M, n_tiles, heavy_min, SLOTS, BLOCK_TILES)
    tl.store(block_heavy_ptr + b, tl.sum(overflowed.to(tl.int32), axis=0))
    tl.store(block_heavy_ptr + tl.cdiv(M, BLOCK_M) + b, tl.sum(heavy.to(tl.int32), axis=0))


@kernel
def heavy_tokens_kernel(
    counts_ptr, block_heavy_ptr, taken_ptr, heavy_rows_ptr, heavy_count_ptr, M, n_tiles, heavy_min, cap,
    SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_TILES: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    # The heavy tokens, those with an overflowed tile first (the longest work: a whole tile each), then those with
    # >= heavy_min stored entries, each class in token order; the first ``cap`` taken: heavy_rows [cap] int32 (the
    # taken tokens), taken [M] int8 (1 for a taken token), heavy_count [2] int32 (how many were taken; how many of
    # those have an overflowed tile). Token order, not program timing, decides which: the same tokens are taken in
    # every run, so each token's sum is always computed the same way.
    b = tl.program_id(0)
    n_blocks = tl.cdiv(M, BLOCK_M)
    before_o = tl.zeros([], dtype=tl.int32)  # overflowed tokens of the blocks before this one
    before_h = tl.zeros([], dtype=tl.int32)  # heavy tokens without overflow of the blocks before this one
    total_o = tl.zeros([], dtype=tl.int32)
    total_h = tl.zeros([], dtype=tl.int32)
    for b0 in range(0, n_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        per_o = tl.load(block_heavy_ptr + blocks, mask=blocks < n_blocks, other=0)
        per_h = tl.load(block_heavy_ptr + n_blocks + blocks, mask=blocks < n_blocks, other=0)
        before_o += tl.sum(tl.where(blocks < b, per_o, 0), axis=0)
        before_h += tl.sum(tl.where(blocks < b, per_h, 0), axis=0)
        total_o += tl.sum(per_o, axis=0)
        total_h += tl.sum(per_h, axis=0)
    rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    overflowed, heavy = _heavy_classes(counts_ptr, rows, row_mask, n_tiles, heavy_min, SLOTS, BLOCK_TILES)
    slot = tl.where(
        overflowed,
        before_o + tl.cumsum(overflowed.to(tl.int32), axis=0) - 1,
        total_o + before_h + tl.cumsum(heavy.to(tl.int32), axis=0) - 1,
    )
    taken = (overflowed | heavy) & (slot < cap)
    tl.store(taken_ptr + rows, taken.to(tl.int8), mask=row_mask)
    tl.store(heavy_rows_ptr + slot, rows.to(tl.int32), mask=taken)
    if b == 0:
        tl.store(heavy_count_ptr, tl.minimum(total_o + total_h, cap))
        tl.store(heavy_count_ptr + 1, tl.minimum(total_o, cap))
