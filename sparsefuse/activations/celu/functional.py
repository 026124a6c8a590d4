"""The public ``celu`` and ``celu_``: check their arguments, then call the launcher directly in plain eager
inference or the torch.library op otherwise."""

from __future__ import annotations

import torch

from ... import _backend
from ..._validation import check_celu_args
from .launch import celu_forward, celu_inplace
from .op import celu_inplace_op, celu_op


def celu(x: torch.Tensor, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0) -> torch.Tensor:
    """``scale * where(z > 0, z, alpha * (exp(z / alpha) - 1))`` with ``z = x * input_scale``.

    Args:
        x: any shape; float32, float16, bfloat16 (or float64). The output has x's shape, dtype and (for dense x)
            strides. With ``scale == input_scale == 1`` this equals ``torch.nn.functional.celu(x, alpha)``.
        alpha: non-zero (``ValueError`` otherwise).

    Differentiable in x (the backward reads the output, not the input).
    """
    alpha, scale, input_scale = check_celu_args("celu", x, alpha, scale, input_scale)
    if _backend.bypass_dispatcher(x):
        return celu_forward(x, alpha, scale, input_scale)
    return celu_op(x, alpha, scale, input_scale)


def celu_(x: torch.Tensor, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0) -> torch.Tensor:
    """In-place :func:`celu`; returns x.

    Without autograd (inference, ``torch.no_grad``, or x not requiring grad) the kernel overwrites x with no extra
    allocation. Under autograd the rules are PyTorch's: a leaf that requires grad (or a view of one) raises
    ``RuntimeError``; for any other tensor the result is computed out of place and copied into x (one extra buffer),
    so gradients flow. Either way x's version counter is bumped, so a backward that saved x before the call raises
    instead of reading the overwritten values.
    """
    alpha, scale, input_scale = check_celu_args("celu_", x, alpha, scale, input_scale)
    if torch.is_grad_enabled() and x.requires_grad:
        # a view (of a leaf, or one made under no_grad) is left to copy_, which raises PyTorch's own error for it
        if x.is_leaf and x._base is None:
            raise RuntimeError(
                "celu_: a leaf Variable that requires grad is being used in an in-place operation; "
                "use sparsefuse.celu (out of place) or run under torch.no_grad()"
            )
        return x.copy_(celu_op(x, alpha, scale, input_scale))
    if _backend.bypass_dispatcher(x):
        celu_inplace(x, alpha, scale, input_scale)
        # The op's mutates_args bumps x's version counter in the dispatcher, which this path skips: without the bump
        # a graph that saved x (or a view sharing its storage) would backpropagate through the overwritten values
        # instead of raising, as PyTorch's in-place ops make it.
        torch.autograd.graph.increment_version(x)
    else:
        celu_inplace_op(x, alpha, scale, input_scale)
    return x
