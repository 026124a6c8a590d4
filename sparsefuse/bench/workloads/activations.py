"""Benchmark workloads for the fused activations: ``snake``, ``celu`` and ``snac`` (SNAC decode end to end).

Implementations compared on every case:

* ``sparsefuse``      the fused Triton kernels (plus ``sparsefuse fast_sin`` for snake, ``sparsefuse celu_`` in place)
* ``eager``           the same math as a plain torch expression (one kernel per op)
* ``torch.compile``   ``torch.compile`` of that eager function, default mode
* what users run today: ``SNAC TorchScript snake`` (SNAC/DAC's scripted ``snake``) and ``F.celu`` (PyTorch's own
  CELU kernel)
* ``copy``            ``x.clone()``: the same bytes as the forward, this size's practical ceiling
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

import sparsefuse

from ..harness import Case, Direction, Options, register

# ----------------------------------------------------------------------------------------------------------------
# Snake
# ----------------------------------------------------------------------------------------------------------------

# [B, C, T] of the five Snake1d stages of SNAC's 24 kHz decoder for ~5 s of audio (T = 236 * 2^k), plus two large
# training-sized tensors.
SNAKE_SHAPES: list[tuple[int, int, int]] = [
    (1, 1024, 236),
    (1, 512, 1888),
    (1, 256, 15104),
    (1, 128, 60416),
    (1, 64, 120832),
    (1, 1024, 65536),
    (8, 512, 16384),
]
SNAKE_QUICK_SHAPES: list[tuple[int, int, int]] = [(1, 1024, 236), (8, 512, 16384)]
SNAC_SNAKE = "SNAC TorchScript snake"  # the row of what SNAC/DAC users run today


def eager_snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """DAC's expression in x's dtype (alpha cast first, so the output dtype matches sparsefuse's)."""
    a = alpha.to(x.dtype)
    return x + (a + 1e-9).reciprocal() * torch.sin(a * x).pow(2)


def _snac_snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    # A copy of snac.layers.snake (identical to DAC's), scripted below exactly as SNAC does. With an fp32 alpha and
    # half-precision x, type promotion makes its output fp32, as in a SNAC model whose Snake parameters stay fp32.
    shape = x.shape
    x = x.reshape(shape[0], shape[1], -1)
    x = x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)
    x = x.reshape(shape)
    return x


