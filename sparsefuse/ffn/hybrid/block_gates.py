"""The block step's dReLU backward pass (``hybrid_mlp(activation="drelu")``) on the row-block unions the step
already walks. The other passes of the FATReLU and dReLU gates live in the shared core's kernels: the gate's
threshold where the unions are found and in the product's and the unpack's epilogues, dReLU's relu on the up
product in the same epilogues (:func:`sparsefuse.sparse.block_sddmm`,
:func:`sparsefuse.sparse.block_pack.unpack_block_factors`).

dReLU keeps the gate's unions (the gate's L1 term has a gradient wherever the gate fired, up > 0 or not); with the up
factor relu'd, the core's backward gives dpre = (dh * relu(up) + c) where the gate fired, the hidden term's sign(h) =
sign(relu(up)), and ``block_drelu_grad_kernel`` zeroes dh_u where up <= 0 (relu's slope, as torch takes it). A NaN up
value is kept (as ``torch.relu`` keeps it) and gets no gradient; a NaN gate value stays fired.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ..._backend import record_launch
from ..._jit import kernel
from ..._triton.slots import load_slots, offsets_fit_32, slot_offsets, store_slots, union_chunk
from .block_l1 import WARPS, slot_pass_grid


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
