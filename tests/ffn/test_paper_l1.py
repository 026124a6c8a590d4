"""The TwELL paper's L1 term on the hidden representation h = h_g * h_u (``hybrid_mlp(l1_on="hidden")``): its value
and its gradients to x and every weight and bias, through both factors, against the float64 reference on every
layout (block, the graphed block step, dense, the paper's format), and the reference itself against torch autograd
in float64."""

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_backend
from helpers import HYBRID_NAMES, accumulation_allowance
from test_hybrid_train import _leaves

from sparsefuse import track_launches
from sparsefuse.ffn.hybrid import graphed, hybrid_mlp, hybrid_relu_mlp, hybrid_step_reference
from sparsefuse.testing import assert_close_to_reference

M, K, N = 40, 32, 80
# the L1 gradient per element, c = coefficient / (M * N), as large as h's own gradient: a wrong term shows
COEF = 0.5 * M * N


def _run(leaves, dy, coef, **kw):
    x, wg, wu, wd, bg, bu, bd = leaves
    out = hybrid_mlp(x, wg, wu, wd, b_gate=bg, b_up=bu, b_down=bd, l1_on="hidden", **kw)
    grads = torch.autograd.grad((out.y * dy).sum() + coef * out.l1, [t for t in leaves if t is not None])
    return out, grads


def _torch_lowp(leaves, dy, coef):
    """The same step and term in the same dtype with plain torch autograd (what an unpatched model computes)."""
    x, wg, wu, wd, bg, bu, bd = (t.detach().clone().requires_grad_() if t is not None else None for t in leaves)
    h = torch.relu(F.linear(x, wg, bg)) * F.linear(x, wu, bu)
    y = F.linear(h, wd, bd)
    l1 = h.abs().sum(dtype=torch.promote_types(h.dtype, torch.float32)) / (x.shape[0] * wg.shape[0])
    used = [t for t in (x, wg, wu, wd, bg, bu, bd) if t is not None]
    return y, l1, torch.autograd.grad((y * dy).sum() + coef * l1, used)


def _allowances(leaves, dy, coef):
    """Per-element allowances for summing each product in another order than cuBLAS (Higham's bound), carried
    into the products that use them, as tests/helpers.py's hybrid_order_allowances with the hidden term: sign(h_u)
    may flip where |h_u| is within the up product's error, moving dh_u by 2 c h_g there."""
    x, wg, wu, wd, bg, bu, bd = (t.detach().double().cpu() if t is not None else None for t in leaves)
    dy = dy.detach().double().cpu()
    Mx, Nw = x.shape[0], wg.shape[0]
    c = coef / max(Mx * Nw, 1)
    u = torch.finfo(leaves[0].dtype).eps / 2
    pre = x @ wg.t() + (bg if bg is not None else 0.0)
    fired = pre > 0
    h_g, h_u = torch.where(fired, pre, 0.0), x @ wu.t() + (bu if bu is not None else 0.0)
    dh = dy @ wd
    dh_l1 = dh + c * torch.where(fired, torch.sign(h_u), 0.0)
    dh_u, dpre = dh_l1 * h_g, torch.where(fired, dh_l1 * h_u, 0.0)
    up_err, dh_err = accumulation_allowance(x, wu.t()), accumulation_allowance(dy, wd)
    flips = fired & (h_u.abs() <= up_err + u * h_u.abs())
    dh_u_err = dh_err * h_g.abs() + 2 * c * h_g * flips
    dpre_err = torch.where(fired, dh_err * h_u.abs() + dh_l1.abs() * up_err, 0.0)
    h_err = h_g.abs() * up_err
    ones = torch.ones(1, Mx, dtype=torch.float64)
    return {
        "l1": float((h_err + u * (h_g * h_u).abs()).sum() / max(Mx * Nw, 1)),
        "y": accumulation_allowance(h_g * h_u, wd.t()) + h_err @ wd.t().abs(),
        "x": accumulation_allowance(dh_u, wu)
        + accumulation_allowance(dpre, wg)
        + dh_u_err @ wu.abs()
        + dpre_err @ wg.abs(),
        "w_gate": accumulation_allowance(dpre.t(), x) + dpre_err.t() @ x.abs(),
        "w_up": accumulation_allowance(dh_u.t(), x) + dh_u_err.t() @ x.abs(),
        "w_down": accumulation_allowance(dy.t(), h_g * h_u) + dy.t().abs() @ h_err,
        "b_gate": dpre_err.sum(0) + accumulation_allowance(ones, dpre)[0],
        "b_up": dh_u_err.sum(0) + accumulation_allowance(ones, dh_u)[0],
        "b_down": accumulation_allowance(ones, dy)[0],
    }


