"""The paper's L1 term through a patched Llama: layers set to ``l1_on="hidden"`` record the mean per element of
|h| (h = h_g * h_u), and ``l1_loss(model, layers="mean", l1_on="hidden")`` is the TwELL paper's eq. 2; the loss's
gradients equal the unpatched model's with that term written out by hand."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from test_twell_integration import sparsify_gates, tiny_config  # noqa: E402

from sparsefuse.integrations.transformers import l1_loss, patch_llama, patched_mlps  # noqa: E402
from sparsefuse.nn.ffn import SparseGatedMLP  # noqa: E402


def _models(device):
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(tiny_config(mlp_bias=True)).to(device)
    sparsify_gates(model, -0.02)  # some of each layer's gate fires on a few tokens
    ref = transformers.LlamaForCausalLM(model.config).to(device)
    ref.load_state_dict(model.state_dict())
    return model, ref


@pytest.mark.parametrize("train_method", ["dense", "hybrid"])
def test_the_papers_term_averaged_over_layers(train_method, device):
    model, ref = _models(device)
    patch_llama(model, train_method=train_method)
    for _, m in patched_mlps(model):
        m.l1_on = "hidden"
    patch_llama(model, train_method=train_method)  # patching again keeps each layer's choice of term
    assert all(m.l1_on == "hidden" for _, m in patched_mlps(model))
    ids = torch.randint(0, 97, (2, 6), device=device)
    out = model(ids, labels=ids)
    l1 = l1_loss(model, layers="mean", l1_on="hidden")
    torch.testing.assert_close(l1_loss(model), l1 * model.config.num_hidden_layers)  # the default: summed
    coef = 50.0  # large enough that the term's gradient shows beside the loss's
    (out.loss + coef * l1).backward()
    # by hand: eq. 2, the mean over layers of each layer's mean |relu(x W_g^T + b_g) * (x W_u^T + b_u)|
    hidden = []
    hooks = [
        layer.mlp.down_proj.register_forward_hook(lambda m, a, o: hidden.append(a[0])) for layer in ref.model.layers
    ]
    ref_out = ref(ids, labels=ids)
    for h in hooks:
        h.remove()
    ref_l1 = sum(h.float().abs().sum() / h.numel() for h in hidden) / len(hidden)
    (ref_out.loss + coef * ref_l1).backward()
    torch.testing.assert_close(out.loss, ref_out.loss)
    torch.testing.assert_close(l1, ref_l1)
    assert float(l1) > 0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    up_grad = model.model.layers[0].mlp.up_proj.weight.grad
    # the term reaches W_u: without it the up gradient is the loss's alone
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    assert not torch.allclose(model.model.layers[0].mlp.up_proj.weight.grad, up_grad)


def test_l1_loss_checks_the_term_and_the_reduction(device):
    model, _ = _models(device)
    patch_llama(model, train_method="hybrid")
    ids = torch.randint(0, 97, (2, 6), device=device)
    model(ids, labels=ids)
    with pytest.raises(ValueError, match=r"l1_loss\(l1_on='hidden'\): 2 patched layers take their L1 term"):
        l1_loss(model, l1_on="hidden")
    with pytest.raises(ValueError, match="layers must be 'sum' or 'mean'"):
        l1_loss(model, layers="max")
    with pytest.raises(ValueError, match="l1_on must be one of"):
        l1_loss(model, l1_on="up")
    assert l1_loss(model, l1_on="gate") is not None


def test_module_option_and_the_submodule_path(device):
    """``SparseGatedMLP(l1_on=...)`` is checked; a forward that must call the submodules (a hook on one) records the
    hidden term from h as the hooks left it; ``patch_llama(l1_on=...)`` sets every layer."""
    with pytest.raises(ValueError, match="l1_on must be one of"):
        SparseGatedMLP(16, 32, l1_on="up")
    mlp = SparseGatedMLP(16, 32, l1_on="hidden").to(device)
    x = torch.randn(3, 16, device=device, requires_grad=True)
    mlp(x)
    h = torch.relu(mlp.gate_proj(x)) * mlp.up_proj(x)
    torch.testing.assert_close(mlp.last_l1, h.abs().sum() / h.numel())
    mlp.up_proj.register_forward_hook(lambda m, a, o: 2 * o)  # the hook's output is what h is made of
    mlp(x)
    torch.testing.assert_close(mlp.last_l1, 2 * h.abs().sum() / h.numel())
    model, _ = _models(device)
    patch_llama(model, l1_on="hidden")
    assert all(m.l1_on == "hidden" for _, m in patched_mlps(model))
    patch_llama(model)  # None: each layer keeps its own
    assert all(m.l1_on == "hidden" for _, m in patched_mlps(model))
