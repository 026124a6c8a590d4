"""The scan: ``a @ weight`` for a mostly-zero ``a`` read in its dense form, through the gather kernel's DENSE format
(:mod:`.spmm`): each program scans a range of a row's columns for non-zeros and gathers only their weight rows. Ranges
far denser than the others are listed on the device and spread over the GPU by a second launch (:mod:`.long_rows`);
those at least half non-zero, where splits are summed by atomics, are summed on tensor cores (:mod:`.dense_units`).
"""

from __future__ import annotations

import torch

from .. import _backend
from .._backend import Backend, backend_for, cdiv, next_power_of_2, sm_count
from .._validation import check_matmul_skip_zeros
from .dense_units import lists_dense_units
from .long_rows import DELIVER_ATOMIC, DELIVER_SPLITS, DELIVER_STORE, FORMAT_DENSE, LongRows, long_row_threshold
from .spmm import launch_gather, launch_spread, product_operands, scan_config


def _scan_warps(block_d: int, weight_itemsize: int) -> int:
    """Warps of a scan program: as many as one row of its [GROUP, BLOCK_D] weight tile fills with 16-byte loads, at
    most 4. More would split the tile's rows over warps, and every accumulate's sum over the group would cross warps
    through shared memory: with 4 warps on 512 bf16 columns the scan took twice its fp32 time (H200)."""
    return max(1, min(4, block_d * weight_itemsize // (32 * 16)))


# Programs per SM that keep every SM busy with loads in flight (a scan is latency-bound per program). When rows
# alone do not fill the GPU, splits summed by atomics cost no partial buffer, so more of them pay: shorter serial
# scans per program (measured on an H200). When rows do fill it, splitting them only adds atomics.
SCAN_PROGRAMS_PER_SM = 4
ATOMIC_SPLIT_PROGRAMS_PER_SM = 32


def scan_splits(
    M: int, n_in: int, n_out: int, block_d: int, block_f: int, sms: int, deterministic: bool, splits: int | None = None
) -> int:
    """Programs the scan splits each row's ``n_in`` columns over (whole chunks of ``block_f`` each, as even as
    they go): ``splits`` if given, else enough (row, D block, split) programs to keep ``sms`` SMs busy. Also for
    cost models: each split is walked serially by one program."""
    n_chunks = cdiv(n_in, block_f)
    if splits is None:
        atomic = splits_by_atomics(M, n_out, block_d, sms, deterministic)
        per_sm = ATOMIC_SPLIT_PROGRAMS_PER_SM if atomic else SCAN_PROGRAMS_PER_SM
        splits = cdiv(per_sm * sms, M * cdiv(n_out, block_d))
    return cdiv(n_chunks, cdiv(n_chunks, max(1, min(splits, n_chunks))))


def splits_by_atomics(M: int, n_out: int, block_d: int, sms: int, deterministic: bool) -> bool:
    """Whether the scan of M rows, ``block_d`` output columns a program, on ``sms`` SMs splits its rows over
    programs whose sums are added by fp32 atomics: rows alone do not fill the GPU, and the order may vary (also for
    cost models: it is where the scan's 16-bit dense units run)."""
    return not deterministic and M * cdiv(n_out, block_d) < SCAN_PROGRAMS_PER_SM * sms


def matmul_skip_zeros(
    a: torch.Tensor,
    weight: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    splits: int | None = None,
    deterministic: bool | None = None,
) -> torch.Tensor:
    """``a @ weight`` for a mostly-zero ``a`` [M, n_in], straight from its dense form: each row is scanned for
    non-zeros and only their rows of ``weight`` [n_in, n_out] are loaded (fp32 accumulation). No sparse format, no
    capacity, no host sync; any strides. Cost: one read of ``a`` plus nnz(a) * n_out weight elements -- against the
    dense product's full read of ``weight``, a win while nnz per row is small.

    ``splits``: how many programs share one row's columns (default: enough to fill the GPU when M is small); with
    more than one, per-split fp32 partials are summed in a fixed order when ``deterministic`` (default:
    ``torch.are_deterministic_algorithms_enabled()``), else added with fp32 atomics (faster; the last bits of the
    sum vary from run to run). A program whose columns turn out denser than ``long_row_threshold`` (a token that
    fires everything) hands them to a second launch that spreads them over many programs (:mod:`.long_rows`).
    """
    op = "matmul_skip_zeros"
    check_matmul_skip_zeros(op, a, weight, splits)
    weight, out = product_operands(a.dtype, a.shape[0], weight, out_dtype)
    (M, n_in), n_out, out_dtype = a.shape, weight.shape[1], out.dtype
    if M == 0 or n_out == 0:
        return out
    if n_in == 0:
        return out.zero_()
    if backend_for(a, weight) is Backend.TORCH:
        _backend.warn_reference_once(op)
        return (a.double() @ weight.double()).to(out_dtype)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    return _scan_into(out, a, weight, splits, deterministic)


def _scan_into(
    out: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, splits: int | None, deterministic: bool
) -> torch.Tensor:
    """The DENSE-format launches of :func:`matmul_skip_zeros` into ``out`` [M, n_out]: the scan, then (when a
    program's columns can be long) the spread pass over the ranges it listed."""
    (M, n_in), n_out = a.shape, weight.shape[1]
    cfg = scan_config(n_out)
    block_d, n_chunks = cfg.block_d, cdiv(n_in, cfg.block_f)
    sms = sm_count(a.device, interpreted=2)

    def n_splits_for(block_d: int) -> int:
        return scan_splits(M, n_in, n_out, block_d, cfg.block_f, sms, deterministic, splits)

    # One program per (row, D block) sums that row's split partials: keep its read (n_splits * block_d fp32) within
    # ~64 KiB by narrowing the D blocks when rows are few (at B=1, D=2304 a single 4096-wide block took 25 us).
    while deterministic and splits is None and block_d > 128 and n_splits_for(block_d) * block_d * 4 > 65536:
        block_d //= 2
    d_blocks, n_splits = cdiv(n_out, block_d), n_splits_for(block_d)
    chunks_per_split = cdiv(n_chunks, n_splits)
    warps = cfg.num_warps if _backend.INTERPRET else _scan_warps(block_d, weight.element_size())
    atomic = n_splits > 1 and not deterministic
    partial = split_nnz = arrivals = out
    if atomic:  # out itself when fp32; else an fp32 sum cast into out after the launch
        partial = out.zero_() if out.dtype == torch.float32 else torch.zeros(M, n_out, device=a.device)
    elif n_splits > 1:
        partial = torch.empty(M, n_splits, n_out, dtype=torch.float32, device=a.device)  # read where written only
        split_nnz = torch.empty(M, n_splits, dtype=torch.int32, device=a.device)
        arrivals = torch.zeros(M, d_blocks, dtype=torch.int32, device=a.device)
    unit_cols = min(n_in, chunks_per_split * cfg.block_f)  # the columns one program scans
    threshold = long_row_threshold(unit_cols)
    long_rows = None
    if threshold < unit_cols:  # a program's columns can be long: list them, spread them
        deliver = DELIVER_ATOMIC if atomic else (DELIVER_SPLITS if n_splits > 1 else DELIVER_STORE)
        spread_block_d = block_d if deliver == DELIVER_SPLITS else None  # that sum is per main-launch D block
        dense_splits = n_splits if lists_dense_units(a, weight, atomic) else 0  # ranges half non-zero or more
        long_rows = LongRows.allocate(
            M * n_splits, n_out, weight, threshold, deliver.value, unit_cols, 0, spread_block_d, dense_splits
        )
    operands = dict(
        dense_ptr=a,
        partial_ptr=partial,
        split_nnz_ptr=split_nnz,
        arrivals_ptr=arrivals,
        n_in=n_in,
        stride_dense=a.stride(0),
        stride_dense_col=a.stride(1),
        chunks_per_split=chunks_per_split,
        n_splits=n_splits,
        long_unit_cols=chunks_per_split * cfg.block_f,
        REDUCE_SPLITS=max(1, min(next_power_of_2(n_splits), 8192 // block_d)),
        FORMAT=FORMAT_DENSE.value,
    )
    launch_gather(
        (d_blocks * M, n_splits),
        weight,
        out,
        warps,
        **operands,
        **(long_rows.listing_args() if long_rows is not None else {}),
        BLOCK_K=cfg.block_k,
        BLOCK_D=block_d,
        BLOCK_F=cfg.block_f,
        GROUP=cfg.group,
        ATOMIC_SPLITS=atomic,
    )
    if long_rows is not None:
        launch_spread(long_rows, weight, out, **operands)
    return out.copy_(partial) if atomic and partial is not out else out
