"""Benchmark workloads ``splade`` (max pooling, SPLADE v2+) and ``splade_sum`` (sum pooling, SPLADE v1): the fused
SPLADE head against the head as users run it today.

Implementations compared on every case:

* ``sparsefuse``      :func:`sparsefuse.splade.splade_pool` (one kernel forward; sparse / recomputing backward)
* ``eager``           naver/splade's head in plain torch: ``torch.max(log1p(relu(h @ W.T + b)) * mask, dim=1)``
                      (the same expression as sentence-transformers' ``SpladePooling``)
* ``torch.compile``   ``torch.compile`` of that eager function, default mode
* ``matmul``          the bare ``hidden @ weight.T`` (forward only, no autograd): the floor every implementation
                      pays; in ``fwd+bwd`` cases too, as the floor of the fused path (whose backward is sparse)

Shapes: SPLADE-v3 (bert-base: H = 768, V = 30522) at B in {32, 64, 128}, S in {256, 512}; multilingual / LLM-sized
vocabularies (H = 768, V = 250002 as XLM-R; H = 1024, V = 151936 as Qwen) at B = 32, S = 256; and the headline
shape B = 32, S = 256 with realistic padding (lengths uniform in [S/4, S]; the fused kernel skips whole padding
tiles, the others compute every position). Inputs: hidden ~ N(0, 1), weight and bias ~ N(0, 0.02), so logits
have both signs at every position (std ~0.55 at H = 768); maxima over the sequence are then almost always
positive, so the max-pooling gradient is dense over (b, v): the worst case for the sparse backward. The padded
case's flops count every position (what eager computes), so its rate is an effective rate.

Cost model: ``flops`` = 2*B*S*V*H for the forward (ceiling "matmul": compare with the bf16 matmul rate measured in
the same run); fwd+bwd adds the sparse backward's 4*B*V*H (max) or the dense 4*B*S*V*H (sum). ``bytes_moved``:
hidden, weight, bias and mask read once and the [B, V] output written once (fwd+bwd: plus the incoming gradient
and the three gradients). The harness records each implementation's peak memory above its inputs (``peak_mb``).

Targets at B=32, S=256, V=30522, bf16 (max): forward >= 2x torch.compile with <= 1/50 of its peak memory;
fwd+bwd >= 4x eager with >= 10x less peak memory; forward >= 55% of the matmul rate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...splade import splade_pool
from ..harness import Case, Direction, Options, register

SpladeShape = tuple[int, int, int, int]  # (B, S, H, V)

SPLADE_V3_SHAPES: list[SpladeShape] = [(B, S, 768, 30522) for B in (32, 64, 128) for S in (256, 512)]
LARGE_VOCAB_SHAPES: list[SpladeShape] = [(32, 256, 768, 250002), (32, 256, 1024, 151936)]
HEADLINE_SHAPE: SpladeShape = (32, 256, 768, 30522)


def eager_splade_max(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """naver/splade's SPLADE v2+ head (max pooling) in the inputs' dtype."""
    scores = torch.log1p(torch.relu(hidden @ weight.t() + bias)) * mask.unsqueeze(-1).to(hidden.dtype)
    return torch.max(scores, dim=1).values


def eager_splade_sum(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """SPLADE v1's head (sum pooling) in the inputs' dtype."""
    return (torch.log1p(torch.relu(hidden @ weight.t() + bias)) * mask.unsqueeze(-1).to(hidden.dtype)).sum(dim=1)


def _matmul_floor(hidden: torch.Tensor, weight: torch.Tensor, *_: Any) -> torch.Tensor:
    return torch.matmul(hidden.detach(), weight.detach().t())


def _attention_mask(B: int, S: int, padded: bool, device: str) -> torch.Tensor:
    """int64 like a tokenizer's; padded: lengths uniform in [S/4, S] with padding at the end."""
    if not padded:
        return torch.ones(B, S, dtype=torch.int64, device=device)
    lengths = torch.randint(S // 4, S + 1, (B,), device=device)
    return (torch.arange(S, device=device)[None, :] < lengths[:, None]).to(torch.int64)


def _case(
    shape: SpladeShape, dtype: torch.dtype, direction: Direction, pooling: str, padded: bool, device: str
) -> Case:
    B, S, H, V = shape
    e = torch.tensor([], dtype=dtype).element_size()
    backward = direction == "fwd+bwd"

    def make_inputs() -> tuple[torch.Tensor, ...]:
        hidden = torch.randn(B, S, H, device=device, dtype=dtype)
        weight = (torch.randn(V, H, device=device) * 0.02).to(dtype)
        bias = (torch.randn(V, device=device) * 0.02).to(dtype)
        mask = _attention_mask(B, S, padded, device)
        if not backward:
            return hidden, weight, bias, mask
        grad_out = torch.randn(B, V, device=device, dtype=dtype)
        return hidden.requires_grad_(), weight.requires_grad_(), bias.requires_grad_(), mask, grad_out

    eager = eager_splade_max if pooling == "max" else eager_splade_sum
    forwards: dict[str, Callable[..., torch.Tensor]] = {
        "sparsefuse": lambda h, w, b, m: splade_pool(h, w, b, m, pooling=pooling),
        "eager": eager,
        "torch.compile": torch.compile(eager),  # compiles on the harness's warm-up call
    }
    if backward:
        # autograd.grad returns fresh gradients each call (no .grad accumulation across timed calls)
        impls: dict[str, Callable[..., Any]] = {
            name: (lambda fn: lambda h, w, b, m, g: torch.autograd.grad(fn(h, w, b, m), (h, w, b), g))(f)
            for name, f in forwards.items()
        }
    else:
        impls = dict(forwards)
    impls["matmul"] = _matmul_floor

    flops = 2 * B * S * V * H
    bytes_moved = (B * S * H + V * H + V + B * V) * e + B * S * 8  # int64 mask
    if backward:
        flops += 4 * B * V * H if pooling == "max" else 4 * B * S * V * H
        bytes_moved += (B * V + B * S * H + V * H + V) * e
    label = f"B={B} S={S} H={H} V={V}" + (" padded" if padded else "")
    return Case(
        workload="splade" if pooling == "max" else "splade_sum",
        shape=label,
        dtype=dtype,
        direction=direction,
        bytes_moved=bytes_moved,
        flops=flops,
        ceiling="matmul",
        make_inputs=make_inputs,
        impls=impls,
    )


def _dtypes(options: Options, workload: str) -> list[torch.dtype]:
    dtypes = [d for d in options.dtypes if d in (torch.bfloat16, torch.float16)]
    if torch.float32 in options.dtypes:
        options.log(
            f"{workload}: float32 skipped (exact-fp32 products of this size take seconds per call in every "
            "implementation; SPLADE runs in bf16/fp16)"
        )
    return dtypes


@register(
    "splade",
    "SPLADE head, max pooling: sparsefuse vs eager torch, torch.compile and the bare matmul",
    "batch B, sequence S, hidden H, vocabulary V",
)
def splade_cases(options: Options) -> list[Case]:
    shapes = [(HEADLINE_SHAPE, False)]
    if not options.quick:
        shapes += [(s, False) for s in SPLADE_V3_SHAPES + LARGE_VOCAB_SHAPES if s != HEADLINE_SHAPE]
        shapes += [(HEADLINE_SHAPE, True)]
    return [
        _case(shape, dtype, direction, "max", padded, options.device)
        for dtype in _dtypes(options, "splade")
        for direction in ("fwd", "fwd+bwd")
        for shape, padded in shapes
    ]


@register(
    "splade_sum",
    "SPLADE head, sum pooling: sparsefuse vs eager torch, torch.compile and the bare matmul",
    "batch B, sequence S, hidden H, vocabulary V",
)
def splade_sum_cases(options: Options) -> list[Case]:
    return [
        _case(HEADLINE_SHAPE, dtype, direction, "sum", False, options.device)
        for dtype in _dtypes(options, "splade_sum")
        for direction in ("fwd", "fwd+bwd")
    ]
