"""The cost model of ``sparse_decode(method="auto")`` and its pick.

``"dense"`` for small dictionaries (d_sae < 4096); otherwise the fastest of ``"scan"``, ``"fixed"`` and cuBLAS by a
cost model fitted to H200 and H100 timings (sae_decode benchmark: main shapes, L0 and batch sweeps; sae_decode_grid),
a sparse method only when predicted at least 10% faster than cuBLAS. What it knows of the per-token L0 is an
:class:`L0Estimate`: the mean and coefficient of variation of the *ordinary* tokens, and the share of *long* ones
(past :func:`~sparsefuse.sparse.long_rows.long_row_threshold` of d_sae: 1024 of 65536), with their mean L0. Long
tokens are set apart because each is spread over the whole GPU by a second launch in every sparse method, so they
cost their own bytes at the spread's rate; folded into a mean, one token firing all 65536 features among 64 sampled
would make every token look like 1100 and send a batch that is sparse but for it to cuBLAS.

* scan ~ rows x d_sae bytes / row rate + ordinary rows x L0 x d_model bytes / gather rate + the long rows + the
  longest ordinary token's extra non-zeros over its split, at one program's pace (~0.6 us a non-zero);
* fixed ~ its launches + rows x (d_sae bytes / bitmask rate + d_sae / 8 bytes / word rate) + ordinary rows x L0 x
  d_model bytes / gather rate + the long rows, or one program's serial walk over a row when that is longer (few
  rows, large L0) -- the scan wins small batches, the two-pass "fixed" large ones (from ~64-1024 rows, later on GPUs
  of less bandwidth);
* dense ~ the hypotenuse of flops / matmul rate and W_dec bytes / DRAM rate (fp32: a fixed ~1.35 TB/s, the rate
  cuBLAS's fp32 product of few rows reads W_dec at on an H100 and an H200 alike);
* the long rows ~ their W_dec bytes over the spread launch's rate (bound by its sub-splits, not by DRAM); in the
  16-bit scan of few rows (its splits summed by atomics), up to 16 tokens at least half full are its dense units
  instead: one read of W_dec for all of them (:mod:`sparsefuse.sparse.dense_units`).

Where the gather launch of "fixed" fits in one wave (rows x output blocks <= 28 programs per SM: ~256 tokens), it
lasts as long as its longest row, and rows past 128 stored entries are spread by a second launch
(:func:`~sparsefuse.sparse.long_rows.stored_row_threshold`): a cost paid once any row gets there (~8 us), then a
little per row. The scan's launch of few rows is one wave too: the split holding the longest token's columns sets
its end. The share of ordinary tokens past 128 and the longest token's L0 come from their mean and coefficient of
variation, the L0 taken as log-normal (heavy-tailed, as sae_decode_grid models SAE tokens): at B=256 (H200),
"fixed" at its 4x width takes 0.61x (bf16) and 0.85x (fp32) the scan's time at a constant L0, and 0.79-0.83x
(bf16) / 0.95-1.07x (fp32) once the L0s spread (log-normal sigma 0.3-1.0).
In launches of many waves rows of different lengths even out, and the mean decides.

The number of long tokens in a batch of more rows than were sampled: the first one the sample holds is taken for a
lone token (the first of a batch, which the evenly spaced sample always includes, is the typical one: two full
tokens of 4096 are decoded best by "fixed", 657 us against cuBLAS's 1619 on an H200), any further ones as a share of
the batch (a batch dense throughout goes to cuBLAS).

The byte-bound terms of "fixed" and of cuBLAS in 16 bits scale with the device's DRAM bandwidth
(:func:`~sparsefuse._backend.dram_bandwidth`); the scan's row read only with its square root, being mostly bound by
latency: the scan took 1.03-1.20x as long on an H100 as on an H200 (B=256-4096; fp32 rows the most), the two-pass
"fixed" 1.25-1.43x, the ratio of the two memories (3.35 vs 4.8 TB/s). Both GPUs take "fixed" from ~64 (bf16) to
~256 (fp32) rows.

The estimate is, first available: ``expected_l0`` (a mean only: taken as a constant L0, no long tokens); the running
estimate kept per decoder (an :class:`~sparsefuse._auto.EstimateCache` keyed on ``W_dec``, fed without a sync every
8th eager call from up to 64 sampled rows: :func:`~sparsefuse._auto.sampled_row_stats`); on the first eager call
with a new ``W_dec``, a count of those rows (the one host sync). Under CUDA-graph capture the estimate from the
warm-up calls decides; under torch.compile tracing, without ``expected_l0``, SAE-like sparsity (L0 = d_sae / 1024)
is assumed. When auto picks ``"fixed"`` without a ``max_l0``, the width is 4x the ordinary tokens' mean L0 (at
least 256): tokens past it are still decoded exactly, from their dense rows, each spread over many programs by the
long-row pass (:mod:`sparsefuse.sparse.long_rows`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import NormalDist

import torch

from ..._backend import cdiv, dram_bandwidth, next_power_of_2, sm_count
from ..._plan import AUTO, EstimateCache, Knobs, Planner, sampled_row_stats
from ..._triton.limits import limits
from ...sparse.long_rows import ONE_WAVE_LONG_ENTRIES, long_row_threshold
from ...sparse.scan import scan_splits, splits_by_atomics
from ...sparse.spmm import SCAN_BLOCK_F, gather_block_d, scan_block_d

DEFAULT_MAX_L0 = 256
# Effective rates, least-squares fits (in log time) to H200 and H100 timings, stated for the H200's DRAM bandwidth
# (REFERENCE_BANDWIDTH): bytes/s per activation element size (fp32 rows are scanned with fewer, wider loads).
REFERENCE_BANDWIDTH = 4.8e12
_SCAN_ROW_RATE = {4: 2.0e12, 2: 1.4e12}
_SCAN_GATHER_RATE = {4: 4.3e12, 2: 2.4e12}
# "fixed": the bitmask pass streams the activations near copy speed; the ELL gather moves gathered W_dec bytes at
# about DRAM rate (some L2 reuse); both scale with the device's bandwidth.
_FIXED_BITS_RATE = 3.5e12
_FIXED_WORDS_RATE = 6.6e12
_FIXED_GATHER_RATE = {4: 4.8e12, 2: 3.8e12}
# With few rows the ELL path is bound by one program's serial chain, not by bytes: the gather walks a row's entries
# 16 at a time and the bits -> ELL pass a row's bitmask 1024 words at a time (B=32, D=768, L0=1024: 78 us against
# cuBLAS's 31, where the byte terms alone predict 28)
_FIXED_GATHER_STEP_S = 0.7e-6
_FIXED_WORDS_CHUNK_S = 2e-6
_DENSE_WEIGHT_RATE = 3.3e12
# fp32 (no tensor cores): with few rows cuBLAS reads W_dec at ~1.3 TB/s on an H100 and an H200 alike (B=32,
# F=65536, D=768: 152 us on both), bound by its kernel, not by DRAM
_DENSE_FP32_WEIGHT_RATE = 1.35e12
_DENSE_FLOP_RATE = {torch.float32: 50e12, torch.float16: 800e12, torch.bfloat16: 800e12}
_LAUNCH_S = 5e-6
# "fixed" launches bitmask, bits -> ELL, the gather and the spread (and fills only the spread's counters): their
# fixed costs together (H200 grid: 17.3 us at B=32 bf16, of which the longest row's serial chain is ~7)
_FIXED_LAUNCHES_S = 10e-6
# The 16-bit scan of few rows sums its splits by fp32 atomics into a zeroed buffer, then casts: two more launches
# (19.1 us at B=32, D=2304 bf16 against 12.4 from bytes and one launch)
_SCAN_16BIT_ATOMIC_S = 6e-6
# One program of the scan gathers about a non-zero per this long (a dependent load's latency): the split holding the
# longest token's columns walks its extra non-zeros at that pace (fit on the H200 grid at 256 tokens, whose scan is
# one wave: log-normal L0s with sigma 1.0 cost it 22-25 us over a constant L0)
_SCAN_NONZERO_S = 0.6e-6
# Long tokens (e.g. two firing all 65536 features, sae_decode_grid): their W_dec bytes over the spread launch's
# rate, bound by the spread's programs rather than by DRAM: two full rows among 32 take 107 / 112 us at D=768 fp32
# and 182 / 192 us at D=2304 bf16 on an H200 / H100, whose bandwidths differ by 1.43x. The rate of the scan's long
# ranges, handed to the spread pass.
_LONG_RATE = {4: 3.8e12, 2: 3.3e12}
# "fixed" spreads an overflowed token as one unit of its whole dense row: slower than the scan's units (ranges of
# its splits) in fp32 -- two full rows among 32 or 256 took ~160 us at D=768 fp32 (2.5 TB/s) and ~165 us at
# D=2304 bf16 (3.7 TB/s) over the same batch without them (H200)
_FIXED_LONG_RATE = {4: 2.5e12, 2: 3.6e12}
# The scan's dense units: two full bf16 rows' units read W_dec (302 MB) in 73-75 us on an H200
_DENSE_UNIT_RATE = 4.1e12
# A one-wave gather launch with rows past ONE_WAVE_LONG_ENTRIES: the spread launch's cost once, then W_dec bytes
# of one output row per such row over this rate (refit on the H200 grid: 16-bit gathers of 256 columns, a spread
# sub-split per 32 non-zeros of a unit, the scan's longest-token term)
_ONE_WAVE_SPREAD_S = 14e-6
_ONE_WAVE_ROW_RATE = 1e10
REFERENCE_SMS = 132  # H100 and H200


@dataclass(frozen=True)
class DecodeKnobs(Knobs):
    """The knobs of ``sparse_decode``'s auto (the cost model's fitted rates are the module's constants), and of
    ``topk_decode``'s backward: ``picked_rows_max_share``."""

    margin: float = 0.9  # a sparse method must be predicted this much faster: the model's error on the grid is ~10%
    # Host time of one plain eager call per method (checks, the pick, allocations, launches), measured on an H200
    # machine (Triton 3.6, one token, d_sae 65536, bf16): the scan 316-342 us a call (two launches, the long-row pass's
    # buffers, the 16-bit atomic sum's zeroing and cast), "fixed" 343-463 us (four launches), cuBLAS's product 72 us
    # (GPU-bound: its host part is a single dispatch). A Python loop of such calls runs at the larger of a method's host
    # and GPU times, so a plain eager call costs each method at least its host time -- one token looped eagerly took
    # 5-8x cuBLAS's time through the sparse kernels, which CUDA-graph replay runs 5x faster than cuBLAS. Under
    # CUDA-graph capture and torch.compile tracing these terms are left out (as the FFN's auto does). Set at the low
    # end of what was measured: a host that is faster still keeps the sparse kernels where they win on the GPU.
    host_s: dict = field(default_factory=lambda: {"scan": 250e-6, "fixed": 300e-6, "dense": 30e-6})
    dense_below_d_sae: int = 4096  # smaller dictionaries: cuBLAS, whatever the L0
    sample_rows: int = 64  # rows whose non-zeros are counted for the estimate
    width_per_l0: int = 4  # auto's "fixed" width: this many times the mean L0, at least DEFAULT_MAX_L0
    # topk_decode's W_dec gradient gives gather programs to the picked features' rows alone (and one memset to the
    # rest) while the M * k picks number at most this share of d_sae, else to all d_sae rows: there the programs
    # drop 8x or more, for a memset and a copy of at most an eighth of the gradient's bytes. Chosen by that count,
    # not by a GPU timing (docs/design/sae-decode.md).
    picked_rows_max_share: float = 0.125


