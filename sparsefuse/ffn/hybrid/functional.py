"""The public training function of the gated ReLU block: :func:`hybrid_mlp` (arguments checked, the step run by
:mod:`.op`) and :func:`sparsity_stats` (what a training loop logs)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..._backend import Backend, backend_for
from ..._validation import (
    autocast_operands,
    check_ffn_activation,
    check_ffn_mlp,
    check_optional_count,
    check_positive_int,
    flat_rows,
    unit_last_stride,
)
from ...sparse.compact import DEFAULT_HYBRID_WIDTH
from ..twell.block import block_plan
from ..twell.reference import ACTIVATIONS
from .block_step import block_mlp_train_fwd
from .choice import PLANNER, TRAIN_CHOICE
from .dense import dense_step
from .graphed import graphed_step, replays_by_default
from .op import hybrid_mlp_fwd_op
from .reference import L1_TERMS

LAYOUTS = ("auto", "block", "dense", "hybrid")

# float64 too: the step runs its products through torch and the core's reference paths there (gradcheck)
TRAIN_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class HybridMLPOutput(NamedTuple):
    """``y`` [..., K]; ``l1`` 0-dim fp32 (differentiable): an L1 norm per element of the M x N hidden activations,
    of the gate's ``sum(relu(x W_g^T + b_g)) / (M * N)`` (``l1_on="gate"``) or of the hidden representation's
    ``sum(|relu(x W_g^T + b_g) * (x W_u^T + b_u)|) / (M * N)`` (``l1_on="hidden"``, the TwELL paper's eq. 2 for one
    layer); ``token_counts`` [M] int32: gate non-zeros per token;
    ``neuron_counts`` [N] int32: tokens in which each neuron fired (0: dead in this batch). With a FATReLU or dReLU
    gate, h_g is that gate's activation (:func:`hybrid_mlp`'s ``activation``) and the counts are its firing."""

    y: torch.Tensor
    l1: torch.Tensor
    token_counts: torch.Tensor
    neuron_counts: torch.Tensor


def hybrid_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    layout: str = "auto",
    width: int = DEFAULT_HYBRID_WIDTH,
    backup_rows: int | None = None,
    block_capacity: int | None = None,
    cuda_graph: bool | None = None,
    l1_on: str = "gate",
    activation: str = "relu",
    threshold: float = 0.0,
) -> HybridMLPOutput:
    """Gated ReLU block ``(relu(x W_g^T + b_g) * (x W_u^T + b_u)) W_d^T + b_d`` for training: differentiable in
    every tensor argument, and what it keeps for the backward is sparse (the gate and up activations where the gate
    fired, in the :class:`~sparsefuse.sparse.Hybrid` layout; no [M, N] tensor).

    Args:
        layout: how the step runs. ``"auto"`` (default): ``"block"`` while the gate is sparse, ``"dense"`` once
            more than ``dense_above`` of it fires (:class:`~sparsefuse.ffn.hybrid.choice.TrainKnobs`), from the
            firing seen on this weight's earlier calls (no host sync). ``"block"``: tokens in blocks of 64
            (sorted by firing count from 8192 tokens), each block's union of fired neurons; tensor cores
            throughout, never overflows, no host sync (CUDA-graph capturable). ``"dense"``: cuBLAS products and one
            fused elementwise pass each way (the dense block's speed and memory). ``"hybrid"``: the TwELL paper's
            format, an ELL of ``width`` slots per token plus whole backup rows for tokens over it (one host sync per
            call). float64, and CPU tensors
            without the Triton interpreter, take ``"hybrid"``'s torch path for ``"auto"`` and ``"block"``.
        x: [..., K] float32/float16/bfloat16 (float64 for gradient checks); w_gate, w_up: [N, K]; w_down: [K, N]
            (``nn.Linear`` weights, x's dtype; w_down column-major, as :class:`sparsefuse.nn.SparseGatedMLP` stores
            it, saves the two copies of W_down^T a row-major one costs a step; either way its gradient comes in its
            own layout).
        width: (``"hybrid"``) ELL slots kept per token (the TwELL paper's 128); a token with more non-zeros is
            kept whole in the backup.
        backup_rows: (``"hybrid"``) whole rows kept for such tokens (default ``ceil(M / 8)``); when more overflow,
            the step grows its backup to hold them all (exact; counted in :data:`sparsefuse.ffn.hybrid.op.REBUILDS`).
        block_capacity: (``"block"``) fired (token, neuron) pairs kept for the backward (6 bytes each at bf16:
            gate and up values and a slot code). Default: 1.25x the non-zeros last seen on this gate weight (all
            ``M * N`` pairs before the first observation; under torch.compile the eager calls' largest need per
            token, rounded up to a power of two). Row blocks past it are recomputed in the backward from x and the
            weights, never dropped;
            :func:`sparsefuse.sparse.block_pack.spilled_blocks` counts them.
        cuda_graph: (``"block"``, CUDA) replay the step from two CUDA graphs captured per layer and input shape
            (:mod:`sparsefuse.ffn.hybrid.graphed`): the host's cost of a layer's step drops from ~15 kernel launches and
            their Python to two replays and a few copies. Same kernels, same results. ``None`` (default): replay where
            the host would otherwise pace the step -- CUDA tensors, no ``block_capacity`` given, and a layer whose gate
            product is at most the knob ``replay_max_gate_flop`` (:class:`~sparsefuse.ffn.hybrid.choice.TrainKnobs`: the
            1.5B layer shape up to 16384 tokens, not the 8B one, whose GPU time already exceeds an eager step's host
            time and would only gain the replay's copies). ``True``: replay at any size; ``False``: never. The eager
            step runs until the gate weight's sparsity has been observed once, inside activation checkpointing's
            recompute, and wherever the call is not a plain eager one (torch.compile, tensor subclasses). A replayed
            step ignores ``block_capacity`` (the capacity is bucketed, see there).
        l1_on: what ``out.l1`` is taken on. ``"gate"`` (default): the gate activations h_g = relu(x W_g^T + b_g).
            ``"hidden"``: the hidden representation h = h_g * h_u that W_d reads, the term of the TwELL paper's
            eq. 2; its gradient reaches x and all four weights and biases of the gate and up products, through both
            factors. Every layout computes it where it already has h (on the fired pairs; no extra [M, N] pass in
            the sparse layouts). Either way a mean per element, divided by M * N; the paper's released code divides
            by M alone, so its coefficient is this one over N (docs/training.md, "The L1 term").
        activation: the gate activation, as :func:`sparsefuse.twell_mlp`'s. ``"relu"`` (default); ``"fatrelu"``:
            h_g = g where the gate pre-activation g > ``threshold``, else 0 (the value unshifted; its gradient 1
            where it fired, 0 elsewhere); ``"drelu"``: h = relu(g) * relu(x W_u^T + b_u), a neuron contributing only
            where both fire (gradients through both relus). The L1 term's ``"gate"`` is the mean of h_g (FATReLU's
            values above the threshold; dReLU's relu(g)), ``"hidden"`` that of |h|, h the product W_d reads. The
            counts are the gate's firing (h_g != 0; for dReLU the gate alone, whatever up does): what the sparse
            layouts walk and keep, and what sizes ``block_capacity`` -- dReLU keeps the gate's pattern because the
            gate's L1 term has a gradient wherever the gate fired. Every layout, the replayed step included.
        threshold: FATReLU's, a finite number >= 0 (0 is ReLU); only with ``activation="fatrelu"``. Each layout
            compares the pre-activation it holds in x's dtype with it exactly (a recomputed block's, rounded as the
            forward's, too).
    Returns: :class:`HybridMLPOutput` (y, l1, per-token and per-neuron firing counts, all on the device). Under
    ``torch.autocast`` the step runs in the autocast dtype, as ``nn.Linear`` would.
    For the L1 penalty add ``coefficient * out.l1`` to the loss: its gradient reaches the weights only where the
    gate fired.
    """
    if l1_on not in L1_TERMS:
        raise ValueError(f"hybrid_mlp: l1_on must be one of {', '.join(map(repr, L1_TERMS))}; got {l1_on!r}")
    threshold = check_ffn_activation("hybrid_mlp", activation, threshold, ACTIVATIONS)
    return _train_step(
        "hybrid_mlp", x, w_gate, b_gate, w_up, b_up, w_down, b_down, layout, width, backup_rows, block_capacity,
        cuda_graph=cuda_graph, hidden_l1=l1_on == "hidden", gate_act=(activation, threshold),
    )  # fmt: skip


def hybrid_relu_mlp(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    layout: str = "auto",
    block_capacity: int | None = None,
    cuda_graph: bool | None = None,
) -> HybridMLPOutput:
    """Non-gated ReLU block ``relu(x W_up^T + b_up) W_down^T + b_down`` for training, as :func:`hybrid_mlp` trains
    the gated one (same outputs: ``l1`` and the counts are those of ``relu(x W_up^T + b_up)``; names as in
    :func:`sparsefuse.twell_relu_mlp`). ``layout``: ``"auto"``, ``"block"`` or ``"dense"`` (the paper's
    ``"hybrid"`` format exists for the gated block only; ``cuda_graph`` as there; no ``l1_on``: the hidden
    representation is the gate's activation itself; ReLU only, no ``activation``: the FATReLU and dReLU models
    are gated). x [..., K]; w_up [N, K]; w_down [K, N]."""
    if layout == "hybrid":
        raise ValueError("hybrid_relu_mlp: layout must be 'auto', 'block' or 'dense'; got 'hybrid'")
    return _train_step(
        "hybrid_relu_mlp", x, w_up, b_up, None, None, w_down, b_down, layout, DEFAULT_HYBRID_WIDTH, None,
        block_capacity, gate_names=("w_up", "b_up"), cuda_graph=cuda_graph,
    )  # fmt: skip


def _train_step(
    op: str,
    x: torch.Tensor,
    w_gate: torch.Tensor,
    b_gate: torch.Tensor | None,
    w_up: torch.Tensor | None,
    b_up: torch.Tensor | None,
    w_down: torch.Tensor,
    b_down: torch.Tensor | None,
    layout: str,
    width: int,
    backup_rows: int | None,
    block_capacity: int | None,
    gate_names: tuple[str, str] = ("w_gate", "b_gate"),
    cuda_graph: bool | None = None,
    hidden_l1: bool = False,
    gate_act: tuple[str, float] = ("relu", 0.0),
) -> HybridMLPOutput:
    """Both blocks' step (``w_up=None``: non-gated): arguments checked, the layout resolved and run. ``hidden_l1``:
    the L1 term on h = h_g * h_u (gated only); ``gate_act``: (activation, threshold), checked (gated only)."""
    # the layout choice and the capacity are kept per gate weight: the caller's, not autocast's per-call copy
    gate = w_gate
    caller_weights = (w_gate, b_gate, w_up, b_up, w_down, b_down)  # a captured step casts inside its graphs
    # as F.linear under autocast: the products in the autocast dtype
    x, w_gate, w_up, w_down, b_gate, b_up, b_down = autocast_operands(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    check_ffn_mlp(op, x, w_gate, b_gate, w_up, b_up, w_down, b_down, gate_names=gate_names, dtypes=TRAIN_DTYPES)
    if layout not in LAYOUTS:
        raise ValueError(f"{op}: layout must be one of {', '.join(map(repr, LAYOUTS))}; got {layout!r}")
    check_positive_int(op, "width", width)
    check_optional_count(op, "backup_rows", backup_rows)
    check_optional_count(op, "block_capacity", block_capacity)
    x2 = unit_last_stride(flat_rows(x))
    M = x2.shape[0]
    if backup_rows is None:
        backup_rows = math.ceil(M / 8)
    out_shape = (*x.shape[:-1], w_down.shape[0])
    if layout == "auto":
        layout = TRAIN_CHOICE.choose(gate, (M, x2.shape[1], w_gate.shape[0], x2.dtype))
    else:
        PLANNER.explicit(layout, "layout")
    kernels = x2.dtype != torch.float64 and backend_for(x2) is not Backend.TORCH
    # float64 / plain CPU (non-gated), or no neuron at all: the torch ops, exact
    if layout == "dense" or (w_up is None and not kernels) or w_gate.shape[0] == 0:
        y, l1, counts, neuron_counts = dense_step(
            x2, w_gate, b_gate, w_up, b_up, w_down, b_down, hidden_l1, *gate_act
        )  # fmt: skip
        TRAIN_CHOICE.observe(gate, counts)
        return HybridMLPOutput(y.reshape(out_shape), l1, counts, neuron_counts)
    if layout == "block" and kernels:
        plan = block_plan(w_gate.shape[0])
        if cuda_graph is None:
            cuda_graph = block_capacity is None and replays_by_default(x2, w_gate.shape[0])
            explicit = False
        else:
            explicit = cuda_graph
        if cuda_graph:
            graphed = graphed_step(
                gate, x2, caller_weights, plan.block_rows, plan.tile, plan.sorts(M), warn=explicit,
                hidden_l1=hidden_l1, activation=gate_act,
            )  # fmt: skip
            if graphed is not None:
                y, l1, counts, neuron_counts = graphed
                TRAIN_CHOICE.observe(gate, counts)
                return HybridMLPOutput(y.reshape(out_shape), l1, counts, neuron_counts)
        if block_capacity is None:
            block_capacity = TRAIN_CHOICE.capacity(gate, M)
        # the kernels read weight rows and bias vectors at unit stride (a strided one is copied, differentiably)
        y, l1, counts, neuron_counts = block_mlp_train_fwd(
            x2,
            unit_last_stride(w_gate),
            unit_last_stride(b_gate),
            unit_last_stride(w_up),
            unit_last_stride(b_up),
            w_down.t(),
            unit_last_stride(b_down),
            plan.block_rows,
            plan.tile,
            plan.sorts(M),
            block_capacity,
            hidden_l1,
            *gate_act,
        )
        TRAIN_CHOICE.observe(gate, counts)
        return HybridMLPOutput(y.reshape(out_shape), l1, counts, neuron_counts)
    # weight rows at unit stride, as for the block step (the op's fake gives dW_gate, dW_up their weights' layouts)
    y, l1, *_, counts, _, _, _, neuron_counts = hybrid_mlp_fwd_op(
        x2, unit_last_stride(w_gate), b_gate, unit_last_stride(w_up), b_up, w_down.t(), b_down, width, backup_rows,
        hidden_l1, *gate_act,
    )  # fmt: skip
    return HybridMLPOutput(y.reshape(out_shape), l1, counts, neuron_counts)


def sparsity_stats(
    token_counts: torch.Tensor, neuron_counts: torch.Tensor, group: torch.distributed.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """Device scalars for logging (reading them is the caller's sync): mean, p99 and max gate non-zeros per token,
    and the fraction of neurons that fired in no token of the batch. token_counts [M] and neuron_counts [N] are a
    step's (``HybridMLPOutput``'s) counts.

    ``group``: a ``torch.distributed`` process group (e.g. ``dist.group.WORLD``) to report over the tokens of all
    its ranks (every rank must call; the statistics are then the same on each): the token counts are gathered and
    the neuron counts summed, so the p99 and the dead fraction are those of the global batch, not means of the
    ranks' own. Default: this process's batch alone (no communication)."""
    if group is not None:
        token_counts, neuron_counts = _counts_over_ranks(token_counts, neuron_counts, group)
    counts = token_counts.float()
    if counts.numel() == 0:
        nan = torch.full((), math.nan, device=counts.device)
        return {"mean_nnz": nan, "p99_nnz": nan, "max_nnz": nan, "dead_fraction": (neuron_counts == 0).float().mean()}
    return {
        "mean_nnz": counts.mean(),
        "p99_nnz": torch.quantile(counts, 0.99),
        "max_nnz": counts.max(),
        "dead_fraction": (neuron_counts == 0).float().mean(),
    }


def _counts_over_ranks(
    token_counts: torch.Tensor, neuron_counts: torch.Tensor, group: torch.distributed.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's token counts, concatenated in rank order, and the neuron counts summed over the ranks (two
    all-gathers of the lengths and counts, padded to the longest, and one all-reduce)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    length = torch.tensor([token_counts.numel()], device=token_counts.device, dtype=torch.int64)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    longest = max(int(n) for n in lengths)
    padded = token_counts.new_zeros(longest)
    padded[: token_counts.numel()] = token_counts
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    tokens = torch.cat([g[: int(n)] for g, n in zip(gathered, lengths)])
    neurons = neuron_counts.clone()
    dist.all_reduce(neurons, group=group)
    return tokens, neurons
