"""apply_rotary_pos_emb (fused RoPE of q and k) against a float64 reference and transformers' own function.

The tolerance is flash-attention's (see sparsefuse.testing): at most twice plain torch's error in the same dtype
plus a rounding allowance. cos and sin are random with unequal halves unless a test says otherwise, so a kernel
that assumed Llama's equal halves would fail.
"""

import pytest
import torch
from conftest import assert_backend
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply_rotary_pos_emb

from sparsefuse import track_launches
from sparsefuse.rotary import (
    apply_rotary_pos_emb,
    rotary_bwd_op,
    rotary_fwd_op,
    torch_apply_rotary_pos_emb,
    torch_rotary_backward,
)
from sparsefuse.testing import assert_close_to_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def randn(shape, dtype, device, scale=1.0):
    return (torch.randn(shape) * scale).to(dtype).to(device)


def make_qk(B, S, H, H_kv, hd, dtype, device, *, storage="bshd", unsqueeze_dim=1):
    """q, k in the layout unsqueeze_dim asks for, stored as [B, S, heads, hd] (Llama's projections viewed and
    transposed) or [B, heads, S, hd]: a transposed view in one of the two layouts, contiguous in the other."""

    def one(heads):
        if storage == "bshd":
            t = randn((B, S, heads, hd), dtype, device)
            return t.transpose(1, 2) if unsqueeze_dim == 1 else t
        t = randn((B, heads, S, hd), dtype, device)
        return t if unsqueeze_dim == 1 else t.transpose(1, 2)

    return one(H), one(H_kv)


def make_cos_sin(B, S, hd, dtype, device):
    """Random [B, S, hd] (B may be 1) cos and sin, halves unequal."""
    return randn((B, S, hd), dtype, device), randn((B, S, hd), dtype, device)


def references(q, k, cos, sin, unsqueeze_dim):
    """(float64 ground truth, transformers' formula in the inputs' dtype) for both outputs."""
    ref64 = torch_apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double(), unsqueeze_dim)
    lowp = hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    return ref64, lowp


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("storage", ["bshd", "bhsd"])
@pytest.mark.parametrize("cos_batch", [1, 2])
@pytest.mark.parametrize("hd", [64, 48])
def test_forward_matches_float64_reference(hd, cos_batch, storage, unsqueeze_dim, dtype, device):
    q, k = make_qk(2, 5, 4, 2, hd, dtype, device, storage=storage, unsqueeze_dim=unsqueeze_dim)
    cos, sin = make_cos_sin(cos_batch, 5, hd, dtype, device)
    assert_backend(q)
    with track_launches() as launched:
        q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    assert launched == {"rotary_fwd_kernel": 1}
    (q64, k64), (q_lp, k_lp) = references(q, k, cos, sin, unsqueeze_dim)
    for out, x, ref, lowp in ((q_out, q, q64, q_lp), (k_out, k, k64, k_lp)):
        assert out.shape == x.shape and out.dtype == dtype and out.stride() == x.stride()
        assert_close_to_reference(out, ref, lowp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("storage", ["bshd", "bhsd"])
@pytest.mark.parametrize("hd", [64, 80])
def test_backward_matches_float64_reference(hd, storage, unsqueeze_dim, dtype, device):
    B, S, H, H_kv = 2, 4, 3, 1
    q, k = make_qk(B, S, H, H_kv, hd, dtype, device, storage=storage, unsqueeze_dim=unsqueeze_dim)
    cos, sin = make_cos_sin(B, S, hd, dtype, device)
    gq, gk = randn(q.shape, dtype, device), randn(k.shape, dtype, device)
    qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
    with track_launches() as launched:
        q_out, k_out = apply_rotary_pos_emb(qr, kr, cos, sin, unsqueeze_dim=unsqueeze_dim)
        dq, dk = torch.autograd.grad((q_out, k_out), (qr, kr), (gq, gk))
    assert launched == {"rotary_fwd_kernel": 1, "rotary_bwd_kernel": 1}
    ql, kl = q.clone().requires_grad_(), k.clone().requires_grad_()
    dq_lp, dk_lp = torch.autograd.grad(
        hf_apply_rotary_pos_emb(ql, kl, cos, sin, unsqueeze_dim=unsqueeze_dim), (ql, kl), (gq, gk)
    )
    dq64, dk64 = torch_rotary_backward(gq.double(), gk.double(), cos.double(), sin.double(), unsqueeze_dim)
    for grad, x, ref, lowp in ((dq, q, dq64, dq_lp), (dk, k, dk64, dk_lp)):
        assert grad.dtype == dtype and grad.shape == x.shape
        assert_close_to_reference(grad, ref, lowp)


def test_head_blocks_loop_with_partial_tails(device, plan):
    """More heads than one loop step holds (the tile lowered), head counts that are not powers of two."""
    plan(rotary={"tile": 64})  # hd 48: HALF_PAD 32, two heads a step
    for H, H_kv in ((5, 3), (7, 0), (0, 2)):
        q, k = make_qk(2, 3, H, H_kv, 48, torch.float32, device)
        cos, sin = make_cos_sin(1, 3, 48, torch.float32, device)
        q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin)
        (q64, k64), (q_lp, k_lp) = references(q, k, cos, sin, 1)
        assert_close_to_reference(q_out, q64, q_lp)
        assert_close_to_reference(k_out, k64, k_lp)


