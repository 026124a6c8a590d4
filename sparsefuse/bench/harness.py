"""Generic GPU benchmark harness: workload registry and per-implementation timing (ceilings: :mod:`.device`).

Nothing here knows about any particular op. A workload is a function ``options -> list[Case]`` registered by name
(see :func:`register`); each :class:`Case` carries its own input factory, implementations and cost model (minimal
bytes moved and flops), and the harness turns it into :class:`Result` rows.

How a case is timed (warm up first, device events, median of many, inputs that do not fit in the cache):

* ``method="graph"``: inputs are drawn several times so that the sets together exceed twice the L2 cache (capped in
  number and bytes); every implementation is warmed up on a side stream (this is also where Triton autotunes and
  torch.compile compiles: neither may happen inside a capture), then ONE CUDA graph calling it once per input set is
  captured and replayed; time per call = replay time / number of sets. Replaying a graph removes Python launch
  overhead for every implementation alike. If capture fails the implementation is timed with events around plain
  calls over the same sets (``method`` column: ``"events"``).
* ``method="eager"``: plain back-to-back calls from Python, device events around the sweep, the implementations
  timed in alternating rounds (a drifting host slows them alike): what a user's eager
  loop gets. For a call too small to fill the GPU this is the host's time per call (launch overhead); compared with
  the ``graph`` time of the same case it measures that overhead.
* ``method="wall"``: whole calls (e.g. an end-to-end model decode) timed with a host clock between device
  synchronizations; one input set, no graph.
* ``Case.host_ahead``: implementations of an eager case timed as the others but each call enqueued behind a sleep
  kernel long enough for the host to enqueue the whole call first (``method`` column: ``"queued"``): the call's
  GPU time on its eager path, which the ``eager`` row paces by the host where the host is as slow as the GPU.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import random
import re
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch

from .device import Ceilings, l2_cache_bytes, measure_ceilings
from .device import event_times_ms as _event_times_ms

__all__ = [
    "Case",
    "Options",
    "Result",
    "Ceilings",
    "WORKLOADS",
    "WORKLOAD_INFO",
    "WorkloadInfo",
    "register",
    "resolve_workloads",
    "measure_ceilings",
    "run_cases",
    "fill_relative_columns",
    "tensor_bytes",
    "dtype_name",
    "l2_cache_bytes",
]

Direction = Literal["fwd", "fwd+bwd"]
CeilingKind = Literal["copy", "matmul", "none"]


@dataclasses.dataclass(frozen=True)
class Options:
    """What the user asked for; workloads read it to choose shapes and dtypes."""

    quick: bool = False
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
    device: str = "cuda"
    max_sets: int = 256  # cap on rotated input sets (small shapes would otherwise need thousands)
    max_rotation_bytes: int = 4 << 30  # cap on the rotated inputs' total size (further capped by free memory)
    log: Callable[[str], None] = print  # where workloads print notes (e.g. "skipped: snac not installed")
    checkpoint: str | None = None  # model workload: a saved model to bench instead of the synthetic ones


@dataclasses.dataclass
class Case:
    """One (workload, shape, dtype, direction) point and the implementations to compare on it.

    ``make_inputs()`` returns a FRESH tuple of random inputs on the device (never zeros: they can hide unwritten
    outputs and run faster than real data); every implementation is called as ``impl(*inputs)``. For
    ``direction="fwd+bwd"`` the implementation itself runs forward and backward (e.g. via ``torch.autograd.grad``),
    so the harness stays op-agnostic.

    ``bytes_moved``/``flops`` are the minimal cost (each input read once, each output written once); ``ceiling``
    says which measured device rate that cost is compared with. ``eager_impl``/``compile_impl`` name the rows the
    speed-up columns divide by (None: no such column for this case). ``auto_choices`` maps an implementation that
    picks a method itself (``method="auto"``) to the implementations it picks among, so the report can say whether
    its pick was the fastest (column ``auto_vs_best``).
    """

    workload: str
    shape: str
    dtype: torch.dtype
    direction: Direction
    bytes_moved: int
    flops: int
    ceiling: CeilingKind
    make_inputs: Callable[[], tuple[Any, ...]]
    impls: dict[str, Callable[..., Any]]
    method: Literal["graph", "eager", "wall"] = "graph"
    rotate: bool = True  # False: time one input set (e.g. a model whose inputs are tiny and weights dominate)
    eager_impl: str | None = "eager"
    compile_impl: str | None = "torch.compile"
    auto_choices: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    host_ahead: frozenset[str] = frozenset()  # eager impls timed with the host ahead of the GPU (method "queued")
    tokens: int = 0  # tokens one call processes (a model's batch x sequence): gives the tokens/s column
    # per implementation, where they differ (each at its own batch size): tokens one call processes, and the row's
    # note; both read after the implementation has run
    impl_tokens: Callable[[str], int] | None = None
    impl_note: Callable[[str], str] | None = None


WorkloadFn = Callable[[Options], list[Case]]
WORKLOADS: dict[str, WorkloadFn] = {}


@dataclasses.dataclass(frozen=True)
class WorkloadInfo:
    """What a workload's plot says without the text: ``title`` names the op and what is compared, ``shape`` what
    the shape labels mean."""

    title: str
    shape: str = "shape"
    # Optional, for workloads the generic report does not suit: extra markdown lines from the rows, and a plot
    # ``plot(rows, meta, path) -> drawn`` in place of the generic one.
    summary: Callable[[Sequence[Result]], list[str]] | None = None
    plot: Callable[[Sequence[Result], dict[str, str], Any], bool] | None = None


WORKLOAD_INFO: dict[str, WorkloadInfo] = {}


def register(
    name: str,
    title: str = "",
    shape: str = "shape",
    *,
    summary: Callable[[Sequence[Result]], list[str]] | None = None,
    plot: Callable[[Sequence[Result], dict[str, str], Any], bool] | None = None,
) -> Callable[[WorkloadFn], WorkloadFn]:
    """Decorator: ``@register("snake", "Snake: sparsefuse vs ...", "[batch, channels, time]") def snake_cases(options)
    -> list[Case]``; ``summary`` and ``plot`` as :class:`WorkloadInfo`."""

    def wrap(fn: WorkloadFn) -> WorkloadFn:
        if name in WORKLOADS and WORKLOADS[name] is not fn:
            raise ValueError(f"benchmark workload {name!r} is registered twice")
        WORKLOADS[name] = fn
        WORKLOAD_INFO[name] = WorkloadInfo(title or name, shape, summary, plot)
        return fn

    return wrap


def resolve_workloads(names: Sequence[str]) -> list[str]:
    """Validated workload names (all registered ones, sorted, for an empty list). Raises KeyError naming the
    known workloads for an unknown name."""
    from . import workloads  # noqa: F401  (imports every workload module, which registers itself)

    known = sorted(WORKLOADS)
    if not names:
        return known
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise KeyError(f"unknown workload(s) {', '.join(map(repr, unknown))}; known workloads: {', '.join(known)}")
    return list(dict.fromkeys(names))


@dataclasses.dataclass
class Result:
    """One row of the report: one implementation on one case."""

    workload: str
    shape: str
    dtype: str
    direction: str
    impl: str
    method: str = ""  # "graph", "events" (graph capture failed), "eager", "queued", "wall"; "" when it failed
    sets: int = 0  # rotated input sets per timed call group
    rotation_mb: float = 0.0  # their total size
    median_us: float = math.nan
    gbps: float = math.nan
    tflops: float = math.nan
    tokens_per_s: float = math.nan  # Case.tokens / time, for cases that name their tokens
    ceiling: str = "none"
    pct_ceiling: float = math.nan
    speedup_eager: float = math.nan
    speedup_compile: float = math.nan
    auto_vs_best: float = math.nan  # an auto row: the fastest of its choices' time / its time (1.0: it picked the best)
    peak_mb: float = math.nan
    bytes_moved: int = 0
    flops: int = 0
    status: str = "ok"
    note: str = ""  # what the case says of this row (e.g. the batch size it ran at); shown when status is ok
    # Not written to files: which rows the speed-up columns divide by, and an auto row's choices.
    eager_impl: str | None = dataclasses.field(default=None, repr=False)
    compile_impl: str | None = dataclasses.field(default=None, repr=False)
    auto_choices: tuple[str, ...] = dataclasses.field(default=(), repr=False)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_bytes(obj: Any) -> int:
    """Total bytes of the tensors in a (nested) tuple/list/dict of inputs."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o) for o in obj.values())
    return 0


