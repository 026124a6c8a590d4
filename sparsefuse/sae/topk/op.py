"""``sparsefuse::topk_encode``: the TopK encode as a custom op, with its fake impl and autograd.

Autograd: gradients for x, W_enc, b_enc and b_dec (the backward scatters the k gradients into a dense
[M, d_sae] buffer and uses dense matmuls, like the dense encode's backward); ``feature_scale`` gets none."""

from __future__ import annotations

import torch

from ... import _backend
from ..._backend import Backend, backend_for, compute_dtype, next_power_of_2, on_tensor_device
from .keys import _topk_keys_torch, _unpack_keys
from .launch import MAX_KERNEL_K, launch_topk_keys


def _topk_encode(
    x2: torch.Tensor,
    W_enc: torch.Tensor,
    b_enc: torch.Tensor,
    b_dec: torch.Tensor | None,
    feature_scale: torch.Tensor | None,
    k: int,
    relu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    # -> (top_acts [M, k], top_indices [M, k] int64)
    if x2.shape[0] == 0:
        keys = torch.zeros(0, k, dtype=torch.int64, device=x2.device)
    elif backend_for(x2) is Backend.TORCH or next_power_of_2(k) > MAX_KERNEL_K:
        if backend_for(x2) is Backend.TORCH:
            _backend.warn_reference_once("topk_encode")
        keys = _topk_keys_torch(x2, W_enc, b_enc, b_dec, feature_scale, k)
    else:
        keys = launch_topk_keys(x2, W_enc, b_enc, b_dec, feature_scale, k)
    indices, values = _unpack_keys(keys)
    return (values.relu() if relu else values).to(x2.dtype), indices


# The op returns (top_acts, top_indices): the differentiable output first (opcheck's autograd test sums the outputs
# into the first one's dtype); the functional API returns them the other way round, like torch.topk's pair.
@torch.library.custom_op("sparsefuse::topk_encode", mutates_args=())
@on_tensor_device
def topk_encode_op(
    x: torch.Tensor,
    W_enc: torch.Tensor,
    b_enc: torch.Tensor,
    b_dec: torch.Tensor | None,
    feature_scale: torch.Tensor | None,
    k: int,
    relu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _topk_encode(x, W_enc, b_enc, b_dec, feature_scale, k, relu)


@topk_encode_op.register_fake
def _(x, W_enc, b_enc, b_dec, feature_scale, k, relu):
    M = x.shape[0]
    return x.new_empty((M, k)), x.new_empty((M, k), dtype=torch.int64)


def _topk_setup(ctx, inputs, output) -> None:
    x, W_enc, b_enc, b_dec, feature_scale, k, relu = inputs
    acts, indices = output
    ctx.relu = relu
    ctx.mark_non_differentiable(indices)
    ctx.save_for_backward(x, W_enc, b_enc, b_dec, feature_scale, indices, acts)


def _topk_backward(ctx, grad_acts, grad_indices):
    x, W_enc, b_enc, b_dec, feature_scale, indices, acts = ctx.saved_tensors
    need_x, need_w, need_b_enc, need_b_dec = ctx.needs_input_grad[:4]
    dtype = compute_dtype(x.dtype)
    grad_pre = grad_acts.to(dtype)
    if ctx.relu:
        grad_pre = grad_pre * (acts > 0)
    if feature_scale is not None:
        grad_pre = grad_pre * feature_scale.to(dtype)[indices]
    # Selected features are distinct within a row, so a scatter (not an add) places each gradient.
    dense = grad_pre.new_zeros(x.shape[0], W_enc.shape[1]).scatter_(1, indices, grad_pre)  # [M, d_sae]
    grad_x = grad_w = grad_b_enc = grad_b_dec = None
    if need_x or need_b_dec:
        grad_sae_in = dense @ W_enc.to(dtype).t()
        grad_x = grad_sae_in.to(x.dtype) if need_x else None
        grad_b_dec = (-grad_sae_in.sum(0)).to(b_dec.dtype) if need_b_dec else None
    if need_w:
        sae_in = x if b_dec is None else (x.to(dtype) - b_dec.to(dtype)).to(x.dtype)
        grad_w = (sae_in.to(dtype).t() @ dense).to(W_enc.dtype)
    if need_b_enc:
        grad_b_enc = dense.sum(0).to(b_enc.dtype)
    return grad_x, grad_w, grad_b_enc, grad_b_dec, None, None, None


topk_encode_op.register_autograd(_topk_backward, setup_context=_topk_setup)
