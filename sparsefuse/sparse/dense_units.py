"""Dense units of the scan: column ranges at least half non-zero, summed for up to DENSE_UNIT_ROWS rows at a time
on tensor cores, so that their weight rows are read once for all of them.

The scan (:func:`~sparsefuse.sparse.matmul_skip_zeros`) splits each row's columns into ranges (units) of
``unit_cols`` columns; the long-row pass (:mod:`.long_rows`) spreads a range far denser than the others over many
programs. That still reads the range's weight rows once *per row*: two tokens that fire every feature of an SAE
decode cost two reads of the whole of W_dec, where cuBLAS's dense product reads it once for the batch (two full bf16
rows at 32 tokens: 2.3x cuBLAS on an H200). A range at least half non-zero reads most of its weight rows anyway, so
here it is summed as a small dense product instead:

1. **Listing, in the scan.** The program that lists a range found long counts its non-zeros whole, in a function
   call of its own (activations only: no weight rows are gathered for it). If at least half of its columns are
   non-zero, the range is appended to its split's table of dense rows (``rows`` [n_splits, DENSE_UNIT_ROWS],
   ``counts`` [n_splits], one integer atomic); the first row of a split also appends the split to the list of
   splits that have dense rows (``splits`` [n_splits], ``n_splits_used`` [1]). A split whose table is full lists
   further ranges as ordinary long units: nothing is dropped.
2. **Summing, in the spread launch**, before its long units. The items are (listed split, output block of DOT_D
   columns, sub-range of the split's columns); each loads the [DENSE_UNIT_ROWS, DOT_F] activations of the split's
   listed rows (unlisted rows masked: never read) against one [DOT_F, DOT_D] tile of W, accumulating in fp32 with
   ``tl.dot``, and adds its [rows, DOT_D] sum into the rows' fp32 sums by atomics. The number of sub-ranges is
   chosen on the device from how many splits were listed: about one item per program of the launch. The product
   reads every weight row of the range, the zero activations' too: a tile of W holding a NaN or an infinity would
   put ``0 * NaN`` into every listed row. An item whose sum comes out NaN or infinite in a listed row (rare: a dead
   feature's NaN weight row, or a NaN activation) is summed again row by row over each row's non-zero activations,
   by the gather's step, so the sums keep the gather's contract -- a zero activation contributes exactly zero
   whatever its weight row holds. The check is one per item, on its [rows, DOT_D] sum.

Only where the scan's splits are already summed by fp32 atomics (its default when rows are too few to fill the GPU:
the case where a full row is a cliff) and the activations and W are one 16-bit dtype (tensor-core products of 16-bit
values are exact in fp32, so the sums match the gather's contract). Elsewhere dense ranges stay long units.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _backend
from .._backend import next_power_of_2
from .._triton.dot import dot_accumulate
from .._triton.gather import accumulate_rows

DENSE_UNIT_ROWS = tl.constexpr(16)  # rows of one split summed together (tl.dot's smallest M)
NONZERO_GROUP = tl.constexpr(8)  # activations a step where a W tile is not finite (a [8, DOT_D] tile: as the gather's)
DENSE_UNIT_MIN_COLS = tl.constexpr(256)  # columns of one item's sub-range, at least
DENSE_UNIT_DTYPES = (torch.float16, torch.bfloat16)


def lists_dense_units(a: torch.Tensor, weight: torch.Tensor, atomic_splits: bool) -> bool:
    """Whether the scan of ``a`` @ ``weight`` lists its dense ranges apart (see module docstring). Not for bf16
    under Triton's interpreter, whose bf16 tl.dot is wrong (triton-lang/triton#11584): the gather sums them there."""
    if _backend.INTERPRET and a.dtype == torch.bfloat16:
        return False
    return atomic_splits and a.dtype == weight.dtype and a.dtype in DENSE_UNIT_DTYPES


def dense_tiles(n_out: int, num_warps: int) -> dict:
    """The tl.dot tile of the dense ranges' sum in a launch of ``num_warps`` warps: DOT_D output columns (at most
    64 a warp, 256 in all: a [16, DOT_D] fp32 accumulator is then at most 32 registers a thread, under what the
    spread launch's long units take) by DOT_F activations (64: one 128-byte row of 16-bit values)."""
    if _backend.INTERPRET:
        return dict(DOT_D=16, DOT_F=16)
    return dict(DOT_D=min(256, 64 * num_warps, max(16, next_power_of_2(n_out))), DOT_F=64)


@triton.jit(noinline=True)
def at_least_half_nonzero(row_ptr, stride_col, f_begin, f_end, BLOCK_F: tl.constexpr):
    """Whether at least half of the columns [f_begin, f_end) of one row (row_ptr, column stride stride_col) are
    non-zero (int32 1 / 0). Not inlined: see the scan's listing (spmm.py)."""
    n = tl.zeros([], dtype=tl.int32)
    for f0 in range(f_begin, f_end, BLOCK_F):
        f = f0 + tl.arange(0, BLOCK_F)
        a = tl.load(row_ptr + f.to(tl.int64) * stride_col, mask=f < f_end, other=0.0)
        n += tl.sum((a != 0).to(tl.int32), axis=0)
    return (2 * n >= f_end - f_begin).to(tl.int32)


