"""The rows of a dense product ``out = a @ weight`` that came out NaN or infinite, recomputed over ``a``'s non-zeros
alone, without a host sync.

Why: a dense product (cuBLAS) multiplies every term, so a weight row holding a NaN or an infinity puts ``0 * NaN =
NaN`` into every output row, also into those whose activation of it is zero. The sparse products never read the
weight row of a zero activation: there such a row contributes exactly zero. This pass gives the dense product the
same answer, for the price of one read of ``out`` where every row is finite.

How, in two launches of fixed grids (nothing read back: CUDA-graph capturable; one opaque op under torch.compile):

1. **Listing**: each program reads a tile of rows of ``out`` and appends every row holding a NaN or an infinity to
   the long-row list of :mod:`.long_rows` (an int32 counter and a buffer, one integer atomic a row).
2. **Recomputing**: the gather kernel's spread launch (:mod:`.long_rows`) walks the listed rows as dense units of
   ``a``'s whole row: it gathers only the weight rows of the row's non-zeros, spread over the GPU, and stores the
   row's fp32-accumulated sum over the dense product's row. A row whose own fired terms are not finite (a NaN
   activation, a fired feature's NaN weight row) comes out NaN / inf again. With nothing listed its programs read
   the counter and exit.

A row listed only because the dense product overflowed its dtype (finite terms past fp16's range) is recomputed to
the same infinity: a wasted recomputation, never a wrong row.
"""

from __future__ import annotations

import torch
import triton.language as tl

from .. import _backend
from .._backend import Backend, backend_for, cdiv, next_power_of_2, record_launch
from .._jit import kernel
from .layout import unit_rows
from .long_rows import DELIVER_STORE, FORMAT_DENSE, LongRows, list_long_unit
from .spmm import launch_spread

# The listing reads tiles of about LIST_TILE elements (4 warps, 32 a thread: 16-byte loads of fp32, 64-byte of
# 16-bit values), up to LIST_MAX_BLOCK_D columns a step; a streaming read, not tuned.
LIST_TILE = 4096
LIST_MAX_BLOCK_D = 1024


@kernel
def list_nonfinite_rows_kernel(
    out_ptr,
    units_ptr,
    count_ptr,
    arrivals_ptr,
    M,
    n_out,
    stride_out,
    arrival_rows,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ARRIVALS: tl.constexpr,
):
    # out [M, n_out] (unit column stride); rows ROWS * program_id .. + ROWS, BLOCK_D columns a step. Rows holding a
    # NaN or an infinity are appended to the list (units, count) by long_rows.list_long_unit.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < M
    bad = tl.zeros([ROWS], dtype=tl.int32)
    for d0 in range(0, n_out, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (d[None, :] < n_out)
        x = tl.load(out_ptr + rows[:, None].to(tl.int64) * stride_out + d[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        nonfinite = (x != x) | (tl.abs(x) == float("inf"))
        bad = bad | tl.max(nonfinite.to(tl.int32), axis=1)
    if tl.max(bad, axis=0) > 0:  # rare: the tile's rows are listed one at a time
        for r in range(0, ROWS):
            if tl.sum(tl.where(tl.arange(0, ROWS) == r, bad, 0), axis=0) > 0:
                row = tl.program_id(0) * ROWS + r
                list_long_unit(units_ptr, count_ptr, arrivals_ptr, row, arrival_rows, ARRIVALS)


def _list_blocks(M: int, n_out: int) -> tuple[int, int]:
    """(rows, columns) of a listing program's tile."""
    if _backend.INTERPRET:
        return 4, 16  # several steps and programs on the tests' small outputs
    block_d = min(LIST_MAX_BLOCK_D, max(16, next_power_of_2(n_out)))
    return max(1, min(LIST_TILE // block_d, next_power_of_2(M))), block_d


def complete_nonfinite_rows(out: torch.Tensor, a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``out`` [M, n_out] (unit column stride) = ``a`` [M, n_in] @ ``weight`` [n_in, n_out] as a dense product
    computed it, with each row that holds a NaN or an infinity recomputed in place over ``a``'s non-zeros (see the
    module docstring); returns ``out``. A ``weight`` without unit column stride (a transposed view) is copied for
    the recomputation, as the sparse products copy it. The torch backend (CPU tensors without the interpreter) has
    no such pass: the caller computes its reference there."""
    M, n_out = out.shape
    n_in = a.shape[1]
    if M == 0 or n_out == 0 or n_in == 0 or backend_for(out, a, weight) is Backend.TORCH:
        return out
    if out.stride(1) != 1 and n_out > 1:
        raise ValueError(f"complete_nonfinite_rows: out must have unit column stride; got strides {out.stride()}")
    weight = unit_rows(weight)
    long_rows = LongRows.allocate(M, n_out, weight, 0, DELIVER_STORE.value, n_in, 0)
    rows, block_d = _list_blocks(M, n_out)
    list_nonfinite_rows_kernel[(cdiv(M, rows),)](
        out,
        long_rows.units,
        long_rows.count,
        long_rows.arrivals,
        M,
        n_out,
        out.stride(0),
        long_rows.arrival_rows,
        ROWS=rows,
        BLOCK_D=block_d,
        ARRIVALS=long_rows.arrivals_per_unit,
        num_warps=4,
    )
    record_launch("list_nonfinite_rows_kernel")
    launch_spread(
        long_rows,
        weight,
        out,
        dense_ptr=a,
        n_in=n_in,
        stride_dense=a.stride(0),
        stride_dense_col=a.stride(1),
        n_splits=1,
        long_unit_cols=n_in,
        FORMAT=FORMAT_DENSE.value,
    )
    return out
