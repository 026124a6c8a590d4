"""synthetic_llama: a whole ReLU Llama whose every MLP's gate fires ~mean_nnz neurons per token (synthetic weights,
CPU, float32; the patched model's kernels run under TRITON_INTERPRET)."""

import copy

import pytest
import torch

pytest.importorskip("transformers")

from sparsefuse._backend import track_launches  # noqa: E402
from sparsefuse.ffn.synthetic import LLAMA_SHAPES, model_gate_statistics, synthetic_llama  # noqa: E402
from sparsefuse.integrations.transformers import patch_llama  # noqa: E402
from sparsefuse.nn import SparseGatedMLP  # noqa: E402

TINY = dict(
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=5000,
)
MEAN_NNZ = 16.0


def _tiny(mean_nnz=MEAN_NNZ):
    return synthetic_llama(TINY, mean_nnz=mean_nnz, dtype=torch.float32, device="cpu", calibration_tokens=512)


@pytest.fixture(scope="module")
def tiny():
    return _tiny()


def _fresh_ids(shape=(4, 256)) -> torch.Tensor:
    # Not the calibration tokens (those come from the generator seeded with seed + 1).
    return torch.randint(0, TINY["vocab_size"], shape, generator=torch.Generator().manual_seed(1234))


def test_structure(tiny):
    assert not tiny.training
    assert tiny.config.hidden_act == "relu"
    assert len(tiny.model.layers) == TINY["num_hidden_layers"]
    for layer in tiny.model.layers:
        mlp = layer.mlp
        assert mlp.gate_proj.bias is not None and mlp.gate_proj.bias.dtype == torch.float32
        assert mlp.up_proj.bias is None and mlp.down_proj.bias is None
        assert "up_proj.bias" not in dict(mlp.named_parameters())


@pytest.mark.parametrize("shape", [(4, 256), (256, 1)])
def test_realised_statistics_on_fresh_tokens(tiny, shape):
    stats = model_gate_statistics(tiny, _fresh_ids(shape))
    assert len(stats) == TINY["num_hidden_layers"]
    for s in stats:
        assert abs(s["mean"] - MEAN_NNZ) <= 0.15 * MEAN_NNZ, s
        assert s["median"] < s["mean"] < s["p90"] < s["max"], s  # skewed: a heavy tail across tokens
        assert s["p99"] >= 4 * s["median"], s
        assert s["hot10_share"] > 0.3, s  # hot neurons (uniform firing would give 0.1)
    # Dead neurons: ~30% of 256 are never fired by construction; over 1024 tokens few live ones look dead.
    dead = model_gate_statistics(tiny, _fresh_ids((4, 256)))
    for s in dead:
        assert 0.2 <= s["dead_fraction"] <= 0.4, s


def test_dead_neurons_have_a_large_negative_bias(tiny):
    for layer in tiny.model.layers:
        bias = layer.mlp.gate_proj.bias
        dead = bias < -1e3
        assert 0.2 <= float(dead.double().mean()) <= 0.4


def test_dense_case_fires_about_half():
    model = _tiny(mean_nnz=None)
    assert model.model.layers[0].mlp.gate_proj.bias is None  # plain random weights, no calibration device
    for s in model_gate_statistics(model, _fresh_ids((2, 64))):
        assert 0.4 * TINY["intermediate_size"] <= s["mean"] <= 0.6 * TINY["intermediate_size"], s
        assert s["dead_fraction"] == 0.0


def test_deterministic_in_seed():
    a, b = _tiny(), _tiny()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("method", ["twell", "block"])
def test_patched_model_matches_unpatched(method, device):
    model = _tiny().to(device)
    ids = _fresh_ids((2, 16)).to(device)
    with torch.no_grad():
        reference = copy.deepcopy(model)(input_ids=ids).logits
        stats_before = model_gate_statistics(model, ids)
        patch_llama(model, method=method)
        assert all(isinstance(layer.mlp, SparseGatedMLP) for layer in model.model.layers)
        with track_launches() as launched:
            logits = model(input_ids=ids).logits
    assert launched, "the patched MLPs ran no Triton kernel"
    # fp32 budget: each MLP reduces over at most N = 256 products (the up/down sums over the fired neurons, the
    # gate over K = 64) in a different order than torch's; a reordered sum of L terms differs by at most
    # ~L * 2^-24 of the sum of its absolute terms, and the RMSNorms keep the residual stream at unit scale, so
    # per layer the output moves by <= N * 2^-24 relative; 4x margin per layer, over the layers and the head.
    eps = torch.finfo(torch.float32).eps / 2
    tol = 4 * (TINY["num_hidden_layers"] + 1) * TINY["intermediate_size"] * eps * float(reference.abs().max())
    torch.testing.assert_close(logits, reference, rtol=0, atol=tol)
    stats_after = model_gate_statistics(model, ids)
    for before, after in zip(stats_before, stats_after):
        assert after == pytest.approx(before, rel=1e-3, abs=1e-3)


def test_shapes_and_parameter_count():
    assert LLAMA_SHAPES["1.5B"]["intermediate_size"] == 5632 and LLAMA_SHAPES["8B"]["num_key_value_heads"] == 8
    model = synthetic_llama("1.5B", device="meta")
    assert model.config.max_position_embeddings == 4096 and model.config.hidden_act == "relu"
    n = sum(p.numel() for p in model.parameters())
    assert round(n / 1e9, 2) == 1.36
    assert model.model.layers[0].mlp.gate_proj.bias is not None and model.model.layers[0].mlp.up_proj.bias is None
    small = synthetic_llama("8B", num_hidden_layers=1, device="meta", mean_nnz=None)
    assert small.config.num_hidden_layers == 1 and small.config.vocab_size == 128256


def test_bad_arguments():
    with pytest.raises(ValueError, match="shape"):
        synthetic_llama("3B", device="meta")
    with pytest.raises(ValueError, match="mean_nnz"):
        synthetic_llama(TINY, mean_nnz=10_000.0, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("shape, layers, params", [("SparseLM-1.5B", 28, 1.54e9), ("SparseLM-2B", 38, 2.05e9)])
def test_the_papers_released_shapes(shape, layers, params):
    """The released SparseLM models' geometry: full multi-head attention, vocab 49152, tied embeddings, rope theta
    1e5 (structure only, on the meta device)."""
    model = synthetic_llama(shape, device="meta")
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (layers, 2048, 5632)
    assert config.num_attention_heads == config.num_key_value_heads == 32 and config.vocab_size == 49152
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert abs(sum(p.numel() for p in model.parameters()) - params) < 0.01e9
