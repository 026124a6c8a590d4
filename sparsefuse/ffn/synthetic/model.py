"""A whole transformers ``LlamaForCausalLM`` (``hidden_act="relu"``) with SYNTHETIC weights whose every MLP sees
ReLU gate activations with the statistics of a sparse ReLU LLM -- something to measure kernels on end to end
without downloading weights. Nothing here is a trained model: its outputs are meaningless.

Construction (all seeded):

- Every weight is transformers' random init (normal, std ``initializer_range`` = 0.02; RMSNorm weights 1) except
  the token embeddings, drawn with std ``_EMBED_STD`` = 1: with std 0.02 the attention outputs (near-uniform
  averages of the values at init) and the MLP outputs dominate the residual stream, so an MLP's input depends
  mostly on the position and the sequence, and thresholds calibrated on one batch shape missed the target by up to
  8x on another (1.5B shape, 2 layers). With the token dominating the stream, every MLP's input distribution is
  nearly the same for any batch shape.
- The gate rows of layer l share a common direction so that tokens differ in how many neurons they fire (the
  heavy tail across tokens): ``w_n = 0.02 * sqrt(K) * normalize(alpha * u_l + r_n)``, ``u_l`` one random unit
  vector per layer, ``r_n`` random unit vectors, ``alpha = _ALPHA`` = 0.8, so ``x . w_n ~ alpha * (x . u_l) +
  (x . r_n)``: a token whose input points along ``u_l`` crosses many neurons' thresholds at once.
- Each neuron gets a target firing probability ``p_n``: 0 for a ``_DEAD_FRACTION`` = 30% of the neurons,
  log-normal (sigma ``_NEURON_SPREAD`` = 1) across the others (hot and rare neurons), scaled so that
  ``sum(p_n) = mean_nnz`` (each at most ``_P_MAX``).
- The model is built with ``mlp_bias=True``; ``up_proj.bias`` and ``down_proj.bias`` are removed (``LlamaMLP``
  just calls its Linear modules, so a ``None`` bias is a plain bias-free Linear) and the gate bias is the
  calibration device: one forward pass over ``calibration_tokens`` random token ids (sequences of
  ``_CALIBRATION_SEQ`` tokens), where a forward pre-hook on each MLP computes the pre-activations
  ``P = X W_gate^T`` of its actual input and sets ``bias_n = -(mean(P[:, n]) + std(P[:, n]) * Phi^-1(1 - p_n))``
  (dead neurons: ``_DEAD_BIAS``). The hook runs before the MLP's own forward, so layer l's calibrated output is
  what layer l + 1 is calibrated on: every layer sees its real input distribution. The pre-activations are
  nearly Gaussian per neuron, and the Gaussian fit is far less noisy than empirical tail quantiles (with 1024
  calibration tokens those put the realised means 15-30% above the target: the rare neurons' thresholds are set
  by one or two samples, and the top tokens' common-direction excess shifts every threshold together).

Realised on fresh tokens (H200, bf16, full depth, ``mean_nnz=30``; batches of 8 x 256, 1 x 512, 1 x 2048): every
layer's mean is 20-41 non-zeros per token at the 1.5B shape and 17-41 at the 8B shape; the first layer's median
is 3-6 and its p99 330-475 (the layer generator of :mod:`.layer`: median ~8, p99 ~270). See :data:`BRANCH_SHARE`
for why the residual branches are scaled down.

What is and is not realistic: the per-layer gate statistics (mean non-zeros per token, a heavy per-token tail,
hot and ~30% dead neurons; check them with :func:`model_gate_statistics` on fresh tokens) and every shape, dtype
and module of a real ReLU Llama are; the attention, the embeddings and the up/down projections are random, so the
residual stream, the attention patterns and the logits are not those of a trained model: a token fires nearly
the same neurons in any context, and a real sparse model has no gate bias (here it only places the thresholds).
The statistics hold for token ids drawn like the calibration ones (uniform over the vocabulary).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .layer import gate_statistics, resolve_device

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

__all__ = ["LLAMA_SHAPES", "synthetic_llama", "model_gate_statistics"]

LLAMA_SHAPES: dict[str, dict] = {
    # A 1.5B-class Llama at the paper's FFN width (1.36B parameters, untied embeddings; not the released SparseLM).
    "1.5B": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    # Llama-3-8B's geometry.
    "8B": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
    ),
}
# The TwELL paper's released SparseLM-1.5B (full multi-head attention, tied embeddings, rope theta 1e5) and
# SparseLM-2B, the same width 38 layers deep.
LLAMA_SHAPES["SparseLM-1.5B"] = dict(
    LLAMA_SHAPES["1.5B"],
    num_hidden_layers=28,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=49152,
    max_position_embeddings=2048,
    rope_theta=1e5,
    tie_word_embeddings=True,
)
LLAMA_SHAPES["SparseLM-2B"] = dict(LLAMA_SHAPES["SparseLM-1.5B"], num_hidden_layers=38)

_ALPHA = 0.8  # weight of the shared gate direction (sets the per-token tail)
_NEURON_SPREAD = 1.0  # log-normal sigma of the live neurons' firing probabilities (hot-10% share ~45%)
_DEAD_FRACTION = 0.3
_DEAD_BIAS = -1.0e4  # far below any pre-activation, and exact in bf16/fp16
_EMBED_STD = 1.0  # token embeddings dominate the residual stream (see the module docstring)
_P_MAX = 0.9  # no neuron fires for every token
_CALIBRATION_SEQ = 256
# Norm of each residual branch's output (attention, MLP) as a share of the token embedding's, set during calibration.
# At transformers' init the attention output of a wide model rivals the embedding (its norm grows like K * 0.02^2 of
# the embedding's: 0.8x at K=2048, 1.6x at K=4096) and depends on the position and the context, so deep layers'
# inputs drift with the batch shape and thresholds set on one shape miss on another (measured at the 8B shape: 30
# non-zeros per token in the first layers, 100-700 in deep ones). Small branches keep every layer's input close to
# its token's embedding, whatever the context.
BRANCH_SHARE: float | None = 0.05
_NEURON_CHUNK = 2048  # neurons whose pre-activations are held at once during calibration


def _config(shape: str | dict, num_hidden_layers: int | None, attn_implementation: str, overrides: dict):
    from transformers import LlamaConfig

    if isinstance(shape, str):
        if shape not in LLAMA_SHAPES:
            raise ValueError(
                f"synthetic_llama: shape must be one of {', '.join(LLAMA_SHAPES)} or a dict; got {shape!r}"
            )
        fields = dict(LLAMA_SHAPES[shape])
    else:
        fields = dict(shape)
    fields.update(overrides)
    if num_hidden_layers is not None:
        fields["num_hidden_layers"] = num_hidden_layers
    fields["hidden_act"] = "relu"
    config = LlamaConfig(**fields)
    config._attn_implementation = attn_implementation
    return config


def target_probabilities(
    intermediate_size: int,
    mean_nnz: float,
    generator: torch.Generator,
    *,
    dead_fraction: float = _DEAD_FRACTION,
    neuron_spread: float = _NEURON_SPREAD,
) -> torch.Tensor:
    """Per-neuron firing probabilities [N] float64: 0 for ~``dead_fraction`` of the neurons, log-normal across the
    others, summing to ``mean_nnz`` (each at most ``_P_MAX``)."""
    N = intermediate_size
    dead = torch.rand(N, generator=generator, dtype=torch.float64) < dead_fraction
    weight = torch.exp(neuron_spread * torch.randn(N, generator=generator, dtype=torch.float64))
    weight[dead] = 0.0
    n_live = int((~dead).sum())
    if not 0 < mean_nnz < _P_MAX * n_live:
        raise ValueError(
            f"synthetic_llama: mean_nnz must be in (0, {_P_MAX * n_live:.0f}) ({n_live} live neurons); got {mean_nnz}"
        )
    p = torch.zeros(N, dtype=torch.float64)
    capped = torch.zeros(N, dtype=torch.bool)
    for _ in range(N):  # water-filling: scale the uncapped neurons, cap those above _P_MAX, repeat
        free = ~capped & ~dead
        p[free] = weight[free] * (mean_nnz - _P_MAX * int(capped.sum())) / weight[free].sum()
        over = free & (p > _P_MAX)
        if not bool(over.any()):
            break
        capped |= over
        p[capped] = _P_MAX
    return p


def _gate_rows(N: int, K: int, alpha: float, std: float, generator: torch.Generator) -> torch.Tensor:
    """[N, K] float32 rows ``std * sqrt(K) * normalize(alpha * u + r_n)`` (``u``, ``r_n`` random unit vectors)."""
    u = F.normalize(torch.randn(K, generator=generator), dim=0)
    r = F.normalize(torch.randn(N, K, generator=generator), dim=1)
    return std * math.sqrt(K) * F.normalize(alpha * u + r, dim=1)


def _calibrated_bias(x: torch.Tensor, weight: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Gate bias [N] float32 giving neuron n a firing probability ``p_n`` on inputs like ``x`` [..., K] (the MLP's
    input): ``-(mean_n + std_n * Phi^-1(1 - p_n))`` of the pre-activations ``P[:, n] = x W[n]^T`` (computed as the
    model computes them), ``_DEAD_BIAS`` where ``p_n = 0``."""
    x2 = x.reshape(-1, x.shape[-1])
    N = weight.shape[0]
    z = torch.special.ndtri(1.0 - p.clamp(max=_P_MAX)).float()  # +inf where p = 0, overwritten below
    bias = torch.empty(N, dtype=torch.float32)
    for start in range(0, N, _NEURON_CHUNK):
        stop = min(start + _NEURON_CHUNK, N)
        std, mean = torch.std_mean(F.linear(x2, weight[start:stop]).float(), dim=0)
        bias[start:stop] = -(mean + std * z[start:stop].to(std.device)).cpu()
    bias[p == 0] = _DEAD_BIAS
    return bias


