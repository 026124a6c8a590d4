"""sparsefuse.nn.Snake1d and sparsefuse.integrations.snac against the real `snac` package (random weights)."""

import copy
import io

import pytest
import torch
from conftest import DEVICE

import sparsefuse
from sparsefuse.integrations import snac as sf_snac
from sparsefuse.testing import assert_close_to_reference, assert_norm_close_to_reference

snac = pytest.importorskip("snac")

# The published 24 kHz SNAC configuration (hubertsiuzdak/snac_24khz); its decoder's first Snake sees T = 236 for
# codes of length 59 -- the shapes of the SNAC Snake write-up this project started from.
SNAC_24KHZ = dict(
    sampling_rate=24000,
    encoder_dim=48,
    encoder_rates=[2, 4, 8, 8],
    decoder_dim=1024,
    decoder_rates=[8, 8, 4, 2],
    attn_window_size=None,
    codebook_size=4096,
    codebook_dim=8,
    vq_strides=[4, 2, 1],
    noise=True,
    depthwise=True,
)
# The same architecture shrunk so the interpreter can run a whole decode in seconds.
SNAC_TINY = dict(
    sampling_rate=24000,
    encoder_dim=4,
    encoder_rates=[2, 2],
    decoder_dim=32,
    decoder_rates=[2, 2],
    attn_window_size=None,
    codebook_size=64,
    codebook_dim=4,
    vq_strides=[2, 1],
    noise=True,
    depthwise=True,
)


def randomize_alphas(model: torch.nn.Module) -> None:
    """SNAC initialises alpha to ones; trained models do not have equal alphas, and neither should the test."""
    with torch.no_grad():
        for m in model.modules():
            if sf_snac.is_snake1d(m):
                m.alpha.uniform_(0.3, 3.0)


def random_codes(model, length: int, device) -> list[torch.Tensor]:
    return [torch.randint(0, model.codebook_size, (1, length * s), device=device) for s in reversed(model.vq_strides)]


def test_snake1d_state_dict_loads_from_snac():
    theirs = snac.layers.Snake1d(7)
    with torch.no_grad():
        theirs.alpha.uniform_(0.5, 2.0)
    ours = sparsefuse.nn.Snake1d(7)
    ours.load_state_dict(theirs.state_dict())
    assert list(ours.state_dict()) == list(theirs.state_dict()) == ["alpha"]
    x = torch.randn(2, 7, 50, device=DEVICE)
    assert_close_to_reference(ours.to(DEVICE)(x), theirs.double().to(DEVICE)(x.double()), theirs.float()(x))


def decode_three_ways(config: dict, length: int, dtype: torch.dtype, device):
    """(patched decode in dtype, unpatched decode in dtype, unpatched decode in float64, launch counts)."""
    model = snac.SNAC(**config).eval().to(device)
    randomize_alphas(model)
    patched = sf_snac.patch(copy.deepcopy(model)).to(dtype)
    codes = random_codes(model, length, device)
    model_lowp, model64 = copy.deepcopy(model).to(dtype), copy.deepcopy(model).double()
    # no_grad, not inference_mode: SNAC's TorchScript snake fails under inference_mode with trainable alphas.
    # The decoder's NoiseBlocks draw torch.randn in the activation dtype: re-seed before each decode.
    with torch.no_grad(), sparsefuse.track_launches() as launched:
        outs = []
        for m in (patched, model_lowp, model64):
            torch.manual_seed(1)
            outs.append(m.decode(codes))
    return (*outs, launched, patched)


def test_patch_replaces_every_snake_and_decodes_the_same_audio():
    """Against float64 with noise off (randn in float64 draws other numbers than in float32, so a noisy float64
    decode is no reference); then with noise on, patched against unpatched in the same dtype and seed."""
    device = torch.device(DEVICE)
    ours, theirs, ref64, launched, patched = decode_three_ways({**SNAC_TINY, "noise": False}, 6, torch.float32, device)
    n_snakes = sum(isinstance(m, sparsefuse.nn.Snake1d) for m in patched.modules())
    assert n_snakes > 0 and not any(sf_snac.is_snake1d(m) for m in patched.modules())
    fused_launches = launched["snake_fwd_kernel"] + launched["snake_fwd_flat_kernel"]
    assert fused_launches == sum(isinstance(m, sparsefuse.nn.Snake1d) for m in patched.decoder.modules())
    rel_err = assert_norm_close_to_reference(ours, ref64, theirs)
    ours, theirs, _, _, _ = decode_three_ways(SNAC_TINY, 6, torch.float32, device)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=10 * (rel_err + 1e-7) * float(theirs.abs().max()))


