"""Fused JumpReLU encode -> ELL, against the float64 dense reference (interpreter: fp16/fp32 tl.dot only)."""

import pytest
import torch
from conftest import DEVICE, assert_backend

from sparsefuse import track_launches
from sparsefuse.sae import JumpReLUEncoder, jumprelu_sae_forward
from sparsefuse.sae.encode import jumprelu_encode, torch_jumprelu_encode
from sparsefuse.sparse import sparse_matmul
from sparsefuse.testing import accumulation_allowance, assert_close_to_reference

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def make_sae(M, d_in, d_sae, dtype, device, margin, shift_input=True):
    """Random SAE whose pre-activations stay at least `margin` away from the thresholds (so the float64 reference
    and a low-precision matmul agree on which features fire); ``shift_input``: b_dec is subtracted from x first."""
    x = torch.randn(M, d_in).to(dtype)
    w = (torch.randn(d_in, d_sae) / d_in**0.5).to(dtype)
    b_enc = torch.randn(d_sae) * 0.1
    b_dec = (torch.randn(d_in) * 0.1).to(dtype)
    pre = (x.double() - (b_dec.double() if shift_input else 0.0)) @ w.double() + b_enc.double()
    threshold = torch.full((d_sae,), 1.2)
    near = (pre - threshold.double()).abs() < margin
    b_enc = b_enc - torch.where(near.any(0), 3 * margin, 0.0)  # shift the features that come too close
    return [t.to(device) for t in (x, w, b_enc, threshold, b_dec)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, d_in, d_sae", [(5, 40, 100), (33, 64, 256), (1, 17, 45)])
def test_encode_matches_reference(M, d_in, d_sae, dtype, device):
    x, w, b_enc, threshold, b_dec = make_sae(M, d_in, d_sae, dtype, device, margin=0.05)
    assert_backend(x)
    with track_launches() as launched:
        ell = jumprelu_encode(x, w, b_enc, threshold, b_dec=b_dec, max_l0=d_sae)
    assert launched["jumprelu_encode_kernel"] == 1
    ref = torch_jumprelu_encode(x, w, b_enc, threshold, b_dec)
    assert torch.equal(ell.counts.cpu(), (ref != 0).sum(1).to(torch.int32).cpu())
    dense = ell.to_dense().double().cpu()
    assert torch.equal(dense != 0, (ref != 0).cpu())
    tol = 8 * torch.finfo(dtype).eps * ref.abs().max()
    assert (dense - ref.cpu()).abs().max() <= tol
    # entries in feature order (the same ELL on every run, whatever order the slots were claimed in)
    fired_ids = [ref[m].nonzero().flatten().tolist() for m in range(M)]
    assert [ell.indices[m, : len(ids)].tolist() for m, ids in enumerate(fired_ids)] == fired_ids
    again = jumprelu_encode(x, w, b_enc, threshold, b_dec=b_dec, max_l0=d_sae)
    assert torch.equal(again.values, ell.values) and torch.equal(again.indices, ell.indices)


def test_overflow_is_counted_flagged_and_never_silent(device):
    x, w, b_enc, threshold, b_dec = make_sae(9, 32, 200, torch.float32, device, margin=0.05)
    ref = torch_jumprelu_encode(x, w, b_enc, threshold, b_dec)
    width = max(1, int((ref != 0).sum(1).max()) // 2)
    ell = jumprelu_encode(x, w, b_enc, threshold, b_dec=b_dec, max_l0=width)
    assert torch.equal(ell.counts.cpu(), (ref != 0).sum(1).to(torch.int32).cpu())
    over = ell.overflowed()
    assert over.any()
    decoded = sparse_matmul(ell, torch.randn(200, 8, device=device))
    assert torch.isnan(decoded[over]).all() and not torch.isnan(decoded[~over]).any()
    with pytest.raises(ValueError, match=f"but max_l0={width}"):
        jumprelu_encode(x, w, b_enc, threshold, b_dec=b_dec, max_l0=width, validate=True)


def test_encode_errors(device):
    x, w, b_enc, threshold, b_dec = make_sae(2, 8, 16, torch.float32, device, margin=0.05)
    with pytest.raises(ValueError, match=r"expected x \[..., d_in\]"):
        jumprelu_encode(x[:, :7], w, b_enc, threshold)
    with pytest.raises(TypeError, match="W_enc must have a floating dtype"):
        jumprelu_encode(x, w.long(), b_enc, threshold)
    with pytest.raises(ValueError, match="b_dec must be a floating"):
        jumprelu_encode(x, w, b_enc, threshold, b_dec=b_dec[:3])
    with pytest.raises(ValueError, match="max_l0 must be a positive int"):
        jumprelu_encode(x, w, b_enc, threshold, max_l0=0)


def test_fused_encode_then_decode_completes_overflowed_tokens_on_device(device):
    x, w, b_enc, threshold, b_dec = make_sae(9, 32, 200, torch.float32, device, margin=0.05)
    w_dec = torch.randn(200, 24, device=device)
    ref_acts = torch_jumprelu_encode(x, w, b_enc, threshold, b_dec)
    width = max(1, int((ref_acts != 0).sum(1).max()) // 2)
    ell = jumprelu_encode(x, w, b_enc, threshold, b_dec=b_dec, max_l0=width)
    assert ell.overflowed().any()
    out = sparse_matmul(ell, w_dec, encoder=JumpReLUEncoder(x, w, b_enc, threshold, b_dec))
    ref = ref_acts @ w_dec.double()
    assert (out.double().cpu() - ref.cpu()).abs().max() <= 1e-4 * ref.abs().max()
    with pytest.raises(ValueError, match="pass dense or encoder, not both"):
        sparse_matmul(ell, w_dec, dense=ref_acts.float(), encoder=JumpReLUEncoder(x, w, b_enc, threshold, b_dec))


def test_opcheck_and_fullgraph_compile(device):
    from sparsefuse.sae.encode import jumprelu_encode_op

    x, w, b_enc, threshold, b_dec = make_sae(5, 24, 64, torch.float32, device, margin=0.05)
    torch.library.opcheck(
        jumprelu_encode_op,
        (x, w, b_enc, threshold, b_dec, 64),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    fn = torch.compile(lambda *a: jumprelu_encode(*a, b_dec=b_dec, max_l0=64).counts, fullgraph=True, backend=backend)
    ref = torch_jumprelu_encode(x, w, b_enc, threshold, b_dec)
    assert torch.equal(fn(x, w, b_enc, threshold).cpu(), (ref != 0).sum(1).to(torch.int32).cpu())


@pytest.mark.parametrize("max_l0", [64, 4])  # every token stored; most recomputed from the encoder's inputs
def test_fused_sae_forward_is_an_op_and_compiles_without_a_graph_break(max_l0, device):
    """The fused forward's decode of the encode's ELL is ``sparsefuse::jumprelu_ell_decode``: under
    torch.compile(fullgraph=True) the module with max_l0 (the fused encode) is two op calls, not traced launches."""
    import sparsefuse.nn
    from sparsefuse.sae.encode import jumprelu_encode_op
    from sparsefuse.sae.encode.op import jumprelu_ell_decode_op

    x, w, b_enc, threshold, b_dec = make_sae(5, 24, 64, torch.float32, device, margin=0.05)
    w_dec = torch.randn(64, 24, device=device) / 8
    values, indices, counts = jumprelu_encode_op(x, w, b_enc, threshold, b_dec, max_l0)
    torch.library.opcheck(
        jumprelu_ell_decode_op,
        (values, indices, counts, w_dec, x, w, b_enc, threshold, b_dec),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )
    sae = sparsefuse.nn.SparseJumpReLUSAE(24, 64, max_l0=max_l0).to(device)
    with torch.no_grad():
        for p, v in zip(
            (sae.W_enc, sae.b_enc, sae.threshold, sae.W_dec, sae.b_dec), (w, b_enc, threshold, w_dec, b_dec)
        ):
            p.copy_(v)
        eager = sae(x)
        backend = "inductor" if device.type == "cuda" else "aot_eager"
        torch._dynamo.reset()
        compiled = torch.compile(sae, fullgraph=True, backend=backend)
        with track_launches() as launched:
            out = compiled(x)
    assert launched["gather_accumulate_kernel"] >= 1, dict(launched)
    ref = torch_jumprelu_encode(x, w, b_enc, threshold, b_dec).double() @ w_dec.double() + b_dec.double()
    assert_close_to_reference(out, ref, eager)


def test_encoder_weight_in_another_dtype_is_cast_per_tile(device):
    x, w, b_enc, threshold, b_dec = make_sae(7, 40, 96, torch.float16, device, margin=0.05)
    ref = jumprelu_encode(x, w, b_enc, threshold, b_dec=b_dec, max_l0=96)
    mixed = jumprelu_encode(x, w.float(), b_enc, threshold, b_dec=b_dec, max_l0=96)  # fp32 W_enc, fp16 x
    assert torch.equal(mixed.counts, ref.counts) and torch.equal(mixed.to_dense(), ref.to_dense())


def test_deprecated_core_alias_builds_the_same_layer():
    import sparsefuse.sparse

    x, w, b_enc, threshold, b_dec = (
        torch.randn(2, 3),
        torch.randn(3, 4),
        torch.randn(4),
        torch.rand(4),
        torch.randn(3),
    )
    with pytest.warns(DeprecationWarning, match="sparsefuse.sae.JumpReLUEncoder"):
        legacy = sparsefuse.sparse.JumpReLUEncoder(x, w, b_enc, threshold, b_dec)
    assert isinstance(legacy, sparsefuse.sparse.ThresholdedLinear)
    encoder = JumpReLUEncoder(x, w, b_enc, threshold, b_dec)
    assert encoder.W_enc is w and encoder.b_enc is b_enc and encoder.b_dec is b_dec and encoder.threshold is threshold
    assert torch.equal(legacy.reference_activations(), encoder.reference_activations())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fused, shift_input", [(True, True), (False, True), (True, False)])
def test_jumprelu_sae_forward_matches_float64_with_overflowing_tokens(fused, shift_input, dtype, device):
    """Both paths of the fused forward against the float64 SAE, at a width that most tokens overflow (the fused
    encode recomputes them from the encoder inputs; the unfused "fixed" decode from their dense rows)."""
    x, w, b_enc, threshold, b_dec = make_sae(3, 32, 200, dtype, device, margin=0.05, shift_input=shift_input)
    x = x.reshape(3, 1, 32)
    b_enc = b_enc.to(dtype)  # one dtype, as in an SAE's parameters
    w_dec = (torch.randn(200, 32) / 4).to(dtype).to(device)
    input_shift = b_dec if shift_input else None
    acts64 = torch_jumprelu_encode(x, w, b_enc, threshold, input_shift)
    width = max(1, int((acts64 != 0).sum(1).max()) // 2)
    assert bool(((acts64 != 0).sum(1) > width).any())
    with torch.no_grad(), track_launches() as launched:
        out = jumprelu_sae_forward(
            x,
            w,
            b_enc,
            threshold,
            w_dec,
            b_dec,
            apply_b_dec_to_input=shift_input,
            max_l0=width,
            fused_encode=fused,
            decode_method="fixed",
        )
    assert out.shape == (3, 1, 32) and out.dtype == dtype
    # fused: overflowed tokens recomputed from the encoder in the decode's one launch; else a scan of their rows
    assert launched["jumprelu_encode_kernel"] == int(fused) and launched["gather_accumulate_kernel"] == 2 - fused
    ref = acts64 @ w_dec.double() + b_dec.double()
    sae_in = (x.reshape(3, 32) - input_shift if shift_input else x.reshape(3, 32)).float()
    pre = sae_in @ w.float() + b_enc.float()
    torch_acts = (torch.relu(pre) * (pre > threshold.float())).to(dtype)
    torch_out = (torch_acts.float() @ w_dec.float() + b_dec.float()).to(dtype)
    allowance = (
        accumulation_allowance(acts64, w_dec)
        + (accumulation_allowance(sae_in, w) * (acts64 != 0)) @ w_dec.double().abs()
    )
    assert_close_to_reference(out.reshape(3, 32), ref, torch_out, extra_abs=allowance)


def test_jumprelu_sae_forward_rejects_gradients_and_bad_decoders(device):
    x, w, b_enc, threshold, b_dec = make_sae(2, 8, 16, torch.float32, device, margin=0.05)
    w_dec = torch.randn(16, 8, device=device)
    with pytest.raises(ValueError, match="inference-only"):
        jumprelu_sae_forward(x, w.requires_grad_(), b_enc, threshold, w_dec, b_dec)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"expected W_dec \[d_sae=16, d_model\]"):
            jumprelu_sae_forward(x, w, b_enc, threshold, w_dec[:15], b_dec)
        with pytest.raises(ValueError, match="max_l0 must be a positive int"):
            jumprelu_sae_forward(x, w, b_enc, threshold, w_dec, b_dec, max_l0=0)
