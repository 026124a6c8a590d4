"""The block step replayed from captured graphs (``hybrid_mlp(..., cuda_graph=True)``,
:mod:`sparsefuse.ffn.hybrid.graphed`). Under the interpreter a "graph" re-runs its captured function, so these
tests cover the copy-in / copy-out logic, the keys and the autograd rule; the CUDA capture is in the GPU test."""

import warnings

import pytest
import torch
import torch.utils.checkpoint
from conftest import assert_backend
from test_hybrid_train import _check, _leaves, _relu_leaves

from sparsefuse._plan.config import current
from sparsefuse.ffn.hybrid import graphed, hybrid_mlp, hybrid_relu_mlp

M, K, N = 40, 32, 80


@pytest.fixture(autouse=True)
def _fresh_graphs():
    graphed.release_graphs()
    yield
    graphed.release_graphs()


def _grads(leaves, dy, coef, **kw):
    x, wg, wu, wd, bg, bu, bd = leaves
    out = hybrid_mlp(x, wg, wu, wd, b_gate=bg, b_up=bu, b_down=bd, layout="block", **kw)
    grads = torch.autograd.grad((out.y * dy).sum() + coef * out.l1, [t for t in leaves if t is not None])
    return out, grads


def _events():
    return dict(graphed.GRAPH_EVENTS)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_replayed_step_matches_the_float64_reference_and_the_eager_step(bias, dtype, device):
    leaves = _leaves(M, K, N, dtype, device, bias, seed=3)
    assert_backend(leaves[0])
    dy = torch.randn(M, K, dtype=dtype, device=device)
    before = _events()
    _grads(leaves, dy, 0.3, cuda_graph=True)  # no observation of the gate yet: the eager step
    assert _events() == before
    eager_out, eager_grads = _grads(leaves, dy, 0.3)
    out, grads = _grads(leaves, dy, 0.3, cuda_graph=True)
    assert graphed.GRAPH_EVENTS["capture"] == before.get("capture", 0) + 1
    assert graphed.GRAPH_EVENTS["replay"] == before.get("replay", 0) + 1
    _check(leaves, dy, 0.3, out, grads)
    # the same kernels on the same operands: equal to the eager step's results (its capacity may differ, and a
    # block past it is recomputed to the forward's rounding: the same values)
    assert torch.equal(out.y, eager_out.y) and torch.equal(out.l1, eager_out.l1)
    assert torch.equal(out.token_counts, eager_out.token_counts)
    assert torch.equal(out.neuron_counts, eager_out.neuron_counts)
    for ours, theirs, leaf in zip(grads, eager_grads, [t for t in leaves if t is not None]):
        assert torch.equal(ours, theirs)
        assert ours.stride() == leaf.stride()  # w_down's (row-major here) too: no copy into its layout after


def test_interleaved_forwards_and_accumulated_gradients(device):
    """Two micro-batches' forwards before either backward (what a pipeline or a kept graph does), then the
    gradients accumulated into .grad over both: each backward uses its own forward's kept pairs, and a replay
    never overwrites a gradient handed out earlier."""
    leaves = _leaves(M, K, N, torch.float32, device, True, seed=4)
    params = [t for t in leaves[1:] if t is not None]
    xs = [torch.randn(M, K, device=device).requires_grad_() for _ in range(2)]
    dys = [torch.randn(M, K, device=device) for _ in range(2)]
    _grads([xs[0], *leaves[1:]], dys[0], 0.2)  # an observation for the bucketed capacity

    def forward(x, **kw):
        wg, wu, wd, bg, bu, bd = leaves[1:]
        return hybrid_mlp(x, wg, wu, wd, b_gate=bg, b_up=bu, b_down=bd, layout="block", **kw)

    expected = []
    for x, dy in zip(xs, dys):
        out = forward(x)
        expected.append(torch.autograd.grad((out.y * dy).sum() + 0.2 * out.l1, [x, *params]))
    outs = [forward(x, cuda_graph=True) for x in xs]
    assert graphed.GRAPH_EVENTS["replay"] >= 2
    for out, dy in zip(reversed(outs), reversed(dys)):  # backwards in the other order
        ((out.y * dy).sum() + 0.2 * out.l1).backward()
    for x, want in zip(xs, expected):
        torch.testing.assert_close(x.grad, want[0], rtol=1e-5, atol=1e-6)
    for i, p in enumerate(params):
        torch.testing.assert_close(p.grad, expected[0][i + 1] + expected[1][i + 1], rtol=1e-5, atol=1e-6)


