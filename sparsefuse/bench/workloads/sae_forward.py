"""Benchmark workload ``sae_forward``: a whole SAE forward (encode + decode) at B=4096 tokens.

Shapes: Gemma Scope 2B 65k (d_in 2304, d_sae 65536, L0 72 -- the target case), 2B 262k (L0 100) and 9B 131k
(d_in 3584, L0 72); JumpReLU and TopK (k = 64). Weights are random in Gemma Scope's structure (unit-norm decoder
rows, untied encoder); JumpReLU thresholds are one value chosen from a sample of pre-activations so that the mean
L0 matches; inputs are fresh ``randn`` tokens.

Implementations:

* ``sparsefuse fused``        JumpReLU: ``jumprelu_encode`` -> ELL -> ``sparse_matmul`` (overflow recomputed);
                              TopK: ``topk_encode`` -> ``topk_decode``. Functional calls, no SAELens.
* ``sparsefuse sae_lens.patch``  a SAELens SAE patched with the defaults (hook points and checks included): the
                              cuBLAS encode, then JumpReLU in place + sparse_decode (auto), or torch.topk +
                              ``topk_decode``
* ``... patch(max_l0=256)`` / ``patch(fused_encode=True)``  patched for low memory: the fused encodes above
* ``sae_lens``                SAELens' own forward (dense encode, dense decode) -- the baseline of the speed-up column
* ``eager``                   the same dense math as a plain torch function (the baseline when sae_lens is missing)
* ``torch.compile``           ``torch.compile`` of ``eager``
* ``encode matmul only``      ``x @ W_enc`` alone: the floor under any forward that computes every pre-activation

Cost model (minimal): the encode matmul plus the decode of the fired rows (2 * B * L0 * d_in); bytes: x, W_enc and
the output once, the decoder rows that any token fired. The ceiling is "matmul" (the encode dominates).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ...sae import JumpReLUEncoder, jumprelu_encode, sparse_decode, topk_decode, topk_encode
from ...sparse import sparse_matmul
from ..harness import Case, Options, register

TOKENS = 4096
TOPK_K = 64
SAE_SHAPES: list[tuple[str, int, int, int]] = [  # (name, d_in, d_sae, L0)
    ("Gemma2B-65k", 2304, 65536, 72),
    ("Gemma2B-262k", 2304, 262144, 100),
    ("Gemma9B-131k", 3584, 131072, 72),
]
QUICK_SHAPES = SAE_SHAPES[:1]
CALIBRATION_TOKENS = 512
MAX_L0 = 256  # ELL width of the fused JumpReLU path (tokens above it are recomputed, not truncated)
# SAELens SAEs: unpatched, patched with the defaults (fastest), patched for low memory (the fused encodes)
FUSED_PATCH = {
    "jumprelu": (f"sparsefuse sae_lens.patch(max_l0={MAX_L0})", dict(max_l0=MAX_L0)),
    "topk": ("sparsefuse sae_lens.patch(fused_encode=True)", dict(fused_encode=True)),
}
SAE_LENS_IMPLS = {arch: ("sae_lens", "sparsefuse sae_lens.patch", FUSED_PATCH[arch][0]) for arch in FUSED_PATCH}


@dataclasses.dataclass
class SAEWeights:
    W_enc: torch.Tensor  # [d_in, d_sae]
    b_enc: torch.Tensor  # [d_sae]
    threshold: torch.Tensor  # [d_sae] (JumpReLU)
    W_dec: torch.Tensor  # [d_sae, d_in]
    b_dec: torch.Tensor  # [d_in]
    sae_lens: dict[str, Any]  # "sae_lens" / "sparsefuse sae_lens.patch" modules sharing these tensors, if installed


def make_weights(d_in: int, d_sae: int, l0: int, dtype: torch.dtype, device: str) -> SAEWeights:
    g = torch.Generator(device=device).manual_seed(0)
    W_dec = torch.randn(d_sae, d_in, device=device, generator=g)
    W_dec = (W_dec / W_dec.norm(dim=1, keepdim=True)).to(dtype)
    W_enc = (torch.randn(d_in, d_sae, device=device, generator=g) / d_in**0.5).to(dtype)
    b_enc = (torch.randn(d_sae, device=device, generator=g) * 0.1).to(dtype)
    b_dec = (torch.randn(d_in, device=device, generator=g) * 0.1).to(dtype)
    # One threshold: the value exceeded by l0 / d_sae of a sample's pre-activations (mean L0 = l0 on such tokens).
    sample = torch.randn(CALIBRATION_TOKENS, d_in, device=device, generator=g).to(dtype)
    pre = ((sample - b_dec) @ W_enc + b_enc).float().flatten()
    above = round(l0 / d_sae * pre.numel())
    threshold = torch.full((d_sae,), float(pre.topk(above + 1).values[-1]), device=device, dtype=dtype)
    return SAEWeights(W_enc, b_enc, threshold, W_dec, b_dec, {})


def _attach_sae_lens(weights: SAEWeights, architecture: str, dtype: torch.dtype, device: str) -> None:
    """SAELens SAEs (unpatched and patched) whose parameters ARE the benchmark's tensors (no copies)."""
    try:
        import sae_lens

        from ...integrations import sae_lens as sf_sae_lens
    except ImportError:
        return
    d_in, d_sae = weights.W_enc.shape
    config = dict(d_in=d_in, d_sae=d_sae, dtype=str(dtype).removeprefix("torch."), device="meta")
    if architecture == "jumprelu":
        sae_class, config_class = sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig
        names = ("W_enc", "b_enc", "threshold", "W_dec", "b_dec")
    else:
        sae_class, config_class, config["k"] = sae_lens.TopKSAE, sae_lens.TopKSAEConfig, TOPK_K
        names = ("W_enc", "b_enc", "W_dec", "b_dec")
    modules = {}
    for impl in SAE_LENS_IMPLS[architecture]:
        sae = sae_class(config_class(**config))  # on the meta device: SAELens' own init is replaced by our weights
        for name in names:
            setattr(sae, name, torch.nn.Parameter(getattr(weights, name), requires_grad=False))
        modules[impl] = sae.to(device)
    sf_sae_lens.patch(modules["sparsefuse sae_lens.patch"])  # cuBLAS encode, then the sparse decode
    fused_name, fused_options = FUSED_PATCH[architecture]
    sf_sae_lens.patch(modules[fused_name], **fused_options)  # the epilogue-compacting encode: low memory
    weights.sae_lens = modules


