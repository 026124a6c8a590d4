"""Dense -> ELL / CSR compaction (Triton), deterministic and in column order.

Two launches over a [M, N] dense tensor tiled into (row, column chunk) programs:
  1. ``count_nonzero_kernel`` writes the non-zero count of every (row, chunk) -- no atomics;
  2. an exclusive cumulative sum over chunks (torch, on the device) gives each chunk its first slot in its row;
  3. ``scatter_nonzero_kernel`` writes every non-zero at ``row base + chunk start + rank within the chunk``.

:func:`dense_to_row_block_pattern` builds a :class:`RowBlockPattern` (row-block unions; optionally rows sorted by
their count of non-zeros first, so that tokens of similar sparsity share a block) with one union kernel; no host
sync.

ELL needs no device->host sync (its row base is ``row * width`` and entries past the width are counted but not
stored). CSR needs the total nnz on the host to allocate exactly (one sync). NaN counts as a non-zero, so it
propagates into whatever consumes the format.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _backend
from .._backend import Backend, backend_for, new_output, record_launch
from .._validation import check_float, describe
from .formats import CSR, ELL, RowBlockPattern, check_twell_geometry

_FORMAT_ELL = tl.constexpr(0)
_FORMAT_CSR = tl.constexpr(1)


@triton.jit
def _is_nonzero(v, RELU: tl.constexpr):
    """Non-zero test of the compaction kernels; with RELU, of relu(v) (v > 0), for pre-activations. NaN counts."""
    if RELU:
        return (v > 0) | (v != v)
    return v != 0


@triton.jit
def count_nonzero_kernel(dense_ptr, chunk_counts_ptr, n_cols, stride_row, n_chunks, BLOCK: tl.constexpr,
                         RELU: tl.constexpr = False):  # fmt: skip
    # dense [M, N] (unit column stride); chunk_counts [M, n_chunks] int32 (non-zeros of relu(dense) with RELU)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    v = tl.load(dense_ptr + row * stride_row + cols, mask=cols < n_cols, other=0.0)
    tl.store(chunk_counts_ptr + row * n_chunks + chunk, tl.sum(_is_nonzero(v, RELU).to(tl.int32), axis=0))


@triton.jit
def scatter_nonzero_kernel(dense_ptr, chunk_starts_ptr, row_offsets_ptr, values_ptr, indices_ptr, n_cols,
                           stride_row, n_chunks, width, BLOCK: tl.constexpr, FORMAT: tl.constexpr):  # fmt: skip
    # chunk_starts [M, n_chunks]: first slot of each chunk within its row. ELL: values/indices [M, width];
    # CSR: values/indices [nnz] with row_offsets [M + 1].
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(dense_ptr + row * stride_row + cols, mask=cols < n_cols, other=0.0)
    nonzero = v != 0
    slot = tl.load(chunk_starts_ptr + row * n_chunks + chunk) + tl.cumsum(nonzero.to(tl.int32), axis=0) - 1
    if FORMAT == _FORMAT_ELL:
        base = row * width
        keep = nonzero & (slot < width)  # past the width: counted (the row overflowed), not stored
    else:
        base = tl.load(row_offsets_ptr + row)
        keep = nonzero
    tl.store(values_ptr + base + slot, v, mask=keep)
    tl.store(indices_ptr + base + slot, cols, mask=keep)


def _compaction_block(n_cols: int) -> int:
    return 64 if _backend.INTERPRET else min(4096, max(128, triton.next_power_of_2(n_cols)))


def _check_dense(op: str, dense: torch.Tensor) -> torch.Tensor:
    check_float(op, "dense", dense)
    if dense.dim() != 2:
        raise ValueError(f"{op}: dense must be 2-D [rows, cols]; got {describe(dense)}")
    return dense if dense.stride(1) == 1 or dense.shape[1] <= 1 else dense.contiguous()


def _chunk_starts(dense: torch.Tensor, block: int, relu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunk_starts [M, n_chunks] int32, row counts [M] int32) from the count kernel and a device cumsum; with
    ``relu`` the non-zeros of relu(dense)."""
    M, N = dense.shape
    n_chunks = triton.cdiv(N, block)
    chunk_counts = torch.empty(M, n_chunks, dtype=torch.int32, device=dense.device)
    count_nonzero_kernel[(M, n_chunks)](dense, chunk_counts, N, dense.stride(0), n_chunks, BLOCK=block, RELU=relu)
    record_launch("count_nonzero_kernel")
    inclusive = chunk_counts.cumsum(dim=1, dtype=torch.int32)
    return inclusive - chunk_counts, inclusive[:, -1].contiguous()


