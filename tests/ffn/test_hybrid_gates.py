"""FATReLU and dReLU gates in the training step (``hybrid_mlp(activation=, threshold=)``): values, the L1 term (on
the gate and on h), the firing counts and every gradient against the float64 reference on every layout (block, the
replayed block step, dense, the paper's format, auto), blocks recomputed past the capacity, the ops' schemas, and the
reference itself against torch autograd in float64.

The gate and up products' inputs lie on a coarse binary grid (x in 1/8, W_g and W_u in 1/32, biases in 1/64), so
both pre-activations are exact in every dtype and order: no pre-activation is within rounding of FATReLU's threshold
or of dReLU's zero, and each path fires exactly where the reference does (the counts are compared exactly)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_backend
from helpers import HYBRID_NAMES

from sparsefuse import track_launches
from sparsefuse.ffn.hybrid import graphed, hybrid_mlp, hybrid_relu_mlp, hybrid_step_reference
from sparsefuse.testing import accumulation_allowance, assert_close_to_reference

M, K, N = 70, 24, 80  # two row blocks, the second partial; no dimension a power of two
COEF = 0.5 * M * N  # the L1 gradient per element, c = COEF / (M * N), as large as h's own: a wrong term shows
GATES = [("fatrelu", 0.0625), ("drelu", 0.0)]  # 0.0625: on the grid, so some pre-activations equal it
ZERO_TOKEN = 5


def _leaves(M, K, N, dtype, device, bias, seed):
    """x [M, K] (token ZERO_TOKEN all zeros) and weights with ~15% of the gate above 0.0625 and ~30% above 0."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    grid = lambda shape, scale: torch.randint(-4, 5, shape, generator=g, dtype=torch.float64) / scale  # noqa: E731
    x, wg, wu = grid((M, K), 8), grid((N, K), 32), grid((N, K), 32)
    x[ZERO_TOKEN] = 0.0
    wd = torch.randn(K, N, generator=g, dtype=torch.float64) / K**0.5
    bg, bu = grid((N,), 64) - 0.0625, grid((N,), 64)
    bd = torch.randn(K, generator=g, dtype=torch.float64)
    tensors = [x, wg, wu, wd] + ([bg, bu, bd] if bias else [None, None, None])
    return [t.to(device=device, dtype=dtype).requires_grad_() if t is not None else None for t in tensors]


def _gate_parts(pre, up, activation, threshold):
    """(fired, h_g, a_u, relu's slope on up) of a gate, as autograd would take them."""
    fired = pre > (threshold if activation == "fatrelu" else 0.0)
    h_g = torch.where(fired, pre, torch.zeros_like(pre))
    return fired, h_g, (torch.relu(up) if activation == "drelu" else up)


def _torch_step(leaves, dy, coef, activation, threshold, l1_on):
    """The same step with plain torch autograd, in the leaves' dtype (what an unpatched model computes; float64
    leaves: the ground truth the reference is checked against)."""
    x, wg, wu, wd, bg, bu, bd = (t.detach().clone().requires_grad_() if t is not None else None for t in leaves)
    _, h_g, a_u = _gate_parts(F.linear(x, wg, bg), F.linear(x, wu, bu), activation, threshold)
    h = h_g * a_u
    y = F.linear(h, wd, bd)
    on = h.abs() if l1_on == "hidden" else h_g
    l1 = on.sum(dtype=torch.promote_types(h.dtype, torch.float32)) / (x.shape[0] * wg.shape[0])
    used = [t for t in (x, wg, wu, wd, bg, bu, bd) if t is not None]
    return y, l1, torch.autograd.grad((y * dy).sum() + coef * l1, used)