@dataclass(frozen=True)
class L0Estimate:
    """What auto knows of the per-token L0: the mean of the ordinary tokens, their coefficient of variation, and the
    share of long tokens (past :func:`~sparsefuse.sparse.long_rows.long_row_threshold` of d_sae, spread in every
    launch) with their mean L0."""

    mean: float
    cv: float = 0.0
    long_share: float = 0.0
    long_l0: float = 0.0

    @staticmethod
    def from_per_row(per_row: tuple[float, ...]) -> L0Estimate:
        """From a monitor's per-row averages of :func:`~sparsefuse._auto.sampled_row_stats` (ordinary non-zeros,
        ordinary squared counts, long rows, long non-zeros; each per row sampled)."""
        nnz, squares, long, long_nnz = per_row
        ordinary = 1.0 - long
        if ordinary <= 1e-9:
            return L0Estimate(0.0, 0.0, 1.0, long_nnz)
        mean = nnz / ordinary
        cv = math.sqrt(max(0.0, squares / ordinary / mean**2 - 1.0)) if mean > 0 else 0.0
        return L0Estimate(mean, cv, long, long_nnz / long if long > 0 else 0.0)


def _long_rows_in_batch(M: int, long_share: float) -> float:
    """Long tokens expected in a batch of M from their share of the sampled rows: the first one a sample holds is
    taken for a lone token (the first of a batch, which the evenly spaced sample always includes, is the typical
    one), any further ones as a share of the batch."""
    sampled = PLANNER.knobs.sample_rows
    n = min(M, sampled)
    return n * long_share + (M - n) * max(0.0, long_share - 1.0 / sampled)


