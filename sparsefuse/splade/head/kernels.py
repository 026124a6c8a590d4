"""The SPLADE head's forward Triton kernels: the GEMM with the pooling as its epilogue and the combine of per-tile
partials. (The sum-pooling backward is :mod:`.sum_kernels`; max pooling's is the shared sparse core's
gather-accumulate, see :mod:`.launch`.)

Forward: a GEMM over hidden viewed as [B*S, H] times weight^T [H, V] whose [BLOCK_M, BLOCK_N] output tiles never
cross a batch row (an M tile holds BLOCK_M positions of one batch row; positions past S and masked ones are
excluded), with the pooling as the matmul's epilogue: each logit tile comes from ``tl.dot`` (fp32 accumulation) and
is reduced over its rows on the spot, so nothing of size [B, S, V] ever reaches global memory. For max pooling the
reduction is over the raw logits: since ``log1p(relu(.))`` is non-decreasing, ``max_s f(x_s) = f(max_s x_s)``, and
because fp32 rounding is monotone, ``max_s (x_s + bias) = max_s x_s + bias`` exactly, so the bias and
``log1p(relu(.))`` are applied once per (b, v) at the end; the first row equal to the column max gives the argmax.
Sum pooling does not commute, so each logit goes through ``log1p(relu(. + bias))`` before being summed; both
poolings run in the same kernel. When one M tile covers the sequence (BLOCK_M >= S) the epilogue writes the output
directly; otherwise each tile writes fp32 partials [B, cdiv(S, BLOCK_M), V] (column max or sum, and the first
argmax position as int32) and a small combine kernel folds them in sequence order (strictly greater wins, so ties
keep the first position; deterministic). Tiles are ordered in groups of M tiles whose hidden rows fit in L2
together (:func:`sparsefuse._triton.schedule.grouped_tile_coords`), so each weight tile is read from DRAM about once
per group. Two schedules: one tile per program (fully masked padding tiles then skip their matmul), or persistent
(one program per SM) with the tile loop flattened into the K loop (``tl.range(flatten=True)``) so the software
pipeline keeps loading across tiles; padding tiles are then computed and masked. Loads are pointer loads, or on
Hopper TMA loads through ``tl.make_tensor_descriptor``.

Mask values: a position whose mask is 0 is skipped (its logits never reach a max or a sum, so padding's NaN or inf
cannot leak), and a kept position's score is multiplied by its mask value c, as in naver/splade's
``max_s log1p(relu(x_s)) * mask_s`` (and the sum). A bool mask (or none) has c = 1: the raw-logit max above. Any
other mask dtype may hold other values, which max pooling meets in two passes of the same kernel (MASK_SCALES). Pass
1, the schedule above, reduces the raw logits and scales the max by the tile's largest kept weight c, exact where the
kept positions share one positive c (``max_s c * f(x_s) = c * f(max_s x_s)``), as 0/1 integer masks do. Pass 2, one
tile per program, skips such tiles after reading their mask and rewrites the others' results from every weighted
score. Their per-element log1p stays out of pass 1: at 128x256 tiles it spills (1.2 KB a thread on sm_90), which
slowed the 0/1-mask forward by ~27% on an H100 when both were one kernel. The partials are finished weighted scores
(bias and log1p applied), and they carry the derivative ``c / (1 + x)`` at their max, which the combine could not
recover from a score.

Precision: logits accumulate in fp32 (fp32 products per :mod:`sparsefuse._triton.dot`), ``log1p`` is evaluated
accurately near 0, the output is rounded once to its dtype; NaN logits propagate to the output.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..._jit import kernel
from ..._triton.dot import dot_accumulate
from ..._triton.schedule import grouped_tile_coords

__all__ = ["splade_fwd_kernel", "splade_fwd_combine_kernel"]


@triton.jit
def _log1p_nonneg(x):
    # log1p for x >= 0 (NaN and inf pass through). log(1 + x) alone loses x's low bits when x << 1; multiplying by
    # x / ((1 + x) - 1) corrects for the rounding of 1 + x (Goldberg). Where 1 + x rounds to 1, log1p(x) = x.
    u = 1.0 + x
    d = u - 1.0
    tiny = d == 0.0
    huge = x > 1.0e30  # includes inf, where x / d would be inf / inf
    ratio = x / tl.where(tiny | huge, 1.0, d)
    log_u = tl.log(u)
    return tl.where(tiny, x, tl.where(huge, log_u, log_u * ratio))


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _column_max(x, NATIVE_NAN_MAX: tl.constexpr):
    """[BLOCK_V] max over axis 0 that propagates NaN, like torch.max (tl.max ignores NaN). Compiled: one max.NaN
    reduction. The interpreter runs a custom combine element by element in Python, so there the same result comes
    from numpy's max plus a NaN test."""
    if NATIVE_NAN_MAX:
        result = tl.reduce(x, 0, _nan_max)
    else:
        has_nan = tl.max((x != x).to(tl.int32), axis=0) > 0
        result = tl.where(has_nan, float("nan"), tl.max(x, axis=0))
    return result