def test_output_layouts(device):
    """Dense inputs (transposed views included) keep their strides; others give contiguous outputs; the gradients
    follow their incoming gradients by the same rule."""
    q, k = make_qk(2, 6, 4, 2, 32, torch.float32, device)  # [B, H, S, hd] views of [B, S, H, hd] storage
    cos, sin = make_cos_sin(2, 6, 32, torch.float32, device)
    q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin)
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()
    assert q_out.transpose(1, 2).is_contiguous()  # what SDPA gets from transformers today
    wide = randn((2, 4, 6, 40), torch.float32, device)[..., 4:36]  # not dense: a slice of the last dim
    cos_t = randn((2, 32, 6), torch.float32, device).transpose(1, 2)  # cos with a strided last dim
    w_out, _ = apply_rotary_pos_emb(wide, k, cos_t, sin)
    assert w_out.is_contiguous()
    assert_close_to_reference(w_out, *(r[0] for r in references(wide, k, cos_t, sin, 1)))
    qr = q.clone().requires_grad_()  # a clone keeps the transposed strides
    out, _ = apply_rotary_pos_emb(qr, k, cos, sin)
    g = randn(q.shape, torch.float32, device)
    (dq,) = torch.autograd.grad(out, qr, g)
    assert dq.is_contiguous()
    (dq_t,) = torch.autograd.grad(
        apply_rotary_pos_emb(qr, k, cos, sin)[0], qr, g.transpose(1, 2).contiguous().transpose(1, 2)
    )
    assert dq_t.stride() == q.stride()
    torch.testing.assert_close(dq, dq_t, rtol=0, atol=0)
    expanded = torch.ones((), device=device).expand(q.shape)  # the gradient of out.sum(): stride 0, read in place
    (d_sum,) = torch.autograd.grad(apply_rotary_pos_emb(qr, k, cos, sin)[0], qr, expanded)
    assert d_sum.is_contiguous()
    assert_close_to_reference(
        d_sum, torch_rotary_backward(expanded.double(), expanded.double(), cos.double(), sin.double())[0]
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_transformers_llama_with_real_rope(dtype, device):
    """Llama's own rotary embedding (cos, sin with equal halves, in q's dtype) and transformers' function."""
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    rope = LlamaRotaryEmbedding(config).to(device)
    B, S, hd = 2, 9, 64
    hidden = randn((B, S, 256), dtype, device)
    position_ids = torch.arange(S, device=device)[None].expand(B, S)
    cos, sin = rope(hidden, position_ids)
    assert cos.dtype == dtype and cos.shape == (B, S, hd)
    q, k = make_qk(B, S, 4, 2, hd, dtype, device)
    ours = apply_rotary_pos_emb(q, k, cos, sin, position_ids)
    theirs = hf_apply_rotary_pos_emb(q, k, cos, sin)
    ref64 = torch_apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double())
    for a, b, r in zip(ours, theirs, ref64):
        assert a.stride() == b.stride()
        assert_close_to_reference(a, r, b)


