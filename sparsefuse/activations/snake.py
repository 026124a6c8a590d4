"""Snake1d activation (DAC / SNAC audio codecs), forward and backward in one pass each.

    y = x + 1 / (alpha + eps) * sin(alpha * x) ** 2          x [B, C, T], alpha [C] (one per channel)

Cost model (per element, E = bytes of x's dtype): forward reads x and writes y (2E bytes), backward reads grad_y and
x and writes grad_x (3E bytes); alpha and its per-program partial sums are O(B*C*T/BLOCK_T) bytes. Arithmetic is
~20 flops per element, far below the machine balance, so both passes are memory-bound and the ceiling is the
device-to-device copy bandwidth.

Layout: each program owns one (batch*channel row, time block) tile, so a channel's alpha is one scalar load per
program and no per-element integer division is needed. The grid is 2-D over (time blocks, rows), with rows past
65535 (the limit on grid y) folded into grid z. A contiguous x takes a flat forward kernel instead: full, aligned
blocks whatever T is, channel by high-multiply division once per 16-byte run.

Alpha's gradient is a reduction over batch and time. The backward kernel writes one fp32 partial sum per program
while it computes grad_x (no second pass over x). Large grids sum the partials with torch in a second launch; small
ones let the last program of each channel to arrive (integer counter) sum that channel's partials in a fixed order
(see _alpha_finish). No float atomics either way, so results are bitwise reproducible.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _backend
from .._backend import STREAMING_WARPS, Backend, backend_for, new_output, record_launch, streaming_block
from ._sfu import sfu_cos, sfu_sin
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

# Sine. Snake needs sin(u)^2 (forward) and sin(u)cos(u) (backward), and both only depend on u modulo pi: with
# u = k*pi + r, sin(u) = ±sin(r) and cos(u) = ±cos(r) with the same sign. Reducing to |r| <= pi/2 first keeps every
# mode below accurate for |u| up to 2e5 (PI_A and PI_B have 8 significant bits, so k*PI_A and k*PI_B are exact for
# |k| < 2^16). Beyond 2e5 the error grows like |u| * 2^-24 -- the size of the rounding of alpha * x to float32 itself,
# so no float32 sine is meaningfully better there. libdevice's sinf costs ~40 instructions an element.
#
# SIN_ACCURATE (fp32 default): Cody-Waite reduction with pi split in three and near-minimax polynomials of degree 9 / 10:
#   |sin^2 error| <= 3.5e-7 for |u| <= 1e5 (libdevice: 1.5e-7). ~20 instructions an element.
# SIN_FAST (fp32, fast_sin=True): two-part reduction, polynomials of degree 7 / 8: |sin^2 error| <= 1e-5.
# SIN_HARDWARE (fp16 / bf16 on the GPU): three-part reduction, then the SFU's sin.approx / cos.approx (one MUFU
#   instruction each, 2^-21.4 absolute error for |r| <= pi): |sin^2 error| <= 1e-6, over 2^10 below an fp16 or bf16
#   output's rounding. At 2 bytes an element the polynomial made the forward issue-bound (88% of copy bandwidth on
#   the H200); this mode costs ~9 instructions an element. The interpreter has no SFU: it runs tl.sin in its place.
# SIN_LIBDEVICE: tl.sin/tl.cos (float64 inputs, where the polynomials would be the accuracy bottleneck).
SIN_ACCURATE = tl.constexpr(0)
SIN_FAST = tl.constexpr(1)
SIN_LIBDEVICE = tl.constexpr(2)
SIN_HARDWARE = tl.constexpr(3)
_INV_PI = tl.constexpr(0.3183098861837907)
_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: (t + M) - M rounds |t| < 2^22 to an integer, without FRND
_PI_A = tl.constexpr(3.140625)
_PI_B = tl.constexpr(9.6893310546875e-04)
_PI_C = tl.constexpr(-1.279515686292143e-06)
_PI_LO = tl.constexpr(9.676535897932795e-04)  # pi - _PI_A, for the two-part reduction
_R_LIMIT = tl.constexpr(2.0)
_PARTS_PER_STEP = tl.constexpr(256)  # alpha partial sums read per step by the channel's last program
# How the backward finishes alpha's gradient (a sum over batch and time tiles), all deterministic:
ALPHA_DIRECT = tl.constexpr(0)  # one program per channel: it stores the sum itself
ALPHA_LAST_ARRIVER = tl.constexpr(1)  # per-program partials; the channel's last program (integer counter) sums them
ALPHA_PARTIALS = tl.constexpr(2)  # per-program partials; a separate reduction sums them


@triton.jit
def _reduce_mod_pi(u, PARTS: tl.constexpr, CLAMP: tl.constexpr):
    k = (u * _INV_PI + _ROUND_MAGIC) - _ROUND_MAGIC  # nearest integer to u / pi (an FADD, not the slower FRND)
    if PARTS == 3:
        r = ((u - k * _PI_A) - k * _PI_B) - k * _PI_C
    else:
        r = (u - k * _PI_A) - k * _PI_LO
    if CLAMP:
        # |r| <= pi/2 up to k's rounding (0.03 at |u| = 2e5). Past the exact range r is rounding noise that can be
        # huge (|u| ~ 1e30): clamping to |r| <= 2, where the polynomials still hold, keeps sin^2 in [0, 1] and y
        # within O(1/alpha) of x, as with any float32 sine there. NaN (u = ±inf or NaN) must survive the clamp.
        r = tl.minimum(r, _R_LIMIT, propagate_nan=tl.PropagateNan.ALL)
        r = tl.maximum(r, -_R_LIMIT, propagate_nan=tl.PropagateNan.ALL)
    return r


@triton.jit
def _poly_sin(r, DEGREE: tl.constexpr):
    # Near-minimax odd polynomials on |r| <= pi/2 (Lawson-weighted least squares, leading term fixed to r):
    # max |error| 4.6e-9 at degree 9, 8.8e-7 at degree 7.
    q = r * r
    if DEGREE == 9:
        p = 2.6000558892872935e-06
        p = p * q - 1.9806615726246542e-04
        p = p * q + 8.3330172990903910e-03
        p = p * q - 1.6666657096822848e-01
    else:
        p = -1.849221933678839e-04
        p = p * q + 8.312367419995508e-03
        p = p * q - 1.666568116052337e-01
    return r + r * q * p


@triton.jit
def _poly_cos(r, DEGREE: tl.constexpr):
    # Near-minimax even polynomials on |r| <= pi/2: max |error| 2.4e-10 at degree 10, 5.3e-8 at degree 8.
    q = r * r
    if DEGREE == 10:
        p = -2.607710643878769e-07
        p = p * q + 2.4761886327835658e-05
        p = p * q - 1.3888403510107141e-03
        p = p * q + 4.1666640728228050e-02
        p = p * q - 4.9999999549561636e-01
    else:
        p = 2.3194408582546955e-05
        p = p * q - 1.3855928127603744e-03
        p = p * q + 4.1663989574158910e-02
        p = p * q - 4.9999932297231330e-01
    return 1.0 + q * p


@triton.jit
def _sin_cos_mod_pi(u, NEED_COS: tl.constexpr, SIN_MODE: tl.constexpr):
    """(s, c) = ±(sin u, cos u) with one common sign: enough for s*s and s*c. c is s when NEED_COS is False."""
    if SIN_MODE == SIN_FAST:
        r = _reduce_mod_pi(u, 2, True)
        s = _poly_sin(r, 7)
        c = s
        if NEED_COS:
            c = _poly_cos(r, 8)
    elif SIN_MODE == SIN_ACCURATE:
        r = _reduce_mod_pi(u, 3, True)
        s = _poly_sin(r, 9)
        c = s
        if NEED_COS:
            c = _poly_cos(r, 10)
    elif SIN_MODE == SIN_HARDWARE:  # the SFU takes any r (NaN stays NaN): no clamp
        r = _reduce_mod_pi(u, 3, False)
        s = sfu_sin(r)
        c = s
        if NEED_COS:
            c = sfu_cos(r)
    else:
        s = tl.sin(u)
        c = s
        if NEED_COS:
            c = tl.cos(u)
    return s, c


@triton.jit
def _magic_div(n, magic, shift):
    """n // d for 0 <= n < 2^31 by a 32-bit high multiply, with (magic, shift) = division_magic(d) from the host."""
    return (tl.umulhi(n.to(tl.uint32) * 2, magic.to(tl.uint32)) >> shift).to(tl.int32)


