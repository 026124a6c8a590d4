"""CELU's Triton kernels: flat elementwise forward (out-of-place or in place) and a backward that reads the
forward's output rather than its input (see :mod:`.launch`)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..._jit import kernel
from ..._triton.sfu import sfu_exp2_ftz


@triton.jit
def _expm1(w, SERIES_DEGREE: tl.constexpr):
    # exp(w) - 1 cancels catastrophically for |w| << 1; there a Taylor series is used. To w^8 it is exact to < 1 ulp
    # of float32 (|w| < 0.25: truncation 0.25^9 / 9! < 1e-10); to w^4 it is within 3.3e-5 relative (0.25^4 / 5!), 7x
    # below half an fp16 ulp, which is all a half-precision output keeps (4 fewer FMAs an element).
    w2 = w * w
    if SERIES_DEGREE == 8:
        p = 2.4801587301587302e-05
        p = p * w + 1.9841269841269841e-04
        p = p * w + 1.3888888888888889e-03
        p = p * w + 8.3333333333333332e-03
        p = p * w + 4.1666666666666664e-02
    else:
        p = 4.1666666666666664e-02
    p = p * w + 1.6666666666666666e-01
    p = p * w + 0.5
    series = w + w2 * p
    if w.dtype == tl.float64:
        e = tl.exp(w)
    else:  # the hardware exp2 without tl.exp's denormal guards (3 compares and 5 multiplies an element): a flushed
        e = sfu_exp2_ftz(w * 1.4426950408889634)  # denormal is invisible to exp(w) - 1 (-1 + 1e-38 rounds to -1)
    return tl.where(tl.abs(w) < 0.25, series, e - 1.0)


@triton.jit
def _block(pid, n_elements, BLOCK: tl.constexpr):
    start = pid.to(tl.int64) * BLOCK  # int64: tensors above 2^31 elements
    offsets = tl.arange(0, BLOCK)  # [BLOCK], relative to start
    return start, offsets, offsets < n_elements - start


@kernel
def celu_fwd_kernel(
    x_ptr, y_ptr, n_elements, alpha, scale, input_scale, BLOCK: tl.constexpr, SERIES_DEGREE: tl.constexpr
):
    # x, y: flat [n_elements] (y may alias x for the in-place op)
    start, offsets, mask = _block(tl.program_id(0), n_elements, BLOCK)
    compute_dtype = tl.float64 if x_ptr.dtype.element_ty == tl.float64 else tl.float32
    x = tl.load(x_ptr + start + offsets, mask=mask).to(compute_dtype)
    # Scalars arrive as fp32 kernel arguments; x's compute dtype sets the precision of the math. The scalar products
    # are formed once per program, so an element costs two multiplies before expm1 (no per-element division).
    input_scale, alpha = tl.cast(input_scale, compute_dtype), tl.cast(alpha, compute_dtype)
    w = x * (input_scale / alpha)  # z / alpha
    y = tl.where(x * input_scale > 0, x * (scale * input_scale), _expm1(w, SERIES_DEGREE) * (scale * alpha))
    tl.store(y_ptr + start + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@kernel
def celu_bwd_kernel(grad_y_ptr, y_ptr, grad_x_ptr, n_elements, alpha, scale, input_scale, BLOCK: tl.constexpr):
    # grad_y, y (the forward's output), grad_x: flat [n_elements]
    start, offsets, mask = _block(tl.program_id(0), n_elements, BLOCK)
    compute_dtype = tl.float64 if y_ptr.dtype.element_ty == tl.float64 else tl.float32
    g = tl.load(grad_y_ptr + start + offsets, mask=mask).to(compute_dtype)
    y = tl.load(y_ptr + start + offsets, mask=mask).to(compute_dtype)
    input_scale, alpha = tl.cast(input_scale, compute_dtype), tl.cast(alpha, compute_dtype)
    slope_positive = scale * input_scale
    # input_scale * (y / alpha + scale) as one FMA with per-program scalars
    slope_negative = y * (input_scale / alpha) + slope_positive
    slope = tl.where(y * scale > 0, slope_positive, slope_negative)
    tl.store(grad_x_ptr + start + offsets, (g * slope).to(grad_x_ptr.dtype.element_ty), mask=mask)
