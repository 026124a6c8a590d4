"""Lab workload ``ffn_products`` (``python -m benchmarks.lab bench ffn_products`` from the repository root): each
product of the block training step on its own, against its floor and against the dense product it replaces.

The step (:func:`sparsefuse.ffn.hybrid.hybrid_mlp`, ``layout="block"``) runs once on a synthetic layer (~30 gate
non-zeros per token, the paper's heavy tail) while its sparse-core calls are recorded; each row then replays one
product on the recorded arguments (CUDA-graph timed, input sets rotated past 2x L2). Shapes as ``ffn_train``: the
1.5B layer (K=2048, N=5632) and the 8B layer (K=4096, N=14336) at M=8192 tokens, bf16 (``--quick``: the 1.5B layer).

Rows per shape (shape label ``"M=.. K=.. N=.. <product>"``), each with ``block step`` (the product as the step runs
it) and ``dense`` (the cuBLAS product it replaces, on random operands of the dense shapes); "vs eager" is dense's
time over the step's:

* ``gate GEMM``     ``x W_g^T``: the one dense product, both rows the same call (the step's reference)
* ``up + stats``    :func:`~sparsefuse.sparse.block_sddmm`: ``x W_u^T`` on the 64-token groups' unions, relu'd
                    gate factors, L1 sum and firing counts -- dense: ``x W_u^T``
* ``down``          :func:`~sparsefuse.sparse.block_sparse_matmul`: ``h W_d^T`` over the unions -- dense: ``h W_d^T``
* ``dh``            :func:`~sparsefuse.sparse.block_ell_sddmm`: ``dy W_d`` sampled on the unions, with the chain
                    rule -- dense: ``dy W_d``
* ``dx``            two :func:`~sparsefuse.sparse.block_sparse_matmul` over the unions -- dense: two ``[M,N] [N,K]``
* ``weight grads``  :func:`~sparsefuse.sparse.transposed_matmul`: dW_g, dW_u, dW_d from the fired pairs -- dense:
                    three ``[N,M] [M,K]``

Floors: the union products' ``flops`` are ``2 S K`` per product (``S``: the union slots, rows x union width summed
over the groups), against the bf16 matmul rate measured in the run; the weight gradients' ``bytes_moved`` are one
gathered row of x and of dy per fired pair (``2 nnz K`` elements) plus the three [N, K] outputs, against the copy
bandwidth (the gathers mostly hit L2, so more than 100% is possible). The gate GEMM's are the dense ``2 M N K``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from sparsefuse.bench.check import WORKLOAD_FAMILIES
from sparsefuse.bench.harness import Case, Options, register
from sparsefuse.bench.workloads.ffn_train import QUICK, SHAPES
from sparsefuse.ffn.hybrid import block_step, hybrid_mlp
from sparsefuse.ffn.synthetic import synthetic_ffn

M_TOKENS = 8192
RECORDED = ("block_sddmm", "block_sparse_matmul", "block_ell_sddmm", "transposed_matmul")


def record_step(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, dy: torch.Tensor):
    """One block step's forward and backward on these operands, with every call it makes to the recorded sparse-core
    functions: {name: [(args, kwargs), ...]} in call order (``block_sparse_matmul``: the down product, then the
    two dx products)."""
    calls: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {name: [] for name in RECORDED}
    originals = {name: getattr(block_step, name) for name in RECORDED}

    def recorder(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name].append((args, kwargs))
            return originals[name](*args, **kwargs)

        return call

    try:
        for name in RECORDED:
            setattr(block_step, name, recorder(name))
        leaves = [t.detach().requires_grad_() for t in (x, w_gate, w_up, w_down)]
        out = hybrid_mlp(*leaves, layout="block")
        torch.autograd.grad((out.y, out.l1), leaves, (dy, torch.tensor(2e-5, device=x.device)))
    finally:
        for name, fn in originals.items():
            setattr(block_step, name, fn)
    return calls


def _replay(name: str, call: tuple[tuple[Any, ...], dict[str, Any]], **changed: Any) -> Any:
    """A recorded call to the step's function ``name`` again (``changed``: keyword arguments replaced)."""
    return getattr(block_step, name)(*call[0], **{**call[1], **changed})


