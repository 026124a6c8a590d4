"""Fused SPLADE head: the masked LM's vocabulary logits pooled over the sequence, without the logits in memory.

    logits[b, s, v] = hidden[b, s, :] . weight[v, :] + bias[v]          hidden [B, S, H], weight [V, H] (tied decoder)
    max:  out[b, v] = max_s log1p(relu(logits[b, s, v])) * mask[b, s]    (SPLADE v2+, naver/splade, SpladePooling)
    sum:  out[b, v] = sum_s log1p(relu(logits[b, s, v])) * mask[b, s]    (SPLADE v1)

Masked positions contribute 0 -- so a column whose unmasked logits are all negative scores 0, and a fully masked
row is all zeros. The mask is an attention mask: any non-zero value keeps the position.

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
together, so each weight tile is read from DRAM about once per group. Two schedules: one tile per program (fully
masked padding tiles then skip their matmul), or persistent (one program per SM) with the tile loop flattened into
the K loop (``tl.range(flatten=True)``) so the software pipeline keeps loading across tiles; padding tiles are then
computed and masked. Loads are pointer loads, or on Hopper TMA loads through ``tl.make_tensor_descriptor`` (which
needs ``triton.set_allocator``: set only before a TMA launch and only when no allocator is set yet, to one that
allocates with torch on the current device and stream, so it works under CUDA graph capture).

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

Tuning: the forward uses a fixed rule (``_fwd_config``), no autotuning. Measured by scripts/probe_splade_fwd.py on an
H200 (Triton 3.6, torch 2.11), bf16 max pooling at B=32, S=256, H=768, V=30522, inference / with SAVE_AUX:

* previous kernel (a program per (b, vocabulary tile) walking the sequence; autotuned, picked 128x128 w4 s3):
  875 / 990 us;
* TMA + persistent, BLOCK_M x BLOCK_N x BLOCK_K = 128x256x64, 8 warps, 3 stages: 628 us (88% of the measured
  matmul rate) / 778 us;
* the same without TMA (pointer loads): 702 / 831 us;
* one tile per program, pointer loads, 128x128x64, 4 warps, 3 stages: 655 / 729 us (best with SAVE_AUX).

At B=64, S=512: previous 3442 / 3753 us, TMA + persistent 128x256 2433 / 3038 us; at V=250002: 7410 / 8179 us
vs 5505 / 6429 us. Hence the rule: on Hopper (capability 9.x), 16-bit inputs whose layout TMA accepts (16-byte
aligned bases and row strides, hidden's rows equally spaced), inference (sum pooling too, which saves nothing;
not measured) runs TMA + persistent 128x256x64 w8 s3; with SAVE_AUX, and for 16-bit inputs elsewhere, one tile per
program with pointer loads, 128x128x64 w4 s3 (2 stages where a block gets < 128 KiB of shared memory). BLOCK_M is
64 when S <= 64 (short queries). fp32 uses 64x128x32 w4 s3 with pointer loads. The S <= 64, fp32 and
non-Hopper choices are reasonable defaults, not measurements. Under the interpreter the same rule runs with
16x32x16 tiles (and 4 persistent programs), so the CPU tests cover both the TMA + persistent and the pointer-load
paths.

Precision: fp32/fp16/bf16 inputs (hidden and weight of one dtype; bias any float dtype); logits accumulate in fp32,
``log1p`` is evaluated accurately near 0, the output is rounded once to the input dtype. fp32 products use exact
fp32 (``input_precision="ieee"``) unless ``torch.set_float32_matmul_precision`` allows TF32, as for torch.matmul.
NaN logits propagate to the output (the argmax stored for a NaN column is unspecified).
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import torch
import triton
import triton.language as tl

from .. import _backend
from .._backend import Backend, backend_for, new_output, record_launch, tuning_configs
from .._validation import FLOAT_DTYPES, check_float, check_same_device, check_tensor, describe
from .._triton.dot import dot_accumulate, ieee_fp32
from .._triton.schedule import grouped_tile_coords
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
        acc = dot_accumulate(acc, x, w, IEEE_FP32)
        x_ptrs += BLOCK_H
        w_ptrs += BLOCK_H
    return acc


@triton.jit
def _kept_positions(mask_ptr, b, s, S, stride_mb, stride_ms, HAS_MASK: tl.constexpr):
    """[BLOCK_S] bool: in range and not masked out."""
    keep = s < S
    if HAS_MASK:
        m = tl.load(mask_ptr + b.to(tl.int64) * stride_mb + s.to(tl.int64) * stride_ms, mask=keep, other=0)
        keep = keep & (m != 0)
    return keep


@triton.jit
def _finish_columns(value, best_s, b, v, v_ok, V, bias_ptr, out_ptr, argmax_ptr, slope_ptr, POOL_MAX: tl.constexpr,
                    HAS_BIAS: tl.constexpr, SAVE_AUX: tl.constexpr):  # fmt: skip
    """Writes out[b, v] (and argmax/slope) from the pooled value of a [BLOCK_N] column block of batch row b: for max
    pooling the masked max raw logit (no bias yet; -inf when every position is masked), for sum pooling the sum."""
    offsets = b.to(tl.int64) * V + v
    if POOL_MAX:
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


@triton.jit
def splade_fwd_kernel(hidden_ptr, weight_ptr, bias_ptr, mask_ptr, out_ptr, argmax_ptr, slope_ptr, part_ptr,
                      part_arg_ptr, B, S, V, stride_hb, stride_hs, stride_wv, stride_mb, stride_ms, n_s_tiles, group_m,
                      H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      POOL_MAX: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, SAVE_AUX: tl.constexpr,
                      SINGLE_PASS: tl.constexpr, PERSISTENT: tl.constexpr, USE_TMA: tl.constexpr,
                      IEEE_FP32: tl.constexpr, NATIVE_NAN_MAX: tl.constexpr):  # fmt: skip
    # A GEMM over hidden viewed as [B*S, H] times weight^T [H, V] whose M tiles never cross a batch row: M tile
    # pid_m = b * n_s_tiles + j holds positions s = j*BLOCK_M ... j*BLOCK_M + BLOCK_M - 1 of batch row b (s >= S and
    # masked positions are excluded by `keep`). hidden [B, S, H], weight [V, H] (unit last strides), bias [V],
    # mask [B, S] (any int/float dtype); out [B, V] (hidden's dtype); SAVE_AUX: argmax [B, V] int32, slope fp32.
    # SINGLE_PASS (n_s_tiles == 1): each tile finishes its columns. Otherwise each tile writes the partials
    # part [B * n_s_tiles, V] fp32 (column max of the raw logits, or column sum of the scores) and part_arg (the
    # first position of the max) for splade_fwd_combine_kernel. A program walks tiles pid, pid + #programs, ...:
    # PERSISTENT grids have one program per SM and flatten that loop with the K loop (the pipeline keeps loading
    # across tiles); otherwise there is one tile per program and fully masked (padding) tiles skip their matmul.
    K_TILES: tl.constexpr = (H + BLOCK_K - 1) // BLOCK_K
    EVEN_K: tl.constexpr = H % BLOCK_K == 0
    num_pid_m = B * n_s_tiles
    num_pid_n = tl.cdiv(V, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    if USE_TMA:  # hidden rows are equally spaced ([B*S, H] view); rows past S read the next batch row, masked below
        hidden_desc = tl.make_tensor_descriptor(hidden_ptr, shape=[B * S, H], strides=[stride_hs, 1],
                                                block_shape=[BLOCK_M, BLOCK_K])  # fmt: skip
        weight_desc = tl.make_tensor_descriptor(weight_ptr, shape=[V, H], strides=[stride_wv, 1],
                                                block_shape=[BLOCK_N, BLOCK_K])  # fmt: skip
    for tile_id in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=PERSISTENT):
        # hidden rows that fit in L2 together sweep the vocabulary tiles side by side
        pid_m, pid_n = grouped_tile_coords(tile_id, num_pid_m, num_pid_n, group_m)
        b = pid_m // n_s_tiles
        s0 = (pid_m % n_s_tiles) * BLOCK_M
        s = s0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        v = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        v_ok = v < V
        v_load = tl.minimum(v, V - 1)
        keep = _kept_positions(mask_ptr, b, s, S, stride_mb, stride_ms, HAS_MASK)  # [BLOCK_M]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        run = True
        if HAS_MASK and not PERSISTENT:  # (a branch inside the flattened loop nest would stop the flattening)
            run = tl.max(keep.to(tl.int32), axis=0) > 0
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
                x_ptrs = (hidden_ptr + b.to(tl.int64) * stride_hb + s_load[:, None].to(tl.int64) * stride_hs
                          + k[None, :])  # [BLOCK_M, BLOCK_K]  # fmt: skip
                w_ptrs = weight_ptr + v_load[None, :].to(tl.int64) * stride_wv + k[:, None]  # [BLOCK_K, BLOCK_N]
                for ki in range(K_TILES):
                    if EVEN_K:
                        x = tl.load(x_ptrs + ki * BLOCK_K)
                        w = tl.load(w_ptrs + ki * BLOCK_K)
                    else:
                        x = tl.load(x_ptrs + ki * BLOCK_K, mask=(ki * BLOCK_K + k)[None, :] < H, other=0.0)
                        w = tl.load(w_ptrs + ki * BLOCK_K, mask=(ki * BLOCK_K + k)[:, None] < H, other=0.0)
                    acc = dot_accumulate(acc, x, w, IEEE_FP32)
        if POOL_MAX:  # over the raw logits: the bias and log1p(relu(.)) commute with the max (module docstring)
            logits = tl.where(keep[:, None], acc, float("-inf"))  # [BLOCK_M, BLOCK_N]
            value = _column_max(logits, NATIVE_NAN_MAX)  # [BLOCK_N]
            if SAVE_AUX:  # first position equal to the max (ties: first, like torch.max); NaN column: clamped
                best_s = tl.min(tl.where(logits == value[None, :], s[:, None], 2147483647), axis=0)
                best_s = tl.minimum(best_s, S - 1)
            else:
                best_s = tl.zeros([BLOCK_N], dtype=tl.int32)
        else:
            if HAS_BIAS:
                bias = tl.load(bias_ptr + v_load).to(tl.float32)  # [BLOCK_N]
            else:
                bias = tl.zeros([BLOCK_N], dtype=tl.float32)
            scores = _log1p_nonneg(tl.maximum(acc + bias[None, :], 0.0, propagate_nan=tl.PropagateNan.ALL))
            value = tl.sum(tl.where(keep[:, None], scores, 0.0), axis=0)  # [BLOCK_N]
            best_s = tl.zeros([BLOCK_N], dtype=tl.int32)
        if SINGLE_PASS:
            _finish_columns(value, best_s, b, v, v_ok, V, bias_ptr, out_ptr, argmax_ptr, slope_ptr, POOL_MAX,
                            HAS_BIAS, SAVE_AUX)  # fmt: skip
        else:
            part_offsets = pid_m.to(tl.int64) * V + v
            tl.store(part_ptr + part_offsets, value, mask=v_ok)
            if SAVE_AUX:
                tl.store(part_arg_ptr + part_offsets, best_s, mask=v_ok)


@triton.jit
def splade_fwd_combine_kernel(part_ptr, part_arg_ptr, bias_ptr, out_ptr, argmax_ptr, slope_ptr, V, n_s_tiles,
                              BLOCK_V: tl.constexpr, POOL_MAX: tl.constexpr, HAS_BIAS: tl.constexpr,
                              SAVE_AUX: tl.constexpr):  # fmt: skip
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
    for j in range(0, n_s_tiles):
        offsets = (b.to(tl.int64) * n_s_tiles + j) * V + v
        x = tl.load(part_ptr + offsets, mask=v_ok, other=0.0)
        if POOL_MAX:
            # strictly greater: on ties the earlier tile keeps the max (first position); NaN sticks
            better = (x > value) | ((x != x) & (value == value))
            value = tl.where(better, x, value)
            if SAVE_AUX:
                best_s = tl.where(better, tl.load(part_arg_ptr + offsets, mask=v_ok, other=0), best_s)
        else:
            value += x
    _finish_columns(value, best_s, b, v, v_ok, V, bias_ptr, out_ptr, argmax_ptr, slope_ptr, POOL_MAX, HAS_BIAS,
                    SAVE_AUX)  # fmt: skip


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
            acc = dot_accumulate(acc, d.to(w.dtype), w, IEEE_FP32)
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
                acc = dot_accumulate(acc, tl.trans(d.to(x.dtype)), x, IEEE_FP32)
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


@dataclasses.dataclass(frozen=True)
class _FwdConfig:
    """Tile shape and schedule of splade_fwd_kernel (chosen by :func:`_fwd_config`)."""

    block_m: int  # sequence positions of one batch row per tile
    block_n: int  # vocabulary columns per tile
    block_k: int  # hidden (reduction) slice per step
    num_warps: int
    num_stages: int
    persistent: bool = False  # one program per SM, the tile loop flattened with the K loop
    tma: bool = False  # tensor-descriptor (TMA) loads instead of pointer loads


_TMA_API = hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")
_INTERPRET_PROGRAMS = 4  # "SMs" of a persistent grid under the interpreter (several tiles per program)


@functools.lru_cache(maxsize=None)
def _device_info(index: int) -> tuple[int, int, int]:
    """(compute capability major, SM count, opt-in shared memory per block in bytes) of a CUDA device."""
    p = torch.cuda.get_device_properties(index)
    smem = getattr(p, "shared_memory_per_block_optin", 0)
    if not smem:  # older torch: the datacenter parts have >= 164 KiB, the others ~100 KiB
        smem = 164 << 10 if p.major in (9, 10) or (p.major, p.minor) == (8, 0) else 99 << 10
    return p.major, p.multi_processor_count, smem


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _tma_eligible(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """TMA loads are possible for this call: Triton has device-side tensor descriptors, the GPU is a Hopper (or the
    interpreter runs), the inputs are 16-bit, the bases and row strides are 16-byte aligned, and hidden's rows are
    equally spaced so that it can be described as one [B*S, H] matrix."""
    if not _TMA_API or hidden.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not _backend.INTERPRET and not (hidden.is_cuda and _device_info(_cuda_index(hidden.device))[0] == 9):
        return False
    B, S, H = hidden.shape
    size = hidden.element_size()
    return (H * size >= 16 and B * S < 2**31 and hidden.stride(2) == 1 and weight.stride(1) == 1
            and (B == 1 or hidden.stride(0) == S * hidden.stride(1))
            and all(x % 16 == 0 for x in (hidden.data_ptr(), weight.data_ptr(), hidden.stride(1) * size,
                                          weight.stride(0) * size)))  # fmt: skip


def _fwd_config(hidden: torch.Tensor, weight: torch.Tensor, save_aux: bool) -> _FwdConfig:
    """The forward's config rule (module docstring, "Tuning"). Under the interpreter the same rule with small tiles,
    so the CPU tests run the TMA + persistent kernel for inference and the pointer-load kernel with SAVE_AUX."""
    tma = not save_aux and _tma_eligible(hidden, weight)
    if _backend.INTERPRET:
        return _FwdConfig(16, 32, 16, num_warps=4, num_stages=1, persistent=tma, tma=tma)
    block_m = 64 if hidden.shape[1] <= 64 else 128  # short sequences (queries): half the masked rows
    if tma:  # measured best for inference on an H200
        return _FwdConfig(block_m, 256, 64, num_warps=8, num_stages=3, persistent=True, tma=True)
    if hidden.dtype == torch.float32:
        return _FwdConfig(64, 128, 32, num_warps=4, num_stages=3)
    big_smem = _device_info(_cuda_index(hidden.device))[2] >= 128 << 10
    return _FwdConfig(block_m, 128, 64, num_warps=4, num_stages=3 if big_smem else 2)  # measured best with SAVE_AUX


def _torch_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Triton's global scratch (device-side tensor descriptors) from torch's caching allocator, on the current
    device and stream, i.e. where Triton launches. Stream-ordered like any temporary, and under CUDA graph capture
    it comes from the graph's private pool, so captured launches replay with a valid buffer."""
    del stream  # torch.empty allocates on the current stream, the one Triton launches on
    buffer = torch.empty(size + alignment, dtype=torch.int8, device=torch.device("cuda", torch.cuda.current_device()))
    start = -buffer.data_ptr() % alignment  # 0 in practice: torch's blocks are 512-byte aligned
    return buffer[start:start + size]