_current: dict[tuple, SAEWeights] = {}


def weights_for(key: tuple[str, int, int, int, torch.dtype, str]) -> SAEWeights:
    """The weights of one case, built on first use; the previous case's are dropped (only one set in memory)."""
    if key not in _current:
        _current.clear()
        architecture, d_in, d_sae, l0, dtype, device = key
        _current[key] = make_weights(d_in, d_sae, l0, dtype, device)
        _attach_sae_lens(_current[key], architecture, dtype, device)
    return _current[key]


# --- implementations ----------------------------------------------------------------------------------------------
def dense_jumprelu_forward(x, W_enc, b_enc, threshold, W_dec, b_dec):
    """SAELens JumpReLUSAE's math as plain torch ops."""
    pre = (x - b_dec) @ W_enc + b_enc
    acts = torch.relu(pre) * (pre > threshold).to(pre.dtype)
    return acts @ W_dec + b_dec


def dense_topk_forward(x, W_enc, b_enc, W_dec, b_dec):
    """SAELens TopKSAE's math as plain torch ops."""
    pre = (x - b_dec) @ W_enc + b_enc
    values, indices = torch.topk(pre, TOPK_K, dim=-1, sorted=False)
    acts = torch.zeros_like(pre).scatter_(-1, indices, values.relu())
    return acts @ W_dec + b_dec


def fused_jumprelu_forward(x, W_enc, b_enc, threshold, W_dec, b_dec):
    ell = jumprelu_encode(x, W_enc, b_enc, threshold, b_dec=b_dec, max_l0=MAX_L0)
    return sparse_matmul(ell, W_dec, encoder=JumpReLUEncoder(x, W_enc, b_enc, threshold, b_dec)) + b_dec


