"""How every op that has more than one method chooses one: the estimates it keeps without a host sync
(:mod:`.estimates`), its knobs in one config object (:mod:`.config`), and the planner that owns the ladder, the
execution contexts, memoisation, warm-up and :func:`explain` (:mod:`.planner`). An op declares its cost model in its
own ``auto.py``; nothing else in the package picks a method."""

from .config import KnobGroup, Knobs, PlanConfig, planning
from .estimates import (
    EstimateCache,
    SparsityMonitor,
    device_scalar,
    observable,
    sampled_nonzero_stats,
    sampled_row_stats,
    sampled_rows,
)
from .planner import (
    AUTO,
    Explanation,
    Planner,
    call_context,
    decided,
    explain,
    explaining,
    pick_fastest,
    planner,
)

__all__ = [
    "AUTO",
    "EstimateCache",
    "Explanation",
    "KnobGroup",
    "Knobs",
    "PlanConfig",
    "Planner",
    "SparsityMonitor",
    "call_context",
    "decided",
    "device_scalar",
    "explain",
    "explaining",
    "observable",
    "pick_fastest",
    "planner",
    "planning",
    "sampled_nonzero_stats",
    "sampled_row_stats",
    "sampled_rows",
]
