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
