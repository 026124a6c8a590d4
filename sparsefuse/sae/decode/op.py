"""``sparsefuse::sparse_decode``, ``sparsefuse::topk_decode`` and their backwards as custom ops (fake impls,
autograd). Each method is a call of the shared sparse core (:mod:`sparsefuse.sparse`): the decode has no kernels of
its own.

Every method sums over the features that fired: cuBLAS's product (``"dense"``) has the elements it made NaN or
infinite recomputed over their rows' non-zero activations on the device (:mod:`sparsefuse.sparse.nonfinite_rows`),
so that a decoder row of NaN contributes nothing to a token that did not fire its feature, as in the sparse methods.

Backward, without a host sync: the gradient for W_dec is ``feature_acts^T @ grad_out`` computed by the same
skip-zeros kernel on the transposed activations (d_sae rows fill the GPU, so no split and no float atomics, unless
d_sae < 4 rows per SM; a feature that fired for many of the tokens is spread by the long-row pass and summed in a
fixed order) -- torch's gradient, whose rows for features that never fired are zero. The gradient for the
activations is, with ``acts_grad="sparse"``, the sampled product ``grad_out[m] . W_dec[f]`` on the activations' own
sparsity pattern (zero elsewhere) -- the gradient a thresholded activation (JumpReLU, TopK) passes on; with
``acts_grad="full"``, torch's ``grad_out @ W_dec^T`` by cuBLAS (attribution patching, straight-through estimators).
"""

from __future__ import annotations

import torch

from ... import _backend
from ..._backend import Backend, backend_for, on_tensor_device
from ...sparse import CSR, ELL, dense_to_csr, dense_to_ell, matmul_skip_zeros, sparse_matmul
from ...sparse.nonfinite_rows import complete_nonfinite_rows
from ...sparse.sddmm import sampled_dot_dense_pattern, sampled_dot_rows
from .auto import PLANNER, resolve_method
from .reference import torch_sparse_decode

ACTS_GRADS = ("sparse", "full")


def decode_forward(
    acts: torch.Tensor, W_dec: torch.Tensor, method: str, max_l0: int, validate: bool, out_dtype: torch.dtype
) -> torch.Tensor:
    """The op's forward, also called directly for a plain eager call: acts [M, d_sae] -> [M, d_model]. ``"auto"``
    (from a graph compiled without ``expected_l0``; ``max_l0`` 0 for auto's width) is decided here, with real
    tensors, as the planner decides an eager call or a capture."""
    if method == "auto":
        method, max_l0 = resolve_method("auto", acts, W_dec, max_l0 or None, None, at_run_time=True)
    if backend_for(acts, W_dec) is Backend.TORCH:
        # the dense products of the core's torch paths would turn a zero activation of a NaN row into NaN
        if method == "fixed" and validate:
            _check_capacity((acts != 0).sum(1), max_l0)
        _backend.warn_reference_once("sparse_decode")
        return torch_sparse_decode(acts, W_dec).to(out_dtype)
    if method == "scan":
        return matmul_skip_zeros(acts, W_dec, out_dtype=out_dtype)
    if method == "exact":
        return sparse_matmul(dense_to_csr(acts), W_dec, out_dtype=out_dtype, spread_long_rows=True)
    if method == "dense":
        return complete_nonfinite_rows(_dense_product(acts, W_dec, out_dtype), acts, W_dec)
    ell = dense_to_ell(acts, max_l0)
    if validate:
        _check_capacity(ell.counts, max_l0)
    return sparse_matmul(ell, W_dec, dense=acts, out_dtype=out_dtype, spread_long_rows=True)


def _check_capacity(counts: torch.Tensor, max_l0: int) -> None:
    """``validate=True`` of "fixed": ValueError naming the largest count past ``max_l0`` (one host sync)."""
    largest = int(counts.max()) if counts.numel() else 0
    if largest > max_l0:
        raise ValueError(
            f"sparse_decode: a token fired {largest} features but max_l0={max_l0}; raise max_l0 "
            "or use validate=False (overflowing tokens are then decoded from their dense rows)"
        )


