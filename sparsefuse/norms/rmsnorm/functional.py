"""The public ``rms_norm``: check the arguments, then run torch's native RMSNorm (small plain eager inference calls on
CUDA, which are host-bound), the launcher directly (other plain eager inference), an ``autograd.Function`` (plain
eager training) or the torch.library op (torch.compile, subclasses, modes)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ... import _backend
from ..._plan import call_context
from ..._validation import CELU_DTYPES, check_float, check_same_device, check_scalar, describe, unit_last_stride
from .launch import rms_norm_forward
from .op import EagerRMSNorm, rms_norm_fwd_op

RMS_NORM_DTYPES = CELU_DTYPES  # float32, float16, bfloat16, float64


def _normalized(op: str, x: torch.Tensor, normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
        raise TypeError(
            f"{op}: normalized_shape must be an int or a non-empty sequence of ints; got {normalized_shape!r}"
        )
    if tuple(x.shape[x.dim() - len(shape) :]) != shape or x.dim() < len(shape):
        raise ValueError(
            f"{op}: normalized_shape {list(shape)} must equal the last dimensions of input ({describe(x)})"
        )
    return shape


# A plain eager inference call on CUDA of at most this many input bytes runs torch's native RMSNorm (without the
# weight, which is then multiplied in as LlamaRMSNorm does). Such a call is host-bound -- a decode step from Python
# -- and one native dispatch is the cheapest host path there is: on an H200 machine, one call at 1 or 8 rows of
# 2048 bf16 took 17-18 us through torch's op, 93-100 through the Triton kernel's launch (Triton binds and
# specialises every argument per launch) and 110-118 through transformers' LlamaRMSNorm (eight dispatches). Past a
# few hundred rows the GPU time dominates and the Triton kernel (copy bandwidth) takes over; so do CUDA-graph
# captures, compiled graphs and calls that record autograd (the kernel's backward keeps 4 bytes a row).
NATIVE_EAGER_MAX_BYTES = 1 << 20
# Before torch's fused native kernel (aten::_fused_rms_norm, torch 2.8 on), F.rms_norm is a chain of elementwise
# dispatches, no shorter on the host than LlamaRMSNorm: such a torch keeps the Triton kernel.
NATIVE_FUSED = hasattr(torch.ops.aten, "_fused_rms_norm")


# torch's native CUDA kernel gives LlamaRMSNorm's answer for a row holding an inf (1/rms = 0: NaN where the inf
# was, 0 elsewhere) only on its vectorised path; its other path (a row length that is not a multiple of its vector,
# or an unaligned row) returns the whole row NaN (H200, torch 2.11: 16-bit rows of 2, 3 and 70 elements). So the
# route takes only rows that path is sure to take: contiguous, 16-byte aligned, a multiple of 8 elements long.
NATIVE_ROW_MULTIPLE = 8


def _host_bound_inference(x2: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether this call takes torch's native kernel: small plain eager inference calls on CUDA (priced as such:
    ``sparsefuse.planning(context="eager")`` makes any untraced call one), where one dispatch beats two launches."""
    if not NATIVE_FUSED or not 0 < x2.numel() * x2.element_size() <= NATIVE_EAGER_MAX_BYTES:
        return False
    if torch.is_grad_enabled() and (x2.requires_grad or (weight is not None and weight.requires_grad)):
        return False
    # eager first: torch.compile cannot trace data_ptr() arithmetic (a graph break on CUDA)
    tensors = (x2,) if weight is None else (x2, weight)
    if not _backend.plain_eager_call(*tensors) or call_context(x2) != "eager":
        return False
    return not (x2.shape[1] % NATIVE_ROW_MULTIPLE or not x2.is_contiguous() or x2.data_ptr() % 16)


def rms_norm(
    input: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """Root-mean-square normalisation over the trailing ``normalized_shape`` dimensions, in one kernel forward and
    one backward (plus a small sum for the weight's gradient).

    Args (as ``torch.nn.functional.rms_norm``):
        input: [..., *normalized_shape]; float32, float16, bfloat16 or float64; any strides (a last dimension that
            is not contiguous is copied once).
        normalized_shape: the trailing dimensions normalised together (an int for the last one).
        weight: None or normalized_shape; any of the same float dtypes.
        eps: added to the mean square; None: ``torch.finfo(input.dtype).eps``. Must be >= 0.

    Returns input's shape, in input's dtype promoted with weight's. The computation is transformers'
    ``LlamaRMSNorm``'s: ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` with the normalisation in float32
    (float64 for float64 input), so a patched model's outputs match the unpatched ones to the last rounding of the
    mean. Differentiable in input and weight (the backward recomputes the normalised row from x and a saved 1/rms
    per row: it keeps 4 bytes a row besides x, where LlamaRMSNorm keeps float32 copies of the whole input)."""
    op = "rms_norm"
    check_float(op, "input", input, RMS_NORM_DTYPES)
    shape = _normalized(op, input, normalized_shape)
    if weight is not None:
        check_float(op, "weight", weight, RMS_NORM_DTYPES)
        check_same_device(op, input=input, weight=weight)
        if tuple(weight.shape) != shape:
            raise ValueError(f"{op}: weight must have normalized_shape {list(shape)}; got {describe(weight)}")
    else:
        check_same_device(op, input=input)
    eps = torch.finfo(input.dtype).eps if eps is None else check_scalar(op, "eps", eps)
    if not eps >= 0.0:
        raise ValueError(f"{op}: eps must be >= 0; got eps={eps}")
    D = math.prod(shape)
    M = math.prod(input.shape[: input.dim() - len(shape)])  # explicit: reshape(-1, 0) cannot infer the rows
    x2 = unit_last_stride(input.reshape(M, D))
    w = unit_last_stride(weight.reshape(D)) if weight is not None else None
    tensors = (x2,) if w is None else (x2, w)
    if _host_bound_inference(x2, w):
        # LlamaRMSNorm's order: normalise, round to x's dtype (autocast would leave torch's rms_norm in float32),
        # then scale by the weight in the promoted dtype
        normed = torch.nn.functional.rms_norm(x2, (D,), None, eps).to(x2.dtype)
        y = normed if w is None else w * normed
    elif _backend.bypass_dispatcher(*tensors):
        y = rms_norm_forward(x2, w, eps)[0]
    elif _backend.plain_eager_call(*tensors) and torch.is_grad_enabled():
        y = EagerRMSNorm.apply(x2, w, eps)[0]
    else:
        y = rms_norm_fwd_op(x2, w, eps)[0]
    return y.reshape(input.shape)