def dense_to_ell(dense: torch.Tensor, width: int) -> ELL:
    """Compact each row of ``dense`` [M, N] into ``width`` slots (column order) with its true count. No host sync:
    rows with more than ``width`` non-zeros keep their first ``width`` and report the full count (``overflowed()``).
    """
    dense = _check_dense("dense_to_ell", dense)
    if not isinstance(width, int) or width <= 0:
        raise ValueError(f"dense_to_ell: width must be a positive int; got {width!r}")
    M, N = dense.shape
    if backend_for(dense) is Backend.TORCH or M == 0 or N == 0:
        if backend_for(dense) is Backend.TORCH:
            _backend.warn_reference_once("dense_to_ell")
        return ELL.from_dense(dense, width)
    block = _compaction_block(N)
    starts, counts = _chunk_starts(dense, block)
    values = torch.zeros(M, width, dtype=dense.dtype, device=dense.device)
    indices = torch.zeros(M, width, dtype=torch.int32, device=dense.device)
    scatter_nonzero_kernel[(M, starts.shape[1])](dense, starts, counts, values, indices, N, dense.stride(0),
                                                 starts.shape[1], width, BLOCK=block, FORMAT=0)  # fmt: skip
    record_launch("scatter_nonzero_kernel")
    return ELL(values, indices, counts, N)


def dense_to_csr(dense: torch.Tensor) -> CSR:
    """Exact-size CSR of ``dense`` [M, N] (column order). Synchronizes once to size the arrays."""
    dense = _check_dense("dense_to_csr", dense)
    M, N = dense.shape
    if backend_for(dense) is Backend.TORCH or M == 0 or N == 0:
        if backend_for(dense) is Backend.TORCH:
            _backend.warn_reference_once("dense_to_csr")
        return CSR.from_dense(dense)
    block = _compaction_block(N)
    starts, counts = _chunk_starts(dense, block)
    row_offsets = torch.zeros(M + 1, dtype=torch.int64, device=dense.device)
    row_offsets[1:] = counts.cumsum(0)
    nnz = int(row_offsets[-1])  # the one host sync: exact allocation
    values = new_output((nnz,), dense.dtype, dense.device)  # NaN-poisoned under test: every slot must be written
    indices = torch.empty(nnz, dtype=torch.int32, device=dense.device)
    scatter_nonzero_kernel[(M, starts.shape[1])](dense, starts, row_offsets, values, indices, N, dense.stride(0),
                                                 starts.shape[1], 0, BLOCK=block, FORMAT=1)  # fmt: skip
    record_launch("scatter_nonzero_kernel")
    return CSR(values, indices, row_offsets, N)


