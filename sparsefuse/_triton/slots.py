"""The tile of :class:`~sparsefuse.sparse.BlockELL` slots that one program of a row-block kernel covers: the
prologue shared by the kernels that walk a block's union of columns a chunk at a time (the sampled products,
packing, the column grouping, the training step's elementwise passes on the unions): which chunk of which block
(:func:`union_chunk`), its slots' positions, columns, rows and offsets (:func:`block_slots`, or :func:`slot_offsets`
where only the values are read), and the values there (:func:`load_slots`, :func:`store_slots`)."""

import torch
import triton
import triton.language as tl

from .limits import limits


def offsets_fit_32(*tensors: torch.Tensor) -> bool:
    """Whether every element offset of these tensors (each with a unit last stride, read as rows of ``stride(0)``)
    is below the knob ``offsets_32_limit`` (:class:`.limits.SparseCoreLimits`: 2**31): the ``OFFSETS_32``
    constexpr of the kernels that gather their rows."""
    limit = limits().offsets_32_limit
    return all(t.shape[0] * t.stride(0) < limit for t in tensors if t.dim() > 0)


@triton.jit
def union_chunk(counts_ptr, BLOCK_C: tl.constexpr):
    """``(chunk, block, count, live)`` of a program on the grid (chunks, row blocks) of a BlockELL with union sizes
    counts [n_blocks]: its chunk and block, the block's count, and whether the chunk holds any listed slot. The grid
    is sized for the widest union, so the caller does nothing unless ``live``: the skipped chunk reads nothing else."""
    chunk = tl.program_id(0)
    block = tl.program_id(1)
    count = tl.load(counts_ptr + block)
    return chunk, block, count, chunk * BLOCK_C < count


@triton.jit
def block_slots(
    indices_ptr,
    order_ptr,
    block,
    chunk,
    count,
    M,
    width,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    LOAD_COLS: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    OFFSETS_32: tl.constexpr = False,
):
    """Slots [chunk * BLOCK_C, (chunk + 1) * BLOCK_C) of row block ``block`` (``count`` of its slots listed) in a
    BlockELL laid out as [M, width] values, indices [n_blocks, width] and order [M] (slot row -> matrix row).

    Returns ``(p, p_mask, cols, local, rows, row_mask, mask, flat)``: the slot positions p [BLOCK_C] and p < count;
    the union's columns there [BLOCK_C] (0 where masked; loaded only with ``LOAD_COLS``, else p); the rows within the
    block [BLOCK_ROWS], their matrix rows (through ``order`` with ``HAS_ORDER``, else the slot rows) and which exist;
    the [BLOCK_ROWS, BLOCK_C] mask and each slot's offset in the [M, width] arrays, int64 (int32 with ``OFFSETS_32``,
    for a caller that checked M * width with :func:`offsets_fit_32`). Loads happen only where
    the flags ask, so a kernel that needs neither columns nor rows (or needs them on one branch only) reads nothing
    here."""
    p = chunk * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    p_mask = p < count
    if LOAD_COLS:
        cols = tl.load(indices_ptr + block.to(tl.int64) * width + p, mask=p_mask, other=0)
    else:
        cols = p
    local = tl.arange(0, BLOCK_ROWS)  # [BLOCK_ROWS]
    slots = block * BLOCK_ROWS + local
    row_mask = slots < M
    if HAS_ORDER:
        rows = tl.load(order_ptr + slots, mask=row_mask, other=0)
    else:
        rows = slots
    mask = row_mask[:, None] & p_mask[None, :]  # [BLOCK_ROWS, BLOCK_C]
    if OFFSETS_32:
        flat = block * BLOCK_ROWS * width + (local[:, None] * width + p[None, :])
    else:  # the block's start can pass 2**31 (M * width values); an offset within one block cannot
        flat = block.to(tl.int64) * BLOCK_ROWS * width + (local[:, None] * width + p[None, :])
    return p, p_mask, cols, local, rows, row_mask, mask, flat


@triton.jit
def slot_offsets(
    block, chunk, count, M, width, BLOCK_ROWS: tl.constexpr, BLOCK_C: tl.constexpr, OFFSETS_32: tl.constexpr
):
    """``(mask, flat)`` of :func:`block_slots` alone, for a pass that reads and writes only the values on the slots
    (no union columns, no matrix rows): nothing is loaded."""
    _, _, _, _, _, _, mask, flat = block_slots(
        None, None, block, chunk, count, M, width, BLOCK_ROWS, BLOCK_C, False, False, OFFSETS_32
    )
    return mask, flat


@triton.jit
def load_slots(ptr, flat, mask):
    """The values at the slots' offsets ``flat`` of an [M, width] array, in fp32; 0 where ``mask`` is off."""
    return tl.load(ptr + flat, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_slots(ptr, flat, value, mask):
    """``value`` written at the slots' offsets ``flat`` of an [M, width] array (rounded to its dtype) where ``mask``."""
    tl.store(ptr + flat, value.to(ptr.dtype.element_ty), mask=mask)
