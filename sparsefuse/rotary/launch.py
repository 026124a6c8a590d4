"""Rotary position embedding's launchers: lay out the outputs, size the grid, launch, ``record_launch``. Nothing here
checks arguments (functional.py did). CPU tensors without the interpreter run the plain-torch reference instead.

    out = x * cos + rotate_half(x) * sin          rotate_half(x) = cat(-x2, x1)
    out1 = x1 * c1 - x2 * s1,   out2 = x2 * c2 + x1 * s2            (x1, x2 the halves of the last dim)
    backward (cos, sin constant): dx1 = g1 * c1 + g2 * s2,   dx2 = g2 * c2 - g1 * s1

Math runs in float32 (float64 when the promoted dtype is float64, so float64 inputs take the kernels too) and the
result is rounded once. The output dtype is q's promoted with cos' (transformers' type promotion: under autocast
Llama passes bfloat16 q, k with float32 cos, sin and gets float32 back); the backward returns q's dtype.

Layout: an output keeps its input's strides when the input is dense (a permutation of a contiguous tensor: the
transposed [B, S, H, hd] views Llama passes are written in that storage order), else it is contiguous. The kernels
take any strides, so no input is ever copied.

Cost model (q and k of E bytes an element, hd-sized rows): the forward reads q and k and writes both outputs
(2E bytes an element) plus cos and sin once per token (4 hd E per token, 1/H of q's bytes or less); the backward
the same with the gradients. transformers' eager formula runs five kernels per tensor (multiply, negate a half, cat,
multiply, add) through ~5x these bytes: measured 12-13x slower than this kernel on an H200 (bf16, Llama shapes).
"""

from __future__ import annotations

import dataclasses

import torch

from .. import _backend
from .._backend import Backend, backend_for, compute_dtype, new_output_layout_like, next_power_of_2, record_launch
from .._plan.config import KnobGroup, current, register_knobs
from .kernels import rotary_kernel
from .reference import torch_apply_rotary_pos_emb, torch_rotary_backward


@dataclasses.dataclass(frozen=True)
class RotaryKnobs(KnobGroup):
    """How the rotary kernels tile their heads (registered as ``"rotary"``; read at each launch).

    ``tile``: elements of one half-row tile [BLOCK_H, HALF_PAD] a program holds per (unrolled) step over the heads,
    16 a thread (its warps follow from it). Measured on an H200 with CUDA-graph replay, bf16, q and k transposed
    views as Llama passes them: tiles of 512, 1024 and 2048 elements over 2, 4 and 8 warps at (B, S, H, H_kv, hd) =
    (4, 2048, 32, 8, 128), (8, 2048, 32, 4, 64), (1, 8192, 64, 8, 128) and (2, 2048, 40, 40, 80); this rule was the
    best or within 2% of it at every shape: 3.4-4.0 TB/s of reads and writes where a device copy reaches 4.2
    (Inductor's kernel for transformers' formula: 3.9 TB/s at the first shape, 0.4-0.9 TB/s at the other three).
    Tests lower it to cover heads looped over several steps with partial tails."""

    tile: int = 2048


register_knobs("rotary", RotaryKnobs())

ELEMENTS_PER_THREAD = 16
WARPS: int | None = None  # a fixed count (benchmarks), else from the tile


def _heads_strides(t: torch.Tensor, unsqueeze_dim: int) -> tuple[int, ...]:
    """t's strides as [B, heads, S, hd] (unsqueeze_dim=1 is that layout already; 2 is [B, S, heads, hd]). Tuples
    rather than transposed views: a view costs microseconds of host time, on every call."""
    s = t.stride()
    return s if unsqueeze_dim == 1 else (s[0], s[2], s[1], s[3])


def _broadcast_strides(t: torch.Tensor) -> tuple[int, ...]:
    """cos' or sin's [B or 1, S or 1, hd] strides with 0 over a broadcast dim (what ``expand`` would give)."""
    return tuple(0 if n == 1 else st for n, st in zip(t.shape, t.stride()))


