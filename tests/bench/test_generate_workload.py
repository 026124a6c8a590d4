"""The ``generate`` benchmark workload without a GPU: its registration, its case list (built without a model), and
that a patched model's greedy generation equals the unpatched model's token for token in fp32 (Triton interpreter,
the TwELL kernels running), which its rows' notes report on the GPU."""

from __future__ import annotations

import copy

import pytest
import torch

import sparsefuse.ffn.synthetic
from sparsefuse import track_launches
from sparsefuse.bench import harness
from sparsefuse.bench import workloads as _workloads  # noqa: F401  (registers every workload)
from sparsefuse.bench.harness import Options
from sparsefuse.bench.workloads import generate

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TINY = dict(
    hidden_size=64,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
    max_position_embeddings=128,
)


def _never_built(*args, **kwargs):
    raise AssertionError("listing cases must not build a model")


@pytest.mark.parametrize("quick", [True, False])
def test_cases_are_listed_without_building_models(monkeypatch, quick):
    monkeypatch.setattr(sparsefuse.ffn.synthetic, "synthetic_llama", _never_built, raising=False)
    cases = harness.WORKLOADS["generate"](Options(quick=quick, device="cpu"))
    scenarios = generate.QUICK_SCENARIOS if quick else generate.SCENARIOS
    hows = generate.QUICK_HOWS if quick else generate.HOWS
    assert len(cases) == len(scenarios) * len(hows)
    new = generate.QUICK_NEW_TOKENS if quick else generate.NEW_TOKENS
    for case in cases:
        assert case.method == "wall" and set(case.impls) == {"unpatched", "patched"} and case.dtype == torch.bfloat16
        batch = int(case.shape.split("B=")[1].split()[0])
        assert case.tokens == batch * new and case.shape.split()[-1] in hows
    assert cases[0].shape == f"SparseLM-1.5B nnz=30 generate B=1 P=512 N={new} eager"


def test_patched_greedy_generation_equals_the_unpatched_models_in_fp32():
    unpatched = sparsefuse.ffn.synthetic.synthetic_llama(TINY, dtype=torch.float32, device="cpu", mean_nnz=6.0)
    from sparsefuse.integrations.transformers import patch_llama

    patched = patch_llama(copy.deepcopy(unpatched), method="twell")
    prompt = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    want = generate.greedy_generate(unpatched, prompt, 24)
    with track_launches() as launched:
        got = generate.greedy_generate(patched, prompt, 24)
    assert launched["twell_up_down_fwd_kernel"] == 2 * 24  # every step, both layers
    assert got.shape == (2, 24) and generate.first_divergence(got, want) is None
    other = want.clone()
    other[1, 5:] += 1
    assert generate.first_divergence(other, want) == 5
