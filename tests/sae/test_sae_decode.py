"""sparse_decode / topk_decode against the float64 dense product, on the interpreter (fp16/fp32; see README)."""

import pytest
import torch
from conftest import DEVICE, assert_backend
from helpers import product_allowance, product_reference, sparse_rows

from sparsefuse import track_launches
from sparsefuse.sae import sparse_decode, topk_decode
from sparsefuse.sae.decode import sparse_decode_backward_op, sparse_decode_op
from sparsefuse.testing import accumulation_allowance, assert_close_to_reference

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["scan", "fixed", "exact", "dense", "auto"])
@pytest.mark.parametrize("B, F, D, l0s", [(1, 256, 128, [8]), (4, 1024, 72, [0, 1, 100, 8]), (32, 512, 33, [0, 1, 8])])
def test_decode_matches_dense_product(B, F, D, l0s, method, dtype, device):
    acts = sparse_rows(B, F, l0s, dtype, device)
    w = (torch.randn(F, D) / 8).to(dtype).to(device)
    assert_backend(acts)
    with track_launches() as launched:
        out = sparse_decode(acts, w, method=method, max_l0=16)
    if method in ("scan", "fixed", "exact"):  # the main launch, then the spread pass over the long rows it listed
        assert launched["gather_accumulate_kernel"] == 2
    assert out.shape == (B, D) and out.dtype == dtype
    assert_close_to_reference(out, *product_reference(acts, w), **product_allowance(acts, w))


