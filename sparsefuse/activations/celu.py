"""CELU with scale and input_scale, out-of-place and in-place, forward and backward.

    z = x * input_scale
    y = scale * (z                          if z > 0
                 alpha * expm1(z / alpha)   otherwise)

With scale = input_scale = 1 this is ``torch.nn.functional.celu``. Math runs in float32 (float64 for float64
inputs); expm1 is evaluated accurately near zero (a plain ``exp(w) - 1`` loses all relative precision there).

Cost model: forward reads x and writes y (2E bytes per element of E bytes), in-place the same bytes without the
second allocation; backward reads grad_y and the saved *output* y and writes grad_x (3E). The derivative is
recovered from the output, so an in-place forward keeps working under autograd:
    z > 0  <=>  y * scale > 0   (for any alpha != 0)
    dy/dx = scale * input_scale                     where z > 0
          = input_scale * (y / alpha + scale)        elsewhere  (= scale * input_scale * exp(z / alpha))
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _backend
from .._backend import STREAMING_WARPS, Backend, backend_for, new_output_like, record_launch, streaming_block
from ._sfu import sfu_exp2_ftz
from .._validation import check_float, check_scalar, describe

CELU_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# ----------------------------------------------------------------------------------------------------------------
# Reference (ground truth; float64-capable)
# ----------------------------------------------------------------------------------------------------------------


def torch_celu(x: torch.Tensor, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0) -> torch.Tensor:
    z = x * input_scale
    return scale * torch.where(z > 0, z, alpha * torch.expm1(z / alpha))


def torch_celu_backward(
    grad_y: torch.Tensor, x: torch.Tensor, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0
) -> torch.Tensor:
    z = x * input_scale
    return grad_y * scale * input_scale * torch.where(z > 0, torch.ones_like(z), torch.exp(z / alpha))


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------


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


@triton.jit
def celu_fwd_kernel(x_ptr, y_ptr, n_elements, alpha, scale, input_scale, BLOCK: tl.constexpr,
                    SERIES_DEGREE: tl.constexpr):  # fmt: skip
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


@triton.jit
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


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------


_INTERPRET_BLOCK = 256


def _launch(kernel, n: int, *args, **constexprs) -> None:
    """Launch a flat CELU kernel over n elements with the shared streaming rule (see _backend.streaming_block)."""
    element = args[0]
    block = streaming_block(n, element.element_size(), element.device, _INTERPRET_BLOCK)
    kernel[(triton.cdiv(n, block),)](*args, BLOCK=block, num_warps=STREAMING_WARPS, **constexprs)


def _dense(t: torch.Tensor) -> bool:
    """True if t's elements exactly fill their memory span (a permutation of a contiguous tensor). An elementwise
    kernel then runs over the storage as a flat array, and ``empty_like`` gives the output the same strides."""
    if t.is_contiguous():
        return True
    expected = 1
    dims = [(n, s) for n, s in zip(t.shape, t.stride()) if n != 1]
    for size, stride in sorted(dims, key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _output_like(t: torch.Tensor) -> torch.Tensor:
    """Output layout shared by the op and its fake: t's strides when dense, else contiguous."""
    return new_output_like(t) if _dense(t) else new_output_like(t.contiguous())


def _celu_into(x: torch.Tensor, out: torch.Tensor, alpha: float, scale: float, input_scale: float) -> None:
    """Writes celu(x) into out; both dense with identical strides (out may be x)."""
    n = x.numel()
    if n == 0:
        return
    if backend_for(x) is Backend.TORCH:
        _backend.warn_reference_once("celu")
        compute = _backend.compute_dtype(x.dtype)
        out.copy_(torch_celu(x.to(compute), alpha, scale, input_scale))
        return
    series_degree = 4 if x.element_size() == 2 else 8  # a half-precision output keeps ~11 bits (see _expm1)
    _launch(celu_fwd_kernel, n, x, out, n, alpha, scale, input_scale, SERIES_DEGREE=series_degree)
    record_launch("celu_fwd_kernel")


def _celu_forward(x: torch.Tensor, alpha: float, scale: float, input_scale: float) -> torch.Tensor:
    if not _dense(x):
        x = x.contiguous()  # sliced/overlapping layouts: one copy, then the flat kernel
    y = _output_like(x)
    _celu_into(x, y, alpha, scale, input_scale)
    return y


def _celu_backward(grad_y: torch.Tensor, y: torch.Tensor, alpha: float, scale: float, input_scale: float):
    if not _dense(y):
        y = y.contiguous()
    grad_y = _match_strides(grad_y, y)
    grad_x = _output_like(y)
    n = y.numel()
    if n == 0:
        return grad_x
    if backend_for(y) is Backend.TORCH:
        _backend.warn_reference_once("celu")
        compute = _backend.compute_dtype(y.dtype)
        g, yy = grad_y.to(compute), y.to(compute)
        slope = torch.where(yy * scale > 0, scale * input_scale, input_scale * (yy / alpha + scale))
        grad_x.copy_(g * slope)
        return grad_x
    _launch(celu_bwd_kernel, n, grad_y, y, grad_x, n, alpha, scale, input_scale)
    record_launch("celu_bwd_kernel")
    return grad_x


