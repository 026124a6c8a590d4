"""Sparse training of the gated block (:func:`sparsefuse.ffn.hybrid.hybrid_mlp`): gradients against the float64
product-by-product reference, the block step's capacity and what its backward keeps, auto's choice, and the autograd
contexts a training loop uses (compile, checkpointing, autocast). The paper's format: test_hybrid_format.py; the
dense step's fused ops: test_hybrid_dense.py."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_backend
from helpers import HYBRID_NAMES, check_hybrid_step, check_relu_step, hybrid_dense_lowp

from sparsefuse import track_launches
from sparsefuse.ffn.hybrid import hybrid_mlp, hybrid_relu_mlp, hybrid_step_reference, sparsity_stats
from sparsefuse.ffn.synthetic import synthetic_ffn
from sparsefuse.ffn.twell.block import block_plan
from sparsefuse.testing import assert_close_to_reference

NAMES = HYBRID_NAMES


def _leaves(M, K, N, dtype, device, bias, seed=0, dense_rows=(), zero=False):
    """x [M, K] and weights with ~a third of the gate firing; ``dense_rows``: tokens that fire every neuron."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(M, K, generator=g, dtype=torch.float64)
    wg, wu, wd = (torch.randn(*s, generator=g, dtype=torch.float64) / K**0.5 for s in ((N, K), (N, K), (K, N)))
    bg = torch.full((N,), -0.5 if not zero else -1e3, dtype=torch.float64)
    for r in dense_rows:
        x[r] = 0.0
        bg_row = None  # a zero input row fires where the bias is positive: make it fire everywhere via x
        x[r, 0] = 1.0
        wg[:, 0] = 1e3
        del bg_row
    bu, bd = torch.randn(N, generator=g, dtype=torch.float64), torch.randn(K, generator=g, dtype=torch.float64)
    tensors = [x, wg, wu, wd] + ([bg, bu, bd] if bias else [None, None, None])
    return [t.to(device=device, dtype=dtype).requires_grad_() if t is not None else None for t in tensors]


def _run(leaves, dy, coef, **kw):
    x, wg, wu, wd, bg, bu, bd = leaves
    out = hybrid_mlp(x, wg, wu, wd, b_gate=bg, b_up=bu, b_down=bd, **kw)
    grads = torch.autograd.grad(
        (out.y * dy).sum() + coef * out.l1, [t for t in leaves if t is not None], allow_unused=False
    )
    return out, grads


_check, _dense_lowp = check_hybrid_step, hybrid_dense_lowp


BLOCK_KERNELS = (
    "block_sddmm_kernel",
    "block_ell_matmul_kernel",
    "block_ell_sddmm_kernel",
    "block_csc_kernel",
    "transposed_matmul_kernel",
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["block", "hybrid", "dense"])
def test_step_matches_the_float64_reference_with_the_kernels(layout, dtype, bias, device):
    leaves = _leaves(40, 32, 80, dtype, device, bias, seed=1)
    assert_backend(leaves[0])
    dy = torch.randn(40, 32, dtype=dtype, device=device)
    with track_launches() as launched:
        out, grads = _run(leaves, dy, coef=0.3, layout=layout, width=8, backup_rows=1)
    if layout == "hybrid":
        assert launched["bits_to_sparse_kernel"] >= 1 and launched["gather_accumulate_kernel"] == 3, launched
    elif layout == "dense":  # cuBLAS products; relu, the product, L1 and counts in one pass, their backward in one
        assert launched == {"relu_mul_stats_kernel": 1, "relu_mul_backward_kernel": 1}, launched
    else:  # forward: up on the unions (+ statistics), down; backward: dh + chain rule, dx, transpose, weight grads
        assert all(launched[k] >= 1 for k in BLOCK_KERNELS), launched
        assert launched["block_ell_matmul_kernel"] == 3 and launched["transposed_matmul_kernel"] == 1, launched
        # the row blocks' launch order is found once, in the forward, and kept for the backward's products; the
        # weight gradients order their column groups once more
        several_blocks = 40 > block_plan(80).block_rows
        assert launched["heavy_first_schedule_kernel"] == several_blocks + 1, launched
    _check(leaves, dy, 0.3, out, grads)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("down", ["row", "column"])
