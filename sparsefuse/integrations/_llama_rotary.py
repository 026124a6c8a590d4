"""The fused rotary embedding inside a patched Llama's attention, kept local to that model.

A transformers ``LlamaAttention`` calls the module global ``modeling_llama.apply_rotary_pos_emb``. Two ways to make
the attention of one model (and only that model) call :func:`sparsefuse.rotary.apply_rotary_pos_emb` instead:

* **Its own rotary wrapper** (transformers with the ``kernels`` package: the global is a ``kernels`` function
  module, and each attention module keeps a private copy of it in ``_kernel_funcs``, to which its forward routes
  the global's calls). The private copy's ``forward`` is set to :func:`_fused_rotary_forward`, the way ``kernels``
  itself swaps in a hub kernel. Nothing global changes: an unpatched Llama in the same process, ``torch.save`` /
  ``torch.load`` of any Llama (which look the global up by name) and ``copy.deepcopy`` behave as without sparsefuse,
  and the patched model's wrappers pickle with it (their forward is stored by reference and rebound on load).
* **A dispatcher** otherwise (the global is a plain function): the global is pointed once at
  :func:`_rotary_dispatch`, which runs the fused function only while a fused model's attention is running (a
  per-thread count kept by forward hooks on those modules); elsewhere transformers' function.

Under torch.compile without autograd (compiled inference) the rotary embedding is the plain torch expression, which
the compiler fuses with its neighbours better than it can call an opaque op
(:func:`sparsefuse._backend.inductor_traces_inference`); compiled training keeps the fused op.
"""

from __future__ import annotations

import inspect
import threading
import types
from typing import Any

import torch
from torch import nn

from .._backend import inductor_traces_inference
from ..rotary import apply_rotary_pos_emb, torch_apply_rotary_pos_emb

__all__ = ["fuse_rotary"]


def fuse_rotary(model: nn.Module) -> int:
    """Make every transformers ``LlamaAttention`` inside ``model`` apply its rotary embedding with
    :func:`sparsefuse.rotary.apply_rotary_pos_emb` (see the module docstring); returns how many modules. Idempotent.
    Patch before wrapping the model (FSDP, accelerate's device maps): the change goes on the modules found here."""
    from transformers.models.llama import modeling_llama

    fused = 0
    for module in model.modules():
        if isinstance(module, modeling_llama.LlamaAttention):
            wrapper = own_rotary_wrapper(module, modeling_llama)
            if wrapper is not None:
                if getattr(wrapper.__dict__.get("forward"), "__func__", None) is not _fused_rotary_forward:
                    wrapper.forward = types.MethodType(_fused_rotary_forward, wrapper)
            else:
                _hook_attention(module, modeling_llama)
            fused += 1
        elif isinstance(module, (modeling_llama.LlamaModel, modeling_llama.LlamaDecoderLayer)):
            if not getattr(module, "_sparsefuse_rotary_reset", False):
                module.register_forward_pre_hook(_reset_fused_attention, with_kwargs=True)
                module._sparsefuse_rotary_reset = True
    return fused


def is_rotary_fused(attention: nn.Module) -> bool:
    """Whether ``attention`` (a ``LlamaAttention``) applies the fused rotary embedding."""
    from transformers.models.llama import modeling_llama

    wrapper = own_rotary_wrapper(attention, modeling_llama)
    if wrapper is not None:
        return getattr(wrapper.__dict__.get("forward"), "__func__", None) is _fused_rotary_forward
    return bool(getattr(attention, "_sparsefuse_rotary", False))


def own_rotary_wrapper(attention: nn.Module, modeling_llama: types.ModuleType) -> nn.Module | None:
    """The attention module's private copy of the global rotary function module (``kernels``' per-instance
    wrapper), or None where transformers gives it none (the global is a plain function)."""
    shared = modeling_llama.apply_rotary_pos_emb
    if not isinstance(shared, nn.Module):
        return None
    own = attention.__dict__.get("_kernel_funcs")
    if not isinstance(own, dict):
        return None
    return next((w for w in own.values() if type(w) is type(shared)), None)


