"""Dense -> ELL / CSR compaction (Triton), deterministic and in column order.

Two passes over a [M, N] dense tensor:
  1. ``row_bits_kernel`` streams ``dense`` once and writes a bitmask of its non-zeros (bit c % 32 of word c // 32;
     N / 8 bytes per row, a sixteenth of bf16 rows);
  2. ``bits_to_sparse_kernel`` walks each row's words: a word's first slot is the row's running popcount, and the
     columns of its set bits go to consecutive slots in column order; then the row's values are gathered from
     ``dense`` in one pass over its slots (one sector per non-zero). At SAE sparsity a row is a few thousand
     words of which a few dozen are non-zero, so the ranking runs over words, not over every column.

:func:`dense_to_row_block_pattern` builds a :class:`RowBlockPattern` (row-block unions; optionally rows sorted by
their count of non-zeros first, so that tokens of similar sparsity share a block) from the same bitmask: a union
kernel or-s its words per block; no host sync.

ELL needs no device->host sync (its row base is ``row * width`` and entries past the width are counted but not
stored). CSR needs the total nnz on the host to allocate exactly (one sync). NaN counts as a non-zero, so it
propagates into whatever consumes the format.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import _backend
from .._backend import Backend, backend_for, cdiv, new_output, next_power_of_2, record_launch, sm_count, threshold_in
from .._jit import kernel
from .._triton.gates import fires
from .._triton.limits import limits
from .._validation import check_dense, check_rows, check_twell_geometry, unit_last_stride
from .formats import CSR, ELL, IN_ELL, SPILLED, Hybrid, RowBlockPattern


@triton.jit
def _is_nonzero(v, RELU: tl.constexpr, threshold=0.0):
    """Non-zero test of the compaction kernels; with RELU, where a gate of pre-activations fires (:func:`fires`).
    NaN counts. Compared in fp32: the interpreter compares bf16 by its bit pattern, so -0.0 would count."""
    if RELU:
        return fires(v, threshold)
    return v.to(tl.float32) != 0


_MODE_COUNT = tl.constexpr(0)
_MODE_ELL = tl.constexpr(1)
_MODE_CSR = tl.constexpr(2)


@triton.jit
def _popcount(u):
    """Set bits of each uint32 word (SWAR: no inline assembly, so the interpreter runs it too) as int32."""
    u = u - ((u >> 1) & 0x55555555)
    u = (u & 0x33333333) + ((u >> 2) & 0x33333333)
    u = (u + (u >> 4)) & 0x0F0F0F0F
    return ((u * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _lowest_bit(u):
    """Index (int32) of the lowest set bit of each non-zero uint32 word: the exponent of that bit as an fp32, which
    a power of two converts to exactly."""
    low = (u & (~u + 1)).to(tl.float32)
    return ((low.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@kernel
def bits_to_sparse_kernel(
    bits_ptr,
    dense_ptr,
    counts_ptr,
    row_offsets_ptr,
    values_ptr,
    indices_ptr,
    n_words,
    stride_dense,
    width,
    BLOCK_W: tl.constexpr,
    MODE: tl.constexpr,
):
    # bits [M, n_words] int32 (row_bits_kernel) of dense [M, N] (unit column stride); one program per row.
    # MODE count: counts [M] int32 = the row's set bits. ELL: values/indices [M, width] (the first width non-zeros,
    # then zeros) and counts [M] (all of them). CSR: values/indices [nnz] from row_offsets [M + 1] int64 on.
    row = tl.program_id(0).to(tl.int64)
    if MODE == _MODE_CSR:
        base = tl.load(row_offsets_ptr + row)
    else:
        base = row * width
    filled = tl.zeros([], dtype=tl.int32)
    for w0 in range(0, n_words, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)  # [BLOCK_W]
        word = tl.load(bits_ptr + row * n_words + w, mask=w < n_words, other=0).to(tl.uint32, bitcast=True)
        pc = _popcount(word)
        if MODE != _MODE_COUNT:
            slot = filled + tl.cumsum(pc, axis=0) - pc  # each word's first slot in the row
            rest = word
            # round k places the column of every word's k-th set bit, at a slot >= filled + k: an ELL row needs
            # no round past the width it has left, and a full one only counts the rest (a token firing every
            # feature would otherwise walk 32 rounds per block for nothing)
            most = tl.max(pc, axis=0)
            rounds = most if MODE == _MODE_CSR else tl.minimum(most, tl.maximum(width - filled, 0))
            for _ in range(rounds):
                live = rest != 0
                col = w * 32 + _lowest_bit(rest)
                keep = live & (slot < width) if MODE == _MODE_ELL else live
                tl.store(indices_ptr + base + slot, col, mask=keep)
                slot += live.to(tl.int32)
                rest = rest & (rest - 1)
        filled += tl.sum(pc, axis=0)
    if MODE != _MODE_COUNT:
        # The values in one pass over the placed slots, not a load per round: a round then waits on no memory, and
        # a row's gathers from dense are in flight together (with a load per round, a full row waits 32 DRAM
        # latencies: 19 us against 13.5 at 256 rows, H200).
        # The indices are read back from memory, written by other threads of this program: hence the barrier,
        # and loads that bypass L1.
        tl.debug_barrier()
        placed = filled if MODE == _MODE_CSR else tl.minimum(filled, width)
        for s0 in range(0, placed, BLOCK_W):
            s = s0 + tl.arange(0, BLOCK_W)
            in_row = s < placed
            col = tl.load(indices_ptr + base + s, mask=in_row, other=0, cache_modifier=".cg")
            v = tl.load(dense_ptr + row * stride_dense + col, mask=in_row, other=0.0)
            tl.store(values_ptr + base + s, v, mask=in_row)
    if MODE == _MODE_ELL:  # the unused slots get index 0 and value 0 here: no fill launches before this one
        for s0 in range(tl.minimum(filled, width), width, BLOCK_W):
            s = s0 + tl.arange(0, BLOCK_W)
            tl.store(values_ptr + base + s, tl.zeros([BLOCK_W], dtype=values_ptr.dtype.element_ty), mask=s < width)
            tl.store(indices_ptr + base + s, tl.zeros([BLOCK_W], dtype=tl.int32), mask=s < width)
    if MODE != _MODE_CSR:
        tl.store(counts_ptr + row, filled)


def _bits_to_sparse(
    bits: torch.Tensor,
    dense: torch.Tensor,
    mode: int,
    *,
    counts: torch.Tensor | None = None,
    row_offsets: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    width: int = 0,
) -> None:
    """One bits_to_sparse_kernel launch over the rows of ``bits`` (see the kernel for the modes)."""
    M, n_words = bits.shape
    if _backend.INTERPRET:
        block_w, warps = 8, 4
    elif mode != _MODE_CSR.value and M >= limits().many_rows_per_sm * sm_count(bits.device):
        # Many waves: the walk is bound by its instructions (each round of set bits runs over every word of the
        # block, and at SAE sparsity nearly all words are zero), so small blocks of one warp: at 4096 rows of 2048
        # words, 31 us against 52 with 1024 words and 4 warps and a load per round (H200). Not for CSR, which places
        # every entry: one warp would walk a token firing every feature 4x longer than 4 warps do (ELL stops at its
        # width).
        block_w, warps = 128, 1
    else:  # about a wave: bound by each row's latency, so few, wide blocks (5.8 us at 256 rows, H200)
        block_w, warps = min(1024, max(32, next_power_of_2(n_words))), 4
    unused = bits
    bits_to_sparse_kernel[(M,)](
        bits,
        dense,
        unused if counts is None else counts,
        unused if row_offsets is None else row_offsets,
        unused if values is None else values,
        unused if indices is None else indices,
        n_words,
        dense.stride(0),
        width,
        BLOCK_W=block_w,
        MODE=mode,
        num_warps=warps,
    )
    record_launch("bits_to_sparse_kernel")


def dense_to_ell(dense: torch.Tensor, width: int) -> ELL:
    """Compact each row of ``dense`` [M, N] into ``width`` slots (column order) with its true count. No host sync:
    rows with more than ``width`` non-zeros keep their first ``width`` and report the full count (``overflowed()``).
    """
    check_dense("dense_to_ell", dense)
    dense = unit_last_stride(dense)
    if not isinstance(width, int) or width <= 0:
        raise ValueError(f"dense_to_ell: width must be a positive int; got {width!r}")
    M, N = dense.shape
    if backend_for(dense) is Backend.TORCH or M == 0 or N == 0:
        if backend_for(dense) is Backend.TORCH:
            _backend.warn_reference_once("dense_to_ell")
        return ELL.from_dense(dense, width)
    bits = _row_bits(dense, False)
    values = new_output((M, width), dense.dtype, dense.device)  # every slot written by the kernel (padding too)
    indices = new_output((M, width), torch.int32, dense.device)
    counts = new_output((M,), torch.int32, dense.device)
    _bits_to_sparse(bits, dense, _MODE_ELL.value, counts=counts, values=values, indices=indices, width=width)
    return ELL(values, indices, counts, N)


def dense_to_csr(dense: torch.Tensor) -> CSR:
    """Exact-size CSR of ``dense`` [M, N] (column order). Synchronizes once to size the arrays."""
    check_dense("dense_to_csr", dense)
    dense = unit_last_stride(dense)
    M, N = dense.shape
    if backend_for(dense) is Backend.TORCH or M == 0 or N == 0:
        if backend_for(dense) is Backend.TORCH:
            _backend.warn_reference_once("dense_to_csr")
        return CSR.from_dense(dense)
    bits = _row_bits(dense, False)
    counts = new_output((M,), torch.int32, dense.device)
    _bits_to_sparse(bits, dense, _MODE_COUNT.value, counts=counts)
    row_offsets = torch.zeros(M + 1, dtype=torch.int64, device=dense.device)
    row_offsets[1:] = counts.cumsum(0)
    nnz = int(row_offsets[-1])  # the one host sync: exact allocation
    values = new_output((nnz,), dense.dtype, dense.device)  # NaN-poisoned under test: every slot must be written
    indices = torch.empty(nnz, dtype=torch.int32, device=dense.device)
    _bits_to_sparse(bits, dense, _MODE_CSR.value, row_offsets=row_offsets, values=values, indices=indices)
    return CSR(values, indices, row_offsets, N)


@triton.jit
def _bitwise_or(a, b):
    return a | b


@kernel
def row_bits_kernel(
    dense_ptr, bits_ptr, M, N, n_words, stride_row, ROWS: tl.constexpr, BLOCK_C: tl.constexpr, RELU: tl.constexpr,
    threshold=0.0,
):  # fmt: skip
    # dense [M, N] -> bits [M, n_words] int32 (bit c % 32 of word c // 32 set where column c is non-zero, or with
    # RELU above threshold; BLOCK_C a multiple of 32). Grid (column chunks, row chunks): one [ROWS, BLOCK_C] load per
    # program, so even a few thousand rows give enough loads in flight (a program looping over whole rows had too
    # few; a 1-D grid of the same programs ran 15% slower on an H200). Past 65535 row chunks (grid y's limit)
    # programs take several. Row counts are popcounts of these words (row_keys_kernel, bits_to_sparse_kernel):
    # counting here as well made this pass 2.7 TB/s instead of 3.5 on the FFN's pre-activations (H200).
    chunk = tl.program_id(0)
    lane = tl.arange(0, 32)
    for row_chunk in range(tl.program_id(1), tl.cdiv(M, ROWS), tl.num_programs(1)):
        rows = row_chunk * ROWS + tl.arange(0, ROWS)  # [ROWS]
        row_mask = rows < M
        cols = chunk * BLOCK_C + tl.arange(0, BLOCK_C)
        v = tl.load(
            dense_ptr + rows[:, None].to(tl.int64) * stride_row + cols[None, :],
            mask=row_mask[:, None] & (cols[None, :] < N),
            other=0.0,
        )
        fired = _is_nonzero(v, RELU, threshold).to(tl.int32)  # [ROWS, BLOCK_C]
        words = tl.reduce(tl.reshape(fired, [ROWS, BLOCK_C // 32, 32]) << lane[None, None, :], 2, _bitwise_or)
        w = chunk * (BLOCK_C // 32) + tl.arange(0, BLOCK_C // 32)
        tl.store(
            bits_ptr + rows[:, None].to(tl.int64) * n_words + w[None, :],
            words,
            mask=row_mask[:, None] & (w[None, :] < n_words),
        )


@kernel
def row_block_union_kernel(
    bits_ptr,
    order_ptr,
    indices_ptr,
    counts_ptr,
    M,
    N,
    n_words,
    n_tiles,
    TILE: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    HAS_ORDER: tl.constexpr,
):
    # bits [M, n_words] (row_bits_kernel); order [M] int32 (block b = rows order[b * BLOCK_ROWS ...]); out: indices
    # [n_blocks, n_tiles * TILE] (the union of tile t at [t * TILE, t * TILE + count), column order), counts
    # [n_blocks, n_tiles]. A program or-s the WORDS = max(1, TILE / 32) words that hold its tile for each of the
    # block's rows (a few KB, in L2 after the bits pass) and compacts the union's columns.
    tile = tl.program_id(0)
    block = tl.program_id(1)
    slots = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BLOCK_ROWS]
    slot_mask = slots < M
    rows = tl.load(order_ptr + slots, mask=slot_mask, other=0) if HAS_ORDER else slots
    first_word = (tile * TILE) // 32
    w = tl.arange(0, WORDS)
    words = tl.load(
        bits_ptr + rows[:, None].to(tl.int64) * n_words + first_word + w[None, :],
        mask=slot_mask[:, None] & (first_word + w[None, :] < n_words),
        other=0,
    )
    union = tl.reduce(words, 0, _bitwise_or)  # [WORDS]
    cols = tile * TILE + tl.arange(0, TILE)  # [TILE]
    word_of_col = tl.reduce(
        tl.where((cols // 32 - first_word)[:, None] == w[None, :], union[None, :], 0), 1, _bitwise_or
    )
    in_union = ((word_of_col >> (cols % 32)) & 1) * (cols < N)  # [TILE]
    rank = tl.cumsum(in_union, axis=0) - 1
    tl.store(indices_ptr + block.to(tl.int64) * (n_tiles * TILE) + tile * TILE + rank, cols, mask=in_union > 0)
    tl.store(counts_ptr + block * n_tiles + tile, tl.sum(in_union, axis=0))


def _row_bits(dense: torch.Tensor, relu: bool, threshold: float = 0.0) -> torch.Tensor:
    """bits [M, ceil(N / 32)] int32 of ``dense`` [M, N] (with ``relu``: of its entries > ``threshold``) from one
    row_bits_kernel launch: the one pass over ``dense``."""
    M, N = dense.shape
    n_words = cdiv(N, 32)
    rows, block_c = (2, 64) if _backend.INTERPRET else (8, 512)  # 4 warps (measured on an H200)
    block_c = min(block_c, max(32, next_power_of_2(N)))
    bits = new_output((M, n_words), torch.int32, dense.device)  # poisoned under test
    row_bits_kernel[(cdiv(N, block_c), min(cdiv(M, rows), limits().max_grid_y))](
        dense,
        bits,
        M,
        N,
        n_words,
        dense.stride(0),
        ROWS=rows,
        BLOCK_C=block_c,
        RELU=relu,
        threshold=float(threshold),
        num_warps=4,
    )
    record_launch("row_bits_kernel")
    return bits


# Sorting rows for row-block unions. What shrinks a block's union is grouping rows of similar non-zero counts, not
# their exact order, so rows are bucketed by a log-scale key of their count with four buckets per octave,
# key = 4 * floor(log2(c + 1)) + (the two bits after the leading one of c + 1), and ordered by decreasing key within
# groups of SORT_GROUP consecutive rows (each group is ordered on its own: no prefix across the whole batch). On the
# synthetic ReLU FFN (8192 tokens, 30 non-zeros per token, 64-row blocks) the unions cover 21.9% of N in token order,
# 12.9% after an exact global sort, 13.6% with keys counted over the first eighth of the columns and sorted globally,
# and 13.8% with those keys sorted in groups of 1024 -- whose heaviest blocks are then spread over the batch (largest
# union 60% of N, against 68% with one global sort), which balances the products' grid. Counting every column (free
# since the bits pass reads them all; the FFN's block plan does) gives 13.1-13.3% in groups of 1024.
SORT_GROUP = 1024


def _sort_keys(n_sample: int) -> int:
    """Key count (a power of two) covering counts 0..n_sample."""
    return next_power_of_2(4 * (n_sample + 1).bit_length())


@triton.jit
def _count_key(count):
    """The quarter-octave key [ROWS] int32 of non-zero counts [ROWS] int32 (see the comment above)."""
    v = count + 1
    e = tl.zeros_like(v)
    for k in tl.static_range(1, 31):
        e += (v >= (1 << k)).to(tl.int32)
    return 4 * e + ((v.to(tl.int64) * 4) >> e.to(tl.int64)).to(tl.int32) - 4


@kernel
def row_keys_kernel(bits_ptr, keys_ptr, M, n_words, n_sample, ROWS: tl.constexpr, WORDS: tl.constexpr):
    # bits [M, n_words] (row_bits_kernel) -> keys [M] int32: the key of each row's count of set bits among its
    # first n_sample columns (the last such word masked to its low n_sample % 32 bits).
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < M
    count = tl.zeros([ROWS], dtype=tl.int32)
    for w0 in range(0, tl.cdiv(n_sample, 32), WORDS):
        w = w0 + tl.arange(0, WORDS)
        words = tl.load(
            bits_ptr + rows[:, None].to(tl.int64) * n_words + w[None, :],
            mask=row_mask[:, None] & (w[None, :] * 32 < n_sample),
            other=0,
        ).to(tl.uint32, bitcast=True)
        kept = n_sample - w * 32  # bits of each word inside the sample (>= 32: all)
        low = (tl.full([WORDS], 1, tl.uint32) << tl.minimum(tl.maximum(kept, 0), 31).to(tl.uint32)) - 1
        low = tl.where(kept >= 32, tl.full([WORDS], 0xFFFFFFFF, tl.uint32), low)
        count += tl.sum(_popcount(words & low[None, :]), axis=1)
    tl.store(keys_ptr + rows, _count_key(count), mask=row_mask)


@kernel
def group_rank_kernel(keys_ptr, order_ptr, M, GROUP: tl.constexpr, SUB: tl.constexpr, KEYS: tl.constexpr):
    # A stable counting sort by decreasing key within groups of GROUP rows (keys [M] int32): row r goes to
    #   group start + (the group's rows with a larger key) + (its earlier rows with r's key); order[position] = r.
    # Program (g, c) places the SUB rows of chunk c of group g. It histograms the whole group's keys itself, so the
    # chunks need nothing from each other: no serial walk over the group (18 us -> 8 on an H200 at 8192 rows).
    base = tl.program_id(0) * GROUP
    chunk = tl.program_id(1)
    k = tl.arange(0, KEYS)
    totals = tl.zeros([KEYS], dtype=tl.int32)
    earlier = tl.zeros([KEYS], dtype=tl.int32)  # keys of the group's chunks before this one
    for c in tl.static_range((GROUP + SUB - 1) // SUB):
        local = c * SUB + tl.arange(0, SUB)
        key = tl.load(keys_ptr + base + local, mask=(local < GROUP) & (base + local < M), other=-1)
        hist = tl.sum((key[:, None] == k[None, :]).to(tl.int32), axis=0)
        totals += hist
        earlier += tl.where(c < chunk, hist, 0)
    first = base + tl.sum(totals, axis=0) - tl.cumsum(totals, axis=0) + earlier  # [KEYS]: this chunk's first slots
    local = chunk * SUB + tl.arange(0, SUB)
    rows = base + local
    row_mask = (local < GROUP) & (rows < M)
    key = tl.load(keys_ptr + rows, mask=row_mask, other=-1)
    onehot = (key[:, None] == k[None, :]).to(tl.int32)  # [SUB, KEYS]
    position = tl.sum(onehot * (first[None, :] + tl.cumsum(onehot, axis=0) - onehot), axis=1)
    tl.store(order_ptr + position, rows, mask=row_mask)


def torch_count_order(fired: torch.Tensor, group: int = SORT_GROUP) -> torch.Tensor:
    """Reference of :func:`count_order` from a boolean [M, n_sample] of non-zeros: [M] int32."""
    v = fired.sum(dim=1).long() + 1
    e = torch.floor(torch.log2(v.double())).long()  # exact: v < 2**31
    key = 4 * e + torch.bitwise_right_shift(4 * v, e) - 4
    parts = [
        g0 + torch.sort(key[g0 : g0 + group], descending=True, stable=True).indices
        for g0 in range(0, fired.shape[0], group)
    ]
    return torch.cat(parts).to(torch.int32) if parts else key.to(torch.int32)


def _group_rank(bits: torch.Tensor, n_sample: int, group: int) -> torch.Tensor:
    """[M] int32 order from the bitmask [M, n_words] (:func:`_row_bits`): heaviest first within groups. Two
    launches: the keys (a kernel of their own: summing counts inside the rank kernel, once per program and chunk,
    took it from 8 to 57 us at 8192 rows on an H200), then the rank."""
    M, n_words = bits.shape
    keys = torch.empty(M, dtype=torch.int32, device=bits.device)
    rows, words = (4, 2) if _backend.INTERPRET else (32, 64)
    row_keys_kernel[(cdiv(M, rows),)](bits, keys, M, n_words, n_sample, ROWS=rows, WORDS=words)
    order = new_output((M,), torch.int32, bits.device)  # poisoned (-1) under test: every position is written
    sub = min(next_power_of_2(group), 64 if _backend.INTERPRET else 128)
    grid = (cdiv(M, group), cdiv(min(M, group), sub))
    group_rank_kernel[grid](keys, order, M, GROUP=group, SUB=sub, KEYS=_sort_keys(n_sample))
    record_launch("row_keys_kernel")
    record_launch("group_rank_kernel")
    return order


def count_order(
    dense: torch.Tensor, n_sample: int, relu: bool = False, group: int = SORT_GROUP, threshold: float = 0.0
) -> torch.Tensor:
    """[M] int32 row order: within each ``group`` consecutive rows of ``dense`` [M, N], the rows by decreasing count
    of non-zeros (with ``relu``: of entries > ``threshold``, NaN included) among their first ``n_sample`` columns,
    bucketed four buckets per octave, stable within a bucket: heavy rows first. Three Triton launches (bitmask,
    keys, rank), no host sync; reads ``dense`` once."""
    M = dense.shape[0]
    threshold = threshold_in(dense.dtype, threshold)  # one firing point on both backends (torch's compare rounds)
    if backend_for(dense) is Backend.TORCH or M == 0:
        if M:
            _backend.warn_reference_once("count_order")
        fired = dense[:, :n_sample]
        return torch_count_order((fired > threshold) | fired.isnan() if relu else fired != 0, group)
    return _group_rank(_row_bits(dense, relu, threshold), n_sample, group)


def dense_to_row_block_pattern(
    dense: torch.Tensor,
    tile: int,
    block_rows: int,
    *,
    relu: bool = False,
    threshold: float = 0.0,
    sort_rows: bool = False,
    sort_sample: int | None = None,
) -> RowBlockPattern:
    """The :class:`RowBlockPattern` of ``dense`` [M, N] (of ``relu(dense)`` when ``relu``: pre-activations; with a
    ``threshold`` too, of its entries above it: FATReLU's gate, exactly, in any dtype).

    With ``sort_rows`` the rows are first ordered by :func:`count_order` -- heavy rows first within each group of
    :data:`SORT_GROUP` rows, counted over the first ``sort_sample`` columns (default: all) -- so tokens of similar
    sparsity share blocks and the unions shrink: on the synthetic ReLU FFN at 30 non-zeros per token, 64-row unions
    cover 14% of the columns against 22% in token order. No host sync; reads ``dense`` once: one streaming pass
    writes a bitmask of its non-zeros (N / 8 bytes per row); the rows' counts are popcounts of it and the unions
    are or-ed from it."""
    op = "dense_to_row_block_pattern"
    check_dense(op, dense)
    dense = unit_last_stride(dense)
    check_twell_geometry(op, tile, 1)
    if sort_sample is not None and (
        not isinstance(sort_sample, int) or isinstance(sort_sample, bool) or sort_sample <= 0
    ):
        raise ValueError(f"{op}: sort_sample must be a positive int or None; got {sort_sample!r}")
    M, N = dense.shape
    threshold = threshold_in(dense.dtype, threshold)  # one firing point on both backends (torch's compare rounds)
    n_sample = N if sort_sample is None else min(N, sort_sample)
    n_tiles, n_blocks = cdiv(N, tile), cdiv(M, block_rows)
    if backend_for(dense) is Backend.TORCH or M == 0:
        order = count_order(dense, n_sample, relu, threshold=threshold) if sort_rows else None
        if M:
            _backend.warn_reference_once(op)
        fired = (dense > threshold) | dense.isnan() if relu else dense != 0
        return RowBlockPattern.from_dense(fired.to(torch.uint8), tile, block_rows, order)
    bits = _row_bits(dense, relu, threshold)
    order = _group_rank(bits, n_sample, SORT_GROUP) if sort_rows else None
    indices = torch.empty(n_blocks, n_tiles * tile, dtype=torch.int32, device=dense.device)
    union_counts = torch.empty(n_blocks, n_tiles, dtype=torch.int32, device=dense.device)
    row_block_union_kernel[(n_tiles, n_blocks)](
        bits,
        order if order is not None else bits,
        indices,
        union_counts,
        M,
        N,
        bits.shape[1],
        n_tiles,
        TILE=tile,
        WORDS=max(1, tile // 32),
        BLOCK_ROWS=block_rows,
        HAS_ORDER=order is not None,
        num_warps=4,
    )
    record_launch("row_block_union_kernel")
    return RowBlockPattern(indices, union_counts, order, M, N, tile, block_rows)


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