@pytest.mark.parametrize("layout", ["block", "hybrid"])
def test_the_down_weights_gradient_comes_in_its_layout(layout, down, gated, device):
    """w_down [K, N] row-major (nn.Linear's, FSDP2's) or column-major (what inference prefers): the step's gradient
    for it comes out in its own layout, as the kernels wrote it (so no transposing copy on its way to ``.grad``) and
    as the ops' fake implementations say (a stride the fake does not promise fails inductor's checks under
    torch.compile), and equal to the float64 reference."""
    if layout == "hybrid" and not gated:
        pytest.skip("the paper's format is for the gated block only")
    leaves = _leaves(40, 16, 80, torch.float32, device, False, seed=12)
    if down == "column":
        leaves[3] = leaves[3].detach().t().contiguous().t().requires_grad_()
    x, wg, wu, wd = leaves[:4]
    dy = torch.randn(40, 16, device=device)
    if gated:
        out, grads = _run(leaves, dy, coef=0.3, layout=layout, width=8, backup_rows=1)
        _check(leaves, dy, 0.3, out, grads)
    else:
        out = hybrid_relu_mlp(x, wg, wd, layout=layout)
        grads = torch.autograd.grad((out.y * dy).sum() + 0.3 * out.l1, (x, wg, wd))
        check_relu_step([x, wg, wd, None, None], dy, 0.3, out, grads)
    assert grads[-1].stride() == wd.stride(), (grads[-1].stride(), wd.stride())


@pytest.mark.parametrize(
    "M, N, dense_rows, zero",
    [
        (16, 300, (3,), False),  # a token firing all 300 neurons; N not a multiple of the tile
        (70, 64, (0, 1, 2, 69), False),  # several all-dense tokens; M past a whole number of blocks, sorted rows
        (12, 64, (), True),  # an all-zero batch: no neuron fires
        (0, 64, (), False),  # an empty batch
        (1, 20, (), False),  # one token
    ],
)
def test_block_layout_edge_cases_are_exact(M, N, dense_rows, zero, device):
    leaves = _leaves(M, 16, N, torch.float32, device, True, seed=2, dense_rows=dense_rows, zero=zero)
    dy = torch.randn(M, 16, device=device)
    out, grads = _run(leaves, dy, coef=0.5, layout="block")
    _check(leaves, dy, 0.5, out, grads)
    counts = out.token_counts.cpu()
    assert counts.shape == (M,)
    assert all(int(counts[r]) == N for r in dense_rows)
    if zero:
        assert int(counts.sum()) == 0 and float(out.l1.detach()) == 0.0


@pytest.mark.parametrize("which", ["y", "l1"])
def test_block_step_with_only_one_output_in_the_loss(which, device):
    """The backward gets no gradient for an output the loss does not use (none is materialised): y alone, or the
    L1 term alone, still gives the reference's gradients."""
    leaves = _leaves(24, 16, 48, torch.float32, device, False, seed=5)
    dy = torch.randn(24, 16, device=device) if which == "y" else torch.zeros(24, 16, device=device)
    coef = 0.0 if which == "y" else 0.7
    out = hybrid_mlp(*leaves[:4], layout="block")
    loss = (out.y * dy).sum() if which == "y" else coef * out.l1
    grads = torch.autograd.grad(loss, leaves[:4])
    _check(leaves, dy, coef, out, grads)


@pytest.mark.parametrize("capacity", [0, 700, None])
def test_block_step_recomputes_blocks_past_the_kept_capacity(capacity, device):
    """block_capacity bounds what the forward keeps; blocks past it (all at 0, some at 700 pairs) are recomputed in
    the backward from x and the weights (biases included) and counted, and the gradients stay the reference's."""
    from sparsefuse.sparse.block_pack import spilled_blocks

    leaves = _leaves(70, 16, 96, torch.float32, device, True, seed=6, dense_rows=(5,))
    dy = torch.randn(70, 16, device=device)
    before = int(spilled_blocks(device))
    with track_launches() as launched:
        out, grads = _run(leaves, dy, coef=0.4, layout="block", block_capacity=capacity)
    assert launched["block_pack_kernel"] == 1 and launched["block_unpack_kernel"] == 1, launched
    _check(leaves, dy, 0.4, out, grads)
    spilled = int(spilled_blocks(device)) - before
    assert (spilled == 0) if capacity is None else (spilled >= 1), spilled


