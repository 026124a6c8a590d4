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
  ``validate=True`` instead raises ``ValueError`` naming the largest count (one sync).
* ``"exact"`` -- compact into exact-size CSR (one sync to size it), gather-accumulate.
* ``"dense"`` -- ``torch.matmul`` (cuBLAS).
* ``"auto"`` -- ``"dense"`` for small dictionaries (d_sae < 4096); otherwise the fastest of ``"scan"``, ``"fixed"``
  and cuBLAS by a cost model fitted to the H200 benchmark (benchmarks/results/), a sparse method only when predicted
  at least 10% faster than cuBLAS at the activations' mean L0:
  scan ~ rows x (d_sae bytes / row rate + L0 x d_model bytes / gather rate);
  fixed ~ 3 launches + rows x (d_sae bytes / bitmask rate + d_sae / 8 bytes / word rate + L0 x d_model bytes /
  gather rate), or one program's serial walk over a row when that is longer (few rows, large L0) -- the scan
  wins small batches, the two-pass "fixed" large ones (from ~64-256 rows);
  dense ~ the hypotenuse of flops / matmul rate and W_dec bytes / 3.3 TB/s. The mean L0 is, first available:
  ``expected_l0``; the running estimate kept per decoder (a :class:`~sparsefuse.sparse.SparsityMonitor` per
  ``W_dec`` tensor, fed without a sync every 8th eager call from up to 64 sampled rows); on the first eager call
  with a new ``W_dec``, a count of those rows (the one host sync). Under CUDA-graph capture the estimate from the
  warm-up calls decides; under torch.compile tracing, without ``expected_l0``, SAE-like sparsity (L0 = d_sae / 1024)
  is assumed. When auto picks ``"fixed"`` without a ``max_l0``, the width is 4x the mean L0 (at least 256): tokens
  past it are still decoded exactly, from their dense rows, just more slowly.

