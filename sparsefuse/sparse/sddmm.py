"""Sampled dense x dense: ``out[m, f] = A[m, :] . B[f, :]`` only where a sparsity pattern has an entry.

Used for gradients on a sparsity pattern (an SAE decode's gradient w.r.t. its feature activations:
``grad_acts[m, f] = grad_out[m] . W_dec[f]`` only where feature f fired for token m). The pattern is read in its
dense form (no format, no host sync); :func:`row_dots` is the shared inner step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _backend
from .._backend import Backend, backend_for, new_output, record_launch
from .spmm import pick_nonzeros, rank_nonzeros


@triton.jit
def row_dots(a_row_ptr, b_ptr, rows, row_mask, D, stride_b_row, stride_b_col,
             BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """[BLOCK_R] fp32: ``a_row . b[rows[r], :]`` over D, BLOCK_D at a time; rows outside ``row_mask`` are not loaded
    (0). The inner step of every sampled product (and of the TwELL up projection)."""
    out = tl.zeros([BLOCK_R], dtype=tl.float32)
    base = rows.to(tl.int64) * stride_b_row  # [BLOCK_R]
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_mask = d < D
        av = tl.load(a_row_ptr + d, mask=d_mask, other=0.0).to(tl.float32)  # [BLOCK_D]
        bv = tl.load(b_ptr + base[:, None] + d[None, :].to(tl.int64) * stride_b_col,
                     mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_D]  # fmt: skip
        out += tl.sum(bv.to(tl.float32) * av[None, :], axis=1)
    return out


@triton.jit
def sampled_dot_dense_pattern_kernel(pattern_ptr, a_ptr, b_ptr, out_ptr, N, D, stride_pattern, stride_a, stride_b,
                                     stride_out, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
                                     GROUP: tl.constexpr):  # fmt: skip
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


def sampled_dot_dense_pattern(pattern: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                              out_dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """[M, N]: ``a[m] . b[f]`` where ``pattern[m, f] != 0``, zero elsewhere (fp32 accumulation); pattern [M, N]
    dense, a [M, D], b [N, D]. No sparse format and no host sync: each chunk of a pattern row is scanned for its
    non-zeros, so the cost is one read of the pattern, one write of the output and nnz rows of b."""
    pattern = pattern if pattern.stride(-1) == 1 else pattern.contiguous()
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    (M, N), D = pattern.shape, a.shape[1]
    out = new_output((M, N), out_dtype or pattern.dtype, pattern.device)
    if M == 0 or N == 0:
        return out
    if backend_for(pattern) is Backend.TORCH:
        _backend.warn_reference_once("sampled_dot_dense_pattern")
        return ((a.double() @ b.double().t()) * (pattern != 0)).to(out.dtype)
    block_f, block_d, group = (32, 32, 16) if _backend.INTERPRET else (1024, min(256, max(32, triton.next_power_of_2(D))), 2)
    sampled_dot_dense_pattern_kernel[(M, triton.cdiv(N, block_f))](
        pattern, a, b, out, N, D, pattern.stride(0), a.stride(0), b.stride(0), out.stride(0),
        BLOCK_F=block_f, BLOCK_D=block_d, GROUP=group,
    )  # fmt: skip
    record_launch("sampled_dot_dense_pattern_kernel")
    return out