def test_block_step_keeps_only_the_fired_pairs(device, monkeypatch, plan):
    """After one observed step, the block step keeps the gate and up values where the gate fired, to 1.25x the
    non-zeros seen (no [M, width] array): here under a twentieth of what the dense block keeps (mostly the unions'
    column lists), with no block spilled."""
    from sparsefuse.sparse.block_pack import spilled_blocks

    plan(hybrid_mlp={"capacity_quantum": 64})  # the default rounds small layers up to all of it
    # compiled blocks are 64 rows (16 interpreted): a wider layer keeps their unions as small a share of it
    N = 512 if device.type == "cpu" else 4096
    ffn = synthetic_ffn(64, N, dtype=torch.float32, device=device, seed=4)
    x = ffn.make_input(128, 6.0).requires_grad_()
    weights = [w.clone().requires_grad_() for w in (ffn.w_gate, ffn.w_up, ffn.w_down)]
    hybrid_mlp(x, *weights, layout="block").y.sum().backward()  # observes the non-zeros (at once on the CPU)
    if x.is_cuda:
        torch.cuda.synchronize()  # the observation has arrived: the next step's capacity reads it
    saved = []

    def pack(t):
        saved.append(t)
        return t

    before = int(spilled_blocks(device))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hybrid_mlp(x, *weights, layout="block").y.sum().backward()
    assert int(spilled_blocks(device)) == before
    inputs = {t.untyped_storage().data_ptr() for t in [x, *weights]}
    activations = sum(t.numel() * t.element_size() for t in saved if t.untyped_storage().data_ptr() not in inputs)
    assert all(t.dim() < 2 or t.shape[0] != 128 for t in saved if t.untyped_storage().data_ptr() not in inputs)
    dense_keeps = 4 * 128 * N * 4
    assert activations < dense_keeps / 20, (activations, dense_keeps)


def _relu_leaves(M, K, N, dtype, device, bias, seed=0):
    x, w, _, wd, bg, _, bd = _leaves(M, K, N, dtype, device, bias, seed=seed)
    return [x, w, wd, bg, bd]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout, capacity", [("block", None), ("block", 0), ("dense", None)])
def test_non_gated_step_matches_the_float64_reference(layout, capacity, dtype, bias, device):
    """relu(x W^T + b) W_d^T + b_d: the block step's kernels without the up product (all groups recomputed at
    capacity 0), and the dense layout, against the float64 reference with W_u absent."""
    x, w, wd, b, bd = leaves = _relu_leaves(70, 32, 80, dtype, device, bias, seed=7)
    dy = torch.randn(70, 32, dtype=dtype, device=device)
    with track_launches() as launched:
        out = hybrid_relu_mlp(x, w, wd, b_up=b, b_down=bd, layout=layout, block_capacity=capacity)
        used = [t for t in leaves if t is not None]
        grads = torch.autograd.grad((out.y * dy).sum() + 0.3 * out.l1, used)
    if layout == "block":
        assert launched["block_sddmm_kernel"] == 1 and launched["transposed_matmul_kernel"] == 1, launched
        assert launched["block_ell_matmul_kernel"] == 2, launched  # down, and dx from one product
    check_relu_step(leaves, dy, 0.3, out, grads)


def test_non_gated_gradcheck_and_bad_layout():
    leaves = [t.requires_grad_() for t in _relu_leaves(6, 5, 12, torch.float64, "cpu", True, seed=3)]

    def step(x, w, wd, b, bd):
        out = hybrid_relu_mlp(x, w, wd, b_up=b, b_down=bd)
        return out.y, out.l1

    assert torch.autograd.gradcheck(step, tuple(leaves), eps=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="layout must be 'auto', 'block' or 'dense'"):
        hybrid_relu_mlp(*leaves[:3], layout="hybrid")