def _dense_product(acts: torch.Tensor, W_dec: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``acts @ W_dec`` in ``out_dtype`` with the sparse methods' accuracy: accumulated in fp32 and rounded once to
    ``out_dtype`` -- not a 16-bit product widened afterwards when fp32 is asked of 16-bit inputs. There cuBLAS
    writes fp32 directly where torch offers it (``mm`` with ``out_dtype``); otherwise the operands are widened
    (16-bit values are exact in fp32, and in TF32 too)."""
    compute = torch.promote_types(acts.dtype, W_dec.dtype)
    if out_dtype.itemsize <= compute.itemsize:
        return (acts.to(compute) @ W_dec.to(compute)).to(out_dtype)
    if acts.is_cuda and hasattr(torch.ops.aten.mm, "dtype") and compute in (torch.float16, torch.bfloat16):
        try:
            return torch.mm(acts.to(compute), W_dec.to(compute), out_dtype=torch.float32).to(out_dtype)
        except (RuntimeError, TypeError):  # a build without that kernel: widen instead
            pass
    return (acts.to(torch.float32) @ W_dec.to(torch.float32)).to(out_dtype)


@torch.library.custom_op("sparsefuse::sparse_decode", mutates_args=())
@on_tensor_device
def sparse_decode_op(
    feature_acts: torch.Tensor,
    W_dec: torch.Tensor,
    method: str,
    max_l0: int,
    validate: bool,
    out_dtype: torch.dtype,
    acts_grad: str = "sparse",
) -> torch.Tensor:
    # acts_grad: the backward's gradient for feature_acts (module docstring); the forward is the same either way
    return decode_forward(feature_acts, W_dec, method, max_l0, validate, out_dtype)


@sparse_decode_op.register_fake
def _(feature_acts, W_dec, method, max_l0, validate, out_dtype, acts_grad="sparse"):
    return feature_acts.new_empty((feature_acts.shape[0], W_dec.shape[1]), dtype=out_dtype)


@torch.library.custom_op("sparsefuse::sparse_decode_backward", mutates_args=())
@on_tensor_device
def sparse_decode_backward_op(
    grad_out: torch.Tensor,
    feature_acts: torch.Tensor,
    W_dec: torch.Tensor,
    need_acts: bool,
    need_weight: bool,
    acts_grad: str = "sparse",
) -> tuple[torch.Tensor, torch.Tensor]:
    # grad_acts [M, d_sae]: on the activations' pattern, or in full (torch's gradient: one dense product, the
    # sampled product's kernel not run); grad_weight [d_sae, d_model] = acts^T @ grad_out, whose rows are non-zero
    # only for features that fired: the skip-zeros kernel over acts^T (a strided view, no copy).
    grad_acts = feature_acts.new_zeros(0)
    if need_acts and acts_grad == "full":
        grad_acts = _dense_product(grad_out, W_dec.t(), feature_acts.dtype)
    elif need_acts:
        grad_acts = sampled_dot_dense_pattern(feature_acts, grad_out, W_dec)
    grad_weight = (
        matmul_skip_zeros(feature_acts.t(), grad_out, out_dtype=W_dec.dtype) if need_weight else W_dec.new_zeros(0)
    )
    return grad_acts, grad_weight


@sparse_decode_backward_op.register_fake
def _(grad_out, feature_acts, W_dec, need_acts, need_weight, acts_grad="sparse"):
    return (
        feature_acts.new_empty(feature_acts.shape if need_acts else (0,)),
        W_dec.new_empty(W_dec.shape if need_weight else (0,)),
    )


def _decode_setup(ctx, inputs, output) -> None:
    feature_acts, W_dec = inputs[0], inputs[1]
    ctx.acts_grad = inputs[6] if len(inputs) > 6 else "sparse"
    ctx.save_for_backward(feature_acts, W_dec)


def _decode_backward(ctx, grad_out):
    feature_acts, W_dec = ctx.saved_tensors
    need_acts, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_acts, grad_weight = sparse_decode_backward_op(
        grad_out, feature_acts, W_dec, need_acts, need_weight, ctx.acts_grad
    )
    return (grad_acts if need_acts else None), (grad_weight if need_weight else None), None, None, None, None, None


sparse_decode_op.register_autograd(_decode_backward, setup_context=_decode_setup)


def topk_decode_forward(top_indices: torch.Tensor, top_acts: torch.Tensor, W_dec: torch.Tensor, out_dtype: torch.dtype):
    """The TopK decode's forward, also called directly for a plain eager call: top_indices [M, k] int32 and top_acts
    [M, k], both contiguous -> [M, d_model], ``sum_j top_acts[m, j] W_dec[top_indices[m, j]]``."""
    M, k = top_acts.shape
    counts = torch.full((M,), k, dtype=torch.int32, device=top_acts.device)
    return sparse_matmul(ELL(top_acts, top_indices, counts, W_dec.shape[0]), W_dec, out_dtype=out_dtype)


@torch.library.custom_op("sparsefuse::topk_decode", mutates_args=())
@on_tensor_device
def topk_decode_op(
    top_indices: torch.Tensor, top_acts: torch.Tensor, W_dec: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    return topk_decode_forward(top_indices, top_acts, W_dec, out_dtype)


@topk_decode_op.register_fake
def _(top_indices, top_acts, W_dec, out_dtype):
    return top_acts.new_empty((top_acts.shape[0], W_dec.shape[1]), dtype=out_dtype)


def _features_by_row(top_indices: torch.Tensor, top_acts: torch.Tensor, d_sae: int) -> CSR:
    """The TopK activations transposed, [d_sae, M] as CSR: feature f's entries are the tokens that picked it, in
    token order (a stable sort of the flat ids; row offsets by binary search, so no host sync and no atomics)."""
    M, k = top_acts.shape
    ids, order = torch.sort(top_indices.reshape(-1), stable=True)  # (int32 keys: a faster sort than int64's)
    offsets = torch.searchsorted(ids, torch.arange(d_sae + 1, dtype=ids.dtype, device=ids.device))
    tokens = torch.div(order, k, rounding_mode="floor").to(torch.int32)
    return CSR(top_acts.reshape(-1)[order].contiguous(), tokens, offsets, M)


def _picked_features_grad(
    top_indices: torch.Tensor, top_acts: torch.Tensor, grad_out: torch.Tensor, d_sae: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """W_dec's gradient [d_sae, d_model] = acts^T grad_out where few features were picked (M * k well under d_sae):
    the gather runs over one CSR row per *picked* feature (at most M * k rows, in feature order; rows past the
    number of distinct features are empty), and one memset zeroes every other row. Over all d_sae rows instead, the
    gather's one-warp programs for rows nobody picked cost more than the rows' bytes (a program per row and 256
    columns, 196k of them at d_sae 65536, d_model 768). No host sync: the row count is the bound M * k."""
    M, k = top_acts.shape
    ids, order = torch.sort(top_indices.reshape(-1), stable=True)
    first = torch.ones_like(ids, dtype=torch.bool)
    first[1:] = ids[1:] != ids[:-1]
    row = torch.cumsum(first, 0, dtype=torch.int32) - 1  # each pick's row: its feature's rank among the picked
    rows = ids.shape[0]
    offsets = torch.searchsorted(row, torch.arange(rows + 1, dtype=torch.int32, device=ids.device)).to(torch.int64)
    # each row's feature: the id of its first pick; the empty rows' (offset = rows) go to a spare row past d_sae
    starts = offsets[:-1]
    feature = torch.where(starts < rows, ids[starts.clamp(max=max(rows - 1, 0))].long(), d_sae)
    tokens = torch.div(order, k, rounding_mode="floor").to(torch.int32)
    picked = CSR(top_acts.reshape(-1)[order].contiguous(), tokens, offsets, M)
    sums = sparse_matmul(picked, grad_out, out_dtype=out_dtype, spread_long_rows=True)
    grad = torch.zeros(d_sae + 1, grad_out.shape[1], dtype=out_dtype, device=grad_out.device)
    # index_put_ rather than index_copy_ (which has no deterministic CUDA version); only the spare row is written
    # more than once, always with zeros
    return grad.index_put_((feature,), sums)[:d_sae]


def _topk_weight_grad(
    top_indices: torch.Tensor, top_acts: torch.Tensor, grad_out: torch.Tensor, d_sae: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """acts^T grad_out [d_sae, d_model]: by the picked features' rows where they are few (at most the knob
    ``picked_rows_max_share`` of d_sae: :class:`.auto.DecodeKnobs`), else by all d_sae rows."""
    if top_acts.numel() <= PLANNER.knobs.picked_rows_max_share * d_sae:
        return _picked_features_grad(top_indices, top_acts, grad_out, d_sae, out_dtype)
    by_feature = _features_by_row(top_indices, top_acts, d_sae)
    return sparse_matmul(by_feature, grad_out, out_dtype=out_dtype, spread_long_rows=True)


@torch.library.custom_op("sparsefuse::topk_decode_backward", mutates_args=())
@on_tensor_device
def topk_decode_backward_op(
    grad_out: torch.Tensor,
    top_indices: torch.Tensor,
    top_acts: torch.Tensor,
    W_dec: torch.Tensor,
    need_acts: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    # grad_acts [M, k] = grad_out[m] . W_dec[id]; grad_weight [d_sae, d_model] = acts^T grad_out, by feature: each
    # row of it gathers the grad_out rows of the tokens that picked that feature (a feature every token picked is a
    # long row, spread over the GPU by the gather's second launch)
    grad_acts = sampled_dot_rows(top_indices, grad_out, W_dec, top_acts.dtype) if need_acts else top_acts.new_zeros(0)
    grad_weight = W_dec.new_zeros(0)
    if need_weight:
        grad_weight = _topk_weight_grad(top_indices, top_acts, grad_out, W_dec.shape[0], W_dec.dtype)
    return grad_acts, grad_weight


@topk_decode_backward_op.register_fake
def _(grad_out, top_indices, top_acts, W_dec, need_acts, need_weight):
    return (
        top_acts.new_empty(top_acts.shape if need_acts else (0,)),
        W_dec.new_empty(W_dec.shape if need_weight else (0,)),
    )


def _topk_setup(ctx, inputs, output) -> None:
    top_indices, top_acts, W_dec, _ = inputs
    ctx.save_for_backward(top_indices, top_acts, W_dec)


def _topk_backward(ctx, grad_out):
    top_indices, top_acts, W_dec = ctx.saved_tensors
    need_acts, need_weight = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    grad_acts, grad_weight = topk_decode_backward_op(grad_out, top_indices, top_acts, W_dec, need_acts, need_weight)
    return None, (grad_acts if need_acts else None), (grad_weight if need_weight else None), None


topk_decode_op.register_autograd(_topk_backward, setup_context=_topk_setup)
