"""The TopK encode's sort keys on the torch side, and the selection in plain torch over them: the path for k too
large for the kernel's registers and for the torch backend.

A (value, feature) pair is one int64 key: the float32 value's order-preserving integer image in the high 32 bits,
``0x7FFFFFFF - feature`` in the low 32 (see :mod:`sparsefuse.sae.topk.functional`)."""

from __future__ import annotations

import dataclasses

import torch

from ..._backend import compute_dtype
from ..._plan.config import KnobGroup, current, register_knobs
from .._encoder_tile import sae_input


@dataclasses.dataclass(frozen=True)
class TopKEncodeKnobs(KnobGroup):
    """The TopK encode's torch path (registered as ``"topk_encode"``; read at each call of it).

    ``torch_chunk``: features per step of the chunked torch path (for k past the kernel's registers, and the torch
    backend): it holds M * (k + torch_chunk) keys at a time, where the whole pre-activations would be M * d_sae.
    Tests lower it to merge several chunks at small sizes."""

    torch_chunk: int = 4096


register_knobs("topk_encode", TopKEncodeKnobs())

_LOW_MASK = 0x7FFFFFFF
_NAN_ORDERED = 0x7FC00000  # above +inf's image 0x7F800000


def _pack_keys(pre: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """float32 pre [M, C], feature ids cols [C] -> int64 keys [M, C]."""
    bits = torch.where(pre == 0, 0, pre.view(torch.int32))  # -0.0 -> +0.0
    ordered = torch.where(bits < 0, bits ^ _LOW_MASK, bits)
    ordered = torch.where(torch.isnan(pre), _NAN_ORDERED, ordered)
    return (ordered.to(torch.int64) << 32) | (_LOW_MASK - cols.to(torch.int64))


def _unpack_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 keys -> (feature ids int64, float32 values)."""
    ordered = (keys >> 32).to(torch.int32)
    values = torch.where(ordered < 0, ordered ^ _LOW_MASK, ordered).view(torch.float32)
    return _LOW_MASK - (keys & _LOW_MASK), values


def _topk_keys_torch(
    x2: torch.Tensor,
    W_enc: torch.Tensor,
    b_enc: torch.Tensor,
    b_dec: torch.Tensor | None,
    feature_scale: torch.Tensor | None,
    k: int,
) -> torch.Tensor:
    """The kernel's selection in plain torch, the knob ``torch_chunk`` features at a time (:class:`TopKEncodeKnobs`;
    memory: M * (k + chunk) keys). Returns the k best keys per row, sorted decreasing."""
    dtype = compute_dtype(x2.dtype)
    sae_in = sae_input(x2, b_dec).to(dtype)
    chunk = current().knobs("topk_encode").torch_chunk
    best = None
    for f0 in range(0, W_enc.shape[1], chunk):
        f1 = min(f0 + chunk, W_enc.shape[1])
        pre = sae_in @ W_enc[:, f0:f1].to(dtype) + b_enc[f0:f1].to(dtype)
        if feature_scale is not None:
            pre = pre * feature_scale[f0:f1].to(dtype)
        keys = _pack_keys(pre, torch.arange(f0, f1, device=x2.device))
        merged = keys if best is None else torch.cat([best, keys], dim=1)
        best = merged.topk(min(k, merged.shape[1]), dim=1).values  # sorted, decreasing
    return best
