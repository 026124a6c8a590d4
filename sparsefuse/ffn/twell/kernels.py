"""The TwELL Triton kernels (see :mod:`sparsefuse.ffn.twell` for the block they compute). Launched from
:mod:`.launch`."""

from __future__ import annotations

import triton
import triton.language as tl

from ..._jit import kernel
from ..._triton.dot import dot_accumulate
from ..._triton.gates import fires
from ..._triton.gather import accumulate_nonzeros, accumulate_rows, pick_nonzeros, rank_nonzeros, sum_split_partials
from ..._triton.schedule import grouped_tile_coords
from ...sparse.sddmm import row_dots


@kernel
def twell_gate_fwd_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    values_ptr,
    indices_ptr,
    counts_ptr,
    M,
    K,
    N,
    n_tiles,
    tune_key,
    stride_xm,
    stride_wn,
    stride_wk,
    TILE: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    threshold=0.0,
    pre_ptr=None,
    stride_pre=0,
    STORE_PRE: tl.constexpr = False,
):
    # x [M, K] (unit column stride), w [N, K] (nn.Linear layout, any strides), b [N];
    # out: values/indices [M, n_tiles * SLOTS], counts [M, n_tiles] int32 (true counts) of the entries > threshold
    # (0: ReLU; > 0: FATReLU, the values kept unshifted)
    # STORE_PRE: the pre-activations of every overflowed (token, tile) also go to pre [M, N] (x's dtype, written
    # nowhere else), which the up/down kernel then reads for those tiles instead of recomputing them by a GEMV over
    # TILE rows of w: one program's serial chain per overflowed tile otherwise (a token firing 727 of 5632 among
    # 8 took the block 3x dense's time on an H200)
    pid = tl.program_id(0)
    # Grouped ordering: GROUP_M row blocks sweep all tiles together, so their W columns are reused from L2.
    pid_m, tile = grouped_tile_coords(pid, tl.cdiv(M, BLOCK_M), n_tiles, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tile * TILE + tl.arange(0, TILE)  # [TILE]
    row_mask, col_mask = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, TILE], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_mask = k < K
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xm + k[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_ptr + cols[None, :].to(tl.int64) * stride_wn + k[:, None].to(tl.int64) * stride_wk,
            mask=k_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(x.dtype)  # [BLOCK_K, TILE]
        acc = dot_accumulate(acc, x, w, IEEE_FP32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    count = _pack_tile(
        acc, rows, row_mask, cols, col_mask, tile, values_ptr, indices_ptr, counts_ptr, n_tiles, threshold, SLOTS,
        BLOCK_M,
    )  # fmt: skip
    if STORE_PRE:
        over = row_mask & (count > SLOTS)  # [BLOCK_M]
        tl.store(
            pre_ptr + rows[:, None].to(tl.int64) * stride_pre + cols[None, :],
            acc.to(pre_ptr.dtype.element_ty),
            mask=over[:, None] & col_mask[None, :],
        )


@kernel
def twell_pack_kernel(
    pre_ptr,
    values_ptr,
    indices_ptr,
    counts_ptr,
    M,
    N,
    n_tiles,
    stride_pm,
    threshold,
    TILE: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    # pre [M, N] (unit column stride): the gate's pre-activations from a dense GEMM; out as twell_gate_fwd_kernel's.
    # From a few hundred tokens the GEMM is cuBLAS's and this pass packs its output: the packing is a scan along each
    # tile row, which in a tensor-core accumulator's register layout costs several [BLOCK_M, TILE] layout
    # conversions through shared memory (the fused kernel took 2.6x cuBLAS's GEMM at 8192 tokens on an H200), while
    # here the loaded tile is laid out along its rows already.
    pid = tl.program_id(0)
    pid_m, tile = pid // n_tiles, pid % n_tiles
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tile * TILE + tl.arange(0, TILE)  # [TILE]
    row_mask, col_mask = rows < M, cols < N
    pre = tl.load(
        pre_ptr + rows[:, None].to(tl.int64) * stride_pm + cols[None, :],
        mask=row_mask[:, None] & col_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, TILE]
    _pack_tile(
        pre, rows, row_mask, cols, col_mask, tile, values_ptr, indices_ptr, counts_ptr, n_tiles, threshold, SLOTS,
        BLOCK_M,
    )  # fmt: skip


@triton.jit
def _pack_tile(
    pre, rows, row_mask, cols, col_mask, tile, values_ptr, indices_ptr, counts_ptr, n_tiles, threshold,
    SLOTS: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """ReLU (FATReLU for a threshold > 0) + TwELL packing of the pre-activations ``pre`` [BLOCK_M, TILE] of (rows,
    tile): the entries > threshold at [row, tile * SLOTS + slot] of values/indices, counts [M, n_tiles] int32 (true
    counts). NaN counts as fired (it propagates). Returns the counts [BLOCK_M]."""
    fired = fires(pre, threshold) & row_mask[:, None] & col_mask[None, :]  # [BLOCK_M, TILE]
    fired_i = fired.to(tl.int32)
    rank = tl.cumsum(fired_i, axis=1) - 1  # slot of each fired column within its tile row
    row_base = rows.to(tl.int64) * (n_tiles * SLOTS) + tile * SLOTS  # [BLOCK_M]
    # Unused slots hold (index 0, value 0): clear the block's slots, then scatter the survivors over them (the
    # barrier orders the two stores across the program's threads).
    slot = tl.arange(0, SLOTS)
    clear_mask = row_mask[:, None] & (slot[None, :] < SLOTS)  # [BLOCK_M, SLOTS]
    clear_ptr = row_base[:, None] + slot[None, :]
    tl.store(
        values_ptr + clear_ptr,
        tl.zeros([BLOCK_M, SLOTS], dtype=tl.float32).to(values_ptr.dtype.element_ty),
        mask=clear_mask,
    )
    tl.store(indices_ptr + clear_ptr, tl.zeros([BLOCK_M, SLOTS], dtype=tl.int32), mask=clear_mask)
    tl.debug_barrier()
    keep = fired & (rank < SLOTS)  # past the slots: counted (the tile overflowed), not stored
    dst = row_base[:, None] + rank
    tl.store(values_ptr + dst, pre.to(values_ptr.dtype.element_ty), mask=keep)
    tl.store(indices_ptr + dst, cols[None, :] + tl.zeros_like(rank), mask=keep)
    count = tl.sum(fired_i, axis=1)  # [BLOCK_M]
    tl.store(counts_ptr + rows.to(tl.int64) * n_tiles + tile, count, mask=row_mask)
    return count


@triton.jit
def _pre_activations(
    x_row_ptr, wa_ptr, ba_ptr, cols, col_mask, K, stride_wa_n, stride_wa_k, BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_BA: tl.constexpr,
):  # fmt: skip
    """[BLOCK_C] x . W_a[cols] + b_a[cols] in fp32 (a GEMV over BLOCK_C rows of W_a)."""
    pre = row_dots(x_row_ptr, wa_ptr, cols, col_mask, K, stride_wa_n, stride_wa_k, BLOCK_C, BLOCK_K)
    if HAS_BA:
        pre += tl.load(ba_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    return pre


@triton.jit
def _recompute_overflowed_tiles(
    acc,
    row,
    counts_ptr,
    t_begin,
    t_end,
    n_tiles,
    c_begin,
    c_step,
    x_row_ptr,
    wa_ptr,
    stride_wa_n,
    stride_wa_k,
    ba_ptr,
    wu_ptr,
    stride_wu,
    bu_ptr,
    wd_ptr,
    stride_wd,
    d,
    d_mask,
    K,
    N,
    TILE: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PICK: tl.constexpr,
    HAS_BA: tl.constexpr,
    HAS_BU: tl.constexpr,
    GATED: tl.constexpr,
    pre_row_ptr=None,
    HAS_PRE: tl.constexpr = False,
    threshold=0.0,
    UP_RELU: tl.constexpr = False,
):
    """acc += the contribution of every overflowed tile t in [t_begin, t_end) of ``row``, recomputed from x: the
    activation ``a = x . W_a[n] + b_a`` where it exceeds ``threshold`` (0: ReLU), else 0 (W_a = W_gate, or W_up for
    the non-gated block) over the tile's columns, BLOCK_C at a time from column c_begin every c_step (0 and
    BLOCK_C: the whole tile; programs that share a token's tiles take interleaved chunks), times ``u = x . W_up[n]
    + b_up`` when GATED (``relu(u)`` with UP_RELU: dReLU), times row n of W_down^T. Only rows whose coefficient is
    non-zero are loaded from W_down (and only fired ones from W_up). Meant for rare (token, tile) pairs.
    HAS_PRE: the pre-activations are read from the row's dense pre-activations (``pre_row_ptr``: the gate GEMM's
    output row, bias included), else recomputed by a GEMV over TILE rows of W_a."""
    for t in range(t_begin, t_end):
        if tl.load(counts_ptr + row * n_tiles + t) > SLOTS:
            for c0 in range(c_begin, TILE, c_step):
                cols = t * TILE + c0 + tl.arange(0, BLOCK_C)  # [BLOCK_C]
                col_mask = cols < N
                if HAS_PRE:
                    pre = tl.load(pre_row_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
                else:
                    pre = _pre_activations(
                        x_row_ptr, wa_ptr, ba_ptr, cols, col_mask, K, stride_wa_n, stride_wa_k, BLOCK_C, BLOCK_K, HAS_BA
                    )
                fired = col_mask & fires(pre, threshold)
                coef = tl.where(fired, pre, 0.0)
                if GATED:
                    u = row_dots(x_row_ptr, wu_ptr, cols, fired, K, stride_wu, 1, BLOCK_C, BLOCK_K)
                    if HAS_BU:
                        u += tl.load(bu_ptr + cols, mask=fired, other=0.0).to(tl.float32)
                    if UP_RELU:
                        fired = fired & ((u > 0) | (u != u))
                    coef = tl.where(fired, coef * u, 0.0)
                # down projection of the fired columns PICK at a time: [PICK, BLOCK_D] tiles, no wider than the main
                # loop's, so this rare path does not raise the kernel's register count (and cut its occupancy)
                acc = accumulate_nonzeros(acc, coef, cols, wd_ptr, stride_wd, d, d_mask, PICK)
    return acc


@triton.jit
def _overflowed_tiles_from_pre(
    acc, x, row, counts_ptr, t_begin, t_end, n_tiles, j_begin, j_step, pre_row_ptr, wu_ptr, stride_wu, bu_ptr,
    wd_ptr, stride_wd, d, d_mask, N, threshold, TILE: tl.constexpr, SLOTS: tl.constexpr, BLOCK_J: tl.constexpr,
    HAS_BU: tl.constexpr, UP_RELU: tl.constexpr,
):  # fmt: skip
    """acc [BLOCK_D] += every overflowed tile t in [t_begin, t_end) of ``row``, its pre-activations read from the
    gate GEMM's output row (``pre_row_ptr``): the fired columns are ranked and walked BLOCK_J at a time like stored
    entries (a whole W_up row against x [BLOCK_D] in registers, then a W_down row), the fired columns of rank
    j_begin, j_begin + BLOCK_J, ... every j_step (programs that share a token's tiles take interleaved groups)."""
    for t in range(t_begin, t_end):
        if tl.load(counts_ptr + row * n_tiles + t) > SLOTS:
            cols = t * TILE + tl.arange(0, TILE)  # [TILE]
            col_mask = cols < N
            pre = tl.load(pre_row_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            h = tl.where(col_mask & fires(pre, threshold), pre, 0.0)  # (FAT)ReLU; NaN propagates
            n, rank = rank_nonzeros(h)
            for j0 in range(j_begin, n, j_step):
                j = j0 + tl.arange(0, BLOCK_J)  # [BLOCK_J]
                j_mask = j < n
                idx, h_gate = pick_nonzeros(h, cols, rank, j)
                acc = _up_down_step(
                    acc, x, idx, h_gate, j_mask, wu_ptr, stride_wu, bu_ptr, wd_ptr, stride_wd, d, d_mask, HAS_BU,
                    UP_RELU,
                )  # fmt: skip
    return acc


@triton.jit
def _up_down_step(
    acc, x, n, h_gate, j_mask, wu_ptr, stride_wu, bu_ptr, wd_ptr, stride_wd, d, d_mask, HAS_BU: tl.constexpr,
    UP_RELU: tl.constexpr,
):  # fmt: skip
    """One step of kernel 2 over BLOCK_J fired neurons n [BLOCK_J] of a token with gate values h_gate: u = x . W_up[n]
    (+ b_up[n]), a whole W_up row against x [BLOCK_D] in registers, then acc [BLOCK_D] += h_gate * u * W_down^T[n].
    UP_RELU (dReLU): relu(u) instead of u, and the W_down rows of the neurons whose u <= 0 are not loaded."""
    w_up = tl.load(
        wu_ptr + n[:, None].to(tl.int64) * stride_wu + d[None, :], mask=j_mask[:, None] & d_mask[None, :], other=0.0
    )  # [BLOCK_J, BLOCK_D]
    u = tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)  # [BLOCK_J]
    if HAS_BU:
        u += tl.load(bu_ptr + n, mask=j_mask, other=0.0).to(tl.float32)
    if UP_RELU:
        j_mask = j_mask & ((u > 0) | (u != u))  # NaN propagates
    return accumulate_rows(acc, tl.where(j_mask, h_gate * u, 0.0), n, j_mask, wd_ptr, stride_wd, d, d_mask)


@kernel
def twell_up_down_fwd_kernel(
    values_ptr,
    indices_ptr,
    counts_ptr,
    order_ptr,
    x_ptr,
    wg_ptr,
    bg_ptr,
    wu_ptr,
    bu_ptr,
    wd_ptr,
    bd_ptr,
    y_ptr,
    partial_ptr,
    used_ptr,
    arrivals_ptr,
    K,
    N,
    n_tiles,
    tiles_per_split,
    n_splits,
    stride_xm,
    stride_wg_n,
    stride_wg_k,
    stride_wu,
    stride_wd,
    stride_ym,
    TILE: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_TILES: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    REDUCE_SPLITS: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    HAS_B_GATE: tl.constexpr,
    HAS_B_UP: tl.constexpr,
    HAS_B_DOWN: tl.constexpr,
    heavy_count_ptr=None,
    heavy_rows_ptr=None,
    taken_ptr=None,
    SKIP_HEAVY: tl.constexpr = False,
    HEAVY_PASS: tl.constexpr = False,
    pre_ptr=None,
    stride_pre=0,
    HAS_PRE: tl.constexpr = False,
    threshold=0.0,
    UP_RELU: tl.constexpr = False,
):
    # TwELL of h_g: values/indices [M, n_tiles * SLOTS], counts [M, n_tiles]; x [M, K] (unit column stride);
    # wg [N, K] (any strides; read only for overflowed tiles); wu [N, K] and wd = W_down^T [N, K] with unit column
    # strides (row n contiguous: coalesced); biases bg/bu [N], bd [K]; y [M, K].
    # Grid (tokens, splits): program (p, s) owns token order[p] (heavy tokens first, so their long chains overlap
    # the rest; heavy_rows[p] in the HEAVY_PASS) and the stored entries of tiles [s * tiles_per_split, ...) of it,
    # over the whole output row (BLOCK_D >= K: the x row stays in registers). With n_splits > 1 the splits' fp32
    # partials are summed in order by the last to arrive.
    # SKIP_HEAVY: tokens flagged in taken [M] (int8) are left to a second launch of this kernel (HEAVY_PASS) over
    # heavy_rows [heavy_count [0]], which splits each over more programs; its partials are indexed by the token's
    # place in that list (part_row), not by the token.
    # HAS_PRE: pre [M, N] holds the gate's dense pre-activations (its GEMM's output): overflowed tiles read them
    # instead of a GEMV over the gate. threshold: where an overflowed tile's gate fires (> threshold: FATReLU; 0:
    # ReLU), as kernel 1 packed it. UP_RELU: dReLU's relu on the up product (W_down rows skipped where it is <= 0).
    p = tl.program_id(0)
    if HEAVY_PASS:
        if p >= tl.load(heavy_count_ptr):
            return
        row = tl.load(heavy_rows_ptr + p).to(tl.int64)
    elif HAS_ORDER:
        row = tl.load(order_ptr + p).to(tl.int64)
    else:
        row = p.to(tl.int64)
    if SKIP_HEAVY:
        if tl.load(taken_ptr + row) != 0:
            return
    part_row = row
    if HEAVY_PASS:
        part_row = p.to(tl.int64)
    split = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D] the whole output row
    d_mask = d < K
    x_row_ptr = x_ptr + row * stride_xm
    x = tl.load(x_row_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    t_begin = split * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, n_tiles)
    local = tl.arange(0, BLOCK_TILES)
    counts = tl.load(counts_ptr + row * n_tiles + t_begin + local, mask=t_begin + local < t_end, other=0)
    stored = tl.where(counts > SLOTS, 0, counts)  # overflowed tiles: recomputed whole, below
    ends = tl.cumsum(stored, axis=0)
    starts = ends - stored
    total = tl.sum(stored, axis=0)
    row_slots = row * (n_tiles * SLOTS) + t_begin * SLOTS
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    # The stored entries as one sequence j = 0..total-1 (tile by tile), BLOCK_J at a time: with ~1 non-zero per
    # tile, walking tile by tile would leave most of a step idle.
    for j0 in range(0, total, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)  # [BLOCK_J]
        j_mask = j < total
        tile_of_j = tl.sum((ends[None, :] <= j[:, None]).to(tl.int32), axis=1)
        first_of_tile = tl.sum(tl.where(local[None, :] == tile_of_j[:, None], starts[None, :], 0), axis=1)
        slot = row_slots + tile_of_j * SLOTS + (j - first_of_tile)
        n = tl.load(indices_ptr + slot, mask=j_mask, other=0)  # [BLOCK_J] neuron ids
        h_gate = tl.load(values_ptr + slot, mask=j_mask, other=0.0).to(tl.float32)
        acc = _up_down_step(
            acc, x, n, h_gate, j_mask, wu_ptr, stride_wu, bu_ptr, wd_ptr, stride_wd, d, d_mask, HAS_B_UP, UP_RELU
        )
    if HEAVY_PASS:
        # the listed tokens with an overflowed tile come first (heavy_count[1] of them); each split of such a token
        # takes its own interleaved share of every overflowed tile of the row (groups of its fired columns read from
        # pre, or column chunks of the GEMV over the gate without it): a whole tile is the longest serial work a
        # token has
        has_overflow = p < tl.load(heavy_count_ptr + 1)
        r_begin, r_end, c_begin, c_step = 0, n_tiles, split * BLOCK_C, n_splits * BLOCK_C
        j_begin, j_step = split * BLOCK_J, n_splits * BLOCK_J
    else:
        has_overflow = tl.max(counts, axis=0) > SLOTS
        r_begin, r_end, c_begin, c_step = t_begin, t_end, 0, BLOCK_C
        j_begin, j_step = 0, BLOCK_J
    if has_overflow:
        if HAS_PRE:
            acc = _overflowed_tiles_from_pre(
                acc, x, row, counts_ptr, r_begin, r_end, n_tiles, j_begin, j_step, pre_ptr + row * stride_pre,
                wu_ptr, stride_wu, bu_ptr, wd_ptr, stride_wd, d, d_mask, N, threshold, TILE, SLOTS, BLOCK_J, HAS_B_UP,
                UP_RELU,
            )  # fmt: skip
        else:
            acc = _recompute_overflowed_tiles(
                acc,
                row,
                counts_ptr,
                r_begin,
                r_end,
                n_tiles,
                c_begin,
                c_step,
                x_row_ptr,
                wg_ptr,
                stride_wg_n,
                stride_wg_k,
                bg_ptr,
                wu_ptr,
                stride_wu,
                bu_ptr,
                wd_ptr,
                stride_wd,
                d,
                d_mask,
                K,
                N,
                TILE,
                SLOTS,
                BLOCK_C,
                BLOCK_K,
                BLOCK_J,
                HAS_B_GATE,
                HAS_B_UP,
                True,
                threshold=threshold,
                UP_RELU=UP_RELU,
            )
    if n_splits > 1:
        last, acc = sum_split_partials(
            acc,
            (total > 0) | has_overflow,
            partial_ptr,
            used_ptr,
            arrivals_ptr,
            part_row,
            split,
            n_splits,
            0,
            1,
            K,
            d,
            d_mask,
            REDUCE_SPLITS,
        )
        if last:
            if HAS_B_DOWN:
                acc += tl.load(bd_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
            tl.store(y_ptr + row * stride_ym + d, acc.to(y_ptr.dtype.element_ty), mask=d_mask)
    else:
        if HAS_B_DOWN:
            acc += tl.load(bd_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_ym + d, acc.to(y_ptr.dtype.element_ty), mask=d_mask)


@kernel
def twell_to_ell_kernel(
    values_ptr,
    indices_ptr,
    counts_ptr,
    ell_values_ptr,
    ell_indices_ptr,
    ell_counts_ptr,
    n_tiles,
    SLOTS: tl.constexpr,
    BLOCK_TILES: tl.constexpr,
):
    # TwELL [M, n_tiles * SLOTS] -> ELL of the same width (pre-zeroed), packed at the row start. Overflowed tiles
    # are left out (their consumers recompute them), so the ELL never overflows.
    row = tl.program_id(0).to(tl.int64)
    tiles = tl.arange(0, BLOCK_TILES)
    tile_mask = tiles < n_tiles
    counts = tl.load(counts_ptr + row * n_tiles + tiles, mask=tile_mask, other=0)
    stored = tl.where(counts > SLOTS, 0, counts)  # [BLOCK_TILES]
    starts = tl.cumsum(stored, axis=0) - stored
    slot = tl.arange(0, SLOTS)
    used = tile_mask[:, None] & (slot[None, :] < stored[:, None])  # [BLOCK_TILES, SLOTS]
    row_base = row * (n_tiles * SLOTS)
    src = row_base + tiles[:, None] * SLOTS + slot[None, :]
    dst = row_base + starts[:, None] + slot[None, :]
    tl.store(ell_values_ptr + dst, tl.load(values_ptr + src, mask=used, other=0.0), mask=used)
    tl.store(ell_indices_ptr + dst, tl.load(indices_ptr + src, mask=used, other=0), mask=used)
    tl.store(ell_counts_ptr + row, tl.sum(stored, axis=0))


@kernel
def twell_overflow_down_kernel(
    counts_ptr,
    x_ptr,
    wa_ptr,
    ba_ptr,
    wd_ptr,
    y_ptr,
    K,
    N,
    n_tiles,
    stride_xm,
    stride_wa_n,
    stride_wa_k,
    stride_wd,
    stride_ym,
    TILE: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_TILES: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_BA: tl.constexpr,
    pre_ptr=None,
    stride_pre=0,
    HAS_PRE: tl.constexpr = False,
):
    # Non-gated block: y [M, K] += the overflowed tiles' relu(x . W_up[n] + b_up) * W_down^T[n, :], in place.
    # wa = W_up [N, K] (any strides); wd = W_down^T [N, K] with a unit column stride. HAS_PRE: pre [M, N] holds
    # x W_up^T + b_up (the gate GEMM's output), read instead of a GEMV.
    row = tl.program_id(0).to(tl.int64)
    tiles = tl.arange(0, BLOCK_TILES)
    counts = tl.load(counts_ptr + row * n_tiles + tiles, mask=tiles < n_tiles, other=0)
    if tl.max(counts, axis=0) > SLOTS:
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = d < K
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        acc = _recompute_overflowed_tiles(
            acc,
            row,
            counts_ptr,
            0,
            n_tiles,
            n_tiles,
            0,
            BLOCK_C,
            x_ptr + row * stride_xm,
            wa_ptr,
            stride_wa_n,
            stride_wa_k,
            ba_ptr,
            wa_ptr,
            stride_wa_n,
            ba_ptr,
            wd_ptr,
            stride_wd,
            d,
            d_mask,
            K,
            N,
            TILE,
            SLOTS,
            BLOCK_C,
            BLOCK_K,
            BLOCK_C,
            HAS_BA,
            False,
            False,
            pre_ptr + row * stride_pre if HAS_PRE else pre_ptr,
            HAS_PRE,
        )
        y_ptrs = y_ptr + row * stride_ym + d
        y = tl.load(y_ptrs, mask=d_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=d_mask)