def dense_encode_sparse_decode_forward(x, W_enc, b_enc, threshold, W_dec, b_dec):
    """cuBLAS encode, JumpReLU in place, then ``sparse_decode`` (auto: the bitmask + ELL path at large batches):
    fastest at large batches, at the price of the dense [tokens, d_sae] activations in memory."""
    pre = torch.addmm(b_enc, x - b_dec, W_enc)
    acts = pre.masked_fill_(pre <= threshold.clamp(min=0), 0)
    return sparse_decode(acts, W_dec) + b_dec


def fused_topk_forward(x, W_enc, b_enc, W_dec, b_dec):
    indices, acts = topk_encode(x, W_enc, b_enc, TOPK_K, b_dec=b_dec)
    return topk_decode(indices, acts, W_dec, check_indices=False) + b_dec


def _case(architecture: str, shape: tuple[str, int, int, int], dtype: torch.dtype, device: str) -> Case:
    name, d_in, d_sae, l0 = shape
    l0 = TOPK_K if architecture == "topk" else l0
    key = (architecture, d_in, d_sae, l0, dtype, device)
    e = torch.tensor([], dtype=dtype).element_size()

    def params() -> tuple[torch.Tensor, ...]:
        w = weights_for(key)
        if architecture == "jumprelu":
            return w.W_enc, w.b_enc, w.threshold, w.W_dec, w.b_dec
        return w.W_enc, w.b_enc, w.W_dec, w.b_dec

    def make_inputs() -> tuple[torch.Tensor]:
        weights_for(key)  # build the weights before the harness sizes its input rotation
        return (torch.randn(TOKENS, d_in, device=device).to(dtype),)

    dense = dense_jumprelu_forward if architecture == "jumprelu" else dense_topk_forward
    fused = fused_jumprelu_forward if architecture == "jumprelu" else fused_topk_forward
    compiled = torch.compile(dense)
    impls: dict[str, Callable[..., Any]] = {
        "sparsefuse fused": lambda x: fused(x, *params()),
        **(
            {
                "sparsefuse cuBLAS encode + sparse decode (auto)": lambda x: dense_encode_sparse_decode_forward(
                    x, *params()
                )
            }
            if architecture == "jumprelu"
            else {}
        ),
        "eager": lambda x: dense(x, *params()),
        "torch.compile": lambda x: compiled(x, *params()),
        "encode matmul only": lambda x: x @ weights_for(key).W_enc,
    }
    try:
        import sae_lens  # noqa: F401

        has_sae_lens = True
        for impl in SAE_LENS_IMPLS[architecture]:
            impls[impl] = (lambda name: lambda x: weights_for(key).sae_lens[name](x))(impl)
    except ImportError:
        has_sae_lens = False
    touched_rows = d_sae * (1 - (1 - l0 / d_sae) ** TOKENS)  # expected distinct fired features in the batch
    return Case(
        workload="sae_forward",
        shape=f"{architecture} {name} B={TOKENS} d_in={d_in} d_sae={d_sae} L0={l0}",
        dtype=dtype,
        direction="fwd",
        bytes_moved=int((2 * TOKENS * d_in + d_in * d_sae + touched_rows * d_in) * e),
        flops=2 * TOKENS * d_in * d_sae + 2 * TOKENS * l0 * d_in,
        ceiling="matmul",
        make_inputs=make_inputs,
        impls=impls,
        eager_impl="sae_lens" if has_sae_lens else "eager",
        compile_impl="torch.compile",
    )


@register(
    "sae_forward",
    "SAE forward (encode + decode), 4096 tokens: sparsefuse vs SAELens, eager torch, "
    "torch.compile and the encode matmul alone",
    "architecture, SAE, tokens B, d_in, d_sae, L0",
)
def sae_forward_cases(options: Options) -> list[Case]:
    try:
        import sae_lens  # noqa: F401
    except ImportError:
        options.log("sae_forward: sae_lens is not installed: its rows are skipped (pip install sae-lens)")
    shapes = QUICK_SHAPES if options.quick else SAE_SHAPES
    dtypes = [d for d in options.dtypes if d != torch.float16]  # SAEs ship in fp32 and run in bf16
    if options.quick:
        dtypes = [d for d in dtypes if d == torch.bfloat16] or dtypes[:1]
    # weights_for keeps one case's weights in memory at a time.
    return [
        _case(arch, shape, dtype, options.device)
        for dtype in dtypes
        for shape in shapes
        for arch in ("jumprelu", "topk")
    ]
