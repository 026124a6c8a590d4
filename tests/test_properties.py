"""Seeded random cases for every public op against its float64 reference: shapes with 0, 1 and tails, strided
inputs, fp32/fp16 (bf16 for the ops without ``tl.dot``: the interpreter's bf16 dot is wrong, triton#11584), NaN and
infinities, random parameters and methods. ``SPARSEFUSE_PROPERTY_CASES`` cases per op (default 1000); the GPU suite
runs them compiled on CUDA, and a fifth as many at shapes up to 16x larger. Outputs are NaN-poisoned before every
launch (conftest), so an unwritten element fails. A failure names its case's seed: ``Draw(seed, device)`` and the
op's check rebuild it."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_valid_topk, check_hybrid_step, check_relu_step, pre_activations_and_bound

import sparsefuse
from sparsefuse.activations.celu.reference import torch_celu
from sparsefuse.activations.snake.reference import torch_snake
from sparsefuse.ffn.hybrid import hybrid_mlp, hybrid_relu_mlp
from sparsefuse.norms.rmsnorm.reference import torch_rms_norm
from sparsefuse.rotary import apply_rotary_pos_emb, torch_apply_rotary_pos_emb
from sparsefuse.sae.encode.reference import torch_jumprelu_encode
from sparsefuse.splade.head.reference import torch_splade_pool
from sparsefuse.testing import accumulation_allowance, assert_close_to_reference

CASES = int(os.environ.get("SPARSEFUSE_PROPERTY_CASES", "1000"))


class Draw:
    """Random choices of one case, from its seed (edge values favoured)."""

    def __init__(self, seed: int, device: torch.device, scale: int = 1) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.device = device
        self.scale = scale  # sizes' upper ends multiplied by this (the GPU grid's larger shapes)

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.g))

    def size(self, lo: int, hi: int) -> int:
        hi = max(lo, hi * self.scale)
        edges = [v for v in (lo, lo + 1, hi, hi - 1) if lo <= v <= hi]
        if self.uniform() < 0.3:
            return edges[int(self.uniform() * len(edges))]
        return lo + int(self.uniform() * (hi - lo + 1))

    def choice(self, options):
        return options[int(self.uniform() * len(options))]

    def tensor(self, *shape, dtype=torch.float32, scale=1.0, strided=None, special=0.0) -> torch.Tensor:
        """randn * scale in dtype; ``strided`` (default: at random) makes it a stride-2 view of a wider tensor;
        ``special``: the chance of NaN and inf at random places."""
        t = torch.randn(*shape, generator=self.g) * scale
        if t.numel() and self.uniform() < special:
            flat = t.view(-1)
            for value in (float("nan"), float("inf"), -float("inf")):
                flat[int(self.uniform() * flat.numel())] = value
        t = t.to(dtype)
        if (self.uniform() < 0.3 if strided is None else strided) and t.dim() and t.shape[-1]:
            t = torch.stack([t, t], dim=-1).flatten(-2)[..., ::2]
        return t.to(self.device)

    def sparse(self, m, n, dtype, density) -> torch.Tensor:
        keep = torch.rand(m, n, generator=self.g) < density
        values = torch.randn(m, n, generator=self.g).abs() + 0.1
        return (values * keep).to(dtype).to(self.device)


def _run(name, check, device, cases=CASES, scale=1):
    for seed in range(cases):
        try:
            check(Draw(seed, device, scale))
        except AssertionError as exc:
            raise AssertionError(f"{name}: case seed={seed}: {exc}") from exc


def _snake(d):
    dtype = d.choice([torch.float32, torch.float16, torch.bfloat16])
    B, C, T = d.size(0, 3), d.size(1, 5), d.size(0, 70)
    x = d.tensor(B, C, T, dtype=dtype, scale=d.choice([1.0, 10.0]), special=0.1)
    alpha = (torch.rand(C, generator=d.g) * 2 + 0.2).to(d.device)
    out = sparsefuse.snake(x, alpha)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close_to_reference(out, torch_snake(x.double(), alpha.double()), torch_snake(x, alpha.to(dtype)))


def _celu(d):
    dtype = d.choice([torch.float32, torch.float16, torch.bfloat16])
    shape = [d.size(0, 4) for _ in range(d.choice([1, 2, 3]))]
    x = d.tensor(*shape, dtype=dtype, scale=d.choice([1.0, 30.0]), special=0.1)
    alpha, scale, input_scale = d.choice([1.0, 0.5, 2.0]), d.choice([1.0, 1.0507]), d.choice([1.0, 0.7])
    out = sparsefuse.celu(x, alpha, scale, input_scale)
    assert out.dtype == dtype and out.shape == x.shape
    ref = torch_celu(x.double(), alpha, scale, input_scale)
    assert_close_to_reference(out, ref, torch_celu(x, alpha, scale, input_scale))


def _rms_norm(d):
    dtype = d.choice([torch.float32, torch.float16, torch.bfloat16])
    rows = [d.size(0, 5) for _ in range(d.choice([1, 2]))]
    D = d.size(1, 70)
    x = d.tensor(*rows, D, dtype=dtype, scale=d.choice([1.0, 30.0]), special=0.1)
    weight = d.choice([None, d.tensor(D, dtype=d.choice([dtype, torch.float32]), strided=False)])
    eps = d.choice([None, 1e-6, 1e-5])
    out = sparsefuse.rms_norm(x, D, weight, eps)
    expected = dtype if weight is None else torch.promote_types(dtype, weight.dtype)
    assert out.dtype == expected and out.shape == x.shape
    eps = torch.finfo(dtype).eps if eps is None else eps
    ref = torch_rms_norm(x.double(), weight.double() if weight is not None else None, eps)
    assert_close_to_reference(out, ref, torch_rms_norm(x, weight, eps))


def _rotary(d):
    dtype = d.choice([torch.float32, torch.float16, torch.bfloat16])
    B, S, H, H_kv, hd = d.size(0, 3), d.size(0, 9), d.size(1, 4), d.size(1, 3), 2 * d.size(1, 20)
    unsqueeze_dim = d.choice([1, 2])

    def heads(n):  # [B, S, n, hd] storage: a transposed view for unsqueeze_dim=1 (Llama's layout) or a copy of it
        t = d.tensor(B, S, n, hd, dtype=dtype, scale=d.choice([1.0, 20.0]), special=0.05)
        return t if unsqueeze_dim == 2 else d.choice([t.transpose(1, 2), t.transpose(1, 2).contiguous()])

    q, k = heads(H), heads(H_kv)
    angle_dtype = d.choice([dtype, torch.float32])
    cos = d.tensor(d.choice([1, B]), S, hd, dtype=angle_dtype, strided=False)
    sin = d.tensor(cos.shape[0], S, hd, dtype=angle_dtype, strided=False)
    outs = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    refs = torch_apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double(), unsqueeze_dim)
    lowps = torch_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    for out, t, ref, lowp in zip(outs, (q, k), refs, lowps):
        assert out.dtype == torch.promote_types(dtype, angle_dtype) and out.shape == t.shape
        assert_close_to_reference(out, ref, lowp)


def _sparse_decode(d):
    dtype = d.choice([torch.float32, torch.float16])
    M, S, Dm = d.size(0, 9), d.size(1, 70), d.size(1, 24)
    acts = d.sparse(M, S, dtype, d.choice([0.02, 0.1, 0.5, 1.0]))
    if M and d.uniform() < 0.1:
        acts[0, 0] = float("nan")
    w = d.tensor(S, Dm, dtype=dtype)
    method = d.choice(["auto", "scan", "exact", "fixed", "dense"])
    out_dtype = d.choice([None, torch.float32])
    out = sparsefuse.sparse_decode(acts, w, method=method, max_l0=d.size(1, 16), out_dtype=out_dtype)
    ref = acts.double() @ w.double()
    assert out.dtype == (out_dtype or dtype) and out.shape == (M, Dm)
    lowp = (acts.float() @ w.float()).to(out.dtype)
    assert_close_to_reference(out, ref, lowp, extra_abs=accumulation_allowance(acts.nan_to_num(0.0), w))


def _topk_decode(d):
    dtype = d.choice([torch.float32, torch.float16])
    M, S, Dm, k = d.size(0, 9), d.size(1, 50), d.size(1, 24), d.size(1, 6)
    idx = torch.randint(0, S, (M, k), generator=d.g).to(d.device)
    vals, w = d.tensor(M, k, dtype=dtype), d.tensor(S, Dm, dtype=dtype)
    out = sparsefuse.topk_decode(idx, vals, w)
    ref = torch.einsum("mk,mkd->md", vals.double(), w.double()[idx])
    lowp = torch.einsum("mk,mkd->md", vals.float(), w.float()[idx]).to(dtype)
    extra = torch.einsum("mk,mkd->md", vals.double().abs(), w.double().abs()[idx]) * k * 2**-24
    assert_close_to_reference(out, ref, lowp, extra_abs=extra)
    if d.uniform() < 0.5:  # the backward: the slots' sampled dots, W_dec's gradient by feature (ids may repeat)
        v, b = vals.detach().requires_grad_(), w.detach().requires_grad_()
        grad_out = d.tensor(M, Dm, dtype=dtype)
        g_vals, g_w = torch.autograd.grad(sparsefuse.topk_decode(idx, v, b), (v, b), grad_out)
        go, rows = grad_out.double(), w.double()[idx]  # [M, k, Dm]
        ref_v = torch.einsum("md,mkd->mk", go, rows)
        extra_v = torch.einsum("md,mkd->mk", go.abs(), rows.abs()) * Dm * 2**-24
        assert_close_to_reference(g_vals, ref_v, dtype=dtype, extra_abs=extra_v, name="grad_acts")
        terms = vals.double()[:, :, None] * go[:, None, :]  # [M, k, Dm]: each slot's share of its feature's row
        ref_w = torch.zeros(S, Dm, dtype=torch.float64).index_add_(0, idx.cpu().flatten(), terms.cpu().reshape(-1, Dm))
        abs_w = torch.zeros(S, Dm, dtype=torch.float64).index_add_(
            0, idx.cpu().flatten(), terms.abs().cpu().reshape(-1, Dm)
        )
        extra_w = abs_w * M * k * 2**-24
        assert_close_to_reference(g_w, ref_w, dtype=dtype, extra_abs=extra_w.to(g_w.device), name="grad_W_dec")


def _jumprelu_encode(d):
    dtype = d.choice([torch.float32, torch.float16])
    M, d_in, d_sae = d.size(0, 7), d.size(1, 40), d.size(1, 80)
    x, w = d.tensor(M, d_in, dtype=dtype), d.tensor(d_in, d_sae, dtype=dtype, scale=d_in**-0.5)
    b_enc, threshold = d.tensor(d_sae, scale=0.3), (torch.rand(d_sae, generator=d.g) * 0.8).to(d.device)
    b_dec = d.tensor(d_in, dtype=dtype, scale=0.1) if d.uniform() < 0.5 else None
    ell = sparsefuse.jumprelu_encode(x, w, b_enc, threshold, b_dec=b_dec, max_l0=d_sae)
    pre, bound = pre_activations_and_bound(x, w, b_enc, b_dec)
    ref = torch_jumprelu_encode(x, w, b_enc, threshold, b_dec).cpu()
    ours = ell.to_dense().double().cpu()
    # a feature within rounding of its threshold (or of 0) may go either way; every other one must agree
    th = threshold.double().cpu()
    clear = ((pre - th).abs() > bound) & (pre.abs() > bound)
    assert torch.equal((ours != 0) & clear, (ref != 0) & clear)
    both = (ours != 0) & (ref != 0)
    assert_close_to_reference(ours[both], ref[both], dtype=dtype, extra_abs=bound[both])


def _topk_encode(d):
    dtype = d.choice([torch.float32, torch.float16])
    M, d_in, d_sae = d.size(0, 7), d.size(1, 40), d.size(2, 80)
    k = min(d.size(1, 8), d_sae)  # size() scales its bound on the GPU grid: k stays within d_sae
    x, w, b_enc = d.tensor(M, d_in, dtype=dtype), d.tensor(d_in, d_sae, dtype=dtype), d.tensor(d_sae)
    activation = d.choice(["relu", "none"])
    indices, acts = sparsefuse.topk_encode(x, w, b_enc, k, activation=activation)
    pre, bound = pre_activations_and_bound(x, w, b_enc)
    assert_valid_topk(indices, acts, pre, bound, k, activation)


def _splade_pool(d):
    dtype = d.choice([torch.float32, torch.float16])
    B, L, H, V = d.size(0, 3), d.size(1, 9), d.size(1, 24), d.size(1, 60)
    hidden, weight = d.tensor(B, L, H, dtype=dtype), d.tensor(V, H, dtype=dtype, scale=H**-0.5)
    bias = d.tensor(V, dtype=dtype) if d.uniform() < 0.5 else None
    mask = (torch.rand(B, L, generator=d.g) < 0.8).long().to(d.device) if d.uniform() < 0.5 else None
    pooling = d.choice(["max", "sum"])
    out = sparsefuse.splade_pool(hidden, weight, bias, mask, pooling=pooling)
    ref = torch_splade_pool(
        hidden.double(), weight.double(), bias.double() if bias is not None else None, mask, pooling=pooling
    )
    logits_err = accumulation_allowance(hidden.reshape(-1, H), weight.t()).reshape(B, L, V)
    extra = logits_err.amax(1) * (L if pooling == "sum" else 1)
    assert_close_to_reference(out, ref, dtype=dtype, extra_abs=extra)


def _ffn_case(d, gated):
    dtype = d.choice([torch.float32, torch.float16])
    M, K, N = d.size(0, 20), d.size(1, 24), d.size(1, 70)  # from 16 tokens the TwELL gate is a GEMM
    x = d.tensor(M, K, dtype=dtype)
    wg, wd = d.tensor(N, K, dtype=dtype, scale=K**-0.5), d.tensor(K, N, dtype=dtype, scale=N**-0.5)
    wu = d.tensor(N, K, dtype=dtype, scale=K**-0.5) if gated else None
    bg = d.tensor(N, dtype=dtype, scale=0.5) - 0.5 if d.uniform() < 0.5 else None  # from ~half to few firing
    return dtype, x, wg, wu, wd, bg


def _ffn_reference(x, wg, wu, wd, bg):
    pre = F.linear(x.double(), wg.double(), bg.double() if bg is not None else None)
    h = torch.relu(pre) * (F.linear(x.double(), wu.double()) if wu is not None else 1.0)
    return F.linear(h, wd.double()), h


def _check_ffn(out, x, wg, wu, wd, bg, dtype):
    ref, h = _ffn_reference(x, wg, wu, wd, bg)
    lowp_h = torch.relu(F.linear(x, wg, bg)) * (F.linear(x, wu) if wu is not None else 1.0)
    lowp = F.linear(lowp_h.to(dtype), wd)
    # a gate within rounding of 0 may fire or not: its share of y is |h| at most, allowed with the summation order
    kink = accumulation_allowance(x, wg.t()) * (F.linear(x.double(), wu.double()).abs() if wu is not None else 1.0)
    extra = accumulation_allowance(h, wd.double().t()) + (kink + h.abs() * 2**-10) @ wd.double().t().abs()
    assert_close_to_reference(out, ref, lowp, extra_abs=extra)


def _twell_mlp(d):
    dtype, x, wg, wu, wd, bg = _ffn_case(d, gated=d.uniform() < 0.7)
    if wu is not None:
        out = sparsefuse.twell_mlp(x, wg, wu, wd, b_gate=bg, method=d.choice(["auto", "twell", "block", "dense"]))
    else:
        out = sparsefuse.twell_relu_mlp(x, wg, wd, b_up=bg, method=d.choice(["twell", "dense"]))
    _check_ffn(out, x, wg, wu, wd, bg, dtype)


def _hybrid_mlp(d):
    """The forward on every layout; in about half the cases the backward too (the training step's products),
    against the float64 step product by product, unless a gate lies within rounding of 0 (it may fire or not, and
    its gradients with it)."""
    dtype, x, wg, wu, wd, bg = _ffn_case(d, gated=d.uniform() < 0.7)
    pre = F.linear(x.double(), wg.double(), bg.double() if bg is not None else None)
    near = pre.abs() <= accumulation_allowance(x, wg.t()) * 4
    if wu is not None:
        leaves, check = [x, wg, wu, wd, bg, None, None], check_hybrid_step
        layout = d.choice(["block", "dense", "hybrid"])
        kwargs = dict(width=d.size(1, 12), backup_rows=d.size(0, 3), block_capacity=d.choice([None, 0, d.size(0, 400)]))

        def step(t):
            return hybrid_mlp(*t[:4], b_gate=t[4], layout=layout, **kwargs)
    else:
        leaves, check = [x, wg, wd, bg, None], check_relu_step
        layout = d.choice(["block", "dense"])

        def step(t):
            return hybrid_relu_mlp(*t[:3], b_up=t[3], layout=layout)

    backward = d.uniform() < 0.5 and not bool(near.any())
    if backward:
        leaves = [t.detach().requires_grad_() if t is not None else None for t in leaves]
    out = step(leaves)
    if backward:
        dy, coef = d.tensor(*out.y.shape, dtype=dtype), d.choice([0.0, 0.5])
        grads = torch.autograd.grad((out.y * dy).sum() + coef * out.l1, [t for t in leaves if t is not None])
        check(leaves, dy, coef, out, grads)
    _check_ffn(out.y.detach(), x, wg, wu, wd, bg, dtype)
    fired = (pre > 0).sum(1)
    assert bool(((out.token_counts.cpu() - fired.cpu()).abs() <= near.sum(1).cpu()).all())


CHECKS = {
    "snake": _snake,
    "celu": _celu,
    "rms_norm": _rms_norm,
    "apply_rotary_pos_emb": _rotary,
    "sparse_decode": _sparse_decode,
    "topk_decode": _topk_decode,
    "jumprelu_encode": _jumprelu_encode,
    "topk_encode": _topk_encode,
    "splade_pool": _splade_pool,
    "twell_mlp": _twell_mlp,
    "hybrid_mlp": _hybrid_mlp,
}


@pytest.mark.parametrize("name", list(CHECKS))
def test_random_cases(name, device):
    _run(name, CHECKS[name], device)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CHECKS))
def test_random_cases_larger_shapes_on_the_gpu(name):
    """The same checks with shapes up to 16x larger (several tiles and programs per dimension), compiled."""
    _run(name, CHECKS[name], torch.device("cuda"), cases=max(1, CASES // 5), scale=16)
