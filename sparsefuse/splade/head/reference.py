"""The SPLADE head in plain torch: the ground truth of the tests (float64-capable) and the CPU fallback of the op.

Every function here materialises the [B, S, V] logits; the fused kernels exist to avoid exactly that."""

from __future__ import annotations

import torch

from ... import _backend

__all__ = ["torch_splade_pool", "reference_forward", "reference_backward"]


def torch_splade_pool(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    pooling: str = "max",
) -> torch.Tensor:
    """naver/splade's expression in hidden's dtype: ``torch.max(log1p(relu(logits)) * mask[..., None], dim=1)``
    (values; gradients go to the first maximal position, as torch.max's) or the same with a sum, where positions
    whose mask is 0 are skipped rather than multiplied by 0 (their NaN or inf logits would leak through ``0 * x``).
    The max over no kept position is 0.

    hidden [B, S, H], weight [V, H], bias [V] or None, attention_mask [B, S] or None -> [B, V]."""
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    scores = torch.log1p(torch.relu(logits))
    if attention_mask is None:
        return scores.sum(dim=1) if pooling == "sum" or hidden.shape[1] == 0 else torch.max(scores, dim=1).values
    weights = attention_mask.unsqueeze(-1).to(scores.dtype)  # [B, S, 1]
    kept = attention_mask.unsqueeze(-1) != 0
    if pooling == "sum" or hidden.shape[1] == 0:
        return torch.where(kept, scores * weights, 0.0).sum(dim=1)
    top = torch.max(torch.where(kept, scores * weights, float("-inf")), dim=1).values
    return torch.where(kept.any(dim=1), top, 0.0)


def _weighted_max(logits: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Max pooling's argmax [B, V] (first position of the largest weighted score; 0 for a fully masked row) and the
    derivative there, ``mask / (1 + logit)`` for a positive logit and 0 otherwise, from logits [B, S, V]."""
    scores = torch.log1p(torch.relu(logits))
    weights = torch.ones_like(logits[..., :1]) if mask is None else mask.unsqueeze(-1).to(logits.dtype)
    if mask is not None:
        scores = torch.where(weights != 0, scores * weights, float("-inf"))
    arg = torch.max(scores, dim=1).indices  # [B, V]
    x = torch.gather(logits, 1, arg.unsqueeze(1)).squeeze(1)
    c = torch.gather(weights.expand_as(logits), 1, arg.unsqueeze(1)).squeeze(1)
    return arg, torch.where((x > 0) & (c != 0), c / (1 + x.clamp_min(0)), 0.0)


def _no_aux(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=like.device)


def reference_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    pooling: str,
    save_aux: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the forward kernels return, computed in fp32 (float64 for float64 inputs): (out [B, V] in hidden's
    dtype, argmax [B, V] int32, slope [B, V] fp32); argmax/slope are empty unless max pooling with save_aux."""
    compute = _backend.compute_dtype(hidden.dtype)
    h, w = hidden.to(compute), weight.to(compute)
    b = bias.to(compute) if bias is not None else None
    out = torch_splade_pool(h, w, b, mask, pooling).to(hidden.dtype)
    B, V = hidden.shape[0], weight.shape[0]
    if not (save_aux and pooling == "max"):
        return out, _no_aux(hidden, torch.int32), _no_aux(hidden, torch.float32)
    if hidden.shape[1] == 0:
        return out, torch.zeros(B, V, dtype=torch.int32, device=hidden.device), out.new_zeros(B, V).float()
    logits = h @ w.t()
    if b is not None:
        logits = logits + b
    arg, slope = _weighted_max(logits, mask)
    return out, arg.to(torch.int32), slope.float()


def reference_backward(
    grad: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    pooling: str,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(grad_hidden [B, S, H] | None, grad_weight [V, H] | None, grad_bias [V] | None) through dense [B, S, V]
    logits, by explicit formulas: an op's implementation runs below autograd, so it cannot differentiate
    :func:`torch_splade_pool`."""
    compute = _backend.compute_dtype(hidden.dtype)
    h, w, g = hidden.to(compute), weight.to(compute), grad.to(compute)
    if mask is not None:  # masked rows get no gradient, and their NaN would survive dlogit's zeros (0 * NaN)
        h = h.masked_fill((mask == 0).unsqueeze(-1), 0.0)
    logits = h @ w.t()
    if bias is not None:
        logits = logits + bias.to(compute)
    if pooling == "sum":
        weights = mask.unsqueeze(-1).to(compute) if mask is not None else torch.ones_like(logits[..., :1])
        slope = torch.where((weights != 0) & (logits > 0), weights / (1 + logits.clamp_min(0)), 0.0)
        dlogit = g.unsqueeze(1) * slope
    else:  # the whole gradient goes to the first maximal kept position
        first, slope = _weighted_max(logits, mask)
        dlogit = torch.zeros_like(logits).scatter_(1, first.unsqueeze(1), (g * slope).unsqueeze(1))
    return (
        (dlogit @ w).to(hidden.dtype) if need_hidden else None,
        torch.einsum("bsv,bsh->vh", dlogit, h).to(weight.dtype) if need_weight else None,
        dlogit.sum(dim=(0, 1)).to(bias.dtype) if need_bias else None,
    )
