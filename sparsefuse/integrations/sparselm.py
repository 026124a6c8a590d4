"""Load the TwELL paper's released sparse checkpoints (SakanaAI ``SparseLM0.5B`` / ``1B`` / ``1.5B`` / ``2B``) as
plain transformers models, without ``trust_remote_code``, and patch them with :func:`patch_llama`.

The checkpoints (``config.json`` + safetensors, written by ``custom_models/sparse_models.py`` of
``SakanaAI/sparser-faster-llms``) declare ``architectures: ["SparseLlamaForCausalLM"]`` and ``model_type:
"llama_sparse_relu"`` (``SparseQwen2ForCausalLM`` / ``"qwen2_sparse_relu"`` for the Qwen2 variant). Their model is
the base transformers model with every MLP replaced by a ``SparseMLP`` that always runs ``nn.ReLU`` -- whatever
``hidden_act`` says (the released configs say ``"silu"``) -- with

* ``sparsity_gated_mlp`` (default true): ``down(relu(gate(x)) * up(x))``; false: ``down(relu(up(x)))``, no gate;
* ``sparsity_new_intermediate_size`` (when set) in place of ``intermediate_size``;
* ``mlp_bias`` (default false) on all the MLP's projections, for the Qwen2 variant too (whose own MLP has none);
* ``sparsity_use_hybrid_kernel``: training kept ``down_proj.weight`` transposed, [intermediate, hidden];
* ``sparsity_*`` training fields (batch sizes, L1 schedule, tracking) that do not change the forward.

Everything else (attention, norms, rotary embedding, tied embeddings) is the base model's. So the loader builds:

=====================  ===========================================================================================
checkpoint             transformers model
=====================  ===========================================================================================
gated Llama            ``LlamaForCausalLM``, ``hidden_act="relu"``; :func:`patch_llama` runs the TwELL kernels
gated Qwen2            ``Qwen2ForCausalLM``, ``hidden_act="relu"``, each ``Qwen2MLP`` swapped for a ``LlamaMLP``
                       (the same computation, plus ``mlp_bias``) so that :func:`patch_llama` patches it; Qwen2's
                       norms and rotary embedding stay transformers' (``fuse`` touches Llama modules only)
non-gated (either)     the base model with each MLP a :class:`sparsefuse.nn.SparseReluMLP` (``up_proj``,
                       ``down_proj``): :func:`sparsefuse.twell_relu_mlp` once patched (``method`` "auto"/"twell";
                       "dense" and forwards that need gradients run the dense ops); ``fuse`` as above
=====================  ===========================================================================================

Weight names are the base model's (``model.layers.N.mlp.gate_proj.weight`` ...), the names the released files
use. The names the upstream converters also accept map as they do: ``...mlp.GATE`` / ``UP`` -> ``gate_proj`` /
``up_proj.weight`` as stored, ``...mlp.DOWN`` -> ``down_proj.weight`` transposed, ``...mlp.gate_weight`` /
``down_weight`` -> transposed, ``...mlp.up_weight`` -> as stored when gated, transposed when not; ``tracker.`` /
``metrics_accumulator.`` entries are dropped. A ``down_proj.weight`` of shape [intermediate, hidden] (hybrid-kernel
layout) is transposed back. ``lm_head.weight`` may be absent when the embeddings are tied.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

# SparseReluMLP is a module (sparsefuse.nn); named here too, where the loader's users import it. The hook too:
# a whole pickled module refers to it by this path.
from ..nn.relu_mlp import SparseReluMLP, _contiguous_down_weight  # noqa: F401

__all__ = ["load_sparse_checkpoint", "SparseReluMLP", "SPARSE_MODEL_TYPES"]

# model_type -> (architecture, base family)
SPARSE_MODEL_TYPES: dict[str, tuple[str, str]] = {
    "llama_sparse_relu": ("SparseLlamaForCausalLM", "llama"),
    "qwen2_sparse_relu": ("SparseQwen2ForCausalLM", "qwen2"),
}
_ARCHITECTURES = {arch: family for arch, family in SPARSE_MODEL_TYPES.values()}
_CONFIG_DROP = ("architectures", "auto_map", "model_type", "transformers_version", "_name_or_path")
_AUX_PREFIXES = ("tracker.", "metrics_accumulator.")
_EXPECTED = (
    "a directory holding config.json (architectures SparseLlamaForCausalLM / SparseQwen2ForCausalLM, model_type "
    "llama_sparse_relu / qwen2_sparse_relu) and model.safetensors or model.safetensors.index.json with its shards"
)
_PATCH_OPTIONS = ("compression", "tile", "method", "train_method", "down_layout", "fuse", "train_cuda_graph", "l1_on")


def _read_config(path: Path) -> tuple[str, dict[str, Any]]:
    config_file = path / "config.json"
    if not path.is_dir() or not config_file.is_file():
        raise ValueError(f"load_sparse_checkpoint: path {str(path)!r} is not {_EXPECTED}")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"load_sparse_checkpoint: {config_file} is not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"load_sparse_checkpoint: {config_file} must hold a JSON object")
    model_type, archs = raw.get("model_type"), raw.get("architectures") or []
    families = {_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES}
    if model_type in SPARSE_MODEL_TYPES:
        families.add(SPARSE_MODEL_TYPES[model_type][1])
    if len(families) != 1:
        raise ValueError(
            f"load_sparse_checkpoint: {config_file} declares model_type={model_type!r}, architectures={archs!r}; "
            f"expected {_EXPECTED}"
        )
    return families.pop(), raw


def _base_config(family: str, raw: dict[str, Any]) -> tuple[Any, bool, bool]:
    """(transformers config, gated, mlp_bias): the base model's config with hidden_act="relu"."""
    import transformers

    fields = {k: v for k, v in raw.items() if k not in _CONFIG_DROP and not k.startswith("sparsity_")}
    gated = bool(raw.get("sparsity_gated_mlp", True))
    mlp_bias = bool(raw.get("mlp_bias", False))
    if raw.get("sparsity_new_intermediate_size") is not None:
        fields["intermediate_size"] = int(raw["sparsity_new_intermediate_size"])
    # the checkpoint's MLPs run nn.ReLU whatever hidden_act says; TwELL needs those exact zeros
    fields["hidden_act"] = "relu"
    config_class = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
    return config_class(**fields), gated, mlp_bias


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"load_sparse_checkpoint: {index} has no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        raise ValueError(f"load_sparse_checkpoint: no safetensors weights in {str(path)!r}; expected {_EXPECTED}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"load_sparse_checkpoint: shard(s) named by the index are missing: {missing}")
    return files


