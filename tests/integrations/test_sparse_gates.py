"""The FATReLU and dReLU gates through ``SparseGatedMLP`` and ``patch_llama``: Llama, Mistral and Qwen2 MLPs whose
``act_fn`` is a FATReLU (``nn.Threshold(t, 0)`` or a model's own class) are recognised with their threshold, a
dReLU model is patched when told, and the patched model's outputs (and, training dense, gradients) are those of the
same weights computed in float64."""

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
from test_twell_integration import tiny_config  # noqa: E402

from sparsefuse import track_launches  # noqa: E402
from sparsefuse.ffn.twell import torch_twell_mlp  # noqa: E402
from sparsefuse.integrations.transformers import patch_llama, patched_mlps, sparse_gate  # noqa: E402
from sparsefuse.nn import FATReLU, SparseGatedMLP  # noqa: E402


class ModelsOwnFATReLU(nn.Module):
    """As a released model's remote code might define it."""

    def __init__(self, threshold: float) -> None:
        super().__init__()
        self.threshold = threshold

    def forward(self, x):
        return torch.where(x > self.threshold, x, torch.zeros_like(x))


def _grid(t: torch.Tensor) -> torch.Tensor:
    """Values on a 1/64 grid: a gate pre-activation never sits within rounding of the thresholds used here."""
    return (t * 64).round() / 64


def _mlp_reference(mlp: nn.Module, x: torch.Tensor, activation: str, threshold: float) -> torch.Tensor:
    return torch_twell_mlp(
        x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, activation=activation, threshold=threshold
    )


@pytest.mark.parametrize(
    "act, expected",
    [
        (nn.ReLU(), ("relu", 0.0)),
        (nn.Threshold(0.25, 0.0), ("fatrelu", 0.25)),
        (ModelsOwnFATReLU(0.125), ("fatrelu", 0.125)),
        (FATReLU(0.5), ("fatrelu", 0.5)),
        (nn.Threshold(0.25, 1.0), None),  # not a FATReLU: it fills with 1
        (nn.SiLU(), None),
    ],
)
def test_the_gate_is_read_from_the_act_fn(act, expected):
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = LlamaMLP(tiny_config())
    mlp.act_fn = act
    assert sparse_gate(mlp) == expected
    if expected == ("relu", 0.0):
        assert sparse_gate(mlp, "drelu") == ("drelu", 0.0)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("gate", ["fatrelu", "drelu"])
def test_patched_model_matches_the_float64_forward_of_its_gate(family, gate, device):
    torch.manual_seed(0)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, hidden_act="relu")  # fmt: skip
    model = model_cls(config_cls(**kw)).to(device).float()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(_grid(p))
    mlps = [layer.mlp for layer in model.model.layers]
    if gate == "fatrelu":
        for mlp in mlps:
            mlp.act_fn = ModelsOwnFATReLU(0.0625 + 1 / 128)  # between grid points
    x = _grid(torch.randn(2, 5, 64, device=device))
    wanted = [_mlp_reference(m, x, gate, 0.0625 + 1 / 128 if gate == "fatrelu" else 0.0) for m in mlps]
    patch_llama(model, method="twell", activation="drelu" if gate == "drelu" else None)
    patched = [m for _, m in patched_mlps(model)]
    assert len(patched) == 2 and all(m.activation == gate for m in patched)
    for m, want in zip(patched, wanted):
        with torch.no_grad(), track_launches() as launched:
            got = m(x)
        assert launched["twell_up_down_fwd_kernel"] == 1, dict(launched)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    ids = torch.randint(0, 97, (2, 6), device=device)
    model(ids, labels=ids).loss.backward()  # trains: the dense ops until the firing is counted
    assert all(m.gate_proj.weight.grad is not None for m in patched)


@pytest.mark.parametrize("gate, threshold", [("fatrelu", 0.0625 + 1 / 128), ("drelu", 0.0)])
def test_the_sparse_training_step_takes_the_gate(gate, threshold, device):
    """train_method="hybrid": the block step with the module's gate gives the dense ops' gradients."""
    torch.manual_seed(1)
    dense = SparseGatedMLP(16, 48, activation=gate, threshold=threshold, train_method="dense").to(device)
    with torch.no_grad():
        for p in dense.parameters():
            p.copy_(_grid(p))
    sparse = SparseGatedMLP(16, 48, activation=gate, threshold=threshold, train_method="hybrid").to(device)
    sparse.load_state_dict(dense.state_dict())
    x = _grid(torch.randn(24, 16, device=device))
    grads = []
    for mlp in (dense, sparse):
        with track_launches() as launched:
            (mlp(x) ** 2).sum().backward()
        assert ("block_sddmm_kernel" in launched) == (mlp is sparse), dict(launched)
        grads.append([p.grad for p in mlp.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_module_gates_configure_and_refuse_what_cannot_apply(device):
    mlp = SparseGatedMLP(16, 32, activation="fatrelu", threshold=0.5).to(device)
    assert isinstance(mlp.act_fn, FATReLU) and mlp.act_fn.threshold == 0.5 and "fatrelu" in repr(mlp)
    mlp.configure(activation="drelu", threshold=0.0)
    assert type(mlp.act_fn) is nn.ReLU and mlp.activation == "drelu"
    mlp.configure()  # None keeps the gate
    assert mlp.activation == "drelu"
    with pytest.raises(ValueError, match="threshold=0.5 applies to activation='fatrelu' only"):
        SparseGatedMLP(16, 32, activation="relu", threshold=0.5)
    with pytest.raises(ValueError, match="activation must be one of"):
        SparseGatedMLP(16, 32, activation="gelu")
    with pytest.raises(ValueError, match="needs activation='fatrelu'"):
        patch_llama(transformers.LlamaForCausalLM(tiny_config()), threshold=0.1)