@triton.jit
def row_block_union_kernel(dense_ptr, order_ptr, indices_ptr, counts_ptr, M, N, n_tiles, stride_row,
                           TILE: tl.constexpr, BLOCK_ROWS: tl.constexpr, SUB_ROWS: tl.constexpr,
                           RELU: tl.constexpr, HAS_ORDER: tl.constexpr):  # fmt: skip
    # dense [M, N]; order [M] int32 (block b = rows order[b * BLOCK_ROWS ...]); out: indices [n_blocks, n_tiles *
    # TILE] (the union of tile t at [t * TILE, t * TILE + count), column order), counts [n_blocks, n_tiles].
    # The block's rows are or-ed SUB_ROWS at a time in registers and reduced across rows once: one [BLOCK_ROWS,
    # TILE] load and reduction per program read the pre-activations at 1.4 TB/s on an H200, this at 2.1
    # (benchmarks/results/probe-union-NVIDIA-H200.log).
    tile = tl.program_id(0)
    block = tl.program_id(1)
    cols = tile * TILE + tl.arange(0, TILE)  # [TILE]
    fired = tl.zeros([SUB_ROWS, TILE], dtype=tl.int1)
    for r0 in range(0, BLOCK_ROWS, SUB_ROWS):
        slots = block * BLOCK_ROWS + r0 + tl.arange(0, SUB_ROWS)
        slot_mask = slots < M
        rows = tl.load(order_ptr + slots, mask=slot_mask, other=0) if HAS_ORDER else slots
        v = tl.load(dense_ptr + rows[:, None].to(tl.int64) * stride_row + cols[None, :],
                    mask=slot_mask[:, None] & (cols[None, :] < N), other=0.0)  # [SUB_ROWS, TILE]  # fmt: skip
        fired = fired | _is_nonzero(v, RELU)
    in_union = tl.max(fired.to(tl.int32), axis=0)  # [TILE]
    rank = tl.cumsum(in_union, axis=0) - 1
    tl.store(indices_ptr + block.to(tl.int64) * (n_tiles * TILE) + tile * TILE + rank, cols, mask=in_union > 0)
    tl.store(counts_ptr + block * n_tiles + tile, tl.sum(in_union, axis=0))


def _descending_order(counts: torch.Tensor) -> torch.Tensor:
    """[M] int32: rows by decreasing count (stable: deterministic), so the heaviest row blocks start first."""
    return torch.sort(counts, descending=True, stable=True).indices.to(torch.int32)


def dense_to_row_block_pattern(dense: torch.Tensor, tile: int, block_rows: int, *, relu: bool = False,
                               sort_rows: bool = False) -> RowBlockPattern:  # fmt: skip
    """The :class:`RowBlockPattern` of ``dense`` [M, N] (of ``relu(dense)`` when ``relu``: pre-activations), rows
    sorted by decreasing non-zero count when ``sort_rows`` (tokens of similar sparsity then share blocks, whose
    unions shrink: on the synthetic ReLU FFN at 30 non-zeros per token, 64-row unions cover 13% of the columns
    against 22% in token order; but the count pass, the sort and the imbalance between light and heavy blocks
    cost about what the smaller products save on an H200, so it is off by default). No host sync; reads ``dense``
    once (twice when sorting)."""
    op = "dense_to_row_block_pattern"
    dense = _check_dense(op, dense)
    check_twell_geometry(op, tile, 1)
    M, N = dense.shape
    n_tiles, n_blocks = triton.cdiv(N, tile), triton.cdiv(M, block_rows)
    if backend_for(dense) is Backend.TORCH or M == 0:
        if M:
            _backend.warn_reference_once(op)
        fired = (dense > 0) | dense.isnan() if relu else dense != 0
        order = _descending_order(fired.sum(dim=1, dtype=torch.int32)) if sort_rows else None
        return RowBlockPattern.from_dense(fired.to(torch.uint8), tile, block_rows, order)
    order = None
    if sort_rows:
        order = _descending_order(_chunk_starts(dense, _compaction_block(N), relu)[1])
    indices = torch.empty(n_blocks, n_tiles * tile, dtype=torch.int32, device=dense.device)
    union_counts = torch.empty(n_blocks, n_tiles, dtype=torch.int32, device=dense.device)
    row_block_union_kernel[(n_tiles, n_blocks)](dense, order if order is not None else dense, indices, union_counts,
                                                M, N, n_tiles, dense.stride(0), TILE=tile, BLOCK_ROWS=block_rows,
                                                SUB_ROWS=min(16, block_rows), RELU=relu, HAS_ORDER=order is not None,
                                                num_warps=2)  # fmt: skip
    record_launch("row_block_union_kernel")
    return RowBlockPattern(indices, union_counts, order, M, N, tile, block_rows)
