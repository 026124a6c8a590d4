"""Benchmark workload ``ffn``: the TwELL gated feed-forward block against dense eager, torch.compile and the gate
matmul alone (the floor of this design), across batch sizes and sparsity levels.

Shapes: the paper's 1.5B model (K=2048, N=5632) and an 8B-class layer (K=4096, N=14336); tokens M in
{1, 16, 256, 2048, 8192, 16384}; mean gate non-zeros per token from 8 to 2048, drawn by
:mod:`sparsefuse.ffn.synthetic` (heavy-tailed across tokens, hot and dead neurons). One case per (shape, M, dtype)
holds every sparsity level, because the dense baselines do not depend on it. bf16 only (fp16 when bf16 is not
requested). ``--quick``: the 1.5B shape at M in {16, 8192}, nnz in {32, 512}. Rows:

* ``eager``              ``F.linear(relu(F.linear(x, Wg)) * F.linear(x, Wu), Wd)``: three cuBLAS matmuls + 2 passes
* ``torch.compile``      the same function compiled (default mode)
* ``gate matmul``        ``F.linear(x, Wg)`` alone (cuBLAS): what the fused path can at best cost
* ``twell gate kernel``  sparsefuse's gate matmul with the TwELL epilogue alone (kernel 1)
* ``twell nnz=S``        ``twell_mlp(method="twell")`` at S mean non-zeros per token (omitted where the cost model
                         predicts > 8x dense: those rows would dominate the run time and say nothing new)
* ``block nnz=S``        ``twell_mlp(method="block")`` (cuBLAS gate, row-block unions, tensor-core up/down on the
                         unions), from 1024 tokens up
* ``auto nnz=S``         ``twell_mlp(method="auto")`` with a :class:`~sparsefuse.ffn.SparsityMonitor` (sync-free
                         after the warm-up calls), i.e. what :class:`sparsefuse.nn.SparseGatedMLP` runs

``flops`` is the dense block's ``6 M K N`` for every row, so TFLOP/s of a sparse row is dense-equivalent.
:func:`crossover` turns the result rows into the crossover table (largest sparsity at which twell still beats
eager, and the worst auto/eager ratio) for the report.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ...ffn import CostModel, SparsityMonitor, predicted_block_time, predicted_times, twell_gate, twell_mlp
from ...ffn.synthetic import synthetic_ffn
from ..harness import Case, Options, Result, register

FFN_SHAPES: list[tuple[int, int]] = [(2048, 5632), (4096, 14336)]  # (K = hidden, N = intermediate)
M_VALUES = [1, 16, 256, 2048, 8192, 16384]
NNZ_VALUES = [8, 32, 128, 512, 2048]
# The 8B layer is 2.5x the work per token: a sparser grid keeps the full run at a few minutes.
GRID: dict[tuple[int, int], tuple[list[int], list[int]]] = {
    (2048, 5632): (M_VALUES, NNZ_VALUES),
    (4096, 14336): ([16, 2048, 8192], [8, 32, 512, 2048]),
}
QUICK_GRID: dict[tuple[int, int], tuple[list[int], list[int]]] = {(2048, 5632): ([16, 8192], [32, 512])}
TARGET_NNZ = 32  # the x used by the dense rows (their time does not depend on it)
SKIP_TWELL_ABOVE = 8.0  # predicted twell / dense ratio above which the forced-twell row is left out
# The skip's prediction leaves out auto's heavy-tail factor (which grows with the batch, and keeps auto off twell past
# small batches): from ``heavy_pass_min_tokens`` tokens (a twell_mlp knob) the heavy tokens get their own launch,
# and the forced-twell rows there are what shows how far it is from the best method.
_SKIP_MODEL = CostModel(tail_tokens=math.inf)


def eager_ffn(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return F.linear(torch.relu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def _case(K: int, N: int, M: int, nnz_values: list[int], dtype: torch.dtype, device: str, log) -> Case:
    live = int(0.7 * N)  # synthetic_ffn's default: 30% dead neurons
    levels = [s for s in nnz_values if s < live]
    dense_level = TARGET_NNZ if TARGET_NNZ in levels else levels[0]
    seeds = iter(range(1 << 30))

    def make_inputs() -> tuple[Any, ...]:
        ffn = synthetic_ffn(K, N, dtype=dtype, device=device, seed=next(seeds))
        xs = tuple(ffn.make_input(M, float(s)) for s in levels)
        return (*xs, ffn.w_gate, ffn.w_up, ffn.w_down)

    n = len(levels)
    dense_x = levels.index(dense_level)
    compiled = torch.compile(eager_ffn)
    impls: dict[str, Any] = {
        "eager": lambda *a: eager_ffn(a[dense_x], *a[n:]),
        "torch.compile": lambda *a: compiled(a[dense_x], *a[n:]),
        "gate matmul": lambda *a: F.linear(a[dense_x], a[n]),
        "twell gate kernel": lambda *a: twell_gate(a[dense_x], a[n], tile=256 if M > 64 else 64).values,
    }
    for i, s in enumerate(levels):
        twell_s, dense_s = predicted_times(M, K, N, s, dtype, _SKIP_MODEL)
        if twell_s <= SKIP_TWELL_ABOVE * dense_s:
            impls[f"twell nnz={s}"] = lambda *a, i=i: twell_mlp(a[i], *a[n:], method="twell")
        else:
            log(f"ffn: M={M} K={K} N={N} nnz={s}: forced twell predicted {twell_s / dense_s:.0f}x dense, not timed")
        if M >= 1024 and predicted_block_time(M, K, N, s, dtype) <= SKIP_TWELL_ABOVE * dense_s:
            impls[f"block nnz={s}"] = lambda *a, i=i: twell_mlp(a[i], *a[n:], method="block")
        monitor = SparsityMonitor()
        impls[f"auto nnz={s}"] = lambda *a, i=i, monitor=monitor: twell_mlp(
            a[i], *a[n:], method="auto", monitor=monitor
        )
    e = torch.finfo(dtype).bits // 8
    return Case(
        workload="ffn",
        shape=f"M={M} K={K} N={N}",
        dtype=dtype,
        direction="fwd",
        bytes_moved=(3 * K * N + 2 * M * K) * e,
        flops=6 * M * K * N,
        ceiling="matmul",
        make_inputs=make_inputs,
        impls=impls,
        auto_choices={
            f"auto nnz={s}": tuple(c for c in (f"twell nnz={s}", f"block nnz={s}", "eager") if c in impls)
            for s in levels
        },
    )


@register(
    "ffn",
    "TwELL gated FFN: sparsefuse twell / block / auto at each sparsity vs dense cuBLAS and torch.compile",
    "tokens M, hidden K, intermediate N",
)
def ffn_cases(options: Options) -> list[Case]:
    grid = QUICK_GRID if options.quick else GRID
    # bf16 is the design point (fp16 runs the same kernels; the tests cover it): one half-precision dtype only.
    dtypes = [d for d in options.dtypes if d in (torch.bfloat16, torch.float16)]
    dtypes = [d for d in dtypes if d == torch.bfloat16] or dtypes[:1]
    return [
        _case(K, N, M, nnz_values, dtype, options.device, options.log)
        for dtype in dtypes
        for (K, N), (m_values, nnz_values) in grid.items()
        for M in m_values
    ]


def crossover(rows: list[Result]) -> list[str]:
    """Markdown lines: per (shape, dtype) the largest mean non-zeros per token at which ``twell`` (and ``block``)
    beats eager, and the worst ``auto`` time relative to eager (target: <= 1.10) with where it happens."""
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in rows:
        if r.workload == "ffn" and r.status == "ok":
            groups.setdefault((r.shape, r.dtype), []).append(r)
    lines = [
        "| shape | dtype | eager us | gate matmul us | twell beats eager up to nnz | best twell x eager | "
        "block beats eager up to nnz | best block x eager | worst auto / eager |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (shape, dtype), group in sorted(groups.items()):
        times = {r.impl: r.median_us for r in group}
        eager = times.get("eager", math.nan)
        wins = [int(k.split("=")[1]) for k, t in times.items() if k.startswith("twell nnz=") and t < eager]
        best = max((eager / t for k, t in times.items() if k.startswith("twell nnz=")), default=math.nan)
        block_wins = [int(k.split("=")[1]) for k, t in times.items() if k.startswith("block nnz=") and t < eager]
        best_block = max((eager / t for k, t in times.items() if k.startswith("block nnz=")), default=math.nan)
        autos = {k: t / eager for k, t in times.items() if k.startswith("auto nnz=")}
        worst = max(autos.items(), key=lambda kv: kv[1], default=("-", math.nan))
        lines.append(
            f"| {shape} | {dtype} | {eager:.1f} | {times.get('gate matmul', math.nan):.1f} | "
            f"{max(wins) if wins else 'none'} | {best:.2f} | {max(block_wins) if block_wins else '-'} | "
            f"{best_block:.2f} | {worst[1]:.2f} ({worst[0]}) |"
        )
    return lines
