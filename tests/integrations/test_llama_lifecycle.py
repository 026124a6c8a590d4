"""A patched Llama over its whole life, used around the public API as a user would: hooks on the projections,
saving and loading, copies, dtype changes, checkpointing, patching twice. Each behaves as on the unpatched model
(docs/bad-inputs.md, "Over a model's life")."""

import copy
import io

import pytest
import torch
from conftest import assert_backend

from sparsefuse import track_launches
from sparsefuse.nn.ffn import SparseGatedMLP

transformers = pytest.importorskip("transformers")
from test_twell_integration import sparsify_gates, tiny_config  # noqa: E402

from sparsefuse.integrations.transformers import l1_loss, patch_llama  # noqa: E402


def pair(device, **overrides):
    """(unpatched, patched) copies of one sparse ReLU Llama, gate biases pushed down so the kernels have zeros."""
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(tiny_config(mlp_bias=True, **overrides)).to(device)
    sparsify_gates(plain, -0.5)
    patched = patch_llama(copy.deepcopy(plain), method="twell")
    return plain, patched


def ids_for(device):
    return torch.randint(0, 97, (2, 6), device=device)


def test_forward_hooks_on_the_projections_run_and_steer(device):
    plain, patched = pair(device)
    ids = ids_for(device)
    seen = {"plain": [], "patched": []}
    for name, model in (("plain", plain), ("patched", patched)):
        mlp = model.model.layers[0].mlp
        mlp.down_proj.register_forward_hook(lambda m, i, o, seen=seen[name]: seen.append(i[0].detach().clone()))
        mlp.act_fn.register_forward_hook(lambda m, i, o, seen=seen[name]: seen.append(o.detach().clone()))
        model.model.layers[1].mlp.up_proj.register_forward_hook(lambda m, i, o: torch.zeros_like(o))  # ablation
    with torch.no_grad():
        want, got = plain(ids).logits, patched(ids).logits
    assert len(seen["patched"]) == len(seen["plain"]) == 2  # act_fn, then down_proj, once each
    for a, b in zip(seen["plain"], seen["patched"]):
        torch.testing.assert_close(b, a)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the ablation took effect in both


def test_hooks_run_in_training_and_the_gradients_match(device):
    plain, patched = pair(device)
    patched = patch_llama(patched, train_method="hybrid")
    ids = ids_for(device)
    calls = []
    for model in (plain, patched):
        model.model.layers[0].mlp.gate_proj.register_forward_pre_hook(lambda m, a: calls.append(1))
        model(ids, labels=ids).loss.backward()
    assert calls == [1, 1]
    for (name, p), q in zip(patched.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert patched.model.layers[0].mlp.last_l1 is not None  # the hooked layer still gives the L1 term


def test_an_unhooked_patched_model_still_runs_the_kernels(device):
    _, patched = pair(device)
    ids = ids_for(device)
    handle = patched.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: None)
    handle.remove()
    assert_backend(patched.model.embed_tokens.weight)
    with torch.no_grad(), track_launches() as launched:
        patched(ids)
    assert launched["twell_up_down_fwd_kernel"] == 2, launched


def test_torch_save_and_load_of_any_llama_after_patching(device, tmp_path):
    plain, patched = pair(device)
    ids = ids_for(device)
    for model in (plain, patched):
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    with torch.no_grad(), track_launches() as launched:
        loaded(ids)
    assert launched["rotary_fwd_kernel"] == 2 and launched["twell_up_down_fwd_kernel"] == 2  # still patched


def test_copies_after_a_training_step_hold_no_graph(device):
    _, patched = pair(device)
    ids = ids_for(device)
    loss = patched(ids, labels=ids).loss + 1e-3 * l1_loss(patched)
    copied = copy.deepcopy(patched)  # between forward and backward, as an EMA or best-model copy may be taken
    loss.backward()
    copied_after = copy.deepcopy(patched)
    for model in (copied, copied_after):
        assert all(m.last_l1 is None for m in model.modules() if isinstance(m, SparseGatedMLP))
        with pytest.raises(RuntimeError, match="l1_loss"):
            l1_loss(model)
    with torch.no_grad():
        torch.testing.assert_close(copied_after(ids).logits, patched(ids).logits, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):  # a forward without gradients clears the term
        l1_loss(patched)


def test_reentrant_checkpointing_refuses_a_stale_l1_term(device):
    _, patched = pair(device)
    ids = ids_for(device)
    patched(ids, labels=ids).loss.backward()  # a first step leaves its L1 term behind
    patched.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    patched.train()
    loss = patched(ids, labels=ids).loss
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        l1_loss(patched)
    loss.backward()  # the step itself still trains
    patched.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    (patched(ids, labels=ids).loss + l1_loss(patched)).backward()


def test_state_dict_is_contiguous_and_saves_with_safetensors(device, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    plain, patched = pair(device)
    state = patched.state_dict()
    assert all(t.is_contiguous() for t in state.values())
    assert patched.model.layers[0].mlp.down_proj.weight.stride(0) == 1  # the module keeps its own layout
    assert patched.state_dict(keep_vars=True)["model.layers.0.mlp.down_proj.weight"].stride(0) == 1
    safetensors.save_file(state, tmp_path / "model.safetensors")
    fresh = patch_llama(transformers.LlamaForCausalLM(plain.config).to(device), method="twell")
    fresh.load_state_dict(safetensors.load_file(tmp_path / "model.safetensors", device=str(device)))
    ids = ids_for(device)
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)


def test_float64_model_runs_inference_and_training(device):
    plain, patched = pair(device)
    plain, patched = plain.double(), patch_llama(patched, method="auto").double()
    ids = ids_for(device)
    with torch.no_grad():  # LlamaRMSNorm normalises a float64 input in float32; the fused norm in float64
        torch.testing.assert_close(patched(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-6)
    patched(ids, labels=ids).loss.backward()


def test_patching_twice_takes_the_new_options(device):
    plain, patched = pair(device)
    assert patch_llama(patched, train_method="hybrid", down_layout="row") is patched
    mlps = [m for m in patched.modules() if isinstance(m, SparseGatedMLP)]
    assert len(mlps) == 2 and all(m.train_method == "hybrid" and m.down_layout == "row" for m in mlps)
    assert all(m.down_proj.weight.is_contiguous() for m in mlps)
    assert patch_llama(mlps[0], method="dense") is mlps[0] and mlps[0].method == "dense"
    ids = ids_for(device)
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no LlamaMLP with a ReLU"):
        patch_llama(transformers.LlamaForCausalLM(tiny_config(hidden_act="silu")))