# ----------------------------------------------------------------------------------------------------------------
# Device timing primitives
# ----------------------------------------------------------------------------------------------------------------


def _choose_reps(fn: Callable[[], Any], quick: bool) -> int:
    """Enough repetitions for a stable median within a time budget: at least 5 (quick) / 20, at most 20 / 200."""
    lo, hi, budget_s = (5, 20, 0.1) if quick else (20, 200, 0.5)
    probe_ms = statistics.median(_event_times_ms(fn, 3))
    return max(lo, min(hi, int(budget_s * 1e3 / max(probe_ms, 1e-3))))


def _number_of_sets(bytes_per_set: int, options: Options) -> int:
    """Sets needed for the rotation to exceed 2x L2 (so every call reads from DRAM), within the set and byte caps."""
    if bytes_per_set <= 0:
        return 1
    free, _ = torch.cuda.mem_get_info()
    byte_cap = min(options.max_rotation_bytes, free // 4)  # outputs and workspaces need room too
    wanted = math.ceil(2 * l2_cache_bytes() / bytes_per_set)
    return max(1, min(wanted, options.max_sets, byte_cap // bytes_per_set))


def _warm_up(fn: Callable[..., Any], sets: list[tuple[Any, ...]], calls: int) -> None:
    # On a side stream, as CUDA-graph capture wants (autograd and cuBLAS set up per-stream state lazily); this is
    # also where autotuning and compilation happen, which must stay outside any capture.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            fn(*sets[i % len(sets)])
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def _peak_bytes(fn: Callable[..., Any], inputs: tuple[Any, ...]) -> int:
    """Allocator high-water mark of one call above what was allocated before it (outputs included)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn(*inputs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return max(0, peak)


def _capture_graph(fn: Callable[..., Any], sets: list[tuple[Any, ...]]) -> tuple[Any, list[Any]] | None:
    """One CUDA graph holding one call per set, and the outputs it writes (kept referenced so that every call
    writes fresh memory: reusing one output buffer would let the writes of small cases live in L2); None if
    capture fails."""
    graph = torch.cuda.CUDAGraph()
    outputs: list[Any] = []
    stream = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph):
            for inputs in sets:
                outputs.append(fn(*inputs))
    except Exception:  # noqa: BLE001  (any capture failure means: time plain calls instead)
        # A failing capture can leave its capture stream current (the graph context exits early): restore ours.
        torch.cuda.set_stream(stream)
        del graph
        outputs.clear()
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        return None
    graph.replay()
    torch.cuda.synchronize()
    return graph, outputs


def _time_graphs_interleaved(graphs: dict[str, Any], n_sets: int, quick: bool) -> dict[str, float]:
    """Median ms per call of each graph's replays, the graphs replayed in rounds with every event recorded before
    one final sync: a device whose clock or memory speed drifts during the measurement slows every
    implementation alike, instead of whichever happened to be timed then (one kernel timed as three graphs one
    after another spread 13% at 20 us, H200)."""
    reps = {name: _choose_reps(graph.replay, quick) for name, graph in graphs.items()}
    order = random.Random(0)
    events: dict[str, list[tuple[Any, Any]]] = {name: [] for name in graphs}
    for round_ in range(max(reps.values())):
        # Each round in a fresh order, so no implementation always comes right after the same one: a graph replayed
        # after a heavy one (cuBLAS reading a whole W_dec) ran ~2 us slower at 15 us (H200). A rotation would not
        # do: it keeps every implementation's predecessor. A graph leaves the rounds once it has its own count of
        # replays (a slow one fewer), so the case takes no longer than its graphs timed one by one.
        live = [name for name in graphs if round_ < reps[name]]
        for name in order.sample(live, len(live)):
            graph = graphs[name]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {
        name: statistics.median(start.elapsed_time(end) for start, end in pairs) / n_sets
        for name, pairs in events.items()
    }


def _interleave_budget() -> float:
    """Bytes the graphs of one case may hold at once to be replayed in rounds together: a quarter of the free
    device memory, so a big case's later implementations still find room for their own calls."""
    free, _ = torch.cuda.mem_get_info()
    return free / 4


def _time_events(fn: Callable[..., Any], sets: list[tuple[Any, ...]], quick: bool) -> float:
    """Median ms per call of plain calls over all sets (Python launch overhead included)."""

    def sweep() -> None:
        for inputs in sets:
            fn(*inputs)

    reps = _choose_reps(sweep, quick)
    return statistics.median(_event_times_ms(sweep, reps)) / len(sets)


def _time_events_interleaved(
    fns: dict[str, Callable[..., Any]], sets: list[tuple[Any, ...]], quick: bool, host_ahead: frozenset[str]
) -> dict[str, float]:
    """:func:`_time_events` for several implementations in alternating rounds (one sweep of each per round), so a
    host whose speed drifts during the measurement -- common for host-bound eager loops -- slows every
    implementation alike instead of whichever happened to run then. Each sweep of ``host_ahead`` is enqueued behind
    a sleep kernel of twice its host time (at most 2 GHz clocks, so at least that long), so that the host has
    enqueued all of it before the GPU starts it: its GPU time."""
    sweeps = {name: (lambda fn=fn: [fn(*inputs) for inputs in sets]) for name, fn in fns.items()}
    reps = max(_choose_reps(sweep, quick) for sweep in sweeps.values())
    before: dict[str, Callable[[], Any] | None] = dict.fromkeys(fns)
    for name in host_ahead & fns.keys():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sweeps[name]()
        cycles = int(2e9 * (2 * (time.perf_counter() - t0) + 1e-3))
        torch.cuda.synchronize()
        before[name] = lambda cycles=cycles: torch.cuda._sleep(cycles)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, sweep in sweeps.items():
            times[name] += _event_times_ms(sweep, 1, before[name])
    return {name: statistics.median(t) / len(sets) for name, t in times.items()}


def _time_wall(fn: Callable[..., Any], inputs: tuple[Any, ...], quick: bool) -> float:
    """Median ms of whole calls, host clock between device synchronizations (end-to-end latency)."""
    reps = 5 if quick else 20
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*inputs)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ----------------------------------------------------------------------------------------------------------------
# Running cases
# ----------------------------------------------------------------------------------------------------------------


def _reset_compile_caches() -> None:
    # Each case compiles from scratch: otherwise shapes seen in earlier cases make torch.compile switch to
    # dynamic-shape kernels, and after 8 recompiles of one function it silently falls back to eager.
    try:
        import torch._dynamo

        torch._dynamo.reset()
    except Exception:  # noqa: BLE001  (no dynamo: nothing to reset)
        pass


def _blank_row(case: Case, impl: str) -> Result:
    return Result(
        workload=case.workload,
        shape=case.shape,
        dtype=dtype_name(case.dtype),
        direction=case.direction,
        impl=impl,
        ceiling=case.ceiling,
        bytes_moved=case.bytes_moved,
        flops=case.flops,
        eager_impl=case.eager_impl,
        compile_impl=case.compile_impl,
        auto_choices=case.auto_choices.get(impl, ()),
    )


# The figures of torch's CUDA out-of-memory message: what the row needed and where the memory was
_OOM_FIGURES = {
    "tried": r"Tried to allocate ([0-9.]+ [KMG]iB)",
    "free": r"of which ([0-9.]+ [KMG]iB) is free",
    "in use": r"this process has ([0-9.]+ [KMG]iB) memory in use",
    "allocated": r"([0-9.]+ [KMG]iB) is allocated by PyTorch",
    "cached": r"([0-9.]+ [KMG]iB) is reserved by PyTorch but unallocated",
}


def _short_error(exc: BaseException) -> str:
    """One line for a failed row's status. Out of GPU memory: the request and the memory's whereabouts (in use by
    the process, held by live tensors, cached), which say whether earlier cases left memory behind."""
    if isinstance(exc, torch.OutOfMemoryError):
        found = {key: re.search(pattern, str(exc)) for key, pattern in _OOM_FIGURES.items()}
        figures = ", ".join(f"{key} {match.group(1)}" for key, match in found.items() if match)
        if figures:
            return f"OutOfMemoryError: {figures}"[:200]
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return text[:160]


def run_case(case: Case, options: Options, ceilings: Ceilings, advance: Callable[[str], None]) -> list[Result]:
    """Time every implementation of one case; a failing implementation gives a row with its error, not a crash."""
    _reset_compile_caches()
    rows: list[Result] = []
    try:
        first = case.make_inputs()
        per_set = tensor_bytes(first)
        n_sets = 1 if case.method == "wall" or not case.rotate else _number_of_sets(per_set, options)
        sets = [first] + [case.make_inputs() for _ in range(n_sets - 1)]
    except Exception as exc:  # noqa: BLE001  (e.g. out of memory for this shape: report, go on)
        for impl in case.impls:
            row = _blank_row(case, impl)
            row.status = f"inputs: {_short_error(exc)}"
            rows.append(row)
            advance(impl)
        torch.cuda.empty_cache()
        return rows

    interleaved: dict[str, Callable[..., Any]] = {}  # eager cases: timed together after every warm-up
    graphs: dict[str, tuple[Any, list[Any]]] = {}  # graph cases: captured, replayed together at the end
    graph_bytes = 0.0  # what the kept graphs' outputs and workspaces hold (peak of a call x sets)
    for impl, fn in case.impls.items():
        row = _blank_row(case, impl)
        row.sets, row.rotation_mb = n_sets, per_set * n_sets / 1e6
        try:
            _warm_up(fn, sets, calls=max(5, min(len(sets), 10)))
            row.peak_mb = _peak_bytes(fn, sets[0]) / 1e6
            if case.method == "wall":
                ms, row.method = _time_wall(fn, sets[0], options.quick), "wall"
            elif case.method == "eager":
                interleaved[impl], row.method = fn, "queued" if impl in case.host_ahead else "eager"
            else:
                captured = _capture_graph(fn, sets)
                row.method = "graph"
                if captured is None:
                    ms, row.method = _time_events(fn, sets, options.quick), "events"
                elif graph_bytes + row.peak_mb * 1e6 * n_sets <= _interleave_budget():
                    graphs[impl], graph_bytes = captured, graph_bytes + row.peak_mb * 1e6 * n_sets
                else:  # too big to keep beside the others: timed alone, now
                    ms = _time_graphs_interleaved({impl: captured[0]}, n_sets, options.quick)[impl]
                del captured
            if impl not in interleaved and impl not in graphs:
                _fill_rates(row, case, ceilings, ms)
        except Exception as exc:  # noqa: BLE001
            _failed(row, exc)
        rows.append(row)
        advance(impl)
    if graphs:
        try:
            timed = _time_graphs_interleaved({impl: g for impl, (g, _) in graphs.items()}, n_sets, options.quick)
            for impl, ms in timed.items():
                _fill_rates(next(r for r in rows if r.impl == impl), case, ceilings, ms)
        except Exception as exc:  # noqa: BLE001
            for row in rows:
                if row.impl in graphs:
                    _failed(row, exc)
        graphs.clear()
    if interleaved:
        try:
            for impl, ms in _time_events_interleaved(interleaved, sets, options.quick, case.host_ahead).items():
                _fill_rates(next(r for r in rows if r.impl == impl), case, ceilings, ms)
        except Exception as exc:  # noqa: BLE001
            for row in rows:
                if row.impl in interleaved:
                    _failed(row, exc)
    del sets, first
    gc.collect()
    torch.cuda.empty_cache()
    fill_relative_columns(rows)
    return rows


def _fill_rates(row: Result, case: Case, ceilings: Ceilings, ms: float) -> None:
    row.median_us = ms * 1e3
    seconds = ms * 1e-3
    if case.bytes_moved:
        row.gbps = case.bytes_moved / seconds / 1e9
    if case.flops:
        row.tflops = case.flops / seconds / 1e12
    tokens = case.impl_tokens(row.impl) if case.impl_tokens is not None else case.tokens
    if tokens:
        row.tokens_per_s = tokens / seconds
    if case.impl_note is not None:
        row.note = case.impl_note(row.impl)
    achieved = {"copy": case.bytes_moved / seconds, "matmul": case.flops / seconds}.get(case.ceiling)
    if achieved:
        row.pct_ceiling = 100.0 * achieved / ceilings.rate(case.ceiling)


def _failed(row: Result, exc: Exception) -> None:
    row.method, row.status = "", _short_error(exc)
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        pass


def fill_relative_columns(rows: Iterable[Result]) -> None:
    """Speed-ups vs the case's eager and torch.compile rows (time of the reference / time of the row), and each auto
    row's fastest choice / its time."""
    groups: dict[tuple[str, str, str, str], list[Result]] = {}
    for r in rows:
        groups.setdefault((r.workload, r.shape, r.dtype, r.direction), []).append(r)
    for group in groups.values():
        times = {r.impl: r.median_us for r in group if r.status == "ok"}
        for r in group:
            if r.status != "ok":
                continue
            for ref_name, attr in ((r.eager_impl, "speedup_eager"), (r.compile_impl, "speedup_compile")):
                ref = times.get(ref_name) if ref_name else None
                if ref is not None and r.median_us > 0:
                    setattr(r, attr, ref / r.median_us)
            chosen = [times[c] for c in r.auto_choices if c in times]
            if chosen and r.median_us > 0:
                r.auto_vs_best = min(chosen) / r.median_us


def run_cases(
    cases: Sequence[Case],
    options: Options,
    ceilings: Ceilings,
    progress: Callable[[str], None] | None = None,
    case_done: Callable[[list[Result]], None] | None = None,
) -> list[Result]:
    """Run all cases in order. ``progress(label)`` is called once per finished implementation and
    ``case_done(all rows so far)`` once per finished case (to save partial results of a long run)."""
    results: list[Result] = []
    for case in cases:
        label = f"{case.workload} {case.shape} {dtype_name(case.dtype)} {case.direction}"
        results.extend(
            run_case(case, options, ceilings, lambda impl, label=label: progress and progress(f"{label} {impl}"))
        )
        if case_done:
            case_done(results)
    return results