def test_mixed_dtypes_promote_like_transformers(device):
    """Under autocast Llama passes bfloat16 q, k with float32 cos, sin: the outputs are float32 (transformers'
    promotion), the gradients bfloat16 (q's dtype)."""
    q, k = make_qk(1, 4, 2, 2, 32, torch.bfloat16, device)
    cos, sin = make_cos_sin(1, 4, 32, torch.float32, device)
    qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
    q_out, k_out = apply_rotary_pos_emb(qr, kr, cos, sin)
    theirs = hf_apply_rotary_pos_emb(q, k, cos, sin)
    assert q_out.dtype == theirs[0].dtype == torch.float32
    ref64 = torch_apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double())
    assert_close_to_reference(q_out, ref64[0], theirs[0])
    assert_close_to_reference(k_out, ref64[1], theirs[1])
    g = randn(q.shape, torch.float32, device)
    (dq,) = torch.autograd.grad(q_out, qr, g)
    assert dq.dtype == torch.bfloat16
    ref = torch_rotary_backward(g.double(), g.double(), cos.double(), sin.double())[0]
    assert_close_to_reference(dq, ref)


def test_gradcheck_and_gradgradcheck_float64(device):
    q, k = make_qk(1, 2, 2, 1, 6, torch.float64, device)  # small: each check launches per perturbed element
    cos, sin = make_cos_sin(1, 2, 6, torch.float64, device)
    qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
    fn = lambda a, b: apply_rotary_pos_emb(a, b, cos, sin)  # noqa: E731
    with track_launches() as launched:
        assert torch.autograd.gradcheck(fn, (qr, kr))
        assert torch.autograd.gradgradcheck(fn, (qr, kr))
    assert launched["rotary_fwd_kernel"] > 0 and launched["rotary_bwd_kernel"] > 0


def test_cos_sin_requiring_grad_take_the_differentiable_formula(device):
    q, k = make_qk(2, 3, 2, 1, 16, torch.float32, device)
    cos, sin = make_cos_sin(1, 3, 16, torch.float32, device)
    cr, sr = cos.clone().requires_grad_(), sin.clone().requires_grad_()
    with track_launches() as launched:
        q_out, k_out = apply_rotary_pos_emb(q, k, cr, sr)
        dcos, dsin = torch.autograd.grad((q_out.sum() + 2 * k_out.sum()), (cr, sr))
    assert not launched
    c64, s64 = cos.double().requires_grad_(), sin.double().requires_grad_()
    r_q, r_k = torch_apply_rotary_pos_emb(q.double(), k.double(), c64, s64)
    ref = torch.autograd.grad(r_q.sum() + 2 * r_k.sum(), (c64, s64))
    assert_close_to_reference(dcos, ref[0], extra_abs=1e-5)
    assert_close_to_reference(dsin, ref[1], extra_abs=1e-5)
    assert_close_to_reference(q_out, r_q)


def test_eager_path_and_op_path_agree_bitwise(device, monkeypatch, plan):
    """The launcher (inference) and the autograd.Function (training) that plain eager calls take give the op's
    numbers exactly."""
    q, k = make_qk(2, 5, 4, 2, 48, torch.bfloat16, device)
    cos, sin = make_cos_sin(1, 5, 48, torch.bfloat16, device)
    gq, gk = randn(q.shape, torch.bfloat16, device), randn(k.shape, torch.bfloat16, device)

    def run(node):
        qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
        outs = apply_rotary_pos_emb(qr, kr, cos, sin)
        assert node in type(outs[0].grad_fn).__name__  # the path under test was taken
        return (*apply_rotary_pos_emb(q, k, cos, sin), *outs, *torch.autograd.grad(outs, (qr, kr), (gq, gk)))

    eager = run("EagerRotary")
    plan(eager_fast_path=False)
    through_op = run("sparsefuse_rotary_fwd")
    direct = (*rotary_fwd_op(q, k, cos, sin, 1), *rotary_bwd_op(gq, gk, cos, sin, 1, torch.bfloat16))
    for a, b in zip(eager, through_op):
        assert torch.equal(a, b) and a.stride() == b.stride()
    for a, b in zip(eager[2:], direct):
        assert torch.equal(a, b)