def _check(leaves, dy, coef, out, grads):
    """Value and gradients against the float64 reference, within twice plain torch's error in the same dtype plus
    the allowance for another summation order."""
    x, wg, wu, wd, bg, bu, bd = leaves
    y64, l164, g64 = hybrid_step_reference(x, wg, wu, wd, dy, coef, bg, bu, bd, l1_on="hidden")
    y_lp, l1_lp, grads_lp = _torch_lowp(leaves, dy, coef)
    allow = _allowances(leaves, dy, coef)
    assert_close_to_reference(out.y, y64, y_lp, extra_abs=allow["y"], name="y")
    assert_close_to_reference(
        out.l1.reshape(1), l164.reshape(1), l1_lp.reshape(1), dtype=torch.float32, extra_abs=allow["l1"], name="l1"
    )
    names = [n for n, t in zip(HYBRID_NAMES, leaves) if t is not None]
    for name, ours, lp in zip(names, grads, grads_lp):
        assert_close_to_reference(ours, getattr(g64, name), lp, extra_abs=allow[name], name=f"d{name}")


@pytest.mark.parametrize("bias", [False, True])
def test_reference_is_torch_autograd_in_float64(bias):
    """The product-by-product reference's hidden term and gradients are autograd's on |relu(x W_g^T) * x W_u^T|; the
    gate term stays the gate's; and the two differ (the test below would not tell them apart otherwise)."""
    leaves = _leaves(M, K, N, torch.float64, "cpu", bias, seed=31)
    dy = torch.randn(M, K, dtype=torch.float64)
    y_ad, l1_ad, grads_ad = _torch_lowp(leaves, dy, COEF)  # float64 leaves: float64 autograd
    y64, l164, g64 = hybrid_step_reference(*leaves[:4], dy, COEF, *leaves[4:], l1_on="hidden")
    torch.testing.assert_close(y64, y_ad.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(l164, l1_ad.detach().double(), rtol=1e-12, atol=1e-12)
    names = [n for n, t in zip(HYBRID_NAMES, leaves) if t is not None]
    for name, ad in zip(names, grads_ad):
        torch.testing.assert_close(getattr(g64, name), ad, rtol=1e-10, atol=1e-10, msg=name)
    _, l1_gate, g_gate = hybrid_step_reference(*leaves[:4], dy, COEF, *leaves[4:])
    assert not torch.allclose(l1_gate, l164) and not torch.allclose(g_gate.w_up, g64.w_up)
    with pytest.raises(ValueError, match="l1_on"):
        hybrid_step_reference(*leaves[:4], dy, COEF, l1_on="up")


HIDDEN_KERNELS = {"block": ("block_abs_sum_kernel", "block_hidden_l1_grad_kernel")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["block", "dense", "hybrid"])
def test_hidden_term_matches_the_float64_reference_on_every_layout(layout, dtype, bias, device):
    leaves = _leaves(M, K, N, dtype, device, bias, seed=32)
    assert_backend(leaves[0])
    dy = torch.randn(M, K, dtype=dtype, device=device)
    with track_launches() as launched:
        out, grads = _run(leaves, dy, COEF, layout=layout, width=8, backup_rows=1)
    if layout == "block":  # the term on the unions, one launch each way
        assert launched["block_abs_sum_kernel"] == 1 and launched["block_hidden_l1_grad_kernel"] == 1, launched
    elif layout == "dense":  # folded into the fused elementwise pass each way: no other launch
        assert launched == {"relu_mul_stats_kernel": 1, "relu_mul_backward_kernel": 1}, launched
    else:
        assert launched["gather_accumulate_kernel"] == 3, launched
    _check(leaves, dy, COEF, out, grads)


@pytest.mark.parametrize("layout", ["block", "dense", "hybrid"])
def test_hidden_term_alone_in_the_loss(layout, device):
    """dy = 0: every gradient is the L1 term's (through both factors), and the block step's backward gets no y
    gradient at all."""
    leaves = _leaves(M, K, N, torch.float32, device, True, seed=33)
    out = hybrid_mlp(
        *leaves[:4], b_gate=leaves[4], b_up=leaves[5], b_down=leaves[6], layout=layout, l1_on="hidden", width=8
    )
    grads = torch.autograd.grad(COEF * out.l1, leaves, allow_unused=True)
    # W_d and b_d: the loss does not reach them (the dense step's graph has no path to them: None)
    grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, leaves)]
    _check(leaves, torch.zeros(M, K, device=device), COEF, out, grads)
    assert float(grads[2].abs().max()) > 0  # W_u's gradient: the term reaches the up product


