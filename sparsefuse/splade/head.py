"""Fused SPLADE head: the masked LM's vocabulary logits pooled over the sequence, without the logits in memory.

    logits[b, s, v] = hidden[b, s, :] . weight[v, :] + bias[v]          hidden [B, S, H], weight [V, H] (tied decoder)
    max:  out[b, v] = max_s log1p(relu(logits[b, s, v])) * mask[b, s]    (SPLADE v2+, naver/splade, SpladePooling)
    sum:  out[b, v] = sum_s log1p(relu(logits[b, s, v])) * mask[b, s]    (SPLADE v1)

Masked positions contribute 0 -- so a column whose unmasked logits are all negative scores 0, and a fully masked
row is all zeros. The mask is an attention mask: any non-zero value keeps the position.

Forward: ONE kernel. A program owns a (batch row b, vocabulary tile) pair and walks the sequence in BLOCK_S tiles,
so its weight tile is reused across the whole sequence; each [BLOCK_S, BLOCK_V] logit tile comes from ``tl.dot``
(fp32 accumulation) and is reduced on the spot. For max pooling the reduction is over the raw logits: since
``log1p(relu(.))`` is non-decreasing, ``max_s f(x_s) = f(max_s x_s)``, and because fp32 rounding is monotone,
``max_s (x_s + bias) = max_s x_s + bias`` exactly, so the bias and ``log1p(relu(.))`` are applied once per
(b, v) at the end. Sum pooling does not commute, so each logit goes through ``log1p(relu(. + bias))`` before being
summed. Fully masked sequence tiles (padding) are skipped. Programs are ordered in groups of batch rows whose hidden
states fit in L2 together, so each weight tile is read from DRAM about once per group. Nothing of size [B, S, V] or
[B, S, BLOCK_V] ever reaches global memory.

Backward, max pooling: only the argmax position of each (b, v) receives a gradient. When gradients are needed the
forward also stores ``argmax`` [B, V] (int32; first position on ties, like ``torch.max``) and the derivative
``slope = 1 / (1 + m)`` at the max logit m (0 where m <= 0 or the row is fully masked), fp32 [B, V]. Then with
``dlogit = grad * slope`` (zero entries are skipped everywhere):

* grad_bias[v]   = sum_b dlogit[b, v]                                   (a column sum)
* grad_weight[v] = sum_b dlogit[b, v] * hidden[b, argmax[b, v]]          (ELL, one row per v, width B)
* grad_hidden[b, s] = sum_{v: argmax[b, v] = s} dlogit[b, v] * weight[v] (CSR, one row per (b, s))

Both sparse products are the shared gather-accumulate kernel (:func:`sparsefuse.sparse.sparse_matmul`). The
CSR of grad_hidden is built on the device without a host sync: a stable sort of the (b, argmax) keys and a
``searchsorted`` for the row offsets; its arrays are sized B*V (the upper bound), so no count is needed first.

Backward, sum pooling: every position gets a gradient, ``dlogit[b, s, v] = grad[b, v] * mask[b, s] / (1 + x)``
for ``x = logits > 0``. Two kernels recompute the logits tile by tile (never storing [B, S, V]): one owns
(b, sequence tile, hidden slice) and accumulates ``dlogit @ weight``; one owns (vocabulary tile, hidden slice) and
accumulates ``dlogit^T @ hidden`` over every (b, sequence tile), plus the bias gradient. Cost: a register
accumulator holds only a BLOCK_HO slice of H, so each kernel recomputes the logits H / BLOCK_HO times -- several
forward matmuls in all; max pooling (SPLADE v2+) is the path built for speed.

Determinism: the backward uses no float atomics anywhere (integer-only sort/compaction, fixed-order reductions), so
results are bitwise reproducible run to run; this is the only mode and needs no flag. (A scatter-add of
``dlogit * weight[v]`` into grad_hidden would read each weight row once instead of once per batch row, at the price
of B*V*H float atomics and run-to-run variation; it is not implemented.)

Tuning: the forward autotunes (BLOCK_S, BLOCK_V, warps, stages) per (V, H, dtype, pooling) and power-of-two class of
B and S. ``SPARSEFUSE_SPLADE_FLATTEN=1`` (read at import) adds candidates that let Triton flatten the sequence x
hidden loop nest (``tl.range(flatten=True)``) so the software pipeline does not drain at every sequence tile;
those candidates do not skip padding tiles.

Precision: fp32/fp16/bf16 inputs (hidden and weight of one dtype; bias any float dtype); logits accumulate in fp32,
``log1p`` is evaluated accurately near 0, the output is rounded once to the input dtype. fp32 products use exact
fp32 (``input_precision="ieee"``) unless ``torch.set_float32_matmul_precision`` allows TF32, as for torch.matmul.
NaN logits propagate to the output (the argmax stored for a NaN column is unspecified).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import _backend
from .._backend import Backend, backend_for, new_output, record_launch, tuning_configs
from .._validation import FLOAT_DTYPES, check_float, check_same_device, check_tensor, describe
from ..sparse import CSR, ELL, dense_to_ell, sparse_matmul

__all__ = ["splade_pool", "torch_splade_pool", "splade_pool_op", "splade_pool_backward_op", "POOLINGS"]

POOLINGS = ("max", "sum")
SPLADE_DTYPES = FLOAT_DTYPES  # float32, float16, bfloat16
_L2_BUDGET_BYTES = 16 << 20  # hidden states of one program group that should stay in L2 together

# ----------------------------------------------------------------------------------------------------------------
# Reference (ground truth; float64-capable)
# ----------------------------------------------------------------------------------------------------------------


def torch_splade_pool(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None, pooling: str = "max") -> torch.Tensor:  # fmt: skip
    """naver/splade's expression in hidden's dtype: ``torch.max(log1p(relu(logits)) * mask[..., None], dim=1)``
    (values; gradients go to the first maximal position, as torch.max's) or the same with a sum. Materialises
    [B, S, V]."""
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    scores = torch.log1p(torch.relu(logits))
    if attention_mask is not None:
        scores = scores * attention_mask.unsqueeze(-1).to(scores.dtype)
    if pooling == "sum" or hidden.shape[1] == 0:
        return scores.sum(dim=1)
    return torch.max(scores, dim=1).values


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------


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
def _logit_tile(hidden_row_ptr, weight_ptr, s_load, v_load, H, stride_hs, stride_wv,
                BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, EVEN_H: tl.constexpr,
                IEEE_FP32: tl.constexpr):  # fmt: skip
    """[BLOCK_S, BLOCK_V] fp32 = hidden[b, s_load, :] @ weight[v_load, :]^T. s_load/v_load are clamped in-range
    indices (tails are masked by the caller), so only the hidden dimension needs load masks (EVEN_H: none)."""
    h = tl.arange(0, BLOCK_H)
    x_ptrs = hidden_row_ptr + s_load[:, None].to(tl.int64) * stride_hs + h[None, :]  # [BLOCK_S, BLOCK_H]
    w_ptrs = weight_ptr + v_load[None, :].to(tl.int64) * stride_wv + h[:, None]  # [BLOCK_H, BLOCK_V]
    acc = tl.zeros([BLOCK_S, BLOCK_V], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        if EVEN_H:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            x = tl.load(x_ptrs, mask=(h0 + h)[None, :] < H, other=0.0)
            w = tl.load(w_ptrs, mask=(h0 + h)[:, None] < H, other=0.0)
        if IEEE_FP32:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_H
        w_ptrs += BLOCK_H
    return acc


@triton.jit
def _pool_tile(acc, keep, s, S, bias, best, best_s, total, POOL_MAX: tl.constexpr, SAVE_AUX: tl.constexpr,
               NATIVE_NAN_MAX: tl.constexpr):  # fmt: skip
    """Fold one [BLOCK_S, BLOCK_V] logit tile (no bias yet) into the running (best, best_s, total) of a program."""
    if POOL_MAX:
        logits = tl.where(keep[:, None], acc, float("-inf"))
        tile_max = _column_max(logits, NATIVE_NAN_MAX)  # [BLOCK_V]
        # strictly greater: on ties the earlier tile keeps the max (first position, like torch.max); NaN sticks
        better = (tile_max > best) | ((tile_max != tile_max) & (best == best))
        best = tl.where(better, tile_max, best)
        if SAVE_AUX:
            first = tl.min(tl.where(logits == tile_max[None, :], s[:, None], 2147483647), axis=0)
            best_s = tl.where(better, tl.minimum(first, S - 1), best_s)  # NaN column: clamped, unspecified
    else:
        scores = _log1p_nonneg(tl.maximum(acc + bias[None, :], 0.0, propagate_nan=tl.PropagateNan.ALL))
        total += tl.sum(tl.where(keep[:, None], scores, 0.0), axis=0)
    return best, best_s, total


@triton.jit
def _kept_positions(mask_ptr, b, s, S, stride_mb, stride_ms, HAS_MASK: tl.constexpr):
    """[BLOCK_S] bool: in range and not masked out."""
    keep = s < S
    if HAS_MASK:
        m = tl.load(mask_ptr + b.to(tl.int64) * stride_mb + s.to(tl.int64) * stride_ms, mask=keep, other=0)
        keep = keep & (m != 0)
    return keep


def _fwd_configs() -> list[triton.Config]:
    configs = [
        triton.Config({"BLOCK_S": bs, "BLOCK_V": bv, "FLATTEN": False}, num_warps=w, num_stages=st)
        for bs, bv, w, st in [
            (128, 128, 8, 3), (128, 128, 8, 4), (128, 128, 4, 3), (64, 128, 4, 4), (64, 128, 4, 3),
            (128, 256, 8, 3), (64, 256, 8, 3), (128, 64, 4, 4),
        ]
    ]  # fmt: skip
    if os.environ.get("SPARSEFUSE_SPLADE_FLATTEN", "0") == "1":
        # Experimental: let Triton flatten the sequence x hidden loop nest so the pipeline does not drain at every
        # sequence tile. Off by default until measured on the target GPU/Triton.
        configs += [triton.Config({**c.kwargs, "FLATTEN": True}, num_warps=c.num_warps, num_stages=c.num_stages)
                    for c in configs[:4]]  # fmt: skip
    return tuning_configs(configs, interpret_config=triton.Config({"BLOCK_S": 16, "BLOCK_V": 32, "FLATTEN": False}))


@triton.autotune(configs=_fwd_configs(), key=["V", "H", "s_bucket", "b_bucket", "POOL_MAX", "SAVE_AUX"])
@triton.jit
def splade_fwd_kernel(hidden_ptr, weight_ptr, bias_ptr, mask_ptr, out_ptr, argmax_ptr, slope_ptr,
                      B, S, V, H, stride_hb, stride_hs, stride_wv, stride_mb, stride_ms, group_b, s_bucket, b_bucket,
                      BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, FLATTEN: tl.constexpr,
                      POOL_MAX: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
                      SAVE_AUX: tl.constexpr, EVEN_H: tl.constexpr, IEEE_FP32: tl.constexpr,
                      NATIVE_NAN_MAX: tl.constexpr):  # fmt: skip
    # hidden [B, S, H], weight [V, H] (unit last strides), bias [V], mask [B, S] (any int/float dtype);
    # out [B, V] (hidden's dtype); max pooling with SAVE_AUX: argmax [B, V] int32, slope [B, V] fp32.
    # s_bucket/b_bucket only key the autotuner.
    pid = tl.program_id(0)
    n_v_tiles = tl.cdiv(V, BLOCK_V)
    tiles_per_group = group_b * n_v_tiles
    first_b = (pid // tiles_per_group) * group_b
    rows_in_group = tl.minimum(B - first_b, group_b)
    local = pid % tiles_per_group
    b = first_b + local % rows_in_group  # consecutive programs: same vocabulary tile, different batch rows
    v = (local // rows_in_group) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    v_ok = v < V
    v_load = tl.minimum(v, V - 1)
    hidden_row_ptr = hidden_ptr + b.to(tl.int64) * stride_hb
    if HAS_BIAS:
        bias = tl.load(bias_ptr + v_load).to(tl.float32)  # [BLOCK_V]
    else:
        bias = tl.zeros([BLOCK_V], dtype=tl.float32)

    best = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)  # running max of the masked raw logits (no bias)
    best_s = tl.zeros([BLOCK_V], dtype=tl.int32)
    total = tl.zeros([BLOCK_V], dtype=tl.float32)  # running sum of log1p(relu(logit + bias))
    for s0 in tl.range(0, S, BLOCK_S, flatten=FLATTEN):
        s = s0 + tl.arange(0, BLOCK_S)  # [BLOCK_S]
        s_load = tl.minimum(s, S - 1)
        keep = _kept_positions(mask_ptr, b, s, S, stride_mb, stride_ms, HAS_MASK)
        if FLATTEN:  # the hidden-dimension loop sits directly in this loop's body, so the nest can be flattened
            acc = _logit_tile(hidden_row_ptr, weight_ptr, s_load, v_load, H, stride_hs, stride_wv,
                              BLOCK_S, BLOCK_V, BLOCK_H, EVEN_H, IEEE_FP32)  # [BLOCK_S, BLOCK_V]  # fmt: skip
            best, best_s, total = _pool_tile(acc, keep, s, S, bias, best, best_s, total, POOL_MAX, SAVE_AUX,
                                             NATIVE_NAN_MAX)  # fmt: skip
        else:
            if HAS_MASK:
                has_tokens = tl.max(keep.to(tl.int32), axis=0) > 0
            else:
                has_tokens = s0 < S
            if has_tokens:  # a tile of padding contributes nothing: skip its matmul
                acc = _logit_tile(hidden_row_ptr, weight_ptr, s_load, v_load, H, stride_hs, stride_wv,
                                  BLOCK_S, BLOCK_V, BLOCK_H, EVEN_H, IEEE_FP32)  # [BLOCK_S, BLOCK_V]  # fmt: skip
                best, best_s, total = _pool_tile(acc, keep, s, S, bias, best, best_s, total, POOL_MAX, SAVE_AUX,
                                                 NATIVE_NAN_MAX)  # fmt: skip

    out_offsets = b.to(tl.int64) * V + v
    if POOL_MAX:
        m = best + bias  # -inf for a fully masked row: relu makes it 0
        y = _log1p_nonneg(tl.maximum(m, 0.0, propagate_nan=tl.PropagateNan.ALL))
        if SAVE_AUX:
            tl.store(argmax_ptr + out_offsets, best_s, mask=v_ok)
            tl.store(slope_ptr + out_offsets, tl.where(m > 0, 1.0 / (1.0 + m), 0.0), mask=v_ok)
    else:
        y = total
    tl.store(out_ptr + out_offsets, y.to(out_ptr.dtype.element_ty), mask=v_ok)


@triton.jit
def _sum_dlogit(acc, bias, g, keep):
    """[BLOCK_S, BLOCK_V] fp32: d/dlogit of sum-pooled log1p(relu(logit)) times the incoming gradient g [BLOCK_V]."""
    logits = acc + bias[None, :]
    return tl.where(keep[:, None] & (logits > 0), g[None, :] / (1.0 + logits), 0.0)


def _sum_bwd_configs() -> list[triton.Config]:
    return tuning_configs(
        [triton.Config({"BLOCK_S": bs, "BLOCK_V": bv, "BLOCK_HO": ho}, num_warps=w, num_stages=st)
         for bs, bv, ho, w, st in [(64, 128, 128, 4, 3), (64, 64, 256, 8, 3), (128, 64, 128, 8, 3),
                                   (64, 128, 256, 8, 3), (32, 128, 128, 4, 4)]],
        interpret_config=triton.Config({"BLOCK_S": 16, "BLOCK_V": 32, "BLOCK_HO": 32}),
    )  # fmt: skip


@triton.autotune(configs=_sum_bwd_configs(), key=["V", "H", "s_bucket", "b_bucket"])
@triton.jit
def splade_sum_bwd_hidden_kernel(grad_ptr, hidden_ptr, weight_ptr, bias_ptr, mask_ptr, grad_hidden_ptr,
                                 B, S, V, H, stride_gb, stride_gv, stride_hb, stride_hs, stride_wv, stride_mb,
                                 stride_ms, s_bucket, b_bucket,
                                 BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                                 BLOCK_HO: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
                                 EVEN_H: tl.constexpr, IEEE_FP32: tl.constexpr):  # fmt: skip
    # grad [B, V] (any strides); grad_hidden [B, S, H] contiguous. A program owns (b, sequence tile, hidden slice
    # of BLOCK_HO) and sweeps the vocabulary: recompute the logit tile, form dlogit, accumulate dlogit @ weight.
    pid = tl.program_id(0)
    n_s_tiles = tl.cdiv(S, BLOCK_S)
    n_h_tiles = tl.cdiv(H, BLOCK_HO)
    b = pid // (n_s_tiles * n_h_tiles)
    s = (pid // n_h_tiles) % n_s_tiles * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S]
    ho = pid % n_h_tiles * BLOCK_HO + tl.arange(0, BLOCK_HO)  # [BLOCK_HO]
    ho_ok = ho < H
    keep = _kept_positions(mask_ptr, b, s, S, stride_mb, stride_ms, HAS_MASK)
    s_load = tl.minimum(s, S - 1)
    hidden_row_ptr = hidden_ptr + b.to(tl.int64) * stride_hb
    acc = tl.zeros([BLOCK_S, BLOCK_HO], dtype=tl.float32)
    if HAS_MASK:
        has_tokens = tl.max(keep.to(tl.int32), axis=0) > 0
    else:
        has_tokens = pid >= 0
    if has_tokens:  # masked positions get a zero gradient: skip padding tiles
        for v0 in range(0, V, BLOCK_V):
            v = v0 + tl.arange(0, BLOCK_V)
            v_ok = v < V
            v_load = tl.minimum(v, V - 1)
            logits = _logit_tile(hidden_row_ptr, weight_ptr, s_load, v_load, H, stride_hs, stride_wv,
                                 BLOCK_S, BLOCK_V, BLOCK_H, EVEN_H, IEEE_FP32)  # fmt: skip
            if HAS_BIAS:
                bias = tl.load(bias_ptr + v_load).to(tl.float32)
            else:
                bias = tl.zeros([BLOCK_V], dtype=tl.float32)
            g = tl.load(grad_ptr + b.to(tl.int64) * stride_gb + v.to(tl.int64) * stride_gv, mask=v_ok,
                        other=0.0).to(tl.float32)  # [BLOCK_V]; 0 past V  # fmt: skip
            d = _sum_dlogit(logits, bias, g, keep)  # [BLOCK_S, BLOCK_V]
            w = tl.load(weight_ptr + v_load[:, None].to(tl.int64) * stride_wv + ho[None, :], mask=ho_ok[None, :],
                        other=0.0)  # [BLOCK_V, BLOCK_HO]  # fmt: skip
            if IEEE_FP32:
                acc = tl.dot(d.to(w.dtype), w, acc, input_precision="ieee")
            else:
                acc = tl.dot(d.to(w.dtype), w, acc)
    dst = grad_hidden_ptr + (b.to(tl.int64) * S + s[:, None]) * H + ho[None, :]
    tl.store(dst, acc.to(grad_hidden_ptr.dtype.element_ty), mask=(s < S)[:, None] & ho_ok[None, :])


@triton.autotune(configs=_sum_bwd_configs(), key=["V", "H", "s_bucket", "b_bucket", "NEED_BIAS"])
@triton.jit
def splade_sum_bwd_weight_kernel(grad_ptr, hidden_ptr, weight_ptr, bias_ptr, mask_ptr, grad_weight_ptr,
                                 grad_bias_ptr, B, S, V, H, stride_gb, stride_gv, stride_hb, stride_hs, stride_wv,
                                 stride_mb, stride_ms, s_bucket, b_bucket,
                                 BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                                 BLOCK_HO: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
                                 NEED_BIAS: tl.constexpr, EVEN_H: tl.constexpr, IEEE_FP32: tl.constexpr):  # fmt: skip
    # grad_weight [V, H] contiguous, grad_bias [V] fp32. A program owns (vocabulary tile, hidden slice) and sweeps
    # every (b, sequence tile) in a fixed order: recompute the logit tile, accumulate dlogit^T @ hidden. The first
    # hidden slice's program also sums dlogit into the bias gradient. No atomics: deterministic.
    pid = tl.program_id(0)
    n_h_tiles = tl.cdiv(H, BLOCK_HO)
    v = pid // n_h_tiles * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    v_ok = v < V
    v_load = tl.minimum(v, V - 1)
    ho_tile = pid % n_h_tiles
    ho = ho_tile * BLOCK_HO + tl.arange(0, BLOCK_HO)  # [BLOCK_HO]
    ho_ok = ho < H
    if HAS_BIAS:
        bias = tl.load(bias_ptr + v_load).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_V], dtype=tl.float32)
    acc = tl.zeros([BLOCK_V, BLOCK_HO], dtype=tl.float32)
    bias_acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for batch in range(0, B):
        b = tl.cast(batch, tl.int64)  # the loop index is a plain int under the interpreter
        hidden_row_ptr = hidden_ptr + b * stride_hb
        g = tl.load(grad_ptr + b * stride_gb + v.to(tl.int64) * stride_gv, mask=v_ok,
                    other=0.0).to(tl.float32)  # fmt: skip
        for s0 in range(0, S, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            keep = _kept_positions(mask_ptr, b, s, S, stride_mb, stride_ms, HAS_MASK)
            if HAS_MASK:
                has_tokens = tl.max(keep.to(tl.int32), axis=0) > 0
            else:
                has_tokens = s0 < S
            if has_tokens:
                s_load = tl.minimum(s, S - 1)
                logits = _logit_tile(hidden_row_ptr, weight_ptr, s_load, v_load, H, stride_hs, stride_wv,
                                     BLOCK_S, BLOCK_V, BLOCK_H, EVEN_H, IEEE_FP32)  # fmt: skip
                d = _sum_dlogit(logits, bias, g, keep)  # [BLOCK_S, BLOCK_V]; 0 on rows that are not kept
                x = tl.load(hidden_row_ptr + s_load[:, None].to(tl.int64) * stride_hs + ho[None, :],
                            mask=ho_ok[None, :], other=0.0)  # [BLOCK_S, BLOCK_HO]  # fmt: skip
                if IEEE_FP32:
                    acc = tl.dot(tl.trans(d.to(x.dtype)), x, acc, input_precision="ieee")
                else:
                    acc = tl.dot(tl.trans(d.to(x.dtype)), x, acc)
                if NEED_BIAS:
                    bias_acc += tl.sum(d, axis=0)
    dst = grad_weight_ptr + v[:, None].to(tl.int64) * H + ho[None, :]
    tl.store(dst, acc.to(grad_weight_ptr.dtype.element_ty), mask=v_ok[:, None] & ho_ok[None, :])
    if NEED_BIAS:
        if ho_tile == 0:
            tl.store(grad_bias_ptr + v, bias_acc, mask=v_ok)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------


def _block_h() -> int:
    return 16 if _backend.INTERPRET else 64


def _ieee_fp32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _kernel_layout(hidden, weight, bias):
    """hidden/weight with unit last strides (other strides are passed to the kernels), bias contiguous; a copy
    only where the layout differs."""
    return (_unit_last_stride(hidden), _unit_last_stride(weight),
            bias.contiguous() if bias is not None else None)  # fmt: skip


def _mask_for_kernel(mask: torch.Tensor | None) -> torch.Tensor | None:
    # bool is read through a zero-copy uint8 view (one byte per element either way)
    return mask.view(torch.uint8) if mask is not None and mask.dtype == torch.bool else mask


def _tune_buckets(B: int, S: int) -> tuple[int, int]:
    return S.bit_length(), B.bit_length()  # autotune once per power-of-two size class, not per padded length


def _torch_reference_forward(hidden, weight, bias, mask, pooling, save_aux):
    compute = _backend.compute_dtype(hidden.dtype)
    h, w = hidden.to(compute), weight.to(compute)
    b = bias.to(compute) if bias is not None else None
    out = torch_splade_pool(h, w, b, mask, pooling).to(hidden.dtype)
    B, V = hidden.shape[0], weight.shape[0]
    if not (save_aux and pooling == "max"):
        return out, _no_aux(hidden, torch.int32), _no_aux(hidden, torch.float32)
    logits = h @ w.t()
    if mask is not None:
        logits = logits.masked_fill(mask.unsqueeze(-1) == 0, float("-inf"))
    if hidden.shape[1] == 0:
        top = torch.full((B, V), float("-inf"), dtype=compute, device=hidden.device)
        arg = torch.zeros(B, V, dtype=torch.int64, device=hidden.device)
    else:
        top, arg = torch.max(logits, dim=1)
    m = top + (b if b is not None else 0.0)
    slope = torch.where(m > 0, 1.0 / (1.0 + m.clamp_min(0)), torch.zeros_like(m))
    return out, arg.to(torch.int32), slope.float()


def _no_aux(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=like.device)


def _splade_forward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mask: torch.Tensor | None,
                    pooling: str, save_aux: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out [B, V] in hidden's dtype, argmax [B, V] int32, slope [B, V] fp32); argmax/slope are empty unless
    max pooling with save_aux."""
    B, S, H = hidden.shape
    V = weight.shape[0]
    keep_aux = save_aux and pooling == "max"
    if backend_for(hidden) is Backend.TORCH:
        _backend.warn_reference_once("splade_pool")
        return _torch_reference_forward(hidden, weight, bias, mask, pooling, save_aux)
    out = new_output((B, V), hidden.dtype, hidden.device)
    argmax = torch.empty((B, V) if keep_aux else (0,), dtype=torch.int32, device=hidden.device)
    slope = new_output((B, V) if keep_aux else (0,), torch.float32, hidden.device)
    if B == 0 or V == 0:
        return out, argmax, slope
    if S == 0:  # no position contributes: every score is 0 (and no gradient flows)
        out.zero_()
        argmax.zero_()
        slope.zero_()
        return out, argmax, slope
    hidden, weight, bias = _kernel_layout(hidden, weight, bias)
    kmask = _mask_for_kernel(mask)
    block_h = _block_h()
    group_b = max(1, min(B, _L2_BUDGET_BYTES // max(1, S * H * hidden.element_size())))
    s_bucket, b_bucket = _tune_buckets(B, S)
    grid = lambda meta: (B * triton.cdiv(V, meta["BLOCK_V"]),)  # noqa: E731
    splade_fwd_kernel[grid](
        hidden, weight, bias if bias is not None else out, kmask if kmask is not None else out, out,
        argmax if keep_aux else out, slope if keep_aux else out,
        B, S, V, H, hidden.stride(0), hidden.stride(1), weight.stride(0),
        kmask.stride(0) if kmask is not None else 0, kmask.stride(1) if kmask is not None else 0,
        group_b, s_bucket, b_bucket,
        BLOCK_H=block_h, POOL_MAX=pooling == "max", HAS_BIAS=bias is not None, HAS_MASK=kmask is not None,
        SAVE_AUX=keep_aux, EVEN_H=H % block_h == 0, IEEE_FP32=_ieee_fp32(hidden.dtype),
        NATIVE_NAN_MAX=not _backend.INTERPRET,
    )  # fmt: skip
    record_launch("splade_fwd_kernel")
    return out, argmax, slope


def _torch_reference_backward(grad, hidden, weight, bias, mask, pooling, need_hidden, need_weight, need_bias):
    """The backward in plain torch through dense [B, S, V] logits (explicit formulas: an op's implementation runs
    below autograd, so it cannot differentiate the reference)."""
    compute = _backend.compute_dtype(hidden.dtype)
    h, w, g = hidden.to(compute), weight.to(compute), grad.to(compute)
    logits = h @ w.t()
    if bias is not None:
        logits = logits + bias.to(compute)
    keep = (mask != 0).unsqueeze(-1) if mask is not None else torch.ones_like(logits, dtype=torch.bool)
    if pooling == "sum":
        dlogit = torch.where(keep & (logits > 0), g.unsqueeze(1) / (1 + logits.clamp_min(0)), 0.0)
    else:  # the whole gradient goes to the first maximal unmasked position
        top, first = torch.max(logits.masked_fill(~keep, float("-inf")), dim=1)
        slope = torch.where(top > 0, 1 / (1 + top.clamp_min(0)), 0.0)
        dlogit = torch.zeros_like(logits).scatter_(1, first.unsqueeze(1), (g * slope).unsqueeze(1))
    return ((dlogit @ w).to(hidden.dtype) if need_hidden else None,
            torch.einsum("bsv,bsh->vh", dlogit, h).to(weight.dtype) if need_weight else None,
            dlogit.sum(dim=(0, 1)).to(bias.dtype) if need_bias else None)  # fmt: skip


def _hidden_grad_pattern(dlogit: torch.Tensor, argmax: torch.Tensor, S: int) -> CSR:
    """CSR [B*S, V] of dlogit grouped by the row (b, argmax[b, v]) that produced each max, columns ascending.
    Built on the device without a host sync: a stable sort of the row keys (zero entries get the key B*S and sort
    past every row), then searchsorted for the row offsets. values/indices are sized B*V, the upper bound."""
    B, V = dlogit.shape
    n_rows = B * S
    key_dtype = torch.int32 if n_rows < 2**31 - 1 else torch.int64
    base = torch.arange(B, device=dlogit.device, dtype=key_dtype).mul_(S).unsqueeze(1)
    keys = torch.where(dlogit != 0, argmax.to(key_dtype) + base, n_rows).flatten()
    sorted_keys, order = torch.sort(keys, stable=True)
    rows = torch.arange(n_rows + 1, device=dlogit.device, dtype=key_dtype)
    row_offsets = torch.searchsorted(sorted_keys, rows)  # int64 [B*S + 1]
    return CSR(dlogit.flatten()[order], (order % V).to(torch.int32), row_offsets, V)


def _weight_grad_pattern(dlogit: torch.Tensor, argmax: torch.Tensor, S: int) -> ELL:
    """ELL [V, B*S]: row v holds dlogit[b, v] for every b with a non-zero gradient, pointing at hidden row
    b*S + argmax[b, v]. Width B is the largest possible count, so no row can overflow."""
    B, V = dlogit.shape
    by_batch = dense_to_ell(dlogit.t(), B)  # column index = b
    hidden_rows = argmax.t() + torch.arange(B, device=argmax.device, dtype=torch.int32).mul_(S).unsqueeze(0)
    indices = torch.gather(hidden_rows, 1, by_batch.indices.long()).to(torch.int32)
    return ELL(by_batch.values, indices, by_batch.counts, B * S)


def _splade_backward(grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     mask: torch.Tensor | None, argmax: torch.Tensor, slope: torch.Tensor, pooling: str,
                     need_hidden: bool, need_weight: bool, need_bias: bool):  # fmt: skip
    """(grad_hidden [B, S, H] | None, grad_weight [V, H] | None, grad_bias [V] | None)."""
    B, S, H = hidden.shape
    V = weight.shape[0]
    need_bias = need_bias and bias is not None
    if backend_for(hidden) is Backend.TORCH:
        _backend.warn_reference_once("splade_pool")
        return _torch_reference_backward(grad, hidden, weight, bias, mask, pooling, need_hidden, need_weight,
                                         need_bias)  # fmt: skip
    if B * S * V == 0 or not (need_hidden or need_weight or need_bias):
        return (hidden.new_zeros(hidden.shape) if need_hidden else None,
                weight.new_zeros(weight.shape) if need_weight else None,
                bias.new_zeros(bias.shape) if need_bias else None)  # fmt: skip
    if H == 0:  # logits = bias: only the bias has a gradient, and the kernels have no hidden dimension to tile
        return _torch_reference_backward(grad, hidden, weight, bias, mask, pooling, need_hidden, need_weight,
                                         need_bias)  # fmt: skip
    hidden, weight, bias = _kernel_layout(hidden, weight, bias)
    if pooling == "max":
        if argmax.numel() != B * V:  # the forward ran without saving them (e.g. the op was called directly)
            _, argmax, slope = _splade_forward(hidden, weight, bias, mask, pooling, True)
        dlogit = grad.float() * slope  # [B, V]; 0 where the max was <= 0 or the row fully masked
        grad_hidden = grad_weight = grad_bias = None
        if need_hidden:
            pattern = _hidden_grad_pattern(dlogit, argmax, S)
            grad_hidden = sparse_matmul(pattern, weight, out_dtype=hidden.dtype).view(B, S, H)
        if need_weight:
            pattern = _weight_grad_pattern(dlogit, argmax, S)
            grad_weight = sparse_matmul(pattern, hidden.reshape(B * S, H), out_dtype=weight.dtype)
        if need_bias:
            grad_bias = dlogit.sum(dim=0).to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias

    kmask = _mask_for_kernel(mask)
    block_h = _block_h()
    s_bucket, b_bucket = _tune_buckets(B, S)
    placeholder = grad
    common = dict(BLOCK_H=block_h, HAS_BIAS=bias is not None, HAS_MASK=kmask is not None, EVEN_H=H % block_h == 0,
                  IEEE_FP32=_ieee_fp32(hidden.dtype))  # fmt: skip
    strides = (grad.stride(0), grad.stride(1), hidden.stride(0), hidden.stride(1), weight.stride(0),
               kmask.stride(0) if kmask is not None else 0, kmask.stride(1) if kmask is not None else 0)  # fmt: skip
    inputs = (grad, hidden, weight, bias if bias is not None else placeholder,
              kmask if kmask is not None else placeholder)  # fmt: skip
    grad_hidden = grad_weight = grad_bias = None
    if need_hidden:
        grad_hidden = new_output((B, S, H), hidden.dtype, hidden.device)
        grid = lambda meta: (B * triton.cdiv(S, meta["BLOCK_S"]) * triton.cdiv(H, meta["BLOCK_HO"]),)  # noqa: E731
        splade_sum_bwd_hidden_kernel[grid](*inputs, grad_hidden, B, S, V, H, *strides, s_bucket, b_bucket, **common)
        record_launch("splade_sum_bwd_hidden_kernel")
    if need_weight or need_bias:
        grad_weight = new_output((V, H), weight.dtype, weight.device)
        grad_bias32 = new_output((V,), torch.float32, weight.device) if need_bias else grad_weight
        grid = lambda meta: (triton.cdiv(V, meta["BLOCK_V"]) * triton.cdiv(H, meta["BLOCK_HO"]),)  # noqa: E731
        splade_sum_bwd_weight_kernel[grid](*inputs, grad_weight, grad_bias32, B, S, V, H, *strides, s_bucket,
                                           b_bucket, NEED_BIAS=need_bias, **common)  # fmt: skip
        record_launch("splade_sum_bwd_weight_kernel")
        grad_bias = grad_bias32.to(bias.dtype) if need_bias else None
        grad_weight = grad_weight if need_weight else None
    return grad_hidden, grad_weight, grad_bias


# ----------------------------------------------------------------------------------------------------------------
# torch.library ops
# ----------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("sparsefuse::splade_pool", mutates_args=())
def splade_pool_op(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   attention_mask: torch.Tensor | None, pooling: str,
                   save_for_backward: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out [B, V], argmax [B, V] int32, slope [B, V] fp32); the last two are empty unless max pooling with
    save_for_backward (they are what the backward needs, computed by the same kernel)."""
    return _splade_forward(hidden, weight, bias, attention_mask, pooling, save_for_backward)


@splade_pool_op.register_fake
def _(hidden, weight, bias, attention_mask, pooling, save_for_backward):
    B, V = hidden.shape[0], weight.shape[0]
    aux_shape = (B, V) if save_for_backward and pooling == "max" else (0,)
    return (hidden.new_empty((B, V)), hidden.new_empty(aux_shape, dtype=torch.int32),
            hidden.new_empty(aux_shape, dtype=torch.float32))  # fmt: skip


@torch.library.custom_op("sparsefuse::splade_pool_backward", mutates_args=())
def splade_pool_backward_op(grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            attention_mask: torch.Tensor | None, argmax: torch.Tensor, slope: torch.Tensor,
                            pooling: str, need_hidden: bool, need_weight: bool,
                            need_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(grad_hidden, grad_weight, grad_bias); a gradient that was not asked for is an empty tensor."""
    gh, gw, gb = _splade_backward(grad, hidden, weight, bias, attention_mask, argmax, slope, pooling, need_hidden,
                                  need_weight, need_bias)  # fmt: skip
    return (gh if gh is not None else hidden.new_empty(0), gw if gw is not None else weight.new_empty(0),
            gb if gb is not None else hidden.new_empty(0))  # fmt: skip


@splade_pool_backward_op.register_fake
def _(grad, hidden, weight, bias, attention_mask, argmax, slope, pooling, need_hidden, need_weight, need_bias):
    need_bias = need_bias and bias is not None
    return (hidden.new_empty(hidden.shape if need_hidden else (0,)),
            weight.new_empty(weight.shape if need_weight else (0,)),
            bias.new_empty(bias.shape) if need_bias else hidden.new_empty(0))  # fmt: skip


def _splade_setup_context(ctx, inputs, output) -> None:
    hidden, weight, bias, attention_mask, pooling, _ = inputs
    _, argmax, slope = output
    ctx.pooling = pooling
    ctx.save_for_backward(hidden, weight, bias, attention_mask, argmax, slope)


def _splade_autograd_backward(ctx, grad_out, _grad_argmax, _grad_slope):
    hidden, weight, bias, attention_mask, argmax, slope = ctx.saved_tensors
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    need_bias = need_bias and bias is not None
    gh, gw, gb = splade_pool_backward_op(grad_out, hidden, weight, bias, attention_mask, argmax, slope, ctx.pooling,
                                         need_hidden, need_weight, need_bias)  # fmt: skip
    return (gh if need_hidden else None, gw if need_weight else None, gb if need_bias else None, None, None, None)


splade_pool_op.register_autograd(_splade_autograd_backward, setup_context=_splade_setup_context)


# ----------------------------------------------------------------------------------------------------------------
# Functional API
# ----------------------------------------------------------------------------------------------------------------


def _check_splade_args(op: str, hidden, weight, bias, attention_mask, pooling) -> None:
    check_float(op, "hidden", hidden, SPLADE_DTYPES)
    check_float(op, "weight", weight, SPLADE_DTYPES)
    if hidden.dim() != 3:
        raise ValueError(f"{op}: hidden must be [batch, seq_len, hidden_size]; got {describe(hidden)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(f"{op}: weight must be [vocab_size, hidden_size={hidden.shape[2]}] (the MLM decoder's "
                         f"weight) for hidden of {describe(hidden)}; got weight with {describe(weight)}")  # fmt: skip
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{op}: hidden and weight must have the same dtype (as for hidden @ weight.T); got hidden "
                        f"{describe(hidden)} and weight {describe(weight)}")  # fmt: skip
    tensors = {"hidden": hidden, "weight": weight}
    if bias is not None:
        check_float(op, "bias", bias, SPLADE_DTYPES + (torch.float64,))
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"{op}: bias must be [vocab_size={weight.shape[0]}]; got {describe(bias)}")
        tensors["bias"] = bias
    if attention_mask is not None:
        check_tensor(op, "attention_mask", attention_mask)
        if attention_mask.is_complex():
            raise TypeError(f"{op}: attention_mask must be bool, integer or floating; got {describe(attention_mask)}")
        if attention_mask.shape != hidden.shape[:2]:
            raise ValueError(f"{op}: attention_mask must be [batch, seq_len] = {list(hidden.shape[:2])} to match "
                             f"hidden of {describe(hidden)}; got {describe(attention_mask)}")  # fmt: skip
        tensors["attention_mask"] = attention_mask
    check_same_device(op, **tensors)
    if pooling not in POOLINGS:
        raise ValueError(f"{op}: pooling must be one of {POOLINGS}; got {pooling!r}")


def splade_pool(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, *, pooling: str = "max") -> torch.Tensor:  # fmt: skip
    """SPLADE term weights ``pool_s log1p(relu(hidden @ weight.T + bias)) * mask`` without materialising the
    [batch, seq_len, vocab] logits (see :mod:`sparsefuse.splade.head`).

    Args:
        hidden: [B, S, H] hidden states entering the MLM decoder (after the MLM head's transform), float32,
            float16 or bfloat16.
        weight: [V, H] the decoder's weight (usually tied to the word embeddings), same dtype as hidden.
        bias: [V] the decoder's bias, or None.
        attention_mask: [B, S] (bool, integer or float; non-zero keeps a position), or None for all positions.
        pooling: "max" (SPLADE v2+, the default) or "sum" (SPLADE v1).

    Returns:
        [B, V] in hidden's dtype. Equal to naver/splade's and sentence-transformers' ``SpladePooling``: masked
        positions contribute 0, so an all-negative column and a fully masked row score 0. Differentiable in hidden,
        weight and bias (max pooling: the gradient reaches the first maximal position only, as with torch.max).
        Under autocast, hidden and weight are cast to the autocast dtype (as ``F.linear`` would be).
    """
    op = "splade_pool"
    check_tensor(op, "hidden", hidden)
    check_tensor(op, "weight", weight)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type) and hidden.is_floating_point() and weight.is_floating_point():
        autocast_dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(autocast_dtype), weight.to(autocast_dtype)
    _check_splade_args(op, hidden, weight, bias, attention_mask, pooling)
    tensors = [t for t in (hidden, weight, bias, attention_mask) if t is not None]
    if _backend.bypass_dispatcher(*tensors):
        return _splade_forward(hidden, weight, bias, attention_mask, pooling, False)[0]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (hidden, weight, bias) if t is not None)
    return splade_pool_op(hidden, weight, bias, attention_mask, pooling, needs_grad)[0]
