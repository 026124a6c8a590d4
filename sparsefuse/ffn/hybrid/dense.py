"""The dense step of ``hybrid_mlp`` (``layout="dense"``, or ``"auto"`` once the gate fires widely): the three
products are ``F.linear`` under ordinary autograd (biases, autocast and checkpointing work as for any layer), and
everything between them is one elementwise op each way:

* gated: ``sparsefuse::relu_mul_l1`` (pre, up) -> (h_gate, h, l1, token counts, neuron counts) -- the ReLU, the
  product with up, the L1 term (on h_gate, or with ``hidden`` on h) and the firing counts in one pass -- and
  ``sparsefuse::relu_mul_l1_backward``, both products' chain rule with the L1 gradient folded in, in one pass;
* non-gated: ``sparsefuse::relu_l1`` (pre) -> (h, l1, counts) and ``sparsefuse::relu_l1_backward``.

FATReLU and dReLU gates (``activation``, ``threshold``: as ``hybrid_mlp``'s) run in the same two passes.

So the step costs what the dense block costs (fewer elementwise passes, in fact: plain torch runs relu, mul and
three backward passes), not that plus separate sum, compare and count passes. Kernels: :mod:`.dense_kernels`.

A torch.library op with registered autograd costs ~0.2-0.3 ms of host time a call (dispatcher, autograd wrapper,
alias checks): a plain eager call runs the same implementations as an ``autograd.Function`` instead, as the block
step does (:mod:`.block_step`); the ops serve torch.compile, tensor subclasses, dispatch modes and functorch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..._backend import on_tensor_device, plain_eager_call
from ..._validation import autocast_off
from .dense_kernels import l1_dtype, relu_mul_backward, relu_mul_stats


def _check_pair(pre: torch.Tensor, up: torch.Tensor) -> None:
    if pre.dim() != 2 or up.shape != pre.shape or up.dtype != pre.dtype or up.device != pre.device:
        raise ValueError(
            "relu_mul_l1: pre and up must be [M, N] of one shape, dtype and device; got "
            f"{tuple(pre.shape)} {pre.dtype} {pre.device} and {tuple(up.shape)} {up.dtype} {up.device}"
        )


# --- gated: relu(pre) * up -----------------------------------------------------------------------------------------


@on_tensor_device
def _gated_forward(
    pre: torch.Tensor, up: torch.Tensor, hidden: bool = False, activation: str = "relu", threshold: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """pre (the gate's pre-activations), up [M, N] -> (h_gate = relu(pre) [M, N] (NaN kept), h = h_gate * up [M, N]
    (fp32 product, rounded once), l1 = sum(h_gate) / (M * N) (``hidden``: sum(|h|) / (M * N); 0-dim fp32, float64
    for float64 inputs), fired count per row [M] and per column [N] (int32; fired: pre > 0 or NaN)). FATReLU:
    fired where pre > threshold, h_gate = pre there; dReLU: h = h_gate * relu(up), counts of the gate's firing."""
    _check_pair(pre, up)
    gate, h, l1, token_counts, neuron_counts = relu_mul_stats(pre, up, hidden, threshold, activation == "drelu")
    return gate, h, l1, token_counts, neuron_counts


def _contiguous_like(t: torch.Tensor) -> torch.Tensor:
    """A fake's [M, N] output: contiguous whatever ``t``'s strides, as the implementations write them."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


relu_mul_l1_op = torch.library.custom_op("sparsefuse::relu_mul_l1", _gated_forward, mutates_args=())


@relu_mul_l1_op.register_fake
def _(pre, up, hidden=False, activation="relu", threshold=0.0):
    M, N = pre.shape
    counts = lambda n: torch.empty(n, dtype=torch.int32, device=pre.device)  # noqa: E731
    l1 = torch.empty((), dtype=l1_dtype(pre.dtype), device=pre.device)
    return _contiguous_like(pre), _contiguous_like(pre), l1, counts(M), counts(N)


@on_tensor_device
def _gated_backward(
    grad_h: torch.Tensor,
    grad_l1: torch.Tensor | None,
    gate: torch.Tensor,
    up: torch.Tensor,
    hidden: bool = False,
    activation: str = "relu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_pre, d_up) [M, N] from grad_h [M, N] (h's gradient), grad_l1 (0-dim, l1's; None: no L1 term in the loss)
    and the forward's h_gate and up [M, N]: d_up = grad_h * h_gate, d_pre = (grad_h * up + grad_l1 / (M * N)) where
    h_gate != 0, else 0 (``hidden``: grad_h + grad_l1 / (M * N) * sign(up) in both; dReLU: relu(up) for up, d_up
    zero where up <= 0; FATReLU's threshold is in h_gate already)."""
    return relu_mul_backward(grad_h, grad_l1, gate, up, hidden, activation == "drelu")


