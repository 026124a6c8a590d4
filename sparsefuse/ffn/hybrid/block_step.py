"""The training step of the gated ReLU block on row-block unions (``layout="block"``, the default), as two
``torch.library`` ops joined by a registered autograd rule. Tokens are grouped ``block_rows`` at a time (sorted by
their gate's non-zero count first at large batches); each block's union of fired neurons is the pattern every
product but the gate's forward runs on. A union never overflows, so the step is exact with no capacity to size, no
host sync, and it can be captured in a CUDA graph.

=====================  ===============================================  =========================================
product                what it computes                                 kernel (``sparsefuse.sparse``)
=====================  ===============================================  =========================================
gate ``x W_g^T``       dense: it finds the pattern                      cuBLAS
up ``x W_u^T``         on the unions; gate and up kept, the gate's      ``block_sddmm(factors=True)``
                       L1 and firing counts in the same epilogue        (``l1_on="hidden"``: |h| summed on the
                                                                        unions, :mod:`.block_l1`)
down ``h W_d^T``       sparse rows                                      ``block_sparse_matmul``
``dh = dy W_d``        on the unions, chain rule in the epilogue        ``block_ell_sddmm(gate=, up=)`` (+ the
                                                                        hidden L1 term's gradient, :mod:`.block_l1`)
``dx``                 two sparse operands into one output              ``block_sparse_matmul(accumulate=)``
``dW_u, dW_g, dW_d``   transposed, per fired (token, neuron) only       ``block_ell_transpose`` +
                                                                        ``transposed_matmul``
=====================  ===============================================  =========================================

Kept for the backward: x, the gate and up values where the gate fired, packed pair by pair into ``capacity`` pairs
with a 2-byte slot code each (:func:`~sparsefuse.sparse.block_pack.pack_block_factors`: 6 bytes per non-zero at
bf16, not the [M, width] layout the products walk), the unions' column lists and the token order -- no
pre-activation, no product h. A block past the capacity is recomputed in the backward, never dropped.

FATReLU and dReLU gates (``activation``, ``threshold``) ride in the same kernels (the gate's threshold where the
unions are found, the product's and the unpack's epilogues); dReLU's backward adds one pass on the unions' slots
(:mod:`.block_gates`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..._backend import (
    cdiv,
    empty_layout_like,
    new_output,
    new_output_layout_like,
    on_tensor_device,
    plain_eager_call,
)
from ..._validation import autocast_off
from ...sparse import BlockELL
from ...sparse.block_grad import block_ell_sddmm, block_ell_transpose, transposed_matmul
from ...sparse.block_pack import PackedFactors, pack_block_factors, unpack_block_factors
from ...sparse.block_spmm import block_sparse_matmul, heavy_first_schedule_and_offsets
from ...sparse.compact import dense_to_row_block_pattern
from ...sparse.sddmm import block_sddmm, factor_chunk
from .block_gates import drelu_up_grad
from .block_l1 import add_hidden_l1_grad, block_hidden_l1


def _on_slots(values, indices, counts, order, N, block_rows) -> BlockELL:
    return BlockELL(values, indices, counts, N, block_rows, order)


@on_tensor_device
def _train_forward(
    x2: torch.Tensor,
    w_gate: torch.Tensor,
    b_gate: torch.Tensor | None,
    w_up: torch.Tensor | None,
    b_up: torch.Tensor | None,
    w_down_t: torch.Tensor,
    b_down: torch.Tensor | None,
    block_rows: int,
    tile: int,
    sort_rows: bool,
    capacity: int,
    hidden_l1: bool = False,
    activation: str = "relu",
    threshold: float = 0.0,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]:
    """x2 [M, K]; w_gate, w_up, w_down_t [N, K] (w_up None, b_up None: the non-gated block ``relu(x W_g^T + b_g)
    W_d^T + b_d``). Returns y [M, K], l1 (0-dim fp32: the gate's mean per element; ``hidden_l1``, gated only: |h|'s,
    h = h_g * h_u), token counts then neuron counts [M + N] (int32), and what the
    backward keeps: the fired pairs' gate and up values [capacity] each (up empty without w_up) and slot codes
    [capacity] (int16) with their chunk offsets [n_blocks * n_chunks + 1] (int64), union columns [n_blocks, width]
    and sizes [n_blocks] (int32), token order [M] (int32) and the blocks' heavy-first launch order [n_blocks]
    (int32; unused with one block). ``activation``, ``threshold``: the gated block's gate (``hybrid_mlp``'s); the
    counts and the kept pairs are the gate's firing."""
    return _train_forward_into(
        x2, w_gate, b_gate, w_up, b_up, w_down_t, b_down, block_rows, tile, sort_rows, capacity, None, hidden_l1,
        activation, threshold,
    )  # fmt: skip


