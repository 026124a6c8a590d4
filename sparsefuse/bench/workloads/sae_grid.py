"""Benchmark workload ``sae_decode_grid``: is any valid input far slower than the best method? The SAE decode over
distributions of the per-token L0 that real SAEs show, every method a user can pick, and how far each is from the
fastest on that input.

L0 distributions (each with the shape's mean L0): ``constant``; ``lognormal s`` for s in 0.3, 0.6, 1.0 (per-token L0
= mean * exp(s * g - s^2 / 2), g ~ N(0, 1): the heavy tails a fixed capacity overflows on); ``full rows`` (constant,
plus two tokens firing every feature). Batches 32, 256 and 4096; shapes F=65536 with D=768 (fp32) and D=2304 (bf16).
Methods: ``auto``, ``scan``, ``fixed`` (``max_l0`` = 2 x the mean L0: tokens past it overflow), ``exact`` (one
host sync), and dense cuBLAS (``eager``). The summary lists, per input, each method's time over the fastest's --
the "no cliff" targets are fixed within 1.5x and auto within 1.05x of the best. ``--quick``: B=32, the fp32 shape.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...sae import sparse_decode
from ..harness import Case, Options, Result, register

SHAPES: list[tuple[int, int, int, torch.dtype]] = [(65536, 768, 64, torch.float32), (65536, 2304, 72, torch.bfloat16)]
BATCHES = [32, 256, 4096]
DISTRIBUTIONS = ["constant", "lognormal 0.3", "lognormal 0.6", "lognormal 1.0", "full rows"]
METHODS = ("sparsefuse auto", "sparsefuse scan", "sparsefuse fixed", "sparsefuse exact (1 sync)", "eager")


def token_l0s(B: int, F: int, mean_l0: int, distribution: str, generator: torch.Generator) -> torch.Tensor:
    """[B] int64 fired features per token, with mean ``mean_l0`` in expectation, each in [0, F]."""
    if distribution == "constant" or distribution == "full rows":
        l0 = torch.full((B,), mean_l0, dtype=torch.int64)
        if distribution == "full rows":
            l0[: min(2, B)] = F
        return l0
    if not distribution.startswith("lognormal "):
        raise ValueError(f"sae_decode_grid: unknown L0 distribution {distribution!r}")
    s = float(distribution.split()[1])
    g = torch.randn(B, generator=generator, dtype=torch.float64)
    return (mean_l0 * torch.exp(s * g - s * s / 2)).round().clamp(0, F).to(torch.int64)


def grid_acts(B: int, F: int, l0: torch.Tensor, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """[B, F] activations with l0[b] positive values at random features of token b."""
    g = torch.Generator(device=device).manual_seed(seed)
    rank = torch.rand(B, F, generator=g, device=device).argsort(dim=1).argsort(dim=1)  # a random order per token
    fired = rank < l0.to(device)[:, None]
    values = torch.rand(B, F, generator=g, device=device) + 0.1
    return torch.where(fired, values, 0.0).to(dtype)


def _case(B: int, F: int, D: int, mean_l0: int, dtype: torch.dtype, distribution: str, device: str) -> Case:
    seeds = iter(range(1 << 30))
    l0 = token_l0s(B, F, mean_l0, distribution, torch.Generator().manual_seed(B + F + D))
    cap = 2 * mean_l0

    def make_inputs() -> tuple[Any, ...]:
        acts = grid_acts(B, F, l0, dtype, device, next(seeds))
        return acts, torch.randn(F, D, device=device, dtype=dtype) / 16

    impls = {
        "sparsefuse auto": lambda a, w: sparse_decode(a, w),
        "sparsefuse scan": lambda a, w: sparse_decode(a, w, method="scan"),
        "sparsefuse fixed": lambda a, w: sparse_decode(a, w, method="fixed", max_l0=cap),
        "sparsefuse exact (1 sync)": lambda a, w: sparse_decode(a, w, method="exact"),
        "eager": lambda a, w: a @ w,
    }
    total = int(l0.sum())
    e = dtype.itemsize
    overflowing = int((l0 > cap).sum())
    return Case(
        workload="sae_decode_grid",
        shape=f"{distribution} B={B} F={F} D={D} L0={mean_l0} (over {cap}: {overflowing})",
        dtype=dtype,
        direction="fwd",
        bytes_moved=B * F * e + total * D * e + B * D * e,
        flops=2 * total * D,
        ceiling="copy",
        make_inputs=make_inputs,
        impls=impls,
        compile_impl=None,
        auto_choices={"sparsefuse auto": ("sparsefuse scan", "sparsefuse fixed", "eager")},
    )


def summary(rows: list[Result]) -> list[str]:
    """Markdown: per input, each method's time over the fastest method's on it."""
    by_shape: dict[tuple[str, str], dict[str, Result]] = {}
    for r in rows:
        if r.status == "ok" and math.isfinite(r.median_us):
            by_shape.setdefault((r.shape, r.dtype), {})[r.impl] = r
    short = {m: m.removeprefix("sparsefuse ").removesuffix(" (1 sync)") for m in METHODS}
    lines = [
        "Time over the fastest method on the same input (1.00x: the fastest). Targets: fixed within 1.5x, auto "
        "within 1.05x.",
        "",
        "| input | dtype | fastest | " + " | ".join(short[m] for m in METHODS) + " |",
        "|---|---|---|" + "---|" * len(METHODS),
    ]
    for (shape, dtype), impls in by_shape.items():
        best = min(impls.values(), key=lambda r: r.median_us)
        ratios = [f"{impls[m].median_us / best.median_us:.2f}x" if m in impls else "-" for m in METHODS]
        lines.append(f"| {shape} | {dtype} | {short.get(best.impl, best.impl)} | " + " | ".join(ratios) + " |")
    return [*lines, ""]


@register(
    "sae_decode_grid",
    "SAE decode over per-token L0 distributions: every method against the fastest on each input",
    "L0 distribution, batch B, d_sae F, d_model D, mean L0 (tokens over fixed's capacity)",
    summary=summary,
)
def sae_decode_grid_cases(options: Options) -> list[Case]:
    shapes, batches = (SHAPES[:1], [32]) if options.quick else (SHAPES, BATCHES)
    return [
        _case(B, F, D, l0, dtype, distribution, options.device)
        for F, D, l0, dtype in shapes
        if dtype in options.dtypes or options.quick
        for B in batches
        for distribution in DISTRIBUTIONS
    ]


__all__ = ["sae_decode_grid_cases", "token_l0s", "grid_acts", "summary"]