def test_new_shapes_and_moved_weights_capture_anew_and_old_captures_are_dropped(device, plan):
    plan(hybrid_mlp={"graphs_per_weight": 2})
    leaves = _leaves(M, K, N, torch.float32, device, False, seed=5)
    dy = torch.randn(M, K, device=device)
    _grads(leaves, dy, 0.0)
    captures = lambda: graphed.GRAPH_EVENTS["capture"]  # noqa: E731
    start = captures()
    _grads(leaves, dy, 0.0, cuda_graph=True)
    _grads(leaves, dy, 0.0, cuda_graph=True)
    assert captures() == start + 1  # replayed the second time
    with torch.no_grad():  # an optimizer's in-place update: the same capture sees the new values
        leaves[2].mul_(0.5)
    out, grads = _grads(leaves, dy, 0.0, cuda_graph=True)
    assert captures() == start + 1
    _check(leaves, dy, 0.0, out, grads)
    moved = [leaves[0], leaves[1], leaves[2].detach().clone().requires_grad_(), *leaves[3:]]
    _grads(moved, dy, 0.0, cuda_graph=True)
    assert captures() == start + 2
    short = [leaves[0][: M // 2].detach().requires_grad_(), *moved[1:]]
    out, grads = _grads(short, dy[: M // 2], 0.0, cuda_graph=True)
    assert captures() == start + 3
    _check(short, dy[: M // 2], 0.0, out, grads)
    assert len(graphed._LAYERS[leaves[1]].steps) == 2


def test_a_layer_captured_too_often_runs_eagerly(device, plan):
    """A new token count every step (ragged batches): after the capture limit the eager step runs, with one
    warning, and its results stay right."""
    plan(hybrid_mlp={"capture_limit": 2})
    leaves = _leaves(M, K, N, torch.float32, device, False, seed=8)
    dy = torch.randn(M, K, device=device)
    _grads(leaves, dy, 0.0)
    for i in range(4):
        rows = M - 2 * (i + 1)
        ragged = [leaves[0][:rows].detach().requires_grad_(), *leaves[1:]]
        if i == 2:
            with pytest.warns(UserWarning, match="captured 2 times"):
                out, grads = _grads(ragged, dy[:rows], 0.0, cuda_graph=True)
        else:
            out, grads = _grads(ragged, dy[:rows], 0.0, cuda_graph=True)
        _check(ragged, dy[:rows], 0.0, out, grads)
    assert graphed.GRAPH_EVENTS["capture"] >= 2 and graphed._LAYERS[leaves[1]].captures == 3


def test_weights_regathered_every_step_replay_copies(device):
    """Weights at a new address every step, as FSDP2 gathers them into fresh storage: one move is captured anew (a
    model moved once), the next one warns and the layer is captured once more reading copies of its weights, which
    every later step replays (filled from wherever the weights are), with right results."""
    leaves = _leaves(M, K, N, torch.float32, device, False, seed=9)
    dy = torch.randn(M, K, device=device)
    _grads(leaves, dy, 0.0)  # the first observation of the gate's firing: eager
    captures = lambda: graphed.GRAPH_EVENTS["capture"]  # noqa: E731
    start, copied = captures(), graphed.GRAPH_EVENTS["copied replay"]
    kept = []  # alive, so that no copy takes a freed one's address
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(4):
            # w_up at a new address, and of other values each step: a replay must read this step's copy
            moved = [leaves[0], leaves[1], (leaves[2].detach() * (1 + i / 4)).requires_grad_(), *leaves[3:]]
            kept.append(moved)
            out, grads = _grads(moved, dy, 0.0, cuda_graph=True)
            _check(moved, dy, 0.0, out, grads)
            # the first weights' capture, the one move's, then the copied weights' for good
            assert captures() == start + min(i + 1, 3)
            assert graphed.GRAPH_EVENTS["copied replay"] == copied + max(0, i - 1)
    moves = [w for w in caught if "new address 2 times" in str(w.message)]
    assert len(moves) == 1 and moves[0].filename == __file__  # once, pointing at the caller's line
    # the in-place captures are freed; one capture, of the copied weights, is kept
    assert [key[2] for key in graphed._LAYERS[leaves[1]].steps] == [graphed._COPIED]
    # the row-major w_down is copied in column-major (the copy-in transposes it: the graphs do not), and its
    # gradient still comes in its own layout
    (step,) = graphed._LAYERS[leaves[1]].steps.values()
    assert leaves[3].is_contiguous() and step.copies.tensors[4].t().is_contiguous()
    assert grads[3].stride() == leaves[3].stride()
    out, grads = _grads(kept[0], dy, 0.0, cuda_graph=True)  # weights seen before: still copied, same capture
    _check(kept[0], dy, 0.0, out, grads)
    assert captures() == start + 3 and graphed.GRAPH_EVENTS["copied replay"] == copied + 3


def _moved_until_copied(leaves, dy, kept):
    """Steps of a layer with its w_up moved each time (other values too) until its replays read copied weights."""
    _grads(leaves, dy, 0.0)  # the gate's first observation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the first addresses, move_limit moves captured in place, one more
        for i in range(current().knobs("hybrid_mlp").move_limit + 2):
            kept.append([leaves[0], leaves[1], (leaves[2].detach() * (2 - i / 4)).requires_grad_(), *leaves[3:]])
            _grads(kept[-1], dy, 0.0, cuda_graph=True)
    assert [key[2] for key in graphed._LAYERS[leaves[1]].steps] == [graphed._COPIED]


def test_two_layers_share_the_weight_copies_and_each_replay_fills_them(device, plan):
    """Two layers of one shape replaying copied weights share the static copies: forwards of both, then one
    backward through both (the second layer's backward first): each forward and each backward fills the copies with
    its own layer's weights, so the gradients are the eager steps'."""
    plan(hybrid_mlp={"move_limit": 0})  # copied from the first move on: one capture fewer per layer
    dy = torch.randn(M, K, device=device)
    kept, layers = [], []
    for seed in (11, 12):
        leaves = _leaves(M, K, N, torch.float32, device, True, seed=seed)
        _moved_until_copied(leaves, dy, kept)
        layers.append(kept[-1])
    # one shared set of copies for both layers (the weights in the step's order: w_gate, b_gate, w_up, b_up, ...)
    shared = [next(iter(graphed._LAYERS[layer[1]].steps.values())).copies for layer in layers]
    _x, wg, wu, wd, bg, bu, bd = layers[0]
    assert shared[0] is shared[1] is graphed._weight_copies((wg, bg, wu, bu, wd, bd))

    def chain(**kw):
        h = layers[0][0]
        outs = []
        for _x, wg, wu, wd, bg, bu, bd in layers:
            outs.append(hybrid_mlp(h, wg, wu, wd, b_gate=bg, b_up=bu, b_down=bd, layout="block", **kw))
            h = outs[-1].y
        leaves = [layers[0][0], *(t for layer in layers for t in layer[1:] if t is not None)]
        return torch.autograd.grad((h * dy).sum() + 0.2 * sum(o.l1 for o in outs), leaves)

    copied = graphed.GRAPH_EVENTS["copied replay"]
    got = chain(cuda_graph=True)
    assert graphed.GRAPH_EVENTS["copied replay"] == copied + 2
    for ours, theirs in zip(got, chain()):
        assert torch.equal(ours, theirs)


def test_a_layers_captures_go_with_its_weights(device):
    """The captures are kept per gate weight, weakly: a layer whose weights are gone leaves nothing behind."""
    import gc

    leaves = _leaves(M, K, N, torch.float32, device, False, seed=10)
    dy = torch.randn(M, K, device=device)
    for kw in ({}, {"cuda_graph": True}, {"cuda_graph": True}):
        out, grads = _grads(leaves, dy, 0.0, **kw)
    assert graphed.GRAPH_EVENTS["capture"] >= 1 and len(graphed._LAYERS) == 1
    del leaves, out, grads
    gc.collect()
    assert len(graphed._LAYERS) == 0


def test_no_grad_and_checkpointing(device):
    """Without grad, and under activation checkpointing (whose recompute must save what its forward saved), the
    eager step runs: no replay, the eager step's gradients."""
    leaves = _leaves(M, K, N, torch.float32, device, False, seed=6)
    x, wg, wu, wd = leaves[:4]
    with torch.no_grad():
        hybrid_mlp(x, wg, wu, wd, layout="block", cuda_graph=True)
    assert graphed._LAYERS.get(wg) is None
    _grads(leaves, torch.randn(M, K, device=device), 0.0)  # observed from here on

    def block(x):
        return hybrid_mlp(x, wg, wu, wd, layout="block", cuda_graph=True).y

    want = torch.autograd.grad(hybrid_mlp(x, wg, wu, wd, layout="block").y.sum(), [x, wg, wu, wd])
    for reentrant in (False, True):
        replays = graphed.GRAPH_EVENTS["replay"]
        for t in (x, wg, wu, wd):
            t.grad = None
        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant).sum().backward()
        assert graphed.GRAPH_EVENTS["replay"] == replays
        for a, b in zip([t.grad for t in (x, wg, wu, wd)], want):
            assert torch.equal(a, b)


def test_weights_moved_or_changed_between_forward_and_backward(device):
    """A weight regathered at another address before the backward (as sharded parameters can be): the backward runs
    eagerly on the kept arrays, with the same gradients. A weight changed in place in between: the error the eager
    step raises."""
    leaves = _leaves(M, K, N, torch.float32, device, True, seed=9)
    dy = torch.randn(M, K, device=device)
    _grads(leaves, dy, 0.2)
    want = _grads(leaves, dy, 0.2)[1]
    x, wg, wu, wd, bg, bu, bd = leaves
    out = hybrid_mlp(x, wg, wu, wd, b_gate=bg, b_up=bu, b_down=bd, layout="block", cuda_graph=True)
    assert graphed.GRAPH_EVENTS["replay"] >= 1
    eager_backwards = graphed.GRAPH_EVENTS["eager backward"]
    moved = wu.data.clone()
    wu.data = moved  # same values, another address
    got = torch.autograd.grad((out.y * dy).sum() + 0.2 * out.l1, leaves)
    assert graphed.GRAPH_EVENTS["eager backward"] == eager_backwards + 1
    for a, b, leaf in zip(got, want, leaves):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert a.stride() == leaf.stride()  # the row-major w_down's gradient in its layout there too
    out = hybrid_mlp(x, wg, wu, wd, b_gate=bg, b_up=bu, b_down=bd, layout="block", cuda_graph=True)
    with torch.no_grad():
        wd.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out.y.sum(), leaves)


def test_non_gated_block_and_an_l1_only_loss(device):
    leaves = _relu_leaves(M, K, N, torch.float32, device, True, seed=7)
    x, wu, wd, bu, bd = leaves
    hybrid_relu_mlp(x, wu, wd, b_up=bu, b_down=bd, layout="block")  # observed
    eager = hybrid_relu_mlp(x, wu, wd, b_up=bu, b_down=bd, layout="block")
    want = torch.autograd.grad(eager.y.sum() + eager.l1, leaves)
    out = hybrid_relu_mlp(x, wu, wd, b_up=bu, b_down=bd, layout="block", cuda_graph=True)
    assert graphed.GRAPH_EVENTS["replay"] >= 1
    got = torch.autograd.grad(out.y.sum() + out.l1, leaves)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    only_l1 = torch.autograd.grad(
        hybrid_relu_mlp(x, wu, wd, b_up=bu, b_down=bd, layout="block", cuda_graph=True).l1, [x, wu]
    )
    want_l1 = torch.autograd.grad(hybrid_relu_mlp(x, wu, wd, b_up=bu, b_down=bd, layout="block").l1, [x, wu])
    for a, b in zip(only_l1, want_l1):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True])
def test_cuda_graph_step_on_the_gpu_equals_the_eager_step(autocast):
    """bf16 at a real layer shape, and fp32 weights under bf16 autocast: the replayed step gives the eager step's
    results, and replays launch nothing from Python. Under autocast the replay writes the fp32 weights' gradients
    in fp32 where the eager step rounds them to bf16 before autograd's cast: rounded, they are the eager ones."""
    from sparsefuse import track_launches
    from sparsefuse.ffn.synthetic import synthetic_ffn

    dtype = torch.float32 if autocast else torch.bfloat16
    ffn = synthetic_ffn(1024, 3000, dtype=dtype, device="cuda", seed=2)
    leaves = [ffn.make_input(2048, 30.0).requires_grad_()]
    leaves += [w.clone().requires_grad_() for w in (ffn.w_gate, ffn.w_up, ffn.w_down)]
    dy = torch.randn(2048, 1024, device="cuda")

    def step(**kw):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = hybrid_mlp(*leaves, layout="block", **kw)
        grads = torch.autograd.grad((out.y.float() * dy).sum() + 0.5 * out.l1, leaves)
        return (out.y.detach(), out.l1.detach(), *grads)

    step(cuda_graph=False)  # observed
    want = step(cuda_graph=False)
    step(cuda_graph=True)  # captured
    with track_launches() as launched:
        got = step(cuda_graph=True)
    assert graphed.GRAPH_EVENTS["replay"] >= 2
    assert not any(k.endswith("_kernel") for k in launched), launched
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        if autocast and i >= 3:  # the three weight gradients
            a = a.to(torch.bfloat16).to(a.dtype)
        assert torch.equal(a, b)


def test_the_default_replays_by_layer_size_and_falls_back_quietly(device, monkeypatch, plan):
    """cuda_graph=None replays plain eager CUDA calls of layers whose gate product is at most the knob
    replay_max_gate_flop (the 1.5B layer, not the 8B one) and never CPU tensors; where it replays it gives the eager
    step's results, falls back to the eager step past the capture limit without the warning an explicit
    cuda_graph=True gets, and leaves a given block_capacity to the eager step."""
    from sparsefuse import planning
    from sparsefuse.ffn.hybrid.choice import TrainKnobs
    from sparsefuse.sparse.block_pack import spilled_blocks

    def on_gpu(rows, features):  # priced as a plain eager CUDA call below
        return torch.empty(rows, features, device="meta")

    with planning(context="eager", hybrid_mlp={"replay_max_gate_flop": TrainKnobs().replay_max_gate_flop}):
        assert graphed.replays_by_default(on_gpu(8192, 2048), 5632)
        assert graphed.replays_by_default(on_gpu(16384, 2048), 5632)
        assert not graphed.replays_by_default(on_gpu(8192, 4096), 14336)
        with planning(context=None):
            assert not graphed.replays_by_default(torch.empty(8, 8), 8)  # a CPU tensor
        with monkeypatch.context() as traced:  # a call torch.compile traces: the eager step's op, whatever the size
            traced.setattr(torch.compiler, "is_compiling", lambda: True)
            assert not graphed.replays_by_default(on_gpu(8192, 2048), 5632)

    # every layer replays, on the CPU too, as a GPU's small layer would
    plan(hybrid_mlp={"capture_limit": 1})
    with planning(context="eager", hybrid_mlp={"replay_max_gate_flop": float("inf")}):
        leaves = _leaves(M, K, N, torch.float32, device, False, seed=9)
        dy = torch.randn(M, K, device=device)
        _grads(leaves, dy, 0.0)  # observed (the eager step)
        before = _events()
        out, grads = _grads(leaves, dy, 0.0)  # captured and replayed
        assert graphed.GRAPH_EVENTS["replay"] == before.get("replay", 0) + 1
        _check(leaves, dy, 0.0, out, grads)
        ragged = [leaves[0][: M - 2].detach().requires_grad_(), *leaves[1:]]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a new shape past the limit: the eager step, quietly
            out, grads = _grads(ragged, dy[: M - 2], 0.0)
        _check(ragged, dy[: M - 2], 0.0, out, grads)
        assert graphed.GRAPH_EVENTS["replay"] == before.get("replay", 0) + 1
        spilled = int(spilled_blocks(device))
        out, grads = _grads(leaves, dy, 0.0, block_capacity=0)  # the eager step, every block recomputed
        assert int(spilled_blocks(device)) > spilled and graphed.GRAPH_EVENTS["replay"] == before.get("replay", 0) + 1
        _check(leaves, dy, 0.0, out, grads)


@pytest.mark.gpu
def test_the_default_replays_a_15b_layer_on_the_gpu_as_the_eager_step():
    """The default call (cuda_graph=None, the library's own choice, not the tests' pin) at the 1.5B layer shape and
    8192 tokens: it captures once it has observed the layer, then replays, and gives the eager step's results."""
    from sparsefuse import planning
    from sparsefuse.ffn.hybrid.choice import TrainKnobs

    with planning(hybrid_mlp={"replay_max_gate_flop": TrainKnobs().replay_max_gate_flop}):
        _default_replays_a_15b_layer()


def _default_replays_a_15b_layer():
    from sparsefuse.ffn.synthetic import synthetic_ffn

    ffn = synthetic_ffn(2048, 5632, dtype=torch.bfloat16, device="cuda", seed=4)
    leaves = [ffn.make_input(8192, 30.0).requires_grad_()]
    leaves += [w.clone().requires_grad_() for w in (ffn.w_gate, ffn.w_up, ffn.w_down)]
    dy = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    assert graphed.replays_by_default(leaves[0], 5632)

    def step(**kw):
        out = hybrid_mlp(*leaves, **kw)
        grads = torch.autograd.grad((out.y, out.l1), leaves, (dy, torch.tensor(2e-5, device="cuda")))
        return (out.y.detach(), out.l1.detach(), *grads)

    want = step(cuda_graph=False)
    before = graphed.GRAPH_EVENTS["replay"]
    for _ in range(3):  # observed, captured, replayed
        got = step()
    assert graphed.GRAPH_EVENTS["replay"] > before
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.gpu
def test_captures_after_every_earlier_graph_is_gone():
    """A layer freed (its graphs with it) and another captured after: a new pool, not the emptied one."""
    import gc

    dy = torch.randn(256, 64, device="cuda")
    for seed in range(3):
        leaves = _leaves(256, 64, 512, torch.float16, "cuda", False, seed=seed)
        for kw in ({}, {"cuda_graph": True}, {"cuda_graph": True}):
            out, grads = _grads(leaves, dy.half(), 0.1, **kw)
        _check(leaves, dy.half(), 0.1, out, grads)
        del leaves, out, grads
        gc.collect()
    assert graphed.GRAPH_EVENTS["capture"] >= 3


def test_the_captured_capacity_grows_at_once_and_shrinks_only_by_a_factor_of_four(plan):
    from sparsefuse.ffn.hybrid.choice import TRAIN_CHOICE

    plan(hybrid_mlp={"capacity_margin": 1.0, "observe_every": 1})
    w = torch.zeros(1000, 4)
    seen = []
    for need in (10.0, 11.0, 14.0, 30.0, 12.0, 5.0, 3.0, 1000.0):  # each step's firing per token, observed
        TRAIN_CHOICE.observe(w, torch.full((8,), need, dtype=torch.int32))
        seen.append(TRAIN_CHOICE.bucketed_capacity(w, 8) // 8)
    # 10 -> 16, held through 11 and 14; 30 -> 32, held at 12; 5 is under a quarter of 32: 8, held at 3; then capped
    # at every pair (M N)
    assert seen == [16, 16, 16, 32, 32, 8, 8, 1000]
