import pytest
import torch
import triton
import triton.language as tl
from conftest import assert_backend
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparsefuse
from sparsefuse import track_launches
from sparsefuse.activations.snake import kernels as snake_kernels
from sparsefuse.activations.snake import launch as snake_launch
from sparsefuse.activations.snake import snake_backward_op, snake_op, torch_snake, torch_snake_backward
from sparsefuse.testing import assert_close_to_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# fast_sin's documented bound on |sin(u)^2 error| and |sin(u)cos(u) error| for |u| <= 1e5 (README); in y it is
# divided by alpha (>= 0.2 in these tests). The default sine's error (3e-7) is within the dtype tolerance.
FAST_SIN_SIN2_ERROR = 1e-5
FAST_SIN_EXTRA = FAST_SIN_SIN2_ERROR / 0.2
HARDWARE_SIN2_ERROR = 1e-6  # fp16 / bf16 inputs: reduction mod pi, then the SFU's sin.approx (README)
FORWARD_KERNELS = ("snake_fwd_kernel", "snake_fwd_flat_kernel")


def forward_launches(launched) -> int:
    return sum(launched[k] for k in FORWARD_KERNELS)


@pytest.fixture(params=["flat", "rows"])
def forward_path(request, plan):
    """Run a test through both forward kernels: a contiguous x takes the flat one."""
    if request.param == "rows":
        plan(snake={"flat_forward": False})
    return request.param


def make_inputs(shape, dtype, device, scale=3.0, alpha_shape="1c1"):
    x = (torch.randn(shape, dtype=torch.float32) * scale).to(dtype).to(device)
    channels = shape[0] if len(shape) == 2 else shape[1]
    alpha = torch.empty(channels, dtype=torch.float64 if dtype == torch.float64 else torch.float32).uniform_(0.3, 2.5)
    alpha = (alpha.reshape(1, -1, 1) if alpha_shape == "1c1" else alpha).to(device)
    return x, alpha


def reference(x, alpha):
    """float64 ground truth and plain torch in x's dtype."""
    return torch_snake(x.double(), alpha.double()), torch_snake(x, alpha.to(x.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 300), (1, 5, 1), (3, 4, 257), (4, 129), (2, 3, 4, 33), (1, 2, 1100)])
def test_forward_matches_float64_reference(shape, dtype, device, forward_path):
    x, alpha = make_inputs(shape, dtype, device)
    assert_backend(x)
    with track_launches() as launched:
        y = sparsefuse.snake(x, alpha)
    expected = "snake_fwd_flat_kernel" if forward_path == "flat" else "snake_fwd_kernel"
    assert launched[expected] == 1 and forward_launches(launched) == 1
    assert y.shape == x.shape and y.dtype == dtype
    assert_close_to_reference(y, *reference(x, alpha))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_sin_forward(dtype, device, forward_path):
    x, alpha = make_inputs((2, 3, 200), dtype, device, scale=20.0)
    with track_launches() as launched:
        y = sparsefuse.snake(x, alpha, fast_sin=True)
    assert forward_launches(launched) == 1
    assert_close_to_reference(y, *reference(x, alpha), extra_abs=FAST_SIN_EXTRA)