def _share_above(threshold: float, mean: float, cv: float) -> float:
    """Share of ordinary tokens with more than ``threshold`` features, their L0 taken as log-normal of this mean and
    coefficient of variation (heavy-tailed, as sae_decode_grid models SAE tokens)."""
    if mean <= 0:
        return 0.0
    if cv <= 0:
        return float(mean > threshold)
    sigma = math.sqrt(math.log1p(cv * cv))
    return 0.5 * math.erfc((math.log(threshold / mean) + sigma * sigma / 2) / (sigma * math.sqrt(2)))


def _longest_l0(tokens: float, mean: float, cv: float) -> float:
    """Expected L0 of the longest of ``tokens`` ordinary tokens, their L0 taken as log-normal of this mean and
    coefficient of variation (as :func:`_share_above`)."""
    if tokens < 1 or cv <= 0:
        return mean
    sigma = math.sqrt(math.log1p(cv * cv))
    z = NormalDist().inv_cdf(1.0 - 1.0 / (tokens + 1.0))
    return mean * math.exp(sigma * z - sigma * sigma / 2)


def _predicted_seconds(
    M: int,
    d_sae: int,
    d_model: int,
    mean_l0: float,
    acts_dtype: torch.dtype,
    w_dtype: torch.dtype,
    bandwidth: float = REFERENCE_BANDWIDTH,
    *,
    cv: float = 0.0,
    long_share: float = 0.0,
    long_l0: float = 0.0,
    sms: int = REFERENCE_SMS,
    one_wave_programs_per_sm: int | None = None,
) -> dict[str, float]:
    """The cost model (see module docstring): predicted seconds per method on a device of DRAM ``bandwidth``
    (bytes/s) and ``sms`` SMs. ``mean_l0``, ``cv``: of the ordinary tokens; ``long_share``, ``long_l0``: the long
    tokens' share of the sampled rows and their mean L0 (see :class:`L0Estimate`). ``one_wave_programs_per_sm``:
    the gather programs per SM a launch of one wave holds, as the launcher reads it (default: the sparse core's knob
    in force, :class:`~sparsefuse._triton.limits.SparseCoreLimits`)."""
    if one_wave_programs_per_sm is None:
        one_wave_programs_per_sm = limits().one_wave_programs_per_sm
    e_a, e_w = acts_dtype.itemsize, w_dtype.itemsize
    scale = bandwidth / REFERENCE_BANDWIDTH
    n_long = _long_rows_in_batch(M, long_share) if long_share > 0 else 0.0
    ordinary = M - n_long
    gathered = ordinary * mean_l0 * d_model * e_w  # W_dec bytes of the ordinary rows
    scan_gather, fixed_gather = _SCAN_GATHER_RATE.get(e_a, 2.4e12), _FIXED_GATHER_RATE.get(e_w, 3.8e12) * scale
    long_rate = _LONG_RATE.get(e_a, 3.3e12)
    scan_long_s = n_long * long_l0 * d_model * e_w / long_rate  # the scan's long ranges, spread
    deterministic = torch.are_deterministic_algorithms_enabled()
    atomic_splits = splits_by_atomics(M, d_model, scan_block_d(d_model), sms, deterministic)
    if e_a == e_w == 2 and n_long > 0 and 2 * long_l0 >= d_sae and atomic_splits:
        # few 16-bit rows (the scan's splits summed by atomics): up to 16 tokens at least half full are dense units,
        # one read of W_dec for all of them; a full table sends further ones to the spread
        scan_long_s = d_sae * d_model * e_w / (_DENSE_UNIT_RATE * scale)
        scan_long_s += max(0.0, n_long - 16) * long_l0 * d_model * e_w / long_rate
    row_rate = _SCAN_ROW_RATE.get(e_a, 1.4e12) * math.sqrt(scale)
    scan = _LAUNCH_S + M * d_sae * e_a / row_rate + gathered / scan_gather + scan_long_s
    splits = scan_splits(M, d_sae, d_model, scan_block_d(d_model), SCAN_BLOCK_F, sms, deterministic)
    scan += max(0.0, _longest_l0(ordinary, mean_l0, cv) - mean_l0) / splits * _SCAN_NONZERO_S
    if atomic_splits and e_a == e_w == 2:
        scan += _SCAN_16BIT_ATOMIC_S
    fixed = _FIXED_LAUNCHES_S + max(  # bitmask, bits -> ELL, gather, and the long rows' spread
        M * (d_sae * e_a / (_FIXED_BITS_RATE * scale) + d_sae / 8 / _FIXED_WORDS_RATE) + gathered / fixed_gather,
        mean_l0 / 16 * _FIXED_GATHER_STEP_S + math.ceil(d_sae / 32768) * _FIXED_WORDS_CHUNK_S,
    )
    fixed += n_long * long_l0 * d_model * e_w / _FIXED_LONG_RATE.get(e_a, 2.5e12)
    if M * cdiv(d_model, gather_block_d(M, d_model, sms, e_w)) <= one_wave_programs_per_sm * sms:
        # one wave: the gather lasts as long as its longest row, and rows past ONE_WAVE_LONG_ENTRIES entries are
        # spread by a second launch -- a cost paid once any row gets there, then a little more per row
        over = ordinary * _share_above(ONE_WAVE_LONG_ENTRIES, mean_l0, cv)
        fixed += min(1.0, over + n_long) * _ONE_WAVE_SPREAD_S + over * d_model * e_w / _ONE_WAVE_ROW_RATE
    compute = torch.promote_types(acts_dtype, w_dtype)
    weight_rate = _DENSE_FP32_WEIGHT_RATE if compute == torch.float32 else _DENSE_WEIGHT_RATE * scale
    # cuBLAS reaches neither bound where both are close (B=256, d_model=768: 45 us against 32 and 31): their sum
    # in quadrature
    dense = math.hypot(
        2 * M * d_sae * d_model / _DENSE_FLOP_RATE.get(compute, 50e12),
        d_sae * d_model * compute.itemsize / weight_rate,
    )
    return {"scan": scan, "fixed": fixed, "dense": dense}


