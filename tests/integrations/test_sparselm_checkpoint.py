"""load_sparse_checkpoint on small checkpoints written here in the released SparseLM format (config.json with the
released fields, safetensors), random weights. The reference is this file's own float64 forward of the
architecture (Llama / Qwen2 with ReLU MLPs), computed from the stored tensors, not from transformers."""

import io
import json
import math

import pytest
import torch
from conftest import assert_backend

from sparsefuse import track_launches
from sparsefuse.nn import SparseReluMLP
from sparsefuse.nn.ffn import SparseGatedMLP
from sparsefuse.testing import assert_norm_close_to_reference

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
from transformers.models.llama.modeling_llama import LlamaMLP  # noqa: E402

from sparsefuse.integrations.transformers import load_sparse_checkpoint  # noqa: E402

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 192, 4, 2, 2, 97
ROPE_THETA, EPS = 100000.0, 1e-5


def released_config(family: str = "llama", *, gated: bool = True, dtype: str = "bfloat16", **extra) -> dict:
    """The fields of the released configs (cfgs/run_cfg/sparsity_gated_*.yaml as saved by save_pretrained),
    shrunk. ``intermediate_size`` differs from ``sparsity_new_intermediate_size``, which wins."""
    arch = {"llama": "SparseLlamaForCausalLM", "qwen2": "SparseQwen2ForCausalLM"}[family]
    config = {
        "architectures": [arch],
        "model_type": f"{family}_sparse_relu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": 160,
        "is_llama_config": True,
        "max_position_embeddings": 64,
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "pretraining_tp": 1,
        "rms_norm_eps": EPS,
        "rope_interleaved": False,
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "tie_word_embeddings": True,
        "torch_dtype": dtype,
        "use_cache": True,
        "vocab_size": VOCAB,
        "sparsity_l1_coeff": 2e-5,
        "sparsity_train_batch_size": 512,
        "sparsity_per_device_train_batch_size": 8,
        "sparsity_max_seq_length": 2048,
        "sparsity_tokens_until_dead": None,
        "sparsity_new_intermediate_size": INTERMEDIATE,
        "sparsity_gated_mlp": gated,
        "sparsity_reinitialize": True,
        "sparsity_mlp_execution_logic": "training",
        "sparsity_use_hybrid_kernel": False,
        "sparsity_l0_cutoff": -1,
        "sparsity_l0_cutoff_period": 20,
        "mlp_bias": False,
        "transformers_version": "4.56.1",
    }
    config.update(extra)
    return config


def random_weights(family: str, gated: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """float32 tensors under the transformers names; gate/up rows shifted negative so that ReLU leaves zeros."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale if scale is not None else 1 / math.sqrt(shape[-1]))

    head = HIDDEN // HEADS
    w = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN, scale=1.0), "model.norm.weight": 1 + 0.1 * rand(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + 0.1 * rand(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rand(HIDDEN)
        w[p + "self_attn.q_proj.weight"] = rand(HEADS * head, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = rand(KV_HEADS * head, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = rand(KV_HEADS * head, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = rand(HIDDEN, HEADS * head)
        if family == "qwen2":  # Qwen2's q/k/v carry biases
            for name, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                w[p + f"self_attn.{name}_proj.bias"] = 0.1 * rand(rows * head, scale=1.0)
        first = "gate_proj" if gated else "up_proj"
        w[p + f"mlp.{first}.weight"] = rand(INTERMEDIATE, HIDDEN) - 0.15
        if gated:
            w[p + "mlp.up_proj.weight"] = rand(INTERMEDIATE, HIDDEN)
        w[p + "mlp.down_proj.weight"] = rand(HIDDEN, INTERMEDIATE)
    return w


def write_checkpoint(path, config: dict, weights: dict[str, torch.Tensor], dtype: torch.dtype, shards: int = 1):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    stored = {k: v.to(dtype).contiguous() for k, v in weights.items()}
    if shards == 1:
        safetensors_torch.save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    keys = sorted(stored)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: stored[k] for k in keys[s::shards]}
        safetensors_torch.save_file(part, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def reference_logits(w: dict[str, torch.Tensor], ids: torch.Tensor, gated: bool, act=torch.relu) -> torch.Tensor:
    """float64 causal-LM forward: ids [batch, seq] -> logits [batch, seq, vocab]. RMSNorm, GQA attention with
    the rotate-half rotary embedding (theta ROPE_THETA), (gated) ReLU MLP, tied lm_head."""
    w = {k: v.double() for k, v in w.items()}
    head = HIDDEN // HEADS
    batch, seq = ids.shape

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight

    def linear(x, name):
        return x @ w[name + ".weight"].t() + w.get(name + ".bias", 0)

    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, head, 2, dtype=torch.float64) / head)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rope(x):  # [batch, heads, seq, head]
        x1, x2 = x[..., : head // 2], x[..., head // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    mask = torch.full((seq, seq), float("-inf"), dtype=torch.float64).triu(1)
    h = w["model.embed_tokens.weight"][ids]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        x = norm(h, w[p + "input_layernorm.weight"])
        q = linear(x, p + "self_attn.q_proj").view(batch, seq, HEADS, head).transpose(1, 2)
        k = linear(x, p + "self_attn.k_proj").view(batch, seq, KV_HEADS, head).transpose(1, 2)
        v = linear(x, p + "self_attn.v_proj").view(batch, seq, KV_HEADS, head).transpose(1, 2)
        q, k = rope(q), rope(k)
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(head) + mask, -1) @ v
        h = h + linear(attn.transpose(1, 2).reshape(batch, seq, HIDDEN), p + "self_attn.o_proj")
        x = norm(h, w[p + "post_attention_layernorm.weight"])
        if gated:
            inner = act(linear(x, p + "mlp.gate_proj")) * linear(x, p + "mlp.up_proj")
        else:
            inner = act(linear(x, p + "mlp.up_proj"))
        h = h + linear(inner, p + "mlp.down_proj")
    return norm(h, w["model.norm.weight"]) @ w["model.embed_tokens.weight"].t()


def stored_as(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The values the checkpoint actually holds (rounded to its dtype), for the float64 reference."""
    return {k: v.to(dtype) for k, v in weights.items()}


def ids_for(device, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1)).to(device)