LONG_ROW_CASES = {  # (B, per-token L0 cycled over the batch) at d_sae 700: not a multiple of any block
    "one full row": (5, [3, 700, 0, 12, 1]),
    "several full rows": (6, [700, 700, 2, 700, 0, 1]),
    "heavy tail": (7, [1, 3, 9, 27, 81, 243, 700]),
    "all rows full": (3, [700]),
    "zero rows": (4, [0]),
    "B=1, full": (1, [700]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("method", ["scan", "fixed", "exact"])
@pytest.mark.parametrize("case", list(LONG_ROW_CASES))
def test_tokens_firing_every_feature_are_spread_and_exact(case, method, dtype, device, monkeypatch):
    """Tokens far denser than the rest are listed on the device by the main launch and spread over many programs
    by a second one (sparsefuse/sparse/long_rows.py); the result is the fp32-accumulated product either way."""
    from sparsefuse.sparse import long_rows

    plans = []
    allocate = long_rows.LongRows.allocate
    monkeypatch.setattr(
        long_rows.LongRows, "allocate", staticmethod(lambda *a, **k: plans.append(allocate(*a, **k)) or plans[-1])
    )
    B, l0s = LONG_ROW_CASES[case]
    acts = sparse_rows(B, 700, l0s, dtype, device)
    w = (torch.randn(700, 40) / 8).to(dtype).to(device)
    assert_backend(acts)
    with track_launches() as launched:
        out = sparse_decode(acts, w, method=method, max_l0=16)
    assert launched["gather_accumulate_kernel"] == 2  # the main launch, then the spread pass
    (plan,) = plans
    fired = (acts != 0).sum(1)
    if method == "scan":  # a row's columns may be split over programs, each range listed on its own (every case
        # with a row past 32 non-zeros here has a full one), fp16 ranges summed by atomics as dense units
        dense = int(plan.dense_used) if plan.dense_used is not None else 0
        assert (int(plan.count) + dense > 0) == bool((fired > 32).any())
    else:  # rows past 32 non-zeros (1 in 64 columns, at least 32), and for "fixed" those past its 16 slots
        assert int(plan.count) == int((fired > (16 if method == "fixed" else 32)).sum())
    assert out.shape == (B, 40) and out.dtype == dtype
    assert_close_to_reference(out, *product_reference(acts, w), **product_allowance(acts, w))


def test_overflowing_tokens_are_decoded_correctly_or_rejected(device):
    acts = sparse_rows(6, 512, [2, 90, 0, 512, 7, 40], device=device)
    w = torch.randn(512, 40, device=device)
    out = sparse_decode(acts, w, method="fixed", max_l0=32)
    assert_close_to_reference(out, *product_reference(acts, w), **product_allowance(acts, w))
    with pytest.raises(ValueError, match="a token fired 512 features but max_l0=32"):
        sparse_decode(acts, w, method="fixed", max_l0=32, validate=True)
    sparse_decode(acts, w, method="fixed", max_l0=512, validate=True)  # fits: no error


def test_batch_dims_nan_noncontiguous_weight_and_out_dtype(device):
    acts = sparse_rows(6, 300, [5], device=device).reshape(2, 3, 300)
    acts[0, 1, 7] = float("nan")
    w = torch.randn(70, 300, device=device).t()  # [300, 70], non-contiguous
    out = sparse_decode(acts, w, method="fixed", max_l0=8, out_dtype=torch.float16)
    assert out.shape == (2, 3, 70) and out.dtype == torch.float16
    assert torch.isnan(out[0, 1]).all() and not torch.isnan(out[1]).any()
    ref = acts.double() @ w.double()
    assert_close_to_reference(out[1], ref[1], (acts[1] @ w).half())


def test_backward_matches_autograd_on_the_pattern(device):
    acts = sparse_rows(5, 200, [3, 0, 20], device=device).requires_grad_()
    w = torch.randn(200, 24, device=device, requires_grad=True)
    grad = torch.randn(5, 24, device=device)
    with track_launches() as launched:
        sparse_decode(acts, w, method="fixed", max_l0=8).backward(grad)
    # forward: the ELL rows and the overflowed rows' scan; backward: W_dec's gradient
    assert launched["sampled_dot_dense_pattern_kernel"] == 1 and launched["gather_accumulate_kernel"] == 3
    pattern = acts.detach() != 0
    ref_acts = (grad.double() @ w.detach().double().t()) * pattern
    ref_w = acts.detach().double().t() @ grad.double()
    assert_close_to_reference(
        acts.grad, ref_acts, ((grad @ w.detach().t()) * pattern), **product_allowance(grad, w.detach().t())
    )
    assert_close_to_reference(w.grad, ref_w, acts.detach().t() @ grad, **product_allowance(acts.detach().t(), grad))


def test_opcheck(device):
    acts = sparse_rows(3, 128, [4, 0, 9], device=device)
    w = torch.randn(128, 16, device=device)
    for method in ("scan", "fixed", "exact", "dense"):
        torch.library.opcheck(sparse_decode_op, (acts, w, method, 8, False, torch.float32))
    torch.library.opcheck(sparse_decode_backward_op, (torch.randn(3, 16, device=device), acts, w, True, True))


def test_topk_decode(device):
    idx = torch.stack([torch.randperm(500)[:12] for _ in range(7)]).to(device)
    vals = torch.randn(7, 12, device=device)
    w = torch.randn(500, 40, device=device)
    dense = torch.zeros(7, 500, device=device).scatter_(1, idx, vals)
    assert_close_to_reference(topk_decode(idx, vals, w), *product_reference(dense, w))
    with pytest.raises(ValueError, match=r"top_indices must lie in \[0, 500\); got range \[-1, "):
        topk_decode(torch.where(idx == idx[0, 0], -1, idx), vals, w)
    with pytest.raises(TypeError, match="top_indices must be int32/int64"):
        topk_decode(idx.float(), vals, w)


def _topk_inputs(M, k, F, D, dtype, device, seed=0, hot=()):
    """TopK ids (distinct per token; every token also picks each feature in ``hot``), their activations, W_dec."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(F, generator=g)[:k] for _ in range(M)]) if M else torch.zeros(0, k).long()
    for j, f in enumerate(hot):
        idx[idx == f] = idx[:, j].unsqueeze(1).expand_as(idx)[idx == f]  # f out of the other slots ...
        idx[:, j] = f  # ... and into slot j of every token
    vals = torch.rand(M, k, generator=g) + 0.1
    w = torch.randn(F, D, generator=g) / 4
    return idx.to(device), vals.to(dtype).to(device), w.to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "M, k, F, D, hot",
    [(7, 12, 500, 40, ()), (1, 3, 64, 33, ()), (40, 8, 300, 24, (5,)), (0, 4, 64, 8, ()), (5, 0, 64, 8, ())],
)
def test_topk_decode_gradients_match_the_dense_products(M, k, F, D, hot, dtype, device):
    """Forward and backward against the float64 dense product of the scattered activations: grad_acts on the
    TopK slots (one decoder row a slot), W_dec's gradient by feature (``hot``: a feature every token picked, a long
    row of the transposed activations, spread over the GPU), with the kernels that run and no dense [M, d_sae]."""
    idx, vals, w = _topk_inputs(M, k, F, D, dtype, device, hot=hot)
    vals.requires_grad_()
    w.requires_grad_()
    grad_out = (torch.randn(M, D) / 2).to(dtype).to(device)
    with track_launches() as launched:
        out = topk_decode(idx, vals, w)
        g_vals, g_w = torch.autograd.grad(out, (vals, w), grad_out)
    if M and k:
        assert launched["gather_accumulate_kernel"] >= 2 and launched["sampled_dot_rows_kernel"] == 1, launched
    dense = torch.zeros(M, F, dtype=torch.float64, device=device).scatter_(1, idx, vals.detach().double())
    go, w64 = grad_out.double(), w.detach().double()
    assert_close_to_reference(out, dense @ w64, dtype=dtype, extra_abs=accumulation_allowance(dense, w64))
    assert_close_to_reference(
        g_vals, (go @ w64.t()).gather(1, idx), dtype=dtype, extra_abs=accumulation_allowance(go, w64.t()).gather(1, idx)
    )
    assert_close_to_reference(g_w, dense.t() @ go, dtype=dtype, extra_abs=accumulation_allowance(dense.t(), go))
    assert g_vals.shape == vals.shape and g_w.shape == w.shape


@pytest.mark.parametrize("picked_rows", [True, False])
@pytest.mark.parametrize("M, k, F, D, hot", [(9, 6, 400, 40, (3,)), (1, 1, 64, 8, ()), (0, 3, 64, 8, ())])
def test_topk_weight_gradient_by_picked_rows_and_by_all_rows(M, k, F, D, hot, picked_rows, device, plan):
    """Both ways to W_dec's gradient (a row per picked feature and a memset of the rest, or a row per feature) give
    the float64 product, a feature every token picked (a long row, spread) included. The gather's output starts as
    NaN under the tests (new_output's poison), so a picked row left unwritten would show."""
    from sparsefuse.sae.decode import op as decode_op

    plan(sparse_decode={"picked_rows_max_share": float("inf") if picked_rows else 0.0})
    idx, vals, w = _topk_inputs(M, k, F, D, torch.float32, device, seed=7, hot=hot)
    grad_out = torch.randn(M, D, device=device)
    if M and k:  # the backward op's schema, fake and strides on this way too
        torch.library.opcheck(decode_op.topk_decode_backward_op, (grad_out, idx.to(torch.int32), vals, w, True, True))
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # every op of either way has a deterministic version
    try:
        with track_launches() as launched:
            g_w = decode_op._topk_weight_grad(idx.to(torch.int32), vals, grad_out, F, torch.float32)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    if M and k:
        assert launched["gather_accumulate_kernel"] >= 1, launched
    dense = torch.zeros(M, F, dtype=torch.float64, device=device).scatter_(1, idx, vals.double())
    go = grad_out.double()
    assert g_w.shape == (F, D) and g_w.is_contiguous()
    assert_close_to_reference(g_w, dense.t() @ go, dtype=torch.float32, extra_abs=accumulation_allowance(dense.t(), go))


def test_topk_decode_ops_pass_opcheck_and_compile(device):
    """The forward and backward ops' schemas, fakes and autograd registration; fullgraph compile (the range check
    off: it reads the ids back) gives the eager results bit for bit. (The gradients' values against float64: above;
    the kernels take no float64 for gradcheck.)"""
    from sparsefuse.sae.decode.op import topk_decode_backward_op, topk_decode_op

    idx, vals, w = _topk_inputs(6, 5, 80, 12, torch.float32, device, seed=3, hot=(7,))
    idx32 = idx.to(torch.int32)
    torch.library.opcheck(topk_decode_op, (idx32, vals.requires_grad_(), w.requires_grad_(), torch.float32))
    grad_out = torch.randn(6, 12, device=device)
    torch.library.opcheck(topk_decode_backward_op, (grad_out, idx32, vals.detach(), w.detach(), True, True))
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    fn = torch.compile(lambda i, v, b: topk_decode(i, v, b, check_indices=False), fullgraph=True, backend=backend)
    out = fn(idx, vals, w)
    grads = torch.autograd.grad(out, (vals, w), grad_out)
    eager = topk_decode(idx, vals, w)
    assert torch.equal(out, eager)
    for a, b in zip(grads, torch.autograd.grad(eager, (vals, w), grad_out)):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_topk_decode_backward_on_the_gpu_at_an_sae_shape(dtype):
    """k=64 of 65536 features, d_model 2304, 2048 tokens (two features every token picks): the gradients within
    twice torch's own error (the dense products in that dtype) of float64, whole-tensor norms, without a host sync."""
    from sparsefuse.testing import assert_norm_close_to_reference

    idx, vals, w = _topk_inputs(2048, 64, 65536, 2304, dtype, "cuda", seed=5, hot=(11, 40000))
    vals.requires_grad_()
    w.requires_grad_()
    grad_out = torch.randn(2048, 2304, device="cuda", dtype=dtype)
    topk_decode(idx, vals, w, check_indices=False)  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = topk_decode(idx, vals, w, check_indices=False)
        g_vals, g_w = torch.autograd.grad(out, (vals, w), grad_out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    dense = torch.zeros(2048, 65536, device="cuda", dtype=dtype).scatter_(1, idx, vals.detach())
    d64, go64, w64 = dense.double(), grad_out.double(), w.detach().double()
    assert_norm_close_to_reference(out, d64 @ w64, dense @ w.detach(), name="out")
    lowp_acts = (grad_out @ w.detach().t()).gather(1, idx)
    assert_norm_close_to_reference(g_vals, (go64 @ w64.t()).gather(1, idx), lowp_acts, name="grad_acts")
    assert_norm_close_to_reference(g_w, d64.t() @ go64, dense.t() @ grad_out, name="grad_W_dec")


def test_bad_inputs(device):
    acts, w = torch.randn(2, 64, device=device), torch.randn(64, 8, device=device)
    with pytest.raises(ValueError, match=r"disagree on d_sae.*\[2, 63\]"):
        sparse_decode(acts[:, :63], w)
    with pytest.raises(TypeError, match="W_dec must have a floating dtype"):
        sparse_decode(acts, w.long())
    with pytest.raises(ValueError, match="max_l0 must be a positive int; got 0"):
        sparse_decode(acts, w, max_l0=0)
    with pytest.raises(ValueError, match="method must be one of"):
        sparse_decode(acts, w, method="csr")
    with pytest.raises(ValueError, match="W_dec is on meta"):
        sparse_decode(acts, w.to("meta"))


@pytest.mark.parametrize("method", ["scan", "exact", "fixed", "dense", "auto"])
def test_every_method_meets_one_accuracy_contract(method, device):
    """fp16 inputs, ``out_dtype=torch.float32``: whichever method runs (the dense fallback ``auto`` can pick
    included), the result is fp32-accurate -- fp32 accumulation rounded once -- not a 16-bit product widened."""
    acts = sparse_rows(48, 256, [24, 3, 60], torch.float16, device)
    w = torch.randn(256, 40, device=device).half()
    out = sparse_decode(acts, w, method=method, max_l0=32, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    ref = acts.double() @ w.double()
    assert_close_to_reference(out, ref, dtype=torch.float32, extra_abs=accumulation_allowance(acts, w))
    widened = (acts @ w).float()  # what a 16-bit product cast afterwards gives: the contract excludes it
    assert (widened.double() - ref).abs().max() > 10 * (out.double() - ref).abs().max()


def test_dtypes_follow_torch_matmul(device):
    """A mix of dtypes raises, as ``feature_acts @ W_dec`` does; under autocast both take the autocast dtype."""
    acts = torch.relu(torch.randn(4, 64, device=device)) * (torch.rand(4, 64, device=device) < 0.2)
    w = torch.randn(64, 8, device=device)
    with pytest.raises(TypeError, match=r"feature_acts and W_dec must have the same dtype.*float16.*float32"):
        sparse_decode(acts.half(), w)
    with pytest.raises(RuntimeError, match="same dtype"):
        acts.half() @ w  # the rule being followed (torch's own error is a RuntimeError)
    idx = torch.topk(acts, 4).indices
    with pytest.raises(TypeError, match="top_acts and W_dec must have the same dtype"):
        topk_decode(idx, acts.gather(1, idx).half(), w)
    kind, low = device.type, torch.float16  # (the interpreter's bf16 tl.dot is wrong: triton#11584)
    with torch.autocast(kind, dtype=low):
        out, expected = sparse_decode(acts, w, method="scan"), acts @ w
        top = topk_decode(idx, acts.gather(1, idx), w)
    assert out.dtype == expected.dtype == low and top.dtype == low
    assert_close_to_reference(out, acts.double() @ w.double(), expected, dtype=low)


def test_torch_compile_fullgraph(device):
    acts = sparse_rows(4, 256, [3, 9], device=device).requires_grad_()
    w = torch.randn(256, 16, device=device, requires_grad=True)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    fn = torch.compile(lambda a, b: sparse_decode(a, b, method="fixed", max_l0=8), fullgraph=True, backend=backend)
    out = fn(acts, w)
    out.sum().backward()
    assert_close_to_reference(out, *product_reference(acts.detach(), w.detach()))
    assert w.grad is not None and acts.grad is not None


@pytest.mark.gpu
def test_gpu_seed_correctness_grid():
    """The JumpReLU-decode write-up's 486-configuration grid (its 2 methods and our scan x 3 dtypes x B x F x D x
    L0)."""
    import itertools

    for method, dtype, B, F, D, l0 in itertools.product(
        ["scan", "fixed", "exact"],
        [torch.float32, torch.float16, torch.bfloat16],
        [1, 4, 32],
        [256, 1024, 16384],
        [128, 512, 768],
        [1, 8, 100],
    ):
        acts = sparse_rows(B, F, [l0], dtype, "cuda")
        w = (torch.randn(F, D, device="cuda") / 8).to(dtype)
        out = sparse_decode(acts, w, method=method, max_l0=64)  # l0 = 100 overflows 64: decoded from dense rows
        name = f"{method} {dtype} B={B} F={F} D={D} L0={l0}"
        assert_close_to_reference(out, *product_reference(acts, w), **product_allowance(acts, w), name=name)


def test_sparse_jumprelu_sae_module(device):
    import sparsefuse

    torch.manual_seed(0)
    sae = sparsefuse.nn.SparseJumpReLUSAE(48, 1024, max_l0=16).to(device)
    assert list(sae.state_dict()) == ["W_enc", "b_enc", "threshold", "W_dec", "b_dec"]
    with torch.no_grad():
        sae.threshold.fill_(0.9)  # a sparse code (a few dozen features per token)
        sae.b_dec.normal_()
    x = torch.randn(6, 48, device=device)
    # max_l0 is the width of "fixed" where the planner picks it (here made to): ELL rows, then the overflowed ones
    fixed_fastest = {"dense_below_d_sae": 256, "measured_s": {"scan": 2.0, "fixed": 1.0, "dense": 3.0}}
    with torch.no_grad(), sparsefuse.planning(sparse_decode=fixed_fastest), track_launches() as launched:
        recon, acts = sae(x, return_feature_acts=True)
    assert launched["gather_accumulate_kernel"] == 2 and launched["row_bits_kernel"] == 1, dict(launched)
    p = {k: v.detach().double() for k, v in sae.state_dict().items()}
    pre = (x.double() - p["b_dec"]) @ p["W_enc"] + p["b_enc"]
    ref_acts = torch.relu(pre) * (pre > p["threshold"])
    assert torch.equal(acts != 0, ref_acts != 0)
    assert_close_to_reference(recon, ref_acts @ p["W_dec"] + p["b_dec"], sae.encode(x) @ sae.W_dec + sae.b_dec)


def test_sparse_jumprelu_sae_fused_inference_with_overflow(device):
    import sparsefuse

    torch.manual_seed(1)
    sae = sparsefuse.nn.SparseJumpReLUSAE(32, 512, max_l0=4).to(device)  # tiny width: most tokens overflow
    with torch.no_grad():
        sae.threshold.fill_(0.5)
    x = torch.randn(2, 3, 32, device=device)
    with torch.no_grad(), track_launches() as launched:
        recon = sae(x)
    assert launched["jumprelu_encode_kernel"] == 1 and launched["gather_accumulate_kernel"] == 1
    p = {k: v.detach().double() for k, v in sae.state_dict().items()}
    pre = (x.double() - p["b_dec"]) @ p["W_enc"] + p["b_enc"]
    ref = (torch.relu(pre) * (pre > p["threshold"])) @ p["W_dec"] + p["b_dec"]
    assert recon.shape == x.shape
    assert (recon.double() - ref).abs().max() <= 1e-4 * ref.abs().max()
