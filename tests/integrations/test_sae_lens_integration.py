"""sparsefuse.integrations.sae_lens against the real sae_lens package: patched JumpReLUSAE / TopKSAE vs unpatched.

SAEs are built with random weights in Gemma Scope's structure (unit-norm decoder rows, untied encoder, thresholds
that give a target mean L0). CPU/interpreter runs use a scaled-down shape (d_in 64, d_sae 1024, L0 ~12); the real
Gemma Scope 2B width (d_in 2304, d_sae 65536, L0 ~72) runs in the GPU tests.

The patched SAE must give the float64 run's result within the per-dtype bound of sparsefuse.testing, where the
unpatched SAE in the same dtype sets torch's own error. Thresholds (JumpReLU) and tokens (TopK) are chosen so that
no pre-activation lies within the low-precision computations' measured deviation of a firing/selection boundary:
there, SAELens (deciding on the dtype-rounded value) and the kernels (deciding in float32) may legitimately differ.
"""

import copy
import dataclasses
import io

import pytest
import torch
from conftest import DEVICE

from sparsefuse import track_launches
from sparsefuse.testing import accumulation_allowance, assert_close_to_reference, assert_norm_close_to_reference

sae_lens = pytest.importorskip("sae_lens")
from sae_lens import (  # noqa: E402
    JumpReLUSAE,
    JumpReLUSAEConfig,
    StandardSAE,
    StandardSAEConfig,
    TopKSAE,
    TopKSAEConfig,
)

import sparsefuse.integrations.sae_lens as sf_sae_lens  # noqa: E402

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
SMALL = dict(d_in=64, d_sae=1024, l0=12, tokens=16)  # Gemma Scope's structure, interpreter-sized
GEMMA_2B = dict(d_in=2304, d_sae=65536, l0=72, tokens=256)


# --- building SAEs ------------------------------------------------------------------------------------------------
def build_sae(cls, config_cls, d_in, d_sae, dtype, device, **config):
    """A sae_lens SAE with Gemma-Scope-like random weights: unit-norm decoder rows, an untied encoder."""
    sae = cls(config_cls(d_in=d_in, d_sae=d_sae, dtype=DTYPE_NAMES[dtype], device=str(device), **config))
    g = torch.Generator(device="cpu").manual_seed(1)
    w_dec = torch.randn(d_sae, d_in, generator=g)
    with torch.no_grad():
        sae.W_dec.copy_(w_dec / w_dec.norm(dim=1, keepdim=True))
        sae.W_enc.copy_(torch.randn(d_in, d_sae, generator=g) / d_in**0.5)
        sae.b_enc.copy_(torch.randn(d_sae, generator=g) * 0.1)
        sae.b_dec.copy_(torch.randn(d_in, generator=g) * 0.1)
    return sae


def pre_activations(sae, x):
    """float64 pre-activations [tokens, d_sae] of the SAE's parameters, and how far SAELens' dtype computation and
    the kernels' float32 one can stray from them (measured, plus an allowance for another fp32 summation order)."""
    p = {n: t.detach() for n, t in sae.named_parameters()}
    b_dec = p["b_dec"] if sae.cfg.apply_b_dec_to_input else torch.zeros_like(p["b_dec"])
    sae_in = x.to(sae.dtype) - b_dec  # rounded to the dtype, as SAELens' process_sae_in does
    pre64 = (x.double() - b_dec.double()) @ p["W_enc"].double() + p["b_enc"].double()
    pre_lowp = sae_in @ p["W_enc"] + p["b_enc"]
    pre_f32 = sae_in.float() @ p["W_enc"].float() + p["b_enc"].float()
    deviation = torch.maximum((pre_lowp.double() - pre64).abs(), (pre_f32.double() - pre64).abs())
    deviation = deviation + accumulation_allowance(sae_in, p["W_enc"])
    if getattr(sae.cfg, "rescale_acts_by_decoder_norm", False):
        norm = p["W_dec"].double().norm(dim=1)
        pre64, deviation = pre64 * norm, deviation * norm + torch.finfo(sae.dtype).eps * (pre64 * norm).abs()
    return pre64, deviation


