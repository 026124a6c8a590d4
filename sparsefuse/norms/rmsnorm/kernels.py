"""RMSNorm's Triton kernels: a forward that reads each row once and writes it once (and 4 bytes of 1/rms), and a
backward that reads x and dy once, writes dx once, and leaves each program's share of the weight gradient in a
[programs, D] float32 buffer (summed afterwards: no atomics, so the result does not depend on scheduling).

Rows up to ``BLOCK_D`` elements are held in registers (``SINGLE``); longer rows are walked twice in chunks (sum of
squares, then the outputs), the second pass reading the row again from L2."""

from __future__ import annotations

import triton
import triton.language as tl

from ..._jit import kernel


@triton.jit
def _rounded(v, dtype: tl.constexpr):
    """v (float32, or float64 for float64 data) rounded to ``dtype``'s precision and kept in v's type: the value
    LlamaRMSNorm multiplies the weight by. bfloat16 is rounded to nearest-even on the bits, because Triton's
    interpreter truncates float32 -> bfloat16 casts (the GPU rounds them to nearest-even); NaN passes unchanged."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
    else:
        return v.to(dtype).to(v.dtype)


@kernel
def rms_norm_fwd_kernel(
    x_ptr,  # [M, D], rows at stride_x
    w_ptr,  # [D] (unused without HAS_WEIGHT)
    y_ptr,  # [M, D], rows at stride_y
    rstd_ptr,  # [M] float32 (float64 for float64 x)
    M,
    D,
    stride_x,
    stride_y,
    eps,
    HAS_WEIGHT: tl.constexpr,
    SINGLE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    compute = rstd_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    row_mask = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x  # [BM, 1]
    y_rows = y_ptr + rows.to(tl.int64)[:, None] * stride_y
    d = tl.arange(0, BLOCK_D)
    if SINGLE:
        mask = row_mask[:, None] & (d < D)[None, :]
        x = tl.load(x_rows + d[None, :], mask=mask, other=0.0).to(compute)  # [BM, BD]
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)  # [BM]
    else:
        squares = tl.zeros([BLOCK_M], dtype=compute)
        for d0 in range(0, D, BLOCK_D):
            mask = row_mask[:, None] & (d0 + d < D)[None, :]
            xc = tl.load(x_rows + d0 + d[None, :], mask=mask, other=0.0).to(compute)
            squares += tl.sum(xc * xc, axis=1)
        rstd = 1.0 / tl.sqrt(squares / D + eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + d
        mask = row_mask[:, None] & (cols < D)[None, :]
        if not SINGLE:
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(compute)
        # rounded to x's dtype before the weight multiplies it, as LlamaRMSNorm does
        y = _rounded(x * rstd[:, None], x_ptr.dtype.element_ty)
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(compute)[None, :]
        tl.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@kernel
def rms_norm_bwd_kernel(
    dy_ptr,  # [M, D], rows at stride_dy
    x_ptr,  # [M, D], rows at stride_x
    w_ptr,  # [D] (unused without HAS_WEIGHT)
    rstd_ptr,  # [M]
    dx_ptr,  # [M, D], rows at stride_dx
    dw_ptr,  # [programs, D] float32 partial weight gradients (unused without HAS_WEIGHT)
    M,
    D,
    stride_dy,
    stride_x,
    stride_dx,
    HAS_WEIGHT: tl.constexpr,
    SINGLE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # dx = rstd * (g - n * mean(g * n)) with n = x * rstd, g = dy * w; dw = sum over rows of dy * round(n).
    # Program p takes row blocks p, p + programs, ...: its weight-gradient share stays in registers (SINGLE) or in
    # its own row of dw (longer rows), so no two programs write the same address.
    compute = rstd_ptr.dtype.element_ty
    pid, programs = tl.program_id(0), tl.num_programs(0)
    d = tl.arange(0, BLOCK_D)
    dw_row = dw_ptr + pid.to(tl.int64) * D
    if SINGLE:
        d_mask = d < D
        if HAS_WEIGHT:
            w = tl.load(w_ptr + d, mask=d_mask, other=0.0).to(compute)
        dw = tl.zeros([BLOCK_D], dtype=compute)
    for block in range(pid, tl.cdiv(M, BLOCK_M), programs):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        r64 = rows.to(tl.int64)[:, None]
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)  # [BM]
        if SINGLE:
            mask = row_mask[:, None] & d_mask[None, :]
            x = tl.load(x_ptr + r64 * stride_x + d[None, :], mask=mask, other=0.0).to(compute)
            dy = tl.load(dy_ptr + r64 * stride_dy + d[None, :], mask=mask, other=0.0).to(compute)
            n = x * rstd[:, None]
            g = dy * w[None, :] if HAS_WEIGHT else dy
            if HAS_WEIGHT:
                dw += tl.sum(dy * _rounded(n, x_ptr.dtype.element_ty), axis=0)
            mean_gn = tl.sum(g * n, axis=1) / D
            dx = (g - n * mean_gn[:, None]) * rstd[:, None]
            tl.store(dx_ptr + r64 * stride_dx + d[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        else:
            gn = tl.zeros([BLOCK_M], dtype=compute)
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + d
                mask = row_mask[:, None] & (cols < D)[None, :]
                x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(compute)
                g = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(compute)
                if HAS_WEIGHT:
                    g = g * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(compute)[None, :]
                gn += tl.sum(g * x, axis=1)
            mean_gn = gn * rstd / D
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + d
                mask = row_mask[:, None] & (cols < D)[None, :]
                x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(compute)
                dy = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(compute)
                n = x * rstd[:, None]
                g = dy
                if HAS_WEIGHT:
                    g = dy * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(compute)[None, :]
                    share = tl.sum(dy * _rounded(n, x_ptr.dtype.element_ty), axis=0)
                    tl.store(dw_row + cols, tl.load(dw_row + cols, mask=cols < D) + share, mask=cols < D)
                dx = (g - n * mean_gn[:, None]) * rstd[:, None]
                tl.store(dx_ptr + r64 * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if SINGLE and HAS_WEIGHT:
        tl.store(dw_row + d, dw, mask=d_mask)