def test_patch_shares_parameters_so_training_still_works():
    model = snac.SNAC(**SNAC_TINY).to(DEVICE)
    alphas_before = [m.alpha for m in model.modules() if sf_snac.is_snake1d(m)]
    sf_snac.patch(model)
    alphas_after = [m.alpha for m in model.modules() if isinstance(m, sparsefuse.nn.Snake1d)]
    assert all(a is b for a, b in zip(alphas_before, alphas_after, strict=True))
    snake = model.decoder.model[-3]
    assert isinstance(snake, sparsefuse.nn.Snake1d)
    x = torch.randn(1, snake.alpha.shape[1], 20, device=DEVICE)
    snake(x).sum().backward()
    assert snake.alpha.grad is not None


def test_patch_errors_and_single_module():
    with pytest.raises(ValueError, match="no Snake1d module found in Linear"):
        sf_snac.patch(torch.nn.Linear(2, 2))
    fused = sf_snac.patch(snac.layers.Snake1d(3))
    assert isinstance(fused, sparsefuse.nn.Snake1d)


def test_patch_twice_is_a_no_op():
    model = snac.SNAC(**SNAC_TINY)
    assert not sf_snac.is_patched(model)
    sf_snac.patch(model)
    snakes = [m for m in model.modules() if isinstance(m, sparsefuse.nn.Snake1d)]
    assert sf_snac.is_patched(model)
    assert sf_snac.patch(model, fast_sin=True) is model and sf_snac.is_patched(model)
    assert [m for m in model.modules() if isinstance(m, sparsefuse.nn.Snake1d)] == snakes
    assert not any(m.fast_sin for m in snakes)  # the first patch's settings stay
    fused = sparsefuse.nn.Snake1d(3)
    assert sf_snac.patch(fused) is fused and sf_snac.is_patched(fused)
    with pytest.raises(ValueError, match="no Snake1d module found in Sequential"):
        sf_snac.patch(torch.nn.Sequential(torch.nn.Conv1d(2, 2, 1)))


def test_patched_model_pickles_and_deep_copies():
    """copy.deepcopy of a patched SNAC, and torch.save/torch.load of a patched stack of SNAC Snake1d modules, keep
    the fused Snake1d. (A whole SNAC cannot go through torch.save, patched or not: its convolutions carry
    torch.nn.utils.parametrizations.weight_norm, whose modules and state-dict hook pickle refuses.)"""
    model = snac.SNAC(**{**SNAC_TINY, "noise": False}).eval().to(DEVICE)
    randomize_alphas(model)
    codes = random_codes(model, 3, torch.device(DEVICE))
    sf_snac.patch(model)
    copied = copy.deepcopy(model)
    assert sf_snac.is_patched(copied)
    with torch.no_grad(), sparsefuse.track_launches() as launched:
        torch.testing.assert_close(copied.decode(codes), model.decode(codes), rtol=0, atol=0)
    assert launched["snake_fwd_kernel"] + launched["snake_fwd_flat_kernel"] > 0

    stack = torch.nn.Sequential(snac.layers.Snake1d(4), torch.nn.Conv1d(4, 4, 3), snac.layers.Snake1d(4)).to(DEVICE)
    randomize_alphas(stack)
    sf_snac.patch(stack)
    buffer = io.BytesIO()
    torch.save(stack, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert sf_snac.is_patched(loaded) and all(isinstance(loaded[i], sparsefuse.nn.Snake1d) for i in (0, 2))
    x = torch.randn(2, 4, 9, device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), stack(x), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_snac_24khz_decode_matches(dtype):
    ours, theirs, ref64, _, _ = decode_three_ways({**SNAC_24KHZ, "noise": False}, 59, dtype, torch.device("cuda"))
    assert ours.shape == ref64.shape == (1, 1, 59 * 4 * 512)
    assert_norm_close_to_reference(ours, ref64, theirs)