@triton.jit
def list_dense_unit(rows_ptr, counts_ptr, splits_ptr, n_splits_used_ptr, row, split, ROWS: tl.constexpr):
    """Append ``row`` to ``split``'s table of dense rows; False if the table is full (the caller lists the range as
    a long unit instead)."""
    slot = tl.atomic_add(counts_ptr + split, 1, sem="relaxed")  # read by the next launch only
    if slot < ROWS:
        tl.store(rows_ptr + split * ROWS + slot, row.to(tl.int32))
        if slot == 0:
            at = tl.atomic_add(n_splits_used_ptr, 1, sem="relaxed")
            tl.store(splits_ptr + at, split.to(tl.int32))
    return slot < ROWS


@triton.jit
def _sum_nonzero_terms(
    rows,
    listed,
    dense_ptr,
    stride_dense,
    stride_dense_col,
    s_begin,
    s_end,
    w_ptr,
    stride_w,
    d,
    d_mask,
    ROWS: tl.constexpr,
    DOT_D: tl.constexpr,
):
    """[ROWS, DOT_D] fp32: the listed rows' activations [s_begin, s_end) times W[those, d], each row over its non-zero
    activations alone, one row and NONZERO_GROUP activations at a time (the gather's step: the W rows of zero
    activations are never loaded); unlisted rows 0. For an item whose product came out NaN / inf (module
    docstring)."""
    r_ids = tl.arange(0, ROWS)
    acc = tl.zeros((ROWS, DOT_D), dtype=tl.float32)
    for r in range(0, ROWS):
        sel = r_ids == r
        if tl.sum(tl.where(sel & listed, 1, 0), axis=0) > 0:
            row = tl.sum(tl.where(sel, rows, 0), axis=0)
            part = tl.zeros(d.shape, dtype=tl.float32)
            for f0 in range(s_begin, s_end, NONZERO_GROUP):
                f = f0 + tl.arange(0, NONZERO_GROUP)
                a = tl.load(
                    dense_ptr + row * stride_dense + f.to(tl.int64) * stride_dense_col, mask=f < s_end, other=0.0
                ).to(tl.float32)
                part = accumulate_rows(part, a, f, a != 0, w_ptr, stride_w, d, d_mask)
            acc = tl.where(sel[:, None], acc + part[None, :], acc)
    return acc


@triton.jit
def sum_dense_units(
    rows_ptr,
    counts_ptr,
    splits_ptr,
    n_splits_used_ptr,
    dense_ptr,
    stride_dense,
    stride_dense_col,
    w_ptr,
    stride_w,
    sums_ptr,
    n_in,
    n_out,
    unit_cols,
    ROWS: tl.constexpr,
    DOT_D: tl.constexpr,
    DOT_F: tl.constexpr,
    MIN_COLS: tl.constexpr,
):
    """Every listed split's dense rows (see module docstring), one program of a 1-D grid looping over the items:
    ``sums`` [M, n_out] fp32 += dense[rows, split's columns] @ W[split's columns] by atomics."""
    n_used = tl.load(n_splits_used_ptr)
    n_d_blocks = tl.cdiv(n_out, DOT_D)
    per_sub = n_used * n_d_blocks
    # about one item per program: longer items than the long units' (fewer fp32 atomics, longer pipelined loops)
    subs = tl.minimum(tl.cdiv(tl.num_programs(0), tl.maximum(per_sub, 1)), tl.maximum(unit_cols // MIN_COLS, 1))
    r = tl.arange(0, ROWS)
    for item in range(tl.program_id(0), per_sub * subs, tl.num_programs(0)):
        split = tl.load(splits_ptr + item % n_used)
        d_block = (item // n_used) % n_d_blocks
        sub = item // per_sub
        listed = r < tl.minimum(tl.load(counts_ptr + split), ROWS)
        rows = tl.load(rows_ptr + split * ROWS + r, mask=listed, other=0).to(tl.int64)
        f_begin = split * unit_cols
        f_end = tl.minimum(n_in, f_begin + unit_cols)
        per = tl.cdiv(tl.cdiv(f_end - f_begin, subs), DOT_F) * DOT_F
        s_begin = f_begin + sub * per
        s_end = tl.minimum(f_end, s_begin + per)
        d = d_block * DOT_D + tl.arange(0, DOT_D)
        d_mask = d < n_out
        acc = tl.zeros((ROWS, DOT_D), dtype=tl.float32)
        for f0 in range(s_begin, s_end, DOT_F):
            f = f0 + tl.arange(0, DOT_F)
            f_mask = f < s_end
            a = tl.load(
                dense_ptr + rows[:, None] * stride_dense + f[None, :].to(tl.int64) * stride_dense_col,
                mask=listed[:, None] & f_mask[None, :],
                other=0.0,
            )
            w = tl.load(
                w_ptr + f[:, None].to(tl.int64) * stride_w + d[None, :],
                mask=f_mask[:, None] & d_mask[None, :],
                other=0.0,
            )
            acc = dot_accumulate(acc, a, w, False)  # 16-bit operands only: the native tensor-core path
        # a NaN / inf in a listed row's sum (rare): summed again over each row's non-zero activations alone, which
        # leaves out a zero activation's NaN weight row; one check an item, not a step
        nonfinite = ((acc != acc) | (tl.abs(acc) == float("inf"))) & listed[:, None]
        if tl.max(tl.max(nonfinite.to(tl.int32), axis=1), axis=0) > 0:
            acc = _sum_nonzero_terms(
                rows,
                listed,
                dense_ptr,
                stride_dense,
                stride_dense_col,
                s_begin,
                s_end,
                w_ptr,
                stride_w,
                d,
                d_mask,
                ROWS,
                DOT_D,
            )
        if s_end > s_begin:
            tl.atomic_add(
                sums_ptr + rows[:, None] * n_out + d[None, :],
                acc,
                mask=listed[:, None] & d_mask[None, :],
                sem="relaxed",
            )
