"""The ``torch.library`` ops of the TwELL blocks (``sparsefuse::twell_gate``, ``twell_up_down``, ``twell_mlp``,
``twell_relu_mlp``, ``twell_to_ell``): what torch.compile, export and autograd see. Their bodies call the launchers;
tensors arrive laid out as :mod:`.launch` expects. The ops are inference-only: backward raises rather than return
wrong gradients (the functional API runs the dense, differentiable block whenever autograd needs a gradient)."""

from __future__ import annotations

import torch

from ..._backend import on_tensor_device
from .auto import resolve_method
from .launch import launch_gate, launch_mlp, launch_relu_mlp, launch_to_ell, launch_up_down


def _inference_only(ctx, *grads):
    raise RuntimeError(
        "sparsefuse TwELL ops are inference-only (no backward through the sparse format). Call sparsefuse.twell_mlp "
        "/ twell_relu_mlp (they use the dense, differentiable computation whenever autograd needs gradients) or "
        "run under torch.no_grad()"
    )


def _no_context(ctx, inputs, output) -> None:
    pass


@torch.library.custom_op("sparsefuse::twell_gate", mutates_args=())
@on_tensor_device
def twell_gate_op(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, tile: int, compression: int, threshold: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return launch_gate(x, w, b, tile, compression, threshold=threshold)[:3]


@twell_gate_op.register_fake
def _(x, w, b, tile, compression, threshold=0.0):
    # -(-a // b), not _backend.cdiv: under dynamic shapes w.shape[0] is a SymInt, and cdiv's (a + b - 1) // b form
    # fails opcheck's dynamic-shape test (unhashable SymInt) where this one traces
    M, n_tiles = x.shape[0], -(-w.shape[0] // tile)
    width = n_tiles * (tile // compression)
    return (
        x.new_empty((M, width)),
        x.new_empty((M, width), dtype=torch.int32),
        x.new_empty((M, n_tiles), dtype=torch.int32),
    )


@torch.library.custom_op("sparsefuse::twell_up_down", mutates_args=())
@on_tensor_device
def twell_up_down_op(
    values: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    x: torch.Tensor,
    w_gate: torch.Tensor,
    b_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    b_up: torch.Tensor | None,
    w_down_t: torch.Tensor,
    b_down: torch.Tensor | None,
    tile: int,
    compression: int,
    activation: str = "relu",
    threshold: float = 0.0,
) -> torch.Tensor:
    return launch_up_down(
        values, indices, counts, x, w_gate, b_gate, w_up, b_up, w_down_t, b_down, tile, compression, None,
        activation, threshold,
    )  # fmt: skip


@twell_up_down_op.register_fake
def _(
    values, indices, counts, x, w_gate, b_gate, w_up, b_up, w_down_t, b_down, tile, compression, activation="relu",
    threshold=0.0,
):  # fmt: skip
    return x.new_empty(x.shape)


@torch.library.custom_op("sparsefuse::twell_mlp", mutates_args=())
@on_tensor_device
def twell_mlp_op(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    b_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    b_up: torch.Tensor | None,
    w_down_t: torch.Tensor,
    b_down: torch.Tensor | None,
    tile: int,
    compression: int,
    method: str,
    with_stats: bool,
    activation: str = "relu",
    threshold: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    # "auto" reaches the op from a graph compiled without an estimate (and from direct callers): decided now, with
    # real tensors, as the planner decides an eager call or a capture.
    if method == "auto":
        method = resolve_method("auto", x, w_gate, b_gate, None, None, at_run_time=True, threshold=threshold)
    return launch_mlp(
        x, w_gate, b_gate, w_up, b_up, w_down_t, b_down, tile, compression, method, with_stats, activation, threshold
    )


@twell_mlp_op.register_fake
def _(
    x, w_gate, b_gate, w_up, b_up, w_down_t, b_down, tile, compression, method, with_stats, activation="relu",
    threshold=0.0,
):  # fmt: skip
    return x.new_empty((x.shape[0], w_down_t.shape[1])), x.new_empty((2 if with_stats else 0,), dtype=torch.int64)


@torch.library.custom_op("sparsefuse::twell_relu_mlp", mutates_args=())
@on_tensor_device
def twell_relu_mlp_op(
    x: torch.Tensor,
    w_up: torch.Tensor,
    b_up: torch.Tensor | None,
    w_down_t: torch.Tensor,
    b_down: torch.Tensor | None,
    tile: int,
    compression: int,
) -> torch.Tensor:
    return launch_relu_mlp(x, w_up, b_up, w_down_t, b_down, tile, compression)


@twell_relu_mlp_op.register_fake
def _(x, w_up, b_up, w_down_t, b_down, tile, compression):
    return x.new_empty((x.shape[0], w_down_t.shape[1]))


@torch.library.custom_op("sparsefuse::twell_to_ell", mutates_args=())
@on_tensor_device
def twell_to_ell_op(
    values: torch.Tensor, indices: torch.Tensor, counts: torch.Tensor, n_cols: int, tile: int, compression: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ell = launch_to_ell(values, indices, counts, n_cols, tile, compression)
    return ell.values, ell.indices, ell.counts


@twell_to_ell_op.register_fake
def _(values, indices, counts, n_cols, tile, compression):
    M = values.shape[0]
    return values.new_empty(values.shape), indices.new_empty(values.shape), counts.new_empty((M,))


for _op in (twell_gate_op, twell_up_down_op, twell_mlp_op, twell_relu_mlp_op, twell_to_ell_op):
    _op.register_autograd(_inference_only, setup_context=_no_context)
