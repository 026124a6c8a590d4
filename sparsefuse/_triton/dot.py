"""The one fp32 matmul-precision policy of every tensor-core kernel in sparsefuse.

torch.matmul computes fp32 products exactly (IEEE) unless ``torch.set_float32_matmul_precision("high")`` or
``"medium"`` allows TF32; the kernels follow the same setting, so a sparsefuse op and the torch code it replaces agree
on precision. fp16/bf16 operands always take the tensor cores' native path (fp32 accumulation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def ieee_fp32(dtype: torch.dtype) -> bool:
    """The ``IEEE_FP32`` constexpr for a kernel whose dot operands have ``dtype``: exact fp32 products unless the user
    allowed TF32 through ``torch.set_float32_matmul_precision``."""
    return dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"


@triton.jit
def dot_accumulate(acc, a, b, IEEE_FP32: tl.constexpr):
    """acc + a @ b on tensor cores, b cast to a's dtype; fp32 operands in exact IEEE arithmetic when IEEE_FP32
    (see :func:`ieee_fp32`), else Triton's default (TF32 for fp32)."""
    if IEEE_FP32:
        return tl.dot(a, b.to(a.dtype), acc, input_precision="ieee")
    return tl.dot(a, b.to(a.dtype), acc)


@triton.jit
def gathered_rows_dot(
    acc, a_rows_ptr, row_mask, b_rows_ptr, col_mask, D, BLOCK_D: tl.constexpr, IEEE_FP32: tl.constexpr
):
    """acc [R, C] + a[rows] @ b[cols]^T over D features, the rows of both operands gathered: ``a_rows_ptr`` [R, 1] and
    ``b_rows_ptr`` [1, C] point at the starts of the gathered rows (unit feature stride); masked rows and columns
    read as 0. The sampled product every row-block kernel computes (the "sample" move of the sparse core)."""
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)  # [BLOCK_D]
        d_mask = d < D
        a = tl.load(a_rows_ptr + d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [R, BLOCK_D]
        bt = tl.load(b_rows_ptr + d[:, None], mask=d_mask[:, None] & col_mask[None, :], other=0.0)  # [BLOCK_D, C]
        acc = dot_accumulate(acc, a, bt, IEEE_FP32)
    return acc
