"""complete_nonfinite_rows: a dense product's NaN / inf elements recomputed over the activations' non-zeros, on the
weight as it lies -- a transposed view (a decoder tied to its encoder, ``W_enc.T``) or a column-strided one is read
at its strides, never copied. On the interpreter (fp16/fp32)."""

import pytest
import torch
from conftest import assert_backend
from helpers import sparse_rows

from sparsefuse import track_launches
from sparsefuse.sae import sparse_decode
from sparsefuse.sae.decode import torch_sparse_decode
from sparsefuse.sparse import nonfinite_rows
from sparsefuse.sparse.nonfinite_rows import complete_nonfinite_rows
from sparsefuse.testing import accumulation_allowance, assert_close_to_reference

M, F, D = 7, 300, 40  # the interpreter's tiles: 4 rows by 16 columns, so row tiles, column blocks and a ragged edge
DEAD, HOT = 5, 77  # a NaN row that never fires; an inf row fired by token 2 alone
LAYOUTS = ["rows", "transposed", "column_strided"]


def activations(dtype, device):
    """[M, F]: token 1 fires nothing, token 4 holds a NaN activation, token 6 fires every feature but DEAD (its row is
    summed in order, GROUP weight rows at a time); the others a few features (picked non-zeros)."""
    acts = sparse_rows(M, F, [3, 0, 20, 1, 9, 6, 1])
    acts[:, [DEAD, HOT]] = 0.0
    acts[2, HOT] = 0.5
    acts[4, 200] = float("nan")
    acts[6] = torch.where(acts[6] == 0, 0.25, acts[6])
    acts[6, [DEAD, HOT]] = 0.0
    return acts.to(dtype).to(device)


def weight(layout, dtype, device, poisoned=True):
    """W [F, D] (``poisoned``: HOT's row holding +-inf, DEAD's NaN), laid out as ``layout``: rows at unit stride,
    the transpose of a contiguous [D, F] (strides (1, F)) or every other column of a [F, 2D] (strides (2D, 2))."""
    w = torch.randn(F, D) / 8
    if poisoned:
        w[HOT, :4], w[HOT, 33] = float("inf"), float("-inf")
        w[DEAD] = float("nan")
    w = w.to(dtype).to(device)
    if layout == "transposed":
        w = w.t().contiguous().t()
        assert w.stride() == (1, F)
    elif layout == "column_strided":
        w = torch.stack([w, torch.full_like(w, float("nan"))], dim=2).flatten(1)[:, ::2]  # the skipped columns NaN
        assert w.stride() == (2 * D, 2)
    return w


def check_against_reference(out, acts, w):
    """``out`` is the float64 sum over the fired features, NaN and infinities in the same places; the finite elements
    within fp32 accumulation in any order."""
    ref = torch_sparse_decode(acts, w)
    assert_close_to_reference(out, ref, extra_abs=accumulation_allowance(acts, w.nan_to_num(0.0, 0.0, 0.0)))
    return ref


@pytest.fixture
def weights_passed(monkeypatch):
    """The data pointer and strides of the weight each launch of the kernel received."""
    seen = []
    real = nonfinite_rows.complete_nonfinite_rows_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(out, a, w, *args, **kwargs):
                seen.append((w.data_ptr(), w.stride()))
                return real[grid](out, a, w, *args, **kwargs)

            return launch

    monkeypatch.setattr(nonfinite_rows, "complete_nonfinite_rows_kernel", Recording())
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_nonfinite_elements_recomputed_on_the_weight_as_it_lies(layout, dtype, device, weights_passed):
    acts = activations(dtype, device)
    w = weight(layout, dtype, device)
    assert_backend(acts)
    dense = acts @ w
    assert not torch.isfinite(dense).all(dim=1).any()  # DEAD's NaN row: every row of the dense product is bad
    out = dense.clone()
    with track_launches() as launched:
        assert complete_nonfinite_rows(out, acts, w) is out
    assert dict(launched) == {"complete_nonfinite_rows_kernel": 1}  # no transpose copy launched
    assert weights_passed == [(w.data_ptr(), w.stride())]  # the caller's weight itself, at its strides
    ref = check_against_reference(out, acts, w)
    assert torch.isfinite(ref[[0, 1, 3, 5, 6]]).all() and torch.isnan(out[4]).all()
    assert torch.isinf(out[2, :4]).all() and torch.isinf(out[2, 33]) and torch.isfinite(out[2, 4:33]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_finite_rows_keep_the_dense_product(layout, dtype, device):
    """Only the rows holding a NaN or an infinity are rewritten (here token 4's, of its NaN activation)."""
    acts = activations(dtype, device)
    w = weight(layout, dtype, device, poisoned=False)
    dense = acts @ w
    out = dense.clone()
    complete_nonfinite_rows(out, acts, w)
    check_against_reference(out, acts, w)
    finite = torch.isfinite(dense).all(dim=1)
    assert finite.tolist() == [True, True, True, True, False, True, True]
    assert torch.equal(out[finite], dense[finite])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dense_decode_of_a_tied_decoder_copies_nothing(dtype, device, weights_passed):
    """sparse_decode(method="dense") with W_dec = W_enc.T: cuBLAS reads the view, and so does the recomputation."""
    acts = activations(dtype, device)
    W_enc = weight("rows", dtype, device).t().contiguous()  # [D, F]
    W_dec = W_enc.T
    for out_dtype in (dtype, torch.float32):
        with track_launches() as launched:
            out = sparse_decode(acts, W_dec, method="dense", out_dtype=out_dtype)
        assert dict(launched) == {"complete_nonfinite_rows_kernel": 1}
        assert out.dtype == out_dtype
        check_against_reference(out, acts, W_dec)
    assert weights_passed == [(W_enc.data_ptr(), (1, F))] * 2