Backward, without a host sync: the gradient for W_dec is ``feature_acts^T @ grad_out`` computed by the same
skip-zeros kernel on the transposed activations (d_sae rows fill the GPU, so no split and no float atomics, unless
d_sae < 4 rows per SM); the gradient for the activations is the sampled product ``grad_out[m] . W_dec[f]`` on the
activations' own sparsity pattern (zero elsewhere) -- the gradient a thresholded activation (JumpReLU, TopK) passes
on.
"""

from __future__ import annotations

import math

import torch
import triton
from torch.utils.weak import WeakIdKeyDictionary

from .._validation import check_float, check_same_device, describe
from ..sparse import ELL, dense_to_csr, dense_to_ell, matmul_skip_zeros, sparse_matmul
from .._auto import SparsityMonitor, sampled_nonzero_stats
from ..sparse.sddmm import sampled_dot_dense_pattern

METHODS = ("auto", "scan", "fixed", "exact", "dense")
DEFAULT_MAX_L0 = 256
AUTO_DENSE_BELOW_D_SAE = 4096
AUTO_SAMPLE_ROWS = 64  # rows whose non-zeros are counted for the estimate
AUTO_OBSERVE_EVERY = 8  # eager calls per (sync-free) observation
AUTO_MARGIN = 0.9  # a sparse method must be predicted this much faster: the model's error on the grid is ~10%
# Cost model of "auto", least-squares fits to the H200 sae_decode benchmark (main shapes, L0 and batch sweeps):
# effective rates in bytes/s per activation element size (fp32 rows are scanned with fewer, wider loads), flop/s.
# The ratios, not the absolute values, decide, so they carry over to other GPUs roughly.
_SCAN_ROW_RATE = {4: 1.6e12, 2: 1.5e12}
_SCAN_GATHER_RATE = {4: 2.6e12, 2: 2.0e12}
# "fixed": the bitmask pass streams the activations near copy speed; the bits -> ELL pass is latency-bound (its
# rate per bitmask byte is low); the ELL gather moves gathered W_dec bytes at about DRAM rate (some L2 reuse)
# (benchmarks/results/probe-decode-bits-NVIDIA-H200.log).
_FIXED_BITS_RATE = 4.0e12
_FIXED_WORDS_RATE = 0.7e12
_FIXED_GATHER_RATE = {4: 4.6e12, 2: 4.4e12}
# With few rows the ELL path is bound by one program's serial chain, not by bytes: the gather walks a row's entries
# 16 at a time and the bits -> ELL pass a row's bitmask 1024 words at a time (B=32, D=768, L0=1024: 78 us against
# cuBLAS's 31, where the byte terms alone predict 28)
_FIXED_GATHER_STEP_S = 0.7e-6
_FIXED_WORDS_CHUNK_S = 2e-6
_DENSE_WEIGHT_RATE = 3.3e12
_DENSE_FLOP_RATE = {torch.float32: 50e12, torch.float16: 800e12, torch.bfloat16: 800e12}
_LAUNCH_S = 5e-6
AUTO_WIDTH_PER_L0 = 4  # auto's "fixed" width: this many times the mean L0, at least DEFAULT_MAX_L0
_MONITORS = WeakIdKeyDictionary()  # W_dec -> [SparsityMonitor, calls]: dies with the decoder


def torch_sparse_decode(feature_acts: torch.Tensor, W_dec: torch.Tensor) -> torch.Tensor:
    """Reference: the dense product in float64."""
    return feature_acts.double() @ W_dec.double()


def _predicted_seconds(M: int, d_sae: int, d_model: int, mean_l0: float, acts_dtype: torch.dtype,
                       w_dtype: torch.dtype) -> dict[str, float]:  # fmt: skip
    """The cost model of ``method="auto"`` (see module docstring): predicted seconds per method."""
    e_a, e_w = acts_dtype.itemsize, w_dtype.itemsize
    gathered = mean_l0 * d_model * e_w  # W_dec bytes per row
    scan = _LAUNCH_S + M * (d_sae * e_a / _SCAN_ROW_RATE.get(e_a, 1.5e12)
                            + gathered / _SCAN_GATHER_RATE.get(e_a, 2.0e12))  # fmt: skip
    fixed = 3 * _LAUNCH_S + max(M * (d_sae * e_a / _FIXED_BITS_RATE + d_sae / 8 / _FIXED_WORDS_RATE
                                     + gathered / _FIXED_GATHER_RATE.get(e_w, 4.4e12)),
                                mean_l0 / 16 * _FIXED_GATHER_STEP_S + math.ceil(d_sae / 32768) * _FIXED_WORDS_CHUNK_S)
    compute = torch.promote_types(acts_dtype, w_dtype)
    # cuBLAS reaches neither bound where both are close (B=256, d_model=768: 45 us against 32 and 31): their sum
    # in quadrature
    dense = _LAUNCH_S + math.hypot(2 * M * d_sae * d_model / _DENSE_FLOP_RATE.get(compute, 50e12),
                                   d_sae * d_model * compute.itemsize / _DENSE_WEIGHT_RATE)  # fmt: skip
    return {"scan": scan, "fixed": fixed, "dense": dense}


def _fastest_method(M: int, d_sae: int, d_model: int, mean_l0: float, acts_dtype: torch.dtype,
                    w_dtype: torch.dtype) -> str:  # fmt: skip
    """auto's pick: the faster sparse method if predicted at least 1 - AUTO_MARGIN faster than cuBLAS, else dense."""
    t = _predicted_seconds(M, d_sae, d_model, mean_l0, acts_dtype, w_dtype)
    sparse = min(("scan", "fixed"), key=t.__getitem__)
    return sparse if t[sparse] <= AUTO_MARGIN * t["dense"] else "dense"


def _auto_width(mean_l0: float, d_sae: int) -> int:
    return min(d_sae, max(DEFAULT_MAX_L0, triton.next_power_of_2(max(1, math.ceil(AUTO_WIDTH_PER_L0 * mean_l0)))))


def _observable(t: torch.Tensor) -> bool:
    """Whether the activations' values may be looked at (not under torch.compile tracing, fake tensors or CUDA-graph
    capture)."""
    return not (torch.compiler.is_compiling() or type(t) not in (torch.Tensor, torch.nn.Parameter)
                or (t.is_cuda and torch.cuda.is_current_stream_capturing()))  # fmt: skip


def _estimated_l0(acts: torch.Tensor, W_dec: torch.Tensor) -> float | None:
    """Mean L0 from the decoder's monitor, fed by this call when it is eager (see module docstring); None when
    nothing is known (compile tracing, or a capture without a warm-up call)."""
    if torch.compiler.is_compiling() or type(W_dec) not in (torch.Tensor, torch.nn.Parameter):
        return None
    entry = _MONITORS.get(W_dec)
    observable = _observable(acts) and acts.shape[0] > 0
    if entry is None:
        if not observable:
            return None
        monitor = SparsityMonitor()
        monitor.update(*(float(v) for v in sampled_nonzero_stats(acts, AUTO_SAMPLE_ROWS).tolist()))  # the sync
        _MONITORS[W_dec] = [monitor, 0]
        return monitor.mean_nnz
    monitor = entry[0]
    estimate = monitor.estimate()
    if observable:
        entry[1] += 1
        if entry[1] % AUTO_OBSERVE_EVERY == 0 and monitor.accepts:
            monitor.observe(sampled_nonzero_stats(acts, AUTO_SAMPLE_ROWS))
    return estimate


