"""Patch transformers Llama models whose MLP activation is ReLU so every ``LlamaMLP`` runs the TwELL kernels.

    model = transformers.LlamaForCausalLM(LlamaConfig(..., hidden_act="relu"))
    patch_llama(model)                  # in place; returns the model

transformers is imported lazily. A module is swapped when it is a ``LlamaMLP`` (or a subclass) whose ``act_fn`` is
``nn.ReLU``; other activations (SiLU, GELU, ...) are left alone -- TwELL needs exact zeros. The replacement
:class:`sparsefuse.nn.SparseGatedMLP` takes over the original ``gate_proj``/``up_proj``/``down_proj`` Linear
modules themselves (same Parameter objects, so tied weights, hooks on the projections and ``state_dict`` keys are
unchanged); ``down_proj.weight`` is re-laid out column-major in place (same values and shape: one copy per layer,
done once).

With ``fuse=True`` (default) the rest of each decoder layer stops hiding the FFN's gain: every ``LlamaRMSNorm``
becomes :class:`sparsefuse.nn.RMSNorm` (same weight Parameter, one kernel each way where transformers runs ~6
elementwise kernels forward and ~10 backward), and the model's ``LlamaAttention`` modules apply the rotary embedding
with :func:`sparsefuse.rotary.apply_rotary_pos_emb` (one kernel each way for q and k together, where transformers
runs ~10). In an eager 1.5B-shape training step those two are ~30% of the time.

The fused rotary embedding stays local to the patched model: other Llama models in the process, and pickling any
of them, keep transformers' function (:mod:`._llama_rotary` says how).

Under torch.compile without autograd (compiled inference) the norms and the rotary embedding are the plain torch
expressions again, which the compiler fuses with their neighbours better than it can call an opaque op
(:func:`sparsefuse._backend.inductor_traces_inference`); compiled training keeps the fused ops.
"""

from __future__ import annotations

import torch
from torch import nn

from .._validation import check_ffn_activation
from ..ffn.hybrid.reference import L1_TERMS
from ..ffn.twell import DEFAULT_COMPRESSION
from ..nn.ffn import FATReLU, SparseGatedMLP
from ..nn.norms import RMSNorm
from ._llama_rotary import fuse_rotary

__all__ = [
    "patch_llama",
    "fuse_norms",
    "fuse_rotary",
    "is_relu_llama_mlp",
    "sparse_gate",
    "l1_loss",
    "sparsity_report",
    "patched_mlps",
    "release_step",
    "shard_llama_fsdp2",
]

# FSDP2 units for a patched model (shard_llama_fsdp2 says why): runs of this many decoder layers, kept gathered
# from forward to backward
FSDP2_LAYERS_PER_UNIT = 3
FSDP2_RESHARD_AFTER_FORWARD = False


