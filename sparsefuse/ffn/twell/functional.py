"""The public TwELL functions: arguments checked (:mod:`sparsefuse._validation`), laid out for the kernels, the
method resolved once, then the launcher (plain eager inference) or the torch.library op."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from ... import _backend
from ..._plan import AUTO, SparsityMonitor, decided
from ..._validation import (
    check_ffn_activation,
    check_ffn_bias,
    check_ffn_expected_nnz,
    check_ffn_geometry,
    check_ffn_mlp,
    check_ffn_weight,
    check_ffn_x,
    check_same_device,
    check_tensor,
    describe,
    flat_rows,
    unit_last_stride,
)
from ...sparse.formats import ELL, TwELL
from .auto import resolve_method
from .launch import DEFAULT_COMPRESSION, launch_mlp, launch_relu_mlp, launch_to_ell
from .op import twell_gate_op, twell_mlp_op, twell_relu_mlp_op, twell_to_ell_op, twell_up_down_op
from .reference import ACTIVATIONS, dense_mlp

METHODS = ("auto", "twell", "block", "dense")


def twell_down_layout(w_down: torch.Tensor) -> torch.Tensor:
    """``w_down`` [K, N] (``down_proj.weight``) with the same values laid out column-major (strides (1, K)), so
    that row n of W_down^T -- what the sparse kernels read per non-zero -- is contiguous. Returns w_down itself
    when it already is. ``F.linear`` and ``load_state_dict`` accept the result unchanged."""
    if w_down.dim() == 2 and (w_down.stride(0) == 1 or w_down.shape[0] <= 1):
        return w_down
    return w_down.t().contiguous().t()


_warned_down_copy: set[str] = set()


def _down_rows(op: str, w_down: torch.Tensor) -> torch.Tensor:
    """W_down^T [N, K] with unit column stride (a view when w_down is column-major, else one copy per call)."""
    if w_down.stride(0) == 1 or w_down.shape[0] <= 1:
        return w_down.t()
    # (one neuron: a copy of K values, no warning; none while torch.compile traces: a warning breaks its graph)
    if w_down.shape[1] > 1 and op not in _warned_down_copy and not torch.compiler.is_compiling():
        _warned_down_copy.add(op)
        warnings.warn(
            f"sparsefuse.{op}: w_down is row-major [K, N], so its rows per neuron are strided; it is "
            "copied to column-major on every call. Store it once with sparsefuse.ffn.twell_down_layout "
            "(sparsefuse.nn.SparseGatedMLP does unless down_layout='row').",
            stacklevel=4,
        )
    return w_down.t().contiguous()


def _mlp_layout(op: str, x, w_up, w_down) -> tuple[torch.Tensor, ...]:
    """(x2 [M, K], w_up, W_down^T [N, K]) as the kernels read them: unit column strides (the gate weight is read
    with any strides)."""
    x2 = unit_last_stride(flat_rows(x))
    return x2, unit_last_stride(w_up), _down_rows(op, w_down)


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def twell_gate(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    *,
    tile: int = 256,
    compression: int = DEFAULT_COMPRESSION,
    threshold: float = 0.0,
) -> TwELL:
    """Kernel 1 alone: ``relu(x @ w^T + b)`` straight into TwELL (no dense [M, N] activations in memory); with a
    ``threshold`` > 0, FATReLU: the pre-activations > threshold, unshifted.

    Args:
        x: [..., K] float32/float16/bfloat16.
        w: [N, K] (``nn.Linear`` weight, any strides), x's dtype; b: optional [N].
        tile: columns per tile, a power of two in [16, 1024]; compression: tile // compression slots per tile.
        threshold: a finite number >= 0 (0: ReLU).
    Returns: TwELL of shape [M, N] (M = x.numel() // K) with exact per-tile counts (overflowed tiles flagged).
    Inference-only.
    """
    op = "twell_gate"
    check_ffn_geometry(op, tile, compression)
    threshold = check_ffn_activation(op, "fatrelu", threshold, ACTIVATIONS)
    check_tensor(op, "w", w)
    if w.dim() != 2:
        raise ValueError(f"{op}: w must be [N, K] (nn.Linear layout); got {describe(w)}")
    check_ffn_x(op, x, w.shape[1])
    check_ffn_weight(op, "w", w, tuple(w.shape), x)
    if b is not None:
        check_ffn_bias(op, "b", b, w.shape[0], x)
    check_same_device(op, x=x, w=w, **({"b": b} if b is not None else {}))
    x2 = unit_last_stride(flat_rows(x))
    values, indices, counts = twell_gate_op(x2, w, b, tile, compression, threshold)
    return TwELL(values, indices, counts, w.shape[0], tile, compression)


def twell_up_down(
    twell: TwELL,
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    activation: str = "relu",
    threshold: float = 0.0,
) -> torch.Tensor:
    """Kernel 2 alone: ``(h_g * (x @ w_up^T + b_up)) @ w_down^T + b_down`` for gate activations ``h_g`` given as
    TwELL (from :func:`twell_gate` on ``w_gate``/``b_gate``, which are read only to recompute overflowed tiles).
    Shapes, ``activation`` and ``threshold`` as :func:`twell_mlp` (the threshold the TwELL was packed with);
    returns [..., K]. Inference-only."""
    op = "twell_up_down"
    threshold = check_ffn_activation(op, activation, threshold, ACTIVATIONS)
    check_ffn_mlp(op, x, w_gate, b_gate, w_up, b_up, w_down, b_down)
    x2, w_up, w_down_t = _mlp_layout(op, x, w_up, w_down)
    if not isinstance(twell, TwELL) or twell.shape != (x2.shape[0], w_gate.shape[0]):
        raise ValueError(
            f"{op}: twell must be a TwELL of shape [{x2.shape[0]}, {w_gate.shape[0]}]; got "
            f"{type(twell).__name__} {getattr(twell, 'shape', None)}"
        )
    check_same_device(op, x=x, twell_values=twell.values)
    if twell.values.dtype != x.dtype:
        raise TypeError(f"{op}: twell.values must have x's dtype; got {twell.values.dtype}")
    y = twell_up_down_op(
        twell.values,
        twell.indices,
        twell.counts,
        x2,
        w_gate,
        b_gate,
        w_up,
        b_up,
        w_down_t,
        b_down,
        twell.tile,
        twell.compression,
        activation,
        threshold,
    )
    return y.reshape(*x.shape[:-1], w_down.shape[0])


def twell_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    compression: int = DEFAULT_COMPRESSION,
    tile: int | None = None,
    method: str = "auto",
    expected_nnz: float | None = None,
    monitor: SparsityMonitor | None = None,
    activation: str = "relu",
    threshold: float = 0.0,
) -> torch.Tensor:
    """Gated ReLU feed-forward block ``(relu(x W_gate^T + b_gate) * (x W_up^T + b_up)) W_down^T + b_down`` (a
    transformers ``LlamaMLP`` with ``hidden_act="relu"``), skipping the up/down rows of gate activations that are 0.
    With ``activation="fatrelu"`` the gate is ``g if g > threshold else 0``; with ``"drelu"`` the up product is
    ``relu(x W_up^T + b_up)`` as well.

    Args:
        x: [..., K] float32/float16/bfloat16 (K = hidden size).
        w_gate, w_up: [N, K]; w_down: [K, N] -- ``nn.Linear`` weights, x's dtype and device. For coalesced reads
            w_down should be column-major (``w_down.stride(0) == 1``: :func:`twell_down_layout`); a row-major one is
            copied on every sparse call (warned once). Biases optional: [N], [N], [K].
        compression: C; each tile of ``tile`` columns keeps ``tile // C`` non-zeros (more are recomputed, never
            dropped). A power of two dividing the tile.
        tile: TwELL tile width (power of two, 16..1024); None: 256, or 64 for batches of <= 64 tokens.
        method: "twell" (the two fused TwELL kernels: small batches), "block" (cuBLAS gate, then the up and down
            products on tensor cores over each 64-token block's union of fired neurons: large batches), "dense"
            (three cuBLAS matmuls), or "auto": the fastest predicted (:func:`predicted_times`,
            :func:`predicted_block_time`) for the batch's mean non-zeros per token, a sparse method only if it beats
            dense by the margin. The estimate comes from ``expected_nnz``, else ``monitor``, else a running estimate
            kept per ``w_gate`` tensor (its first call counts a probe of <= 64 tokens: one host sync in the weight's
            life; later calls do not sync).
        monitor: a :class:`SparsityMonitor` updated by this call (without a sync) from all the batch's tokens.
        activation: the gate activation: "relu"; "fatrelu" (ProSparse-Llama-2, MiniCPM-S), a neuron firing where its
            gate pre-activation g > ``threshold`` with the value g itself; "drelu" (TurboSparse, Bamboo),
            ``relu(gate) * relu(up)``, so a neuron contributes only where both fire.
        threshold: FATReLU's, a finite number >= 0 (0 is ReLU); only with ``activation="fatrelu"``. Each method
            compares the pre-activation it holds (fp32 in the fused kernel, x's dtype from cuBLAS) with it exactly;
            a pre-activation within rounding of the threshold may fire on one method and not another.
    Returns: [..., K] in x's dtype; fp32 accumulation. When autograd needs a gradient the dense computation runs
    (differentiable); the sparse kernels are inference-only.
    """
    op = "twell_mlp"
    if method not in METHODS:
        raise ValueError(f"{op}: method must be one of {', '.join(METHODS)}; got {method!r}")
    threshold = check_ffn_activation(op, activation, threshold, ACTIVATIONS)
    gate = (activation, threshold)
    check_ffn_geometry(op, tile, compression)
    check_ffn_expected_nnz(op, expected_nnz)
    check_ffn_mlp(op, x, w_gate, b_gate, w_up, b_up, w_down, b_down)
    x2, w_up, w_down_t = _mlp_layout(op, x, w_up, w_down)
    out_shape = (*x.shape[:-1], w_down.shape[0])
    if _needs_grad(x, w_gate, w_up, w_down, b_gate, b_up, b_down):
        decided(op, "dense", "autograd needs a gradient: the sparse kernels are inference-only", "autograd")
        return dense_mlp(x2, w_gate, b_gate, w_up, b_up, w_down_t.t(), b_down, *gate).reshape(out_shape)
    method = resolve_method(
        method,
        x2,
        w_gate,
        b_gate,
        expected_nnz,
        monitor,
        warm_up=lambda m: launch_mlp(
            x2, w_gate, b_gate, w_up, b_up, w_down_t, b_down, tile or 0, compression, m, False, *gate
        ),
        threshold=threshold,
    )
    # Counting costs a few launches: only when the monitor would take the count (none in flight, not capturing).
    with_stats = monitor is not None and not torch.compiler.is_compiling() and monitor.accepts
    args = (x2, w_gate, b_gate, w_up, b_up, w_down_t, b_down, tile or 0, compression, method, with_stats, *gate)
    # Plain eager inference skips the dispatcher (tens of microseconds per call: it matters for decode batches).
    fast = method != AUTO and _backend.bypass_dispatcher(*(t for t in args[:7] if t is not None))
    y, stats = launch_mlp(*args) if fast else twell_mlp_op(*args)
    if with_stats:
        monitor.observe(stats)
    return y.reshape(out_shape)


def twell_relu_mlp(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    compression: int = DEFAULT_COMPRESSION,
    tile: int | None = None,
    method: str = "twell",
) -> torch.Tensor:
    """Non-gated ReLU block ``relu(x W_up^T + b_up) W_down^T + b_down``: kernel 1 on W_up, TwELL -> ELL on the
    device, the shared :func:`sparsefuse.sparse.sparse_matmul`, overflowed tiles recomputed and added in place.

    Args: x [..., K]; w_up [N, K]; w_down [K, N] (column-major preferred, see :func:`twell_mlp`); biases [N], [K];
    method "twell" or "dense". Returns [..., K] in x's dtype. Dense (differentiable) under autograd.
    """
    op = "twell_relu_mlp"
    if method not in ("twell", "dense"):
        raise ValueError(f"{op}: method must be 'twell' or 'dense'; got {method!r}")
    check_ffn_geometry(op, tile, compression)
    check_ffn_mlp(op, x, w_up, b_up, None, None, w_down, b_down, gate_names=("w_up", "b_up"))
    x2, _, w_down_t = _mlp_layout(op, x, None, w_down)
    out_shape = (*x.shape[:-1], w_down.shape[0])
    if method == "dense" or _needs_grad(x, w_up, w_down, b_up, b_down):
        return F.linear(torch.relu(F.linear(x2, w_up, b_up)), w_down_t.t(), b_down).reshape(out_shape)
    args = (x2, w_up, b_up, w_down_t, b_down, tile or 0, compression)
    fast = _backend.bypass_dispatcher(*(t for t in args[:5] if t is not None))
    return (launch_relu_mlp(*args) if fast else twell_relu_mlp_op(*args)).reshape(out_shape)


def twell_to_ell(twell: TwELL) -> ELL:
    """Pack TwELL rows into ELL of the same width on the device (no host sync), for the shared
    :func:`sparsefuse.sparse.sparse_matmul`. Overflowed tiles are **left out** (their entries are incomplete), so
    the ELL's counts are the stored entries of the complete tiles; check ``twell.overflowed()`` and complete those
    tiles separately (as :func:`twell_relu_mlp` does)."""
    args = (twell.values, twell.indices, twell.counts, twell.n_cols, twell.tile, twell.compression)
    if _backend.bypass_dispatcher(twell.values, twell.indices, twell.counts):
        return launch_to_ell(*args)
    values, indices, counts = twell_to_ell_op(*args)
    return ELL(values, indices, counts, twell.n_cols)
