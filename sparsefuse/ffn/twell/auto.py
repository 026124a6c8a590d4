"""``method="auto"`` of the gated block, declared for the planner (:mod:`sparsefuse._plan`): predicted seconds per
method (:class:`CostModel`, its rates and thresholds being the op's knobs) for the batch's mean gate non-zeros per
token.

The planner's ladder gives that mean: ``expected_nnz``; the caller's :class:`~sparsefuse._plan.SparsityMonitor`;
the per-gate-weight estimate, whose first observable call on a weight computes the gate of <= ``probe_tokens``
sampled tokens densely and reads the count (the one host sync of that weight's life), and which later folds in a
new sample every few calls without a sync; with nothing observed, the sparse regime the kernels are for
(``prior_firing``).

The gate activations are priced as ReLU, at the count of gates that fire (the estimate counts entries above
FATReLU's threshold). For FATReLU that is the same work, plus, on the block path only, one in-place pass over the
[M, N] pre-activations that the model leaves out. dReLU compacts and forms unions on the gate alone, as ReLU does; its
TwELL path loads no W_down row where the up product is <= 0 (about half of the fired gates on random and synthetic
weights), so the model over-predicts its gathers by up to a quarter, which errs toward dense; its block and dense
paths add a pass over their [M, N] products, also left out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..._backend import cdiv
from ..._plan import AUTO, Knobs, Planner, SparsityMonitor, device_scalar, sampled_rows
from .launch import auto_tile
from .reference import threshold_in


@dataclasses.dataclass(frozen=True)
class CostModel(Knobs):
    """Rates for the auto decision, fitted to an H200 run of the ffn grid (1.5B and 8B shapes, bf16, synthetic
    heavy-tailed sparsity, 1-256 tokens): with these every pick of twell or dense there is within 5% of the faster
    one but one (8B shape, 64 tokens, 8 non-zeros: twell, 9% slower than dense); twell up to ~128 non-zeros at 16
    tokens of the 8B shape, ~32 at 1.5B, dense from 128 tokens of 1.5B. The gate costs its GEMM plus a pass over its
    [M, N] output (the packing, measured at ~1 TB/s); kernel 2's weight-row gathers ran at ~0.8 TB/s on the
    heavy-tailed batch against ~6 TB/s on a tail-free one.

    ``gather_bytes_per_s`` is kernel 2's effective rate for weight-row gathers when the GPU is full; with fewer than
    ``2 * n_sms`` programs it scales down in proportion. ``serial_s_per_step`` is kernel 2's time per step of a
    token's chain (4 entries); ``min_s`` is the fused path's floor at tiny batches."""

    matmul_flops_per_s: float = 600e12  # bf16/fp16 tensor cores
    fp32_matmul_flops_per_s: float = 50e12
    dram_bytes_per_s: float = 3.0e12
    gather_bytes_per_s: float = 0.8e12
    pack_bytes_per_s: float = 1.0e12
    launch_s: float = 3e-6
    serial_s_per_step: float = 1.5e-6
    min_s: float = 25e-6
    n_sms: int = 132
    # Whole-model decode steps (synthetic Llama, 1.5B shape, per-layer means 17-41 with a heavy tail, H100) ran the
    # fused path at 1.37x / 1.13x / 0.67x of dense for 1 / 8 / 32 tokens, where the terms above predicted 1.25x /
    # 1.20x / 1.00x: the slowest token's chain grows with the batch's tail. The prediction is scaled by
    # (1 + M / tail_tokens) to follow that, refitted on the H200 grid (64 tokens of 1.5B ran 1.7x dense at 8 non-zeros
    # where 32 ran 0.77x); past a few hundred tokens it over-predicts (8192 tokens ran 0.5-1.1x dense, never faster
    # than the block path, which auto takes there).
    tail_tokens: float = 80.0
    # row-block path (method="block"): the up/down products' rate on the model's uniform-firing union estimate,
    # scaled like the dense terms (which the model over-predicts by ~1.25x) so the two compare fairly. Fitted to
    # the full ffn grid on an H200: the model predicts the block path within -28%..+7% of its measured ratio to
    # dense at <= 32 non-zeros and under-predicts above, so auto never takes block where it loses on that grid
    block_flops_per_s: float = 330e12
    block_min_tokens: int = 1024  # fewer than 16 row blocks of 64 tokens cannot fill the GPU
    # Host time of one plain eager call per method (argument checks, allocations, launches), measured on an H200
    # machine's CPU at one token: cuBLAS's three matmuls and two elementwise ops 67 us, the two TwELL kernels with
    # their launch plans 176 us. A decode step in eager mode is host-bound, so there a method costs at least its
    # host time (under CUDA-graph capture and torch.compile tracing these terms are left out).
    host_s: dict = dataclasses.field(default_factory=lambda: {"twell": 175e-6, "dense": 65e-6})
    # From a full GPU's worth of tokens (2 x SMs) up, auto takes twell only for a predicted win of at least this
    # much: there the model's twell time is off by up to ~35% either way near the crossover (the heavy tail's serial
    # chains are not modelled), and one wrong pick cost 26% (M=2048, 8B layer, 8 non-zeros). Below that the model
    # errs only on the pessimistic side (predicted 0.81-0.90 of dense, measured 0.55-0.87), so no margin.
    margin: float = 0.92
    # With nothing observed, auto assumes this fraction of the gate fires (~1.5%: 88 of 5632, the sparse regime the
    # kernels are built for) and picks by the cost model for the batch size: the fused kernels for a few tokens, the
    # row-block path for thousands, dense between -- never the fused path on a large batch, where a wrong guess is
    # a cliff (12x dense at 2048 tokens), while block's worst case is ~1.5x dense.
    prior_firing: float = 1.0 / 64
    probe_tokens: int = 64  # tokens whose gate the estimate's probe computes densely
    # How the "twell" method runs its launches (read by launch.py):
    # From this many tokens the gate is cuBLAS's GEMM and a packing pass (twell_pack_kernel) instead of the fused
    # kernel, whose packing epilogue runs on the tensor-core accumulator's register layout (a scan along each tile
    # row costs several layout conversions through shared memory there): H200, bf16, 1.5B layer, the fused kernel
    # took 31 / 174 / 623 us at 256 / 2048 / 8192 tokens against cuBLAS's 11 / 62 / 241 for the GEMM alone (the GEMM
    # and packing pass: 16 / 86 / 354). Its dense pre-activations also stay for the up/down kernel, whose overflowed
    # tiles read them instead of a GEMV over the gate (16 tokens of ~512 non-zeros: 184 -> 72 us). Below 16 tokens
    # the fused kernel (one launch, 64-column tiles) is ~1 us faster where nothing overflows, the common decode case.
    gate_gemm_min_tokens: int = 16
    # From this many tokens the heaviest are taken out of the main launch (up to a cap) and split over
    # ``heavy_splits`` programs each by a second launch: a token's entries and its overflowed tiles (each a whole
    # tile's columns) are otherwise walked by its own one or two programs, and the heaviest sets the launch's length
    # (H200, 1.5B layer, heavy tail: 2048 tokens of mean 32 non-zeros, 20 overflowed tiles recomputed by GEMVs, took
    # 10x the dense block).
    heavy_pass_min_tokens: int = 128
    # Kernel 2's programs per token below a full wave of tokens: each split writes a partial row that the last to
    # finish sums, so past a few fired rows per split the partials cost more than they spread (a one-token step of
    # the SparseLM-1.5B shape on an H100: 6.6 us at 16 splits, 12.2 us at one split per 64-column tile, 88)
    max_splits: int = 16
    heavy_splits: int = 16  # programs per heavy token, up to heavy_splits_tokens tokens; fewer past it, down to 4
    heavy_splits_tokens: int = 1024
    heavy_partial_bytes: int = 64 << 20  # the heavy launch's fp32 partials [tokens, splits, K], at most


def _matmul_s(M: int, K: int, N: int, elem: int, fp32: bool, cm: CostModel) -> float:
    rate = cm.fp32_matmul_flops_per_s if fp32 else cm.matmul_flops_per_s
    return max(2.0 * M * K * N / rate, (M * K + K * N + M * N) * elem / cm.dram_bytes_per_s) + cm.launch_s


def predicted_times(
    M: int, K: int, N: int, mean_nnz: float, dtype: torch.dtype, cost_model: CostModel | None = None
) -> tuple[float, float]:
    """(twell seconds, dense seconds) predicted for a gated block of M tokens with ``mean_nnz`` gate non-zeros per
    token. Dense: three matmuls plus the ReLU and product passes over [M, N]. Twell: the gate matmul and its packing
    pass, plus kernel 2's row gathers -- per non-zero a W_up row for each of the token's ``splits`` programs and a
    W_down row -- at the gather rate scaled by how full the GPU is, but never faster than reading the distinct rows
    touched from DRAM once (an overflowed tile's fired columns are walked like stored entries, from the gate's
    pre-activations)."""
    cm = cost_model or PLANNER.knobs
    elem = torch.finfo(dtype).bits // 8
    fp32 = dtype == torch.float32
    gate = _matmul_s(M, K, N, elem, fp32, cm)
    dense = 3 * gate + 5.0 * M * N * elem / cm.dram_bytes_per_s + 2 * cm.launch_s
    wave = 2 * cm.n_sms
    splits = 1 if M >= wave else min(cdiv(N, auto_tile(M, N, 1)), cdiv(wave, max(M, 1)))
    occupancy = min(1.0, M * splits / wave)
    gathered = M * mean_nnz * 2.0 * K * elem  # a W_up row and a W_down row per non-zero
    distinct_rows = N * (1.0 - (1.0 - min(mean_nnz, N) / N) ** M) if N else 0.0
    steps = mean_nnz / (4.0 * splits)  # a token's serial chain: 4 entries per step, its tiles over `splits`
    gathers = max(
        gathered / (cm.gather_bytes_per_s * occupancy),
        distinct_rows * 2.0 * K * elem / cm.dram_bytes_per_s,
        steps * cm.serial_s_per_step,
    )
    pack = M * N * elem / cm.pack_bytes_per_s
    twell = max(cm.min_s, gate + pack + gathers + 2.0 * M * K * elem / cm.dram_bytes_per_s + cm.launch_s)
    return twell * (1.0 + M / cm.tail_tokens), dense


def predicted_block_time(
    M: int,
    K: int,
    N: int,
    mean_nnz: float,
    dtype: torch.dtype,
    cost_model: CostModel | None = None,
    block_rows: int = 64,
) -> float:
    """Seconds predicted for ``method="block"``: the cuBLAS gate, one pass over the [M, N] pre-activations (the
    unions), and the up and down products on the unions. A block's union is estimated as if neurons fired
    independently and uniformly, ``N * (1 - (1 - nnz / N) ** block_rows)`` -- an over-estimate for real layers,
    whose hot neurons are shared (the synthetic FFN at 30 non-zeros: 22% of N measured, 29% estimated)."""
    cm = cost_model or PLANNER.knobs
    elem = torch.finfo(dtype).bits // 8
    fp32 = dtype == torch.float32
    gate = _matmul_s(M, K, N, elem, fp32, cm)
    union = 1.0 - (1.0 - min(mean_nnz, N) / max(N, 1)) ** block_rows
    n_blocks = cdiv(max(M, 1), block_rows)
    fill = min(1.0, M / 8192) ** 0.31 * min(1.0, n_blocks * cdiv(K, 256) / (2 * cm.n_sms))
    rate = cm.block_flops_per_s * (cm.fp32_matmul_flops_per_s / cm.matmul_flops_per_s if fp32 else 1.0) * fill
    products = 2 * 2.0 * M * K * N * union / rate
    traffic = (M * N + 3 * M * N * union + 2 * M * K) * elem / cm.dram_bytes_per_s
    return gate + products + traffic + 4 * cm.launch_s


def _predict(question: tuple, mean_nnz: float, cm: CostModel) -> dict[str, float]:
    """Each method's predicted seconds at ``question`` (M, K, N, dtype); ``"block"`` from ``block_min_tokens``
    tokens (fewer row blocks would not fill the GPU, and their GPU time is under the host time). A tie goes to
    ``"twell"``."""
    M, K, N, dtype = question
    twell, dense = predicted_times(M, K, N, mean_nnz, dtype, cm)
    predicted = {"twell": twell}
    if M >= cm.block_min_tokens:
        predicted["block"] = predicted_block_time(M, K, N, mean_nnz, dtype, cm)
    return predicted | {"dense": dense}


def _empty_batch(question: tuple, cm: CostModel) -> tuple[str, str] | None:
    M = question[0]
    return ("dense", "an empty batch: nothing to count, nothing to gain") if isinstance(M, int) and M == 0 else None


PLANNER = Planner(
    "twell_mlp",
    _predict,
    CostModel(),
    prior=lambda question, cm: cm.prior_firing * question[2],
    rule=_empty_batch,
    margin=lambda question, cm: cm.margin if question[0] >= 2 * cm.n_sms else 1.0,
)
ESTIMATES = PLANNER.estimates  # per gate weight: the default call's estimate


def auto_method(M: int, K: int, N: int, mean_nnz: float, dtype: torch.dtype, eager: bool = False) -> str:
    """The method auto runs for ``mean_nnz`` gate non-zeros per token: the fastest predicted of twell, block (from
    ``block_min_tokens``) and dense, a sparse one only if it beats dense by the margin. ``eager``: the call runs
    from Python, not inside a CUDA graph or a compiled graph, so each method costs at least its host time."""
    return PLANNER.pick((M, K, N, dtype), round(float(mean_nnz), 1), eager)


def probe_stats(
    x2: torch.Tensor, w_gate: torch.Tensor, b_gate: torch.Tensor | None, threshold: float = 0.0
) -> torch.Tensor:
    """[2] int64 (gate non-zeros: entries > ``threshold``, tokens) over <= ``probe_tokens`` evenly spaced tokens of
    x2 [M >= 1, K], the gate computed densely for those tokens only; no sync."""
    rows = sampled_rows(x2, PLANNER.knobs.probe_tokens)
    fired = (F.linear(rows, w_gate, b_gate) > threshold_in(x2.dtype, threshold)).sum(dtype=torch.int64)
    return torch.stack([fired, device_scalar(rows.shape[0], x2.device)])


def eager_runs_dense(w_gate: torch.Tensor, M: int, dtype: torch.dtype) -> bool | None:
    """Whether an eager CUDA call of M tokens on this gate weight would run dense by its current estimate (None
    when none exists yet): a dictionary lookup, for callers that can then skip the functional API's checks."""
    N, K = w_gate.shape
    pick = PLANNER.kept_pick(w_gate, (M, K, N, dtype), eager=True)
    return None if pick is None else pick == "dense"


