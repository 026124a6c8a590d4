"""``check`` entries for the fused Llama pieces ``patch_llama`` installs besides the FFN: RMSNorm and the rotary
embedding, forward and backward, against their float64 references (same rule as :mod:`.check`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

import sparsefuse
from sparsefuse.norms.rmsnorm import torch_rms_norm
from sparsefuse.rotary import apply_rotary_pos_emb, torch_apply_rotary_pos_emb

from .check_rules import Outputs, compare


def _leaf(shape: Sequence[int], gen: torch.Generator, dtype: torch.dtype, device: str, scale: float = 1.0):
    return (torch.randn(tuple(shape), generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)


def _grads(fn, leaves, grad_outputs):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return outs, torch.autograd.grad(outs, leaves, grad_outputs)


def rms_norm_fwd_bwd(shape: Sequence[int], dtype: torch.dtype, device: str, gen: torch.Generator):
    """shape (M, D): x ~ N(0, 4), weight ~ N(1, 0.25); y, grad_x and grad_weight (a sum over M rows)."""
    M, D = shape
    x, w = (
        _leaf((M, D), gen, dtype, device, 2.0),
        (1 + _leaf((D,), gen, torch.float64, "cpu", 0.5)).to(dtype).to(device),
    )
    g = _leaf((M, D), gen, dtype, device)

    def run() -> Outputs:
        def ours(a, b):
            return sparsefuse.rms_norm(a, D, b, 1e-6)

        def reference(a, b):
            return torch_rms_norm(a, b, 1e-6)

        (y,), grads = _grads(ours, (x, w), (g,))
        (y64,), grads64 = _grads(reference, (x.double(), w.double()), (g.double(),))
        (y_low,), grads_low = _grads(reference, (x, w), (g,))
        outs = [compare("y", y, y64, y_low, dtype)]
        for name, o, r, lo in zip(("grad_x", "grad_weight"), grads, grads64, grads_low):
            outs.append(compare(name, o, r, lo, dtype))
        return outs

    return x, run


def rotary_fwd_bwd(shape: Sequence[int], dtype: torch.dtype, device: str, gen: torch.Generator):
    """shape (B, S, H, H_kv, hd): q, k as Llama lays them out (transposed views of [B, S, heads, hd]), cos/sin of
    real angles [1, S, hd]; both outputs and both gradients."""
    B, S, H, H_kv, hd = shape
    q, k = _leaf((B, S, H, hd), gen, dtype, device), _leaf((B, S, H_kv, hd), gen, dtype, device)
    angles = torch.arange(S, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(0, hd, 2) / hd)
    angles = torch.cat([angles, angles], -1)[None]
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    gq, gk = _leaf((B, H, S, hd), gen, dtype, device), _leaf((B, H_kv, S, hd), gen, dtype, device)

    def run() -> Outputs:
        def call(fn: Callable, c, s):
            return lambda a, b: fn(a.transpose(1, 2), b.transpose(1, 2), c, s)

        outs, grads = _grads(call(apply_rotary_pos_emb, cos, sin), (q, k), (gq, gk))
        outs64, grads64 = _grads(
            call(torch_apply_rotary_pos_emb, cos.double(), sin.double()),
            (q.double(), k.double()),
            (gq.double(), gk.double()),
        )
        outs_low, grads_low = _grads(call(torch_apply_rotary_pos_emb, cos, sin), (q, k), (gq, gk))
        names = ("q_embed", "k_embed", "grad_q", "grad_k")
        return [
            compare(n, o, r, lo, dtype)
            for n, o, r, lo in zip(names, (*outs, *grads), (*outs64, *grads64), (*outs_low, *grads_low))
        ]

    return q, run
