"""The cost model of ``sparse_decode(method="auto")`` and its pick.

``"dense"`` for small dictionaries (d_sae < 4096); otherwise the fastest of ``"scan"``, ``"fixed"`` and cuBLAS by a
cost model fitted to H200 and H100 timings (sae_decode benchmark: main shapes, L0 and batch sweeps; sae_decode_grid's
constant-L0 rows), a sparse method only when predicted at least 10% faster than cuBLAS at the activations' mean L0:

* scan ~ rows x (d_sae bytes / row rate + L0 x d_model bytes / gather rate);
* fixed ~ 4 launches + rows x (d_sae bytes / bitmask rate + d_sae / 8 bytes / word rate + L0 x d_model bytes /
  gather rate), or one program's serial walk over a row when that is longer (few rows, large L0) -- the scan wins
  small batches, the two-pass "fixed" large ones (from ~64-1024 rows, later on GPUs of less bandwidth);
* dense ~ the hypotenuse of flops / matmul rate and W_dec bytes / DRAM rate.

The byte-bound terms of "fixed" and cuBLAS scale with the device's DRAM bandwidth
(:func:`~sparsefuse._backend.dram_bandwidth`); the scan's do not: at B=4096, D=2304 bf16 the scan took 811 us on an
H100 and 783 on an H200, the two-pass "fixed" 723 and 529, in the ratio of the two memories (3.35 vs 4.8 TB/s), so
"fixed" takes over from the scan at ~512 (bf16) to ~2048 (fp32) rows on an H100, at ~256 on an H200. The model
knows the mean L0 only: with heavy-tailed L0 (log-normal sigma >= 0.6) "fixed" loses up to 25% to the scan at
large batches, which it cannot see.

The mean L0 is, first available: ``expected_l0``; the running estimate kept per decoder (an
:class:`~sparsefuse._auto.EstimateCache` keyed on ``W_dec``, fed without a sync every 8th eager call from up to 64
sampled rows); on the first eager call with a new ``W_dec``, a count of those rows (the one host sync). Under
CUDA-graph capture the estimate from the warm-up calls decides; under torch.compile tracing, without
``expected_l0``, SAE-like sparsity (L0 = d_sae / 1024) is assumed. When auto picks ``"fixed"`` without a
``max_l0``, the width is 4x the mean L0 (at least 256): tokens past it are still decoded exactly, from their dense
rows, each spread over many programs by the long-row pass (:mod:`sparsefuse.sparse.long_rows`).
"""

from __future__ import annotations

import math

import torch
import triton

from ..._auto import EstimateCache, observable, pick_fastest, sampled_nonzero_stats
from ..._backend import dram_bandwidth

DEFAULT_MAX_L0 = 256
AUTO_DENSE_BELOW_D_SAE = 4096
AUTO_SAMPLE_ROWS = 64  # rows whose non-zeros are counted for the estimate
AUTO_OBSERVE_EVERY = 8  # eager calls per (sync-free) observation
AUTO_MARGIN = 0.9  # a sparse method must be predicted this much faster: the model's error on the grid is ~10%
AUTO_WIDTH_PER_L0 = 4  # auto's "fixed" width: this many times the mean L0, at least DEFAULT_MAX_L0
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
_DENSE_FLOP_RATE = {torch.float32: 50e12, torch.float16: 800e12, torch.bfloat16: 800e12}
_LAUNCH_S = 5e-6

_ESTIMATES = EstimateCache(observe_every=AUTO_OBSERVE_EVERY)  # per W_dec: dies with the decoder


