"""Tensor-core product of row-block sparse operands: ``y = A W^T`` where A is a :class:`BlockELL` (per block of rows,
the values on the block's union of non-zero columns), for large batches where blocks of rows share most of their
non-zero columns (the FFN's row-block path). Blocks are launched heaviest first so the longest finish early."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _backend
from .._backend import Backend, backend_for, cdiv, new_output, record_launch
from .._jit import kernel
from .._triton.dot import dot_accumulate, ieee_fp32
from .._validation import check_out, check_sparse_weight, describe
from .formats import BlockELL
from .spmm import product_operands


@triton.jit
def _group_count(counts_ptr, i, mask, n_cols, STEP: tl.constexpr, FROM_OFFSETS: tl.constexpr):
    # Work of group i: counts[i], or with FROM_OFFSETS the entries of columns [i * STEP, (i + 1) * STEP) in a
    # prefix-sum array of n_cols + 1 offsets. -1 where masked off (never ahead of a real count).
    if FROM_OFFSETS:
        hi = tl.load(counts_ptr + tl.minimum((i + 1) * STEP, n_cols), mask=mask, other=0)
        count = hi - tl.load(counts_ptr + i * STEP, mask=mask, other=0)
    else:
        count = tl.load(counts_ptr + i, mask=mask, other=0)
    return tl.where(mask, count, -1)


@kernel
def heavy_first_schedule_kernel(
    counts_ptr,
    sizes_ptr,
    parts_ptr,
    schedule_ptr,
    prefix_ptr,
    n,
    n_cols,
    n_parts,
    STEP: tl.constexpr,
    FROM_OFFSETS: tl.constexpr,
    PREFIX: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_J: tl.constexpr,
    PARTS: tl.constexpr,
):
    # counts [n] int32 (>= 0; or offsets [n_cols + 1], see _group_count) -> schedule [n] int32: the indices by
    # decreasing count, ties in index order. Each index's rank is counted by comparing it with every other count
    # (n is a number of row blocks, M / 64, or of column groups, N / 16). PREFIX: the same loop also sums sizes [n]
    # (int32) up to each index; each index's size is split in n_parts parts [n, n_parts] (int32, each row summing
    # to its size), and prefix [n * n_parts + 1] int64 = the exclusive running sum over (index, part), its last
    # entry the total. Program p ranks indices [p * BLOCK, (p + 1) * BLOCK) against all n, BLOCK_J at a time.
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    i_mask = i < n
    count_i = _group_count(counts_ptr, i, i_mask, n_cols, STEP, FROM_OFFSETS)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    through = tl.zeros([BLOCK], dtype=tl.int64)
    for j0 in range(0, n, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        count_j = _group_count(counts_ptr, j, j < n, n_cols, STEP, FROM_OFFSETS)
        tie = (count_j[None, :] == count_i[:, None]) & (j[None, :] < i[:, None])
        ahead = (count_j[None, :] > count_i[:, None]) | tie
        rank += tl.sum(ahead.to(tl.int32), axis=1)
        if PREFIX:
            size_j = tl.load(sizes_ptr + j, mask=j < n, other=0)
            before = (j[None, :] < i[:, None]) & (j[None, :] < n)
            through += tl.sum(tl.where(before, size_j[None, :], 0).to(tl.int64), axis=1)
    tl.store(schedule_ptr + rank, i, mask=i_mask)
    if PREFIX:
        for c0 in range(0, n_parts, PARTS):
            c = c0 + tl.arange(0, PARTS)
            flat = i[:, None].to(tl.int64) * n_parts + c[None, :]
            mask = i_mask[:, None] & (c[None, :] < n_parts)
            part = tl.load(parts_ptr + flat, mask=mask, other=0).to(tl.int64)
            tl.store(prefix_ptr + flat + 1, through[:, None] + tl.cumsum(part, axis=1), mask=mask)
            through += tl.sum(part, axis=1)
        if tl.program_id(0) == 0:
            tl.store(prefix_ptr, tl.zeros([], dtype=tl.int64))


def heavy_first_schedule(counts: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """[n] int32 indices of ``counts`` [n] (int32, >= 0, on the GPU) by decreasing count, ties in index order: one
    Triton launch, no host sync. A grid whose programs' work grows with their count, dispatched in this order, is
    longest-processing-time-first scheduled: the long programs start first and the short ones fill in behind them.

    ``group``: ``counts`` is instead a prefix-sum array of ``n_cols + 1`` offsets (int64, a CSC's), and the
    schedule orders the ``ceil(n_cols / group)`` groups of ``group`` consecutive columns by their entries."""
    n_cols = counts.numel() - 1 if group is not None else counts.numel()
    n = cdiv(n_cols, group) if group is not None else n_cols
    schedule = new_output((n,), torch.int32, counts.device)  # poisoned (-1) under test: every position is written
    _launch_schedule(counts, schedule, None, n, n_cols, group, None, None)
    return schedule


def heavy_first_schedule_and_offsets(
    counts: torch.Tensor, sizes: torch.Tensor, parts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`heavy_first_schedule` of ``counts`` [n] int32, offsets) in the one launch: where blocks are both
    scheduled and packed end to end (the training step), the offsets cost no launch of their own. ``offsets``:
    [n + 1] int64, the running sum of ``sizes`` [n] int32 before each index, then the total; or with ``parts``
    [n, n_parts] int32 (each index's size split in parts, each row summing to its size) [n * n_parts + 1], the
    running sum over (index, part)."""
    n = counts.numel()
    parts = sizes.reshape(n, 1) if parts is None else parts
    schedule = new_output((n,), torch.int32, counts.device)
    offsets = new_output((n * parts.shape[1] + 1,), torch.int64, counts.device)
    if n == 0:
        return schedule, offsets.zero_()
    _launch_schedule(counts, schedule, offsets, n, n, None, sizes, parts)
    return schedule, offsets


def _launch_schedule(
    counts: torch.Tensor,
    schedule: torch.Tensor,
    prefix: torch.Tensor | None,
    n: int,
    n_cols: int,
    group: int | None,
    sizes: torch.Tensor | None,
    parts: torch.Tensor | None,
) -> None:
    if n:
        # 16 indices a program: with 128 (one program per 128 indices, 7 at the 8B layer's 896 column groups) each
        # program's 4 warps ran their compare-and-reduce steps one dependent instruction at a time, ~19 cycles
        # each (ncu on an H200: 135 us, 7 SMs busy, SM-active cycles equal to the elapsed ones). A program of 16
        # indices does an eighth of that work a step, and 8 times as many programs run side by side.
        block, block_j, part_tile = (16, 32, 4) if _backend.INTERPRET else (16, 128, 32)
        heavy_first_schedule_kernel[(cdiv(n, block),)](
            counts, sizes if sizes is not None else counts, parts if parts is not None else counts, schedule,
            prefix if prefix is not None else schedule, n, n_cols, parts.shape[1] if parts is not None else 0,
            STEP=group or 1, FROM_OFFSETS=group is not None, PREFIX=prefix is not None, BLOCK=block, BLOCK_J=block_j,
            PARTS=part_tile,
        )  # fmt: skip
        record_launch("heavy_first_schedule_kernel")


@kernel
def block_ell_matmul_kernel(
    values_ptr,
    indices_ptr,
    counts_ptr,
    order_ptr,
    schedule_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    n_out,
    width,
    stride_w,
    stride_out,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    HAS_SCHEDULE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    # BlockELL values [M, width] (slot rows), indices [n_blocks, width], counts [n_blocks], order [M] int32 (slot
    # row -> output row); schedule [n_blocks] int32 (grid row -> row block, heaviest first); w [n_in, n_out] (unit
    # column stride), bias [n_out]; out [M, n_out]. Grid (D blocks, row blocks): program (db, blk) walks its block's
    # column list BLOCK_J at a time -- a [BLOCK_ROWS, BLOCK_J] tile of values times BLOCK_J gathered rows of w --
    # on tensor cores (the gather-accumulate of sparsefuse.sparse.spmm, batched over a row block's shared columns).
    # ACCUMULATE adds the product to what out holds (a backward's A1 W1 + A2 W2 as two launches).
    d_block = tl.program_id(0)
    block = tl.load(schedule_ptr + tl.program_id(1)) if HAS_SCHEDULE else tl.program_id(1)
    count = tl.load(counts_ptr + block)
    local_rows = tl.arange(0, BLOCK_ROWS)
    slots = block * BLOCK_ROWS + local_rows
    row_mask = slots < M
    d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_mask = d < n_out
    values_block_ptr = values_ptr + block.to(tl.int64) * BLOCK_ROWS * width + local_rows[:, None] * width
    indices_block_ptr = indices_ptr + block.to(tl.int64) * width
    acc = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
    # Each step's column indices are loaded one step ahead: the weight gather that depends on them then does not
    # wait an L2 round trip for them (4-6% on an H200).
    j = tl.arange(0, BLOCK_J)
    cols_next = tl.load(indices_block_ptr + j, mask=j < count, other=0)
    for j0 in range(0, count, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)  # [BLOCK_J]
        j_mask = j < count
        cols = cols_next
        cols_next = tl.load(indices_block_ptr + j + BLOCK_J, mask=j + BLOCK_J < count, other=0)
        a = tl.load(values_block_ptr + j[None, :], mask=row_mask[:, None] & j_mask[None, :], other=0.0)
        w = tl.load(
            w_ptr + cols[:, None].to(tl.int64) * stride_w + d[None, :],
            mask=j_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_J, BLOCK_D]
        acc = dot_accumulate(acc, a, w, IEEE_FP32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    rows = tl.load(order_ptr + slots, mask=row_mask, other=0) if HAS_ORDER else slots
    out_tile_ptr = out_ptr + rows[:, None].to(tl.int64) * stride_out + d[None, :]
    out_mask = row_mask[:, None] & d_mask[None, :]
    if ACCUMULATE:
        acc += tl.load(out_tile_ptr, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_tile_ptr, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _block_matmul_blocks(n_out: int) -> tuple[int, int, int, int]:
    """(BLOCK_J, BLOCK_D, num_warps, num_stages): measured on an H200 (with the indices loaded
    ahead, 4 stages ran 1.5x slower than 3)."""
    if _backend.INTERPRET:
        return 16, 32, 4, 1
    return 64, 256, 8, 3


def block_sparse_matmul(
    sparse: BlockELL,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    heavy_first: bool = True,
    accumulate: torch.Tensor | None = None,
    schedule: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sparse @ weight + bias`` -> [M, n_out] for a :class:`BlockELL` [M, n_in] (rows in blocks sharing their
    column lists; slot rows written to their ``row_order`` rows) and weight [n_in, n_out] (columns contiguous or
    copied once): per row block, tensor-core tiles of its values times the gathered weight rows of its columns, fp32
    accumulation. ``2 * block_rows * n_out`` flops per listed column: the dense product's work times the union's
    share of n_in.

    A block's programs take time in proportion to its column count, which varies several-fold between blocks. With
    ``heavy_first`` (default) the blocks are launched longest first (:func:`heavy_first_schedule`, one small extra
    launch) so that no long block starts last and runs alone at the end of the grid.

    ``accumulate`` [M, n_out] (unit column stride): the product is added to it in place and it is returned (in its
    dtype; no bias then) -- a sum of products ``A1 W1 + A2 W2`` without a second output. ``out`` [M, n_out] (unit
    column stride): written with the product (in its dtype) and returned, instead of a new tensor. ``schedule``: the
    :func:`heavy_first_schedule` of ``sparse.counts`` when the caller already has it (several products on the same
    pattern)."""
    op = "block_sparse_matmul"
    check_sparse_weight(op, sparse, weight)
    n_out = weight.shape[1]
    if bias is not None and (bias.shape != (n_out,) or bias.device != weight.device):
        raise ValueError(f"{op}: bias must be [{n_out}] on {weight.device}; got {describe(bias)}")
    if accumulate is not None:
        if bias is not None or accumulate.shape != (sparse.shape[0], n_out) or accumulate.stride(-1) != 1:
            raise ValueError(
                f"{op}: accumulate must be [{sparse.shape[0]}, {n_out}] with unit column stride, and no bias given; "
                f"got {describe(accumulate)}"
            )
        weight = product_operands(sparse.values.dtype, 0, weight, None)[0]
        out = accumulate
    elif out is not None:
        check_out(op, out, (sparse.shape[0], n_out), weight.device, out_dtype, contiguous=False)
        weight = product_operands(sparse.values.dtype, 0, weight, None)[0]
    else:
        weight, out = product_operands(sparse.values.dtype, sparse.shape[0], weight, out_dtype)
    M, out_dtype = out.shape[0], out.dtype
    if M == 0 or n_out == 0:
        return out
    if backend_for(weight) is Backend.TORCH:
        _backend.warn_reference_once(op)
        ref = sparse.to_dense().double() @ weight.double()
        ref = ref + bias.double() if bias is not None else ref
        if accumulate is not None:
            return out.add_(ref.to(out_dtype))
        return out.copy_(ref)
    block_j, block_d, warps, stages = _block_matmul_blocks(n_out)
    n_blocks = sparse.counts.shape[0]
    if schedule is None and heavy_first and n_blocks > 1:
        schedule = heavy_first_schedule(sparse.counts)
    block_ell_matmul_kernel[(cdiv(n_out, block_d), n_blocks)](
        sparse.values,
        sparse.indices,
        sparse.counts,
        sparse.row_order if sparse.row_order is not None else sparse.counts,
        schedule if schedule is not None else sparse.counts,
        weight,
        bias if bias is not None else weight,
        out,
        M,
        n_out,
        sparse.values.shape[1],
        weight.stride(0),
        out.stride(0),
        BLOCK_ROWS=sparse.block_rows,
        BLOCK_J=block_j,
        BLOCK_D=block_d,
        HAS_ORDER=sparse.row_order is not None,
        HAS_SCHEDULE=schedule is not None,
        HAS_BIAS=bias is not None,
        ACCUMULATE=accumulate is not None,
        IEEE_FP32=ieee_fp32(sparse.values.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    record_launch("block_ell_matmul_kernel")
    return out
