"""Snake1d's launchers: allocate the outputs, pick the kernel and its grid, launch, ``record_launch``. Nothing here
checks arguments (functional.py did). CPU tensors without the interpreter run the plain-torch reference instead.

Cost model (per element, E = bytes of x's dtype): forward reads x and writes y (2E bytes), backward reads grad_y and
x and writes grad_x (3E bytes); alpha and its per-program partial sums are O(B*C*T/BLOCK_T) bytes. Arithmetic is
~20 flops per element, far below the machine balance, so both passes are memory-bound and the ceiling is the
device-to-device copy bandwidth.
"""

from __future__ import annotations

import dataclasses

import torch

from ... import _backend
from ..._backend import (
    STREAMING_WARPS,
    Backend,
    backend_for,
    cdiv,
    new_output,
    next_power_of_2,
    record_launch,
    streaming_block,
)
from ..._plan.config import KnobGroup, current, register_knobs
from ..._validation import unit_last_stride
from .kernels import (
    ALPHA_DIRECT,
    ALPHA_LAST_ARRIVER,
    ALPHA_PARTIALS,
    SIN_ACCURATE,
    SIN_FAST,
    SIN_HARDWARE,
    SIN_LIBDEVICE,
    snake_bwd_kernel,
    snake_fwd_flat_kernel,
    snake_fwd_kernel,
)
from .reference import torch_snake, torch_snake_backward


@dataclasses.dataclass(frozen=True)
class SnakeKnobs(KnobGroup):
    """Which of snake's kernels and grids a launch takes (registered as ``"snake"``; read at each launch).

    ``flat_forward``: a contiguous x below 2^31 elements takes the flat forward kernel (runs of the flattened x,
    launches sized by ``_backend.streaming_block``, measured rather than autotuned), else the row kernel. The flat
    kernel matched or beat the row kernel's best at 13 of the 14 bench cases on an H200; at fp32 1x256x15104 a 16 KB
    row tile is 5% ahead, but the same tile trails by 5% at the large shapes. False: the row kernel always (tests;
    what huge or strided inputs take).

    ``rows_per_slice``: rows of the row kernels' grid along y, at most (CUDA caps grid y and z at 65535; x at
    2^31 - 1); further rows go to further slices along z.

    ``offsets_32_max``: the kernels compute a row's element offsets in int32 while its length times its time
    stride, plus 8192 of slack for the last block's overhang, is at most this (int32's largest), else in int64
    (row bases are int64 always); the flat kernel takes only an x of fewer elements than this less the slack.
    Tests lower it to cover the int64 offsets at small sizes.

    ``partials_min_programs``: backward grids of at least this many programs finish alpha's gradient by partials and
    a second launch, smaller ones in the kernel (:func:`_alpha_finish`); None: 2048 (64 under the interpreter, so
    the CPU tests cover both finishes)."""

    flat_forward: bool = True
    rows_per_slice: int = 65535
    offsets_32_max: int = 2**31 - 1
    partials_min_programs: int | None = None


register_knobs("snake", SnakeKnobs())

_INTERPRET_ROW_BLOCK, _INTERPRET_FLAT_BLOCK = 64, 128  # CPU tests: several programs and ragged tails at small shapes


def _row_grid(n_rows: int, n_time_blocks: int, rows_per_slice: int) -> tuple[int, int, int]:
    """(time blocks, rows in a slice, row slices): rows past ``rows_per_slice`` go to further slices along grid
    z."""
    return (n_time_blocks, min(n_rows, rows_per_slice), cdiv(n_rows, rows_per_slice))