@pytest.mark.parametrize("case", range(12))
def test_block_step_fuzz_over_token_count_distributions(case, device):
    """Seeded random layers and batches: heavy-tailed firing counts (synthetic gates at a random mean and spread),
    some tokens firing every neuron, shapes off every tile, random kept capacities (none, some or all groups
    recomputed). Every case matches the float64 reference: nothing dropped, whatever the distribution."""
    g = torch.Generator().manual_seed(1000 + case)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    K, N, M = pick(4, 24), pick(16, 300), pick(1, 150)
    ffn = synthetic_ffn(K, N, dtype=torch.float32, device=device, seed=case, dead_fraction=0.0,
                        token_spread=0.2 + 0.8 * float(torch.rand(1, generator=g)))  # fmt: skip
    x = ffn.make_input(M, max(1.0, N * float(torch.rand(1, generator=g)) * 0.3), seed=case)
    for r in torch.randint(0, M, (pick(0, 3),), generator=g).tolist():
        x[r, 0] = -1e3  # this token fires every neuron
    capacity = [None, 0, pick(0, M * N)][case % 3]
    leaves = [x.requires_grad_()] + [w.clone().requires_grad_() for w in (ffn.w_gate, ffn.w_up, ffn.w_down)]
    leaves += [None] * 3
    dy = torch.randn(M, K, generator=g).to(device)
    out, grads = _run(leaves, dy, coef=0.3, layout="block", block_capacity=capacity)
    _check(leaves, dy, 0.3, out, grads)
    fired = (F.linear(x.detach().double(), ffn.w_gate.double()) > 0).sum(1)
    assert torch.equal(out.token_counts.cpu().long(), fired.cpu())


@pytest.mark.parametrize("capacity", [0, None])
def test_block_step_with_strided_weights_and_biases(capacity, device):
    """A column-major gate weight and biases at stride 2 (leaves as a user may hold them): the forward and the
    recompute of groups past the capacity read them as they are laid out."""
    ref = _leaves(40, 16, 48, torch.float32, device, True, seed=12)

    def strided(t, strides):
        out = torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device)
        return out.copy_(t.detach()).requires_grad_()

    x, wg, wu, wd, bg, bu, bd = ref
    leaves = [x, strided(wg, (1, wg.shape[0])), wu, wd, strided(bg, (2,)), strided(bu, (2,)), strided(bd, (2,))]
    assert leaves[1].stride(-1) != 1 and leaves[4].stride(0) == 2
    dy = torch.randn(40, 16, device=device)
    out, grads = _run(leaves, dy, coef=0.3, layout="block", block_capacity=capacity)
    _check(leaves, dy, 0.3, out, grads)


def test_block_step_under_checkpointing_keeps_its_capacity(device, monkeypatch, plan):
    """Activation checkpointing re-runs the forward inside the backward: it takes the capacity (and layout) of the
    forward it recomputes, though the estimate moved in between, so the saved tensors keep their shapes."""

    plan(hybrid_mlp={"capacity_quantum": 64})
    leaves = _leaves(64, 16, 80, torch.float32, device, False, seed=13)[:4]
    dy = torch.randn(64, 16, device=device)

    def fn(x, wg, wu, wd):
        o = hybrid_mlp(x, wg, wu, wd, layout="block")
        return o.y, o.l1

    for _ in range(3):  # the first step keeps everything, the next ones the estimate (different shapes)
        y, l1 = torch.utils.checkpoint.checkpoint(fn, *leaves, use_reentrant=False)
        grads = torch.autograd.grad((y * dy).sum() + 0.2 * l1, leaves)
        plain = torch.autograd.grad((fn(*leaves)[0] * dy).sum() + 0.2 * fn(*leaves)[1], leaves)
        for a, b in zip(grads, plain):
            torch.testing.assert_close(a, b)


def test_auto_takes_the_dense_step_once_the_gate_fires_widely(device):
    """~a third of the gate fires here: the first call (no estimate yet) takes the block step, the next ones the
    dense step; a gate weight of its own starts over."""
    leaves = _leaves(32, 16, 64, torch.float32, device, False, seed=11)
    dy = torch.randn(32, 16, device=device)
    runs = []
    for _ in range(3):
        with track_launches() as launched:
            out, grads = _run(leaves, dy, coef=0.2)
        runs.append("dense" if launched["relu_mul_stats_kernel"] else "block")
        _check(leaves, dy, 0.2, out, grads)  # (on a GPU its reads also let the first call's count arrive)
    assert runs == ["block", "dense", "dense"], runs


