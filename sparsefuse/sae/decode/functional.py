"""Sparse SAE decode: ``feature_acts @ W_dec`` touching only the decoder rows of features that fired.

    feature_acts [..., d_sae] (mostly zeros), W_dec [d_sae, d_model] -> [..., d_model]

Methods (all built on the shared core in :mod:`sparsefuse.sparse`):
* ``"scan"`` -- one kernel straight from the dense activations: each token's row is scanned for non-zeros and only
  their decoder rows are gathered (:func:`~sparsefuse.sparse.matmul_skip_zeros`). No format, no capacity to
  overflow, no host sync. Small batches split a row over programs whose sums are added by fp32 atomics, or in a
  fixed order under ``torch.use_deterministic_algorithms(True)``.
* ``"fixed"`` -- compact into ELL of width ``max_l0`` (no host sync: a bitmask pass over the activations, then
  the bits are placed), gather-accumulate; a token that fired more than ``max_l0`` features is recomputed from its
  dense row on the device, so the result is always complete.
  ``validate=True`` instead raises ``ValueError`` naming the largest count (one sync). An explicit
  ``method="fixed"`` always runs these two passes; with few tokens the scan is often faster (on an H200 at 32
  tokens the two passes took 0.9-1.35x the scan's time in bf16 and 1.5-2.1x in fp32; at 256 tokens 0.61x at a
  constant L0 in bf16, 0.85x in fp32), which ``"auto"`` weighs for you.
* ``"exact"`` -- compact into exact-size CSR (one sync to size it), gather-accumulate.
* ``"dense"`` -- ``torch.matmul`` (cuBLAS).
* ``"auto"`` -- ``"dense"`` for small dictionaries, else the fastest of the others by a cost model at the
  activations' mean L0, estimated without host syncs after the first call per decoder (:mod:`.auto`). A plain
  eager call counts each method's host time too, so a Python loop of a few tokens gets cuBLAS, where the same call
  captured in a CUDA graph or compiled gets the sparse kernels.

In ``"scan"``, ``"fixed"`` and ``"exact"`` a token far denser than the rest (past 1 in 64 features: one that fires
every feature) is not walked by one program: the first launch lists it on the device and a second spreads it over
the GPU, without a host sync (:mod:`sparsefuse.sparse.long_rows`).

Every method, the torch fallback of CPU tensors included, sums over the features that fired: **a feature that did
not fire contributes exactly zero, whatever its decoder row holds** (a NaN or inf row of a dead feature included,
where ``feature_acts @ W_dec`` gives ``0 * NaN = NaN``), as ``topk_decode`` and ``torch.sparse.mm`` do; a fired
feature's non-finite row, or a NaN / inf activation, propagates as in the float64 product
(:func:`~.reference.torch_sparse_decode`). The gathers never read an unfired feature's row; the products that read
every row -- cuBLAS's (``"dense"``), the scan's tensor-core sums of near-full tokens
(:mod:`sparsefuse.sparse.dense_units`) -- sum again, over the non-zero activations, what came out NaN or infinite,
on the device (for ``"dense"`` :mod:`sparsefuse.sparse.nonfinite_rows`: where every element is finite, one read of
the output in one launch).

Backward, without a host sync (:mod:`.op`): W_dec's gradient is ``feature_acts^T @ grad_out`` (torch's); the
activations' is, with ``acts_grad="sparse"`` (default), ``grad_out @ W_dec^T`` on the activations' sparsity pattern
and zero elsewhere -- the gradient a JumpReLU / TopK activation passes on anyway, what training needs -- or, with
``acts_grad="full"``, all of ``grad_out @ W_dec^T``, torch's gradient of ``feature_acts @ W_dec`` whichever method
ran: attribution patching and straight-through estimators need it for the features that did not fire.
"""

from __future__ import annotations

import torch

from ... import _backend
from ..._validation import autocast_operands, check_index_range, check_sparse_decode, check_topk_decode, flat_rows
from . import auto
from .op import ACTS_GRADS, decode_forward, sparse_decode_op, topk_decode_forward, topk_decode_op

METHODS = ("auto", "scan", "fixed", "exact", "dense")


