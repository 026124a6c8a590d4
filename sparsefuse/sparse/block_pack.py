"""Kept storage for the factors of a row-block sparse layer between its forward and backward passes.

A :class:`~sparsefuse.sparse.BlockELL` lays each block of rows out at the full width (the largest union it could
have): ``M * width`` values, of which a trained sparse layer fills ~13%. Keeping two such arrays per layer until the
backward would cost half of what a dense layer keeps. :func:`pack_block_factors` copies the filled slots of the
gate and up factors into flat arrays of a fixed ``capacity`` (block b at ``offsets[b]``, its ``block_rows x
counts[b]`` values row after row); :func:`unpack_block_factors` lays them out again for the backward.

The capacity is chosen on the host before the union sizes are known (no host sync), so a batch can need more. A block
that does not fit is **not dropped**: it is marked (``offsets[b] + block_rows * counts[b] > capacity``, known on the
device to both passes) and the unpack pass recomputes its factors from the layer's input and weights --
``relu(x W_g^T + b_g)`` and ``x W_u^T + b_u`` on the block's union, on tensor cores -- together with its firing counts
per column, which the backward's transpose needs to match the recomputed values. A counter of such blocks is
kept on the device (:func:`spilled_blocks`), read only when the user asks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import _backend
from .._backend import Backend, backend_for, new_output, record_launch
from .._triton.dot import gathered_rows_dot, ieee_fp32
from .._triton.slots import block_slots
from .._validation import unit_last_stride
from .block_grad import column_count_table

_SPILLED: dict[torch.device, torch.Tensor] = {}


def spilled_blocks(device: torch.device | str) -> torch.Tensor:
    """0-dim int64 device tensor: row blocks whose factors did not fit their packed capacity (and were recomputed in
    the backward) since the process started on this device. Reading its value is a host sync: read it when logging,
    not every step. Call once before capturing a CUDA graph, so that the counter is not graph-private."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _SPILLED:
        _SPILLED[device] = torch.zeros((), dtype=torch.int64, device=device)
    return _SPILLED[device]


class PackedFactors(NamedTuple):
    """What :func:`pack_block_factors` returns: ``gate`` and ``up`` [capacity] (x's dtype) and ``offsets``
    [n_blocks + 1] int64 (block b's values start at ``offsets[b]``; it fits iff ``offsets[b + 1] <= capacity``)."""

    gate: torch.Tensor
    up: torch.Tensor
    offsets: torch.Tensor


def block_offsets(counts: torch.Tensor, block_rows: int) -> torch.Tensor:
    """[n_blocks + 1] int64: where each block's ``block_rows x counts[b]`` values start in the packed arrays."""
    offsets = torch.zeros(counts.shape[0] + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts.to(torch.int64) * block_rows, 0, out=offsets[1:])
    return offsets


@triton.jit
def block_pack_kernel(
    gate_ptr,
    up_ptr,
    counts_ptr,
    offsets_ptr,
    packed_gate_ptr,
    packed_up_ptr,
    spilled_ptr,
    M,
    width,
    capacity,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_UP: tl.constexpr,
):
    # gate, up [M, width] (BlockELL slots), counts [n_blocks], offsets [n_blocks + 1] int64 -> packed [capacity]:
    # block blk's slot (r, p) at offsets[blk] + r * counts[blk] + p. Program (c, blk): slots [c * BLOCK_C, ...).
    chunk = tl.program_id(0)
    block = tl.program_id(1)
    count = tl.load(counts_ptr + block)
    end = tl.load(offsets_ptr + block + 1)
    fits = end <= capacity
    if (chunk == 0) & (end > capacity) & (count > 0):
        tl.atomic_add(spilled_ptr, 1)  # integer: the same total in any order
    if fits & (chunk * BLOCK_C < count):
        start = tl.load(offsets_ptr + block)
        p, _, _, local, _, _, mask, src = block_slots(
            counts_ptr, counts_ptr, block, chunk, count, M, width, BLOCK_ROWS, BLOCK_C, False, False
        )  # no columns or rows: a copy
        dst = start + local[:, None] * count + p[None, :]
        tl.store(packed_gate_ptr + dst, tl.load(gate_ptr + src, mask=mask), mask=mask)
        if HAS_UP:
            tl.store(packed_up_ptr + dst, tl.load(up_ptr + src, mask=mask), mask=mask)


def _chunk() -> int:
    return 16 if _backend.INTERPRET else 128


