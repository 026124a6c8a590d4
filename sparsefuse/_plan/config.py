"""The planner's thresholds, in one object.

Each op that chooses a method declares its knobs as a frozen dataclass (its margin, its prior, its host times, the
thresholds of its rules; :class:`Knobs` holds the fields every op has). Launchers that choose no method but steer
their kernels by thresholds (a kernel variant from some size on, a grid limit) declare theirs as a
:class:`KnobGroup` of their own fields. :data:`CONFIG` holds the current knobs of every group; :func:`planning`
replaces some of them for the duration of a ``with`` block -- how tests steer a pick or a code path and how a user
overrides one (e.g. with times measured on their own GPU) without touching a module constant.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

CONTEXTS = ("eager", "graph", "compile")


@dataclasses.dataclass(frozen=True)
class KnobGroup:
    """A named group of knobs (a frozen dataclass registered by :func:`register_knobs`): a launcher's thresholds,
    read from :func:`current` when it launches, so that a test or a user steers them with :func:`planning`."""


@dataclasses.dataclass(frozen=True)
class Knobs(KnobGroup):
    """What every op's planner reads.

    ``margin``: a sparse method must be predicted at most this fraction of the baseline's time to be picked (< 1
    where the cost model's error near the crossover is known to be large). ``host_s``: host seconds of one plain
    eager call per method (argument checks, allocations, launches): a loop of eager calls runs at the larger of a
    method's host and GPU times, so an eager call is priced at ``max(gpu, host)``. ``measured_s``: seconds per
    method to use in place of the cost model's predictions (times measured on your own GPU) for the methods it
    names, or your own cost model: a function ``(question, estimate) -> {method: seconds}`` (the op's question
    tuple of shapes and dtypes, and its rounded estimate). ``observe_every``: calls between the first samples of a
    weight's running estimate (the op's :class:`~.estimates.EstimateCache` follows it; inference ops double the gap
    as calls accumulate, the training step keeps it fixed)."""

    margin: float = 1.0
    observe_every: int = 8
    host_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    measured_s: Mapping[str, float] | Callable[[Any, Any], Mapping[str, float]] | None = None


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """Every group's knobs (``ops``: op or group name -> its :class:`Knobs` subclass, or :class:`KnobGroup` for a
    launcher that chooses no method); ``context``: None to read each call's
    execution context from its tensors, or ``"eager"`` / ``"graph"`` to price every call that is not being traced as
    if it ran there (a CPU test of what a CUDA call would pick); ``eager_fast_path``: whether a plain eager call
    (no autograd, tracing, subclass or mode) may call its launcher directly instead of the ``torch.library`` op --
    tens of microseconds of host time less per call, the same kernels (False: always through the op)."""

    ops: Mapping[str, KnobGroup] = dataclasses.field(default_factory=dict)
    context: str | None = None
    eager_fast_path: bool = True
    version: int = 0  # bumped on every change: part of the planner's memo key

    def knobs(self, op: str) -> Any:
        return self.ops[op]


CONFIG = PlanConfig()
_VERSIONS = [0]


def register_knobs(op: str, knobs: KnobGroup) -> None:
    """Declare ``op``'s default knobs (called once, where the op declares its cost model or its launcher)."""
    global CONFIG
    CONFIG = dataclasses.replace(CONFIG, ops={**CONFIG.ops, op: knobs})


def current() -> PlanConfig:
    return CONFIG


def _changed(
    config: PlanConfig, context: object, eager_fast_path: object, ops: Mapping[str, Mapping | KnobGroup]
) -> PlanConfig:
    changed = dict(config.ops)
    for op, change in ops.items():
        if op not in changed:
            raise ValueError(f"planning: nothing named {op!r} has knobs; knob groups: {', '.join(sorted(changed))}")
        if isinstance(change, KnobGroup):
            changed[op] = change
        elif isinstance(change, Mapping):
            try:
                changed[op] = dataclasses.replace(changed[op], **change)
            except TypeError as error:
                fields = ", ".join(f.name for f in dataclasses.fields(changed[op]))
                raise ValueError(f"planning: {op} has no knob among {sorted(change)}; its knobs: {fields}") from error
        else:
            raise TypeError(
                f"planning: {op}= must be a mapping of knob values or a KnobGroup; got {type(change).__name__}"
            )
    if context is not ... and context is not None and context not in CONTEXTS[:2]:
        raise ValueError(f"planning: context must be one of {', '.join(CONTEXTS[:2])} or None; got {context!r}")
    if eager_fast_path is not ... and not isinstance(eager_fast_path, bool):
        raise TypeError(f"planning: eager_fast_path must be a bool; got {type(eager_fast_path).__name__}")
    _VERSIONS[0] += 1
    return dataclasses.replace(
        config,
        ops=changed,
        context=config.context if context is ... else context,
        eager_fast_path=config.eager_fast_path if eager_fast_path is ... else eager_fast_path,
        version=_VERSIONS[0],
    )


@contextlib.contextmanager
def planning(
    *,
    context: str | None = ...,
    eager_fast_path: bool = ...,
    **ops: Mapping | KnobGroup,  # type: ignore[assignment]
) -> Iterator[PlanConfig]:
    """Change the planner's knobs inside a ``with`` block (restored on exit), e.g.
    ``with sparsefuse.planning(sparse_decode={"margin": 1.0}): ...`` or ``planning(twell_mlp={"measured_s":
    {"twell": 20e-6, "dense": 35e-6}})``. ``context``: price every call as if it ran in that context (see
    :class:`PlanConfig`); ``eager_fast_path=False``: every call through its ``torch.library`` op. A launcher's
    thresholds the same way, e.g. ``planning(sparse_core={"max_grid_y": 3})``. Yields the config in force."""
    global CONFIG
    saved = CONFIG
    CONFIG = _changed(CONFIG, context, eager_fast_path, ops)
    try:
        yield CONFIG
    finally:
        _VERSIONS[0] += 1
        registered_since = {op: knobs for op, knobs in CONFIG.ops.items() if op not in saved.ops}
        CONFIG = dataclasses.replace(saved, ops={**registered_since, **saved.ops}, version=_VERSIONS[0])
