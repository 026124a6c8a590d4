"""A gated ReLU feed-forward block whose parameters (and state_dict keys) are transformers' ``LlamaMLP``'s.

``forward(x) = down_proj(relu(gate_proj(x)) * up_proj(x))`` (``activation="fatrelu"``: the gate fires above
``threshold``; ``"drelu"``: the up product is ReLU'd too), run by :func:`sparsefuse.ffn.twell_mlp`: the gate
matmul writes TwELL and only the fired rows of up_proj / down_proj are read. ``down_proj.weight`` keeps its
[hidden, intermediate] shape but is stored column-major (``stride(0) == 1``) so that each neuron's row of
W_down^T is contiguous; ``load_state_dict`` copies into that layout, ``.to()`` preserves it, and ``F.linear`` reads
it as is. ``method="auto"`` decides from the estimate of the non-zeros per token that :func:`twell_mlp` keeps per gate
weight (one host sync in the weight's life, then sync-free samples ever more rarely). A plain eager call for which
that choice is dense runs the dense ops directly, at ``LlamaMLP``'s host cost; :attr:`SparseGatedMLP.monitor`
reads the estimate. Inference uses the sparse kernels. When autograd needs gradients, ``train_method`` decides:
``"auto"`` (default) runs ``LlamaMLP``'s ops until the gate's firing has been counted (by those ops, without a sync) and
then whichever step the planner predicts faster -- the sparse step once the gate is sparse (below ~1% firing), the dense
ops before; ``"dense"`` always ``LlamaMLP``'s ops; ``"hybrid"`` always the sparse training step
(:func:`sparsefuse.ffn.hybrid.hybrid_mlp`); all leave the step's L1 term in :attr:`SparseGatedMLP.last_l1` and its
firing statistics in :meth:`SparseGatedMLP.sparsity_report`; ``train_cuda_graph`` (hybrid_mlp's ``cuda_graph``; default
None: where the host would pace the step) replays the hybrid step from CUDA graphs.
``down_layout="row"`` keeps ``down_proj.weight`` row-major (contiguous), as FSDP2's ``fully_shard`` requires of
the parameters it shards; the sparse kernels then copy W_down^T once per call.

The module tree is ``LlamaMLP``'s (``gate_proj``, ``up_proj``, ``down_proj``, ``act_fn``), and so is what hooks see:
while any of those submodules has a hook (forward, forward-pre or backward, a forward wrapped on the instance; or a
global module hook is set) or is not a plain ``nn.Linear`` / ``nn.ReLU`` (a LoRA or quantised projection, a
parametrization), the forward calls the submodules as ``LlamaMLP`` does -- the dense ops, every hook run, whatever
a hook returns used -- instead of handing their weights to the kernels. So do inputs the kernels do not take
(float64) under ``method="auto"``.

What a forward leaves for the step (``last_l1``, the eager choices) is not part of the module's state: a copy
(``copy.deepcopy``, pickling) starts without it, so a copy never holds the step's autograd graph, and a forward
without gradients clears ``last_l1`` (a later :func:`~sparsefuse.integrations.transformers.l1_loss` cannot
return a stale term). ``state_dict()`` holds ``down_proj.weight`` contiguous, as ``LlamaMLP``'s (a copy of the
column-major weight: what safetensors and other writers require; ``keep_vars=True`` gives the Parameter itself).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from .._plan import SparsityMonitor, decided, explaining, observable, sampled_nonzero_stats
from .._validation import FLOAT_DTYPES, check_ffn_activation
from ..ffn.hybrid import hybrid_mlp, sparsity_stats
from ..ffn.hybrid.choice import TRAIN_CHOICE
from ..ffn.hybrid.reference import L1_TERMS
from ..ffn.twell import DEFAULT_COMPRESSION, METHODS, twell_down_layout, twell_mlp
from ..ffn.twell.auto import ESTIMATES, eager_runs_dense
from ..ffn.twell.launch import STATS_TOKENS
from ..ffn.twell.reference import dense_gated, gate_activation
from ..sparse.compact import DEFAULT_HYBRID_WIDTH

# How a forward that needs gradients runs: "dense" (LlamaMLP's ops) or "hybrid" (the sparse training step).
TRAIN_METHODS = ("auto", "dense", "hybrid")
# What a forward leaves for the step or for later calls; a copy or a pickle of the module starts without it.
_STEP_STATE = {"last_l1": None, "_eager_choice_weight": None}


class FATReLU(nn.Module):
    """The FATReLU gate (ProSparse, MiniCPM-S): ``g`` where ``g > threshold``, 0 elsewhere (the value unshifted);
    what a :class:`SparseGatedMLP` with ``activation="fatrelu"`` holds as its ``act_fn``."""

    def __init__(self, threshold: float) -> None:
        super().__init__()
        self.threshold = threshold

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return gate_activation(g, self.threshold)

    def extra_repr(self) -> str:
        return f"threshold={self.threshold}"


class SparseGatedMLP(nn.Module):
    """Parameters: gate_proj.weight [intermediate, hidden], up_proj.weight [intermediate, hidden],
    down_proj.weight [hidden, intermediate] (+ biases when ``bias=True``, as ``LlamaConfig(mlp_bias=True)``)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool = False,
        compression: int = DEFAULT_COMPRESSION,
        tile: int | None = None,
        method: str = "auto",
        train_method: str = "auto",
        train_width: int = DEFAULT_HYBRID_WIDTH,
        down_layout: str = "column",
        train_cuda_graph: bool | None = None,
        l1_on: str = "gate",
        activation: str = "relu",
        threshold: float = 0.0,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, **kw)
        self.act_fn: nn.Module = nn.ReLU()  # LlamaMLP's module tree: a hook on act_fn sees the gate activations
        self.activation, self.threshold = "relu", 0.0
        self.train_width = train_width
        self.configure(
            compression=compression,
            tile=tile,
            method=method,
            train_method=train_method,
            down_layout=down_layout,
            train_cuda_graph=train_cuda_graph,
            l1_on=l1_on,
            activation=activation,
            threshold=threshold,
        )
        self._register_state_dict_hook(_contiguous_down_weight)
        self.last_l1: torch.Tensor | None = None  # the last training step's L1 term (differentiable)
        self._sparse_training = False  # train_method="auto": whether the latest eager step ran the sparse step
        self._last_counts: tuple[torch.Tensor, torch.Tensor] | None = None  # (per token, per neuron) firing counts
        self._eager_choice: dict[tuple[int, torch.dtype], bool] = {}  # (tokens, dtype) -> auto runs dense
        self._eager_choice_weight: torch.Tensor | None = None  # the gate weight those choices were made for
        # dense eager calls made; the count at which the next sample of the gate's sparsity is taken
        self._eager_calls, self._next_sample = 0, None  # None: the knob's observe_every, read at the first call

    def configure(
        self,
        *,
        compression: int = DEFAULT_COMPRESSION,
        tile: int | None = None,
        method: str = "auto",
        train_method: str = "auto",
        down_layout: str = "column",
        train_cuda_graph: bool | None = None,
        l1_on: str | None = None,
        activation: str | None = None,
        threshold: float | None = None,
    ) -> None:
        """Set how the module runs (the constructor's keywords; what :func:`patch_llama` on a patched model calls),
        re-laying ``down_proj.weight`` out in place where ``down_layout`` changes. ``l1_on``: what :attr:`last_l1`
        is taken on, ``"gate"`` or ``"hidden"`` (:func:`~sparsefuse.ffn.hybrid.hybrid_mlp`'s ``l1_on``; the
        attribute of that name may also be set directly); None keeps the module's choice. ``activation`` /
        ``threshold``: the gate (:func:`~sparsefuse.ffn.twell_mlp`'s: "relu", "fatrelu" with its threshold, "drelu");
        None keeps the module's; a new one sets :attr:`act_fn` to its module (:class:`FATReLU` or ``nn.ReLU``)."""
        if method not in METHODS:
            raise ValueError(f"SparseGatedMLP: method must be one of {', '.join(METHODS)}; got {method!r}")
        if train_method not in TRAIN_METHODS:
            raise ValueError(
                f"SparseGatedMLP: train_method must be one of {', '.join(TRAIN_METHODS)}; got {train_method!r}"
            )
        if down_layout not in ("column", "row"):
            raise ValueError(f"SparseGatedMLP: down_layout must be 'column' or 'row'; got {down_layout!r}")
        self.compression, self.tile, self.method = compression, tile, method
        self.train_method, self.down_layout = train_method, down_layout
        # hybrid training: replay the step from CUDA graphs captured per input shape (hybrid_mlp's cuda_graph:
        # None lets it decide by the layer's size)
        self.train_cuda_graph = train_cuda_graph
        if l1_on is not None:
            _check_l1_on(l1_on)
            self.l1_on = l1_on
        if activation is not None or threshold is not None:
            activation = self.activation if activation is None else activation
            threshold = check_ffn_activation("SparseGatedMLP", activation, 0.0 if threshold is None else threshold)
            if (activation, threshold) != (self.activation, self.threshold):
                self.activation, self.threshold = activation, threshold
                self.act_fn = FATReLU(threshold) if activation == "fatrelu" else nn.ReLU()
        self.relayout_down_proj()

    @torch.no_grad()
    def relayout_down_proj(self) -> None:
        """Store down_proj.weight column-major in place (same Parameter object, same values); nothing with
        ``down_layout="row"``."""
        weight = self.down_proj.weight
        if self.down_layout == "row":
            if weight.device.type != "meta" and not weight.is_contiguous():
                weight.data = weight.data.contiguous()
            return
        if weight.device.type != "meta" and weight.stride(0) != 1 and weight.shape[1] > 1:
            weight.data = twell_down_layout(weight.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.down_layout == "column" and self.down_proj.weight.stride(0) != 1 and not torch.compiler.is_compiling():
            self.relayout_down_proj()  # a new weight was assigned or loaded with another layout
        wants_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters()))
        if not wants_grad:
            self.last_l1 = None  # no differentiable term for this forward: l1_loss must not return an older one
        if self._runs_submodules(x):
            return self._submodule_forward(x, wants_grad)
        if wants_grad:
            if self.train_method == "dense":  # (the sparse step's layout is hybrid_mlp's planner's to explain)
                decided("twell_mlp", "dense", "a gradient is wanted: train_method='dense'", "explicit")
            return self._train_forward(x)
        if self.method == "auto" and x.is_cuda and self._eager_dense(x):
            return self._dense_forward(x)
        return twell_mlp(
            x,
            self.gate_proj.weight,
            self.up_proj.weight,
            self.down_proj.weight,
            b_gate=self.gate_proj.bias,
            b_up=self.up_proj.bias,
            b_down=self.down_proj.bias,
            compression=self.compression,
            tile=self.tile,
            method=self.method,
            activation=self.activation,
            threshold=self.threshold,
        )

    def _runs_submodules(self, x: torch.Tensor) -> bool:
        """Whether this forward calls the submodules as ``LlamaMLP`` does (see the module docstring): a hook on one
        of them (or a global module hook), a submodule that is not a plain Linear / ReLU, or (under ``auto``) a
        dtype the kernels do not take. A few dict lookups: an eager call's host time barely moves."""
        if self.method == "auto" and x.dtype not in FLOAT_DTYPES:
            return True
        for module, plain in (
            (self.gate_proj, nn.Linear),
            (self.up_proj, nn.Linear),
            (self.down_proj, nn.Linear),
            (self.act_fn, FATReLU if self.activation == "fatrelu" else nn.ReLU),
        ):
            if type(module) is not plain or _has_hooks(module):
                return True
        return _global_hooks_set()

    def _submodule_forward(self, x: torch.Tensor, wants_grad: bool) -> torch.Tensor:
        """``LlamaMLP.forward`` itself: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, every submodule called (and
        its hooks run) in LlamaMLP's order; a forward with gradients records the step's L1 term and counts from
        the activations as the hooks left them."""
        h_gate = self.act_fn(self.gate_proj(x))
        h = h_gate * self._up(self.up_proj(x), self.act_fn)
        if wants_grad:
            self._record_step(h_gate, h)
        return self.down_proj(h)

    def _record_step(self, h_gate: torch.Tensor, h: torch.Tensor) -> None:
        """The dense step's L1 term (the mean per element of the gate activations, or with ``l1_on="hidden"`` of
        |h|, h = h_gate * up) and firing counts."""
        fired = (h_gate > 0).reshape(-1, h_gate.shape[-1])
        _check_l1_on(self.l1_on)
        if self.l1_on == "hidden":
            self.last_l1 = h.abs().sum(dtype=torch.float32) / max(h.numel(), 1)
        else:
            self.last_l1 = h_gate.sum(dtype=torch.float32) / max(h_gate.numel(), 1)
        self._last_counts = (fired.sum(1, dtype=torch.int32), fired.sum(0, dtype=torch.int32))

    def __getstate__(self) -> dict:
        # copies and pickles start without the step's state (see the module docstring)
        state = dict(self.__dict__, **_STEP_STATE, _eager_choice={})
        state.pop("_compiled_call_impl", None)  # as nn.Module's own __getstate__ (absent from some torch versions)
        return state

    def _eager_dense(self, x: torch.Tensor) -> bool:
        """Whether this call is a plain eager CUDA call for which ``auto`` runs dense (its host time is lower: a
        decode step run from Python is host-bound). Such calls skip the functional API (its checks and method
        choice cost more host time than the five dense ops themselves) and run :meth:`_dense_forward`; the answer
        is kept per (tokens, dtype) until the next sample of the gate's sparsity. False for the call that makes
        that answer (it goes through :func:`twell_mlp`, which makes the estimate on a new weight and warms up the
        kernels a later capture will run), and for compiled or captured calls (they always go through it)."""
        if not observable(x) or x.shape[-1] != self.hidden_size or explaining():
            return False
        weight = self.gate_proj.weight
        if self._eager_choice_weight is not weight:  # a new gate weight has its own estimate
            self._eager_choice.clear()
            self._eager_choice_weight = weight
        key = (x.numel() // self.hidden_size, x.dtype)
        choice = self._eager_choice.get(key)
        if choice is None:
            # This call still goes through twell_mlp: for a new batch size it compiles and tunes the kernels a
            # later CUDA-graph capture of the same call will launch (a capture cannot), and it feeds the estimate.
            choice = eager_runs_dense(weight, *key)
            if choice is not None:  # None: no estimate yet
                self._eager_choice[key] = choice
            return False
        return choice

    def _dense_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``LlamaMLP``'s computation (three cuBLAS matmuls, ReLU, product) on x [..., K]. Now and then (on the
        per-weight estimates' schedule, :meth:`EstimateCache.next_sample_at`) the gate activations are counted on the
        device for the gate weight's estimate (no sync) and the cached eager choices are dropped, so they follow
        the sparsity."""
        y, h_gate, _ = self._dense(x)
        self._eager_calls += 1
        if self._next_sample is None:
            self._next_sample = ESTIMATES.observe_every
        if self._eager_calls >= self._next_sample:
            stats = sampled_nonzero_stats(h_gate.reshape(-1, h_gate.shape[-1]), STATS_TOKENS)
            ESTIMATES.observe(self.gate_proj.weight, stats)
            self._next_sample = ESTIMATES.next_sample_at(self._eager_calls)
            self._eager_choice.clear()
        return y

    def _dense(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(y, gate activations, h) of the dense block (:func:`~sparsefuse.ffn.twell.reference.dense_gated`)."""
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        weights = (gate.weight, gate.bias, up.weight, up.bias, down.weight, down.bias)
        return dense_gated(x, *weights, self.activation, self.threshold)

    def _up(self, u: torch.Tensor, act: nn.Module) -> torch.Tensor:
        """The up product as the gate multiplies it where the submodules are called: ReLU'd by the module's own
        ``act`` for dReLU (its hooks run), as is otherwise."""
        return act(u) if self.activation == "drelu" else u

    def _train_forward(self, x: torch.Tensor) -> torch.Tensor:
        """A forward whose gradients are wanted: ``train_method="hybrid"`` runs the sparse training step
        (:func:`sparsefuse.ffn.hybrid.hybrid_mlp`: only sparse activations kept for the backward), ``"dense"`` the
        dense block as ``LlamaMLP`` does. Either way :attr:`last_l1` holds the step's L1 term and
        :meth:`sparsity_report` its firing statistics."""
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        if self.train_method == "hybrid" or (self.train_method == "auto" and self._trains_sparse(x)):
            out = hybrid_mlp(
                x,
                gate.weight,
                up.weight,
                down.weight,
                # auto has just picked the block step: hybrid_mlp need not ask the planner again
                layout="block" if self.train_method == "auto" else "auto",
                b_gate=gate.bias,
                b_up=up.bias,
                b_down=down.bias,
                width=self.train_width,
                cuda_graph=self.train_cuda_graph,
                l1_on=self.l1_on,
                activation=self.activation,
                threshold=self.threshold,
            )
            self.last_l1, self._last_counts = out.l1, (out.token_counts, out.neuron_counts)
            return out.y
        y, h_gate, h = self._dense(x)
        self._record_step(h_gate, h)
        if self.train_method == "auto":
            TRAIN_CHOICE.observe(gate.weight, self._last_counts[0])  # sync-free, now and then
        return y

    def _trains_sparse(self, x: torch.Tensor) -> bool:
        """``train_method="auto"``: whether this step runs the sparse step (see the module docstring). A traced
        call takes the latest eager step's answer (guarded: a change recompiles, as ``hybrid_mlp``'s layout does)."""
        if torch.compiler.is_compiling():
            return self._sparse_training
        question = (x.numel() // max(x.shape[-1], 1), self.hidden_size, self.intermediate_size, x.dtype)
        self._sparse_training = TRAIN_CHOICE.choose_for_module(self.gate_proj.weight, question) == "block"
        return self._sparse_training

    def sparsity_report(self, group: torch.distributed.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
        """The last training step's gate statistics as device scalars (reading them is the caller's sync): mean,
        p99 and max non-zeros per token, and the fraction of neurons that fired in no token of the batch. ``group``:
        report over the tokens of all that process group's ranks (see :func:`~sparsefuse.ffn.sparsity_stats`);
        default: this process's batch."""
        if self._last_counts is None:
            raise RuntimeError("SparseGatedMLP.sparsity_report: no training step has run yet")
        return sparsity_stats(*self._last_counts, group=group)

    @property
    def monitor(self) -> SparsityMonitor | None:
        """The running estimate of the gate's non-zeros per token that ``method="auto"`` uses (None before the first
        eager call); ``monitor.estimate()`` reads it without a sync."""
        return ESTIMATES.monitor(self.gate_proj.weight)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
            f"compression={self.compression}, method={self.method!r}, train_method={self.train_method!r}"
            + ("" if self.activation == "relu" else f", activation={self.activation!r}, threshold={self.threshold}")
        )


def _check_l1_on(l1_on: str) -> None:
    if l1_on not in L1_TERMS:
        raise ValueError(f"SparseGatedMLP: l1_on must be one of {', '.join(map(repr, L1_TERMS))}; got {l1_on!r}")


def _has_hooks(module: nn.Module) -> bool:
    """Hooks registered on the module, or a forward set on the instance (accelerate's hooks wrap it so)."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or "forward" in module.__dict__
    )


def _global_hooks_set() -> bool:
    return bool(
        _torch_module._global_forward_hooks
        or _torch_module._global_forward_pre_hooks
        or _torch_module._global_backward_hooks
        or _torch_module._global_backward_pre_hooks
    )


def _contiguous_down_weight(module: SparseGatedMLP, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """state_dict hook: ``down_proj.weight`` as ``LlamaMLP`` holds it (contiguous), unless the Parameter itself was
    asked for (``keep_vars=True``)."""
    key = prefix + "down_proj.weight"
    weight = state_dict.get(key)
    if isinstance(weight, torch.Tensor) and not isinstance(weight, nn.Parameter) and not weight.is_contiguous():
        state_dict[key] = weight.contiguous()
