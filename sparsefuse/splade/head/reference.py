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
    (values; gradients go to the first maximal position, as torch.max's) or the same with a sum.

    hidden [B, S, H], weight [V, H], bias [V] or None, attention_mask [B, S] or None -> [B, V]."""
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    scores = torch.log1p(torch.relu(logits))
    if attention_mask is not None:
        scores = scores * attention_mask.unsqueeze(-1).to(scores.dtype)
    if pooling == "sum" or hidden.shape[1] == 0:
        return scores.sum(dim=1)
    return torch.max(scores, dim=1).values


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
    logits = h @ w.t()
    if mask is not None:
        logits = logits.masked_fill(mask.unsqueeze(-1) == 0, float("-inf"))
    if hidden.shape[1] == 0:
        top = torch.full((B, V), float("-inf"), dtype=compute, device=hidden.device)
        arg = torch.zeros(B, V, dtype=torch.int64, device=hidden.device)
    else:
        top, arg = torch.max(logits, dim=1)
    m = top + (b if b is not None else 0.0)
    slope = torch.where(m > 0, 1.0 / (1.0 + m.clamp_min(0)), torch.zeros_like(m))
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
    logits = h @ w.t()
    if bias is not None:
        logits = logits + bias.to(compute)
    keep = (mask != 0).unsqueeze(-1) if mask is not None else torch.ones_like(logits, dtype=torch.bool)
    if pooling == "sum":
        dlogit = torch.where(keep & (logits > 0), g.unsqueeze(1) / (1 + logits.clamp_min(0)), 0.0)
    else:  # the whole gradient goes to the first maximal unmasked position
        top, first = torch.max(logits.masked_fill(~keep, float("-inf")), dim=1)
        slope = torch.where(top > 0, 1 / (1 + top.clamp_min(0)), 0.0)
        dlogit = torch.zeros_like(logits).scatter_(1, first.unsqueeze(1), (g * slope).unsqueeze(1))
    return (
        (dlogit @ w).to(hidden.dtype) if need_hidden else None,
        torch.einsum("bsv,bsh->vh", dlogit, h).to(weight.dtype) if need_weight else None,
        dlogit.sum(dim=(0, 1)).to(bias.dtype) if need_bias else None,
    )
