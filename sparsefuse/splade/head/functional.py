"""The public SPLADE head function, :func:`splade_pool`: argument checks, autocast, then the op (or, in plain eager
inference, the op's body without the dispatcher's overhead)."""

from __future__ import annotations

import torch

from ... import _backend
from ..._validation import SPLADE_DTYPES, SPLADE_POOLINGS, autocast_operands, check_splade_args, check_tensor
from .op import splade_forward, splade_pool_op

__all__ = ["splade_pool", "POOLINGS", "SPLADE_DTYPES"]

POOLINGS = SPLADE_POOLINGS  # ("max", "sum")


def splade_pool(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    pooling: str = "max",
) -> torch.Tensor:
    """SPLADE term weights ``pool_s log1p(relu(hidden @ weight.T + bias)) * mask`` without materialising the
    [batch, seq_len, vocab] logits (see :mod:`sparsefuse.splade.head`).

    Args:
        hidden: [B, S, H] hidden states entering the MLM decoder (after the MLM head's transform), float32,
            float16 or bfloat16.
        weight: [V, H] the decoder's weight (usually tied to the word embeddings), same dtype as hidden.
        bias: [V] the decoder's bias (any float dtype), or None.
        attention_mask: [B, S] (bool, integer or float), or None for all positions. A position whose mask is 0 is
            skipped; any other value keeps it and multiplies its score ``log1p(relu(logit))`` before the pooling
            (0/1 masks: plain SPLADE; weights: ``max_s mask_s * log1p(relu(logit_s))``).
        pooling: "max" (SPLADE v2+, the default) or "sum" (SPLADE v1).

    Returns:
        [B, V] in hidden's dtype. Equal to naver/splade's and sentence-transformers' ``SpladePooling``: masked
        positions contribute 0, so an all-negative column and a fully masked row score 0. Differentiable in hidden,
        weight and bias (max pooling: the gradient, ``mask / (1 + logit)`` times the incoming one, reaches the first
        position of the largest weighted score only, as with torch.max).
        Under autocast, hidden and weight are cast to the autocast dtype (as ``F.linear`` would be).
    """
    name = "splade_pool"
    check_tensor(name, "hidden", hidden)
    check_tensor(name, "weight", weight)
    hidden, weight = autocast_operands(hidden, weight)
    check_splade_args(name, hidden, weight, bias, attention_mask, pooling)
    tensors = [t for t in (hidden, weight, bias, attention_mask) if t is not None]
    if _backend.bypass_dispatcher(*tensors):
        return splade_forward(hidden, weight, bias, attention_mask, pooling, False)[0]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (hidden, weight, bias) if t is not None)
    return splade_pool_op(hidden, weight, bias, attention_mask, pooling, needs_grad)[0]
