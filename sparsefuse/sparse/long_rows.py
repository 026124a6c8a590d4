"""Long rows of a gather product, spread over many programs by a second launch, without a host sync.

The gather kernel (:mod:`.spmm`) gives each row -- or, for dense rows split over programs, each range of a row's
columns -- to one program. A row far denser than the others (an SAE token that fires every feature) would cost one
program's serial walk over tens of thousands of weight rows while the rest of the GPU idles: walked that way, two
such tokens cost 4-21x cuBLAS's dense product on an H100 (sae_decode_grid).

A *unit* is what one program of the main launch would walk: a row of stored entries (ELL, CSR), an ELL row that
overflowed its width (its dense row), or one split's column range of a dense row. Then:

1. **Listing, in the main launch.** A unit is *long* when it holds more non-zeros than :func:`long_row_threshold`
   of its columns (an ELL row that overflowed always is). Stored units are known long from their count before any
   work; a dense range is counted chunk by chunk as it is scanned, and given up as soon as its count passes the
   threshold (at most that many non-zeros were gathered for nothing). The program of the unit's first output block
   appends the unit to a device list -- an int32 counter (zeroed before the launch) and a buffer with room for every
   unit -- with one integer atomic; every output block of the unit then exits without writing.
2. **Spreading, in a second launch** of the same kernel (``SPREAD_PASS``). Its grid is fixed by the device (a few
   programs per SM, never a count read on the host: no sync, CUDA-graph capturable, torch.compile sees one opaque
   op); each program loops over the items (unit, output block, sub-split). The number of sub-splits is chosen on
   the device from the list's length, so that the items fill the GPU: one long row gets the whole GPU, thousands of
   them one program each; and a unit takes no more than one per SPREAD_ENTRIES_PER_SUBSPLIT of its non-zeros, so
   a row of a few hundred is not cut into slivers whose partials cost more to sum than to walk. With no long unit
   every program reads the counter and exits.
3. **Summing.** Sub-splits of a unit write fp32 partial sums; the last to arrive (an integer counter) adds them in
   sub-split order and delivers the unit's sum: stored into the output row; or, for a dense range whose row was
   split over programs, added to that row's fp32 sum by atomics (the product's non-deterministic mode) or handed to
   the row's fixed-order sum of split partials, which the unit then completes. fp32 accumulation throughout,
   rounded once to the output dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import _backend
from .._backend import cdiv, next_power_of_2, sm_count
from .._triton.gather import accumulate_nonzeros, accumulate_rows, load_rows, sum_split_partials
from .._triton.limits import limits
from .dense_units import DENSE_UNIT_ROWS, dense_tiles

# The row formats the gather kernel reads (a constexpr of its launches).
FORMAT_ELL = tl.constexpr(0)
FORMAT_CSR = tl.constexpr(1)
FORMAT_DENSE = tl.constexpr(2)

# How a long unit's sum reaches the output (a constexpr of the spread launch).
DELIVER_STORE = tl.constexpr(0)  # the unit is a whole row: its sum is stored into the output row
DELIVER_ATOMIC = tl.constexpr(1)  # its sum is added into the row's fp32 sum [M, n_out] by atomics
DELIVER_SPLITS = tl.constexpr(2)  # its sum is the row's split partial: the row's fixed-order sum completes there

# A unit is long when more than 1 in LONG_ROW_DENSITY of its columns are non-zero and it holds more than
# LONG_ROW_MIN_NNZ of them. SAE tokens fire about 1 feature in 1000, so the threshold is 10-20x a typical row; the
# scan gathers about a non-zero per 0.6 us in one program (two full rows split into 1024-column ranges took 600 us on
# an H100, sae_decode_grid B=32 fp32), so a range at the threshold already costs a program several times its scan
# of the zeros. Chosen from those two facts, not tuned.
LONG_ROW_DENSITY = 64
LONG_ROW_MIN_NNZ = 32
NEVER_LONG = 2**31 - 1  # threshold of a launch that lists no stored row as long

# The spread launch's grid and blocks, swept on an H200 over the SAE decode grid's slow inputs (two full rows at
# B=32-4096; log-normal L0 with sigma 0.6-1.0 at B=256-4096, whose overflowed ELL rows are read whole): output
# blocks of up to 1024 columns, 1024 dense columns scanned per step, 8 programs per SM (the grid never depends on
# the data), each looping over about SPREAD_ITEMS_PER_PROGRAM items so that uneven units still balance. Against 256
# / 256 / 4: geometric mean 462 against 637 us; an overflowed row's dense scan is repeated once per output block,
# so fewer, wider blocks cut it 2-3.5x (B=4096, sigma 1.0, D=2304 bf16: 953 against 3371 us). Two full rows at
# B=32 (H200): D=768 fp32 107 us against cuBLAS's 152 -- each full row reads all of W (the items of two rows share it
# through L2 only in part). Summing two overflowed rows per item to read W once cost the inputs with hundreds of
# sparse overflowed rows 30% (the pair code's registers: 255 a thread, 2 programs an SM); the scan's 16-bit ranges
# at least half non-zero are summed apart on tensor cores instead (dense_units.py).
SPREAD_PROGRAMS_PER_SM = 8
SPREAD_ITEMS_PER_PROGRAM = 4
SPREAD_MAX_BLOCK_D = 1024  # output columns per item, at most
SPREAD_BLOCK_S = 1024  # dense columns scanned per step
MAX_SUBSPLITS = 64  # at most this many programs share one unit's output block
SPREAD_ENTRIES_PER_SUBSPLIT = 32  # a unit takes at most one sub-split per this many non-zeros (stored or read)
SUBSPLIT_SUM_BYTES = 262144  # the last sub-split's read of the partials (sub-splits x BLOCK_D fp32), at most
SPREAD_PARTIAL_BYTES = 16 << 20  # the sub-splits' fp32 partial buffer, at most


# A launch whose programs all run in one wave lasts as long as its longest row's walk: where the rows x output
# blocks are that few, a stored row is long past ONE_WAVE_LONG_ENTRIES entries too (8 steps of the gather's 16,
# about twice an SAE token's typical L0). So one token of 500 features among 256 (log-normal L0) is spread like
# an overflowed one instead of holding the launch for 30 steps.
ONE_WAVE_LONG_ENTRIES = 128


def long_row_threshold(columns: int) -> int:
    """Non-zeros past which a unit of ``columns`` columns is long (see LONG_ROW_DENSITY)."""
    return max(LONG_ROW_MIN_NNZ, columns // LONG_ROW_DENSITY)


def stored_row_threshold(columns: int, programs: int, device: torch.device) -> int:
    """Stored entries past which a row of ``columns`` columns is long in a launch of ``programs`` programs: also
    past ONE_WAVE_LONG_ENTRIES where those programs fit one wave (the knob ``one_wave_programs_per_sm`` of
    :class:`~sparsefuse._triton.limits.SparseCoreLimits` per SM)."""
    threshold = long_row_threshold(columns)
    if programs <= limits().one_wave_programs_per_sm * sm_count(device, interpreted=2):
        threshold = min(threshold, ONE_WAVE_LONG_ENTRIES)
    return threshold


@triton.jit
def list_long_unit(units_ptr, count_ptr, arrivals_ptr, unit, arrival_rows, ARRIVALS: tl.constexpr):
    """Append ``unit`` to the device list (count [1] int32, units [capacity] int32) and zero its row of arrival
    counters (arrivals [arrival_rows, ARRIVALS] int32; ARRIVALS = 0: the spread sums by atomics and has none). Only
    the first ``arrival_rows`` units have counters: the spread splits a unit (and counts arrivals) only while the
    list is that short."""
    slot = tl.atomic_add(count_ptr, 1, sem="relaxed")  # the list is read by the next launch only
    tl.store(units_ptr + slot, unit.to(tl.int32))
    if ARRIVALS > 0:
        if slot < arrival_rows:
            j = tl.arange(0, ARRIVALS)
            tl.store(arrivals_ptr + slot.to(tl.int64) * ARRIVALS + j, tl.zeros([ARRIVALS], dtype=tl.int32))


@triton.jit
def sum_dense_columns(
    row_ptr,
    stride_col,
    f_begin,
    f_end,
    sub,
    subsplits,
    w_ptr,
    stride_w,
    stride_w_col,
    d,
    d_mask,
    BLOCK_S: tl.constexpr,
    GROUP: tl.constexpr,
):
    """(fp32 sum [BLOCK_D], any non-zero) of sub-split ``sub`` of ``subsplits`` of the dense columns [f_begin,
    f_end) of one row (row_ptr, column stride stride_col): W rows (row stride stride_w, column stride stride_w_col)
    loaded only where the activation is non-zero. Also how a dense product's non-finite elements are recomputed
    (:mod:`.nonfinite_rows`), there on the caller's W as it lies, a transposed view too.

    A chunk at least half non-zero (a token that fires everything) is summed in order, GROUP consecutive W rows at
    a time: no ranking and picking of its non-zeros, and the rows' addresses are known ahead, so their loads can be
    pipelined; its zeros' rows are masked off, as the picks would skip them."""
    # sub-splits are whole GROUPs of columns, not whole scanned chunks: one full row is spread over many programs
    per = tl.cdiv(tl.cdiv(f_end - f_begin, subsplits), GROUP) * GROUP
    s_begin = f_begin + sub * per
    s_end = tl.minimum(f_end, s_begin + per)
    acc = tl.zeros(d.shape, dtype=tl.float32)
    nnz = tl.zeros([], dtype=tl.int32)
    f = s_begin + tl.arange(0, BLOCK_S)  # [BLOCK_S]
    a_next = tl.load(row_ptr + f.to(tl.int64) * stride_col, mask=f < s_end, other=0.0)
    for f0 in range(s_begin, s_end, BLOCK_S):
        # the next chunk's load is issued before this chunk's W gathers: a mostly-zero row is not scanned at one
        # memory latency per chunk
        a = a_next.to(tl.float32)
        f_next = f + BLOCK_S
        a_next = tl.load(row_ptr + f_next.to(tl.int64) * stride_col, mask=f_next < s_end, other=0.0)
        chunk_nnz = tl.sum((a != 0).to(tl.int32), axis=0)
        nnz += chunk_nnz
        chunk_len = tl.minimum(s_end - f0, BLOCK_S)
        if 2 * chunk_nnz >= chunk_len:
            # the next group's weight rows are loaded before this group's are summed: two tiles in flight
            rows = f0 + tl.arange(0, GROUP)  # [GROUP]
            in_chunk = rows < f0 + chunk_len
            coef = tl.load(row_ptr + rows.to(tl.int64) * stride_col, mask=in_chunk, other=0.0).to(tl.float32)
            w = load_rows(w_ptr, stride_w, rows, coef != 0, d, d_mask, stride_w_col)
            for g in range(GROUP, chunk_len + GROUP, GROUP):
                rows = f0 + g + tl.arange(0, GROUP)
                in_chunk = rows < f0 + chunk_len  # the last step loads nothing
                coef_next = tl.load(row_ptr + rows.to(tl.int64) * stride_col, mask=in_chunk, other=0.0)
                coef_next = coef_next.to(tl.float32)
                w_next = load_rows(w_ptr, stride_w, rows, coef_next != 0, d, d_mask, stride_w_col)
                acc += tl.sum(coef[:, None] * w.to(tl.float32), axis=0)
                coef, w = coef_next, w_next
        else:
            acc = accumulate_nonzeros(acc, a, f, w_ptr, stride_w, d, d_mask, GROUP, stride_w_col)
        f = f_next
    return acc, nnz > 0