def _dx(first: tuple[tuple[Any, ...], dict[str, Any]], second: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
    """The step's two dx products: the second accumulates into the first's fresh output."""
    dx = _replay("block_sparse_matmul", first)
    return _replay("block_sparse_matmul", second, accumulate=dx)


def _floors(calls) -> tuple[int, int]:
    """(S, nnz): union slots summed over the row groups, and fired pairs, of a recorded step (a host sync)."""
    product = calls["block_sparse_matmul"][0][0][0]  # the down product's BlockELL
    M, block_rows = product.values.shape[0], product.block_rows
    rows = torch.full_like(product.counts, block_rows)
    rows[-1] = M - block_rows * (product.counts.shape[0] - 1)
    slots = int((rows.long() * product.counts.long()).sum())
    nnz = int(calls["transposed_matmul"][0][0][0].offsets[-1])
    return slots, nnz


def _cases(K: int, N: int, M: int, dtype: torch.dtype, device: str) -> list[Case]:
    seeds = iter(range(1 << 30))

    def make_inputs() -> tuple[Any, ...]:
        ffn = synthetic_ffn(K, N, dtype=dtype, device=device, seed=next(seeds))
        x = ffn.make_input(M, 30.0)
        dy = torch.randn(M, K, device=device, dtype=dtype)
        calls = record_step(x, ffn.w_gate, ffn.w_up, ffn.w_down, dy)
        rand = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)  # noqa: E731
        dense = {"mn": rand(M, N), "mn2": rand(M, N), "mk": rand(M, K), "nk": rand(N, K), "nk2": rand(N, K)}
        return (x, ffn.w_gate, calls, dense)

    first = make_inputs()
    slots, nnz = _floors(first[2])
    union = 2 * slots * K  # flops of one product over the unions
    itemsize = torch.empty((), dtype=dtype).element_size()

    def step(name: str, index: int = 0) -> Callable[..., Any]:
        return lambda x, wg, calls, dense: _replay(name, calls[name][index])

    products: list[tuple[str, Callable[..., Any], Callable[..., Any], int, int, str]] = [
        ("gate GEMM", lambda x, wg, c, d: F.linear(x, wg), lambda x, wg, c, d: F.linear(x, wg), 2 * M * N * K, 0,
         "matmul"),
        ("up + stats", step("block_sddmm"), lambda x, wg, c, d: F.linear(x, d["nk"]), union, 0, "matmul"),
        ("down", step("block_sparse_matmul", 0), lambda x, wg, c, d: d["mn"] @ d["nk"], union, 0, "matmul"),
        ("dh", step("block_ell_sddmm"), lambda x, wg, c, d: d["mk"] @ d["nk"].t(), union, 0, "matmul"),
        ("dx", lambda x, wg, c, d: _dx(c["block_sparse_matmul"][1], c["block_sparse_matmul"][2]),
         lambda x, wg, c, d: torch.addmm(d["mn"] @ d["nk"], d["mn2"], d["nk2"]), 2 * union, 0, "matmul"),
        ("weight grads", step("transposed_matmul"),
         lambda x, wg, c, d: (d["mn"].t() @ d["mk"], d["mn2"].t() @ d["mk"], d["mn"].t() @ x),
         6 * nnz * K, (2 * nnz * K + 3 * N * K) * itemsize, "copy"),
    ]  # fmt: skip
    inputs = iter([first])

    def fresh() -> tuple[Any, ...]:
        return next(inputs, None) or make_inputs()

    return [
        Case(
            workload="ffn_products",
            shape=f"M={M} K={K} N={N} {name}",
            dtype=dtype,
            direction="fwd+bwd",
            bytes_moved=bytes_moved,
            flops=flops,
            ceiling=ceiling,
            make_inputs=fresh,
            impls={"block step": sparse, "dense": dense},
            eager_impl="dense",
            compile_impl=None,
        )
        for name, sparse, dense, flops, bytes_moved, ceiling in products
    ]


@register(
    "ffn_products",
    "Block training step of the gated FFN, product by product: sparsefuse vs the dense product it replaces",
    "tokens M, hidden K, intermediate N, product",
)
def ffn_products_cases(options: Options) -> list[Case]:
    dtype = torch.bfloat16 if torch.bfloat16 in options.dtypes else torch.float16
    shapes = QUICK[0] if options.quick else SHAPES
    return [case for K, N in shapes for case in _cases(K, N, M_TOKENS, dtype, options.device)]


WORKLOAD_FAMILIES["ffn_products"] = ("ffn_train",)  # without a GPU, bench checks the training step's ops instead


__all__ = ["ffn_products_cases", "record_step"]
