"""The long-row pass of the gather products (sparsefuse/sparse/long_rows.py): units far denser than the others are
listed on the device by the main launch and spread over many programs by a second launch of the same kernel, with
no host sync and a grid that does not depend on the data. Interpreter-sized shapes (fp32/fp16; see README)."""

import contextlib

import pytest
import torch
from conftest import assert_backend
from helpers import check_product, sparse_rows

import sparsefuse
from sparsefuse import track_launches
from sparsefuse._backend import sm_count
from sparsefuse.sparse import (
    ThresholdedLinear,
    dense_to_csr,
    dense_to_ell,
    long_rows,
    matmul_skip_zeros,
    sparse_matmul,
    spmm,
)
from sparsefuse.sparse.long_rows import SPREAD_ENTRIES_PER_SUBSPLIT
from sparsefuse.testing import accumulation_allowance, assert_close_to_reference

DTYPES = [torch.float32, torch.float16]


@contextlib.contextmanager
def host_reads():
    """Count every read of a tensor's value on the host (a device->host sync on a GPU) inside the block."""
    names = ["item", "__bool__", "__int__", "__float__", "__index__", "tolist"]
    saved = {name: getattr(torch.Tensor, name) for name in names}
    reads = []

    def counting(name):
        def read(self, *args, **kwargs):
            reads.append(name)
            return saved[name](self, *args, **kwargs)

        return read

    for name in names:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield reads
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m, deterministic, deliver",
    [
        (6, True, long_rows.DELIVER_STORE),  # rows fill the (interpreted) GPU: one program per row
        (1, False, long_rows.DELIVER_ATOMIC),  # a row split over programs, partials added by atomics
        (1, True, long_rows.DELIVER_SPLITS),  # ... or summed in split order
    ],
)
def test_scan_spreads_full_rows_whichever_way_splits_are_summed(m, deterministic, deliver, dtype, device, listed):
    # 700 columns: not a multiple of any block; a row to be split must span several scanned chunks (3 of a GPU's)
    cols = 700 if m > 1 else max(700, 3 * spmm.scan_config(40).block_f - 324)
    a = sparse_rows(m, cols, [cols, 3, 0, cols, 64, 1], dtype, device)
    w = (torch.randn(cols, 40) / 8).to(dtype).to(device)
    assert_backend(a)
    with track_launches() as launched:
        out = matmul_skip_zeros(a, w, deterministic=deterministic)
    assert launched["gather_accumulate_kernel"] == 2  # the scan, then the spread pass
    (plan,) = listed
    # fp16 ranges summed by atomics are dense units instead (test_dense_units.py)
    dense = int(plan.dense_used) if plan.dense_used is not None else 0
    assert plan.deliver == deliver.value and int(plan.count) + dense >= (3 if m == 6 else 1)
    check_product(out, a, w)
    if deterministic:  # the spread's sub-splits are summed in a fixed order too
        assert torch.equal(out, matmul_skip_zeros(a, w, deterministic=True))


def test_only_ranges_past_the_threshold_are_listed(device, listed):
    """One program per row: rows past 1 in 64 columns and 32 non-zeros are listed, every other row is walked by its
    own program (and the spread pass finds nothing else to do)."""
    a = sparse_rows(8, 640, [32, 33, 0, 640, 5, 31, 200, 1], device=device)
    w = torch.randn(640, 24, device=device)
    out = matmul_skip_zeros(a, w, deterministic=True)
    (plan,) = listed
    assert plan.threshold == 32 and int(plan.count) == 3  # the rows of 33, 640 and 200 non-zeros
    assert sorted(plan.units[:3].tolist()) == [1, 3, 6]
    check_product(out, a, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["csr", "ell"])
