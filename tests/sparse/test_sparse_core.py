"""The shared sparse core: formats, compaction kernels and the gather-accumulate kernel, against torch references."""

import pytest
import torch
from conftest import assert_backend
from helpers import sparse_rows

from sparsefuse import track_launches
from sparsefuse.sparse import (
    CSR,
    ELL,
    ThresholdedLinear,
    dense_to_csr,
    dense_to_ell,
    matmul_skip_zeros,
    sparse_matmul,
    spmm,
)
from sparsefuse.sparse.sddmm import sampled_dot_dense_pattern
from sparsefuse.testing import accumulation_allowance, assert_close_to_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m, n, l0s", [(5, 200, [0, 1, 7, 200, 13]), (1, 64, [64]), (7, 333, [3, 0, 50])])
def test_dense_to_ell_and_csr_match_the_reference(m, n, l0s, dtype, device):
    dense = sparse_rows(m, n, l0s, dtype, device)
    assert_backend(dense)
    with track_launches() as launched:
        ell = dense_to_ell(dense, width=16)
        csr = dense_to_csr(dense)
    # a bitmask pass each, then the bits are compacted: ELL in one launch, CSR counted then placed
    assert launched["row_bits_kernel"] == 2 and launched["bits_to_sparse_kernel"] == 3
    ref_ell, ref_csr = ELL.from_dense(dense, 16), CSR.from_dense(dense)
    for got, ref in (
        (ell.values, ref_ell.values),
        (ell.indices, ref_ell.indices),
        (ell.counts, ref_ell.counts),
        (csr.values, ref_csr.values),
        (csr.indices, ref_csr.indices),
        (csr.row_offsets, ref_csr.row_offsets),
    ):
        assert torch.equal(got.cpu(), ref.cpu())
    assert torch.equal(csr.to_dense().cpu(), dense.cpu())
    assert torch.equal(ell.overflowed().cpu(), (dense != 0).sum(1).cpu() > 16)


def test_compaction_of_wide_rows_placed_by_many_programs(device):
    """Rows of thousands of columns: the compaction walks each row's bitmask in several chunks of words, carrying
    the running count (slots) from one to the next."""
    dense = sparse_rows(3, 4500, [0, 9, 700], device=device)
    dense[1, -1] = 2.0  # the row's last column, in its last word
    ell, csr = dense_to_ell(dense, width=600), dense_to_csr(dense)
    ref_ell = ELL.from_dense(dense, 600)
    assert torch.equal(ell.indices.cpu(), ref_ell.indices.cpu()) and torch.equal(ell.counts.cpu(), ref_ell.counts.cpu())
    assert torch.equal(ell.values.cpu(), ref_ell.values.cpu()) and torch.equal(csr.to_dense().cpu(), dense.cpu())


@pytest.mark.parametrize("rows_per_sm", [0, 10**9], ids=["small-blocks", "wide-blocks"])
def test_compaction_block_sizes_place_the_same_entries(rows_per_sm, device, plan):
    """The compaction walks words in small blocks of one warp once rows fill many waves, else in wide blocks: both
    place every entry (on a GPU; the interpreter runs one small block size)."""
    plan(sparse_core={"many_rows_per_sm": rows_per_sm})
    dense = sparse_rows(4, 5000, [0, 40, 300, 5000], device=device)
    ell, csr = dense_to_ell(dense, width=64), dense_to_csr(dense)
    ref_ell = ELL.from_dense(dense, 64)
    for got, ref in ((ell.values, ref_ell.values), (ell.indices, ref_ell.indices), (ell.counts, ref_ell.counts)):
        assert torch.equal(got.cpu(), ref.cpu())
    assert torch.equal(csr.to_dense().cpu(), dense.cpu())


def test_ell_to_dense_refuses_overflowed_rows(device):
    ell = dense_to_ell(sparse_rows(3, 50, [2, 20, 1], device=device), width=4)
    with pytest.raises(ValueError, match=r"1 row\(s\) overflowed width 4 \(largest count 20\)"):
        ell.to_dense()


