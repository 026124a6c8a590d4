"""Input builders and checks shared by tests of several folders (importable: pyproject puts tests/ on the path)."""

import torch

from sparsefuse.testing import accumulation_allowance, assert_close_to_reference


def sparse_rows(m: int, n: int, l0s: list[int], dtype=torch.float32, device="cpu") -> torch.Tensor:
    """[m, n] with row i holding l0s[i % len(l0s)] non-zeros at random columns (values never 0)."""
    dense = torch.zeros(m, n)
    for i in range(m):
        k = min(l0s[i % len(l0s)], n)
        cols = torch.randperm(n)[:k]
        dense[i, cols] = torch.randn(k).abs().add_(0.1) * torch.where(torch.rand(k) < 0.5, -1.0, 1.0)
    return dense.to(dtype).to(device)


def pre_activations_and_bound(x, w, b_enc, b_dec=None, feature_scale=None):
    """float64 pre-activations [M, d_sae] and a bound on the kernel's error in each: the rounding of x - b_dec to
    x's dtype, fp32 accumulation in any order (Higham), the fp32 bias add and scale."""
    sae_in = x.double() - (b_dec.double() if b_dec is not None else 0.0)
    pre = sae_in @ w.double() + b_enc.double()
    u32 = torch.finfo(torch.float32).eps / 2
    u_in = torch.finfo(x.dtype).eps / 2 if b_dec is not None else 0.0
    magnitude = sae_in.abs() @ w.double().abs()
    bound = u_in * magnitude + accumulation_allowance(sae_in, w) + 2 * u32 * (pre.abs() + b_enc.double().abs())
    if feature_scale is not None:
        pre, bound = pre * feature_scale.double(), bound * feature_scale.double().abs() + u32 * pre.abs()
    return pre.cpu(), bound.cpu()


def assert_valid_topk(indices, acts, pre, bound, k, activation="relu"):
    """``indices`` must be k distinct features that a top-k of ``pre`` perturbed within ``bound`` could select, in
    decreasing order, and ``acts`` their activations."""
    indices, acts = indices.cpu(), acts.cpu()
    M = pre.shape[0]
    assert indices.shape == acts.shape == (M, k) and indices.dtype == torch.int64
    assert bool(((indices >= 0) & (indices < pre.shape[1])).all())
    assert all(len(set(row.tolist())) == k for row in indices), "a feature was selected twice"
    selected = torch.zeros_like(pre, dtype=torch.bool).scatter_(1, indices, True)
    lowest_selected = torch.where(selected, pre + bound, float("inf")).min(1).values
    highest_unselected = torch.where(selected, -float("inf"), pre - bound).max(1).values
    bad = highest_unselected > lowest_selected
    assert not bool(bad.any()), f"rows {bad.nonzero().flatten().tolist()[:5]} skipped a clearly larger feature"
    assert bool((acts[:, 1:] <= acts[:, :-1]).all()), "not in decreasing order"
    ref = pre.gather(1, indices)
    assert_close_to_reference(
        acts, ref.relu() if activation == "relu" else ref, dtype=acts.dtype, extra_abs=bound.gather(1, indices)
    )


def check_product(out, a, w):
    """``out`` is ``a @ w`` (fully written: outputs are NaN-poisoned) within the fp32-accumulation tolerance."""
    assert not torch.isnan(out).any(), "an output element was left unwritten (NaN-poisoned)"
    ref = a.double() @ w.double()
    assert_close_to_reference(out, ref, (a.float() @ w.float()).to(out.dtype), extra_abs=accumulation_allowance(a, w))
