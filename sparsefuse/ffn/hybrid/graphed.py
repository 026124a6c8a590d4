"""The block training step replayed from CUDA graphs (``hybrid_mlp(..., cuda_graph=True)``, and by default where the
host would pace the eager step: :func:`replays_by_default`).

A plain eager block step enqueues ~15 Triton launches, ~10 torch ops and their Python: 2-3.5 ms of host time per
layer forward + backward on H100 and H200 machines, more than the GPU's ~1.8 ms at the 1.5B layer shape, so an
eager model waits on its host. Here each layer's forward and backward are captured once as two CUDA graphs and a
step costs the host two replays and a few copies.

How it stays correct:

* **Inputs and outputs go through buffers outside the graphs.** Every layer of one shape shares one set of static
  buffers (x, dy, y, dx, the weight gradients; the kernels write y, dx and the weight gradients into theirs
  directly); a replay is *copy in, replay, copy out*, so no graph's output is read after another replay, and all
  graphs share one memory pool for their temporaries (the products' [M, N] intermediates exist once, not once per
  layer).
* **What the backward keeps is copied out per call** (the packed pairs, ~6 bytes per fired pair, and the unions'
  lists, in one flat buffer), so forwards and backwards may interleave in any order (micro-batches, pipelines).
* **Weights are read in place**: a graph is keyed by the addresses of the caller's weights and biases (an
  optimizer's in-place update is seen; a parameter moved or replaced once is a new key and a new capture). Casts for
  ``torch.autocast`` happen inside the graphs.
* **Weights that keep moving are copied in**: a layer whose weights turn up at new addresses more than
  ``move_limit`` times (FSDP2 gathers each unit's parameters into fresh storage every step) is captured once more
  reading its weights from static copies, shared by every layer of those shapes, which each forward and backward
  replay fills first: two weight copies per layer and step (69 MB each for bf16 weights at the 1.5B layer shape,
  ~0.05 ms each on an H100 by its bandwidth, a row-major w_down's by a tiled transpose at about the same rate;
  twice that for fp32 master weights), where an eager step costs its host 2-3.5 ms.
* **The capacity is bucketed**: pairs kept per token are rounded up to a power of two of the weight's observed need
  (as under torch.compile) and held until the need outgrows it or falls below a quarter of it, so a layer is
  re-captured a few times while L1 bites, not at every observation. Until a weight has an observation the eager
  step runs. Blocks past the capacity are recomputed in the backward, as in the eager step.
* **Where a replay cannot be right, the eager step runs**: under saved-tensor hooks (activation checkpointing,
  whose recompute must save what its forward saved; offloading), inside a backward, without grad, under
  torch.compile or with tensor subclasses. A weight that moved between forward and backward (a parameter regathered
  at another address) gets its backward run eagerly on the kept arrays; an in-place change to a weight in between
  raises, as in the eager step.
* **Where a replay cannot pay, the eager step runs**: a layer past ``capture_limit`` captures (input shapes that
  keep changing) runs eagerly for good. These limits, and the captures kept per gate weight, are knobs of
  ``hybrid_mlp`` (:class:`.choice.TrainKnobs`).
* **What it costs**: the shared pool keeps the step's temporaries for good, where the eager step hands them back to
  the caching allocator between layers (+2.3 GB reserved in a 24-layer 1.5B-shape model at 4 x 2048 tokens).

Under the Triton interpreter (CPU tests) a "graph" re-runs the captured function on replay, so the copy-in / copy-out
logic is tested without a GPU; the CUDA path is covered by the GPU suite.
"""

from __future__ import annotations

import collections
import contextlib
import math
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..._backend import Backend, backend_for, cdiv, new_output, new_output_layout_like, plain_eager_call
from ..._plan import call_context
from ..._validation import autocast_off, unit_last_stride
from ...sparse.layout import unit_rows
from .block_step import _train_backward_into, _train_forward, _train_forward_into, _weight_grads
from .choice import PLANNER, TRAIN_CHOICE, _in_backward

# How many times the graphs have been captured and replayed (forward replays; "copied replay": those of a step
# reading copied weights), and backwards that ran eagerly because a weight had moved since its forward; for tests
# and logs.
GRAPH_EVENTS: collections.Counter[str] = collections.Counter()

_LAYERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # gate weight -> _LayerGraphs (dies with the layer)
_COPIED = "copied"  # a key's addresses for a step reading copied weights
# Static buffers shared by the steps alive (each step holds its sets; a set no step holds is freed).
_BUFFERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_POOLS: dict[torch.device, object] = {}
# The graphs alive in each device's pool. A pool whose graphs are all gone is left to the allocator to free, never
# captured into again (the caching allocator asserts on that): the next capture takes a new pool.
_POOL_GRAPHS: dict[torch.device, weakref.WeakSet] = {}
_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # one side stream per device for captures
_ALIGN = 16  # bytes: each kept array starts aligned in the flat buffer (the kernels' vector loads)


def release_graphs() -> None:
    """Drop every captured step, the shared buffers and the memory pools, and forget which layers' weights moved
    (the next graphed call captures anew, reading the weights in place)."""
    _LAYERS.clear()
    _BUFFERS.clear()
    _POOLS.clear()
    _POOL_GRAPHS.clear()


@dataclass(eq=False)
class _LayerGraphs:
    """One layer's replay state, kept per gate weight: its captured steps (most recently used last), the captures it
    has taken, where its weights were last found and how many times they had moved."""

    steps: collections.OrderedDict = field(default_factory=collections.OrderedDict)  # key -> GraphedBlockStep
    captures: int = 0
    addresses: tuple[int | None, ...] | None = None
    moves: int = 0


@dataclass(eq=False)
class _TokenBuffers:
    """A shape's per-token static tensors: x and dx in x's dtype (the step's), y and dy in the step's, the counts."""

    x: torch.Tensor
    dy: torch.Tensor
    y: torch.Tensor
    dx: torch.Tensor
    counts: torch.Tensor


@dataclass(eq=False)
class _WeightBuffers:
    """The weights' static gradients (in the weights' dtypes; w_down's as its transpose [N, K], laid out so that
    its transpose has w_down's strides), l1 and its gradient: one set per weight shapes and w_down layout, whatever
    the token count."""

    dl1: torch.Tensor
    l1: torch.Tensor
    dw: list[torch.Tensor | None]
    db: list[torch.Tensor | None]


@dataclass(eq=False)
class _WeightCopies:
    """Static copies of a layer's weights and biases (None where absent), for steps whose callers' weights move:
    one set per weight shapes, dtypes and strides, shared by every such layer."""

    tensors: tuple[torch.Tensor | None, ...]

    def fill(self, weights: tuple) -> None:
        for copy, w in zip(self.tensors, weights):
            if copy is None:
                continue
            if copy.stride() != w.stride() and copy.dim() == 2 and copy.t().is_contiguous() and w.dtype == copy.dtype:
                unit_rows(w.t(), out=copy.t())  # a row-major w_down into its column-major copy: the tiled transpose
            else:
                copy.copy_(w)


def _shared(key: tuple, make: Callable[[], object]):
    """The static buffer set under ``key`` that the steps alive share, made on first use (freed with its last step)."""
    found = _BUFFERS.get(key)
    if found is None:
        found = _BUFFERS[key] = make()
    return found


def _weight_copies(weights: tuple) -> _WeightCopies:
    """The shared static copies for weights of these shapes, dtypes and strides (allocated on first use). w_down's
    copy is column-major whatever the caller's layout: the step reads rows of W_down^T, so a row-major w_down
    (FSDP2's) is transposed by each fill (the tiled transpose, at the copy rate) and the graphs copy it no more."""
    dev = next(t for t in weights if t is not None).device
    key = ("weight copies", dev, tuple((t.dtype, t.shape, t.stride()) if t is not None else None for t in weights))
    empty = lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=dev)  # noqa: E731
    column_major = lambda t: torch.empty(t.shape[1], t.shape[0], dtype=t.dtype, device=dev).t()  # noqa: E731
    makers = [empty] * 4 + [column_major, empty]
    return _shared(
        key, lambda: _WeightCopies(tuple(make(t) if t is not None else None for make, t in zip(makers, weights)))
    )