def _map_name(key: str, value: torch.Tensor, gated: bool) -> tuple[str, torch.Tensor] | None:
    """The transformers name (and layout) of one stored tensor, following the upstream converters."""
    if key.startswith(_AUX_PREFIXES) or any(f".{p}" in key for p in _AUX_PREFIXES):
        return None
    renames = {
        "GATE": ("gate_proj.weight", False),
        "UP": ("up_proj.weight", False),
        "DOWN": ("down_proj.weight", True),
        "gate_weight": ("gate_proj.weight", True),
        "up_weight": ("up_proj.weight", not gated),
        "down_weight": ("down_proj.weight", True),
    }
    prefix, _, leaf = key.rpartition(".")
    if prefix.endswith(".mlp") and leaf in renames:
        name, transpose = renames[leaf]
        if name.startswith("gate") and not gated:
            raise ValueError(f"load_sparse_checkpoint: weight {key!r} is a gate, but sparsity_gated_mlp is false")
        return f"{prefix}.{name}", (value.t() if transpose else value)
    return key, value


def _load_state_dict(files: list[Path], gated: bool) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in files:
        for key, value in load_file(str(file)).items():
            mapped = _map_name(key, value, gated)
            if mapped is not None:
                state[mapped[0]] = mapped[1]
    return state


def _fit_down_proj(state: dict[str, torch.Tensor], hidden: int, intermediate: int, hybrid: bool) -> None:
    # hybrid-kernel training holds down_proj.weight as [intermediate, hidden]; transformers wants [hidden, intermediate]
    for key, value in list(state.items()):
        if key.endswith("mlp.down_proj.weight") and tuple(value.shape) == (intermediate, hidden):
            if hidden == intermediate and not hybrid:
                continue
            if hidden == intermediate:
                raise ValueError(
                    f"load_sparse_checkpoint: {key} is square and sparsity_use_hybrid_kernel is set: its layout "
                    "([hidden, intermediate] or transposed) cannot be told from its shape"
                )
            state[key] = value.t()


