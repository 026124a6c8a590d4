"""The dense step of :func:`sparsefuse.ffn.hybrid.hybrid_mlp` (``layout="dense"``, what ``"auto"`` takes once the
gate fires widely): its fused elementwise ops (ReLU, the product with up, the L1 term and the firing counts in one
pass; both products' chain rule with the L1 gradient in one pass back) against float64, opcheck, gradcheck, compile,
the eager fast path (the GPU test, block and dense, is in test_hybrid_train.py)."""

import pytest
import torch
from test_hybrid_train import _check, _leaves, _run

from sparsefuse import track_launches
from sparsefuse.ffn.hybrid import hybrid_mlp, hybrid_relu_mlp


def _assert_rounded_once(ours, ref64, dtype, fp32_terms=None, name="output"):
    """ours within one rounding to dtype of the float64 reference (the interpreter truncates to bf16: < 1 ulp), plus
    an fp32 rounding of each intermediate term where the kernel forms one (``fp32_terms``: their magnitudes [M, N]);
    NaN exactly where the reference has it."""
    ours64, ref64 = ours.detach().cpu().double(), ref64.detach().cpu().double()
    assert ours.dtype == dtype and ours64.shape == ref64.shape, (name, ours.dtype, ours64.shape)
    assert torch.equal(ours64.isnan(), ref64.isnan()), f"{name}: NaN where the reference has none, or none where it has"
    finfo = torch.finfo(dtype)
    tol = finfo.eps * ref64.abs() + finfo.smallest_normal * finfo.eps
    if fp32_terms is not None:
        tol = tol + 2 * torch.finfo(torch.float32).eps * fp32_terms
    err = (ours64 - ref64).abs().nan_to_num(0.0)
    assert bool((err <= tol.nan_to_num(0.0)).all()), f"{name}: max error {float(err.max()):.3g} past the bound"


def _fused_inputs(M, N, dtype, device, seed, nan=(), negative=False):
    g = torch.Generator().manual_seed(seed)
    pre, up, grad_h = (torch.randn(M, N, generator=g, dtype=torch.float64) for _ in range(3))
    if negative:
        pre = -pre.abs()  # no entry fires
    for r, c in nan:
        pre[r, c] = float("nan")
    return [t.to(device=device, dtype=dtype) for t in (pre, up, grad_h)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "M, N, nan, negative",
    [
        (37, 75, (), False),  # neither a multiple of the interpreter's tile (4 x 32): partial strips and row groups
        (70, 300, ((3, 5), (69, 299)), False),  # NaN pre-activations: fired, kept, their gradient passed on
        (12, 64, (), True),  # an all-zero batch: nothing fires
        (1, 1, (), False),
        (0, 64, (), False),  # empty: the exact torch path
    ],
)
def test_relu_mul_l1_matches_float64(M, N, nan, negative, dtype, device):
    """relu_mul_l1 and its backward against float64, each output within one rounding of its dtype: h_gate exact,
    h = h_gate * up rounded once, the L1 term, the counts exact; d_up = grad_h * h_gate and d_pre = grad_h * up +
    grad_l1 / (M * N) where the gate fired (NaN included)."""
    from sparsefuse.ffn.hybrid.dense import relu_mul_l1

    pre, up, grad_h = _fused_inputs(M, N, dtype, device, seed=20, nan=nan, negative=negative)
    leaves = [pre.clone().requires_grad_(), up.clone().requires_grad_()]
    with track_launches() as launched:
        h_gate, h, l1, token_counts, neuron_counts = relu_mul_l1(*leaves)
        grad_l1 = torch.tensor(0.7, device=device)
        d_pre, d_up = torch.autograd.grad((h, l1), leaves, (grad_h, grad_l1))
    assert launched == ({"relu_mul_stats_kernel": 1, "relu_mul_backward_kernel": 1} if M * N else {}), launched
    p, u, g = pre.double().cpu(), up.double().cpu(), grad_h.double().cpu()
    fired = (p > 0) | p.isnan()
    gate64 = torch.where(fired, p, 0.0)
    assert torch.equal(h_gate.cpu().double().nan_to_num(7.0), gate64.nan_to_num(7.0)) and not h_gate.requires_grad
    _assert_rounded_once(h, gate64 * u, dtype, name="h")
    assert l1.dtype == torch.float32 and l1.shape == ()
    l1_64 = gate64.sum() / max(M * N, 1)
    if nan:
        assert l1.isnan()
    else:
        torch.testing.assert_close(l1.cpu().double(), l1_64, rtol=1e-6, atol=1e-9)
    assert torch.equal(token_counts.cpu(), fired.sum(1, dtype=torch.int32))
    assert torch.equal(neuron_counts.cpu(), fired.sum(0, dtype=torch.int32))
    assert not token_counts.requires_grad and not neuron_counts.requires_grad
    gate_grad = 0.7 / max(M * N, 1)
    _assert_rounded_once(d_up, g * gate64, dtype, name="d_up")
    d_pre64 = torch.where(fired, g * u + gate_grad, 0.0)
    _assert_rounded_once(d_pre, d_pre64, dtype, fp32_terms=(g * u).abs() + gate_grad, name="d_pre")
    if negative:
        assert (
            int(token_counts.sum()) == 0 and float(l1.detach()) == 0.0 and not bool(h.any()) and not bool(d_pre.any())
        )