def _fused_rotary_forward(self: nn.Module, q, k, cos, sin, *args, **kwargs):
    """The forward of a fused attention's own rotary wrapper: transformers' signature there is
    ``(q, k, cos, sin, unsqueeze_dim=1)``."""
    unsqueeze_dim = kwargs.get("unsqueeze_dim", args[0] if args else 1)
    return _fused_rotary(q, k, cos, sin, unsqueeze_dim)


def _fused_rotary(q, k, cos, sin, unsqueeze_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if inductor_traces_inference():  # compiled inference: the compiler fuses the plain expression
        return torch_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


# --- the dispatcher, where transformers gives the attention no rotary wrapper of its own -------------------------


class _FusedAttentionState(threading.local):
    """How many fused models' attention modules are inside their forward on this thread (their rotary embedding
    takes the fused function). Per thread: an unfused Llama run by another thread at the same moment keeps
    transformers' function."""

    depth: int = 0


_FUSED_ATTENTION = _FusedAttentionState()
_TRANSFORMERS_ROTARY: Any = None  # transformers' own apply_rotary_pos_emb, called outside fused models


def _rotary_dispatch(q, k, cos, sin, *args, **kwargs):
    """What ``modeling_llama.apply_rotary_pos_emb`` names once a model was fused by the dispatcher: the fused
    function inside a fused model's attention, transformers' elsewhere."""
    if _FUSED_ATTENTION.depth > 0:
        if not args and not kwargs:  # how LlamaAttention calls it
            return _fused_rotary(q, k, cos, sin, 1)
        # other callers: their arguments read as transformers' signature says (it changed across versions)
        bound = inspect.signature(_TRANSFORMERS_ROTARY).bind(q, k, cos, sin, *args, **kwargs)
        return _fused_rotary(q, k, cos, sin, bound.arguments.get("unsqueeze_dim", 1))
    return _TRANSFORMERS_ROTARY(q, k, cos, sin, *args, **kwargs)


_rotary_dispatch._sparsefuse_dispatch = True  # how a re-imported module recognises an installed dispatcher


def _enter_fused_attention(module, args, kwargs) -> None:
    _FUSED_ATTENTION.depth += 1


def _leave_fused_attention(module, args, kwargs, output) -> None:
    # never below zero: a pre-hook registered before ours that raised skips ours but not this one
    _FUSED_ATTENTION.depth = max(0, _FUSED_ATTENTION.depth - 1)


def _reset_fused_attention(module, args, kwargs) -> None:
    # No attention module is inside its forward when a model (or a decoder layer) starts its own: a count left over
    # by an interrupted forward (a KeyboardInterrupt skips the post-hooks) is cleared here.
    _FUSED_ATTENTION.depth = 0


def _install_rotary_dispatch(modeling_llama: types.ModuleType) -> None:
    """Point ``modeling_llama.apply_rotary_pos_emb`` at the dispatcher once, remembering transformers' function on
    that module (so a reloaded sparsefuse finds it there rather than taking the dispatcher for it)."""
    global _TRANSFORMERS_ROTARY
    current = modeling_llama.apply_rotary_pos_emb
    if getattr(current, "_sparsefuse_dispatch", False):
        _TRANSFORMERS_ROTARY = modeling_llama._sparsefuse_transformers_rotary
    else:
        _TRANSFORMERS_ROTARY = modeling_llama._sparsefuse_transformers_rotary = current
    modeling_llama.apply_rotary_pos_emb = _rotary_dispatch


def _hook_attention(module: nn.Module, modeling_llama: types.ModuleType) -> None:
    if _TRANSFORMERS_ROTARY is None or modeling_llama.apply_rotary_pos_emb is not _rotary_dispatch:
        _install_rotary_dispatch(modeling_llama)
    if not getattr(module, "_sparsefuse_rotary", False):
        module.register_forward_pre_hook(_enter_fused_attention, with_kwargs=True)
        # always_call: the count comes down when the forward raises an Exception too
        module.register_forward_hook(_leave_fused_attention, with_kwargs=True, always_call=True)
        module._sparsefuse_rotary = True