@triton.jit
def _kept_positions(mask_ptr, b, s, S, stride_mb, stride_ms, HAS_MASK: tl.constexpr):
    """([BLOCK_S] bool, [BLOCK_S] fp32): in range and not masked out, and the mask's value there (the weight of a
    kept position's score; 1 without a mask)."""
    keep = s < S
    if HAS_MASK:
        m = tl.load(mask_ptr + b.to(tl.int64) * stride_mb + s.to(tl.int64) * stride_ms, mask=keep, other=0)
        keep = keep & (m != 0)
        weight = m.to(tl.float32)
    else:
        weight = keep.to(tl.float32)
    return keep, weight


@triton.jit
def _weights_uniform(keep, weight):
    """(the largest kept weight, -inf with none kept; whether the kept rows share one positive weight or none is
    kept, so that the raw-logit max holds). tl.max/min skip NaN, so a NaN weight is counted apart."""
    w_hi = tl.max(tl.where(keep, weight, float("-inf")), axis=0)
    w_lo = tl.min(tl.where(keep, weight, float("inf")), axis=0)
    w_nan = tl.max((keep & (weight != weight)).to(tl.int32), axis=0) > 0
    return w_hi, (((w_lo == w_hi) & (w_lo > 0)) | (w_hi == float("-inf"))) & ~w_nan


@triton.jit
def _scaled_column_max(acc, bias, keep, w, s, SAVE_AUX: tl.constexpr, NATIVE_NAN_MAX: tl.constexpr):
    """Max pooling of ``w * log1p(relu(acc_s + bias))`` over the kept rows of a [BLOCK_M, BLOCK_N] logit tile whose
    kept rows all weigh w > 0, by the raw-logit max: ([BLOCK_N] max, -inf where no row is kept; the first row
    attaining it; the derivative there, w / (1 + x) for x > 0 else 0)."""
    raw = tl.where(keep[:, None], acc, float("-inf"))  # [BLOCK_M, BLOCK_N]
    top = _column_max(raw, NATIVE_NAN_MAX)  # [BLOCK_N]
    x = top + bias
    score = w * _log1p_nonneg(tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL))
    value = tl.where(top == float("-inf"), float("-inf"), score)
    best_s = tl.zeros(bias.shape, dtype=tl.int32)
    slope = tl.zeros(bias.shape, dtype=tl.float32)
    if SAVE_AUX:
        best_s = tl.min(tl.where(raw == top[None, :], s[:, None], 2147483647), axis=0)
        slope = tl.where(x > 0, w / (1.0 + x), 0.0)
    return value, best_s, slope


@triton.jit
def _weighted_column_max(acc, bias, keep, weight, s, SAVE_AUX: tl.constexpr, NATIVE_NAN_MAX: tl.constexpr):
    """:func:`_scaled_column_max` for rows of any weights: every weighted score is formed, and the derivative is
    read at the winning row."""
    logits = acc + bias[None, :]  # [BLOCK_M, BLOCK_N]
    scores = weight[:, None] * _log1p_nonneg(tl.maximum(logits, 0.0, propagate_nan=tl.PropagateNan.ALL))
    scores = tl.where(keep[:, None], scores, float("-inf"))
    value = _column_max(scores, NATIVE_NAN_MAX)
    best_s = tl.zeros(bias.shape, dtype=tl.int32)
    slope = tl.zeros(bias.shape, dtype=tl.float32)
    if SAVE_AUX:
        best_s = tl.min(tl.where(scores == value[None, :], s[:, None], 2147483647), axis=0)
        chosen = s[:, None] == best_s[None, :]
        x_best = tl.sum(tl.where(chosen, logits, 0.0), axis=0)
        w_best = tl.sum(tl.where(chosen, weight[:, None], 0.0), axis=0)
        slope = tl.where(x_best > 0, w_best / (1.0 + x_best), 0.0)
    return value, best_s, slope


