"""Benchmark workload ``sae_topk``: a TopK SAE's decode, forward and backward (what a TopK SAE's training step runs
after its encode), ``sparsefuse.topk_decode`` against the dense decode TopK SAEs use (the k activations scattered
into a [B, d_sae] tensor, then ``@ W_dec``, differentiated by autograd) and, in fp32, ``F.embedding_bag`` (torch's
own gather with per-sample weights, differentiable in both there; its CUDA backward has no bf16 kernel).

Shapes (B, F, D, k): a Gemma-2B-sized TopK SAE (65536 features, d_model 2304, k 64) at 4096 tokens, a 9B-sized one
(131072 x 3584) at 1024 tokens, and the reference write-up's (65536 x 768, k 32) at 256 tokens; bf16 and fp32. The
ids are distinct per token, each token's first id one feature that every token picks (a hot feature: a long row of
the transposed activations).

Minimal traffic: the forward's and the activations' gradient's gathered decoder rows (B k D each), W_dec's gradient
written once (F D) from B k gathered rows of the output's gradient, the output and its gradient once each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F_

from ...sae import topk_decode
from ..harness import Case, Options, register

# (B, F, D, k)
SHAPES: list[tuple[int, int, int, int]] = [(4096, 65536, 2304, 64), (1024, 131072, 3584, 64), (256, 65536, 768, 32)]
QUICK_SHAPES = SHAPES[2:]


def topk_inputs(B: int, F: int, D: int, k: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    """(ids [B, k] int64, distinct per token, slot 0 feature 0 for every token; activations [B, k] > 0; W_dec
    [F, D]; the output's gradient [B, D]), activations and W_dec requiring grad."""
    ids = torch.rand(B, F - 1, device=device).argsort(dim=1)[:, : k - 1] + 1 if k > 1 else None
    hot = torch.zeros(B, 1, dtype=torch.long, device=device)
    ids = torch.cat([hot, ids], dim=1) if ids is not None else hot
    vals = (torch.rand(B, k, device=device) + 0.1).to(dtype).requires_grad_()
    w = (torch.randn(F, D, device=device) / 16).to(dtype).requires_grad_()
    return ids, vals, w, torch.randn(B, D, device=device, dtype=dtype)


def _dense_decode(ids: torch.Tensor, vals: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    dense = torch.zeros(ids.shape[0], w.shape[0], dtype=vals.dtype, device=vals.device)
    return dense.scatter(1, ids, vals) @ w


def _step(decode, ids, vals, w, grad_out) -> tuple[torch.Tensor, ...]:
    out = decode(ids, vals, w)
    return (out, *torch.autograd.grad(out, (vals, w), grad_out))


def _case(shape: tuple[int, int, int, int], dtype: torch.dtype, device: str) -> Case:
    B, F, D, k = shape
    e = dtype.itemsize
    impls = {
        "sparsefuse topk_decode": lambda i, v, w, g: _step(lambda *a: topk_decode(*a, check_indices=False), i, v, w, g),
        "eager": lambda i, v, w, g: _step(_dense_decode, i, v, w, g),
    }
    if dtype == torch.float32:  # (torch's CUDA backward of per-sample weights has no bf16 kernel)
        impls["F.embedding_bag"] = lambda i, v, w, g: _step(
            lambda ids, vals, W: F_.embedding_bag(ids, W, per_sample_weights=vals, mode="sum"), i, v, w, g
        )
    return Case(
        workload="sae_topk",
        shape=f"B={B} F={F} D={D} k={k}",
        dtype=dtype,
        direction="fwd+bwd",
        bytes_moved=(3 * B * k * D + 2 * B * D + F * D) * e,
        flops=6 * B * k * D,
        ceiling="copy",
        make_inputs=lambda: topk_inputs(B, F, D, k, dtype, device),
        impls=impls,
        compile_impl=None,
    )


@register(
    "sae_topk",
    "TopK SAE decode, forward + backward: sparsefuse topk_decode vs the dense decode and F.embedding_bag",
    "batch B, d_sae F, d_model D, features per token k",
)
def sae_topk_cases(options: Options) -> list[Case]:
    dtypes = [d for d in options.dtypes if d in (torch.float32, torch.bfloat16)]
    shapes = QUICK_SHAPES if options.quick else SHAPES
    return [_case(s, d, options.device) for d in dtypes for s in shapes]


__all__ = ["sae_topk_cases", "topk_inputs"]