def _swap_mlps(model: nn.Module, config: Any, gated: bool, mlp_bias: bool, family: str) -> None:
    """Give every decoder layer the checkpoint's MLP: a ReLU LlamaMLP (gated) or a SparseReluMLP."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    if family == "llama" and gated:
        return  # LlamaForCausalLM with hidden_act="relu" and config.mlp_bias already is the checkpoint's model
    hidden, intermediate = config.hidden_size, config.intermediate_size
    mlp_config = LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, hidden_act="relu", mlp_bias=mlp_bias, vocab_size=1
    )
    dtype = next(model.parameters()).dtype
    for layer in model.model.layers:
        mlp = LlamaMLP(mlp_config) if gated else SparseReluMLP(hidden, intermediate, bias=mlp_bias)
        layer.mlp = mlp.to(dtype)


def load_sparse_checkpoint(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    patch: bool = True,
    **patch_options: Any,
) -> nn.Module:
    """Load a SparseLM checkpoint directory (module docstring: the format and the mapping) as a transformers causal
    LM in eval mode, and with ``patch`` run its FFNs with the sparse kernels (:func:`patch_llama` and its options:
    ``compression``, ``tile``, ``method``, ``train_method``, ``down_layout``, ``fuse``, ``train_cuda_graph``; for
    non-gated checkpoints ``method``, ``compression``, ``tile``, ``down_layout`` and ``fuse`` apply).

    ``dtype``: the parameters' dtype (default: the config's ``torch_dtype`` / ``dtype``, else float32);
    ``device``: where they go (default CPU). The model takes input_ids [batch, seq] and gives logits
    [batch, seq, vocab]. Raises ``ValueError`` for a directory not in that format, naming what was expected, and
    for weights that do not fit the config (missing or unexpected names, wrong shapes)."""
    import transformers

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"load_sparse_checkpoint: path must be a str or os.PathLike; got {type(path).__name__}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"load_sparse_checkpoint: dtype must be a floating torch.dtype or None; got {dtype!r}")
    unknown = sorted(set(patch_options) - set(_PATCH_OPTIONS))
    if unknown:
        raise TypeError(f"load_sparse_checkpoint: unknown patch option(s) {unknown}; expected some of {_PATCH_OPTIONS}")
    root = Path(path)
    family, raw = _read_config(root)
    files = _safetensors_files(root)
    config, gated, mlp_bias = _base_config(family, raw)
    if dtype is None:
        stored = raw.get("torch_dtype", raw.get("dtype"))
        dtype = getattr(torch, stored) if isinstance(stored, str) and hasattr(torch, stored) else torch.float32

    model_class = transformers.LlamaForCausalLM if family == "llama" else transformers.Qwen2ForCausalLM
    model = model_class._from_config(config, dtype=dtype)
    _swap_mlps(model, config, gated, mlp_bias, family)

    state = _load_state_dict(files, gated)
    _fit_down_proj(state, config.hidden_size, config.intermediate_size, bool(raw.get("sparsity_use_hybrid_kernel")))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied:
        state.pop("lm_head.weight", None)  # the tie makes it the embedding
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as err:
        raise ValueError(f"load_sparse_checkpoint: the weights in {str(root)!r} do not fit its config: {err}") from None
    missing = [k for k in result.missing_keys if not (tied and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"load_sparse_checkpoint: the weights in {str(root)!r} do not match a {model_class.__name__} with "
            f"{'gated' if gated else 'non-gated'} ReLU MLPs: missing {missing[:8]}, unexpected "
            f"{result.unexpected_keys[:8]}"
        )
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device=device or "cpu").eval()
    if patch:
        model = _patch(model, gated, patch_options)
    return model


def _patch(model: nn.Module, gated: bool, options: dict[str, Any]) -> nn.Module:
    from ._llama import fuse_norms, fuse_rotary, patch_llama

    if gated:
        return patch_llama(model, **options)
    for module in model.modules():
        if isinstance(module, SparseReluMLP):
            module.configure(
                method=options.get("method", "auto"),
                compression=options.get("compression"),
                tile=options.get("tile"),
                down_layout=options.get("down_layout", "column"),
            )
    if options.get("fuse", True):
        fuse_norms(model)
        fuse_rotary(model)
    return model
