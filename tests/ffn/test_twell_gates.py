"""The gated block's gate activations beside ReLU: FATReLU (``g if g > threshold else 0``) and dReLU
(``relu(gate) * relu(up)``), on every method against the float64 reference, with the kernels' paths (stored entries,
overflowed tiles from the gate GEMM's output or recomputed, the heavy tokens' launch, the row-block unions), the
ops under opcheck and torch.compile, and the argument errors. Interpreter: fp16/fp32.

FATReLU is discontinuous at its threshold (a neuron that flips contributes ``threshold * up``), so every threshold
here lies in a wide gap of the float64 gate pre-activations: no method's rounding can move a neuron across it."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, assert_backend
from test_twell import mlp_weights

from sparsefuse import track_launches
from sparsefuse.ffn import torch_twell_mlp, twell_gate, twell_mlp, twell_up_down
from sparsefuse.ffn.synthetic import synthetic_ffn
from sparsefuse.ffn.twell import auto as twell_auto
from sparsefuse.ffn.twell.auto import PLANNER as TWELL_PLANNER
from sparsefuse.ffn.twell.reference import threshold_in
from sparsefuse.sparse.formats import TwELL
from sparsefuse.testing import assert_close_to_reference

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
GATES = ["relu", "fatrelu", "drelu"]
METHODS = ["twell", "block", "dense"]


def gap_threshold(x, w_gate, b_gate=None, quantiles=(0.1, 0.5)) -> float:
    """A FATReLU threshold among the positive gate pre-activations (between those quantiles of them): the middle of
    the widest gap there between neighbouring float64 pre-activations, so no value lies within several roundings
    of x's dtype of it."""
    g = x.double().reshape(-1, x.shape[-1]) @ w_gate.double().t()
    if b_gate is not None:
        g = g + b_gate.double()
    values = g[g.isfinite()].flatten().sort().values
    positive = values[values > 0]
    lo, hi = (int(q * (positive.numel() - 1)) for q in quantiles)
    window = positive[lo : hi + 1]
    i = int((window[1:] - window[:-1]).argmax())
    threshold = float(window[i] + window[i + 1]) / 2
    gap = float(window[i + 1] - window[i]) / 2
    assert gap > 2 * torch.finfo(x.dtype).eps * threshold, f"no clear gap near the threshold ({gap:.2g})"
    return threshold


def on_grid(t: torch.Tensor | None, step: float) -> torch.Tensor | None:
    """t rounded to multiples of ``step``: gate inputs whose pre-activations are multiples of 1/64, exact in every
    dtype below 4 in magnitude, so a threshold between two multiples is never crossed by a rounding."""
    return None if t is None else (t.double() / step).round().mul(step).to(t.dtype)


def torch_lowp_gated(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, *, activation, threshold):
    """Plain torch in the low-precision dtype (the error scale of the comparison)."""
    g, u = F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up)
    h = torch.where(g > threshold, g, 0.0) if activation == "fatrelu" else torch.relu(g)
    return F.linear(h * (torch.relu(u) if activation == "drelu" else u), w_down, b_down)


def gate_args(activation, x, w_gate, b_gate=None) -> dict:
    threshold = gap_threshold(x, w_gate, b_gate) if activation == "fatrelu" else 0.0
    return dict(activation=activation, threshold=threshold)


def check(y, x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, **gate):
    ref = torch_twell_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down, **gate)
    assert_close_to_reference(y, ref, torch_lowp_gated(x, w_gate, w_up, w_down, b_gate, b_up, b_down, **gate))


def kernels_ran(launched, method: str, M: int) -> bool:
    if method == "twell":
        gate = "twell_gate_fwd_kernel" if M < TWELL_PLANNER.knobs.gate_gemm_min_tokens else "twell_pack_kernel"
        return launched[gate] == 1 and launched["twell_up_down_fwd_kernel"] >= 1
    if method == "block":
        return launched["block_sddmm_kernel"] == 1 and launched["block_ell_matmul_kernel"] == 1
    return not any(launched.values())  # dense: cuBLAS only


