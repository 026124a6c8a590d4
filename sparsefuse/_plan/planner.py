"""The planner: the one place that decides which method an op's ``method="auto"`` runs, and says why.

An op declares one cost model (``predict(question, estimate, knobs)``: the predicted GPU seconds of each method that
applies, in the order that breaks ties), a baseline (cuBLAS), its knobs (:mod:`.config`), what it assumes with
nothing observed (its prior) and the rules that decide without costs. The :class:`Planner` owns the rest, for every
op alike:

* **the estimate ladder** -- first available: the value the caller gave (``expected_nnz`` / ``expected_l0``); the
  caller's own :class:`~.estimates.SparsityMonitor`; the running estimate kept per weight tensor
  (:class:`~.estimates.EstimateCache`: one host sync in a weight's life, none after); the op's prior;
* **one rule per execution context** -- a plain eager CUDA call is priced at ``max(gpu, host)`` seconds per method
  (a loop of them runs at the larger); a CUDA-graph capture (and a CPU call) at GPU time alone; a call being traced
  by torch.compile does not pick at all unless the caller gave the estimate: it hands ``"auto"`` to the op, whose
  implementation asks again when the compiled graph runs -- with real tensors, the per-weight estimate and the
  context of that moment (a capture under ``mode="reduce-overhead"``) -- so a graph compiled before any eager call
  never freezes the prior's pick, and a drifting estimate never recompiles;
* **memoisation** of the pick on the question and the rounded estimate (a decode loop asks the same every step);
* **the graph warm-up** -- where an eager call picks another method than a capture of it would, the first such
  call per shape runs the in-graph pick once (a capture cannot compile or tune a Triton kernel);
* **explain** -- :func:`explain` runs a call up to its decision and returns what was picked and every method's
  predicted cost, instead of running it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch

from .config import Knobs, current, register_knobs
from .estimates import EstimateCache, SparsityMonitor, observable

AUTO = "auto"


def pick_fastest(predicted: Mapping[str, float], *, baseline: str = "dense", margin: float = 1.0) -> str:
    """The method with the smallest predicted time, but ``baseline`` unless that method is predicted at most
    ``margin`` times the baseline's time (the first listed wins a tie)."""
    best = baseline
    for method, seconds in predicted.items():  # a plain loop, not min(key=...): torch.compile traces it
        if method != baseline and (best == baseline or seconds < predicted[best]):
            best = method
    if best == baseline or baseline not in predicted or predicted[best] < margin * predicted[baseline]:
        return best
    return baseline


