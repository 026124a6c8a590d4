import pytest
import torch
from conftest import assert_backend
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import sparsefuse
import sparsefuse.norms.rmsnorm.launch as rms_launch
from sparsefuse import track_launches
from sparsefuse.norms.rmsnorm import rms_norm_bwd_op, rms_norm_fwd_op, torch_rms_norm, torch_rms_norm_backward
from sparsefuse.testing import assert_close_to_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS32 = torch.finfo(torch.float32).eps  # eps=None default for float32 input


def make(shape, dtype, device, scale=2.0):
    return (torch.randn(shape) * scale).to(dtype).to(device)


def lowp_llama(x, weight, eps):
    """transformers' LlamaRMSNorm computation in x's dtype (differentiable in x and weight): the low-precision
    comparator."""
    xc = x.float()
    normed = (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if weight is None else weight * normed


@pytest.fixture(params=[False, True], ids=["rows-in-registers", "chunked-rows"])
def chunked(request, plan):
    """Both kernel paths at test sizes: rows held whole, and rows walked in chunks (single_max lowered)."""
    if request.param:
        plan(rms_norm={"single_max": 16, "chunk": 16})
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (3, 5, 48), (37, 100), (2, 3, 4, 33)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_forward_backward_match_float64_reference(shape, dtype, with_weight, chunked, device):
    x = make(shape, dtype, device)
    w = make(shape[-1:], dtype, device, 1.0) if with_weight else None
    assert_backend(x)
    xr = x.clone().requires_grad_()
    wr = w.clone().requires_grad_() if w is not None else None
    with track_launches() as launched:
        y = sparsefuse.rms_norm(xr, shape[-1], wr, 1e-5)
        grads = torch.autograd.grad(y, (xr, wr) if w is not None else (xr,), g := make(shape, dtype, device, 1.0))
    assert launched["rms_norm_fwd_kernel"] == 1 and launched["rms_norm_bwd_kernel"] == 1
    assert y.shape == x.shape and y.dtype == dtype
    x64, w64 = x.double(), w.double() if w is not None else None
    assert_close_to_reference(y, torch_rms_norm(x64, w64, 1e-5), lowp_llama(x, w, 1e-5))
    ref64 = torch.autograd.grad(
        torch_rms_norm(x64.requires_grad_(), w64.requires_grad_() if w is not None else None, 1e-5),
        (x64, w64) if w is not None else (x64,),
        g.double(),
    )
    xl = x.clone().requires_grad_()
    wl = w.clone().requires_grad_() if w is not None else None
    lowp = torch.autograd.grad(lowp_llama(xl, wl, 1e-5), (xl, wl) if w is not None else (xl,), g)
    for ours, ref, low, name in zip(grads, ref64, lowp, ("grad_x", "grad_w")):
        assert ours.dtype == dtype
        # the weight's gradient sums over every row: its reference is rounded once, torch's once per product
        assert_close_to_reference(ours, ref, low, name=name)


def test_matches_transformers_llama_rmsnorm_module(device):
    theirs = LlamaRMSNorm(64, eps=1e-6).to(device, torch.bfloat16)
    theirs.weight.data.normal_()
    ours = sparsefuse.nn.RMSNorm.from_module(theirs)
    assert ours.weight is theirs.weight and ours.variance_epsilon == 1e-6
    assert list(ours.state_dict()) == list(theirs.state_dict()) and repr(ours).endswith(repr(theirs)[12:])
    x = make((4, 9, 64), torch.bfloat16, device)
    assert_close_to_reference(ours(x), torch_rms_norm(x.double(), theirs.weight.double(), 1e-6), theirs(x))


def test_mixed_dtypes_promote_as_llama_rmsnorm(device):
    """bf16 activations with a float32 weight (autocast training with float32 master weights): the result is
    float32, as ``weight * normed.to(bfloat16)`` gives in LlamaRMSNorm; the gradients keep each input's dtype."""
    x = make((6, 40), torch.bfloat16, device).requires_grad_()
    w = make((40,), torch.float32, device).requires_grad_()
    y = sparsefuse.rms_norm(x, 40, w, 1e-6)
    assert y.dtype == torch.float32
    assert_close_to_reference(y, torch_rms_norm(x.detach().double(), w.detach().double(), 1e-6), lowp_llama(x, w, 1e-6))
    gx, gw = torch.autograd.grad(y.sum(), (x, w))
    assert gx.dtype == torch.bfloat16 and gw.dtype == torch.float32


def test_float64_gradcheck(device):
    x = torch.randn(5, 24, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(24, dtype=torch.float64, device=device, requires_grad=True)
    with track_launches() as launched:
        assert torch.autograd.gradcheck(lambda a, b: sparsefuse.rms_norm(a, 24, b, 1e-3), (x, w))
    assert launched["rms_norm_fwd_kernel"] >= 1 and launched["rms_norm_bwd_kernel"] >= 1


def test_eager_path_and_op_path_agree_bitwise(device, monkeypatch, plan):
    x = make((7, 50), torch.float32, device)
    w = make((50,), torch.float32, device)
    g = make((7, 50), torch.float32, device)

    def run():
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = sparsefuse.rms_norm(xr, 50, wr)
        return (y, *torch.autograd.grad(y, (xr, wr), g))

    eager = run()
    plan(eager_fast_path=False)
    through_op = run()
    for a, b in zip(eager, through_op):
        assert torch.equal(a, b)


def test_eager_backward_makes_no_gradient_for_rstd(device, monkeypatch, plan):
    """The eager twin's backward gets no materialised zero gradient for the per-row 1/rms it returns beside y (a
    kernel and its host time per norm per step), and a y that took no part in the loss gives no gradient at all."""
    import sparsefuse.norms.rmsnorm.op as rms_op

    seen = []
    backward_with = rms_op._backward_with

    def spy(backward, ctx, grad_y, grad_rstd):
        seen.append(grad_rstd)
        return backward_with(backward, ctx, grad_y, grad_rstd)

    class NoGradient(torch.autograd.Function):  # passes y on and gives it no gradient back
        @staticmethod
        def forward(ctx, a):
            return a.clone()

        @staticmethod
        def backward(ctx, grad):
            return None

    plan(eager_fast_path=True)
    monkeypatch.setattr(rms_op, "_backward_with", spy)
    x = make((5, 32), torch.float32, device).requires_grad_()
    w = make((32,), torch.float32, device).requires_grad_()
    sparsefuse.rms_norm(x, 32, w).backward(make((5, 32), torch.float32, device))
    assert seen == [None] and x.grad is not None and w.grad is not None
    x.grad, w.grad, seen[:] = None, None, []
    (NoGradient.apply(sparsefuse.rms_norm(x, 32, w)).sum() + x.sum()).backward()
    assert seen == [] and w.grad is None and torch.equal(x.grad, torch.ones_like(x))


def test_strided_and_multi_dim_normalized_shape(device):
    base = make((6, 2, 40), torch.float32, device)
    x = base.transpose(0, 1)  # [2, 6, 40], rows not contiguous
    w = make((6, 40), torch.float32, device)
    y = sparsefuse.rms_norm(x, (6, 40), w)
    ref = torch_rms_norm(x.double().reshape(2, 240), w.double().reshape(240), torch.finfo(torch.float32).eps)
    assert_close_to_reference(y.reshape(2, 240), ref)
    cols = make((40, 8), torch.float32, device).t()  # last dimension not contiguous: copied once
    assert_close_to_reference(sparsefuse.rms_norm(cols, 40), torch_rms_norm(cols.double(), None, EPS32))


def test_empty_inputs(device):
    w = torch.ones(16, device=device, requires_grad=True)
    x = torch.empty(0, 16, device=device, requires_grad=True)
    with track_launches() as launched:
        y = sparsefuse.rms_norm(x, 16, w)
        gx, gw = torch.autograd.grad(y.sum(), (x, w))
    assert y.shape == (0, 16) and gx.shape == (0, 16) and torch.equal(gw, torch.zeros(16, device=device))
    assert launched["rms_norm_fwd_kernel"] == 0


@pytest.mark.parametrize(
    "dtype, D", [(torch.float32, 32), (torch.bfloat16, 70), (torch.float16, 3), (torch.bfloat16, 2048)]
)
def test_nan_and_inf_propagate_per_row_as_torch(dtype, D, device):
    """A NaN poisons its row; an inf makes its row's 1/rms zero (inf * 0 = NaN where it was, 0 elsewhere), as
    LlamaRMSNorm gives; other rows are untouched. Whatever route a small eager call takes on CUDA: torch's native
    kernel returns such a row all NaN off its vectorised path (row lengths such as 3 and 70)."""
    x = make((4, D), dtype, device)
    x[1, D // 2] = float("nan")
    x[2, 0] = float("inf")
    with torch.no_grad():
        y = sparsefuse.rms_norm(x, D)
    assert torch.isnan(y[1]).all() and torch.isnan(y[2, 0]) and torch.equal(y[2, 1:], torch.zeros_like(y[2, 1:]))
    eps = torch.finfo(dtype).eps
    assert_close_to_reference(y, torch_rms_norm(x.double(), None, eps), lowp_llama(x, None, eps))


def test_bad_inputs(device):
    x = make((3, 8), torch.float32, device)
    with pytest.raises(TypeError, match="input must have a floating dtype"):
        sparsefuse.rms_norm(torch.ones(3, 8, dtype=torch.int32, device=device), 8)
    with pytest.raises(ValueError, match=r"normalized_shape \[7\] must equal the last dimensions of input"):
        sparsefuse.rms_norm(x, 7)
    with pytest.raises(ValueError, match=r"weight must have normalized_shape \[8\]"):
        sparsefuse.rms_norm(x, 8, torch.ones(4, device=device))
    with pytest.raises(TypeError, match="weight must have a floating dtype"):
        sparsefuse.rms_norm(x, 8, torch.ones(8, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="eps must be >= 0"):
        sparsefuse.rms_norm(x, 8, eps=-1.0)
    with pytest.raises(TypeError, match="normalized_shape must be an int"):
        sparsefuse.rms_norm(x, [])
    with pytest.raises(TypeError, match="input must be a torch.Tensor"):
        sparsefuse.rms_norm([1.0], 1)
    if device.type == "cpu":
        with pytest.raises(ValueError, match="weight"):
            sparsefuse.rms_norm(x, 8, torch.ones(8, device="meta"))


def test_opcheck(device):
    x = make((5, 24), torch.float32, device).requires_grad_()
    w = make((24,), torch.float32, device).requires_grad_()
    torch.library.opcheck(rms_norm_fwd_op, (x, w, 1e-6))
    torch.library.opcheck(rms_norm_fwd_op, (x, None, 1e-6))
    y, rstd = rms_norm_fwd_op(x.detach(), w.detach(), 1e-6)
    torch.library.opcheck(rms_norm_bwd_op, (torch.randn_like(y), x.detach(), w.detach(), rstd))
    torch.library.opcheck(rms_norm_bwd_op, (torch.randn_like(y), x.detach(), None, rstd))


def test_reference_backward_is_autograd_of_the_reference():
    """The closed form the kernels compute equals autograd through the float64 reference."""
    x = torch.randn(4, 12, dtype=torch.float64, requires_grad=True)
    w = torch.randn(12, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 12, dtype=torch.float64)
    gx, gw = torch.autograd.grad(torch_rms_norm(x, w, 1e-6), (x, w), g)
    rstd = torch.rsqrt(x.detach().pow(2).mean(-1) + 1e-6)
    cx, cw = torch_rms_norm_backward(g, x.detach(), w.detach(), rstd)
    torch.testing.assert_close(cx, gx)
    torch.testing.assert_close(cw, gw)


def test_torch_compile_fullgraph_has_no_graph_break(device):
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), sparsefuse.nn.RMSNorm(32), torch.nn.Linear(32, 4)).to(device)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    x = torch.randn(5, 16, device=device)
    with track_launches() as launched:
        compiled(x).sum().backward()
    assert launched["rms_norm_fwd_kernel"] >= 1 and launched["rms_norm_bwd_kernel"] >= 1
    assert model[1].weight.grad is not None


def test_compiled_inference_hands_the_compiler_the_plain_expression(device):
    """Under torch.compile without autograd the module is the plain torch expression (which the compiler fuses with
    its neighbours), not the fused op; the values are LlamaRMSNorm's either way."""
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), sparsefuse.nn.RMSNorm(32), torch.nn.Linear(32, 4)).to(device)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    x = torch.randn(5, 16, device=device)
    with torch.no_grad(), track_launches() as launched:
        y = compiled(x)
        expected = model[2](torch_rms_norm(model[0](x), model[1].weight, model[1].variance_epsilon))
    assert launched["rms_norm_fwd_kernel"] == 0, launched
    torch.testing.assert_close(y, expected)
    with track_launches() as launched:  # eager no-grad calls keep the kernel
        model(x)
    assert launched["rms_norm_fwd_kernel"] == 1