# ----------------------------------------------------------------------------------------------------------------
# Every method x gate against the float64 reference
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("activation", GATES[1:])  # (ReLU: tests/ffn/test_twell.py, and bit for bit below)
def test_gates_match_float64_reference(activation, method, dtype, device):
    """Odd K and N, batches 1..33 (the fused gate kernel below gate_gemm_min_tokens tokens, cuBLAS's GEMM and the
    packing pass from it), biases; random weights fire about half the gate, so most 16-column tiles overflow their
    4 slots, and in the 33-token batch one token fires every neuron and one none."""
    K, N = 37, 83
    w_gate, w_up, w_down, b_gate, b_up, b_down = mlp_weights(K, N, dtype, device, bias=True, seed=4)
    w_gate, b_gate = on_grid(w_gate, 1 / 16), on_grid(b_gate, 1 / 64)
    x = torch.randn(33, K)
    x[7, 0] = -40.0  # a heavy token: every neuron fires, every tile overflowed
    x[11, 0] = 40.0  # an all-zero token
    x = on_grid(x.to(device=device, dtype=dtype), 1 / 4)
    assert_backend(x)
    biases = dict(b_gate=b_gate, b_up=b_up, b_down=b_down)
    gate = gate_args(activation, x, w_gate, b_gate)
    for M in (1, 2, 15, 16, 33):
        with track_launches() as launched:
            y = twell_mlp(x[:M], w_gate, w_up, w_down, **biases, tile=16, compression=4, method=method, **gate)
        assert kernels_ran(launched, method, M), (M, dict(launched))
        check(y, x[:M], w_gate, w_up, w_down, **biases, **gate)


@pytest.mark.parametrize("activation", ["fatrelu", "drelu"])
def test_gates_on_synthetic_sparsity_and_heavy_tokens(activation, device, plan):
    """Realistic sparsity (stored entries, few overflowed tiles), and the heavy tokens' second launch (from 8 tokens
    here): both kernel-2 launches and the sorted row blocks (from 64 tokens under the interpreter)."""

    plan(twell_mlp={"heavy_pass_min_tokens": 8, "heavy_splits": 3})
    ffn = synthetic_ffn(48, 100, dtype=torch.float32, device=device, seed=2)
    x = ffn.make_input(70, 12.0)
    x[3] *= 4.0  # a heavier token
    gate = gate_args(activation, x, ffn.w_gate)
    for method in METHODS:
        with track_launches() as launched:
            y = twell_mlp(x, ffn.w_gate, ffn.w_up, ffn.w_down, tile=32, compression=4, method=method, **gate)
        assert kernels_ran(launched, method, x.shape[0]), (method, dict(launched))
        if method == "twell":
            assert launched["twell_up_down_fwd_kernel"] == 2, dict(launched)  # the heavy tokens' own launch
        check(y, x, ffn.w_gate, ffn.w_up, ffn.w_down, **gate)


@pytest.mark.parametrize("M", [5, 20])  # the fused gate kernel; cuBLAS's GEMM and the packing pass
def test_separate_kernels_recompute_overflowed_tiles(M, device):
    """twell_gate packs above the threshold; twell_up_down, given no pre-activations, recomputes the overflowed
    tiles from x and W_gate (a GEMV) with the same threshold and dReLU's relu on the up product."""
    K, N = 33, 70
    w_gate, w_up, w_down, b_gate, b_up, b_down = mlp_weights(K, N, torch.float32, device, bias=True, seed=5)
    x = torch.randn(M, K, device=device)
    threshold = gap_threshold(x, w_gate, b_gate)
    twell = twell_gate(x, w_gate, b_gate, tile=16, compression=4, threshold=threshold)
    pre = F.linear(x, w_gate, b_gate)
    assert twell.overflowed().any() and not twell.overflowed().all()
    assert torch.equal(twell.row_nnz(), (pre > threshold).sum(1).to(torch.int32))
    complete = ~twell.overflowed().repeat_interleave(16, dim=1)[:, :N]
    stored = TwELL(twell.values, twell.indices, twell.counts.masked_fill(twell.overflowed(), 0), N, 16, 4)
    expected = torch.where(pre > threshold, pre, 0.0)  # g itself where it fires, not g - threshold
    assert torch.allclose(stored.to_dense()[complete], expected[complete], rtol=1e-5, atol=1e-6)
    biases = dict(b_gate=b_gate, b_up=b_up, b_down=b_down)
    for activation, t in (("fatrelu", threshold), ("drelu", 0.0)):
        packed = twell if t else twell_gate(x, w_gate, b_gate, tile=16, compression=4)
        with track_launches() as launched:
            y = twell_up_down(packed, x, w_gate, w_up, w_down, **biases, activation=activation, threshold=t)
        assert launched["twell_up_down_fwd_kernel"] == 1, dict(launched)
        check(y, x, w_gate, w_up, w_down, **biases, activation=activation, threshold=t)


