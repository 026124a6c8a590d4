"""Fused SPLADE head against the float64 reference (interpreter: fp16/fp32 tl.dot only; bf16 in the GPU tests).

Tolerances: ``testing.compare_to_reference`` (twice plain torch's error in the same dtype plus the dtype's rounding)
with one documented extra: the kernel sums products in fp32 where torch rounds to the dtype, and a sum's rounding
error scales with the sum of its terms' magnitudes, not with the result, so every output gets
``eps(accumulation) * max(sum |terms|)`` (``bench.check.reduction_allowance``), with the terms taken from the
float64 computation itself.
"""

import pytest
import torch
from conftest import DEVICE, assert_backend

from sparsefuse import track_launches
from sparsefuse._backend import poison_outputs
from sparsefuse.bench.check import reduction_allowance
from sparsefuse.nn.splade import SpladeHead
from sparsefuse.splade import splade_pool, splade_pool_backward_op, splade_pool_op, torch_splade_pool
from sparsefuse.testing import assert_close_to_reference

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
EPS32 = torch.finfo(torch.float32).eps


def make_inputs(B, S, H, V, dtype, device, *, bias=True, mask="padded", negative_columns=True):
    """Random hidden ~ N(0, 1), weight ~ N(0, 1/H) (logits of unit scale, both signs), bias ~ N(0, 0.5) with a few
    columns pushed far negative (they must score exactly 0); mask: random lengths plus a fully masked row."""
    hidden = torch.randn(B, S, H).to(dtype)
    weight = (torch.randn(V, H) / max(H, 1) ** 0.5).to(dtype)
    b = torch.randn(V) * 0.5
    if negative_columns:
        b[::7] = -60.0
    if mask is None:
        m = None
    else:
        lengths = torch.randint(1, S + 1, (B,)) if S else torch.zeros(B, dtype=torch.int64)
        m = (torch.arange(S)[None, :] < lengths[:, None]).to(torch.int64)
        if B > 1:
            m[-1] = 0  # a fully masked row
        m = {"padded": m, "bool": m.bool(), "float": m.to(dtype)}[mask]
    hidden, weight, m = hidden.to(device), weight.to(device), m.to(device) if m is not None else m
    b = b.to(device) if bias else None
    return [hidden, separate_maxima(hidden, weight, b, m), b, m]


def separate_maxima(hidden, weight, bias, mask, rounds=50):
    """Re-draw the decoder rows whose maximum over the sequence comes within a few fp32 roundings of the runner-up
    in some batch row. There the float64 reference and any fp32-accumulating kernel may pick different positions,
    and max pooling sends the whole gradient to the one picked (exact ties are tested separately)."""
    B, S, H = hidden.shape
    for _ in range(rounds):
        if S < 2 or weight.shape[0] == 0:
            break
        logits = float64_logits(hidden, weight, None)
        if mask is not None:
            logits = logits.masked_fill(mask.unsqueeze(-1) == 0, float("-inf"))
        top2 = logits.topk(2, dim=1).values  # [B, 2, V]
        scale = (hidden.double().abs() @ weight.double().abs().t()).amax(dim=1)  # [B, V]
        close = (top2[:, 0] - top2[:, 1]) < 64 * EPS32 * scale
        if bias is not None:
            close &= top2[:, 0] + bias.double() > 0  # a non-positive max passes no gradient anyway
        redraw = close.any(dim=0)  # [V]
        if not bool(redraw.any()):
            break
        weight = weight.clone()
        weight[redraw] = (torch.randn(int(redraw.sum()), H, device=weight.device) / max(H, 1) ** 0.5).to(weight.dtype)
    return weight


def pool_from_logits(logits, mask, pooling):
    """The reference's pooling applied to given logits (to differentiate with respect to the logits)."""
    scores = torch.log1p(torch.relu(logits))
    if mask is not None:
        scores = scores * mask.unsqueeze(-1).to(scores.dtype)
    return scores.sum(1) if pooling == "sum" else torch.max(scores, dim=1).values


def float64_logits(hidden, weight, bias):
    logits = hidden.double() @ weight.double().t()
    return logits + bias.double() if bias is not None else logits