def _predicted_seconds(
    M: int,
    d_sae: int,
    d_model: int,
    mean_l0: float,
    acts_dtype: torch.dtype,
    w_dtype: torch.dtype,
    bandwidth: float = REFERENCE_BANDWIDTH,
) -> dict[str, float]:
    """The cost model (see module docstring): predicted seconds per method on a device of DRAM ``bandwidth``
    (bytes/s)."""
    e_a, e_w = acts_dtype.itemsize, w_dtype.itemsize
    scale = bandwidth / REFERENCE_BANDWIDTH
    gathered = mean_l0 * d_model * e_w  # W_dec bytes per row
    scan = _LAUNCH_S + M * (
        d_sae * e_a / _SCAN_ROW_RATE.get(e_a, 1.4e12) + gathered / _SCAN_GATHER_RATE.get(e_a, 2.4e12)
    )
    fixed = 4 * _LAUNCH_S + max(  # bitmask, bits -> ELL, gather, and the overflowed rows' scan
        M
        * (
            d_sae * e_a / (_FIXED_BITS_RATE * scale)
            + d_sae / 8 / _FIXED_WORDS_RATE
            + gathered / (_FIXED_GATHER_RATE.get(e_w, 3.8e12) * scale)
        ),
        mean_l0 / 16 * _FIXED_GATHER_STEP_S + math.ceil(d_sae / 32768) * _FIXED_WORDS_CHUNK_S,
    )
    compute = torch.promote_types(acts_dtype, w_dtype)
    # cuBLAS reaches neither bound where both are close (B=256, d_model=768: 45 us against 32 and 31): their sum
    # in quadrature
    dense = math.hypot(
        2 * M * d_sae * d_model / _DENSE_FLOP_RATE.get(compute, 50e12),
        d_sae * d_model * compute.itemsize / (_DENSE_WEIGHT_RATE * scale),
    )
    return {"scan": scan, "fixed": fixed, "dense": dense}


def _fastest_method(
    M: int,
    d_sae: int,
    d_model: int,
    mean_l0: float,
    acts_dtype: torch.dtype,
    w_dtype: torch.dtype,
    bandwidth: float = REFERENCE_BANDWIDTH,
) -> str:
    """auto's pick: the faster sparse method if predicted at least 1 - AUTO_MARGIN faster than cuBLAS, else dense."""
    predicted = _predicted_seconds(M, d_sae, d_model, mean_l0, acts_dtype, w_dtype, bandwidth)
    return pick_fastest(predicted, margin=AUTO_MARGIN)


def _auto_width(mean_l0: float, d_sae: int) -> int:
    return min(d_sae, max(DEFAULT_MAX_L0, triton.next_power_of_2(max(1, math.ceil(AUTO_WIDTH_PER_L0 * mean_l0)))))


def _estimated_l0(acts: torch.Tensor, decoder: torch.Tensor) -> float | None:
    """Mean L0 from the decoder's estimate, fed by this call when it is eager (see module docstring); None when
    nothing is known (compile tracing, or a capture without a warm-up call)."""
    return _ESTIMATES.estimate(
        decoder, lambda: sampled_nonzero_stats(acts, AUTO_SAMPLE_ROWS), observable(acts) and acts.shape[0] > 0
    )


def resolve_method(
    method: str,
    acts: torch.Tensor,
    W_dec: torch.Tensor,
    max_l0: int | None,
    expected_l0: float | None,
    decoder: torch.Tensor | None = None,
) -> tuple[str, int]:
    """(method, ELL width) for acts [M, d_sae], W_dec [d_sae, d_model]: ``method`` itself unless it is "auto".
    ``decoder``: the tensor the estimate is kept for, the caller's W_dec where ``W_dec`` is its autocast copy."""
    (M, d_sae), d_model = acts.shape, W_dec.shape[1]
    width = max_l0 if max_l0 is not None else min(DEFAULT_MAX_L0, d_sae)
    if method == "auto":
        if d_sae < AUTO_DENSE_BELOW_D_SAE:
            method = "dense"
        else:
            mean_l0 = (
                expected_l0 if expected_l0 is not None else _estimated_l0(acts, W_dec if decoder is None else decoder)
            )
            if mean_l0 is None:
                mean_l0 = d_sae / 1024  # SAE-like sparsity, assumed where nothing was observed
            bandwidth = dram_bandwidth(acts.device) or REFERENCE_BANDWIDTH
            method = _fastest_method(M, d_sae, d_model, mean_l0, acts.dtype, W_dec.dtype, bandwidth)
            if max_l0 is None:
                width = _auto_width(mean_l0, d_sae)
    return method, width
