"""Patch transformers Llama models whose MLP activation is ReLU so every ``LlamaMLP`` runs the TwELL kernels.

    model = transformers.LlamaForCausalLM(LlamaConfig(..., hidden_act="relu"))
    patch_llama(model)                  # in place; returns the model

transformers is imported lazily. A module is swapped when it is a ``LlamaMLP`` (or a subclass) whose ``act_fn`` is
``nn.ReLU``; other activations (SiLU, GELU, ...) are left alone -- TwELL needs exact zeros. The replacement
:class:`sparsefuse.nn.SparseGatedMLP` takes over the original ``gate_proj``/``up_proj``/``down_proj`` Linear
modules themselves (same Parameter objects, so tied weights, hooks on the projections and ``state_dict`` keys are
unchanged); ``down_proj.weight`` is re-laid out column-major in place (same values and shape: one copy per layer,
done once).
"""

from __future__ import annotations

import torch
from torch import nn

from ..ffn.twell import DEFAULT_COMPRESSION
from ..nn.ffn import SparseGatedMLP

__all__ = ["patch_llama", "is_relu_llama_mlp", "l1_loss", "sparsity_report", "patched_mlps", "release_step"]


def is_relu_llama_mlp(module: nn.Module) -> bool:
    """True for a transformers ``LlamaMLP`` whose activation is ReLU."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    return (
        isinstance(module, LlamaMLP)
        and isinstance(getattr(module, "act_fn", None), nn.ReLU)
        and not isinstance(module, SparseGatedMLP)
    )


def _replacement(
    mlp: nn.Module,
    compression: int,
    tile: int | None,
    method: str,
    train_method: str = "dense",
    down_layout: str = "column",
) -> SparseGatedMLP:
    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    fused = SparseGatedMLP(
        gate.in_features,
        gate.out_features,
        bias=gate.bias is not None,
        compression=compression,
        tile=tile,
        method=method,
        train_method=train_method,
        down_layout=down_layout,
        device="meta",
    )
    fused.gate_proj, fused.up_proj, fused.down_proj = gate, up, down  # the modules themselves, not copies
    fused.relayout_down_proj()
    fused.train(mlp.training)
    return fused


def patch_llama(
    model: nn.Module,
    *,
    compression: int = DEFAULT_COMPRESSION,
    tile: int | None = None,
    method: str = "auto",
    train_method: str = "dense",
    down_layout: str = "column",
) -> nn.Module:
    """Replace every ReLU ``LlamaMLP`` inside ``model`` (in place) with :class:`sparsefuse.nn.SparseGatedMLP`
    (inference by ``method``; forwards that need gradients by ``train_method``: "dense" or "hybrid", the sparse
    training step; ``down_layout="row"`` keeps ``down_proj.weight`` contiguous, for FSDP2).

    Returns the model (or, if ``model`` itself is a ReLU LlamaMLP, its replacement). Raises ``ValueError`` if no
    ReLU LlamaMLP was found (e.g. a model with ``hidden_act="silu"``: TwELL needs the ReLU's exact zeros)."""
    if is_relu_llama_mlp(model):
        return _replacement(model, compression, tile, method, train_method, down_layout)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if is_relu_llama_mlp(child):
                setattr(parent, name, _replacement(child, compression, tile, method, train_method, down_layout))
                replaced += 1
    if replaced == 0:
        act = getattr(getattr(model, "config", None), "hidden_act", None)
        raise ValueError(
            f"sparsefuse patch_llama: no LlamaMLP with a ReLU activation found in "
            f"{type(model).__name__}" + (f" (config.hidden_act={act!r})" if act else "")
        )
    return model


def patched_mlps(model: nn.Module) -> list[tuple[str, SparseGatedMLP]]:
    """(qualified name, module) of every :class:`SparseGatedMLP` in ``model``, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, SparseGatedMLP)]


def l1_loss(model: nn.Module) -> torch.Tensor:
    """The summed L1 term of every patched layer's last forward that needed gradients (each the gate activations'
    mean per element, :attr:`SparseGatedMLP.last_l1`): add ``coefficient * l1_loss(model)`` to the loss after the
    forward. A per-element mean per layer keeps a coefficient portable across batch sizes and widths; summing over
    layers weighs every layer alike. Raises if no patched layer has run a training forward."""
    terms = [m.last_l1 for _, m in patched_mlps(model) if m.last_l1 is not None]
    if not terms:
        raise RuntimeError(
            "sparsefuse l1_loss: no patched SparseGatedMLP has run a forward with gradients yet "
            "(patch the model with patch_llama and call l1_loss after the forward)"
        )
    return torch.stack([t.float() for t in terms]).sum()


def release_step(model: nn.Module) -> None:
    """Drop what every patched layer keeps of its last forward (:attr:`SparseGatedMLP.last_l1` and the firing
    counts). ``last_l1`` is differentiable, so until the backward has run it holds the layer's whole autograd graph,
    saved activations included: call this where a step fails between forward and backward (a caught
    ``torch.OutOfMemoryError`` in a batch-size search) so that the failed step's memory is freed before the next
    try, not only as each layer runs again."""
    for _, module in patched_mlps(model):
        module.last_l1, module._last_counts = None, None


def sparsity_report(
    model: nn.Module, group: torch.distributed.ProcessGroup | None = None
) -> dict[str, dict[str, torch.Tensor]]:
    """Per patched layer (qualified name): the last training step's gate statistics as device scalars (mean, p99
    and max non-zeros per token, dead-neuron fraction). Reading them is one sync: do it when logging. ``group``
    (e.g. ``dist.group.WORLD``, every rank calling): over all its ranks' tokens; default: this process's batch."""
    return {name: m.sparsity_report(group) for name, m in patched_mlps(model) if m._last_counts is not None}
