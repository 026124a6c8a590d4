"""Snake1d as torch.library ops (canonical shapes: x [B, C, T], alpha [C] contiguous), with fake implementations
for tracing and the autograd formula (one fused backward kernel for both gradients)."""

from __future__ import annotations

import torch

from ..._backend import on_tensor_device
from .launch import snake_backward, snake_forward


@torch.library.custom_op("sparsefuse::snake", mutates_args=())
@on_tensor_device
def snake_op(x: torch.Tensor, alpha: torch.Tensor, eps: float, fast_sin: bool) -> torch.Tensor:
    return snake_forward(x, alpha, eps, fast_sin)


@snake_op.register_fake
def _(x: torch.Tensor, alpha: torch.Tensor, eps: float, fast_sin: bool) -> torch.Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("sparsefuse::snake_backward", mutates_args=())
@on_tensor_device
def snake_backward_op(
    grad_y: torch.Tensor, x: torch.Tensor, alpha: torch.Tensor, eps: float, fast_sin: bool, need_alpha_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return snake_backward(grad_y, x, alpha, eps, fast_sin, need_alpha_grad)


@snake_backward_op.register_fake
def _(grad_y, x, alpha, eps, fast_sin, need_alpha_grad):
    return x.new_empty(x.shape), alpha.new_empty(alpha.shape)


def _snake_setup_context(ctx, inputs, output) -> None:
    x, alpha, eps, fast_sin = inputs
    ctx.save_for_backward(x, alpha)
    ctx.eps, ctx.fast_sin = eps, fast_sin


def _snake_autograd_backward(ctx, grad_y):
    x, alpha = ctx.saved_tensors
    need_x, need_alpha = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_x, grad_alpha = snake_backward_op(grad_y, x, alpha, ctx.eps, ctx.fast_sin, need_alpha)
    return (grad_x if need_x else None), (grad_alpha if need_alpha else None), None, None


snake_op.register_autograd(_snake_autograd_backward, setup_context=_snake_setup_context)