_allocator_fallback = threading.local()


def _ensure_tma_allocator() -> None:
    """Installs :func:`_torch_scratch` with ``triton.set_allocator`` unless an allocator is already set. Called
    only before TMA launches. Triton keeps the allocator in a ContextVar, so this sets it once per thread/context
    and never replaces one that the application installed."""
    try:
        from triton.runtime import _allocation

        current = _allocation._allocator
        current = current.get() if hasattr(current, "get") else current  # ContextVar, or a module global (older)
        missing = isinstance(current, _allocation.NullAllocator)
    except (ImportError, AttributeError):  # private layout changed: set ours once per thread
        missing = not getattr(_allocator_fallback, "done", False)
        _allocator_fallback.done = True
    if missing:
        triton.set_allocator(_torch_scratch)


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
    cfg = _fwd_config(hidden, weight, keep_aux)
    n_s_tiles = triton.cdiv(S, cfg.block_m)
    single_pass = n_s_tiles == 1
    num_tiles = B * n_s_tiles * triton.cdiv(V, cfg.block_n)
    if cfg.persistent:
        n_sms = _INTERPRET_PROGRAMS if _backend.INTERPRET else _device_info(_cuda_index(hidden.device))[1]
        grid = (min(num_tiles, n_sms),)
    else:
        grid = (num_tiles,)
    if cfg.tma and hidden.is_cuda:
        _ensure_tma_allocator()
    # M tiles whose hidden rows fit in L2 together sweep the vocabulary side by side
    group_m = max(1, min(B * n_s_tiles, _L2_BUDGET_BYTES // (cfg.block_m * max(H, 1) * hidden.element_size())))
    part = part_arg = out  # placeholders (never read or written)
    if not single_pass:
        part = torch.empty((B * n_s_tiles, V), dtype=torch.float32, device=hidden.device)
        if keep_aux:
            part_arg = torch.empty((B * n_s_tiles, V), dtype=torch.int32, device=hidden.device)
    bias_arg = bias if bias is not None else out
    argmax_arg, slope_arg = (argmax, slope) if keep_aux else (out, out)
    splade_fwd_kernel[grid](
        hidden, weight, bias_arg, kmask if kmask is not None else out, out, argmax_arg, slope_arg, part, part_arg,
        B, S, V, hidden.stride(0), hidden.stride(1), weight.stride(0),
        kmask.stride(0) if kmask is not None else 0, kmask.stride(1) if kmask is not None else 0, n_s_tiles, group_m,
        H=H, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, POOL_MAX=pooling == "max",
        HAS_BIAS=bias is not None, HAS_MASK=kmask is not None, SAVE_AUX=keep_aux, SINGLE_PASS=single_pass,
        PERSISTENT=cfg.persistent, USE_TMA=cfg.tma, IEEE_FP32=ieee_fp32(hidden.dtype),
        NATIVE_NAN_MAX=not _backend.INTERPRET, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    record_launch("splade_fwd_kernel")
    if not single_pass:
        block_v = 128 if _backend.INTERPRET else 1024
        splade_fwd_combine_kernel[(B * triton.cdiv(V, block_v),)](
            part, part_arg, bias_arg, out, argmax_arg, slope_arg, V, n_s_tiles,
            BLOCK_V=block_v, POOL_MAX=pooling == "max", HAS_BIAS=bias is not None, SAVE_AUX=keep_aux, num_warps=4,
        )  # fmt: skip
        record_launch("splade_fwd_combine_kernel")
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
                  IEEE_FP32=ieee_fp32(hidden.dtype))  # fmt: skip
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