def forward_allowance(hidden, weight, bias, mask, pooling):
    """fp32 accumulation: over H for every logit, and over S for the sum of the scores."""
    hidden, weight, bias = (t.detach() if t is not None else None for t in (hidden, weight, bias))
    kept = (mask != 0).unsqueeze(-1) if mask is not None else torch.ones(1, dtype=torch.bool, device=hidden.device)
    terms = (hidden.double().abs() @ weight.double().abs().t()) * kept  # [B, S, V]: sum_h |x_h w_h|
    if pooling == "sum":
        scores = torch.log1p(float64_logits(hidden, weight, bias).relu()) * kept
        return reduction_allowance(terms.sum(1)) + reduction_allowance(scores.sum(1))
    return reduction_allowance(terms)


def check_forward(hidden, weight, bias, mask, pooling):
    assert_backend(hidden)
    with track_launches() as launched:
        out = splade_pool(hidden, weight, bias, mask, pooling=pooling)
    assert launched["splade_fwd_kernel"] == 1
    assert out.shape == (hidden.shape[0], weight.shape[0]) and out.dtype == hidden.dtype
    ref64 = torch_splade_pool(
        hidden.double(), weight.double(), bias.double() if bias is not None else None, mask, pooling
    )
    lowp = torch_splade_pool(hidden, weight, bias, mask, pooling)
    assert_close_to_reference(out, ref64, lowp, extra_abs=forward_allowance(hidden, weight, bias, mask, pooling))
    return out, ref64


def reference_gradients(hidden, weight, bias, mask, pooling, grad):
    """(float64 grads, plain-torch grads in the inputs' dtype, per-output allowances for fp32/dtype accumulation)."""

    def grads_of(h, w, b, g):
        leaves = [t.detach().clone().requires_grad_() for t in (h, w) + ((b,) if b is not None else ())]
        y = torch_splade_pool(*leaves[:2], leaves[2] if b is not None else None, mask, pooling)
        return torch.autograd.grad(y, leaves, g)

    ref64 = grads_of(hidden.double(), weight.double(), bias.double() if bias is not None else None, grad.double())
    lowp = grads_of(hidden, weight, bias, grad)
    # |dlogit| from the float64 graph: the magnitudes of the terms each gradient sums
    logits = float64_logits(hidden, weight, bias).requires_grad_()
    (dlogit,) = torch.autograd.grad(pool_from_logits(logits, mask, pooling), logits, grad.double().abs())
    # max pooling gathers with fp32 values; sum pooling feeds dlogit to tl.dot rounded to the inputs' dtype
    rounding = torch.float32 if pooling == "max" else hidden.dtype
    allowances = [
        reduction_allowance(dlogit @ weight.double().abs(), rounding),
        reduction_allowance((dlogit.transpose(1, 2) @ hidden.double().abs()).sum(0), rounding),
        reduction_allowance(dlogit.sum(dim=(0, 1))),
    ]
    if pooling == "sum":
        # relu's kink: a logit within the kernel's fp32 accumulation error of 0 may take the other side, which moves
        # its term of each gradient by |grad| (the slope jumps by 1 there) times the other factor.
        h_abs, w_abs = hidden.detach().double().abs(), weight.detach().double().abs()
        window = hidden.shape[-1] * torch.finfo(torch.float32).eps * (h_abs @ w_abs.t())  # [B, S, V]
        kink = (logits.detach().abs() <= window) * grad.double().abs().unsqueeze(1)
        if mask is not None:
            kink = kink * (mask != 0).unsqueeze(-1)
        allowances = [
            allowances[0] + kink @ w_abs,
            allowances[1] + (kink.transpose(1, 2) @ h_abs).sum(0),
            allowances[2] + kink.sum(dim=(0, 1)),
        ]
    return ref64, lowp, allowances


def check_gradients(hidden, weight, bias, mask, pooling):
    grad = torch.randn(hidden.shape[0], weight.shape[0]).to(hidden.dtype).to(hidden.device)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    with track_launches() as launched:
        out = splade_pool(*leaves[:2], leaves[2] if bias is not None else None, mask, pooling=pooling)
        ours = torch.autograd.grad(out, leaves, grad)
    if pooling == "max":
        assert launched["gather_accumulate_kernel"] == 2  # grad_hidden (CSR) and grad_weight (ELL)
    else:
        assert launched["splade_sum_bwd_hidden_kernel"] == 1 and launched["splade_sum_bwd_weight_kernel"] == 1
    ref64, lowp, allowances = reference_gradients(hidden, weight, bias, mask, pooling, grad)
    for name, g, leaf, r, lp, extra in zip(
        ("grad_hidden", "grad_weight", "grad_bias"), ours, leaves, ref64, lowp, allowances
    ):
        assert g.shape == leaf.shape and g.dtype == leaf.dtype
        assert_close_to_reference(g, r, lp, extra_abs=extra, name=name)
    return ours