def _gated_mlp_classes() -> tuple[type, ...]:
    """transformers' gated MLP classes of the Llama family (same module tree): Llama, Mistral, Qwen2."""
    import importlib

    found = []
    for family, name in (("llama", "LlamaMLP"), ("mistral", "MistralMLP"), ("qwen2", "Qwen2MLP")):
        try:
            found.append(getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def _fatrelu_threshold(act: nn.Module | None) -> float | None:
    """The threshold of a FATReLU activation module (sparsefuse's, ``nn.Threshold(t, 0)``, or a model's own class
    named FATReLU with a ``threshold`` attribute), else None."""
    if isinstance(act, nn.Threshold):
        return float(act.threshold) if act.value == 0 and act.threshold >= 0 else None
    if isinstance(act, FATReLU) or "fatrelu" in type(act).__name__.lower():
        threshold = getattr(act, "threshold", None)
        return float(threshold) if isinstance(threshold, (int, float)) and threshold >= 0 else None
    return None


def sparse_gate(module: nn.Module, activation: str | None = None) -> tuple[str, float] | None:
    """``(activation, threshold)`` of a transformers gated MLP (Llama, Mistral, Qwen2) whose gate the kernels run:
    ``act_fn`` ReLU ("relu", or "drelu" when ``activation="drelu"`` says its up product is ReLU'd too: the module
    tree cannot tell) or FATReLU ("fatrelu" and its threshold); None for anything else (SiLU, GELU, a patched
    module)."""
    if isinstance(module, SparseGatedMLP) or not isinstance(module, _gated_mlp_classes()):
        return None
    act = getattr(module, "act_fn", None)
    if isinstance(act, nn.ReLU):
        return ("drelu", 0.0) if activation == "drelu" else ("relu", 0.0)
    threshold = _fatrelu_threshold(act)
    return None if threshold is None else ("fatrelu", threshold)


def is_relu_llama_mlp(module: nn.Module) -> bool:
    """True for a transformers gated MLP (Llama, Mistral, Qwen2) whose activation is ReLU."""
    return sparse_gate(module) == ("relu", 0.0)


def _replacement(mlp: nn.Module, options: dict, gate_kind: tuple[str, float]) -> SparseGatedMLP:
    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    activation, threshold = gate_kind
    options = {**options, "l1_on": options.get("l1_on") or "gate", "activation": activation, "threshold": threshold}
    fused = SparseGatedMLP(gate.in_features, gate.out_features, bias=gate.bias is not None, device="meta", **options)
    # the modules themselves, not copies: their Parameters (tied weights), their hooks and their state_dict keys
    fused.gate_proj, fused.up_proj, fused.down_proj = gate, up, down
    if type(mlp.act_fn) is type(fused.act_fn) and _fatrelu_threshold(mlp.act_fn) in (None, threshold):
        fused.act_fn = mlp.act_fn  # its own module (hooks included); another gate module becomes sparsefuse's
    fused.relayout_down_proj()
    fused.train(mlp.training)
    return fused


def patch_llama(
    model: nn.Module,
    *,
    compression: int = DEFAULT_COMPRESSION,
    tile: int | None = None,
    method: str = "auto",
    train_method: str = "auto",
    down_layout: str = "column",
    fuse: bool = True,
    train_cuda_graph: bool | None = None,
    l1_on: str | None = None,
    activation: str | None = None,
    threshold: float | None = None,
) -> nn.Module:
    """Replace every ReLU ``LlamaMLP`` inside ``model`` (in place) with :class:`sparsefuse.nn.SparseGatedMLP` (inference
    by ``method``; forwards that need gradients by ``train_method``: "auto" -- the dense ops until the gate's firing is
    counted, then the sparse training step where the planner predicts it faster --, "dense", or "hybrid", the sparse
    training step always, replayed from CUDA graphs per ``train_cuda_graph`` (default: where the host would pace it):
    see :func:`sparsefuse.ffn.hybrid.hybrid_mlp` ``cuda_graph``; ``down_layout="row"`` keeps ``down_proj.weight``
    contiguous, for FSDP2), and with ``fuse`` every ``LlamaRMSNorm`` with :class:`sparsefuse.nn.RMSNorm` and the
    attention's rotary embedding with :func:`sparsefuse.rotary.apply_rotary_pos_emb` (the same computations in one
    kernel each way; :func:`fuse_norms`, :func:`fuse_rotary`). ``l1_on``: what each module's ``last_l1`` is taken
    on, ``"gate"`` or ``"hidden"`` (the paper's h = h_g * h_u; :func:`l1_loss`); None: ``"gate"`` for a new
    module, an already patched one keeps its own. ``activation``: each MLP's gate as its ``act_fn`` says when None
    (ReLU; FATReLU -- ``nn.Threshold(t, 0)``, :class:`sparsefuse.nn.FATReLU`, or a model's own FATReLU class with a
    ``threshold``); ``"drelu"`` for dReLU models (TurboSparse, Bamboo: ReLU on the up product too, which the module
    tree cannot show); ``"relu"`` / ``"fatrelu"`` (with ``threshold``) to set every layer's gate.

    Patching a patched model again is not an error: its :class:`SparseGatedMLP` modules take this call's options
    (the same options: nothing changes). Returns the model (or, if ``model`` itself is a ReLU LlamaMLP, its
    replacement). Raises ``ValueError`` if there is neither a ReLU LlamaMLP nor a patched one (e.g. a model with
    ``hidden_act="silu"``: TwELL needs the ReLU's exact zeros)."""
    options = dict(
        compression=compression,
        tile=tile,
        method=method,
        train_method=train_method,
        down_layout=down_layout,
        train_cuda_graph=train_cuda_graph,
        l1_on=l1_on,
    )
    if activation is not None:
        threshold = check_ffn_activation("patch_llama", activation, 0.0 if threshold is None else threshold)
    elif threshold is not None:
        raise ValueError(f"patch_llama: threshold={threshold!r} needs activation='fatrelu'")

    def gate_of(child: nn.Module) -> tuple[str, float] | None:
        found = sparse_gate(child, activation)
        if found is None or activation is None or activation == "drelu":
            return found
        return activation, threshold  # an explicit gate: relu, or a FATReLU threshold for every layer

    kind = gate_of(model)
    if kind is not None:
        return _replacement(model, options, kind)
    found = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            kind = gate_of(child)
            if kind is not None:
                setattr(parent, name, _replacement(child, options, kind))
                found += 1
            elif isinstance(child, SparseGatedMLP):
                child.configure(**options, activation=activation, threshold=threshold)
                found += 1
    if isinstance(model, SparseGatedMLP):
        model.configure(**options, activation=activation, threshold=threshold)
        return model
    if found == 0:
        act = getattr(getattr(model, "config", None), "hidden_act", None)
        raise ValueError(
            f"sparsefuse patch_llama: no LlamaMLP with a ReLU activation found in "
            f"{type(model).__name__}" + (f" (config.hidden_act={act!r})" if act else "")
        )
    if fuse:
        fuse_norms(model)
        fuse_rotary(model)
    return model


def fuse_norms(model: nn.Module) -> int:
    """Replace every transformers ``LlamaRMSNorm`` inside ``model`` (in place) with :class:`sparsefuse.nn.RMSNorm`
    holding the same weight Parameter; returns how many. Works on any model (ReLU or not)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is LlamaRMSNorm:
                setattr(parent, name, RMSNorm.from_module(child))
                replaced += 1
    return replaced


def patched_mlps(model: nn.Module) -> list[tuple[str, SparseGatedMLP]]:
    """(qualified name, module) of every :class:`SparseGatedMLP` in ``model``, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, SparseGatedMLP)]