def _mlps(model: nn.Module) -> list[nn.Module]:
    """The gated MLPs of ``model`` in layer order (transformers ``LlamaMLP`` or sparsefuse ``SparseGatedMLP``)."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "gate_proj", None), nn.Linear) and isinstance(getattr(m, "down_proj", None), nn.Linear)
    ]


def _random_ids(vocab: int, tokens: int, seq: int, generator: torch.Generator) -> torch.Tensor:
    seq = max(1, min(seq, tokens))
    return torch.randint(0, vocab, (max(1, tokens // seq), seq), generator=generator)


@torch.no_grad()
def synthetic_llama(
    shape: str | dict = "1.5B",
    *,
    num_hidden_layers: int | None = None,
    mean_nnz: float | None = 30.0,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device | None = None,
    seed: int = 0,
    calibration_tokens: int = 2048,
    attn_implementation: str = "sdpa",
    **config_overrides,
) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` with ReLU MLPs whose gates fire ~``mean_nnz`` neurons per token in every layer
    (synthetic weights; see the module docstring), in eval mode on ``device`` (None: CUDA when available, else the
    CPU) in ``dtype``.

    ``shape``: a key of :data:`LLAMA_SHAPES` or a dict of ``LlamaConfig`` fields; ``config_overrides`` are further
    ``LlamaConfig`` fields. ``mean_nnz=None``: plain random weights and no calibration (a dense ReLU model: ~50%
    of the neurons fire). ``device="meta"`` builds the structure only (no values, no calibration)."""
    from transformers import LlamaForCausalLM

    device = resolve_device("synthetic_llama", device)
    if mean_nnz is not None:
        config_overrides = {**config_overrides, "mlp_bias": True}
    config = _config(shape, num_hidden_layers, attn_implementation, config_overrides)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            model = LlamaForCausalLM._from_config(config, dtype=dtype)
    model.eval()
    if mean_nnz is None:
        return model

    mlps = _mlps(model)
    for mlp in mlps:
        mlp.up_proj.register_parameter("bias", None)
        mlp.down_proj.register_parameter("bias", None)
    if device.type == "meta":  # the structure only (e.g. to count parameters): nothing to calibrate
        return model

    g = torch.Generator().manual_seed(seed + 1)
    emb = model.get_input_embeddings().weight
    emb.copy_(_EMBED_STD * torch.randn(emb.shape, generator=g))
    K, N, std = config.hidden_size, config.intermediate_size, config.initializer_range
    targets = []
    for mlp in mlps:
        mlp.gate_proj.weight.copy_(_gate_rows(N, K, _ALPHA, std, g))
        targets.append(target_probabilities(N, mean_nnz, g))

    def calibrate(p: torch.Tensor):
        def hook(mlp: nn.Module, args: tuple) -> None:
            bias = _calibrated_bias(args[0], mlp.gate_proj.weight, p)
            mlp.gate_proj.bias.copy_(bias.to(mlp.gate_proj.bias.device))

        return hook

    embed_norm = _EMBED_STD * math.sqrt(K)

    def shrink(proj: nn.Linear):
        def hook(module: nn.Module, args: tuple, output):
            out = output[0] if isinstance(output, tuple) else output
            scale = BRANCH_SHARE * embed_norm / max(float(out.float().norm(dim=-1).mean()), 1e-30)
            proj.weight.mul_(scale)
            out.mul_(scale)
            return output

        return hook

    handles = [mlp.register_forward_pre_hook(calibrate(p)) for mlp, p in zip(mlps, targets)]
    if BRANCH_SHARE is not None:
        for layer in model.model.layers:
            handles.append(layer.self_attn.register_forward_hook(shrink(layer.self_attn.o_proj)))
            handles.append(layer.mlp.register_forward_hook(shrink(layer.mlp.down_proj)))
    try:
        ids = _random_ids(config.vocab_size, calibration_tokens, _CALIBRATION_SEQ, g).to(device)
        model.model(input_ids=ids)  # the decoder stack only: the logits are not needed
    finally:
        for h in handles:
            h.remove()
    return model


