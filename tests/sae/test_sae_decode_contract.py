"""sparse_decode's contract whichever method runs: a feature that did not fire contributes exactly zero, whatever its
decoder row holds (non-finite values included). On the interpreter (fp16/fp32; see README)."""

import pytest
import torch
from conftest import DEVICE, assert_backend
from helpers import sparse_rows

from sparsefuse import _backend, track_launches
from sparsefuse.sae import sparse_decode
from sparsefuse.sae.decode import torch_sparse_decode
from sparsefuse.testing import accumulation_allowance, assert_close_to_reference

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
METHODS = ["scan", "fixed", "exact", "dense", "auto"]
DEAD, HOT, SPARSE_NAN = 5, 77, 150  # a NaN row never fired, an inf row fired by token 2, a NaN entry never fired


def poisoned_decoder(M=7, F=300, D=40, dtype=torch.float32, device="cpu", dead_rows=True):
    """Activations [M, F] (token 4 holds a NaN activation, token 5 an inf one, token 1 none) and W_dec [F, D] whose
    rows of features that never fire hold NaN and inf (with ``dead_rows``); feature HOT's row holds +-inf and fires
    in token 2 only; token 6 fires every other feature."""
    acts = sparse_rows(M, F, [3, 0, 20, 1, 9, 6, 300 if M > 6 else 3], torch.float32)
    acts[:, [DEAD, HOT, SPARSE_NAN]] = 0.0
    acts[2, HOT] = 0.5
    acts[4, 200], acts[5, 201] = float("nan"), float("inf")
    w = torch.randn(F, D) / 8
    w[HOT, :4], w[HOT, 10] = float("inf"), float("-inf")
    if dead_rows:
        w[DEAD] = float("nan")
        w[SPARSE_NAN, 3], w[SPARSE_NAN + 1, 7] = float("nan"), float("inf")
        acts[:, SPARSE_NAN + 1] = 0.0
    if M > 6:  # token 6 fires every feature but the dead ones (a long row: the spread pass)
        acts[6] = torch.where(acts[6] == 0, 0.25, acts[6])
        acts[6, [DEAD, HOT, SPARSE_NAN, SPARSE_NAN + 1]] = 0.0
    return acts.to(dtype).to(device), w.to(dtype).to(device)


def check_against_reference(out, acts, w):
    """``out`` is the float64 decode over the fired features, NaN and infinities in the same places; the finite
    elements within fp32 accumulation in any order."""
    ref = torch_sparse_decode(acts, w)
    allowance = accumulation_allowance(acts, w.nan_to_num(0.0, 0.0, 0.0))
    assert_close_to_reference(out, ref, extra_abs=allowance)
    return ref