def _forward_block_t(T: int, element_size: int) -> int:
    """The row kernel's time block: a streaming tile of x, but no longer than the row needs (256 at least)."""
    if _backend.INTERPRET:
        return _INTERPRET_ROW_BLOCK
    return min(_backend.STREAMING_TILE_BYTES // element_size, max(256, next_power_of_2(T)))


def _flat_run(T: int, element_size: int) -> tuple[int, bool]:
    """(run, shares_channel): the flat kernel walks runs of `run` elements, one aligned vector load each. A 16-byte
    run when T allows: when the run divides T, a run never crosses a row, so its channel and alpha are found once
    (shares_channel). If T's largest power-of-two factor is half a vector, 8-byte runs that share a channel beat
    16-byte runs that do not (bf16 at SNAC's T = 236 = 4 * 59); below that, 16-byte runs with a channel per element."""
    vector = max(1, 16 // element_size)
    run = min(vector, T & -T)
    return (run, True) if 2 * run >= vector else (vector, False)


def _wide_index(offsets_32_max: int, *tensors: torch.Tensor) -> bool:
    # Per-element time offsets use int32 unless a row (or its stride) can exceed int32; row bases are always int64.
    return any(t.shape[2] * max(t.stride(2), 1) + 8192 > offsets_32_max for t in tensors)


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
    long rows and ahead on short ones (H200)."""
    if _backend.INTERPRET:
        return 64, 4
    return min(2048, max(256, next_power_of_2(T))), 4


def _alpha_finish(n_programs: int, n_channels: int, least: int | None) -> int:
    """How the backward completes alpha's gradient. Large grids write partials and sum them in a second launch:
    in one launch, each program would wait for its partial's release and the channel counter's round trip before it
    can retire (measured on the H200: ~20% of the bf16 backward). Small grids, where a launch costs more than that
    wait, finish in the kernel."""
    if n_programs == n_channels:
        return ALPHA_DIRECT.value
    if n_programs >= (least if least is not None else 64 if _backend.INTERPRET else 2048):
        return ALPHA_PARTIALS.value
    return ALPHA_LAST_ARRIVER.value


def snake_forward(x: torch.Tensor, alpha: torch.Tensor, eps: float, fast_sin: bool) -> torch.Tensor:
    """y [B, C, T] (contiguous, x's dtype) from x [B, C, T] and alpha [C] contiguous. A time axis with stride != 1 is
    copied once: reading it in place would waste most of every memory transaction."""
    B, C, T = x.shape
    y = new_output((B, C, T), x.dtype, x.device)
    if y.numel() == 0:
        return y
    if backend_for(x) is Backend.TORCH:
        _backend.warn_reference_once("snake")
        compute = _backend.compute_dtype(x.dtype)
        return torch_snake(x.to(compute), alpha.to(compute), eps).to(x.dtype)
    x = unit_last_stride(x)
    mode = _sin_mode(x.dtype, fast_sin)
    knobs: SnakeKnobs = current().knobs("snake")
    if knobs.flat_forward and x.is_contiguous() and x.numel() < knobs.offsets_32_max - 8192:
        n = x.numel()
        block = streaming_block(n, x.element_size(), x.device, _INTERPRET_FLAT_BLOCK)
        run, shares_channel = _flat_run(T, x.element_size())
        snake_fwd_flat_kernel[(cdiv(n, block),)](
            x,
            alpha,
            y,
            n,
            C,
            *division_magic(T),
            *division_magic(C),
            eps,
            BLOCK=block,
            VECTOR=run,
            RUN_SHARES_CHANNEL=shares_channel,
            SIN_MODE=mode,
            num_warps=STREAMING_WARPS,
        )
        record_launch("snake_fwd_flat_kernel")
        return y
    block_t = _forward_block_t(T, x.element_size())
    snake_fwd_kernel[_row_grid(B * C, cdiv(T, block_t), knobs.rows_per_slice)](
        x,
        alpha,
        y,
        B * C,
        knobs.rows_per_slice,
        C,
        *division_magic(C),
        T,
        x.stride(0),
        x.stride(1),
        eps,
        BLOCK_T=block_t,
        SIN_MODE=mode,
        WIDE_INDEX=_wide_index(knobs.offsets_32_max, x),
        num_warps=STREAMING_WARPS,
    )
    record_launch("snake_fwd_kernel")
    return y


def snake_backward(
    grad_y: torch.Tensor, x: torch.Tensor, alpha: torch.Tensor, eps: float, fast_sin: bool, need_alpha_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x [B, C, T] contiguous, grad_alpha [C]) from grad_y, x [B, C, T] and alpha [C] contiguous; grad_alpha
    is zeros when not need_alpha_grad."""
    B, C, T = x.shape
    grad_x = new_output((B, C, T), x.dtype, x.device)
    if x.numel() == 0:
        return grad_x, torch.zeros_like(alpha)
    if backend_for(x) is Backend.TORCH:
        _backend.warn_reference_once("snake")
        compute = _backend.compute_dtype(x.dtype)
        gx, ga = torch_snake_backward(grad_y.to(compute), x.to(compute), alpha.to(compute), eps)
        return gx.to(x.dtype), ga.to(alpha.dtype)
    x, grad_y = unit_last_stride(x), unit_last_stride(grad_y)
    block_t, num_warps = _backward_config(T)
    n_time_blocks = cdiv(T, block_t)
    n_programs = B * C * n_time_blocks
    knobs: SnakeKnobs = current().knobs("snake")
    finish = _alpha_finish(n_programs, C, knobs.partials_min_programs)
    if need_alpha_grad:
        grad_alpha = new_output((C,), alpha.dtype, x.device)
    else:  # the kernel's alpha branch is compiled out
        grad_alpha = torch.zeros_like(alpha)
    partial = arrivals = grad_alpha  # placeholders, never touched, unless:
    if need_alpha_grad and finish != ALPHA_DIRECT.value:
        partial = torch.empty(n_programs, dtype=_backend.compute_dtype(x.dtype), device=x.device)
    if need_alpha_grad and finish == ALPHA_LAST_ARRIVER.value:
        arrivals = torch.zeros(C, dtype=torch.int32, device=x.device)
    snake_bwd_kernel[_row_grid(B * C, n_time_blocks, knobs.rows_per_slice)](
        grad_y,
        x,
        alpha,
        grad_x,
        grad_alpha,
        partial,
        arrivals,
        B * n_time_blocks,
        B * C,
        knobs.rows_per_slice,
        C,
        *division_magic(C),
        T,
        grad_y.stride(0),
        grad_y.stride(1),
        x.stride(0),
        x.stride(1),
        eps,
        BLOCK_T=block_t,
        SIN_MODE=_sin_mode(x.dtype, fast_sin),
        WIDE_INDEX=_wide_index(knobs.offsets_32_max, x, grad_y),
        NEED_ALPHA_GRAD=need_alpha_grad,
        ALPHA_FINISH=finish,
        num_warps=num_warps,
    )
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
