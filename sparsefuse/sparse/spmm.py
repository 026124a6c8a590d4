"""Gather-accumulate: sparse rows times a dense weight, ``y[m] = sum_j val[m, j] * W[idx[m, j], :]``.

The one kernel every sparse x dense product in sparsefuse uses (SAE decode, FFN down projection, ...). A program
owns one row and a BLOCK_D slice of the output; it walks the row's entries BLOCK_K at a time, gathering BLOCK_K rows
of W as one [BLOCK_K, BLOCK_D] tile, and accumulates in fp32.

Cost: per row, nnz * D weight elements gathered plus the row's values and indices; the output is written once.

Rows far longer than the others -- a token that fires every feature -- would each be one program's serial walk:
the main launch lists them on the device instead and a second launch of the same kernel spreads each over many
programs (:mod:`.long_rows`; no host sync). That is how ELL rows that overflowed are completed when the dense
activations are passed in. Or, given the :class:`ThresholdedLinear` layer whose activations the rows are, an
overflowed row's activations are recomputed from that layer's inputs. Without either an overflowed row is written as
NaN -- visibly wrong, never silently truncated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from .. import _backend
from .._backend import Backend, backend_for, cdiv, new_output, next_power_of_2, record_launch, sm_count
from .._jit import kernel
from .._triton.gather import accumulate_nonzeros, accumulate_rows, sum_split_partials
from .._validation import check_overflow_completion, check_sparse_weight
from .dense_units import (
    DENSE_UNIT_MIN_COLS,
    DENSE_UNIT_ROWS,
    at_least_half_nonzero,
    list_dense_unit,
    sum_dense_units,
)
from .formats import CSR, ELL
from .layout import unit_rows
from .long_rows import (
    DELIVER_STORE,
    FORMAT_CSR,
    FORMAT_DENSE,
    FORMAT_ELL,
    NEVER_LONG,
    LongRows,
    list_long_unit,
    spread_long_units,
    stored_row_threshold,
)
from .thresholded import ThresholdedLinear, thresholded_linear_chunk


@kernel
def gather_accumulate_kernel(
    values_ptr,
    indices_ptr,
    counts_ptr,
    row_offsets_ptr,
    dense_ptr,
    w_ptr,
    out_ptr,
    partial_ptr,
    split_nnz_ptr,
    arrivals_ptr,
    enc_x_ptr,
    enc_w_ptr,
    enc_bias_ptr,
    enc_threshold_ptr,
    enc_shift_ptr,
    long_units_ptr,
    long_count_ptr,
    long_arrivals_ptr,
    long_partial_ptr,
    long_used_ptr,
    dense_rows_ptr,
    dense_counts_ptr,
    dense_splits_ptr,
    dense_used_ptr,
    n_out,
    n_in,
    stride_w,
    stride_out,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_F: tl.constexpr,
    GROUP: tl.constexpr,
    FORMAT: tl.constexpr,
    width=0,
    stride_dense=0,
    stride_dense_col=1,
    chunks_per_split=0,
    n_splits=1,
    d_enc=0,
    stride_enc_x=0,
    stride_enc_w=0,
    long_nnz=NEVER_LONG,
    long_unit_cols=0,
    long_partial_rows=0,
    long_max_subsplits=1,
    long_target_items=0,
    long_entries_per_sub=1,
    long_arrival_rows=0,
    REDUCE_SPLITS: tl.constexpr = 1,
    FALLBACK: tl.constexpr = 0,
    HAS_SHIFT: tl.constexpr = False,
    ATOMIC_SPLITS: tl.constexpr = False,
    LIST_LONG: tl.constexpr = False,
    SPREAD_PASS: tl.constexpr = False,
    DELIVER: tl.constexpr = 0,  # DELIVER_STORE
    ARRIVALS: tl.constexpr = 0,
    REDUCE_SUBSPLITS: tl.constexpr = 1,
    LIST_DENSE: tl.constexpr = False,
    DOT_D: tl.constexpr = 16,
    DOT_F: tl.constexpr = 16,
):
    # Grid (rows * D blocks, splits): the D blocks of one row are neighbours, so a row's activations are read from
    # DRAM once and from L2 by the other blocks (rows live on axis 0: the other axes are capped at 65535).
    # ELL: values/indices [M, width], counts [M]; CSR: values/indices [nnz], row_offsets [M + 1];
    # DENSE: dense [M, n_in] (strides stride_dense, stride_dense_col) scanned for non-zeros, its columns split over
    #   n_splits programs of chunks_per_split chunks of BLOCK_F; with n_splits > 1 each program writes an fp32
    #   partial [M, n_splits, n_out] (if its chunks had any non-zero: split_nnz [M, n_splits]) and the last to
    #   arrive (arrivals [M, D blocks] int32, zeroed) sums them in split order: deterministic, no float atomics;
    #   with ATOMIC_SPLITS each program instead adds its fp32 sum into partial [M, n_out] (zeroed) by atomics.
    # w [n_in, n_out] (unit column stride); out [M, n_out].
    # LIST_LONG: long units (long_rows.py) -- rows with more than long_nnz stored entries, overflowed ELL rows
    #   (FALLBACK 1), dense ranges whose count passes long_nnz while scanned -- are appended to the device list
    #   long_units / long_count (their arrival counters long_arrivals [capacity, ARRIVALS] zeroed) and left to
    #   the SPREAD_PASS launch, a 1-D grid over that list (long_rows.spread_long_units).
    # LIST_DENSE (DENSE with ATOMIC_SPLITS): a long range at least half non-zero goes to its split's table of dense
    #   rows instead (dense_rows [n_splits, 16], dense_counts [n_splits], dense_splits / dense_used: the splits
    #   listed), summed on tensor cores by the SPREAD_PASS launch before its long units (dense_units.py).
    # Other overflowed ELL rows (count > width): FALLBACK 2 recomputes the activations of a ThresholdedLinear from
    # enc_x [M, d_enc], enc_w [d_enc, n_in], enc_bias/enc_threshold [n_in], enc_shift [d_enc]; 0 writes NaN.
    if SPREAD_PASS:
        if LIST_DENSE:
            sum_dense_units(
                dense_rows_ptr,
                dense_counts_ptr,
                dense_splits_ptr,
                dense_used_ptr,
                dense_ptr,
                stride_dense,
                stride_dense_col,
                w_ptr,
                stride_w,
                partial_ptr,
                n_in,
                n_out,
                long_unit_cols,
                DENSE_UNIT_ROWS,
                DOT_D,
                DOT_F,
                DENSE_UNIT_MIN_COLS,
            )
        spread_long_units(
            long_units_ptr,
            long_count_ptr,
            long_arrivals_ptr,
            long_partial_ptr,
            long_used_ptr,
            values_ptr,
            indices_ptr,
            counts_ptr,
            row_offsets_ptr,
            dense_ptr,
            w_ptr,
            out_ptr,
            partial_ptr,
            split_nnz_ptr,
            arrivals_ptr,
            n_out,
            n_in,
            width,
            stride_w,
            stride_out,
            stride_dense,
            stride_dense_col,
            n_splits,
            long_unit_cols,
            long_partial_rows,
            long_max_subsplits,
            long_target_items,
            long_entries_per_sub,
            FORMAT,
            DELIVER,
            BLOCK_D,
            BLOCK_F,
            BLOCK_K,
            GROUP,
            ARRIVALS,
            REDUCE_SUBSPLITS,
            REDUCE_SPLITS,
        )
        return
    n_d_blocks = tl.cdiv(n_out, BLOCK_D)
    d_block = tl.program_id(0) % n_d_blocks
    row = (tl.program_id(0) // n_d_blocks).to(tl.int64)
    split = tl.program_id(1)
    d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_mask = d < n_out
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if FORMAT == FORMAT_DENSE:
        split_nnz = tl.zeros([], dtype=tl.int32)
        deferred = tl.zeros([], dtype=tl.int32)  # the range turned out long: left to the spread pass
        c_begin = split * chunks_per_split
        c_end = tl.minimum(c_begin + chunks_per_split, tl.cdiv(n_in, BLOCK_F))
        row_ptr = dense_ptr + row * stride_dense
        f_end = tl.minimum(n_in, c_end * BLOCK_F)  # this split's columns end here
        f_next = c_begin * BLOCK_F + tl.arange(0, BLOCK_F)  # [BLOCK_F]
        a_next = tl.load(row_ptr + f_next.to(tl.int64) * stride_dense_col, mask=f_next < f_end, other=0.0)
        for _ in range(c_begin, c_end):
            # The next chunk's load is issued before this chunk's W gathers, so scanning is not one DRAM latency
            # per chunk.
            f, a = f_next, a_next.to(tl.float32)
            f_next = f + BLOCK_F
            f_stop = tl.where(deferred == 0, f_end, 0)  # a deferred range loads nothing more
            a_next = tl.load(row_ptr + f_next.to(tl.int64) * stride_dense_col, mask=f_next < f_stop, other=0.0)
            chunk_nnz = tl.sum((a != 0).to(tl.int32), axis=0)
            if LIST_LONG:  # counted before it is gathered: a long range wastes at most long_nnz gathers
                deferred = deferred | (split_nnz + chunk_nnz > long_nnz).to(tl.int32)
            if deferred == 0:
                split_nnz += chunk_nnz
                acc = accumulate_nonzeros(acc, a, f, w_ptr, stride_w, d, d_mask, GROUP)
        if LIST_LONG:
            if deferred != 0:  # every D block of the range decides alike; the first lists it
                if d_block == 0:
                    dense = tl.zeros([], dtype=tl.int32)
                    if LIST_DENSE:
                        # counted whole by this one program, in a function of its own: inlined, its loop changed
                        # the register allocation of the scan's own loop (125 -> 105 a thread, fewer loads in
                        # flight) and the main launch took 25% longer (H200, bf16 B=256)
                        if at_least_half_nonzero(row_ptr, stride_dense_col, c_begin * BLOCK_F, f_end, BLOCK_F):
                            dense = list_dense_unit(
                                dense_rows_ptr,
                                dense_counts_ptr,
                                dense_splits_ptr,
                                dense_used_ptr,
                                row,
                                split,
                                DENSE_UNIT_ROWS,
                            ).to(tl.int32)
                    if dense == 0:
                        list_long_unit(
                            long_units_ptr,
                            long_count_ptr,
                            long_arrivals_ptr,
                            row * n_splits + split,
                            long_arrival_rows,
                            ARRIVALS,
                        )
                return
        if ATOMIC_SPLITS:
            # fp32 atomics into partial [M, n_out] (zeroed; out itself when out is fp32): no per-split buffer to
            # write and re-read, no arrival counter, but the summation order varies from run to run.
            if split_nnz > 0:
                tl.atomic_add(partial_ptr + row * n_out + d, acc, mask=d_mask, sem="relaxed")
            return
        if n_splits > 1:
            last, acc = sum_split_partials(
                acc,
                split_nnz > 0,
                partial_ptr,
                split_nnz_ptr,
                arrivals_ptr,
                row,
                split,
                n_splits,
                d_block,
                n_d_blocks,
                n_out,
                d,
                d_mask,
                REDUCE_SPLITS,
            )
            if last:
                tl.store(out_ptr + row * stride_out + d, acc.to(out_ptr.dtype.element_ty), mask=d_mask)
            return
    else:
        if FORMAT == FORMAT_ELL:
            start = row * width
            count = tl.load(counts_ptr + row)
            n = tl.minimum(count, width)
            overflowed = count > width
        else:
            start = tl.load(row_offsets_ptr + row)
            n = (tl.load(row_offsets_ptr + row + 1) - start).to(tl.int32)
            overflowed = n < 0  # never
        if LIST_LONG:
            if FALLBACK == 1:  # an overflowed row is completed from its dense row by the spread pass
                long = overflowed | (n > long_nnz)
            else:  # ... or here, by the other fallbacks
                long = tl.where(overflowed, 0, n) > long_nnz
            if long:
                if d_block == 0:
                    list_long_unit(long_units_ptr, long_count_ptr, long_arrivals_ptr, row, long_arrival_rows, ARRIVALS)
                return
        if overflowed:
            n = 0  # the stored entries are incomplete: recomputed below
        for k0 in range(0, n, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            k_mask = k < n
            idx = tl.load(indices_ptr + start + k, mask=k_mask, other=0)
            val = tl.load(values_ptr + start + k, mask=k_mask, other=0.0).to(tl.float32)
            acc = accumulate_rows(acc, val, idx, k_mask, w_ptr, stride_w, d, d_mask)  # [BLOCK_D]
        if overflowed:
            if FALLBACK == 0:
                acc += float("nan")
            else:
                for f0 in range(0, n_in, BLOCK_F):
                    f = f0 + tl.arange(0, BLOCK_F)
                    a = thresholded_linear_chunk(
                        row,
                        f,
                        f < n_in,
                        enc_x_ptr,
                        stride_enc_x,
                        enc_w_ptr,
                        stride_enc_w,
                        enc_bias_ptr,
                        enc_threshold_ptr,
                        enc_shift_ptr,
                        d_enc,
                        HAS_SHIFT,
                        BLOCK_K,
                    )
                    acc = accumulate_nonzeros(acc, a, f, w_ptr, stride_w, d, d_mask, GROUP)
    tl.store(out_ptr + row * stride_out + d, acc.to(out_ptr.dtype.element_ty), mask=d_mask)


_POINTER_ARGS = (
    "values_ptr indices_ptr counts_ptr row_offsets_ptr dense_ptr partial_ptr split_nnz_ptr arrivals_ptr enc_x_ptr "
    "enc_w_ptr enc_bias_ptr enc_threshold_ptr enc_shift_ptr long_units_ptr long_count_ptr long_arrivals_ptr "
    "long_partial_ptr long_used_ptr dense_rows_ptr dense_counts_ptr dense_splits_ptr dense_used_ptr"
).split()


def launch_gather(grid: tuple[int, int], weight: torch.Tensor, out: torch.Tensor, num_warps: int, **args) -> None:
    """One gather_accumulate_kernel launch; pointers not given are ``out`` (never read), other arguments not given
    take the kernel's defaults (unused)."""
    shapes = dict(n_out=weight.shape[1], stride_w=weight.stride(0), stride_out=out.stride(0))
    args = dict.fromkeys(_POINTER_ARGS, out) | shapes | args | dict(w_ptr=weight, out_ptr=out)
    gather_accumulate_kernel[grid](**args, num_warps=num_warps)
    record_launch("gather_accumulate_kernel")


