"""A patched Llama under torch.compile(fullgraph=True) as a user compiles it: straight away, with no eager call
first. Its FFN ops decide their method when the compiled graph runs (from each gate weight's estimate, counted
then), so the graph holds no frozen guess, and repeated calls and training steps do not recompile."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from test_twell_integration import sparsify_gates, tiny_config  # noqa: E402

from sparsefuse import planning, track_launches  # noqa: E402
from sparsefuse.ffn.twell import auto as twell_auto  # noqa: E402
from sparsefuse.integrations.transformers import patch_llama, patched_mlps  # noqa: E402


def _twell_iff_sparse(question, estimate):
    """A cost model of the test's own: TwELL while fewer than 10 gate neurons fire per token, else dense."""
    return {"twell": 1e-6 if estimate < 10 else 1.0, "block": 2.0, "dense": 1e-3}


def _model(device, bias: float):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_config(num_hidden_layers=2, mlp_bias=True)).to(device)
    sparsify_gates(model, bias)
    return patch_llama(model)


def _compiled_calls(compiled, n: int, device) -> list:
    counts = []
    for seed in range(n):
        ids = torch.randint(0, 97, (2, 6), device=device, generator=torch.Generator(device).manual_seed(seed))
        with torch.no_grad(), track_launches() as launched:
            compiled(ids)
        counts.append(launched["twell_up_down_fwd_kernel"])
    return counts


@pytest.mark.parametrize("bias, sparse", [(-1.0, True), (0.0, False)])
def test_compiled_first_inference_follows_each_layers_firing_without_recompiles(bias, sparse, device):
    model = _model(device, bias)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with planning(twell_mlp={"measured_s": _twell_iff_sparse}):
        counts = _compiled_calls(compiled, 3, device)
    assert counts == ([2, 2, 2] if sparse else [0, 0, 0]), counts  # one TwELL launch per layer, or none
    for _, mlp in patched_mlps(model):  # counted when the graph ran: no eager call was made
        assert twell_auto.ESTIMATES.monitor(mlp.gate_proj.weight) is not None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_compiled_training_steps_do_not_recompile(device):
    model = _model(device, -1.0)
    patch_llama(model, train_method="hybrid")
    ids = torch.randint(0, 97, (2, 6), device=device)
    model(ids, labels=ids).loss.backward()  # one eager step: the training layout's choice settles
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for seed in range(3):
        ids = torch.randint(0, 97, (2, 6), device=device, generator=torch.Generator(device).manual_seed(seed))
        compiled(ids, labels=ids).loss.backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
