"""The block step's L1 term on the hidden representation ``h = h_g * h_u`` (``hybrid_mlp(l1_on="hidden")``), on
the row-block unions the step already walks: no [M, N] pass and no [M, N] tensor.

* forward ``block_abs_sum_kernel``: ``sum(|h|) / (M * N)`` from the values of the up product on the unions (``h``
  as the forward's ``block_sddmm`` stored it, zero where the gate did not fire), a partial sum per program summed
  afterwards in a fixed order (no atomics: the same result every run);
* backward ``block_hidden_l1_grad_kernel``: adds the term's gradient to the two gradients that ``block_ell_sddmm``
  wrote on the same slots: ``c * sign(h_u) * h_g`` to ``dh_u`` and ``c * |h_u|`` to ``dpre`` where the gate fired,
  ``c = dl1 / (M * N)`` (``|h|``'s gradient ``c * sign(h)`` joined to ``dh`` before the chain rule; ``sign(h) =
  sign(h_u)`` where the gate fired).

Both read only the slots listed in each block's union (``counts``), as every other product of the step does.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ... import _backend
from ..._backend import cdiv, new_output, record_launch
from ..._jit import kernel
from ..._triton.slots import load_slots, offsets_fit_32, slot_offsets, store_slots, union_chunk

# Union slots per program: a [block_rows, BLOCK_C] elementwise tile (64 x 64 at 4 warps: 32 values a thread)
BLOCK_C = 64
WARPS = 4
_INTERPRET_BLOCK_C = 16  # the interpreter: several chunks per union in small CPU tests


@kernel
def block_abs_sum_kernel(
    values_ptr,
    counts_ptr,
    part_ptr,
    M,
    width,
    scale,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    OFFSETS_32: tl.constexpr,
):
    # values [M, width] on BlockELL slots (slot rows), counts [n_blocks]: the union sizes. Program (chunk, blk):
    # part[blk * n_chunks + chunk] = scale * sum(|values|) over the block's listed slots in the chunk (0 past them).
    chunk, block, count, live = union_chunk(counts_ptr, BLOCK_C)
    at = block * tl.num_programs(0) + chunk
    if live:
        mask, flat = slot_offsets(block, chunk, count, M, width, BLOCK_ROWS, BLOCK_C, OFFSETS_32)
        v = load_slots(values_ptr, flat, mask)  # [BLOCK_ROWS, BLOCK_C]
        tl.store(part_ptr + at, tl.sum(tl.sum(tl.abs(v), axis=1), axis=0) * scale)
    else:
        tl.store(part_ptr + at, 0.0)


@kernel
def block_hidden_l1_grad_kernel(
    gate_ptr,
    up_ptr,
    d_up_ptr,
    d_pre_ptr,
    counts_ptr,
    grad_ptr,
    divisor,
    M,
    width,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    OFFSETS_32: tl.constexpr,
):
    # gate, up (the forward's factors), d_up, d_pre (h's chain rule, updated in place) [M, width] on the same
    # BlockELL slots; grad: 1 element, the loss's gradient w.r.t. l1 = sum(|gate * up|) / divisor.
    chunk, block, count, live = union_chunk(counts_ptr, BLOCK_C)
    if live:
        mask, flat = slot_offsets(block, chunk, count, M, width, BLOCK_ROWS, BLOCK_C, OFFSETS_32)
        c = tl.math.div_rn(tl.load(grad_ptr).to(tl.float32), divisor)  # correctly rounded, as torch divides
        gate = load_slots(gate_ptr, flat, mask)
        up = load_slots(up_ptr, flat, mask)
        d_up = load_slots(d_up_ptr, flat, mask)
        d_pre = load_slots(d_pre_ptr, flat, mask)
        sign = tl.where(up > 0, 1.0, tl.where(up < 0, -1.0, 0.0))
        d_up += c * sign * gate  # 0 where the gate did not fire
        d_pre += tl.where(gate != 0, c * tl.abs(up), 0.0)
        store_slots(d_up_ptr, flat, d_up, mask)
        store_slots(d_pre_ptr, flat, d_pre, mask)


def slot_pass_grid(values: torch.Tensor, counts: torch.Tensor) -> tuple[int, tuple[int, int]] | None:
    """(BLOCK_C, grid) of an elementwise pass over the union slots of values [M, width] whose blocks list
    ``counts`` [n_blocks] columns each, or None when there is none (the L1 passes here, the gate passes of
    :mod:`.block_gates`)."""
    M, width = values.shape
    if M == 0 or counts.shape[0] == 0 or width == 0:
        return None
    block_c = _INTERPRET_BLOCK_C if _backend.INTERPRET else BLOCK_C
    return block_c, (cdiv(width, block_c), counts.shape[0])


def block_hidden_l1(values: torch.Tensor, counts: torch.Tensor, block_rows: int, n_cols: int) -> torch.Tensor:
    """``sum(|h|) / (M * n_cols)`` (0-dim fp32) for h given as values [M, width] on BlockELL slots whose blocks of
    ``block_rows`` slot rows list ``counts`` [n_blocks] columns each (the values past a block's count are not read)."""
    launch = slot_pass_grid(values, counts)
    if launch is None:
        return torch.zeros((), dtype=torch.float32, device=values.device)
    (block_c, grid), (M, width) = launch, values.shape
    part = new_output((grid[0] * grid[1],), torch.float32, values.device)
    block_abs_sum_kernel[grid](
        values,
        counts,
        part,
        M,
        width,
        1.0 / max(M * n_cols, 1),
        BLOCK_ROWS=block_rows,
        BLOCK_C=block_c,
        OFFSETS_32=offsets_fit_32(values),
        num_warps=WARPS,
    )
    record_launch("block_abs_sum_kernel")
    return part.sum()


def add_hidden_l1_grad(
    gate: torch.Tensor,
    up: torch.Tensor,
    d_up: torch.Tensor,
    d_pre: torch.Tensor,
    counts: torch.Tensor,
    dl1: torch.Tensor,
    block_rows: int,
    divisor: int,
) -> None:
    """Adds the gradient of ``l1 = sum(|gate * up|) / divisor`` (``dl1``: the loss's gradient w.r.t. it, 1 element)
    to ``d_up`` and ``d_pre`` in place: ``c * sign(up) * gate`` and ``c * |up|`` where ``gate != 0``, ``c = dl1 /
    divisor``. All four [M, width] on the BlockELL slots of ``counts`` [n_blocks] (``block_rows`` slot rows each)."""
    launch = slot_pass_grid(gate, counts)
    if launch is None:
        return
    (block_c, grid), (M, width) = launch, gate.shape
    block_hidden_l1_grad_kernel[grid](
        gate,
        up,
        d_up,
        d_pre,
        counts,
        dl1,
        float(max(divisor, 1)),
        M,
        width,
        BLOCK_ROWS=block_rows,
        BLOCK_C=block_c,
        OFFSETS_32=offsets_fit_32(gate),
        num_warps=WARPS,
    )
    record_launch("block_hidden_l1_grad_kernel")
