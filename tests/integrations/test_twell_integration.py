"""SparseGatedMLP (transformers LlamaMLP parameter names) and patch_llama on a real, randomly initialised
transformers LlamaForCausalLM(hidden_act="relu") built from a LlamaConfig (no downloads)."""

import warnings

import pytest
import torch
from conftest import assert_backend

from sparsefuse import track_launches
from sparsefuse.ffn import torch_twell_mlp
from sparsefuse.nn.ffn import SparseGatedMLP
from sparsefuse.nn.norms import RMSNorm
from sparsefuse.testing import assert_close_to_reference, assert_norm_close_to_reference

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaMLP  # noqa: E402

from sparsefuse.integrations._llama import fuse_norms, patch_llama  # noqa: E402


def twell_launches(launched) -> tuple[int, int]:
    """(gate launches -- the fused kernel or, from gate_gemm_min_tokens tokens, the packing pass after cuBLAS's
    GEMM --, up/down launches)."""
    return launched["twell_gate_fwd_kernel"] + launched["twell_pack_kernel"], launched["twell_up_down_fwd_kernel"]


def tiny_config(**overrides):
    kw = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        hidden_act="relu",
        attn_implementation="eager",
    )
    kw.update(overrides)
    return transformers.LlamaConfig(**kw)


def sparsify_gates(model, shift: float) -> None:
    """Push the gate biases down so that few neurons fire (a sparse ReLU model's regime)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LlamaMLP) and module.gate_proj.bias is not None:
                module.gate_proj.bias.fill_(shift)


@pytest.mark.parametrize("bias", [False, True])
def test_module_loads_llama_mlp_state_dict_and_matches(bias, device):
    config = tiny_config(mlp_bias=bias)
    mlp = LlamaMLP(config).to(device)
    fused = SparseGatedMLP(
        config.hidden_size,
        config.intermediate_size,
        bias=bias,
        method="twell",
        tile=32,
        compression=4 if bias else 2,
        device=device,
    )
    if bias:
        sparsify_gates(mlp, -1.0)
    fused.load_state_dict(mlp.state_dict(), strict=True)
    assert fused.state_dict().keys() == mlp.state_dict().keys()
    assert fused.down_proj.weight.stride(0) == 1  # column-major kept through load_state_dict
    x = torch.randn(2, 5, config.hidden_size, device=device)
    assert_backend(x)
    with torch.no_grad(), track_launches() as launched:
        y = fused(x)
    assert twell_launches(launched) == (1, 1), launched
    assert_matches_llama_mlp(y, x, mlp)


def assert_matches_llama_mlp(y, x, mlp):
    """y is ``mlp(x)`` (a LlamaMLP) within the float64 reference's bound, the fp32 summation-order slack allowed."""
    b = [m.bias for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    ref = torch_twell_mlp(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, *b)
    with torch.no_grad():
        assert_close_to_reference(y, ref, mlp(x), extra_abs=mlp_accumulation_allowance(x, mlp))


def mlp_accumulation_allowance(x, mlp):
    """fp32 summation-order slack of relu(x Wg^T) * (x Wu^T) @ Wd^T: each product's Higham bound, the first two
    carried through the elementwise product."""
    x64 = x.detach().double()
    wg, wu, wd = (m.weight.detach().double() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    gamma = lambda n: n * torch.finfo(torch.float32).eps  # noqa: E731
    g, u = x64 @ wg.t(), x64 @ wu.t()
    if mlp.gate_proj.bias is not None:
        g, u = g + mlp.gate_proj.bias.double(), u + mlp.up_proj.bias.double()
    err_g = gamma(x.shape[-1]) * (x64.abs() @ wg.abs().t())
    err_u = gamma(x.shape[-1]) * (x64.abs() @ wu.abs().t())
    h = g.relu() * u
    err_h = g.relu() * err_u + (g > 0) * u.abs() * err_g
    return (err_h + gamma(h.shape[-1]) * h.abs()) @ wd.abs().t()


def test_row_layout_module_compiles_without_a_graph_break(device):
    """``down_layout="row"`` (FSDP2's) keeps W_down row-major, so the sparse call copies W_down^T (warned once in
    eager); under torch.compile(fullgraph=True) that warning is not emitted (it would break the graph), even as the
    first call of the process."""
    from sparsefuse.ffn.twell import functional as twell_functional

    config = tiny_config(mlp_bias=True)
    mlp = LlamaMLP(config).to(device)
    sparsify_gates(mlp, -1.0)
    fused = SparseGatedMLP(config.hidden_size, config.intermediate_size, bias=True, method="twell", tile=32,
                           compression=4, down_layout="row", device=device)  # fmt: skip
    fused.load_state_dict(mlp.state_dict())
    assert fused.down_proj.weight.stride(1) == 1  # row-major kept
    x = torch.randn(2, 5, config.hidden_size, device=device)
    twell_functional._warned_down_copy.discard("twell_mlp")  # as in a fresh process
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True, backend=backend)
    with torch.no_grad(), track_launches() as launched:
        y = compiled(x)
    assert twell_launches(launched) == (1, 1), launched
    assert_matches_llama_mlp(y, x, mlp)


def test_module_trains_through_the_dense_path(device):
    fused = SparseGatedMLP(32, 64, device=device)
    x = torch.randn(5, 32, device=device)
    with track_launches() as launched:
        fused(x).square().sum().backward()
    assert not launched and fused.down_proj.weight.grad.shape == (32, 64)


@pytest.mark.parametrize("mlp_bias", [False, True])
def test_patch_llama_logits_match_unpatched(mlp_bias, device):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_config(mlp_bias=mlp_bias)).to(device).eval()
    if mlp_bias:
        sparsify_gates(model, -1.5)
    ids = torch.randint(0, 97, (2, 4), device=device)
    ref_model = transformers.LlamaForCausalLM(model.config).to(device).double().eval()
    ref_model.load_state_dict(model.state_dict())
    with torch.no_grad():
        unpatched = model(ids).logits
        ref64 = ref_model(ids).logits
    gate_before = model.model.layers[0].mlp.gate_proj.weight
    norm_before = model.model.layers[0].input_layernorm.weight
    keys_before = model.state_dict().keys()
    # Random weights fire ~50% (unbiased): 64-column tiles keep every non-zero there (compression 1); the sparse
    # model (biased) runs the defaults, 8 slots per tile.
    assert patch_llama(model, method="twell", **({} if mlp_bias else {"compression": 1})) is model
    mlps = [layer.mlp for layer in model.model.layers]
    assert all(isinstance(m, SparseGatedMLP) for m in mlps)
    assert mlps[0].gate_proj.weight is gate_before  # the very Parameters, not copies
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * model.config.num_hidden_layers + 1 and norms[0].weight is norm_before
    assert model.state_dict().keys() == keys_before
    with torch.no_grad(), track_launches() as launched:
        patched = model(ids).logits
    assert twell_launches(launched) == (model.config.num_hidden_layers,) * 2, launched
    # a small eager inference call on CUDA normalises through torch's native RMSNorm (its host path is shorter)
    from sparsefuse.norms.rmsnorm.functional import NATIVE_FUSED

    assert launched["rms_norm_fwd_kernel"] == (0 if ids.is_cuda and NATIVE_FUSED else len(norms))
    assert_norm_close_to_reference(patched, ref64, unpatched, name="logits")