def set_jumprelu_thresholds(sae, x, l0):
    """Thresholds giving a mean L0 of about ``l0`` on ``x``, each at least twice the deviation away from every
    token's pre-activation: feature f fires for its n_f highest tokens, n_f ~ Poisson (moved by one, or to 0, where
    the gap between the n-th and (n+1)-th highest is too small)."""
    pre64, deviation = pre_activations(sae, x)
    tokens, d_sae = pre64.shape
    margin = 2 * deviation + 1e-6
    top, top_tok = pre64.topk(6, dim=0)  # [6, d_sae]: the highest tokens of each feature
    top_margin = margin.gather(0, top_tok)
    g = torch.Generator(device="cpu").manual_seed(2)
    wanted = torch.poisson(torch.full((d_sae,), tokens * l0 / d_sae), generator=g).clamp(max=4).long().to(x.device)
    silent = top[0] + 2 * top_margin[0] + 1.0  # above every token
    threshold = silent.clone()
    for n in (wanted - 1, wanted + 1, wanted):  # later candidates take precedence
        upper, lower = top.gather(0, (n - 1).clamp(min=0)[None])[0], top.gather(0, n.clamp(min=0)[None])[0]
        room = torch.maximum(
            top_margin.gather(0, (n - 1).clamp(min=0)[None])[0], top_margin.gather(0, n.clamp(min=0)[None])[0]
        )
        fits = (n >= 1) & (wanted >= 1) & (upper - lower > 2 * room)
        threshold = torch.where(fits, (upper + lower) / 2, threshold)
    threshold = threshold.to(sae.dtype)
    near = ((pre64 - threshold.double()).abs() <= margin).any(0)  # after rounding the thresholds to the dtype
    threshold = torch.where(near, silent.to(sae.dtype), threshold)
    assert not bool(((pre64 - threshold.double()).abs() <= margin).any())
    with torch.no_grad():
        sae.threshold.copy_(threshold)
    return pre64


def separated_tokens(sae, tokens, k, device):
    """``tokens`` random inputs whose k-th and (k+1)-th pre-activations are far apart (rejection sampling)."""
    x = torch.randn(8 * tokens, sae.cfg.d_in, device=device).to(sae.dtype)
    pre64, deviation = pre_activations(sae, x)
    values, order = pre64.sort(dim=1, descending=True)
    spread = deviation.gather(1, order[:, k - 1 : k + 1]).sum(1)
    keep = (values[:, k - 1] - values[:, k] > 4 * spread).nonzero().flatten()[:tokens]
    assert keep.numel() == tokens, "too few well-separated tokens: enlarge the pool"
    return x[keep]


def float64_copy(sae):
    """The same SAE in float64, unpatched. (Not copy.deepcopy: SAELens' hook_z reshape closures would still point
    at the original.)"""
    ref = type(sae)(dataclasses.replace(sae.cfg, dtype="float64"))
    ref.load_state_dict({name: t.double() for name, t in sae.state_dict().items()})
    ref._use_error_term = sae.use_error_term
    return ref


def summation_allowances(sae, x, ref_acts):
    """{"extra_abs": ...} for the feature activations and for the reconstruction: the fp32 rounding a correct
    kernel may add by summing the encoder's dot products (and then the decoder's) in another order than torch --
    on the GPU torch's own fp32 result is so close to float64 that this slack, not torch's error, sets the bound."""
    p = {n: t.detach() for n, t in sae.named_parameters()}
    b_dec = p["b_dec"] if sae.cfg.apply_b_dec_to_input else torch.zeros_like(p["b_dec"])
    sae_in = x.reshape(-1, x.shape[-1]).to(sae.dtype) - b_dec
    fired = ref_acts.reshape(-1, ref_acts.shape[-1]) != 0
    encode = accumulation_allowance(sae_in, p["W_enc"]) * fired
    decode = accumulation_allowance(ref_acts.reshape(fired.shape), p["W_dec"]) + encode @ p["W_dec"].double().abs()
    return {"extra_abs": encode.reshape(ref_acts.shape)}, {"extra_abs": decode.reshape(x.shape)}