def pack_block_factors(
    gate: torch.Tensor,
    up: torch.Tensor | None,
    counts: torch.Tensor,
    block_rows: int,
    capacity: int,
    offsets: torch.Tensor | None = None,
) -> PackedFactors:
    """Copy the filled slots of ``gate`` and ``up`` ([M, width], one :class:`~sparsefuse.sparse.BlockELL` layout with
    union sizes ``counts`` [n_blocks] int32) into arrays of ``capacity`` values each; blocks past the capacity are
    counted in :func:`spilled_blocks` and left for :func:`unpack_block_factors` to recompute. No host sync.
    ``up=None`` (a non-gated layer): only the gate is kept; the returned ``up`` is empty. ``offsets``: the
    :func:`block_offsets` of these counts when already computed (e.g. by
    :func:`~sparsefuse.sparse.block_spmm.heavy_first_schedule_and_offsets`)."""
    M, width = gate.shape
    offsets = block_offsets(counts, block_rows) if offsets is None else offsets
    up_packed = new_output((capacity if up is not None else 0,), gate.dtype, gate.device)
    packed = PackedFactors(new_output((capacity,), gate.dtype, gate.device), up_packed, offsets)
    if M == 0 or counts.shape[0] == 0:
        return packed
    if backend_for(gate) is Backend.TORCH:
        raise NotImplementedError("pack_block_factors runs on the GPU or the Triton interpreter")
    block_c = _chunk()
    block_pack_kernel[(triton.cdiv(width, block_c), counts.shape[0])](
        gate, up if up is not None else gate, counts, offsets, packed.gate, packed.up, spilled_blocks(gate.device),
        M, width, capacity, BLOCK_ROWS=block_rows, BLOCK_C=block_c, HAS_UP=up is not None, num_warps=4,
    )  # fmt: skip
    record_launch("block_pack_kernel")
    return packed


