"""Plain-torch CELU with scale and input_scale: the float64-capable ground truth, and the backward recovered from
the forward's output that the backward kernel computes."""

from __future__ import annotations

import torch


def torch_celu(x: torch.Tensor, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0) -> torch.Tensor:
    """``scale * where(z > 0, z, alpha * expm1(z / alpha))`` with ``z = x * input_scale``; any shape."""
    z = x * input_scale
    return scale * torch.where(z > 0, z, alpha * torch.expm1(z / alpha))


def torch_celu_backward(
    grad_y: torch.Tensor, x: torch.Tensor, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0
) -> torch.Tensor:
    """grad_x (x's shape) of ``torch_celu`` from the input x."""
    z = x * input_scale
    return grad_y * scale * input_scale * torch.where(z > 0, torch.ones_like(z), torch.exp(z / alpha))


def torch_celu_backward_from_output(
    grad_y: torch.Tensor, y: torch.Tensor, alpha: float, scale: float, input_scale: float
) -> torch.Tensor:
    """grad_x (y's shape) of ``torch_celu`` from its output y, as the backward kernel computes it."""
    slope = torch.where(y * scale > 0, scale * input_scale, input_scale * (y / alpha + scale))
    return grad_y * slope
