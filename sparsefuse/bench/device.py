"""What the benchmarks measure the device by: its copy and matmul ceilings (measured in the same run as the rows
they rate), its L2 size, and the event timing every method builds on."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Ceilings", "measure_ceilings", "l2_cache_bytes", "event_times_ms"]


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """Measured device rates: copy bandwidth (bytes read + written per second) and bf16 matmul flop/s."""

    copy_bytes_per_s: float
    matmul_flops_per_s: float

    def rate(self, kind: str) -> float:
        return {"copy": self.copy_bytes_per_s, "matmul": self.matmul_flops_per_s}.get(kind, math.nan)


def event_times_ms(fn: Callable[[], Any], reps: int, before: Callable[[], Any] | None = None) -> list[float]:
    """Device time of ``fn()`` per repetition (ms). All events are recorded first and read after one sync, so the
    host never stalls the queue between repetitions. ``before()`` is enqueued ahead of each timed call, untimed."""
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in pairs:
        if before is not None:
            before()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in pairs]


def measure_ceilings(quick: bool = False) -> Ceilings:
    """Copy bandwidth from a 1 GiB device-to-device copy (bytes read + written) and bf16 matmul flop/s from
    random 8192^3 products, each the median of many event-timed repetitions."""
    reps = 10 if quick else 30
    n = (1 << 30) // 4
    src = torch.randn(n, device="cuda")  # random data: zeros can run faster than real data
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    copy_ms = statistics.median(event_times_ms(lambda: dst.copy_(src), reps))
    copy_rate = 2 * src.numel() * src.element_size() / (copy_ms * 1e-3)
    src = dst = None  # free the 8 GiB before the matmul's operands

    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(m, m, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    mm_ms = statistics.median(event_times_ms(lambda: torch.matmul(a, b, out=c), reps))
    mm_rate = 2 * m**3 / (mm_ms * 1e-3)
    a = b = c = None
    torch.cuda.empty_cache()
    return Ceilings(copy_rate, mm_rate)


def l2_cache_bytes() -> int:
    """The device's L2 size (50 MB when torch does not report it)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or 50 * 1000 * 1000)