def test_auto_keeps_its_choice_for_the_callers_gate_weight_under_autocast(device):
    """Under autocast the step runs on cast copies of the weights made anew each call; the layout choice (and the
    capacity) must follow the caller's fp32 gate weight, as outside autocast: block first, then dense."""
    leaves = _leaves(32, 16, 64, torch.float32, device, False, seed=11)
    dy = torch.randn(32, 16, device=device)
    half = torch.float16 if device.type == "cuda" else torch.bfloat16
    runs = []
    for _ in range(3):
        with track_launches() as launched, torch.autocast(device.type, dtype=half):
            _run(leaves, dy, coef=0.2)
        runs.append("dense" if launched["relu_mul_stats_kernel"] else "block")
        if device.type == "cuda":
            torch.cuda.synchronize()  # the first call's count arrives
    assert runs == ["block", "dense", "dense"], runs


def test_block_layout_is_deterministic(device):
    leaves = _leaves(48, 16, 96, torch.float32, device, True, seed=8)
    dy = torch.randn(48, 16, device=device)
    first = _run(leaves, dy, coef=0.1, layout="block")[1]
    second = _run(leaves, dy, coef=0.1, layout="block")[1]
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bias", [False, True])
def test_eager_step_skips_the_dispatcher_with_the_same_results(bias, device, monkeypatch, plan):
    # plain eager calls run the ops' code as an autograd.Function (less host time); the torch.library ops (what
    # torch.compile traces) must give bit-identical outputs and gradients
    from sparsefuse.ffn.hybrid import block_step

    leaves = _leaves(80, 16, 96, torch.float16, device, bias, seed=9)
    dy = torch.randn(80, 16, device=device, dtype=torch.float16)
    forward, calls = block_step._EagerTrainStep.forward, []
    counted = staticmethod(lambda ctx, *inputs: calls.append(1) or forward(ctx, *inputs))
    monkeypatch.setattr(block_step._EagerTrainStep, "forward", counted)
    fast_out, fast = _run(leaves, dy, coef=0.2, layout="block", block_capacity=10**6)
    assert calls == [1]
    plan(eager_fast_path=False)
    op_out, through_op = _run(leaves, dy, coef=0.2, layout="block", block_capacity=10**6)
    assert calls == [1]
    for a, b in zip((*fast_out, *fast), (*op_out, *through_op)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["block", "dense"])
def test_compiled_autograd_over_an_eager_forward(layout, device):
    # the eager step's backward (block or dense), traced by compiled autograd, runs the opaque backward op (Dynamo
    # does not step into the kernels' launchers): the same gradients as a plain backward
    from torch._dynamo import compiled_autograd

    enable = getattr(compiled_autograd, "_enable", None) or compiled_autograd.enable
    leaves = _leaves(48, 16, 96, torch.float32, device, False, seed=10)
    dy = torch.randn(48, 16, device=device)
    grads = []
    capacity = {"block_capacity": 10**6} if layout == "block" else {}
    for compiled in (False, True):
        params = [t.detach().clone().requires_grad_() for t in leaves if t is not None]
        out = hybrid_mlp(*params, layout=layout, **capacity)
        loss = (out.y * dy).sum() + 0.1 * out.l1
        with enable(torch.compile(backend="aot_eager")) if compiled else contextlib.nullcontext():
            loss.backward()
        grads.append([p.grad for p in params])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_compile_checkpoint_and_autocast(device):
    leaves = _leaves(16, 16, 48, torch.float32, device, True, seed=5)
    dy = torch.randn(16, 16, device=device)
    out, grads = _run(leaves, dy, coef=0.2, width=4)

    def fn(*args):
        o = hybrid_mlp(*args[:4], b_gate=args[4], b_up=args[5], b_down=args[6], width=4)
        return o.y, o.l1

    # inductor on the GPU: it checks each op's output strides against its fake's (w_down is row-major here)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    y_c, l1_c = compiled(*leaves)
    grads_c = torch.autograd.grad((y_c * dy).sum() + 0.2 * l1_c, leaves)
    torch.testing.assert_close(y_c, out.y)
    for a, b in zip(grads_c, grads):
        torch.testing.assert_close(a, b)
    y_k, l1_k = torch.utils.checkpoint.checkpoint(fn, *leaves, use_reentrant=False)
    grads_k = torch.autograd.grad((y_k * dy).sum() + 0.2 * l1_k, leaves)
    for a, b in zip(grads_k, grads):
        torch.testing.assert_close(a, b)
    kind = "cuda" if leaves[0].is_cuda else "cpu"
    with torch.autocast(kind, dtype=torch.float16):
        y_a = hybrid_mlp(*leaves[:4], b_gate=leaves[4], b_up=leaves[5], b_down=leaves[6], width=4).y
    assert y_a.dtype == torch.float16
    assert_close_to_reference(y_a, hybrid_step_reference(*leaves[:4], dy, 0.0, *leaves[4:])[0], dtype=torch.float16)


