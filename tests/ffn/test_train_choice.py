"""How the training step's per-weight record sizes what the block step keeps (``TrainChoice.capacity``): every pair
before an observation, 1.25x the non-zeros seen after one (rounded to the quantum), and under torch.compile the eager
calls' largest per-token need rounded up to a power of two, so that its guard changes rarely."""

import torch

from sparsefuse.ffn.hybrid.choice import TrainChoice


class _Seen:
    """A firing monitor whose estimate is a given mean of non-zeros per token."""

    def __init__(self, per_token: float) -> None:
        self.per_token = per_token

    def estimate(self) -> float:
        return self.per_token


def test_capacity_follows_the_non_zeros_seen(monkeypatch, plan):
    plan(hybrid_mlp={"capacity_quantum": 64})
    choice = TrainChoice()
    a, b = torch.nn.Parameter(torch.zeros(512, 8)), torch.nn.Parameter(torch.zeros(512, 8))
    assert choice.capacity(a, 100) == 100 * 512  # nothing seen yet: every pair
    assert choice.compiled_per_token == 0
    choice._monitors[a] = [_Seen(10.0), 0]
    assert choice.capacity(a, 100) == 1280  # 1.25 * 10 * 100 = 1250, rounded up to 64s
    assert choice.compiled_per_token == 16  # 12.5 per token -> 16
    choice._monitors[b] = [_Seen(30.0), 0]
    assert choice.capacity(b, 100) == 3776  # 3750 -> 3776
    assert choice.compiled_per_token == 64  # the largest weight's 37.5 -> 64
    choice._monitors[b] = [_Seen(3.0), 0]
    choice.capacity(b, 100)
    assert choice.compiled_per_token == 16  # b now needs 4; a still 16
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert choice.capacity(a, 100) == 1600 and choice.capacity(b, 7) == 112  # 16 per token, any weight
    choice.compiled_per_token = 0
    assert choice.capacity(a, 100) == 100 * 512
