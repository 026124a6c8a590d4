"""What the planner knows of a tensor's sparsity, kept without a host sync.

A choice between a sparse kernel and cuBLAS depends on how many features fire per row, which lives on the GPU.
Reading it costs a host sync per call and is impossible inside a CUDA-graph capture. Instead each call may hand a
[2] int64 device tensor (non-zeros, rows counted) -- or longer, with further sums over those rows -- to a
:class:`SparsityMonitor`, which copies it to pinned host memory without blocking and folds it into a running
estimate on a later call, once it has arrived. :class:`EstimateCache` keeps one monitor per weight tensor, so the
default call of an op on the same layer pays at most one host sync in its life (its first eager call) and none
after.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary


def device_scalar(value: int, device: torch.device) -> torch.Tensor:
    """A 0-dim int64 tensor on ``device`` made by a fill kernel: no host copy (safe inside a CUDA-graph capture)."""
    return torch.full((), value, dtype=torch.int64, device=device)


def sampled_rows(t: torch.Tensor, max_rows: int) -> torch.Tensor:
    """<= ``max_rows`` evenly spaced rows of ``t`` [M, n] (M >= 1), the first and the last included."""
    M = t.shape[0]
    return t[torch.linspace(0, M - 1, min(M, max_rows), device=t.device).long()]


def sampled_nonzero_stats(
    t: torch.Tensor, max_rows: int, positive: bool = False, threshold: float = 0.0
) -> torch.Tensor:
    """[2] int64 (non-zeros, rows) over <= ``max_rows`` evenly spaced rows of ``t`` [M, n] (M >= 1), without a sync.
    ``positive``: count entries > ``threshold`` (pre-activations of a ReLU at 0, of a FATReLU above) instead of
    entries != 0 (NaN counts as fired)."""
    sample = sampled_rows(t, max_rows)
    fired = sample > threshold if positive else sample != 0
    return torch.stack([fired.sum(dtype=torch.int64), device_scalar(sample.shape[0], t.device)])


def sampled_row_stats(t: torch.Tensor, max_rows: int, long_above: int) -> torch.Tensor:
    """[5] int64 over the rows :func:`sampled_nonzero_stats` samples, without a sync: (non-zeros of the ordinary
    rows, rows, sum of the ordinary rows' squared counts, long rows, non-zeros of the long rows), a row being long
    when it holds more than ``long_above`` non-zeros. For a cost model that needs the spread of the per-row count
    (its second moment) and the few rows far denser than the rest, which would swamp a plain mean. A
    :class:`SparsityMonitor` keeps each element per row counted (:attr:`SparsityMonitor.per_row`)."""
    sample = sampled_rows(t, max_rows)
    counts = (sample != 0).sum(dim=1, dtype=torch.int64)
    long = counts > long_above
    ordinary = torch.where(long, 0, counts)
    return torch.stack(
        [
            ordinary.sum(),
            device_scalar(sample.shape[0], t.device),
            (ordinary * ordinary).sum(),
            long.sum(dtype=torch.int64),
            torch.where(long, counts, 0).sum(),
        ]
    )


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class SparsityMonitor:
    """Sync-free running estimate of the mean non-zeros per token, for ``method="auto"``.

    Each call hands it a device tensor (non-zeros, tokens counted); it is copied to pinned host memory without
    blocking and folded into the estimate (exponential average) on a *later* call, once its CUDA event has
    completed -- the estimate lags by a call or so, and no call ever waits for the GPU. During CUDA-graph capture
    it neither records nor reads (the estimate at capture time is used). On the CPU it updates at once."""

    def __init__(self, momentum: float = 0.5) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"SparsityMonitor: momentum must be in [0, 1); got {momentum!r}")
        self.momentum = momentum
        self.per_row: tuple[float, ...] | None = None  # every element of the stats over the tokens, averaged alike
        self._pending: tuple[torch.Tensor, torch.cuda.Event] | None = None

    def update(self, nnz: float, tokens: float, *extra: float) -> None:
        """Fold a count taken on the host (``nnz`` non-zeros over ``tokens`` tokens; ``extra``: further sums over
        those tokens, such as :func:`sampled_row_stats` gives) into the estimate now."""
        if tokens <= 0:
            return
        values = (nnz / tokens, *(x / tokens for x in extra))
        if self.per_row is None or len(self.per_row) != len(values):
            self.per_row = values
        else:
            self.per_row = tuple(self.momentum * a + (1 - self.momentum) * b for a, b in zip(self.per_row, values))

    @property
    def mean_nnz(self) -> float | None:
        """The running mean of non-zeros per token (None before the first observation has been folded in)."""
        return None if self.per_row is None else self.per_row[0]

    @property
    def accepts(self) -> bool:
        """Whether :meth:`observe` would take a new observation now (none in flight, not capturing): lets a caller
        skip computing stats that would be dropped."""
        return self._pending is None and not _capturing()

    def observe(self, stats: torch.Tensor) -> None:
        """``stats``: [2] int64 device tensor (non-zeros, tokens), or longer (further sums over those tokens).
        Dropped while an earlier one is in flight."""
        if stats.device.type != "cuda":
            self.update(*(float(v) for v in stats.tolist()))
            return
        if not self.accepts:
            return
        host = torch.empty(stats.numel(), dtype=torch.int64, pin_memory=True)
        host.copy_(stats, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(stats.device))  # the copy's stream, whichever device is current
        self._pending = (host, event)

    def estimate(self) -> float | None:
        """The current estimate (None before the first observation has arrived); never blocks."""
        if self._pending is not None and not _capturing() and self._pending[1].query():
            host, _ = self._pending
            self._pending = None
            self.update(*(float(v) for v in host.tolist()))
        return self.mean_nnz


def observable(t: torch.Tensor) -> bool:
    """Whether a tensor's values may be looked at now: not under torch.compile tracing, not a fake or subclass
    tensor, not during a CUDA-graph capture."""
    if torch.compiler.is_compiling() or type(t) not in (torch.Tensor, torch.nn.Parameter):
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


class EstimateCache:
    """Per-weight running estimates of the mean non-zeros per row, fed without a host sync.

    ``estimate_per_row(weight, stats, can_observe)``: ``weight`` keys the estimate (the decoder or the gate weight; the
    entry dies with it); ``stats`` is a zero-argument callable returning the [2] int64 device tensor (non-zeros, rows)
    of the current call's input, called only when an observation is due. The first observable call with a new weight
    counts its sample on the host (the one sync of that weight's life); later calls read the monitor, which folds in new
    samples once they have arrived. Samples are taken every ``observe_every`` calls at first, then ever more rarely (the
    gap doubles with the calls made, up to ``max_every``): a layer's sparsity moves slowly, and each sample costs a few
    launches of host time that a host-bound decode loop would otherwise pay every few steps. Under compile tracing, fake
    tensors or CUDA-graph capture it only reads (None when nothing was ever observed)."""

    def __init__(self, observe_every: int = 8, max_every: int = 256, momentum: float = 0.5) -> None:
        self.max_every, self.momentum = max_every, momentum
        self._observe_every: Callable[[], int] = lambda: observe_every
        self._entries: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight -> [SparsityMonitor, calls, next_at]

    @property
    def observe_every(self) -> int:
        """Calls between a weight's first samples (the gap then doubles up to ``max_every``)."""
        return self._observe_every()

    def follow(self, observe_every: Callable[[], int]) -> None:
        """Read ``observe_every`` from this callable at each use, in place of the constructor's: a
        :class:`~.planner.Planner` makes its cache follow its op's knob (:func:`~.config.planning` steers it)."""
        self._observe_every = observe_every

    def estimate_per_row(
        self, weight: torch.Tensor, stats: Callable[[], torch.Tensor] | None, can_observe: bool
    ) -> tuple[float, ...] | None:
        """The weight's running averages per row counted (:attr:`SparsityMonitor.per_row`; the first element is
        the mean non-zeros per row), as read before this call's own observation; None when nothing is known.
        ``stats``: a zero-argument callable giving the [2] (or longer) int64 device tensor of this call's sample,
        called only when an observation is due; ``can_observe``: whether this call's values may be looked at."""
        if torch.compiler.is_compiling() or type(weight) not in (torch.Tensor, torch.nn.Parameter):
            return None
        entry = self._entries.get(weight)
        if entry is None:
            if not can_observe:
                return None
            monitor = SparsityMonitor(self.momentum)
            monitor.update(*(float(v) for v in stats().tolist()))  # the one sync
            self._entries[weight] = [monitor, 0, self.observe_every]
            return monitor.per_row
        monitor = entry[0]
        monitor.estimate()
        value = monitor.per_row
        if can_observe:
            entry[1] += 1
            if entry[1] >= entry[2] and monitor.accepts:
                monitor.observe(stats())
                entry[2] = self.next_sample_at(entry[1])
        return value

    def next_sample_at(self, calls: int) -> int:
        """The call count at which the sample after one taken at ``calls`` is due: the gap doubles with the calls
        made, from ``observe_every`` up to ``max_every`` (for callers that keep their own count, too)."""
        return calls + min(self.max_every, max(self.observe_every, calls))

    def observe(self, weight: torch.Tensor, stats: torch.Tensor) -> bool:
        """Hand a sample taken by the caller's own route (e.g. a module's dense path) to ``weight``'s monitor:
        the last one is folded in if it has arrived, and ``stats`` ([2] int64 on the device: non-zeros, rows) is
        taken unless one is still in flight. Returns False when ``weight`` has no estimate yet (its first call must
        go through the op, which makes one)."""
        entry = self._entries.get(weight)
        if entry is None:
            return False
        entry[0].estimate()
        if entry[0].accepts:
            entry[0].observe(stats)
        return True

    def feed(self, weight: torch.Tensor, stats: Callable[[], torch.Tensor]) -> None:
        """Count ``weight``'s calls and hand its monitor ``stats()`` (as :meth:`observe` takes it) on the first call
        and every ``observe_every`` calls after, without a sync even on the first: for a caller that computes the counts
        anyway and runs without an estimate until one arrives (the training step). Skipped while a sample is in
        flight; the caller skips calls whose values may not be looked at."""
        entry = self._entries.get(weight)
        if entry is None:
            entry = self._entries[weight] = [SparsityMonitor(self.momentum), 0, 0]
        monitor = entry[0]
        monitor.estimate()  # the last sample folded in, if it has arrived: the monitor then accepts the next
        entry[1] += 1
        if entry[1] >= entry[2] and monitor.accepts:
            monitor.observe(stats())
            entry[2] = entry[1] + self.observe_every

    def monitor(self, weight: torch.Tensor) -> SparsityMonitor | None:
        """The monitor kept for ``weight`` (None before its first observed call)."""
        entry = self._entries.get(weight)
        return None if entry is None else entry[0]

    def clear(self) -> None:
        self._entries = WeakIdKeyDictionary()