def _buffers(x2: torch.Tensor, weights: tuple) -> tuple[_TokenBuffers, _WeightBuffers]:
    w_gate, b_gate, w_up, b_up, w_down, b_down = weights
    M, N, K_out, dev = x2.shape[0], w_gate.shape[0], w_down.shape[0], x2.device
    # poisoned under test (NaN, -1) like every kernel output: a value a replay fails to write shows
    empty = lambda *shape, dtype: new_output(shape, dtype, dev)  # noqa: E731
    # w_down's strides too: its gradient's buffer takes its layout (as the eager step's, _weight_grads)
    layouts = tuple((t.dtype, t.shape) if t is not None else None for t in weights) + (w_down.stride(),)
    weight_key = ("weights", dev, layouts)
    token_key = ("tokens", dev, x2.shape, x2.dtype, K_out, N)
    tokens = _shared(
        token_key,
        lambda: _TokenBuffers(
            x=empty(*x2.shape, dtype=x2.dtype),
            dy=empty(M, K_out, dtype=x2.dtype),
            y=empty(M, K_out, dtype=x2.dtype),
            dx=empty(*x2.shape, dtype=x2.dtype),
            counts=empty(M + N, dtype=torch.int32),
        ),
    )
    grads = _shared(
        weight_key,
        lambda: _WeightBuffers(
            dl1=empty(dtype=torch.float32),
            l1=empty(dtype=torch.float32),
            dw=[empty(*w.shape, dtype=w.dtype) if w is not None else None for w in (w_gate, w_up)]
            + [new_output_layout_like(w_down.t())],
            db=[empty(*b.shape, dtype=b.dtype) if b is not None else None for b in (b_gate, b_up, b_down)],
        ),
    )
    return tokens, grads


def _operands(x: torch.Tensor, weights: tuple, dtype: torch.dtype) -> tuple:
    """(x, w_gate, b_gate, w_up, b_up, w_down_t, b_down) as the step takes them: in the step's dtype (autocast's
    casts), rows at unit stride, w_down transposed."""
    w_gate, b_gate, w_up, b_up, w_down, b_down = weights
    cast = lambda t: unit_last_stride(t.to(dtype)) if t is not None else None  # noqa: E731
    w_down_t = unit_rows(w_down.to(dtype).t())
    return x.to(dtype), cast(w_gate), cast(b_gate), cast(w_up), cast(b_up), w_down_t, cast(b_down)


