"""The dense step of ``hybrid_mlp`` (``layout="dense"``, or ``"auto"`` once the gate fires widely): plain cuBLAS
products, with the ReLU, the L1 term and the firing counts fused into one pass over the gate pre-activations
(``sparsefuse::relu_l1``) and the L1 gradient folded into the ReLU's backward pass -- so the step costs what the
dense block costs, not that plus the separate sum, compare and count passes plain torch ops would add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ... import _backend
from ..._backend import Backend, backend_for, on_tensor_device, record_launch

MAX_GROUPS = 512  # row groups of relu_stats_kernel: its per-neuron partial counts are [MAX_GROUPS, N] at most


@triton.jit
def relu_stats_kernel(
    pre_ptr,
    h_ptr,
    l1_part_ptr,
    token_part_ptr,
    neuron_part_ptr,
    M,
    N,
    chunks_per_program,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # pre [M, N] (contiguous) -> h = relu(pre) (NaN kept, as torch.relu), and partial statistics of the fired
    # entries (pre > 0 or NaN), reduced by the host code in a fixed order (no atomics: the same result every run):
    # relu(pre)'s sum to l1_part[g, c] (fp32), each row's count to token_part[c, rows], each column's to
    # neuron_part[g, cols]. Program (c, g): column chunk c, row chunks g * chunks_per_program ...
    chunk = tl.program_id(0)
    group = tl.program_id(1)
    cols = chunk * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < N
    total = tl.zeros([ROWS], dtype=tl.float32)
    per_col = tl.zeros([BLOCK_C], dtype=tl.int32)
    for row_chunk in range(group * chunks_per_program, (group + 1) * chunks_per_program):
        rows = row_chunk * ROWS + tl.arange(0, ROWS)
        row_mask = rows < M
        offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
        v = tl.load(pre_ptr + offsets, mask=mask, other=0.0)
        fired = (v > 0) | (v != v)
        h = tl.where(fired, v, 0.0)
        tl.store(h_ptr + offsets, h, mask=mask)
        total += tl.sum(h.to(tl.float32), axis=1)
        fired = fired.to(tl.int32)
        per_col += tl.sum(fired, axis=0)
        tl.store(token_part_ptr + chunk.to(tl.int64) * M + rows, tl.sum(fired, axis=1), mask=row_mask)
    tl.store(l1_part_ptr + group * tl.num_programs(0) + chunk, tl.sum(total, axis=0))
    tl.store(neuron_part_ptr + group.to(tl.int64) * N + cols, per_col, mask=col_mask)


@triton.jit
def relu_l1_backward_kernel(h_ptr, grad_h_ptr, gate_grad_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # out = (grad_h + gate_grad) where h != 0 (fired, NaN included), else 0: the ReLU's backward with the L1
    # term's gradient added on the fired entries, one pass.
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    h = tl.load(h_ptr + i, mask=mask, other=0.0)
    g = tl.load(grad_h_ptr + i, mask=mask, other=0.0).to(tl.float32)
    out = tl.where(h != 0, g + tl.load(gate_grad_ptr), 0.0)
    tl.store(out_ptr + i, out.to(out_ptr.dtype.element_ty), mask=mask)


def _l1_dtype(pre: torch.Tensor) -> torch.dtype:
    return torch.float64 if pre.dtype == torch.float64 else torch.float32


@torch.library.custom_op("sparsefuse::relu_l1", mutates_args=())
@on_tensor_device
def relu_l1_op(pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """pre [M, N] -> (relu(pre), l1 = sum(relu(pre)) / (M * N) as 0-dim fp32 (float64 for float64 pre: gradient
    checks), fired count per row [M] and per column [N], int32)."""
    M, N = pre.shape
    if M == 0 or N == 0 or pre.dtype == torch.float64 or backend_for(pre) is Backend.TORCH:
        fired = (pre > 0) | pre.isnan()
        h = torch.where(fired, pre, 0)
        l1 = h.sum(dtype=_l1_dtype(pre)) / max(M * N, 1)
        return h, l1, fired.sum(1, dtype=torch.int32), fired.sum(0, dtype=torch.int32)
    pre = pre.contiguous()
    h = torch.empty_like(pre)
    rows, block_c = (4, 32) if _backend.INTERPRET else (16, 512)
    per_program = triton.cdiv(triton.cdiv(M, rows), MAX_GROUPS)
    grid = (triton.cdiv(N, block_c), triton.cdiv(triton.cdiv(M, rows), per_program))
    l1_part = torch.empty(grid[1], grid[0], dtype=torch.float32, device=pre.device)
    token_part = torch.empty(grid[0], M, dtype=torch.int32, device=pre.device)
    neuron_part = torch.empty(grid[1], N, dtype=torch.int32, device=pre.device)
    relu_stats_kernel[grid](
        pre, h, l1_part, token_part, neuron_part, M, N, per_program, ROWS=rows, BLOCK_C=block_c, num_warps=8
    )
    record_launch("relu_stats_kernel")
    l1 = l1_part.sum() / (M * N)
    return h, l1, token_part.sum(0, dtype=torch.int32), neuron_part.sum(0, dtype=torch.int32)


@relu_l1_op.register_fake
def _(pre):
    M, N = pre.shape
    counts = lambda n: torch.empty(n, dtype=torch.int32, device=pre.device)  # noqa: E731
    return torch.empty_like(pre), torch.empty((), dtype=_l1_dtype(pre), device=pre.device), counts(M), counts(N)


@torch.library.custom_op("sparsefuse::relu_l1_backward", mutates_args=())
@on_tensor_device
def relu_l1_backward_op(h: torch.Tensor, grad_h: torch.Tensor, grad_l1: torch.Tensor) -> torch.Tensor:
    """The gradient w.r.t. pre of ``relu_l1``'s (h, l1) outputs: ``(grad_h + grad_l1 / (M * N)) * [h != 0]``."""
    M, N = h.shape
    gate_grad = (grad_l1.to(_l1_dtype(h)) / max(M * N, 1)).reshape(1)
    if h.numel() == 0 or h.dtype == torch.float64 or backend_for(h) is Backend.TORCH:
        return torch.where(h != 0, grad_h.to(gate_grad.dtype) + gate_grad, 0).to(h.dtype)
    grad_h = grad_h.to(h.dtype).contiguous()
    out = torch.empty_like(h)
    block = 1024 if _backend.INTERPRET else 4096
    relu_l1_backward_kernel[(triton.cdiv(h.numel(), block),)](h, grad_h, gate_grad, out, h.numel(), BLOCK=block)
    record_launch("relu_l1_backward_kernel")
    return out


@relu_l1_backward_op.register_fake
def _(h, grad_h, grad_l1):
    return torch.empty_like(h)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[0])


def _backward(ctx, grad_h, grad_l1, *unused):
    (h,) = ctx.saved_tensors
    if grad_h is None:
        grad_h = torch.zeros_like(h)
    if grad_l1 is None:
        grad_l1 = torch.zeros((), dtype=_l1_dtype(h), device=h.device)
    return relu_l1_backward_op(h, grad_h, grad_l1)


relu_l1_op.register_autograd(_backward, setup_context=_setup)


def dense_step(x2, w_gate, b_gate, w_up, b_up, w_down, b_down):
    """The step with cuBLAS products (autograd through them): (y [M, K], l1, token counts [M], neuron counts
    [N]). ``w_up=None``: the non-gated block."""
    h_gate, l1, token_counts, neuron_counts = relu_l1_op(F.linear(x2, w_gate, b_gate))
    h = h_gate * F.linear(x2, w_up, b_up) if w_up is not None else h_gate
    y = F.linear(h, w_down, b_down)
    return y, l1, token_counts, neuron_counts
