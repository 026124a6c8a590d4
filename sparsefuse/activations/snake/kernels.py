"""Snake1d's Triton kernels: a row-tiled and a flat forward, and a backward that computes grad_x and alpha's
per-program partial sums in one pass.

Layout: each program of the row kernels owns one (batch*channel row, time block) tile, so a channel's alpha is one
scalar load per program and no per-element integer division is needed. The grid is 2-D over (time blocks, rows),
with rows past 65535 (the limit on grid y) folded into grid z. The flat forward walks a contiguous x as full,
aligned blocks whatever T is, finding the channel by high-multiply division once per 16-byte run.

Alpha's gradient is a reduction over batch and time: the backward writes one fp32 partial sum per program while it
computes grad_x (no second pass over x), then either the channel's last program to arrive (integer counter) sums
them in a fixed order, or the launcher sums them in a second launch (see launch._alpha_finish). No float atomics
either way, so results are bitwise reproducible.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..._jit import kernel
from ..._triton.sfu import sfu_cos, sfu_sin

# Sine. Snake needs sin(u)^2 (forward) and sin(u)cos(u) (backward), and both only depend on u modulo pi: with
# u = k*pi + r, sin(u) = ±sin(r) and cos(u) = ±cos(r) with the same sign. Reducing to |r| <= pi/2 first keeps every
# mode below accurate for |u| up to 2e5 (PI_A and PI_B have 8 significant bits, so k*PI_A and k*PI_B are exact for
# |k| < 2^16). Beyond 2e5 the error grows like |u| * 2^-24 -- the size of the rounding of alpha * x to float32 itself,
# so no float32 sine is meaningfully better there. libdevice's sinf costs ~40 instructions an element.
#
# SIN_ACCURATE (fp32 default): Cody-Waite reduction with pi split in three and near-minimax polynomials of degree
#   9 / 10: |sin^2 error| <= 3.5e-7 for |u| <= 1e5 (libdevice: 1.5e-7). ~20 instructions an element.
# SIN_FAST (fp32, fast_sin=True): two-part reduction, polynomials of degree 7 / 8: |sin^2 error| <= 1e-5.
# SIN_HARDWARE (fp16 / bf16 on the GPU): three-part reduction, then the SFU's sin.approx / cos.approx (one MUFU
#   instruction each, 2^-21.4 absolute error for |r| <= pi): |sin^2 error| <= 1e-6, over 2^10 below an fp16 or bf16
#   output's rounding. At 2 bytes an element the polynomial makes the forward issue-bound (88% of copy bandwidth,
#   measured on an H200); this mode costs ~9 instructions an element. The interpreter has no SFU: it runs tl.sin in
#   its place.
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
    """n // d for 0 <= n < 2^31 by a 32-bit high multiply, with (magic, shift) = launch.division_magic(d) from the
    host."""
    return (tl.umulhi(n.to(tl.uint32) * 2, magic.to(tl.uint32)) >> shift).to(tl.int32)


@triton.jit
def _row_tile(rows_per_slice, n_channels, c_magic, c_shift, T, BLOCK_T: tl.constexpr, WIDE_INDEX: tl.constexpr):
    """This program's (batch, channel, row, time offsets [BLOCK_T], mask [BLOCK_T]) on the grid (time blocks,
    rows_per_slice, row slices) of launch._row_grid. The channel is row % C by a high multiply with host-computed
    magic numbers: a runtime division would put ~25 dependent instructions before every load."""
    row = tl.program_id(1) + tl.program_id(2) * rows_per_slice  # = b * C + c
    b = _magic_div(row, c_magic, c_shift)
    c = row - b * n_channels
    time_block = tl.program_id(0)
    if WIDE_INDEX:
        time_block = time_block.to(tl.int64)  # before the multiply: time_block * BLOCK_T can pass 2^31
    t = time_block * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    return b, c, row, t, t < T


@kernel
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


@kernel
def snake_fwd_flat_kernel(
    x_ptr,
    alpha_ptr,
    y_ptr,
    n_elements,
    n_channels,
    t_magic,
    t_shift,
    c_magic,
    c_shift,
    eps,
    BLOCK: tl.constexpr,
    VECTOR: tl.constexpr,
    RUN_SHARES_CHANNEL: tl.constexpr,
    SIN_MODE: tl.constexpr,
):
    # A contiguous x [B*C*T] walked flat, as [BLOCK // VECTOR, VECTOR] runs of one aligned vector load each (8 or 16
    # bytes, see launch._flat_run), so every block is full whatever T is. Each element finds its channel as
    # (i // T) % C by two 32-bit high multiplies with host-computed magic numbers (a runtime integer division costs
    # ~30 instructions an element). When VECTOR divides T, a run never crosses a row: its channel and alpha are
    # computed and loaded once per run (RUN_SHARES_CHANNEL).
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


@kernel
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