def _match_strides(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """t laid out with like's strides (a no-op when they already match)."""
    if t.stride() == like.stride():
        return t
    out = torch.empty_like(like, dtype=t.dtype)
    out.copy_(t)
    return out


# ----------------------------------------------------------------------------------------------------------------
# torch.library ops
# ----------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("sparsefuse::celu", mutates_args=())
def celu_op(x: torch.Tensor, alpha: float, scale: float, input_scale: float) -> torch.Tensor:
    return _celu_forward(x, alpha, scale, input_scale)


@celu_op.register_fake
def _(x, alpha, scale, input_scale):
    return torch.empty_like(x) if _dense(x) else torch.empty_like(x, memory_format=torch.contiguous_format)


def _celu_inplace(x: torch.Tensor, alpha: float, scale: float, input_scale: float) -> None:
    if _dense(x):
        _celu_into(x, x, alpha, scale, input_scale)
    else:
        x.copy_(_celu_forward(x, alpha, scale, input_scale))


@torch.library.custom_op("sparsefuse::celu_", mutates_args=("x",))
def celu_inplace_op(x: torch.Tensor, alpha: float, scale: float, input_scale: float) -> None:
    _celu_inplace(x, alpha, scale, input_scale)


@celu_inplace_op.register_fake
def _(x, alpha, scale, input_scale) -> None:
    return None


@torch.library.custom_op("sparsefuse::celu_backward", mutates_args=())
def celu_backward_op(grad_y: torch.Tensor, y: torch.Tensor, alpha: float, scale: float, input_scale: float) -> torch.Tensor:
    return _celu_backward(grad_y, y, alpha, scale, input_scale)


@celu_backward_op.register_fake
def _(grad_y, y, alpha, scale, input_scale):
    return torch.empty_like(y) if _dense(y) else torch.empty_like(y, memory_format=torch.contiguous_format)


def _celu_setup_context(ctx, inputs, output) -> None:
    _, ctx.alpha, ctx.scale, ctx.input_scale = inputs
    ctx.save_for_backward(output)  # the derivative is recovered from y (see module docstring)


def _celu_autograd_backward(ctx, grad_y):
    (y,) = ctx.saved_tensors
    return celu_backward_op(grad_y, y, ctx.alpha, ctx.scale, ctx.input_scale), None, None, None


celu_op.register_autograd(_celu_autograd_backward, setup_context=_celu_setup_context)


# ----------------------------------------------------------------------------------------------------------------
# Functional API
# ----------------------------------------------------------------------------------------------------------------


def _check_celu_args(op: str, x: torch.Tensor, alpha: float, scale: float, input_scale: float):
    check_float(op, "x", x, CELU_DTYPES)
    alpha, scale, input_scale = (check_scalar(op, n, v) for n, v in
                                 (("alpha", alpha), ("scale", scale), ("input_scale", input_scale)))  # fmt: skip
    if alpha == 0.0:
        raise ValueError(f"{op}: alpha must be non-zero (CELU divides by alpha); got alpha=0 for x with {describe(x)}")
    return alpha, scale, input_scale


def celu(x: torch.Tensor, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0) -> torch.Tensor:
    """``scale * where(z > 0, z, alpha * (exp(z / alpha) - 1))`` with ``z = x * input_scale``.

    Args:
        x: any shape; float32, float16, bfloat16 (or float64). The output has x's shape, dtype and (for dense x)
            strides. With ``scale == input_scale == 1`` this equals ``torch.nn.functional.celu(x, alpha)``.
        alpha: non-zero (``ValueError`` otherwise).

    Differentiable in x (the backward reads the output, not the input).
    """
    alpha, scale, input_scale = _check_celu_args("celu", x, alpha, scale, input_scale)
    if _backend.bypass_dispatcher(x):
        return _celu_forward(x, alpha, scale, input_scale)
    return celu_op(x, alpha, scale, input_scale)


def celu_(x: torch.Tensor, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0) -> torch.Tensor:
    """In-place :func:`celu`; returns x.

    Without autograd (inference, ``torch.no_grad``, or x not requiring grad) the kernel overwrites x with no extra
    allocation. Under autograd the rules are PyTorch's: a leaf that requires grad raises ``RuntimeError``; for any
    other tensor the result is computed out of place and copied into x (one extra buffer), so gradients flow.
    """
    alpha, scale, input_scale = _check_celu_args("celu_", x, alpha, scale, input_scale)
    if torch.is_grad_enabled() and x.requires_grad:
        if x.is_leaf:
            raise RuntimeError(
                "celu_: a leaf Variable that requires grad is being used in an in-place operation; "
                "use sparsefuse.celu (out of place) or run under torch.no_grad()"
            )
        return x.copy_(celu_op(x, alpha, scale, input_scale))
    if _backend.bypass_dispatcher(x):
        _celu_inplace(x, alpha, scale, input_scale)
    else:
        celu_inplace_op(x, alpha, scale, input_scale)
    return x
