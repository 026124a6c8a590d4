"""Dense -> ELL in one pass over the dense tensor (Triton), deterministic and in column order; and the training
format :class:`Hybrid` built on it.

A program owns ROWS rows by BLOCK_C columns (a chunk) of ``dense`` [M, N]. It loads the tile once, counts each row's
non-zeros in it and ranks them, and needs one number more to place them: how many non-zeros the row has before the
chunk. The chunks of a row find that out from each other with a *decoupled look-back*, the single-pass prefix sum
of GPU scans: each program publishes its chunk's count (an *aggregate*) as soon as it has loaded, then reads its
predecessors' statuses a window at a time back to the nearest one that already knows its *inclusive* prefix (a
chunk of the row's start knows it at once), adds the aggregates in between, publishes its own inclusive prefix and
stores its entries at their final slots. Each status is one word (two flag bits over the count), so publishing
and reading it needs no memory fence.

Programs are numbered chunk-fastest, so a chunk's predecessors are dispatched before it (the GPU dispatches a 1-D
grid in order) and the wait is short. Nothing relies on that order for correctness: a program that finds a
predecessor unpublished for ``LOOK_BACK_SPINS`` reads in a row counts the rest of its prefix from ``dense`` itself.

Why one pass: the two-pass form (a bitmask of the non-zeros, then one program per row ranking its words) spent as
long in the second pass's chain of memory latencies, a row at a time, as a sixth of the first pass streamed; at
256 SAE tokens, where everything is one wave, that was 5.8 us against the stream's 10 (H200).

ELL needs no device->host sync: entries past a row's width are counted but not stored. The statuses are a zeroed
[M, n_chunks] buffer per call (one memset). NaN counts as a non-zero, so it propagates into whatever consumes the
format.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import _backend
from .._backend import Backend, backend_for, cdiv, new_output, next_power_of_2, record_launch
from .._jit import kernel
from .._validation import check_dense, check_rows, unit_last_stride
from .compact import bitwise_or, is_nonzero, lowest_bit, popcount
from .formats import ELL, IN_ELL, SPILLED, Hybrid

LOOK_BACK_SPINS = 4096  # window reads that find a predecessor unpublished before a program counts its prefix itself
_NOT_READY = tl.constexpr(0)  # a status's flag (its top two bits): nothing published yet,
_AGGREGATE = tl.constexpr(1)  # the chunk's own count,
_INCLUSIVE = tl.constexpr(2)  # or the row's count up to and including the chunk
_INT32_COUNT_BITS = 29  # int32 statuses hold counts below 2**29 columns; wider rows take int64 statuses


@triton.jit
def _status(count, FLAG: tl.constexpr, COUNT_BITS: tl.constexpr):
    """A status word: ``count`` [ROWS] under the flag ``FLAG``."""
    return count | (FLAG << COUNT_BITS)


@triton.jit
def _row_prefix(
    dense_ptr,
    stride_row,
    status_row,
    rows,
    row_mask,
    chunk,
    count,
    N,
    BLOCK_C: tl.constexpr,
    WINDOW: tl.constexpr,
    spins,
    COUNT_BITS: tl.constexpr,
):
    """Non-zeros [ROWS] of each row before column ``chunk * BLOCK_C``, from the statuses [ROWS rows of n_chunks]
    that ``status_row`` points at (this chunk's aggregate ``count`` already published)."""
    mask = (1 << COUNT_BITS) - 1
    prefix = tl.zeros_like(count)
    # 0/1 int32 flags rather than booleans: the interpreter hands a while loop's booleans back as int32, which a
    # load's mask does not take
    pending = (row_mask & (chunk > 0)).to(tl.int32)
    end = tl.zeros_like(count) + chunk  # [ROWS]: the window is chunks [end - WINDOW, end)
    waits = tl.zeros([], dtype=tl.int32)
    while (tl.max(pending, axis=0) > 0) & (waits <= spins):
        j = end[:, None] - WINDOW + tl.arange(0, WINDOW)[None, :]  # [ROWS, WINDOW]
        # before the row's first chunk: an inclusive prefix of 0
        s = tl.load(
            status_row[:, None] + j,
            mask=(pending[:, None] != 0) & (j >= 0),
            other=_INCLUSIVE << COUNT_BITS,
            volatile=True,
        )
        flag = s >> COUNT_BITS
        last_inclusive = tl.max(tl.where(flag == _INCLUSIVE, j, -1 - WINDOW), axis=1)  # [ROWS]
        counted = j >= last_inclusive[:, None]  # that inclusive prefix and the aggregates after it
        ready = tl.min(tl.where(counted, (flag != _NOT_READY).to(tl.int32), 1), axis=1)  # [ROWS] 0/1
        advance = pending * ready
        prefix += tl.where(advance != 0, tl.sum(tl.where(counted, s & mask, 0), axis=1), 0)
        found = (last_inclusive >= end - WINDOW).to(tl.int32)
        waits += tl.max(pending * (1 - ready), axis=0)
        end = tl.where((advance * (1 - found)) != 0, end - WINDOW, end)  # only aggregates: the window before next
        pending = pending * (1 - advance * found)
    if tl.max(pending, axis=0) > 0:
        # a predecessor never published (or spins < 0): count the chunks [0, end) of those rows from dense
        cols = tl.arange(0, BLOCK_C)
        stop = tl.where(pending != 0, tl.minimum(end * BLOCK_C, N), 0)
        for c0 in range(0, tl.max(stop, axis=0), BLOCK_C):
            c = c0 + cols
            m = c[None, :] < stop[:, None]
            v = tl.load(dense_ptr + rows[:, None].to(tl.int64) * stride_row + c[None, :], mask=m, other=0.0)
            prefix += tl.sum((is_nonzero(v, False) & m).to(count.dtype), axis=1)
    return prefix


@kernel
def dense_to_ell_kernel(
    dense_ptr,
    values_ptr,
    indices_ptr,
    counts_ptr,
    status_ptr,
    M,
    N,
    n_chunks,
    stride_row,
    width,
    spins,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    WINDOW: tl.constexpr,
    COUNT_BITS: tl.constexpr,
    PAD: tl.constexpr,
    PUBLISH_INCLUSIVE: tl.constexpr = True,
):
    # dense [M, N] (unit column stride) -> values/indices [M, width] (each row's first width non-zeros in column
    # order, then index 0 / value 0) and counts [M] int32 (all of them). status [M, n_chunks] int32/int64, zeroed.
    # 1-D grid of cdiv(M, ROWS) * n_chunks programs, chunk fastest. PUBLISH_INCLUSIVE=False (tests): chunks publish
    # aggregates only, so every look-back walks its windows back to the row's start.
    pid = tl.program_id(0)
    chunk = pid % n_chunks
    rows = (pid // n_chunks) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    row_mask = rows < M
    rows64 = rows.to(tl.int64)
    cols = chunk * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    in_tile = row_mask[:, None] & (cols[None, :] < N)
    v = tl.load(dense_ptr + rows64[:, None] * stride_row + cols[None, :], mask=in_tile, other=0.0)
    status_row = status_ptr + rows64 * n_chunks
    # the tile's non-zeros as bitmask words [ROWS, BLOCK_C // 32]: ranks come from popcounts of a few words, not a
    # scan over every column (a [ROWS, BLOCK_C] cumsum crosses warps and took this pass from 22 to 71 us, H200)
    fired = (is_nonzero(v, False) & in_tile).to(tl.int32)
    lane = tl.arange(0, 32)
    words = tl.reduce(tl.reshape(fired, [ROWS, BLOCK_C // 32, 32]) << lane[None, None, :], 2, bitwise_or)
    words = words.to(tl.uint32, bitcast=True)
    pc = popcount(words).to(status_ptr.dtype.element_ty)  # [ROWS, BLOCK_C // 32]
    count = tl.sum(pc, axis=1)  # [ROWS]
    # a row's first chunk knows its inclusive prefix at once
    first = tl.where(chunk == 0, _status(count, _INCLUSIVE, COUNT_BITS), _status(count, _AGGREGATE, COUNT_BITS))
    tl.atomic_xchg(status_row + chunk, first, mask=row_mask, sem="relaxed")
    prefix = _row_prefix(
        dense_ptr, stride_row, status_row, rows, row_mask, chunk, count, N, BLOCK_C, WINDOW, spins, COUNT_BITS
    )
    if PUBLISH_INCLUSIVE and chunk > 0:
        inclusive = _status(prefix + count, _INCLUSIVE, COUNT_BITS)
        tl.atomic_xchg(status_row + chunk, inclusive, mask=row_mask, sem="relaxed")
    # round k places each word's k-th set bit; no round past the width a row has left
    slot = (prefix[:, None] + tl.cumsum(pc, axis=1) - pc).to(tl.int64)  # [ROWS, BLOCK_C // 32]: words' first slots
    w_cols = chunk * BLOCK_C + 32 * tl.arange(0, BLOCK_C // 32)  # [BLOCK_C // 32]
    room = tl.where(row_mask, width - prefix, 0)
    rest = words
    rounds = tl.max(tl.minimum(tl.max(pc, axis=1), tl.maximum(room, 0)), axis=0)
    for _ in range(rounds):
        live = rest != 0
        col = w_cols[None, :] + lowest_bit(rest)
        keep = live & (slot < width)
        tl.store(indices_ptr + rows64[:, None] * width + slot, col, mask=keep)
        # the value from the tile's lines, just read (a cache hit), not carried through the ranking
        val = tl.load(dense_ptr + rows64[:, None] * stride_row + col, mask=keep, other=0.0)
        tl.store(values_ptr + rows64[:, None] * width + slot, val, mask=keep)
        slot += live.to(tl.int64)
        rest = rest & (rest - 1)
    if chunk == n_chunks - 1:  # the row's total, and its unused slots (index 0, value 0): no fill launches
        total = (prefix + count).to(tl.int32)
        tl.store(counts_ptr + rows, total, mask=row_mask)
        placed = tl.minimum(total, width)
        for s0 in range(tl.min(tl.where(row_mask, placed, width), axis=0), width, PAD):
            s = s0 + tl.arange(0, PAD)
            unused = row_mask[:, None] & (s[None, :] >= placed[:, None]) & (s[None, :] < width)
            pad_at = rows64[:, None] * width + s[None, :]
            tl.store(values_ptr + pad_at, tl.zeros([ROWS, PAD], dtype=values_ptr.dtype.element_ty), mask=unused)
            tl.store(indices_ptr + pad_at, tl.zeros([ROWS, PAD], dtype=tl.int32), mask=unused)


def _launch_dense_to_ell(
    dense: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    *,
    spins: int = LOOK_BACK_SPINS,
    publish_inclusive: bool = True,
) -> None:
    """One dense_to_ell_kernel launch (``spins``, ``publish_inclusive``: the look-back's paths, for tests)."""
    M, N = dense.shape
    width = values.shape[1]
    if _backend.INTERPRET:
        rows, block_c, window = 2, 32, 4  # several chunks a row and windows a look-back, at test shapes
    else:
        rows, block_c, window = 8, 512, 32  # the bitmask pass's tile (4 warps, measured on an H200)
    block_c = min(block_c, max(32, next_power_of_2(N)))  # whole words
    n_chunks = cdiv(N, block_c)
    count_bits = _INT32_COUNT_BITS if N < 1 << _INT32_COUNT_BITS else 61
    status = torch.zeros(M, n_chunks, dtype=torch.int32 if count_bits < 32 else torch.int64, device=dense.device)
    dense_to_ell_kernel[(cdiv(M, rows) * n_chunks,)](
        dense,
        values,
        indices,
        counts,
        status,
        M,
        N,
        n_chunks,
        dense.stride(0),
        width,
        spins,
        ROWS=rows,
        BLOCK_C=block_c,
        WINDOW=window,
        COUNT_BITS=count_bits,
        PAD=min(block_c, next_power_of_2(width)),
        PUBLISH_INCLUSIVE=publish_inclusive,
        num_warps=4,
    )
    record_launch("dense_to_ell_kernel")


def dense_to_ell(dense: torch.Tensor, width: int) -> ELL:
    """Compact each row of ``dense`` [M, N] into ``width`` slots (column order) with its true count. No host sync:
    rows with more than ``width`` non-zeros keep their first ``width`` and report the full count (``overflowed()``).
    One pass over ``dense`` (see the module docstring)."""
    check_dense("dense_to_ell", dense)
    dense = unit_last_stride(dense)
    if not isinstance(width, int) or isinstance(width, bool) or width <= 0:
        raise ValueError(f"dense_to_ell: width must be a positive int; got {width!r}")
    M, N = dense.shape
    if backend_for(dense) is Backend.TORCH or M == 0 or N == 0:
        if backend_for(dense) is Backend.TORCH:
            _backend.warn_reference_once("dense_to_ell")
        return ELL.from_dense(dense, width)
    values = new_output((M, width), dense.dtype, dense.device)  # every slot written by the kernel (padding too)
    indices = new_output((M, width), torch.int32, dense.device)
    counts = new_output((M,), torch.int32, dense.device)
    _launch_dense_to_ell(dense, values, indices, counts)
    return ELL(values, indices, counts, N)


DEFAULT_HYBRID_WIDTH = 128  # ELL slots per row of the training format (the TwELL paper's)


def dense_to_hybrid(dense: torch.Tensor, width: int = DEFAULT_HYBRID_WIDTH, backup_rows: int | None = None) -> Hybrid:
    """The :class:`Hybrid` form of ``dense`` [M, N] (non-zeros: entries != 0; pass ``relu(pre)`` for a ReLU layer).

    Args:
        width: ELL slots per row (a row with more non-zeros goes to the backup whole).
        backup_rows: R, dense rows kept for overflowed rows (default ``ceil(M / 8)``); overflowed rows past the
            first R are marked ``SPILLED``.
    No host sync; deterministic (prefix sums and a sorted search, no atomics), so the same input always gives the
    same format. How many rows spilled is a device scalar (:meth:`Hybrid.spilled`) a caller reads when it chooses,
    e.g. to size the next step's backup."""
    check_rows("dense", dense, 2)
    M, N = dense.shape
    R = math.ceil(M / 8) if backup_rows is None else backup_rows
    if not isinstance(R, int) or isinstance(R, bool) or R < 0:
        raise ValueError(f"dense_to_hybrid: backup_rows must be a non-negative int or None; got {backup_rows!r}")
    # float64 (gradient checks) has no kernel: the plain-torch compaction, same format
    ell = ELL.from_dense(dense, width) if dense.dtype == torch.float64 else dense_to_ell(dense, width)
    overflowed = ell.overflowed()
    seen = overflowed.to(torch.int32).cumsum(0, dtype=torch.int32)  # overflowed rows up to and including each row
    rank = seen - 1
    slot = torch.where(overflowed, torch.where(rank < R, rank, SPILLED), IN_ELL).to(torch.int32)
    # backup row s holds the first row at which `seen` reaches s + 1 (M when fewer rows overflowed)
    wanted = torch.arange(1, R + 1, device=dense.device, dtype=torch.int32)
    rows = torch.searchsorted(seen, wanted) if M else torch.zeros(R, dtype=torch.int64, device=dense.device)
    valid = rows < M
    backup = dense[rows.clamp(max=max(M - 1, 0))] if M else dense.new_zeros(R, N)
    backup = torch.where(valid[:, None], backup, 0)  # unused rows: zeros (never read)
    return Hybrid(ell, backup, torch.where(valid, rows, -1).to(torch.int32), slot)
