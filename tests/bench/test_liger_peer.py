"""The Liger-Kernel peer rows' wiring, without Liger or a GPU: a stand-in ``liger_kernel`` patches as Liger does
(transformers' module globals, and the model instance's norms), and the peer keeps those globals out of every other
model's way -- the Liger copy's norms are patched, its rotary function is in force only during its own calls."""

from __future__ import annotations

import sys
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402

from sparsefuse.bench.workloads import liger_peer, model  # noqa: E402


def _liger_rope(q, k, cos, sin, *args, **kwargs):
    _liger_rope.calls += 1
    return q, k


_liger_rope.calls = 0


@pytest.fixture
def fake_liger(monkeypatch):
    """``liger_kernel.transformers`` as far as the peer uses it: the patching function (globals and, given a model,
    its RMSNorm instances) and the rotary function."""

    def apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True, model=None):  # fmt: skip
        if rope:
            modeling_llama.apply_rotary_pos_emb = _liger_rope
        if fused_linear_cross_entropy:  # as older versions do: the class's forward, for every model
            modeling_llama.LlamaForCausalLM.forward = _lce_forward
        if rms_norm:
            modeling_llama.LlamaRMSNorm = type("LigerRMSNorm", (torch.nn.Module,), {})
            for module in model.modules() if model is not None else ():
                if type(module).__name__ == "LlamaRMSNorm":
                    module.liger = True

    package = types.ModuleType("liger_kernel")
    api = types.ModuleType("liger_kernel.transformers")
    api.apply_liger_kernel_to_llama = apply_liger_kernel_to_llama
    rope = types.ModuleType("liger_kernel.transformers.rope")
    rope.liger_rotary_pos_emb = _liger_rope
    llama = types.ModuleType("liger_kernel.transformers.model.llama")
    llama.lce_forward = _lce_forward
    for name, module in (
        ("liger_kernel", package),
        ("liger_kernel.transformers", api),
        ("liger_kernel.transformers.rope", rope),
        ("liger_kernel.transformers.model", types.ModuleType("liger_kernel.transformers.model")),
        ("liger_kernel.transformers.model.llama", llama),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(modeling_llama.LlamaForCausalLM, "forward", modeling_llama.LlamaForCausalLM.forward)
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    monkeypatch.setattr(modeling_llama, "LlamaRMSNorm", modeling_llama.LlamaRMSNorm)


def _lce_forward(self, *args, **kwargs):
    return "liger loss"


def test_the_training_copy_binds_the_fused_loss_to_itself_only(fake_liger):
    forward = modeling_llama.LlamaForCausalLM.forward
    base = _tiny()
    peer = liger_peer.liger_training_copy(base)
    assert modeling_llama.LlamaForCausalLM.forward is forward  # the class put back
    assert peer(torch.zeros(1, 2, dtype=torch.long)) == "liger loss"
    assert base(torch.zeros(1, 2, dtype=torch.long)) != "liger loss"


def _tiny() -> torch.nn.Module:
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=50, hidden_act="relu")  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def test_the_liger_copy_patches_itself_only(fake_liger):
    assert liger_peer.available()
    assert model.whole_model_impls("cuda") == ("unpatched", "patched", "liger")
    assert model.whole_model_impls("cpu") == ("unpatched", "patched")
    rope, norm = modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm
    base = _tiny()
    peer = liger_peer.liger_copy(base)
    assert (modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm) == (rope, norm)  # globals put back
    assert all(getattr(m, "liger", False) for m in peer.modules() if type(m).__name__ == "LlamaRMSNorm")
    assert not any(getattr(m, "liger", False) for m in base.modules())
    ids = torch.randint(0, 50, (1, 5))
    before = _liger_rope.calls
    with torch.no_grad():
        base(ids)
        assert _liger_rope.calls == before  # the unpatched model keeps transformers' rotary function
        liger_peer.peer("liger compile", lambda: peer(ids))()
        assert _liger_rope.calls == before + 1  # one attention layer, Liger's rotary function
    assert modeling_llama.apply_rotary_pos_emb is rope


def test_the_patched_row_takes_ligers_loss_only(fake_liger):
    """``patched + liger loss``: the fused loss bound to the patched model for the step only, its norms left as
    patch_llama made them."""
    from sparsefuse.integrations.transformers import patch_llama

    patched = patch_llama(_tiny())
    norms = [type(m) for m in patched.modules() if "RMSNorm" in type(m).__name__]
    ids = torch.zeros(1, 2, dtype=torch.long)
    with liger_peer.liger_loss(patched):
        assert patched(ids) == "liger loss"
    assert patched(ids) != "liger loss" and "forward" not in patched.__dict__
    assert [type(m) for m in patched.modules() if "RMSNorm" in type(m).__name__] == norms
