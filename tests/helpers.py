"""Input builders and checks shared by tests of several folders (importable: pyproject puts tests/ on the path)."""

import pytest
import torch
import torch.nn.functional as F

from sparsefuse.ffn.hybrid import hybrid_step_reference
from sparsefuse.testing import accumulation_allowance, assert_close_to_reference

HYBRID_NAMES = ("x", "w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")


def interpreter_only(device: torch.device, workload: str) -> None:
    """Skips a bench workload's interpreter test on a GPU, where ``sparsefuse bench`` runs the workload itself."""
    if device.type != "cpu":
        pytest.skip(f"the GPU runs this workload through `sparsefuse bench {workload}`")


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


def product_reference(a, w):
    """(``a @ w`` in float64, torch's fp32-accumulated product in torch's result dtype)."""
    return a.double() @ w.double(), (a.float() @ w.float()).to(torch.result_type(a, w))


def product_allowance(a, w):
    """Keyword arguments of the comparison allowing ``a @ w``'s summation order: ``**product_allowance(a, w)``."""
    return {"extra_abs": accumulation_allowance(a, w)}


def check_product(out, a, w):
    """``out`` is ``a @ w`` (fully written: outputs are NaN-poisoned) within the fp32-accumulation tolerance."""
    assert not torch.isnan(out).any(), "an output element was left unwritten (NaN-poisoned)"
    ref = a.double() @ w.double()
    assert_close_to_reference(out, ref, (a.float() @ w.float()).to(out.dtype), extra_abs=accumulation_allowance(a, w))


def hybrid_dense_lowp(leaves, dy, coef):
    """The same step in the same dtype with plain torch (what an unpatched model computes)."""
    x, wg, wu, wd, bg, bu, bd = (t.detach().clone().requires_grad_() if t is not None else None for t in leaves)
    M, N = x.shape[0], wg.shape[0]
    h_g = torch.relu(F.linear(x, wg, bg))
    y = F.linear(h_g * F.linear(x, wu, bu), wd, bd)
    l1 = h_g.float().sum() / (M * N)
    leaves2 = [t for t in (x, wg, wu, wd, bg, bu, bd) if t is not None]
    return y, l1, torch.autograd.grad((y * dy).sum() + coef * l1, leaves2)


def hybrid_order_allowances(leaves, dy, coef):
    """Per-element allowances for summing each product of the step in another order than cuBLAS (Higham's bound,
    :func:`accumulation_allowance`), the sampled products' own differences carried into the products that use them.
    Torch's error can be smaller than ours by luck where magnitudes are large, so the bound adds these."""
    x, wg, wu, wd, bg, bu, bd = (t.detach().double().cpu() if t is not None else None for t in leaves)
    dy = dy.detach().double().cpu()
    M, N = x.shape[0], wg.shape[0]
    pre = x @ wg.t() + (bg if bg is not None else 0.0)
    fired = pre > 0
    h_g, h_u = torch.where(fired, pre, 0.0), x @ wu.t() + (bu if bu is not None else 0.0)
    dh = dy @ wd
    dh_u, dpre = dh * h_g, torch.where(fired, dh * h_u + coef / max(M * N, 1), 0.0)
    up_err, dh_err = accumulation_allowance(x, wu.t()), accumulation_allowance(dy, wd)  # [M, N]
    dh_u_err = dh_err * h_g.abs()
    dpre_err = torch.where(fired, dh_err * h_u.abs() + dh.abs() * up_err, 0.0)
    h_err = h_g.abs() * up_err
    return {
        "y": accumulation_allowance(h_g * h_u, wd.t()) + h_err @ wd.t().abs(),
        "x": accumulation_allowance(dh_u, wu)
        + accumulation_allowance(dpre, wg)
        + dh_u_err @ wu.abs()
        + dpre_err @ wg.abs(),
        "w_gate": accumulation_allowance(dpre.t(), x) + dpre_err.t() @ x.abs(),
        "w_up": accumulation_allowance(dh_u.t(), x) + dh_u_err.t() @ x.abs(),
        "w_down": accumulation_allowance(dy.t(), h_g * h_u) + dy.t().abs() @ h_err,
        "b_gate": dpre_err.sum(0) + accumulation_allowance(torch.ones(1, M, dtype=torch.float64), dpre)[0],
        "b_up": dh_u_err.sum(0) + accumulation_allowance(torch.ones(1, M, dtype=torch.float64), dh_u)[0],
        "b_down": accumulation_allowance(torch.ones(1, M, dtype=torch.float64), dy)[0],
    }


