"""The public ``snake``: checks its arguments, brings x and alpha to the ops' canonical shapes, then calls the
launcher directly in plain eager inference or the torch.library op otherwise."""

from __future__ import annotations

import torch

from ... import _backend
from ..._validation import check_snake_args
from .launch import snake_forward
from .op import snake_op


def snake(x: torch.Tensor, alpha: torch.Tensor, eps: float = 1e-9, *, fast_sin: bool = False) -> torch.Tensor:
    """Snake activation ``x + (alpha + eps).reciprocal() * sin(alpha * x) ** 2`` (DAC / SNAC ``snake``).

    Args:
        x: [B, C, T], [C, T] or [B, C, *]; float32, float16, bfloat16 (or float64). Math runs in float32 (float64
            for float64 inputs); the output has x's dtype and shape (contiguous).
        alpha: [C] or [1, C, 1], one value per channel; any floating dtype.
        eps: added to alpha before the reciprocal, as in DAC (1e-9).
        fast_sin: fp32 only: a cheaper sine (two-part reduction, degree-7 polynomial; |sin^2 error| <= 1e-5 for
            |alpha*x| <= 1e5) instead of the default (three-part reduction, degree 9; 3.5e-7). fp16 and bf16 inputs
            always use the hardware sine after the three-part reduction (|sin^2 error| <= 1e-6, far below their
            output rounding), which is both cheaper and more accurate than the fp32 fast path. See the README.

    Differentiable in x and alpha. A time axis with stride != 1 is copied once before the kernel runs.
    """
    (B, C, T), eps = check_snake_args(x, alpha, eps)
    x3, alpha1 = x.reshape(B, C, T), alpha.reshape(C).contiguous()
    if _backend.bypass_dispatcher(x, alpha):
        return snake_forward(x3, alpha1, eps, bool(fast_sin)).reshape(x.shape)
    return snake_op(x3, alpha1, eps, bool(fast_sin)).reshape(x.shape)