def call_context(t: torch.Tensor) -> str:
    """``"compile"`` while torch.compile traces, ``"eager"`` for a plain call on a CUDA tensor (launched from Python:
    its host time counts), ``"graph"`` otherwise (a CUDA-graph capture; a CPU call). :func:`~.config.planning`'s
    ``context`` overrides it for calls that are not being traced."""
    if torch.compiler.is_compiling():
        return "compile"
    forced = current().context
    if forced is not None:
        return forced
    return "eager" if t.is_cuda and observable(t) else "graph"


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What an op's call picks and why. ``predicted``: GPU seconds per method that applies (the cost model's, or
    the knobs' ``measured_s``); ``priced``: what the pick compared (eager calls: at least each method's host
    time); ``in_graph``: what a CUDA-graph capture of the same call would pick; ``source``: where the estimate came
    from ("given", "monitor", "observed", "prior"), or "rule" / "explicit" / "autograd" for a decision made
    without costs."""

    op: str
    method: str
    reason: str
    context: str = ""
    source: str = ""
    estimate: Any = None
    predicted: Mapping[str, float] = dataclasses.field(default_factory=dict)
    priced: Mapping[str, float] = dataclasses.field(default_factory=dict)
    margin: float | None = None
    in_graph: str | None = None

    def __str__(self) -> str:
        lines = [f"{self.op}: {self.method!r} -- {self.reason}"]
        if self.priced:
            lines.append(f"  context {self.context}; estimate {self.estimate} ({self.source}); margin {self.margin}")
            for method, seconds in sorted(self.priced.items(), key=lambda item: item[1]):
                gpu = self.predicted.get(method, seconds)
                host = "" if gpu == seconds else f" (GPU {gpu * 1e6:.1f} us, host-bound)"
                lines.append(f"  {method:>8}: {seconds * 1e6:9.1f} us{host}")
            if self.in_graph is not None and self.in_graph != self.method:
                lines.append(f"  inside a CUDA graph (GPU time alone) it picks {self.in_graph!r}")
        return "\n".join(lines)


class _Explained(Exception):
    def __init__(self, explanation: Explanation) -> None:
        super().__init__(str(explanation))
        self.explanation = explanation


_EXPLAINING = [False]


def explain(fn: Callable, *args, **kwargs) -> Explanation:
    """What ``fn(*args, **kwargs)`` -- a sparsefuse function or a module that calls one -- picks and why: the call
    runs up to its first decision and stops there (no kernel runs; the per-weight estimate is fed as the call
    would feed it). A call that decides nothing (one method only) runs and is reported as such, e.g.
    ``print(sparsefuse.explain(sparsefuse.twell_mlp, x, w_gate, w_up, w_down))``."""
    if _EXPLAINING[0]:
        raise RuntimeError("sparsefuse.explain: already explaining a call")
    _EXPLAINING[0] = True
    try:
        fn(*args, **kwargs)
    except _Explained as stop:
        return stop.explanation
    finally:
        _EXPLAINING[0] = False
    name = getattr(fn, "__name__", type(fn).__name__)
    return Explanation(name, "", "the call chose nothing: it has one method", source="rule")


def explaining() -> bool:
    """Whether :func:`explain` is running a call (a caller's shortcut around the planner must then ask it)."""
    return _EXPLAINING[0]


def decided(op: str, method: str, reason: str, source: str = "rule") -> None:
    """Tell the planner a call's method was decided without costs (an explicit ``method=``, autograd, a rule):
    under :func:`explain` the call stops here with that reason (not while torch.compile traces: a compiled call is
    explained by its op's decision when the graph runs); otherwise nothing happens."""
    if _EXPLAINING[0] and not torch.compiler.is_compiling():
        raise _Explained(Explanation(op, method, reason, source=source))


_PLANNERS: dict[str, Planner] = {}
_MEMO_SIZE = 4096


class Planner:
    """One op's ``auto``: its cost model, baseline and knobs, and the shared ladder (see the module docstring).

    ``predict(question, estimate, knobs)``: ``{method: predicted GPU seconds}`` over the methods that apply (the
    first listed wins a tie); ``from_per_row``: the op's estimate from a monitor's per-row averages; ``from_given``:
    from the number a caller gave; ``rounded``: the estimate at the resolution picks are memoised at (hashable);
    ``prior(question, knobs)``: the estimate with nothing observed; ``rule(question, knobs)``: ``(method, reason)``
    where a rule decides without costs, else None; ``margin(question, knobs)``: the margin of that question
    (default: the knobs')."""

    def __init__(
        self,
        op: str,
        predict: Callable[[Any, Any, Any], Mapping[str, float]],
        knobs: Knobs,
        *,
        baseline: str = "dense",
        estimates: EstimateCache | None = None,
        from_per_row: Callable[[tuple[float, ...]], Any] = lambda per_row: per_row[0],
        from_given: Callable[[float], Any] = float,
        rounded: Callable[[Any], Hashable] = lambda estimate: round(float(estimate), 1),
        prior: Callable[[Any, Any], Any],
        rule: Callable[[Any, Any], tuple[str, str] | None] = lambda question, knobs: None,
        margin: Callable[[Any, Any], float] = lambda question, knobs: knobs.margin,
    ) -> None:
        self.op, self.predict, self.baseline = op, predict, baseline
        self.estimates = estimates if estimates is not None else EstimateCache()
        self.estimates.follow(lambda: self.knobs.observe_every)
        self.from_per_row, self.from_given, self.rounded = from_per_row, from_given, rounded
        self.prior, self.rule, self.margin = prior, rule, margin
        self._memo: dict[tuple, str] = {}
        self._warmed: set[tuple] = set()
        self._on_clear: list[Callable[[], None]] = []
        register_knobs(op, knobs)
        _PLANNERS[op] = self

    @property
    def knobs(self) -> Any:
        return current().knobs(self.op)

    def predicted(self, question: Any, estimate: Any) -> dict[str, float]:
        """GPU seconds per method that applies to ``question`` at ``estimate`` (the knobs' ``measured_s`` in place
        of the cost model's for the methods it names)."""
        knobs = self.knobs
        predicted = dict(self.predict(question, estimate, knobs))
        measured = knobs.measured_s(question, estimate) if callable(knobs.measured_s) else knobs.measured_s
        if measured:
            predicted.update({m: s for m, s in measured.items() if m in predicted})
        return predicted

    def _priced(self, predicted: dict[str, float], eager: bool) -> dict[str, float]:
        if not eager:
            return predicted
        host = self.knobs.host_s
        return {method: max(seconds, host.get(method, 0.0)) for method, seconds in predicted.items()}

    def pick(self, question: Any, estimate: Any, eager: bool) -> str:
        """The method for ``question`` at a rounded ``estimate``, priced as a plain eager call or by GPU time
        (memoised: the cost model is tens of microseconds of Python arithmetic, a decode loop asks every step)."""
        config = current()
        key = (config.version, question, estimate, eager)
        method = self._memo.get(key)
        if method is None:
            if len(self._memo) >= _MEMO_SIZE:
                self._memo.clear()
            priced = self._priced(self.predicted(question, estimate), eager)
            method = self._memo[key] = pick_fastest(
                priced, baseline=self.baseline, margin=self.margin(question, config.knobs(self.op))
            )
        return method

    def kept_pick(self, weight: torch.Tensor, question: Any, eager: bool) -> str | None:
        """The pick for ``question`` at the estimate already kept for ``weight`` (None before one exists), without
        observing anything: a dictionary lookup and the memo, for a caller's host path that skips the op."""
        monitor = self.estimates.monitor(weight)
        if monitor is None or monitor.per_row is None:
            return None
        return self.pick(question, self.rounded(self.from_per_row(monitor.per_row)), eager)

    def estimate(
        self,
        question: Any,
        context: str,
        *,
        given: float | None = None,
        monitor: SparsityMonitor | None = None,
        weight: torch.Tensor | None = None,
        stats: Callable[[], torch.Tensor] | None = None,
        can_observe: bool = False,
    ) -> tuple[Any, str]:
        """(rounded estimate, where it came from) by the ladder of the module docstring."""
        if given is not None:
            return self.rounded(self.from_given(given)), "given"
        if context != "compile":
            if monitor is not None:
                monitor.estimate()
                if monitor.per_row is not None:
                    return self.rounded(self.from_per_row(monitor.per_row)), "monitor"
            if weight is not None:  # without ``stats``: the weight's estimate is read, never observed
                per_row = self.estimates.estimate_per_row(weight, stats, can_observe and stats is not None)
                if per_row is not None:
                    return self.rounded(self.from_per_row(per_row)), "observed"
        return self.rounded(self.prior(question, self.knobs)), "prior"

    def explicit(self, method: str, argument: str = "method") -> str:
        """A method the caller named (in ``argument``): it runs, never another (recorded for :func:`explain`).
        Callers check for it before building ``auto``'s question, so that an explicit call pays nothing for the
        planner."""
        if _EXPLAINING[0]:
            decided(self.op, method, f"{argument}={method!r} given", "explicit")
        return method

    def resolve(
        self,
        question: Any,
        call: torch.Tensor,
        *,
        warm_up: Callable[[str, Any], object] | None = None,
        at_run_time: bool = False,
        **sources: Any,
    ) -> tuple[str, Any]:
        """``"auto"``'s method by :meth:`choose` in the context of the call's tensor ``call`` (its first dimension
        the rows; a call with none, or one whose values may not be looked at, observes nothing). ``sources``: the
        estimate's (:meth:`estimate`). Returns (method, the rounded estimate; None where none was used)."""
        sources.setdefault("can_observe", observable(call) and call.shape[0] > 0)
        return self.choose(question, call_context(call), warm_up=warm_up, at_run_time=at_run_time, **sources)

    def choose(
        self,
        question: Any,
        context: str,
        *,
        warm_up: Callable[[str, Any], object] | None = None,
        at_run_time: bool = False,
        **sources: Any,
    ) -> tuple[str, Any]:
        """(method, the rounded estimate it was picked at; None where no estimate was used) for ``question`` in
        ``context`` (:func:`call_context`); ``sources``: the estimate's, as :meth:`estimate` takes them. Returns
        ``"auto"`` while torch.compile traces without a ``given`` estimate: the op decides when the graph runs
        (``at_run_time=True`` there, where it never defers)."""
        given = sources.get("given")
        rule = self.rule(question, self.knobs)
        if rule is not None:
            decided(self.op, rule[0], rule[1])
            return rule[0], None
        if context == "compile" and given is None:
            if at_run_time:
                context = "graph"
            else:
                decided(self.op, AUTO, "traced by torch.compile: decided inside the op when the graph runs")
                return AUTO, None
        if context == "compile":
            if not _constant_question(question, given):
                return AUTO, None  # a symbolic size: decided when the graph runs
            return _traced_pick(self.op, question, float(given)), self.rounded(self.from_given(given))
        estimate, source = self.estimate(question, context, **sources)
        eager = context == "eager"
        method = self.pick(question, estimate, eager)
        if _EXPLAINING[0] and not torch.compiler.is_compiling():
            raise _Explained(self.explanation(question, estimate, source, context, method))
        if eager and warm_up is not None:
            in_graph = self.pick(question, estimate, False)
            if in_graph != method and (question, in_graph) not in self._warmed:
                self._warmed.add((question, in_graph))
                warm_up(in_graph, estimate)
        return method, estimate

    def explanation(self, question: Any, estimate: Any, source: str, context: str, method: str) -> Explanation:
        eager = context == "eager"
        predicted = self.predicted(question, estimate)
        priced = self._priced(predicted, eager)
        margin = self.margin(question, self.knobs)
        fastest = min(priced, key=priced.get)
        if method == self.baseline and fastest != method:
            reason = f"no method predicted under {margin:g}x the time of {self.baseline!r}"
        elif method == self.baseline:
            reason = "predicted fastest"
        else:
            reason = f"predicted fastest, {priced[method] / priced[self.baseline]:.2f}x the time of {self.baseline!r}"
        in_graph = self.pick(question, estimate, False)
        return Explanation(self.op, method, reason, context, source, estimate, predicted, priced, margin, in_graph)

    def clear(self) -> None:
        """Forget every estimate, memoised pick and warm-up (tests; a model whose weights were replaced), and what
        the op keeps beside them (:meth:`on_clear`)."""
        self.estimates.clear()
        self._memo.clear()
        self._warmed.clear()
        for forget in self._on_clear:
            forget()

    def on_clear(self, forget: Callable[[], None]) -> None:
        """Have :meth:`clear` call ``forget`` too: for an op's own records derived from the estimates."""
        self._on_clear.append(forget)


def _constant_question(question: Any, given: float | None) -> bool:
    """Whether a traced call's question holds only Python constants (no symbolic size)."""
    values = question if isinstance(question, tuple) else (question,)
    return isinstance(given, (int, float)) and all(
        isinstance(v, (bool, int, float, str, torch.dtype)) or v is None for v in values
    )


@torch.compiler.assume_constant_result
def _traced_pick(op: str, question: Any, given: float) -> str:
    """:meth:`Planner.pick` as torch.compile sees it for a given estimate: evaluated once at trace time and baked
    into the graph as a constant (a GPU-time pick: a compiled graph launches without Python's per-op host time).
    Its arguments are Python constants only (the op's estimate object is made inside)."""
    plan = _PLANNERS[op]
    return plan.pick(question, plan.rounded(plan.from_given(given)), False)


def planner(op: str) -> Planner:
    """The planner of the op named ``op`` (KeyError if it has none)."""
    return _PLANNERS[op]