def launch_spread(long_rows: LongRows, weight: torch.Tensor, out: torch.Tensor, **args) -> None:
    """The spread launch over ``long_rows``' list (``args``: the main launch's operands, FORMAT, ...)."""
    cfg = long_rows.config
    launch_gather((cfg.programs, 1), weight, out, cfg.num_warps, **args | long_rows.spread_args())


def torch_sparse_matmul(sparse: ELL | CSR, weight: torch.Tensor) -> torch.Tensor:
    """Reference: ``sparse.to_dense() @ weight`` in float64 (ELL must not have overflowed)."""
    return sparse.to_dense().double() @ weight.double()


@dataclass(frozen=True)
class _LaunchConfig:
    block_d: int
    block_f: int  # activations scanned per step (dense rows, overflow fallback)
    block_k: int  # stored entries gathered per step (ELL/CSR)
    group: int  # non-zeros picked per step from a scanned chunk
    num_warps: int


_INTERPRETER_CONFIG = _LaunchConfig(block_d=32, block_f=64, block_k=16, group=16, num_warps=4)  # few steps


SCAN_BLOCK_F = 1024  # dense columns a scan program reads per step on a GPU


def scan_config(n_out: int) -> _LaunchConfig:
    """Blocks of the dense-row scan, measured on an H200: one program covers all of D (each D block re-scans and
    re-ranks the row). The gather of stored entries: :func:`_gather_config`."""
    if _backend.INTERPRET:
        return _INTERPRETER_CONFIG
    return _LaunchConfig(block_d=scan_block_d(n_out), block_f=SCAN_BLOCK_F, block_k=32, group=2, num_warps=4)