@triton.jit
def _row_tile(rows_per_slice, n_channels, c_magic, c_shift, T, BLOCK_T: tl.constexpr, WIDE_INDEX: tl.constexpr):
    """This program's (batch, channel, row, time offsets [BLOCK_T], mask [BLOCK_T]) on the grid (time blocks,
    rows_per_slice, row slices) of _row_grid. The channel is row % C by a high multiply with host-computed magic
    numbers: a runtime division would put ~25 dependent instructions before every load."""
    row = tl.program_id(1) + tl.program_id(2) * rows_per_slice  # = b * C + c
    b = _magic_div(row, c_magic, c_shift)
    c = row - b * n_channels
    time_block = tl.program_id(0)
    if WIDE_INDEX:
        time_block = time_block.to(tl.int64)  # before the multiply: time_block * BLOCK_T can pass 2^31
    t = time_block * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    return b, c, row, t, t < T


@triton.jit
def snake_fwd_kernel(
    x_ptr,
    alpha_ptr,
    y_ptr,
    n_rows,
    rows_per_slice,
    n_channels,
    c_magic,
    c_shift,
    T,
    stride_xb,
    stride_xc,
    eps,
    BLOCK_T: tl.constexpr,
    SIN_MODE: tl.constexpr,
    WIDE_INDEX: tl.constexpr,
):
    # x [B, C, T] with unit time stride (rows may be strided); y [B, C, T] contiguous; alpha [C]
    b, c, row, t, mask = _row_tile(rows_per_slice, n_channels, c_magic, c_shift, T, BLOCK_T, WIDE_INDEX)
    if row >= n_rows:  # the last row slice overhangs when B * C > 65535
        return
    compute_dtype = tl.float64 if x_ptr.dtype.element_ty == tl.float64 else tl.float32
    alpha = tl.load(alpha_ptr + c).to(compute_dtype)
    inv_alpha = 1.0 / (alpha + eps)
    x_row = x_ptr + b.to(tl.int64) * stride_xb + c.to(tl.int64) * stride_xc
    x = tl.load(x_row + t, mask=mask, other=0.0).to(compute_dtype)  # [BLOCK_T]
    s, _ = _sin_cos_mod_pi(alpha * x, False, SIN_MODE)
    y = x + inv_alpha * (s * s)
    tl.store(y_ptr + row.to(tl.int64) * T + t, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def snake_fwd_flat_kernel(x_ptr, alpha_ptr, y_ptr, n_elements, n_channels, t_magic, t_shift, c_magic, c_shift, eps,
                          BLOCK: tl.constexpr, VECTOR: tl.constexpr, RUN_SHARES_CHANNEL: tl.constexpr,
                          SIN_MODE: tl.constexpr):  # fmt: skip
    # A contiguous x [B*C*T] walked flat, as [BLOCK // VECTOR, VECTOR] runs of one aligned vector load each (8 or 16
    # bytes, see _flat_run), so every block is full whatever T is. Each element finds its channel as (i // T) % C by
    # two 32-bit high multiplies with host-computed magic numbers (a runtime integer division costs ~30 instructions
    # an element). When VECTOR divides T, a run never crosses a row: its channel and alpha are computed and loaded
    # once per run (RUN_SHARES_CHANNEL).
    first = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK // VECTOR) * VECTOR  # [RUNS]; int32: n < 2^31
    offs = first[:, None] + tl.arange(0, VECTOR)[None, :]  # [RUNS, VECTOR]
    mask = offs < n_elements
    compute_dtype = tl.float64 if x_ptr.dtype.element_ty == tl.float64 else tl.float32
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(compute_dtype)  # issued before the channel arithmetic
    where = first[:, None] if RUN_SHARES_CHANNEL else offs  # [RUNS, 1] or [RUNS, VECTOR]
    row = _magic_div(where, t_magic, t_shift)  # // T
    channel = row - _magic_div(row, c_magic, c_shift) * n_channels  # % C
    alpha = tl.load(alpha_ptr + channel, mask=where < n_elements, other=1.0).to(compute_dtype)
    s, _ = _sin_cos_mod_pi(alpha * x, False, SIN_MODE)
    y = x + (1.0 / (alpha + eps)) * (s * s)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def snake_bwd_kernel(
    grad_y_ptr,
    x_ptr,
    alpha_ptr,
    grad_x_ptr,
    grad_alpha_ptr,
    alpha_partial_ptr,
    arrivals_ptr,
    n_parts,
    n_rows,
    rows_per_slice,
    n_channels,
    c_magic,
    c_shift,
    T,
    stride_gb,
    stride_gc,
    stride_xb,
    stride_xc,
    eps,
    BLOCK_T: tl.constexpr,
    SIN_MODE: tl.constexpr,
    WIDE_INDEX: tl.constexpr,
    NEED_ALPHA_GRAD: tl.constexpr,
    ALPHA_FINISH: tl.constexpr,
):
    # grad_y, x [B, C, T] unit time stride; grad_x [B, C, T] contiguous; grad_alpha [C];
    # alpha_partial [B, C, n_time_blocks] fp32/64 scratch; arrivals [C] int32, zeroed (ALPHA_LAST_ARRIVER only)
    b, c, row, t, mask = _row_tile(rows_per_slice, n_channels, c_magic, c_shift, T, BLOCK_T, WIDE_INDEX)
    if row >= n_rows:  # the last row slice overhangs when B * C > 65535
        return
    pid = row * tl.num_programs(0) + tl.program_id(0)  # = row * n_time_blocks + time block
    compute_dtype = tl.float64 if x_ptr.dtype.element_ty == tl.float64 else tl.float32
    alpha = tl.load(alpha_ptr + c).to(compute_dtype)
    inv_alpha = 1.0 / (alpha + eps)
    b64, c64 = b.to(tl.int64), c.to(tl.int64)
    x = tl.load(x_ptr + b64 * stride_xb + c64 * stride_xc + t, mask=mask, other=0.0).to(compute_dtype)
    g = tl.load(grad_y_ptr + b64 * stride_gb + c64 * stride_gc + t, mask=mask, other=0.0).to(compute_dtype)
    s, co = _sin_cos_mod_pi(alpha * x, True, SIN_MODE)
    sc = s * co  # sin(2u) / 2
    grad_x = g + g * ((2.0 * alpha * inv_alpha) * sc)  # dy/dx = 1 + 2 alpha/(alpha+eps) sin(u)cos(u)
    # grad_x is stored first, so that its stores drain while the tile's alpha partial is reduced
    tl.store(grad_x_ptr + row.to(tl.int64) * T + t, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)
    if not NEED_ALPHA_GRAD:
        return
    # dy/dalpha = inv * (2 x sin(u)cos(u) - inv sin(u)^2), summed over the tile with the common factor inv taken out;
    # masked lanes have x = g = 0 and contribute 0.
    partial = tl.sum(g * (2.0 * x * sc - (s * s) * inv_alpha), axis=0) * inv_alpha
    if ALPHA_FINISH == ALPHA_DIRECT:  # B == 1 and the row fits one tile (the SNAC shapes): nothing to combine
        tl.store(grad_alpha_ptr + c, partial.to(grad_alpha_ptr.dtype.element_ty))
        return
    tl.store(alpha_partial_ptr + pid, partial)
    if ALPHA_FINISH == ALPHA_PARTIALS:  # the launcher sums alpha_partial over batch and time blocks afterwards
        return
    # ALPHA_LAST_ARRIVER: the last of the channel's B * n_time_blocks programs to arrive (integer counter, acq_rel)
    # sums the channel's partials in a fixed order. Every program waits here for its stores to be released and for
    # the counter's round trip (~20% of the bf16 backward on the H200), so only small grids finish this way.
    tl.debug_barrier()  # the partial's store (one thread) precedes the release below (maybe another thread)
    arrived = tl.atomic_add(arrivals_ptr + c, 1) + 1
    if arrived == n_parts:
        n_time_blocks = tl.cdiv(T, BLOCK_T)  # n_parts = B * n_time_blocks (a plain int for range())
        acc = tl.zeros([_PARTS_PER_STEP], dtype=compute_dtype)
        for first in range(0, n_parts, _PARTS_PER_STEP):
            j = first + tl.arange(0, _PARTS_PER_STEP)  # j = b * n_time_blocks + time block
            src = (j // n_time_blocks) * n_channels * n_time_blocks + c * n_time_blocks + j % n_time_blocks
            acc += tl.load(alpha_partial_ptr + src, mask=j < n_parts, other=0.0, cache_modifier=".cg")
        tl.store(grad_alpha_ptr + c, tl.sum(acc, axis=0).to(grad_alpha_ptr.dtype.element_ty))


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------

_INT32_LIMIT = 2**31 - 1
FLAT_FORWARD = True  # a contiguous x below 2^31 elements takes the flat forward kernel (tests turn it off)
# Forward launches follow _backend.streaming_block (measured, not autotuned). The flat kernel matched or beat the row
# kernel's best at 13 of the 14 bench cases; at fp32 1x256x15104 a 16 KB row tile is 5% ahead, but the same tile
# trails by 5% at the large shapes (benchmarks/results/probe-snake-fwd-NVIDIA-H200.log).
_INTERPRET_ROW_BLOCK, _INTERPRET_FLAT_BLOCK = 64, 128  # CPU tests: several programs and ragged tails at small shapes


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


ROWS_PER_SLICE = 65535  # CUDA caps grid y and z at 65535 (x at 2^31 - 1)


def _row_grid(n_rows: int, n_time_blocks: int) -> tuple[int, int, int]:
    """(time blocks, rows in a slice, row slices): rows past ROWS_PER_SLICE go to further slices along grid z."""
    return (n_time_blocks, min(n_rows, ROWS_PER_SLICE), triton.cdiv(n_rows, ROWS_PER_SLICE))


def _forward_block_t(T: int, element_size: int) -> int:
    """The row kernel's time block: a streaming tile of x, but no longer than the row needs (256 at least)."""
    if _backend.INTERPRET:
        return _INTERPRET_ROW_BLOCK
    return min(_backend.STREAMING_TILE_BYTES // element_size, max(256, triton.next_power_of_2(T)))


def _flat_run(T: int, element_size: int) -> tuple[int, bool]:
    """(run, shares_channel): the flat kernel walks runs of `run` elements, one aligned vector load each. A 16-byte
    run when T allows: when the run divides T, a run never crosses a row, so its channel and alpha are found once
    (shares_channel). If T's largest power-of-two factor is half a vector, 8-byte runs that share a channel beat
    16-byte runs that do not (bf16 at SNAC's T = 236 = 4 * 59); below that, 16-byte runs with a channel per element."""
    vector = max(1, 16 // element_size)
    run = min(vector, T & -T)
    return (run, True) if 2 * run >= vector else (vector, False)


def _wide_index(*tensors: torch.Tensor) -> bool:
    # Per-element time offsets use int32 unless a row (or its stride) can exceed int32; row bases are always int64.
    return any(t.shape[2] * max(t.stride(2), 1) + 8192 > _INT32_LIMIT for t in tensors)


def division_magic(divisor: int) -> tuple[int, int]:
    """(m, l) with n // divisor == umulhi(2n, m) >> l for every 0 <= n < 2^31, where umulhi(a, b) = (a * b) >> 32 on
    uint32. Granlund & Montgomery 1994, Thm 4.2 with N = 31: n // d == (n * m) >> (31 + l) for
    m = ceil(2^(31+l) / d), l = ceil(log2 d); m < 2^32 because d > 2^(l-1), and 2n < 2^32, so both fit uint32 and
    (n * m) >> (31 + l) == ((2n * m) >> 32) >> l."""
    log2_ceil = (divisor - 1).bit_length()
    return -(-(1 << (31 + log2_ceil)) // divisor), log2_ceil


def _sin_mode(dtype: torch.dtype, fast_sin: bool) -> int:
    if dtype == torch.float64:
        return SIN_LIBDEVICE.value
    if dtype in (torch.float16, torch.bfloat16):
        return SIN_HARDWARE.value  # more accurate than SIN_FAST and cheaper than both polynomials
    return SIN_FAST.value if fast_sin else SIN_ACCURATE.value


def _backward_config(T: int) -> tuple[int, int]:
    """(BLOCK_T, num_warps), fixed rather than autotuned: the partial-sum layout and the reduction order (hence the
    exact bits of alpha's gradient) must not depend on a timing-based choice. 2048/4 measured level with 4096/8 on
    long rows and ahead on short ones (H200, scripts/probe_snake.py)."""
    if _backend.INTERPRET:
        return 64, 4
    return min(2048, max(256, triton.next_power_of_2(T))), 4


def _snake_forward(x: torch.Tensor, alpha: torch.Tensor, eps: float, fast_sin: bool) -> torch.Tensor:
    B, C, T = x.shape
    y = new_output((B, C, T), x.dtype, x.device)
    if y.numel() == 0:
        return y
    if backend_for(x) is Backend.TORCH:
        _backend.warn_reference_once("snake")
        compute = _backend.compute_dtype(x.dtype)
        return torch_snake(x.to(compute), alpha.to(compute), eps).to(x.dtype)
    x = _unit_time_stride(x)
    mode = _sin_mode(x.dtype, fast_sin)
    if FLAT_FORWARD and x.is_contiguous() and x.numel() < _INT32_LIMIT - 8192:
        n = x.numel()
        block = streaming_block(n, x.element_size(), x.device, _INTERPRET_FLAT_BLOCK)
        run, shares_channel = _flat_run(T, x.element_size())
        snake_fwd_flat_kernel[(triton.cdiv(n, block),)](
            x, alpha, y, n, C, *division_magic(T), *division_magic(C), eps,
            BLOCK=block, VECTOR=run, RUN_SHARES_CHANNEL=shares_channel, SIN_MODE=mode, num_warps=STREAMING_WARPS,
        )  # fmt: skip
        record_launch("snake_fwd_flat_kernel")
        return y
    block_t = _forward_block_t(T, x.element_size())
    snake_fwd_kernel[_row_grid(B * C, triton.cdiv(T, block_t))](
        x, alpha, y, B * C, ROWS_PER_SLICE, C, *division_magic(C), T, x.stride(0), x.stride(1), eps,
        BLOCK_T=block_t, SIN_MODE=mode, WIDE_INDEX=_wide_index(x), num_warps=STREAMING_WARPS,
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
    if backend_for(x) is Backend.TORCH:
        _backend.warn_reference_once("snake")
        compute = _backend.compute_dtype(x.dtype)
        gx, ga = torch_snake_backward(grad_y.to(compute), x.to(compute), alpha.to(compute), eps)
        return gx.to(x.dtype), ga.to(alpha.dtype)
    x, grad_y = _unit_time_stride(x), _unit_time_stride(grad_y)
    block_t, num_warps = _backward_config(T)
    n_time_blocks = triton.cdiv(T, block_t)
    n_programs = B * C * n_time_blocks
    finish = _alpha_finish(n_programs, C)
    if need_alpha_grad:
        grad_alpha = new_output((C,), alpha.dtype, x.device)
    else:  # the kernel's alpha branch is compiled out
        grad_alpha = torch.zeros_like(alpha)
    partial = arrivals = grad_alpha  # placeholders, never touched, unless:
    if need_alpha_grad and finish != ALPHA_DIRECT.value:
        partial = torch.empty(n_programs, dtype=_backend.compute_dtype(x.dtype), device=x.device)
    if need_alpha_grad and finish == ALPHA_LAST_ARRIVER.value:
        arrivals = torch.zeros(C, dtype=torch.int32, device=x.device)
    snake_bwd_kernel[_row_grid(B * C, n_time_blocks)](
        grad_y, x, alpha, grad_x, grad_alpha, partial, arrivals, B * n_time_blocks, B * C, ROWS_PER_SLICE,
        C, *division_magic(C), T, grad_y.stride(0), grad_y.stride(1), x.stride(0), x.stride(1), eps,
        BLOCK_T=block_t, SIN_MODE=_sin_mode(x.dtype, fast_sin), WIDE_INDEX=_wide_index(x, grad_y),
        NEED_ALPHA_GRAD=need_alpha_grad, ALPHA_FINISH=finish, num_warps=num_warps,
    )  # fmt: skip
    record_launch("snake_bwd_kernel")
    if need_alpha_grad and finish == ALPHA_PARTIALS.value:
        # torch's sum is deterministic (fixed reduction tree), like the in-kernel finish it replaces here
        partials = partial.view(B, C, n_time_blocks)
        if grad_alpha.dtype == partial.dtype:
            torch.sum(partials, dim=(0, 2), out=grad_alpha)
        else:
            grad_alpha = partials.sum(dim=(0, 2)).to(alpha.dtype)
        record_launch("snake_bwd_alpha_sum")
    return grad_x, grad_alpha


def _alpha_finish(n_programs: int, n_channels: int) -> int:
    """How the backward completes alpha's gradient. Large grids write partials and sum them in a second launch:
    in one launch, each program would wait for its partial's release and the channel counter's round trip before it
    can retire (measured on the H200: ~20% of the bf16 backward). Small grids, where a launch costs more than that
    wait, finish in the kernel."""
    if n_programs == n_channels:
        return ALPHA_DIRECT.value
    if n_programs >= (_PARTIALS_MIN_PROGRAMS_INTERPRETED if _backend.INTERPRET else _PARTIALS_MIN_PROGRAMS):
        return ALPHA_PARTIALS.value
    return ALPHA_LAST_ARRIVER.value


_PARTIALS_MIN_PROGRAMS = 2048
_PARTIALS_MIN_PROGRAMS_INTERPRETED = 64  # CPU tests cover both finishes


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
        fast_sin: fp32 only: a cheaper sine (two-part reduction, degree-7 polynomial; |sin^2 error| <= 1e-5 for
            |alpha*x| <= 1e5) instead of the default (three-part reduction, degree 9; 3.5e-7). fp16 and bf16 inputs
            always use the hardware sine after the three-part reduction (|sin^2 error| <= 1e-6, far below their
            output rounding), which is both cheaper and more accurate than the fp32 fast path. See the README.

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
    x3, alpha1 = x.reshape(B, C, T), alpha.reshape(C).contiguous()
    if _backend.bypass_dispatcher(x, alpha):
        return _snake_forward(x3, alpha1, eps, bool(fast_sin)).reshape(x.shape)
    return snake_op(x3, alpha1, eps, bool(fast_sin)).reshape(x.shape)