# ----------------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------------

# (B, S, H, V, bias, mask): a sample of the grid, not its full product (the interpreter is slow)
FORWARD_CASES = [
    (2, 7, 24, 50, True, "padded"),
    (3, 40, 40, 100, True, "bool"),
    (1, 1, 16, 33, False, None),
    (4, 19, 32, 64, False, "float"),
    (2, 33, 17, 70, True, None),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pooling", ["max", "sum"])
@pytest.mark.parametrize("B, S, H, V, bias, mask", FORWARD_CASES)
def test_forward_matches_float64_reference(B, S, H, V, bias, mask, pooling, dtype, device):
    hidden, weight, b, m = make_inputs(B, S, H, V, dtype, device, bias=bias, mask=mask)
    out, ref = check_forward(hidden, weight, b, m, pooling)
    if m is not None and B > 1:
        assert torch.equal(out[-1].cpu(), torch.zeros(V, dtype=dtype))  # the fully masked row
    if bias:
        assert torch.equal(out[:, ::7].cpu(), torch.zeros_like(out[:, ::7].cpu()))  # all-negative columns


@pytest.mark.parametrize("persistent, tma", [(False, False), (True, False), (False, True), (True, True)])
def test_every_forward_schedule(persistent, tma, plan, device):
    """The config rule picks TMA + persistent for inference and one tile per program with pointer loads for the
    training forward; force each (schedule, loads) pair for both: sequences over several tiles (partials + combine
    kernel) and within one tile, a vocabulary tail, padding, max with and without the saved argmax, and sum."""
    from sparsefuse.splade.head import launch

    if device.type == "cuda" and tma and torch.cuda.get_device_capability(device)[0] != 9:
        pytest.skip("TMA loads are used on Hopper only")
    config = launch.FwdConfig(16, 32, 16, num_warps=4, num_stages=1, persistent=persistent, tma=tma)
    plan(splade={"fwd_config": config})
    for B, S in [(3, 40), (2, 9)]:
        hidden, weight, bias, mask = make_inputs(B, S, 32, 70, torch.float16, device)
        assert launch._tma_eligible(hidden, weight) or not tma
        with track_launches() as launched:
            check_forward(hidden, weight, bias, mask, "max")
            check_forward(hidden, weight, bias, mask, "sum")
        assert launched["splade_fwd_combine_kernel"] == (2 if S > 16 else 0)
        check_gradients(hidden, weight, bias, mask, "max")


def test_vocabulary_tail_over_many_tiles(device):
    """A prime vocabulary over 32 tiles (V = 30522 itself runs in the GPU tests: under the interpreter every one of
    its ~1000 programs costs tens of milliseconds)."""
    hidden, weight, b, m = make_inputs(2, 5, 16, 1021, torch.float16, device)
    out, _ = check_forward(hidden, weight, b, m, "max")
    assert bool((out[0, -26:] > 0).any())


@pytest.mark.parametrize("pooling", ["max", "sum"])
def test_long_sequence(pooling, device):
    hidden, weight, b, m = make_inputs(2, 600, 16, 40, torch.float32, device, mask="bool")
    m[0] = True
    check_forward(hidden, weight, b, m, pooling)


def test_all_negative_and_fully_masked_score_exactly_zero(device):
    hidden, weight, _, mask = make_inputs(3, 20, 16, 45, torch.float32, device)
    bias = torch.full((45,), -100.0, device=device)
    bias[:5] = 0.0
    mask[1] = 0
    for pooling in ("max", "sum"):
        out = splade_pool(hidden, weight, bias, mask, pooling=pooling)
        assert torch.equal(out[:, 5:], torch.zeros_like(out[:, 5:])) and torch.equal(out[1], torch.zeros_like(out[1]))
        assert bool((out[0, :5] > 0).any())


def test_log1p_keeps_relative_precision_near_zero(device):
    """Tiny positive maxima: a plain log(1 + x) in fp32 would lose x's low bits (or all of x below 6e-8)."""
    hidden = torch.ones(1, 2, 16, device=device)
    weight = torch.zeros(40, 16, device=device)
    bias = torch.logspace(-12, -2, 40, device=device)
    out = splade_pool(hidden, weight, bias)
    rel = ((out[0].double() - torch.log1p(bias.double())) / torch.log1p(bias.double())).abs().max().item()
    assert rel < 4 * EPS32


def test_ties_first_position_wins_like_torch_max(device):
    """Small dyadic inputs make every logit exact in any summation order, so equal logits are bit-identical and
    ties are everywhere: the first (unmasked) position must win -- within a tile and across tiles -- and the
    gradient must reach only that position (torch.max's rule)."""
    B, S, H, V = 2, 40, 16, 48
    hidden = torch.randint(-2, 3, (B, S, H)).float().to(device)
    weight = (torch.randint(-8, 9, (V, H)) / 8).to(device)
    bias = (torch.randint(-16, 17, (V,)) / 8).to(device)
    hidden[:, 3] *= 3.0  # a dominant row, the max of most columns ...
    hidden[:, 9] = hidden[:, 3]  # ... tied in the same 16-row tile
    hidden[:, 35] = hidden[:, 3]  # ... and in a later tile
    mask = torch.ones(B, S, dtype=torch.bool, device=device)
    mask[1, 3] = False  # batch row 1: the first tie is masked out, so position 9 must win there
    out, argmax, slope = splade_pool_op(hidden, weight, bias, mask, "max", True)
    scores = torch.log1p(torch.relu(float64_logits(hidden, weight, bias))) * mask.unsqueeze(-1)
    values, indices = torch.max(scores, dim=1)
    positive = values > 0
    assert torch.equal(argmax[positive].long(), indices[positive])
    assert int((indices[0] == 3).sum()) >= 4 and int((indices[1] == 9).sum()) >= 4  # the planted ties matter
    assert torch.equal(slope == 0, ~positive)
    grads = check_gradients(hidden, weight, bias, mask, "max")
    assert torch.equal(grads[0][:, 35], torch.zeros_like(grads[0][:, 35]))
    assert torch.equal(grads[0][1, 3], torch.zeros_like(grads[0][1, 3]))


def test_nan_propagates_like_the_reference(device):
    hidden, weight, bias, _ = make_inputs(3, 20, 16, 40, torch.float32, device, negative_columns=False)
    hidden[0, 17, 5] = float("nan")
    for pooling in ("max", "sum"):
        out = splade_pool(hidden, weight, bias, pooling=pooling)
        ref = torch_splade_pool(hidden.double(), weight.double(), bias.double(), None, pooling)
        assert torch.equal(torch.isnan(out), torch.isnan(ref)) and bool(torch.isnan(out[0]).all())


def test_outputs_are_fully_written_under_nan_poisoning(device):
    hidden, weight, bias, mask = make_inputs(3, 21, 16, 77, torch.float16, device)
    with poison_outputs(True):
        for pooling in ("max", "sum"):
            out, argmax, slope = splade_pool_op(hidden, weight, bias, mask, pooling, True)
            assert not bool(torch.isnan(out).any())
            if pooling == "max":
                assert not bool(torch.isnan(slope).any()) and int(argmax.min()) >= 0 and int(argmax.max()) < 21
            leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
            grads = torch.autograd.grad(splade_pool(*leaves, mask, pooling=pooling).sum(), leaves)
            assert not any(bool(torch.isnan(g).any()) for g in grads)


def test_layouts_and_empty_shapes(device):
    base = torch.randn(20, 3, 32, device=device)
    hidden = base.transpose(0, 1)[:, :, ::2]  # [3, 20, 16], no unit stride anywhere
    weight = (torch.randn(16, 90, device=device) / 4).t()  # [90, 16] column-major
    mask = torch.ones(20, 3, dtype=torch.int32, device=device).t()
    mask[0, 12:] = 0
    bias = torch.randn(180, device=device)[::2]
    check_forward(hidden, weight, bias, mask, "max")
    check_gradients(hidden, weight, bias, mask, "max")
    check_forward(hidden, weight, bias, mask, "sum")
    for B, S, V in [(0, 5, 9), (2, 0, 9), (2, 5, 0)]:
        h = torch.randn(B, S, 16, device=device, requires_grad=True)
        w = torch.randn(V, 16, device=device, requires_grad=True)
        for pooling in ("max", "sum"):
            out = splade_pool(h, w, pooling=pooling)
            assert out.shape == (B, V) and bool((out == 0).all())
            gh, gw = torch.autograd.grad(out.sum(), (h, w))
            assert gh.shape == h.shape and gw.shape == w.shape and not bool(gh.any()) and not bool(gw.any())


# ----------------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------------

BACKWARD_CASES = [  # (B, S, H, V, bias, mask)
    (2, 20, 32, 64, True, "padded"),
    (3, 17, 24, 45, False, None),
    (1, 35, 16, 50, True, "bool"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pooling", ["max", "sum"])
@pytest.mark.parametrize("B, S, H, V, bias, mask", BACKWARD_CASES)
def test_gradients_match_float64_autograd(B, S, H, V, bias, mask, pooling, dtype, device):
    hidden, weight, b, m = make_inputs(B, S, H, V, dtype, device, bias=bias, mask=mask)
    check_gradients(hidden, weight, b, m, pooling)


@pytest.mark.parametrize("pooling", ["max", "sum"])
def test_only_requested_gradients_are_computed(pooling, device):
    hidden, weight, bias, mask = make_inputs(2, 12, 16, 40, torch.float32, device)
    h = hidden.clone().requires_grad_()
    with track_launches() as launched:
        (gh,) = torch.autograd.grad(splade_pool(h, weight, bias, mask, pooling=pooling).sum(), h)
    w = weight.clone().requires_grad_()
    (gw,) = torch.autograd.grad(splade_pool(hidden, w, bias, mask, pooling=pooling).sum(), w)
    ref = reference_gradients(hidden, weight, bias, mask, pooling, torch.ones(2, 40, device=device))
    assert_close_to_reference(gh, ref[0][0], ref[1][0], extra_abs=ref[2][0])
    assert_close_to_reference(gw, ref[0][1], ref[1][1], extra_abs=ref[2][1])
    if pooling == "max":
        assert launched["gather_accumulate_kernel"] == 1 and launched["bits_to_sparse_kernel"] == 0
    else:
        assert launched["splade_sum_bwd_hidden_kernel"] == 1 and launched["splade_sum_bwd_weight_kernel"] == 0


@pytest.mark.parametrize("pooling", ["max", "sum"])
def test_backward_is_deterministic(pooling, device):
    hidden, weight, bias, mask = make_inputs(3, 24, 16, 60, torch.float32, device)
    hidden[:, 5] = hidden[:, 2]  # ties and many rows sharing columns
    grad = torch.randn(3, 60, device=device)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        runs.append(torch.autograd.grad(splade_pool(*leaves, mask, pooling=pooling), leaves, grad))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_backward_without_saved_argmax_recomputes_it(device):
    """Calling the op with save_for_backward=False and then differentiating still gives the right gradient."""
    hidden, weight, bias, mask = make_inputs(2, 10, 16, 30, torch.float32, device)
    h = hidden.clone().requires_grad_()
    out, argmax, _ = splade_pool_op(h, weight, bias, mask, "max", False)
    assert argmax.numel() == 0
    (gh,) = torch.autograd.grad(out.sum(), h)
    ref = reference_gradients(hidden, weight, bias, mask, "max", torch.ones(2, 30, device=device))
    assert_close_to_reference(gh, ref[0][0], ref[1][0], extra_abs=ref[2][0])


@pytest.mark.parametrize("pooling", ["max", "sum"])
def test_plain_torch_fallback_matches_the_reference(pooling, monkeypatch, device):
    """CPU tensors without TRITON_INTERPRET take the torch path (forward and backward, explicit formulas); force it
    here, where the interpreter is on."""
    from sparsefuse import Backend, _backend
    from sparsefuse.splade.head import op

    monkeypatch.setattr(op, "backend_for", lambda *tensors: Backend.TORCH)
    hidden, weight, bias, mask = make_inputs(2, 9, 16, 30, torch.float32, device)
    grad = torch.randn(2, 30, device=device)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    monkeypatch.setattr(_backend, "_warned", set())  # warn_reference_once warns again
    with pytest.warns(UserWarning, match="plain-torch reference"), track_launches() as launched:
        out = splade_pool(*leaves, mask, pooling=pooling)
        ours = torch.autograd.grad(out, leaves, grad)
    assert sum(launched.values()) == 0
    ref64 = torch_splade_pool(hidden.double(), weight.double(), bias.double(), mask, pooling)
    assert_close_to_reference(
        out,
        ref64,
        torch_splade_pool(hidden, weight, bias, mask, pooling),
        extra_abs=forward_allowance(hidden, weight, bias, mask, pooling),
    )
    ref_grads, lowp, allowances = reference_gradients(hidden, weight, bias, mask, pooling, grad)
    for g, r, lp, extra in zip(ours, ref_grads, lowp, allowances):
        assert_close_to_reference(g, r, lp, extra_abs=extra)


# ----------------------------------------------------------------------------------------------------------------
# Errors, registration, compile, module
# ----------------------------------------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors(device):
    hidden, weight, bias, mask = make_inputs(2, 6, 16, 20, torch.float32, device)
    with pytest.raises(ValueError, match=r"weight must be \[vocab_size, hidden_size=16\].*shape \[20, 15\]"):
        splade_pool(hidden, weight[:, :15], bias, mask)
    with pytest.raises(ValueError, match=r"attention_mask must be \[batch, seq_len\] = \[2, 6\].*shape \[2, 5\]"):
        splade_pool(hidden, weight, bias, mask[:, :5])
    with pytest.raises(ValueError, match=r"bias must be \[vocab_size=20\]"):
        splade_pool(hidden, weight, bias[:3], mask)
    with pytest.raises(ValueError, match=r"hidden must be \[batch, seq_len, hidden_size\]"):
        splade_pool(hidden[0], weight)
    with pytest.raises(TypeError, match=r"hidden must have a floating dtype.*dtype int64"):
        splade_pool(hidden.long(), weight)
    with pytest.raises(TypeError, match=r"weight must have a floating dtype.*dtype int32"):
        splade_pool(hidden, weight.int())
    with pytest.raises(TypeError, match=r"hidden and weight must have the same dtype"):
        splade_pool(hidden, weight.half())
    with pytest.raises(ValueError, match=r"weight is on meta but hidden is on"):
        splade_pool(hidden, weight.to("meta"))
    with pytest.raises(ValueError, match=r"attention_mask is on meta"):
        splade_pool(hidden, weight, bias, mask.to("meta"))
    with pytest.raises(ValueError, match=r"pooling must be one of \('max', 'sum'\); got 'mean'"):
        splade_pool(hidden, weight, pooling="mean")
    with pytest.raises(TypeError, match=r"weight must be a torch.Tensor"):
        splade_pool(hidden, [[1.0]])
    with pytest.raises(ValueError, match=r"pooling must be one of"):
        SpladeHead(16, 20, pooling="avg")


def test_opcheck(device):
    hidden, weight, bias, mask = make_inputs(2, 9, 16, 24, torch.float32, device)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    torch.library.opcheck(splade_pool_op, (*leaves, mask, "max", True))
    torch.library.opcheck(splade_pool_op, (leaves[0], leaves[1], None, mask.bool(), "sum", True))
    torch.library.opcheck(splade_pool_op, (hidden, weight, None, None, "max", False))
    out, argmax, slope = splade_pool_op(hidden, weight, bias, mask, "max", True)
    grad = torch.randn_like(out)
    torch.library.opcheck(
        splade_pool_backward_op, (grad, hidden, weight, bias, mask, argmax, slope, "max", True, True, True)
    )
    torch.library.opcheck(
        splade_pool_backward_op, (grad, hidden, weight, None, mask, argmax[:0], slope[:0], "sum", True, False, False)
    )


def test_module_tied_to_a_decoder_shares_its_parameters(device):
    decoder = torch.nn.Linear(16, 50).to(device)
    head = SpladeHead.tied_to(decoder)
    assert head.weight is decoder.weight and head.bias is decoder.bias
    assert [n for n, _ in head.named_parameters()] == ["weight", "bias"]
    assert "pooling='max'" in repr(head)
    hidden, _, _, mask = make_inputs(2, 11, 16, 50, torch.float32, device)
    out = head(hidden, mask)
    w, b = decoder.weight.detach(), decoder.bias.detach()
    assert_close_to_reference(
        out,
        torch_splade_pool(hidden.double(), w.double(), b.double(), mask),
        torch_splade_pool(hidden, w, b, mask),
        extra_abs=forward_allowance(hidden, w, b, mask, "max"),
    )
    standalone = SpladeHead(16, 50, bias=False, pooling="sum").to(device)
    standalone.load_state_dict({"weight": w})
    assert standalone.bias is None
    assert_close_to_reference(
        standalone(hidden, mask),
        torch_splade_pool(hidden.double(), w.double(), None, mask, "sum"),
        torch_splade_pool(hidden, w, None, mask, "sum"),
        extra_abs=forward_allowance(hidden, w, None, mask, "sum"),
    )


def test_torch_compile_fullgraph_has_no_graph_break(device):
    backend = "inductor" if device.type == "cuda" else "aot_eager"

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.transform = torch.nn.Linear(16, 16)
            self.head = SpladeHead(16, 40)

        def forward(self, x, mask):
            return self.head(torch.nn.functional.gelu(self.transform(x)), mask)

    model = Model().to(device)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    x = torch.randn(2, 10, 16, device=device)
    mask = torch.ones(2, 10, dtype=torch.int64, device=device)
    mask[1, 6:] = 0
    with track_launches() as launched:
        out = compiled(x, mask)
        out.sum().backward()
    assert launched["splade_fwd_kernel"] >= 1 and launched["gather_accumulate_kernel"] >= 2
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    eager = model(x, mask)
    eager.sum().backward()
    torch.testing.assert_close(out, eager)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad)
    with torch.no_grad(), track_launches() as launched:
        compiled(x, mask)
    assert launched["splade_fwd_kernel"] == 1 and launched["gather_accumulate_kernel"] == 0


@pytest.mark.parametrize("direction", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("pooling, padded", [("max", True), ("sum", False)])
def test_bench_workload_impls_agree_on_tiny_inputs(direction, pooling, padded, device):
    """The benchmark's implementations compute the same function (wiring check; accuracy is tested above).
    torch.compile is skipped: it would build CPU code here."""
    from sparsefuse.bench.harness import WORKLOADS, Options
    from sparsefuse.bench.workloads.splade import _case

    listed = WORKLOADS["splade"](Options(quick=True, device="cpu", dtypes=(torch.bfloat16,), log=lambda _: None))
    assert {c.direction for c in listed} == {"fwd", "fwd+bwd"} and all(c.ceiling == "matmul" for c in listed)
    case = _case((3, 20, 16, 37), torch.float32, direction, pooling, padded, device.type)
    inputs = case.make_inputs()
    results = {name: fn(*inputs) for name, fn in case.impls.items() if name not in ("torch.compile", "matmul")}
    for name, out in results.items():
        for o, r in zip(*(x if isinstance(x, tuple) else (x,) for x in (out, results["eager"]))):
            torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5, msg=f"{case.shape} {name}")
    hidden, weight = inputs[:2]
    torch.testing.assert_close(case.impls["matmul"](*inputs), hidden.detach() @ weight.detach().t())


# ----------------------------------------------------------------------------------------------------------------
# GPU: bf16 and realistic shapes
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pooling", ["max", "sum"])
def test_gpu_splade_v3_shape(dtype, pooling, device):
    """bert-base SPLADE head: H = 768, V = 30522, S = 256 with padding."""
    hidden, weight, bias, mask = make_inputs(4, 256, 768, 30522, dtype, device)
    check_forward(hidden, weight, bias, mask, pooling)
    check_gradients(hidden, weight, bias, mask, pooling)


@pytest.mark.gpu
@pytest.mark.parametrize("S", [512, 1000])
def test_gpu_long_sequences_bf16(S, device):
    hidden, weight, bias, mask = make_inputs(2, S, 768, 4099, torch.bfloat16, device)
    check_forward(hidden, weight, bias, mask, "max")
    check_gradients(hidden, weight, bias, mask, "max")


@pytest.mark.gpu
def test_gpu_large_vocabulary_bf16(device):
    hidden, weight, bias, mask = make_inputs(2, 64, 1024, 151936, torch.bfloat16, device)
    check_forward(hidden, weight, bias, mask, "max")


@pytest.mark.gpu
def test_gpu_tf32_follows_torch_matmul_precision(device):
    hidden, weight, bias, mask = make_inputs(2, 64, 256, 3000, torch.float32, device)
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        out = splade_pool(hidden, weight, bias, mask)
        ref = torch_splade_pool(hidden.double(), weight.double(), bias.double(), mask)
        # TF32 keeps 10 mantissa bits of each input: error ~ 2^-11 * sum |x_h w_h|
        assert (out.double() - ref).abs().max() <= 2.0**-10 * float((hidden.abs() @ weight.abs().t()).max())
    finally:
        torch.set_float32_matmul_precision(previous)