class _Replay:
    """``body()`` captured in a CUDA graph (replay re-runs its kernels), or on the Triton interpreter kept as is
    (replay calls it)."""

    def __init__(self, body: Callable[[], None], device: torch.device) -> None:
        self.graph, self.body = None, None
        if device.type != "cuda":
            body()
            self.body = body
            return
        users = _POOL_GRAPHS.setdefault(device, weakref.WeakSet())
        if device not in _POOLS or not users:
            _POOLS[device] = torch.cuda.graph_pool_handle()
        pool = _POOLS[device]
        users.add(self)
        stream = _CAPTURE_STREAMS.get(device)
        if stream is None:
            stream = _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
        self.graph = torch.cuda.CUDAGraph()
        # thread-local: work that other threads enqueue meanwhile (a loader's pinned copies) does not void it
        with torch.cuda.graph(self.graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            body()

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.body()


class GraphedBlockStep:
    """One layer's block step (forward and backward) at one input shape, weight addresses and capacity, captured.

    ``forward(x2, weights)`` -> (y [M, K], l1, counts [M + N], kept): ``kept`` is what :meth:`backward` needs (one
    flat uint8 tensor). ``backward(x2, kept, dy, dl1, weights)`` -> gradients of (x2, w_gate, b_gate, w_up, b_up,
    w_down, b_down), None for an absent tensor; if a weight has moved since the capture (a parameter regathered at
    another address), the backward runs eagerly on the kept arrays instead of replaying. ``copied``: the graphs
    read the weights from shared static copies (:class:`_WeightCopies`), which each replay fills from ``weights``
    first, wherever those live. ``hidden_l1``: the step's L1 term is on h (``hybrid_mlp(l1_on="hidden")``);
    ``gate``: (activation, threshold), the step's gate."""

    def __init__(
        self,
        x2: torch.Tensor,
        weights: tuple,
        block_rows: int,
        tile: int,
        sort_rows: bool,
        capacity: int,
        copied: bool = False,
        hidden_l1: bool = False,
        gate: tuple[str, float] = ("relu", 0.0),
    ) -> None:
        w_gate, b_gate, w_up, b_up, w_down, b_down = weights
        self.addresses = _addresses(weights)
        self.copies = _weight_copies(weights) if copied else None
        self.has = tuple(a is not None for a in self.addresses)
        self.block_rows, self.hidden_l1, self.gate = block_rows, hidden_l1, gate
        self.bias_grads = any(t is not None for t in (b_gate, b_up, b_down))
        self.tokens, self.grads = tokens, grads = _buffers(x2, weights)
        tokens.x.copy_(x2)  # the warm-up and the layout probe run on this call's tokens
        if self.copies is not None:
            self.copies.fill(weights)
        dev, dtype = x2.device, x2.dtype

        # what the forward keeps, in one flat buffer: its shapes and dtypes from a run of the step
        probe = _train_forward(
            *_operands(tokens.x, weights, dtype), block_rows, tile, sort_rows, capacity, hidden_l1, *gate
        )  # fmt: skip
        self.layout, offset = [], 0
        for t in probe[3:]:
            offset = cdiv(offset, _ALIGN) * _ALIGN
            self.layout.append((offset, t.dtype, t.shape))
            offset += t.numel() * t.element_size()
        self.kept = torch.zeros(offset, dtype=torch.uint8, device=dev)
        self.kept_views = self._views(self.kept)
        del probe
        # The bodies reach the weights through weak references: a CUDA graph holds only their addresses, and the
        # interpreter's stand-in (which re-runs a body) must not keep a layer's weights, and so its captures, alive.
        # (Copied weights are the shared static copies, which the step holds.)
        read = self.copies.tensors if self.copies is not None else weights
        refs = tuple(weakref.ref(t) if t is not None else None for t in read)
        live = lambda: tuple(r() if r is not None else None for r in refs)  # noqa: E731

        def forward_body() -> None:
            x_c, *ops = _operands(tokens.x, live(), dtype)
            _, l1, counts, *kept = _train_forward_into(
                x_c, *ops, block_rows, tile, sort_rows, capacity, tokens.y, hidden_l1, *gate
            )  # fmt: skip
            grads.l1.copy_(l1)
            tokens.counts.copy_(counts)
            for view, t in zip(self.kept_views, kept):
                view.copy_(t)

        def backward_body() -> None:
            x_c, wg, bg, wu, bu, wdt, _ = _operands(tokens.x, live(), dtype)
            # dx and the weight gradients are written where the replay's caller reads them (no copy)
            *_, dbg, dbu, dbd = _train_backward_into(
                tokens.dy, grads.dl1, x_c, wg, wu, wdt, bg, bu, *self.kept_views, block_rows, self.bias_grads,
                tokens.dx, grads.dw, hidden_l1, *gate,
            )  # fmt: skip
            for out, g in zip(grads.db, (dbg, dbu, dbd)):
                if out is not None:
                    out.copy_(g)

        if dev.type == "cuda":  # compile and warm up (cuBLAS workspaces, Triton) off the capture, as CUDA graphs ask
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):
                    forward_body()
                    backward_body()
            torch.cuda.current_stream(dev).wait_stream(side)
        self.forward_graph = _Replay(forward_body, dev)
        self.backward_graph = _Replay(backward_body, dev)
        GRAPH_EVENTS["capture"] += 1

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The kept arrays (typed views) inside a flat uint8 buffer of this step's layout."""
        return [flat[o : o + math.prod(s) * d.itemsize].view(d).view(s) for o, d, s in self.layout]

    def forward(
        self, x2: torch.Tensor, weights: tuple
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = self.tokens
        tokens.x.copy_(x2)
        if self.copies is not None:
            self.copies.fill(weights)
            GRAPH_EVENTS["copied replay"] += 1
        self.forward_graph.replay()
        GRAPH_EVENTS["replay"] += 1
        return tokens.y.clone(), self.grads.l1.clone(), tokens.counts.clone(), self.kept.clone()

    def backward(
        self, x2: torch.Tensor, kept: torch.Tensor, dy: torch.Tensor | None, dl1: torch.Tensor | None, weights: tuple
    ) -> tuple[torch.Tensor | None, ...]:
        tokens, grads = self.tokens, self.grads
        if self.copies is not None:
            self.copies.fill(weights)
        elif _addresses(weights) != self.addresses:
            dy = dy if dy is not None else torch.zeros_like(tokens.dy)
            dl1 = dl1 if dl1 is not None else torch.zeros_like(grads.dl1)
            return self._eager_backward(x2, kept, dy, dl1, weights)
        tokens.x.copy_(x2)
        for buffer, given in ((tokens.dy, dy), (grads.dl1, dl1)):  # None: only the other output reached the loss
            if given is None:
                buffer.zero_()
            else:
                buffer.copy_(given)
        self.kept.copy_(kept)
        self.backward_graph.replay()
        dw = [g.clone() if g is not None else None for g in grads.dw]
        db = [b.clone() if b is not None else None for b in grads.db]
        return self._grads(tokens.dx.clone(), dw, db)

    def _eager_backward(self, x2, kept, dy, dl1, weights) -> tuple[torch.Tensor | None, ...]:
        """The backward's kernels launched one by one on the kept arrays and the weights where they are now."""
        GRAPH_EVENTS["eager backward"] += 1
        x_c, wg, bg, wu, bu, wdt, _ = _operands(x2, weights, x2.dtype)
        w_gate, b_gate, w_up, b_up, w_down, b_down = weights
        # dW_down^T laid out as the caller's w_down (transposed), as the replay's buffer is: no copy into its layout
        dw_out = _weight_grads(x2, wg, wu, w_down.t())
        dx, dwg, dwu, dwd, *db = _train_backward_into(
            dy, dl1, x_c, wg, wu, wdt, bg, bu, *self._views(kept), self.block_rows, self.bias_grads, None, dw_out,
            self.hidden_l1, *self.gate,
        )  # fmt: skip
        dw = [g.to(w.dtype) if w is not None else None for g, w in ((dwg, w_gate), (dwu, w_up), (dwd, w_down))]
        db = [g.to(b.dtype) if b is not None else None for g, b in zip(db, (b_gate, b_up, b_down))]
        return self._grads(dx, dw, db)

    def _grads(self, dx, dw, db) -> tuple[torch.Tensor | None, ...]:
        has_g, has_u, has_d = self.has[1], self.has[3], self.has[5]
        return (
            dx,
            dw[0],
            db[0] if has_g else None,
            dw[1],
            db[1] if has_u else None,
            dw[2].t(),  # w_down's gradient: the transpose of the [N, K] product, in w_down's layout
            db[2] if has_d else None,
        )


class _GraphedTrainStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, step: GraphedBlockStep, x2, w_gate, b_gate, w_up, b_up, w_down, b_down):
        y, l1, counts, kept = step.forward(x2, (w_gate, b_gate, w_up, b_up, w_down, b_down))
        ctx.step = step
        # the weights too: kept alive for the backward's reads, and an in-place change to one is caught
        ctx.save_for_backward(x2, kept, w_gate, b_gate, w_up, b_up, w_down, b_down)
        ctx.mark_non_differentiable(counts)
        return y, l1, counts

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, dl1, _counts):
        x2, kept, *weights = ctx.saved_tensors
        with autocast_off(x2):
            return (None, *ctx.step.backward(x2, kept, dy, dl1, tuple(weights)))


