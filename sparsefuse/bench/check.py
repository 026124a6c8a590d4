"""``python -m sparsefuse check``: every op against its float64 reference, on fresh random inputs.

The pass rule is :func:`sparsefuse.testing.compare_to_reference`, shared with the test suite: per element, a kernel
may be at most twice as far from the float64 reference (evaluated on the dtype-rounded inputs) as plain torch
computing the same expression in that dtype, plus a rounding allowance of the dtype; NaN or infinity where the
reference has none fails. Two documented extras: fast_sin's polynomial (:data:`FAST_SIN_REL_ERROR`) and sums
such as Snake's alpha gradient (:func:`reduction_allowance`). Reported errors are normwise relative,
``max|out - ref| / max|ref|`` (elementwise relative error is meaningless near zeros of the function).

Outputs are poisoned with NaN before every kernel launch, so an element a kernel forgets to write fails. Under the
Triton interpreter or on a GPU a check also fails if no sparsefuse kernel launched (the reference would otherwise be
compared with itself).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Sequence

import torch

import sparsefuse
from sparsefuse import _backend
from sparsefuse._backend import Backend, poison_outputs, track_launches
from sparsefuse.activations.celu import torch_celu, torch_celu_backward
from sparsefuse.activations.snake import torch_snake, torch_snake_backward
from sparsefuse.ffn import torch_relu_mlp, torch_twell_mlp, twell_mlp, twell_relu_mlp
from sparsefuse.ffn.hybrid import hybrid_mlp, hybrid_step_reference
from sparsefuse.ffn.synthetic import synthetic_ffn
from sparsefuse.sae import (
    jumprelu_encode,
    sparse_decode,
    topk_decode,
    topk_encode,
    torch_jumprelu_encode,
    torch_sparse_decode,
    torch_topk_encode,
)
from sparsefuse.splade import splade_pool, torch_splade_pool
from sparsefuse.testing import accumulation_allowance

from .check_llama import rms_norm_fwd_bwd, rotary_fwd_bwd
from .check_report import CheckResult, format_result, format_skip, tally
from .check_rules import OpFn, Outputs, compare

__all__ = [
    "compare",
    "reduction_allowance",
    "CheckResult",
    "OpCheck",
    "check_op",
    "run_check",
    "ops_for",
    "OPS",
    "WORKLOAD_FAMILIES",
    "FAST_SIN_REL_ERROR",
]

# fast_sin: a two-part range reduction modulo pi and degree-9/8 polynomials, documented |sin^2 error| <= 1e-5
# (measured 7.3e-6 for |alpha*x| <= 1e5). With alpha >= 0.5 that is <= 2e-5 on y, a few 1e-6 of max|ref|; the
# allowance below is relative to max|ref| on top of the usual bound. (The default sine's 3e-7 needs no allowance.)
FAST_SIN_REL_ERROR = 2e-5

DEFAULT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def reduction_allowance(abs_terms_sum: torch.Tensor, accumulate: torch.dtype = torch.float32) -> float:
    """Rounding allowance for an output that is a sum: ``eps(accumulate) * max(sum |terms|)``.

    A sum's rounding error scales with the sum of its terms' magnitudes, not with the result (cancellation), and
    two correct summation orders differ by a sample of that error; with few outputs, "twice torch's error" is then
    a coin toss. ``abs_terms_sum`` holds, per output element, the sum of the absolute values of its terms (float64).
    """
    return torch.finfo(accumulate).eps * float(abs_terms_sum.max()) if abs_terms_sum.numel() else 0.0


def _snake_alpha_terms_abs_sum(g64: torch.Tensor, x64: torch.Tensor, a64: torch.Tensor) -> torch.Tensor:
    """Per channel, sum over batch and time of |d(grad_alpha) term| -- via the reference itself, with every element
    treated as its own channel (so the formula is not repeated here)."""
    B, C, T = x64.shape
    per_elem = a64.reshape(1, C, 1).expand(B, C, T).reshape(-1)
    _, terms = torch_snake_backward(g64.reshape(1, -1, 1), x64.reshape(1, -1, 1), per_elem)
    return terms.abs().reshape(B, C, T).sum(dim=(0, 2))


# ----------------------------------------------------------------------------------------------------------------
# Inputs: drawn on the CPU in float64 from a seeded generator (same values on every device), then rounded to dtype
# ----------------------------------------------------------------------------------------------------------------


def _randn(shape: Sequence[int], gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64) * scale


def _to(t: torch.Tensor, dtype: torch.dtype, device: str, requires_grad: bool = False) -> torch.Tensor:
    return t.to(dtype).to(device).requires_grad_(requires_grad)


def _snake_inputs(shape: Sequence[int], dtype: torch.dtype, device: str, gen: torch.Generator):
    # |alpha * x| up to ~16: several periods of sin, where range reduction matters.
    x = _to(_randn(shape, gen, 2.0), dtype, device)
    alpha = _to(torch.rand((1, shape[1], 1), generator=gen, dtype=torch.float64) * 1.5 + 0.5, torch.float32, device)
    g = _to(_randn(shape, gen), dtype, device)
    return x, alpha, g


def _celu_inputs(shape: Sequence[int], dtype: torch.dtype, device: str, gen: torch.Generator):
    x = _randn(shape, gen, 3.0)
    x.view(-1)[::4] *= 1e-3  # a quarter of the values near 0, where expm1 must not cancel
    return _to(x, dtype, device), _to(_randn(shape, gen), dtype, device)


# ----------------------------------------------------------------------------------------------------------------
# Op checks: each returns (the tensor whose backend is reported, comparisons); the kernels run inside
# poison_outputs() + track_launches() set up by the caller.
# ----------------------------------------------------------------------------------------------------------------


def _snake_fwd(fast_sin: bool) -> OpFn:
    def op(shape, dtype, device, gen):
        x, alpha, _ = _snake_inputs(shape, dtype, device, gen)
        extra = FAST_SIN_REL_ERROR if fast_sin else 0.0

        def run() -> Outputs:
            y = sparsefuse.snake(x, alpha, fast_sin=fast_sin)
            ref = torch_snake(x.double(), alpha.double())
            return [compare("y", y, ref, torch_snake(x, alpha.to(dtype)), dtype, extra)]

        return x, run

    return op


def _snake_fwd_bwd(fast_sin: bool) -> OpFn:
    def op(shape, dtype, device, gen):
        x, alpha, g = _snake_inputs(shape, dtype, device, gen)
        x.requires_grad_(True)
        alpha.requires_grad_(True)
        extra = FAST_SIN_REL_ERROR if fast_sin else 0.0

        def run() -> Outputs:
            y = sparsefuse.snake(x, alpha, fast_sin=fast_sin)
            gx, ga = torch.autograd.grad(y, (x, alpha), g)
            with torch.no_grad():
                x64, a64, g64 = x.double(), alpha.double(), g.double()
                ref_y = torch_snake(x64, a64)
                ref_gx, ref_ga = torch_snake_backward(g64, x64, a64)
                low_gx, low_ga = torch_snake_backward(g, x, alpha.to(dtype))
                return [
                    compare("y", y, ref_y, torch_snake(x, alpha.to(dtype)), dtype, extra),
                    compare("grad_x", gx, ref_gx, low_gx, dtype, extra),
                    compare(
                        "grad_alpha",
                        ga.reshape(-1),
                        ref_ga,
                        low_ga,
                        dtype,
                        extra,
                        reduction_allowance(_snake_alpha_terms_abs_sum(g64, x64, a64)),
                    ),
                ]

        return x, run

    return op


def _celu_fwd(inplace: bool) -> OpFn:
    def op(shape, dtype, device, gen):
        x, _ = _celu_inputs(shape, dtype, device, gen)

        def run() -> Outputs:
            ref, low = torch_celu(x.double()), torch_celu(x)
            if inplace:
                buf = x.clone()
                out = sparsefuse.celu_(buf)
                if out is not buf:
                    raise AssertionError("celu_ did not return its input tensor")
            else:
                out = sparsefuse.celu(x)
            return [compare("y", out, ref, low, dtype)]

        return x, run

    return op


def _celu_fwd_bwd(shape, dtype, device, gen):
    x, g = _celu_inputs(shape, dtype, device, gen)
    x.requires_grad_(True)

    def run() -> Outputs:
        y = sparsefuse.celu(x)
        (gx,) = torch.autograd.grad(y, x, g)
        with torch.no_grad():
            return [
                compare("y", y, torch_celu(x.double()), torch_celu(x), dtype),
                compare("grad_x", gx, torch_celu_backward(g.double(), x.double()), torch_celu_backward(g, x), dtype),
            ]

    return x, run


def _splade_inputs(shape, dtype, device, gen):
    """hidden ~ N(0, 1) [B, S, H], weight ~ N(0, 1/H) [V, H] (unit-scale logits of both signs), bias ~ N(0, 0.5),
    padded int64 mask with one fully masked row."""
    B, S, H, V = shape
    hidden = _to(_randn((B, S, H), gen), dtype, device)
    weight = _to(_randn((V, H), gen, H**-0.5), dtype, device)
    bias = _to(_randn((V,), gen, 0.5), dtype, device)
    lengths = torch.randint(1, S + 1, (B,), generator=gen)
    mask = (torch.arange(S)[None, :] < lengths[:, None]).to(torch.int64)
    mask[-1] = 0
    return hidden, weight, bias, mask.to(device)


def _splade_fwd(pooling: str) -> OpFn:
    def op(shape, dtype, device, gen):
        hidden, weight, bias, mask = _splade_inputs(shape, dtype, device, gen)

        def run() -> Outputs:
            out = splade_pool(hidden, weight, bias, mask, pooling=pooling)
            ref = torch_splade_pool(hidden.double(), weight.double(), bias.double(), mask, pooling)
            # fp32 accumulation over H (and over S for the sum): eps32 * sum |terms|
            kept = (mask != 0).unsqueeze(-1)
            terms = (hidden.double().abs() @ weight.double().abs().t()) * kept
            allowance = reduction_allowance(terms.sum(1) if pooling == "sum" else terms)
            if pooling == "sum":
                allowance += reduction_allowance(ref.abs())
            low = torch_splade_pool(hidden, weight, bias, mask, pooling)
            return [compare("out", out, ref, low, dtype, extra_abs=allowance)]

        return hidden, run

    return op


def _sae_decode(method: str) -> OpFn:
    """shape (B, F, D, L0): L0 random features per token (row 0 empty, the last row 3 * L0: it overflows the
    fixed method's 2 * L0 slots and must come out complete)."""

    def op(shape, dtype, device, gen):
        B, F, D, l0 = shape
        acts = torch.zeros(B, F, dtype=torch.float64)
        for row in range(1, B):
            k = min(F, 3 * l0 if row == B - 1 else l0)
            acts[row, torch.randperm(F, generator=gen)[:k]] = torch.rand(k, generator=gen, dtype=torch.float64) + 0.1
        acts, w = _to(acts, dtype, device), _to(_randn((F, D), gen, 0.125), dtype, device)

        def run() -> Outputs:
            out = sparse_decode(acts, w, method=method, max_l0=2 * l0)
            ref = acts.double() @ w.double()
            low = (acts.float() @ w.float()).to(dtype)
            return [compare("out", out, ref, low, dtype, extra_abs=accumulation_allowance(acts, w))]

        return acts, run

    return op


def _topk_decode(shape, dtype, device, gen):
    """shape (B, F, D, k): k distinct random features per token, positive activations (as after a TopK encode); the
    output and the gradients of the activations and W_dec."""
    B, F, D, k = shape
    indices = torch.stack([torch.randperm(F, generator=gen)[:k] for _ in range(B)])
    acts = _to(torch.rand(B, k, generator=gen, dtype=torch.float64) + 0.1, dtype, device)
    w = _to(_randn((F, D), gen, 0.125), dtype, device)
    indices = indices.to(device)

    grad_out = _to(_randn((B, D), gen), dtype, device)

    def run() -> Outputs:
        a, b = acts.detach().requires_grad_(), w.detach().requires_grad_()
        out = topk_decode(indices, a, b)
        grad_acts, grad_w = torch.autograd.grad(out, (a, b), grad_out)
        dense = torch.zeros(B, F, dtype=dtype, device=device).scatter_(1, indices, acts)
        low = (dense.float() @ w.float()).to(dtype)
        d64, g64, w64 = dense.double(), grad_out.double(), w.double()
        low_acts = (grad_out.float() @ w.float().t()).gather(1, indices).to(dtype)
        low_w = (dense.float().t() @ grad_out.float()).to(dtype)
        return [
            compare("out", out, torch_sparse_decode(dense, w), low, dtype, extra_abs=accumulation_allowance(dense, w)),
            compare(
                "grad_acts",
                grad_acts,
                (g64 @ w64.t()).gather(1, indices),
                low_acts,
                dtype,
                extra_abs=accumulation_allowance(g64, w64.t()).gather(1, indices),
            ),
            compare("grad_W_dec", grad_w, d64.t() @ g64, low_w, dtype, extra_abs=accumulation_allowance(d64.t(), g64)),
        ]

    return acts, run


def _sae_weights(shape, dtype, device, gen):
    """x [M, d_in], W_enc [d_in, d_sae] ~ N(0, 1/d_in), b_enc and b_dec ~ N(0, 0.1^2), rounded to dtype."""
    M, d_in, d_sae = shape[:3]
    x = _to(_randn((M, d_in), gen), dtype, device)
    w = _to(_randn((d_in, d_sae), gen, d_in**-0.5), dtype, device)
    b_enc = _to(_randn((d_sae,), gen, 0.1), dtype, device)
    b_dec = _to(_randn((d_in,), gen, 0.1), dtype, device)
    return x, w, b_enc, b_dec


def _encode_allowance(x, w, b_dec) -> torch.Tensor:
    """Per pre-activation: the rounding of ``x - b_dec`` to x's dtype (the kernels round it as SAELens does) plus
    fp32 accumulation in another order."""
    sae_in = x.double() - b_dec.double()
    u_in = torch.finfo(x.dtype).eps / 2
    return u_in * (sae_in.abs() @ w.double().abs()) + accumulation_allowance(sae_in, w)


def _jumprelu_encode(shape, dtype, device, gen):
    """shape (M, d_in, d_sae); one threshold of 0.8 for every feature, and features whose pre-activation comes
    within 0.05 of it are moved away (the float64 reference and a low-precision matmul would disagree on them)."""
    x, w, b_enc, b_dec = _sae_weights(shape, dtype, device, gen)
    threshold = torch.full_like(b_enc, 0.8)
    pre = (x.double() - b_dec.double()) @ w.double() + b_enc.double()
    near = ((pre - 0.8).abs() < 0.05).any(0)
    b_enc = (b_enc.double() - 0.15 * near).to(dtype)

    def run() -> Outputs:
        ell = jumprelu_encode(x, w, b_enc, threshold, b_dec=b_dec, max_l0=shape[2])
        ref = torch_jumprelu_encode(x, w, b_enc, threshold, b_dec)
        low_pre = (x - b_dec) @ w + b_enc
        low = torch.relu(low_pre) * (low_pre > threshold)
        return [compare("acts", ell.to_dense(), ref, low, dtype, extra_abs=float(_encode_allowance(x, w, b_dec).max()))]

    return x, run


def _topk_encode(shape, dtype, device, gen):
    """shape (M, d_in, d_sae, k). Near-ties may legitimately be selected in either order, so the sorted top-k values
    are compared (continuous in the inputs), and the float64 pre-activations at the returned indices must match the
    returned values (the indices are the features those values belong to)."""
    x, w, b_enc, b_dec = _sae_weights(shape, dtype, device, gen)
    k = shape[3]

    def run() -> Outputs:
        indices, acts = topk_encode(x, w, b_enc, k, b_dec=b_dec)
        _, ref_acts = torch_topk_encode(x, w, b_enc, k, b_dec=b_dec)
        sae_in = (x.double() - b_dec.double()).to(dtype).double()
        pre = sae_in @ w.double() + b_enc.double()
        low = torch.topk((x - b_dec) @ w + b_enc, k, dim=1).values.relu()
        allowance = float(_encode_allowance(x, w, b_dec).max())
        return [
            compare("top_acts", acts, ref_acts, low, dtype, extra_abs=allowance),
            compare(
                "pre[top_indices]", acts, pre.gather(1, indices.cpu().long()).relu(), low, dtype, extra_abs=allowance
            ),
        ]

    return x, run


def _ffn_inputs(shape, dtype, device, gen):
    """shape (M, K, N, mean non-zeros): sparsefuse.ffn.synthetic's layer (heavy-tailed, hot and dead neurons)."""
    M, K, N, nnz = shape
    ffn = synthetic_ffn(K, N, dtype=dtype, device=device, seed=int(torch.randint(1 << 30, (1,), generator=gen)))
    return ffn, ffn.make_input(M, float(nnz))


def _mlp_allowance(x, w_up, w_down, w_gate=None) -> torch.Tensor:
    """Per output: fp32 accumulation in another order (Higham's bound, as :func:`accumulation_allowance`) of the
    up / gate products over K, carried through the down product, plus that of the down product over N."""
    x64, up64 = x.double(), w_up.double()
    u = torch.finfo(torch.float32).eps / 2
    gamma_k = x.shape[-1] * u / (1 - x.shape[-1] * u)
    up, up_err = x64 @ up64.t(), gamma_k * (x64.abs() @ up64.abs().t())
    if w_gate is None:
        h, h_err = up.relu(), up_err
    else:
        gate = x64 @ w_gate.double().t()
        gate_err = gamma_k * (x64.abs() @ w_gate.double().abs().t())
        h, h_err = gate.relu() * up, gate.relu() * up_err + gate_err * up.abs()
    return h_err @ w_down.double().abs().t() + accumulation_allowance(h, w_down.double().t())


def _twell_mlp(shape, dtype, device, gen):
    ffn, x = _ffn_inputs(shape, dtype, device, gen)

    def run() -> Outputs:
        # 32-column tiles, so that N = 100 spans several (the default tile would cover a small N in one).
        y = twell_mlp(x, ffn.w_gate, ffn.w_up, ffn.w_down, tile=32, compression=4, method="twell")
        low = torch.nn.functional.linear(torch.relu(x @ ffn.w_gate.t()) * (x @ ffn.w_up.t()), ffn.w_down)
        allowance = _mlp_allowance(x, ffn.w_up, ffn.w_down, ffn.w_gate)
        return [
            compare("out", y, torch_twell_mlp(x, ffn.w_gate, ffn.w_up, ffn.w_down), low, dtype, extra_abs=allowance)
        ]

    return x, run


def _twell_relu_mlp(shape, dtype, device, gen):
    ffn, x = _ffn_inputs(shape, dtype, device, gen)

    def run() -> Outputs:
        y = twell_relu_mlp(x, ffn.w_gate, ffn.w_down, tile=32, compression=4)
        low = torch.nn.functional.linear(torch.relu(x @ ffn.w_gate.t()), ffn.w_down)
        allowance = _mlp_allowance(x, ffn.w_gate, ffn.w_down)
        return [compare("out", y, torch_relu_mlp(x, ffn.w_gate, ffn.w_down), low, dtype, extra_abs=allowance)]

    return x, run


def _hybrid_mlp(shape, dtype, device, gen):
    ffn, x = _ffn_inputs(shape, dtype, device, gen)
    leaves = [t.detach().clone().requires_grad_() for t in (x, ffn.w_gate, ffn.w_up, ffn.w_down)]
    dy = torch.randn(x.shape, generator=gen).to(device=device, dtype=dtype)

    def run() -> Outputs:
        out = hybrid_mlp(*leaves, width=4, backup_rows=1)  # narrow: overflow and a grown backup are exercised
        ours = torch.autograd.grad(out.y, leaves, dy)
        xl, wg, wu, wd = (t.detach().clone().requires_grad_() for t in leaves)
        y_low = torch.nn.functional.linear(torch.relu(xl @ wg.t()) * (xl @ wu.t()), wd)
        low = torch.autograd.grad(y_low, (xl, wg, wu, wd), dy)
        y64, _, g64 = hybrid_step_reference(*leaves, dy)
        refs = (g64.x, g64.w_gate, g64.w_up, g64.w_down)
        outs = [compare("y", out.y, y64, y_low, dtype, extra_abs=_mlp_allowance(x, ffn.w_up, ffn.w_down, ffn.w_gate))]
        for name, o, r, lo in zip(("dx", "dw_gate", "dw_up", "dw_down"), ours, refs, low):
            outs.append(compare(name, o, r, lo, dtype, extra_rel=2 * torch.finfo(torch.float32).eps * x.shape[0]))
        return outs

    return x, run


@dataclasses.dataclass(frozen=True)
class OpCheck:
    family: str  # what `check WORKLOAD` selects it by (see WORKLOAD_FAMILIES)
    run: OpFn
    small: list[tuple[int, ...]]  # shapes for --size small
    full: list[tuple[int, ...]]  # shapes for --size full
    # bf16 tl.dot: wrong under an interpreter sparsefuse cannot correct (_backend.BF16_DOT_OK), so skipped there
    uses_tl_dot: bool = False


_DECODE_SMALL, _DECODE_FULL = [(5, 700, 40, 9)], [(64, 65536, 768, 64)]
OPS: dict[str, OpCheck] = {
    "snake fwd": OpCheck("snake", _snake_fwd(False), [(2, 6, 257)], [(4, 64, 4099), (1, 16, 120832)]),
    "snake fwd+bwd": OpCheck("snake", _snake_fwd_bwd(False), [(2, 6, 257)], [(4, 64, 4099), (1, 16, 120832)]),
    "snake fast_sin fwd": OpCheck("snake", _snake_fwd(True), [(2, 6, 257)], [(4, 64, 4099)]),
    "snake fast_sin fwd+bwd": OpCheck("snake", _snake_fwd_bwd(True), [(2, 6, 257)], [(4, 64, 4099)]),
    "celu fwd": OpCheck("celu", _celu_fwd(False), [(3, 1001)], [((1 << 20) + 7,)]),
    "celu_ fwd": OpCheck("celu", _celu_fwd(True), [(3, 1001)], [((1 << 20) + 7,)]),
    "celu fwd+bwd": OpCheck("celu", _celu_fwd_bwd, [(3, 1001)], [((1 << 20) + 7,)]),
    # (B, F, D, L0)
    "sae decode scan": OpCheck("sae_decode", _sae_decode("scan"), _DECODE_SMALL, _DECODE_FULL),
    # also past 256 tokens, where a gather launch takes more than one wave
    "sae decode fixed": OpCheck(
        "sae_decode", _sae_decode("fixed"), _DECODE_SMALL, [*_DECODE_FULL, (320, 65536, 768, 64)]
    ),
    "sae decode exact": OpCheck("sae_decode", _sae_decode("exact"), _DECODE_SMALL, _DECODE_FULL),
    "sae topk_decode fwd+bwd": OpCheck("sae_decode", _topk_decode, [(5, 700, 40, 9)], [(64, 65536, 768, 64)]),
    # (M, d_in, d_sae[, k])
    "sae jumprelu_encode": OpCheck("sae_encode", _jumprelu_encode, [(5, 40, 100)], [(256, 2304, 16384)], True),
    "sae topk_encode": OpCheck("sae_encode", _topk_encode, [(5, 40, 100, 7)], [(256, 2304, 16384, 64)], True),
    # (B, S, H, V); the backward is covered by the test suite (its gradient follows the argmax, so random inputs
    # need near-ties separated first)
    "splade max fwd": OpCheck("splade", _splade_fwd("max"), [(2, 37, 48, 1021)], [(8, 256, 768, 30522)], True),
    "splade sum fwd": OpCheck("splade", _splade_fwd("sum"), [(2, 37, 48, 1021)], [(8, 256, 768, 30522)], True),
    # (M, K, N, mean non-zeros per token)
    "ffn twell_mlp": OpCheck("ffn", _twell_mlp, [(13, 80, 100, 6)], [(256, 2048, 5632, 32)], True),
    "ffn twell_relu_mlp": OpCheck("ffn", _twell_relu_mlp, [(13, 80, 100, 6)], [(256, 2048, 5632, 32)], True),
    "ffn hybrid_mlp fwd+bwd": OpCheck("ffn_train", _hybrid_mlp, [(13, 80, 100, 6)], [(1024, 2048, 5632, 32)], True),
    # (M, D); (B, S, H, H_kv, hd): what patch_llama fuses besides the FFN
    "rms_norm fwd+bwd": OpCheck("llama", rms_norm_fwd_bwd, [(7, 100)], [(8192, 2048), (16, 12000)]),
    "rotary fwd+bwd": OpCheck("llama", rotary_fwd_bwd, [(2, 9, 4, 2, 16)], [(4, 2048, 32, 8, 128)]),
}

# What `check WORKLOAD` runs: the op families each benchmark workload times ("sae" is both SAE families).
WORKLOAD_FAMILIES: dict[str, tuple[str, ...]] = {
    "snake": ("snake",),
    "snac": ("snake",),
    "celu": ("celu",),
    "overhead": ("snake", "celu", "sae_decode"),
    "sae_decode": ("sae_decode",),
    "sae_decode_grid": ("sae_decode",),
    "sae_forward": ("sae_encode", "sae_decode"),
    "sae_topk": ("sae_decode",),
    "sae": ("sae_encode", "sae_decode"),
    "splade": ("splade",),
    "splade_sum": ("splade",),
    "ffn": ("ffn",),
    "model": ("ffn", "llama"),  # a whole patched Llama: the FFN's kernels, the fused norms and rotary embedding
    "generate": ("ffn", "llama"),  # the same model's generate
    "ffn_train": ("ffn_train",),
    "train": ("ffn_train", "llama"),  # a whole patched Llama training: the training step's kernels and the fusions
}


def ops_for(workloads: Sequence[str] = ()) -> list[str]:
    """The checks `check WORKLOAD ...` runs, in OPS order (all for no workload). KeyError naming the known workloads
    for an unknown one."""
    if not workloads:
        return list(OPS)
    unknown = [w for w in workloads if w not in WORKLOAD_FAMILIES]
    if unknown:
        raise KeyError(
            f"unknown workload(s) {', '.join(map(repr, unknown))}; known workloads: "
            f"{', '.join(sorted(WORKLOAD_FAMILIES))}"
        )
    families = {f for w in workloads for f in WORKLOAD_FAMILIES[w]}
    return [name for name, op in OPS.items() if op.family in families]


def check_op(
    name: str, op: OpFn, shape: Sequence[int], dtype: torch.dtype, device: str, gen: torch.Generator
) -> CheckResult:
    """Run one op on one (shape, dtype) and compare every output."""
    result = CheckResult(name, str(dtype).removeprefix("torch."), "x".join(map(str, shape)), "?", [], [])
    try:
        probe, run = op(shape, dtype, device, gen)
        backend = sparsefuse.backend_for(probe)
        result.backend = backend.value
        with poison_outputs(), track_launches() as launched:
            result.outputs = run()
        result.kernels = sorted(launched)
        if backend is not Backend.TORCH and not launched:
            result.error = "no sparsefuse kernel launched"
    except Exception as exc:  # noqa: BLE001  (an op that raises is a failure to report, not a crash)
        result.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    return result


def run_check(
    device: str | None = None,
    size: str = "small",
    dtypes: Iterable[torch.dtype] = DEFAULT_DTYPES,
    seed: int | None = None,
    out: Callable[[str], None] = print,
    workloads: Sequence[str] = (),
) -> int:
    """Check the ops of ``workloads`` (every op when empty); prints one line per (op, dtype, shape) and a tally of
    passes, failures and skips; returns 0 if none failed (skips reported as such), 1 otherwise. Raises KeyError for
    an unknown workload."""
    names = ops_for(workloads)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed so a failure reproduces
    gen = torch.Generator().manual_seed(seed)
    probe = torch.empty(0, device=device)
    interpreted = sparsefuse.backend_for(probe) is Backend.INTERPRETER
    selected = f" workloads={','.join(workloads)}" if workloads else ""
    out(
        f"sparsefuse check: device={device} backend={sparsefuse.backend_for(probe).value} size={size} seed={seed}"
        f"{selected} ({len(names)} ops)"
    )
    passed, failures = 0, 0
    skipped: dict[str, int] = {}  # why -> cases
    for dtype in dtypes:
        for name in names:
            op = OPS[name]
            shapes = op.small if size == "small" else op.full
            if op.uses_tl_dot and dtype == torch.bfloat16 and interpreted and not _backend.BF16_DOT_OK:
                why = "this Triton's interpreter computes bf16 tl.dot wrongly; a GPU run checks it"
                skipped[why] = skipped.get(why, 0) + len(shapes)
                out(format_skip(name, "bfloat16", why))
                continue
            for shape in shapes:
                result = check_op(name, op.run, shape, dtype, device, gen)
                passed += result.passed
                failures += not result.passed
                out(format_result(result))
    out(tally(passed, failures, skipped))
    return 0 if failures == 0 else 1