CASES = [
    ("llama", True, torch.float32),
    ("llama", True, torch.bfloat16),
    ("qwen2", True, torch.float32),
    ("llama", False, torch.float32),
    ("qwen2", False, torch.bfloat16),
]


@pytest.mark.parametrize("family,gated,dtype", CASES, ids=lambda c: str(c).replace("torch.", ""))
def test_patched_model_matches_a_float64_forward_of_the_stored_weights(family, gated, dtype, device, tmp_path):
    weights = random_weights(family, gated)
    name = str(dtype).removeprefix("torch.")
    path = write_checkpoint(tmp_path / "ckpt", released_config(family, gated=gated, dtype=name), weights, dtype)
    patched = load_sparse_checkpoint(path, device=device, method="twell")
    plain = load_sparse_checkpoint(path, device=device, patch=False)
    assert next(patched.parameters()).dtype == dtype  # the config's torch_dtype by default
    expected_class = transformers.LlamaForCausalLM if family == "llama" else transformers.Qwen2ForCausalLM
    assert type(patched) is expected_class
    mlps = [layer.mlp for layer in patched.model.layers]
    if gated:
        assert all(isinstance(m, SparseGatedMLP) for m in mlps)
    else:
        assert all(isinstance(m, SparseReluMLP) and m.method == "twell" for m in mlps)
    assert mlps[0].up_proj.weight.shape == (INTERMEDIATE, HIDDEN)  # sparsity_new_intermediate_size won
    ids = ids_for(device)
    assert_backend(patched.model.embed_tokens.weight)
    with torch.no_grad(), track_launches() as launched:
        got = patched(ids).logits
    with torch.no_grad():
        lowp = plain(ids).logits
    # one sparse FFN per layer: the gated up/down kernel, or the non-gated block's TwELL -> ELL packing
    assert launched["twell_up_down_fwd_kernel" if gated else "twell_to_ell_kernel"] == LAYERS, launched
    ref = reference_logits(stored_as(weights, dtype), ids.cpu(), gated)
    assert got.shape == (2, 8, VOCAB)
    assert_norm_close_to_reference(got, ref, lowp, dtype=dtype, name=f"{family} logits")
    # the patched model saves as the checkpoint it came from (the column-major down_proj comes out contiguous)
    saved = {k: v for k, v in patched.state_dict().items() if k != "lm_head.weight"}
    safetensors_torch.save_file(saved, str(tmp_path / "resaved.safetensors"))
    for key, value in saved.items():
        torch.testing.assert_close(value.cpu(), weights[key].to(dtype), rtol=0, atol=0, msg=key)


def test_patch_false_is_the_unpatched_relu_model_whatever_hidden_act_says(tmp_path):
    weights = random_weights("llama", True)
    path = write_checkpoint(tmp_path / "ckpt", released_config(dtype="float32"), weights, torch.float32)
    model = load_sparse_checkpoint(path, dtype=torch.float64, patch=False)
    assert not any(isinstance(m, SparseGatedMLP) for m in model.modules())
    assert all(
        type(layer.mlp) is LlamaMLP and isinstance(layer.mlp.act_fn, torch.nn.ReLU) for layer in model.model.layers
    )
    assert model.config.hidden_act == "relu"
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tie_word_embeddings, no lm_head stored
    ids = ids_for("cpu")
    with torch.no_grad():
        got = model(ids).logits
    relu = reference_logits(weights, ids, True)
    silu = reference_logits(weights, ids, True, act=torch.nn.functional.silu)
    # transformers computes the rotary cos/sin in float32 even for a float64 model
    torch.testing.assert_close(got, relu, rtol=1e-4, atol=1e-5)
    assert (got - silu).abs().max() > 1e-2  # the config's "silu" would have given other logits


