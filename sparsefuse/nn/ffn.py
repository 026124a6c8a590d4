"""A gated ReLU feed-forward block whose parameters (and state_dict keys) are transformers' ``LlamaMLP``'s.

``forward(x) = down_proj(relu(gate_proj(x)) * up_proj(x))``, run by :func:`sparsefuse.ffn.twell_mlp`: the gate
matmul writes TwELL and only the fired rows of up_proj / down_proj are read. ``down_proj.weight`` keeps its
[hidden, intermediate] shape but is stored column-major (``stride(0) == 1``) so that each neuron's row of
W_down^T is contiguous; ``load_state_dict`` copies into that layout, ``.to()`` preserves it, and ``F.linear`` reads
it as is. ``method="auto"`` decides from the estimate of the non-zeros per token that :func:`twell_mlp` keeps per gate
weight (one host sync in the weight's life, then sync-free samples every few calls), so the module's call costs
what the functional call costs; :attr:`SparseGatedMLP.monitor` reads that estimate. Inference uses the sparse
kernels; when autograd needs gradients the block runs densely (differentiable).
"""

from __future__ import annotations

import torch
from torch import nn

from .._auto import SparsityMonitor, observable
from ..ffn.twell import DEFAULT_COMPRESSION, METHODS, twell_down_layout, twell_mlp
from ..ffn.twell.auto import ESTIMATES, eager_runs_dense
from ..ffn.twell.reference import dense_mlp


class SparseGatedMLP(nn.Module):
    """Parameters: gate_proj.weight [intermediate, hidden], up_proj.weight [intermediate, hidden],
    down_proj.weight [hidden, intermediate] (+ biases when ``bias=True``, as ``LlamaConfig(mlp_bias=True)``)."""

    EAGER_REFRESH = 16

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool = False,
        compression: int = DEFAULT_COMPRESSION,
        tile: int | None = None,
        method: str = "auto",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"SparseGatedMLP: method must be one of {', '.join(METHODS)}; got {method!r}")
        kw = dict(device=device, dtype=dtype)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, **kw)
        self.compression, self.tile, self.method = compression, tile, method
        self._eager_calls = 0
        self.relayout_down_proj()

    @torch.no_grad()
    def relayout_down_proj(self) -> None:
        """Store down_proj.weight column-major in place (same Parameter object, same values)."""
        weight = self.down_proj.weight
        if weight.device.type != "meta" and weight.stride(0) != 1 and weight.shape[1] > 1:
            weight.data = twell_down_layout(weight.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.down_proj.weight.stride(0) != 1 and not torch.compiler.is_compiling():
            self.relayout_down_proj()  # a new weight was assigned or loaded with another layout
        if self.method == "auto" and self._eager_dense(x):
            gate, up, down = self.gate_proj, self.up_proj, self.down_proj
            return dense_mlp(x, gate.weight, gate.bias, up.weight, up.bias, down.weight, down.bias)
        return twell_mlp(
            x,
            self.gate_proj.weight,
            self.up_proj.weight,
            self.down_proj.weight,
            b_gate=self.gate_proj.bias,
            b_up=self.up_proj.bias,
            b_down=self.down_proj.bias,
            compression=self.compression,
            tile=self.tile,
            method=self.method,
        )

    def _eager_dense(self, x: torch.Tensor) -> bool:
        """A decode step run from Python is host-bound, and there ``auto`` runs dense (its host time is lower): the
        module then calls the same five dense ops as ``LlamaMLP`` directly, skipping the functional API's checks
        (~60 us a call). Every ``EAGER_REFRESH``-th call still goes through :func:`twell_mlp`, which keeps the
        estimate fed; compiled and captured calls always do."""
        if not (x.is_cuda and observable(x)):
            return False
        self._eager_calls += 1
        if self._eager_calls % self.EAGER_REFRESH == 0 or x.shape[-1] != self.hidden_size:
            return False
        return eager_runs_dense(self.gate_proj.weight, x.numel() // self.hidden_size, x.dtype)

    @property
    def monitor(self) -> SparsityMonitor | None:
        """The running estimate of the gate's non-zeros per token that ``method="auto"`` uses (None before the first
        eager call); ``monitor.estimate()`` reads it without a sync."""
        return ESTIMATES.monitor(self.gate_proj.weight)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
            f"compression={self.compression}, method={self.method!r}"
        )