@pytest.mark.parametrize("which", ["h", "l1"])
@pytest.mark.parametrize("gated", [True, False])
def test_fused_backward_with_one_output_in_the_loss(which, gated, device):
    """Only h (no L1 term: the kernel without its gradient) or only l1 in the loss (h's gradient absent: zeros stand
    in): the gradients of the float64 expression."""
    from sparsefuse.ffn.hybrid.dense import relu_l1, relu_mul_l1

    pre, up, grad_h = _fused_inputs(21, 40, torch.float32, device, seed=21)
    leaves = [pre.clone().requires_grad_()] + ([up.clone().requires_grad_()] if gated else [])
    if gated:
        _, h, l1, _, _ = relu_mul_l1(*leaves)
    else:
        h, l1, _, _ = relu_l1(*leaves)
    loss = (h * grad_h).sum() if which == "h" else 0.7 * l1
    grads = torch.autograd.grad(loss, leaves)
    p, u, g = pre.double().cpu(), up.double().cpu() if gated else 1.0, grad_h.double().cpu()
    gate64 = torch.where(p > 0, p, 0.0)
    if which == "l1":
        g = torch.zeros_like(p)
    d_pre64 = torch.where(p > 0, g * u + (0.7 / p.numel() if which == "l1" else 0.0), 0.0)
    _assert_rounded_once(grads[0], d_pre64, torch.float32, fp32_terms=d_pre64.abs(), name="d_pre")
    if gated:
        _assert_rounded_once(grads[1], g * gate64, torch.float32, name="d_up")


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_ops_pass_opcheck(dtype, layout, device):
    """Schema, fake tensors, autograd registration and AOT dispatch of the four ops (the backward ops with and
    without the L1 gradient); ``transposed``: every [M, N] input the transpose of a contiguous tensor (the outputs
    stay contiguous, as the fakes say)."""
    from sparsefuse.ffn.hybrid.dense import (
        relu_l1_backward_op,
        relu_l1_op,
        relu_mul_l1_backward_op,
        relu_mul_l1_op,
    )

    pre, up, grad_h = _fused_inputs(10, 40, dtype, device, seed=22)
    if layout == "transposed":
        pre, up, grad_h = (t.t().contiguous().t() for t in (pre, up, grad_h))
    torch.library.opcheck(relu_mul_l1_op, (pre.requires_grad_(), up.requires_grad_()))
    torch.library.opcheck(relu_l1_op, (pre,))
    pre, up = pre.detach(), up.detach()
    gate = torch.relu(pre)
    grad_l1 = torch.tensor(0.3, device=device)
    for l1_grad in (grad_l1, None):
        torch.library.opcheck(relu_mul_l1_backward_op, (grad_h, l1_grad, gate, up))
        torch.library.opcheck(relu_l1_backward_op, (gate, grad_h, l1_grad))


def test_fused_ops_torch_path_matches_the_kernels(device, monkeypatch):
    """CPU tensors without the interpreter run the torch path: in fp32 the same outputs as the kernels (one fp32
    rounding of each product either way), the L1 term and the gradients to fp32 summation order."""
    from sparsefuse import _backend
    from sparsefuse.ffn.hybrid.dense import relu_mul_l1

    if not _backend.INTERPRET:
        pytest.skip("compares the interpreter's kernels on CPU tensors with the torch path")

    pre, up, grad_h = (t.cpu() for t in _fused_inputs(33, 70, torch.float32, device, seed=23, nan=((2, 3),)))

    def run():
        leaves = [pre.clone().requires_grad_(), up.clone().requires_grad_()]
        with track_launches() as launched:
            out = relu_mul_l1(*leaves)
            grads = torch.autograd.grad((out[1], out[2]), leaves, (grad_h, torch.tensor(0.4)))
        return out, grads, sum(launched.values())

    kernel_out, kernel_grads, kernel_launches = run()
    monkeypatch.setattr(_backend, "INTERPRET", False)
    torch_out, torch_grads, torch_launches = run()
    assert kernel_launches == 2 and torch_launches == 0
    for a, b in zip((*kernel_out[:2], *kernel_out[3:]), (*torch_out[:2], *torch_out[3:])):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    assert kernel_out[2].isnan() and torch_out[2].isnan()
    for a, b in zip(kernel_grads, torch_grads):
        torch.testing.assert_close(a, b, rtol=2e-7, atol=1e-7, equal_nan=True)