@pytest.mark.parametrize("method", METHODS)
def test_relu_is_unchanged_and_fatrelu_at_zero_is_relu(method, device):
    """The default call is ReLU, bit for bit, and FATReLU at threshold 0 is ReLU."""
    w_gate, w_up, w_down, b_gate, *_ = mlp_weights(24, 40, torch.float32, device, bias=True)
    x = torch.randn(18, 24, device=device)
    kw = dict(b_gate=b_gate, tile=16, compression=2, method=method)
    y = twell_mlp(x, w_gate, w_up, w_down, **kw)
    assert torch.equal(twell_mlp(x, w_gate, w_up, w_down, **kw, activation="relu"), y)
    assert torch.equal(twell_mlp(x, w_gate, w_up, w_down, **kw, activation="fatrelu", threshold=0.0), y)


def test_nan_propagates_and_empty_batches(device):
    w_gate, w_up, w_down, *_ = mlp_weights(20, 48, torch.float16, device)
    x = torch.randn(6, 20).half().to(device)
    x[2, 5] = float("nan")
    for activation in ("fatrelu", "drelu"):
        gate = dict(activation=activation, threshold=0.25 if activation == "fatrelu" else 0.0)
        ref = torch_twell_mlp(x, w_gate, w_up, w_down, **gate)
        assert ref[2].isnan().all() and not ref[[0, 1, 3, 4, 5]].isnan().any()
        for method in METHODS:
            y = twell_mlp(x, w_gate, w_up, w_down, tile=16, compression=2, method=method, **gate)
            assert torch.equal(y.isnan(), ref.isnan()), method
            assert twell_mlp(x[:0], w_gate, w_up, w_down, method=method, **gate).shape == (0, 20)


# ----------------------------------------------------------------------------------------------------------------
# The threshold's comparison, auto, autograd, ops
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_threshold_in_compares_exactly_in_each_dtype(dtype):
    """``v > threshold_in(dtype, t)`` in the dtype is ``v > t`` exactly, for every value v of the dtype: torch and
    Triton round a float scalar to nearest, which would fire (or not) a value within half a step of t."""
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for t in (0.1, 0.3, 1.0 / 3, 5e-8, 7.0, 1e30, 70000.0):
        nearest = torch.tensor(t, dtype=torch.float64).to(dtype).clamp(max=torch.finfo(dtype).max)
        steps = torch.tensor([-1, 0, 1], dtype=bits)
        values = (nearest.view(bits) + steps).view(dtype)  # the nearest value of the dtype and its two neighbours
        below = threshold_in(dtype, t)
        assert torch.equal(values > below, values.double() > t), (t, below)
        assert torch.tensor(below, dtype=dtype).item() == below <= t


def test_auto_counts_the_gates_above_the_threshold(device):
    """The per-weight estimate counts FATReLU's fired gates (> threshold), not the positive ones."""
    w_gate, w_up, w_down, *_ = mlp_weights(24, 64, torch.float32, device, seed=6)
    x = torch.randn(8, 24, device=device)
    threshold = gap_threshold(x, w_gate)
    twell_mlp(x, w_gate, w_up, w_down, activation="fatrelu", threshold=threshold)
    expected = float((F.linear(x, w_gate) > threshold).sum(1).double().mean())
    assert twell_auto.ESTIMATES.monitor(w_gate).mean_nnz == pytest.approx(expected)


@pytest.mark.parametrize("activation", ["fatrelu", "drelu"])
def test_autograd_runs_the_dense_gate(activation, device):
    w_gate, w_up, w_down, *_ = mlp_weights(16, 32, torch.float32, device)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    gate = gate_args(activation, x.detach(), w_gate)
    with track_launches() as launched:
        y = twell_mlp(x, w_gate, w_up, w_down, method="twell", **gate)
    assert not launched
    (grad,) = torch.autograd.grad(y.sum(), x)
    x64 = x.detach().double().requires_grad_()
    (grad_ref,) = torch.autograd.grad(torch_twell_mlp(x64, w_gate, w_up, w_down, **gate).sum(), x64)
    assert torch.allclose(grad.double(), grad_ref, atol=1e-5, rtol=1e-4)


