"""The dense step's elementwise kernels and their launchers (``sparsefuse.ffn.hybrid.dense`` wraps them in ops and
autograd). One kernel per direction, for the gated block (``HAS_UP``) and the non-gated one:

* forward  ``relu_mul_stats_kernel``: pre (and up) [M, N] -> h_gate = relu(pre) (NaN kept, as ``torch.relu``), h =
  h_gate * up, and partial statistics of the fired entries (pre > 0 or NaN) -- relu(pre)'s sum (``HIDDEN``: |h|'s,
  the fp32 product's), fired counts per row and per column -- summed afterwards in a fixed order (no atomics: the
  same result every run). FATReLU fires where pre > ``threshold`` instead (h_gate = pre there, unshifted); dReLU
  (``UP_RELU``) takes relu(up) in h.
  Byte floor: read pre, up and write h_gate, h (4 [M, N] arrays; 2 without up).
* backward ``relu_mul_backward_kernel``: grad_h, h_gate (and up) -> d_up = grad_h * h_gate, d_pre = (grad_h * up +
  gate_grad) where the gate fired, else 0, with gate_grad = grad_l1 / (M * N) the L1 term's gradient; ``HIDDEN``
  (the L1 term on h): grad_h + gate_grad * sign(up) in both instead (sign(h) where the gate fired). ``UP_RELU``
  (dReLU): relu(up) for up, and d_up zero where up <= 0.
  Byte floor: read grad_h, h_gate, up and write d_pre, d_up (5 [M, N] arrays; 3 without up).

Math runs in fp32 and each output is rounded once to the inputs' dtype. float64 (gradient checks), empty tensors
and CPU tensors without the interpreter take the exact torch path (:func:`_torch_stats`, :func:`_torch_backward`).
"""

from __future__ import annotations

import torch
import triton.language as tl

from ... import _backend
from ..._backend import STREAMING_WARPS, Backend, backend_for, cdiv, new_output, record_launch, streaming_block
from ..._jit import kernel
from ..._triton.gates import fires, relu_keep_nan
from ..twell.reference import threshold_in

# Forward tiles: a program walks a strip of BLOCK_C columns down a group of rows, ROWS at a time. BLOCK_C is one
# warp's width of 16-byte vectors (256 columns of a 16-bit dtype, 128 of fp32): every load and store is a 128-bit
# access, a warp holds whole rows of the tile, and each row's fired count is one warp reduction (only those ROWS
# counts cross warps, through shared memory, to be stored). The per-column counts and relu's sum accumulate
# elementwise across the loop and are reduced once at its end. ROWS = 2 rows per thread keeps each accumulator at
# 16 registers or fewer (sm_90: 80 registers at bf16, no spills), so ~6 programs share an SM with ~48 KB of loads in
# flight, past what the copy rate needs (bandwidth x ~0.8 us latency: ~30 KB an SM on an H200).
FORWARD_WARPS = 4
FORWARD_ROWS = 2 * FORWARD_WARPS
# Programs per SM the grid aims at (several waves of short programs: a small tail), but at least MIN_CHUNKS row
# chunks a program: each row group adds N int32 partial column counts (written, then read by the sum), at most 3% of
# the gated forward's bytes at 16-bit (2% at M = 8192, N = 5632 on an H200).
PROGRAMS_PER_SM = 32
MIN_CHUNKS = 4
# The interpreter's shapes: small tiles and groups of 2 chunks, so CPU tests cover several strips and row groups.
_INTERPRET_ROWS, _INTERPRET_BLOCK_C, _INTERPRET_MIN_CHUNKS = 4, 32, 2
_INTERPRET_BACKWARD_BLOCK = 256


