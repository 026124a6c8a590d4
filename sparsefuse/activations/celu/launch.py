"""CELU's launchers: lay out the output, launch the flat kernel over the storage, ``record_launch``. Nothing here
checks arguments (functional.py did). CPU tensors without the interpreter run the plain-torch reference instead.

    z = x * input_scale
    y = scale * (z                          if z > 0
                 alpha * expm1(z / alpha)   otherwise)

Math runs in float32 (float64 for float64 inputs); expm1 is evaluated accurately near zero (a plain
``exp(w) - 1`` loses all relative precision there).

Cost model: forward reads x and writes y (2E bytes per element of E bytes), in-place the same bytes without the
second allocation; backward reads grad_y and the saved *output* y and writes grad_x (3E). The derivative is
recovered from the output, so an in-place forward keeps working under autograd:
    z > 0  <=>  y * scale > 0   (for any alpha != 0)
    dy/dx = scale * input_scale                     where z > 0
          = input_scale * (y / alpha + scale)        elsewhere  (= scale * input_scale * exp(z / alpha))
"""

from __future__ import annotations

import torch

from ... import _backend
from ..._backend import (
    STREAMING_WARPS,
    Backend,
    backend_for,
    cdiv,
    is_dense,
    new_output_layout_like,
    record_launch,
    streaming_block,
)
from .kernels import celu_bwd_kernel, celu_fwd_kernel
from .reference import torch_celu, torch_celu_backward_from_output

_INTERPRET_BLOCK = 256


def _launch(kernel, n: int, *args, **constexprs) -> None:
    """Launch a flat CELU kernel over n elements with the shared streaming rule (see _backend.streaming_block)."""
    element = args[0]
    block = streaming_block(n, element.element_size(), element.device, _INTERPRET_BLOCK)
    kernel[(cdiv(n, block),)](*args, BLOCK=block, num_warps=STREAMING_WARPS, **constexprs)


def _match_strides(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """t laid out with like's strides (a no-op when they already match)."""
    if t.stride() == like.stride():
        return t
    out = torch.empty_like(like, dtype=t.dtype)
    out.copy_(t)
    return out


def _celu_into(x: torch.Tensor, out: torch.Tensor, alpha: float, scale: float, input_scale: float) -> None:
    """Writes celu(x) into out; both dense with identical strides (out may be x)."""
    n = x.numel()
    if n == 0:
        return
    if backend_for(x) is Backend.TORCH:
        _backend.warn_reference_once("celu")
        compute = _backend.compute_dtype(x.dtype)
        out.copy_(torch_celu(x.to(compute), alpha, scale, input_scale))
        return
    series_degree = 4 if x.element_size() == 2 else 8  # a half-precision output keeps ~11 bits (see kernels._expm1)
    _launch(celu_fwd_kernel, n, x, out, n, alpha, scale, input_scale, SERIES_DEGREE=series_degree)
    record_launch("celu_fwd_kernel")


def celu_forward(x: torch.Tensor, alpha: float, scale: float, input_scale: float) -> torch.Tensor:
    """y = celu(x) (any shape; x's strides when x is dense, else contiguous)."""
    if not is_dense(x):
        x = x.contiguous()  # sliced/overlapping layouts: one copy, then the flat kernel
    y = new_output_layout_like(x)
    _celu_into(x, y, alpha, scale, input_scale)
    return y


def celu_inplace(x: torch.Tensor, alpha: float, scale: float, input_scale: float) -> None:
    """Overwrites x with celu(x): in place when x is dense, else through one out-of-place buffer."""
    if is_dense(x):
        _celu_into(x, x, alpha, scale, input_scale)
    else:
        x.copy_(celu_forward(x, alpha, scale, input_scale))


def celu_backward(
    grad_y: torch.Tensor, y: torch.Tensor, alpha: float, scale: float, input_scale: float
) -> torch.Tensor:
    """grad_x (y's layout when y is dense, else contiguous) from grad_y and the forward's output y."""
    if not is_dense(y):
        y = y.contiguous()
    grad_y = _match_strides(grad_y, y)
    grad_x = new_output_layout_like(y)
    n = y.numel()
    if n == 0:
        return grad_x
    if backend_for(y) is Backend.TORCH:
        _backend.warn_reference_once("celu")
        compute = _backend.compute_dtype(y.dtype)
        grad_x.copy_(torch_celu_backward_from_output(grad_y.to(compute), y.to(compute), alpha, scale, input_scale))
        return grad_x
    _launch(celu_bwd_kernel, n, grad_y, y, grad_x, n, alpha, scale, input_scale)
    record_launch("celu_bwd_kernel")
    return grad_x