def test_opcheck_and_fullgraph_compile(device):
    from sparsefuse.ffn.twell import twell_gate_op, twell_mlp_op, twell_up_down_op

    w_gate, w_up, w_down, b_gate, b_up, b_down = mlp_weights(24, 40, torch.float32, device, bias=True)
    x = torch.randn(3, 24, device=device)
    w_down_t = w_down.t()
    t = gap_threshold(x, w_gate, b_gate)
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(twell_gate_op, (x, w_gate, b_gate, 16, 2, t), test_utils=utils)
    values, indices, counts = twell_gate_op(x, w_gate, b_gate, 16, 2, t)
    torch.library.opcheck(
        twell_up_down_op,
        (values, indices, counts, x, w_gate, b_gate, w_up, b_up, w_down_t, b_down, 16, 2, "fatrelu", t),
        test_utils=utils,
    )
    for method, activation, threshold in (("twell", "fatrelu", t), ("block", "drelu", 0.0), ("twell", "drelu", 0.0)):
        args = (x, w_gate, None, w_up, None, w_down_t, None, 0, 2, method, True, activation, threshold)
        torch.library.opcheck(twell_mlp_op, args, test_utils=utils)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    for activation, threshold in (("fatrelu", t), ("drelu", 0.0)):
        torch._dynamo.reset()
        fn = torch.compile(
            lambda *a, act=activation, thr=threshold: twell_mlp(
                *a, b_gate=b_gate, tile=16, compression=2, method="twell", activation=act, threshold=thr
            ),
            fullgraph=True,
            backend=backend,
        )
        with track_launches() as launched:
            y = fn(x, w_gate, w_up, w_down)
        assert launched["twell_up_down_fwd_kernel"] == 1, dict(launched)
        check(y, x, w_gate, w_up, w_down, b_gate, activation=activation, threshold=threshold)


def test_bad_gate_arguments(device):
    w_gate, w_up, w_down, *_ = mlp_weights(16, 32, torch.float32, device)
    x = torch.randn(3, 16, device=device)
    with pytest.raises(ValueError, match="activation must be one of 'relu', 'fatrelu', 'drelu'; got 'silu'"):
        twell_mlp(x, w_gate, w_up, w_down, activation="silu")
    with pytest.raises(TypeError, match="activation must be a str"):
        twell_mlp(x, w_gate, w_up, w_down, activation=None)
    with pytest.raises(ValueError, match=r"threshold must be a finite number >= 0; got -0.1"):
        twell_mlp(x, w_gate, w_up, w_down, activation="fatrelu", threshold=-0.1)
    with pytest.raises(ValueError, match=r"threshold must be a finite number >= 0; got nan"):
        twell_mlp(x, w_gate, w_up, w_down, activation="fatrelu", threshold=float("nan"))
    with pytest.raises(ValueError, match=r"threshold must be a finite number >= 0; got inf"):
        twell_mlp(x, w_gate, w_up, w_down, activation="fatrelu", threshold=float("inf"))
    with pytest.raises(TypeError, match="threshold must be a Python float, got Tensor"):
        twell_mlp(x, w_gate, w_up, w_down, activation="fatrelu", threshold=torch.tensor(0.5))
    with pytest.raises(TypeError, match="threshold must be a Python float, got bool"):
        twell_mlp(x, w_gate, w_up, w_down, activation="fatrelu", threshold=True)
    with pytest.raises(ValueError, match="threshold=0.5 applies to activation='fatrelu' only; got activation='relu'"):
        twell_mlp(x, w_gate, w_up, w_down, threshold=0.5)
    with pytest.raises(ValueError, match="applies to activation='fatrelu' only; got activation='drelu'"):
        twell_mlp(x, w_gate, w_up, w_down, activation="drelu", threshold=0.5)
    with pytest.raises(ValueError, match="twell_gate: threshold must be a finite number >= 0"):
        twell_gate(x, w_gate, tile=16, compression=2, threshold=-1.0)
    twell = twell_gate(x, w_gate, tile=16, compression=2)
    with pytest.raises(ValueError, match="twell_up_down: activation must be one of"):
        twell_up_down(twell, x, w_gate, w_up, w_down, activation="gelu")