def test_stored_rows_past_the_threshold_are_spread_over_their_entries(fmt, dtype, device, listed):
    a = sparse_rows(5, 640, [2, 640, 0, 90, 17], dtype, device)
    w = (torch.randn(640, 40) / 8).to(dtype).to(device)
    sparse = dense_to_csr(a) if fmt == "csr" else dense_to_ell(a, 640)
    with track_launches() as launched:
        one_launch = sparse_matmul(sparse, w)
    assert launched["gather_accumulate_kernel"] == 1 and not listed  # off by default
    with track_launches() as launched:
        out = sparse_matmul(sparse, w, spread_long_rows=True)
    assert launched["gather_accumulate_kernel"] == 2 and int(listed[0].count) == 2  # 640 and 90 entries
    check_product(out, a, w)
    check_product(one_launch, a, w)


@pytest.mark.parametrize("fmt", ["csr", "ell"])
def test_long_rows_of_one_list_take_sub_splits_by_their_entries(fmt, device, listed):
    """Long rows of 33 to 640 entries in one list: the spread gives each at most one sub-split per 16 entries under
    the interpreter (SpreadConfig.entries_per_sub), so the rows of 33 and 40 take 3 sub-splits and the longer ones
    the list's 4 (4 units x 1 output block fill its 16 items). Each unit's partials keep the list's stride: a unit
    of fewer sub-splits neither reads nor overwrites its neighbour's."""
    a = sparse_rows(6, 640, [640, 40, 0, 90, 17, 33], torch.float32, device)
    w = torch.randn(640, 24, device=device) / 8
    sparse = dense_to_csr(a) if fmt == "csr" else dense_to_ell(a, 640)
    out = sparse_matmul(sparse, w, spread_long_rows=True)
    (plan,) = listed
    interpreted = sparsefuse._backend.INTERPRET
    assert int(plan.count) == 4 and plan.config.entries_per_sub == (16 if interpreted else SPREAD_ENTRIES_PER_SUBSPLIT)
    check_product(out, a, w)


@pytest.mark.parametrize("one_wave, threshold, n_long", [(True, 128, 2), (False, 200, 0)])
def test_stored_rows_past_128_entries_are_long_where_the_launch_is_one_wave(
    one_wave, threshold, n_long, device, listed, plan
):
    """At 12800 columns a stored row is long from 200 entries (1 in 64); where the launch's programs all fit one
    wave (4 rows) it is long past 128 entries too: a 180-entry token among short ones is spread instead of holding
    the whole launch. One wave is taken as 4 programs per SM here (the GPU's 28 would make the other case ~60 rows,
    a minute under the interpreter): two rows more than that are not one wave."""
    plan(sparse_core={"one_wave_programs_per_sm": 4})
    m = 4 if one_wave else 4 * sm_count(torch.device(device), interpreted=2) + 2
    a = sparse_rows(m, 12800, [180, 3, 150, 40], device=device)
    w = torch.randn(12800, 24, device=device) / 8
    out = sparse_matmul(dense_to_ell(a, 256), w, dense=a, spread_long_rows=True)
    (plan,) = listed
    assert plan.threshold == threshold and int(plan.count) == n_long  # the rows of 180 and 150 entries
    check_product(out, a, w)


def test_overflowed_rows_are_completed_by_the_spread_pass_and_encoder_rows_are_not_listed(device, listed):
    """ELL of width 40 (more than the threshold, 32): with the dense rows, the overflowed rows and the stored rows
    past 32 entries are spread; with a ThresholdedLinear, overflowed rows are recomputed by the main launch and
    only the long stored rows are spread."""
    weight = torch.randn(20, 640, device=device) / 4
    v = torch.randn(20, device=device)
    top = (v @ weight).sort(descending=True).values
    fires = [5, 20, 36, 39, 60, 120]  # per row; 36 and 39: long and stored, 60 and 120: overflowed
    # row r is s_r * v: it fires the features whose (v @ weight) passes 1 / s_r, midway between two of them
    scales = torch.stack([2 / (top[c - 1] + top[c]) for c in fires])
    x = scales[:, None] * v
    layer = ThresholdedLinear(x, weight, torch.zeros(640, device=device), torch.ones(640, device=device))
    acts = layer.reference_activations()
    assert (acts != 0).sum(1).tolist() == fires
    ell = dense_to_ell(acts.float(), 40)
    w = torch.randn(640, 24, device=device)
    out = sparse_matmul(ell, w, dense=acts.float(), spread_long_rows=True)
    assert int(listed[0].count) == 4
    check_product(out, acts.float(), w)
    out = sparse_matmul(ell, w, encoder=layer, spread_long_rows=True)
    assert int(listed[1].count) == 2
    fired = (acts != 0).double()
    allowance = accumulation_allowance(acts, w) + (accumulation_allowance(x, weight) * fired) @ w.double().abs()
    assert_close_to_reference(out, acts @ w.double(), extra_abs=allowance)