def sparse_decode(
    feature_acts: torch.Tensor,
    W_dec: torch.Tensor,
    *,
    method: str = "auto",
    max_l0: int | None = None,
    validate: bool = False,
    out_dtype: torch.dtype | None = None,
    expected_l0: float | None = None,
    acts_grad: str = "sparse",
) -> torch.Tensor:
    """Drop-in for ``feature_acts @ W_dec`` that skips features that did not fire (see module docstring).

    Args:
        feature_acts: [..., d_sae], float32/float16/bfloat16, mostly zeros.
        W_dec: [d_sae, d_model], float32/float16/bfloat16, same device.
        method: "auto", "scan", "fixed", "exact" or "dense" (see module docstring).
        max_l0: slots per token for "fixed" (default 256, capped at d_sae; when "auto" picks "fixed", 4x the mean
            L0, at least 256).
        validate: "fixed" raises ValueError if a token fired more than max_l0 features (one host sync: a graph
            break under torch.compile).
        out_dtype: defaults to ``torch.result_type(feature_acts, W_dec)``.
        expected_l0: for "auto", the mean number of features that fire per token, if known (e.g. under
            torch.compile, where nothing is observed); otherwise it is estimated (see :mod:`.auto`).
        acts_grad: feature_acts' gradient: "sparse" (default) ``grad_out @ W_dec^T`` on the activations' non-zeros,
            zero elsewhere; "full" all of it, as torch gives it for ``feature_acts @ W_dec`` (attribution
            patching, straight-through estimators). W_dec's gradient is ``feature_acts^T @ grad_out`` either way.
    Returns: [..., d_model], summed over the features that fired (an unfired feature's decoder row, NaN or not,
    contributes zero). Accumulation is in float32.

    Dtypes follow ``feature_acts @ W_dec``: one dtype (a mix raises TypeError), or under ``torch.autocast`` both
    taken in the autocast dtype.
    """
    decoder = W_dec  # auto's estimate is kept per decoder: under autocast W_dec is a new cast copy every call
    feature_acts, W_dec = autocast_operands(feature_acts, W_dec)
    check_sparse_decode("sparse_decode", feature_acts, W_dec, method, METHODS, max_l0, expected_l0)
    if acts_grad not in ACTS_GRADS:
        raise ValueError(f"sparse_decode: acts_grad must be one of {', '.join(ACTS_GRADS)}; got {acts_grad!r}")
    out_dtype = out_dtype or torch.promote_types(feature_acts.dtype, W_dec.dtype)  # (result_type: not traceable)
    acts = flat_rows(feature_acts)
    given_width = max_l0
    method, max_l0 = auto.resolve_method(
        method,
        acts,
        W_dec,
        max_l0,
        expected_l0,
        decoder,
        warm_up=lambda m, width: decode_forward(acts, W_dec, m, width, False, out_dtype),
    )
    if method == "auto":  # traced by torch.compile: the op decides when the graph runs (0: auto's width)
        max_l0 = given_width or 0
    if method != "auto" and _backend.bypass_dispatcher(acts, W_dec):  # a plain eager call: the dispatch is host time
        out = decode_forward(acts, W_dec, method, max_l0, bool(validate), out_dtype)
    else:
        out = sparse_decode_op(acts, W_dec, method, max_l0, bool(validate), out_dtype, acts_grad)
    return out.reshape(*feature_acts.shape[:-1], W_dec.shape[1])


def topk_decode(
    top_indices: torch.Tensor, top_acts: torch.Tensor, W_dec: torch.Tensor, *, check_indices: bool = True
) -> torch.Tensor:
    """TopK SAE decode: ``sum_j top_acts[..., j] * W_dec[top_indices[..., j]]`` -> [..., d_model] (top_acts and
    W_dec of one dtype, or under ``torch.autocast``, as for :func:`sparse_decode`).

    top_indices: [..., k] integer feature ids in [0, d_sae); top_acts: [..., k] floating. Differentiable in top_acts
    and W_dec, without a host sync: ``grad_acts[..., j] = grad_out . W_dec[id]`` (one decoder row read per entry)
    and W_dec's gradient row by row over the tokens that picked each feature (no dense [tokens, d_sae] tensor; a
    feature that many tokens picked is spread over the GPU). Indices are range-checked (one host sync) -- an
    out-of-range id would read outside W_dec; pass ``check_indices=False`` for ids that are in range by construction
    (``topk_encode``'s), e.g. inside a CUDA graph or under ``torch.compile(fullgraph=True)`` (the check's read-back
    is a graph break)."""
    op = "topk_decode"
    top_acts, W_dec = autocast_operands(top_acts, W_dec)
    check_topk_decode(op, top_indices, top_acts, W_dec)
    if check_indices:
        check_index_range(op, top_indices, W_dec.shape[0])
    values = flat_rows(top_acts).contiguous()
    indices = flat_rows(top_indices).to(torch.int32).contiguous()
    out_dtype = torch.promote_types(top_acts.dtype, W_dec.dtype)
    if _backend.bypass_dispatcher(values, W_dec):  # no autograd, tracing or mode: the op's dispatch adds host time
        out = topk_decode_forward(indices, values, W_dec, out_dtype)
    else:
        out = topk_decode_op(indices, values, W_dec, out_dtype)
    return out.reshape(*top_acts.shape[:-1], W_dec.shape[1])