def _saved_tensor_hooks() -> bool:
    """Whether saved-tensor hooks are active (activation checkpointing, offloading): they act on what autograd saves,
    and a checkpoint's recompute must save what its forward saved, so such forwards take the eager step."""
    top = torch._C._autograd._top_saved_tensors_default_hooks
    try:
        return top(False) is not None
    except TypeError:  # torch < 2.1: no argument
        return top() is not None


def _addresses(weights: tuple) -> tuple[int | None, ...]:
    """Where each weight (or bias, None when absent) lives: what a capture reads them at."""
    return tuple(t.data_ptr() if t is not None else None for t in weights)


def _weights_keep_moving(layer: _LayerGraphs, addresses: tuple[int | None, ...], warn: bool = True) -> bool:
    """Whether this layer's weights (at ``addresses`` now) have been found at new addresses more than the knob
    ``move_limit`` times (each move would be a new capture): then its steps replay a capture that reads copies
    of the weights (warned once)."""
    move_limit = PLANNER.knobs.move_limit
    if layer.addresses is not None and layer.addresses != addresses:
        layer.moves += 1
        if layer.moves == move_limit + 1:
            layer.steps.clear()  # its in-place captures, buffers and pool memory are not replayed again
            if warn:
                warnings.warn(
                    "sparsefuse hybrid_mlp(cuda_graph=True): a layer's weights were found at a new address "
                    f"{layer.moves} times (parameters gathered anew each step, as FSDP2 does); from now on its "
                    "replays copy the weights into static buffers first (two weight copies per step)",
                    stacklevel=5,
                )
    layer.addresses = addresses
    return layer.moves > move_limit


