"""CELU as torch.library ops (out of place, in place, backward), with fake implementations for tracing and the
autograd formula, which saves the forward's output rather than its input (see :mod:`.launch`)."""

from __future__ import annotations

import torch

from ..._backend import empty_layout_like, on_tensor_device
from .launch import celu_backward, celu_forward, celu_inplace


@torch.library.custom_op("sparsefuse::celu", mutates_args=())
@on_tensor_device
def celu_op(x: torch.Tensor, alpha: float, scale: float, input_scale: float) -> torch.Tensor:
    return celu_forward(x, alpha, scale, input_scale)


@celu_op.register_fake
def _(x, alpha, scale, input_scale):
    return empty_layout_like(x)


@torch.library.custom_op("sparsefuse::celu_", mutates_args=("x",))
@on_tensor_device
def celu_inplace_op(x: torch.Tensor, alpha: float, scale: float, input_scale: float) -> None:
    celu_inplace(x, alpha, scale, input_scale)


@celu_inplace_op.register_fake
def _(x, alpha, scale, input_scale) -> None:
    return None


@torch.library.custom_op("sparsefuse::celu_backward", mutates_args=())
@on_tensor_device
def celu_backward_op(
    grad_y: torch.Tensor, y: torch.Tensor, alpha: float, scale: float, input_scale: float
) -> torch.Tensor:
    return celu_backward(grad_y, y, alpha, scale, input_scale)


@celu_backward_op.register_fake
def _(grad_y, y, alpha, scale, input_scale):
    return empty_layout_like(y)


def _celu_setup_context(ctx, inputs, output) -> None:
    _, ctx.alpha, ctx.scale, ctx.input_scale = inputs
    ctx.save_for_backward(output)  # the derivative is recovered from y (see launch's docstring)


def _celu_autograd_backward(ctx, grad_y):
    (y,) = ctx.saved_tensors
    return celu_backward_op(grad_y, y, ctx.alpha, ctx.scale, ctx.input_scale), None, None, None


celu_op.register_autograd(_celu_autograd_backward, setup_context=_celu_setup_context)