@triton.jit
def _sum_entries(values_ptr, indices_ptr, n, sub, subsplits, w_ptr, stride_w, d, d_mask, BLOCK_K: tl.constexpr):
    """(fp32 sum [BLOCK_D], any entry) of sub-split ``sub`` of ``subsplits`` of the ``n`` stored entries at
    values_ptr / indices_ptr: balanced over the entries themselves."""
    per = tl.cdiv(tl.cdiv(n, subsplits), BLOCK_K) * BLOCK_K
    e_begin = sub * per
    e_end = tl.minimum(n, e_begin + per)
    acc = tl.zeros(d.shape, dtype=tl.float32)
    for e0 in range(e_begin, e_end, BLOCK_K):
        e = e0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        mask = e < e_end
        idx = tl.load(indices_ptr + e, mask=mask, other=0)
        val = tl.load(values_ptr + e, mask=mask, other=0.0).to(tl.float32)
        acc = accumulate_rows(acc, val, idx, mask, w_ptr, stride_w, d, d_mask)
    return acc, e_end > e_begin


@triton.jit
def spread_long_units(
    units_ptr,
    count_ptr,
    arrivals_ptr,
    sub_partial_ptr,
    sub_used_ptr,
    values_ptr,
    indices_ptr,
    counts_ptr,
    row_offsets_ptr,
    dense_ptr,
    w_ptr,
    out_ptr,
    partial_ptr,
    split_used_ptr,
    split_arrivals_ptr,
    n_out,
    n_in,
    width,
    stride_w,
    stride_out,
    stride_dense,
    stride_dense_col,
    n_splits,
    unit_cols,
    partial_rows,
    max_subsplits,
    target_items,
    entries_per_sub,
    FORMAT: tl.constexpr,
    DELIVER: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    ARRIVALS: tl.constexpr,
    REDUCE_SUBSPLITS: tl.constexpr,
    REDUCE_SPLITS: tl.constexpr,
):
    """The spread pass (see module docstring), one program of a 1-D grid looping over the items.

    units [capacity] int32 (count [1] of them listed); a unit is a row (ELL: values/indices [M, width], counts [M],
    an overflowed row read from dense [M, n_in]; CSR: values/indices [nnz], row_offsets [M + 1]) or, for DENSE, the
    columns [split * unit_cols, (split + 1) * unit_cols) of row unit // n_splits of dense. Sub-split sums go to
    sub_partial [partial_rows, n_out] fp32 / sub_used [partial_rows] int32, summed by the last to arrive on
    arrivals [capacity, ARRIVALS] int32. Delivered into out [M, n_out]; DELIVER_ATOMIC: into partial [M, n_out] fp32
    instead; DELIVER_SPLITS: as split ``split`` of the row's partials (partial [M, n_splits, n_out], split_used
    [M, n_splits], split_arrivals [M, D blocks]; the same BLOCK_D as the main launch)."""
    n_units = tl.load(count_ptr)
    n_d_blocks = tl.cdiv(n_out, BLOCK_D)
    per_sub = n_units * n_d_blocks  # items of one sub-split index
    subsplits = tl.minimum(tl.cdiv(target_items, tl.maximum(per_sub, 1)), max_subsplits)
    if DELIVER != DELIVER_ATOMIC:
        subsplits = tl.minimum(subsplits, partial_rows // tl.maximum(n_units, 1))  # within the partial buffer
    subsplits = tl.maximum(subsplits, 1)
    # The unit varies fastest: programs running side by side walk the same weight rows for different long rows
    # (L2 shares them only in part: two full bf16 rows take about two reads' time of W).
    for item in range(tl.program_id(0), per_sub * subsplits, tl.num_programs(0)):
        slot = item % n_units
        d_block = (item // n_units) % n_d_blocks
        sub = item // per_sub
        unit = tl.load(units_ptr + slot).to(tl.int64)
        # Where the unit is: its row, its split of that row, and its non-zeros (a dense range: its columns)
        if FORMAT == FORMAT_CSR:
            row = unit
            split = 0
            start = tl.load(row_offsets_ptr + row)
            nnz = (tl.load(row_offsets_ptr + row + 1) - start).to(tl.int32)
            read_dense = False
        elif FORMAT == FORMAT_DENSE:
            row = unit // n_splits
            split = unit % n_splits
            f_begin = split * unit_cols
            f_end = tl.minimum(n_in, f_begin + unit_cols)
            nnz = (f_end - f_begin).to(tl.int32)
            read_dense = True
        else:
            row = unit
            split = 0
            nnz = tl.load(counts_ptr + row)  # the true count, also of a row that overflowed its width
            f_begin = 0
            f_end = n_in
            read_dense = nnz > width
        # A unit of few non-zeros takes fewer sub-splits than the list allows, one per entries_per_sub of them: split
        # finer, its last arrival's sum of the partials costs more than the walk it spreads. The items of its other
        # sub-split indices do nothing.
        unit_subs = tl.maximum(tl.minimum(subsplits, tl.cdiv(nnz, entries_per_sub)), 1)
        if sub < unit_subs:
            d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
            d_mask = d < n_out
            if FORMAT == FORMAT_CSR:
                acc, has_work = _sum_entries(
                    values_ptr + start, indices_ptr + start, nnz, sub, unit_subs, w_ptr, stride_w, d, d_mask, BLOCK_K
                )
            else:
                # an ELL row that overflowed has incomplete stored entries: its whole dense row is read instead
                if read_dense:
                    acc, has_work = sum_dense_columns(
                        dense_ptr + row * stride_dense,
                        stride_dense_col,
                        f_begin,
                        f_end,
                        sub,
                        unit_subs,
                        w_ptr,
                        stride_w,
                        1,  # the sparse products hand the spread pass W at unit rows (spmm: unit_rows)
                        d,
                        d_mask,
                        BLOCK_S,
                        GROUP,
                    )
                else:
                    acc, has_work = _sum_entries(
                        values_ptr + row * width,
                        indices_ptr + row * width,
                        nnz,
                        sub,
                        unit_subs,
                        w_ptr,
                        stride_w,
                        d,
                        d_mask,
                        BLOCK_K,
                    )
            # to the output; a unit's sub-split partials are rows [slot * subsplits, + unit_subs) of sub_partial:
            # every unit keeps the list's stride, whatever its own count
            unit_slot = slot.to(tl.int64)  # < arrival_rows: units are split only while the list is that short
            if DELIVER == DELIVER_ATOMIC:
                if has_work:
                    tl.atomic_add(partial_ptr + row * n_out + d, acc, mask=d_mask, sem="relaxed")
            else:
                last = unit_subs == 1
                if unit_subs > 1:
                    last, acc = sum_split_partials(
                        acc,
                        has_work,
                        sub_partial_ptr + unit_slot * subsplits * n_out,
                        sub_used_ptr + unit_slot * subsplits,
                        arrivals_ptr + unit_slot * ARRIVALS,
                        unit_slot * 0,
                        sub,
                        unit_subs,
                        d_block,
                        ARRIVALS,
                        n_out,
                        d,
                        d_mask,
                        REDUCE_SUBSPLITS,
                    )
                if last:
                    if DELIVER == DELIVER_SPLITS:
                        last, acc = sum_split_partials(
                            acc,
                            last,
                            partial_ptr,
                            split_used_ptr,
                            split_arrivals_ptr,
                            row,
                            split,
                            n_splits,
                            d_block,
                            n_d_blocks,
                            n_out,
                            d,
                            d_mask,
                            REDUCE_SPLITS,
                        )
                    if last:
                        tl.store(out_ptr + row * stride_out + d, acc.to(out_ptr.dtype.element_ty), mask=d_mask)


@dataclass(frozen=True)
class SpreadConfig:
    block_d: int  # output columns per item
    block_s: int  # dense columns scanned per step
    block_k: int  # stored entries gathered per step
    group: int  # non-zeros picked per step from a scanned chunk
    num_warps: int
    programs: int  # the spread launch's grid
    entries_per_sub: int  # a unit takes at most one sub-split per this many non-zeros


def spread_config(n_out: int, weight: torch.Tensor, block_d: int | None = None) -> SpreadConfig:
    """Blocks of the spread pass (``block_d``: imposed, for DELIVER_SPLITS). Output blocks of at most
    SPREAD_MAX_BLOCK_D columns (sub-splits, not narrow blocks, give one long row many items); warps as many as one
    weight-tile row fills with 16-byte loads (the sum over the tile's rows then stays inside a warp); as many rows
    per weight tile (GROUP picked non-zeros, BLOCK_K entries) and picks per scanned chunk as keep each at 64 values
    per thread: more spilled registers when compiled for sm_90."""
    if _backend.INTERPRET:
        # 4 programs, each looping over several items: an interpreted program costs milliseconds, and most launches
        # of the tests list nothing. A sub-split per 16 entries: the tests' small rows still split, and the units of
        # one list unequally.
        return SpreadConfig(block_d or 32, block_s=16, block_k=8, group=8, num_warps=4, programs=4, entries_per_sub=16)
    programs = SPREAD_PROGRAMS_PER_SM * sm_count(weight.device)
    block_d = block_d or min(SPREAD_MAX_BLOCK_D, max(32, next_power_of_2(n_out)))
    warps = max(1, min(4, block_d * weight.element_size() // (32 * 16)))
    # 8 scanned activations per thread, as swept at 4 warps: narrow outputs (fewer warps) scan shorter chunks
    block_s = min(SPREAD_BLOCK_S, 256 * warps)
    group = max(2, 64 * 32 * warps // max(block_d, block_s))
    return SpreadConfig(
        block_d,
        block_s,
        block_k=group,
        group=group,
        num_warps=warps,
        programs=programs,
        entries_per_sub=SPREAD_ENTRIES_PER_SUBSPLIT,
    )


@dataclass(frozen=True)
class LongRows:
    """The device list of one product's long units and its spread pass's buffers.

    ``units`` [capacity] int32 (the first ``count[0]`` listed), ``count`` [1] int32 (zeroed); ``arrivals``
    [capacity, arrivals_per_unit] int32, zeroed per unit by the program that lists it; ``sub_partial``
    [partial_rows, n_out] fp32 and ``sub_used`` [partial_rows] int32, each written before it is read. When the
    sums go by atomics none of the last three is used."""

    units: torch.Tensor
    count: torch.Tensor
    arrivals: torch.Tensor
    sub_partial: torch.Tensor
    sub_used: torch.Tensor
    threshold: int  # stored units past this many entries are long (dense ranges: non-zeros)
    deliver: int
    config: SpreadConfig
    max_subsplits: int
    arrivals_per_unit: int  # a power of two, at least the output blocks; 0 with DELIVER_ATOMIC
    arrival_rows: int  # units with arrival counters: those the spread can split; 0 with DELIVER_ATOMIC
    partial_rows: int  # 0 with DELIVER_ATOMIC
    # dense ranges' tables (dense_units.py), where the scan lists them: rows [n_splits, DENSE_UNIT_ROWS], counts
    # [n_splits] (zeroed), splits [n_splits], used [1] (zeroed)
    dense_rows: torch.Tensor | None = None
    dense_counts: torch.Tensor | None = None
    dense_splits: torch.Tensor | None = None
    dense_used: torch.Tensor | None = None

    @staticmethod
    def allocate(
        capacity: int,
        n_out: int,
        weight: torch.Tensor,
        threshold: int,
        deliver: int,
        unit_cols: int,
        unit_entries: int,
        block_d: int | None = None,
        dense_splits: int = 0,
    ) -> LongRows:
        """Buffers for ``capacity`` units of at most ``unit_cols`` dense columns or ``unit_entries`` stored entries
        each, output width ``n_out``; with ``dense_splits``, the tables of the scan's dense ranges for that many
        splits (:mod:`.dense_units`). Host-known sizes only: nothing is read back."""
        cfg = spread_config(n_out, weight, block_d)
        device = weight.device
        d_blocks = cdiv(n_out, cfg.block_d)
        steps = max(cdiv(unit_cols, cfg.group), cdiv(unit_entries, cfg.block_k))  # of one unit
        max_subsplits = max(1, min(MAX_SUBSPLITS, steps, SUBSPLIT_SUM_BYTES // (4 * cfg.block_d)))
        arrivals_per_unit, arrival_rows, partial_rows = 0, 0, 0
        if deliver != DELIVER_ATOMIC.value:
            arrivals_per_unit = next_power_of_2(d_blocks)
            # the spread splits units (sub-splits > 1, which count their arrivals) only while they are fewer than
            # its items per D block: counters for that many units, not for every unit that could be listed (the
            # W_dec gradient lists among d_sae rows: ~64 MiB of counters at a million features otherwise)
            items = SPREAD_ITEMS_PER_PROGRAM * cfg.programs
            arrival_rows = min(capacity, cdiv(items, d_blocks))
            # one partial row per sub-split: into at most twice the items per D block in all (rounding up)
            partial_rows = min(
                capacity * max_subsplits,
                2 * cdiv(items, d_blocks) + max_subsplits,
                max(1, SPREAD_PARTIAL_BYTES // (4 * n_out)),
            )
        # the counters zeroed together: one fill
        counters = torch.zeros(1 + (1 + dense_splits if dense_splits else 0), dtype=torch.int32, device=device)
        dense = {}
        if dense_splits:
            dense = dict(
                dense_rows=torch.empty(dense_splits * DENSE_UNIT_ROWS.value, dtype=torch.int32, device=device),
                dense_counts=counters[2:],
                dense_splits=torch.empty(dense_splits, dtype=torch.int32, device=device),
                dense_used=counters[1:2],
            )
        return LongRows(
            units=torch.empty(capacity, dtype=torch.int32, device=device),
            count=counters[:1],
            arrivals=torch.empty(max(1, arrival_rows * arrivals_per_unit), dtype=torch.int32, device=device),
            sub_partial=torch.empty(max(1, partial_rows), n_out, dtype=torch.float32, device=device),
            sub_used=torch.empty(max(1, partial_rows), dtype=torch.int32, device=device),
            threshold=threshold,
            deliver=deliver,
            config=cfg,
            max_subsplits=max_subsplits,
            arrivals_per_unit=arrivals_per_unit,
            arrival_rows=arrival_rows,
            partial_rows=partial_rows,
            **dense,
        )

    def listing_args(self) -> dict:
        """The main launch's arguments that make it list its long units instead of walking them."""
        return dict(
            long_units_ptr=self.units,
            long_count_ptr=self.count,
            long_arrivals_ptr=self.arrivals,
            long_nnz=self.threshold,
            long_arrival_rows=self.arrival_rows,
            LIST_LONG=True,
            ARRIVALS=self.arrivals_per_unit,
            **self._dense_tables(),
        )

    def _dense_tables(self) -> dict:
        """The dense ranges' tables (both launches), if the scan lists them."""
        if self.dense_rows is None:
            return {}
        return dict(
            dense_rows_ptr=self.dense_rows,
            dense_counts_ptr=self.dense_counts,
            dense_splits_ptr=self.dense_splits,
            dense_used_ptr=self.dense_used,
            LIST_DENSE=True,
        )

    def spread_args(self) -> dict:
        """The spread launch's arguments (its grid: ``(config.programs,)``, its warps ``config.num_warps``)."""
        cfg = self.config
        reduce_rows = 64 * 32 * cfg.num_warps // cfg.block_d  # partials summed per step: 64 values per thread
        return dict(
            self.listing_args(),
            long_partial_ptr=self.sub_partial,
            long_used_ptr=self.sub_used,
            long_partial_rows=self.partial_rows,
            long_max_subsplits=self.max_subsplits,
            long_target_items=SPREAD_ITEMS_PER_PROGRAM * cfg.programs,
            long_entries_per_sub=cfg.entries_per_sub,
            LIST_LONG=False,
            SPREAD_PASS=True,
            DELIVER=self.deliver,
            BLOCK_D=cfg.block_d,
            BLOCK_F=cfg.block_s,
            BLOCK_K=cfg.block_k,
            GROUP=cfg.group,
            REDUCE_SUBSPLITS=max(1, min(next_power_of_2(self.max_subsplits), reduce_rows)),
            **(dense_tiles(self.sub_partial.shape[1], cfg.num_warps) if self.dense_rows is not None else {}),
        )
