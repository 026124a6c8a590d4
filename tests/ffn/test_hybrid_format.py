"""The TwELL paper's own training format (``layout="hybrid"``: an ELL of ``width`` slots per token plus whole backup
rows for the tokens over it): every overflow case exact against the float64 reference, gradcheck in float64, and
what its backward keeps."""

import pytest
import torch
from test_hybrid_train import _check, _leaves, _run

from sparsefuse.ffn.hybrid import REBUILDS, hybrid_mlp
from sparsefuse.ffn.synthetic import synthetic_ffn


@pytest.mark.parametrize(
    "M, N, width, backup, dense_rows, zero",
    [
        (16, 300, 16, 2, (3,), False),  # a token firing all 300 neurons (over the width): kept whole
        (20, 64, 2, 1, (), False),  # most tokens over the width, more than the backup: rebuilt larger, exact
        (12, 64, 8, None, (), True),  # an all-zero batch: no neuron fires
        (0, 64, 8, None, (), False),  # an empty batch
        (9, 300, 300, 0, (0, 8), False),  # width covers every row; no backup at all
    ],
)
def test_every_overflow_case_is_exact(M, N, width, backup, dense_rows, zero, device):
    leaves = _leaves(M, 16, N, torch.float32, device, True, seed=2, dense_rows=dense_rows, zero=zero)
    dy = torch.randn(M, 16, device=device)
    before = dict(REBUILDS)
    out, grads = _run(leaves, dy, coef=0.5, layout="hybrid", width=width, backup_rows=backup)
    _check(leaves, dy, 0.5, out, grads)
    counts = out.token_counts.cpu()
    assert counts.shape == (M,)
    if dense_rows:
        assert all(int(counts[r]) == N for r in dense_rows)
    if zero:
        assert int(counts.sum()) == 0 and float(out.l1.detach()) == 0.0
    overflowing = int((counts > width).sum())
    R = -(-M // 8) if backup is None else backup
    assert REBUILDS["rebuilt"] - before["rebuilt"] == (1 if overflowing > R else 0)


def test_gradcheck_float64():
    leaves = _leaves(6, 5, 12, torch.float64, "cpu", True, seed=3)

    def step(*args):
        out = hybrid_mlp(*args[:4], b_gate=args[4], b_up=args[5], b_down=args[6], width=2, backup_rows=1)
        return out.y, out.l1

    assert torch.autograd.gradcheck(step, tuple(leaves), eps=1e-6, atol=1e-6)


def test_backward_keeps_no_dense_activations(device):
    """What autograd saves for the backward: x, the weights, and the Hybrid parts -- at ~6 of 256 neurons per token
    (ELL width 16, a backup of M/8 rows) none of it is [M, N], and the activations kept are ~1/8 of what the dense
    block keeps."""
    ffn = synthetic_ffn(64, 256, dtype=torch.float32, device=device, seed=4)
    x = ffn.make_input(128, 6.0).requires_grad_()
    weights = [w.clone().requires_grad_() for w in (ffn.w_gate, ffn.w_up, ffn.w_down)]
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hybrid_mlp(x, *weights, layout="hybrid", width=16).y.sum().backward()
    inputs = {t.untyped_storage().data_ptr() for t in [x, *weights]}  # x and weights, or views of them
    activations = sum(t.numel() * t.element_size() for t in saved if t.untyped_storage().data_ptr() not in inputs)
    assert all(tuple(t.shape) != (128, 256) for t in saved)
    dense_keeps = 4 * 128 * 256 * 4  # gate, relu, up, product outputs of the dense block
    assert activations < dense_keeps / 6, (activations, dense_keeps)
