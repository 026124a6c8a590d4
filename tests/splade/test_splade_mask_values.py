"""SPLADE pooling with attention masks that are not 0/1: a kept position's score is weighted by its mask value
(``max_s log1p(relu(x_s)) * mask_s``, naver/splade's expression) and a position whose mask is 0 is skipped, on every
backend and schedule, forward and backward, against the float64 reference's autograd (helpers and tolerances of
test_splade)."""

import pytest
import torch
from conftest import DEVICE, assert_backend
from test_splade import check_forward, check_gradients, make_inputs

from sparsefuse import track_launches
from sparsefuse.splade import splade_pool, splade_pool_op, torch_splade_pool
from sparsefuse.splade.head import launch

WEIGHTS = (0.0, 0.25, 0.5, 1.0)


def weighted_mask(B, S, dtype, device):
    """Row 0: every value of WEIGHTS at random (tiles of differing weights); row 1: 0.5 on a prefix, then padding
    (tiles of one weight that is not 1); row 2: 1 on a prefix, then padding (the 0/1 case in the same call)."""
    g = torch.Generator().manual_seed(1)
    m = torch.tensor(WEIGHTS)[torch.randint(0, len(WEIGHTS), (B, S), generator=g)]
    m[0, 0] = 0.25  # one kept position at least
    m[1:] = 0.0
    m[1, : S - S // 3] = 0.5
    m[2, : S // 2 + 1] = 1.0
    return m.to(dtype).to(device)


def inputs_with_mask(B, S, H, V, dtype, device, mask_dtype):
    hidden, _, bias, _ = make_inputs(B, S, H, V, dtype, device, mask=None)
    mask = weighted_mask(B, S, mask_dtype, device)
    # make_inputs separates near-tied maxima of the raw logits; here the weighted scores compete
    _, weight, _, _ = make_inputs(B, S, H, V, dtype, device, mask=None)
    weight = separate_weighted_maxima(hidden, weight, bias, mask)
    return hidden, weight, bias, mask


def separate_weighted_maxima(hidden, weight, bias, mask, rounds=50):
    """Re-draw the decoder rows whose largest weighted score comes within a few fp32 roundings of the runner-up in
    some batch row (the float64 reference and an fp32 kernel may then pick different positions; see test_splade)."""
    S, H = hidden.shape[1], hidden.shape[2]
    kept = mask.unsqueeze(-1) != 0
    for _ in range(rounds):
        logits = hidden.double() @ weight.double().t() + bias.double()
        scores = torch.where(kept, torch.log1p(logits.relu()) * mask.unsqueeze(-1).double(), float("-inf"))
        top2 = scores.topk(2, dim=1).values
        scale = 1 + (hidden.double().abs() @ weight.double().abs().t()).amax(dim=1)
        redraw = ((top2[:, 0] - top2[:, 1] < 256 * torch.finfo(torch.float32).eps * scale) & (top2[:, 0] > 0)).any(0)
        if S < 2 or not bool(redraw.any()):
            break
        weight = weight.clone()
        weight[redraw] = (torch.randn(int(redraw.sum()), H, device=weight.device) / H**0.5).to(weight.dtype)
    return weight


def force_schedule(plan, persistent, tma):
    config = launch.FwdConfig(16, 32, 16, num_warps=4, num_stages=1, persistent=persistent, tma=tma)
    plan(splade={"fwd_config": config})


def test_a_half_mask_halves_the_max_pooled_scores(device):
    """The report that started this: a 0.5 mask pooled like a 1 mask by the kernels, like a 0.5 weight by the
    reference."""
    hidden, weight, bias, _ = make_inputs(2, 9, 16, 40, torch.float32, device, mask=None)
    full = splade_pool(hidden, weight, bias)
    half = splade_pool(hidden, weight, bias, torch.full((2, 9), 0.5, device=device))
    torch.testing.assert_close(half, 0.5 * full, rtol=2e-7, atol=0)


@pytest.mark.parametrize("pooling", ["max", "sum"])
@pytest.mark.parametrize(
    "persistent, tma", [(False, False), (True, False), (False, True), (True, True)], ids=["tile", "pers", "tma", "both"]
)
@pytest.mark.parametrize("S", [40, 9], ids=["combine", "single"])
def test_every_schedule_weighs_scores_by_the_mask(S, persistent, tma, pooling, plan, device):
    """Each forward schedule (sequences over several tiles, with the combine kernel, and within one), with and
    without the saved argmax, and both backwards; mask values 0, 0.25, 0.5, 1."""
    if device.type == "cuda" and tma and torch.cuda.get_device_capability(device)[0] != 9:
        pytest.skip("TMA loads are used on Hopper only")
    force_schedule(plan, persistent, tma)
    hidden, weight, bias, mask = inputs_with_mask(3, S, 32, 70, torch.float16, device, torch.float32)
    assert launch._tma_eligible(hidden, weight) or not tma
    with track_launches() as launched:
        check_forward(hidden, weight, bias, mask, pooling)
    assert launched["splade_fwd_combine_kernel"] == (1 if S > 16 else 0)
    assert launched["splade_fwd_kernel:weighted_tiles"] == (pooling == "max")  # rows 0's tiles of differing weights
    check_gradients(hidden, weight, bias, mask, pooling)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("pooling", ["max", "sum"])
def test_default_schedule_and_mask_dtypes(pooling, mask_dtype, dtype, device):
    hidden, weight, bias, mask = inputs_with_mask(3, 40, 24, 50, dtype, device, mask_dtype)
    check_forward(hidden, weight, bias, mask, pooling)
    check_gradients(hidden, weight, bias, mask, pooling)


@pytest.mark.parametrize("pooling", ["max", "sum"])
def test_integer_mask_values_weigh_too(pooling, device):
    """An integer mask is a weight like a float one (2 doubles a position's score); bool masks are 0/1."""
    hidden, weight, bias, _ = make_inputs(2, 30, 16, 40, torch.float32, device, mask=None)
    mask = torch.ones(2, 30, dtype=torch.int64, device=device)
    mask[0, 10:20] = 2
    mask[1, 25:] = 0
    weight = separate_weighted_maxima(hidden, weight, bias, mask)
    out, ref = check_forward(hidden, weight, bias, mask, pooling)
    assert not torch.allclose(out, splade_pool(hidden, weight, bias, mask != 0, pooling=pooling))
    check_gradients(hidden, weight, bias, mask, pooling)


def test_saved_argmax_and_slope_follow_the_weighted_scores(monkeypatch, device):
    """The max-pooling aux the backward reads: the first position of the largest weighted score and the derivative
    mask / (1 + logit) there, from the kernels and from the plain-torch path alike."""
    from sparsefuse import Backend
    from sparsefuse.splade.head import op

    hidden, weight, bias, mask = inputs_with_mask(3, 40, 32, 70, torch.float32, device, torch.float32)
    assert_backend(hidden)
    out, argmax, slope = splade_pool_op(hidden, weight, bias, mask, "max", True)
    logits = hidden.double() @ weight.double().t() + bias.double()
    weights = mask.double().unsqueeze(-1).expand_as(logits)
    scores = torch.where(weights != 0, torch.log1p(logits.relu()) * weights, float("-inf"))
    top, first = torch.max(scores, dim=1)
    positive = top > 0
    assert torch.equal(argmax[positive].long(), first[positive])
    x = logits.gather(1, first.unsqueeze(1)).squeeze(1)
    c = weights.gather(1, first.unsqueeze(1)).squeeze(1)
    expected = torch.where(positive, c / (1 + x.clamp_min(0)), 0.0)
    torch.testing.assert_close(slope.double(), expected, rtol=1e-5, atol=0)
    monkeypatch.setattr(op, "backend_for", lambda *tensors: Backend.TORCH)
    _, ref_argmax, ref_slope = splade_pool_op(hidden, weight, bias, mask, "max", True)
    assert torch.equal(ref_argmax[positive], argmax[positive])
    torch.testing.assert_close(ref_slope.double(), expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("backend", ["kernels", "torch"])
@pytest.mark.parametrize("pooling", ["max", "sum"])
def test_garbage_at_masked_positions_never_leaks(pooling, backend, monkeypatch, device):
    """NaN and inf in the hidden states of masked positions: the output and every gradient equal those with zeros
    there (0 * NaN is NaN, so a masked position must be skipped, not multiplied by 0)."""
    from sparsefuse import Backend
    from sparsefuse.splade.head import op

    if backend == "torch":
        monkeypatch.setattr(op, "backend_for", lambda *tensors: Backend.TORCH)
    hidden, weight, bias, mask = inputs_with_mask(3, 40, 16, 45, torch.float32, device, torch.float32)
    masked = (mask == 0).unsqueeze(-1)
    clean = hidden.masked_fill(masked, 0.0)
    dirty = clean.clone()
    dirty[0][masked[0, :, 0]] = float("nan")
    dirty[1][masked[1, :, 0]] = float("inf")
    grad = torch.randn(3, 45, device=device)
    results = []
    for h in (clean, dirty):
        leaves = [t.clone().requires_grad_() for t in (h, weight, bias)]
        out = splade_pool(*leaves, mask, pooling=pooling)
        results.append((out, *torch.autograd.grad(out, leaves, grad)))
    (out, gh, gw, gb), (dirty_out, dirty_gh, dirty_gw, dirty_gb) = results
    assert not bool(out.isnan().any())
    assert torch.equal(dirty_out, out) and torch.equal(dirty_gw, gw) and torch.equal(dirty_gb, gb)
    assert torch.equal(dirty_gh, gh) and not bool(gh[masked.expand_as(gh)].any())
    ref = torch_splade_pool(dirty.double(), weight.double(), bias.double(), mask, pooling)
    assert not bool(ref.isnan().any())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
