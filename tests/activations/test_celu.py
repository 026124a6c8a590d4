import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, assert_backend
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparsefuse
from sparsefuse import track_launches
from sparsefuse.activations.celu import celu_backward_op, celu_inplace_op, celu_op, torch_celu, torch_celu_backward
from sparsefuse.testing import assert_close_to_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PARAMS = [(1.0, 1.0, 1.0), (0.5, 1.0, 1.0), (2.0, 1.5, 0.7), (1.3, -0.8, -2.0), (-0.7, 1.0, 1.0)]


def randn(shape, dtype, device, scale=3.0):
    return (torch.randn(shape) * scale).to(dtype).to(device)


def reference(x, alpha, scale, input_scale):
    """float64 ground truth and plain torch in x's dtype."""
    return torch_celu(x.double(), alpha, scale, input_scale), torch_celu(x, alpha, scale, input_scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("shape", [(1,), (1000,), (3, 257), (2, 3, 4, 5)])
def test_forward_matches_float64_reference(shape, params, dtype, device):
    x = randn(shape, dtype, device)
    assert_backend(x)
    with track_launches() as launched:
        y = sparsefuse.celu(x, *params)
    assert launched["celu_fwd_kernel"] == 1
    assert y.shape == x.shape and y.dtype == dtype
    assert_close_to_reference(y, *reference(x, *params))


@pytest.mark.parametrize("dtype", DTYPES)
def test_equals_torch_celu_with_unit_scales(dtype, device):
    x = randn((4, 300), dtype, device)
    for alpha in (1.0, 0.3, 2.5):
        y = sparsefuse.celu(x, alpha)
        assert_close_to_reference(y, F.celu(x.double(), alpha), F.celu(x, alpha))


def test_small_negative_inputs_keep_relative_precision(device):
    """alpha * expm1(z / alpha) near zero: a plain exp(w) - 1 would lose every significant digit here."""
    x = -torch.logspace(-12, -1, 200, dtype=torch.float32, device=device)
    y = sparsefuse.celu(x)
    rel = ((y.double() - torch.expm1(x.double())) / torch.expm1(x.double())).abs().max().item()
    assert rel < 4 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("params", PARAMS)
def test_backward_matches_float64_reference(params, dtype, device):
    x = randn((3, 200), dtype, device)
    grad = randn(x.shape, dtype, device, scale=1.0)
    xr = x.clone().requires_grad_()
    with track_launches() as launched:
        sparsefuse.celu(xr, *params).backward(grad)
    assert launched["celu_bwd_kernel"] == 1
    xl = x.clone().requires_grad_()
    torch_celu(xl, *params).backward(grad)
    # The kernel recovers exp(z/alpha) from the rounded output y: in low precision that costs one rounding of y.
    ref = torch_celu_backward(grad.double(), x.double(), *params)
    y64 = torch_celu(x.double(), *params)
    extra = torch.finfo(dtype).eps * float((grad.double() * y64 * params[2] / params[0]).abs().max())
    assert_close_to_reference(xr.grad, ref, xl.grad, extra_abs=2 * extra)


@pytest.mark.parametrize("params", PARAMS)
def test_gradcheck_float64(params, device):
    x = randn((5, 13), torch.float64, device).requires_grad_()
    with track_launches() as launched:
        assert torch.autograd.gradcheck(lambda t: sparsefuse.celu(t, *params), (x,))
    assert launched["celu_bwd_kernel"] > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_inplace_overwrites_storage_without_autograd(dtype, device):
    x = randn((7, 131), dtype, device)
    expected = reference(x, 1.3, 0.9, 1.1)
    ptr = x.data_ptr()
    with track_launches() as launched:
        out = sparsefuse.celu_(x, 1.3, 0.9, 1.1)
    assert out is x and x.data_ptr() == ptr
    assert launched["celu_fwd_kernel"] == 1
    assert_close_to_reference(x, *expected)


def test_inplace_on_non_dense_view_writes_through(device):
    base = randn((6, 40), torch.float32, device)
    original = base.clone()
    view = base[:, ::3]
    sparsefuse.celu_(view)
    expected = original.clone()
    expected[:, ::3] = F.celu(original[:, ::3])
    torch.testing.assert_close(base, expected)


def test_inplace_autograd_rules(device):
    leaf = randn((4, 10), torch.float32, device).requires_grad_()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        sparsefuse.celu_(leaf)
    with torch.no_grad():
        sparsefuse.celu_(leaf.clone())  # fine without autograd
    # a non-leaf: PyTorch's rule allows it and gradients must flow as for the out-of-place op
    h = leaf * 2.0
    sparsefuse.celu_(h, 0.8)
    h.sum().backward()
    ones = torch.ones(4, 10, dtype=torch.float64, device=device)
    expected = torch_celu_backward(ones, 2.0 * leaf.detach().double(), 0.8) * 2.0
    assert_close_to_reference(leaf.grad, expected)


@pytest.mark.parametrize("fast_path", [True, False], ids=["launcher", "op"])
def test_inplace_bumps_the_version_counter_like_torch(fast_path, device, monkeypatch, plan):
    """A graph that saved x must not backpropagate through celu_'s overwrite of it: PyTorch raises there, whether
    the graph saved x itself or a view sharing its storage, and whether celu_ ran under no_grad or not."""

    plan(eager_fast_path=fast_path)
    for no_grad in (False, True):
        for region in (slice(None), slice(2, 6)):
            x = randn((8,), torch.float32, device)
            w = torch.randn(8, device=device, requires_grad=True)
            y = (w * x).sum()  # saves x for w's gradient
            assert_backend(x)
            version = x._version
            with track_launches() as launched, torch.set_grad_enabled(not no_grad):
                sparsefuse.celu_(x[region], 0.7)
            assert launched["celu_fwd_kernel"] == 1
            assert x._version > version
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.backward()


def test_inplace_on_views_of_a_leaf_follows_torch(device):
    leaf = randn((4, 10), torch.float32, device).requires_grad_()
    for view in (lambda t: t[1:3], lambda t: t.t()):
        with pytest.raises(RuntimeError, match="a view of a leaf Variable that requires grad"):
            F.celu_(view(leaf))
        with pytest.raises(RuntimeError, match="a view of a leaf Variable that requires grad"):
            sparsefuse.celu_(view(leaf))
    with torch.no_grad():
        made_without_grad = leaf[1:3]
    with pytest.raises(RuntimeError, match="created in no_grad mode"):
        F.celu_(made_without_grad)
    with pytest.raises(RuntimeError, match="created in no_grad mode"):
        sparsefuse.celu_(made_without_grad)
    # under no_grad the leaf itself is overwritten, its version bumped as torch's in-place ops bump it
    expected = F.celu(leaf.detach().double(), 0.6)
    version = leaf._version
    with torch.no_grad():
        sparsefuse.celu_(leaf, 0.6)
    assert leaf._version > version
    assert_close_to_reference(leaf.detach(), expected)


def test_layouts_and_empty(device):
    x = randn((5, 6, 7), torch.float32, device).permute(2, 0, 1)  # dense, not contiguous: runs in place of layout
    y = sparsefuse.celu(x)
    assert y.stride() == x.stride()
    assert_close_to_reference(y, *reference(x, 1.0, 1.0, 1.0))
    sliced = randn((8, 9), torch.float32, device)[::2, 1:]
    assert_close_to_reference(sparsefuse.celu(sliced), *reference(sliced, 1.0, 1.0, 1.0))
    xr = sliced.clone().requires_grad_()
    g = randn((8, 4), torch.float32, device).t()  # a strided gradient
    (gx,) = torch.autograd.grad(sparsefuse.celu(xr), xr, g)
    assert_close_to_reference(gx, torch_celu_backward(g.double(), sliced.double()))
    for shape in [(0,), (3, 0)]:
        e = torch.empty(shape, device=device, requires_grad=True)
        out = sparsefuse.celu(e)
        assert out.shape == shape
        out.sum().backward()
        assert e.grad.shape == shape
    scalar = torch.tensor(-0.5, device=device)
    assert_close_to_reference(sparsefuse.celu(scalar), *reference(scalar, 1.0, 1.0, 1.0))


def test_nan_and_inf_propagate_like_the_reference(device):
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 88.0, -1e30], device=device)
    y = sparsefuse.celu(x)
    ref = torch_celu(x.double())
    assert torch.equal(torch.isnan(y).cpu(), torch.isnan(ref).cpu())
    finite = ~torch.isnan(ref)
    torch.testing.assert_close(y[finite].double().cpu(), ref[finite].cpu())


