"""Rotary position embedding's Triton kernels: one program per token (b, s) rotates every head of q and then of k,
loading that token's cos and sin once. The forward and backward are the same rotation with different sine terms
(``BACKWARD``), each one launch of :func:`rotary_kernel` for both tensors.

All tensors arrive as 4-D [B, heads, S, hd] strided tensors (the launcher passes the strides of that view), cos and
sin as [B, S, hd] with stride 0 over a broadcast dim, so a transposed view of a [B, S, H, hd] tensor is read and
written in its storage order, with no copy.

The head counts are constexprs: the loop over head blocks is unrolled, so a program issues the loads of all its
heads before it waits on any (a runtime loop waits once per block; unrolled measured 2-11% faster on an H200). That
compiles once per model (its H, H_kv and hd), as a constexpr hd already does.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._jit import kernel


@triton.jit
def _rotate_heads(
    x_ptr,
    y_ptr,
    stride_xh,
    stride_xd,
    stride_yh,
    stride_yd,
    c1,
    c2,
    a1,
    a2,
    COMPUTE: tl.constexpr,
    N_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    # x, y: [N_HEADS, 2 * HALF] of one token (the pointers are at the token's first element)
    # y1 = x1 * c1 + x2 * a1,  y2 = x2 * c2 + x1 * a2  with c1, c2, a1, a2: [1, HALF_PAD]
    # The two halves are loaded separately, so rotate_half needs no shuffle between registers.
    dims = tl.arange(0, HALF_PAD).to(tl.int64)  # int64: a stride may be large (hd outermost, say)
    dim_mask = dims < HALF
    for h0 in tl.static_range(0, N_HEADS, BLOCK_H):
        heads = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)  # int64: head strides reach S * hd (tensors > 2^31)
        mask = (heads < N_HEADS)[:, None] & dim_mask[None, :]  # [BLOCK_H, HALF_PAD]
        x_off = heads[:, None] * stride_xh + dims[None, :] * stride_xd
        y_off = heads[:, None] * stride_yh + dims[None, :] * stride_yd
        x1 = tl.load(x_ptr + x_off, mask=mask).to(COMPUTE)
        x2 = tl.load(x_ptr + x_off + HALF * stride_xd, mask=mask).to(COMPUTE)
        # fp32 (fp64) math and one rounding at the store; transformers rounds after each of its three operations
        y1 = x1 * c1 + x2 * a1
        y2 = x2 * c2 + x1 * a2
        tl.store(y_ptr + y_off, y1.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_ptr + y_off + HALF * stride_yd, y2.to(y_ptr.dtype.element_ty), mask=mask)


@kernel
def rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    S,
    stride_qb,
    stride_qh,
    stride_qs,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_qob,
    stride_qoh,
    stride_qos,
    stride_qod,
    stride_kob,
    stride_koh,
    stride_kos,
    stride_kod,
    stride_cb,
    stride_cs,
    stride_cd,
    stride_sb,
    stride_ss,
    stride_sd,
    BACKWARD: tl.constexpr,
    FP64: tl.constexpr,
    H: tl.constexpr,
    H_KV: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    # q, q_out: [B, H, S, 2 * HALF]; k, k_out: [B, H_KV, S, 2 * HALF]; cos, sin: [B, S, 2 * HALF] (any strides);
    # grid (B * S,). Forward: q_out, k_out = x * cos + rotate_half(x) * sin. BACKWARD: q, k hold the gradients g of
    # the outputs, and q_out, k_out get g * cos + rotate_half^T(g * sin).
    # HALF is a constexpr: the second half's address is then known to be as aligned as the first (vector loads
    # for hd = 80, say), and for a power-of-two hd the dim mask folds away.
    COMPUTE: tl.constexpr = tl.float64 if FP64 else tl.float32
    token = tl.program_id(0).to(tl.int64)  # int64: every offset below is built from it
    b = token // S
    s = token - b * S
    dims = tl.arange(0, HALF_PAD).to(tl.int64)
    dim_mask = dims < HALF
    cos_row = cos_ptr + b * stride_cb + s * stride_cs + dims * stride_cd
    sin_row = sin_ptr + b * stride_sb + s * stride_ss + dims * stride_sd
    # the halves of cos (and of sin) are equal in practice, but nothing here assumes it
    c1 = tl.load(cos_row, mask=dim_mask).to(COMPUTE)[None, :]  # [1, HALF_PAD]
    c2 = tl.load(cos_row + HALF * stride_cd, mask=dim_mask).to(COMPUTE)[None, :]
    s1 = tl.load(sin_row, mask=dim_mask).to(COMPUTE)[None, :]
    s2 = tl.load(sin_row + HALF * stride_sd, mask=dim_mask).to(COMPUTE)[None, :]
    if BACKWARD:  # d/dx of (x * cos + rotate_half(x) * sin) applied to g: g * cos + cat(g2 * s2, -g1 * s1)
        a1 = s2
        a2 = -s1
    else:  # x * cos + cat(-x2, x1) * sin
        a1 = -s1
        a2 = s2
    q_off = b * stride_qb + s * stride_qs
    q_out_off = b * stride_qob + s * stride_qos
    _rotate_heads(
        q_ptr + q_off,
        q_out_ptr + q_out_off,
        stride_qh,
        stride_qd,
        stride_qoh,
        stride_qod,
        c1,
        c2,
        a1,
        a2,
        COMPUTE,
        H,
        HALF,
        BLOCK_HQ,
        HALF_PAD,
    )
    k_off = b * stride_kb + s * stride_ks
    k_out_off = b * stride_kob + s * stride_kos
    _rotate_heads(
        k_ptr + k_off,
        k_out_ptr + k_out_off,
        stride_kh,
        stride_kd,
        stride_koh,
        stride_kod,
        c1,
        c2,
        a1,
        a2,
        COMPUTE,
        H_KV,
        HALF,
        BLOCK_HK,
        HALF_PAD,
    )
