"""SPLADE vectors from a plain ``transformers`` masked LM (``AutoModelForMaskedLM``) with the fused head.

    from transformers import AutoModelForMaskedLM
    from sparsefuse.integrations.transformers_mlm import SpladeEncoderForMaskedLM

    mlm = AutoModelForMaskedLM.from_pretrained("naver/splade-v3")
    encoder = SpladeEncoderForMaskedLM(mlm)          # pooling="max"
    reps = encoder(input_ids, attention_mask)          # [B, vocab]: no [B, S, vocab] logits in memory

The vocabulary projection is the model's ``get_output_embeddings()`` -- an ``nn.Linear`` [vocab, hidden] applied
last (BERT, DistilBERT, RoBERTa/XLM-R, ModernBERT, ...). For the duration of a call it is made to pass its input
through (an instance attribute shadows its ``forward``), so the model's own code computes everything up to the
projection -- embeddings, encoder, the MLM head's transform -- and its "logits" output carries the hidden states
the projection would have read; :func:`sparsefuse.splade.splade_pool` then applies the projection fused with the
SPLADE pooling. The model's parameters, state_dict and ordinary forward are untouched outside the call.
The module does not import transformers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..splade import POOLINGS, splade_pool

__all__ = ["vocabulary_projection", "projection_bypassed", "splade_encode", "SpladeEncoderForMaskedLM"]

_BYPASS_ATTR = "_sparsefuse_projection_bypassed"


def vocabulary_projection(model: nn.Module) -> nn.Linear:
    """The masked LM's output projection (``get_output_embeddings()``), checked to be a Linear-like module with a
    2-D ``weight`` [vocab, hidden]."""
    get = getattr(model, "get_output_embeddings", None)
    decoder = get() if callable(get) else None
    weight = getattr(decoder, "weight", None)
    if not isinstance(decoder, nn.Module) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(
            f"sparsefuse: {type(model).__name__} has no nn.Linear-like output projection "
            "(get_output_embeddings() with a [vocab, hidden] weight); expected a transformers masked "
            "LM such as BertForMaskedLM"
        )
    return decoder


def _pass_through(hidden_states: torch.Tensor) -> torch.Tensor:
    return hidden_states


def bypass_projection(decoder: nn.Module) -> None:
    """Make ``decoder`` return its input (an instance-level ``forward``; parameters and state_dict unchanged)."""
    # A plain module-level function, not a bound method: pickle stores a bound method as getattr(instance, its
    # function's name), which the module lacks, so a bypassed model would fail torch.load.
    decoder.forward = _pass_through
    decoder.__dict__[_BYPASS_ATTR] = True


def restore_projection(decoder: nn.Module) -> None:
    if decoder.__dict__.pop(_BYPASS_ATTR, False):
        del decoder.forward


def is_bypassed(decoder: nn.Module) -> bool:
    return bool(decoder.__dict__.get(_BYPASS_ATTR, False))


@contextlib.contextmanager
def projection_bypassed(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, ``model(...)``'s logits are the hidden states entering the vocabulary projection (which is
    yielded). Not thread-safe: other threads calling the same model see the bypass too."""
    decoder = vocabulary_projection(model)
    if is_bypassed(decoder):  # already bypassed (nested use, or a model patched for sentence-transformers)
        yield decoder
        return
    bypass_projection(decoder)
    try:
        yield decoder
    finally:
        restore_projection(decoder)


def _logits_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    logits = output["logits"] if isinstance(output, dict) or hasattr(output, "keys") else output[0]
    return logits


def splade_encode(
    model: nn.Module,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    pooling: str = "max",
    **model_kwargs: Any,
) -> torch.Tensor:
    """SPLADE term weights [B, vocab] of a transformers masked LM, computed with the fused head.

    Equals naver/splade's ``torch.max(log1p(relu(model(...).logits)) * attention_mask[..., None], dim=1).values``
    (``pooling="sum"``: the sum) without the [B, S, vocab] logits. Extra keyword arguments (``token_type_ids``,
    ``inputs_embeds``, ...) go to the model. Differentiable.
    """
    if pooling not in POOLINGS:
        raise ValueError(f"splade_encode: pooling must be one of {POOLINGS}; got {pooling!r}")
    with projection_bypassed(model) as decoder:
        output = model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True, **model_kwargs)
    hidden = _logits_of(output)
    return splade_pool(hidden, decoder.weight, getattr(decoder, "bias", None), attention_mask, pooling=pooling)


class SpladeEncoderForMaskedLM(nn.Module):
    """A SPLADE encoder around a transformers masked LM: ``forward(input_ids, attention_mask, **kwargs)`` ->
    [B, vocab] (see :func:`splade_encode`). The wrapped model stays usable as a masked LM (``.model``)."""

    def __init__(self, model: nn.Module, *, pooling: str = "max") -> None:
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"SpladeEncoderForMaskedLM: pooling must be one of {POOLINGS}; got {pooling!r}")
        vocabulary_projection(model)  # fail early on a model without one
        self.model, self.pooling = model, pooling

    def forward(
        self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, **model_kwargs: Any
    ) -> torch.Tensor:
        return splade_encode(self.model, input_ids, attention_mask, pooling=self.pooling, **model_kwargs)

    def extra_repr(self) -> str:
        return f"pooling={self.pooling!r}"
