"""Normalisation modules whose parameters and ``state_dict`` keys match the modules users already have."""

from __future__ import annotations

import torch
from torch import nn

from .._backend import inductor_traces_inference
from ..norms import rms_norm
from ..norms.rmsnorm.reference import torch_rms_norm


class RMSNorm(nn.Module):
    """Drop-in for transformers' ``LlamaRMSNorm`` (and the RMSNorms of models built like it): one
    ``weight`` Parameter [hidden_size] initialised to ones and ``variance_epsilon``, so their ``state_dict`` loads
    as is. Input [..., hidden_size]; output of the same shape in the input's dtype promoted with the weight's, as
    ``LlamaRMSNorm`` computes it (:func:`sparsefuse.norms.rms_norm`), in one kernel each way. Under
    torch.compile without autograd it is the plain expression, for the compiler to fuse
    (:func:`sparsefuse._backend.inductor_traces_inference`)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    @classmethod
    def from_module(cls, module: nn.Module) -> RMSNorm:
        """The replacement of a ``LlamaRMSNorm``-like module (a ``weight`` [D] and ``variance_epsilon``, or
        ``torch.nn.RMSNorm`` with ``eps``) holding *the same* weight Parameter (no copy: optimizers, FSDP and tied
        references keep pointing at it)."""
        weight = module.weight
        if type(weight) not in (torch.Tensor, nn.Parameter) or hasattr(module, "_hf_hook"):
            raise ValueError(
                f"RMSNorm.from_module: {type(module).__name__} is already wrapped (its weight is a "
                f"{type(weight).__name__}, or accelerate hooks it): patch the model before FSDP / device maps"
            )
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if weight is None or weight.dim() != 1 or eps is None:
            raise ValueError(
                f"RMSNorm.from_module: expected a module with a 1-D weight and variance_epsilon (or eps); "
                f"got {type(module).__name__}"
            )
        norm = cls(weight.shape[0], eps, device="meta")
        norm.weight = weight
        norm.train(module.training)
        return norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if inductor_traces_inference():  # the compiler fuses the plain expression with its neighbours (why: there)
            return torch_rms_norm(x, self.weight, self.variance_epsilon)
        return rms_norm(x, self.weight.shape[0], self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
