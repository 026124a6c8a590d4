"""Float64 ground truth of the feed-forward blocks, and the dense block in the input's dtype (the ``"dense"``
method and the differentiable path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _linear64(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().t()
    return out + b.double() if b is not None else out


def torch_twell_mlp(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None) -> torch.Tensor:
    """``(relu(x W_gate^T + b_gate) * (x W_up^T + b_up)) W_down^T + b_down`` in float64; x [..., K] -> [..., K]."""
    x2 = x.reshape(-1, x.shape[-1])
    h = torch.relu(_linear64(x2, w_gate, b_gate)) * _linear64(x2, w_up, b_up)
    return _linear64(h, w_down, b_down).reshape(*x.shape[:-1], w_down.shape[0])


def torch_relu_mlp(x, w_up, w_down, b_up=None, b_down=None) -> torch.Tensor:
    """Non-gated block ``relu(x W_up^T + b_up) W_down^T + b_down`` in float64; x [..., K] -> [..., K]."""
    x2 = x.reshape(-1, x.shape[-1])
    return _linear64(torch.relu(_linear64(x2, w_up, b_up)), w_down, b_down).reshape(*x.shape[:-1], w_down.shape[0])


def dense_mlp(x2, w_gate, b_gate, w_up, b_up, w_down, b_down) -> torch.Tensor:
    """The gated block in x's dtype with cuBLAS (three matmuls); x2 [M, K], w_down [K, N] -> [M, K]."""
    return F.linear(torch.relu(F.linear(x2, w_gate, b_gate)) * F.linear(x2, w_up, b_up), w_down, b_down)