def test_non_gated_block_step_compiles_and_checkpoints(device):
    leaves = _relu_leaves(40, 16, 48, torch.float32, device, True, seed=8)
    dy = torch.randn(40, 16, device=device)

    def fn(x, w, wd, b, bd):
        o = hybrid_relu_mlp(x, w, wd, b_up=b, b_down=bd, layout="block")
        return o.y, o.l1

    def grads_of(y, l1):
        return torch.autograd.grad((y * dy).sum() + 0.2 * l1, leaves)

    eager = grads_of(*fn(*leaves))
    compiled = grads_of(*torch.compile(fn, fullgraph=True, backend="aot_eager")(*leaves))
    checkpointed = grads_of(*torch.utils.checkpoint.checkpoint(fn, *leaves, use_reentrant=False))
    for a, b, c in zip(eager, compiled, checkpointed):
        torch.testing.assert_close(b, a)
        torch.testing.assert_close(c, a)


def test_sparsity_stats_and_bad_arguments(device):
    leaves = _leaves(10, 8, 20, torch.float32, device, False, seed=6)
    out = hybrid_mlp(*leaves[:4], width=4)
    stats = sparsity_stats(out.token_counts, out.neuron_counts)
    fired = F.linear(leaves[0], leaves[1]).detach() > 0
    assert float(stats["mean_nnz"]) == pytest.approx(float(fired.sum(1).float().mean()))
    assert float(stats["max_nnz"]) == float(fired.sum(1).max())
    assert float(stats["dead_fraction"]) == pytest.approx(float((~fired.any(0)).float().mean()))
    with pytest.raises(ValueError, match="width must be a positive int"):
        hybrid_mlp(*leaves[:4], width=0)
    with pytest.raises(ValueError, match="backup_rows must be a non-negative int"):
        hybrid_mlp(*leaves[:4], backup_rows=-2)
    with pytest.raises(TypeError, match="w_up must have x's dtype"):
        hybrid_mlp(leaves[0], leaves[1], leaves[2].double(), leaves[3])