def _question(
    M: int, d_sae: int, d_model: int, acts_dtype: torch.dtype, w_dtype: torch.dtype, bandwidth: float, sms: int
) -> tuple:
    return (M, d_sae, d_model, acts_dtype, w_dtype, bandwidth, sms, torch.are_deterministic_algorithms_enabled())


def _predict(question: tuple, l0: L0Estimate, knobs: DecodeKnobs) -> dict[str, float]:
    # ``deterministic``, which the model reads, is in the question
    M, d_sae, d_model, acts_dtype, w_dtype, bandwidth, sms, _ = question
    return _predicted_seconds(
        M, d_sae, d_model, l0.mean, acts_dtype, w_dtype, bandwidth, cv=l0.cv, long_share=l0.long_share,
        long_l0=l0.long_l0, sms=sms, one_wave_programs_per_sm=limits().one_wave_programs_per_sm,
    )  # fmt: skip


def _small_dictionary(question: tuple, knobs: DecodeKnobs) -> tuple[str, str] | None:
    if question[1] < knobs.dense_below_d_sae:
        return "dense", f"d_sae < {knobs.dense_below_d_sae}: cuBLAS's product of so few features is as fast"
    return None


def _rounded(l0: L0Estimate) -> L0Estimate:
    """The estimate at the resolution the pick is memoised at: a tenth of a non-zero, a hundredth of the coefficient
    of variation, a thousandth of the long tokens' share, a whole long L0."""
    return L0Estimate(round(l0.mean, 1), round(l0.cv, 2), round(l0.long_share, 3), float(round(l0.long_l0)))