def test_nan_is_a_nonzero(device):
    dense = torch.tensor([[0.0, float("nan"), 0.0, 2.0]], device=device)
    ell = dense_to_ell(dense, 4)
    assert int(ell.counts[0]) == 2 and torch.isnan(ell.values[0, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["ell", "csr"])
def test_gather_accumulate_matches_float64(fmt, dtype, device):
    dense = sparse_rows(6, 300, [0, 1, 9, 40, 300, 5], dtype, device)
    weight = torch.randn(300, 70, dtype=torch.float32).to(dtype).to(device)
    sparse = dense_to_ell(dense, width=300) if fmt == "ell" else dense_to_csr(dense)
    with track_launches() as launched:
        out = sparse_matmul(sparse, weight)
    assert launched["gather_accumulate_kernel"] == 1 and out.dtype == dtype
    ref = dense.double() @ weight.double()
    assert_close_to_reference(out, ref, (dense.float() @ weight.float()).to(dtype))


def test_overflowed_ell_rows_are_completed_from_dense_or_poisoned(device):
    dense = sparse_rows(5, 120, [3, 60, 0, 120, 8], device=device)
    weight = torch.randn(120, 33, device=device)
    weight_strided = torch.randn(33, 120, device=device).t()  # non-contiguous columns: copied once
    ell = dense_to_ell(dense, width=8)
    assert ell.overflowed().tolist() == [False, True, False, True, False]
    ref = dense.double() @ weight.double()
    assert_close_to_reference(sparse_matmul(ell, weight, dense=dense), ref, dense @ weight)
    assert_close_to_reference(
        sparse_matmul(ell, weight_strided, dense=dense),
        dense.double() @ weight_strided.double(),
        dense @ weight_strided,
    )
    unfixed = sparse_matmul(ell, weight)  # no dense rows: overflowed rows must be visibly wrong, never truncated
    assert torch.isnan(unfixed[1]).all() and torch.isnan(unfixed[3]).all()
    assert_close_to_reference(unfixed[[0, 2, 4]], ref[[0, 2, 4]], (dense @ weight)[[0, 2, 4]])


def test_sparse_matmul_errors(device):
    ell = dense_to_ell(sparse_rows(2, 10, [3], device=device), 4)
    with pytest.raises(ValueError, match=r"weight must be \[10, n_out\].*\[11, 5\]"):
        sparse_matmul(ell, torch.randn(11, 5, device=device))
    with pytest.raises(TypeError, match="weight must have a floating dtype"):
        sparse_matmul(ell, torch.ones(10, 5, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="dense must have shape"):
        sparse_matmul(ell, torch.randn(10, 5, device=device), dense=torch.randn(3, 10, device=device))
    with pytest.raises(ValueError, match="width must be a positive int"):
        dense_to_ell(torch.randn(2, 3, device=device), 0)


@pytest.mark.parametrize("with_shift", [True, False])
def test_overflowed_rows_are_recomputed_from_a_thresholded_linear_layer(with_shift, device):
    """ELL of a thresholded linear layer's activations, narrower than most rows: the gather recomputes the
    overflowed rows from the layer's inputs (relu(pre) * (pre > threshold), pre = (x - shift) @ weight + bias)."""
    x, weight = torch.randn(6, 20, device=device), torch.randn(20, 150, device=device) / 4
    bias, threshold = torch.randn(150, device=device) * 0.1, torch.rand(150, device=device)
    shift = torch.randn(20, device=device) if with_shift else None
    pre = ThresholdedLinear(x, weight, bias, torch.full_like(threshold, -float("inf")), shift).reference_activations()
    bias = bias - 0.1 * ((pre - threshold.double()).abs() < 1e-3).any(0)  # no pre-activation within fp32 error
    layer = ThresholdedLinear(x, weight, bias, threshold, shift)
    acts = layer.reference_activations()
    ell = dense_to_ell(acts.float(), int((acts != 0).sum(1).median()))
    assert bool(ell.overflowed().any()) and not bool(ell.overflowed().all())
    w = torch.randn(150, 12, device=device)
    with track_launches() as launched:
        out = sparse_matmul(ell, w, encoder=layer)
    assert launched["gather_accumulate_kernel"] == 1
    fired = (acts != 0).double()
    allowance = accumulation_allowance(acts, w) + (accumulation_allowance(x, weight) * fired) @ w.double().abs()
    assert_close_to_reference(out, acts @ w.double(), extra_abs=allowance)
    with pytest.raises(ValueError, match="needs one input row per sparse row"):
        sparse_matmul(ell, w, encoder=ThresholdedLinear(x[:5], weight, bias, threshold))


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "m, n, d, l0s, splits",
    [
        (4, 300, 40, [0, 5, 300, 17], None),
        (4, 300, 40, [0, 5, 300, 17], 3),
        (1, 64, 7, [9], 1000),
        (9, 97, 65, [2, 0, 33], 1),
    ],
)
def test_matmul_skip_zeros_matches_the_dense_product(m, n, d, l0s, splits, dtype, deterministic, device):
    a = sparse_rows(m, n, l0s, dtype, device)
    w = (torch.randn(n, d) / 4).to(dtype).to(device)
    assert_backend(a)
    with track_launches() as launched:
        out = matmul_skip_zeros(a, w, splits=splits, deterministic=deterministic)
    assert launched["gather_accumulate_kernel"] == 2  # the scan, then the spread pass over the long ranges it listed
    assert out.dtype == dtype and out.shape == (m, d)
    assert_close_to_reference(
        out, a.double() @ w.double(), (a.float() @ w.float()).to(dtype), extra_abs=accumulation_allowance(a, w)
    )
    if deterministic:  # split partials summed in a fixed order
        assert torch.equal(out, matmul_skip_zeros(a, w, splits=splits, deterministic=True))


@pytest.mark.parametrize("deterministic_mode", [True, False])
def test_matmul_skip_zeros_follows_torch_deterministic_mode(deterministic_mode, device, monkeypatch):
    """Split partials are added by fp32 atomics unless torch.use_deterministic_algorithms(True) is in force (or
    deterministic=True is passed): the atomic path needs no [M, splits, n_out] partial buffer."""
    a = sparse_rows(2, 3500, [40, 7], device=device)  # several 1024-column chunks on a GPU, so 3 splits
    w = torch.randn(3500, 24, device=device)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: deterministic_mode)
    kernel, launches = spmm.gather_accumulate_kernel, []

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append(kw) or kernel[grid](*args, **kw)

    monkeypatch.setattr(spmm, "gather_accumulate_kernel", Spy())
    out = matmul_skip_zeros(a, w, splits=3)
    scans = [kw for kw in launches if not kw.get("SPREAD_PASS")]  # (the spread pass over long ranges follows)
    assert [kw["ATOMIC_SPLITS"] for kw in scans] == [not deterministic_mode]
    assert_close_to_reference(out, a.double() @ w.double(), a @ w, extra_abs=accumulation_allowance(a, w))