def test_zero_size_normalized_dimension(device):
    """An empty row (D = 0) is valid, as in torch.nn.functional.rms_norm: an empty result of input's shape."""
    x = torch.randn(3, 0, device=device, requires_grad=True)
    y = sparsefuse.rms_norm(x, 0)
    assert y.shape == (3, 0)
    assert torch.autograd.grad(y.sum(), x)[0].shape == (3, 0)


def test_from_module_refuses_a_wrapped_norm():
    theirs = LlamaRMSNorm(8)
    theirs._hf_hook = object()  # what accelerate's device maps attach
    with pytest.raises(ValueError, match="patch the model before"):
        sparsefuse.nn.RMSNorm.from_module(theirs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_weight", [False, True])
def test_host_bound_route_is_llama_rmsnorm_formula(dtype, with_weight, device, plan):
    """The route of small plain eager inference calls on CUDA (torch's native RMSNorm, then the weight) computes
    LlamaRMSNorm's formula: every call priced as a plain eager CUDA one here, so that it runs on any device, against
    the float64 reference."""
    plan(context="eager")
    x = make((3, 7, 48), dtype, device)
    w = make((48,), torch.float32 if dtype == torch.bfloat16 else dtype, device, 1.0) if with_weight else None
    with torch.no_grad(), track_launches() as launched:
        y = sparsefuse.rms_norm(x, 48, w, 1e-5)
    assert not launched, dict(launched)
    assert y.shape == x.shape and y.dtype == (x.dtype if w is None else torch.promote_types(x.dtype, w.dtype))
    ref = torch_rms_norm(x.double(), None if w is None else w.double(), 1e-5)
    assert_close_to_reference(y, ref, lowp_llama(x, w, 1e-5))


def test_host_bound_route_is_taken_by_small_eager_inference_on_cuda_only(device):
    from sparsefuse.norms.rmsnorm.functional import NATIVE_EAGER_MAX_BYTES, NATIVE_FUSED, _host_bound_inference

    cuda = device.type == "cuda" and NATIVE_FUSED
    small, w = make((8, 2048), torch.bfloat16, device), make((2048,), torch.bfloat16, device, 1.0)
    large = make((NATIVE_EAGER_MAX_BYTES // 4096 + 1, 2048), torch.bfloat16, device)
    with torch.no_grad():
        assert _host_bound_inference(small, w) is cuda and not _host_bound_inference(large, w)
    assert _host_bound_inference(small, w) is cuda  # nothing requires grad
    assert not _host_bound_inference(small, w.clone().requires_grad_())  # autograd: the kernel's backward
    with torch.no_grad():  # rows torch's native kernel may take off its vectorised path (inf rows all NaN there)
        assert not _host_bound_inference(make((8, 70), torch.bfloat16, device), None)
        assert not _host_bound_inference(make((8 * 2048 + 1,), torch.bfloat16, device)[1:].view(8, 2048), None)
        assert not _host_bound_inference(make((8, 4096), torch.bfloat16, device)[:, :2048], None)
    if cuda:
        with torch.no_grad(), track_launches() as launched:
            sparsefuse.rms_norm(small, 2048, w)
            sparsefuse.rms_norm(large, 2048, w)
        assert dict(launched) == {"rms_norm_fwd_kernel": 1}, dict(launched)
        # autocast runs torch's rms_norm in float32: the route still rounds to x's dtype, as the kernel does
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            routed = sparsefuse.rms_norm(small, 2048, w)
        eps = torch.finfo(torch.bfloat16).eps  # eps=None's default for bf16 input
        kernel = rms_launch.rms_norm_forward(small, w, eps)[0]
        assert routed.dtype == torch.bfloat16
        assert_close_to_reference(routed, torch_rms_norm(small.double(), w.double(), eps), kernel)
        rms_launch.rms_norm_forward(small, w, 1e-6)  # compiled for this shape before the capture (it cannot)
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream), torch.no_grad():
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream), track_launches() as captured:
                sparsefuse.rms_norm(small, 2048, w)
        assert captured["rms_norm_fwd_kernel"] == 1  # a capture replays the one kernel
