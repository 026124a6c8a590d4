"""How the training step's per-weight record sizes what the block step keeps (``TrainChoice.capacity``): every pair
before an observation, 1.25x the non-zeros seen after one (rounded to the quantum), and under torch.compile the eager
calls' largest per-token need rounded up to a power of two, so that its guard changes rarely."""

import torch

from sparsefuse import planning
from sparsefuse.ffn.hybrid.choice import PLANNER, TrainChoice


def _seen(weight: torch.Tensor, per_token: float) -> None:
    """Hand the planner's estimate for ``weight`` a step of 100 tokens firing ``per_token`` neurons each (on the CPU
    the monitor folds it in at once; every call is an observation)."""
    with planning(hybrid_mlp={"observe_every": 1}):
        PLANNER.estimates.feed(weight, lambda: torch.tensor([round(per_token * 100), 100]))


def test_capacity_follows_the_non_zeros_seen(monkeypatch, plan):
    plan(hybrid_mlp={"capacity_quantum": 64})
    choice = TrainChoice()
    a, b = torch.nn.Parameter(torch.zeros(512, 8)), torch.nn.Parameter(torch.zeros(512, 8))
    assert choice.capacity(a, 100) == 100 * 512  # nothing seen yet: every pair
    assert choice.compiled_per_token == 0
    _seen(a, 10.0)
    assert choice.capacity(a, 100) == 1280  # 1.25 * 10 * 100 = 1250, rounded up to 64s
    assert choice.compiled_per_token == 16  # 12.5 per token -> 16
    _seen(b, 30.0)
    assert choice.capacity(b, 100) == 3776  # 3750 -> 3776
    assert choice.compiled_per_token == 64  # the largest weight's 37.5 -> 64
    _seen(b, 3.0)
    choice.capacity(b, 100)
    assert choice.compiled_per_token == 16  # b now needs 4; a still 16
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert choice.capacity(a, 100) == 1600 and choice.capacity(b, 7) == 112  # 16 per token, any weight
    choice.compiled_per_token = 0
    assert choice.capacity(a, 100) == 100 * 512


def test_training_estimates_live_in_the_planner(plan):
    """The step's firing counts feed the hybrid planner's per-weight estimate: the first step and every
    ``observe_every``-th after are observed, and the planner's ``clear`` forgets them."""
    plan(hybrid_mlp={"observe_every": 3})
    choice, w = TrainChoice(), torch.nn.Parameter(torch.zeros(512, 8))
    assert choice.firing(w) is None
    for step, fired in enumerate((10, 20, 30, 40, 50)):  # steps 0 and 3 are observed
        choice.observe(w, torch.full((4,), fired, dtype=torch.int32))
        assert choice.firing(w) == (10 if step < 3 else 40) / 512
    PLANNER.clear()
    assert choice.firing(w) is None


def test_the_planners_clear_resets_the_training_record(plan):
    """What the shared record derives from the estimates (the compiled calls' capacity, the captured buckets) goes
    with them."""
    from sparsefuse.ffn.hybrid.choice import TRAIN_CHOICE

    plan(hybrid_mlp={"capacity_quantum": 1})
    w = torch.nn.Parameter(torch.zeros(512, 8))
    _seen(w, 10.0)
    assert TRAIN_CHOICE.bucketed_capacity(w, 4) == 4 * 16 and TRAIN_CHOICE.capacity(w, 4) < 4 * 512
    assert TRAIN_CHOICE.compiled_per_token == 16
    PLANNER.clear()
    assert TRAIN_CHOICE.compiled_per_token == 0 and TRAIN_CHOICE.bucketed_capacity(w, 4) is None
