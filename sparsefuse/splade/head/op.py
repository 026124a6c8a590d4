"""The SPLADE head's ``torch.library`` ops (``sparsefuse::splade_pool`` and its backward), their fake (meta)
implementations and the autograd registration.

The ops' bodies, :func:`splade_forward` and :func:`splade_backward`, resolve the backend once per call: CPU tensors
without the interpreter run the plain-torch reference (:mod:`.reference`), everything else the kernels
(:mod:`.launch`). The functional API's eager fast path calls :func:`splade_forward` directly."""

from __future__ import annotations

import torch

from ... import _backend
from ..._backend import Backend, backend_for, on_tensor_device
from .launch import launch_splade_backward, launch_splade_forward
from .reference import reference_backward, reference_forward

__all__ = ["splade_pool_op", "splade_pool_backward_op", "splade_forward", "splade_backward"]


def splade_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    pooling: str,
    save_aux: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [B, V] in hidden's dtype, argmax [B, V] int32, slope [B, V] fp32); argmax/slope are empty unless
    max pooling with save_aux."""
    if backend_for(hidden) is Backend.TORCH:
        _backend.warn_reference_once("splade_pool")
        return reference_forward(hidden, weight, bias, mask, pooling, save_aux)
    return launch_splade_forward(hidden, weight, bias, mask, pooling, save_aux)


def splade_backward(
    grad: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    argmax: torch.Tensor,
    slope: torch.Tensor,
    pooling: str,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(grad_hidden [B, S, H] | None, grad_weight [V, H] | None, grad_bias [V] | None)."""
    need_bias = need_bias and bias is not None
    if backend_for(hidden) is Backend.TORCH:
        _backend.warn_reference_once("splade_pool")
        return reference_backward(grad, hidden, weight, bias, mask, pooling, need_hidden, need_weight, need_bias)
    B, S, H = hidden.shape
    if H == 0 and B * S * weight.shape[0] > 0:  # logits = bias: the kernels have no hidden dimension to tile
        return reference_backward(grad, hidden, weight, bias, mask, pooling, need_hidden, need_weight, need_bias)
    return launch_splade_backward(
        grad, hidden, weight, bias, mask, argmax, slope, pooling, need_hidden, need_weight, need_bias
    )


@torch.library.custom_op("sparsefuse::splade_pool", mutates_args=())
@on_tensor_device
def splade_pool_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    pooling: str,
    save_for_backward: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [B, V], argmax [B, V] int32, slope [B, V] fp32); the last two are empty unless max pooling with
    save_for_backward (they are what the backward needs, computed by the same kernel)."""
    return splade_forward(hidden, weight, bias, attention_mask, pooling, save_for_backward)


@splade_pool_op.register_fake
def _(hidden, weight, bias, attention_mask, pooling, save_for_backward):
    B, V = hidden.shape[0], weight.shape[0]
    aux_shape = (B, V) if save_for_backward and pooling == "max" else (0,)
    return (
        hidden.new_empty((B, V)),
        hidden.new_empty(aux_shape, dtype=torch.int32),
        hidden.new_empty(aux_shape, dtype=torch.float32),
    )


@torch.library.custom_op("sparsefuse::splade_pool_backward", mutates_args=())
@on_tensor_device
def splade_pool_backward_op(
    grad: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    argmax: torch.Tensor,
    slope: torch.Tensor,
    pooling: str,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight, grad_bias); a gradient that was not asked for is an empty tensor."""
    gh, gw, gb = splade_backward(
        grad, hidden, weight, bias, attention_mask, argmax, slope, pooling, need_hidden, need_weight, need_bias
    )
    return (
        gh if gh is not None else hidden.new_empty(0),
        gw if gw is not None else weight.new_empty(0),
        gb if gb is not None else hidden.new_empty(0),
    )


@splade_pool_backward_op.register_fake
def _(grad, hidden, weight, bias, attention_mask, argmax, slope, pooling, need_hidden, need_weight, need_bias):
    need_bias = need_bias and bias is not None
    return (
        hidden.new_empty(hidden.shape if need_hidden else (0,)),
        weight.new_empty(weight.shape if need_weight else (0,)),
        bias.new_empty(bias.shape) if need_bias else hidden.new_empty(0),
    )


def _splade_setup_context(ctx, inputs, output) -> None:
    hidden, weight, bias, attention_mask, pooling, _ = inputs
    _, argmax, slope = output
    ctx.pooling = pooling
    ctx.save_for_backward(hidden, weight, bias, attention_mask, argmax, slope)


def _splade_autograd_backward(ctx, grad_out, _grad_argmax, _grad_slope):
    hidden, weight, bias, attention_mask, argmax, slope = ctx.saved_tensors
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    need_bias = need_bias and bias is not None
    gh, gw, gb = splade_pool_backward_op(
        grad_out, hidden, weight, bias, attention_mask, argmax, slope, ctx.pooling, need_hidden, need_weight, need_bias
    )
    return (gh if need_hidden else None, gw if need_weight else None, gb if need_bias else None, None, None, None)


splade_pool_op.register_autograd(_splade_autograd_backward, setup_context=_splade_setup_context)