@functools.cache
def snac_snake() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The TorchScript-compiled SNAC/DAC snake (scripted on first use, not at import)."""
    with warnings.catch_warnings():  # TorchScript is deprecated, but it is what SNAC ships
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(_snac_snake)


def _snake_fwd_bwd(f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
    # autograd.grad returns fresh gradients each call (no .grad accumulation across timed calls).
    return lambda x, alpha, grad_y: torch.autograd.grad(f(x, alpha), (x, alpha), grad_y)


def _snake_case(shape: tuple[int, int, int], dtype: torch.dtype, direction: Direction, device: str) -> Case:
    B, C, T = shape
    n, e = B * C * T, torch.tensor([], dtype=dtype).element_size()
    backward = direction == "fwd+bwd"

    def make_inputs() -> tuple[torch.Tensor, ...]:
        x = torch.randn(shape, device=device, dtype=dtype)
        alpha = torch.empty(1, C, 1, device=device).uniform_(0.5, 2.0)  # an fp32 Parameter in SNAC
        if not backward:
            return x, alpha
        return x.requires_grad_(), alpha.requires_grad_(), torch.randn(shape, device=device, dtype=dtype)

    forwards: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "sparsefuse": lambda x, a: sparsefuse.snake(x, a),
        "sparsefuse fast_sin": lambda x, a: sparsefuse.snake(x, a, fast_sin=True),
        "eager": eager_snake,
        "torch.compile": torch.compile(eager_snake),  # lazy: compiles on the harness's warm-up call
        SNAC_SNAKE: lambda x, a: snac_snake()(x, a),
    }
    if backward:
        impls = {name: _snake_fwd_bwd(f) for name, f in forwards.items()}
    else:
        # The same bytes as the forward (read x, write y) through torch's copy: this size's practical ceiling.
        impls = {**forwards, "copy": lambda x, a: x.clone()}
    # Minimal traffic: forward reads x, writes y; backward reads grad_y and x, writes grad_x (alpha is O(C)).
    # Flops: elementwise operations with sin/cos counted as one; informational only (the op is memory-bound).
    return Case(
        workload="snake",
        shape=f"{B}x{C}x{T}",
        dtype=dtype,
        direction=direction,
        bytes_moved=(5 if backward else 2) * n * e,
        flops=(22 if backward else 5) * n,
        ceiling="copy",
        make_inputs=make_inputs,
        impls=impls,
    )


def _grid(make_case: Callable[..., Case], sizes: list, options: Options) -> list[Case]:
    """Every size x dtype x direction, grouped by dtype then direction (the report's panel order)."""
    return [
        make_case(size, dtype, direction, options.device)
        for dtype in options.dtypes
        for direction in ("fwd", "fwd+bwd")
        for size in sizes
    ]


@register(
    "snake",
    "Snake activation: sparsefuse vs eager torch, torch.compile and SNAC's TorchScript snake",
    "[batch, channels, time]",
)
def snake_cases(options: Options) -> list[Case]:
    return _grid(_snake_case, SNAKE_QUICK_SHAPES if options.quick else SNAKE_SHAPES, options)


# ----------------------------------------------------------------------------------------------------------------
# CELU
# ----------------------------------------------------------------------------------------------------------------

CELU_SIZES: list[int] = [1 << 20, 1 << 24, 1 << 26]
CELU_QUICK_SIZES: list[int] = [1 << 20, 1 << 26]


def eager_celu(x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """CELU as a plain torch expression."""
    return torch.where(x > 0, x, alpha * torch.expm1(x / alpha))


def _size_label(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else str(n)


def _celu_case(n: int, dtype: torch.dtype, direction: Direction, device: str) -> Case:
    e = torch.tensor([], dtype=dtype).element_size()
    backward = direction == "fwd+bwd"

    def make_inputs() -> tuple[torch.Tensor, ...]:
        x = torch.randn(n, device=device, dtype=dtype)
        return (x,) if not backward else (x.requires_grad_(), torch.randn(n, device=device, dtype=dtype))

    forwards: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "sparsefuse": lambda x: sparsefuse.celu(x, 1.0),
        "eager": eager_celu,
        "torch.compile": torch.compile(eager_celu),
        "F.celu": lambda x: torch.nn.functional.celu(x, 1.0),
    }
    if backward:
        impls = {name: (lambda fn: lambda x, g: torch.autograd.grad(fn(x), x, g))(f) for name, f in forwards.items()}
    else:
        impls = dict(forwards)
        # In place, each timed call overwrites its own input set, so replays apply CELU again and again to the same
        # buffer. That is fine for timing: CELU maps every real to (-alpha, inf), so repeated application stays
        # finite (negative values drift slowly towards 0, never to NaN/inf), and the bytes moved are the same.
        impls["sparsefuse celu_"] = lambda x: sparsefuse.celu_(x, 1.0)
        impls["copy"] = lambda x: x.clone()  # same bytes as the forward: this size's practical ceiling
    # Forward reads x, writes y; backward reads grad_y and the saved y (or x), writes grad_x.
    return Case(
        workload="celu",
        shape=_size_label(n),
        dtype=dtype,
        direction=direction,
        bytes_moved=(5 if backward else 2) * n * e,
        flops=(7 if backward else 4) * n,
        ceiling="copy",
        make_inputs=make_inputs,
        impls=impls,
    )


@register("celu", "CELU activation: sparsefuse vs eager torch, torch.compile and F.celu", "elements")
def celu_cases(options: Options) -> list[Case]:
    return _grid(_celu_case, CELU_QUICK_SIZES if options.quick else CELU_SIZES, options)


# ----------------------------------------------------------------------------------------------------------------
# SNAC decode, end to end
# ----------------------------------------------------------------------------------------------------------------

# SNAC's 24 kHz configuration (hop 512, codes at 1/4, 1/2 and 1 of the latent rate).
SNAC_24KHZ: dict[str, Any] = dict(
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
# Coarsest code length: codes have lengths L, 2L, 4L and the latent 4L = 236 frames, so the decoder's first Snake
# sees T = 236 (236 * 512 = 120832 samples, ~5 s at 24 kHz).
SNAC_CODE_LENGTH = 59


@register(
    "snac",
    "SNAC 24 kHz decode end to end: the snac model vs the same model with sparsefuse's Snake patched in",
    "codes per decode, timing method",
)
def snac_cases(options: Options) -> list[Case]:
    if torch.float32 not in options.dtypes:
        options.log("snac: skipped (the decode runs in float32, which --dtype excludes)")
        return []
    try:
        import snac
    except ImportError:
        options.log("snac: skipped (the `snac` package is not installed: pip install snac)")
        return []
    try:
        from sparsefuse.integrations.snac import patch
    except ImportError as exc:
        options.log(f"snac: skipped (sparsefuse.integrations.snac is unavailable: {exc})")
        return []

    @functools.cache
    def models() -> dict[str, torch.nn.Module]:
        # Built on first use (inside the harness, on the GPU), not when cases are listed.
        model = snac.SNAC(**SNAC_24KHZ)
        with torch.no_grad():  # trained alphas are not all ones; random ones exercise the per-channel path
            for name, param in model.named_parameters():
                if name.endswith("alpha"):
                    param.uniform_(0.5, 2.0)
        model = model.to(options.device).eval()
        return {"eager (snac)": model, "sparsefuse (patched)": patch(copy.deepcopy(model))}

    L, strides = SNAC_CODE_LENGTH, SNAC_24KHZ["vq_strides"]

    def make_inputs() -> tuple[list[torch.Tensor]]:
        # One code sequence per codebook; the one with stride s has 4L / s frames.
        n_codes = SNAC_24KHZ["codebook_size"]
        return ([torch.randint(0, n_codes, (1, L * strides[0] // s), device=options.device) for s in strides],)

    def decode(name: str) -> Callable[[list[torch.Tensor]], torch.Tensor]:
        def run(codes: list[torch.Tensor]) -> torch.Tensor:
            model = models()[name]
            # no_grad, not inference_mode: SNAC's TorchScript snake raises under inference_mode when its alphas
            # require grad (it still records autograd for them).
            with torch.no_grad():
                return model.decode(codes)

        return run

    seconds = L * strides[0] * 512 / SNAC_24KHZ["sampling_rate"]
    impls = {name: decode(name) for name in ("eager (snac)", "sparsefuse (patched)")}
    # Two views of the same decode: "wall" is what a Python loop sees (host overhead included: the decode is
    # host-bound), "graph" replays a captured CUDA graph of it (GPU time only, as under CUDA graphs in serving).
    return [
        Case(
            workload="snac",
            shape=f"decode L={L} ({seconds:.1f} s) {method}",
            dtype=torch.float32,
            direction="fwd",
            bytes_moved=0,
            flops=0,
            ceiling="none",
            make_inputs=make_inputs,
            impls=impls,
            method=method,
            rotate=False,
            eager_impl="eager (snac)",
            compile_impl=None,
        )
        for method in ("wall", "graph")
    ]
