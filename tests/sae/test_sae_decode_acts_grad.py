"""sparse_decode's gradient for the activations: on their sparsity pattern (``acts_grad="sparse"``, the default) or
torch's full ``grad_out @ W_dec^T`` (``acts_grad="full"``), whichever method ran the forward. On the interpreter
(fp16/fp32; see README)."""

import pytest
import torch
from helpers import product_allowance, sparse_rows

from sparsefuse import track_launches
from sparsefuse.sae import sparse_decode
from sparsefuse.sae.decode import sparse_decode_backward_op, sparse_decode_op
from sparsefuse.testing import assert_close_to_reference


def _grads(method, acts_grad, acts, w, grad):
    a, b = acts.clone().requires_grad_(), w.clone().requires_grad_()
    kwargs = {} if acts_grad is None else {"acts_grad": acts_grad}
    sparse_decode(a, b, method=method, max_l0=8, **kwargs).backward(grad)
    return a.grad, b.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("method", ["scan", "fixed", "exact", "dense"])
def test_full_acts_grad_is_torch_gradient_and_sparse_is_the_pattern(method, dtype, device):
    acts = sparse_rows(6, 200, [3, 0, 20], dtype, device)
    w = (torch.randn(200, 24, device=device) / 8).to(dtype)
    grad = torch.randn(6, 24, device=device).to(dtype)
    full = grad.double() @ w.double().t()
    pattern = acts != 0
    ref_w = acts.double().t() @ grad.double()
    lowp_full = (grad.float() @ w.float().t()).to(dtype)
    lowp_w = (acts.float().t() @ grad.float()).to(dtype)
    with track_launches() as launched:
        g_acts, g_w = _grads(method, "full", acts, w, grad)
    assert launched["sampled_dot_dense_pattern_kernel"] == 0
    assert_close_to_reference(g_acts, full, lowp_full, **product_allowance(grad, w.t()))
    assert_close_to_reference(g_w, ref_w, lowp_w, **product_allowance(acts.t(), grad))
    # relative error of the pattern's gradient against torch's: what "full" is for
    s_acts, s_w = _grads(method, None, acts, w, grad)
    assert torch.equal(s_acts, _grads(method, "sparse", acts, w, grad)[0])
    assert ((s_acts.double() - full).norm() / full.norm()) > 0.5
    assert_close_to_reference(s_acts, full * pattern, lowp_full * pattern, **product_allowance(grad, w.t()))
    assert torch.equal(s_w, g_w)  # W_dec's gradient is acts^T grad_out either way


def test_full_acts_grad_matches_autograd_of_the_matmul(device):
    """fp16 operands, fp32 output: the gradient reaches the activations in their dtype, as torch's does."""
    acts = sparse_rows(5, 128, [2, 9], torch.float16, device).requires_grad_()
    w = (torch.randn(128, 16, device=device) / 8).half().requires_grad_()
    ours = sparse_decode(acts, w, method="scan", out_dtype=torch.float32, acts_grad="full")
    grad = torch.randn(5, 16, device=device)
    g_acts, g_w = torch.autograd.grad(ours, (acts, w), grad)
    a64, w64 = acts.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    r_acts, r_w = torch.autograd.grad(a64 @ w64, (a64, w64), grad.double())
    assert g_acts.dtype == torch.float16 and g_w.dtype == torch.float16
    assert_close_to_reference(g_acts, r_acts, **product_allowance(grad, w.detach().t()))
    assert_close_to_reference(g_w, r_w, **product_allowance(acts.detach().t(), grad))


def test_acts_grad_is_checked(device):
    acts, w = torch.randn(2, 64, device=device), torch.randn(64, 8, device=device)
    with pytest.raises(ValueError, match="acts_grad must be one of sparse, full; got 'dense'"):
        sparse_decode(acts, w, acts_grad="dense")


def test_opcheck_with_acts_grad(device):
    acts = sparse_rows(3, 128, [4, 0, 9], device=device)
    w = torch.randn(128, 16, device=device)
    grad_out = torch.randn(3, 16, device=device)
    for method in ("scan", "dense"):
        for acts_grad in ("sparse", "full"):
            args = (acts.clone().requires_grad_(), w.clone().requires_grad_(), method, 8, False, torch.float32)
            torch.library.opcheck(sparse_decode_op, (*args, acts_grad))
    for acts_grad in ("sparse", "full"):
        torch.library.opcheck(sparse_decode_backward_op, (grad_out, acts, w, True, True, acts_grad))


def test_full_acts_grad_compiles_fullgraph(device):
    acts = sparse_rows(4, 256, [3, 9], device=device).requires_grad_()
    w = torch.randn(256, 16, device=device, requires_grad=True)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    fn = torch.compile(
        lambda a, b: sparse_decode(a, b, method="fixed", max_l0=8, acts_grad="full"), fullgraph=True, backend=backend
    )
    grad = torch.randn(4, 16, device=device)
    fn(acts, w).backward(grad)
    full = grad.double() @ w.detach().double().t()
    assert_close_to_reference(acts.grad, full, **product_allowance(grad, w.detach().t()))