@kernel
def relu_mul_stats_kernel(
    pre_ptr,
    up_ptr,
    gate_ptr,
    h_ptr,
    l1_part_ptr,
    token_part_ptr,
    neuron_part_ptr,
    M,
    N,
    chunks_per_program,
    threshold,
    HAS_UP: tl.constexpr,
    HIDDEN: tl.constexpr,
    UP_RELU: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # pre, up, gate, h [M, N] contiguous (up, h unused without HAS_UP). Program (strip, group): columns strip *
    # BLOCK_C ..., row chunks group * chunks_per_program ... Partials: l1_part[group, strip] (fp32 sum of relu(pre);
    # HIDDEN: of |relu(pre) * up|),
    # token_part[strip, rows] (fired per row within the strip), neuron_part[group, cols] (fired per column).
    # threshold: fp32, the largest value of pre's dtype <= FATReLU's (0 for ReLU): v > it is v > FATReLU's exactly.
    strip = tl.program_id(0)
    group = tl.program_id(1)
    cols = strip * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < N
    l1_acc = tl.zeros([ROWS, BLOCK_C], dtype=tl.float32)
    fired_acc = tl.zeros([ROWS, BLOCK_C], dtype=tl.int32)
    first = group * chunks_per_program
    last = tl.minimum(first + chunks_per_program, tl.cdiv(M, ROWS))
    for chunk in range(first, last):
        rows = chunk * ROWS + tl.arange(0, ROWS)
        row_mask = rows < M
        offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
        pre = tl.load(pre_ptr + offsets, mask=mask, other=0.0)
        if HAS_UP:
            up = tl.load(up_ptr + offsets, mask=mask, other=0.0)
        pre = pre.to(tl.float32)
        fired = fires(pre, threshold)
        gate = tl.where(fired, pre, 0.0)
        tl.store(gate_ptr + offsets, gate.to(gate_ptr.dtype.element_ty), mask=mask)
        if HAS_UP:
            up = up.to(tl.float32)
            if UP_RELU:
                up = relu_keep_nan(up)
            h = gate * up
            tl.store(h_ptr + offsets, h.to(h_ptr.dtype.element_ty), mask=mask)
            if HIDDEN:
                l1_acc += tl.abs(h)
            else:
                l1_acc += gate
        else:
            l1_acc += gate
        fired = fired.to(tl.int32)
        fired_acc += fired
        tl.store(token_part_ptr + strip.to(tl.int64) * M + rows, tl.sum(fired, axis=1), mask=row_mask)
    tl.store(l1_part_ptr + group * tl.num_programs(0) + strip, tl.sum(tl.sum(l1_acc, axis=1), axis=0))
    tl.store(neuron_part_ptr + group.to(tl.int64) * N + cols, tl.sum(fired_acc, axis=0), mask=col_mask)


@kernel
def relu_mul_backward_kernel(
    grad_h_ptr,
    gate_ptr,
    up_ptr,
    grad_l1_ptr,
    d_pre_ptr,
    d_up_ptr,
    n_elements,
    count,
    HAS_UP: tl.constexpr,
    HAS_L1: tl.constexpr,
    HIDDEN: tl.constexpr,
    UP_RELU: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # grad_h, gate, up, d_pre, d_up: flat [n_elements] (up, d_up unused without HAS_UP); grad_l1: 0-dim, the loss's
    # gradient w.r.t. l1 = sum(gate) / count (HIDDEN: sum(|gate * up|) / count; absent without HAS_L1: no L1 term in
    # the loss). up: the raw up product (UP_RELU: relu'd here, and d_up masked by relu's slope, up > 0).
    start = tl.program_id(0).to(tl.int64) * BLOCK  # int64: tensors above 2^31 elements
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n_elements - start
    g = tl.load(grad_h_ptr + start + offsets, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + start + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_L1:  # correctly rounded, as torch divides: the same gate_grad as the torch path's
        gate_grad = tl.math.div_rn(tl.load(grad_l1_ptr).to(tl.float32), count)
    if HAS_UP:
        up = tl.load(up_ptr + start + offsets, mask=mask, other=0.0).to(tl.float32)
        if UP_RELU:
            gate_up = tl.where(up > 0, gate, 0.0)  # d_up's factor: h_gate times relu's slope
            up = tl.where(up <= 0, 0.0, up)
        else:
            gate_up = gate
        if HAS_L1 and HIDDEN:  # |h|'s gradient joins h's: sign(h) = sign(up) where the gate fired (d_up: 0 elsewhere)
            g = g + gate_grad * tl.where(up > 0, 1.0, tl.where(up < 0, -1.0, 0.0))
        tl.store(d_up_ptr + start + offsets, (g * gate_up).to(d_up_ptr.dtype.element_ty), mask=mask)
        g = g * up
    if HAS_L1 and not (HAS_UP and HIDDEN):
        g = g + gate_grad
    tl.store(d_pre_ptr + start + offsets, tl.where(gate != 0, g, 0.0).to(d_pre_ptr.dtype.element_ty), mask=mask)


def l1_dtype(dtype: torch.dtype) -> torch.dtype:
    """The L1 term's dtype: float64 for float64 inputs (gradient checks), else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _exact_torch(t: torch.Tensor) -> bool:
    return t.numel() == 0 or t.dtype == torch.float64 or backend_for(t) is Backend.TORCH


def _torch_stats(
    pre: torch.Tensor, up: torch.Tensor | None, hidden: bool, threshold: float, up_relu: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    M, N = pre.shape
    compute = _backend.compute_dtype(pre.dtype)
    fired = (pre > threshold_in(pre.dtype, threshold)) | pre.isnan() if threshold else (pre > 0) | pre.isnan()
    gate = torch.where(fired, pre, 0)
    if up is not None and up_relu:
        up = torch.relu(up)
    h_compute = gate.to(compute) * up.to(compute) if up is not None else None
    h = h_compute.to(pre.dtype) if up is not None else None
    on = h_compute.abs() if hidden and up is not None else gate
    l1 = on.sum(dtype=l1_dtype(pre.dtype)) / max(M * N, 1)
    return gate, h, l1, fired.sum(1, dtype=torch.int32), fired.sum(0, dtype=torch.int32)


def _forward_grid(M: int, N: int, element_size: int, device: torch.device) -> tuple[int, int, int, int]:
    """(ROWS, BLOCK_C, chunks per program, row groups) of relu_mul_stats_kernel for pre [M, N]."""
    if _backend.INTERPRET:
        rows, block_c, min_chunks = _INTERPRET_ROWS, _INTERPRET_BLOCK_C, _INTERPRET_MIN_CHUNKS
    else:
        rows, block_c, min_chunks = FORWARD_ROWS, 32 * (16 // element_size), MIN_CHUNKS
    strips, chunks = cdiv(N, block_c), cdiv(M, rows)
    groups = cdiv(PROGRAMS_PER_SM * _backend.sm_count(device), strips)
    per_program = max(min_chunks, cdiv(chunks, groups))
    return rows, block_c, per_program, cdiv(chunks, per_program)


def relu_mul_stats(
    pre: torch.Tensor, up: torch.Tensor | None, hidden: bool = False, threshold: float = 0.0, up_relu: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """pre, up [M, N] (one dtype; up None: the non-gated block) -> (h_gate = relu(pre) [M, N], h = h_gate * up [M, N]
    (None without up), l1 = sum(h_gate) / (M * N) (``hidden``: sum(|h|) / (M * N), of the fp32 product; 0-dim fp32,
    float64 for float64 pre), fired count per row [M] and per column [N] (int32)). New tensors throughout (a custom
    op's outputs alias neither inputs nor each other). ``threshold`` > 0 (FATReLU): fired where pre > threshold,
    h_gate = pre there; ``up_relu`` (dReLU): h = h_gate * relu(up)."""
    M, N = pre.shape
    pre = pre.contiguous()  # on either path: the outputs are then contiguous, as the ops' fakes say
    up = up.contiguous() if up is not None else None
    if _exact_torch(pre):
        return _torch_stats(pre, up, hidden, threshold, up_relu)
    rows, block_c, per_program, groups = _forward_grid(M, N, pre.element_size(), pre.device)
    strips = cdiv(N, block_c)
    gate = new_output((M, N), pre.dtype, pre.device)
    h = new_output((M, N), pre.dtype, pre.device) if up is not None else None
    l1_part = new_output((groups, strips), torch.float32, pre.device)
    token_part = new_output((strips, M), torch.int32, pre.device)
    neuron_part = new_output((groups, N), torch.int32, pre.device)
    relu_mul_stats_kernel[(strips, groups)](
        pre,
        up if up is not None else pre,
        gate,
        h if h is not None else gate,
        l1_part,
        token_part,
        neuron_part,
        M,
        N,
        per_program,
        threshold_in(pre.dtype, threshold),
        HAS_UP=up is not None,
        HIDDEN=hidden,
        UP_RELU=up_relu,
        ROWS=rows,
        BLOCK_C=block_c,
        num_warps=FORWARD_WARPS,
    )
    record_launch("relu_mul_stats_kernel")
    l1 = l1_part.sum() / (M * N)
    return gate, h, l1, token_part.sum(0, dtype=torch.int32), neuron_part.sum(0, dtype=torch.int32)


def _torch_backward(
    grad_h: torch.Tensor,
    grad_l1: torch.Tensor | None,
    gate: torch.Tensor,
    up: torch.Tensor | None,
    hidden: bool,
    up_relu: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    M, N = gate.shape
    compute = _backend.compute_dtype(gate.dtype)
    g = grad_h.to(compute)
    gate_up = gate
    if up is not None and up_relu:  # relu's slope on d_up, relu(up) for up
        gate_up, up = torch.where(up > 0, gate, 0), torch.relu(up)
    gate_grad = grad_l1.to(l1_dtype(gate.dtype)) / max(M * N, 1) if grad_l1 is not None else None
    on_h = gate_grad is not None and hidden and up is not None
    if on_h:  # |h|'s gradient joins h's: sign(h) = sign(up) where the gate fired
        g = g + gate_grad * torch.sign(up.to(compute))
    d_up = (g * gate_up.to(compute)).to(gate.dtype) if up is not None else None
    if up is not None:
        g = g * up.to(compute)
    if gate_grad is not None and not on_h:
        g = g + gate_grad
    return torch.where(gate != 0, g, 0).to(gate.dtype), d_up


def relu_mul_backward(
    grad_h: torch.Tensor,
    grad_l1: torch.Tensor | None,
    gate: torch.Tensor,
    up: torch.Tensor | None,
    hidden: bool = False,
    up_relu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradients of :func:`relu_mul_stats`'s (h, l1) w.r.t. (pre, up): grad_h [M, N] (h's; the non-gated block:
    h_gate's), grad_l1 0-dim (None: the loss has no L1 term), gate = h_gate and up [M, N] as the forward returned and
    took them (up None: non-gated). Returns d_pre = (grad_h * up + grad_l1 / (M * N)) where gate != 0 (fired, NaN
    included), else 0, and d_up = grad_h * gate (None without up), [M, N] each. ``hidden`` (the forward's l1 on h):
    grad_h + grad_l1 / (M * N) * sign(up) in both products instead. ``up_relu`` (dReLU): relu(up) for up, and d_up
    zero where up <= 0 (relu's slope, as torch takes it). FATReLU needs nothing here: its gate differentiates to 1
    where it fired, and gate != 0 is where it fired."""
    grad_h = grad_h.to(gate.dtype).contiguous()  # on either path, as in the forward
    gate = gate.contiguous()
    up = up.contiguous() if up is not None else None
    if _exact_torch(gate):
        return _torch_backward(grad_h, grad_l1, gate, up, hidden, up_relu)
    n = gate.numel()
    d_pre = new_output(gate.shape, gate.dtype, gate.device)
    d_up = new_output(gate.shape, gate.dtype, gate.device) if up is not None else None
    block = streaming_block(n, gate.element_size(), gate.device, _INTERPRET_BACKWARD_BLOCK)
    relu_mul_backward_kernel[(cdiv(n, block),)](
        grad_h,
        gate,
        up if up is not None else gate,
        grad_l1 if grad_l1 is not None else gate,
        d_pre,
        d_up if d_up is not None else d_pre,
        n,
        float(n),
        HAS_UP=up is not None,
        HAS_L1=grad_l1 is not None,
        HIDDEN=hidden,
        UP_RELU=up_relu and up is not None,
        BLOCK=block,
        num_warps=STREAMING_WARPS,
    )
    record_launch("relu_mul_backward_kernel")
    return d_pre, d_up