def _allowances(leaves, dy, coef, activation, threshold, l1_on):
    """Per-element allowances for summing each product in another order than cuBLAS (Higham's bound), carried into
    the products that use them (the pre-activations are exact: no firing flips)."""
    x, wg, wu, wd, bg, bu, bd = (t.detach().double().cpu() if t is not None else None for t in leaves)
    dy = dy.detach().double().cpu()
    Mx, Nw = x.shape[0], wg.shape[0]
    c = coef / max(Mx * Nw, 1)
    u = torch.finfo(leaves[0].dtype).eps / 2
    up = x @ wu.t() + (bu if bu is not None else 0.0)
    fired, h_g, a_u = _gate_parts(x @ wg.t() + (bg if bg is not None else 0.0), up, activation, threshold)
    slope = (up > 0).double() if activation == "drelu" else torch.ones_like(up)
    dh = dy @ wd
    dh_l1 = dh + (c * torch.where(fired, torch.sign(a_u), 0.0) if l1_on == "hidden" else 0.0)
    dh_u = dh_l1 * h_g * slope
    dpre = torch.where(fired, dh_l1 * a_u + (c if l1_on == "gate" else 0.0), 0.0)
    dh_err = accumulation_allowance(dy, wd)
    dh_u_err, dpre_err = dh_err * h_g.abs() * slope, torch.where(fired, dh_err * a_u.abs(), 0.0)
    h = h_g * a_u
    ones = torch.ones(1, Mx, dtype=torch.float64)
    return {
        "l1": float(u * h.abs().sum() / max(Mx * Nw, 1)),
        "y": accumulation_allowance(h, wd.t()),
        "x": accumulation_allowance(dh_u, wu) + accumulation_allowance(dpre, wg) + dh_u_err @ wu.abs()
        + dpre_err @ wg.abs(),
        "w_gate": accumulation_allowance(dpre.t(), x) + dpre_err.t() @ x.abs(),
        "w_up": accumulation_allowance(dh_u.t(), x) + dh_u_err.t() @ x.abs(),
        "w_down": accumulation_allowance(dy.t(), h),
        "b_gate": dpre_err.sum(0) + accumulation_allowance(ones, dpre)[0],
        "b_up": dh_u_err.sum(0) + accumulation_allowance(ones, dh_u)[0],
        "b_down": accumulation_allowance(ones, dy)[0],
    }  # fmt: skip


def _run(leaves, dy, coef, activation, threshold, l1_on="gate", **kw):
    x, wg, wu, wd, bg, bu, bd = leaves
    out = hybrid_mlp(
        x, wg, wu, wd, b_gate=bg, b_up=bu, b_down=bd, activation=activation, threshold=threshold, l1_on=l1_on, **kw
    )
    grads = torch.autograd.grad((out.y * dy).sum() + coef * out.l1, [t for t in leaves if t is not None])
    return out, grads


def _check(leaves, dy, coef, activation, threshold, l1_on, out, grads):
    """Value, L1 term and gradients against the float64 reference, within twice plain torch's error in the same
    dtype plus the allowance for another summation order; the counts exactly the gate's firing."""
    x, wg, wu, wd, bg, bu, bd = leaves
    y64, l164, g64 = hybrid_step_reference(
        x, wg, wu, wd, dy, coef, bg, bu, bd, l1_on=l1_on, activation=activation, threshold=threshold
    )
    y_lp, l1_lp, grads_lp = _torch_step(leaves, dy, coef, activation, threshold, l1_on)
    allow = _allowances(leaves, dy, coef, activation, threshold, l1_on)
    assert_close_to_reference(out.y, y64, y_lp, extra_abs=allow["y"], name="y")
    assert_close_to_reference(
        out.l1.reshape(1), l164.reshape(1), l1_lp.reshape(1), dtype=torch.float32, extra_abs=allow["l1"], name="l1"
    )
    names = [n for n, t in zip(HYBRID_NAMES, leaves) if t is not None]
    for name, ours, lp in zip(names, grads, grads_lp):
        assert_close_to_reference(ours, getattr(g64, name), lp, extra_abs=allow[name], name=f"d{name}")
    pre = x.detach().double() @ wg.detach().double().t() + (bg.detach().double() if bg is not None else 0.0)
    fired = pre > (threshold if activation == "fatrelu" else 0.0)
    assert torch.equal(out.token_counts.cpu(), fired.sum(1, dtype=torch.int32).cpu())
    assert torch.equal(out.neuron_counts.cpu(), fired.sum(0, dtype=torch.int32).cpu())


