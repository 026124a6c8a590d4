"""Benchmark workload ``sae_decode``: sparse SAE decode against dense cuBLAS, cuSPARSE and torch.compile.

Shapes from the seed write-up (B=32/256, F=65536, D=768, L0=64; B=32, F=131072, D=512, L0=128) and Gemma Scope 2B
65k (D=2304, L0=72). Minimal traffic: the activations read once (dense input), the fired rows of W_dec, the output.
"""

from __future__ import annotations

from typing import Any

import torch

from ...sae import sparse_decode
from ..harness import Case, Options, register

SAE_SHAPES: list[tuple[int, int, int, int]] = [  # (B, F, D, L0)
    (32, 65536, 768, 64), (256, 65536, 768, 64), (32, 131072, 512, 128), (4096, 65536, 2304, 72),
]  # fmt: skip
SAE_QUICK_SHAPES = SAE_SHAPES[:1]


def _acts(B: int, F: int, l0: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Exactly l0 random features per token with positive values (as after JumpReLU)."""
    cols = torch.rand(B, F, device=device).argsort(dim=1)[:, :l0]
    acts = torch.zeros(B, F, device=device, dtype=dtype)
    return acts.scatter_(1, cols, torch.rand(B, l0, device=device, dtype=dtype) + 0.1)


def _case(shape: tuple[int, int, int, int], dtype: torch.dtype, device: str) -> Case:
    B, F, D, l0 = shape
    e = torch.tensor([], dtype=dtype).element_size()

    def make_inputs() -> tuple[Any, ...]:
        return _acts(B, F, l0, dtype, device), torch.randn(F, D, device=device, dtype=dtype) / 16

    impls = {
        "sparsefuse fixed": lambda a, w: sparse_decode(a, w, method="fixed", max_l0=2 * l0),
        "sparsefuse exact": lambda a, w: sparse_decode(a, w, method="exact"),
        "eager": lambda a, w: a @ w,  # dense cuBLAS in the case's dtype
        "dense fp32": lambda a, w: a.float() @ w.float(),
        "torch.compile": torch.compile(lambda a, w: a @ w),
        "torch.sparse.mm (with to_sparse_csr)": lambda a, w: torch.sparse.mm(a.to_sparse_csr(), w),
    }
    return Case(
        workload="sae_decode", shape=f"B={B} F={F} D={D} L0={l0}", dtype=dtype, direction="fwd",
        bytes_moved=B * F * e + B * l0 * D * e + B * D * e, flops=2 * B * l0 * D, ceiling="copy",
        make_inputs=make_inputs, impls=impls,
    )  # fmt: skip


@register("sae_decode")
def sae_decode_cases(options: Options) -> list[Case]:
    shapes = SAE_QUICK_SHAPES if options.quick else SAE_SHAPES
    return [_case(shape, dtype, options.device) for dtype in options.dtypes if dtype != torch.float16 for shape in shapes]
