"""How ``hybrid_mlp(layout="auto")`` runs a step: the sparse block step while the gate is sparse, plain dense ops
once it is not (the start of training, before L1 has made it sparse), decided on the host without a sync.

The firing fraction comes from a :class:`~sparsefuse._auto.SparsityMonitor` per gate weight: every call hands it
the step's non-zero count (a copy to pinned memory that completes in the background), and the next calls read the
last count that has arrived. The first call of a weight has no estimate and takes the sparse step; a call traced by
torch.compile takes the most recent eager choice."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..._auto import SparsityMonitor


@dataclass
class TrainChoice:
    """``dense_above``: the fraction of (token, neuron) pairs firing above which the dense step beats the block
    step. The block step's weight gradients gather one row of x and of dy per fired pair, so its cost grows with
    the firing while the dense step's does not; measured on an H100 with the synthetic layers (1.5B and 8B
    shapes, 8192-16384 tokens) the two cross between 0.5% and 0.8%."""

    dense_above: float = 0.006
    observe_every: int = 16  # calls between observations once an estimate exists (each costs a few launches)

    def __post_init__(self) -> None:
        self._monitors: WeakIdKeyDictionary = WeakIdKeyDictionary()  # gate weight -> [monitor, calls]
        self.last = "block"  # the most recent eager choice: what a compiled call takes

    def firing(self, w_gate: torch.Tensor) -> float | None:
        """The last observed fraction of firing (token, neuron) pairs for this gate weight (None: none yet)."""
        entry = self._monitors.get(w_gate)
        estimate = entry[0].estimate() if entry is not None else None
        return None if estimate is None else estimate / max(w_gate.shape[0], 1)

    def choose(self, w_gate: torch.Tensor) -> str:
        """``"block"`` or ``"dense"`` for the next step with this gate weight. While torch.compile traces, the
        per-weight estimate is not read (a traced read of it would break the graph): the compiled call takes the
        most recent eager choice (:attr:`last`, guarded: a later change of it recompiles), so run one eager step
        before compiling, as for inference."""
        if torch.compiler.is_compiling():
            return self.last
        firing = self.firing(w_gate)
        self.last = "dense" if firing is not None and firing > self.dense_above else "block"
        return self.last

    def observe(self, w_gate: torch.Tensor, token_counts: torch.Tensor) -> None:
        """Hand this step's per-token firing counts to the weight's monitor (no sync; skipped while compiling or
        while an earlier count is still in flight)."""
        if torch.compiler.is_compiling() or type(w_gate) not in (torch.Tensor, torch.nn.Parameter):
            return
        entry = self._monitors.get(w_gate)
        if entry is None:
            entry = self._monitors[w_gate] = [SparsityMonitor(momentum=0.0), 0]
        monitor, entry[1] = entry[0], entry[1] + 1
        if monitor.accepts and (monitor.mean_nnz is None or entry[1] % self.observe_every == 0):
            total = token_counts.sum(dtype=torch.int64).reshape(1)
            monitor.observe(torch.cat([total, total.new_full((1,), token_counts.shape[0])]))


TRAIN_CHOICE = TrainChoice()
