"""Benchmark workload ``sae_decode``: sparse SAE decode against dense cuBLAS, cuSPARSE, embedding_bag, torch.compile.

Shapes: the reference write-up's (B=32/256, F=65536, D=768, L0=64; B=32, F=131072, D=512, L0=128), Gemma Scope 2B 65k
(D=2304, L0=72) and 262k (L0=100), Gemma Scope 9B 131k (D=3584), Qwen Scope (F=32768, D=2048, L0=100); an L0 sweep
(16..16384) at B=32 and B=1024 showing the crossover with dense; a batch sweep (1..4096) on Gemma 2B 65k.
Minimal traffic: the dense activations read once, the fired rows of W_dec, the output written once.
Activations have exactly L0 random features per token with positive values (as after JumpReLU).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F_

from ...sae import sparse_decode
from ..harness import Case, Options, register

# (B, F, D, L0)
MAIN_SHAPES: list[tuple[int, int, int, int]] = [
    (32, 65536, 768, 64),
    (256, 65536, 768, 64),
    (32, 131072, 512, 128),  # the reference write-up's
    (4096, 65536, 2304, 72),  # Gemma Scope 2B 65k
    (1024, 262144, 2304, 100),  # Gemma Scope 2B 262k
    (1024, 131072, 3584, 72),  # Gemma Scope 9B 131k
    (1024, 32768, 2048, 100),  # Qwen Scope
]
L0_SWEEP = [16, 64, 256, 1024, 4096, 16384]
BATCH_SWEEP = [1, 8, 64, 512, 4096]
QUICK_SHAPES = MAIN_SHAPES[:1]
# What method="auto" picks among (scan, fixed, cuBLAS); "exact" is never auto's pick.
AUTO_CHOICES = ("sparsefuse scan", "sparsefuse fixed (max_l0=2*L0)", "eager")


def _acts(B: int, F: int, l0: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    cols = torch.rand(B, F, device=device).argsort(dim=1)[:, :l0].sort(dim=1).values
    acts = torch.zeros(B, F, device=device, dtype=dtype)
    return acts.scatter_(1, cols, torch.rand(B, l0, device=device, dtype=dtype) + 0.1), cols


def _case(shape: tuple[int, int, int, int], dtype: torch.dtype, device: str, label: str, full: bool) -> Case:
    B, F, D, l0 = shape
    e = dtype.itemsize

    def make_inputs() -> tuple[Any, ...]:
        acts, cols = _acts(B, F, l0, dtype, device)
        w = torch.randn(F, D, device=device, dtype=dtype) / 16
        return acts, w, acts.to_sparse_csr(), cols, acts.gather(1, cols)

    impls = {
        "sparsefuse auto": lambda a, w, *_: sparse_decode(a, w),
        "sparsefuse scan": lambda a, w, *_: sparse_decode(a, w, method="scan"),
        "eager": lambda a, w, *_: a @ w,  # dense cuBLAS in the case's dtype
        "dense fp32": lambda a, w, *_: a.float() @ w.float(),
    }
    if full:
        impls |= {
            "sparsefuse fixed (max_l0=2*L0)": lambda a, w, *_: sparse_decode(a, w, method="fixed", max_l0=2 * l0),
            "sparsefuse exact (1 sync)": lambda a, w, *_: sparse_decode(a, w, method="exact"),
            "dense bf16": lambda a, w, *_: a.bfloat16() @ w.bfloat16(),
            "torch.sparse.mm (prebuilt CSR)": lambda a, w, csr, *_: torch.sparse.mm(csr, w),
            "torch.sparse.mm (with to_sparse_csr)": lambda a, w, *_: torch.sparse.mm(a.to_sparse_csr(), w),
            "F.embedding_bag (prebuilt indices)": lambda a, w, csr, cols, vals: F_.embedding_bag(
                cols, w, per_sample_weights=vals, mode="sum"
            ),
        }
        if B <= 256:  # (a compile per shape costs ~20 s; Inductor's plain matmul is cuBLAS at the large ones)
            impls["torch.compile"] = torch.compile(lambda a, w, *_: a @ w)
    return Case(
        workload="sae_decode",
        shape=f"{label}B={B} F={F} D={D} L0={l0}",
        dtype=dtype,
        direction="fwd",
        bytes_moved=B * F * e + B * l0 * D * e + B * D * e,
        flops=2 * B * l0 * D,
        ceiling="copy",
        make_inputs=make_inputs,
        impls=impls,
        compile_impl="torch.compile" if "torch.compile" in impls else None,
        auto_choices={"sparsefuse auto": tuple(c for c in AUTO_CHOICES if c in impls)},
    )


@register(
    "sae_decode",
    "Sparse SAE decode (acts @ W_dec): sparsefuse vs dense cuBLAS, torch.sparse (cuSPARSE), "
    "F.embedding_bag, torch.compile",
    "batch B, d_sae F, d_model D, fired features per token L0",
)
def sae_decode_cases(options: Options) -> list[Case]:
    dtypes = [d for d in options.dtypes if d in (torch.float32, torch.bfloat16)]
    if options.quick:
        return [_case(s, d, options.device, "", True) for d in dtypes for s in QUICK_SHAPES]
    cases = [_case(s, d, options.device, "", True) for d in dtypes for s in MAIN_SHAPES]
    cases += [
        _case((B, 65536, 768, l0), torch.bfloat16, options.device, "L0 sweep ", False)
        for B in (32, 1024)
        for l0 in L0_SWEEP
    ]
    cases += [_case((B, 65536, 2304, 72), torch.bfloat16, options.device, "batch sweep ", False) for B in BATCH_SWEEP]
    return cases