def _resolve(method: str, acts: torch.Tensor, W_dec: torch.Tensor, max_l0: int | None,
             expected_l0: float | None) -> tuple[str, int]:  # fmt: skip
    (M, d_sae), d_model = acts.shape, W_dec.shape[1]
    width = max_l0 if max_l0 is not None else min(DEFAULT_MAX_L0, d_sae)
    if method == "auto":
        if d_sae < AUTO_DENSE_BELOW_D_SAE:
            method = "dense"
        else:
            mean_l0 = expected_l0 if expected_l0 is not None else _estimated_l0(acts, W_dec)
            if mean_l0 is None:
                mean_l0 = d_sae / 1024  # SAE-like sparsity, assumed where nothing was observed
            method = _fastest_method(M, d_sae, d_model, mean_l0, acts.dtype, W_dec.dtype)
            if max_l0 is None:
                width = _auto_width(mean_l0, d_sae)
    return method, width


def _decode_forward(acts: torch.Tensor, W_dec: torch.Tensor, method: str, max_l0: int, validate: bool,
                    out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    # acts [M, d_sae] -> [M, d_model]
    if method == "scan":
        return matmul_skip_zeros(acts, W_dec, out_dtype=out_dtype)
    if method == "exact":
        return sparse_matmul(dense_to_csr(acts), W_dec, out_dtype=out_dtype)
    if method == "dense":
        compute = torch.promote_types(acts.dtype, W_dec.dtype)
        return (acts.to(compute) @ W_dec.to(compute)).to(out_dtype)
    ell = dense_to_ell(acts, max_l0)
    if validate and acts.shape[0]:
        largest = int(ell.counts.max())
        if largest > max_l0:
            raise ValueError(f"sparse_decode: a token fired {largest} features but max_l0={max_l0}; raise max_l0 "
                             "or use validate=False (overflowing tokens are then decoded from their dense rows)")
    return sparse_matmul(ell, W_dec, dense=acts, out_dtype=out_dtype)


@torch.library.custom_op("sparsefuse::sparse_decode", mutates_args=())
def sparse_decode_op(feature_acts: torch.Tensor, W_dec: torch.Tensor, method: str, max_l0: int, validate: bool,
                     out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    return _decode_forward(feature_acts, W_dec, method, max_l0, validate, out_dtype)


@sparse_decode_op.register_fake
def _(feature_acts, W_dec, method, max_l0, validate, out_dtype):
    return feature_acts.new_empty((feature_acts.shape[0], W_dec.shape[1]), dtype=out_dtype)


@torch.library.custom_op("sparsefuse::sparse_decode_backward", mutates_args=())
def sparse_decode_backward_op(grad_out: torch.Tensor, feature_acts: torch.Tensor, W_dec: torch.Tensor,
                              need_acts: bool, need_weight: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    # grad_acts [M, d_sae] on the activations' pattern; grad_weight [d_sae, d_model] = acts^T @ grad_out, whose
    # rows are non-zero only for features that fired: the skip-zeros kernel over acts^T (a strided view, no copy).
    grad_acts = (sampled_dot_dense_pattern(feature_acts, grad_out, W_dec) if need_acts
                 else feature_acts.new_zeros(0))  # fmt: skip
    grad_weight = (matmul_skip_zeros(feature_acts.t(), grad_out, out_dtype=W_dec.dtype) if need_weight
                   else W_dec.new_zeros(0))  # fmt: skip
    return grad_acts, grad_weight


@sparse_decode_backward_op.register_fake
def _(grad_out, feature_acts, W_dec, need_acts, need_weight):
    return (feature_acts.new_empty(feature_acts.shape if need_acts else (0,)),
            W_dec.new_empty(W_dec.shape if need_weight else (0,)))  # fmt: skip


def _decode_setup(ctx, inputs, output) -> None:
    feature_acts, W_dec = inputs[0], inputs[1]
    ctx.save_for_backward(feature_acts, W_dec)


def _decode_backward(ctx, grad_out):
    feature_acts, W_dec = ctx.saved_tensors
    need_acts, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_acts, grad_weight = sparse_decode_backward_op(grad_out, feature_acts, W_dec, need_acts, need_weight)
    return (grad_acts if need_acts else None), (grad_weight if need_weight else None), None, None, None, None


sparse_decode_op.register_autograd(_decode_backward, setup_context=_decode_setup)


def sparse_decode(feature_acts: torch.Tensor, W_dec: torch.Tensor, *, method: str = "auto",
                  max_l0: int | None = None, validate: bool = False,
                  out_dtype: torch.dtype | None = None, expected_l0: float | None = None) -> torch.Tensor:  # fmt: skip
    """Drop-in for ``feature_acts @ W_dec`` that skips features that did not fire (see module docstring).

    Args:
        feature_acts: [..., d_sae], float32/float16/bfloat16, mostly zeros.
        W_dec: [d_sae, d_model], float32/float16/bfloat16, same device.
        method: "auto", "scan", "fixed", "exact" or "dense" (see module docstring).
        max_l0: slots per token for "fixed" (default 256, capped at d_sae; when "auto" picks "fixed", 4x the mean
            L0, at least 256).
        validate: "fixed" raises ValueError if a token fired more than max_l0 features (one host sync).
        out_dtype: defaults to ``torch.result_type(feature_acts, W_dec)``.
        expected_l0: for "auto", the mean number of features that fire per token, if known (e.g. under
            torch.compile, where nothing is observed); otherwise it is estimated (see module docstring).
    Returns: [..., d_model]. Accumulation is in float32.
    """
    op = "sparse_decode"
    check_float(op, "feature_acts", feature_acts)
    check_float(op, "W_dec", W_dec)
    check_same_device(op, feature_acts=feature_acts, W_dec=W_dec)
    if W_dec.dim() != 2 or feature_acts.dim() < 1 or feature_acts.shape[-1] != W_dec.shape[0]:
        raise ValueError(f"{op}: feature_acts [..., d_sae] and W_dec [d_sae, d_model] disagree on d_sae: "
                         f"feature_acts {describe(feature_acts)}, W_dec {describe(W_dec)}")  # fmt: skip
    if method not in METHODS:
        raise ValueError(f"{op}: method must be one of {', '.join(METHODS)}; got {method!r}")
    if max_l0 is not None and (not isinstance(max_l0, int) or isinstance(max_l0, bool) or max_l0 <= 0):
        raise ValueError(f"{op}: max_l0 must be a positive int; got {max_l0!r}")
    if expected_l0 is not None and (isinstance(expected_l0, bool) or not isinstance(expected_l0, (int, float))
                                    or not expected_l0 >= 0):  # fmt: skip
        raise ValueError(f"{op}: expected_l0 must be a non-negative number; got {expected_l0!r}")
    out_dtype = out_dtype or torch.promote_types(feature_acts.dtype, W_dec.dtype)  # (result_type: not traceable)
    acts = feature_acts.reshape(-1, feature_acts.shape[-1])
    method, max_l0 = _resolve(method, acts, W_dec, max_l0, expected_l0)
    out = sparse_decode_op(acts, W_dec, method, max_l0, bool(validate), out_dtype)
    return out.reshape(*feature_acts.shape[:-1], W_dec.shape[1])


def topk_decode(top_indices: torch.Tensor, top_acts: torch.Tensor, W_dec: torch.Tensor, *,
                check_indices: bool = True) -> torch.Tensor:  # fmt: skip
    """TopK SAE decode: ``sum_j top_acts[..., j] * W_dec[top_indices[..., j]]`` -> [..., d_model].

    top_indices: [..., k] integer feature ids in [0, d_sae); top_acts: [..., k] floating. Forward only for now.
    Indices are range-checked (one host sync) -- an out-of-range id would read outside W_dec; pass
    ``check_indices=False`` for ids that are in range by construction (``topk_encode``'s), e.g. inside a CUDA graph."""
    op = "topk_decode"
    check_float(op, "top_acts", top_acts)
    check_float(op, "W_dec", W_dec)
    if top_indices.dtype not in (torch.int32, torch.int64) or top_indices.shape != top_acts.shape:
        raise TypeError(f"{op}: top_indices must be int32/int64 with top_acts' shape {list(top_acts.shape)}; got "
                        f"{describe(top_indices)}")  # fmt: skip
    check_same_device(op, top_acts=top_acts, top_indices=top_indices, W_dec=W_dec)
    d_sae = W_dec.shape[0]
    if check_indices and top_indices.numel() and (int(top_indices.min()) < 0 or int(top_indices.max()) >= d_sae):
        raise ValueError(f"{op}: top_indices must lie in [0, {d_sae}); got range [{int(top_indices.min())}, "
                         f"{int(top_indices.max())}]")  # fmt: skip
    k = top_acts.shape[-1]
    values = top_acts.reshape(-1, k)
    M = values.shape[0]
    ell = ELL(values.contiguous(), top_indices.reshape(-1, k).to(torch.int32).contiguous(),
              torch.full((M,), k, dtype=torch.int32, device=values.device), d_sae)  # fmt: skip
    out = sparse_matmul(ell, W_dec, out_dtype=torch.promote_types(top_acts.dtype, W_dec.dtype))
    return out.reshape(*top_acts.shape[:-1], W_dec.shape[1])
