"""Where a distributed training step's GPU time goes: compute kernels, collectives, and the part of the collectives
that no compute kernel overlaps (what the step waits on), from the kernel intervals torch.profiler records.

``bench train`` in its distributed mode adds this to each row's note where ``Setup.profile`` is on (a lab knob): a
row's time alone cannot tell exposed communication from a slower rank (every all-reduce waits for the slowest one: its
GPU work, or its host) or from a host that cannot keep up (GPU idle). The summary of those rows reads the words back
(:func:`gpu_bound_ms`) for the step's GPU-bound time, which a host's pace moves much less.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Interval = tuple[int, int]  # [start, end) in ns


def union_length(intervals: list[Interval]) -> int:
    """Total length covered by the intervals (overlaps counted once)."""
    total, end = 0, None
    for s, e in sorted(intervals):
        covered_to = s if end is None else max(s, end)
        total += max(0, e - covered_to)
        end = e if end is None else max(end, e)
    return total


@dataclass(frozen=True)
class StepAnatomy:
    """Per step, in ms: the span from the first kernel's start to the last one's end, the time some compute kernel
    runs, the collectives' summed time, the time a collective runs with no compute kernel beside it, and the time
    no kernel runs. NaN where no GPU kernel was recorded (a CPU run)."""

    span: float
    compute: float
    collectives: float
    exposed: float
    idle: float

    def as_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([self.span, self.compute, self.collectives, self.exposed, self.idle], device=device)


def anatomy(kernels: list[tuple[int, int, str]], steps: int) -> StepAnatomy:
    """The anatomy of ``steps`` steps from their GPU kernels' (start ns, end ns, name); collectives are the kernels
    whose name holds "nccl"."""
    if not kernels:
        return StepAnatomy(*[math.nan] * 5)
    comm: list[Interval] = []
    compute: list[Interval] = []
    for s, e, name in kernels:
        (comm if "nccl" in name.lower() else compute).append((s, e))
    span = max(e for _, e, _ in kernels) - min(s for s, _, _ in kernels)
    busy, computing = union_length(comm + compute), union_length(compute)
    per_step = lambda ns: ns / steps / 1e6  # noqa: E731
    return StepAnatomy(
        span=per_step(span),
        compute=per_step(computing),
        collectives=per_step(sum(e - s for s, e in comm)),
        exposed=per_step(busy - computing),
        idle=per_step(span - busy),
    )


def profile_steps(step: Callable[[], object], steps: int = 3) -> StepAnatomy:
    """Run ``step`` ``steps`` times under torch.profiler (CUDA kernels) and return their anatomy; NaNs without CUDA."""
    if not torch.cuda.is_available():
        for _ in range(steps):
            step()
        return anatomy([], steps)
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [
        (e.start_ns(), e.start_ns() + e.duration_ns(), e.name())
        for e in prof.profiler.kineto_results.events()
        if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0
    ]
    return anatomy(kernels, steps)


def describe(ranks: Sequence[StepAnatomy]) -> str:
    """Each rank's per-step compute, collective and idle time in words, for a row's note (:func:`gpu_bound_ms`
    reads it back)."""
    by_rank = lambda field: "/".join(f"{getattr(r, field):.1f}" for r in ranks)  # noqa: E731
    if not ranks or not all(math.isfinite(r.span) for r in ranks):
        return "anatomy n/a (no GPU kernels recorded)"
    return (
        f"ms a step by rank: compute {by_rank('compute')}, NCCL {by_rank('collectives')} "
        f"(exposed {by_rank('exposed')}), idle {by_rank('idle')}"
    )


_PER_RANK = r"\d+(?:\.\d+)?(?:/\d+(?:\.\d+)?)*"  # one number per rank, "/" between them
_DESCRIBED = re.compile(
    rf"compute (?P<compute>{_PER_RANK}), NCCL {_PER_RANK} \(exposed (?P<exposed>{_PER_RANK})\), idle {_PER_RANK}"
)


def gpu_bound_ms(note: str) -> float | None:
    """The step's GPU-bound time from a note holding :func:`describe`'s words: the largest over the ranks of compute
    plus exposed collectives, i.e. the step without the time its GPUs sat idle. A rank that waits for a slower one
    waits inside a collective, so imbalance stays in, and so does what a lagging host costs the other ranks there.
    None when the note has no anatomy (or a malformed one: ranks missing from a list)."""
    found = _DESCRIBED.search(note)
    if found is None:
        return None
    compute = [float(v) for v in found["compute"].split("/")]
    exposed = [float(v) for v in found["exposed"].split("/")]
    if len(compute) != len(exposed):
        return None
    return max(c + e for c, e in zip(compute, exposed))


__all__ = ["StepAnatomy", "anatomy", "describe", "gpu_bound_ms", "profile_steps", "union_length"]