def _dense_fn(gated):
    """The dense step as a function of its tensors (y, l1 and the counts out): x, w_gate, w_up, w_down and the three
    biases gated; x, w (the gate), w_down, b, b_down not (hybrid_relu_mlp's names)."""

    def gated_step(x, wg, wu, wd, bg, bu, bd):
        o = hybrid_mlp(x, wg, wu, wd, b_gate=bg, b_up=bu, b_down=bd, layout="dense")
        return o.y, o.l1, o.token_counts, o.neuron_counts

    def relu_step(x, w, wd, b, bd):
        o = hybrid_relu_mlp(x, w, wd, b_up=b, b_down=bd, layout="dense")
        return o.y, o.l1, o.token_counts, o.neuron_counts

    return gated_step if gated else relu_step


def _dense_leaves(M, K, N, dtype, device, gated, seed, bias=True):
    """_dense_fn's arguments (biases None without ``bias``)."""
    leaves = _leaves(M, K, N, dtype, device, bias, seed=seed)
    return leaves if gated else [leaves[i] for i in (0, 1, 3, 4, 6)]


@pytest.mark.parametrize("gated", [True, False])
def test_dense_layout_gradcheck_float64(gated):
    """float64 (the exact torch path): the dense step's y and L1 term are differentiable by finite differences."""
    leaves = _dense_leaves(6, 5, 12, torch.float64, "cpu", gated, seed=3)
    step = _dense_fn(gated)
    assert torch.autograd.gradcheck(lambda *a: step(*a)[:2], tuple(leaves), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("which", ["y", "l1"])
def test_dense_step_with_only_one_output_in_the_loss(which, device):
    """The dense layout with y alone or the L1 term alone in the loss: the reference's gradients (the weights the
    loss does not reach get zeros)."""
    leaves = _leaves(24, 16, 48, torch.float32, device, False, seed=5)
    dy = torch.randn(24, 16, device=device) if which == "y" else torch.zeros(24, 16, device=device)
    coef = 0.0 if which == "y" else 0.7
    out = hybrid_mlp(*leaves[:4], layout="dense")
    loss = (out.y * dy).sum() if which == "y" else coef * out.l1
    grads = torch.autograd.grad(loss, leaves[:4], allow_unused=True, materialize_grads=True)
    _check(leaves, dy, coef, out, grads)


@pytest.mark.parametrize("gated", [True, False])
def test_dense_step_compiles_without_graph_breaks(gated, device):
    """torch.compile(fullgraph=True) of the dense step, forward and backward, runs the ops' kernels and gives the
    eager step's results bit for bit; activation checkpointing too."""
    leaves = _dense_leaves(40, 16, 80, torch.float32, device, gated, seed=14)
    dy = torch.randn(40, 16, device=device)
    fn = _dense_fn(gated)

    def with_grads(y, l1, *counts):
        return (y, l1, *counts, *torch.autograd.grad((y * dy).sum() + 0.2 * l1, leaves))

    eager = with_grads(*fn(*leaves))
    torch._dynamo.reset()
    with track_launches() as launched:
        compiled = with_grads(*torch.compile(fn, fullgraph=True, backend="aot_eager")(*leaves))
    assert launched["relu_mul_stats_kernel"] >= 1 and launched["relu_mul_backward_kernel"] >= 1, launched
    checkpointed = with_grads(*torch.utils.checkpoint.checkpoint(fn, *leaves, use_reentrant=False))
    for a, b, c in zip(eager, compiled, checkpointed):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("gated", [True, False])
def test_eager_dense_step_skips_the_dispatcher_with_the_same_results(gated, bias, device, monkeypatch, plan):
    # plain eager calls run the dense ops' code as an autograd.Function (less host time); the torch.library ops
    # (what torch.compile traces) must give bit-identical outputs and gradients, with the same two kernels
    from sparsefuse.ffn.hybrid import dense

    leaves = _dense_leaves(50, 16, 96, torch.float16, device, gated, seed=15, bias=bias)
    used = [t for t in leaves if t is not None]
    dy = torch.randn(50, 16, device=device, dtype=torch.float16)
    eager_fn = dense._EagerReluMulL1 if gated else dense._EagerReluL1
    forward, calls = eager_fn.forward, []
    counted = staticmethod(lambda ctx, *inputs: calls.append(1) or forward(ctx, *inputs))
    monkeypatch.setattr(eager_fn, "forward", counted)
    runs = []
    for fast in (True, False):
        plan(eager_fast_path=fast)
        with track_launches() as launched:
            y, l1, *counts = _dense_fn(gated)(*leaves)
            grads = torch.autograd.grad((y * dy).sum() + 0.2 * l1, used)
        assert launched == {"relu_mul_stats_kernel": 1, "relu_mul_backward_kernel": 1}, launched
        assert calls == [1]  # the fast path's Function ran once, on the first run only
        runs.append((y, l1, *counts, *grads))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_dense_step_is_deterministic(device):
    leaves = _leaves(48, 16, 96, torch.float16, device, True, seed=17)
    dy = torch.randn(48, 16, device=device, dtype=torch.float16)
    first, second = (_run(leaves, dy, coef=0.1, layout="dense") for _ in range(2))
    for a, b in zip((*first[0], *first[1]), (*second[0], *second[1])):
        assert torch.equal(a, b)
