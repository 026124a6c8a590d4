"""The block step's FATReLU and dReLU gates (``hybrid_mlp(activation=...)``) on the row-block unions the step already
walks: the shared core's products take a ReLU gate, and these passes turn its factors into the other gates' on the
unions' slots alone (no [M, N] pass).

* FATReLU needs nothing in the forward: the gate's pre-activations at or below the threshold are zeroed before the
  unions are found (``F.threshold``, in place), so the core's ReLU sees FATReLU's values. In the backward,
  ``block_gate_fix_kernel`` (``FAT``) applies the threshold to the unpacked gate again: a block past the kept
  capacity is recomputed there with the core's ReLU, and its values in (0, threshold] are zeroed and taken off the
  count table that the transpose of the weight gradients reads.
* dReLU keeps the gate's unions (the gate's L1 term has a gradient wherever the gate fired, up > 0 or not).
  ``block_drelu_forward_kernel`` relus the up factor and zeroes h where up <= 0; in the backward
  ``block_gate_fix_kernel`` (``UP_RELU``) relus a recomputed block's up factor, and ``block_drelu_grad_kernel`` zeroes
  dh_u where up <= 0 (relu's slope, as torch takes it). With the up factor relu'd, the core's backward then gives
  dpre = (dh * relu(up) + c) where the gate fired, the hidden term's sign(h) = sign(relu(up)).

A NaN up value is kept (as ``torch.relu`` keeps it) and gets no gradient; a NaN gate value stays fired.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ..._backend import record_launch
from ..._jit import kernel
from ..._triton.slots import block_slots, load_slots, offsets_fit_32, slot_offsets, store_slots, union_chunk
from ..twell.reference import threshold_in
from .block_l1 import WARPS, slot_pass_grid


@kernel
def block_drelu_forward_kernel(
    up_ptr,
    values_ptr,
    counts_ptr,
    M,
    width,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    OFFSETS_32: tl.constexpr,
):
    # up (the up factor), values (h = gate * up, rounded once) [M, width] on BlockELL slots, updated in place:
    # up <- relu(up), h <- 0 where up <= 0. counts [n_blocks]: the union sizes. Program (chunk, blk).
    chunk, block, count, live = union_chunk(counts_ptr, BLOCK_C)
    if live:
        mask, flat = slot_offsets(block, chunk, count, M, width, BLOCK_ROWS, BLOCK_C, OFFSETS_32)
        up = load_slots(up_ptr, flat, mask)  # [BLOCK_ROWS, BLOCK_C]
        h = load_slots(values_ptr, flat, mask)
        off = up <= 0
        store_slots(up_ptr, flat, tl.where(off, 0.0, up), mask)
        store_slots(values_ptr, flat, tl.where(off, 0.0, h), mask)


@kernel
def block_gate_fix_kernel(
    gate_ptr,
    up_ptr,
    indices_ptr,
    counts_ptr,
    table_ptr,
    M,
    N,
    width,
    threshold,
    FAT: tl.constexpr,
    UP_RELU: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    OFFSETS_32: tl.constexpr,
):
    # gate, up [M, width] on BlockELL slots (indices [n_blocks, width], counts [n_blocks]) as unpacked, in place.
    # FAT: gate <- 0 where 0 < gate <= threshold (fp32: the largest value of the dtype <= FATReLU's), and the count
    # table [n_blocks + 1, N] (int64, block b's non-zeros per column in row b + 1) less the values zeroed. UP_RELU:
    # up <- relu(up).
    chunk, block, count, live = union_chunk(counts_ptr, BLOCK_C)
    if live:
        _, p_mask, cols, _, _, _, mask, flat = block_slots(
            indices_ptr, None, block, chunk, count, M, width, BLOCK_ROWS, BLOCK_C, FAT, False, OFFSETS_32
        )
        if FAT:
            gate = load_slots(gate_ptr, flat, mask)  # [BLOCK_ROWS, BLOCK_C]
            drop = (gate != 0) & (gate <= threshold) & mask
            store_slots(gate_ptr, flat, tl.where(drop, 0.0, gate), mask)
            at = table_ptr + (block + 1).to(tl.int64) * N + cols  # [BLOCK_C]: a union's columns are distinct
            dropped = tl.sum(drop.to(tl.int64), axis=0)
            tl.store(at, tl.load(at, mask=p_mask, other=0) - dropped, mask=p_mask)
        if UP_RELU:
            up = load_slots(up_ptr, flat, mask)
            store_slots(up_ptr, flat, tl.where(up <= 0, 0.0, up), mask)


@kernel
def block_drelu_grad_kernel(
    up_ptr,
    d_up_ptr,
    counts_ptr,
    M,
    width,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    OFFSETS_32: tl.constexpr,
):
    # up (relu'd), d_up [M, width] on BlockELL slots: d_up <- 0 where up <= 0 (NaN included), in place.
    chunk, block, count, live = union_chunk(counts_ptr, BLOCK_C)
    if live:
        mask, flat = slot_offsets(block, chunk, count, M, width, BLOCK_ROWS, BLOCK_C, OFFSETS_32)
        up = load_slots(up_ptr, flat, mask)
        d_up = load_slots(d_up_ptr, flat, mask)
        store_slots(d_up_ptr, flat, tl.where(up > 0, d_up, 0.0), mask)


def drelu_forward(up: torch.Tensor, values: torch.Tensor, counts: torch.Tensor, block_rows: int) -> None:
    """dReLU's factors from the core's ReLU ones, in place: up [M, width] <- relu(up), h [M, width] <- 0 where
    up <= 0, on the BlockELL slots of ``counts`` [n_blocks] (``block_rows`` slot rows each)."""
    launch = slot_pass_grid(up, counts)
    if launch is None:
        return
    block_c, grid = launch
    block_drelu_forward_kernel[grid](
        up, values, counts, up.shape[0], up.shape[1],
        BLOCK_ROWS=block_rows, BLOCK_C=block_c, OFFSETS_32=offsets_fit_32(up), num_warps=WARPS,
    )  # fmt: skip
    record_launch("block_drelu_forward_kernel")


def fix_unpacked(
    gate: torch.Tensor,
    up: torch.Tensor | None,
    indices: torch.Tensor,
    counts: torch.Tensor,
    table: torch.Tensor,
    block_rows: int,
    activation: str,
    threshold: float,
) -> None:
    """The unpacked factors (``unpack_block_factors``' gate, up [M, width] and count ``table``) of a FATReLU or dReLU
    step made the gate's, in place: a block recomputed past the capacity came back with the core's ReLU gate and raw
    up factor (kept blocks are unchanged by this)."""
    fat, up_relu = activation == "fatrelu" and threshold > 0, activation == "drelu" and up is not None
    launch = slot_pass_grid(gate, counts)
    if launch is None or not (fat or up_relu):
        return
    block_c, grid = launch
    block_gate_fix_kernel[grid](
        gate, up if up is not None else gate, indices, counts, table, gate.shape[0], table.shape[1], gate.shape[1],
        threshold_in(gate.dtype, threshold) if fat else 0.0,
        FAT=fat, UP_RELU=up_relu, BLOCK_ROWS=block_rows, BLOCK_C=block_c, OFFSETS_32=offsets_fit_32(gate),
        num_warps=WARPS,
    )  # fmt: skip
    record_launch("block_gate_fix_kernel")


def drelu_up_grad(up: torch.Tensor, d_up: torch.Tensor, counts: torch.Tensor, block_rows: int) -> None:
    """dReLU's dh_u: ``d_up`` [M, width] (dh * gate, from the core's backward) zeroed where the relu'd up factor
    ``up`` is not > 0, in place, on the BlockELL slots of ``counts``."""
    launch = slot_pass_grid(up, counts)
    if launch is None:
        return
    block_c, grid = launch
    block_drelu_grad_kernel[grid](
        up, d_up, counts, up.shape[0], up.shape[1],
        BLOCK_ROWS=block_rows, BLOCK_C=block_c, OFFSETS_32=offsets_fit_32(up), num_warps=WARPS,
    )  # fmt: skip
    record_launch("block_drelu_grad_kernel")