@triton.jit
def _finish_columns(
    value,
    best_s,
    best_slope,
    b,
    v,
    v_ok,
    V,
    bias_ptr,
    out_ptr,
    argmax_ptr,
    slope_ptr,
    POOL_MAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SAVE_AUX: tl.constexpr,
    MASK_SCALES: tl.constexpr,
):
    """Writes out[b, v] (and argmax/slope) from the pooled value of a [BLOCK_N] column block of batch row b: for max
    pooling the masked max raw logit (no bias yet; -inf when every position is masked), or under MASK_SCALES the
    finished max weighted score (-inf when every position is masked) and its derivative best_slope; for sum pooling
    the sum."""
    offsets = b.to(tl.int64) * V + v
    if POOL_MAX and MASK_SCALES:
        y = tl.where(value == float("-inf"), 0.0, value)
        if SAVE_AUX:
            tl.store(argmax_ptr + offsets, best_s, mask=v_ok)
            tl.store(slope_ptr + offsets, best_slope, mask=v_ok)
    elif POOL_MAX:
        m = value
        if HAS_BIAS:
            m = m + tl.load(bias_ptr + tl.minimum(v, V - 1)).to(tl.float32)
        y = _log1p_nonneg(tl.maximum(m, 0.0, propagate_nan=tl.PropagateNan.ALL))  # -inf (fully masked) -> 0
        if SAVE_AUX:
            tl.store(argmax_ptr + offsets, best_s, mask=v_ok)
            tl.store(slope_ptr + offsets, tl.where(m > 0, 1.0 / (1.0 + m), 0.0), mask=v_ok)
    else:
        y = value
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=v_ok)