def _train_forward_into(
    x2, w_gate, b_gate, w_up, b_up, w_down_t, b_down, block_rows, tile, sort_rows, capacity, y_out, hidden_l1=False,
    activation="relu", threshold=0.0,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """:func:`_train_forward`, y written into ``y_out`` [M, K] when given (a captured step's static output)."""
    M, N = x2.shape[0], w_gate.shape[0]
    pre = F.linear(x2, w_gate, b_gate)
    # (threshold: 0 but for FATReLU, as the arguments were checked)
    pattern = dense_to_row_block_pattern(pre, tile, block_rows, relu=True, threshold=threshold, sort_rows=sort_rows)
    f = block_sddmm(
        pattern,
        pre,
        x2,
        w_up,
        b_up,
        relu=True,
        threshold=threshold,
        up_relu=activation == "drelu" and w_up is not None,
        out_dtype=x2.dtype,
        factors=True,
        sum_scale=1.0 / max(M * N, 1),
        column_counts=False,
    )
    # The down product here and the backward's dx products walk the same unions: their heavy-first launch order is
    # found once and kept (4 bytes a block). One block has nothing to order: zeros stand in, and no product reads them.
    # The same launch sums the blocks' non-zeros into where each block's chunks' pairs start in the packed arrays.
    many = f.product.counts.shape[0] > 1
    if many:
        schedule, offsets = heavy_first_schedule_and_offsets(f.product.counts, f.block_nnz, f.chunk_nnz)
    else:
        schedule, offsets = torch.zeros_like(f.product.counts), None
    y = block_sparse_matmul(
        f.product, w_down_t, bias=b_down, out_dtype=x2.dtype, schedule=schedule if many else None, out=y_out
    )
    packed = pack_block_factors(f, capacity, offsets)
    order = pattern.row_order
    if order is None:
        order = torch.arange(M, dtype=torch.int32, device=x2.device)
    # the L1 term, a mean over the M x N pairs: the gate's (summed in block_sddmm's epilogue), or h's on the unions
    l1 = block_hidden_l1(f.product.values, f.product.counts, block_rows, N) if hidden_l1 and w_up is not None else None
    return (
        y,
        l1 if l1 is not None else f.gate_sum,
        f.counts,  # token then neuron counts, one tensor: a custom op's outputs may not alias one another
        packed.gate,
        packed.up,
        packed.slots,
        packed.offsets,
        f.product.indices,
        f.product.counts,
        order,
        schedule,
    )


block_mlp_train_fwd_op = torch.library.custom_op("sparsefuse::block_mlp_train_fwd", _train_forward, mutates_args=())


@block_mlp_train_fwd_op.register_fake
def _(x2, w_gate, b_gate, w_up, b_up, w_down_t, b_down, block_rows, tile, sort_rows, capacity, hidden_l1=False,
      activation="relu", threshold=0.0):  # fmt: skip
    M, N = x2.shape[0], w_gate.shape[0]
    width, n_blocks = cdiv(N, tile) * tile, cdiv(M, block_rows)
    n_chunks = cdiv(width, factor_chunk(x2.shape[1], block_rows))
    index = lambda *shape: torch.empty(*shape, dtype=torch.int32, device=x2.device)  # noqa: E731
    return (
        x2.new_empty(M, w_down_t.shape[1]),
        torch.empty((), dtype=torch.float32, device=x2.device),
        index(M + N),
        x2.new_empty(capacity),
        x2.new_empty(capacity if w_up is not None else 0),
        torch.empty(capacity, dtype=torch.int16, device=x2.device),
        torch.empty(n_blocks * n_chunks + 1, dtype=torch.int64, device=x2.device),
        index(n_blocks, width),
        index(n_blocks),
        index(M),
        index(n_blocks),
    )


@on_tensor_device
def _train_backward(
    dy: torch.Tensor,
    dl1: torch.Tensor,
    x2: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor | None,
    w_down_t: torch.Tensor,
    b_gate: torch.Tensor | None,
    b_up: torch.Tensor | None,
    packed_gate: torch.Tensor,
    packed_up: torch.Tensor,
    packed_slots: torch.Tensor,
    offsets: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    order: torch.Tensor,
    schedule: torch.Tensor,
    block_rows: int,
    bias_grads: bool,
    hidden_l1: bool = False,
    activation: str = "relu",
    threshold: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx [M, K], dw_gate, dw_up, dw_down_t [N, K], db_gate, db_up [N], db_down [K]) from dy [M, K] and dl1
    (0-dim: the loss's gradient w.r.t. the L1 term; ``hidden_l1``: the forward's term was on h). Without
    ``bias_grads`` the three bias gradients are empty tensors (nothing computed for them); without w_up (the
    non-gated block) dw_up and db_up are empty. The biases are read only to recompute blocks that did not fit the
    packed capacity. ``activation``, ``threshold``: the forward's gate."""
    kept = (packed_gate, packed_up, packed_slots, offsets, indices, counts, order, schedule)
    return _train_backward_into(
        dy, dl1, x2, w_gate, w_up, w_down_t, b_gate, b_up, *kept, block_rows, bias_grads, None, None, hidden_l1,
        activation, threshold,
    )  # fmt: skip


def _train_backward_into(
    dy, dl1, x2, w_gate, w_up, w_down_t, b_gate, b_up, packed_gate, packed_up, packed_slots, offsets, indices,
    counts, order, schedule, block_rows, bias_grads, dx_out, dw_out, hidden_l1=False, activation="relu",
    threshold=0.0,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """:func:`_train_backward`, dx and the weight gradients written into ``dx_out`` [M, K] and ``dw_out`` (dw_gate,
    dw_up or None: contiguous; dw_down_t: contiguous or the transpose of a contiguous tensor; any float dtype) when
    given (a captured step's static outputs), else into new ones (:func:`_weight_grads`)."""
    M, N = x2.shape[0], w_gate.shape[0]
    dy = dy.to(x2.dtype).contiguous()
    chunk = factor_chunk(x2.shape[1], block_rows)  # as the forward's block_sddmm chunked the unions
    packed = PackedFactors(packed_gate, packed_up, packed_slots, offsets, chunk)
    gate_values, up_values, count_table = unpack_block_factors(
        packed, indices, counts, order, block_rows, chunk, x2, w_gate, b_gate, w_up, b_up,
        threshold=threshold, up_relu=activation == "drelu" and w_up is not None,
    )  # fmt: skip
    gate = _on_slots(gate_values, indices, counts, order, N, block_rows)
    hidden_l1 = hidden_l1 and w_up is not None  # (non-gated: h is the gate, the two terms are one)
    dl1 = dl1.reshape(1)
    d_up, d_pre = block_ell_sddmm(
        gate,
        dy,
        w_down_t,
        gate=gate_values,
        up=up_values,
        gate_grad=torch.zeros_like(dl1, dtype=torch.float32) if hidden_l1 else dl1,
        gate_grad_divisor=max(M * N, 1),
    )
    if hidden_l1:  # |h|'s gradient on the same slots, added to both factors' gradients
        add_hidden_l1_grad(gate_values, up_values, d_up, d_pre, counts, dl1, block_rows, M * N)
    if activation == "drelu" and w_up is not None:  # relu's slope on the up factor
        drelu_up_grad(up_values, d_up, counts, block_rows)
    d_pre_slots = _on_slots(d_pre, indices, counts, order, N, block_rows)
    csc = block_ell_transpose(gate, count_table=count_table)
    if dw_out is None:
        dw_out = _weight_grads(x2, w_gate, w_up, w_down_t)
    schedule = schedule if counts.shape[0] > 1 else None
    if w_up is not None:
        d_up_slots = _on_slots(d_up, indices, counts, order, N, block_rows)
        dx = block_sparse_matmul(d_up_slots, w_up, out_dtype=x2.dtype, schedule=schedule, out=dx_out)
        dx = block_sparse_matmul(d_pre_slots, w_gate, accumulate=dx, schedule=schedule)
        third = (dy, gate_values, up_values)
        (dwg, dwu, dwd), sums = transposed_matmul(
            csc, x2, d_pre, d_up, mode="two", third=third, bias=bias_grads, out=dw_out
        )
    else:  # h = relu(pre): one product into dx, the down gradient from the gate's own values
        dx = block_sparse_matmul(d_pre_slots, w_gate, out_dtype=x2.dtype, schedule=schedule, out=dx_out)
        third = (dy, gate_values, None)
        out = [dw_out[0], dw_out[2]]
        (dwg, dwd), sums = transposed_matmul(csc, x2, d_pre, mode="one", third=third, bias=bias_grads, out=out)
        dwu = x2.new_empty(0)
    if bias_grads:
        db_up = sums[1].to(x2.dtype) if w_up is not None else x2.new_empty(0)
        biases = [sums[0].to(x2.dtype), db_up, dy.sum(0, dtype=torch.float32).to(x2.dtype)]
    else:  # distinct tensors: a custom op's outputs may not alias one another
        biases = [x2.new_empty(0) for _ in range(3)]
    return (dx, dwg, dwu, dwd, *biases)


def _weight_grads(x2, w_gate, w_up, w_down_t) -> list[torch.Tensor | None]:
    """New outputs for the weight gradients (dw_gate, dw_up or None, dw_down_t) in the step's dtype. dw_down_t takes
    w_down_t's layout, as the fake implementation says: for a row-major w_down [K, N] (``w_down_t = w_down.t()``)
    the gradient is then written as the weight is laid out, with no transposing copy for autograd to make on its way
    to the parameter."""
    grad = lambda w: new_output(w.shape, x2.dtype, x2.device) if w is not None else None  # noqa: E731
    return [grad(w_gate), grad(w_up), new_output_layout_like(w_down_t, x2.dtype)]


block_mlp_train_bwd_op = torch.library.custom_op("sparsefuse::block_mlp_train_bwd", _train_backward, mutates_args=())


@block_mlp_train_bwd_op.register_fake
def _(
    dy,
    dl1,
    x2,
    w_gate,
    w_up,
    w_down_t,
    b_gate,
    b_up,
    packed_gate,
    packed_up,
    packed_slots,
    offsets,
    indices,
    counts,
    order,
    schedule,
    block_rows,
    bias_grads,
    hidden_l1=False,
    activation="relu",
    threshold=0.0,
):
    N, K = w_gate.shape[0], w_down_t.shape[1]
    return (
        torch.empty_like(x2),
        torch.empty_like(w_gate),
        torch.empty_like(w_up) if w_up is not None else x2.new_empty(0),
        empty_layout_like(w_down_t),
        x2.new_empty(N if bias_grads else 0),
        x2.new_empty(N if bias_grads and w_up is not None else 0),
        x2.new_empty(K if bias_grads else 0),
    )


def _setup_context(ctx, inputs, output) -> None:
    x2, w_gate, b_gate, w_up, b_up, w_down_t, b_down, block_rows, *_ = inputs
    *_, packed_gate, packed_up, packed_slots, offsets, indices, counts, order, schedule = output
    saved = (packed_gate, packed_up, packed_slots, offsets, indices, counts, order, schedule)
    ctx.save_for_backward(x2, w_gate, w_up, w_down_t, b_gate, b_up, *saved)
    ctx.has_bias = (b_gate is not None, b_up is not None, b_down is not None)
    ctx.block_rows = block_rows
    ctx.hidden_l1 = bool(inputs[11]) if len(inputs) > 11 else False
    ctx.activation = inputs[12] if len(inputs) > 12 else "relu"
    ctx.threshold = inputs[13] if len(inputs) > 13 else 0.0
    ctx.has_up = w_up is not None
    # The saved factors are outputs only so that the backward can have them: no loss uses them, and materialising
    # their (zero) gradients would fill two more arrays per step.
    ctx.set_materialize_grads(False)


def _backward_with(backward_op, ctx, dy, dl1):
    saved = ctx.saved_tensors  # unpacked once: activation checkpointing allows no second unpack
    x2, w_down_t = saved[0], saved[3]
    if dy is None:  # only the L1 term reached the loss
        dy = torch.zeros(x2.shape[0], w_down_t.shape[1], dtype=x2.dtype, device=x2.device)
    if dl1 is None:
        dl1 = torch.zeros((), dtype=torch.float32, device=x2.device)
    dx, dwg, dwu, dwd, dbg, dbu, dbd = backward_op(
        dy, dl1, *saved, ctx.block_rows, any(ctx.has_bias), ctx.hidden_l1, ctx.activation, ctx.threshold
    )  # fmt: skip
    has_g, has_u, has_d = ctx.has_bias
    dwu = dwu if ctx.has_up else None
    return dx, dwg, dbg if has_g else None, dwu, dbu if has_u else None, dwd, dbd if has_d else None, *[None] * 7


def _backward(ctx, dy, dl1, *unused):
    return _backward_with(block_mlp_train_bwd_op, ctx, dy, dl1)


block_mlp_train_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerTrainStep(torch.autograd.Function):
    """The same two implementations and autograd rule as the ops, for plain eager calls: a torch.library op with
    autograd costs ~0.2-0.3 ms of host time per call on its own (the dispatcher, the autograd wrapper, output alias
    checks), which a training step from Python pays twice per layer. What the backward keeps is saved on the context
    directly rather than returned (an op can hand it over only as outputs): 3 outputs for autograd to track, not 11."""

    @staticmethod
    def forward(ctx, *inputs):
        with autocast_off(inputs[0]):  # the operands are already in the step's dtype (as inside an op)
            output = _train_forward(*inputs)
        _setup_context(ctx, inputs, output)
        ctx.mark_non_differentiable(output[2])
        return output[:3]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, dl1, *unused):
        # traced (compiled autograd over an eager forward): the opaque op, which Dynamo does not step into
        backward = block_mlp_train_bwd_op if torch.compiler.is_compiling() else _train_backward
        return _backward_with(backward, ctx, dy, dl1)


def block_mlp_train_fwd(*inputs):
    """:data:`block_mlp_train_fwd_op` with its autograd (arguments as there). Returns y, l1, token counts [M] and
    neuron counts [N] (the op's first three outputs, its counts split here: a custom op's outputs may not alias one
    another): through the torch.library op where the dispatcher is needed (torch.compile, tensor
    subclasses, dispatch modes, functorch), as an ``autograd.Function`` around the same code in a plain eager
    call."""
    if plain_eager_call(*(t for t in inputs if isinstance(t, torch.Tensor))):
        y, l1, counts = _EagerTrainStep.apply(*inputs)
    else:
        y, l1, counts = block_mlp_train_fwd_op(*inputs)[:3]
    M = inputs[0].shape[0]
    return y, l1, counts[:M], counts[M:]
