"""Snake1d activation (DAC / SNAC audio codecs), forward and backward in one pass each.

    y = x + 1 / (alpha + eps) * sin(alpha * x) ** 2          x [B, C, T], alpha [C] (one per channel)

Cost model (per element, E = bytes of x's dtype): forward reads x and writes y (2E bytes), backward reads grad_y and
x and writes grad_x (3E bytes); alpha and its per-program partial sums are O(B*C*T/BLOCK_T) bytes. Arithmetic is
~20 flops per element, far below the machine balance, so both passes are memory-bound and the ceiling is the
device-to-device copy bandwidth.

Layout: each program owns one (batch*channel row, time block) tile, so a channel's alpha is one scalar load per
program and no per-element integer division is needed. Programs are enumerated on a 1-D grid (row-major over
(row, time block)) so that neither grid axis limit (65535 on y/z) can be hit for any B*C.

Alpha's gradient is a reduction over batch and time. The backward kernel writes one fp32 partial sum per program
while it computes grad_x (no second pass over x), and a deterministic torch sum over a [B, C, n_time_blocks]
buffer (1/BLOCK_T of the input's size) finishes it: no float atomics, so results are bitwise reproducible.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _backend
from .._backend import Backend, backend_for, new_output, record_launch, tuning_configs
from .._validation import check_float, check_same_device, check_scalar, check_tensor, describe

SNAKE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# ----------------------------------------------------------------------------------------------------------------
# Reference (ground truth; float64-capable; exactly the DAC/SNAC expression)
# ----------------------------------------------------------------------------------------------------------------


def torch_snake(x: torch.Tensor, alpha: torch.Tensor, eps: float = 1e-9) -> torch.Tensor:
    """Plain-torch Snake: ``x + (alpha + eps).reciprocal() * sin(alpha * x) ** 2`` in x's dtype.

    x [B, C, *] or [C, T]; alpha [C] or [1, C, 1]."""
    rows = _canonical_shape(x.shape)
    x3 = x.reshape(rows)
    a = alpha.reshape(1, -1, 1)
    return (x3 + (a + eps).reciprocal() * torch.sin(a * x3).pow(2)).reshape(x.shape)


def torch_snake_backward(
    grad_y: torch.Tensor, x: torch.Tensor, alpha: torch.Tensor, eps: float = 1e-9
) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form gradients of ``torch_snake`` w.r.t. x (x's shape) and alpha ([C]), in the inputs' dtype."""
    rows = _canonical_shape(x.shape)
    x3, g3 = x.reshape(rows), grad_y.reshape(rows)
    a = alpha.reshape(1, -1, 1)
    inv = (a + eps).reciprocal()
    s, c = torch.sin(a * x3), torch.cos(a * x3)
    sin2 = 2 * s * c
    grad_x = g3 * (1 + a * inv * sin2)
    grad_alpha = (g3 * (x3 * inv * sin2 - s * s * inv * inv)).sum(dim=(0, 2))
    return grad_x.reshape(x.shape), grad_alpha


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------

# sin(u)^2 and sin(2u) only need u modulo pi: with u = k*pi + r, sin(u) = ±sin(r) and cos(u) = ±cos(r) with the same
# sign, so sin(u)^2 = sin(r)^2 and sin(u)cos(u) = sin(r)cos(r). Cody-Waite split of pi: PI_HI has 8 significant bits,
# so k * PI_HI is exact for |k| < 2^16 (|u| < ~2e5).
_INV_PI = tl.constexpr(0.3183098861837907)
_PI_HI = tl.constexpr(3.140625)
_PI_LO = tl.constexpr(9.676535897932795e-04)


@triton.jit
def _reduce_mod_pi(u):
    k = tl.floor(u * _INV_PI + 0.5)
    r = u - k * _PI_HI
    return r - k * _PI_LO


@triton.jit
def _poly_sin(r):
    # Taylor series to r^11 on |r| <= pi/2 (truncation < 6e-8, about one fp32 ulp of 1).
    r2 = r * r
    p = -2.5052108385441720e-08
    p = p * r2 + 2.7557319223985893e-06
    p = p * r2 - 1.9841269841269841e-04
    p = p * r2 + 8.3333333333333332e-03
    p = p * r2 - 1.6666666666666666e-01
    return r + r * r2 * p


@triton.jit
def _poly_cos(r):
    # Taylor series to r^12 on |r| <= pi/2 (truncation < 7e-9).
    r2 = r * r
    p = 2.0876756987868100e-09
    p = p * r2 - 2.7557319223985888e-07
    p = p * r2 + 2.4801587301587302e-05
    p = p * r2 - 1.3888888888888889e-03
    p = p * r2 + 4.1666666666666664e-02
    p = p * r2 - 0.5
    return 1.0 + r2 * p