def resolve_method(
    method: str,
    x2: torch.Tensor,
    w_gate: torch.Tensor,
    b_gate: torch.Tensor | None,
    expected_nnz: float | None,
    monitor: SparsityMonitor | None,
    warm_up: Callable[[str], object] | None = None,
    at_run_time: bool = False,
    threshold: float = 0.0,
) -> str:
    """What a call asking for ``method`` runs on x2 [M, K] and w_gate [N, K] (:meth:`Planner.resolve`: an explicit
    method itself; ``"auto"`` by the planner, and ``"auto"`` itself while torch.compile traces without
    ``expected_nnz``: the op decides when the graph runs, ``at_run_time``). This op's share of the choice is its
    question and its sample: the gate of <= ``probe_tokens`` tokens, counting what fires above FATReLU's
    ``threshold``. ``warm_up(method)``: runs the in-graph pick once where an eager call picks another."""
    if method != AUTO:
        return PLANNER.explicit(method)
    M, K = x2.shape
    picked, _ = PLANNER.resolve(
        (M, K, w_gate.shape[0], x2.dtype),
        x2,
        given=expected_nnz,
        monitor=monitor,
        weight=w_gate,
        stats=lambda: probe_stats(x2, w_gate, b_gate, threshold),
        warm_up=None if warm_up is None else lambda method, estimate: warm_up(method),
        at_run_time=at_run_time,
    )
    return picked