@torch.no_grad()
def model_gate_statistics(model: nn.Module, input_ids: torch.Tensor) -> list[dict[str, float]]:
    """Per-layer ReLU gate statistics of ``model`` on ``input_ids`` [B, T]: ``mean``, ``median``, ``p90``, ``p99``,
    ``max`` non-zeros per token, ``dead_fraction`` (neurons that fired for none of these tokens: with few tokens,
    rare neurons count too) and ``hot10_share`` (share of all firings taken by the 10% most-firing neurons).

    Works on unpatched (``LlamaMLP``) and patched (sparsefuse ``SparseGatedMLP``, which reads ``gate_proj.weight``
    without calling the module) models alike: a forward pre-hook on each MLP recomputes
    ``relu(gate_proj(x)) != 0`` from the MLP's input."""
    mlps = _mlps(model)
    per_token: list[list[torch.Tensor]] = [[] for _ in mlps]
    per_neuron: list[torch.Tensor | None] = [None for _ in mlps]

    def observe(i: int):
        def hook(mlp: nn.Module, args: tuple) -> None:
            x = args[0]
            fired = F.linear(x.reshape(-1, x.shape[-1]), mlp.gate_proj.weight, mlp.gate_proj.bias) > 0
            per_token[i].append(fired.sum(dim=1).cpu())
            counts = fired.sum(dim=0, dtype=torch.int64).cpu()
            per_neuron[i] = counts if per_neuron[i] is None else per_neuron[i] + counts

        return hook

    handles = [mlp.register_forward_pre_hook(observe(i)) for i, mlp in enumerate(mlps)]
    try:
        base = getattr(model, "model", model)
        base(input_ids=input_ids.to(next(model.parameters()).device))
    finally:
        for h in handles:
            h.remove()
    stats = []
    for tokens, neurons in zip(per_token, per_neuron):
        s = gate_statistics(torch.cat(tokens))
        s.pop("frac_above_4x_mean")
        top = neurons.sort(descending=True).values[: max(1, neurons.numel() // 10)]
        total = int(neurons.sum())
        s["dead_fraction"] = float((neurons == 0).double().mean())
        s["hot10_share"] = float(top.sum()) / total if total else 0.0
        stats.append(s)
    return stats