relu_mul_l1_backward_op = torch.library.custom_op("sparsefuse::relu_mul_l1_backward", _gated_backward, mutates_args=())


@relu_mul_l1_backward_op.register_fake
def _(grad_h, grad_l1, gate, up, hidden=False, activation="relu"):
    return _contiguous_like(gate), _contiguous_like(gate)


def _gated_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[0], inputs[1])  # h_gate, up: what torch's relu and mul would keep
    ctx.hidden = inputs[2] if len(inputs) > 2 else False
    ctx.activation = inputs[3] if len(inputs) > 3 else "relu"
    ctx.mark_non_differentiable(output[0], output[3], output[4])
    # The loss may use h or l1 alone: the absent gradient stays None (no [M, N] of zeros, no zero L1 term).
    ctx.set_materialize_grads(False)


def _gated_backward_with(backward, ctx, grad_h, grad_l1):
    gate, up = ctx.saved_tensors  # unpacked once: activation checkpointing allows no second unpack
    if grad_h is None:
        if grad_l1 is None:
            return None, None
        grad_h = torch.zeros_like(gate)  # only the L1 term reached the loss
    return backward(grad_h, grad_l1, gate, up, ctx.hidden, ctx.activation)


def _gated_op_backward(ctx, grad_gate, grad_h, grad_l1, *unused):
    return *_gated_backward_with(relu_mul_l1_backward_op, ctx, grad_h, grad_l1), None, None, None


relu_mul_l1_op.register_autograd(_gated_op_backward, setup_context=_gated_setup)


# --- non-gated: relu(pre) ------------------------------------------------------------------------------------------


@on_tensor_device
def _relu_forward(pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """pre [M, N] -> (relu(pre) [M, N] (NaN kept), l1 = sum(relu(pre)) / (M * N) as 0-dim fp32 (float64 for float64
    pre), fired count per row [M] and per column [N], int32)."""
    gate, _, l1, token_counts, neuron_counts = relu_mul_stats(pre, None)
    return gate, l1, token_counts, neuron_counts


relu_l1_op = torch.library.custom_op("sparsefuse::relu_l1", _relu_forward, mutates_args=())


@relu_l1_op.register_fake
def _(pre):
    M, N = pre.shape
    counts = lambda n: torch.empty(n, dtype=torch.int32, device=pre.device)  # noqa: E731
    return _contiguous_like(pre), torch.empty((), dtype=l1_dtype(pre.dtype), device=pre.device), counts(M), counts(N)


@on_tensor_device
def _relu_backward(h: torch.Tensor, grad_h: torch.Tensor, grad_l1: torch.Tensor | None) -> torch.Tensor:
    """The gradient w.r.t. pre of ``relu_l1``'s (h, l1) outputs: ``(grad_h + grad_l1 / (M * N)) * [h != 0]``
    [M, N] (grad_l1 None: no L1 term in the loss)."""
    return relu_mul_backward(grad_h, grad_l1, h, None)[0]


relu_l1_backward_op = torch.library.custom_op("sparsefuse::relu_l1_backward", _relu_backward, mutates_args=())


@relu_l1_backward_op.register_fake
def _(h, grad_h, grad_l1):
    return _contiguous_like(h)


def _relu_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[0])
    ctx.mark_non_differentiable(output[2], output[3])
    ctx.set_materialize_grads(False)


