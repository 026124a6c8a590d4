"""Rows at unit stride for the kernels: ``unit_rows(t)`` is ``t`` itself when its last stride is 1, else a contiguous
copy made by a tiled transpose.

Why: a row-major weight read as its transpose (``w_down.t()`` of ``nn.Linear``'s [K, N], which the FFN step's down
product and dh gather by rows) is copied to rows first. ``Tensor.contiguous()`` on such a view runs torch's
elementwise copy, which reads or writes one strided element at a time: 0.38 ms for the 8B layer's 4096 x 14336 bf16
W_down on an H200, ~0.6 TB/s, where a plain copy of it takes 0.06 ms. The tiled kernel reads a [BLOCK_R, BLOCK_C]
tile along the source's unit-stride axis and writes it along the destination's (the compiler moves the tile through
shared memory between the two), so both sides are full-width accesses.

Not differentiable: for the kernels' operands inside the ops (autograd's copies of leaves stay ``.contiguous()``).
"""

from __future__ import annotations

import torch
import triton.language as tl

from .._backend import Backend, backend_for, cdiv, new_output, record_launch
from .._jit import kernel
from .._validation import describe


@kernel
def transpose_copy_kernel(
    src_ptr, dst_ptr, R, C, stride_r, stride_c, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):  # fmt: skip
    # src [R, C] at any strides -> dst [R, C] contiguous. Grid (row tiles, column tiles).
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < R) & (c[None, :] < C)
    r64, c64 = r[:, None].to(tl.int64), c[None, :].to(tl.int64)
    tile = tl.load(src_ptr + r64 * stride_r + c64 * stride_c, mask=mask)
    tl.store(dst_ptr + r64 * C + c64, tile, mask=mask)


def unit_rows(t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` [R, C] when its last stride is 1 (or it has one column), else a contiguous copy of it (not
    differentiable; see the module docstring), into ``out`` [R, C] (contiguous, t's dtype) when given, which is then
    written whatever t's layout. Other ranks and the torch backend: ``t.contiguous()`` / ``out.copy_(t)``."""
    if out is None and (t.stride(-1) == 1 or t.shape[-1] <= 1):
        return t
    if t.dim() != 2 or backend_for(t) is Backend.TORCH or t.numel() == 0:
        return t.contiguous() if out is None else out.copy_(t)
    R, C = t.shape
    if out is None:
        out = new_output((R, C), t.dtype, t.device)
    elif out.shape != t.shape or out.dtype != t.dtype or not out.is_contiguous():
        raise ValueError(f"unit_rows: out must be a contiguous {list(t.shape)} {t.dtype} tensor; got {describe(out)}")
    block = 64  # 64 x 64 tiles: 8 KiB of bf16 through shared memory per program
    transpose_copy_kernel[(cdiv(R, block), cdiv(C, block))](
        t, out, R, C, t.stride(0), t.stride(1), BLOCK_R=block, BLOCK_C=block, num_warps=4
    )
    record_launch("transpose_copy_kernel")
    return out