def test_opcheck(device):
    q, k = make_qk(2, 3, 3, 1, 16, torch.float32, device)
    cos, sin = make_cos_sin(1, 3, 16, torch.float32, device)
    torch.library.opcheck(rotary_fwd_op, (q.requires_grad_(), k.requires_grad_(), cos, sin, 1))
    q2, k2 = make_qk(2, 3, 2, 2, 12, torch.float32, device, storage="bhsd", unsqueeze_dim=2)
    torch.library.opcheck(rotary_fwd_op, (q2, k2, cos[..., :12].contiguous(), sin[..., :12].contiguous(), 2))
    gq, gk = randn(q.shape, torch.float32, device), randn(k.shape, torch.float32, device)
    torch.library.opcheck(rotary_bwd_op, (gq.requires_grad_(), gk.requires_grad_(), cos, sin, 1, torch.float32))
    torch.library.opcheck(
        rotary_bwd_op, (gq.detach().transpose(1, 2), gk.detach().transpose(1, 2), cos, sin, 2, torch.float32)
    )
    # the fakes' strides are the real outputs' (transposed views, a non-dense slice, mixed dtypes)
    from torch._subclasses.fake_tensor import FakeTensorMode

    wide = randn((2, 3, 3, 20), torch.float32, device)[..., :16]
    for args in [(q, k, cos, sin, 1), (wide, k, cos.double(), sin.double(), 1)]:
        real = rotary_fwd_op(*args)
        with FakeTensorMode() as mode:
            fake = rotary_fwd_op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        for r, f in zip(real, fake):
            assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)


def test_torch_compile_fullgraph_forward_and_backward(device):
    compile_backend = "inductor" if device.type == "cuda" else "aot_eager"
    q, k = make_qk(2, 5, 4, 2, 32, torch.float32, device)
    cos, sin = make_cos_sin(1, 5, 32, torch.float32, device)

    def attention_inputs(q, k):
        q_out, k_out = apply_rotary_pos_emb(q * 2.0, k, cos, sin)
        return (q_out * k_out.repeat_interleave(2, dim=1)).sum(-1)

    compiled = torch.compile(attention_inputs, fullgraph=True, backend=compile_backend)
    qc, kc = q.clone().requires_grad_(), k.clone().requires_grad_()
    with track_launches() as launched:
        out = compiled(qc, kc)
        out.sum().backward()
    assert launched["rotary_fwd_kernel"] >= 1 and launched["rotary_bwd_kernel"] >= 1
    qe, ke = q.clone().requires_grad_(), k.clone().requires_grad_()
    eager = attention_inputs(qe, ke)
    eager.sum().backward()
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(qc.grad, qe.grad)
    torch.testing.assert_close(kc.grad, ke.grad)


@pytest.mark.parametrize("shape", [(0, 5), (2, 0)])
def test_empty_inputs_launch_nothing(shape, device):
    B, S = shape
    q, k = make_qk(B, S, 4, 2, 16, torch.float32, device)
    cos, sin = make_cos_sin(max(B, 1), S, 16, torch.float32, device)
    qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
    with track_launches() as launched:
        q_out, k_out = apply_rotary_pos_emb(qr, kr, cos, sin)
        (q_out.sum() + k_out.sum()).backward()
    assert not launched
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert qr.grad.shape == q.shape and kr.grad.shape == k.shape


