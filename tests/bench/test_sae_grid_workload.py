"""The ``sae_decode_grid`` workload: its L0 distributions, activations with exactly those counts, every method on
a tiny case under the interpreter agreeing with the dense product, and the summary's ratios to the fastest."""

import pytest
import torch

from sparsefuse.bench.harness import Options, Result
from sparsefuse.bench.workloads import sae_grid


def test_l0_distributions():
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sae_grid.token_l0s(5, 100, 7, "constant", g), torch.full((5,), 7))
    full = sae_grid.token_l0s(5, 100, 7, "full rows", g)
    assert full.tolist() == [100, 100, 7, 7, 7]
    for s in ("0.3", "0.6", "1.0"):
        l0 = sae_grid.token_l0s(20000, 10**6, 64, f"lognormal {s}", g)
        assert abs(l0.float().mean().item() / 64 - 1) < 0.05 and int(l0.min()) >= 0
    with pytest.raises(ValueError, match="unknown L0 distribution"):
        sae_grid.token_l0s(2, 10, 3, "uniform", g)


def test_grid_acts_have_the_requested_counts(device):
    l0 = torch.tensor([0, 3, 50, 7])
    acts = sae_grid.grid_acts(4, 50, l0, torch.float32, str(device), seed=1)
    assert torch.equal((acts != 0).sum(1).cpu(), l0) and bool((acts >= 0).all())


def test_every_method_agrees_on_a_tiny_case_and_the_summary(monkeypatch, device):
    monkeypatch.setattr(sae_grid, "SHAPES", [(256, 16, 8, torch.float32)])
    options = Options(quick=True, dtypes=(torch.float32,), device=str(device), log=lambda _: None)
    cases = sae_grid.sae_decode_grid_cases(options)
    assert [c.shape.split(" B=")[0] for c in cases] == sae_grid.DISTRIBUTIONS
    assert set(cases[0].impls) == set(sae_grid.METHODS)
    case = cases[-1]  # "full rows": two tokens over fixed's capacity
    assert case.shape.endswith("(over 16: 2)")
    acts, w = case.make_inputs()
    ref = acts.double() @ w.double()
    for impl, fn in case.impls.items():
        torch.testing.assert_close(fn(acts, w).double(), ref, rtol=1e-4, atol=1e-4, msg=impl)
    rows = [
        Result("sae_decode_grid", "x", "float32", "fwd", m, median_us=t)
        for m, t in zip(sae_grid.METHODS, [2, 1, 3, 9, 4])
    ]
    text = "\n".join(sae_grid.summary(rows))
    assert "| x | float32 | scan | 2.00x | 1.00x | 3.00x | 9.00x | 4.00x |" in text