def test_sharded_alternate_names_and_hybrid_layout_load_the_same_model(tmp_path):
    weights = random_weights("llama", True)
    base = write_checkpoint(tmp_path / "plain", released_config(dtype="float32"), weights, torch.float32)
    renamed = {}
    for key, value in weights.items():
        if key.endswith("mlp.gate_proj.weight"):
            renamed[key.replace("gate_proj.weight", "GATE")] = value
        elif key.endswith("mlp.down_proj.weight"):
            renamed[key] = value.t()  # hybrid-kernel layout: [intermediate, hidden]
        else:
            renamed[key] = value
    renamed["lm_head.weight"] = weights["model.embed_tokens.weight"]  # written by some savers despite the tie
    other = write_checkpoint(
        tmp_path / "other", released_config(dtype="float32", sparsity_use_hybrid_kernel=True), renamed, torch.float32, 3
    )
    a = load_sparse_checkpoint(base, patch=False).state_dict()
    b = load_sparse_checkpoint(other, patch=False).state_dict()
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=0, msg=key)


def test_directories_not_in_the_format_raise_naming_what_was_expected(tmp_path):
    weights = random_weights("llama", True)
    with pytest.raises(ValueError, match="config.json"):
        load_sparse_checkpoint(tmp_path / "missing")
    plain_llama = released_config(architectures=["LlamaForCausalLM"], model_type="llama")
    with pytest.raises(ValueError, match="llama_sparse_relu"):
        load_sparse_checkpoint(write_checkpoint(tmp_path / "llama", plain_llama, weights, torch.float32))
    no_weights = tmp_path / "noweights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps(released_config()))
    with pytest.raises(ValueError, match="safetensors"):
        load_sparse_checkpoint(no_weights)
    partial = {k: v for k, v in weights.items() if "layers.1.mlp" not in k}
    with pytest.raises(ValueError, match="missing"):
        load_sparse_checkpoint(write_checkpoint(tmp_path / "partial", released_config(), partial, torch.float32))
    with pytest.raises(ValueError, match="unexpected"):  # gate weights in a non-gated checkpoint
        nongated = released_config(gated=False)
        load_sparse_checkpoint(write_checkpoint(tmp_path / "ng", nongated, weights, torch.float32), patch=False)
    with pytest.raises(TypeError, match="patch option"):
        load_sparse_checkpoint(tmp_path / "llama", bogus=1)
    with pytest.raises(TypeError, match="path"):
        load_sparse_checkpoint(3)


def test_sparse_relu_mlp_is_a_sparsefuse_nn_module_also_named_by_the_loader():
    from sparsefuse.integrations import sparselm

    assert SparseReluMLP.__module__ == "sparsefuse.nn.relu_mlp"
    assert sparselm.SparseReluMLP is SparseReluMLP and "SparseReluMLP" in sparselm.__all__


def test_sparse_relu_mlp_state_dict_gives_the_column_major_down_proj_contiguous(device):
    """Configured for the kernels, down_proj.weight is kept column-major; state_dict() (its hook) gives it
    contiguous, as safetensors requires, under any prefix, also after a whole-module pickle round trip."""
    mlp = SparseReluMLP(HIDDEN, INTERMEDIATE, bias=True).to(device)
    dense = {k: v.clone() for k, v in mlp.state_dict().items()}
    mlp.configure(method="twell")
    weight = mlp.down_proj.weight
    assert weight.stride(0) == 1 and not weight.is_contiguous()
    assert mlp.state_dict(keep_vars=True)["down_proj.weight"] is weight  # the Parameter itself when asked
    buffer = io.BytesIO()
    torch.save(torch.nn.Sequential(mlp), buffer)
    buffer.seek(0)
    for model, prefix in ((mlp, ""), (torch.nn.Sequential(mlp), "0."), (torch.load(buffer, weights_only=False), "0.")):
        state = model.state_dict()
        assert state[prefix + "down_proj.weight"].is_contiguous()
        for key, value in dense.items():
            torch.testing.assert_close(state[prefix + key], value, rtol=0, atol=0, msg=key)
    fresh = SparseReluMLP(HIDDEN, INTERMEDIATE, bias=True).to(device)
    fresh.load_state_dict(mlp.state_dict())
    x = torch.randn(5, HIDDEN, device=device)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), fresh(x))  # the kernels (configured) and the dense ops (fresh)