def test_bad_inputs_raise_clear_errors(device):
    q, k = make_qk(2, 5, 4, 2, 16, torch.float32, device)
    cos, sin = make_cos_sin(2, 5, 16, torch.float32, device)
    cases = [
        (TypeError, r"q must be a torch.Tensor", ([1.0], k, cos, sin), {}),
        (TypeError, r"k must have a floating dtype.*dtype int32", (q, k.int(), cos, sin), {}),
        (TypeError, r"k must have q's dtype.*dtype float16", (q, k.half(), cos, sin), {}),
        (TypeError, r"sin must have cos' dtype.*dtype float64", (q, k, cos, sin.double()), {}),
        (ValueError, r"unsqueeze_dim must be 1 .* or 2 .*got 3", (q, k, cos, sin), {"unsqueeze_dim": 3}),
        (ValueError, r"unsqueeze_dim must be 1 .*got True", (q, k, cos, sin), {"unsqueeze_dim": True}),
        (ValueError, r"q must be 4-D \[B, heads, S, hd\].*shape \[2, 4, 5\]", (q[..., 0], k, cos, sin), {}),
        (ValueError, r"k must be 4-D", (q, k[0], cos, sin), {}),
        (ValueError, r"head dim .* must be even.*shape \[2, 4, 5, 15\]", (q[..., :15], k, cos, sin), {}),
        (ValueError, r"k must be \[B, heads, S, hd\] with q's B=2, S=5 and hd=16", (q, k[:, :, :4], cos, sin), {}),
        (ValueError, r"k must be .*hd=16.*shape \[2, 2, 5, 8\]", (q, k[..., :8], cos, sin), {}),
        (
            ValueError,
            r"cos must be \[B, S, hd\] = \[2, 5, 16\].*shape \[3, 5, 16\]",
            (q, k, cos.repeat(2, 1, 1)[:3], sin),
            {},
        ),
        (ValueError, r"sin must be \[B, S, hd\].*shape \[5, 16\]", (q, k, cos, sin[0]), {}),
        (ValueError, r"sin must have cos' shape \[2, 5, 16\]", (q, k, cos, sin[:1]), {}),
        (
            ValueError,
            r"cos must be \[B, S, hd\] = \[2, 5, 16\].*shape \[2, 4, 16\]",
            (q.transpose(1, 2), k.transpose(1, 2), cos[:, :4], sin[:, :4]),
            {"unsqueeze_dim": 2},
        ),
    ]
    for error, message, args, kwargs in cases:
        with pytest.raises(error, match=message):
            apply_rotary_pos_emb(*args, **kwargs)
    with pytest.raises(ValueError, match=r"cos is on meta but q is on"):
        apply_rotary_pos_emb(q, k, cos.to("meta"), sin)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_llama_shapes(dtype, device):
    """Llama 3 8B's attention (32 heads, 8 KV heads, hd 128) at a training length, and odd sizes."""
    for B, S, H, H_kv, hd in [(2, 2048, 32, 8, 128), (3, 77, 40, 40, 80), (1, 1, 32, 8, 128)]:
        q, k = make_qk(B, S, H, H_kv, hd, dtype, device)
        cos, sin = make_cos_sin(1, S, hd, dtype, device)
        qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
        outs = apply_rotary_pos_emb(qr, kr, cos, sin)
        gq, gk = randn(q.shape, dtype, device), randn(k.shape, dtype, device)
        grads = torch.autograd.grad(outs, (qr, kr), (gq, gk))
        (q64, k64), (q_lp, k_lp) = references(q, k, cos, sin, 1)
        assert_close_to_reference(outs[0], q64, q_lp)
        assert_close_to_reference(outs[1], k64, k_lp)
        dq64, dk64 = torch_rotary_backward(gq.double(), gk.double(), cos.double(), sin.double())
        assert_close_to_reference(grads[0], dq64)
        assert_close_to_reference(grads[1], dk64)


@pytest.mark.gpu
def test_gpu_above_int32_elements(device):
    """q of 2^31 + 2^20 elements (a transposed view of [1, S, 8, 128]): offsets past 2^31 need int64 arithmetic
    (checked at the last tokens)."""
    B, S, H, hd = 1, (1 << 21) + (1 << 10), 8, 128
    q = torch.randn((B, S, H, hd), dtype=torch.float16, device=device).transpose(1, 2)
    k = q[:, :1]
    cos = torch.randn((1, S, hd), dtype=torch.float16, device=device)
    sin = torch.randn((1, S, hd), dtype=torch.float16, device=device)
    q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin)
    tail = slice(S - 1024, S)
    (q64, k64), (q_lp, k_lp) = references(q[:, :, tail], k[:, :, tail], cos[:, tail], sin[:, tail], 1)
    assert_close_to_reference(q_out[:, :, tail], q64, q_lp)
    assert_close_to_reference(k_out[:, :, tail], k64, k_lp)
