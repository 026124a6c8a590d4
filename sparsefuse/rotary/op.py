"""Rotary position embedding as torch.library ops (forward and backward, each one launch for q and k), with fakes
for tracing and the autograd formulas, plus ``torch.autograd.Function`` twins that plain eager calls use to skip the
dispatcher.

The backward is linear in the gradients (cos and sin are constants), and its own derivative is the forward
rotation, so each op's autograd is the other op: double backward works too.
"""

from __future__ import annotations

import torch

from .._backend import empty_layout_like, on_tensor_device, plain_eager_call
from .launch import rotary_backward, rotary_forward

# The launchers with the tensors' GPU made current (as the ops are): the eager twins call these.
_forward_on_device = on_tensor_device(rotary_forward)
_backward_on_device = on_tensor_device(rotary_backward)


@torch.library.custom_op("sparsefuse::rotary_fwd", mutates_args=())
@on_tensor_device
def rotary_fwd_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return rotary_forward(q, k, cos, sin, unsqueeze_dim)


@rotary_fwd_op.register_fake
def _(q, k, cos, sin, unsqueeze_dim):
    dtype = torch.promote_types(q.dtype, cos.dtype)
    return empty_layout_like(q, dtype), empty_layout_like(k, dtype)


@torch.library.custom_op("sparsefuse::rotary_bwd", mutates_args=())
@on_tensor_device
def rotary_bwd_op(
    grad_q: torch.Tensor,
    grad_k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int,
    grad_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    return rotary_backward(grad_q, grad_k, cos, sin, unsqueeze_dim, grad_dtype)


@rotary_bwd_op.register_fake
def _(grad_q, grad_k, cos, sin, unsqueeze_dim, grad_dtype):
    return empty_layout_like(grad_q, grad_dtype), empty_layout_like(grad_k, grad_dtype)


# --- autograd: cos and sin are constants (transformers computes them under no_grad); the functional API takes the
# differentiable torch formula when either requires grad, so these rules return no gradient for them.


def _fwd_setup_context(ctx, inputs, output) -> None:
    q, _, cos, sin, ctx.unsqueeze_dim = inputs
    ctx.save_for_backward(cos, sin)
    ctx.grad_dtype = q.dtype


def _fwd_autograd_backward(ctx, grad_q, grad_k):
    cos, sin = ctx.saved_tensors
    dq, dk = rotary_bwd_op(grad_q, grad_k, cos, sin, ctx.unsqueeze_dim, ctx.grad_dtype)
    need_q, need_k = ctx.needs_input_grad[:2]
    return (dq if need_q else None), (dk if need_k else None), None, None, None


def _bwd_setup_context(ctx, inputs, output) -> None:
    _, _, cos, sin, ctx.unsqueeze_dim, _ = inputs
    ctx.save_for_backward(cos, sin)


def _bwd_autograd_backward(ctx, grad_dq, grad_dk):
    cos, sin = ctx.saved_tensors  # d(backward)/d(grad) applied to grad_dq is the forward rotation
    gq, gk = rotary_fwd_op(grad_dq, grad_dk, cos, sin, ctx.unsqueeze_dim)
    need_q, need_k = ctx.needs_input_grad[:2]
    return (gq if need_q else None), (gk if need_k else None), None, None, None, None


rotary_fwd_op.register_autograd(_fwd_autograd_backward, setup_context=_fwd_setup_context)
rotary_bwd_op.register_autograd(_bwd_autograd_backward, setup_context=_bwd_setup_context)


# --- eager twins --------------------------------------------------------------------------------------------------


class EagerRotary(torch.autograd.Function):
    """:data:`rotary_fwd_op` with its autograd for plain eager calls (same launchers, same numbers): a torch.library
    op with autograd costs ~0.2 ms of host time per call (dispatcher, autograd wrapper, alias checks), which a
    training step pays once per attention layer."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim):
        q_out, k_out = _forward_on_device(q, k, cos, sin, unsqueeze_dim)
        ctx.save_for_backward(cos, sin)
        ctx.unsqueeze_dim, ctx.grad_dtype = unsqueeze_dim, q.dtype
        return q_out, k_out

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        dq, dk = rotary_backward_autograd(grad_q, grad_k, cos, sin, ctx.unsqueeze_dim, ctx.grad_dtype)
        return dq, dk, None, None, None


class EagerRotaryGrad(torch.autograd.Function):
    """:data:`rotary_bwd_op` with its autograd for plain eager calls (reached only by double backward)."""

    @staticmethod
    def forward(ctx, grad_q, grad_k, cos, sin, unsqueeze_dim, grad_dtype):
        ctx.save_for_backward(cos, sin)
        ctx.unsqueeze_dim = unsqueeze_dim
        return _backward_on_device(grad_q, grad_k, cos, sin, unsqueeze_dim, grad_dtype)

    @staticmethod
    def backward(ctx, grad_dq, grad_dk):
        cos, sin = ctx.saved_tensors
        gq, gk = rotary_forward_autograd(grad_dq, grad_dk, cos, sin, ctx.unsqueeze_dim)
        return gq, gk, None, None, None, None


def rotary_forward_autograd(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward with autograd: :class:`EagerRotary` in a plain eager call, else the op (torch.compile, tensor
    subclasses, dispatch modes, functorch transforms, compiled autograd tracing a backward)."""
    if plain_eager_call(q, k, cos, sin):
        return EagerRotary.apply(q, k, cos, sin, unsqueeze_dim)
    return rotary_fwd_op(q, k, cos, sin, unsqueeze_dim)


def rotary_backward_autograd(
    grad_q: torch.Tensor,
    grad_k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int,
    grad_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward as the forward's autograd rule runs it: the launcher when no graph of the backward is being
    built, :class:`EagerRotaryGrad` for double backward, the op where the dispatcher is needed."""
    if not plain_eager_call(grad_q, grad_k, cos, sin):
        return rotary_bwd_op(grad_q, grad_k, cos, sin, unsqueeze_dim, grad_dtype)
    if torch.is_grad_enabled() and (grad_q.requires_grad or grad_k.requires_grad):
        return EagerRotaryGrad.apply(grad_q, grad_k, cos, sin, unsqueeze_dim, grad_dtype)
    return _backward_on_device(grad_q, grad_k, cos, sin, unsqueeze_dim, grad_dtype)