def check_hybrid_step(leaves, dy, coef, out, grads):
    """A gated step's output, L1 term and gradients (``grads``, in ``leaves``' order, Nones skipped) against the
    float64 reference, each within the allowance for summing its products in another order than cuBLAS."""
    x, wg, wu, wd, bg, bu, bd = leaves
    y64, l164, g64 = hybrid_step_reference(x, wg, wu, wd, dy, coef, bg, bu, bd)
    y_lp, l1_lp, grads_lp = hybrid_dense_lowp(leaves, dy, coef)
    allow = hybrid_order_allowances(leaves, dy, coef)
    assert_close_to_reference(out.y, y64, y_lp, extra_abs=allow["y"], name="y")
    assert_close_to_reference(out.l1.reshape(1), l164.reshape(1), l1_lp.reshape(1), dtype=torch.float32, name="l1")
    ref = [getattr(g64, n) for n, t in zip(HYBRID_NAMES, leaves) if t is not None]
    names = [n for n, t in zip(HYBRID_NAMES, leaves) if t is not None]
    for name, ours, r, lp in zip(names, grads, ref, grads_lp):
        assert_close_to_reference(ours, r, lp, extra_abs=allow[name], name=f"d{name}")


def check_relu_step(leaves, dy, coef, out, grads):
    """A non-gated step, ``relu(x W^T + b) W_d^T + b_d`` (``leaves`` = [x, w, w_down, b or None, b_down or None]):
    its output, L1 term and gradients (``grads``, Nones skipped) against the float64 reference, held to the same
    dtype's tolerance as plain torch's step in that dtype."""
    x, w, wd, b, bd = leaves
    used = [t for t in leaves if t is not None]
    M, N = x.shape[0], w.shape[0]
    y64, l164, g64 = hybrid_step_reference(x, w, None, wd, dy, coef, b, None, bd)
    lowp = [t.detach().clone().requires_grad_() for t in used]  # plain torch in the same dtype
    x_, w_, wd_, *rest = lowp
    b_ = rest[0] if b is not None else None
    bd_ = rest[-1] if bd is not None else None
    h_lp = torch.relu(F.linear(x_, w_, b_))
    y_lp = F.linear(h_lp, wd_, bd_)
    l1_lp = h_lp.float().sum() / max(M * N, 1)
    grads_lp = torch.autograd.grad((y_lp * dy).sum() + coef * l1_lp, lowp)
    h64 = torch.relu(F.linear(x.detach().double(), w.double(), b.double() if b is not None else None))
    assert_close_to_reference(out.y, y64, y_lp, extra_abs=accumulation_allowance(h64, wd.double().t()), name="y")
    assert_close_to_reference(out.l1.reshape(1), l164.reshape(1), l1_lp.reshape(1), dtype=torch.float32, name="l1")
    names = ["x", "w_gate", "w_down", "b_gate", "b_down"]
    ref = {"x": g64.x, "w_gate": g64.w_gate, "w_down": g64.w_down, "b_gate": g64.b_gate, "b_down": g64.b_down}
    for name, g, lp in zip([n for n, t in zip(names, leaves) if t is not None], grads, grads_lp):
        assert_close_to_reference(g, ref[name], lp, name=f"d{name}")