def reference_and_torch(sae, x, method="forward"):
    """(float64 run of the SAE, unpatched SAE in its dtype): call before patching ``sae``."""
    assert not sf_sae_lens.is_patched(sae)
    with torch.no_grad():
        return getattr(float64_copy(sae), method)(x.double()), getattr(sae, method)(x)


# --- JumpReLU -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_jumprelu_forward_decode_and_encode_match_sae_lens(dtype, device):
    sae = build_sae(JumpReLUSAE, JumpReLUSAEConfig, SMALL["d_in"], SMALL["d_sae"], dtype, device)
    x = torch.randn(2, SMALL["tokens"] // 2, SMALL["d_in"], device=device).to(dtype)
    pre64 = set_jumprelu_thresholds(sae, x.reshape(-1, SMALL["d_in"]), SMALL["l0"])
    l0 = ((pre64 > sae.threshold.double()) & (pre64 > 0)).sum(1).float()
    assert 6 <= float(l0.mean()) <= 20 and int(l0.max()) <= 64
    ref_out, torch_out = reference_and_torch(sae, x)
    ref_acts, torch_acts = reference_and_torch(sae, x, "encode")
    sf_sae_lens.patch(sae, max_l0=64, decode_method="fixed")
    with torch.no_grad(), track_launches() as launched:
        out = sae(x)
    assert launched["jumprelu_encode_kernel"] == 1 and launched["gather_accumulate_kernel"] == 1
    assert out.shape == x.shape and out.dtype == dtype
    assert_close_to_reference(out, ref_out, torch_out, name="reconstruction")
    with torch.no_grad(), track_launches() as launched:
        acts = sae.encode(x)  # SAELens' own dense encode
        recon = sae.decode(acts)  # sparse_decode
    # the decode's ELL rows, then its overflowed rows' scan
    assert launched["jumprelu_encode_kernel"] == 0 and launched["gather_accumulate_kernel"] == 2
    assert torch.equal(acts != 0, ref_acts != 0)
    assert_close_to_reference(acts, ref_acts, torch_acts, name="feature activations")
    assert_close_to_reference(recon, ref_out, torch_out, name="decode(encode(x))")


@pytest.mark.parametrize("dtype", DTYPES)
def test_jumprelu_default_forward_is_cublas_encode_then_scan_decode(dtype, device):
    sae = build_sae(JumpReLUSAE, JumpReLUSAEConfig, SMALL["d_in"], SMALL["d_sae"], dtype, device)
    x = torch.randn(SMALL["tokens"], SMALL["d_in"], device=device).to(dtype)
    set_jumprelu_thresholds(sae, x, SMALL["l0"])
    ref_out, torch_out = reference_and_torch(sae, x)
    sf_sae_lens.patch(sae, decode_method="scan")  # (auto would pick cuBLAS for this small dictionary)
    with torch.no_grad(), track_launches() as launched:
        out = sae(x)
    # no epilogue encode: cuBLAS, then the scan and its long-row pass (which exits at once: no token is long)
    assert dict(launched) == {"gather_accumulate_kernel": 2}
    assert_close_to_reference(out, ref_out, torch_out, name="reconstruction")


def test_jumprelu_overflowing_tokens_are_recomputed_not_truncated(device):
    sae = build_sae(JumpReLUSAE, JumpReLUSAEConfig, SMALL["d_in"], SMALL["d_sae"], torch.float32, device)
    x = torch.randn(SMALL["tokens"], SMALL["d_in"], device=device)
    pre64 = set_jumprelu_thresholds(sae, x, SMALL["l0"])
    l0 = ((pre64 > sae.threshold.double()) & (pre64 > 0)).sum(1)
    ref_out, torch_out = reference_and_torch(sae, x)
    # An ELL narrower than the busiest tokens' L0 (a few: the interpreter recomputes each one slowly).
    width = int(l0.sort().values[-4])
    sf_sae_lens.patch(sae, max_l0=width)
    assert 1 <= int((l0 > width).sum()) <= 3
    with torch.no_grad(), track_launches() as launched:
        out = sae(x)
    assert launched["jumprelu_encode_kernel"] == 1
    assert_close_to_reference(out, ref_out, torch_out)


def test_gradients_and_hooks_take_the_unfused_path(device):
    sae = build_sae(JumpReLUSAE, JumpReLUSAEConfig, SMALL["d_in"], SMALL["d_sae"], torch.float32, device)
    x = torch.randn(6, SMALL["d_in"], device=device)
    set_jumprelu_thresholds(sae, x, SMALL["l0"])
    ref_out, torch_out = reference_and_torch(sae, x)
    sf_sae_lens.patch(sae, decode_method="fixed", fused_encode=True)
    with track_launches() as launched:  # parameters require grad: SAELens encode + differentiable sparse_decode
        out = sae(x)
    assert launched["jumprelu_encode_kernel"] == 0 and launched["gather_accumulate_kernel"] == 2
    assert out.grad_fn is not None  # (sparse_decode's backward itself is tested in test_sae_decode.py)
    assert_close_to_reference(out, ref_out, torch_out)
    seen = {}
    sae.hook_sae_acts_post.add_hook(lambda acts, hook: seen.setdefault("acts", acts.clone()))
    sae.hook_sae_recons.add_hook(lambda recon, hook: seen.setdefault("recons", recon.clone()))
    with torch.no_grad(), track_launches() as launched:
        out = sae(x)
    assert launched["jumprelu_encode_kernel"] == 0  # a hook wants the dense activations
    assert torch.equal(seen["acts"], sae.encode(x).detach()) and torch.equal(seen["recons"], out)
    sae.reset_hooks()
    with torch.no_grad(), track_launches() as launched:
        sae(x)
    assert launched["jumprelu_encode_kernel"] == 1


@pytest.mark.parametrize(
    "config",
    [
        dict(normalize_activations="layer_norm"),
        dict(normalize_activations="constant_norm_rescale", apply_b_dec_to_input=False),
        dict(reshape_activations="hook_z"),
    ],
)
def test_normalization_reshape_and_error_term(config, device):
    sae = build_sae(JumpReLUSAE, JumpReLUSAEConfig, SMALL["d_in"], SMALL["d_sae"], torch.float32, device, **config)
    x = (
        torch.randn(8, 4, SMALL["d_in"] // 4, device=device)
        if "reshape_activations" in config
        else torch.randn(8, SMALL["d_in"], device=device) * 3 + 1
    )
    with torch.no_grad():
        sae_in = sae.run_time_activation_norm_fn_in(x.reshape(8, SMALL["d_in"]))
    sae.run_time_activation_norm_fn_out(sae_in)  # (clears the stored normalisation state)
    set_jumprelu_thresholds(sae, sae_in, SMALL["l0"])
    ref_out, torch_out = reference_and_torch(sae, x)
    sf_sae_lens.patch(sae, fused_encode=True)
    with torch.no_grad(), track_launches() as launched:
        out = sae(x)
    assert launched["jumprelu_encode_kernel"] == 1
    assert out.shape == x.shape
    assert_close_to_reference(out, ref_out, torch_out)
    with pytest.warns(DeprecationWarning):
        sae.use_error_term = True  # SAELens then adds x minus a hook-free reconstruction: the output is ~x
    with torch.no_grad():
        out = sae(x)
    ref_out, torch_out = reference_and_torch(sf_sae_lens.unpatch(sae), x)
    assert_close_to_reference(out, ref_out, torch_out, name="output with the error term")


# --- TopK ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fused_encode", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_forward_decode_and_encode_match_sae_lens(dtype, fused_encode, device):
    """Default: SAELens' encode matmul and torch.topk, then topk_decode; fused_encode: topk_encode's epilogue."""
    k = SMALL["l0"]
    sae = build_sae(TopKSAE, TopKSAEConfig, SMALL["d_in"], SMALL["d_sae"], dtype, device, k=k)
    x = separated_tokens(sae, SMALL["tokens"], k, device)
    ref_out, torch_out = reference_and_torch(sae, x)
    ref_acts, torch_acts = reference_and_torch(sae, x, "encode")
    acts_slack, recon_slack = summation_allowances(sae, x, ref_acts)
    sf_sae_lens.patch(sae, decode_method="fixed", fused_encode=fused_encode or None)
    with torch.no_grad(), track_launches() as launched:
        out = sae(x)
    assert launched["topk_encode_fwd_kernel"] == int(fused_encode) and launched["gather_accumulate_kernel"] == 1
    assert_close_to_reference(out, ref_out, torch_out, name="reconstruction", **recon_slack)
    with torch.no_grad(), track_launches() as launched:
        acts = sae.encode(x)
        recon = sae.decode(acts)
    assert launched["topk_encode_fwd_kernel"] == int(fused_encode) and launched["gather_accumulate_kernel"] == 2
    assert torch.equal(acts != 0, ref_acts != 0) and int((acts != 0).sum(1).max()) == k
    assert_close_to_reference(acts, ref_acts, torch_acts, name="feature activations", **acts_slack)
    assert_close_to_reference(recon, ref_out, torch_out, name="decode(encode(x))", **recon_slack)


def test_topk_rescale_acts_by_decoder_norm(device):
    sae = build_sae(
        TopKSAE,
        TopKSAEConfig,
        SMALL["d_in"],
        SMALL["d_sae"],
        torch.float32,
        device,
        k=8,
        rescale_acts_by_decoder_norm=True,
        apply_b_dec_to_input=False,
    )
    with torch.no_grad():
        sae.W_dec.mul_(torch.rand(SMALL["d_sae"], 1, device=device) + 0.5)  # rows of different norms
    x = separated_tokens(sae, 8, 8, device)
    ref_out, torch_out = reference_and_torch(sae, x)
    ref_acts, torch_acts = reference_and_torch(sae, x, "encode")
    for fused_encode in (False, True):
        sf_sae_lens.patch(sae, fused_encode=fused_encode)
        with torch.no_grad():
            assert_close_to_reference(sae(x), ref_out, torch_out)
            assert_close_to_reference(sae.encode(x), ref_acts, torch_acts)


# --- patch bookkeeping --------------------------------------------------------------------------------------------
def test_unpatch_float64_and_unsupported_saes(device):
    sae = build_sae(JumpReLUSAE, JumpReLUSAEConfig, 16, 64, torch.float32, device)
    original_forward, keys = sae.forward, list(sae.state_dict())
    assert sf_sae_lens.patch(sae) is sae and sf_sae_lens.is_patched(sae)
    assert sae.forward != original_forward and list(sae.state_dict()) == keys
    sf_sae_lens.unpatch(sae)
    assert not sf_sae_lens.is_patched(sae) and sae.forward == original_forward
    sf_sae_lens.patch(sae).to(torch.float64)  # no float64 kernels: SAELens' own code runs
    x = torch.randn(3, 16, device=device, dtype=torch.float64)
    with torch.no_grad(), track_launches() as launched:
        out = sae(x)
    assert sum(launched.values()) == 0 and torch.equal(out, sf_sae_lens.unpatch(sae)(x))
    with pytest.raises(ValueError, match="supports SAELens JumpReLUSAE and TopKSAE.*StandardSAE.*'standard'"):
        sf_sae_lens.patch(StandardSAE(StandardSAEConfig(d_in=8, d_sae=16)))
    from sae_lens.saes.abstopk_sae import AbsTopKSAE, AbsTopKSAEConfig

    with pytest.raises(ValueError, match="AbsTopKSAE.*activation AbsTopK"):
        sf_sae_lens.patch(AbsTopKSAE(AbsTopKSAEConfig(d_in=8, d_sae=16, k=2)))
    with pytest.raises(TypeError, match="expected a sae_lens SAE, got Linear"):
        sf_sae_lens.patch(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="max_l0 must be a positive int; got 0"):
        sf_sae_lens.patch(sae, max_l0=0)


def identity(x, *_):
    return x


@pytest.mark.parametrize("architecture", ["jumprelu", "topk"])
def test_patch_twice_pickling_and_deepcopy(architecture, device):
    """Patching again keeps the SAE patched (with the new call's settings); torch.save/torch.load and copy.deepcopy
    give a patched SAE whose methods are bound to the copy. sae_lens 6 SAEs hold lambdas (reshape and run-time
    normalisation functions) that pickle refuses, patched or not: the round trip replaces them with a module-level
    identity, which is what they compute here."""
    if architecture == "jumprelu":
        sae = build_sae(JumpReLUSAE, JumpReLUSAEConfig, 16, 64, torch.float32, device)
    else:
        sae = build_sae(TopKSAE, TopKSAEConfig, 16, 64, torch.float32, device, k=4)
    for name in (
        "reshape_fn_in",
        "reshape_fn_out",
        "run_time_activation_norm_fn_in",
        "run_time_activation_norm_fn_out",
    ):
        setattr(sae, name, identity)
    x = torch.randn(5, 16, device=device)
    assert sf_sae_lens.patch(sae, decode_method="fixed") is sae
    with torch.no_grad():
        expected = sae(x)
    assert sf_sae_lens.patch(sae, decode_method="fixed") is sae and sf_sae_lens.is_patched(sae)
    buffer = io.BytesIO()
    torch.save(sae, buffer)
    buffer.seek(0)
    for copied in (torch.load(buffer, weights_only=False), copy.deepcopy(sae)):
        assert sf_sae_lens.is_patched(copied)
        with torch.no_grad(), track_launches() as launched:
            torch.testing.assert_close(copied(x), expected, rtol=0, atol=0)
            torch.testing.assert_close(copied.decode(copied.encode(x)), expected)
        assert launched["gather_accumulate_kernel"] >= 1
        with torch.no_grad():
            copied.W_dec.zero_()  # the copy's methods read the copy's parameters, not the original's
            assert not torch.equal(copied(x), expected) and torch.equal(sae(x), expected)


# --- GPU: the real Gemma Scope 2B width ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_gemma_scope_2b_jumprelu(dtype, device):
    sae = build_sae(JumpReLUSAE, JumpReLUSAEConfig, GEMMA_2B["d_in"], GEMMA_2B["d_sae"], dtype, device)
    x = torch.randn(GEMMA_2B["tokens"], GEMMA_2B["d_in"], device=device).to(dtype)
    pre64 = set_jumprelu_thresholds(sae, x, GEMMA_2B["l0"])
    l0 = ((pre64 > sae.threshold.double()) & (pre64 > 0)).sum(1).float()
    assert 50 <= float(l0.mean()) <= 90
    ref_out, torch_out = reference_and_torch(sae, x)
    _, recon_slack = summation_allowances(sae, x, reference_and_torch(sae, x, "encode")[0])
    for max_l0 in (256, 32):  # 32: most tokens overflow and are recomputed on the device
        sf_sae_lens.patch(sae, max_l0=max_l0)
        with torch.no_grad(), track_launches() as launched:
            out = sae(x)
        assert launched["jumprelu_encode_kernel"] == 1
        assert_close_to_reference(out, ref_out, torch_out, name=f"reconstruction, max_l0={max_l0}", **recon_slack)


@pytest.mark.gpu
@pytest.mark.parametrize("fused_encode", [False, True])
def test_gpu_gemma_scope_2b_topk(fused_encode, device):
    """bf16 at k = 64. Default: SAELens' own selection, then the sparse decode. fused_encode: SAELens picks among
    bf16-rounded near-ties, we pick on float32 values. Either way the reconstruction must be at least as close to
    the float64 run as SAELens' (norm-wise), and the selection a valid top-k."""
    from helpers import assert_valid_topk, pre_activations_and_bound

    sae = build_sae(
        TopKSAE,
        TopKSAEConfig,
        GEMMA_2B["d_in"],
        GEMMA_2B["d_sae"],
        torch.bfloat16,
        device,
        k=64,
        apply_b_dec_to_input=False,
    )
    x = torch.randn(GEMMA_2B["tokens"], GEMMA_2B["d_in"], device=device).to(torch.bfloat16)
    ref_out, torch_out = reference_and_torch(sae, x)
    sae_lens_acts = reference_and_torch(sae, x, "encode")[1]
    sf_sae_lens.patch(sae, fused_encode=fused_encode)
    with torch.no_grad(), track_launches() as launched:
        out = sae(x)
        acts = sae.encode(x)
    assert launched["topk_encode_fwd_kernel"] == 2 * fused_encode and launched["gather_accumulate_kernel"] == 1
    assert_norm_close_to_reference(out, ref_out, torch_out)
    if not fused_encode:
        assert torch.equal(acts, sae_lens_acts)  # SAELens' own encode
        return
    values, indices = acts.float().topk(64, dim=1)
    pre, bound = pre_activations_and_bound(x, sae.W_enc.detach(), sae.b_enc.detach())
    assert_valid_topk(indices, values.to(torch.bfloat16), pre, bound, 64)


def test_sae_forward_benchmark_implementations_agree(device, monkeypatch):
    """The ``sae_forward`` workload's implementations on a tiny shape (the benchmark itself needs a GPU)."""
    from sparsefuse.bench.workloads import sae_forward

    monkeypatch.setattr(sae_forward, "TOKENS", 8)
    monkeypatch.setattr(sae_forward, "TOPK_K", 6)
    for architecture in ("jumprelu", "topk"):
        case = sae_forward._case(architecture, ("tiny", 32, 256, 6), torch.float32, str(device))
        (x,) = case.make_inputs()
        weights = sae_forward.weights_for((architecture, 32, 256, 6, torch.float32, str(device)))
        assert set(weights.sae_lens) == set(sae_forward.SAE_LENS_IMPLS[architecture])
        with torch.no_grad(), track_launches() as launched:
            outs = {
                name: case.impls[name](x)
                for name in ("sparsefuse fused", "eager", *sae_forward.SAE_LENS_IMPLS[architecture])
            }
        # one gather each: "sparsefuse fused", the low-memory patch, and TopK's default patch (JumpReLU's decodes
        # 256 features on cuBLAS: auto's small-dictionary rule, then the pass over its non-finite elements)
        assert launched["gather_accumulate_kernel"] == (2 if architecture == "jumprelu" else 3)
        assert launched["complete_nonfinite_rows_kernel"] == (1 if architecture == "jumprelu" else 0)
        dense = sae_forward.dense_jumprelu_forward if architecture == "jumprelu" else sae_forward.dense_topk_forward
        params = [
            getattr(weights, n).double()
            for n in ("W_enc", "b_enc", "threshold", "W_dec", "b_dec")
            if architecture == "jumprelu" or n != "threshold"
        ]
        ref = dense(x.double(), *params)
        for name, out in outs.items():
            assert_close_to_reference(out, ref, outs["eager"], name=f"{architecture} {name}")
