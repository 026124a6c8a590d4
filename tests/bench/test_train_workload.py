"""The ``train`` bench workload on a tiny synthetic Llama under the interpreter: every row runs a real training
step (the patched one through the sparse training layer's kernels) and the rows agree on the loss."""

import pytest
import torch

pytest.importorskip("transformers")

from sparsefuse import track_launches  # noqa: E402
from sparsefuse.bench.harness import Options  # noqa: E402
from sparsefuse.bench.workloads import train, train_setup  # noqa: E402

TINY = dict(
    hidden_size=32,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=64,
    max_position_embeddings=64,
)


def test_train_workload_steps_patched_and_unpatched(monkeypatch, device, plan):
    monkeypatch.setattr(train_setup, "MODEL_SHAPE", TINY)
    monkeypatch.setattr(train_setup, "QUICK", ((2,), (6.0,), [(2, 16)]))
    options = Options(quick=True, dtypes=(torch.float32,), device=str(device), log=lambda _: None)
    case, largest = train.train_cases(options)
    assert case.shape == "2L nnz=6 B=2 S=16" and set(case.impls) == {
        "unpatched",
        "patched",
        "patched no replay",
        "fused only",
        "unpatched compile",
        "patched compile",
        "no FFN",
    }
    assert largest.shape == "2L nnz=6 S=16 largest B" and set(largest.impls) == {"unpatched", "patched"}
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

    # the patched model again, its FFN steps replayed from captured graphs as the default replays them on a GPU at
    # this layer size (CPU tensors replay only when told; under the interpreter a replay re-runs the captured
    # function), then with replays off for the "no replay" row's steps only
    from sparsefuse.ffn.hybrid import graphed

    # the tiny model fires ~6%: keep the block step; every layer replays, as a GPU's small layer would
    plan(context="eager", hybrid_mlp={"dense_above": 1.0, "replay_max_gate_flop": float("inf")})
    replays = graphed.GRAPH_EVENTS["replay"]
    for _ in range(2):
        replayed_loss = float(case.impls["patched"](ids))
    assert graphed.GRAPH_EVENTS["replay"] == replays + 4  # two layers, two steps
    assert replayed_loss == pytest.approx(losses["patched"], rel=1e-5)
    unreplayed_loss = float(case.impls["patched no replay"](ids))
    assert graphed.GRAPH_EVENTS["replay"] == replays + 4  # launched eagerly
    assert unreplayed_loss == pytest.approx(losses["patched"], rel=1e-5)
    graphed.release_graphs()

    # the fused-only model: the norms and the rotary embedding fused, the FFN dense (no sparse kernel)
    with track_launches() as launched:
        fused_loss = float(case.impls["fused only"](ids))
    assert launched["rms_norm_fwd_kernel"] == 5 and launched["rotary_fwd_kernel"] == 2, launched
    assert not launched["block_sddmm_kernel"] and fused_loss == pytest.approx(losses["unpatched"], rel=1e-4)

    # without its MLPs the step runs no FFN kernel and still steps every weight (their gradients are zeros)
    with track_launches() as launched:
        float(case.impls["no FFN"](ids))
    assert not launched, launched


@pytest.mark.parametrize("limit", [0, 1, 3, 4, 5, 9, 64, 200])
@pytest.mark.parametrize("start", [1, 4, 6])
def test_largest_batch_search(limit, start):
    tried = []

    def fits(b):
        tried.append(b)
        return b <= limit

    assert train.largest_batch(fits, start, 64) == min(limit, 64)
    assert len(tried) <= 16 and max(tried) <= 64


def test_largest_batch_case_and_summary(monkeypatch, device):
    """Each implementation's largest micro-batch (capped here: no GPU runs out of memory) with its tokens and note,
    and the summary's FFN share and tokens/s lines from rows."""
    from sparsefuse.bench.harness import Result

    monkeypatch.setattr(train_setup, "MODEL_SHAPE", TINY)
    monkeypatch.setattr(train_setup, "QUICK", ((1,), (6.0,), [(1, 8)]))
    monkeypatch.setattr(train, "LARGEST_BATCH_CAP", 3)
    options = Options(quick=True, dtypes=(torch.float32,), device=str(device), log=lambda _: None)
    _, largest = train.train_cases(options)
    (dummy,) = largest.make_inputs()
    for impl in ("unpatched", "patched"):
        assert torch.isfinite(largest.impls[impl](dummy))
        assert largest.impl_tokens(impl) == 3 * 8 and largest.impl_note(impl) == "largest B=3"

    def row(shape, impl, us, tok=float("nan"), note=""):
        return Result("train", shape, "bfloat16", "fwd+bwd", impl, median_us=us, tokens_per_s=tok, note=note)

    lines = train.summary(
        [
            row("24L nnz=30 B=4 S=2048", "unpatched", 200.0),
            row("24L nnz=30 B=4 S=2048", "patched", 160.0),
            row("24L nnz=30 B=4 S=2048", "fused only", 180.0),
            row("24L nnz=30 B=4 S=2048", "no FFN", 130.0),
            row("24L nnz=30 S=2048 largest B", "unpatched", 1.0, 1000.0, "largest B=8"),
            row("24L nnz=30 S=2048 largest B", "patched", 1.0, 1400.0, "largest B=12"),
        ]
    )
    text = "\n".join(lines)
    assert "| 24L nnz=30 B=4 S=2048 | 35% | 1.54x | 1.25x | 1.11x |" in text
    assert "patched largest B=12, 1400 tok/s (1.40x)" in text


