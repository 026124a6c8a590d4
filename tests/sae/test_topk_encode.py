"""topk_encode (TopK SAE encode without the dense pre-activations) against the float64 reference.

A low-precision top-k may legitimately differ from the float64 one among features whose pre-activations lie within
rounding error of each other, so the selection is checked as "a top-k of the float64 values up to the per-element
error bound" (``assert_valid_topk``), the values elementwise; exact ties are checked with exactly representable
data. Interpreter: fp16/fp32 only (its bf16 ``tl.dot`` is wrong).
"""

import pytest
import torch
from conftest import DEVICE, assert_backend
from helpers import assert_valid_topk, pre_activations_and_bound

from sparsefuse import track_launches
from sparsefuse.sae.topk import topk_encode, topk_encode_op, torch_topk_encode
from sparsefuse.testing import accumulation_allowance, assert_close_to_reference

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def make_inputs(M, d_in, d_sae, dtype, device, *, with_b_dec=True, scale=False):
    x = torch.randn(M, d_in).to(dtype)
    w = (torch.randn(d_in, d_sae) / d_in**0.5).to(dtype)
    b_enc = (torch.randn(d_sae) * 0.1).to(dtype)
    b_dec = (torch.randn(d_in) * 0.1).to(dtype) if with_b_dec else None
    feature_scale = (torch.rand(d_sae) + 0.5).to(dtype) if scale else None
    return [t.to(device) if t is not None else None for t in (x, w, b_enc, b_dec, feature_scale)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "M, d_in, d_sae, k, with_b_dec",
    [(5, 40, 100, 7, True), (33, 64, 512, 16, True), (1, 17, 45, 45, False), (20, 24, 300, 1, True)],
)
def test_topk_encode_is_a_top_k_of_the_float64_pre_activations(M, d_in, d_sae, k, with_b_dec, dtype, device):
    x, w, b_enc, b_dec, _ = make_inputs(M, d_in, d_sae, dtype, device, with_b_dec=with_b_dec)
    assert_backend(x)
    with track_launches() as launched:
        indices, acts = topk_encode(x, w, b_enc, k, b_dec=b_dec)
    assert launched["topk_encode_fwd_kernel"] == 1
    assert acts.dtype == dtype
    assert_valid_topk(indices, acts, *pre_activations_and_bound(x, w, b_enc, b_dec), k)


def test_feature_scale_and_raw_activation(device):
    x, w, b_enc, b_dec, scale = make_inputs(9, 32, 200, torch.float32, device, scale=True)
    indices, acts = topk_encode(x, w, b_enc, 12, b_dec=b_dec, activation="none", feature_scale=scale)
    pre, bound = pre_activations_and_bound(x, w, b_enc, b_dec, scale)
    assert_valid_topk(indices, acts, pre, bound, 12, activation="none")
    # With k large enough to reach negative pre-activations, "relu" zeroes them but keeps SAELens' selection.
    indices, acts = topk_encode(x, w, b_enc, 150, b_dec=b_dec, feature_scale=scale)
    assert bool((acts == 0).any())
    assert_valid_topk(indices, acts, pre, bound, 150)


def test_exact_ties_break_towards_the_lower_feature_and_nan_comes_first(device):
    # Small integers: every product and sum is exact, so equal columns give bit-equal pre-activations.
    d_in, d_sae = 8, 96
    w = torch.randint(-2, 3, (d_in, d_sae)).float()
    b_enc = torch.zeros(d_sae)
    for col in (70, 5, 40, 41):  # four identical columns, well above every other feature
        w[:, col], b_enc[col] = w[:, 3], 100.0
    b_enc[3] = 100.0
    x = torch.randint(-2, 3, (4, d_in)).float()
    x[2, 5] = float("nan")
    x, w, b_enc = x.to(device), w.to(device), b_enc.to(device)
    indices, acts = topk_encode(x, w, b_enc, 3)
    ref_indices, _ = torch_topk_encode(x, w, b_enc, 3)
    assert torch.equal(indices.cpu(), ref_indices.cpu())
    for row in (0, 1, 3):
        assert indices[row].tolist() == [3, 5, 40] and len(set(acts[row].tolist())) == 1
    assert bool(torch.isnan(acts[2]).all()) and indices[2].tolist() == [0, 1, 2]  # NaN is largest, as in torch.topk


def test_batch_dims_noncontiguous_inputs_and_empty_batch(device):
    x, w, b_enc, b_dec, _ = make_inputs(6, 48, 160, torch.float32, device)
    x3 = x.t().contiguous().t().reshape(2, 3, 48)  # a copy with transposed strides: non-contiguous rows
    w_t = w.t().contiguous().t()  # [d_in, d_sae] with column stride d_in
    assert not w_t.is_contiguous()
    indices, acts = topk_encode(x3, w_t, b_enc, 10, b_dec=b_dec)
    assert indices.shape == acts.shape == (2, 3, 10)
    ref_indices, ref_acts = topk_encode(x, w, b_enc, 10, b_dec=b_dec)
    assert torch.equal(indices.reshape(6, 10), ref_indices) and torch.equal(acts.reshape(6, 10), ref_acts)
    empty_indices, empty_acts = topk_encode(x[:0], w, b_enc, 10)
    assert empty_indices.shape == empty_acts.shape == (0, 10)


