"""Gather-and-accumulate steps shared by the sparse-row kernels (the shared core's products, the TwELL up/down
kernel): ranking and picking a chunk's non-zeros, accumulating the weight rows they select, and combining the partial
sums of a row split over several programs."""

import triton
import triton.language as tl


@triton.jit
def rank_nonzeros(a):
    """(non-zero count, rank [BLOCK_F] of each non-zero among them, -1 elsewhere) of a chunk ``a`` [BLOCK_F].
    NaN counts as non-zero, so it propagates into whatever consumes the picks."""
    nonzero = a != 0
    rank = tl.where(nonzero, tl.cumsum(nonzero.to(tl.int32), axis=0) - 1, -1)
    return tl.sum(nonzero.to(tl.int32), axis=0), rank


@triton.jit
def pick_nonzeros(a, f, rank, j):
    """(feature ids [GROUP], values [GROUP]) of the non-zeros of rank j [GROUP] (0 where j >= count): one
    [GROUP, BLOCK_F] select-and-sum, cheap for the few non-zeros a chunk of SAE activations holds."""
    pick = rank[None, :] == j[:, None]  # [GROUP, BLOCK_F], at most one True per row
    return tl.sum(tl.where(pick, f[None, :], 0), axis=1), tl.sum(tl.where(pick, a[None, :], 0.0), axis=1)


@triton.jit
def load_rows(w_ptr, stride_w, rows, row_mask, d, d_mask, stride_w_col=1):
    """W[rows, d] [BLOCK_R, BLOCK_D] in W's dtype; rows outside ``row_mask`` are not loaded (0). W's column stride
    is 1 unless given: a unit stride (a constant, or an argument Triton specialises as 1) multiplies nothing, so a
    row-major W's loads stay full-width; another (a transposed view read without a copy) strides each row's read,
    its offsets in int64 (d * stride_w_col of a large transposed W passes 2**31)."""
    ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_w + d[None, :].to(tl.int64) * stride_w_col
    return tl.load(ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def accumulate_rows(acc, coef, rows, row_mask, w_ptr, stride_w, d, d_mask, stride_w_col=1):
    """acc [BLOCK_D] += sum_r coef[r] * W[rows[r], d] (fp32); rows outside ``row_mask`` are not loaded. The inner
    step of every gather-accumulate (stored entries, picked non-zeros, the TwELL up/down kernel). W's column stride
    as in :func:`load_rows`."""
    w = load_rows(w_ptr, stride_w, rows, row_mask, d, d_mask, stride_w_col)  # [BLOCK_R, BLOCK_D]
    return acc + tl.sum(coef[:, None] * w.to(tl.float32), axis=0)


@triton.jit
def accumulate_nonzeros(acc, a, f, w_ptr, stride_w, d, d_mask, GROUP: tl.constexpr, stride_w_col=1):
    """acc [BLOCK_D] += sum_f a[f] * W[f, d] over a chunk of activations a [BLOCK_F] (fp32) of features f [BLOCK_F],
    loading only the W rows whose activation is non-zero: an all-zero chunk costs one load of ``a``, a chunk with n
    non-zeros n rows of W. W's column stride as in :func:`load_rows`."""
    n, rank = rank_nonzeros(a)
    if n > 0:
        for g0 in range(0, n, GROUP):
            j = g0 + tl.arange(0, GROUP)  # [GROUP]
            idx, val = pick_nonzeros(a, f, rank, j)
            acc = accumulate_rows(acc, val, idx, j < n, w_ptr, stride_w, d, d_mask, stride_w_col)
    return acc


@triton.jit
def sum_split_partials(
    acc,
    has_work,
    partial_ptr,
    used_ptr,
    arrivals_ptr,
    row,
    split,
    n_splits,
    d_block,
    n_d_blocks,
    n_out,
    d,
    d_mask,
    REDUCE_SPLITS: tl.constexpr,
):
    """Combine the fp32 partial sums of a row whose work is split over ``n_splits`` programs, deterministically and
    without float atomics. Each program stores its partial ``acc`` [BLOCK_D] into partial [M, n_splits, n_out]
    (only if ``has_work``: used [M, n_splits] records which did), then arrives on arrivals [M, n_d_blocks] (int32,
    zeroed); the last to arrive sums the partials in split order. Returns (is_last, the row's total in that program
    -- meaningful only where is_last)."""
    part = (row * n_splits + split) * n_out
    if has_work:  # an empty split writes nothing; the sum below skips it
        tl.store(partial_ptr + part + d, acc, mask=d_mask)
    tl.store(used_ptr + row * n_splits + split, has_work.to(tl.int32))
    tl.debug_barrier()  # every thread's stores precede the release below
    arrived = tl.atomic_add(arrivals_ptr + row * n_d_blocks + d_block, 1, sem="acq_rel") + 1
    total = tl.zeros_like(acc)
    if arrived == n_splits:
        for s0 in range(0, n_splits, REDUCE_SPLITS):  # fixed order: deterministic
            s = s0 + tl.arange(0, REDUCE_SPLITS)  # [REDUCE_SPLITS]
            used = tl.load(used_ptr + row * n_splits + s, mask=s < n_splits, other=0, cache_modifier=".cg") > 0
            p = tl.load(
                partial_ptr + (row * n_splits + s[:, None]) * n_out + d[None, :],
                mask=used[:, None] & d_mask[None, :],
                other=0.0,
                cache_modifier=".cg",
            )
            total += tl.sum(p, axis=0)
    return arrived == n_splits, total
