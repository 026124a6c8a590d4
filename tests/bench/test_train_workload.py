"""The ``train`` bench workload on a tiny synthetic Llama under the interpreter: every row runs a real training
step (the patched one through the sparse training layer's kernels) and the rows agree on the loss."""

import pytest
import torch

pytest.importorskip("transformers")

from sparsefuse import track_launches  # noqa: E402
from sparsefuse.bench.harness import Options  # noqa: E402
from sparsefuse.bench.workloads import train  # noqa: E402

TINY = dict(
    hidden_size=32,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=64,
    max_position_embeddings=64,
)


def test_train_workload_steps_patched_and_unpatched(monkeypatch, device):
    monkeypatch.setattr(train, "MODEL_SHAPE", TINY)
    monkeypatch.setattr(train, "QUICK", ((2,), (6.0,), [(2, 16)]))
    options = Options(quick=True, dtypes=(torch.float32,), device=str(device), log=lambda _: None)
    (case,) = train.train_cases(options)
    assert case.shape == "2L nnz=6 B=2 S=16" and set(case.impls) == {
        "unpatched",
        "patched",
        "unpatched compile",
        "patched compile",
    }
    (ids,) = case.make_inputs()
    losses = {}
    for impl in ("unpatched", "patched"):
        with track_launches() as launched:
            losses[impl] = float(case.impls[impl](ids))
        if impl == "patched":  # the sparse training step ran in every layer, forward and backward
            assert launched["block_sddmm_kernel"] == 2 and launched["transposed_matmul_kernel"] == 2, launched
        else:
            assert not launched, launched
    # same weights, same tokens: the LM losses agree (the patched loss adds 2e-5 * L1, about 1e-5 here)
    assert losses["patched"] == pytest.approx(losses["unpatched"], rel=1e-3)