@triton.jit
def block_unpack_kernel(
    packed_gate_ptr,
    packed_up_ptr,
    offsets_ptr,
    indices_ptr,
    counts_ptr,
    order_ptr,
    x_ptr,
    w_gate_ptr,
    b_gate_ptr,
    w_up_ptr,
    b_up_ptr,
    gate_ptr,
    up_ptr,
    column_counts_ptr,
    M,
    N,
    K,
    width,
    capacity,
    stride_x,
    stride_wg,
    stride_wu,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    HAS_B_GATE: tl.constexpr,
    HAS_B_UP: tl.constexpr,
    HAS_UP: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    # The inverse of block_pack_kernel into gate, up [M, width]; a block past the capacity is recomputed instead:
    # gate = relu(round(x[rows] @ w_gate[cols]^T + b_gate)), up = x[rows] @ w_up[cols]^T + b_up (x [M, K], weights
    # [N, K]), and its fired counts per column (gate != 0, as the transpose counts them) to column_counts[blk, cols]
    # ([n_blocks, N], any integer dtype).
    chunk = tl.program_id(0)
    block = tl.program_id(1)
    count = tl.load(counts_ptr + block)
    if chunk * BLOCK_C < count:
        start = tl.load(offsets_ptr + block)
        end = tl.load(offsets_ptr + block + 1)
        if end <= capacity:  # a copy: the block's columns and rows are not read
            # (names unused here differ from the other branch's: the compiler types a name across both branches)
            p, _copy_p_mask, _copy_cols, local, _copy_rows, _copy_row_mask, mask, dst = block_slots(
                indices_ptr, order_ptr, block, chunk, count, M, width, BLOCK_ROWS, BLOCK_C, False, False
            )
            src = start + local[:, None] * count + p[None, :]
            tl.store(gate_ptr + dst, tl.load(packed_gate_ptr + src, mask=mask), mask=mask)
            if HAS_UP:
                tl.store(up_ptr + dst, tl.load(packed_up_ptr + src, mask=mask), mask=mask)
        else:
            _recompute_p, p_mask, cols, _recompute_local, rows, row_mask, mask, dst = block_slots(
                indices_ptr, order_ptr, block, chunk, count, M, width, BLOCK_ROWS, BLOCK_C, True, HAS_ORDER
            )
            x_rows_ptr = x_ptr + rows[:, None].to(tl.int64) * stride_x
            wg_rows_ptr = w_gate_ptr + cols[None, :].to(tl.int64) * stride_wg
            acc_g = tl.zeros([BLOCK_ROWS, BLOCK_C], dtype=tl.float32)
            acc_g = gathered_rows_dot(acc_g, x_rows_ptr, row_mask, wg_rows_ptr, p_mask, K, BLOCK_K, IEEE_FP32)
            acc_u = tl.zeros([BLOCK_ROWS, BLOCK_C], dtype=tl.float32)
            if HAS_UP:
                wu_rows_ptr = w_up_ptr + cols[None, :].to(tl.int64) * stride_wu
                acc_u = gathered_rows_dot(acc_u, x_rows_ptr, row_mask, wu_rows_ptr, p_mask, K, BLOCK_K, IEEE_FP32)
            if HAS_B_GATE:
                acc_g += tl.load(b_gate_ptr + cols, mask=p_mask, other=0.0).to(tl.float32)[None, :]
            if HAS_B_UP:
                acc_u += tl.load(b_up_ptr + cols, mask=p_mask, other=0.0).to(tl.float32)[None, :]
            pre = acc_g.to(gate_ptr.dtype.element_ty)  # rounded as the forward's gate product was
            gate = tl.where((pre > 0) | (pre != pre), pre, 0.0).to(gate_ptr.dtype.element_ty)
            tl.store(gate_ptr + dst, gate, mask=mask)
            if HAS_UP:
                tl.store(up_ptr + dst, acc_u.to(up_ptr.dtype.element_ty), mask=mask)
            fired = ((gate != 0) & mask).to(tl.int32)
            tl.store(column_counts_ptr + block.to(tl.int64) * N + cols, tl.sum(fired, axis=0), mask=p_mask)


def unpack_block_factors(
    packed: PackedFactors,
    indices: torch.Tensor,
    counts: torch.Tensor,
    order: torch.Tensor | None,
    column_counts: torch.Tensor,
    block_rows: int,
    x: torch.Tensor,
    w_gate: torch.Tensor,
    b_gate: torch.Tensor | None,
    w_up: torch.Tensor | None,
    b_up: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(gate, up [M, width] on the BlockELL slots of ``indices`` [n_blocks, width] / ``counts`` / ``order``, column
    counts) from :func:`pack_block_factors`' arrays, in their dtype. Blocks past the capacity are recomputed from
    x [M, K] and the weights [N, K] (biases [N] or None) and recounted from the recomputed gate. No host sync.
    ``w_up=None`` (a non-gated layer, packed without an up factor): up is None.

    The column counts come back as :func:`~sparsefuse.sparse.block_grad.column_count_table` lays out the forward's
    ``column_counts`` [n_blocks, N] (left unchanged), the recounted blocks' rows corrected: what
    :func:`~sparsefuse.sparse.block_ell_transpose` takes as ``count_table``. Whether a block was recomputed is known
    only on the device, so the recounts need a table of their own on every call: this is the int64 table that the
    transpose's prefix sums then run in, in place, rather than a copy of the counts beside it."""
    x, w_gate, b_gate, w_up, b_up = (
        unit_last_stride(t) for t in (x, w_gate, b_gate, w_up, b_up)
    )  # read at unit stride
    M, width = x.shape[0], indices.shape[1]
    N, K = w_gate.shape
    dtype, device = packed.gate.dtype, packed.gate.device
    has_up = w_up is not None
    gate = new_output((M, width), dtype, device)
    up = new_output((M, width), dtype, device) if has_up else None
    table = column_count_table(column_counts)
    if M == 0 or counts.shape[0] == 0:
        return gate, up, table
    if backend_for(x) is Backend.TORCH:
        raise NotImplementedError("unpack_block_factors runs on the GPU or the Triton interpreter")
    block_c, block_k, warps, stages = (16, 32, 4, 1) if _backend.INTERPRET else (64, 64, 4, 2)
    block_unpack_kernel[(triton.cdiv(width, block_c), counts.shape[0])](
        packed.gate, packed.up, packed.offsets, indices, counts, order if order is not None else counts,
        x, w_gate, b_gate if b_gate is not None else w_gate, w_up if has_up else w_gate,
        b_up if b_up is not None else w_gate, gate, up if has_up else gate, table[1:], M, N, K, width,
        packed.gate.shape[0], x.stride(0), w_gate.stride(0), w_up.stride(0) if has_up else 0,
        BLOCK_ROWS=block_rows, BLOCK_C=block_c, BLOCK_K=block_k, HAS_ORDER=order is not None,
        HAS_B_GATE=b_gate is not None, HAS_B_UP=b_up is not None, HAS_UP=has_up, IEEE_FP32=ieee_fp32(x.dtype),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    record_launch("block_unpack_kernel")
    return gate, up, table


__all__ = ["PackedFactors", "block_offsets", "pack_block_factors", "unpack_block_factors", "spilled_blocks"]