@pytest.mark.parametrize("l1_on", ["gate", "hidden"])
@pytest.mark.parametrize("activation, threshold", GATES)
def test_reference_is_torch_autograd_in_float64(activation, threshold, l1_on):
    """The product-by-product reference is autograd's on the gate's expression (FATReLU: ``torch.where(g > t, g,
    0)``; dReLU: ``relu(g) * relu(u)``), and differs from ReLU's (the tests below would not tell them apart
    otherwise)."""
    leaves = _leaves(M, K, N, torch.float64, "cpu", True, seed=41)
    dy = torch.randn(M, K, dtype=torch.float64)
    y_ad, l1_ad, grads_ad = _torch_step(leaves, dy, COEF, activation, threshold, l1_on)
    y64, l164, g64 = hybrid_step_reference(
        *leaves[:4], dy, COEF, *leaves[4:], l1_on=l1_on, activation=activation, threshold=threshold
    )
    torch.testing.assert_close(y64, y_ad.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(l164, l1_ad.detach().double(), rtol=1e-12, atol=1e-12)
    for name, ad in zip(HYBRID_NAMES, grads_ad):
        torch.testing.assert_close(getattr(g64, name), ad, rtol=1e-10, atol=1e-10, msg=name)
    y_relu, _, g_relu = hybrid_step_reference(*leaves[:4], dy, COEF, *leaves[4:], l1_on=l1_on)
    assert not torch.allclose(y_relu, y64) and not torch.allclose(g_relu.w_up, g64.w_up)


LAUNCHES = {
    ("block", "fatrelu"): {"block_sddmm_kernel": 1, "block_unpack_kernel": 1, "block_drelu_grad_kernel": 0},
    ("block", "drelu"): {"block_sddmm_kernel": 1, "block_unpack_kernel": 1, "block_drelu_grad_kernel": 1},
    ("dense", "fatrelu"): {"relu_mul_stats_kernel": 1, "relu_mul_backward_kernel": 1},
    ("dense", "drelu"): {"relu_mul_stats_kernel": 1, "relu_mul_backward_kernel": 1},
    ("hybrid", "fatrelu"): {"gather_accumulate_kernel": 3},
    ("hybrid", "drelu"): {"gather_accumulate_kernel": 3},
}


@pytest.mark.parametrize("dtype, bias", [(torch.float16, True), (torch.float32, False)])
@pytest.mark.parametrize("activation, threshold", GATES)
@pytest.mark.parametrize("layout", ["block", "dense", "hybrid", "auto"])
def test_every_layout_matches_the_float64_reference(layout, activation, threshold, dtype, bias, device):
    leaves = _leaves(M, K, N, dtype, device, bias, seed=42)
    assert_backend(leaves[0])
    dy = torch.randn(M, K, dtype=dtype, device=device)
    with track_launches() as launched:
        out, grads = _run(leaves, dy, COEF, activation, threshold, layout=layout, width=8, backup_rows=1)
    ran = "block" if layout == "auto" else layout  # nothing observed on this gate weight yet: the block step
    for name, count in LAUNCHES[ran, activation].items():
        assert launched[name] == count, launched
    _check(leaves, dy, COEF, activation, threshold, "gate", out, grads)


@pytest.mark.parametrize("activation, threshold", GATES)
@pytest.mark.parametrize("layout", ["block", "dense", "hybrid"])
def test_hidden_l1_term_on_every_layout(layout, activation, threshold, device):
    """``l1_on="hidden"``: |h| with h the product W_d reads (dReLU: relu(g) * relu(u)), its gradient through both
    factors."""
    leaves = _leaves(M, K, N, torch.float32, device, True, seed=43)
    dy = torch.randn(M, K, device=device)
    out, grads = _run(leaves, dy, COEF, activation, threshold, "hidden", layout=layout, width=8, backup_rows=1)
    _check(leaves, dy, COEF, activation, threshold, "hidden", out, grads)


@pytest.mark.parametrize("l1_on", ["gate", "hidden"])
@pytest.mark.parametrize("capacity", [0, 400])
@pytest.mark.parametrize("activation, threshold", GATES)
def test_block_step_recomputes_past_the_capacity(activation, threshold, capacity, l1_on, device):
    """Blocks past the kept capacity are recomputed in the backward with the forward's gate: FATReLU's values at
    or below the threshold left out (and out of the weight gradients' count table), dReLU's up relu'd."""
    leaves = _leaves(M, K, N, torch.float32, device, True, seed=44)
    dy = torch.randn(M, K, device=device)
    out, grads = _run(leaves, dy, COEF, activation, threshold, l1_on, layout="block", block_capacity=capacity)
    _check(leaves, dy, COEF, activation, threshold, l1_on, out, grads)


@pytest.mark.parametrize("layout", ["block", "dense", "hybrid"])
def test_fatrelu_at_threshold_zero_is_relu_bit_for_bit(layout, device):
    leaves = _leaves(M, K, N, torch.float16, device, True, seed=45)
    dy = torch.randn(M, K, dtype=torch.float16, device=device)
    relu_out, relu_grads = _run(leaves, dy, COEF, "relu", 0.0, layout=layout)
    out, grads = _run(leaves, dy, COEF, "fatrelu", 0.0, layout=layout)
    for a, b in zip((*out, *grads), (*relu_out, *relu_grads)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("activation, threshold", GATES)
def test_graphed_step(activation, threshold, device):
    """The block step replayed from its captured graphs (the interpreter re-runs the captured function): a capture
    per gate, the eager step's results bit for bit."""
    graphed.release_graphs()
    try:
        leaves = _leaves(M, K, N, torch.float16, device, True, seed=46)
        dy = torch.randn(M, K, dtype=torch.float16, device=device)
        eager_out, eager_grads = _run(leaves, dy, COEF, activation, threshold, layout="block")  # observed once
        before = dict(graphed.GRAPH_EVENTS)
        out, grads = _run(leaves, dy, COEF, activation, threshold, layout="block", cuda_graph=True)
        assert graphed.GRAPH_EVENTS["capture"] == before.get("capture", 0) + 1
        assert graphed.GRAPH_EVENTS["replay"] == before.get("replay", 0) + 1
        for a, b in zip((*out, *grads), (*eager_out, *eager_grads)):
            assert torch.equal(a, b)
        _check(leaves, dy, COEF, activation, threshold, "gate", out, grads)
        _run(leaves, dy, COEF, "relu", 0.0, layout="block", cuda_graph=True)
        assert graphed.GRAPH_EVENTS["capture"] == before.get("capture", 0) + 2  # ReLU's step: a capture of its own
    finally:
        graphed.release_graphs()


@pytest.mark.parametrize("activation, threshold", [("fatrelu", 0.3), ("drelu", 0.0)])
@pytest.mark.parametrize("layout", ["hybrid", "dense"])
def test_gradcheck_float64(layout, activation, threshold):
    """float64 (the exact torch paths): differentiable by finite differences in every tensor, both L1 terms."""
    leaves = _leaves(6, 5, 12, torch.float64, "cpu", True, seed=47)
    with torch.no_grad():  # off the grid: no pre-activation within eps of a kink
        for t in leaves:
            t.add_(torch.rand(t.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7)) * 1e-2)

    def fn(*args):
        x, wg, wu, wd, bg, bu, bd = args
        kw = dict(b_gate=bg, b_up=bu, b_down=bd, layout=layout, activation=activation, threshold=threshold)
        return hybrid_mlp(x, wg, wu, wd, **kw).y, hybrid_mlp(x, wg, wu, wd, l1_on="hidden", **kw).l1

    assert torch.autograd.gradcheck(fn, tuple(leaves), eps=1e-6, atol=1e-6)


def test_the_ops_take_the_gate(device):
    """The block step's, the paper format's and the dense step's ops take the gate as (str, float) arguments: schema,
    fake implementations and autograd registration."""
    from sparsefuse.ffn.hybrid.block_step import block_mlp_train_bwd_op, block_mlp_train_fwd_op
    from sparsefuse.ffn.hybrid.dense import relu_mul_l1_backward_op, relu_mul_l1_op
    from sparsefuse.ffn.hybrid.functional import block_plan
    from sparsefuse.ffn.hybrid.op import hybrid_mlp_bwd_op, hybrid_mlp_fwd_op

    x, wg, wu, wd, bg, bu, bd = _leaves(M, 16, 48, torch.float32, device, True, seed=48)
    wdt, plan = wd.t(), block_plan(48)
    utils = ("test_schema", "test_faketensor", "test_autograd_registration")
    dy, dl1 = torch.randn(M, 16, device=device), torch.tensor(0.5, device=device)
    detached = [t.detach() for t in (x, wg, wu, wdt, bg, bu)]
    for gate in (("fatrelu", 0.25), ("drelu", 0.0)):
        fwd_args = (x, wg, bg, wu, bu, wdt, bd, plan.block_rows, plan.tile, plan.sorts(M), M * 48, False, *gate)
        torch.library.opcheck(block_mlp_train_fwd_op, fwd_args, test_utils=utils)
        out = block_mlp_train_fwd_op(*(a.detach() if isinstance(a, torch.Tensor) else a for a in fwd_args))
        bwd_args = (dy, dl1, *detached, *out[3:], plan.block_rows, True, False, *gate)
        torch.library.opcheck(block_mlp_train_bwd_op, bwd_args, test_utils=("test_schema", "test_faketensor"))
        hybrid_args = (x, wg, None, wu, None, wdt, None, 6, 2, False, *gate)
        torch.library.opcheck(hybrid_mlp_fwd_op, hybrid_args, test_utils=utils)
        saved = hybrid_mlp_fwd_op(*(a.detach() if isinstance(a, torch.Tensor) else a for a in hybrid_args))[2:9]
        args = (dy, dl1, *detached[:4], *saved, False, gate[0])
        torch.library.opcheck(hybrid_mlp_bwd_op, args, test_utils=("test_schema", "test_faketensor"))
        pre, up = (torch.randn(10, 40, device=device) for _ in range(2))
        torch.library.opcheck(relu_mul_l1_op, (pre.clone().requires_grad_(), up.clone().requires_grad_(), True, *gate))
        grad_h = torch.randn(10, 40, device=device)
        torch.library.opcheck(relu_mul_l1_backward_op, (grad_h, dl1, pre.relu(), up, True, gate[0]))


@pytest.mark.parametrize("layout", ["block", "dense"])
def test_compiled_step(layout, device):
    """torch.compile (fullgraph) traces the ops with the gate's arguments: the eager step's results."""
    leaves = _leaves(16, 16, 48, torch.float32, device, True, seed=49)
    dy = torch.randn(16, 16, device=device)
    for activation, threshold in GATES:
        # a fresh trace per gate: a recompile for a changed float argument would make it a dynamic one, which the
        # argument check (math.isfinite) cannot take under fullgraph
        torch._dynamo.reset()
        out, grads = _run(leaves, dy, 0.5 * 16 * 48, activation, threshold, layout=layout)

        def fn(*args, activation=activation, threshold=threshold):
            x, wg, wu, wd, bg, bu, bd = args
            o = hybrid_mlp(
                x, wg, wu, wd, b_gate=bg, b_up=bu, b_down=bd, layout=layout, activation=activation, threshold=threshold
            )
            return o.y, o.l1

        backend = "inductor" if device.type == "cuda" else "aot_eager"
        y_c, l1_c = torch.compile(fn, fullgraph=True, backend=backend)(*leaves)
        grads_c = torch.autograd.grad((y_c * dy).sum() + 0.5 * 16 * 48 * l1_c, leaves)
        torch.testing.assert_close(y_c, out.y)
        torch.testing.assert_close(l1_c, out.l1)
        for a, b in zip(grads_c, grads):
            torch.testing.assert_close(a, b)


def test_bad_gates(device):
    x, wg, wu, wd, *_ = _leaves(8, 16, 32, torch.float32, device, False, seed=50)
    with pytest.raises(ValueError, match="activation must be one of 'relu', 'fatrelu', 'drelu'; got 'gelu'"):
        hybrid_mlp(x, wg, wu, wd, activation="gelu")
    with pytest.raises(TypeError, match="activation must be a str"):
        hybrid_mlp(x, wg, wu, wd, activation=None)
    with pytest.raises(ValueError, match="applies to activation='fatrelu' only"):
        hybrid_mlp(x, wg, wu, wd, activation="drelu", threshold=0.1)
    with pytest.raises(ValueError, match="applies to activation='fatrelu' only"):
        hybrid_mlp(x, wg, wu, wd, threshold=0.1)
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="threshold must be a finite number >= 0"):
            hybrid_mlp(x, wg, wu, wd, activation="fatrelu", threshold=bad)
    with pytest.raises(TypeError, match="threshold must be a Python float"):
        hybrid_mlp(x, wg, wu, wd, activation="fatrelu", threshold=torch.tensor(0.1))
    with pytest.raises(ValueError, match="activation must be one of"):
        hybrid_step_reference(x, wg, wu, wd, torch.zeros(8, 16), activation="silu")
    with pytest.raises(TypeError):  # the non-gated block is ReLU's alone
        hybrid_relu_mlp(x, wg, wd, activation="fatrelu", threshold=0.1)