@kernel
def splade_fwd_kernel(
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    mask_ptr,
    out_ptr,
    argmax_ptr,
    slope_ptr,
    part_ptr,
    part_arg_ptr,
    part_slope_ptr,
    B,
    S,
    V,
    stride_hb,
    stride_hs,
    stride_wv,
    stride_mb,
    stride_ms,
    n_s_tiles,
    group_m,
    H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    POOL_MAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_SCALES: tl.constexpr,
    SAVE_AUX: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    PERSISTENT: tl.constexpr,
    USE_TMA: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    NATIVE_NAN_MAX: tl.constexpr,
):
    # A GEMM over hidden viewed as [B*S, H] times weight^T [H, V] whose M tiles never cross a batch row: M tile
    # pid_m = b * n_s_tiles + j holds positions s = j*BLOCK_M ... j*BLOCK_M + BLOCK_M - 1 of batch row b (s >= S and
    # masked positions are excluded by `keep`). hidden [B, S, H], weight [V, H] (unit last strides), bias [V],
    # mask [B, S] (any int/float dtype); out [B, V] (hidden's dtype); SAVE_AUX: argmax [B, V] int32, slope fp32.
    # SINGLE_PASS (n_s_tiles == 1): each tile finishes its columns. Otherwise each tile writes the partials
    # part [B * n_s_tiles, V] fp32 (column max of the raw logits -- of the weighted scores under MASK_SCALES, then
    # with their derivative in part_slope -- or column sum of the scores) and part_arg (the first position of the
    # max) for splade_fwd_combine_kernel. A program walks tiles pid, pid + #programs, ...:
    # PERSISTENT grids have one program per SM and flatten that loop with the K loop (the pipeline keeps loading
    # across tiles); otherwise there is one tile per program and fully masked (padding) tiles skip their matmul.
    K_TILES: tl.constexpr = (H + BLOCK_K - 1) // BLOCK_K
    EVEN_K: tl.constexpr = H % BLOCK_K == 0
    num_pid_m = B * n_s_tiles
    num_pid_n = tl.cdiv(V, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    if USE_TMA:  # hidden rows are equally spaced ([B*S, H] view); rows past S read the next batch row, masked below
        hidden_desc = tl.make_tensor_descriptor(
            hidden_ptr, shape=[B * S, H], strides=[stride_hs, 1], block_shape=[BLOCK_M, BLOCK_K]
        )
        weight_desc = tl.make_tensor_descriptor(
            weight_ptr, shape=[V, H], strides=[stride_wv, 1], block_shape=[BLOCK_N, BLOCK_K]
        )
    for tile_id in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=PERSISTENT):
        # hidden rows that fit in L2 together sweep the vocabulary tiles side by side
        pid_m, pid_n = grouped_tile_coords(tile_id, num_pid_m, num_pid_n, group_m)
        b = pid_m // n_s_tiles
        s0 = (pid_m % n_s_tiles) * BLOCK_M
        s = s0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        v = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        v_ok = v < V
        v_load = tl.minimum(v, V - 1)
        keep, weight = _kept_positions(mask_ptr, b, s, S, stride_mb, stride_ms, HAS_MASK)  # [BLOCK_M]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        run = True
        if HAS_MASK and not PERSISTENT:  # (a branch inside the flattened loop nest would stop the flattening)
            run = tl.max(keep.to(tl.int32), axis=0) > 0
        if MASK_SCALES == 2:  # the second pass: only the tiles of differing weights (the first pass did the rest)
            w_hi, uniform = _weights_uniform(keep, weight)
            run = run & ~uniform
        if run:
            if USE_TMA:  # out-of-range rows, columns and the K tail are zero-filled by the TMA unit
                row0 = b * S + s0
                for ki in range(K_TILES):
                    x = hidden_desc.load([row0, ki * BLOCK_K])  # [BLOCK_M, BLOCK_K]
                    w = weight_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])  # [BLOCK_N, BLOCK_K]
                    acc = dot_accumulate(acc, x, tl.trans(w), IEEE_FP32)
            else:  # clamped row/column indices (tails are excluded by keep / v_ok); only the K tail needs a mask
                k = tl.arange(0, BLOCK_K)
                s_load = tl.minimum(s, S - 1)
                x_ptrs = (
                    hidden_ptr + b.to(tl.int64) * stride_hb + s_load[:, None].to(tl.int64) * stride_hs + k[None, :]
                )  # [BLOCK_M, BLOCK_K]
                w_ptrs = weight_ptr + v_load[None, :].to(tl.int64) * stride_wv + k[:, None]  # [BLOCK_K, BLOCK_N]
                for ki in range(K_TILES):
                    if EVEN_K:
                        x = tl.load(x_ptrs + ki * BLOCK_K)
                        w = tl.load(w_ptrs + ki * BLOCK_K)
                    else:
                        x = tl.load(x_ptrs + ki * BLOCK_K, mask=(ki * BLOCK_K + k)[None, :] < H, other=0.0)
                        w = tl.load(w_ptrs + ki * BLOCK_K, mask=(ki * BLOCK_K + k)[:, None] < H, other=0.0)
                    acc = dot_accumulate(acc, x, w, IEEE_FP32)
        if HAS_BIAS and (MASK_SCALES or not POOL_MAX):  # the raw-logit max adds it once, when finishing
            bias = tl.load(bias_ptr + v_load).to(tl.float32)  # [BLOCK_N]
        else:
            bias = tl.zeros([BLOCK_N], dtype=tl.float32)
        best_slope = bias  # placeholder: MASK_SCALES only
        if POOL_MAX and MASK_SCALES == 1:  # a tile of differing weights gets a wrong value here, rewritten by pass 2
            w_hi, uniform = _weights_uniform(keep, weight)
            value, best_s, best_slope = _scaled_column_max(acc, bias, keep, w_hi, s, SAVE_AUX, NATIVE_NAN_MAX)
            best_s = tl.minimum(best_s, S - 1)  # NaN column
        elif POOL_MAX and MASK_SCALES == 2:
            value, best_s, best_slope = _weighted_column_max(acc, bias, keep, weight, s, SAVE_AUX, NATIVE_NAN_MAX)
            best_s = tl.minimum(best_s, S - 1)
        elif POOL_MAX:  # over the raw logits: the bias and log1p(relu(.)) commute with the max (module docstring)
            logits = tl.where(keep[:, None], acc, float("-inf"))  # [BLOCK_M, BLOCK_N]
            value = _column_max(logits, NATIVE_NAN_MAX)  # [BLOCK_N]
            if SAVE_AUX:  # first position equal to the max (ties: first, like torch.max); NaN column: clamped
                best_s = tl.min(tl.where(logits == value[None, :], s[:, None], 2147483647), axis=0)
                best_s = tl.minimum(best_s, S - 1)
            else:
                best_s = tl.zeros([BLOCK_N], dtype=tl.int32)
        else:
            scores = _log1p_nonneg(tl.maximum(acc + bias[None, :], 0.0, propagate_nan=tl.PropagateNan.ALL))
            if HAS_MASK:
                scores = scores * weight[:, None]
            value = tl.sum(tl.where(keep[:, None], scores, 0.0), axis=0)  # [BLOCK_N]
            best_s = tl.zeros([BLOCK_N], dtype=tl.int32)
        write = True
        if MASK_SCALES == 2:
            write = run
        if write:
            if SINGLE_PASS:
                _finish_columns(
                    value,
                    best_s,
                    best_slope,
                    b,
                    v,
                    v_ok,
                    V,
                    bias_ptr,
                    out_ptr,
                    argmax_ptr,
                    slope_ptr,
                    POOL_MAX,
                    HAS_BIAS,
                    SAVE_AUX,
                    MASK_SCALES,
                )
            else:
                part_offsets = pid_m.to(tl.int64) * V + v
                tl.store(part_ptr + part_offsets, value, mask=v_ok)
                if SAVE_AUX:
                    tl.store(part_arg_ptr + part_offsets, best_s, mask=v_ok)
                    if MASK_SCALES:
                        tl.store(part_slope_ptr + part_offsets, best_slope, mask=v_ok)


