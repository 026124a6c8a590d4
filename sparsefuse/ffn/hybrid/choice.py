"""How ``hybrid_mlp(layout="auto")`` runs a step: the sparse block step while the gate is sparse, plain dense ops
once it is not (the start of training, before L1 has made it sparse), decided on the host without a sync by the
planner (:mod:`sparsefuse._plan`: its knobs are :class:`TrainKnobs`, ``sparsefuse.explain`` reports the pick).

The firing fraction is the planner's estimate for the gate weight (its :class:`~sparsefuse._plan.EstimateCache`,
which :meth:`sparsefuse._plan.Planner.clear` forgets): every ``observe_every`` calls the step hands it the non-zero
count it computed anyway (a copy to pinned memory that completes in the background), and the next calls read the
last count that has arrived. The first call of a weight has no estimate and takes the sparse step; a call traced by
torch.compile takes the most recent eager choice.

The same per-weight record sizes what the block step keeps for its backward (:meth:`TrainChoice.capacity`): the
non-zeros seen on the weight's last observed call, with a margin."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..._plan import EstimateCache, Knobs, Planner, decided


@dataclasses.dataclass(frozen=True)
class TrainKnobs(Knobs):
    """``dense_above``: the fraction of (token, neuron) pairs firing above which the dense step beats the block
    step. The block step's products on the pattern (the weight gradients gather one row of x and of dy per fired
    pair) grow with the firing while the dense step's do not. Measured on an H100 at 8192 tokens (GPU time, the
    host kept ahead; synthetic gates), the block step costs 0.67 / 0.78 / 0.96 / 1.15x the dense step at 0.52 /
    0.69 / 0.96 / 1.29% firing at the 1.5B layer shape, and 0.37 / 0.61 / 0.74 / 0.93 / 1.20x at 0.20 / 0.51 /
    0.69 / 0.95 / 1.36% at the 8B one: the two cross at ~1.0% at both; 0.9% keeps a margin. The planner prices the
    block step at ``firing / dense_above`` times the dense one's (its matmuls' time: 3 forward, 6 backward).

    ``replay_max_gate_flop``: ``cuda_graph=None`` replays a CUDA layer's block step whose gate product 2 M K N is at
    most this many FLOPs. An eager block step costs its host ~2.3-2.7 ms (16 Triton launches at ~31 us each on an
    H200 machine, their Python, autograd); its GPU time is ~1.6 ms at the 1.5B layer shape (8192 tokens, gate
    product 1.9e11) and ~3.9 ms at the 8B one (9.6e11): below the line the host paces the eager step and a replay
    frees it; above it the GPU does, and a replay would add only its copies (~0.3 ms at 8B).

    How a replayed step keeps its captures (:mod:`.graphed`): ``graphs_per_weight``, the captures kept per gate
    weight (input shapes, capacities), the least recently used dropped past it; ``capture_limit``, the captures a
    gate weight may take in its life: past it its input shapes keep changing (ragged batches), and its steps run
    eagerly (warned once); ``move_limit``, the times a layer's weights may be found at new addresses (a model moved
    to another device or dtype once) before its replays read copies of them instead (warned once): an engine that
    regathers parameters every step (FSDP2's all-gather into fresh storage) would otherwise take a capture per
    step, each costing more than the step it replaces."""

    dense_above: float = 0.009
    observe_every: int = 16  # calls between observations once an estimate exists (each costs a few launches)
    capacity_margin: float = 1.25  # kept pairs per non-zero last seen: batches vary by a few percent
    capacity_quantum: int = 1 << 16  # capacities rounded up to this many pairs, so the allocator reuses blocks
    replay_max_gate_flop: float = 5e11
    matmul_flops_per_s: float = 600e12  # the dense step's nominal rate (explain's seconds; the ratio decides)
    graphs_per_weight: int = 4
    capture_limit: int = 8
    move_limit: int = 1


def _predict(question: tuple, per_token: float, knobs: TrainKnobs) -> dict[str, float]:
    """The block step at ``firing / dense_above`` times the dense step's time (its matmuls': 3 forward, 6 backward)."""
    M, K, N = question[:3]
    dense = 9 * 2.0 * M * K * N / knobs.matmul_flops_per_s
    return {"block": dense * per_token / max(N, 1) / knobs.dense_above, "dense": dense}


PLANNER = Planner(
    "hybrid_mlp",
    _predict,
    TrainKnobs(),
    prior=lambda question, knobs: 0.0,  # nothing observed: the block step (its capacity keeps every pair)
    estimates=EstimateCache(momentum=0.0),  # the latest count: L1 moves the firing from step to step
)


@dataclasses.dataclass
class TrainChoice:
    """The per-gate-weight record of the training step: the layout the planner picks from the weight's firing
    estimate and the capacity the block step keeps (knobs: :class:`TrainKnobs`, via
    ``sparsefuse.planning(hybrid_mlp=...)``)."""

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every weight's captured bucket, frozen choices and compiled capacity (the planner's ``clear``)."""
        self._graph_buckets: WeakIdKeyDictionary = WeakIdKeyDictionary()  # gate weight -> pairs per token captured
        # gate weight -> {"layout": ..., "capacity": ...}: what its latest forward outside a backward took, which a
        # forward re-run inside a backward (activation checkpointing's recompute) takes again, so the recomputed
        # saved tensors have the shapes of the first forward's
        self._frozen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.last = "block"  # the most recent eager choice: what a compiled call takes
        # gate weight -> its kept pairs per token, rounded up to a power of two; their largest is what a compiled
        # call keeps per token (a coarse value, so that the guard on it recompiles a few times as L1 bites, not on
        # every observation)
        self._per_token_buckets: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.compiled_per_token = 0  # 0: none seen yet, a compiled call keeps every pair

    def firing(self, w_gate: torch.Tensor) -> float | None:
        """The last observed fraction of firing (token, neuron) pairs for this gate weight (None: none yet)."""
        per_token = self._per_token(w_gate)
        return None if per_token is None else per_token / max(w_gate.shape[0], 1)

    def _per_token(self, w_gate: torch.Tensor) -> float | None:
        """The last observed firing neurons per token for this gate weight (None before its first observation)."""
        monitor = PLANNER.estimates.monitor(w_gate)
        return monitor.estimate() if monitor is not None else None

    @property
    def knobs(self) -> TrainKnobs:
        return PLANNER.knobs

    def choose(self, w_gate: torch.Tensor, question: tuple) -> str:
        """``"block"`` or ``"dense"`` for the next step with this gate weight (``question``: M, K, N, dtype),
        priced by GPU time (a step's host time is not what decides). While torch.compile traces, the per-weight
        estimate is not read (a traced read of it would break the graph), and unlike an inference op the step
        cannot decide inside an op when the graph runs (the two layouts save different tensors for the backward):
        the compiled call takes the most recent eager choice (:attr:`last`, guarded: a later change of it
        recompiles), so run one eager step before compiling, as for inference."""
        if torch.compiler.is_compiling():
            return self.last
        frozen = self._frozen_value(w_gate, "layout")
        if frozen is not None:
            decided(PLANNER.op, frozen, "a checkpointed forward's recompute: the layout of its first forward")
            return frozen
        self.last, _ = PLANNER.choose(question, "graph", weight=w_gate)
        self._freeze(w_gate, "layout", self.last)
        return self.last

    def choose_for_module(self, w_gate: torch.Tensor, question: tuple) -> str:
        """What a module's ``train_method="auto"`` runs for its next step (``question``: M, K, N, dtype): the dense
        step until the gate's firing has been observed (the dense step counts it: :meth:`observe`; a block step
        without an estimate would keep every (token, neuron) pair for its backward), then the planner's pick. Kept
        for a checkpointed forward's recompute, as :meth:`choose` is."""
        frozen = self._frozen_value(w_gate, "module")
        if frozen is not None:
            return frozen
        if self.firing(w_gate) is None:
            decided(PLANNER.op, "dense", "nothing observed yet: the dense step counts the gate's firing", "prior")
            method = "dense"
        else:
            method = self.choose(w_gate, question)
        self._freeze(w_gate, "module", method)
        return method

    def _frozen_value(self, w_gate: torch.Tensor, key: str):
        """Inside a backward (a checkpointed forward being recomputed): the value the weight's forward took."""
        if not _in_backward() or type(w_gate) not in (torch.Tensor, torch.nn.Parameter):
            return None
        return self._frozen.get(w_gate, {}).get(key)

    def _freeze(self, w_gate: torch.Tensor, key: str, value) -> None:
        if not _in_backward() and type(w_gate) in (torch.Tensor, torch.nn.Parameter):
            self._frozen.setdefault(w_gate, {})[key] = value

    def observe(self, w_gate: torch.Tensor, token_counts: torch.Tensor) -> None:
        """Hand this step's per-token firing counts to the weight's monitor (no sync; skipped while compiling,
        inside a backward -- a checkpointed forward's recompute saw the same batch -- or while an earlier count is
        still in flight)."""
        if torch.compiler.is_compiling() or type(w_gate) not in (torch.Tensor, torch.nn.Parameter) or _in_backward():
            return

        def stats() -> torch.Tensor:
            total = token_counts.sum(dtype=torch.int64).reshape(1)
            return torch.cat([total, total.new_full((1,), token_counts.shape[0])])

        PLANNER.estimates.feed(w_gate, stats)

    def capacity(self, w_gate: torch.Tensor, M: int) -> int:
        """Fired (token, neuron) pairs the block step keeps for its backward at M tokens: ``capacity_margin`` times
        the non-zeros per token last observed for this gate weight, rounded up; every pair (``M * N``) before the
        first observation. While torch.compile traces (a traced read of the per-weight estimate would break the
        graph), :attr:`compiled_per_token` pairs per token: the eager calls' largest, rounded up to a power of two.
        Blocks past it are recomputed in the backward from x and the weights (to the forward's rounding, on tensor
        cores), never dropped; :func:`sparsefuse.sparse.block_pack.spilled_blocks` counts them."""
        full = M * w_gate.shape[0]
        if torch.compiler.is_compiling():
            return min(full, self.compiled_per_token * M) if self.compiled_per_token else full
        if type(w_gate) not in (torch.Tensor, torch.nn.Parameter):
            return full
        frozen = self._frozen_value(w_gate, "capacity")
        if frozen is not None and frozen[0] == M:
            return frozen[1]
        need = self._need_per_token(w_gate)
        capacity = full
        if need is not None:
            wanted, quantum = need * M, self.knobs.capacity_quantum
            capacity = min(full, quantum * max(1, math.ceil(wanted / quantum)))
            self._per_token_buckets[w_gate] = _power_of_two_above(need)
            # over the weights alive now (a freed layer's need drops out with it)
            self.compiled_per_token = max(self._per_token_buckets.values())
        self._freeze(w_gate, "capacity", (M, capacity))
        return capacity

    def bucketed_capacity(self, w_gate: torch.Tensor, M: int) -> int | None:
        """The capacity of a captured step (:mod:`.graphed`): M times this weight's need per token rounded up to a
        power of two, kept until the need outgrows it or falls below a quarter of it, so that it changes a few times
        while L1 bites rather than at every observation (each change is a new capture); None before the weight's
        first observation (the eager step runs until then)."""
        need = self._need_per_token(w_gate)
        if need is None:
            return None
        bucket = _power_of_two_above(need)
        held = self._graph_buckets.get(w_gate)
        if held is not None and held / 4 < need <= held:  # grows at once, shrinks only past a factor of 4
            bucket = held
        self._graph_buckets[w_gate] = bucket
        return min(M * w_gate.shape[0], bucket * M)

    def _need_per_token(self, w_gate: torch.Tensor) -> float | None:
        """``capacity_margin`` times the non-zeros per token last observed for this gate weight (None before the
        first observation)."""
        per_token = self._per_token(w_gate)
        return None if per_token is None else self.knobs.capacity_margin * per_token


def _power_of_two_above(need: float) -> int:
    """The smallest power of two >= need (>= 1)."""
    return 1 << math.ceil(math.log2(max(need, 1.0)))


def _in_backward() -> bool:
    """Whether an autograd backward is running on this thread (where activation checkpointing re-runs forwards)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


TRAIN_CHOICE = TrainChoice()
PLANNER.on_clear(TRAIN_CHOICE.reset)