def replays_by_default(x2: torch.Tensor, n_neurons: int) -> bool:
    """Whether ``hybrid_mlp(cuda_graph=None)`` replays the block step of x2 [M, K] through a gate of ``n_neurons``
    rows: plain eager CUDA calls whose gate product is at most the knob ``replay_max_gate_flop``
    (:class:`.choice.TrainKnobs`: where the host paces the eager step). CPU tensors (the interpreter's emulated
    graphs included) run the eager step, and so does a call being traced by torch.compile (decided before the size
    is read: no guard on a dynamic token count); ``sparsefuse.planning(context="eager")`` prices any call as a plain
    CUDA one."""
    if call_context(x2) != "eager":  # a CPU tensor, a capture, or torch.compile tracing
        return False
    return 2 * x2.shape[0] * x2.shape[1] * n_neurons <= PLANNER.knobs.replay_max_gate_flop


def graphed_step(
    gate: torch.Tensor,
    x2: torch.Tensor,
    weights: tuple,
    block_rows: int,
    tile: int,
    sort_rows: bool,
    warn: bool = True,
    hidden_l1: bool = False,
    activation: tuple[str, float] = ("relu", 0.0),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The block step of one layer from its captured graphs: (y [M, K], l1, token counts [M], neuron counts [N]);
    None where the eager step must run instead (see the module docstring). ``gate``: the caller's gate weight (the
    graphs and the capacity are kept per gate weight); x2 [M, K] in the step's dtype (autocast's cast done);
    ``weights``: (w_gate, b_gate, w_up, b_up, w_down, b_down) as the caller passed them (before autocast), w_down
    [K, N]. ``warn``: say (once per layer) when a layer's weights keep moving or its shapes keep changing (for a
    caller who asked for replays; the default choice falls back quietly). ``hidden_l1``: l1 on h, not on the gate
    (a capture of its own). ``activation``: the gate, (activation, threshold) (a capture of its own each)."""
    tensors = [x2, *(t for t in weights if t is not None)]
    if (
        not torch.is_grad_enabled()
        or _in_backward()
        or _saved_tensor_hooks()
        or not plain_eager_call(*tensors)
        or type(gate) not in (torch.Tensor, torch.nn.Parameter)
        or (x2.device.type != "cuda" and backend_for(x2) is not Backend.INTERPRETER)
    ):
        return None
    layer = _LAYERS.get(gate)
    if layer is None:
        layer = _LAYERS[gate] = _LayerGraphs()
    addresses = _addresses(weights)
    copied = _weights_keep_moving(layer, addresses, warn)
    capacity = TRAIN_CHOICE.bucketed_capacity(gate, x2.shape[0])
    if capacity is None:
        return None
    key = (
        x2.shape,
        x2.dtype,
        _COPIED if copied else addresses,
        tuple((t.dtype, t.shape, t.stride()) if t is not None else None for t in weights),
        block_rows,
        tile,
        sort_rows,
        capacity,
        hidden_l1,
        activation,
    )
    step = layer.steps.get(key)
    # captures and replays on the tensors' GPU (a layer on cuda:1 while cuda:0 is current)
    on_device = torch.cuda.device(x2.device) if x2.is_cuda else contextlib.nullcontext()
    if step is None:
        knobs = PLANNER.knobs
        if layer.captures >= knobs.capture_limit:
            if layer.captures == knobs.capture_limit and warn:
                warnings.warn(
                    f"sparsefuse hybrid_mlp(cuda_graph=True): a layer's step was captured {layer.captures} times "
                    "(its input shape keeps changing); it runs eagerly from now on",
                    stacklevel=4,
                )
                layer.captures += 1
            return None
        layer.captures += 1
        with torch.no_grad(), on_device, autocast_off(x2):
            step = GraphedBlockStep(
                x2.detach(), weights, block_rows, tile, sort_rows, capacity, copied, hidden_l1, activation
            )  # fmt: skip
        layer.steps[key] = step
        while len(layer.steps) > knobs.graphs_per_weight:
            layer.steps.popitem(last=False)
    layer.steps.move_to_end(key)
    with on_device:
        y, l1, counts = _GraphedTrainStep.apply(step, x2, *weights)
    M = x2.shape[0]
    return y, l1, counts[:M], counts[M:]