def scan_block_d(n_out: int) -> int:
    """Output columns of a scan program on a GPU (see :func:`scan_config`; also for cost models)."""
    return min(4096, max(32, next_power_of_2(n_out)))


def _gather_config(M: int, n_out: int, weight: torch.Tensor) -> _LaunchConfig:
    """Blocks of the gather of stored entries (ELL/CSR), measured on an H200: one warp, 16 entries per step, 512
    fp32 or 256 16-bit columns of W per program -- 1.2-1.7x faster than 4 warps on 1 KiB, whose sum over the entries
    crossed warps through shared memory at every step; 16-bit rows of 512 columns were 5-65% slower than of 256 (SAE
    decode, constant L0 72, B=256-4096, D=2304 and 4096: 37.9 against 22.9 us at B=256, D=2304) -- narrowed to 128
    columns while rows x D blocks would leave fewer than 8 programs per SM (B=256, D=768 fp32: 10.8 us at 128
    against 18.6 at 512)."""
    if _backend.INTERPRET:
        return _INTERPRETER_CONFIG
    block_d = gather_block_d(M, n_out, sm_count(weight.device), weight.element_size())
    return _LaunchConfig(block_d=block_d, block_f=1024, block_k=16, group=2, num_warps=1)


def gather_block_d(M: int, n_out: int, sms: int, itemsize: int) -> int:
    """Output columns per program of the gather of stored entries, ``itemsize``-byte weights, on a GPU of ``sms``
    SMs (see :func:`_gather_config`; also for cost models, which count its programs)."""
    block_d = min(512 if itemsize >= 4 else 256, max(32, next_power_of_2(n_out)))
    while block_d > 128 and M * cdiv(n_out, block_d) < 8 * sms:
        block_d //= 2
    return block_d