def _relu_backward_with(backward, ctx, grad_h, grad_l1):
    (h,) = ctx.saved_tensors
    if grad_h is None:
        if grad_l1 is None:
            return None
        grad_h = torch.zeros_like(h)
    return backward(h, grad_h, grad_l1)


def _relu_op_backward(ctx, grad_h, grad_l1, *unused):
    return _relu_backward_with(relu_l1_backward_op, ctx, grad_h, grad_l1)


relu_l1_op.register_autograd(_relu_op_backward, setup_context=_relu_setup)


# --- the eager fast path -------------------------------------------------------------------------------------------


def _without_autocast(fn, *inputs):
    """fn(*inputs) with autocast off: the operands are already in the step's dtype (as inside an op)."""
    with autocast_off(inputs[0]):
        return fn(*inputs)


class _EagerReluMulL1(torch.autograd.Function):
    """``relu_mul_l1_op`` with its autograd rule, the same implementations, without the dispatcher."""

    @staticmethod
    def forward(ctx, pre, up, hidden, activation, threshold):
        output = _without_autocast(_gated_forward, pre, up, hidden, activation, threshold)
        _gated_setup(ctx, (pre, up, hidden, activation, threshold), output)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_gate, grad_h, grad_l1, *unused):
        # traced (compiled autograd over an eager forward): the opaque op, which Dynamo does not step into
        backward = relu_mul_l1_backward_op if torch.compiler.is_compiling() else _gated_backward
        return *_gated_backward_with(backward, ctx, grad_h, grad_l1), None, None, None


class _EagerReluL1(torch.autograd.Function):
    """``relu_l1_op`` with its autograd rule, the same implementations, without the dispatcher."""

    @staticmethod
    def forward(ctx, pre):
        output = _without_autocast(_relu_forward, pre)
        _relu_setup(ctx, (pre,), output)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_h, grad_l1, *unused):
        backward = relu_l1_backward_op if torch.compiler.is_compiling() else _relu_backward
        return _relu_backward_with(backward, ctx, grad_h, grad_l1)


def relu_mul_l1(
    pre: torch.Tensor, up: torch.Tensor, hidden: bool = False, activation: str = "relu", threshold: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:data:`relu_mul_l1_op` with its autograd (h and l1 differentiable; h_gate and the counts not): through the
    op where the dispatcher is needed, as an ``autograd.Function`` around the same code in a plain eager call.
    ``hidden``: l1 on h rather than on h_gate; ``activation``, ``threshold``: the gate (``hybrid_mlp``'s)."""
    if plain_eager_call(pre, up):
        return _EagerReluMulL1.apply(pre, up, hidden, activation, threshold)
    return relu_mul_l1_op(pre, up, hidden, activation, threshold)


def relu_l1(pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:data:`relu_l1_op` with its autograd (h and l1 differentiable), chosen as :func:`relu_mul_l1` chooses."""
    if plain_eager_call(pre):
        return _EagerReluL1.apply(pre)
    return relu_l1_op(pre)


def dense_step(
    x2: torch.Tensor,
    w_gate: torch.Tensor,
    b_gate: torch.Tensor | None,
    w_up: torch.Tensor | None,
    b_up: torch.Tensor | None,
    w_down: torch.Tensor,
    b_down: torch.Tensor | None,
    hidden: bool = False,
    activation: str = "relu",
    threshold: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step with cuBLAS products (autograd through them): x2 [M, K], w_gate, w_up [N, K], w_down [K, N], biases
    [N], [N], [K] -> (y [M, K], l1 (0-dim; ``hidden``: on h), token counts [M], neuron counts [N]). ``w_up=None``:
    the non-gated block ``relu(x W_g^T + b_g) W_d^T + b_d``. ``activation``, ``threshold``: the gated block's gate."""
    pre = F.linear(x2, w_gate, b_gate)
    if w_up is None:
        h, l1, token_counts, neuron_counts = relu_l1(pre)
    else:
        up = F.linear(x2, w_up, b_up)
        _, h, l1, token_counts, neuron_counts = relu_mul_l1(pre, up, hidden, activation, threshold)
    return F.linear(h, w_down, b_down), l1, token_counts, neuron_counts