def test_largest_batch_note_says_what_the_allocator_said(monkeypatch):
    """A search that stops at an out-of-memory error names the smallest batch that failed and the allocator's figures
    (asked, free, allocated, cached), so an early stop explains itself in the results."""
    from types import SimpleNamespace

    message = (
        "CUDA out of memory. Tried to allocate 12.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 3.21 GiB "
        "is free. Of the allocated memory 70.10 GiB is allocated by PyTorch, and 5.20 GiB is reserved by PyTorch but "
        "unallocated."
    )

    class Trainer:
        model = SimpleNamespace(config=SimpleNamespace(vocab_size=11), device="cpu", named_modules=lambda: [])
        optimizer = SimpleNamespace(zero_grad=lambda set_to_none: None)

        def step(self, ids):
            if ids.shape[0] > 6:
                raise torch.cuda.OutOfMemoryError(message)
            return torch.zeros(())

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    models = SimpleNamespace(get=lambda key, impl, alone: Trainer())
    largest = train._LargestBatch(models, (24, 30.0), batch=4, seq=8)
    largest.step("patched")
    assert (
        largest.note("patched")
        == "largest B=6 (B=7: asked 12.00 GiB, 3.21 GiB free, 70.10 GiB allocated, 5.20 GiB cached)"
    )


def test_summary_of_distributed_rows():
    """Rows of the distributed mode (an N=1 and an N=2 run merged into one set): tokens/s per GPU, the patched
    speed-up and the scaling efficiency per engine, each patched row's note; the single-GPU table leaves them out."""
    from sparsefuse.bench.harness import Result

    def row(shape, impl, tok, note=""):
        return Result("train", shape, "bfloat16", "fwd+bwd", impl, median_us=1e6 * 8192 / tok, tokens_per_s=tok,
                      note=note)  # fmt: skip

    rows = [
        row("24L nnz=30 B=4 S=2048 ddp x1", "unpatched", 40000.0),
        row("24L nnz=30 B=4 S=2048 ddp x1", "patched", 50000.0, "ddp on 1x H100; ok"),
        row("24L nnz=30 B=4 S=2048 ddp x2", "unpatched", 36000.0),
        row("24L nnz=30 B=4 S=2048 ddp x2", "patched", 47500.0, "ddp on 2x H100; ok"),
        row("24L nnz=30 B=4 S=2048 fsdp2 x2", "unpatched", 30000.0),  # no 1-GPU FSDP2 rows: no efficiency
        row("24L nnz=30 B=4 S=2048 fsdp2 x2", "patched", 33000.0, "fsdp2 on 2x H100; ok"),
    ]
    text = "\n".join(train.summary(rows))
    assert "| 24L nnz=30 B=4 S=2048 | ddp | 1 | 40000 / 50000 | 1.25x | 1.00 / 1.00 |" in text
    assert "| 24L nnz=30 B=4 S=2048 | ddp | 2 | 36000 / 47500 | 1.32x | 0.90 / 0.95 |" in text
    assert "| 24L nnz=30 B=4 S=2048 | fsdp2 | 2 | 30000 / 33000 | 1.10x | nan / nan |" in text
    assert "- 24L nnz=30 B=4 S=2048 ddp x2 patched: ddp on 2x H100; ok" in text
    assert "FFN share" not in text  # no single-GPU rows

    single = [row("24L nnz=30 B=4 S=2048", "unpatched", 40000.0), row("24L nnz=30 B=4 S=2048", "patched", 40000.0)]
    text = "\n".join(train.summary(single + rows))
    assert "| 24L nnz=30 B=4 S=2048 | nan% |" in text and "ddp x2" not in text.split("Several GPUs")[0]
    assert "| 24L nnz=30 B=4 S=2048 | ddp | 2 |" in text
