"""Activation-sparse feed-forward blocks for ReLU LLMs: gate activations compacted into TwELL inside the gate
matmul, then only the fired rows of the up and down projections are touched.

Gated block (Llama-style, ``nn.Linear`` weight layouts, ``K`` = hidden size, ``N`` = intermediate size):

    h_g = relu(x @ W_gate^T + b_gate)        x [M, K], W_gate [N, K]
    y   = (h_g * (x @ W_up^T + b_up)) @ W_down^T + b_down        W_up [N, K], W_down [K, N]

Two kernels (inference):

1. ``twell_gate_fwd_kernel``: a ``tl.dot`` tile of [BLOCK_M tokens, TILE columns] of ``x @ W_gate^T`` whose
   epilogue applies the ReLU and writes TwELL (see :class:`sparsefuse.sparse.TwELL`) instead of the dense tile: one
   program owns a whole (rows, tile) block, so each row's in-tile rank is a ``cumsum`` over the tile -- no atomics,
   deterministic, column order. The dense [M, N] gate activations never reach memory. Counts are exact totals.
2. ``twell_up_down_fwd_kernel``: one program per (token, BLOCK_D slice of the output). It walks the token's
   stored non-zeros BLOCK_NZ at a time: ``u = x[m] . W_up[n, :]`` (a contiguous row of ``up_proj.weight``),
   ``y[m] += h_g[m, n] * u * W_down^T[n, :]`` (a contiguous row when ``down_proj.weight`` [K, N] is stored
   column-major, i.e. ``w_down.stride(0) == 1``; see :func:`twell_down_layout`). fp32 accumulation throughout.

Overflow is never silent: a (token, tile) with more non-zeros than its ``TILE / C`` slots is flagged by its count;
kernel 2 skips that tile's stored entries and recomputes the whole tile from ``x`` and ``W_gate`` (a GEMV over
TILE columns for that token only), so the result is exact whatever the sparsity, with no host sync.

Non-gated block (``y = relu(x @ W_up^T + b_up) @ W_down^T + b_down``): kernel 1 on W_up, a small kernel that packs
the TwELL rows into ELL (``twell_to_ell_kernel``, no host sync), the shared gather-accumulate
:func:`sparsefuse.sparse.sparse_matmul`, then ``twell_overflow_down_kernel`` adds the overflowed tiles' terms in
place (recomputed like kernel 2's; rows without overflow return at once).

Cost model (per call): kernel 1 is the gate matmul (``2 M K N`` flops) plus the TwELL writes; kernel 2 reads per
token ``nnz * 2K`` weight elements (a row of W_up and a row of W_down per non-zero; mostly L2 hits, since hot
neurons are shared across tokens) plus x and y. At M=8192, K=2048, 30 non-zeros per token that is ~2 GB of row
gathers against ~380 GFLOP of dense up/down matmuls: kernel 2 is bound by the L2 rate, so the fused path costs the
gate matmul plus an L2-bound gather.

Large batches: ``method="block"`` (:func:`_launch_block_mlp`) runs the gate on cuBLAS, lists per block of 64 tokens
the union of their fired neurons (:class:`sparsefuse.sparse.RowBlockPattern`) and does the up and down products on
those unions with tensor cores (:func:`sparsefuse.sparse.block_sddmm`, :func:`sparsefuse.sparse.block_sparse_matmul`).

``method="auto"`` compares predicted times of the paths (:class:`CostModel`) for the batch's mean non-zeros per
token, taken (in this order, first available) from ``expected_nnz``, a :class:`SparsityMonitor` (sync-free running
estimate from earlier calls: :class:`sparsefuse.nn.SparseGatedMLP` keeps one), or a probe that computes the gate of
at most 64 sampled tokens densely and reads its count -- the one host sync, documented.

Gradients: the fused path is inference-only. The functional API computes the dense block with plain torch ops
(differentiable) whenever autograd needs a gradient; the ``torch.library`` ops themselves raise a clear error in
backward rather than return wrong gradients.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import _backend
from .._backend import Backend, backend_for, new_output, record_launch, sm_count
from .._triton.dot import dot_accumulate, ieee_fp32
from .._triton.schedule import grouped_tile_coords
from .._validation import FLOAT_DTYPES, check_float, check_same_device, check_tensor, describe
from ..sparse.compact import dense_to_row_block_pattern
from ..sparse.formats import ELL, TwELL, check_twell_geometry
from .._auto import SparsityMonitor, device_scalar, sampled_nonzero_stats
from ..sparse.sddmm import block_sddmm, row_dots
from .._triton.gather import accumulate_rows, pick_nonzeros, rank_nonzeros, sum_split_partials
from ..sparse.spmm import block_sparse_matmul, sparse_matmul

__all__ = [
    "torch_twell_mlp",
    "torch_relu_mlp",
    "twell_gate",
    "twell_up_down",
    "twell_mlp",
    "twell_relu_mlp",
    "twell_to_ell",
    "twell_down_layout",
    "SparsityMonitor",
    "CostModel",
    "COST_MODEL",
    "predicted_times",
    "predicted_block_time",
    "BlockPlan",
    "DEFAULT_COMPRESSION",
    "METHODS",
]

METHODS = ("auto", "twell", "block", "dense")
DEFAULT_COMPRESSION = 8  # slots = tile / 8: 32 slots per 256-column tile (the paper's setting)
PROBE_TOKENS = 64  # tokens whose gate the auto probe computes densely
STATS_TOKENS = 256  # tokens whose non-zeros the dense path counts for a SparsityMonitor

# ----------------------------------------------------------------------------------------------------------------
# Reference (ground truth; float64-capable)
# ----------------------------------------------------------------------------------------------------------------


def _linear64(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().t()
    return out + b.double() if b is not None else out


def torch_twell_mlp(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None) -> torch.Tensor:
    """``(relu(x W_gate^T + b_gate) * (x W_up^T + b_up)) W_down^T + b_down`` in float64; x [..., K] -> [..., K]."""
    x2 = x.reshape(-1, x.shape[-1])
    h = torch.relu(_linear64(x2, w_gate, b_gate)) * _linear64(x2, w_up, b_up)
    return _linear64(h, w_down, b_down).reshape(*x.shape[:-1], w_down.shape[0])


def torch_relu_mlp(x, w_up, w_down, b_up=None, b_down=None) -> torch.Tensor:
    """Non-gated block ``relu(x W_up^T + b_up) W_down^T + b_down`` in float64; x [..., K] -> [..., K]."""
    x2 = x.reshape(-1, x.shape[-1])
    return _linear64(torch.relu(_linear64(x2, w_up, b_up)), w_down, b_down).reshape(*x.shape[:-1], w_down.shape[0])


def _dense_mlp(x2, w_gate, b_gate, w_up, b_up, w_down, b_down) -> torch.Tensor:
    """The dense block in x's dtype with cuBLAS (three matmuls): the ``method="dense"`` path and the autograd path."""
    return F.linear(torch.relu(F.linear(x2, w_gate, b_gate)) * F.linear(x2, w_up, b_up), w_down, b_down)


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def twell_gate_fwd_kernel(x_ptr, w_ptr, b_ptr, values_ptr, indices_ptr, counts_ptr,
                          M, K, N, n_tiles, tune_key, stride_xm, stride_wn, stride_wk,
                          TILE: tl.constexpr, SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE_FP32: tl.constexpr):  # fmt: skip
    # x [M, K] (unit column stride), w [N, K] (nn.Linear layout, any strides), b [N];
    # out: values/indices [M, n_tiles * SLOTS], counts [M, n_tiles] int32 (true counts)
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
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]  # fmt: skip
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + k[:, None].to(tl.int64) * stride_wk,
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0).to(x.dtype)  # [BLOCK_K, TILE]  # fmt: skip
        acc = dot_accumulate(acc, x, w, IEEE_FP32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    # Epilogue: ReLU + TwELL packing of this (rows, tile) block. NaN counts as fired (it propagates).
    fired = ((acc > 0) | (acc != acc)) & row_mask[:, None] & col_mask[None, :]  # [BLOCK_M, TILE]
    fired_i = fired.to(tl.int32)
    rank = tl.cumsum(fired_i, axis=1) - 1  # slot of each fired column within its tile row
    row_base = rows.to(tl.int64) * (n_tiles * SLOTS) + tile * SLOTS  # [BLOCK_M]
    # Unused slots hold (index 0, value 0): clear the block's slots, then scatter the survivors over them (the
    # barrier orders the two stores across the program's threads).
    slot = tl.arange(0, SLOTS)
    clear_mask = row_mask[:, None] & (slot[None, :] < SLOTS)  # [BLOCK_M, SLOTS]
    clear_ptr = row_base[:, None] + slot[None, :]
    tl.store(values_ptr + clear_ptr, tl.zeros([BLOCK_M, SLOTS], dtype=tl.float32).to(values_ptr.dtype.element_ty),
             mask=clear_mask)  # fmt: skip
    tl.store(indices_ptr + clear_ptr, tl.zeros([BLOCK_M, SLOTS], dtype=tl.int32), mask=clear_mask)
    tl.debug_barrier()
    keep = fired & (rank < SLOTS)  # past the slots: counted (the tile overflowed), not stored
    dst = row_base[:, None] + rank
    tl.store(values_ptr + dst, acc.to(values_ptr.dtype.element_ty), mask=keep)
    tl.store(indices_ptr + dst, cols[None, :] + tl.zeros_like(rank), mask=keep)
    tl.store(counts_ptr + rows.to(tl.int64) * n_tiles + tile, tl.sum(fired_i, axis=1), mask=row_mask)


@triton.jit
def _recompute_overflowed_tiles(acc, row, counts_ptr, t_begin, t_end, n_tiles, x_row_ptr, wa_ptr, stride_wa_n,
                                stride_wa_k, ba_ptr, wu_ptr, stride_wu, bu_ptr, wd_ptr, stride_wd, d, d_mask, K, N,
                                TILE: tl.constexpr, SLOTS: tl.constexpr, BLOCK_C: tl.constexpr,
                                BLOCK_K: tl.constexpr, PICK: tl.constexpr, HAS_BA: tl.constexpr,
                                HAS_BU: tl.constexpr, GATED: tl.constexpr):  # fmt: skip
    """acc += the whole contribution of every overflowed tile t in [t_begin, t_end) of ``row``, recomputed from x:
    the activation ``a = relu(x . W_a[n] + b_a)`` (W_a = W_gate, or W_up for the non-gated block) over the tile's
    columns, BLOCK_C at a time, times ``x . W_up[n] + b_up`` when GATED, times row n of W_down^T. Only rows that
    fired are loaded from W_up / W_down; the GEMV over W_a reads TILE rows. Meant for rare (token, tile) pairs."""
    for t in range(t_begin, t_end):
        if tl.load(counts_ptr + row * n_tiles + t) > SLOTS:
            for c0 in range(0, TILE, BLOCK_C):
                cols = t * TILE + c0 + tl.arange(0, BLOCK_C)  # [BLOCK_C]
                col_mask = cols < N
                pre = row_dots(x_row_ptr, wa_ptr, cols, col_mask, K, stride_wa_n, stride_wa_k,
                                       BLOCK_C, BLOCK_K)  # fmt: skip
                if HAS_BA:
                    pre += tl.load(ba_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
                fired = col_mask & ((pre > 0) | (pre != pre))
                coef = tl.where(fired, pre, 0.0)
                if GATED:
                    u = row_dots(x_row_ptr, wu_ptr, cols, fired, K, stride_wu, 1, BLOCK_C, BLOCK_K)
                    if HAS_BU:
                        u += tl.load(bu_ptr + cols, mask=fired, other=0.0).to(tl.float32)
                    coef = tl.where(fired, coef * u, 0.0)
                # down projection of the fired columns PICK at a time: [PICK, BLOCK_D] tiles, no wider than the main
                # loop's, so this rare path does not raise the kernel's register count (and cut its occupancy)
                n_fired, rank = rank_nonzeros(coef)
                for g0 in range(0, n_fired, PICK):
                    j = g0 + tl.arange(0, PICK)
                    n, c = pick_nonzeros(coef, cols, rank, j)
                    acc = accumulate_rows(acc, c, n, j < n_fired, wd_ptr, stride_wd, d, d_mask)
    return acc


@triton.jit
def twell_up_down_fwd_kernel(values_ptr, indices_ptr, counts_ptr, order_ptr, x_ptr, wg_ptr, bg_ptr, wu_ptr, bu_ptr,
                             wd_ptr, bd_ptr, y_ptr, partial_ptr, used_ptr, arrivals_ptr,
                             K, N, n_tiles, tiles_per_split, n_splits, stride_xm, stride_wg_n, stride_wg_k,
                             stride_wu, stride_wd, stride_ym,
                             TILE: tl.constexpr, SLOTS: tl.constexpr, BLOCK_TILES: tl.constexpr,
                             BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
                             BLOCK_K: tl.constexpr, REDUCE_SPLITS: tl.constexpr, HAS_ORDER: tl.constexpr,
                             HAS_B_GATE: tl.constexpr, HAS_B_UP: tl.constexpr, HAS_B_DOWN: tl.constexpr):  # fmt: skip
    # TwELL of h_g: values/indices [M, n_tiles * SLOTS], counts [M, n_tiles]; x [M, K] (unit column stride);
    # wg [N, K] (any strides; read only for overflowed tiles); wu [N, K] and wd = W_down^T [N, K] with unit column
    # strides (row n contiguous: coalesced); biases bg/bu [N], bd [K]; y [M, K].
    # Grid (tokens, splits): program (p, s) owns token order[p] (heavy tokens first, so their long chains overlap
    # the rest) and tiles [s * tiles_per_split, ...) of it, over the whole output row (BLOCK_D >= K: the x row stays
    # in registers). With n_splits > 1 the splits' fp32 partials are summed in order by the last to arrive.
    if HAS_ORDER:
        row = tl.load(order_ptr + tl.program_id(0)).to(tl.int64)
    else:
        row = tl.program_id(0).to(tl.int64)
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
        w_up = tl.load(wu_ptr + n[:, None].to(tl.int64) * stride_wu + d[None, :],
                       mask=j_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_J, BLOCK_D]  # fmt: skip
        u = tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)  # [BLOCK_J]
        if HAS_B_UP:
            u += tl.load(bu_ptr + n, mask=j_mask, other=0.0).to(tl.float32)
        acc = accumulate_rows(acc, tl.where(j_mask, h_gate * u, 0.0), n, j_mask, wd_ptr, stride_wd, d, d_mask)
    has_overflow = tl.max(counts, axis=0) > SLOTS
    if has_overflow:
        acc = _recompute_overflowed_tiles(acc, row, counts_ptr, t_begin, t_end, n_tiles, x_row_ptr, wg_ptr,
                                          stride_wg_n, stride_wg_k, bg_ptr, wu_ptr, stride_wu, bu_ptr, wd_ptr,
                                          stride_wd, d, d_mask, K, N, TILE, SLOTS, BLOCK_C, BLOCK_K, BLOCK_J,
                                          HAS_B_GATE, HAS_B_UP, True)  # fmt: skip
    if n_splits > 1:
        last, acc = sum_split_partials(acc, (total > 0) | has_overflow, partial_ptr, used_ptr, arrivals_ptr, row,
                                       split, n_splits, 0, 1, K, d, d_mask, REDUCE_SPLITS)  # fmt: skip
        if last:
            if HAS_B_DOWN:
                acc += tl.load(bd_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
            tl.store(y_ptr + row * stride_ym + d, acc.to(y_ptr.dtype.element_ty), mask=d_mask)
    else:
        if HAS_B_DOWN:
            acc += tl.load(bd_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_ym + d, acc.to(y_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def heavy_first_order_kernel(counts_ptr, order_ptr, cursors_ptr, M, n_tiles, heavy_min,
                             SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_TILES: tl.constexpr):  # fmt: skip
    # order [M] (int32): a permutation of the tokens with the heavy ones (>= heavy_min stored non-zeros, or any
    # overflowed tile) at the front and the rest at the back; cursors [2] int32 (zeroed) count the two ends. Order
    # within each class depends on program timing -- it only schedules work, the results do not depend on it.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_mask = rows < M
    tiles = tl.arange(0, BLOCK_TILES)
    counts = tl.load(counts_ptr + rows[:, None].to(tl.int64) * n_tiles + tiles[None, :],
                     mask=row_mask[:, None] & (tiles[None, :] < n_tiles), other=0)  # fmt: skip
    work = tl.sum(tl.where(counts > SLOTS, heavy_min, counts), axis=1)
    heavy = row_mask & (work >= heavy_min)
    light = row_mask & (work < heavy_min)
    front = tl.atomic_add(cursors_ptr, tl.sum(heavy.to(tl.int32), axis=0))
    back = tl.atomic_add(cursors_ptr + 1, tl.sum(light.to(tl.int32), axis=0))
    tl.store(order_ptr + front + tl.cumsum(heavy.to(tl.int32), axis=0) - 1, rows, mask=heavy)
    tl.store(order_ptr + (M - back) - tl.cumsum(light.to(tl.int32), axis=0), rows, mask=light)


@triton.jit
def twell_to_ell_kernel(values_ptr, indices_ptr, counts_ptr, ell_values_ptr, ell_indices_ptr, ell_counts_ptr,
                        n_tiles, SLOTS: tl.constexpr, BLOCK_TILES: tl.constexpr):  # fmt: skip
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


@triton.jit
def twell_overflow_down_kernel(counts_ptr, x_ptr, wa_ptr, ba_ptr, wd_ptr, y_ptr, K, N, n_tiles, stride_xm,
                               stride_wa_n, stride_wa_k, stride_wd, stride_ym,
                               TILE: tl.constexpr, SLOTS: tl.constexpr, BLOCK_TILES: tl.constexpr,
                               BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                               HAS_BA: tl.constexpr):  # fmt: skip
    # Non-gated block: y [M, K] += the overflowed tiles' relu(x . W_up[n] + b_up) * W_down^T[n, :], in place.
    # wa = W_up [N, K] (any strides); wd = W_down^T [N, K] with a unit column stride.
    row = tl.program_id(0).to(tl.int64)
    tiles = tl.arange(0, BLOCK_TILES)
    counts = tl.load(counts_ptr + row * n_tiles + tiles, mask=tiles < n_tiles, other=0)
    if tl.max(counts, axis=0) > SLOTS:
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = d < K
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        acc = _recompute_overflowed_tiles(acc, row, counts_ptr, 0, n_tiles, n_tiles, x_ptr + row * stride_xm, wa_ptr,
                                          stride_wa_n, stride_wa_k, ba_ptr, wa_ptr, stride_wa_n, ba_ptr, wd_ptr,
                                          stride_wd, d, d_mask, K, N, TILE, SLOTS, BLOCK_C, BLOCK_K, BLOCK_C, HAS_BA,
                                          False, False)  # fmt: skip
        y_ptrs = y_ptr + row * stride_ym + d
        y = tl.load(y_ptrs, mask=d_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=d_mask)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------


def _tune_key(M: int) -> int:
    return min(M, 1 << 20).bit_length()  # autotune once per power-of-two bucket of the token count


def _gate_configs() -> list[triton.Config]:
    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
        for bm, bk, w, s in [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 4), (64, 64, 8, 3), (128, 32, 8, 4),
                             (64, 128, 8, 3), (32, 128, 4, 4), (16, 128, 4, 4), (16, 256, 4, 3)]
    ]  # fmt: skip
    return _backend.tuning_configs(configs, triton.Config({"BLOCK_M": 16, "BLOCK_K": 32, "GROUP_M": 4}))


def _prune_gate_configs(configs, named_args, **kwargs):
    # Row blocks much taller than the batch only waste the tensor cores; wide tiles need smaller row blocks.
    M = named_args["M"]
    tile = kwargs.get("TILE", named_args.get("TILE", 256))
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, triton.next_power_of_2(M))
            and c.kwargs["BLOCK_M"] * tile <= 128 * 256]  # fmt: skip
    return kept or configs[-1:]


