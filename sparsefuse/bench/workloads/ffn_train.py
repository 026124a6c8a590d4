"""Benchmark workload ``ffn_train``: one training step (forward and backward) of the gated ReLU block, sparse
(:func:`sparsefuse.ffn.hybrid.hybrid_mlp`) against dense eager and torch.compile.

Shapes: the paper's 1.5B layer (K=2048, N=5632) and an 8B-class layer (K=4096, N=14336) at M in {8192, 16384} tokens,
bf16 (fp16 when bf16 is not requested). Inputs from :mod:`sparsefuse.ffn.synthetic`: ``nnz=30`` has ~30 gate
non-zeros per token with the paper's heavy tail (a model trained with L1); ``nnz=half`` fires ~45% of N (a model at
the start of training). Each implementation computes ``y`` (and for the sparse rows the L1 term, coefficient 2e-5)
and the gradients of x and the three weights with ``torch.autograd.grad``. Rows are plain eager calls (method
``eager``: what a training loop runs). ``--quick``: the 1.5B layer at 8192 tokens.

* ``dense eager``       ``F.linear(relu(F.linear(x, Wg)) * F.linear(x, Wu), Wd)`` and its autograd backward
* ``torch.compile``     the same, compiled
* ``sparse nnz=S``      ``hybrid_mlp`` as a user calls it (``layout="auto"``: the block step while the gate is
                        sparse, dense ops once it fires widely; ``cuda_graph=None``: replayed from the layer's two
                        CUDA graphs where the host would pace it, the 1.5B layer, launched eagerly at 8B) at S
                        non-zeros per token
* ``eager nnz=30``      the same with ``cuda_graph=False``: every step's ~16 Triton launches from Python
* ``queued nnz=30``     those eager calls, each enqueued while the GPU is still busy (method ``queued``): the step's
                        GPU time on the eager path, where the ``eager`` row's time is paced by a host as slow as
                        its GPU
* ``graphed nnz=30``    the same with ``cuda_graph=True``: each step replayed from the layer's two captured CUDA
                        graphs at any size (the host's launches and Python out of the way; captured on the first
                        calls)
* ``ELL nnz=30``        ``layout="hybrid"``: the TwELL paper's ELL + dense-backup format (one host sync per call)
* ``row-major nnz=30``  ``sparse nnz=30`` with w_down row-major, as an ``nn.Linear`` holds it (FSDP2's layout): what
                        the step's two copies of W_down^T cost a user who did not re-lay it out

``flops`` is the dense step's ``18 M K N`` for every row (TFLOP/s of a sparse row is dense-equivalent); the
``peak MB`` column is each call's allocator high-water mark above what was allocated before it: with no activation
kept past the call, it includes what the forward keeps for the backward. Each row's note gives what the forward
keeps for the backward (memory allocated after a forward, less its output), and its share of dense eager's.
"""

from __future__ import annotations

from typing import Any

import torch

from ...ffn.hybrid import hybrid_mlp
from ...ffn.synthetic import synthetic_ffn
from ..harness import Case, Options, register
from .ffn import eager_ffn

SHAPES: list[tuple[int, int]] = [(2048, 5632), (4096, 14336)]
M_VALUES = [8192, 16384]
QUICK = ([(2048, 5632)], [8192])
L1_COEFFICIENT = 2e-5  # on the per-element out.l1: a light term (the timings do not depend on its size)


def _dense_step(fn, x, w_gate, w_up, w_down, dy):
    y = fn(x, w_gate, w_up, w_down)
    return torch.autograd.grad(y, (x, w_gate, w_up, w_down), dy)


def _sparse_step(x, w_gate, w_up, w_down, dy, coefficient, layout, cuda_graph=None):
    out = hybrid_mlp(x, w_gate, w_up, w_down, layout=layout, cuda_graph=cuda_graph)
    return torch.autograd.grad((out.y, out.l1), (x, w_gate, w_up, w_down), (dy, coefficient))


