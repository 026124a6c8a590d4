"""Liger-Kernel as a peer row of the whole-model workloads: what an LLM user would run instead of patch_llama.

``liger_copy(model)`` returns a deep copy of an unpatched Llama with Liger's fused RMSNorm on its own norm modules,
and ``liger_call(fn)`` wraps a call of it so that Liger's rotary embedding is in force for that call only.
``apply_liger_kernel_to_llama`` patches transformers' module globals (the RMSNorm class, ``apply_rotary_pos_emb``)
for every model of the process; the rows compare models side by side in one process, so those globals are put back
at once and the rotary function is swapped in only around the Liger model's own calls -- the unpatched and patched
rows run exactly what they run without Liger installed. SwiGLU is off (the models are ReLU); the training rows take
Liger's fused linear cross entropy (:func:`liger_training_copy`, and :func:`liger_loss` on the patched model).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch

_GLOBALS = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaForCausalLM.forward")


def peer(impl: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A row's call, with Liger's rotary embedding in force for the Liger rows' (``"liger"``, ``"liger compile"``)."""
    return liger_call(fn) if impl.startswith("liger") else fn


def runs_on(device: str) -> bool:
    """Whether the Liger rows apply: Liger-Kernel installed, and a CUDA device to run its kernels."""
    return str(device).startswith("cuda") and available()


def available() -> bool:
    """Whether Liger-Kernel can be imported (it needs a CUDA build of Triton to run)."""
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _globals_kept() -> Iterator[Any]:
    from transformers.models.llama import modeling_llama

    saved = {name: _get(modeling_llama, name) for name in _GLOBALS}
    try:
        yield modeling_llama
    finally:
        for name, value in saved.items():
            owner, _, attr = name.rpartition(".")
            setattr(_get(modeling_llama, owner) if owner else modeling_llama, attr, value)


def _get(module: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


def liger_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` whose RMSNorm modules run Liger's kernel (instance-level; globals untouched)."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    peer = copy.deepcopy(model)
    with _globals_kept():
        apply_liger_kernel_to_llama(
            rope=False, rms_norm=True, swiglu=False, cross_entropy=False, fused_linear_cross_entropy=False, model=peer
        )
    return peer


def liger_training_copy(model: torch.nn.Module) -> torch.nn.Module:
    """:func:`liger_copy` for training: also Liger's fused linear cross entropy (the loss without the [tokens,
    vocab] logits), as a trainer applies it, bound to this copy's own ``forward``."""
    from types import MethodType

    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from liger_kernel.transformers.model.llama import lce_forward

    peer = copy.deepcopy(model)
    with _globals_kept():
        apply_liger_kernel_to_llama(
            rope=False, rms_norm=True, swiglu=False, cross_entropy=False, fused_linear_cross_entropy=True, model=peer
        )
    if "forward" not in peer.__dict__:  # a version that patched the class alone: the copy's own method instead
        peer.forward = MethodType(lce_forward, peer)
    return peer


@contextlib.contextmanager
def liger_loss(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` (a patched Llama: its norms and rotary are patch_llama's) with Liger's fused linear cross entropy as
    its forward for the block's duration, as ``apply_liger_kernel_to_llama(fused_linear_cross_entropy=True,
    model=model)`` binds it, and its own forward again afterwards: the same model and optimizer serve both rows."""
    from types import MethodType

    from liger_kernel.transformers.model.llama import lce_forward

    had, own = "forward" in model.__dict__, model.__dict__.get("forward")
    model.forward = MethodType(lce_forward, model)
    try:
        yield model
    finally:
        if had:
            model.forward = own
        else:
            del model.forward


def liger_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with Liger's rotary embedding installed in transformers' Llama module for the call's duration."""
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    def call(*args: Any, **kwargs: Any) -> Any:
        with _globals_kept() as modeling_llama:
            modeling_llama.apply_rotary_pos_emb = liger_rotary_pos_emb
            return fn(*args, **kwargs)

    return call
