"""Gather-accumulate: sparse rows times a dense weight, ``y[m] = sum_j val[m, j] * W[idx[m, j], :]``.

The one kernel every sparse x dense product in sparsefuse uses (SAE decode, FFN down projection, ...). A program
owns one row and a BLOCK_D slice of the output; it walks the row's entries BLOCK_K at a time, gathering BLOCK_K rows
of W as one [BLOCK_K, BLOCK_D] tile, and accumulates in fp32.

Cost: per row, nnz * D weight elements gathered plus the row's values and indices; the output is written once.

ELL rows that overflowed (true count > width) are completed without a host sync when the dense activations are
passed in: a second launch scans those rows alone from their dense form (the other rows' programs exit at once),
each row's columns spread over several programs as :func:`matmul_skip_zeros` spreads them, loading W only where the
activation is non-zero -- an overflowed row costs what ``"scan"`` pays for it, not one program's serial walk. Or,
given the :class:`ThresholdedLinear` layer whose activations the rows are, the row's activations are recomputed
from that layer's inputs. Without either an overflowed row is written as NaN -- visibly wrong, never silently
truncated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import _backend
from .._backend import Backend, backend_for, new_output, record_launch, sm_count
from .._triton.gather import accumulate_nonzeros, accumulate_rows, sum_split_partials
from .._validation import (
    check_matmul_skip_zeros,
    check_overflow_completion,
    check_sparse_weight,
    unit_last_stride,
)
from .formats import CSR, ELL


@dataclass(frozen=True)
class ThresholdedLinear:
    """A thresholded linear layer whose activations form the rows of a sparse operand, so that the gather product
    can recompute an overflowed ELL row on the device instead of reading its (incomplete) stored entries:

        activations = relu(pre) * (pre > threshold),   pre = (x - input_shift) @ weight + bias

    (e.g. a JumpReLU encoder; a ReLU layer is threshold 0)."""

    x: torch.Tensor  # [M, d_in]
    weight: torch.Tensor  # [d_in, n]
    bias: torch.Tensor  # [n]
    threshold: torch.Tensor  # [n]
    input_shift: torch.Tensor | None = None  # [d_in]

    def prepared(self) -> tuple[torch.Tensor, ...]:
        """(x, weight, bias, threshold, input_shift) with unit column strides, input_shift defaulting to a
        placeholder (never read)."""
        shift = self.input_shift if self.input_shift is not None else self.bias
        vectors = (unit_last_stride(v) for v in (self.bias, self.threshold, shift))  # read at unit stride
        return unit_last_stride(self.x), unit_last_stride(self.weight), *vectors

    def reference_activations(self) -> torch.Tensor:
        """float64 activations [M, n]; ``x - input_shift`` is rounded to x's dtype first, as the encode kernels feed
        it to tl.dot in that dtype."""
        shifted = self.x.double()
        if self.input_shift is not None:
            shifted = (shifted - self.input_shift.double()).to(self.x.dtype).double()
        pre = shifted @ self.weight.double() + self.bias.double()
        return torch.relu(pre) * (pre > self.threshold.double())


@triton.jit
def thresholded_linear_chunk(
    row,
    f,
    f_mask,
    x_ptr,
    stride_x,
    w_ptr,
    stride_w,
    bias_ptr,
    threshold_ptr,
    shift_ptr,
    d_in,
    HAS_SHIFT: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Activations [BLOCK_F] of input row ``row`` for outputs f of a :class:`ThresholdedLinear` (x [M, d_in],
    w [d_in, n], bias/threshold [n], shift [d_in]): relu(pre) * (pre > threshold), fp32. A GEMV: meant for the rare
    rows that overflowed."""
    pre = tl.zeros(f.shape, dtype=tl.float32)
    for e0 in range(0, d_in, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        e_mask = e < d_in
        xe = tl.load(x_ptr + row * stride_x + e, mask=e_mask, other=0.0).to(tl.float32)
        if HAS_SHIFT:
            xe -= tl.load(shift_ptr + e, mask=e_mask, other=0.0).to(tl.float32)
        we = tl.load(
            w_ptr + e[:, None].to(tl.int64) * stride_w + f[None, :], mask=e_mask[:, None] & f_mask[None, :], other=0.0
        )  # [BLOCK_E, BLOCK_F]
        pre += tl.sum(xe[:, None] * we.to(tl.float32), axis=0)
    pre += tl.load(bias_ptr + f, mask=f_mask, other=0.0).to(tl.float32)
    threshold = tl.load(threshold_ptr + f, mask=f_mask, other=float("inf")).to(tl.float32)
    return tl.where(((pre > threshold) & (pre > 0)) | (pre != pre), pre, 0.0)  # NaN kept, as in the reference


_FORMAT_ELL = tl.constexpr(0)
_FORMAT_CSR = tl.constexpr(1)
_FORMAT_DENSE = tl.constexpr(2)


@triton.jit
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
    n_out,
    n_in,
    width,
    stride_w,
    stride_out,
    stride_dense,
    stride_dense_col,
    chunks_per_split,
    n_splits,
    d_enc,
    stride_enc_x,
    stride_enc_w,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_F: tl.constexpr,
    GROUP: tl.constexpr,
    REDUCE_SPLITS: tl.constexpr,
    FORMAT: tl.constexpr,
    FALLBACK: tl.constexpr,
    HAS_SHIFT: tl.constexpr,
    ATOMIC_SPLITS: tl.constexpr = False,
    ONLY_OVERFLOWED: tl.constexpr = False,
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
    # Overflowed ELL rows (FALLBACK): 1 = left unwritten, for a DENSE pass over those rows alone (ONLY_OVERFLOWED:
    # rows whose ELL count, counts[row], is within width are skipped), which spreads each row's scan over splits;
    # 2 = recompute the activations of a ThresholdedLinear from enc_x [M, d_enc], enc_w [d_enc, n_in],
    # enc_bias/enc_threshold [n_in], enc_shift [d_enc]; 0 = write NaN.
    n_d_blocks = tl.cdiv(n_out, BLOCK_D)
    d_block = tl.program_id(0) % n_d_blocks
    row = (tl.program_id(0) // n_d_blocks).to(tl.int64)
    if ONLY_OVERFLOWED:
        if tl.load(counts_ptr + row) <= width:
            return
    split = tl.program_id(1)
    d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_mask = d < n_out
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if FORMAT == _FORMAT_DENSE:
        split_nnz = tl.zeros([], dtype=tl.int32)
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
            a_next = tl.load(row_ptr + f_next.to(tl.int64) * stride_dense_col, mask=f_next < f_end, other=0.0)
            split_nnz += tl.sum((a != 0).to(tl.int32), axis=0)
            acc = accumulate_nonzeros(acc, a, f, w_ptr, stride_w, d, d_mask, GROUP)
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
        if FORMAT == _FORMAT_ELL:
            start = row * width
            count = tl.load(counts_ptr + row)
            n = tl.minimum(count, width)
            overflowed = count > width
        else:
            start = tl.load(row_offsets_ptr + row)
            n = (tl.load(row_offsets_ptr + row + 1) - start).to(tl.int32)
            overflowed = n < 0  # never
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
            elif FALLBACK == 1:
                return  # the DENSE pass over the overflowed rows writes this one
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


def _scan_warps(block_d: int, weight_itemsize: int) -> int:
    """Warps of a scan program: as many as one row of its [GROUP, BLOCK_D] weight tile fills with 16-byte loads, at
    most 4. More would split the tile's rows over warps, and every accumulate's sum over the group would cross warps
    through shared memory: with 4 warps on 512 bf16 columns the scan took twice its fp32 time (H200)."""
    return max(1, min(4, block_d * weight_itemsize // (32 * 16)))


_INTERPRETER_CONFIG = _LaunchConfig(block_d=32, block_f=64, block_k=16, group=16, num_warps=4)  # few steps


def _launch_config(n_out: int) -> _LaunchConfig:
    """Blocks of the dense-row scan, measured on an H200: one program covers all of D (each D block re-scans and
    re-ranks the row). The gather of stored entries: :func:`_gather_config`."""
    if _backend.INTERPRET:
        return _INTERPRETER_CONFIG
    return _LaunchConfig(
        block_d=min(4096, max(32, triton.next_power_of_2(n_out))), block_f=1024, block_k=32, group=2, num_warps=4
    )


def _gather_config(M: int, n_out: int, device: torch.device) -> _LaunchConfig:
    """Blocks of the gather of stored entries (ELL/CSR), measured on an H200: one warp, 16 entries per step, 512
    columns of W per program -- 1.2-1.7x faster than 4 warps on 1 KiB, whose sum over the entries crossed warps
    through shared memory at every step -- narrowed to 128 columns while rows x D blocks would leave
    fewer than 8 programs per SM (B=256, D=768: 10.8 us at 128 against 18.6 at 512)."""
    if _backend.INTERPRET:
        return _INTERPRETER_CONFIG
    block_d = min(512, max(32, triton.next_power_of_2(n_out)))
    while block_d > 128 and M * triton.cdiv(n_out, block_d) < 8 * sm_count(device):
        block_d //= 2
    return _LaunchConfig(block_d=block_d, block_f=1024, block_k=16, group=2, num_warps=1)


def _device_programs(device: torch.device, atomic_splits: bool = False) -> int:
    """How many programs keep every SM busy with loads in flight (a scan is latency-bound per program). When rows
    alone do not fill the GPU, splits summed by atomics cost no partial buffer, so more of them pay: shorter serial
    scans per program (measured on an H200). When rows do fill it, splitting them only adds atomics."""
    return (32 if atomic_splits else 4) * sm_count(device, interpreted=2)


def _weight_for_gather(weight: torch.Tensor) -> torch.Tensor:
    return weight if weight.stride(1) == 1 or weight.shape[1] <= 1 else weight.contiguous()


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
) -> torch.Tensor:
    """``sparse @ weight`` -> [M, n_out] with fp32 accumulation.

    Args:
        sparse: ELL or CSR, [M, n_in].
        weight: [n_in, n_out], float32/float16/bfloat16 (any row stride; columns contiguous or copied once).
        dense: for ELL, the dense [M, n_in] rows the format came from: overflowed rows are recomputed from them on
            the device.
        encoder: for ELL holding the activations of a :class:`ThresholdedLinear` (e.g. written by a fused encode),
            that layer: overflowed rows' activations are recomputed on the device (a GEMV per overflowed row and
            output tile: meant for rare rows). Without ``dense`` or ``encoder`` an overflowed row comes out as NaN.
        out_dtype: defaults to the promoted dtype of values and weight.
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
    cfg = _gather_config(M, n_out, weight.device)
    placeholder = sparse.values
    enc = encoder.prepared() if encoder is not None else None
    gather_accumulate_kernel[(triton.cdiv(n_out, cfg.block_d) * M, 1)](
        sparse.values,
        sparse.indices,
        sparse.counts if is_ell else placeholder,
        placeholder if is_ell else sparse.row_offsets,
        dense if dense is not None else placeholder,
        weight,
        out,
        placeholder,
        placeholder,
        placeholder,
        *(enc if enc is not None else (placeholder,) * 5),
        n_out,
        sparse.n_cols,
        sparse.width if is_ell else 0,
        weight.stride(0),
        out.stride(0),
        dense.stride(0) if dense is not None else 0,
        dense.stride(1) if dense is not None else 1,
        0,
        1,
        enc[1].shape[0] if enc is not None else 0,
        enc[0].stride(0) if enc is not None else 0,
        enc[1].stride(0) if enc is not None else 0,
        BLOCK_K=cfg.block_k,
        BLOCK_D=cfg.block_d,
        BLOCK_F=cfg.block_f,
        GROUP=cfg.group,
        REDUCE_SPLITS=1,
        FORMAT=0 if is_ell else 1,
        FALLBACK=1 if dense is not None else (2 if encoder is not None else 0),
        HAS_SHIFT=encoder is not None and encoder.input_shift is not None,
        num_warps=cfg.num_warps,
    )
    record_launch("gather_accumulate_kernel")
    if is_ell and dense is not None and sparse.width < sparse.n_cols:  # overflowed rows (when a row can overflow):
        # scanned from their dense rows, each over several programs
        _scan_into(out, dense, weight, None, True, overflowed=(sparse.counts, sparse.width))
    return out


def matmul_skip_zeros(
    a: torch.Tensor,
    weight: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    splits: int | None = None,
    deterministic: bool | None = None,
) -> torch.Tensor:
    """``a @ weight`` for a mostly-zero ``a`` [M, n_in], straight from its dense form: each row is scanned for
    non-zeros and only their rows of ``weight`` [n_in, n_out] are loaded (fp32 accumulation). No sparse format, no
    capacity, no host sync; any strides. Cost: one read of ``a`` plus nnz(a) * n_out weight elements -- against the
    dense product's full read of ``weight``, a win while nnz per row is small.

    ``splits``: how many programs share one row's columns (default: enough to fill the GPU when M is small); with
    more than one, per-split fp32 partials are summed in a fixed order when ``deterministic`` (default:
    ``torch.are_deterministic_algorithms_enabled()``), else added with fp32 atomics (faster; the last bits of the
    sum vary from run to run).
    """
    op = "matmul_skip_zeros"
    check_matmul_skip_zeros(op, a, weight, splits)
    weight, out = product_operands(a.dtype, a.shape[0], weight, out_dtype)
    (M, n_in), n_out, out_dtype = a.shape, weight.shape[1], out.dtype
    if M == 0 or n_out == 0:
        return out
    if n_in == 0:
        return out.zero_()
    if backend_for(a, weight) is Backend.TORCH:
        _backend.warn_reference_once(op)
        return (a.double() @ weight.double()).to(out_dtype)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    return _scan_into(out, a, weight, splits, deterministic)


OVERFLOW_ROW_SHARE = 32  # the overflow pass sizes its splits as if one row in this many had overflowed
OVERFLOW_PARTIAL_BYTES = 64 << 20  # at most this much fp32 partial-sum buffer for the overflow pass's splits


def _scan_into(
    out: torch.Tensor,
    a: torch.Tensor,
    weight: torch.Tensor,
    splits: int | None,
    deterministic: bool,
    overflowed: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """The DENSE-format launch of :func:`matmul_skip_zeros` into ``out`` [M, n_out]. ``overflowed = (counts,
    width)``: only the rows of an ELL whose count passed its width are computed (the others keep what ``out``
    holds); their partial sums are then always reduced in a fixed order, which never touches the other rows."""
    (M, n_in), n_out = a.shape, weight.shape[1]
    deterministic = deterministic or overflowed is not None
    cfg = _launch_config(n_out)
    block_d, n_chunks = cfg.block_d, triton.cdiv(n_in, cfg.block_f)
    programs = _device_programs(a.device)
    if not deterministic and M * triton.cdiv(n_out, block_d) < programs:  # rows alone do not fill the GPU
        programs = _device_programs(a.device, atomic_splits=True)

    # The overflow pass works on the rows past the ELL width only, which the host cannot count without a sync: its
    # splits are sized for a share of the rows (the other rows' programs exit at once), so that a few long rows are
    # spread over the GPU instead of each walked by one program -- within a budget for the fp32 partials.
    rows = M if overflowed is None else triton.cdiv(M, OVERFLOW_ROW_SHARE)
    most = n_chunks if overflowed is None else max(1, OVERFLOW_PARTIAL_BYTES // (4 * M * n_out))

    def n_splits_for(block_d: int) -> int:
        wanted = splits if splits is not None else triton.cdiv(programs, rows * triton.cdiv(n_out, block_d))
        return triton.cdiv(n_chunks, triton.cdiv(n_chunks, max(1, min(wanted, n_chunks, most))))

    # One program per (row, D block) sums that row's split partials: keep its read (n_splits * block_d fp32) within
    # ~64 KiB by narrowing the D blocks when rows are few (at B=1, D=2304 a single 4096-wide block took 25 us).
    while deterministic and splits is None and block_d > 128 and n_splits_for(block_d) * block_d * 4 > 65536:
        block_d //= 2
    d_blocks, n_splits = triton.cdiv(n_out, block_d), n_splits_for(block_d)
    chunks_per_split = triton.cdiv(n_chunks, n_splits)
    warps = cfg.num_warps if _backend.INTERPRET else _scan_warps(block_d, weight.element_size())
    atomic = n_splits > 1 and not deterministic
    partial = split_nnz = arrivals = out
    if atomic:  # out itself when fp32; else an fp32 sum cast into out after the launch
        partial = out.zero_() if out.dtype == torch.float32 else torch.zeros(M, n_out, device=a.device)
    elif n_splits > 1:
        partial = torch.empty(M, n_splits, n_out, dtype=torch.float32, device=a.device)  # read where written only
        split_nnz = torch.empty(M, n_splits, dtype=torch.int32, device=a.device)
        arrivals = torch.zeros(M, d_blocks, dtype=torch.int32, device=a.device)
    counts, width = overflowed if overflowed is not None else (a, 0)
    gather_accumulate_kernel[(d_blocks * M, n_splits)](
        a,
        a,
        counts,
        a,
        a,
        weight,
        out,
        partial,
        split_nnz,
        arrivals,
        a,
        a,
        a,
        a,
        a,
        n_out,
        n_in,
        width,
        weight.stride(0),
        out.stride(0),
        a.stride(0),
        a.stride(1),
        chunks_per_split,
        n_splits,
        0,
        0,
        0,
        BLOCK_K=cfg.block_k,
        BLOCK_D=block_d,
        BLOCK_F=cfg.block_f,
        GROUP=cfg.group,
        REDUCE_SPLITS=max(1, min(triton.next_power_of_2(n_splits), 8192 // block_d)),
        FORMAT=2,
        FALLBACK=0,
        HAS_SHIFT=False,
        ATOMIC_SPLITS=atomic,
        ONLY_OVERFLOWED=overflowed is not None,
        num_warps=warps,
    )
    record_launch("gather_accumulate_kernel")
    return out.copy_(partial) if atomic and partial is not out else out