def _weight_for_gather(weight: torch.Tensor) -> torch.Tensor:
    return unit_rows(weight)  # (a transposed one, e.g. a row-major W_down's W_down^T, by the tiled copy)


def product_operands(
    a_dtype: torch.dtype, M: int, weight: torch.Tensor, out_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight with unit column stride, the [M, n_out] output in ``out_dtype`` or the promoted dtype of the sparse
    values and weight) for every sparse x dense product launcher."""
    weight = _weight_for_gather(weight)
    out_dtype = out_dtype or torch.promote_types(a_dtype, weight.dtype)
    return weight, new_output((M, weight.shape[1]), out_dtype, weight.device)


def sparse_matmul(
    sparse: ELL | CSR,
    weight: torch.Tensor,
    *,
    dense: torch.Tensor | None = None,
    encoder: ThresholdedLinear | None = None,
    out_dtype: torch.dtype | None = None,
    spread_long_rows: bool = False,
) -> torch.Tensor:
    """``sparse @ weight`` -> [M, n_out] with fp32 accumulation.

    Args:
        sparse: ELL or CSR, [M, n_in].
        weight: [n_in, n_out], float32/float16/bfloat16 (any row stride; columns contiguous or copied once).
        dense: for ELL, the dense [M, n_in] rows the format came from: overflowed rows are recomputed from them on
            the device, each spread over many programs by a second launch (:mod:`.long_rows`).
        encoder: for ELL holding the activations of a :class:`ThresholdedLinear` (e.g. written by a fused encode),
            that layer: overflowed rows' activations are recomputed on the device (a GEMV per overflowed row and
            output tile: meant for rare rows). Without ``dense`` or ``encoder`` an overflowed row comes out as NaN.
        out_dtype: defaults to the promoted dtype of values and weight.
        spread_long_rows: rows with more stored entries than ``long_row_threshold(n_in)`` (1 in 64 columns, at
            least 32; at most 128 where the launch's programs fit one wave) are also listed on the device and spread
            over many programs by that second launch, instead of each walked by one program. Off by default: one
            launch where rows are bounded by construction.
    """
    op = "sparse_matmul"
    check_sparse_weight(op, sparse, weight)
    is_ell = isinstance(sparse, ELL)
    check_overflow_completion(op, sparse, is_ell, dense, encoder)
    weight, out = product_operands(sparse.values.dtype, sparse.shape[0], weight, out_dtype)
    (M, n_out), out_dtype = out.shape, out.dtype
    if M == 0 or n_out == 0:
        return out
    if backend_for(weight) is Backend.TORCH:
        _backend.warn_reference_once(op)
        if is_ell and dense is not None:
            return (dense.double() @ weight.double()).to(out_dtype)
        if is_ell and encoder is not None:
            return (encoder.reference_activations() @ weight.double()).to(out_dtype)
        return torch_sparse_matmul(sparse, weight).to(out_dtype)
    cfg = _gather_config(M, n_out, weight)
    n_in, width = sparse.n_cols, sparse.width if is_ell else 0
    programs = cdiv(n_out, cfg.block_d) * M
    threshold = stored_row_threshold(n_in, programs, weight.device) if spread_long_rows else NEVER_LONG
    can_overflow = is_ell and dense is not None and width < n_in  # completed by the spread pass
    long_rows = None
    if can_overflow or threshold < (width if is_ell else n_in):
        unit_cols, unit_entries = n_in if can_overflow else 0, width if is_ell else n_in
        long_rows = LongRows.allocate(M, n_out, weight, threshold, DELIVER_STORE.value, unit_cols, unit_entries)
    enc = encoder.prepared() if encoder is not None else None
    operands = dict(
        values_ptr=sparse.values,
        indices_ptr=sparse.indices,
        counts_ptr=sparse.counts if is_ell else sparse.values,
        row_offsets_ptr=sparse.values if is_ell else sparse.row_offsets,
        dense_ptr=dense if dense is not None else sparse.values,
        n_in=n_in,
        width=width,
        stride_dense=dense.stride(0) if dense is not None else 0,
        stride_dense_col=dense.stride(1) if dense is not None else 1,
        FORMAT=FORMAT_ELL.value if is_ell else FORMAT_CSR.value,
    )
    encoder_args = {}
    if enc is not None:
        encoder_args = dict(
            zip(("enc_x_ptr", "enc_w_ptr", "enc_bias_ptr", "enc_threshold_ptr", "enc_shift_ptr"), enc),
            d_enc=enc[1].shape[0],
            stride_enc_x=enc[0].stride(0),
            stride_enc_w=enc[1].stride(0),
            HAS_SHIFT=encoder.input_shift is not None,
        )
    listing = long_rows.listing_args() if long_rows is not None else {}
    launch_gather(
        (programs, 1),
        weight,
        out,
        cfg.num_warps,
        **operands,
        **encoder_args,
        **listing,
        FALLBACK=1 if can_overflow else (2 if enc is not None else 0),
        BLOCK_K=cfg.block_k,
        BLOCK_D=cfg.block_d,
        BLOCK_F=cfg.block_f,
        GROUP=cfg.group,
    )
    if long_rows is not None:
        launch_spread(long_rows, weight, out, **operands)
    return out