def _launch_shapes(monkeypatch, fn):
    """(grid, every non-tensor argument) of each gather launch made by fn()."""
    real, shapes = spmm.gather_accumulate_kernel, []

    class Spy:
        def __getitem__(self, grid):
            def launch(**kwargs):
                shapes.append((grid, {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}))
                return real[grid](**kwargs)

            return launch

    monkeypatch.setattr(spmm, "gather_accumulate_kernel", Spy())
    fn()
    monkeypatch.setattr(spmm, "gather_accumulate_kernel", real)
    return shapes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["scan", "fixed", "exact"])
def test_launches_do_not_depend_on_how_many_rows_are_long(method, dtype, device, monkeypatch):
    """The same grids and scalar arguments whether no row or every row is long (fp16: the scan's full ranges are
    dense units, dense_units.py): nothing about the long rows is read on the host, so the launches can be captured
    in a CUDA graph and replayed on other activations."""
    from sparsefuse.sae import sparse_decode

    w = torch.randn(300, 24, device=device).to(dtype)
    sparse_ones = sparse_rows(4, 300, [3], dtype, device)
    full_ones = sparse_rows(4, 300, [300], dtype, device)
    shapes = [
        _launch_shapes(monkeypatch, lambda a=a: sparse_decode(a, w, method=method, max_l0=16))
        for a in (sparse_ones, full_ones)
    ]
    assert len(shapes[0]) == 2 and shapes[0] == shapes[1]


@pytest.mark.parametrize("method, syncs", [("scan", 0), ("fixed", 0), ("exact", 1)])
def test_no_host_sync_but_exacts_own(method, syncs, device, listed):
    """Listing and spreading read nothing on the host; "exact" keeps its one documented sync (the CSR's size)."""
    from sparsefuse.sae import sparse_decode

    a = sparse_rows(4, 300, [300, 3, 0, 300], device=device)
    w = torch.randn(300, 24, device=device)
    with host_reads() as reads:
        out = sparse_decode(a, w, method=method, max_l0=16)
    assert len(reads) == syncs, reads
    assert int(listed[0].count) >= 2
    check_product(out, a, w)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["scan", "fixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_rows_in_a_cuda_graph_without_syncs(method, dtype):
    """Compiled: a graph captured on activations without long rows replays correctly on activations with full rows
    (the list and the spread's sub-splits are sized on the device), and eager calls never synchronise."""
    from sparsefuse.sae import sparse_decode

    F, D = 16384, 768
    w = (torch.randn(F, D, device="cuda") / 16).to(dtype)
    for B in (1, 32, 512):
        a = sparse_rows(B, F, [40], dtype, "cuda")
        full = a.clone()
        full[: min(2, B)] = (torch.rand(min(2, B), F, device="cuda") + 0.1).to(dtype)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            sparse_decode(a, w, method=method, max_l0=64)  # warm-up (compiles)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = sparse_decode(a, w, method=method, max_l0=64)
        a.copy_(full)
        graph.replay()
        torch.cuda.synchronize()
        check_product(out, full, w)
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = sparse_decode(full, w, method=method, max_l0=64)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        check_product(eager, full, w)
