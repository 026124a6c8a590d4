"""The non-gated ReLU feed-forward block ``down_proj(relu(up_proj(x)))`` as a module: the MLP of the SparseLM
checkpoints written with ``sparsity_gated_mlp: false`` (``load_sparse_checkpoint`` of
:mod:`sparsefuse.integrations.transformers` puts one in each of their layers), and usable on its own.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ffn import twell_down_layout, twell_relu_mlp
from ..ffn.twell import DEFAULT_COMPRESSION

__all__ = ["SparseReluMLP"]


class SparseReluMLP(nn.Module):
    """The non-gated ReLU block of a ``sparsity_gated_mlp: false`` checkpoint: ``down_proj(relu(up_proj(x)))``.

    x [..., hidden] -> [..., hidden]; ``up_proj`` [intermediate, hidden], ``down_proj`` [hidden, intermediate]
    (``nn.Linear``, so the state_dict keys are the checkpoint's). Unpatched (``method=None``) it runs the dense ops;
    :meth:`configure` with ``method`` "auto" or "twell" makes inference run :func:`sparsefuse.twell_relu_mlp`
    (forwards that need gradients, and inputs the kernels do not take, stay dense)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = nn.ReLU()
        self.method: str | None = None
        self.compression: int | None = None
        self.tile: int | None = None
        self.down_layout = "row"
        self._register_state_dict_hook(_contiguous_down_weight)

    def configure(
        self,
        *,
        method: str = "auto",
        compression: int | None = None,
        tile: int | None = None,
        down_layout: str = "column",
    ) -> None:
        """Run the TwELL kernels for inference (``method`` "auto" or "twell") or the dense ops ("dense");
        ``down_layout="column"`` stores ``down_proj.weight`` column-major in place (what the kernels read per
        fired neuron; same values and shape), "row" keeps it contiguous (the kernels then copy it per call)."""
        if method not in ("auto", "twell", "dense"):
            raise ValueError(f"SparseReluMLP: method must be 'auto', 'twell' or 'dense'; got {method!r}")
        if down_layout not in ("column", "row"):
            raise ValueError(f"SparseReluMLP: down_layout must be 'column' or 'row'; got {down_layout!r}")
        self.method, self.compression, self.tile, self.down_layout = method, compression, tile, down_layout
        self._relayout_down_proj()

    @torch.no_grad()
    def _relayout_down_proj(self) -> None:
        weight = self.down_proj.weight
        if self.down_layout == "column" and self.method != "dense" and weight.device.type != "meta":
            weight.data = twell_down_layout(weight.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.method in ("auto", "twell") and self._kernels_take(x):
            if self.down_layout == "column" and self.down_proj.weight.stride(0) != 1:
                self._relayout_down_proj()  # a new weight was assigned or loaded row-major
            return twell_relu_mlp(
                x,
                self.up_proj.weight,
                self.down_proj.weight,
                b_up=self.up_proj.bias,
                b_down=self.down_proj.bias,
                compression=self.compression or DEFAULT_COMPRESSION,
                tile=self.tile,
            )
        return self.down_proj(self.act_fn(self.up_proj(x)))

    def _kernels_take(self, x: torch.Tensor) -> bool:
        # hooks and wrapped projections must see the dense calls, as in SparseGatedMLP
        plain = all(type(m) in (nn.Linear, nn.ReLU) for m in (self.up_proj, self.down_proj, self.act_fn))
        hooked = any(m._forward_hooks or m._forward_pre_hooks for m in (self.up_proj, self.down_proj, self.act_fn))
        return (
            plain
            and not hooked
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and x.dtype == self.up_proj.weight.dtype
            and not (torch.is_grad_enabled() and (x.requires_grad or self.up_proj.weight.requires_grad))
        )

    def extra_repr(self) -> str:
        return f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, method={self.method}"


def _contiguous_down_weight(module: SparseReluMLP, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    # state_dict() gives down_proj.weight contiguous, as savers (safetensors) require, unless keep_vars asked for
    # the Parameter itself
    key = prefix + "down_proj.weight"
    weight = state_dict.get(key)
    if isinstance(weight, torch.Tensor) and not isinstance(weight, nn.Parameter) and not weight.is_contiguous():
        state_dict[key] = weight.contiguous()