@pytest.mark.parametrize("train_method", ["dense", "hybrid"])
def test_module_trains_with_either_method_and_reports(train_method, device):
    """SparseGatedMLP under autograd: same state_dict keys as LlamaMLP, gradients of the float64 reference, the
    step's L1 term in last_l1 (its gradient reaches the gate) and the firing statistics."""
    from sparsefuse.nn import SparseGatedMLP

    torch.manual_seed(7)
    mlp = SparseGatedMLP(16, 48, bias=True, train_method=train_method, train_width=4, device=device)
    with torch.no_grad():
        mlp.gate_proj.bias.fill_(-0.3)
    assert set(mlp.state_dict()) == {f"{p}_proj.{t}" for p in ("gate", "up", "down") for t in ("weight", "bias")}
    x = torch.randn(2, 9, 16, device=device, requires_grad=True)
    dy = torch.randn(2, 9, 16, device=device)
    y = mlp(x)
    loss = (y * dy).sum() + 0.7 * mlp.last_l1
    loss.backward()
    g, u, d = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    y64, l164, ref = hybrid_step_reference(
        x.reshape(-1, 16), g.weight, u.weight, d.weight, dy.reshape(-1, 16), 0.7, g.bias, u.bias, d.bias
    )
    torch.testing.assert_close(y.reshape(-1, 16).double(), y64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mlp.last_l1.double(), l164, rtol=1e-5, atol=1e-7)
    for got, want in (
        (x.grad.reshape(-1, 16), ref.x),
        (g.weight.grad, ref.w_gate),
        (u.weight.grad, ref.w_up),
        (d.weight.grad, ref.w_down),
        (g.bias.grad, ref.b_gate),
    ):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    report = mlp.sparsity_report()
    fired = (F.linear(x.detach().reshape(-1, 16), g.weight, g.bias) > 0).sum(1).float()
    assert float(report["mean_nnz"]) == pytest.approx(float(fired.mean()))
    with pytest.raises(ValueError, match="train_method must be one of auto, dense, hybrid"):
        SparseGatedMLP(16, 48, train_method="sparse")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "layout, K, N, down",
    [("block", 2048, 5632, "column"), ("block", 1024, 3000, "column"), ("block", 1024, 3000, "row")]
    + [("dense", 2048, 5632, "column")],
)
def test_step_on_the_gpu_is_sync_free_capturable_and_close_to_float64(layout, K, N, down):
    """bf16 at a real layer shape, the block and the dense step: gradients within twice torch's own bf16 error of
    the float64 step (whole-tensor norms), no host sync in forward or backward, and a CUDA-graph replay equal to the
    eager step. ``down="row"``: w_down row-major, its gradient stored by the weight-gradient kernel in that layout
    (N = 3000: a last column group of 8)."""
    from sparsefuse.testing import assert_norm_close_to_reference

    ffn = synthetic_ffn(K, N, dtype=torch.bfloat16, device="cuda", seed=9)
    x = ffn.make_input(2048, 30.0).requires_grad_()
    w_down = ffn.w_down.contiguous() if down == "row" else ffn.w_down
    leaves = [x] + [w.clone().requires_grad_() for w in (ffn.w_gate, ffn.w_up, w_down)] + [None] * 3
    dy = torch.randn(2048, K, device="cuda", dtype=torch.bfloat16)
    coef = torch.tensor(0.5, device="cuda")

    def step():
        out = hybrid_mlp(*leaves[:4], layout=layout)
        grads = torch.autograd.grad((out.y, out.l1), leaves[:4], (dy, coef))
        # y detached: a graph kept alive from an eager step keeps the leaves' gradient accumulators, bound to the
        # stream of that step (the legacy default stream), and the captured backward would sync with it
        return (out.y.detach(), *grads)

    eager = step()  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    y64, _, g64 = hybrid_step_reference(*leaves[:4], dy, 0.5)
    y_lp, _, grads_lp = _dense_lowp(leaves, dy, 0.5)
    assert_norm_close_to_reference(eager[0], y64, y_lp, name="y")
    for name, ours, lp, leaf in zip(NAMES, eager[1:], grads_lp, leaves):
        assert_norm_close_to_reference(ours, getattr(g64, name), lp, name=f"d{name}")
        assert layout == "dense" or ours.stride() == leaf.stride(), (name, ours.stride(), leaf.stride())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream before capture, as torch.cuda.graphs asks
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    again = step()
    for a, b in zip(captured, again):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_non_gated_block_step_on_the_gpu_is_close_to_float64():
    """bf16 at the 1.5B layer's shape: the non-gated step's gradients within twice torch's own bf16 error."""
    from sparsefuse.testing import assert_norm_close_to_reference

    ffn = synthetic_ffn(2048, 5632, dtype=torch.bfloat16, device="cuda", seed=10)
    x = ffn.make_input(2048, 30.0).requires_grad_()
    w, wd = (t.clone().requires_grad_() for t in (ffn.w_gate, ffn.w_down))
    dy = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    out = hybrid_relu_mlp(x, w, wd, layout="block")
    grads = torch.autograd.grad((out.y, out.l1), (x, w, wd), (dy, torch.tensor(0.5, device="cuda")))
    y64, _, g64 = hybrid_step_reference(x, w, None, wd, dy, 0.5)
    lowp = [t.detach().clone().requires_grad_() for t in (x, w, wd)]
    h = torch.relu(F.linear(lowp[0], lowp[1]))
    y_lp = F.linear(h, lowp[2])
    grads_lp = torch.autograd.grad((y_lp * dy).sum() + 0.5 * h.float().sum() / h.numel(), lowp)
    assert_norm_close_to_reference(out.y, y64, y_lp, name="y")
    for name, ours, lp, ref in zip(("x", "w", "w_down"), grads, grads_lp, (g64.x, g64.w_gate, g64.w_down)):
        assert_norm_close_to_reference(ours, ref, lp, name=f"d{name}")
