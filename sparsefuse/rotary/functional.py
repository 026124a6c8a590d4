"""The public ``apply_rotary_pos_emb``: check its arguments, then call the launcher directly in plain eager inference,
an ``autograd.Function`` around the same launchers in plain eager training, or the torch.library op otherwise."""

from __future__ import annotations

import torch

from .. import _backend
from .._validation import check_float, check_same_device, check_tensor, describe
from .launch import rotary_forward
from .op import rotary_forward_autograd
from .reference import torch_apply_rotary_pos_emb_rounded_once

ROTARY_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_OP = "apply_rotary_pos_emb"


def _layout(unsqueeze_dim: int) -> str:
    return "[B, heads, S, hd]" if unsqueeze_dim == 1 else "[B, S, heads, hd]"


def check_rotary_args(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: object
) -> None:
    """ValueError / TypeError naming the argument unless: q and k are 4-D of one float dtype (ROTARY_DTYPES) in the
    layout unsqueeze_dim names (1: [B, heads, S, hd], 2: [B, S, heads, hd]) with equal B, S and an even hd; cos and
    sin have one float dtype and the shape [B or 1, S or 1, hd]; all on one device."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_tensor(_OP, name, t)
        check_float(_OP, name, t, ROTARY_DTYPES)
    check_same_device(_OP, q=q, k=k, cos=cos, sin=sin)
    if isinstance(unsqueeze_dim, bool) or unsqueeze_dim not in (1, 2):
        raise ValueError(
            f"{_OP}: unsqueeze_dim must be 1 (q, k [B, heads, S, hd]) or 2 (q, k [B, S, heads, hd]); "
            f"got {unsqueeze_dim!r}"
        )
    if k.dtype != q.dtype:
        raise TypeError(f"{_OP}: k must have q's dtype {q.dtype}; got k with {describe(k)}")
    if sin.dtype != cos.dtype:
        raise TypeError(f"{_OP}: sin must have cos' dtype {cos.dtype}; got sin with {describe(sin)}")
    layout = _layout(unsqueeze_dim)
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(f"{_OP}: {name} must be 4-D {layout} for unsqueeze_dim={unsqueeze_dim}; got {describe(t)}")
    s_dim = 2 if unsqueeze_dim == 1 else 1
    B, S, hd = q.shape[0], q.shape[s_dim], q.shape[3]
    if hd % 2:
        raise ValueError(f"{_OP}: the head dim (q's last) must be even to rotate its two halves; got {describe(q)}")
    if k.shape[0] != B or k.shape[s_dim] != S or k.shape[3] != hd:
        raise ValueError(
            f"{_OP}: k must be {layout} with q's B={B}, S={S} and hd={hd} (its head count may differ); "
            f"got k with {describe(k)}"
        )
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or t.shape[0] not in (1, B) or t.shape[1] not in (1, S) or t.shape[2] != hd:
            raise ValueError(
                f"{_OP}: {name} must be [B, S, hd] = [{B}, {S}, {hd}] (B and S may be 1, broadcast) for q with "
                f"{describe(q)}; got {name} with {describe(t)}"
            )
    if sin.shape != cos.shape:
        raise ValueError(f"{_OP}: sin must have cos' shape {list(cos.shape)}; got sin with {describe(sin)}")


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q and k: a fused drop-in for transformers' ``apply_rotary_pos_emb`` (Llama).

    ``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)`` with cos and sin unsqueezed at
    unsqueeze_dim, ``rotate_half(x) = cat(-x2, x1)`` over the halves of the last dim; one kernel launch for both.

    Args:
        q: [B, H, S, hd] for ``unsqueeze_dim=1`` (Llama's layout, usually a transposed view of a [B, S, H, hd]
            tensor) or [B, S, H, hd] for ``unsqueeze_dim=2``; float32, float16, bfloat16 or float64; hd even.
        k: as q with its own head count (grouped-query attention), q's dtype.
        cos, sin: [B, S, hd] or [1, S, hd] (a dim of 1 broadcasts), one float dtype.
        position_ids: accepted and ignored, as in transformers.
        unsqueeze_dim: 1 or 2 (``ValueError`` otherwise).

    Returns:
        (q_embed, k_embed): q's and k's shapes in q's dtype promoted with cos' (as transformers' arithmetic
        promotes), each with its input's strides when that input is dense, else contiguous.

    Computed in float32 (float64 when the promoted dtype is) and rounded once; transformers rounds three times in
    low precision, so this is at least as accurate. Differentiable in q and k with cos and sin held constant, as
    transformers computes them under ``no_grad``; when cos or sin requires grad the call takes the differentiable
    torch formula instead (same numbers, several kernels).
    """
    check_rotary_args(q, k, cos, sin, unsqueeze_dim)
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return torch_apply_rotary_pos_emb_rounded_once(q, k, cos, sin, unsqueeze_dim)
    if _backend.bypass_dispatcher(q, k, cos, sin):
        return rotary_forward(q, k, cos, sin, unsqueeze_dim)
    return rotary_forward_autograd(q, k, cos, sin, unsqueeze_dim)
