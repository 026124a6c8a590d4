"""Plain-torch Snake: the float64-capable ground truth, exactly the DAC/SNAC expression, and the closed-form
gradients the backward kernel computes."""

from __future__ import annotations

import torch

from ..._validation import check_snake_shape


def torch_snake(x: torch.Tensor, alpha: torch.Tensor, eps: float = 1e-9) -> torch.Tensor:
    """Plain-torch Snake: ``x + (alpha + eps).reciprocal() * sin(alpha * x) ** 2`` in x's dtype.

    x [B, C, *] or [C, T]; alpha [C] or [1, C, 1]."""
    rows = check_snake_shape(x.shape)
    x3 = x.reshape(rows)
    a = alpha.reshape(1, -1, 1)
    return (x3 + (a + eps).reciprocal() * torch.sin(a * x3).pow(2)).reshape(x.shape)


def torch_snake_backward(
    grad_y: torch.Tensor, x: torch.Tensor, alpha: torch.Tensor, eps: float = 1e-9
) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form gradients of ``torch_snake`` w.r.t. x (x's shape) and alpha ([C]), in the inputs' dtype."""
    rows = check_snake_shape(x.shape)
    x3, g3 = x.reshape(rows), grad_y.reshape(rows)
    a = alpha.reshape(1, -1, 1)
    inv = (a + eps).reciprocal()
    s, c = torch.sin(a * x3), torch.cos(a * x3)
    sin2 = 2 * s * c
    grad_x = g3 * (1 + a * inv * sin2)
    grad_alpha = (g3 * (x3 * inv * sin2 - s * s * inv * inv)).sum(dim=(0, 2))
    return grad_x.reshape(x.shape), grad_alpha