def test_bad_inputs_raise_clear_errors(device):
    x = randn((3, 4), torch.float32, device)
    with pytest.raises(ValueError, match=r"alpha must be non-zero.*shape \[3, 4\]"):
        sparsefuse.celu(x, alpha=0.0)
    with pytest.raises(ValueError, match=r"celu_: alpha must be non-zero"):
        sparsefuse.celu_(x, alpha=0)
    with pytest.raises(TypeError, match=r"x must have a floating dtype.*dtype int32"):
        sparsefuse.celu(torch.ones(3, dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match=r"scale must be a Python float"):
        sparsefuse.celu(x, scale=torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor"):
        sparsefuse.celu([1.0, 2.0])


def test_opcheck(device):
    x = randn((4, 33), torch.float32, device).requires_grad_()
    torch.library.opcheck(celu_op, (x, 1.3, 0.9, 1.1))
    torch.library.opcheck(celu_op, (x.detach().t(), 0.5, 1.0, 1.0))
    torch.library.opcheck(celu_inplace_op, (x.detach().clone(), 1.3, 0.9, 1.1))
    y = sparsefuse.celu(x.detach(), 1.3)
    torch.library.opcheck(celu_backward_op, (torch.randn_like(y), y, 1.3, 1.0, 1.0))


def test_module_is_a_drop_in_for_torch_celu(device):
    for inplace in (False, True):
        ours, theirs = sparsefuse.nn.CELU(0.7, inplace=inplace), torch.nn.CELU(0.7, inplace=inplace)
        assert repr(ours) == repr(theirs)
        x = randn((3, 50), torch.float32, device)
        assert_close_to_reference(ours(x.clone()), F.celu(x.double(), 0.7), F.celu(x, 0.7))


def test_torch_compile_fullgraph_has_no_graph_break(device):
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), sparsefuse.nn.CELU(0.9), torch.nn.Linear(16, 4)).to(device)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    x = torch.randn(5, 8, device=device)
    with track_launches() as launched:
        compiled(x).sum().backward()
    assert launched["celu_fwd_kernel"] >= 1 and launched["celu_bwd_kernel"] >= 1
    inplace = torch.compile(
        torch.nn.Sequential(torch.nn.Linear(8, 8), sparsefuse.nn.CELU(inplace=True)).to(device),
        fullgraph=True,
        backend=backend,
    )
    with torch.no_grad():
        torch.testing.assert_close(inplace(x), F.celu(inplace._orig_mod[0](x)))


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    n=st.integers(0, 3000),
    log_scale=st.integers(-4, 3),
    dtype=st.sampled_from(DTYPES),
    alpha=st.sampled_from([1.0, 0.1, 3.0, -1.5]),
    scale=st.sampled_from([1.0, 2.0, -0.5]),
    input_scale=st.sampled_from([1.0, 0.25, -3.0]),
)
def test_fuzz_sizes_and_values(n, log_scale, dtype, alpha, scale, input_scale):
    device = torch.device(DEVICE)
    x = randn((n,), dtype, device, scale=10.0**log_scale)
    y = sparsefuse.celu(x, alpha, scale, input_scale)
    assert_close_to_reference(y, *reference(x, alpha, scale, input_scale))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_large_sizes(dtype, device):
    for n in [1 << 20, (1 << 24) + 3]:
        x = randn((n,), dtype, device)
        assert_close_to_reference(sparsefuse.celu(x), *reference(x, 1.0, 1.0, 1.0))


@pytest.mark.gpu
def test_gpu_above_int32_elements(device):
    n = 2**31 + 4099
    x = torch.randn(n, dtype=torch.float16, device=device)
    head, tail = x[:4096].clone(), x[-4096:].clone()
    sparsefuse.celu_(x, 0.5)
    assert_close_to_reference(x[:4096], *reference(head, 0.5, 1.0, 1.0))
    assert_close_to_reference(x[-4096:], *reference(tail, 0.5, 1.0, 1.0))
