"""The backward products of a row-block sparse layer (the gated FFN's training step on row-block unions).

Given the forward's :class:`~sparsefuse.sparse.BlockELL` slots (each block of rows shares the union of its columns):

* :func:`block_ell_sddmm` -- a dense x dense product sampled on those slots, ``(a @ b^T)[row, col]`` (the gradient
  w.r.t. the sparse activations, ``dh = dy W_d``), with the gated layer's chain rule fused in its epilogue;
* :func:`block_ell_transpose` -- the slots holding a non-zero, grouped by column (:class:`BlockCSC`): deterministic,
  no atomics on values and no host sync;
* :func:`transposed_matmul` -- ``out[col] = sum over rows of value[row, col] * x[row]`` from that grouping (the weight
  gradients ``A^T X``) on tensor cores, each column's terms summed in one fixed order, so the result does not depend
  on scheduling. The work is the non-zeros', not the dense product's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _backend
from .._backend import Backend, backend_for, cdiv, new_output, record_launch
from .._jit import kernel
from .._triton.dot import dot_accumulate, gathered_rows_dot, ieee_fp32
from .._triton.limits import limits
from .._triton.slots import block_slots, load_slots, offsets_fit_32, store_slots, union_chunk
from .._validation import check_out, unit_last_stride
from .block_spmm import heavy_first_schedule
from .formats import BlockCSC, BlockELL
from .layout import unit_rows


@kernel
def block_ell_sddmm_kernel(
    indices_ptr,
    counts_ptr,
    order_ptr,
    a_ptr,
    b_ptr,
    gate_ptr,
    up_ptr,
    gate_grad_ptr,
    out_ptr,
    out2_ptr,
    M,
    D,
    width,
    stride_a,
    stride_b,
    gate_grad_divisor,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    GATED: tl.constexpr,
    HAS_UP: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    OFFSETS_32: tl.constexpr,
):
    # BlockELL slots: indices [n_blocks, width], counts [n_blocks], order [M] (slot row -> matrix row); a [M, D],
    # b [N, D]. Program (c, blk): slots [c * BLOCK_C, (c + 1) * BLOCK_C) of block blk, acc = a[rows] @ b[cols]^T.
    # Plain: out = acc. GATED (gate, up [M, width] on the same slots; gate_grad a 1-element tensor, read over
    # gate_grad_divisor, correctly rounded as torch divides):
    #   out = acc * gate                                   (gradient w.r.t. up)
    #   out2 = (acc * up + gate_grad) where gate != 0     (gradient w.r.t. the gate's pre-activation)
    # Without HAS_UP (a non-gated layer: h = gate) only out2, with up = 1. OFFSETS_32: every element offset of a, b
    # and the [M, width] arrays fits in int32.
    chunk, block, count, live = union_chunk(counts_ptr, BLOCK_C)
    if live:
        _, p_mask, cols, _, rows, row_mask, mask, offsets = block_slots(
            indices_ptr, order_ptr, block, chunk, count, M, width, BLOCK_ROWS, BLOCK_C, True, HAS_ORDER, OFFSETS_32
        )
        if not OFFSETS_32:
            rows, cols = rows.to(tl.int64), cols.to(tl.int64)
        a_rows_ptr = a_ptr + rows[:, None] * stride_a
        b_cols_ptr = b_ptr + cols[None, :] * stride_b
        acc = tl.zeros([BLOCK_ROWS, BLOCK_C], dtype=tl.float32)
        acc = gathered_rows_dot(acc, a_rows_ptr, row_mask, b_cols_ptr, p_mask, D, BLOCK_D, IEEE_FP32)
        if GATED:
            gate = load_slots(gate_ptr, offsets, mask)
            gate_grad = tl.math.div_rn(tl.load(gate_grad_ptr).to(tl.float32), gate_grad_divisor)
            if HAS_UP:
                up = load_slots(up_ptr, offsets, mask)
                store_slots(out_ptr, offsets, acc * gate, mask)
                d_gate = tl.where(gate != 0, acc * up + gate_grad, 0.0)
            else:
                d_gate = tl.where(gate != 0, acc + gate_grad, 0.0)
            store_slots(out2_ptr, offsets, d_gate, mask)
        else:
            store_slots(out_ptr, offsets, acc, mask)


def _sddmm_blocks() -> tuple[int, int, int, int, int | None]:
    """(BLOCK_C, BLOCK_D, num_warps, num_stages, maxnreg): measured on an H200, one recorded training step's dh
    replayed from a CUDA graph. With 32-bit offsets 4 warps and the compiler's registers: 227 us at the 8B layer
    shape and 117 at 1.5B, against 232 and 119 with 8 warps capped at 128 registers (two programs an SM; 8 warps
    uncapped take one an SM: 296 and 140 us)."""
    return (16, 32, 4, 1, None) if _backend.INTERPRET else (128, 64, 4, 4, None)


def block_ell_sddmm(
    like: BlockELL,
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    gate: torch.Tensor | None = None,
    up: torch.Tensor | None = None,
    gate_grad: torch.Tensor | None = None,
    gate_grad_divisor: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor | None, torch.Tensor]:
    """``(a @ b^T)`` on ``like``'s slots: a [M, D], b [N, D] -> values [M, width] (``like``'s slots, fp32
    accumulation on tensor cores, no host sync; ``2 * block_rows * D`` flops per listed column).

    With ``gate``/``up`` ([M, width], the forward's factors of ``h = gate * up`` on the same slots, gate already
    relu'd) and ``gate_grad`` (1-element float tensor; over ``gate_grad_divisor``, the gradient added to every fired
    gate pre-activation, e.g. an L1 term's: the loss's gradient w.r.t. a mean, divided by its count with no launch
    of its own, correctly rounded as the dense layout's kernel and torch divide it), returns the two gradients of
    ``h`` given ``dh = a @ b^T``: ``(dh * gate, (dh * up + gate_grad) * [gate != 0])``. With ``gate`` but no
    ``up`` (a non-gated layer, ``h = gate``): ``(None, (dh + gate_grad) * [gate != 0])``."""
    a, b = unit_rows(a), unit_rows(b)  # (b: W_down^T of a row-major W_down, by the tiled copy)
    M, width = like.values.shape
    gated, has_up = gate is not None, up is not None
    out_dtype = out_dtype or a.dtype
    out2 = new_output((M, width), out_dtype, a.device) if gated else None  # slots past a count are never read
    out = new_output((M, width), out_dtype, a.device) if has_up or not gated else out2

    def result():
        return (out if has_up else None, out2) if gated else out

    if M == 0:
        return result()
    if backend_for(a) is Backend.TORCH:
        raise NotImplementedError("block_ell_sddmm runs on the GPU or the Triton interpreter")
    block_c, block_d, warps, stages, max_registers = _sddmm_blocks()
    order = like.row_order
    block_ell_sddmm_kernel[(cdiv(width, block_c), like.counts.shape[0])](
        like.indices,
        like.counts,
        order if order is not None else like.counts,
        a,
        b,
        gate if gated else a,
        up if has_up else a,
        gate_grad if gated else a,
        out,
        out2 if gated else out,
        M,
        a.shape[1],
        width,
        a.stride(0),
        b.stride(0),
        float(gate_grad_divisor),
        BLOCK_ROWS=like.block_rows,
        BLOCK_C=block_c,
        BLOCK_D=block_d,
        HAS_ORDER=order is not None,
        GATED=gated,
        HAS_UP=has_up,
        IEEE_FP32=ieee_fp32(a.dtype),
        OFFSETS_32=offsets_fit_32(a, b, like.values),
        num_warps=warps,
        num_stages=stages,
        **({"maxnreg": max_registers} if max_registers else {}),
    )
    record_launch("block_ell_sddmm_kernel")
    return result()


@kernel
def block_csc_kernel(
    values_ptr,
    indices_ptr,
    counts_ptr,
    start_ptr,
    offsets_ptr,
    pair_ptr,
    src_ptr,
    order_ptr,
    rows_ptr,
    M,
    N,
    width,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    FILL: tl.constexpr,
    HAS_ORDER: tl.constexpr,
):
    # BlockELL values [M, width], indices [n_blocks, width], counts [n_blocks]. Program (c, blk) takes slots
    # [c * BLOCK_C, (c + 1) * BLOCK_C) of block blk and finds the rows of the block holding a non-zero there.
    # Count pass (not FILL): pair[blk, col] = how many. Fill pass: each such (row, slot) gets the position
    # offsets[col] + start[blk, col] + (its rank among the block's non-zeros of that column, by row), start being
    # the column's entries in the blocks before, and its flat slot index row * width + slot is written to src there
    # and its matrix row (order[row] with HAS_ORDER) to rows -- every position once: no atomics, the same layout
    # every run.
    chunk, block, count, live = union_chunk(counts_ptr, BLOCK_C)
    if live:
        _, p_mask, cols, _, rows, _, mask, flat = block_slots(
            indices_ptr, order_ptr, block, chunk, count, M, width, BLOCK_ROWS, BLOCK_C, True, HAS_ORDER and FILL
        )  # [BLOCK_ROWS, BLOCK_C] flat slot indices
        v = tl.load(values_ptr + flat, mask=mask, other=0.0)
        nz = ((v != 0) & mask).to(tl.int32)
        if FILL:
            start = tl.load(start_ptr + block.to(tl.int64) * N + cols, mask=p_mask, other=0)  # [BLOCK_C] int64
            start += tl.load(offsets_ptr + cols, mask=p_mask, other=0)
            position = start[None, :] + (tl.cumsum(nz, axis=0) - nz)
            tl.store(src_ptr + position, flat.to(src_ptr.dtype.element_ty), mask=nz > 0)
            matrix_rows = tl.broadcast_to(rows[:, None], [BLOCK_ROWS, BLOCK_C]).to(rows_ptr.dtype.element_ty)
            tl.store(rows_ptr + position, matrix_rows, mask=nz > 0)
        else:
            tl.store(pair_ptr + block.to(tl.int64) * N + cols, tl.sum(nz, axis=0), mask=p_mask)


def column_count_table(column_counts: torch.Tensor) -> torch.Tensor:
    """``column_counts`` [n_blocks, N] laid out as :func:`block_ell_transpose`'s ``count_table``: a new
    [n_blocks + 1, N] int64 table, block b's counts in row b + 1 and zeros in row 0. A caller that must correct some
    blocks' counts (a backward that recomputed them) writes into its rows and leaves ``column_counts`` as it was."""
    n_blocks, N = column_counts.shape
    table = torch.empty(n_blocks + 1, N, dtype=torch.int64, device=column_counts.device)
    table[0].zero_()
    table[1:].copy_(column_counts)
    return table


@kernel
def column_prefix_sum_kernel(
    table_ptr, src_ptr, R, N, stride_src, ROW_ZERO: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr
):
    # table [R + 1, N] int64; src [R, N] (any integer dtype, unit column stride; may be table's rows 1..R, in place).
    # table[r + 1] = table[0] + src[0] + ... + src[r], table[0] zeroed first with ROW_ZERO. Program: BLOCK_N columns,
    # the rows walked BLOCK_R at a time with a running carry; each chunk is read before it is written, and no other
    # program touches these columns.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if ROW_ZERO:
        carry = tl.zeros([BLOCK_N], dtype=tl.int64)
        tl.store(table_ptr + cols, carry, mask=col_mask)
    else:
        carry = tl.load(table_ptr + cols, mask=col_mask, other=0)
    for r0 in range(0, R, BLOCK_R):
        r = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
        mask = (r < R)[:, None] & col_mask[None, :]
        v = tl.load(src_ptr + r[:, None] * stride_src + cols[None, :], mask=mask, other=0).to(tl.int64)
        tl.store(table_ptr + (r[:, None] + 1) * N + cols[None, :], tl.cumsum(v, axis=0) + carry[None, :], mask=mask)
        carry += tl.sum(v, axis=0)


def _column_prefix_sums(table: torch.Tensor, src: torch.Tensor, row_zero: bool) -> None:
    """``table`` [R + 1, N] int64 (contiguous) <- running sums down the rows of ``src`` [R, N] (``table[1:]`` itself
    for an in-place sum), from ``table[0]`` (zeroed first with ``row_zero``): one launch where torch's sum down
    dim 0 of the step's [n_blocks + 1, N] table took 53 us (H200, 129 rows, at either layer shape)."""
    R, N = src.shape
    block_r, block_n = (16, 16) if _backend.INTERPRET else (32, 64)
    column_prefix_sum_kernel[(cdiv(N, block_n),)](
        table, src, R, N, src.stride(0), ROW_ZERO=row_zero, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=4
    )
    record_launch("column_prefix_sum_kernel")


def _index_dtype(largest: int) -> torch.dtype:
    """int32 for indices below ``largest`` where it fits (below 2**31), else int64."""
    return torch.int32 if largest < 2**31 else torch.int64


def block_ell_transpose(
    sparse: BlockELL, column_counts: torch.Tensor | None = None, *, count_table: torch.Tensor | None = None
) -> BlockCSC:
    """The non-zero slots of ``sparse`` (values != 0; NaN counts) grouped by column, in (block, row) order within a
    column: :class:`BlockCSC`. Two passes over the slots and prefix sums over a [n_blocks, N] table; no host sync.
    ``column_counts`` [n_blocks, N] int32, the non-zeros per (row block, column) when already known (e.g. from
    :func:`sparsefuse.sparse.block_sddmm` with ``factors``), saves the first pass; it is only read. Or
    ``count_table``, the same counts as :func:`column_count_table` lays them out (contiguous): this call takes it
    over and overwrites it with its prefix sums.
    The index arrays are allocated for every slot that could hold a non-zero (``M * min(width, N)`` entries: 4
    bytes each while the flat slot index fits int32), since the count is only known on the device."""
    values = sparse.values
    M, width = values.shape
    N, n_blocks = sparse.n_cols, sparse.counts.shape[0]
    capacity = M * min(width, N)
    src = torch.empty(capacity, dtype=_index_dtype(M * width), device=values.device)  # flat slot indices
    rows = torch.empty(capacity, dtype=_index_dtype(M), device=values.device)  # matrix rows
    offsets = torch.zeros(N + 1, dtype=torch.int64, device=values.device)
    csc = BlockCSC(src, offsets, width, sparse.row_order, M, N, rows)
    if M == 0 or N == 0:
        return csc
    if backend_for(values) is Backend.TORCH:
        raise NotImplementedError("block_ell_transpose runs on the GPU or the Triton interpreter")
    block_c = 16 if _backend.INTERPRET else 128
    grid = (cdiv(width, block_c), n_blocks)
    args = (sparse.indices, sparse.counts)
    order = sparse.row_order
    common = dict(BLOCK_ROWS=sparse.block_rows, BLOCK_C=block_c, HAS_ORDER=order is not None, num_warps=4)
    order = order if order is not None else src
    # One int64 table [n_blocks + 1, N] holds the counts shifted down a row, so that its running sum in place is
    # each (block, column)'s count in the blocks before it (row n_blocks: the column's total) and, plus the
    # column's offset, where the block's entries of the column start: no second table of the counts is needed.
    if count_table is not None:
        if (
            count_table.shape != (n_blocks + 1, N)
            or count_table.dtype != torch.int64
            or not count_table.is_contiguous()
        ):
            raise ValueError(
                f"block_ell_transpose: count_table must be a contiguous [{n_blocks + 1}, {N}] int64 tensor; got "
                f"{list(count_table.shape)} {count_table.dtype} with strides {count_table.stride()}"
            )
        table = count_table  # its running sums are written in place
        _column_prefix_sums(table, table[1:], row_zero=False)
    elif column_counts is not None:
        table = torch.empty(n_blocks + 1, N, dtype=torch.int64, device=values.device)
        _column_prefix_sums(table, unit_last_stride(column_counts), row_zero=True)
    else:
        table = torch.zeros(n_blocks + 1, N, dtype=torch.int64, device=values.device)
        block_csc_kernel[grid](
            values, *args, table[1:], offsets, table[1:], src, order, rows, M, N, width, FILL=False, **common
        )
        record_launch("block_csc_kernel")
        _column_prefix_sums(table, table[1:], row_zero=False)
    torch.cumsum(table[-1], 0, out=offsets[1:])
    start = table[:-1]  # [n_blocks, N]: the column's entries in the blocks before; the kernel adds its offset
    block_csc_kernel[grid](values, *args, start, offsets, start, src, order, rows, M, N, width, FILL=True, **common)
    record_launch("block_csc_kernel")
    return csc


@kernel
def transposed_matmul_kernel(
    src_ptr,
    offsets_ptr,
    order_ptr,
    rows_ptr,
    schedule_ptr,
    v1_ptr,
    v2_ptr,
    v3_ptr,
    v4_ptr,
    x_ptr,
    y_ptr,
    out_ptr,
    out2_ptr,
    out3_ptr,
    sum_ptr,
    sum2_ptr,
    N,
    D,
    width,
    stride_x,
    stride_y,
    stride_o1_n,
    stride_o1_d,
    stride_o2_n,
    stride_o2_d,
    stride_o3_n,
    stride_o3_d,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    HAS_SCHEDULE: tl.constexpr,
    EVEN_D: tl.constexpr,
    OFFSETS_32: tl.constexpr,
    TWO: tl.constexpr,
    PRODUCT: tl.constexpr,
    THIRD: tl.constexpr,
    THIRD_PRODUCT: tl.constexpr,
    BIAS: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    # BlockCSC src [nnz] (flat slot index, grouped by column), offsets [N + 1], rows [nnz] (each entry's matrix row;
    # without HAS_ROWS found as order[src // width], or src // width without HAS_ORDER); schedule [cdiv(N, BLOCK_N)]
    # int32 (launch order of the column groups; the natural order without HAS_SCHEDULE); values v1..v4 [M, width]
    # on the slots; x, y [M, D]. A 1-D grid (any N): program p takes features [db * BLOCK_D, ...),
    # db = p % cdiv(D, BLOCK_D), of columns [nb * BLOCK_N, ...), nb = schedule[p // cdiv(D, BLOCK_D)]. Their entries
    # are contiguous in src; BLOCK_E at a time the gathered x rows, transposed [BLOCK_D, BLOCK_E], times
    # B [BLOCK_E, BLOCK_N] (entry e's value in its column, 0 elsewhere) accumulate out^T on tensor cores: the
    # gathered tile is the product's wide operand, read by the tensor cores from shared memory where the pipelined
    # gather put it. Outputs: out = A1^T x with A1 = v1 (v1 * v2 when PRODUCT); TWO: out2 = v2^T x as well (the
    # same gathered rows); THIRD: out3 = (v3 * v4)^T y. BIAS: the programs of feature block 0 also write the column
    # sums of A1 (and v2) to sum (sum2), fp32. The next step's entry rows are loaded before this step's gathers.
    # EVEN_D: D is a multiple of BLOCK_D (no feature mask); OFFSETS_32: row * stride fits in int32 for x and y.
    n_d = tl.cdiv(D, BLOCK_D)
    group, d_program = tl.program_id(0) // n_d, tl.program_id(0) % n_d
    n0 = (tl.load(schedule_ptr + group) if HAS_SCHEDULE else group) * BLOCK_N
    d = d_program * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < D
    col = tl.arange(0, BLOCK_N)
    ends = tl.load(offsets_ptr + tl.minimum(n0 + 1 + col, N))  # [BLOCK_N]: where each column's entries end
    first = tl.load(offsets_ptr + n0)
    last = tl.load(offsets_ptr + tl.minimum(n0 + BLOCK_N, N))
    acc1 = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
    sum1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    sum2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    x_base = x_ptr + d_program * BLOCK_D  # this program's features of row 0
    y_base = y_ptr + d_program * BLOCK_D
    features = tl.arange(0, BLOCK_D)
    e = first + tl.arange(0, BLOCK_E)  # [BLOCK_E]
    flat = tl.load(src_ptr + e, mask=e < last, other=0)
    row = _entry_rows(rows_ptr, order_ptr, e, flat, last, width, HAS_ROWS, HAS_ORDER)
    for _ in range(first, last, BLOCK_E):
        e_mask = e < last
        e_next = e + BLOCK_E
        flat_next = tl.load(src_ptr + e_next, mask=e_next < last, other=0)
        row_next = _entry_rows(rows_ptr, order_ptr, e_next, flat_next, last, width, HAS_ROWS, HAS_ORDER)
        # Both gathers are issued before anything else of the step (the order the pipeliner was measured fastest in)
        tile_mask = e_mask[:, None] if EVEN_D else e_mask[:, None] & d_mask[None, :]
        row_x = row * stride_x if OFFSETS_32 else row.to(tl.int64) * stride_x
        xv = tl.load(x_base + row_x[:, None] + features[None, :], mask=tile_mask, other=0.0)  # [BLOCK_E, BLOCK_D]
        if THIRD:
            row_y = row * stride_y if OFFSETS_32 else row.to(tl.int64) * stride_y
            yv = tl.load(y_base + row_y[:, None] + features[None, :], mask=tile_mask, other=0.0)
        owner = tl.sum((e[:, None] >= ends[None, :]).to(tl.int32), axis=1)  # [BLOCK_E]: column within the block
        hit = (owner[:, None] == col[None, :]) & e_mask[:, None]  # [BLOCK_E, BLOCK_N]
        v1 = tl.load(v1_ptr + flat, mask=e_mask, other=0.0)
        if PRODUCT:
            v1 = (v1.to(tl.float32) * tl.load(v2_ptr + flat, mask=e_mask, other=0.0).to(tl.float32)).to(xv.dtype)
        if TWO:
            v2 = tl.load(v2_ptr + flat, mask=e_mask, other=0.0)
        if THIRD:
            v3 = tl.load(v3_ptr + flat, mask=e_mask, other=0.0).to(tl.float32)
            if THIRD_PRODUCT:
                v3 = v3 * tl.load(v4_ptr + flat, mask=e_mask, other=0.0).to(tl.float32)
        # Every B operand is built before the first product: each goes through shared memory behind a barrier, and
        # three barriers between three products cost 20% at the 8B shape against one before them all.
        b1 = tl.where(hit, v1[:, None], 0.0).to(xv.dtype)
        if TWO:
            b2 = tl.where(hit, v2[:, None], 0.0).to(xv.dtype)
        if THIRD:
            b3 = tl.where(hit, v3[:, None], 0.0).to(yv.dtype)
        xt = tl.trans(xv)  # [BLOCK_D, BLOCK_E]
        acc1 = dot_accumulate(acc1, xt, b1, IEEE_FP32)
        if TWO:
            acc2 = dot_accumulate(acc2, xt, b2, IEEE_FP32)
        if THIRD:
            acc3 = dot_accumulate(acc3, tl.trans(yv), b3, IEEE_FP32)
        if BIAS:
            sum1 += tl.sum(b1.to(tl.float32), axis=0)
            if TWO:
                sum2 += tl.sum(b2.to(tl.float32), axis=0)
        e, flat, row = e_next, flat_next, row_next
    cols = n0 + col
    n_mask = cols < N
    # [BLOCK_D, BLOCK_N] of each [N, D] output at its strides: (D, 1) contiguous, (1, N) the transpose of a
    # row-major [D, N] weight's gradient (its columns then are this tile's unit-stride axis)
    cols64, d64 = cols[None, :].to(tl.int64), d[:, None].to(tl.int64)
    mask = n_mask[None, :] & d_mask[:, None]
    tl.store(out_ptr + cols64 * stride_o1_n + d64 * stride_o1_d, acc1.to(out_ptr.dtype.element_ty), mask=mask)
    if TWO:
        tl.store(out2_ptr + cols64 * stride_o2_n + d64 * stride_o2_d, acc2.to(out2_ptr.dtype.element_ty), mask=mask)
    if THIRD:
        tl.store(out3_ptr + cols64 * stride_o3_n + d64 * stride_o3_d, acc3.to(out3_ptr.dtype.element_ty), mask=mask)
    if BIAS:
        if d_program == 0:
            tl.store(sum_ptr + cols, sum1, mask=n_mask)
            if TWO:
                tl.store(sum2_ptr + cols, sum2, mask=n_mask)


@triton.jit
def _entry_rows(rows_ptr, order_ptr, e, flat, last, width, HAS_ROWS: tl.constexpr, HAS_ORDER: tl.constexpr):
    """The matrix rows of BlockCSC entries e (flat slot indices ``flat``; 0 past ``last``): read from rows, or found
    through the slot row's order."""
    if HAS_ROWS:
        return tl.load(rows_ptr + e, mask=e < last, other=0)
    if HAS_ORDER:
        return tl.load(order_ptr + flat // width, mask=e < last, other=0)
    return flat // width


# (BLOCK_N, BLOCK_E, BLOCK_D, num_warps, num_stages, maxnreg) for 16-bit operands, measured on an H200 at the 1.5B
# and 8B FFN shapes (8192 tokens, ~30 non-zeros each; fp32 takes one pipeline stage fewer: three of its tiles do not
# fit shared memory). The product is written out^T = x^T B so that the gathered tile [BLOCK_D, BLOCK_E] is the
# tensor cores' wide operand (wgmma, read from shared memory where the pipelined gather lands it) and the one-hot
# B [BLOCK_E, BLOCK_N] the narrow one. Written the other way (out = A x, 16 rows a warp-level mma), Nsight Compute
# put the kernel at 83% of the L1/shared-memory pipe's throughput with DRAM at 20%: the gathered tile went through
# registers to the mma and every warp read all of A. With the matrix rows stored per entry (no division and
# dependent lookup before each gather), the three products of the training step (dW_g, dW_u, dW_d) took
# 1445 -> 980 us at 8B and 636 -> 426 us at 1.5B (3.9 and 1.9 GB of gathered rows at 4.0 and 4.6 TB/s); 32 entries
# and 256 features a step, 8 warps, 3 stages (101 KB of shared memory, two programs an SM). 16 or 64 entries,
# 64 or 128 features, 8 or 32 columns a group, 2 or 4 stages, or a register cap were 7-60% slower. Two products
# (the non-gated step's dW and dW_d) run best at 2 stages (725 us at 8B, 321 at 1.5B), one at 3 (371 and 165 us).
TRANSPOSED_CONFIG = {1: (16, 32, 256, 8, 3, None), 2: (16, 32, 256, 8, 2, None), 3: (16, 32, 256, 8, 3, None)}


def transposed_matmul(
    csc: BlockCSC,
    x: torch.Tensor,
    values: torch.Tensor,
    second: torch.Tensor | None = None,
    *,
    mode: str = "one",
    third: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    bias: bool = False,
    out_dtype: torch.dtype | None = None,
    out: list[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """``A^T x`` for each sparse A on ``csc``'s non-zero slots: x [M, D]; values (and second) [M, width].

    ``mode``: "one" -> A = values; "two" -> A = values and A = second (one gather of x for both); "product" -> A =
    values * second (elementwise, on the slots). ``third = (y, v3, v4)`` adds ``(v3 * v4)^T y`` (y of x's shape;
    ``v3^T y`` when v4 is None)
    in the same pass over the entries. Returns (a list of [N, D] products in ``out_dtype`` (default x's), one per
    A, the third last; the column sums [N] fp32 of the A's on x when ``bias``, else None). Deterministic: each
    column's terms are summed in one fixed order. The cost is one gathered row of x (and y) per entry: ``nnz * D``
    elements, against the dense product's ``M * N * D`` multiply-adds. ``out``: the products written into these
    [N, D] tensors (any float dtype each, or ``out_dtype`` if given; one per product), each contiguous or the
    transpose of a contiguous [D, N] one (a row-major weight's gradient, written in place rather than copied after),
    instead of new contiguous ones."""
    if mode not in ("one", "two", "product"):
        raise ValueError(f"transposed_matmul: mode must be 'one', 'two' or 'product'; got {mode!r}")
    x = unit_last_stride(x)
    n_x = 2 if mode == "two" else 1
    n_out = n_x + (third is not None)
    N, D = csc.n_cols, x.shape[1]
    if third is not None:
        y, v3, v4 = third
        y = unit_last_stride(y)
        if y.shape != x.shape:
            raise ValueError(f"transposed_matmul: third's y must have x's shape {list(x.shape)}; got {list(y.shape)}")
    if out is None:
        out = [new_output((N, D), out_dtype or x.dtype, x.device) for _ in range(n_out)]
    elif len(out) != n_out:
        raise ValueError(f"transposed_matmul: out must hold {n_out} tensors, one per product; got {len(out)}")
    else:
        for o in out:
            check_out("transposed_matmul", o, (N, D), x.device, out_dtype, contiguous=True, transposed=True)
    sums = [torch.zeros(N, dtype=torch.float32, device=x.device) for _ in range(n_x)] if bias else None
    if N == 0 or D == 0:
        return out, sums
    if csc.n_rows == 0:
        for o in out:
            o.zero_()
        return out, sums
    if backend_for(x) is Backend.TORCH:
        raise NotImplementedError("transposed_matmul runs on the GPU or the Triton interpreter")
    if _backend.INTERPRET:
        block_n, block_e, block_d, warps, stages, max_registers = 16, 16, 32, 4, 1, None
    else:
        block_n, block_e, block_d, warps, stages, max_registers = TRANSPOSED_CONFIG[n_out]
        stages -= x.element_size() > 2
    order = csc.row_order
    y_like = y if third is not None else x
    offsets_32 = offsets_fit_32(x, y_like)
    # Column groups are launched by decreasing entry count (longest first: hot neurons' groups hold 4-5x the mean
    # entries), and a group's feature blocks side by side, so that the rows they gather are read whole while
    # they are in L2: 1.43x on a 1.5B model layer's entries (H200), order-only, the sums unchanged.
    # The order costs one launch comparing every group with every other: past the knob transposed_scheduled_groups
    # (8192 groups: N > 131072) the grid is long enough for its tail not to matter, and the natural order is taken.
    n_groups = cdiv(N, block_n)
    scheduled = n_groups <= limits().transposed_scheduled_groups
    schedule = heavy_first_schedule(csc.offsets, group=block_n) if scheduled else None
    transposed_matmul_kernel[(n_groups * cdiv(D, block_d),)](
        csc.src,
        csc.offsets,
        order if order is not None else csc.offsets,
        csc.rows if csc.rows is not None else csc.offsets,
        schedule if schedule is not None else csc.offsets,
        values,
        second if second is not None else values,
        v3 if third is not None else values,
        v4 if third is not None and v4 is not None else values,
        x,
        y if third is not None else x,
        out[0],
        out[1] if n_x == 2 else out[0],
        out[-1],
        sums[0] if bias else out[0],
        sums[-1] if bias else out[0],
        N,
        D,
        csc.width,
        x.stride(0),
        y_like.stride(0),
        *out[0].stride(),
        *out[1 if n_x == 2 else 0].stride(),
        *out[-1].stride(),
        BLOCK_N=block_n,
        BLOCK_E=block_e,
        BLOCK_D=block_d,
        HAS_ROWS=csc.rows is not None,
        HAS_ORDER=order is not None,
        HAS_SCHEDULE=schedule is not None,
        EVEN_D=D % block_d == 0,
        OFFSETS_32=offsets_32,
        TWO=mode == "two",
        PRODUCT=mode == "product",
        THIRD=third is not None,
        THIRD_PRODUCT=third is not None and v4 is not None,
        BIAS=bias,
        IEEE_FP32=ieee_fp32(x.dtype),
        num_warps=warps,
        num_stages=stages,
        **({"maxnreg": max_registers} if max_registers else {}),
    )
    record_launch("transposed_matmul_kernel")
    return out, sums