L1_LAYER_REDUCTIONS = ("sum", "mean")


def l1_loss(model: nn.Module, *, layers: str = "sum", l1_on: str | None = None) -> torch.Tensor:
    """The L1 term of every patched layer's last forward that needed gradients (:attr:`SparseGatedMLP.last_l1`:
    each a mean per element, of the gate activations or, for a layer with ``l1_on="hidden"``, of the hidden
    representation h = h_g * h_u), summed (``layers="sum"``, default) or averaged (``layers="mean"``) over those
    layers: add ``coefficient * l1_loss(model)`` to the loss after the forward. A per-element mean per layer keeps
    a coefficient portable across batch sizes and widths; both reductions weigh every layer alike, and the mean
    keeps it portable across depths too.

    The TwELL paper's eq. 2 is ``l1_loss(model, layers="mean", l1_on="hidden")`` on layers set to ``"hidden"``
    (``SparseGatedMLP(l1_on="hidden")``, or ``m.l1_on = "hidden"`` for each ``m`` of :func:`patched_mlps`);
    ``l1_on`` here only checks that every layer takes that term (ValueError naming the layers that do not). Its
    released code divides by the tokens alone: its coefficient is this one over the intermediate size
    (docs/training.md, "The L1 term"). Raises RuntimeError if no patched layer has run a training forward."""
    if layers not in L1_LAYER_REDUCTIONS:
        raise ValueError(f"sparsefuse l1_loss: layers must be 'sum' or 'mean'; got {layers!r}")
    mlps = patched_mlps(model)
    if l1_on is not None:
        if l1_on not in L1_TERMS:
            raise ValueError(
                f"sparsefuse l1_loss: l1_on must be one of {', '.join(map(repr, L1_TERMS))}; got {l1_on!r}"
            )
        other = [name for name, m in mlps if m.l1_on != l1_on]
        if other:
            raise ValueError(
                f"sparsefuse l1_loss(l1_on={l1_on!r}): {len(other)} patched layers take their L1 term on something "
                f"else (first: {other[0]!r}); set each layer's l1_on to {l1_on!r} before the forward (for _, m in "
                f"patched_mlps(model): m.l1_on = {l1_on!r})"
            )
    terms = [m.last_l1 for _, m in mlps if m.last_l1 is not None]
    if not terms:
        raise RuntimeError(
            "sparsefuse l1_loss: no patched SparseGatedMLP has run a forward with gradients since its last forward "
            "without them (patch the model with patch_llama and call l1_loss after the training forward; under "
            "activation checkpointing use use_reentrant=False: the reentrant kind runs the forward without "
            "gradients, so no differentiable L1 term exists until its backward)"
        )
    total = torch.stack([t.float() for t in terms]).sum()
    return total / len(terms) if layers == "mean" else total


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


def shard_llama_fsdp2(
    model: nn.Module,
    *,
    layers_per_unit: int = FSDP2_LAYERS_PER_UNIT,
    reshard_after_forward: bool = FSDP2_RESHARD_AFTER_FORWARD,
    mesh: object | None = None,
) -> nn.Module:
    """Shard a (patched) transformers causal LM with FSDP2, as a patched model runs it best: ``fully_shard`` over
    each run of ``layers_per_unit`` decoder layers (``model.model.layers``), then over the root, in place; returns
    the model, its parameters now sharded DTensors. ``mesh``: FSDP2's device mesh (default: its own, over the
    default process group and the current accelerator).

    Why not torch's per-layer, resharded setup: the sparse step leaves a patched model's step close to its host's
    pace, and each FSDP2 unit's collectives, copies and hooks are host work on top. Units of 3 layers kept gathered
    from forward to backward (``reshard_after_forward=False``: no all-gathers in the backward) took a patched 1.5B
    step on 2 H100s from 226 to 165 ms (1.04x -> 1.34x unpatched), for ~2.4 GB more peak memory per GPU
    (docs/training.md, "Several GPUs"). FSDP2 shards contiguous parameters only: patch with
    ``down_layout="row"``. Layers whose steps are replayed from CUDA graphs keep replaying: FSDP2 gathers their
    weights into fresh storage every step, so after two steps their replays read copies of the weights, filled each call
    (:mod:`sparsefuse.ffn.hybrid.graphed`)."""
    if layers_per_unit < 1:
        raise ValueError(f"shard_llama_fsdp2: layers_per_unit must be >= 1; got {layers_per_unit}")
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.5 has FSDP2 under its earlier, private name
        from torch.distributed._composable.fsdp import fully_shard

    layers = list(model.model.layers)
    for first in range(0, len(layers), layers_per_unit):
        unit = layers[first : first + layers_per_unit]
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, reshard_after_forward=reshard_after_forward)
    return fully_shard(model, mesh=mesh)
