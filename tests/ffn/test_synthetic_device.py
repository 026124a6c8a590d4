"""The synthetic builders' ``device``: the default runs on any machine (CUDA when available, else the CPU), and a
device that cannot be used is a ValueError naming the argument, not an AssertionError from deep in torch's init."""

import pytest
import torch

from sparsefuse.ffn.synthetic import synthetic_ffn, synthetic_llama

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    vocab_size=200,
)
DEFAULT = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# device strings no machine can use, and, without a GPU, CUDA itself (the AssertionError case)
UNUSABLE = ["bogus", "cuda:99", *([] if torch.cuda.is_available() else ["cuda", torch.device("cuda", 0)])]


def _device_type(t: torch.Tensor) -> torch.device:
    return torch.device(t.device.type)


def test_synthetic_ffn_default_device():
    ffn = synthetic_ffn(16, 32, dtype=torch.float32)
    assert _device_type(ffn.w_gate) == DEFAULT
    assert _device_type(ffn.make_input(4, 5.0)) == DEFAULT


def test_synthetic_llama_default_device():
    pytest.importorskip("transformers")
    model = synthetic_llama(TINY, mean_nnz=8.0, dtype=torch.float32, calibration_tokens=64)
    assert {torch.device(p.device.type) for p in model.parameters()} == {DEFAULT}


@pytest.mark.parametrize("device", UNUSABLE, ids=str)
def test_unusable_device_names_the_argument(device):
    with pytest.raises(ValueError, match=r"synthetic_ffn: device="):
        synthetic_ffn(16, 32, device=device)
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match=r"synthetic_llama: device="):
        synthetic_llama(TINY, device=device)


def test_device_of_the_wrong_type():
    with pytest.raises(TypeError, match="synthetic_ffn: device must be"):
        synthetic_ffn(16, 32, device=1.5)  # type: ignore[arg-type]
