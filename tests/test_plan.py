"""The planner (sparsefuse/_plan): explain, the knobs in one config object, the estimate ladder and the rule per
execution context -- above all that a graph compiled before any eager call decides when it runs, from the
weight's own estimate, not from a prior frozen at trace time."""

import pytest
import torch
from helpers import sparse_rows

import sparsefuse
from sparsefuse import planning, track_launches
from sparsefuse._plan import config as plan_config
from sparsefuse.ffn.twell import auto as twell_auto
from sparsefuse.sae.decode import auto as decode_auto

TWELL_KERNELS = ("twell_gate_fwd_kernel", "twell_up_down_fwd_kernel")


def _mlp(device, K=24, N=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w_gate, w_up = (torch.randn(N, K, generator=g).to(device) for _ in range(2))
    w_down = sparsefuse.ffn.twell_down_layout(torch.randn(K, N, generator=g).to(device))
    return w_gate, w_up, w_down


def _twell_iff_sparse(question, estimate):
    """A cost model of the test's own: twell while fewer than 10 gate neurons fire per token, else dense."""
    return {"twell": 1e-6 if estimate < 10 else 1.0, "block": 2.0, "dense": 1e-3}


def test_explain_reports_the_pick_its_estimate_and_every_method(device):
    w_gate, w_up, w_down = _mlp(device)
    x = torch.randn(5, 24, device=device)
    why = sparsefuse.explain(sparsefuse.twell_mlp, x, w_gate, w_up, w_down)
    assert why.op == "twell_mlp" and why.source == "observed" and why.method in why.priced
    fired = (x @ w_gate.t() > 0).sum().item() / 5
    assert why.estimate == pytest.approx(fired, abs=0.05)
    assert set(why.predicted) == {"twell", "dense"}  # block needs 1024 tokens
    assert why.method == min(why.priced, key=why.priced.get) or why.reason.startswith("no method")
    assert "twell_mlp" in str(why) and "dense" in str(why)
    given = sparsefuse.explain(sparsefuse.twell_mlp, x, w_gate, w_up, w_down, expected_nnz=2.0)
    assert given.source == "given" and given.estimate == 2.0
    explicit = sparsefuse.explain(sparsefuse.twell_mlp, x, w_gate, w_up, w_down, method="block")
    assert (explicit.method, explicit.source) == ("block", "explicit")
    with torch.enable_grad():
        trained = sparsefuse.explain(sparsefuse.twell_mlp, x.requires_grad_(), w_gate, w_up, w_down)
    assert (trained.method, trained.source) == ("dense", "autograd")


def test_explain_stops_the_call_before_any_kernel_and_explains_rules(device):
    acts = sparse_rows(4, 600, [3, 5, 0, 7], device=device)
    w = torch.randn(600, 16, device=device)
    with track_launches() as launched:
        why = sparsefuse.explain(sparsefuse.sparse_decode, acts, w)
    assert not launched
    assert (why.method, why.source) == ("dense", "rule") and "4096" in why.reason  # a small dictionary
    snake = sparsefuse.explain(sparsefuse.snake, torch.randn(1, 2, 8, device=device), torch.ones(2, device=device))
    assert snake.method == "" and "nothing" in snake.reason


def test_explain_goes_through_a_module(device):
    mlp = sparsefuse.nn.SparseGatedMLP(24, 64).to(device).eval()
    x = torch.randn(3, 24, device=device)
    with torch.no_grad():
        why = sparsefuse.explain(mlp, x)
    assert why.op == "twell_mlp" and why.method in ("twell", "dense") and why.source == "observed"
    trained = sparsefuse.explain(mlp, x)  # the parameters want gradients: the training forward, dense until counted
    assert (trained.op, trained.method, trained.source) == ("hybrid_mlp", "dense", "prior"), trained
    mlp.configure(train_method="dense")
    assert sparsefuse.explain(mlp, x).source == "explicit"


def test_planning_changes_knobs_for_a_block_only_and_names_what_exists():
    before = plan_config.current()
    with planning(twell_mlp={"margin": 0.5}, context="eager") as config:
        assert config.knobs("twell_mlp").margin == 0.5 and config.context == "eager"
        assert twell_auto.PLANNER.knobs.margin == 0.5
    assert twell_auto.PLANNER.knobs.margin == before.knobs("twell_mlp").margin and plan_config.current().context is None
    with planning(sparse_core={"max_grid_y": 3}) as config:  # a launcher's group, not a method choice
        assert config.knobs("sparse_core").max_grid_y == 3
    assert plan_config.current().knobs("sparse_core").max_grid_y == 65535
    with pytest.raises(ValueError, match="nothing named 'nope' has knobs; knob groups: .*sparse_core, sparse_decode"):
        with planning(nope={}):
            pass
    with pytest.raises(ValueError, match="sparse_decode has no knob among \\['wdith'\\].*width_per_l0"):
        with planning(sparse_decode={"wdith": 3}):
            pass
    with pytest.raises(ValueError, match="context must be one of eager, graph or None"):
        with planning(context="cuda"):
            pass


def test_measured_times_replace_the_cost_model():
    question = (1, 2048, 5632, torch.bfloat16)
    assert twell_auto.PLANNER.pick(question, 30.0, False) == "twell"
    with planning(twell_mlp={"measured_s": {"twell": 2.0, "dense": 1.0}}):
        assert twell_auto.PLANNER.pick(question, 30.0, False) == "dense"
    assert twell_auto.PLANNER.pick(question, 30.0, False) == "twell"  # the memo is per config


def test_an_eager_call_is_priced_with_its_host_time_and_a_capture_without():
    question = (1, 2048, 5632, torch.bfloat16)
    assert twell_auto.PLANNER.pick(question, 30.0, eager=True) == "dense"  # host-bound: one cuBLAS dispatch
    assert twell_auto.PLANNER.pick(question, 30.0, eager=False) == "twell"
    with planning(twell_mlp={"host_s": {}}):
        assert twell_auto.PLANNER.pick(question, 30.0, eager=True) == "twell"


def test_a_graph_compiled_before_any_eager_call_decides_when_it_runs(device):
    """No eager call before compiling: the prior (1 of 64 neurons) would pick twell, but random weights fire ~half
    of them. The compiled graph hands "auto" to the op, which counts the weight's firing when the graph runs and
    picks dense; the same graph follows a sparser weight to twell, without recompiling."""
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fn = torch.compile(sparsefuse.twell_mlp, fullgraph=True, backend=backend)
    x = torch.randn(5, 24, device=device)
    w_gate, w_up, w_down = _mlp(device)
    with planning(twell_mlp={"measured_s": _twell_iff_sparse}):
        with track_launches() as launched:
            fn(x, w_gate, w_up, w_down)
        assert not any(k in launched for k in TWELL_KERNELS), dict(launched)
        assert twell_auto.ESTIMATES.monitor(w_gate).mean_nnz > 10  # counted when the graph ran
        quiet = torch.full_like(w_gate, -1.0)  # fires nowhere: the same graph now runs twell
        with track_launches() as launched:
            fn(x.abs(), quiet, w_up, w_down)
        assert launched["twell_up_down_fwd_kernel"] == 1, dict(launched)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames == 1, frames


def test_a_given_estimate_under_compile_is_a_constant_of_the_graph(device):
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    torch._dynamo.reset()
    acts, w = sparse_rows(5, 600, [3, 30, 0, 4, 7], device=device), torch.randn(600, 24, device=device)
    scan_fastest = {"scan": 1e-6, "fixed": 1.0, "dense": 1.0}
    with planning(sparse_decode={"dense_below_d_sae": 256, "measured_s": scan_fastest}):
        fn = torch.compile(lambda a, b: sparsefuse.sparse_decode(a, b, expected_l0=3.0), fullgraph=True,
                           backend=backend)  # fmt: skip
        with track_launches() as launched:
            fn(acts, w)
    assert "complete_nonfinite_rows_kernel" not in launched  # a sparse method, picked at trace time
    assert decode_auto.PLANNER.estimates.monitor(w) is None  # nothing counted: the given estimate decided


def test_an_explicit_method_is_never_replaced(device):
    acts = sparse_rows(3, 5000, [3, 4, 5], device=device)
    w = torch.randn(5000, 8, device=device)
    for method, kernel in (("scan", "gather_accumulate_kernel"), ("fixed", "row_bits_kernel")):
        with planning(sparse_decode={"measured_s": {"scan": 9.0, "fixed": 9.0, "dense": 1e-9}}):
            with track_launches() as launched:
                sparsefuse.sparse_decode(acts, w, method=method)
        assert kernel in launched, (method, dict(launched))


def test_explain_reports_the_training_steps_layout(device, plan):
    from sparsefuse.ffn.hybrid import hybrid_mlp

    w_gate, w_up, w_down = (w.requires_grad_() for w in _mlp(device))
    x = torch.randn(16, 24, device=device, requires_grad=True)
    first = sparsefuse.explain(hybrid_mlp, x, w_gate, w_up, w_down)
    assert (first.op, first.method, first.source) == ("hybrid_mlp", "block", "prior")  # nothing observed yet
    hybrid_mlp(x, w_gate, w_up, w_down, layout="dense")  # observes ~half the neurons firing
    assert sparsefuse.explain(hybrid_mlp, x, w_gate, w_up, w_down).method == "dense"
    plan(hybrid_mlp={"dense_above": 1.0})
    assert sparsefuse.explain(hybrid_mlp, x, w_gate, w_up, w_down).method == "block"
    explicit = sparsefuse.explain(hybrid_mlp, x, w_gate, w_up, w_down, layout="dense")
    assert (explicit.method, explicit.source) == ("dense", "explicit")


def test_the_module_trains_dense_until_counted_then_sparse_where_the_planner_says(device):
    """``train_method="auto"`` (the default): LlamaMLP's dense ops on the first step (nothing counted yet: a block
    step would keep every pair), which count the gate's firing without a sync; from then on the sparse step, the
    gate firing ~0.6% of its neurons (under the planner's 0.9%); the same gradients either way."""
    from sparsefuse.ffn.synthetic import synthetic_ffn

    ffn = synthetic_ffn(32, 512, dtype=torch.float32, device=device, seed=3)
    mlp = sparsefuse.nn.SparseGatedMLP(32, 512, device=device)
    with torch.no_grad():
        for linear, w in ((mlp.gate_proj, ffn.w_gate), (mlp.up_proj, ffn.w_up), (mlp.down_proj, ffn.w_down)):
            linear.weight.copy_(w)
    x = ffn.make_input(64, 3.0)
    weights = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    want = torch.autograd.grad((_dense_block(x, *weights) ** 2).sum(), weights)  # the dense block by hand
    for step in range(2):
        assert sparsefuse.explain(mlp, x).method == ("dense" if step == 0 else "block")
        with track_launches() as launched:
            got = torch.autograd.grad((mlp(x) ** 2).sum(), weights)
        assert ("block_sddmm_kernel" in launched) == (step == 1), (step, dict(launched))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def _dense_block(x, w_gate, w_up, w_down):
    return torch.nn.functional.linear(torch.relu(x @ w_gate.t()) * (x @ w_up.t()), w_down)
