"""Float64 ground truth of the feed-forward blocks, the dense block in the input's dtype (the ``"dense"`` method and
the differentiable path), and the gate activations they share.

Gate activations of the gated block ``(act(x W_gate^T + b_gate) * up) W_down^T + b_down``:

- ``"relu"``: ``act = relu``, ``up = x W_up^T + b_up`` (Llama with ``hidden_act="relu"``, the TwELL paper's models);
- ``"fatrelu"``: ``act(g) = g if g > threshold else 0`` -- ReLU with its firing point moved to ``threshold >= 0``,
  the value kept as is, not shifted (ProSparse-Llama-2, MiniCPM-S); ``threshold=0`` is ReLU;
- ``"drelu"``: ``act = relu`` and ``up = relu(x W_up^T + b_up)``, so a neuron contributes only where both fire
  (TurboSparse-Mistral/-Mixtral, Bamboo).

A NaN pre-activation counts as fired on every path (it propagates to the output, as ``torch.relu`` propagates it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..._backend import threshold_in

ACTIVATIONS = ("relu", "fatrelu", "drelu")


def gate_activation(g: torch.Tensor, threshold: float) -> torch.Tensor:
    """``relu(g)`` (threshold 0), else ``g`` where ``g > threshold`` (NaN kept) and 0 elsewhere, in g's dtype."""
    if threshold == 0:
        return torch.relu(g)
    return F.threshold(g, threshold_in(g.dtype, threshold), 0.0)


def _linear64(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().t()
    return out + b.double() if b is not None else out


def torch_twell_mlp(
    x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, *, activation: str = "relu", threshold: float = 0.0
) -> torch.Tensor:
    """``(act(x W_gate^T + b_gate) * up) W_down^T + b_down`` in float64 for a gate ``activation`` of
    :data:`ACTIVATIONS` (see the module docstring); x [..., K] -> [..., K]."""
    x2 = x.reshape(-1, x.shape[-1])
    up = _linear64(x2, w_up, b_up)
    h = gate_activation(_linear64(x2, w_gate, b_gate), threshold) * (torch.relu(up) if activation == "drelu" else up)
    return _linear64(h, w_down, b_down).reshape(*x.shape[:-1], w_down.shape[0])


def torch_relu_mlp(x, w_up, w_down, b_up=None, b_down=None) -> torch.Tensor:
    """Non-gated block ``relu(x W_up^T + b_up) W_down^T + b_down`` in float64; x [..., K] -> [..., K]."""
    x2 = x.reshape(-1, x.shape[-1])
    return _linear64(torch.relu(_linear64(x2, w_up, b_up)), w_down, b_down).reshape(*x.shape[:-1], w_down.shape[0])


def dense_gated(
    x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation: str = "relu", threshold: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gated block in x's dtype with cuBLAS (three matmuls), as ``LlamaMLP`` runs it: x [..., K], w_down
    [K, N]. Returns (y [..., K], the gate's activations [..., N], h = gate * up [..., N]; dReLU: up ReLU'd) --
    the last two for callers that count the firing or keep the hidden term."""
    h_gate = gate_activation(F.linear(x, w_gate, b_gate), threshold)
    up = F.linear(x, w_up, b_up)
    h = h_gate * (up.relu_() if activation == "drelu" else up)
    return F.linear(h, w_down, b_down), h_gate, h


def dense_mlp(
    x2, w_gate, b_gate, w_up, b_up, w_down, b_down, activation: str = "relu", threshold: float = 0.0
) -> torch.Tensor:
    """The gated block in x's dtype with cuBLAS (three matmuls); x2 [M, K], w_down [K, N] -> [M, K]."""
    return dense_gated(x2, w_gate, b_gate, w_up, b_up, w_down, b_down, activation, threshold)[0]