def test_matmul_skip_zeros_strided_nan_and_empty(device):
    a = sparse_rows(50, 6, [2, 0, 6], device=device).t()  # [6, 50] with column stride 6: read in place
    w = torch.randn(70, 50, device=device).t()  # [50, 70], non-contiguous
    a[2, 7] = float("nan")
    out = matmul_skip_zeros(a, w, splits=4, out_dtype=torch.float16)
    ref = a.double() @ w.double()
    assert out.dtype == torch.float16 and torch.isnan(out[2]).all()
    keep = [0, 1, 3, 4, 5]
    assert_close_to_reference(out[keep], ref[keep], (a @ w).half()[keep], extra_abs=accumulation_allowance(a[keep], w))
    assert matmul_skip_zeros(a[:0], w).shape == (0, 70)
    assert torch.equal(matmul_skip_zeros(a[:, :0], w[:0]).cpu(), torch.zeros(6, 70))
    with pytest.raises(ValueError, match=r"expected a \[M, n_in\] and weight \[n_in, n_out\]"):
        matmul_skip_zeros(a, w[:49])
    with pytest.raises(ValueError, match="splits must be a positive int or None; got 0"):
        matmul_skip_zeros(a, w, splits=0)


def test_sampled_dot_dense_pattern(device):
    pattern = sparse_rows(6, 130, [0, 3, 130, 11], device=device)
    a, b = torch.randn(6, 37, device=device), torch.randn(130, 37, device=device)
    with track_launches() as launched:
        out = sampled_dot_dense_pattern(pattern, a, b)
    assert launched["sampled_dot_dense_pattern_kernel"] == 1
    mask = pattern != 0
    assert_close_to_reference(
        out, (a.double() @ b.double().t()) * mask, (a @ b.t()) * mask, extra_abs=accumulation_allowance(a, b.t())
    )


@pytest.mark.gpu
def test_more_rows_than_a_cuda_grid_axis_holds():
    """Rows are folded into grid axis 0, so more than 65535 rows (a W_dec gradient over 65536 features, a SPLADE
    backward over B*S positions) launch in one go."""
    a = sparse_rows(70_000, 48, [3, 0, 1], device="cuda")
    w = torch.randn(48, 300, device="cuda")
    ref = a.double() @ w.double()
    allowance = accumulation_allowance(a, w)
    assert_close_to_reference(matmul_skip_zeros(a, w), ref, a @ w, extra_abs=allowance)
    assert_close_to_reference(sparse_matmul(dense_to_csr(a), w), ref, a @ w, extra_abs=allowance)
    assert_close_to_reference(sparse_matmul(dense_to_ell(a, 4), w, dense=a), ref, a @ w, extra_abs=allowance)