_twell_gate_kernel = triton.autotune(
    configs=_gate_configs(), key=["tune_key", "N", "K", "TILE", "SLOTS"],
    prune_configs_by={"early_config_prune": _prune_gate_configs},
)(twell_gate_fwd_kernel)  # fmt: skip


def _n_sms(device: torch.device) -> int:
    return sm_count(device)


def _output_block(M: int, K: int, device: torch.device) -> int:
    """Output slice per program of the up/down kernels: the whole row (weight rows read once per token) unless the
    batch is too small to fill the GPU, then split so that there are >= 2 programs per SM."""
    if _backend.INTERPRET:
        return 128
    block = min(4096, triton.next_power_of_2(K))
    while block > 128 and M * triton.cdiv(K, block) < 2 * _n_sms(device):
        block //= 2
    return block


def _auto_tile(M: int, N: int, compression: int) -> int:
    """256-column tiles (the paper's); 64 when the batch is small, so the gate GEMV has enough programs."""
    tile = 256 if M > 64 else 64
    tile = min(tile, max(16, triton.next_power_of_2(N)))
    return max(tile, triton.next_power_of_2(compression))


@dataclasses.dataclass(frozen=True)
class _UpDownPlan:
    block_d: int  # the whole output row
    block_j: int  # stored entries per step: [block_j, block_d] weight tiles
    num_warps: int
    n_splits: int  # programs per token (each a share of its tiles)
    ordered: bool  # heavy tokens scheduled first
    block_c: int  # overflowed-tile recompute: columns per step ...
    block_k: int  # ... and hidden elements per step (small: the recompute must not raise the kernel's registers)


