"""Gather-accumulate: sparse rows times a dense weight, ``y[m] = sum_j val[m, j] * W[idx[m, j], :]``.

The one kernel every sparse x dense product in sparsefuse uses (SAE decode, FFN down projection, ...). A program
owns one row and a BLOCK_D slice of the output; it walks the row's entries BLOCK_K at a time, gathering BLOCK_K rows
of W as one [BLOCK_K, BLOCK_D] tile, and accumulates in fp32.

Cost: per row, nnz * D weight elements gathered plus the row's values and indices; the output is written once.

ELL rows that overflowed (true count > width) are completed without a host sync when the dense activations are
passed in: such a row is recomputed from its dense form, loading W only where the activation is non-zero (masked
loads fetch nothing for the zeros), so the fallback costs a scan of the dense row plus the rows actually used.
Without the dense activations an overflowed row is written as NaN -- visibly wrong, never silently truncated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import _backend
from .._backend import Backend, backend_for, new_output, record_launch
from .._validation import check_float, check_same_device, describe
from .formats import CSR, ELL


@dataclass(frozen=True)
class JumpReLUEncoder:
    """The inputs of a JumpReLU encode, so a consumer can recompute an overflowed token's activations on the device:
    ``relu(pre) * (pre > threshold)`` with ``pre = (x - b_dec) @ W_enc + b_enc``."""

    x: torch.Tensor  # [M, d_in]
    W_enc: torch.Tensor  # [d_in, d_sae]
    b_enc: torch.Tensor  # [d_sae]
    threshold: torch.Tensor  # [d_sae]
    b_dec: torch.Tensor | None = None  # [d_in]

    def prepared(self) -> tuple[torch.Tensor, ...]:
        """(x, W_enc, b_enc, threshold, b_dec) with unit column strides, b_dec defaulting to a placeholder."""
        x = self.x if self.x.stride(-1) == 1 else self.x.contiguous()
        w = self.W_enc if self.W_enc.stride(-1) == 1 else self.W_enc.contiguous()
        return x, w, self.b_enc, self.threshold, self.b_dec if self.b_dec is not None else self.b_enc

    def reference_activations(self) -> torch.Tensor:
        sae_in = self.x.double() - (self.b_dec.double() if self.b_dec is not None else 0.0)
        pre = sae_in @ self.W_enc.double() + self.b_enc.double()
        return torch.relu(pre) * (pre > self.threshold.double())


@triton.jit
def _accumulate_dense_chunk(acc, a, f, w_ptr, stride_w, d, d_mask):
    """acc [BLOCK_D] += sum_f a[f] * W[f, d] over one chunk of activations a [BLOCK_K]; W rows whose activation is
    zero are not loaded (masked), so a dense fallback costs the rows actually used."""
    used = a != 0
    w = tl.load(w_ptr + f[:, None].to(tl.int64) * stride_w + d[None, :], mask=used[:, None] & d_mask[None, :],
                other=0.0)  # [BLOCK_K, BLOCK_D]  # fmt: skip
    return acc + tl.sum(tl.where(used[:, None], a[:, None] * w.to(tl.float32), 0.0), axis=0)


@triton.jit
def gather_accumulate_kernel(values_ptr, indices_ptr, counts_ptr, row_offsets_ptr, dense_ptr, w_ptr, out_ptr,
                             x_ptr, w_enc_ptr, b_enc_ptr, threshold_ptr, b_dec_ptr,
                             n_out, n_in, width, stride_w, stride_out, stride_dense, d_enc, stride_x, stride_w_enc,
                             BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, IS_ELL: tl.constexpr,
                             FALLBACK: tl.constexpr, HAS_B_DEC: tl.constexpr):  # fmt: skip
    # ELL: values/indices [M, width], counts [M]; CSR: values/indices [nnz], row_offsets [M + 1].
    # w [n_in, n_out] (unit column stride); out [M, n_out].
    # Overflowed ELL rows (FALLBACK): 1 = recompute from dense [M, n_in]; 2 = recompute the JumpReLU activations
    # from x [M, d_enc], w_enc [d_enc, n_in], b_enc/threshold [n_in], b_dec [d_enc]; 0 = write NaN.
    row = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_mask = d < n_out
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if IS_ELL:
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
        idx = tl.load(indices_ptr + start + k, mask=k_mask, other=0).to(tl.int64)
        val = tl.load(values_ptr + start + k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + idx[:, None] * stride_w + d[None, :], mask=k_mask[:, None] & d_mask[None, :], other=0.0)
        acc += tl.sum(val[:, None] * w.to(tl.float32), axis=0)  # [BLOCK_D]
    if IS_ELL:
        if overflowed:
            if FALLBACK == 1:
                for f0 in range(0, n_in, BLOCK_K):
                    f = f0 + tl.arange(0, BLOCK_K)
                    a = tl.load(dense_ptr + row * stride_dense + f, mask=f < n_in, other=0.0).to(tl.float32)
                    acc = _accumulate_dense_chunk(acc, a, f, w_ptr, stride_w, d, d_mask)
            elif FALLBACK == 2:
                for f0 in range(0, n_in, BLOCK_K):
                    f = f0 + tl.arange(0, BLOCK_K)
                    f_mask = f < n_in
                    pre = tl.zeros([BLOCK_K], dtype=tl.float32)
                    for e0 in range(0, d_enc, BLOCK_D):
                        e = e0 + tl.arange(0, BLOCK_D)
                        e_mask = e < d_enc
                        xe = tl.load(x_ptr + row * stride_x + e, mask=e_mask, other=0.0).to(tl.float32)
                        if HAS_B_DEC:
                            xe -= tl.load(b_dec_ptr + e, mask=e_mask, other=0.0).to(tl.float32)
                        we = tl.load(w_enc_ptr + e[:, None].to(tl.int64) * stride_w_enc + f[None, :],
                                     mask=e_mask[:, None] & f_mask[None, :], other=0.0)  # [BLOCK_D, BLOCK_K]  # fmt: skip
                        pre += tl.sum(xe[:, None] * we.to(tl.float32), axis=0)
                    pre += tl.load(b_enc_ptr + f, mask=f_mask, other=0.0).to(tl.float32)
                    threshold = tl.load(threshold_ptr + f, mask=f_mask, other=float("inf")).to(tl.float32)
                    a = tl.where((pre > threshold) & (pre > 0), pre, 0.0)
                    acc = _accumulate_dense_chunk(acc, a, f, w_ptr, stride_w, d, d_mask)
            else:
                acc += float("nan")
    tl.store(out_ptr + row * stride_out + d, acc.to(out_ptr.dtype.element_ty), mask=d_mask)


def torch_sparse_matmul(sparse: ELL | CSR, weight: torch.Tensor) -> torch.Tensor:
    """Reference: ``sparse.to_dense() @ weight`` in float64 (ELL must not have overflowed)."""
    return sparse.to_dense().double() @ weight.double()


def sparse_matmul(sparse: ELL | CSR, weight: torch.Tensor, *, dense: torch.Tensor | None = None,
                  encoder: JumpReLUEncoder | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """``sparse @ weight`` -> [M, n_out] with fp32 accumulation.

    Args:
        sparse: ELL or CSR, [M, n_in].
        weight: [n_in, n_out], float32/float16/bfloat16 (any row stride; columns contiguous or copied once).
        dense: for ELL, the dense [M, n_in] rows the format came from: overflowed rows are recomputed from them on
            the device.
        encoder: for ELL produced by a JumpReLU encode, its inputs: overflowed rows' activations are recomputed on
            the device (a GEMV per overflowed row and output tile: meant for rare rows). Without ``dense`` or
            ``encoder`` an overflowed row comes out as NaN.
        out_dtype: defaults to the promoted dtype of values and weight.
    """
    op = "sparse_matmul"
    check_float(op, "weight", weight)
    if weight.dim() != 2 or weight.shape[0] != sparse.n_cols:
        raise ValueError(f"{op}: weight must be [{sparse.n_cols}, n_out] for a sparse matrix of shape "
                         f"{list(sparse.shape)}; got {describe(weight)}")  # fmt: skip
    check_same_device(op, values=sparse.values, weight=weight)
    is_ell = isinstance(sparse, ELL)
    if dense is not None and encoder is not None:
        raise ValueError(f"{op}: pass dense or encoder, not both")
    if encoder is not None and (not is_ell or encoder.x.shape[0] != sparse.shape[0]):
        raise ValueError(f"{op}: encoder completes overflowed ELL rows and needs one input row per sparse row")
    if dense is not None:
        if not is_ell:
            raise ValueError(f"{op}: dense is only used to complete overflowed ELL rows; a CSR is always complete")
        if dense.shape != sparse.shape:
            raise ValueError(f"{op}: dense must have shape {list(sparse.shape)}; got {describe(dense)}")
        dense = dense if dense.stride(1) == 1 else dense.contiguous()
    weight = weight if weight.stride(1) == 1 or weight.shape[1] <= 1 else weight.contiguous()
    M, n_out = sparse.shape[0], weight.shape[1]
    out_dtype = out_dtype or torch.promote_types(sparse.values.dtype, weight.dtype)
    out = new_output((M, n_out), out_dtype, weight.device)
    if M == 0 or n_out == 0:
        return out
    if backend_for(weight) is Backend.TORCH:
        _backend.warn_reference_once(op)
        if is_ell and dense is not None:
            return (dense.double() @ weight.double()).to(out_dtype)
        if is_ell and encoder is not None:
            return (encoder.reference_activations() @ weight.double()).to(out_dtype)
        return torch_sparse_matmul(sparse, weight).to(out_dtype)
    block_d = 32 if _backend.INTERPRET else min(256, max(32, triton.next_power_of_2(n_out)))
    block_k = 16 if _backend.INTERPRET else 32
    placeholder = sparse.values
    enc = encoder.prepared() if encoder is not None else None
    gather_accumulate_kernel[(M, triton.cdiv(n_out, block_d))](
        sparse.values, sparse.indices,
        sparse.counts if is_ell else placeholder, placeholder if is_ell else sparse.row_offsets,
        dense if dense is not None else placeholder, weight, out,
        *(enc if enc is not None else (placeholder,) * 5),
        n_out, sparse.n_cols, sparse.width if is_ell else 0, weight.stride(0), out.stride(0),
        dense.stride(0) if dense is not None else 0,
        enc[1].shape[0] if enc is not None else 0, enc[0].stride(0) if enc is not None else 0,
        enc[1].stride(0) if enc is not None else 0,
        BLOCK_K=block_k, BLOCK_D=block_d, IS_ELL=is_ell,
        FALLBACK=1 if dense is not None else (2 if encoder is not None else 0),
        HAS_B_DEC=encoder is not None and encoder.b_dec is not None,
    )  # fmt: skip
    record_launch("gather_accumulate_kernel")
    return out