PLANNER = Planner(
    "sparse_decode",
    _predict,
    DecodeKnobs(),
    estimates=EstimateCache(),  # per W_dec: dies with the decoder; samples every observe_every-th eager call
    from_per_row=L0Estimate.from_per_row,
    from_given=L0Estimate,
    rounded=_rounded,
    prior=lambda question, knobs: L0Estimate(question[1] / 1024),  # SAE-like sparsity, with nothing observed
    rule=_small_dictionary,
)


def _fastest_method(
    M: int,
    d_sae: int,
    d_model: int,
    mean_l0: float,
    acts_dtype: torch.dtype,
    w_dtype: torch.dtype,
    bandwidth: float = REFERENCE_BANDWIDTH,
    *,
    eager: bool = False,
    cv: float = 0.0,
    long_share: float = 0.0,
    long_l0: float = 0.0,
    sms: int = REFERENCE_SMS,
) -> str:
    """The planner's pick by the cost model alone (no rule) for these shapes and this L0: the faster sparse method
    if predicted at least 1 - margin faster than cuBLAS, else dense. ``eager``: a plain call from Python, where
    each method costs at least its host time."""
    question = _question(M, d_sae, d_model, acts_dtype, w_dtype, bandwidth, sms)
    return PLANNER.pick(question, _rounded(L0Estimate(mean_l0, cv, long_share, long_l0)), eager)