def test_patch_llama_refuses_models_without_relu_mlps(device):
    model = transformers.LlamaForCausalLM(tiny_config(hidden_act="silu", num_hidden_layers=1))
    with pytest.raises(ValueError, match=r"no LlamaMLP with a ReLU activation.*hidden_act='silu'"):
        patch_llama(model)
    single = LlamaMLP(tiny_config())
    assert isinstance(patch_llama(single), SparseGatedMLP)


def test_patch_llama_fuse_false_keeps_transformers_norms_and_fuse_norms_works_alone(device):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    model = transformers.LlamaForCausalLM(tiny_config(num_hidden_layers=2)).to(device)
    patch_llama(model, fuse=False)
    assert not any(isinstance(m, RMSNorm) for m in model.modules())
    silu = transformers.LlamaForCausalLM(tiny_config(hidden_act="silu", num_hidden_layers=2)).to(device)
    assert fuse_norms(silu) == 5 and not any(type(m) is LlamaRMSNorm for m in silu.modules())


@pytest.mark.gpu
def test_patched_bf16_llama_gpu(device):
    torch.manual_seed(0)
    config = tiny_config(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        mlp_bias=True,
    )
    model = transformers.LlamaForCausalLM(config).to(device).eval()
    sparsify_gates(model, -2.0)
    ref_model = transformers.LlamaForCausalLM(config).to(device).double().eval()
    ref_model.load_state_dict(model.state_dict())
    model = model.to(torch.bfloat16)
    ids = torch.randint(0, 97, (4, 33), device=device)
    with torch.no_grad():
        unpatched = model(ids).logits
        ref64 = ref_model(ids).logits
        patch_llama(model)
        patched = model(ids).logits
        patched = model(ids).logits  # second call: the monitor's estimate, no probe
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert_norm_close_to_reference(patched, ref64, unpatched, name="logits")


