"""The SPLADE head's sum-pooling backward kernels (the forward is :mod:`.kernels`).

Backward, sum pooling: every kept position gets a gradient, ``dlogit[b, s, v] = grad[b, v] * mask[b, s] / (1 + x)``
for ``x = logits > 0``. Two kernels recompute the logits tile by tile (never storing [B, S, V]): one owns
(b, sequence tile, hidden slice) and accumulates ``dlogit @ weight``; one owns (vocabulary tile, hidden slice) and
accumulates ``dlogit^T @ hidden`` over every (b, sequence tile), plus the bias gradient, in a fixed order (no
atomics: deterministic). Cost: a register accumulator holds only a BLOCK_HO slice of H, so each kernel recomputes
the logits H / BLOCK_HO times -- several forward matmuls in all; max pooling (SPLADE v2+) is the path built for
speed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..._jit import kernel
from ..._triton.dot import dot_accumulate
from .kernels import _kept_positions

__all__ = ["splade_sum_bwd_hidden_kernel", "splade_sum_bwd_weight_kernel"]


@triton.jit
def _logit_tile(
    hidden_row_ptr,
    weight_ptr,
    s_load,
    v_load,
    H,
    stride_hs,
    stride_wv,
    BLOCK_S: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVEN_H: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
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
        acc = dot_accumulate(acc, x, w, IEEE_FP32)
        x_ptrs += BLOCK_H
        w_ptrs += BLOCK_H
    return acc


@triton.jit
def _sum_dlogit(acc, bias, g, keep, weight):
    """[BLOCK_S, BLOCK_V] fp32: d/dlogit of sum-pooled weight * log1p(relu(logit)) times the incoming gradient g
    [BLOCK_V]."""
    logits = acc + bias[None, :]
    return tl.where(keep[:, None] & (logits > 0), g[None, :] * weight[:, None] / (1.0 + logits), 0.0)


@kernel
def splade_sum_bwd_hidden_kernel(
    grad_ptr,
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    mask_ptr,
    grad_hidden_ptr,
    B,
    S,
    V,
    H,
    stride_gb,
    stride_gv,
    stride_hb,
    stride_hs,
    stride_wv,
    stride_mb,
    stride_ms,
    s_bucket,
    b_bucket,
    BLOCK_S: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    EVEN_H: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    # grad [B, V] (any strides); grad_hidden [B, S, H] contiguous. A program owns (b, sequence tile, hidden slice
    # of BLOCK_HO) and sweeps the vocabulary: recompute the logit tile, form dlogit, accumulate dlogit @ weight.
    # s_bucket and b_bucket are read only by the autotuner (its keys, see launch.py).
    pid = tl.program_id(0)
    n_s_tiles = tl.cdiv(S, BLOCK_S)
    n_h_tiles = tl.cdiv(H, BLOCK_HO)
    b = pid // (n_s_tiles * n_h_tiles)
    s = (pid // n_h_tiles) % n_s_tiles * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S]
    ho = pid % n_h_tiles * BLOCK_HO + tl.arange(0, BLOCK_HO)  # [BLOCK_HO]
    ho_ok = ho < H
    keep, weight = _kept_positions(mask_ptr, b, s, S, stride_mb, stride_ms, HAS_MASK)
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
            logits = _logit_tile(
                hidden_row_ptr,
                weight_ptr,
                s_load,
                v_load,
                H,
                stride_hs,
                stride_wv,
                BLOCK_S,
                BLOCK_V,
                BLOCK_H,
                EVEN_H,
                IEEE_FP32,
            )
            if HAS_BIAS:
                bias = tl.load(bias_ptr + v_load).to(tl.float32)
            else:
                bias = tl.zeros([BLOCK_V], dtype=tl.float32)
            g = tl.load(grad_ptr + b.to(tl.int64) * stride_gb + v.to(tl.int64) * stride_gv, mask=v_ok, other=0.0).to(
                tl.float32
            )  # [BLOCK_V]; 0 past V
            d = _sum_dlogit(logits, bias, g, keep, weight)  # [BLOCK_S, BLOCK_V]
            w = tl.load(
                weight_ptr + v_load[:, None].to(tl.int64) * stride_wv + ho[None, :], mask=ho_ok[None, :], other=0.0
            )  # [BLOCK_V, BLOCK_HO]
            acc = dot_accumulate(acc, d.to(w.dtype), w, IEEE_FP32)
    dst = grad_hidden_ptr + (b.to(tl.int64) * S + s[:, None]) * H + ho[None, :]
    tl.store(dst, acc.to(grad_hidden_ptr.dtype.element_ty), mask=(s < S)[:, None] & ho_ok[None, :])


@kernel
def splade_sum_bwd_weight_kernel(
    grad_ptr,
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    mask_ptr,
    grad_weight_ptr,
    grad_bias_ptr,
    B,
    S,
    V,
    H,
    stride_gb,
    stride_gv,
    stride_hb,
    stride_hs,
    stride_wv,
    stride_mb,
    stride_ms,
    s_bucket,
    b_bucket,
    BLOCK_S: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    NEED_BIAS: tl.constexpr,
    EVEN_H: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
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
        g = tl.load(grad_ptr + b * stride_gb + v.to(tl.int64) * stride_gv, mask=v_ok, other=0.0).to(tl.float32)
        for s0 in range(0, S, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            keep, weight = _kept_positions(mask_ptr, b, s, S, stride_mb, stride_ms, HAS_MASK)
            if HAS_MASK:
                has_tokens = tl.max(keep.to(tl.int32), axis=0) > 0
            else:
                has_tokens = s0 < S
            if has_tokens:
                s_load = tl.minimum(s, S - 1)
                logits = _logit_tile(
                    hidden_row_ptr,
                    weight_ptr,
                    s_load,
                    v_load,
                    H,
                    stride_hs,
                    stride_wv,
                    BLOCK_S,
                    BLOCK_V,
                    BLOCK_H,
                    EVEN_H,
                    IEEE_FP32,
                )
                d = _sum_dlogit(logits, bias, g, keep, weight)  # [BLOCK_S, BLOCK_V]; 0 on rows not kept
                x = tl.load(
                    hidden_row_ptr + s_load[:, None].to(tl.int64) * stride_hs + ho[None, :],
                    mask=keep[:, None] & ho_ok[None, :],
                    other=0.0,
                )  # [BLOCK_S, BLOCK_HO]; 0 on rows not kept, whose NaN would survive d's zeros (0 * NaN)
                acc = dot_accumulate(acc, tl.trans(d.to(x.dtype)), x, IEEE_FP32)
                if NEED_BIAS:
                    bias_acc += tl.sum(d, axis=0)
    dst = grad_weight_ptr + v[:, None].to(tl.int64) * H + ho[None, :]
    tl.store(dst, acc.to(grad_weight_ptr.dtype.element_ty), mask=v_ok[:, None] & ho_ok[None, :])
    if NEED_BIAS:
        if ho_tile == 0:
            tl.store(grad_bias_ptr + v, bias_acc, mask=v_ok)
