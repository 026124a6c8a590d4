"""Activation modules whose parameters and ``state_dict`` keys match the modules users already have."""

from __future__ import annotations

import torch
from torch import nn

from ..activations.celu import celu, celu_
from ..activations.snake import snake


class Snake1d(nn.Module):
    """Snake activation with one learnable alpha per channel; a drop-in for DAC's and SNAC's ``Snake1d``.

    ``alpha`` is a Parameter of shape [1, C, 1] initialised to ones, so their ``state_dict`` loads as is.
    Input [B, C, T] (or [B, C, *]); output of the same shape and dtype.
    """

    def __init__(self, channels: int, *, fast_sin: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1, device=device, dtype=dtype))
        self.fast_sin = fast_sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return snake(x, self.alpha, fast_sin=self.fast_sin)

    def extra_repr(self) -> str:
        return f"channels={self.alpha.shape[1]}" + (", fast_sin=True" if self.fast_sin else "")


class CELU(nn.Module):
    """Drop-in for ``torch.nn.CELU`` (same arguments), plus ``scale`` and ``input_scale``."""

    def __init__(self, alpha: float = 1.0, inplace: bool = False, *, scale: float = 1.0, input_scale: float = 1.0):
        super().__init__()
        self.alpha, self.inplace, self.scale, self.input_scale = alpha, inplace, scale, input_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fn = celu_ if self.inplace else celu
        return fn(x, self.alpha, self.scale, self.input_scale)

    def extra_repr(self) -> str:
        s = f"alpha={self.alpha}" + (", inplace=True" if self.inplace else "")
        if self.scale != 1.0 or self.input_scale != 1.0:
            s += f", scale={self.scale}, input_scale={self.input_scale}"
        return s
