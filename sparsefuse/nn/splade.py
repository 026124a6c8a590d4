"""``SpladeHead``: a masked LM's vocabulary projection fused with SPLADE pooling.

    head = SpladeHead.tied_to(mlm.get_output_embeddings())   # shares the decoder's weight and bias Parameters
    reps = head(hidden_states, attention_mask)                # [B, S, H] -> [B, V]

The module holds (or shares) the decoder's parameters and calls :func:`sparsefuse.splade.splade_pool`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..splade import POOLINGS, splade_pool

__all__ = ["SpladeHead"]


class SpladeHead(nn.Module):
    """``pool_s log1p(relu(hidden @ weight.T + bias)) * mask`` -> [B, V] without the [B, S, V] logits.

    Parameters: ``weight`` [vocab_size, hidden_size] and ``bias`` [vocab_size] (None with ``bias=False``), named
    like ``nn.Linear``'s so a decoder's state_dict loads directly. :meth:`tied_to` builds a head that shares an
    existing decoder's Parameter objects (tied weights stay tied; optimisers see one parameter).
    """

    def __init__(
        self, hidden_size: int, vocab_size: int, *, bias: bool = True, pooling: str = "max", device=None, dtype=None
    ) -> None:
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"SpladeHead: pooling must be one of {POOLINGS}; got {pooling!r}")
        self.hidden_size, self.vocab_size, self.pooling = hidden_size, vocab_size, pooling
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(vocab_size, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's initialisation (the decoder this head replaces)
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0.0
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def tied_to(cls, decoder: nn.Linear, *, pooling: str = "max") -> SpladeHead:
        """A head whose ``weight``/``bias`` ARE ``decoder``'s Parameters (no copy), e.g. a masked LM's
        ``get_output_embeddings()``."""
        weight = getattr(decoder, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            raise TypeError(
                f"SpladeHead.tied_to: decoder must be an nn.Linear-like module with a 2-D weight "
                f"Parameter [vocab_size, hidden_size]; got {type(decoder).__name__}"
            )
        bias = getattr(decoder, "bias", None)
        head = cls(weight.shape[1], weight.shape[0], bias=False, pooling=pooling, device="meta")
        head.weight = weight
        head.bias = bias
        return head

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states [B, S, hidden_size], attention_mask [B, S] or None -> [B, vocab_size]."""
        return splade_pool(hidden_states, self.weight, self.bias, attention_mask, pooling=self.pooling)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, bias={self.bias is not None}, "
            f"pooling={self.pooling!r}"
        )
