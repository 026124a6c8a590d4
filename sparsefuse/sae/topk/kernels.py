"""The TopK encode kernel: pre-activation tiles merged into a running top-k of sort keys per token."""

from __future__ import annotations

import triton
import triton.language as tl

from ..._jit import kernel
from .._encoder_tile import encoder_pre_tile

# Sort keys: below every real key (real ones are >= the key of -inf, about -0.996 * 2**63); slot j of an empty
# buffer holds EMPTY_KEY + j so that the slots stay distinct.
EMPTY_KEY = tl.constexpr(-(2**63) + 2**24)


@triton.jit
def _sort_keys(pre, cols):
    # pre [BLOCK_M, BLOCK_N] fp32, cols [BLOCK_N] -> int64 keys (the mapping of keys._pack_keys)
    bits = tl.where(pre == 0, 0, pre.to(tl.int32, bitcast=True))
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    ordered = tl.where(pre != pre, 0x7FC00000, ordered)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)[None, :]


@kernel
def topk_encode_fwd_kernel(
    x_ptr,
    w_ptr,
    b_enc_ptr,
    scale_ptr,
    keys_ptr,
    M,
    K,
    N,
    k,
    cols_per_group,
    n_candidates,
    stride_xm,
    stride_wk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_PAD: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    # x [M, K] (x - b_dec), w [K, N] (unit column strides), b_enc/scale [N];
    # out: keys [M, n_candidates], this program's k best keys at columns [group * k, group * k + k)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_mask = rows < M
    group = tl.program_id(1)
    col_start = group * cols_per_group
    col_end = tl.minimum(col_start + cols_per_group, N)
    slots = tl.arange(0, K_PAD)
    real_slot = slots < k  # [K_PAD]; slots >= k are padding, kept out of every minimum
    best_keys = tl.zeros([BLOCK_M, K_PAD], dtype=tl.int64) + (slots.to(tl.int64) + EMPTY_KEY)[None, :]
    kth = tl.min(tl.where(real_slot[None, :], best_keys, 0x7FFFFFFFFFFFFFFF), axis=1)  # [BLOCK_M] k-th best key
    for n0 in range(col_start, col_end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        col_mask = cols < col_end
        pre = encoder_pre_tile(
            x_ptr,
            w_ptr,
            b_enc_ptr,
            rows,
            cols,
            row_mask,
            col_mask,
            K,
            stride_xm,
            stride_wk,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            IEEE_FP32,
        )  # [BLOCK_M, BLOCK_N]
        if HAS_SCALE:
            pre = pre * tl.load(scale_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        keys = tl.where(row_mask[:, None] & col_mask[None, :], _sort_keys(pre, cols), EMPTY_KEY)
        # Insert the tile's entries that beat the k-th best, largest first (each replaces the current k-th); the
        # busiest token sets the pass count. Entries still to insert are those in (kth, last inserted).
        passes = tl.max(tl.minimum(tl.sum((keys > kth[:, None]).to(tl.int32), axis=1), k))
        below = tl.full([BLOCK_M], 0x7FFFFFFFFFFFFFFF, dtype=tl.int64)  # last key inserted per token
        for _ in range(passes):
            candidate = (keys > kth[:, None]) & (keys < below[:, None])  # [BLOCK_M, BLOCK_N]
            top = tl.max(tl.where(candidate, keys, EMPTY_KEY), axis=1)  # [BLOCK_M]
            replace = (best_keys == kth[:, None]) & (top > kth)[:, None] & real_slot[None, :]
            best_keys = tl.where(replace, top[:, None], best_keys)
            kth = tl.min(tl.where(real_slot[None, :], best_keys, 0x7FFFFFFFFFFFFFFF), axis=1)
            below = top
    dst = rows[:, None].to(tl.int64) * n_candidates + group * k + slots[None, :]
    tl.store(keys_ptr + dst, best_keys, mask=row_mask[:, None] & real_slot[None, :])