def _case(K: int, N: int, M: int, dtype: torch.dtype, device: str) -> Case:
    seeds = iter(range(1 << 30))
    half = 0.45 * N  # synthetic_ffn leaves 30% of the neurons dead: at most ~0.7 N can fire

    def make_inputs() -> tuple[Any, ...]:
        ffn = synthetic_ffn(K, N, dtype=dtype, device=device, seed=next(seeds))
        x30, x_half = (ffn.make_input(M, s).requires_grad_() for s in (30.0, half))
        weights = [w.clone().requires_grad_() for w in (ffn.w_gate, ffn.w_up, ffn.w_down)]
        # the rows at 45% firing get their own copy of the weights: auto's choice follows each gate weight's
        # firing, as in training, where a weight sees about the same sparsity from one step to the next
        half_weights = [w.detach().clone().requires_grad_() for w in weights]
        # the row-major row's own weights too (its captures and choice are kept per gate weight), w_down laid out
        # as nn.Linear holds [K, N]
        row_weights = [w.detach().clone().requires_grad_() for w in weights[:2]]
        row_weights.append(weights[2].detach().contiguous().requires_grad_())
        dy = torch.randn(M, K, device=device, dtype=dtype)
        coefficient = torch.tensor(L1_COEFFICIENT, device=device)
        inputs = (x30, x_half, *weights, dy, coefficient, *half_weights, *row_weights)
        last.clear()
        last["inputs"] = inputs
        return inputs

    compiled = torch.compile(eager_ffn)
    last: dict[str, Any] = {}  # the latest inputs, and what each implementation's forward keeps on them (bytes)
    forwards = {
        "dense eager": lambda x30, xh, wg, wu, wd, *rest: eager_ffn(x30, wg, wu, wd),
        "torch.compile": lambda x30, xh, wg, wu, wd, *rest: compiled(x30, wg, wu, wd),
        "sparse nnz=30": lambda x30, xh, wg, wu, wd, *rest: hybrid_mlp(x30, wg, wu, wd, layout="auto").y,
        "eager nnz=30": lambda x30, xh, wg, wu, wd, *rest: hybrid_mlp(x30, wg, wu, wd, cuda_graph=False).y,
        "queued nnz=30": lambda x30, xh, wg, wu, wd, *rest: hybrid_mlp(x30, wg, wu, wd, cuda_graph=False).y,
        "graphed nnz=30": lambda x30, xh, wg, wu, wd, *rest: hybrid_mlp(x30, wg, wu, wd, cuda_graph=True).y,
        "ELL nnz=30": lambda x30, xh, wg, wu, wd, *rest: hybrid_mlp(x30, wg, wu, wd, layout="hybrid").y,
        "sparse nnz=half": lambda x30, xh, wg, wu, wd, dy, c, *h: hybrid_mlp(xh, *h[:3], layout="auto").y,
        "row-major nnz=30": lambda x30, xh, wg, wu, wd, dy, c, *h: hybrid_mlp(x30, *h[3:], layout="auto").y,
    }

    def kept_note(impl: str) -> str:
        for name in (impl, "dense eager"):  # each measured once per input set
            if name not in last:
                last[name] = _kept_bytes(forwards[name], last["inputs"])
        share = last[impl] / max(last["dense eager"], 1)
        return f"kept for backward {last[impl] / 2**20:.1f} MB ({share:.1%} of dense eager's)"

    impls = {
        "dense eager": lambda x30, xh, wg, wu, wd, dy, c, *h: _dense_step(eager_ffn, x30, wg, wu, wd, dy),
        "torch.compile": lambda x30, xh, wg, wu, wd, dy, c, *h: _dense_step(compiled, x30, wg, wu, wd, dy),
        "sparse nnz=30": lambda x30, xh, wg, wu, wd, dy, c, *h: _sparse_step(x30, wg, wu, wd, dy, c, "auto"),
        "eager nnz=30": lambda x30, xh, wg, wu, wd, dy, c, *h: _sparse_step(x30, wg, wu, wd, dy, c, "auto", False),
        "queued nnz=30": lambda x30, xh, wg, wu, wd, dy, c, *h: _sparse_step(x30, wg, wu, wd, dy, c, "auto", False),
        "graphed nnz=30": lambda x30, xh, wg, wu, wd, dy, c, *h: _sparse_step(x30, wg, wu, wd, dy, c, "auto", True),
        "ELL nnz=30": lambda x30, xh, wg, wu, wd, dy, c, *h: _sparse_step(x30, wg, wu, wd, dy, c, "hybrid"),
        "sparse nnz=half": lambda x30, xh, wg, wu, wd, dy, c, *h: _sparse_step(xh, *h[:3], dy, c, "auto"),
        "row-major nnz=30": lambda x30, xh, wg, wu, wd, dy, c, *h: _sparse_step(x30, *h[3:], dy, c, "auto"),
    }
    return Case(
        workload="ffn_train",
        shape=f"M={M} K={K} N={N}",
        dtype=dtype,
        direction="fwd+bwd",
        bytes_moved=0,
        flops=18 * M * K * N,
        ceiling="matmul",
        make_inputs=make_inputs,
        impls=impls,
        method="eager",
        rotate=False,
        host_ahead=frozenset({"queued nnz=30"}),
        eager_impl="dense eager",
        compile_impl="torch.compile",
        impl_note=kept_note if device != "cpu" else None,
    )


def _kept_bytes(forward, inputs: tuple[Any, ...]) -> int:
    """Bytes a forward leaves allocated past its output: what autograd keeps for the backward."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = forward(*inputs)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    del y
    return kept


@register(
    "ffn_train",
    "Gated FFN training step (forward + backward): sparsefuse hybrid_mlp vs dense eager and torch.compile",
    "tokens M, hidden K, intermediate N",
)
def ffn_train_cases(options: Options) -> list[Case]:
    dtype = torch.bfloat16 if torch.bfloat16 in options.dtypes else torch.float16
    shapes, ms = QUICK if options.quick else (SHAPES, M_VALUES)
    return [_case(K, N, M, dtype, options.device) for K, N in shapes for M in ms]


__all__ = ["ffn_train_cases"]