def _warps(tile: int) -> int:
    """Warps for a program whose q tile holds ``tile`` elements per half: ELEMENTS_PER_THREAD each."""
    if WARPS is not None:
        return WARPS
    return max(1, min(8, tile // (32 * ELEMENTS_PER_THREAD)))


def _head_block(n_heads: int, half_pad: int, tile: int) -> int:
    """Heads a loop step covers: all of them where they fit in a ``tile``, else the most that do."""
    return max(1, min(next_power_of_2(max(n_heads, 1)), tile // half_pad))


def _rotate_into(
    backward: bool,
    q: torch.Tensor,
    k: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int,
) -> None:
    """Writes the rotation (forward) or its transpose (backward) of q and k into q_out and k_out: one launch."""
    if unsqueeze_dim == 1:
        B, H, S, hd = q.shape
        B_k, H_kv, S_k, hd_k = k.shape
    else:
        B, S, H, hd = q.shape
        B_k, S_k, H_kv, hd_k = k.shape
    if (B_k, S_k, hd_k) != (B, S, hd):  # a direct op call skips functional's checks; this would read out of bounds
        raise ValueError(f"rotary: k {list(k.shape)} does not match q {list(q.shape)} (unsqueeze_dim={unsqueeze_dim})")
    if B * S == 0 or hd == 0 or H + H_kv == 0:
        return
    if backend_for(q) is Backend.TORCH:
        _backend.warn_reference_once("apply_rotary_pos_emb")
        compute = _backend.compute_dtype(q_out.dtype)
        formula = torch_rotary_backward if backward else torch_apply_rotary_pos_emb
        a, b = formula(q.to(compute), k.to(compute), cos.to(compute), sin.to(compute), unsqueeze_dim)
        q_out.copy_(a)
        k_out.copy_(b)
        return
    half = hd // 2
    half_pad = next_power_of_2(half)
    fp64 = compute_dtype(torch.promote_types(torch.promote_types(q.dtype, cos.dtype), q_out.dtype)) == torch.float64
    tile = current().knobs("rotary").tile
    block_hq = _head_block(H, half_pad, tile)
    rotary_kernel[(B * S,)](
        q,
        k,
        q_out,
        k_out,
        cos,
        sin,
        S,
        *_heads_strides(q, unsqueeze_dim),
        *_heads_strides(k, unsqueeze_dim),
        *_heads_strides(q_out, unsqueeze_dim),
        *_heads_strides(k_out, unsqueeze_dim),
        *_broadcast_strides(cos),
        *_broadcast_strides(sin),
        BACKWARD=backward,
        FP64=fp64,
        H=H,
        H_KV=H_kv,
        HALF=half,
        BLOCK_HQ=block_hq,
        BLOCK_HK=_head_block(H_kv, half_pad, tile),
        HALF_PAD=half_pad,
        num_warps=_warps(block_hq * half_pad),
    )
    record_launch("rotary_bwd_kernel" if backward else "rotary_fwd_kernel")  # one kernel, counted per direction


def rotary_forward(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_embed, k_embed) with q's and k's shapes in the promoted dtype of q and cos, laid out as described above.

    q [B, H, S, hd] and k [B, H_kv, S, hd] for ``unsqueeze_dim=1`` ([B, S, H, hd] and [B, S, H_kv, hd] for 2);
    cos, sin broadcastable to [B, S, hd] by their leading dims (in practice [B, S, hd] or [1, S, hd])."""
    dtype = torch.promote_types(q.dtype, cos.dtype)
    q_out, k_out = new_output_layout_like(q, dtype), new_output_layout_like(k, dtype)
    _rotate_into(False, q, k, q_out, k_out, cos, sin, unsqueeze_dim)
    return q_out, k_out


def rotary_backward(
    grad_q: torch.Tensor,
    grad_k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int,
    grad_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of q, grad of k) in grad_dtype (q's dtype) from the outputs' gradients (shapes as in
    :func:`rotary_forward`); each laid out like its incoming gradient when that is dense, else contiguous."""
    dq, dk = new_output_layout_like(grad_q, grad_dtype), new_output_layout_like(grad_k, grad_dtype)
    _rotate_into(True, grad_q, grad_k, dq, dk, cos, sin, unsqueeze_dim)
    return dq, dk
