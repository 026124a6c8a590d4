"""Plain-torch RMSNorm as transformers' ``LlamaRMSNorm`` computes it: the float64-capable ground truth, the
low-precision comparator of the tests, and the closed-form backward the kernels compute."""

from __future__ import annotations

import torch


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] or None. ``LlamaRMSNorm``'s order of operations: normalise in float32 (float64 for
    float64 input), round to x's dtype, then multiply by the weight in the promoted dtype of the two."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x.to(compute)
    normed = (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if weight is None else weight * normed


def torch_rms_norm_rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) per row of x [..., D] in the compute precision ([...])."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    return torch.rsqrt(x.to(compute).pow(2).mean(-1) + eps)


def torch_rms_norm_backward(
    grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(grad_x in x's dtype, grad_weight in weight's dtype or None) of :func:`torch_rms_norm` from grad_y [..., D],
    x [..., D] and rstd [...], in the compute precision; the rounding of the normalised value to x's dtype is
    differentiated as the identity (as autograd does for ``.to``), and the weight's gradient uses the rounded
    value the forward multiplied it by:

        n = x * rstd,  g = grad_y * weight,  grad_x = rstd * (g - n * mean(g * n)),  grad_w = sum(grad_y * n)"""
    compute = rstd.dtype
    xc, gy, r = x.to(compute), grad_y.to(compute), rstd.to(compute).unsqueeze(-1)
    n = xc * r
    g = gy * weight.to(compute) if weight is not None else gy
    grad_x = r * (g - n * (g * n).mean(-1, keepdim=True))
    grad_w = None
    if weight is not None:
        grad_w = (gy * n.to(x.dtype).to(compute)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return grad_x.to(x.dtype), grad_w