def test_large_k_runs_the_chunked_torch_path(device, plan):
    plan(topk_encode={"torch_chunk": 256})  # several chunks to merge
    x, w, b_enc, b_dec, _ = make_inputs(3, 16, 1100, torch.float32, device)
    with track_launches() as launched:
        indices, acts = topk_encode(x, w, b_enc, 600, b_dec=b_dec)  # k rounds up to 1024 > MAX_KERNEL_K
    assert launched["topk_encode_fwd_kernel"] == 0
    assert_valid_topk(indices, acts, *pre_activations_and_bound(x, w, b_enc, b_dec), 600)


def test_backward_matches_autograd_through_the_selection(device):
    x, w, b_enc, b_dec, _ = make_inputs(7, 24, 128, torch.float32, device)
    leaves = [t.clone().requires_grad_() for t in (x, w, b_enc, b_dec)]
    indices, acts = topk_encode(leaves[0], leaves[1], leaves[2], 9, b_dec=leaves[3])
    grad = torch.randn_like(acts)
    ours = torch.autograd.grad(acts, leaves, grad)
    # The same function in float64 with the selection fixed: autograd gives the reference gradients.
    leaves64 = [t.detach().double().requires_grad_() for t in (x, w, b_enc, b_dec)]
    pre = (leaves64[0] - leaves64[3]) @ leaves64[1] + leaves64[2]
    ref = torch.autograd.grad(pre.gather(1, indices).relu(), leaves64, grad.double())
    dense_grad = torch.zeros(7, 128, dtype=torch.float64, device=device).scatter_(1, indices, grad.double())
    dense_grad = dense_grad * (pre.detach() > 0)
    sae_in = (x - b_dec).double()
    ones = torch.ones(7, 1, dtype=torch.float64, device=device)
    allowances = [
        accumulation_allowance(dense_grad, w.double().t()),
        accumulation_allowance(sae_in.t(), dense_grad),
        accumulation_allowance(dense_grad.t(), ones).flatten(),
        accumulation_allowance(ones.t(), (dense_grad @ w.double().t()).abs()).flatten(),
    ]
    for name, g, r, extra in zip(("x", "W_enc", "b_enc", "b_dec"), ours, ref, allowances):
        assert_close_to_reference(g, r, extra_abs=extra, name=f"grad {name}")


def test_bad_arguments(device):
    x, w, b_enc, b_dec, _ = make_inputs(2, 8, 16, torch.float32, device)
    with pytest.raises(ValueError, match=r"k must be an int in \[1, d_sae=16\]; got 17"):
        topk_encode(x, w, b_enc, 17)
    with pytest.raises(ValueError, match=r"k must be an int"):
        topk_encode(x, w, b_enc, 0)
    with pytest.raises(ValueError, match=r"k must be an int"):
        topk_encode(x, w, b_enc, True)
    with pytest.raises(ValueError, match="activation must be one of relu, none; got 'abs'"):
        topk_encode(x, w, b_enc, 4, activation="abs")
    with pytest.raises(ValueError, match=r"expected x \[..., d_in\]"):
        topk_encode(x[:, :7], w, b_enc, 4)
    with pytest.raises(TypeError, match="W_enc must have a floating dtype"):
        topk_encode(x, w.long(), b_enc, 4)
    with pytest.raises(ValueError, match=r"b_dec must have shape \[8\]"):
        topk_encode(x, w, b_enc, 4, b_dec=b_dec[:3])
    with pytest.raises(ValueError, match="feature_scale is not differentiated"):
        topk_encode(x, w, b_enc, 4, feature_scale=torch.ones(16, device=device, requires_grad=True))


def test_opcheck_and_fullgraph_compile(device):
    x, w, b_enc, b_dec, scale = make_inputs(5, 24, 64, torch.float32, device, scale=True)
    torch.library.opcheck(topk_encode_op, (x, w, b_enc, b_dec, scale, 6, True))
    torch.library.opcheck(topk_encode_op, (x.requires_grad_(), w.requires_grad_(), b_enc, None, None, 6, False))
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    fn = torch.compile(lambda *a: topk_encode(*a, 6, b_dec=b_dec), fullgraph=True, backend=backend)
    indices, acts = fn(x, w, b_enc)
    acts.sum().backward()
    eager_indices, eager_acts = topk_encode(x.detach(), w.detach(), b_enc, 6, b_dec=b_dec)
    assert torch.equal(indices, eager_indices) and torch.equal(acts.detach(), eager_acts)
    assert x.grad is not None and w.grad is not None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_gemma_scope_shapes(dtype, device):
    """Gemma 2B width (d_in 2304, 65536 features) at k = 64, plus shapes with tails in every dimension."""
    for M, d_in, d_sae, k, with_b_dec in [
        (300, 2304, 65536, 64, True),
        (77, 333, 5000, 200, False),
        (4097, 64, 1024, 8, True),
        (2, 2304, 16384, 512, True),
    ]:
        x, w, b_enc, b_dec, _ = make_inputs(M, d_in, d_sae, dtype, device, with_b_dec=with_b_dec)
        with track_launches() as launched:
            indices, acts = topk_encode(x, w, b_enc, k, b_dec=b_dec)
        assert launched["topk_encode_fwd_kernel"] == 1
        assert_valid_topk(indices, acts, *pre_activations_and_bound(x, w, b_enc, b_dec), k)
