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

import math

import torch
import torch.nn.functional as F

ACTIVATIONS = ("relu", "fatrelu", "drelu")

# (significand bits, frexp exponent of the smallest normal, largest finite) of the dtypes the kernels take
_FORMATS = {
    torch.float32: (24, -125, torch.finfo(torch.float32).max),
    torch.float16: (11, -13, torch.finfo(torch.float16).max),
    torch.bfloat16: (8, -125, torch.finfo(torch.bfloat16).max),
}


def threshold_in(dtype: torch.dtype, threshold: float) -> float:
    """The largest value of ``dtype`` that is <= ``threshold`` (>= 0): for every value v of that dtype, ``v >
    threshold_in(dtype, t)`` compared in the dtype's arithmetic is ``v > t`` exactly. torch compares a half-precision
    tensor with a Python float after rounding the float to the tensor's dtype (to nearest), and Triton rounds a float
    argument to fp32, so every path passes this instead: each then fires exactly where the pre-activation it holds
    exceeds the threshold. Pure Python (torch.compile traces it as constants)."""
    if threshold <= 0 or dtype not in _FORMATS:
        return threshold
    bits, min_exponent, largest = _FORMATS[dtype]
    if threshold >= largest:
        return largest
    spacing = max(math.frexp(threshold)[1], min_exponent) - bits  # the dtype's grid step near the threshold: 2**spacing
    return math.ldexp(math.floor(math.ldexp(threshold, -spacing)), spacing)


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