def _up_down_plan(M: int, K: int, n_tiles: int, device: torch.device) -> _UpDownPlan:
    """Kernel 2's launch, measured on an H200 (scripts/probe_twell.py): 4 entries per step with ~64 weight elements
    per thread per tile; one program per token once the batch fills the GPU (the heavy ones first), otherwise
    each token's tiles split over enough programs to fill it."""
    block_d = triton.next_power_of_2(max(K, 1))
    block_j = 4 if block_d <= 16384 else max(1, 65536 // block_d)
    num_warps = min(32, max(4, block_j * block_d // 2048))
    wave = 2 * _n_sms(device)
    n_splits = 1 if M >= wave else min(n_tiles, triton.cdiv(wave, max(M, 1)))
    block_c, block_k = (16, 64) if _backend.INTERPRET else (8, 1024)
    return _UpDownPlan(block_d, block_j, num_warps, n_splits, M >= wave, block_c, block_k)


def _heavy_first_order(counts: torch.Tensor, slots: int, block_j: int) -> torch.Tensor:
    """[M] int32 permutation of the tokens, those with >= 16 steps of work (or an overflowed tile) first."""
    M, n_tiles = counts.shape
    order = torch.empty(M, dtype=torch.int32, device=counts.device)
    cursors = torch.zeros(2, dtype=torch.int32, device=counts.device)
    block_m = 16 if _backend.INTERPRET else 256
    heavy_first_order_kernel[(triton.cdiv(M, block_m),)](counts, order, cursors, M, n_tiles, 16 * block_j,
                                                        SLOTS=slots, BLOCK_M=block_m,
                                                        BLOCK_TILES=triton.next_power_of_2(n_tiles))  # fmt: skip
    record_launch("heavy_first_order_kernel")
    return order


def _launch_gate(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, tile: int,
                 compression: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    M, K = x2.shape
    N = w.shape[0]
    n_tiles, slots = triton.cdiv(N, tile), tile // compression
    if backend_for(x2) is Backend.TORCH:
        _backend.warn_reference_once("twell_gate")
        compute = _backend.compute_dtype(x2.dtype)
        pre = F.linear(x2.to(compute), w.to(compute), b.to(compute) if b is not None else None)
        t = TwELL.from_dense(torch.relu(pre).to(x2.dtype), tile, compression)
        return t.values, t.indices, t.counts
    values = new_output((M, n_tiles * slots), x2.dtype, x2.device)  # poisoned under test: every slot is written
    indices = torch.empty(M, n_tiles * slots, dtype=torch.int32, device=x2.device)
    counts = torch.empty(M, n_tiles, dtype=torch.int32, device=x2.device)
    if M == 0:
        return values, indices, counts
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * n_tiles,)  # noqa: E731
    _twell_gate_kernel[grid](
        x2, w, b if b is not None else x2, values, indices, counts, M, K, N, n_tiles, _tune_key(M), x2.stride(0),
        w.stride(0), w.stride(1), TILE=tile, SLOTS=slots, HAS_BIAS=b is not None,
        IEEE_FP32=ieee_fp32(x2.dtype),
    )  # fmt: skip
    record_launch("twell_gate_fwd_kernel")
    return values, indices, counts


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """The row-block path (``method="block"``): tokens grouped ``block_rows`` at a time, unions per ``tile`` columns.
    From ``sort_min_tokens`` tokens up (when ``sort_rows``) the tokens are first ordered by their gate non-zero
    count over the first ``sort_fraction`` of the columns (:func:`sparsefuse.sparse.compact.count_order`; counting
    all of them costs nothing extra since the pattern's one pass over the gate output reads every column).

    Measured on an H200 (scripts/probe_twell_block.py, scripts/probe_count_order.py, scripts/probe_block_schedule.py;
    1.5B shape, 30 non-zeros): 64 rows beat 32 and 128; sorting shrinks the unions from 22% to 13-14% of N and the
    whole path by 5-10% from 8192 tokens up (8B layer: 1.88x -> 2.00x dense), but still cost 5-30% at 1024-4096
    tokens after the down product was launched heaviest block first (its tail was the first suspect)."""

    block_rows: int = 64
    tile: int = 256
    sort_rows: bool = True
    sort_fraction: float = 1.0
    sort_min_tokens: int = 8192

    def sort_sample(self, N: int) -> int:
        """Columns counted to sort the tokens."""
        return max(1, math.ceil(N * self.sort_fraction))

    def sorts(self, M: int) -> bool:
        return self.sort_rows and M >= self.sort_min_tokens


BLOCK_PLAN = BlockPlan()
_INTERPRET_BLOCK_PLAN = BlockPlan(block_rows=16, tile=64, sort_min_tokens=64)  # the tests cover both orders


def _block_plan(N: int) -> BlockPlan:
    plan = _INTERPRET_BLOCK_PLAN if _backend.INTERPRET else BLOCK_PLAN
    tile = min(plan.tile, max(16, triton.next_power_of_2(N)))
    return dataclasses.replace(plan, tile=tile) if tile != plan.tile else plan


def _launch_block_mlp(x2, w_gate, b_gate, w_up, b_up, w_down_t, b_down,
                      plan: BlockPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The gated block through row-block unions (tensor cores throughout; for large batches):

    1. ``pre = x W_gate^T + b_gate`` by cuBLAS (dense [M, N] in x's dtype, as the dense block has it);
    2. :func:`sparsefuse.sparse.dense_to_row_block_pattern`: per block of ``block_rows`` tokens and tile of columns,
       the union of the columns where ``pre > 0`` (large batches: tokens sorted by non-zero count first);
    3. :func:`sparsefuse.sparse.block_sddmm`: ``h = relu(pre) * (x W_up^T + b_up)`` on the unions only (BlockELL,
       rounded to x's dtype as the dense block rounds h);
    4. :func:`sparsefuse.sparse.block_sparse_matmul`: ``y = h W_down^T + b_down``.

    The up and down products cost the dense ones times the unions' share of N. Returns (y [M, K], pre)."""
    plan = plan or _block_plan(w_gate.shape[0])
    pre = F.linear(x2, w_gate, b_gate)
    M, N = pre.shape
    pattern = dense_to_row_block_pattern(pre, plan.tile, plan.block_rows, relu=True, sort_rows=plan.sorts(M),
                                         sort_sample=plan.sort_sample(N))  # fmt: skip
    h = block_sddmm(pattern, pre, x2, w_up, b_up, relu=True, out_dtype=x2.dtype)
    return block_sparse_matmul(h, w_down_t, bias=b_down, out_dtype=x2.dtype), pre


def _launch_up_down(values, indices, counts, x2, w_gate, b_gate, w_up, b_up, w_down_t, b_down, tile: int,
                    compression: int) -> torch.Tensor:  # fmt: skip
    # w_up and w_down_t: [N, K] with unit column strides (checked by the caller).
    M, K = x2.shape
    N = w_up.shape[0]
    y = new_output((M, K), x2.dtype, x2.device)
    if M == 0 or K == 0:
        return y
    if backend_for(x2) is Backend.TORCH:
        _backend.warn_reference_once("twell_up_down")
        compute = _backend.compute_dtype(x2.dtype)
        twell = TwELL(values, indices, counts, N, tile, compression)
        h_gate = _complete_dense(twell, x2, w_gate, b_gate, compute)
        h = h_gate * F.linear(x2.to(compute), w_up.to(compute), _opt(b_up, compute))
        return y.copy_(F.linear(h, w_down_t.t().to(compute), _opt(b_down, compute)))
    n_tiles, slots = triton.cdiv(N, tile), tile // compression
    plan = _up_down_plan(M, K, n_tiles, x2.device)
    order = _heavy_first_order(counts, slots, plan.block_j) if plan.ordered else counts
    if plan.n_splits > 1:
        partial = torch.empty(M, plan.n_splits, K, dtype=torch.float32, device=x2.device)  # read where written only
        used = torch.empty(M, plan.n_splits, dtype=torch.int32, device=x2.device)
        arrivals = torch.zeros(M, 1, dtype=torch.int32, device=x2.device)
    else:
        partial = used = arrivals = y
    twell_up_down_fwd_kernel[(M, plan.n_splits)](
        values, indices, counts, order, x2, w_gate, b_gate if b_gate is not None else x2, w_up,
        b_up if b_up is not None else x2, w_down_t, b_down if b_down is not None else x2, y, partial, used, arrivals,
        K, N, n_tiles, triton.cdiv(n_tiles, plan.n_splits), plan.n_splits, x2.stride(0), w_gate.stride(0),
        w_gate.stride(1), w_up.stride(0), w_down_t.stride(0), y.stride(0),
        TILE=tile, SLOTS=slots, BLOCK_TILES=triton.next_power_of_2(triton.cdiv(n_tiles, plan.n_splits)),
        BLOCK_J=plan.block_j, BLOCK_D=plan.block_d, BLOCK_C=plan.block_c, BLOCK_K=plan.block_k,
        REDUCE_SPLITS=max(1, min(triton.next_power_of_2(plan.n_splits), 8192 // plan.block_d)),
        HAS_ORDER=plan.ordered, HAS_B_GATE=b_gate is not None, HAS_B_UP=b_up is not None,
        HAS_B_DOWN=b_down is not None, num_warps=plan.num_warps,
    )  # fmt: skip
    record_launch("twell_up_down_fwd_kernel")
    return y


def _opt(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return t.to(dtype) if t is not None else None


def _complete_dense(twell: TwELL, x2, w_act, b_act, compute: torch.dtype) -> torch.Tensor:
    """Torch fallback: the dense activations, stored entries where the tile fits, recomputed where it overflowed."""
    recomputed = torch.relu(F.linear(x2.to(compute), w_act.to(compute), _opt(b_act, compute)))
    over = twell.overflowed().repeat_interleave(twell.tile, dim=1)[:, : twell.n_cols]
    clean = TwELL(twell.values, twell.indices, twell.counts.masked_fill(twell.overflowed(), 0), twell.n_cols,
                  twell.tile, twell.compression)  # fmt: skip
    return torch.where(over, recomputed, clean.to_dense().to(compute))


def _launch_to_ell(values, indices, counts, n_cols: int, tile: int, compression: int) -> ELL:
    M, width = values.shape
    n_tiles, slots = counts.shape[1], tile // compression
    if backend_for(values) is Backend.TORCH or M == 0:
        if M:
            _backend.warn_reference_once("twell_to_ell")
        clean = counts.masked_fill(counts > slots, 0)
        dense = TwELL(values, indices, clean, n_cols, tile, compression).to_dense()
        ell = ELL.from_dense(dense, width)
        return ELL(ell.values, ell.indices, clean.sum(1, dtype=torch.int32), n_cols)
    ell_values = torch.zeros(M, width, dtype=values.dtype, device=values.device)
    ell_indices = torch.zeros(M, width, dtype=torch.int32, device=values.device)
    ell_counts = torch.empty(M, dtype=torch.int32, device=values.device)
    twell_to_ell_kernel[(M,)](values, indices, counts, ell_values, ell_indices, ell_counts, n_tiles, SLOTS=slots,
                              BLOCK_TILES=triton.next_power_of_2(n_tiles))  # fmt: skip
    record_launch("twell_to_ell_kernel")
    return ELL(ell_values, ell_indices, ell_counts, n_cols)


def _relu_down(x2, w_up, b_up, w_down_t, b_down, tile: int, compression: int) -> torch.Tensor:
    """Non-gated block through TwELL -> ELL -> sparse_matmul, overflowed tiles added in place."""
    M, K = x2.shape
    N = w_up.shape[0]
    values, indices, counts = _launch_gate(x2, w_up, b_up, tile, compression)
    if backend_for(x2) is Backend.TORCH:
        _backend.warn_reference_once("twell_relu_mlp")
        compute = _backend.compute_dtype(x2.dtype)
        h = _complete_dense(TwELL(values, indices, counts, N, tile, compression), x2, w_up, b_up, compute)
        return F.linear(h, w_down_t.t().to(compute), _opt(b_down, compute)).to(x2.dtype)
    ell = _launch_to_ell(values, indices, counts, N, tile, compression)
    y = sparse_matmul(ell, w_down_t, out_dtype=x2.dtype)
    if M == 0 or K == 0:
        return y
    if b_down is not None:
        y += b_down
    n_tiles, slots = counts.shape[1], tile // compression
    block_d = _output_block(M, K, x2.device)
    twell_overflow_down_kernel[(M, triton.cdiv(K, block_d))](
        counts, x2, w_up, b_up if b_up is not None else x2, w_down_t, y, K, N, n_tiles, x2.stride(0),
        w_up.stride(0), w_up.stride(1), w_down_t.stride(0), y.stride(0),
        TILE=tile, SLOTS=slots, BLOCK_TILES=triton.next_power_of_2(n_tiles), BLOCK_C=16 if _backend.INTERPRET else 8,
        BLOCK_K=64 if _backend.INTERPRET else min(block_d, 1024), BLOCK_D=block_d, HAS_BA=b_up is not None,
    )  # fmt: skip
    record_launch("twell_overflow_down_kernel")
    return y


# ----------------------------------------------------------------------------------------------------------------
# method="auto": predicted times and the sparsity estimate
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CostModel:
    """Rates for the auto decision, fitted to the H200 runs of ``scripts/probe_twell.py`` (1.5B shape, bf16,
    synthetic heavy-tailed sparsity, ~31 non-zeros per token; benchmarks/NOTES.md): the TwELL gate kernel took
    2.3-2.8x cuBLAS's gate matmul from 2048 tokens up (its epilogue, not its mainloop: a counts-only epilogue ran at
    1.1-1.2x); kernel 2 moved its weight rows at ~0.9 TB/s on the heavy-tailed batch (its overflowed tiles are
    recomputed by a GEMV inside the token's program) against ~6 TB/s on a tail-free one; and the fused path took
    28 us at 16 tokens (1.05x dense eager at 32 non-zeros; 201 us at 512). With these the model picks twell at 16
    tokens x 32 non-zeros and dense elsewhere on the measured grid, as measured.

    ``gather_bytes_per_s`` is kernel 2's effective rate for weight-row gathers when the GPU is full; with fewer than
    ``2 * n_sms`` programs it scales down in proportion. ``twell_overhead`` scales the gate matmul for the TwELL
    epilogue; ``serial_s_per_step`` is kernel 2's time per step of a token's chain (4 entries); ``min_s`` is the
    fused path's floor at tiny batches."""

    matmul_flops_per_s: float = 600e12  # bf16/fp16 tensor cores
    fp32_matmul_flops_per_s: float = 50e12
    dram_bytes_per_s: float = 3.0e12
    gather_bytes_per_s: float = 0.9e12
    launch_s: float = 3e-6
    twell_overhead: float = 2.5
    serial_s_per_step: float = 1.5e-6
    min_s: float = 25e-6
    n_sms: int = 132
    # row-block path (method="block"): the up/down products' rate on the model's uniform-firing union estimate,
    # scaled like the dense terms (which the model over-predicts by ~1.25x) so the two compare fairly. Refitted to
    # the full ffn grid at 84620c3 on an H200 (down product launched heavy first): the model then predicts the
    # block path within -28%..+7% of its measured ratio to dense at <= 32 non-zeros and under-predicts above, so
    # auto never took block where it lost (the fit it replaced, 260e12, missed the 1.08x win at 2048 tokens)
    block_flops_per_s: float = 330e12
    block_min_tokens: int = 1024  # fewer than 16 row blocks of 64 tokens cannot fill the GPU


COST_MODEL = CostModel()


def _matmul_s(M: int, K: int, N: int, elem: int, fp32: bool, cm: CostModel) -> float:
    rate = cm.fp32_matmul_flops_per_s if fp32 else cm.matmul_flops_per_s
    return max(2.0 * M * K * N / rate, (M * K + K * N + M * N) * elem / cm.dram_bytes_per_s) + cm.launch_s


def predicted_times(M: int, K: int, N: int, mean_nnz: float, dtype: torch.dtype,
                    cost_model: CostModel | None = None) -> tuple[float, float]:  # fmt: skip
    """(twell seconds, dense seconds) predicted for a gated block of M tokens with ``mean_nnz`` gate non-zeros per
    token. Dense: three matmuls plus the ReLU and product passes over [M, N]. Twell: the gate matmul with its
    epilogue, plus kernel 2's row gathers -- per non-zero a W_up row for each of the token's ``splits`` programs
    and a W_down row -- at the gather rate scaled by how full the GPU is, but never faster than reading the
    distinct rows touched from DRAM once."""
    cm = cost_model or COST_MODEL
    elem = torch.finfo(dtype).bits // 8
    fp32 = dtype == torch.float32
    gate = _matmul_s(M, K, N, elem, fp32, cm)
    dense = 3 * gate + 5.0 * M * N * elem / cm.dram_bytes_per_s + 2 * cm.launch_s
    wave = 2 * cm.n_sms
    splits = 1 if M >= wave else min(triton.cdiv(N, _auto_tile(M, N, 1)), triton.cdiv(wave, max(M, 1)))
    occupancy = min(1.0, M * splits / wave)
    gathered = M * mean_nnz * 2.0 * K * elem  # a W_up row and a W_down row per non-zero
    distinct_rows = N * (1.0 - (1.0 - min(mean_nnz, N) / N) ** M) if N else 0.0
    steps = mean_nnz / (4.0 * splits)  # a token's serial chain: 4 entries per step, its tiles over `splits`
    gathers = max(gathered / (cm.gather_bytes_per_s * occupancy), distinct_rows * 2.0 * K * elem / cm.dram_bytes_per_s,
                  steps * cm.serial_s_per_step)  # fmt: skip
    twell = max(cm.min_s, cm.twell_overhead * gate + gathers + 2.0 * M * K * elem / cm.dram_bytes_per_s + cm.launch_s)
    return twell, dense


def predicted_block_time(M: int, K: int, N: int, mean_nnz: float, dtype: torch.dtype,
                         cost_model: CostModel | None = None, block_rows: int = 64) -> float:  # fmt: skip
    """Seconds predicted for ``method="block"``: the cuBLAS gate, one pass over the [M, N] pre-activations (the
    unions), and the up and down products on the unions. A block's union is estimated as if neurons fired
    independently and uniformly, ``N * (1 - (1 - nnz / N) ** block_rows)`` -- an over-estimate for real layers,
    whose hot neurons are shared (the synthetic FFN at 30 non-zeros: 22% of N measured, 29% estimated)."""
    cm = cost_model or COST_MODEL
    elem = torch.finfo(dtype).bits // 8
    fp32 = dtype == torch.float32
    gate = _matmul_s(M, K, N, elem, fp32, cm)
    union = 1.0 - (1.0 - min(mean_nnz, N) / max(N, 1)) ** block_rows
    n_blocks = triton.cdiv(max(M, 1), block_rows)
    fill = min(1.0, M / 8192) ** 0.31 * min(1.0, n_blocks * triton.cdiv(K, 256) / (2 * cm.n_sms))
    rate = cm.block_flops_per_s * (cm.fp32_matmul_flops_per_s / cm.matmul_flops_per_s if fp32 else 1.0) * fill
    products = 2 * 2.0 * M * K * N * union / rate
    traffic = (M * N + 3 * M * N * union + 2 * M * K) * elem / cm.dram_bytes_per_s
    return gate + products + traffic + 4 * cm.launch_s


# From a full GPU's worth of tokens (2 x SMs) up, auto takes twell only for a predicted win of at least this much:
# there the model's twell time is off by up to ~35% either way near the crossover (the heavy tail's serial chains are
# not modelled), and one wrong pick cost 26% (M=2048, 8B layer, 8 non-zeros; benchmarks/NOTES.md row 23). Below
# that the model erred only on the pessimistic side (predicted 0.81-0.90 of dense, measured 0.55-0.87), so no margin.
AUTO_MARGIN = 0.92


def _auto_method(M: int, K: int, N: int, mean_nnz: float, dtype: torch.dtype) -> str:
    """The method auto runs: the fastest predicted of twell, block (from ``block_min_tokens``) and dense, a sparse
    one only if it beats dense by the margin."""
    twell, dense = predicted_times(M, K, N, mean_nnz, dtype)
    margin = AUTO_MARGIN if M >= 2 * COST_MODEL.n_sms else 1.0
    best, method = twell, "twell"
    if M >= COST_MODEL.block_min_tokens:
        block = predicted_block_time(M, K, N, mean_nnz, dtype)
        if block < best:
            best, method = block, "block"
    return method if best < margin * dense else "dense"


def _probe_mean_nnz(x2: torch.Tensor, w_gate: torch.Tensor, b_gate: torch.Tensor | None) -> float:
    """Mean gate non-zeros per token over <= PROBE_TOKENS evenly spaced tokens (dense, one host sync)."""
    M = x2.shape[0]
    rows = torch.linspace(0, M - 1, min(M, PROBE_TOKENS), device=x2.device).long()
    fired = (F.linear(x2[rows], w_gate, b_gate) > 0).sum()
    return float(fired) / rows.numel()  # the sync


# ----------------------------------------------------------------------------------------------------------------
# torch.library ops
# ----------------------------------------------------------------------------------------------------------------


def _inference_only(ctx, *grads):
    raise RuntimeError(
        "sparsefuse TwELL ops are inference-only (no backward through the sparse format). Call sparsefuse.twell_mlp "
        "/ twell_relu_mlp (they use the dense, differentiable computation whenever autograd needs gradients) or "
        "run under torch.no_grad()"
    )


def _no_context(ctx, inputs, output) -> None:
    pass


@torch.library.custom_op("sparsefuse::twell_gate", mutates_args=())
def twell_gate_op(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, tile: int,
                  compression: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return _launch_gate(x, w, b, tile, compression)


@twell_gate_op.register_fake
def _(x, w, b, tile, compression):
    M, n_tiles = x.shape[0], -(-w.shape[0] // tile)
    width = n_tiles * (tile // compression)
    return (x.new_empty((M, width)), x.new_empty((M, width), dtype=torch.int32),
            x.new_empty((M, n_tiles), dtype=torch.int32))  # fmt: skip


@torch.library.custom_op("sparsefuse::twell_up_down", mutates_args=())
def twell_up_down_op(values: torch.Tensor, indices: torch.Tensor, counts: torch.Tensor, x: torch.Tensor,
                     w_gate: torch.Tensor, b_gate: torch.Tensor | None, w_up: torch.Tensor, b_up: torch.Tensor | None,
                     w_down_t: torch.Tensor, b_down: torch.Tensor | None, tile: int,
                     compression: int) -> torch.Tensor:  # fmt: skip
    return _launch_up_down(values, indices, counts, x, w_gate, b_gate, w_up, b_up, w_down_t, b_down, tile,
                           compression)  # fmt: skip


@twell_up_down_op.register_fake
def _(values, indices, counts, x, w_gate, b_gate, w_up, b_up, w_down_t, b_down, tile, compression):
    return x.new_empty(x.shape)


def _mlp_forward(x2, w_gate, b_gate, w_up, b_up, w_down_t, b_down, tile: int, compression: int, method: str,
                 with_stats: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    M, K = x2.shape
    N = w_gate.shape[0]
    if method == "auto":  # no estimate was given: the probe (one host sync)
        method = _auto_method(M, K, N, _probe_mean_nnz(x2, w_gate, b_gate), x2.dtype) if M else "dense"
    if method == "dense":
        h_gate = torch.relu(F.linear(x2, w_gate, b_gate))
        y = F.linear(h_gate * F.linear(x2, w_up, b_up), w_down_t.t(), b_down)
        if not with_stats or M == 0:
            return y, _no_stats(x2, with_stats)
        return y, sampled_nonzero_stats(h_gate, STATS_TOKENS, positive=True)
    if method == "block":
        y, pre = _launch_block_mlp(x2, w_gate, b_gate, w_up, b_up, w_down_t, b_down)
        if not with_stats or M == 0:
            return y, _no_stats(x2, with_stats)
        return y, sampled_nonzero_stats(pre, STATS_TOKENS, positive=True)
    tile = tile or _auto_tile(M, N, compression)
    values, indices, counts = _launch_gate(x2, w_gate, b_gate, tile, compression)
    y = _launch_up_down(values, indices, counts, x2, w_gate, b_gate, w_up, b_up, w_down_t, b_down, tile, compression)
    if not with_stats:
        return y, _no_stats(x2, with_stats)
    return y, torch.stack([counts.sum(dtype=torch.int64), device_scalar(M, x2.device)])


def _no_stats(x2: torch.Tensor, with_stats: bool) -> torch.Tensor:
    """Stats when none were asked for: an empty tensor (no kernel; a zero-filled [2] cost a launch, ~3 us at one
    token), or zeros for an empty batch that was asked for them."""
    return x2.new_zeros(2, dtype=torch.int64) if with_stats else x2.new_empty(0, dtype=torch.int64)


@torch.library.custom_op("sparsefuse::twell_mlp", mutates_args=())
def twell_mlp_op(x: torch.Tensor, w_gate: torch.Tensor, b_gate: torch.Tensor | None, w_up: torch.Tensor,
                 b_up: torch.Tensor | None, w_down_t: torch.Tensor, b_down: torch.Tensor | None, tile: int,
                 compression: int, method: str, with_stats: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return _mlp_forward(x, w_gate, b_gate, w_up, b_up, w_down_t, b_down, tile, compression, method, with_stats)


@twell_mlp_op.register_fake
def _(x, w_gate, b_gate, w_up, b_up, w_down_t, b_down, tile, compression, method, with_stats):
    return x.new_empty((x.shape[0], w_down_t.shape[1])), x.new_empty((2 if with_stats else 0,), dtype=torch.int64)


def _relu_mlp_forward(x2, w_up, b_up, w_down_t, b_down, tile: int, compression: int) -> torch.Tensor:
    tile = tile or _auto_tile(x2.shape[0], w_up.shape[0], compression)
    return _relu_down(x2, w_up, b_up, w_down_t, b_down, tile, compression)


@torch.library.custom_op("sparsefuse::twell_relu_mlp", mutates_args=())
def twell_relu_mlp_op(x: torch.Tensor, w_up: torch.Tensor, b_up: torch.Tensor | None, w_down_t: torch.Tensor,
                      b_down: torch.Tensor | None, tile: int, compression: int) -> torch.Tensor:  # fmt: skip
    return _relu_mlp_forward(x, w_up, b_up, w_down_t, b_down, tile, compression)


@twell_relu_mlp_op.register_fake
def _(x, w_up, b_up, w_down_t, b_down, tile, compression):
    return x.new_empty((x.shape[0], w_down_t.shape[1]))


for _op in (twell_gate_op, twell_up_down_op, twell_mlp_op, twell_relu_mlp_op):
    _op.register_autograd(_inference_only, setup_context=_no_context)


# ----------------------------------------------------------------------------------------------------------------
# Functional API
# ----------------------------------------------------------------------------------------------------------------


def twell_down_layout(w_down: torch.Tensor) -> torch.Tensor:
    """``w_down`` [K, N] (``down_proj.weight``) with the same values laid out column-major (strides (1, K)), so
    that row n of W_down^T -- what the sparse kernels read per non-zero -- is contiguous. Returns w_down itself
    when it already is. ``F.linear`` and ``load_state_dict`` accept the result unchanged."""
    if w_down.dim() == 2 and (w_down.stride(0) == 1 or w_down.shape[1] <= 1):
        return w_down
    return w_down.t().contiguous().t()


def _down_rows(op: str, w_down: torch.Tensor) -> torch.Tensor:
    """W_down^T [N, K] with unit column stride (a view when w_down is column-major, else one copy per call)."""
    if w_down.stride(0) == 1 or w_down.shape[1] <= 1:
        return w_down.t()
    if op not in _warned_down_copy:
        _warned_down_copy.add(op)
        warnings.warn(f"sparsefuse.{op}: w_down is row-major [K, N], so its rows per neuron are strided; it is "
                      "copied to column-major on every call. Store it once with sparsefuse.ffn.twell_down_layout "
                      "(sparsefuse.nn.SparseGatedMLP does).", stacklevel=3)  # fmt: skip
    return w_down.t().contiguous()


_warned_down_copy: set[str] = set()


def _rows_contiguous(w: torch.Tensor) -> torch.Tensor:
    return w if w.stride(-1) == 1 or w.shape[-1] <= 1 else w.contiguous()


def _check_weight(op: str, name: str, w: object, shape: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
    check_tensor(op, name, w)
    check_float(op, name, w)
    if w.dtype != x.dtype:
        raise TypeError(f"{op}: {name} must have x's dtype {str(x.dtype).removeprefix('torch.')}; got {describe(w)}")
    if tuple(w.shape) != shape:
        raise ValueError(f"{op}: {name} must have shape {list(shape)} (nn.Linear layout [out, in]) for x "
                         f"{describe(x)}; got {describe(w)}")  # fmt: skip
    return w


def _check_geometry_args(op: str, tile: int | None, compression: int) -> None:
    if tile is not None:
        check_twell_geometry(op, tile, compression)
    elif not isinstance(compression, int) or isinstance(compression, bool) or compression <= 0 or \
            compression & (compression - 1) or compression > 1024:  # fmt: skip
        raise ValueError(f"{op}: compression must be a power of two in [1, 1024] (it must divide the power-of-two "
                         f"tile); got {compression!r}")  # fmt: skip


def _check_x(op: str, x: object, K: int | None = None) -> torch.Tensor:
    check_tensor(op, "x", x)
    check_float(op, "x", x, FLOAT_DTYPES)
    if x.dim() < 1 or (K is not None and x.shape[-1] != K):
        raise ValueError(f"{op}: x must be [..., hidden_size={K}]; got {describe(x)}")
    return x


def twell_gate(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *, tile: int = 256,
               compression: int = DEFAULT_COMPRESSION) -> TwELL:  # fmt: skip
    """Kernel 1 alone: ``relu(x @ w^T + b)`` straight into TwELL (no dense [M, N] activations in memory).

    Args:
        x: [..., K] float32/float16/bfloat16.
        w: [N, K] (``nn.Linear`` weight, any strides), x's dtype; b: optional [N].
        tile: columns per tile, a power of two in [16, 1024]; compression: tile // compression slots per tile.
    Returns: TwELL of shape [M, N] (M = x.numel() // K) with exact per-tile counts (overflowed tiles flagged).
    Inference-only.
    """
    op = "twell_gate"
    _check_geometry_args(op, tile, compression)
    check_tensor(op, "w", w)
    if w.dim() != 2:
        raise ValueError(f"{op}: w must be [N, K] (nn.Linear layout); got {describe(w)}")
    x = _check_x(op, x, w.shape[1])
    _check_weight(op, "w", w, tuple(w.shape), x)
    if b is not None:
        _check_bias(op, "b", b, w.shape[0], x)
    check_same_device(op, x=x, w=w, **({"b": b} if b is not None else {}))
    x2 = _rows_contiguous(x.reshape(-1, x.shape[-1]))
    values, indices, counts = twell_gate_op(x2, w, b, tile, compression)
    return TwELL(values, indices, counts, w.shape[0], tile, compression)


def twell_up_down(twell: TwELL, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *,
                  b_gate: torch.Tensor | None = None, b_up: torch.Tensor | None = None,
                  b_down: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Kernel 2 alone: ``(h_g * (x @ w_up^T + b_up)) @ w_down^T + b_down`` for gate activations ``h_g`` given as
    TwELL (from :func:`twell_gate` on ``w_gate``/``b_gate``, which are read only to recompute overflowed tiles).
    Shapes as :func:`twell_mlp`; returns [..., K]. Inference-only."""
    op = "twell_up_down"
    x2, w_gate, b_gate, w_up, b_up, w_down_t, b_down = _check_mlp(op, x, w_gate, b_gate, w_up, b_up, w_down, b_down)
    if not isinstance(twell, TwELL) or twell.shape != (x2.shape[0], w_gate.shape[0]):
        raise ValueError(f"{op}: twell must be a TwELL of shape [{x2.shape[0]}, {w_gate.shape[0]}]; got "
                         f"{type(twell).__name__} {getattr(twell, 'shape', None)}")  # fmt: skip
    check_same_device(op, x=x, twell_values=twell.values)
    if twell.values.dtype != x.dtype:
        raise TypeError(f"{op}: twell.values must have x's dtype; got {twell.values.dtype}")
    y = twell_up_down_op(twell.values, twell.indices, twell.counts, x2, w_gate, b_gate, w_up, b_up, w_down_t, b_down,
                         twell.tile, twell.compression)  # fmt: skip
    return y.reshape(*x.shape[:-1], w_down.shape[0])


def _check_bias(op: str, name: str, b: object, n: int, x: torch.Tensor) -> None:
    check_tensor(op, name, b)
    check_float(op, name, b)
    if b.dtype != x.dtype or tuple(b.shape) != (n,):
        raise ValueError(f"{op}: {name} must be a [{n}] tensor of x's dtype {str(x.dtype).removeprefix('torch.')}; "
                         f"got {describe(b)}")  # fmt: skip


def _check_mlp(op: str, x, w_gate, b_gate, w_up, b_up, w_down, b_down, gate_names=("w_gate", "b_gate")):
    """Validated (x2 [M, K], w_gate, b_gate, w_up with unit column stride, b_up, W_down^T [N, K] rows, b_down).
    ``gate_names``: what the activation weight and bias are called in messages (w_up/b_up for the non-gated
    block, which passes no w_up)."""
    w_name, b_name = gate_names
    check_tensor(op, w_name, w_gate)
    if w_gate.dim() != 2:
        raise ValueError(f"{op}: {w_name} must be [intermediate_size, hidden_size] (nn.Linear layout); got "
                         f"{describe(w_gate)}")  # fmt: skip
    N, K = w_gate.shape
    x = _check_x(op, x, K)
    _check_weight(op, w_name, w_gate, (N, K), x)
    if w_up is not None:
        _check_weight(op, "w_up", w_up, (N, K), x)
    _check_weight(op, "w_down", w_down, (K, N), x)
    biases = {}
    for name, b, n in ((b_name, b_gate, N), ("b_up", b_up, N), ("b_down", b_down, K)):
        if b is not None:
            _check_bias(op, name, b, n, x)
            biases[name] = b
    others = {w_name: w_gate, "w_down": w_down, **({"w_up": w_up} if w_up is not None else {}), **biases}
    check_same_device(op, x=x, **others)
    x2 = _rows_contiguous(x.reshape(-1, K))
    return x2, w_gate, b_gate, _rows_contiguous(w_up) if w_up is not None else None, b_up, \
        _down_rows(op, w_down), b_down  # fmt: skip


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def twell_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *,
              b_gate: torch.Tensor | None = None, b_up: torch.Tensor | None = None,
              b_down: torch.Tensor | None = None, compression: int = DEFAULT_COMPRESSION, tile: int | None = None,
              method: str = "auto", expected_nnz: float | None = None,
              monitor: SparsityMonitor | None = None) -> torch.Tensor:  # fmt: skip
    """Gated ReLU feed-forward block ``(relu(x W_gate^T + b_gate) * (x W_up^T + b_up)) W_down^T + b_down`` (a
    transformers ``LlamaMLP`` with ``hidden_act="relu"``), skipping the up/down rows of gate activations that are 0.

    Args:
        x: [..., K] float32/float16/bfloat16 (K = hidden size).
        w_gate, w_up: [N, K]; w_down: [K, N] -- ``nn.Linear`` weights, x's dtype and device. For coalesced reads
            w_down should be column-major (``w_down.stride(0) == 1``: :func:`twell_down_layout`); a row-major one is
            copied on every sparse call (warned once). Biases optional: [N], [N], [K].
        compression: C; each tile of ``tile`` columns keeps ``tile // C`` non-zeros (more are recomputed, never
            dropped). A power of two dividing the tile.
        tile: TwELL tile width (power of two, 16..1024); None: 256, or 64 for batches of <= 64 tokens.
        method: "twell" (the two fused TwELL kernels: small batches), "block" (cuBLAS gate, then the up and down
            products on tensor cores over each 64-token block's union of fired neurons: large batches; see
            :func:`_launch_block_mlp`), "dense" (three cuBLAS matmuls), or "auto": the fastest predicted
            (:func:`predicted_times`, :func:`predicted_block_time`) for the batch's mean non-zeros per token, a sparse
            method only if it beats dense by the margin. The estimate comes from ``expected_nnz``, else ``monitor``
            (sync-free, from earlier calls), else a probe of <= 64 tokens (one host sync).
        monitor: a :class:`SparsityMonitor` updated by this call (without a sync).
    Returns: [..., K] in x's dtype; fp32 accumulation. When autograd needs a gradient the dense computation runs
    (differentiable); the sparse kernels are inference-only.
    """
    op = "twell_mlp"
    if method not in METHODS:
        raise ValueError(f"{op}: method must be one of {', '.join(METHODS)}; got {method!r}")
    _check_geometry_args(op, tile, compression)
    if expected_nnz is not None and (isinstance(expected_nnz, bool) or not isinstance(expected_nnz, (int, float))
                                     or not expected_nnz >= 0):  # fmt: skip
        raise ValueError(f"{op}: expected_nnz must be a non-negative number; got {expected_nnz!r}")
    x2, w_gate, b_gate, w_up, b_up, w_down_t, b_down = _check_mlp(op, x, w_gate, b_gate, w_up, b_up, w_down, b_down)
    out_shape = (*x.shape[:-1], w_down.shape[0])
    if _needs_grad(x, w_gate, w_up, w_down, b_gate, b_up, b_down):
        return _dense_mlp(x2, w_gate, b_gate, w_up, b_up, w_down_t.t(), b_down).reshape(out_shape)
    M, K = x2.shape
    if method == "auto":
        estimate = expected_nnz
        if estimate is None and monitor is not None and not torch.compiler.is_compiling():
            estimate = monitor.estimate()
        if estimate is not None:
            method = _auto_method(M, K, w_gate.shape[0], estimate, x.dtype)
        elif torch.compiler.is_compiling():
            # No sync inside a compiled graph, and a monitor's changing estimate would recompile it: without
            # expected_nnz a compiled call assumes the sparse regime.
            method = "twell"
    with_stats = monitor is not None and not torch.compiler.is_compiling() and \
        not (x.is_cuda and torch.cuda.is_current_stream_capturing())  # fmt: skip
    args = (x2, w_gate, b_gate, w_up, b_up, w_down_t, b_down, tile or 0, compression, method, with_stats)
    # Plain eager inference skips the dispatcher (tens of microseconds per call: it matters for decode batches).
    fast = _backend.bypass_dispatcher(*(t for t in args[:7] if t is not None))
    y, stats = _mlp_forward(*args) if fast else twell_mlp_op(*args)
    if with_stats:
        monitor.observe(stats)
    return y.reshape(out_shape)


def twell_relu_mlp(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *, b_up: torch.Tensor | None = None,
                   b_down: torch.Tensor | None = None, compression: int = DEFAULT_COMPRESSION,
                   tile: int | None = None, method: str = "twell") -> torch.Tensor:  # fmt: skip
    """Non-gated ReLU block ``relu(x W_up^T + b_up) W_down^T + b_down``: kernel 1 on W_up, TwELL -> ELL on the
    device, the shared :func:`sparsefuse.sparse.sparse_matmul`, overflowed tiles recomputed and added in place.

    Args: x [..., K]; w_up [N, K]; w_down [K, N] (column-major preferred, see :func:`twell_mlp`); biases [N], [K];
    method "twell" or "dense". Returns [..., K] in x's dtype. Dense (differentiable) under autograd.
    """
    op = "twell_relu_mlp"
    if method not in ("twell", "dense"):
        raise ValueError(f"{op}: method must be 'twell' or 'dense'; got {method!r}")
    _check_geometry_args(op, tile, compression)
    x2, w_up, b_up, _, _, w_down_t, b_down = _check_mlp(op, x, w_up, b_up, None, None, w_down, b_down,
                                                         gate_names=("w_up", "b_up"))
    out_shape = (*x.shape[:-1], w_down.shape[0])
    if method == "dense" or _needs_grad(x, w_up, w_down, b_up, b_down):
        return F.linear(torch.relu(F.linear(x2, w_up, b_up)), w_down_t.t(), b_down).reshape(out_shape)
    args = (x2, w_up, b_up, w_down_t, b_down, tile or 0, compression)
    fast = _backend.bypass_dispatcher(*(t for t in args[:5] if t is not None))
    return (_relu_mlp_forward(*args) if fast else twell_relu_mlp_op(*args)).reshape(out_shape)


def twell_to_ell(twell: TwELL) -> ELL:
    """Pack TwELL rows into ELL of the same width on the device (no host sync), for the shared
    :func:`sparsefuse.sparse.sparse_matmul`. Overflowed tiles are **left out** (their entries are incomplete), so
    the ELL's counts are the stored entries of the complete tiles; check ``twell.overflowed()`` and complete those
    tiles separately (as :func:`twell_relu_mlp` does)."""
    return _launch_to_ell(twell.values, twell.indices, twell.counts, twell.n_cols, twell.tile, twell.compression)