def test_patched_llama_replays_its_hybrid_steps_from_graphs(device, monkeypatch, plan):
    """patch_llama(train_cuda_graph=True): after a first (observing) step every layer's FFN step replays its
    capture, with the gradients of the same model stepped eagerly (under the interpreter a capture re-runs)."""
    from sparsefuse.ffn.hybrid import graphed
    from sparsefuse.integrations.transformers import l1_loss, patched_mlps

    plan(hybrid_mlp={"dense_above": 1.0})  # the tiny model fires widely: keep the block step
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(tiny_config(mlp_bias=True)).to(device)
    sparsify_gates(model, -1.0)
    eager = transformers.LlamaForCausalLM(model.config).to(device)
    eager.load_state_dict(model.state_dict())
    patch_llama(model, train_method="hybrid", train_cuda_graph=True)
    patch_llama(eager, train_method="hybrid")
    assert all(m.train_cuda_graph for _, m in patched_mlps(model))
    ids = torch.randint(0, 97, (2, 6), device=device)
    graphed.release_graphs()
    try:
        for step in range(2):
            replays = graphed.GRAPH_EVENTS["replay"]
            for m in (model, eager):
                m.zero_grad(set_to_none=True)
                (m(ids, labels=ids).loss + 0.1 * l1_loss(m)).backward()
            assert graphed.GRAPH_EVENTS["replay"] == replays + (model.config.num_hidden_layers if step else 0)
            for (name, p), q in zip(model.named_parameters(), eager.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        graphed.release_graphs()


@pytest.mark.parametrize("train_method", ["dense", "hybrid"])
def test_patched_llama_trains_with_l1_and_reports(train_method, device):
    """A patched model under a training step: the loss's gradients equal the unpatched model's (plus the L1 term's
    gate gradient), l1_loss sums every layer's term and sparsity_report gives every layer's statistics."""
    from sparsefuse.integrations.transformers import l1_loss, sparsity_report

    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(tiny_config(mlp_bias=True)).to(device)
    sparsify_gates(model, -1.0)
    ref = transformers.LlamaForCausalLM(model.config).to(device)
    ref.load_state_dict(model.state_dict())
    patch_llama(model, train_method=train_method)
    ids = torch.randint(0, 97, (2, 6), device=device)
    with pytest.raises(RuntimeError, match="no patched SparseGatedMLP has run"):
        l1_loss(model)
    out = model(ids, labels=ids)
    l1 = l1_loss(model)
    (out.loss + 0.1 * l1).backward()
    # the reference: same loss, and the L1 term computed by hand from each layer's gate activations
    gates = []
    hooks = [
        layer.mlp.gate_proj.register_forward_hook(lambda m, a, o: gates.append(torch.relu(o)))
        for layer in ref.model.layers
    ]
    ref_out = ref(ids, labels=ids)
    for h in hooks:
        h.remove()
    ref_l1 = sum(g.float().sum() / g.numel() for g in gates)
    (ref_out.loss + 0.1 * ref_l1).backward()
    torch.testing.assert_close(out.loss, ref_out.loss)
    torch.testing.assert_close(l1, ref_l1)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    report = sparsity_report(model)
    assert len(report) == model.config.num_hidden_layers
    first = report["model.layers.0.mlp"]
    assert float(first["mean_nnz"]) == pytest.approx(float((gates[0] > 0).sum(-1).float().mean()))


def test_release_step_frees_a_failed_steps_graph(device):
    """A step that fails between forward and backward (an out-of-memory error in a batch-size search) leaves each
    patched layer's differentiable L1 term holding its forward's graph; release_step drops it."""
    import weakref

    from sparsefuse.integrations.transformers import l1_loss, patched_mlps, release_step

    torch.manual_seed(2)
    model = transformers.LlamaForCausalLM(tiny_config()).to(device)
    sparsify_gates(model, -1.0)
    patch_llama(model, train_method="hybrid")
    ids = torch.randint(0, 97, (2, 6), device=device)
    model(ids, labels=ids)  # the forward ran; its backward never will
    held = [weakref.ref(m.last_l1.grad_fn) for _, m in patched_mlps(model)]
    assert all(ref() is not None for ref in held)
    release_step(model)
    assert all(m.last_l1 is None and m._last_counts is None for _, m in patched_mlps(model))
    assert all(ref() is None for ref in held)  # nothing else kept the graphs alive
    with pytest.raises(RuntimeError, match="no patched SparseGatedMLP has run"):
        l1_loss(model)


def plain_rotary(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' rotary embedding as a plain function (what modeling_llama holds without the kernels package)."""
    from sparsefuse.rotary import torch_apply_rotary_pos_emb

    return torch_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


@pytest.fixture(params=["own wrapper", "dispatcher"])
def rotary_route(request, monkeypatch):
    """Both ways fuse_rotary reaches one model's attention (sparsefuse/integrations/_llama_rotary.py): the
    attention's own rotary wrapper where transformers gives it one, the dispatcher where the global is a plain
    function -- simulated here by putting one there."""
    from transformers.models.llama import modeling_llama

    has_wrappers = isinstance(modeling_llama.apply_rotary_pos_emb, torch.nn.Module)
    if request.param == "own wrapper" and not has_wrappers:
        pytest.skip("this transformers gives the attention no rotary wrapper of its own (no kernels package)")
    if request.param == "dispatcher" and has_wrappers:
        monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", plain_rotary)
    return request.param


def test_fused_rotary_runs_only_inside_fused_models(device, rotary_route):
    """After patch_llama the fused model's attention rotates q and k with one kernel each way; a model that was not
    patched, in the same process, keeps transformers' function; an attention forward that raises leaves nothing
    behind."""
    from sparsefuse.integrations import _llama_rotary

    torch.manual_seed(0)
    fused = transformers.LlamaForCausalLM(tiny_config(num_hidden_layers=2)).to(device)
    plain = transformers.LlamaForCausalLM(fused.config).to(device)
    plain.load_state_dict(fused.state_dict())
    patch_llama(fused, method="dense")
    assert all(_llama_rotary.is_rotary_fused(layer.self_attn) for layer in fused.model.layers)
    assert not any(_llama_rotary.is_rotary_fused(layer.self_attn) for layer in plain.model.layers)
    ids = torch.randint(0, 97, (2, 5), device=device)
    with track_launches() as launched:
        loss = fused(ids, labels=ids).loss
        loss.backward()
    assert launched["rotary_fwd_kernel"] == 2 and launched["rotary_bwd_kernel"] == 2
    with track_launches() as launched:
        plain_loss = plain(ids, labels=ids).loss
        plain_loss.backward()
    assert launched["rotary_fwd_kernel"] == 0
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    with pytest.raises(RuntimeError):  # hidden states of the wrong width
        fused.model.layers[0].self_attn(torch.ones(1, 2, 3, device=device), position_embeddings=None)
    assert _llama_rotary._FUSED_ATTENTION.depth == 0


def test_fused_model_compiles_without_graph_breaks(device, rotary_route):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_config(num_hidden_layers=2, mlp_bias=True)).to(device)
    sparsify_gates(model, -1.0)
    patch_llama(model, train_method="hybrid")
    ids = torch.randint(0, 97, (2, 6), device=device)
    model(ids, labels=ids).loss.backward()  # one eager step first, as the docs say (auto's choices settle)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with track_launches() as launched:
        compiled(ids, labels=ids).loss.backward()
    assert launched["rms_norm_fwd_kernel"] == 5 and launched["rotary_fwd_kernel"] == 2, launched
    # compiled inference: the norms and the rotary embedding are the compiler's to fuse (plain torch), and the
    # logits those of the unpatched expressions
    with torch.no_grad(), track_launches() as launched:
        logits = compiled(ids).logits
    assert launched["rms_norm_fwd_kernel"] == 0 and launched["rotary_fwd_kernel"] == 0, launched
    with torch.no_grad():
        torch.testing.assert_close(logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_fused_rotary_state_is_per_thread_and_survives_a_reload(device):
    """The count of running fused attentions is per thread (an unfused model in another thread keeps transformers'
    function), and re-importing sparsefuse (IPython's autoreload) keeps transformers' own function as the fallback
    rather than taking the installed dispatcher for it (which would recurse)."""
    import subprocess
    import sys
    import threading

    from sparsefuse.integrations import _llama_rotary

    _llama_rotary._FUSED_ATTENTION.depth = 1  # as inside a fused model's attention on this thread
    try:
        seen = []
        worker = threading.Thread(target=lambda: seen.append(_llama_rotary._FUSED_ATTENTION.depth))
        worker.start()
        worker.join()
        assert seen == [0]
    finally:
        _llama_rotary._FUSED_ATTENTION.depth = 0
    script = (
        "import importlib, torch, transformers\n"
        "from transformers.models.llama import modeling_llama\n"
        "from sparsefuse.integrations import _llama_rotary as _llama\n"
        "from sparsefuse.rotary import torch_apply_rotary_pos_emb\n"
        "def plain(q, k, cos, sin, unsqueeze_dim=1):\n"
        "    return torch_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)\n"
        "modeling_llama.apply_rotary_pos_emb = plain  # the dispatcher's case: a plain function\n"
        "cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,"
        " num_attention_heads=2, num_key_value_heads=2, hidden_act='relu')\n"
        "_llama.fuse_rotary(transformers.LlamaForCausalLM(cfg))\n"
        "importlib.reload(_llama)\n"
        "_llama.fuse_rotary(transformers.LlamaForCausalLM(cfg))\n"
        "with torch.no_grad():\n"
        "    transformers.LlamaForCausalLM(cfg)(torch.randint(0, 97, (1, 4)))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_shard_llama_fsdp2_keeps_the_replay(tmp_path, monkeypatch):
    """The layers patched for CUDA-graph replays keep them once sharded, without a warning (their replays copy the
    weights FSDP2 gathers anew each step: tests/distributed); a one-process gloo group: the sharding, not a step."""
    import torch.distributed as dist

    fsdp = pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch >= 2.6")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard")
    from conftest import loopback_env
    from torch.distributed.device_mesh import DeviceMesh

    from sparsefuse.integrations.transformers import patch_llama, shard_llama_fsdp2

    for name, value in loopback_env().items():
        monkeypatch.setenv(name, value)
    model = patch_llama(
        transformers.LlamaForCausalLM(tiny_config()), train_method="hybrid", down_layout="row", train_cuda_graph=True
    )
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            shard_llama_fsdp2(model, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))
        assert not [w for w in caught if "sparsefuse" in w.filename or "train_cuda_graph" in str(w.message)]
    finally:
        dist.destroy_process_group()
    layers = [m for m in model.modules() if isinstance(m, SparseGatedMLP)]
    assert len(layers) == 2 and all(m.train_cuda_graph for m in layers)


def test_shard_llama_fsdp2_refuses_an_empty_unit():
    """The sharding itself runs in tests/distributed (the bench's FSDP2 rows and the example, two gloo processes)."""
    from sparsefuse.integrations.transformers import shard_llama_fsdp2

    with pytest.raises(ValueError, match="layers_per_unit must be >= 1; got 0"):
        shard_llama_fsdp2(torch.nn.Module(), layers_per_unit=0)
