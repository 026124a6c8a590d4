"""Plain-torch rotary position embedding: transformers' ``apply_rotary_pos_emb`` (the float64-capable ground truth)
and its backward, as the kernels compute them.

Shapes (``unsqueeze_dim=1``, Llama's layout): q [B, H, S, hd], k [B, Hkv, S, hd], cos and sin [B or 1, S, hd];
``unsqueeze_dim=2``: q [B, S, H, hd], k [B, S, Hkv, hd].
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` over the last dim, x1 and x2 its two halves (transformers' ``rotate_half``)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_half_transposed(u: torch.Tensor) -> torch.Tensor:
    """The transpose of :func:`rotate_half` as a linear map: ``cat(u2, -u1)``."""
    half = u.shape[-1] // 2
    return torch.cat((u[..., half:], -u[..., :half]), dim=-1)


def torch_apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_embed, k_embed) = (q * cos + rotate_half(q) * sin, same for k), cos and sin unsqueezed at unsqueeze_dim;
    computed in the inputs' (promoted) dtype, rounding after every operation as transformers does."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def torch_rotary_backward(
    grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of q, grad of k) in the grads' shapes, cos and sin held constant: ``g * cos + rotate_half^T(g * sin)``."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (
        grad_q * cos + rotate_half_transposed(grad_q * sin),
        grad_k * cos + rotate_half_transposed(grad_k * sin),
    )


def torch_apply_rotary_pos_emb_rounded_once(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`torch_apply_rotary_pos_emb` computed in float32 (float64 when any input is float64) and rounded once to
    the promoted dtype: the kernels' numbers, differentiable in all four inputs (the fallback when cos or sin
    requires grad)."""
    out_dtype = torch.promote_types(q.dtype, cos.dtype)
    compute = torch.float64 if out_dtype == torch.float64 else torch.float32
    q_out, k_out = torch_apply_rotary_pos_emb(
        q.to(compute), k.to(compute), cos.to(compute), sin.to(compute), unsqueeze_dim
    )
    return q_out.to(out_dtype), k_out.to(out_dtype)
