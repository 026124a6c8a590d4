"""Kept storage for the factors of a row-block sparse layer between its forward and backward passes.

A :class:`~sparsefuse.sparse.BlockELL` lays each block of rows out at the full width (the largest union it could
have): ``M * width`` values, of which a trained sparse layer's unions fill ~13% and its gate's non-zeros ~0.5%.
:func:`pack_block_factors` keeps only the fired (row, slot) pairs: for each pair the gate and up values and where it
sits within its block's chunk of slots (2 bytes), in flat arrays of a fixed ``capacity`` of pairs, grouped by row
block and chunk of union slots (any order within a chunk). Every product of the backward reads the factors where
the gate fired and nowhere else (the up factor's gradient is the gate there, the gate's is zero where it did not
fire), so nothing else is needed; :func:`unpack_block_factors` lays the pairs out again on the unions' slots, zeros
between them.

The capacity is chosen on the host before the non-zeros are counted (no host sync), so a batch can need more. A block
that does not fit is **not dropped**: it is marked (its last chunk's end past ``capacity``, known on the device to
both passes) and the unpack pass recomputes its factors from the layer's input and weights --
``relu(x W_g^T + b_g)`` and ``x W_u^T + b_u`` on the block's union, on tensor cores. Either way the unpack pass
counts the gate's non-zeros per (block, column) again, from what it wrote, for the backward's transpose. A counter
of recomputed blocks is kept on the device (:func:`spilled_blocks`), read only when the user asks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import _backend
from .._backend import Backend, backend_for, cdiv, new_output, record_launch, threshold_in
from .._jit import kernel
from .._triton.dot import gathered_rows_dot, ieee_fp32
from .._triton.gates import fires, relu_keep_nan
from .._triton.slots import block_slots, union_chunk
from .._validation import unit_last_stride
from .sddmm import BlockFactors

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
    """What :func:`pack_block_factors` returns: ``gate`` and ``up`` [capacity] (the factors' dtype; ``up`` empty
    without an up factor), ``slots`` [capacity] int16 (each pair's ``row * chunk + slot`` within its block's chunk of
    union slots) and ``offsets`` [n_blocks * n_chunks + 1] int64: the pairs of block b's chunk c start at
    ``offsets[b * n_chunks + c]``; block b fits iff ``offsets[(b + 1) * n_chunks] <= capacity``. ``chunk``: the
    union slots per chunk the codes were written for (unpacking with any other would misread every code)."""

    gate: torch.Tensor
    up: torch.Tensor
    slots: torch.Tensor
    offsets: torch.Tensor
    chunk: int


@triton.jit
def _sum_before(values_ptr, end, SCAN: tl.constexpr):
    # sum of the int32 values [0, end), as int64
    total = tl.zeros([], dtype=tl.int64)
    for j0 in range(0, end, SCAN):
        j = j0 + tl.arange(0, SCAN)
        total += tl.sum(tl.load(values_ptr + j, mask=j < end, other=0).to(tl.int64), axis=0)
    return total


@kernel
def block_pack_kernel(
    gate_ptr,
    up_ptr,
    counts_ptr,
    chunk_nnz_ptr,
    block_nnz_ptr,
    packed_gate_ptr,
    packed_up_ptr,
    packed_slots_ptr,
    offsets_ptr,
    spilled_ptr,
    M,
    width,
    capacity,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SUB: tl.constexpr,
    SCAN: tl.constexpr,
    GIVEN_OFFSETS: tl.constexpr,
    HAS_UP: tl.constexpr,
):
    # gate, up [M, width] (BlockELL slots), counts [n_blocks] (union sizes), chunk_nnz [n_blocks, n_chunks] and
    # block_nnz [n_blocks] (the gate's non-zeros, as block_sddmm counted them with chunks of BLOCK_C slots) -> the
    # fired pairs of chunk c of block blk at offsets[blk * n_chunks + c] onwards (SUB slots at a time, row by row
    # within them). Program (c, blk).
    # GIVEN_OFFSETS: offsets [n_blocks * n_chunks + 1] already hold the running sum of chunk_nnz (the step's
    # schedule launch wrote them); else every program sums what comes before its chunk and writes its chunk's end.
    chunk = tl.program_id(0)
    block = tl.program_id(1)
    n_chunks = tl.num_programs(0)
    flat = block * n_chunks + chunk
    if GIVEN_OFFSETS:
        start = tl.load(offsets_ptr + flat)
        nnz = tl.load(offsets_ptr + flat + 1) - start
        block_start = tl.load(offsets_ptr + block * n_chunks)
        block_end = tl.load(offsets_ptr + (block + 1) * n_chunks)
    else:
        block_start = _sum_before(block_nnz_ptr, block, SCAN)
        block_end = block_start + tl.load(block_nnz_ptr + block)
        own = chunk_nnz_ptr + block * n_chunks
        start = block_start + _sum_before(own, chunk, SCAN)
        nnz = tl.load(own + chunk).to(tl.int64)
        tl.store(offsets_ptr + flat + 1, start + nnz)
        if flat == 0:
            tl.store(offsets_ptr, tl.zeros([], dtype=tl.int64))
    if (chunk == 0) & (block_end > capacity) & (block_end > block_start):
        tl.atomic_add(spilled_ptr, 1)  # integer: the same total in any order
    if (block_end <= capacity) & (nnz > 0):
        count = tl.load(counts_ptr + block)
        local = tl.arange(0, BLOCK_ROWS)
        row_mask = block * BLOCK_ROWS + local < M
        rows_ptr = block.to(tl.int64) * BLOCK_ROWS * width + local[:, None] * width  # [BLOCK_ROWS, 1]
        # SUB slots at a time (the order within a chunk is free: the unpack reads only each pair's code), which
        # keeps the [BLOCK_ROWS, SUB] tiles of addresses in registers
        for sub in tl.static_range(BLOCK_C // SUB):
            q = sub * SUB + tl.arange(0, SUB)  # [SUB] slots within the chunk
            p = chunk * BLOCK_C + q
            mask = row_mask[:, None] & (p < count)[None, :]
            src = rows_ptr + p[None, :]
            gate = tl.load(gate_ptr + src, mask=mask, other=0.0)
            fired = ((gate != 0) & mask).to(tl.int32)  # NaN counts, as block_sddmm counted it
            row_total = tl.sum(fired, axis=1)
            position = (tl.cumsum(row_total, axis=0) - row_total)[:, None] + (tl.cumsum(fired, axis=1) - fired)
            keep = fired != 0
            tl.store(packed_gate_ptr + start + position, gate, mask=keep)
            if HAS_UP:
                tl.store(packed_up_ptr + start + position, tl.load(up_ptr + src, mask=keep), mask=keep)
            code = local[:, None] * BLOCK_C + q[None, :]
            tl.store(packed_slots_ptr + start + position, code.to(tl.int16), mask=keep)
            start += tl.sum(row_total, axis=0)


def _check_codes(op: str, block_rows: int, chunk: int) -> None:
    if block_rows * chunk > 1 << 15:
        raise ValueError(f"{op}: {block_rows} rows x {chunk} slots a chunk do not fit the pairs' int16 codes")


def _scan() -> int:
    return 16 if _backend.INTERPRET else 1024


# launch shapes on a GPU, measured on an H200 at the 1.5B and 8B layer shapes: (pack warps, slots per step), (unpack
# BLOCK_K, pairs written per step, warps, stages)
PACK_CONFIG = (4, 32)
UNPACK_CONFIG = (64, 256, 4, 2)


def pack_block_factors(factors: BlockFactors, capacity: int, offsets: torch.Tensor | None = None) -> PackedFactors:
    """Keep the fired pairs of ``factors``' gate and up ([M, width] on one :class:`~sparsefuse.sparse.BlockELL`
    layout, as :func:`~sparsefuse.sparse.block_sddmm` returns them with ``factors``) in arrays of ``capacity`` pairs;
    blocks past the capacity are counted in :func:`spilled_blocks` and left for :func:`unpack_block_factors` to
    recompute. One launch, no host sync. Without an up factor (a non-gated layer) only the gate is kept; the
    returned ``up`` is empty. ``offsets`` [n_blocks * n_chunks + 1] int64: the running sum of ``factors.chunk_nnz``
    when already computed (e.g. by :func:`~sparsefuse.sparse.block_spmm.heavy_first_schedule_and_offsets` with
    ``parts``); the returned offsets are then that tensor."""
    gate, up, counts, block_rows = factors.gate.values, factors.up, factors.gate.counts, factors.gate.block_rows
    M, width = gate.shape
    n_blocks, n_chunks = factors.chunk_nnz.shape
    _check_codes("pack_block_factors", block_rows, factors.chunk)
    if offsets is not None and (offsets.dtype != torch.int64 or offsets.shape != (n_blocks * n_chunks + 1,)):
        raise ValueError(
            f"pack_block_factors: offsets must be [{n_blocks * n_chunks + 1}] int64 (one per chunk, and the total); "
            f"got {tuple(offsets.shape)} {offsets.dtype}"
        )
    packed = PackedFactors(
        new_output((capacity,), gate.dtype, gate.device),
        new_output((capacity if up is not None else 0,), gate.dtype, gate.device),
        new_output((capacity,), torch.int16, gate.device),
        offsets if offsets is not None else new_output((n_blocks * n_chunks + 1,), torch.int64, gate.device),
        factors.chunk,
    )
    if n_blocks * n_chunks == 0:
        if offsets is None:
            packed.offsets.zero_()
        return packed
    if backend_for(gate) is Backend.TORCH:
        raise NotImplementedError("pack_block_factors runs on the GPU or the Triton interpreter")
    warps, sub = (4, factors.chunk // 2) if _backend.INTERPRET else PACK_CONFIG  # interpreted: the loop runs twice
    block_pack_kernel[(n_chunks, n_blocks)](
        gate, up.values if up is not None else gate, counts, factors.chunk_nnz, factors.block_nnz, packed.gate,
        packed.up, packed.slots, packed.offsets, spilled_blocks(gate.device), M, width, capacity,
        BLOCK_ROWS=block_rows, BLOCK_C=factors.chunk, SUB=min(sub, factors.chunk), SCAN=_scan(),
        GIVEN_OFFSETS=offsets is not None, HAS_UP=up is not None, num_warps=warps,
    )  # fmt: skip
    record_launch("block_pack_kernel")
    return packed


@kernel
def block_unpack_kernel(
    packed_gate_ptr,
    packed_up_ptr,
    packed_slots_ptr,
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
    SCATTER: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    HAS_B_GATE: tl.constexpr,
    HAS_B_UP: tl.constexpr,
    HAS_UP: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    threshold=0.0,
    UP_RELU: tl.constexpr = False,
):
    # The inverse of block_pack_kernel into gate, up [M, width]: the chunk's slots zeroed, then its pairs written.
    # A block past the capacity is recomputed instead: gate = round(x[rows] @ w_gate[cols]^T + b_gate) where it is
    # > threshold (0: ReLU; FATReLU's above) or NaN, else 0; up = x[rows] @ w_up[cols]^T + b_up (x [M, K], weights
    # [N, K]), relu'd with UP_RELU (dReLU; NaN kept): the gate and up factors the forward kept. Either way the
    # gate's non-zeros per column of the chunk (NaN counts, as the transpose counts them) go to
    # column_counts[blk, cols] ([n_blocks, N], any integer dtype; left untouched elsewhere).
    chunk, block, count, live = union_chunk(counts_ptr, BLOCK_C)
    n_chunks = tl.num_programs(0)
    if live:
        p, p_mask, cols, _, rows, row_mask, mask, dst = block_slots(
            indices_ptr, order_ptr, block, chunk, count, M, width, BLOCK_ROWS, BLOCK_C, True, HAS_ORDER
        )
        if tl.load(offsets_ptr + (block + 1) * n_chunks) <= capacity:
            tl.store(gate_ptr + dst, tl.zeros([BLOCK_ROWS, BLOCK_C], dtype=gate_ptr.dtype.element_ty), mask=mask)
            if HAS_UP:
                tl.store(up_ptr + dst, tl.zeros([BLOCK_ROWS, BLOCK_C], dtype=up_ptr.dtype.element_ty), mask=mask)
            tl.debug_barrier()  # the zeros land before the pairs that overwrite some of them
            base = block.to(tl.int64) * BLOCK_ROWS * width + chunk * BLOCK_C
            lo = tl.load(offsets_ptr + block * n_chunks + chunk)
            hi = tl.load(offsets_ptr + block * n_chunks + chunk + 1)
            for e0 in range(lo, hi, SCATTER):
                e = e0 + tl.arange(0, SCATTER)
                e_mask = e < hi
                code = tl.load(packed_slots_ptr + e, mask=e_mask, other=0).to(tl.int32)
                e_mask &= (code >= 0) & (code < BLOCK_ROWS * BLOCK_C)  # never outside the chunk's own slots
                to = base + (code // BLOCK_C) * width + code % BLOCK_C
                tl.store(gate_ptr + to, tl.load(packed_gate_ptr + e, mask=e_mask), mask=e_mask)
                if HAS_UP:
                    tl.store(up_ptr + to, tl.load(packed_up_ptr + e, mask=e_mask), mask=e_mask)
            tl.debug_barrier()  # the counts below read the chunk as written
            gate = tl.load(gate_ptr + dst, mask=mask, other=0.0)
        else:
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
            pre = acc_g.to(gate_ptr.dtype.element_ty).to(tl.float32)  # rounded as the forward's gate product was
            gate = tl.where(fires(pre, threshold), pre, 0.0).to(gate_ptr.dtype.element_ty)
            tl.store(gate_ptr + dst, gate, mask=mask)
            if HAS_UP:
                if UP_RELU:
                    acc_u = relu_keep_nan(acc_u)
                tl.store(up_ptr + dst, acc_u.to(up_ptr.dtype.element_ty), mask=mask)
        fired = ((gate != 0) & mask).to(tl.int32)
        tl.store(column_counts_ptr + block.to(tl.int64) * N + cols, tl.sum(fired, axis=0), mask=p_mask)


def unpack_block_factors(
    packed: PackedFactors,
    indices: torch.Tensor,
    counts: torch.Tensor,
    order: torch.Tensor | None,
    block_rows: int,
    chunk: int,
    x: torch.Tensor,
    w_gate: torch.Tensor,
    b_gate: torch.Tensor | None,
    w_up: torch.Tensor | None,
    b_up: torch.Tensor | None,
    *,
    threshold: float = 0.0,
    up_relu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(gate, up [M, width] on the BlockELL slots of ``indices`` [n_blocks, width] / ``counts`` / ``order``, count
    table) from :func:`pack_block_factors`' arrays (packed with chunks of ``chunk`` slots), in their dtype: zeros on
    the unions' slots where the gate did not fire. Blocks past the capacity are recomputed from x [M, K] and the
    weights [N, K] (biases [N] or None), with the gate the forward's :func:`~sparsefuse.sparse.block_sddmm` took
    (``threshold``, ``up_relu``: its FATReLU and dReLU). One launch and a fill, no host sync. ``w_up=None`` (a
    non-gated layer, packed without an up factor): up is None.

    The table is what :func:`~sparsefuse.sparse.block_ell_transpose` takes as ``count_table``: [n_blocks + 1, N]
    int64, the gate's non-zeros of block b per column in row b + 1 and zeros in row 0, counted from the values laid
    out (recomputed blocks included), in the int64 table that the transpose's prefix sums then run in, in place."""
    x, w_gate, b_gate, w_up, b_up = (
        unit_last_stride(t) for t in (x, w_gate, b_gate, w_up, b_up)
    )  # read at unit stride
    M, width = x.shape[0], indices.shape[1]
    N, K = w_gate.shape
    n_blocks = counts.shape[0]
    _check_codes("unpack_block_factors", block_rows, chunk)
    if chunk != packed.chunk:
        raise ValueError(
            f"unpack_block_factors: chunk={chunk} and the {packed.chunk}-slot chunks the pairs were packed in do not "
            "match"
        )
    if chunk <= 0 or packed.offsets.numel() != n_blocks * cdiv(width, chunk) + 1:
        raise ValueError(
            f"unpack_block_factors: offsets of {packed.offsets.numel()} entries do not match {n_blocks} blocks of "
            f"{width} slots in chunks of {chunk}"
        )
    dtype, device = packed.gate.dtype, packed.gate.device
    has_up = w_up is not None
    if up_relu and not has_up:
        raise ValueError("unpack_block_factors: up_relu needs the up factor's w_up")
    gate = new_output((M, width), dtype, device)
    up = new_output((M, width), dtype, device) if has_up else None
    table = torch.zeros(n_blocks + 1, N, dtype=torch.int64, device=device)
    if M == 0 or n_blocks == 0 or width == 0:
        return gate, up, table
    if backend_for(x) is Backend.TORCH:
        raise NotImplementedError("unpack_block_factors runs on the GPU or the Triton interpreter")
    block_k, scatter, warps, stages = (32, 16, 4, 1) if _backend.INTERPRET else UNPACK_CONFIG
    block_unpack_kernel[(cdiv(width, chunk), n_blocks)](
        packed.gate, packed.up if has_up else packed.gate, packed.slots, packed.offsets, indices, counts,
        order if order is not None else counts, x, w_gate, b_gate if b_gate is not None else w_gate,
        w_up if has_up else w_gate, b_up if b_up is not None else w_gate, gate, up if has_up else gate, table[1:],
        M, N, K, width, packed.gate.shape[0], x.stride(0), w_gate.stride(0), w_up.stride(0) if has_up else 0,
        BLOCK_ROWS=block_rows, BLOCK_C=chunk, BLOCK_K=block_k, SCATTER=scatter, HAS_ORDER=order is not None,
        HAS_B_GATE=b_gate is not None, HAS_B_UP=b_up is not None, HAS_UP=has_up, IEEE_FP32=ieee_fp32(x.dtype),
        threshold=threshold_in(dtype, threshold), UP_RELU=up_relu, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    record_launch("block_unpack_kernel")
    return gate, up, table


__all__ = ["PackedFactors", "pack_block_factors", "unpack_block_factors", "spilled_blocks"]