def test_the_reference_sums_over_the_fired_features_only():
    acts, w = poisoned_decoder()
    ref = torch_sparse_decode(acts, w)
    assert ref.dtype == torch.float64
    # tokens without a non-finite activation: NaN / inf only where a fired feature's row has them
    assert torch.isfinite(ref[[0, 1, 3]]).all()
    assert torch.isinf(ref[2, :4]).all() and torch.isinf(ref[2, 10]) and torch.isfinite(ref[2, 11:]).all()
    assert torch.isnan(ref[4]).all() and not torch.isfinite(ref[5]).any()
    finite = w.double().nan_to_num(0.0, 0.0, 0.0)
    torch.testing.assert_close(ref[[0, 1, 3]], acts.double()[[0, 1, 3]] @ finite)
    assert torch.equal(torch_sparse_decode(acts[:0], w), torch.zeros(0, w.shape[1], dtype=torch.float64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", METHODS)
def test_unfired_features_contribute_zero_whatever_their_decoder_rows_hold(method, dtype, device):
    acts, w = poisoned_decoder(dtype=dtype, device=device)
    assert_backend(acts)
    out = sparse_decode(acts, w, method=method, max_l0=16)
    assert out.shape == (7, 40) and out.dtype == dtype
    check_against_reference(out, acts, w)


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_scan_dense_units_skip_unfired_nonfinite_rows(dtype, device, listed):
    """The 16-bit scan of few tokens sums a range of columns at least half non-zero on tensor cores, every weight row
    of the range at once (sparsefuse/sparse/dense_units.py): a tile holding a NaN / inf weight is summed over each
    token's non-zero activations instead, so a dead feature's NaN row inside a full token's range stays out."""
    F = 4096 if device.type == "cuda" else 300  # ranges split over programs: several scan chunks
    acts = torch.rand(3, F) + 0.1  # token 0 fires every feature but the dead ones; tokens 1, 2 a few
    acts[1:, 10:] = 0.0
    acts[:, [DEAD, SPARSE_NAN]] = 0.0
    acts[1, 2] = float("nan")
    w = torch.randn(F, 24) / 8
    w[DEAD], w[SPARSE_NAN, 3], w[7, 5] = float("nan"), float("inf"), float("-inf")  # feature 7 fired: -inf
    acts, w = acts.to(dtype).to(device), w.to(dtype).to(device)
    out = sparse_decode(acts, w, method="scan")
    (plan,) = listed
    assert plan.dense_used is not None and int(plan.dense_used) > 0  # token 0's ranges went to the dense units
    check_against_reference(out, acts, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dense_recomputes_the_nonfinite_elements_on_the_device(dtype, device):
    """cuBLAS's product, then one launch over its output: the elements that are NaN or inf are recomputed over their
    rows' non-zero activations; rows that are finite throughout keep cuBLAS's values."""
    acts, w = poisoned_decoder(dtype=dtype, device=device, dead_rows=False)
    w[HOT] = 0.125  # every row finite but tokens 4 and 5's (a NaN and an inf activation)
    assert_backend(acts)
    with track_launches() as launched:
        out = sparse_decode(acts, w, method="dense")
    assert dict(launched) == {"complete_nonfinite_rows_kernel": 1}
    ref = check_against_reference(out, acts, w)
    finite_rows = [0, 1, 2, 3, 6]
    assert torch.isfinite(ref[finite_rows]).all()
    assert torch.equal(out[finite_rows], (acts @ w)[finite_rows])

    for dead_rows in (False, True):  # HOT's inf row: NaN or inf in every row of cuBLAS's product; and dead NaN rows
        acts, w = poisoned_decoder(dtype=dtype, device=device, dead_rows=dead_rows)
        assert not torch.isfinite(acts @ w).all(dim=1).any()
        check_against_reference(sparse_decode(acts, w, method="dense"), acts, w)


def test_dense_with_finite_elements_returns_cublas_product(device):
    """The normal case: the extra work is one launch that reads the output."""
    acts = sparse_rows(9, 256, [4, 0, 31], device=device)
    w = torch.randn(256, 24, device=device)
    with track_launches() as launched:
        out = sparse_decode(acts, w, method="dense")
    assert dict(launched) == {"complete_nonfinite_rows_kernel": 1}
    assert torch.equal(out, acts @ w)


def test_dense_transposed_decoder_and_fp32_out_of_fp16(device):
    """A W_dec read by rows at a stride (a transposed view) and an fp32 output of fp16 operands."""
    acts, w = poisoned_decoder(dtype=torch.float16, device=device)
    wt = w.t().contiguous().t()
    assert wt.stride(1) != 1
    out = sparse_decode(acts, wt, method="dense", out_dtype=torch.float32)
    assert out.dtype == torch.float32
    ref = torch_sparse_decode(acts, w)
    assert_close_to_reference(out, ref, extra_abs=accumulation_allowance(acts, w.nan_to_num(0.0, 0.0, 0.0)))


@pytest.mark.parametrize("method", ["scan", "fixed", "exact", "dense"])
def test_plain_torch_fallback_keeps_the_contract(method, monkeypatch, device):
    """CPU tensors without TRITON_INTERPRET take the torch path; forced here, where the interpreter is on."""
    if device.type != "cpu":
        pytest.skip("the torch path is the CPU fallback")
    acts, w = poisoned_decoder(device=device)
    monkeypatch.setattr(_backend, "INTERPRET", False)
    monkeypatch.setattr(_backend, "_warned", set())
    with pytest.warns(UserWarning, match="plain-torch reference"), track_launches() as launched:
        out = sparse_decode(acts, w, method=method, max_l0=16)
    assert sum(launched.values()) == 0
    check_against_reference(out, acts, w)


def test_dense_compiles_fullgraph_with_nonfinite_rows(device):
    acts, w = poisoned_decoder(device=device)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    fn = torch.compile(lambda a, b: sparse_decode(a, b, method="dense"), fullgraph=True, backend=backend)
    check_against_reference(fn(acts, w), acts, w)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_fixup_in_a_cuda_graph(dtype):
    """No host sync: the dense decode and its pass over the non-finite elements are captured and replayed; each
    replay recomputes what is non-finite in the data it finds (tokens 4 and 5's rows; then every row, where a dead
    feature's decoder row went NaN; then 4 and 5's again)."""
    acts, w = poisoned_decoder(M=64, F=4096, D=768, dtype=dtype, device="cuda", dead_rows=False)
    w[HOT] = 0.125
    clean = w.clone()
    sparse_decode(acts, w, method="dense")  # warm-up: compiles the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sparse_decode(acts, w, method="dense")
    for nan_row in (False, True, False):
        w.copy_(clean)
        if nan_row:
            w[DEAD] = float("nan")
        graph.replay()
        torch.cuda.synchronize()
        check_against_reference(out, acts, w)
        finite = [m for m in range(acts.shape[0]) if m not in (4, 5)]
        assert torch.isfinite(out[finite]).all()
        if not nan_row:  # rows finite throughout keep cuBLAS's values
            assert torch.equal(out[finite], (acts @ w)[finite])