@triton.jit
def _snake_sin(u, FAST_SIN: tl.constexpr):
    if FAST_SIN:
        return _poly_sin(_reduce_mod_pi(u))
    else:
        return tl.sin(u)


@triton.jit
def _row_tile(pid, n_channels, T, BLOCK_T: tl.constexpr, WIDE_INDEX: tl.constexpr):
    """Decode a 1-D program id into (batch, channel, row, time offsets [BLOCK_T], mask [BLOCK_T])."""
    n_time_blocks = tl.cdiv(T, BLOCK_T)
    row = pid // n_time_blocks  # = b * C + c
    time_block = pid - row * n_time_blocks
    t = time_block * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    if WIDE_INDEX:
        t = t.to(tl.int64)
    return row // n_channels, row % n_channels, row, t, t < T


@triton.autotune(
    configs=tuning_configs(
        [
            triton.Config({"BLOCK_T": 256}, num_warps=2),
            triton.Config({"BLOCK_T": 512}, num_warps=4),
            triton.Config({"BLOCK_T": 1024}, num_warps=4),
            triton.Config({"BLOCK_T": 2048}, num_warps=4),
            triton.Config({"BLOCK_T": 2048}, num_warps=8),
            triton.Config({"BLOCK_T": 4096}, num_warps=8),
        ],
        interpret_config=triton.Config({"BLOCK_T": 64}),
    ),
    key=["tune_key"],
    prune_configs_by={"early_config_prune": lambda configs, nargs, **kw: _prune_by_length(configs, nargs)},
)
@triton.jit(do_not_specialize=["tune_key"])
def snake_fwd_kernel(
    x_ptr,
    alpha_ptr,
    y_ptr,
    n_channels,
    T,
    stride_xb,
    stride_xc,
    eps,
    tune_key,
    BLOCK_T: tl.constexpr,
    FAST_SIN: tl.constexpr,
    WIDE_INDEX: tl.constexpr,
):
    # x [B, C, T] with unit time stride (rows may be strided); y [B, C, T] contiguous; alpha [C]
    b, c, row, t, mask = _row_tile(tl.program_id(0), n_channels, T, BLOCK_T, WIDE_INDEX)
    compute_dtype = tl.float64 if x_ptr.dtype.element_ty == tl.float64 else tl.float32
    alpha = tl.load(alpha_ptr + c).to(compute_dtype)
    inv_alpha = 1.0 / (alpha + eps)
    x_row = x_ptr + b.to(tl.int64) * stride_xb + c.to(tl.int64) * stride_xc
    x = tl.load(x_row + t, mask=mask, other=0.0).to(compute_dtype)  # [BLOCK_T]
    s = _snake_sin(alpha * x, FAST_SIN)
    y = x + inv_alpha * (s * s)
    tl.store(y_ptr + row.to(tl.int64) * T + t, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.autotune(
    configs=tuning_configs(
        [triton.Config({}, num_warps=w) for w in (2, 4, 8)],
        interpret_config=triton.Config({}),
    ),
    key=["tune_key"],
)
@triton.jit(do_not_specialize=["tune_key"])
def snake_bwd_kernel(
    grad_y_ptr,
    x_ptr,
    alpha_ptr,
    grad_x_ptr,
    alpha_partial_ptr,
    n_channels,
    T,
    stride_gb,
    stride_gc,
    stride_xb,
    stride_xc,
    eps,
    tune_key,
    BLOCK_T: tl.constexpr,
    FAST_SIN: tl.constexpr,
    WIDE_INDEX: tl.constexpr,
    NEED_ALPHA_GRAD: tl.constexpr,
):
    # grad_y, x [B, C, T] unit time stride; grad_x [B, C, T] contiguous; alpha_partial [B*C*n_time_blocks] fp32/64
    pid = tl.program_id(0)
    b, c, row, t, mask = _row_tile(pid, n_channels, T, BLOCK_T, WIDE_INDEX)
    compute_dtype = tl.float64 if x_ptr.dtype.element_ty == tl.float64 else tl.float32
    alpha = tl.load(alpha_ptr + c).to(compute_dtype)
    inv_alpha = 1.0 / (alpha + eps)
    b64, c64 = b.to(tl.int64), c.to(tl.int64)
    x = tl.load(x_ptr + b64 * stride_xb + c64 * stride_xc + t, mask=mask, other=0.0).to(compute_dtype)
    g = tl.load(grad_y_ptr + b64 * stride_gb + c64 * stride_gc + t, mask=mask, other=0.0).to(compute_dtype)
    u = alpha * x
    if FAST_SIN:
        r = _reduce_mod_pi(u)
        s = _poly_sin(r)
        sin_2u = 2.0 * s * _poly_cos(r)
    else:
        s = tl.sin(u)
        sin_2u = 2.0 * s * tl.cos(u)
    grad_x = g * (1.0 + alpha * inv_alpha * sin_2u)
    tl.store(grad_x_ptr + row.to(tl.int64) * T + t, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)
    if NEED_ALPHA_GRAD:
        d_alpha = g * (x * inv_alpha * sin_2u - (s * s) * (inv_alpha * inv_alpha))
        tl.store(alpha_partial_ptr + pid, tl.sum(tl.where(mask, d_alpha, 0.0), axis=0))


def _prune_by_length(configs: list[triton.Config], nargs: dict) -> list[triton.Config]:
    # Blocks much longer than a row only add masked lanes.
    longest_useful = max(256, triton.next_power_of_2(int(nargs["T"])))
    kept = [cfg for cfg in configs if cfg.kwargs.get("BLOCK_T", 0) <= longest_useful]
    return kept or configs[:1]


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------

_INT32_LIMIT = 2**31 - 1


def _canonical_shape(shape: torch.Size) -> tuple[int, int, int]:
    """[B, C, *] -> (B, C, prod(*)); [C, T] -> (1, C, T)."""
    if len(shape) == 2:
        return (1, shape[0], shape[1])
    if len(shape) < 2:
        raise ValueError(f"snake: x must have shape [C, T] or [B, C, *]; got shape {list(shape)}")
    t = 1
    for d in shape[2:]:
        t *= d
    return (shape[0], shape[1], t)


def _unit_time_stride(t: torch.Tensor) -> torch.Tensor:
    """A [B, C, T] view with time stride 1. Strided rows are read in place; a tensor whose time axis is strided is
    copied once (one extra read + write of the tensor), because reading it in place would waste most of every
    memory transaction."""
    return t if t.stride(2) == 1 or t.shape[2] <= 1 else t.contiguous()


def _tune_key(n_rows: int, T: int) -> int:
    # Autotune once per (length, rows) power-of-two bucket, not once per distinct audio length.
    return (T.bit_length() << 8) | n_rows.bit_length()


def _wide_index(*tensors: torch.Tensor) -> bool:
    # Per-element time offsets use int32 unless a row (or its stride) can exceed int32; row bases are always int64.
    return any(t.shape[2] * max(t.stride(2), 1) + 8192 > _INT32_LIMIT for t in tensors)


def _backward_block(T: int) -> int:
    # Fixed (not autotuned) so that the alpha partial-sum buffer's layout does not depend on the tuned config.
    return 64 if _backend.INTERPRET else min(2048, max(256, triton.next_power_of_2(T)))


def _snake_forward(x: torch.Tensor, alpha: torch.Tensor, eps: float, fast_sin: bool) -> torch.Tensor:
    B, C, T = x.shape
    y = new_output((B, C, T), x.dtype, x.device)
    if y.numel() == 0:
        return y
    backend = backend_for(x)
    if backend is Backend.TORCH:
        _backend.warn_reference_once("snake")
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        return torch_snake(x.to(compute), alpha.to(compute), eps).to(x.dtype)
    x = _unit_time_stride(x)
    grid = lambda meta: (B * C * triton.cdiv(T, meta["BLOCK_T"]),)  # noqa: E731
    snake_fwd_kernel[grid](
        x, alpha, y, C, T, x.stride(0), x.stride(1), eps, _tune_key(B * C, T),
        FAST_SIN=fast_sin, WIDE_INDEX=_wide_index(x),
    )  # fmt: skip
    record_launch("snake_fwd_kernel")
    return y


def _snake_backward(
    grad_y: torch.Tensor, x: torch.Tensor, alpha: torch.Tensor, eps: float, fast_sin: bool, need_alpha_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    B, C, T = x.shape
    grad_x = new_output((B, C, T), x.dtype, x.device)
    if x.numel() == 0:
        return grad_x, torch.zeros_like(alpha)
    backend = backend_for(x)
    if backend is Backend.TORCH:
        _backend.warn_reference_once("snake")
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        gx, ga = torch_snake_backward(grad_y.to(compute), x.to(compute), alpha.to(compute), eps)
        return gx.to(x.dtype), ga.to(alpha.dtype)
    x, grad_y = _unit_time_stride(x), _unit_time_stride(grad_y)
    block_t = _backward_block(T)
    n_time_blocks = triton.cdiv(T, block_t)
    partial_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    partial = new_output((B, C, n_time_blocks) if need_alpha_grad else (1,), partial_dtype, x.device)
    snake_bwd_kernel[(B * C * n_time_blocks,)](
        grad_y, x, alpha, grad_x, partial, C, T,
        grad_y.stride(0), grad_y.stride(1), x.stride(0), x.stride(1), eps, _tune_key(B * C, T),
        BLOCK_T=block_t, FAST_SIN=fast_sin, WIDE_INDEX=_wide_index(x, grad_y), NEED_ALPHA_GRAD=need_alpha_grad,
    )  # fmt: skip
    record_launch("snake_bwd_kernel")
    grad_alpha = partial.sum(dim=(0, 2)).to(alpha.dtype) if need_alpha_grad else torch.zeros_like(alpha)
    return grad_x, grad_alpha


# ----------------------------------------------------------------------------------------------------------------
# torch.library ops (canonical shapes: x [B, C, T], alpha [C] contiguous)
# ----------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("sparsefuse::snake", mutates_args=())
def snake_op(x: torch.Tensor, alpha: torch.Tensor, eps: float, fast_sin: bool) -> torch.Tensor:
    return _snake_forward(x, alpha, eps, fast_sin)


@snake_op.register_fake
def _(x: torch.Tensor, alpha: torch.Tensor, eps: float, fast_sin: bool) -> torch.Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("sparsefuse::snake_backward", mutates_args=())
def snake_backward_op(
    grad_y: torch.Tensor, x: torch.Tensor, alpha: torch.Tensor, eps: float, fast_sin: bool, need_alpha_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _snake_backward(grad_y, x, alpha, eps, fast_sin, need_alpha_grad)


@snake_backward_op.register_fake
def _(grad_y, x, alpha, eps, fast_sin, need_alpha_grad):
    return x.new_empty(x.shape), alpha.new_empty(alpha.shape)


def _snake_setup_context(ctx, inputs, output) -> None:
    x, alpha, eps, fast_sin = inputs
    ctx.save_for_backward(x, alpha)
    ctx.eps, ctx.fast_sin = eps, fast_sin


def _snake_autograd_backward(ctx, grad_y):
    x, alpha = ctx.saved_tensors
    need_x, need_alpha = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_x, grad_alpha = snake_backward_op(grad_y, x, alpha, ctx.eps, ctx.fast_sin, need_alpha)
    return (grad_x if need_x else None), (grad_alpha if need_alpha else None), None, None


snake_op.register_autograd(_snake_autograd_backward, setup_context=_snake_setup_context)


# ----------------------------------------------------------------------------------------------------------------
# Functional API
# ----------------------------------------------------------------------------------------------------------------


def snake(x: torch.Tensor, alpha: torch.Tensor, eps: float = 1e-9, *, fast_sin: bool = False) -> torch.Tensor:
    """Snake activation ``x + (alpha + eps).reciprocal() * sin(alpha * x) ** 2`` (DAC / SNAC ``snake``).

    Args:
        x: [B, C, T], [C, T] or [B, C, *]; float32, float16, bfloat16 (or float64). Math runs in float32 (float64
            for float64 inputs); the output has x's dtype and shape (contiguous).
        alpha: [C] or [1, C, 1], one value per channel; any floating dtype.
        eps: added to alpha before the reciprocal, as in DAC (1e-9).
        fast_sin: use a range-reduced polynomial sine instead of ``tl.sin`` (see README for its measured error).

    Differentiable in x and alpha. A time axis with stride != 1 is copied once before the kernel runs.
    """
    op = "snake"
    check_float(op, "x", x, SNAKE_DTYPES)
    check_tensor(op, "alpha", alpha)
    check_float(op, "alpha", alpha, SNAKE_DTYPES)
    check_same_device(op, x=x, alpha=alpha)
    eps = check_scalar(op, "eps", eps)
    B, C, T = _canonical_shape(x.shape)
    if alpha.numel() != C or not (alpha.dim() == 1 or (alpha.dim() == 3 and alpha.shape == (1, C, 1))):
        raise ValueError(f"snake: alpha must have shape [{C}] or [1, {C}, 1] for x of shape {list(x.shape)}; "
                         f"got {describe(alpha)}")  # fmt: skip
    y = snake_op(x.reshape(B, C, T), alpha.reshape(C).contiguous(), eps, bool(fast_sin))
    return y.reshape(x.shape)
