"""A patched Llama trains with Liger-Kernel's fused linear cross entropy: the loss is taken from the final hidden
states and the LM head's weight in chunks, so no [tokens, vocab] logits are kept, while the patched MLPs, norms and
rotary run as without it. Liger's Triton kernels run here too (through the interpreter on CPU tensors): the loss and
every gradient, the L1 term's included, equal the patched model's with transformers' own loss."""

import copy

import pytest
import torch

from sparsefuse import _backend

transformers = pytest.importorskip("transformers")
liger = pytest.importorskip("liger_kernel.transformers")
from test_twell_integration import sparsify_gates, tiny_config  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from sparsefuse.integrations.transformers import l1_loss, patch_llama  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (_backend.INTERPRET or torch.cuda.is_available()), reason="Liger's kernels need the interpreter or a GPU"
)


@pytest.mark.parametrize("train_method", ["dense", "hybrid"])
def test_patched_model_trains_with_ligers_fused_loss(train_method, device, monkeypatch):
    # some Liger versions set LlamaForCausalLM.forward for every model, as well as this one's: put it back after
    monkeypatch.setattr(modeling_llama.LlamaForCausalLM, "forward", modeling_llama.LlamaForCausalLM.forward)
    torch.manual_seed(5)
    base = transformers.LlamaForCausalLM(tiny_config(mlp_bias=True)).to(device)
    sparsify_gates(base, -0.02)
    plain = patch_llama(copy.deepcopy(base), train_method=train_method).train()
    fused = patch_llama(copy.deepcopy(base), train_method=train_method).train()
    # patch_llama already fuses the norms and rotary: Liger brings its loss only
    liger.apply_liger_kernel_to_llama(
        rope=False, rms_norm=False, swiglu=False, cross_entropy=False, fused_linear_cross_entropy=True, model=fused
    )
    ids = torch.randint(0, base.config.vocab_size, (2, 12), device=device)
    losses = []
    for model in (plain, fused):
        out = model(ids, labels=ids)
        (out.loss + 10.0 * l1_loss(model)).backward()
        losses.append(out.loss.detach())
    assert out.logits is None  # the fused loss keeps no logits
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for (name, a), (_, b) in zip(plain.named_parameters(), fused.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)
