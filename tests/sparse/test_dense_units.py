"""Dense ranges of the scan (sparsefuse/sparse/dense_units.py): where the scan's splits are summed by atomics and the
operands are one 16-bit dtype, a range at least half non-zero is listed in its split's table and summed on tensor
cores by the spread launch; a full table, a sparser range or another mode leaves it to the long-row pass.
Interpreter-sized shapes in fp16 (the interpreter's bf16 tl.dot is wrong: triton-lang/triton#11584; bf16 runs in the
GPU suite's test_long_rows)."""

import pytest
import torch
from conftest import assert_backend
from helpers import check_product, sparse_rows

from sparsefuse import track_launches
from sparsefuse.sparse import matmul_skip_zeros, spmm
from sparsefuse.sparse.dense_units import DENSE_UNIT_ROWS


def weight(n_in, n_out, dtype, device):
    return (torch.randn(n_in, n_out) / 8).to(dtype).to(device)


@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_full_rows_are_summed_as_dense_units_in_every_split(out_dtype, device, listed):
    """One row split over programs (atomic sums): every range of the full rows is dense, none is a long unit; the
    sparse row is walked by the scan. fp32 outputs take the same path (the products of fp16 values are exact)."""
    a = sparse_rows(3, 1500, [1500, 10, 1500], torch.float16, device)
    w = weight(1500, 40, torch.float16, device)
    assert_backend(a)
    with track_launches() as launched:
        out = matmul_skip_zeros(a, w, out_dtype=out_dtype)
    assert launched["gather_accumulate_kernel"] == 2  # the scan, then the spread launch with the dense ranges
    (plan,) = listed
    n_splits = plan.dense_counts.numel()
    assert n_splits > 1 and int(plan.count) == 0
    assert int(plan.dense_used) == n_splits and plan.dense_counts.tolist() == [2] * n_splits
    rows = plan.dense_rows.view(n_splits, DENSE_UNIT_ROWS.value)[:, :2]
    assert rows.sort(1).values.tolist() == [[0, 2]] * n_splits  # in either order: the atomics decide
    assert sorted(plan.dense_splits.tolist()) == list(range(n_splits))
    check_product(out, a, w)


def test_a_full_table_lists_further_ranges_as_long_units(device, listed):
    """20 full rows in 2 splits: each split's table takes 16, the other 4 ranges of each split are long units --
    every row still summed exactly once."""
    cols = max(300, 2 * spmm.scan_config(24).block_f)  # two scanned chunks on a GPU: two splits
    a = sparse_rows(20, cols, [cols], torch.float16, device)
    w = weight(cols, 24, torch.float16, device)
    out = matmul_skip_zeros(a, w, splits=2, deterministic=False)
    (plan,) = listed
    assert plan.dense_counts.tolist() == [20, 20]  # counted past the table
    assert int(plan.dense_used) == 2 and int(plan.count) == 2 * (20 - DENSE_UNIT_ROWS.value)
    check_product(out, a, w)


def test_ranges_under_half_non_zero_stay_long_units(device, listed):
    """A row of 30% non-zeros is long (past 1 in 64 columns) but not dense: the long-row pass spreads it."""
    a = sparse_rows(2, 1500, [450, 4], torch.float16, device)
    w = weight(1500, 40, torch.float16, device)
    out = matmul_skip_zeros(a, w)
    (plan,) = listed
    assert int(plan.dense_used) == 0 and int(plan.count) >= 2
    check_product(out, a, w)


@pytest.mark.parametrize(
    "a_dtype, w_dtype, deterministic",
    [
        (torch.float32, torch.float32, False),  # fp32 products: the gather's, not tf32 tensor cores
        (torch.float16, torch.float16, True),  # splits summed in order: the long-row pass keeps that order
    ],
)
def test_no_dense_tables_outside_16_bit_atomic_scans(a_dtype, w_dtype, deterministic, device, listed):
    a = sparse_rows(2, 1500, [1500, 4], a_dtype, device)
    w = weight(1500, 40, w_dtype, device)
    out = matmul_skip_zeros(a, w, deterministic=deterministic)
    (plan,) = listed
    assert plan.dense_rows is None and int(plan.count) >= 1
    check_product(out, a, w)


def test_dense_units_read_strided_activations(device, listed):
    """The transposed activations (the decode's weight gradient reads acts.t()): column stride != 1."""
    columns = torch.zeros(1500, 3)
    columns[:, 0] = torch.rand(1500) + 0.1  # a full row of a
    columns[::7, 2] = 1.0
    a = columns.to(torch.float16).to(device).t()
    w = weight(1500, 24, torch.float16, device)
    out = matmul_skip_zeros(a, w, splits=4, deterministic=False)
    (plan,) = listed
    assert int(plan.dense_used) >= 1
    check_product(out, a, w)
