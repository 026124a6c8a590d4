"""Benchmark workload ``overhead``: what one default eager call costs on the host, against CUDA-graph replay.

Small calls -- a SNAC decoder's Snake stage, one token's SAE decode, one token through a TwELL FFN -- finish on the
GPU in a few microseconds, so a Python loop calling them is bound by the host: argument checks, method choice,
allocation and the kernel launch. Each op is timed twice on the same inputs:

* ``eager calls``   plain back-to-back calls (harness method ``"eager"``): the time per call a user's loop sees
* ``graph replay``  the same call captured in a CUDA graph and replayed: GPU time alone, as under CUDA graphs in
                    serving (``torch.compile(mode="reduce-overhead")``, vLLM)

The difference between the two rows of an implementation is its host overhead per call. The eager torch
expression and the library a user runs today are timed alongside, so the table also says whether sparsefuse's
default call costs more host time than what it replaces. Inputs are not rotated: the weights are what is read, and
the question is the host, not DRAM. Each op runs in the dtype it is used in (``--dtype`` does not apply).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import sparsefuse

from ...ffn import twell_mlp
from ...ffn.synthetic import synthetic_ffn
from ...nn import SparseGatedMLP
from ...sae import sparse_decode
from ..harness import Case, Options, register
from .activations import SNAC_SNAKE, eager_celu, eager_snake, snac_snake

METHODS = (("eager", "eager calls"), ("graph", "graph replay"))


def _cases(
    op: str,
    shape: str,
    dtype: torch.dtype,
    make_inputs: Callable[[], tuple[Any, ...]],
    impls: dict[str, Callable[..., Any]],
) -> list[Case]:
    return [
        Case(
            workload="overhead",
            shape=f"{op} {shape} {label}",
            dtype=dtype,
            direction="fwd",
            bytes_moved=0,
            flops=0,
            ceiling="none",
            make_inputs=make_inputs,
            impls=impls,
            method=method,
            rotate=False,
            compile_impl="torch.compile" if "torch.compile" in impls else None,
        )
        for method, label in METHODS
    ]


def _snake(device: str) -> list[Case]:
    B, C, T = 1, 1024, 236  # the first Snake of SNAC's 24 kHz decoder for ~5 s of audio

    def make_inputs() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(B, C, T, device=device), torch.empty(1, C, 1, device=device).uniform_(0.5, 2.0)

    impls = {
        "sparsefuse": lambda x, a: sparsefuse.snake(x, a),
        "eager": eager_snake,
        "torch.compile": torch.compile(eager_snake),
        SNAC_SNAKE: lambda x, a: snac_snake()(x, a),
    }
    return _cases("snake", f"{B}x{C}x{T}", torch.float32, make_inputs, impls)


def _celu(device: str) -> list[Case]:
    n = 1024 * 236

    def make_inputs() -> tuple[torch.Tensor]:
        return (torch.randn(n, device=device),)

    impls = {
        "sparsefuse": lambda x: sparsefuse.celu(x),
        "eager": eager_celu,
        "F.celu": lambda x: torch.nn.functional.celu(x),
    }
    return _cases("celu", str(n), torch.float32, make_inputs, impls)


def _sae_decode(device: str) -> list[Case]:
    F, D, l0 = 65536, 2304, 72  # Gemma Scope 2B 65k, one token

    def make_inputs() -> tuple[torch.Tensor, torch.Tensor]:
        acts = torch.zeros(1, F, device=device, dtype=torch.bfloat16)
        acts[0, torch.randperm(F, device=device)[:l0]] = 1.0
        return acts, torch.randn(F, D, device=device, dtype=torch.bfloat16) / 16

    impls = {
        "sparsefuse auto": lambda a, w: sparse_decode(a, w),
        "sparsefuse scan": lambda a, w: sparse_decode(a, w, method="scan"),
        "eager": lambda a, w: a @ w,
    }
    return _cases("sae_decode", f"B=1 F={F} D={D} L0={l0}", torch.bfloat16, make_inputs, impls)


def _ffn(device: str) -> list[Case]:
    """One token through the 1.5B model's FFN layer: the default functional call (no hint), the explicit twell
    method, the drop-in module and what it replaces (transformers' ``LlamaMLP``, when installed), and the eager
    torch expression."""
    K, N, nnz = 2048, 5632, 32  # the 1.5B model's layer, one decode token
    built: dict[str, Any] = {}

    def make_inputs() -> tuple[torch.Tensor, ...]:
        if not built:  # built on first use (on the GPU, inside the harness), not when cases are listed
            f = synthetic_ffn(K, N, dtype=torch.bfloat16, device=device, seed=0)
            built["ffn"] = f
            built["module"] = SparseGatedMLP(K, N, device=device, dtype=torch.bfloat16)
            try:
                from transformers import LlamaConfig
                from transformers.models.llama.modeling_llama import LlamaMLP

                built["llama"] = LlamaMLP(LlamaConfig(hidden_size=K, intermediate_size=N, hidden_act="relu"))
                built["llama"].to(device=device, dtype=torch.bfloat16)
            except ImportError:
                pass
            for module in (built["module"], built.get("llama")):
                if module is not None:
                    module.requires_grad_(False)
                    module.gate_proj.weight.copy_(f.w_gate)
                    module.up_proj.weight.copy_(f.w_up)
                    module.down_proj.weight.copy_(f.w_down)
        f = built["ffn"]
        return f.make_input(1, float(nnz)), f.w_gate, f.w_up, f.w_down

    def eager(x, w_gate, w_up, w_down):
        F_ = torch.nn.functional
        return F_.linear(torch.relu(F_.linear(x, w_gate)) * F_.linear(x, w_up), w_down)

    impls = {
        "sparsefuse default": lambda *a: twell_mlp(*a),
        "sparsefuse twell": lambda *a: twell_mlp(*a, method="twell"),
        "SparseGatedMLP": lambda x, *w: built["module"](x),
        "eager": eager,
    }
    try:
        import transformers  # noqa: F401

        impls["transformers LlamaMLP"] = lambda x, *w: built["llama"](x)
    except ImportError:
        pass
    return _cases("ffn", f"M=1 K={K} N={N} nnz={nnz}", torch.bfloat16, make_inputs, impls)


@register(
    "overhead",
    "Time per small call: plain eager calls (host-bound, what a Python loop pays) vs CUDA-graph replay (GPU time only)",
    "op, shape, timing method",
)
def overhead_cases(options: Options) -> list[Case]:
    if options.quick:
        return _snake(options.device) + _sae_decode(options.device)
    return _snake(options.device) + _celu(options.device) + _sae_decode(options.device) + _ffn(options.device)