@kernel
def splade_fwd_combine_kernel(
    part_ptr,
    part_arg_ptr,
    part_slope_ptr,
    bias_ptr,
    out_ptr,
    argmax_ptr,
    slope_ptr,
    V,
    n_s_tiles,
    BLOCK_V: tl.constexpr,
    POOL_MAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SAVE_AUX: tl.constexpr,
    MASK_SCALES: tl.constexpr,
):
    # Folds the n_s_tiles partials of each (b, v) in sequence order (fixed order: deterministic) and finishes them.
    pid = tl.program_id(0)
    n_v_tiles = tl.cdiv(V, BLOCK_V)
    b = pid // n_v_tiles
    v = (pid % n_v_tiles) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    v_ok = v < V
    if POOL_MAX:
        value = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
    else:
        value = tl.zeros([BLOCK_V], dtype=tl.float32)
    best_s = tl.zeros([BLOCK_V], dtype=tl.int32)
    best_slope = tl.zeros([BLOCK_V], dtype=tl.float32)
    for j in range(0, n_s_tiles):
        offsets = (b.to(tl.int64) * n_s_tiles + j) * V + v
        x = tl.load(part_ptr + offsets, mask=v_ok, other=0.0)
        if POOL_MAX:
            # strictly greater: on ties the earlier tile keeps the max (first position); NaN sticks
            better = (x > value) | ((x != x) & (value == value))
            value = tl.where(better, x, value)
            if SAVE_AUX:
                best_s = tl.where(better, tl.load(part_arg_ptr + offsets, mask=v_ok, other=0), best_s)
                if MASK_SCALES:
                    best_slope = tl.where(better, tl.load(part_slope_ptr + offsets, mask=v_ok, other=0.0), best_slope)
        else:
            value += x
    _finish_columns(
        value,
        best_s,
        best_slope,
        b,
        v,
        v_ok,
        V,
        bias_ptr,
        out_ptr,
        argmax_ptr,
        slope_ptr,
        POOL_MAX,
        HAS_BIAS,
        SAVE_AUX,
        MASK_SCALES,
    )