@triton.jit
def _sin_squared_probe_kernel(u_ptr, out_ptr, n, SIN_MODE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    u = tl.load(u_ptr + offs, mask=offs < n)
    s, _ = snake_kernels._sin_cos_mod_pi(u, False, SIN_MODE)
    tl.store(out_ptr + offs, s * s, mask=offs < n)


@pytest.mark.parametrize(
    "mode, limit, bound",
    [
        (snake_kernels.SIN_ACCURATE.value, 1e4, 5e-7),  # polynomial path
        (snake_kernels.SIN_ACCURATE.value, 1e5, 5e-7),
        (snake_kernels.SIN_FAST.value, 1e5, FAST_SIN_SIN2_ERROR),
        (snake_kernels.SIN_HARDWARE.value, 1e5, HARDWARE_SIN2_ERROR),  # the SFU on a GPU (tl.sin when interpreted)
    ],
)
def test_sin_squared_error_bound(mode, limit, bound, device):
    """The bounds the README documents, for fp32 arguments u taken as exact."""
    u = torch.linspace(-limit, limit, 400_001 if device.type == "cuda" else 40_001, dtype=torch.float32, device=device)
    out = torch.full_like(u, float("nan"))
    _sin_squared_probe_kernel[(triton.cdiv(u.numel(), 1024),)](u, out, u.numel(), SIN_MODE=mode, BLOCK=1024)
    err = (out.double() - torch.sin(u.double()) ** 2).abs().max().item()
    assert err < bound, err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alpha_shape", ["1c1", "c"])
@pytest.mark.parametrize("fast_sin", [False, True])
# alpha's sum: several programs per channel (finished in the kernel / interpreted, by a second launch), one program
@pytest.mark.parametrize("shape", [(2, 3, 150), (4, 8, 150), (1, 3, 50)])
def test_backward_matches_float64_reference(shape, dtype, alpha_shape, fast_sin, device):
    x, alpha = make_inputs(shape, dtype, device, alpha_shape=alpha_shape)
    grad = torch.randn(x.shape, dtype=torch.float32).to(dtype).to(device)
    xr, ar = x.clone().requires_grad_(), alpha.clone().requires_grad_()
    with track_launches() as launched:
        sparsefuse.snake(xr, ar, fast_sin=fast_sin).backward(grad)
    assert launched["snake_bwd_kernel"] == 1
    gx64, ga64 = torch_snake_backward(grad.double(), x.double(), alpha.double().reshape(-1))
    # plain torch autograd in the low dtype, as the yardstick
    xl, al = x.clone().requires_grad_(), alpha.to(dtype).clone().requires_grad_()
    torch_snake(xl, al).backward(grad)
    extra = FAST_SIN_EXTRA if fast_sin else 0.0
    assert_close_to_reference(xr.grad, gx64, xl.grad, name="grad_x", extra_abs=extra)
    assert ar.grad.shape == alpha.shape and ar.grad.dtype == alpha.dtype
    # alpha's grad sums B*T terms of size ~|g x| / alpha: allow fp32 rounding over the sum, plus fast_sin's error
    terms = (grad.double() * x.double()).abs().sum().item() / 0.3
    assert_close_to_reference(
        ar.grad.reshape(-1),
        ga64,
        dtype=torch.float32,
        name="grad_alpha",
        extra_abs=terms * (1e-6 + (2 * FAST_SIN_EXTRA if fast_sin else 0.0)),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_past_a_grid_slice(dtype, device, plan):
    """More rows than grid y holds: the rest go to further slices along grid z, the last one overhanging."""
    plan(snake={"rows_per_slice": 4, "flat_forward": False})
    x, alpha = make_inputs((3, 5, 70), dtype, device)  # 15 rows: slices of 4, 4, 4, 3
    with track_launches() as launched:
        y = sparsefuse.snake(x, alpha)
    assert launched["snake_fwd_kernel"] == 1
    assert_close_to_reference(y, *reference(x, alpha))
    grad = torch.randn(x.shape, dtype=torch.float32).to(dtype).to(device)
    xr, ar = x.clone().requires_grad_(), alpha.clone().requires_grad_()
    with track_launches() as launched:
        sparsefuse.snake(xr, ar).backward(grad)
    assert launched["snake_bwd_kernel"] == 1
    gx64, ga64 = torch_snake_backward(grad.double(), x.double(), alpha.double().reshape(-1))
    xl = x.clone().requires_grad_()
    torch_snake(xl, alpha.to(dtype)).backward(grad)  # plain torch in the low dtype, as the yardstick
    assert_close_to_reference(xr.grad, gx64, xl.grad, name="grad_x")
    terms = (grad.double() * x.double()).abs().sum().item() / 0.3
    assert_close_to_reference(ar.grad.reshape(-1), ga64, dtype=torch.float32, name="grad_alpha", extra_abs=terms * 1e-6)


def test_division_magic_numbers():
    """The flat kernel's high-multiply division is exact for every int32 numerator, in uint32 arithmetic."""
    import random

    rng = random.Random(0)
    for d in list(range(1, 2000)) + [rng.randrange(1, 2**31) for _ in range(2000)]:
        m, s = snake_launch.division_magic(d)
        assert 0 < m < 2**32
        for n in [0, 1, d - 1, d, d + 1, 2**31 - 1] + [rng.randrange(0, 2**31) for _ in range(10)]:
            if n < 0:
                continue
            assert ((2 * n * m) >> 32) >> s == n // d


@pytest.mark.parametrize("finish", ["last_arriver", "partials"])
def test_alpha_gradient_is_bitwise_reproducible(finish, device, plan):
    """No float atomics: the same inputs give the same bits, whatever order the programs ran in; each way of
    finishing alpha's sum (in the kernel, or in a second launch) matches the float64 reference."""
    plan(snake={"partials_min_programs": 1 if finish == "partials" else 2**31})
    x, alpha = make_inputs((3, 4, 500), torch.float32, device)
    grad = torch.randn_like(x)
    results = []
    for _ in range(3):
        ar = alpha.clone().requires_grad_()
        with track_launches() as launched:
            (ga,) = torch.autograd.grad(sparsefuse.snake(x, ar), ar, grad)
        results.append(ga)
    assert launched["snake_bwd_alpha_sum"] == (finish == "partials")
    assert all(torch.equal(results[0], r) for r in results[1:])
    _, ga64 = torch_snake_backward(grad.double(), x.double(), alpha.double().reshape(-1))
    terms = (grad.double() * x.double()).abs().sum().item() / 0.3
    assert_close_to_reference(
        results[0].reshape(-1), ga64, dtype=torch.float32, name="grad_alpha", extra_abs=terms * 1e-6
    )


def test_only_x_or_only_alpha_requires_grad(device):
    x, alpha = make_inputs((2, 3, 40), torch.float32, device)
    xr = x.clone().requires_grad_()
    sparsefuse.snake(xr, alpha).sum().backward()
    assert xr.grad is not None and torch.isfinite(xr.grad).all()
    ar = alpha.clone().requires_grad_()
    sparsefuse.snake(x, ar).sum().backward()
    gx64, ga64 = torch_snake_backward(torch.ones_like(x).double(), x.double(), alpha.double().reshape(-1))
    assert_close_to_reference(ar.grad.reshape(-1), ga64, dtype=torch.float32, extra_abs=1e-5 * 80)


def test_gradcheck_float64(device):
    x, alpha = make_inputs((2, 2, 11), torch.float64, device)
    x.requires_grad_()
    alpha.requires_grad_()
    with track_launches() as launched:
        assert torch.autograd.gradcheck(lambda a, b: sparsefuse.snake(a, b), (x, alpha))
    assert launched["snake_bwd_kernel"] > 0 and forward_launches(launched) > 0


def test_non_contiguous_inputs(device):
    base = torch.randn(2, 40, 6, device=device)
    cases = {
        "time axis strided (copied once)": base.transpose(1, 2),  # [2, 6, 40], time stride 6
        "channels sliced": torch.randn(2, 8, 70, device=device)[:, ::2, :],
        "time narrowed (row stride != T)": torch.randn(2, 3, 90, device=device)[..., 5:80],
        "batch expanded": torch.randn(1, 3, 50, device=device).expand(4, 3, 50),
    }
    for name, x in cases.items():
        alpha = torch.rand(x.shape[1], device=device) + 0.5
        with track_launches() as launched:
            y = sparsefuse.snake(x, alpha)
        assert forward_launches(launched) == 1, name
        assert_close_to_reference(y, *reference(x, alpha), name=name)
        xr = x.detach().clone().requires_grad_()
        g = torch.randn(x.shape, device=device).transpose(0, 2).contiguous().transpose(0, 2)  # strided grad
        (gx,) = torch.autograd.grad(sparsefuse.snake(xr, alpha), xr, g)
        gx64, _ = torch_snake_backward(g.double(), x.double(), alpha.double())
        assert_close_to_reference(gx, gx64, name=name + " grad")


def test_empty_inputs(device):
    for shape in [(0, 3, 10), (2, 3, 0), (2, 0, 5)]:
        x = torch.randn(shape, device=device, requires_grad=True)
        alpha = torch.ones(1, shape[1], 1, device=device, requires_grad=True)
        y = sparsefuse.snake(x, alpha)
        assert y.shape == shape
        y.sum().backward()
        assert x.grad.shape == shape and alpha.grad.shape == alpha.shape
        assert (alpha.grad == 0).all()


def test_nan_and_inf_propagate_like_the_reference(device):
    x = torch.tensor([[[0.5, float("nan"), float("inf"), -float("inf"), 1e30, -2.0]]], device=device)
    alpha = torch.ones(1, device=device)
    y = sparsefuse.snake(x, alpha)
    ref = torch_snake(x.double(), alpha.double())
    assert torch.equal(torch.isnan(y), torch.isnan(ref).to(y.device))
    finite = torch.isfinite(ref)
    assert torch.allclose(y[finite].double().cpu(), ref[finite].cpu(), rtol=1e-6)


def test_wide_index_path(device, plan):
    """The int64 per-element offset path (taken for rows above 2^31 elements) computes the same values."""
    plan(snake={"offsets_32_max": 64, "flat_forward": False})
    x, alpha = make_inputs((2, 3, 300), torch.float16, device)
    y = sparsefuse.snake(x, alpha)
    assert_close_to_reference(y, *reference(x, alpha))
    xr = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(sparsefuse.snake(xr, alpha), xr, torch.ones_like(x))
    gx64, _ = torch_snake_backward(torch.ones_like(x).double(), x.double(), alpha.double().reshape(-1))
    assert_close_to_reference(gx, gx64, dtype=torch.float16)


def test_bad_inputs_raise_clear_errors(device):
    x = torch.randn(2, 3, 10, device=device)
    alpha = torch.ones(1, 3, 1, device=device)
    with pytest.raises(TypeError, match=r"x must have a floating dtype.*shape \[2, 3, 10\], dtype int64"):
        sparsefuse.snake(torch.ones(2, 3, 10, dtype=torch.int64, device=device), alpha)
    with pytest.raises(TypeError, match=r"alpha must have a floating dtype.*int32"):
        sparsefuse.snake(x, torch.ones(3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=r"alpha must have shape \[3\] or \[1, 3, 1\].*\[1, 4, 1\]"):
        sparsefuse.snake(x, torch.ones(1, 4, 1, device=device))
    with pytest.raises(ValueError, match=r"alpha must have shape"):
        sparsefuse.snake(x, torch.ones(3, 1, device=device))
    with pytest.raises(ValueError, match=r"x must have shape \[C, T\] or \[B, C, \*\]"):
        sparsefuse.snake(torch.randn(10, device=device), torch.ones(1, device=device))
    with pytest.raises(ValueError, match=r"alpha is on meta but x is on"):
        sparsefuse.snake(x, torch.ones(3, device="meta"))
    with pytest.raises(TypeError, match=r"alpha must be a torch.Tensor"):
        sparsefuse.snake(x, 1.0)


def test_opcheck(device):
    x, alpha = make_inputs((2, 3, 33), torch.float32, device, alpha_shape="c")
    x.requires_grad_()
    alpha.requires_grad_()
    torch.library.opcheck(snake_op, (x, alpha, 1e-9, False))
    torch.library.opcheck(snake_op, (x.detach().half(), alpha.detach(), 1e-9, True))
    g = torch.randn_like(x)
    torch.library.opcheck(snake_backward_op, (g, x.detach(), alpha.detach(), 1e-9, False, True))


def test_torch_compile_fullgraph_has_no_graph_break(device):
    model = torch.nn.Sequential(torch.nn.Conv1d(4, 6, 3, padding=1), sparsefuse.nn.Snake1d(6)).to(device)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    x = torch.randn(2, 4, 50, device=device)
    with track_launches() as launched:
        y = compiled(x)
        y.square().sum().backward()
    assert forward_launches(launched) >= 1 and launched["snake_bwd_kernel"] >= 1
    grad_alpha = model[1].alpha.grad.clone()
    model.zero_grad()
    y_eager = model(x)
    y_eager.square().sum().backward()
    torch.testing.assert_close(y, y_eager)
    torch.testing.assert_close(grad_alpha, model[1].alpha.grad)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    b=st.integers(0, 3),
    c=st.integers(1, 5),
    t=st.integers(0, 150),
    log_scale=st.integers(-3, 3),
    dtype=st.sampled_from(DTYPES),
    alpha_sign=st.sampled_from([1.0, -1.0]),
    fast_sin=st.booleans(),
)
def test_fuzz_shapes_and_values(b, c, t, log_scale, dtype, alpha_sign, fast_sin):
    from conftest import DEVICE

    device = torch.device(DEVICE)
    x = (torch.randn(b, c, t) * 10.0**log_scale).to(dtype).to(device)
    alpha = (alpha_sign * torch.empty(c).uniform_(0.2, 3.0)).to(device)
    y = sparsefuse.snake(x, alpha, fast_sin=fast_sin)
    extra = FAST_SIN_EXTRA if fast_sin else 0.0
    assert_close_to_reference(y, *reference(x, alpha), extra_abs=extra)
    if x.numel():
        xr = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(sparsefuse.snake(xr, alpha, fast_sin=fast_sin), xr, torch.ones_like(x))
        gx64, _ = torch_snake_backward(torch.ones_like(x).double(), x.double(), alpha.double())
        xl = x.clone().requires_grad_()
        (gl,) = torch.autograd.grad(torch_snake(xl, alpha.to(dtype)), xl, torch.ones_like(x))
        assert_close_to_reference(gx, gx64, gl, extra_abs=extra * 4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_large_shapes(dtype, device):
    """Real SNAC shapes plus one above 2^31 elements (int64 offsets) on the GPU."""
    for shape in [(1, 1024, 236), (1, 64, 120832), (8, 512, 16384), (3, 7, 100003)]:
        x, alpha = make_inputs(shape, dtype, device)
        assert_close_to_reference(sparsefuse.snake(x, alpha), *reference(x, alpha))


@pytest.mark.gpu
def test_gpu_above_int32_elements(device):
    T = 2**30 + 4099  # x [1, 2, T] fp16: 2^31 + 8198 elements, 4 GiB
    x = torch.randn(1, 2, T, dtype=torch.float16, device=device)
    alpha = torch.tensor([0.7, 1.3], device=device)
    y = sparsefuse.snake(x, alpha)
    for c in range(2):
        for sl in [slice(0, 4096), slice(T - 4096, T)]:
            xs = x[:, c : c + 1, sl]
            assert_close_to_reference(y[:, c : c + 1, sl], *reference(xs, alpha[c : c + 1]))


def test_eager_fast_path_and_dispatcher_path_agree(device, monkeypatch, plan):
    """Plain eager inference skips the torch.library dispatcher; tracing and fake tensors must still use the op."""
    import sparsefuse._backend as backend

    x, alpha = make_inputs((2, 3, 70), torch.float32, device)
    fast = sparsefuse.snake(x, alpha)
    plan(eager_fast_path=False)
    assert torch.equal(fast, sparsefuse.snake(x, alpha))
    plan(eager_fast_path=True)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx, falpha = mode.from_tensor(x), mode.from_tensor(alpha)
        assert not backend.bypass_dispatcher(fx, falpha)
        assert sparsefuse.snake(fx, falpha).shape == x.shape
        assert sparsefuse.celu(fx).shape == x.shape