@pytest.mark.parametrize("capacity", [0, 300])
def test_block_step_recomputes_past_the_capacity_with_the_hidden_term(capacity, device):
    """Blocks past the kept capacity are recomputed in the backward: the hidden term's gradient is added on their
    recomputed factors too."""
    leaves = _leaves(70, 16, 96, torch.float32, device, True, seed=34, dense_rows=(5,))
    dy = torch.randn(70, 16, device=device)
    out, grads = _run(leaves, dy, 0.5 * 70 * 96, layout="block", block_capacity=capacity)
    _check(leaves, dy, 0.5 * 70 * 96, out, grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_graphed_step_with_the_hidden_term(dtype, device):
    """The block step replayed from its captured graphs (the interpreter re-runs the captured function): a capture
    of its own for the hidden term, the same results as the eager step, and the gate term's capture untouched."""
    graphed.release_graphs()
    try:
        leaves = _leaves(M, K, N, dtype, device, True, seed=35)
        dy = torch.randn(M, K, dtype=dtype, device=device)
        eager_out, eager_grads = _run(leaves, dy, COEF, layout="block")  # an observation for the capacity
        before = dict(graphed.GRAPH_EVENTS)
        out, grads = _run(leaves, dy, COEF, layout="block", cuda_graph=True)
        assert graphed.GRAPH_EVENTS["capture"] == before.get("capture", 0) + 1
        assert graphed.GRAPH_EVENTS["replay"] == before.get("replay", 0) + 1
        _check(leaves, dy, COEF, out, grads)
        assert torch.equal(out.y, eager_out.y) and torch.equal(out.l1, eager_out.l1)
        for ours, theirs in zip(grads, eager_grads):
            assert torch.equal(ours, theirs)
        x, wg, wu, wd, bg, bu, bd = leaves
        gate = hybrid_mlp(x, wg, wu, wd, b_gate=bg, b_up=bu, b_down=bd, layout="block", cuda_graph=True)
        assert graphed.GRAPH_EVENTS["capture"] == before.get("capture", 0) + 2  # the gate term: another capture
        eager_gate = hybrid_mlp(x, wg, wu, wd, b_gate=bg, b_up=bu, b_down=bd, layout="block")
        assert torch.equal(gate.l1, eager_gate.l1) and not torch.equal(gate.l1, out.l1)
    finally:
        graphed.release_graphs()


@pytest.mark.parametrize("layout", ["hybrid", "dense"])
def test_hidden_term_gradcheck_float64(layout):
    """float64 (the exact torch paths): the hidden term is differentiable by finite differences in every tensor."""
    leaves = _leaves(6, 5, 12, torch.float64, "cpu", True, seed=36)

    def l1(*args):
        x, wg, wu, wd, bg, bu, bd = args
        return hybrid_mlp(x, wg, wu, wd, b_gate=bg, b_up=bu, b_down=bd, layout=layout, l1_on="hidden").l1

    assert torch.autograd.gradcheck(l1, tuple(leaves), eps=1e-6, atol=1e-6)


def test_the_ops_with_the_hidden_term_pass_opcheck(device):
    """The block step's and the paper format's ops and the dense step's fused ops take the term as a bool argument:
    schema, fake implementations and autograd registration."""
    from sparsefuse.ffn.hybrid.block_step import block_mlp_train_bwd_op, block_mlp_train_fwd_op
    from sparsefuse.ffn.hybrid.dense import relu_mul_l1_backward_op, relu_mul_l1_op
    from sparsefuse.ffn.hybrid.functional import block_plan
    from sparsefuse.ffn.hybrid.op import hybrid_mlp_bwd_op, hybrid_mlp_fwd_op

    x, wg, wu, wd, bg, bu, bd = _leaves(M, 16, 48, torch.float32, device, True, seed=37)
    wdt = wd.t()
    plan = block_plan(48)
    utils = ("test_schema", "test_faketensor", "test_autograd_registration")
    fwd_args = (x, wg, bg, wu, bu, wdt, bd, plan.block_rows, plan.tile, plan.sorts(M), M * 48, True)
    torch.library.opcheck(block_mlp_train_fwd_op, fwd_args, test_utils=utils)
    out = block_mlp_train_fwd_op(*(a.detach() if isinstance(a, torch.Tensor) else a for a in fwd_args))
    dy, dl1 = torch.randn(M, 16, device=device), torch.tensor(0.5, device=device)
    detached = [t.detach() for t in (x, wg, wu, wdt, bg, bu)]
    bwd_args = (dy, dl1, *detached, *out[3:], plan.block_rows, True, True)
    torch.library.opcheck(block_mlp_train_bwd_op, bwd_args, test_utils=("test_schema", "test_faketensor"))
    hybrid_args = (x, wg, None, wu, None, wdt, None, 6, 2, True)
    torch.library.opcheck(hybrid_mlp_fwd_op, hybrid_args, test_utils=utils)
    saved = hybrid_mlp_fwd_op(*(a.detach() if isinstance(a, torch.Tensor) else a for a in hybrid_args))[2:9]
    args = (dy, dl1, *detached[:4], *saved, True)
    torch.library.opcheck(hybrid_mlp_bwd_op, args, test_utils=("test_schema", "test_faketensor"))
    pre, up = (torch.randn(10, 40, device=device) for _ in range(2))
    torch.library.opcheck(relu_mul_l1_op, (pre.clone().requires_grad_(), up.clone().requires_grad_(), True))
    torch.library.opcheck(relu_mul_l1_backward_op, (torch.randn(10, 40, device=device), dl1, pre.relu(), up, True))


def test_compiled_step_with_the_hidden_term(device):
    """torch.compile (fullgraph) traces the block step's ops with the term's flag: the eager step's results."""
    leaves = _leaves(16, 16, 48, torch.float32, device, True, seed=38)
    dy = torch.randn(16, 16, device=device)
    out, grads = _run(leaves, dy, 0.5 * 16 * 48, layout="block")

    def fn(*args):
        o = hybrid_mlp(*args[:4], b_gate=args[4], b_up=args[5], b_down=args[6], layout="block", l1_on="hidden")
        return o.y, o.l1

    backend = "inductor" if device.type == "cuda" else "aot_eager"
    y_c, l1_c = torch.compile(fn, fullgraph=True, backend=backend)(*leaves)
    grads_c = torch.autograd.grad((y_c * dy).sum() + 0.5 * 16 * 48 * l1_c, leaves)
    torch.testing.assert_close(y_c, out.y)
    torch.testing.assert_close(l1_c, out.l1)
    for a, b in zip(grads_c, grads):
        torch.testing.assert_close(a, b)


def test_bad_l1_on_and_the_non_gated_block(device):
    leaves = _leaves(8, 16, 32, torch.float32, device, False, seed=39)
    with pytest.raises(ValueError, match="l1_on must be one of 'gate', 'hidden'; got 'up'"):
        hybrid_mlp(*leaves[:4], l1_on="up")
    with pytest.raises(TypeError):  # the non-gated block's hidden representation is its gate: no option
        hybrid_relu_mlp(leaves[0], leaves[1], leaves[3], l1_on="hidden")
