"""RMSNorm as torch.library ops (forward, backward) with fake implementations and the autograd rule, and the
same rule as an ``autograd.Function`` for plain eager calls (which skip the dispatcher's host cost)."""

from __future__ import annotations

import torch

from ..._backend import compute_dtype, on_tensor_device
from ..._validation import unit_last_stride
from .launch import out_dtype, rms_norm_backward, rms_norm_forward

# The launchers with the tensors' GPU made current (as the ops are), wrapped once: the eager twin calls these.
_forward_on_device = on_tensor_device(rms_norm_forward)
_backward_on_device = on_tensor_device(rms_norm_backward)


@torch.library.custom_op("sparsefuse::rms_norm_fwd", mutates_args=())
@on_tensor_device
def rms_norm_fwd_op(x2: torch.Tensor, weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [M, D], rstd [M]) for x2 [M, D] and weight [D] or None."""
    return rms_norm_forward(x2, weight, eps)


@rms_norm_fwd_op.register_fake
def _(x2, weight, eps):
    M, D = x2.shape
    return x2.new_empty((M, D), dtype=out_dtype(x2, weight)), x2.new_empty((M,), dtype=compute_dtype(x2.dtype))


@torch.library.custom_op("sparsefuse::rms_norm_bwd", mutates_args=())
@on_tensor_device
def rms_norm_bwd_op(
    grad_y: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x [M, D], grad_weight [D]; empty without a weight)."""
    return rms_norm_backward(grad_y, x2, weight, rstd)


@rms_norm_bwd_op.register_fake
def _(grad_y, x2, weight, rstd):
    return torch.empty_like(x2), torch.empty_like(weight) if weight is not None else x2.new_empty(0)


def _setup_context(ctx, inputs, output) -> None:
    x2, weight, _ = inputs
    ctx.save_for_backward(x2, weight, output[1])
    ctx.mark_non_differentiable(output[1])


def _backward_with(backward, ctx, grad_y, _grad_rstd):
    x2, weight, rstd = ctx.saved_tensors
    grad_y = unit_last_stride(grad_y)
    grad_x, grad_w = backward(grad_y, x2, weight, rstd)
    return grad_x, grad_w if weight is not None and ctx.needs_input_grad[1] else None, None


def _backward(ctx, grad_y, grad_rstd):
    return _backward_with(rms_norm_bwd_op, ctx, grad_y, grad_rstd)


rms_norm_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class EagerRMSNorm(torch.autograd.Function):
    """The ops' computation and autograd rule for plain eager calls that need gradients: a custom op with autograd
    costs a few tens of microseconds of host time per call, paid twice per norm, ~50 times per Llama step."""

    @staticmethod
    def forward(ctx, x2, weight, eps):
        y, rstd = _forward_on_device(x2, weight, eps)
        _setup_context(ctx, (x2, weight, eps), (y, rstd))
        ctx.set_materialize_grads(False)  # rstd gets no gradient: no zeros kernel for it in every backward
        return y, rstd

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y, grad_rstd):
        if grad_y is None:  # y itself took no part in the loss
            return None, None, None
        # traced (compiled autograd over an eager forward): the opaque op
        backward = rms_norm_bwd_op if torch.compiler.is_compiling() else _backward_on_device
        return _backward_with(backward, ctx, grad_y, grad_rstd)
