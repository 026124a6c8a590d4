"""The elements of a dense product ``out = a @ weight`` that came out NaN or infinite, recomputed over ``a``'s
non-zeros alone, in one launch without a host sync.

Why: a dense product (cuBLAS) multiplies every term, so a weight row holding a NaN or an infinity puts ``0 * NaN =
NaN`` into every output row, also into those whose activation of it is zero. The sparse products never read the
weight row of a zero activation: there such a row contributes exactly zero. Only the non-finite elements of the
dense product can differ from that sum (a finite element had no such term), so they alone are recomputed.

How: each program owns a tile of ``out`` (ROWS rows, BLOCK_D columns) and reads it once. A row of the tile holding a
NaN or an infinity is recomputed over the tile's columns by the spread pass's sum over a dense row
(:func:`.long_rows.sum_dense_columns`: ``a``'s row scanned for non-zeros, only their weight rows gathered, fp32
accumulation) and stored over it; a row whose own fired terms are not finite (a NaN activation, a fired feature's
NaN weight row) comes out NaN / inf again. The grid is the tiles: nothing is listed or read back (CUDA-graph
capturable, one opaque op under torch.compile), and where every element is finite the cost is one read of ``out``
in one launch. Host side: that launch alone, no buffer. The weight is read where it lies, at its own row and column
strides: a decoder tied as a transposed view of the encoder (``W_enc.T``) is not copied on every call for a pass
that, where every element is finite, never reads it; the rare recomputation then gathers each fired row with a
strided read instead.

The rare path's cost: each program recomputes its tile's bad rows one after another, each a scan of ``a``'s row
(``n_in`` activations) and a gather of its non-zeros' weight rows over BLOCK_D columns, by one program: where every
row is bad (a dead feature's NaN weight row) that is the scan decode's work D / BLOCK_D times over, without its
splitting of a row over programs -- slower than the scan decode, never wrong.
"""

from __future__ import annotations

import torch
import triton.language as tl

from .. import _backend
from .._backend import cdiv, next_power_of_2, record_launch, sm_count
from .._jit import kernel
from .long_rows import sum_dense_columns

# A program's tile: BLOCK_D columns of out, at most MAX_BLOCK_D -- also the width its rare recomputation gathers, so
# each recomputed row scans a's row once per D / BLOCK_D programs -- by ROWS rows: TILE elements in all (4 warps, 32
# values a thread) where the tiles fill the GPU many times over, else one row, so that a recomputation (each a
# program's serial scan of a's row) is spread over as many programs as there are rows. The recomputation scans
# SCAN_BLOCK activations a step and gathers GROUP weight rows at a time, as the spread pass's 1024-column items do
# (long_rows.spread_config: 64 values a thread). On an H100 (one dead feature's NaN row: every row recomputed) 16
# rows of 256 columns a program took 1.6 ms for 32 bf16 tokens at d_sae 65536, where the scan decode takes 15 us.
TILE = 4096
MAX_BLOCK_D = 1024
ONE_ROW_PROGRAMS_PER_SM = 8
SCAN_BLOCK = 1024
GROUP = 8


@kernel
def complete_nonfinite_rows_kernel(
    out_ptr,
    a_ptr,
    w_ptr,
    M,
    n_in,
    n_out,
    stride_out,
    stride_a,
    stride_a_col,
    stride_w,
    stride_w_col,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    GROUP: tl.constexpr,
):
    # out [M, n_out] (unit column stride) = a [M, n_in] @ w [n_in, n_out] (any strides) as a dense product gave it.
    # Grid (row tiles, column blocks): the tile's rows holding a NaN or an infinity in its columns are recomputed
    # there over a's non-zeros.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < n_out
    x = tl.load(
        out_ptr + rows[:, None].to(tl.int64) * stride_out + d[None, :],
        mask=(rows[:, None] < M) & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    bad = tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=1)  # [ROWS]
    if tl.max(bad, axis=0) > 0:  # rare: the tile's bad rows one at a time
        for r in range(0, ROWS):
            if tl.sum(tl.where(tl.arange(0, ROWS) == r, bad, 0), axis=0) > 0:
                row = (tl.program_id(0) * ROWS + r).to(tl.int64)
                acc, _ = sum_dense_columns(
                    a_ptr + row * stride_a,
                    stride_a_col,
                    0,
                    n_in,
                    0,
                    1,
                    w_ptr,
                    stride_w,
                    stride_w_col,
                    d,
                    d_mask,
                    BLOCK_S,
                    GROUP,
                )
                tl.store(out_ptr + row * stride_out + d, acc.to(out_ptr.dtype.element_ty), mask=d_mask)


def _tile(M: int, n_out: int, device: torch.device) -> tuple[int, int, int, int]:
    """(ROWS, BLOCK_D, BLOCK_S, GROUP) of the launch."""
    if _backend.INTERPRET:
        return 4, 16, 16, 8  # several programs, row tiles and scan steps on the tests' small outputs
    block_d = min(MAX_BLOCK_D, max(16, next_power_of_2(n_out)))
    if M * cdiv(n_out, block_d) <= ONE_ROW_PROGRAMS_PER_SM * sm_count(device):
        return 1, block_d, SCAN_BLOCK, GROUP
    return max(1, min(TILE // block_d, next_power_of_2(M))), block_d, SCAN_BLOCK, GROUP


def complete_nonfinite_rows(out: torch.Tensor, a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``out`` [M, n_out] (unit column stride) = ``a`` [M, n_in] @ ``weight`` [n_in, n_out] as a dense product
    computed it, with every element that is NaN or infinite recomputed in place over ``a``'s non-zeros (see the
    module docstring); returns ``out``. ``weight`` is read at its own strides, a transposed view too: no copy is
    made. Triton backends only (CUDA tensors, or the interpreter's): on the torch backend the caller computes its
    reference instead, where no such pass is needed."""
    M, n_out = out.shape
    n_in = a.shape[1]
    if M == 0 or n_out == 0 or n_in == 0:
        return out
    if out.stride(1) != 1 and n_out > 1:
        raise ValueError(f"complete_nonfinite_rows: out must have unit column stride; got strides {out.stride()}")
    rows, block_d, block_s, group = _tile(M, n_out, out.device)
    complete_nonfinite_rows_kernel[(cdiv(M, rows), cdiv(n_out, block_d))](
        out,
        a,
        weight,
        M,
        n_in,
        n_out,
        out.stride(0),
        a.stride(0),
        a.stride(1),
        weight.stride(0),
        weight.stride(1),
        ROWS=rows,
        BLOCK_D=block_d,
        BLOCK_S=block_s,
        GROUP=group,
        num_warps=4,
    )
    record_launch("complete_nonfinite_rows_kernel")
    return out