def _auto_width(mean_l0: float, d_sae: int) -> int:
    width = next_power_of_2(max(1, math.ceil(PLANNER.knobs.width_per_l0 * mean_l0)))
    return min(d_sae, max(DEFAULT_MAX_L0, width))


def resolve_method(
    method: str,
    acts: torch.Tensor,
    W_dec: torch.Tensor,
    max_l0: int | None,
    expected_l0: float | None,
    decoder: torch.Tensor | None = None,
    warm_up: Callable[[str, int], object] | None = None,
    at_run_time: bool = False,
) -> tuple[str, int]:
    """(method, ELL width) for acts [M, d_sae], W_dec [d_sae, d_model]: ``method`` itself unless it is "auto"
    (``"auto"`` while torch.compile traces without ``expected_l0``: the op decides when the graph runs,
    ``at_run_time``). ``decoder``: the tensor the estimate is kept for, the caller's W_dec where ``W_dec`` is its
    autocast copy. ``warm_up(method, width)`` runs the in-graph pick once where an eager call picks another (see
    :mod:`sparsefuse._plan.planner`). Auto's "fixed" is ``width_per_l0`` times the mean L0 wide (at least 256)
    unless ``max_l0`` is given."""
    (M, d_sae), d_model = acts.shape, W_dec.shape[1]
    width = max_l0 if max_l0 is not None else min(DEFAULT_MAX_L0, d_sae)
    if method != AUTO:
        return PLANNER.explicit(method), width

    def width_at(l0: L0Estimate | None) -> int:
        return width if max_l0 is not None or l0 is None else _auto_width(l0.mean, d_sae)

    bandwidth = dram_bandwidth(acts.device) or REFERENCE_BANDWIDTH
    sms = sm_count(acts.device) if acts.is_cuda else REFERENCE_SMS
    weight = W_dec if decoder is None else decoder
    method, l0 = PLANNER.resolve(
        _question(M, d_sae, d_model, acts.dtype, W_dec.dtype, bandwidth, sms),
        acts,
        given=expected_l0,
        weight=weight,
        stats=lambda: sampled_row_stats(acts, PLANNER.knobs.sample_rows, long_row_threshold(d_sae)),
        warm_up=None if warm_up is None else lambda method, l0: warm_up(method, width_at(l0)),
        at_run_time=at_run_time,
    )
    return method, width_at(l0)
