"""Sampled dense x dense: ``out[m, f] = A[m, :] . B[f, :]`` only where a sparsity pattern has an entry.

Used for gradients on a sparsity pattern (an SAE decode's gradient w.r.t. its feature activations:
``grad_acts[m, f] = grad_out[m] . W_dec[f]`` only where feature f fired for token m). The pattern is read in its
dense form (no format, no host sync); :func:`row_dots` is the shared inner step.

:func:`block_sddmm` is the tensor-core form for a :class:`~sparsefuse.sparse.RowBlockPattern` (the gated FFN's up
projection at large batches): ``out = scale * (A @ B^T + bias)`` on each row block's union of columns, written as
the compacted :class:`~sparsefuse.sparse.BlockELL` that :func:`~sparsefuse.sparse.block_sparse_matmul` consumes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import _backend
from .._backend import Backend, backend_for, cdiv, new_output, next_power_of_2, record_launch, threshold_in
from .._jit import kernel
from .._triton.dot import gathered_rows_dot, ieee_fp32
from .._triton.gates import fires, relu_keep_nan
from .._triton.gather import pick_nonzeros, rank_nonzeros
from .._triton.slots import block_slots, offsets_fit_32
from .._validation import unit_last_stride
from .formats import BlockELL, RowBlockPattern


@triton.jit
def row_dots(
    a_row_ptr, b_ptr, rows, row_mask, D, stride_b_row, stride_b_col, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
):
    """[BLOCK_R] fp32: ``a_row . b[rows[r], :]`` over D, BLOCK_D at a time; rows outside ``row_mask`` are not loaded
    (0). The inner step of every sampled product (and of the TwELL up projection)."""
    out = tl.zeros([BLOCK_R], dtype=tl.float32)
    base = rows.to(tl.int64) * stride_b_row  # [BLOCK_R]
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_mask = d < D
        av = tl.load(a_row_ptr + d, mask=d_mask, other=0.0).to(tl.float32)  # [BLOCK_D]
        bv = tl.load(
            b_ptr + base[:, None] + d[None, :].to(tl.int64) * stride_b_col,
            mask=row_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_R, BLOCK_D]
        out += tl.sum(bv.to(tl.float32) * av[None, :], axis=1)
    return out


@kernel
def sampled_dot_dense_pattern_kernel(
    pattern_ptr,
    a_ptr,
    b_ptr,
    out_ptr,
    N,
    D,
    stride_pattern,
    stride_a,
    stride_b,
    stride_out,
    BLOCK_F: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
):
    # pattern [M, N] (dense, its non-zeros are the pattern), a [M, D], b [N, D]; out [M, N]: a[m] . b[f] on the
    # pattern, 0 elsewhere. Grid (rows, column chunks); every element of the chunk is written.
    row = tl.program_id(0).to(tl.int64)
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)  # [BLOCK_F]
    f_mask = f < N
    p = tl.load(pattern_ptr + row * stride_pattern + f, mask=f_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + f, tl.zeros_like(p).to(out_ptr.dtype.element_ty), mask=f_mask & (p == 0))
    n, rank = rank_nonzeros(p)
    for g0 in range(0, n, GROUP):
        j = g0 + tl.arange(0, GROUP)  # [GROUP]
        j_mask = j < n
        col, _ = pick_nonzeros(p, f, rank, j)
        acc = row_dots(a_ptr + row * stride_a, b_ptr, col, j_mask, D, stride_b, 1, GROUP, BLOCK_D)
        tl.store(out_ptr + row * stride_out + col, acc.to(out_ptr.dtype.element_ty), mask=j_mask)


def sampled_dot_dense_pattern(
    pattern: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """[M, N]: ``a[m] . b[f]`` where ``pattern[m, f] != 0``, zero elsewhere (fp32 accumulation); pattern [M, N]
    dense, a [M, D], b [N, D]. No sparse format and no host sync: each chunk of a pattern row is scanned for its
    non-zeros, so the cost is one read of the pattern, one write of the output and nnz rows of b."""
    pattern = unit_last_stride(pattern)
    a = unit_last_stride(a)
    b = unit_last_stride(b)
    (M, N), D = pattern.shape, a.shape[1]
    out = new_output((M, N), out_dtype or pattern.dtype, pattern.device)
    if M == 0 or N == 0:
        return out
    if backend_for(pattern) is Backend.TORCH:
        _backend.warn_reference_once("sampled_dot_dense_pattern")
        return ((a.double() @ b.double().t()) * (pattern != 0)).to(out.dtype)
    block_f, block_d, group = (32, 32, 16) if _backend.INTERPRET else (1024, min(256, max(32, next_power_of_2(D))), 2)
    sampled_dot_dense_pattern_kernel[(M, cdiv(N, block_f))](
        pattern,
        a,
        b,
        out,
        N,
        D,
        pattern.stride(0),
        a.stride(0),
        b.stride(0),
        out.stride(0),
        BLOCK_F=block_f,
        BLOCK_D=block_d,
        GROUP=group,
    )
    record_launch("sampled_dot_dense_pattern_kernel")
    return out


@kernel
def sampled_dot_rows_kernel(
    indices_ptr,
    a_ptr,
    b_ptr,
    out_ptr,
    k,
    D,
    stride_idx,
    stride_a,
    stride_b,
    stride_out,
    BLOCK_J: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # indices [M, k] (rows of b), a [M, D], b [N, D]; out [M, k]: a[m] . b[indices[m, j]]. Grid (M, k blocks).
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    j_mask = j < k
    cols = tl.load(indices_ptr + row * stride_idx + j, mask=j_mask, other=0)
    acc = row_dots(a_ptr + row * stride_a, b_ptr, cols, j_mask, D, stride_b, 1, BLOCK_J, BLOCK_D)
    tl.store(out_ptr + row * stride_out + j, acc.to(out_ptr.dtype.element_ty), mask=j_mask)


def sampled_dot_rows(
    indices: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """[M, k]: ``a[m] . b[indices[m, j]]`` (fp32 accumulation) for indices [M, k] (int32/int64, in [0, N): not
    checked), a [M, D], b [N, D] -- the sampled product on a fixed-width pattern such as a TopK SAE's (its decode's
    gradient w.r.t. the activations). One read of a row of b per entry; no host sync."""
    a, b = unit_last_stride(a), unit_last_stride(b)
    indices = unit_last_stride(indices)
    (M, k), D = indices.shape, a.shape[1]
    out = new_output((M, k), out_dtype or a.dtype, a.device)
    if M == 0 or k == 0:
        return out
    if D == 0:
        return out.zero_()
    if backend_for(a) is Backend.TORCH:
        _backend.warn_reference_once("sampled_dot_rows")
        return (b.double()[indices.long()] @ a.double()[:, :, None]).squeeze(-1).to(out.dtype)
    block_j, block_d = (16, 32) if _backend.INTERPRET else (16, min(256, max(32, next_power_of_2(D))))
    sampled_dot_rows_kernel[(M, cdiv(k, block_j))](
        indices, a, b, out, k, D, indices.stride(0), a.stride(0), b.stride(0), out.stride(0),
        BLOCK_J=block_j, BLOCK_D=block_d,
    )  # fmt: skip
    record_launch("sampled_dot_rows_kernel")
    return out


@kernel
def block_sddmm_kernel(
    scale_ptr,
    indices_ptr,
    counts_ptr,
    order_ptr,
    a_ptr,
    b_ptr,
    bias_ptr,
    out_values_ptr,
    out_indices_ptr,
    out_counts_ptr,
    gate_out_ptr,
    up_out_ptr,
    pair_ptr,
    row_counts_ptr,
    neuron_counts_ptr,
    sum_part_ptr,
    chunk_nnz_ptr,
    block_nnz_ptr,
    M,
    N,
    D,
    n_tiles,
    stride_scale,
    stride_a,
    stride_b,
    sum_scale,
    TILE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_TILES: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RELU: tl.constexpr,
    FACTORS: tl.constexpr,
    PAIR_COUNTS: tl.constexpr,
    HAS_B: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    OFFSETS_32: tl.constexpr,
    threshold=0.0,
    UP_RELU: tl.constexpr = False,
):
    # Pattern (RowBlockPattern): indices [n_blocks, width], counts [n_blocks, n_tiles] (width = n_tiles * TILE),
    # order [M] int32 (block rows -> matrix rows). scale [M, N] dense (with RELU kept where > threshold or NaN, 0
    # elsewhere: ReLU at 0, FATReLU above); UP_RELU: the product (+ bias) relu'd, NaN kept. a [M, D], b [N, D] (unit
    # column strides), bias [N]. Out: BlockELL values [M, width] (slot rows), indices [n_blocks, width], counts
    # [n_blocks]. Grid (chunks, row blocks): program (c, blk) computes compacted union slots
    # [c * BLOCK_C, (c + 1) * BLOCK_C) of its block -- the tiles' unions laid end to end, so a chunk spans tiles and
    # every tensor-core tile is full but the block's last -- and stores them in that compacted order. With FACTORS
    # the two factors are stored as well, in the same slots: relu?(scale) to gate_out, the product (+ bias) to
    # up_out (what a backward through the product needs), with the statistics of the gate factor's non-zeros --
    # every one lies in its block's union, so they cost no extra pass: per (block, column) counts to pair[blk, col]
    # (PAIR_COUNTS),
    # per row and per column (neuron) counts added to row_counts[row] and neuron_counts[col], the factor's sum
    # times sum_scale to sum_part[blk, c] (partial sums, reduced by the host code in a fixed order: no float
    # atomics), and the non-zeros per (block, chunk) to chunk_nnz[blk, c] (every program writes its entry, 0 past
    # the union) and per block to block_nnz[blk] -- where each chunk's non-zeros go when the factors are packed
    # pair by pair. The counts' atomics are integer ones: the same totals in any order. OFFSETS_32: every element
    # offset of scale, a, b and the [M, width] outputs fits in int32 (the epilogue's [BLOCK_ROWS, BLOCK_C] offsets
    # and the gathered rows' starts are then 32-bit).
    chunk = tl.program_id(0)
    block = tl.program_id(1)
    width = n_tiles * TILE
    tiles = tl.arange(0, BLOCK_TILES)
    counts = tl.load(counts_ptr + block * n_tiles + tiles, mask=tiles < n_tiles, other=0)  # [BLOCK_TILES]
    ends = tl.cumsum(counts, axis=0)
    total = tl.sum(counts, axis=0)
    if chunk == 0:
        tl.store(out_counts_ptr + block, total)
    if chunk * BLOCK_C < total:
        # p: [BLOCK_C] compacted slots; their columns are looked up through the per-tile layout below
        p, p_mask, _, _, rows, row_mask, mask, out_offsets = block_slots(
            indices_ptr, order_ptr, block, chunk, total, M, width, BLOCK_ROWS, BLOCK_C, False, HAS_ORDER, OFFSETS_32
        )
        # each slot's tile (how many tiles end at or before it) and its place in that tile's union
        tile_of_p = tl.sum((ends[None, :] <= p[:, None]).to(tl.int32), axis=1)  # [BLOCK_C]
        first_of_tile = tl.sum(tl.where(tiles[None, :] == tile_of_p[:, None], (ends - counts)[None, :], 0), axis=1)
        src = tile_of_p * TILE + p - first_of_tile  # [BLOCK_C] slot in the per-tile layout
        cols = tl.load(indices_ptr + block.to(tl.int64) * width + src, mask=p_mask, other=0)
        # the offsets' copies of rows and cols (int64 past OFFSETS_32): the int32 ones are stored and counted below
        if OFFSETS_32:
            row_at, col_at = rows, cols
        else:
            row_at, col_at = rows.to(tl.int64), cols.to(tl.int64)
        if HAS_B:
            a_rows_ptr = a_ptr + row_at[:, None] * stride_a  # [BLOCK_ROWS, 1]
            b_cols_ptr = b_ptr + col_at[None, :] * stride_b  # [1, BLOCK_C]
            acc = tl.zeros([BLOCK_ROWS, BLOCK_C], dtype=tl.float32)
            acc = gathered_rows_dot(acc, a_rows_ptr, row_mask, b_cols_ptr, p_mask, D, BLOCK_D, IEEE_FP32)
        else:  # no product: the scale alone, compacted (a non-gated layer's relu(pre))
            acc = tl.full([BLOCK_ROWS, BLOCK_C], 1.0, dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=p_mask, other=0.0).to(tl.float32)[None, :]
        if UP_RELU:
            acc = relu_keep_nan(acc)
        scale = tl.load(scale_ptr + row_at[:, None] * stride_scale + col_at[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
        if RELU:
            scale = tl.where(fires(scale, threshold), scale, 0.0)
        tl.store(out_values_ptr + out_offsets, (scale * acc).to(out_values_ptr.dtype.element_ty), mask=mask)
        if FACTORS:
            if HAS_B:  # without a product the values already are the gate factor
                tl.store(gate_out_ptr + out_offsets, scale.to(gate_out_ptr.dtype.element_ty), mask=mask)
                tl.store(up_out_ptr + out_offsets, acc.to(up_out_ptr.dtype.element_ty), mask=mask)
            # counted on the gate as stored (an out_dtype narrower than the scale's can round a tiny one to 0), so
            # that the counts agree with the values the pack keeps and the backward masks by
            fired = ((scale.to(gate_out_ptr.dtype.element_ty) != 0) & mask).to(tl.int32)
            if PAIR_COUNTS:
                tl.store(pair_ptr + block.to(tl.int64) * N + cols, tl.sum(fired, axis=0), mask=p_mask)
            tl.atomic_add(row_counts_ptr + rows, tl.sum(fired, axis=1), mask=row_mask, sem="relaxed")
            tl.atomic_add(neuron_counts_ptr + cols, tl.sum(fired, axis=0), mask=p_mask, sem="relaxed")
            part = tl.sum(tl.sum(scale, axis=1), axis=0) * sum_scale
            tl.store(sum_part_ptr + block * tl.num_programs(0) + chunk, part)
            n_fired = tl.sum(tl.sum(fired, axis=1), axis=0)
            tl.store(chunk_nnz_ptr + block * tl.num_programs(0) + chunk, n_fired)
            tl.atomic_add(block_nnz_ptr + block, n_fired, sem="relaxed")
        tl.store(out_indices_ptr + block.to(tl.int64) * width + p, cols, mask=p_mask)
    elif FACTORS:
        tl.store(chunk_nnz_ptr + block * tl.num_programs(0) + chunk, 0)


def torch_block_sddmm(
    pattern: RowBlockPattern,
    scale: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    relu: bool = False,
    threshold: float = 0.0,
    up_relu: bool = False,
) -> torch.Tensor:
    """Reference: the dense [M, N] ``pattern * gate(scale) * up(a @ b^T + bias)`` in float64 (no product when b is
    None), gate(s) = s where s > threshold (or NaN) with ``relu``, else s; up(u) = relu(u) (NaN kept) with
    ``up_relu``, else u."""
    prod = a.double() @ b.double().t() if b is not None else torch.ones((), dtype=torch.float64, device=scale.device)
    if bias is not None:
        prod = prod + bias.double()
    if up_relu:
        prod = torch.where((prod > 0) | prod.isnan(), prod, 0.0)
    s = scale.double()
    if relu:
        s = torch.where((s > threshold) | s.isnan(), s, 0.0)
    return pattern.to_mask() * s * prod


def factor_chunk(D: int, block_rows: int) -> int:
    """Union slots per program of :func:`block_sddmm` with ``factors`` at reduction length D and ``block_rows``-row
    blocks: its ``chunk_nnz`` count non-zeros per chunk of this many slots, and the packing of the factors walks the
    same chunks."""
    return _block_sddmm_blocks(D, block_rows, factors=True)[0]


def _block_sddmm_blocks(D: int, block_rows: int, factors: bool = False) -> tuple[int, int, int, int, int | None]:
    """(BLOCK_C, BLOCK_D, num_warps, num_stages, maxnreg): measured on an H200, one recorded training step's call
    (``factors``: three outputs and the statistics) replayed from a CUDA graph. With 32-bit offsets it runs 4 warps
    at every D, with the compiler's registers: 348 us at the 8B layer shape against 357 with 8 warps capped at
    128 registers (two programs an SM; 8 warps uncapped take 255 and spill: 435 us), 178 against 187 us at 1.5B.
    256 slots a program (half the re-reads of a's rows) spill at 8 warps: 402 us at 8B. The inference call (no
    factors) keeps 8 warps: the 4-warp tile was measured on the training call only."""
    if _backend.INTERPRET:
        return 16, 32, 4, 1, None
    if factors:
        return 128, 64, 4, 4, None
    return 128, 64, 8, 4, None


class BlockFactors(NamedTuple):
    """What :func:`block_sddmm` returns with ``factors``: three BlockELLs on the same slots (one indices/counts)
    and the statistics of the gate factor's non-zeros: ``column_counts`` [n_blocks, N] int32 (per row block and
    column; None unless asked for), ``row_counts`` [M] int32 (per matrix row) and ``neuron_counts`` [N] int32 (per
    column), the two views of ``counts`` [M + N] (one tensor for a caller to return whole), ``gate_sum`` 0-dim fp32
    (its sum, times :func:`block_sddmm`'s ``sum_scale``); ``chunk_nnz`` [n_blocks, n_chunks] int32 (per row block
    and chunk of ``chunk`` union slots) and ``block_nnz`` [n_blocks] int32 (per row block): what
    :func:`~sparsefuse.sparse.block_pack.pack_block_factors` places pairs by."""

    product: BlockELL
    gate: BlockELL
    up: BlockELL | None
    column_counts: torch.Tensor | None
    row_counts: torch.Tensor
    neuron_counts: torch.Tensor
    counts: torch.Tensor
    gate_sum: torch.Tensor
    chunk_nnz: torch.Tensor
    block_nnz: torch.Tensor
    chunk: int


def block_sddmm(
    pattern: RowBlockPattern,
    scale: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    *,
    relu: bool = False,
    threshold: float = 0.0,
    up_relu: bool = False,
    out_dtype: torch.dtype | None = None,
    factors: bool = False,
    sum_scale: float = 1.0,
    column_counts: bool = True,
) -> BlockELL | BlockFactors:
    """``relu?(scale) * (a @ b^T + bias)`` on the pattern's row-block unions, compacted: pattern [M, N]
    (:class:`RowBlockPattern`), scale [M, N] dense (e.g. gate pre-activations, relu'd when ``relu``), a [M, D],
    b [N, D], bias [N] -> :class:`BlockELL` [M, N] (same block rows and row order, width n_tiles * tile) in
    ``out_dtype`` (default: scale's). fp32 accumulation on tensor cores, no host sync; the work is
    ``2 * block_rows * D * sum(union sizes)`` flops.

    With ``factors`` it returns :class:`BlockFactors`: ``gate = relu?(scale)`` and ``up = a @ b^T + bias`` as well
    as their product, and the gate's non-zero statistics -- what the training step keeps for its backward and
    reports. Its ``gate_sum`` is the gate's sum times ``sum_scale`` (the training step's 1 / (M N): the L1 term as a
    mean, with no launch of its own), each program's partial sum scaled before the fixed-order reduction.
    ``column_counts=False`` leaves out the [n_blocks, N] per (block, column) counts (``None`` in the result): a
    caller that needs only the token and neuron counts saves their fill.

    ``b=None`` (and no bias): no product, just ``relu?(scale)`` on the unions -- a non-gated layer's activation;
    with ``factors`` the gate is then the product itself and ``up`` is None.

    The other gates, in the same pass: ``threshold`` (with ``relu``) keeps the scale where it exceeds it (FATReLU's
    values, unshifted, compared exactly in the scale's dtype), ``up_relu`` relus the product (+ bias)
    before it multiplies the gate and is stored as ``up`` (dReLU); NaN is kept by both."""
    if up_relu and b is None:
        raise ValueError("block_sddmm: up_relu needs the product's b")
    a = unit_last_stride(a)
    b = unit_last_stride(b) if b is not None else None
    bias = unit_last_stride(bias) if bias is not None else None  # read at unit stride
    if b is None and bias is not None:
        raise ValueError("block_sddmm: a bias needs the product's b")
    scale = unit_last_stride(scale)
    threshold = threshold_in(scale.dtype, threshold)  # one firing point on both backends (torch's compare rounds)
    M, N = pattern.shape
    n_blocks, n_tiles = pattern.counts.shape
    width, D = n_tiles * pattern.tile, a.shape[1]
    out_dtype = out_dtype or scale.dtype
    values = new_output((M, width), out_dtype, a.device)  # slots past a block's count are never read
    indices = torch.empty(n_blocks, width, dtype=torch.int32, device=a.device)
    counts = torch.empty(n_blocks, dtype=torch.int32, device=a.device)

    def on_slots(v: torch.Tensor) -> BlockELL:
        return BlockELL(v, indices, counts, N, pattern.block_rows, pattern.row_order)

    block_c, block_d, warps, stages, max_registers = _block_sddmm_blocks(D, pattern.block_rows, factors)
    n_chunks = cdiv(width, block_c)
    if n_chunks == 0:  # no column (N = 0): no program writes the unions' sizes, which are all 0
        counts.zero_()
    out = on_slots(values)
    separate = factors and b is not None  # without a product the values are the gate factor
    gate = on_slots(new_output((M, width), out_dtype, a.device)) if separate else out
    up = on_slots(new_output((M, width), out_dtype, a.device)) if separate else (out if b is not None else None)
    if factors:
        # the statistics every program adds to start at zero: one fill for all of them (the float partial sums as
        # int32 zeros, the same bits). The token and neuron counts come first, so that a caller keeping them (the
        # counts outlive the step) holds no more of the buffer than they and the small partials.
        pair = n_blocks * N if column_counts else 0
        sizes = (M + N, n_blocks * n_chunks, n_blocks, pair)
        zeros = torch.zeros(sum(sizes), dtype=torch.int32, device=a.device).split(sizes)
        row_neuron, block_nnz = zeros[0], zeros[2]
        row_counts, neuron_counts = row_neuron[:M], row_neuron[M:]
        sum_part = zeros[1].view(torch.float32).view(n_blocks, n_chunks)
        pair_counts = zeros[3].view(n_blocks, N) if column_counts else None
        chunk_nnz = torch.empty(n_blocks, n_chunks, dtype=torch.int32, device=a.device)  # every entry written
        stats = (pair_counts if column_counts else block_nnz, row_counts, neuron_counts, sum_part, chunk_nnz, block_nnz)

        def result():
            gate_sum = sum_part.sum()
            return BlockFactors(
                out, gate, up, pair_counts, row_counts, neuron_counts, row_neuron, gate_sum, chunk_nnz, block_nnz,
                block_c,
            )  # fmt: skip

    else:
        stats = (counts,) * 6  # not read

        def result():
            return out

    if M == 0:
        return result()
    if backend_for(a) is Backend.TORCH:
        if factors:
            raise NotImplementedError("block_sddmm(factors=True) runs on the GPU or the Triton interpreter")
        _backend.warn_reference_once("block_sddmm")
        dense = torch_block_sddmm(pattern, scale, a, b, bias, relu, threshold, up_relu).to(out_dtype)
        for blk in range(n_blocks):
            cols = pattern.block_columns(blk)
            slots = slice(blk * pattern.block_rows, min(M, (blk + 1) * pattern.block_rows))
            rows = torch.arange(M)[slots].to(a.device)
            rows = pattern.row_order[rows].long() if pattern.row_order is not None else rows
            indices[blk, : cols.numel()] = cols.to(torch.int32)
            values[slots, : cols.numel()] = dense[rows[:, None], cols[None, :]]
        counts.copy_(pattern.union_sizes())
        return result()
    order = pattern.row_order
    block_sddmm_kernel[(n_chunks, n_blocks)](
        scale,
        pattern.indices,
        pattern.counts,
        order if order is not None else pattern.counts,
        a,
        b if b is not None else a,
        bias if bias is not None else a,
        values,
        indices,
        counts,
        gate.values,
        up.values if up is not None else values,
        *stats,
        M,
        N,
        D,
        n_tiles,
        scale.stride(0),
        a.stride(0),
        b.stride(0) if b is not None else 0,
        float(sum_scale),
        TILE=pattern.tile,
        BLOCK_ROWS=pattern.block_rows,
        BLOCK_C=block_c,
        BLOCK_D=block_d,
        BLOCK_TILES=next_power_of_2(n_tiles),
        HAS_ORDER=order is not None,
        HAS_BIAS=bias is not None,
        RELU=relu,
        FACTORS=factors,
        PAIR_COUNTS=factors and column_counts,
        HAS_B=b is not None,
        IEEE_FP32=ieee_fp32(a.dtype),
        OFFSETS_32=offsets_fit_32(scale, a, values, *((b,) if b is not None else ())),
        threshold=float(threshold),
        UP_RELU=up_relu,
        num_warps=warps,
        num_stages=stages,
        **({"maxnreg": max_registers} if max_registers else {}),
    )
    record_launch("block_sddmm_kernel")
    return result()
