"""The ``python -m sparsefuse bench|check`` command line, and the GPU-free parts of the benchmark harness.

The CLI runs in subprocesses (the commands re-execute themselves, which must not replace pytest). The harness's
timing loop is exercised in-process on the CPU with a stand-in for the few ``torch.cuda`` calls it makes, so its
control flow (rotation, graph capture and its fallback, peak memory, speed-ups, result files) is tested without a
GPU; the real device path runs only on a GPU machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from conftest import needs_modern_interpreter

import sparsefuse
import sparsefuse._backend
from sparsefuse.__main__ import main, parse_dtypes
from sparsefuse.bench import check, harness, report
from sparsefuse.bench import workloads as _workloads  # noqa: F401  (registers every workload, whatever test runs first)
from sparsefuse.bench.harness import Case, Ceilings, Options

REPO = Path(__file__).resolve().parents[2]
# torch.compile's import of torch.utils.mkldnn warns about its own TorchScript use; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def run_cli(*args: str, interpret: bool, timeout: float = 600) -> subprocess.CompletedProcess:
    # Generous: the interpreted `check` takes ~35 s alone but several times that beside other xdist workers.
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "_SPARSEFUSE_REEXECUTED")}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "sparsefuse", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------


@needs_modern_interpreter
def test_check_small_passes_under_interpreter():
    proc = run_cli("check", "--size", "small", interpret=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "backend=interpreter" in proc.stdout
    assert "FAIL" not in proc.stdout and "all passed" in proc.stdout
    for op in check.OPS:  # every op, each launching a sparsefuse kernel (check_op fails an op that launches none)
        assert f"PASS  {op}" in proc.stdout, op


def test_check_and_bench_fallback_run_only_the_named_workloads(monkeypatch):
    """`check snake` and, without a GPU, `bench snake` run the snake ops and nothing else."""
    seen: list[str] = []
    monkeypatch.setattr(
        check,
        "check_op",
        lambda name, *a: seen.append(name) or check.CheckResult(name, "float32", "1", "interpreter", ["k"], []),
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for command in ("check", "bench"):
        seen.clear()
        assert main([command, "snake", "--dtype", "float32"], allow_reexec=False) == 0
        assert seen and all(name.startswith("snake") for name in seen), (command, seen)
        assert set(seen) == {n for n, op in check.OPS.items() if op.family == "snake"}
    seen.clear()
    assert main(["check", "sae", "--dtype", "float32"], allow_reexec=False) == 0
    assert {check.OPS[n].family for n in seen} == {"sae_decode", "sae_encode"}


def test_every_op_family_and_workload_is_checked():
    families = {op.family for op in check.OPS.values()}
    assert families == {f for fams in check.WORKLOAD_FAMILIES.values() for f in fams}
    assert set(harness.resolve_workloads([])) <= set(check.WORKLOAD_FAMILIES)  # bench's fallback covers every one
    public = {
        "snake",
        "celu",
        "celu_",
        "sparse_decode",
        "topk_decode",
        "jumprelu_encode",
        "topk_encode",
        "splade_pool",
        "twell_mlp",
        "twell_relu_mlp",
    }
    assert public <= set(sparsefuse.__all__)
    covered = " ".join(check.OPS)
    for op, needle in {
        "sparse_decode": "sae decode",
        "topk_decode": "topk_decode",
        "splade_pool": "splade",
        "jumprelu_encode": "jumprelu_encode",
        "topk_encode": "topk_encode",
        "celu_": "celu_",
        "twell_mlp": "twell_mlp",
        "twell_relu_mlp": "twell_relu_mlp",
    }.items():
        assert needle in covered, op
    assert check.ops_for(["snake"]) == [n for n in check.OPS if n.startswith("snake")]
    with pytest.raises(KeyError, match="unknown workload"):
        check.ops_for(["nope"])


@pytest.mark.parametrize("command", ["check", "bench"])
def test_unknown_workload_in_check_or_bench_is_a_clear_error(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "nope"], allow_reexec=False)
    assert exit_info.value.code == 2
    assert "unknown workload(s) 'nope'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-GPU fallback")
def test_bench_without_gpu_reexecs_and_runs_check_of_its_workload():
    proc = run_cli("bench", "snake", "--quick", "--dtype", "float32", interpret=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "re-running with TRITON_INTERPRET=1" in proc.stdout
    assert "timings need a CUDA GPU" in proc.stdout and "check --size small snake" in proc.stdout
    assert "backend=interpreter" in proc.stdout and "all passed" in proc.stdout
    checked = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert checked and all(op == "snake" for op in checked), proc.stdout


def test_unknown_workload_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "snake", "no-such-workload"], allow_reexec=False)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown workload(s) 'no-such-workload'" in err
    known = err.split("known workloads:")[1]
    assert all(name in known for name in ("celu", "sae_decode", "snac", "snake", "splade", "overhead"))


def test_parse_dtypes():
    assert parse_dtypes("float32, bf16,fp16,float32") == (torch.float32, torch.bfloat16, torch.float16)
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        parse_dtypes("int8")


# ----------------------------------------------------------------------------------------------------------------
# Registry and workloads (listing cases touches no device; impls are run on tiny CPU inputs)
# ----------------------------------------------------------------------------------------------------------------


def test_registry_and_case_listing():
    assert {"snake", "celu", "snac"} <= set(harness.resolve_workloads([]))
    assert harness.resolve_workloads(["celu", "snake", "celu"]) == ["celu", "snake"]
    with pytest.raises(ValueError, match="registered twice"):
        harness.register("snake")(lambda options: [])

    options = Options(quick=True, device="cpu", dtypes=(torch.float16,))
    snake_cases = harness.WORKLOADS["snake"](options)
    assert len(snake_cases) == 2 * 2  # quick shapes x directions
    for case in snake_cases:
        expected = {"sparsefuse", "sparsefuse fast_sin", "eager", "torch.compile", "SNAC TorchScript snake"}
        assert set(case.impls) == (expected | {"copy"} if case.direction == "fwd" else expected)
        B, C, T = map(int, case.shape.split("x"))
        assert case.bytes_moved == (2 if case.direction == "fwd" else 5) * B * C * T * 2
        assert case.ceiling == "copy" and case.method == "graph"
    celu_cases = harness.WORKLOADS["celu"](options)
    assert {c.direction for c in celu_cases} == {"fwd", "fwd+bwd"}
    assert all(("sparsefuse celu_" in c.impls) == (c.direction == "fwd") for c in celu_cases)


@pytest.mark.parametrize("direction", ["fwd", "fwd+bwd"])
def test_activation_impls_agree_on_tiny_inputs(direction):
    """Every implementation a case times computes the same function (torch.compile skipped: it would build CPU
    code here)."""
    options = Options(quick=True, device="cpu", dtypes=(torch.float32,))
    snake_case = next(c for c in harness.WORKLOADS["snake"](options) if c.direction == direction)
    celu_case = next(c for c in harness.WORKLOADS["celu"](options) if c.direction == direction)
    x = torch.randn(2, 3, 50)
    alpha = torch.empty(1, 3, 1).uniform_(0.5, 2.0)
    g = torch.randn_like(x)
    for case, make in ((snake_case, lambda: (x.clone(), alpha.clone())), (celu_case, lambda: (x.clone(),))):
        results = {}
        for name, fn in case.impls.items():
            if name in ("torch.compile", "copy"):  # compile would build CPU code; copy is a bandwidth yardstick
                continue
            inputs = make()
            if direction == "fwd+bwd":
                inputs = tuple(t.requires_grad_() for t in inputs) + (g,)
            out = fn(*inputs)
            results[name] = out if name != "sparsefuse celu_" else inputs[0]
        reference = results["eager"]
        for name, out in results.items():
            outs = out if isinstance(out, tuple) else (out,)
            refs = reference if isinstance(reference, tuple) else (reference,)
            for o, r in zip(outs, refs):
                torch.testing.assert_close(o.detach(), r.detach(), rtol=1e-4, atol=1e-4, msg=f"{case.workload} {name}")


# ----------------------------------------------------------------------------------------------------------------
# Harness timing loop with a CPU stand-in for torch.cuda
# ----------------------------------------------------------------------------------------------------------------


class _FakeCuda:
    """Just enough of torch.cuda for harness.run_case: host-clock events, a 'graph' that runs its calls at
    capture and sleeps on replay, and allocator counters."""

    def __init__(self) -> None:
        self.capturing = False

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            self.t = 0.0

        def record(self, stream=None) -> None:
            self.t = time.perf_counter()

        def elapsed_time(self, end) -> float:
            return (end.t - self.t) * 1e3

    class CUDAGraph:
        def replay(self) -> None:
            time.sleep(2e-4)

    def graph(self, g):
        fake = self

        @contextlib.contextmanager
        def capture():
            fake.capturing = True
            try:
                yield
            finally:
                fake.capturing = False

        return capture()

    def install(self, monkeypatch) -> None:
        cuda = torch.cuda
        noop = lambda *a, **k: None  # noqa: E731
        for name, value in {
            "Event": self.Event,
            "CUDAGraph": self.CUDAGraph,
            "graph": self.graph,
            "synchronize": noop,
            "empty_cache": noop,
            "reset_peak_memory_stats": noop,
            "set_stream": noop,
            "Stream": lambda *a, **k: types.SimpleNamespace(wait_stream=noop),
            "current_stream": lambda *a, **k: types.SimpleNamespace(wait_stream=noop),
            "stream": lambda s: contextlib.nullcontext(),
            "is_current_stream_capturing": lambda: self.capturing,
            "mem_get_info": lambda *a: (8 << 30, 16 << 30),
            "current_device": lambda: 0,
            "get_device_properties": lambda *a: types.SimpleNamespace(L2_cache_size=1 << 20),
            "memory_allocated": lambda *a: 1000,
            "max_memory_allocated": lambda *a: 1000 + 4_000_000,
        }.items():
            monkeypatch.setattr(cuda, name, value)


def _fake_case(direction: str = "fwd") -> Case:
    n = 10_000

    def refuses_capture(x: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("operation not permitted when stream is capturing")
        return x * 2

    def broken(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom [/not markup]")

    return Case(
        workload="fake",
        shape=f"{n}",
        dtype=torch.float32,
        direction=direction,
        bytes_moved=2 * n * 4,
        flops=n,
        ceiling="copy",
        make_inputs=lambda: (torch.randn(n),),
        impls={
            "eager": lambda x: x * 2,
            "torch.compile": lambda x: x * 2,
            "mine": lambda x: x + x,
            "no graph": refuses_capture,
            "broken": broken,
        },
    )


def test_harness_run_case_with_fake_cuda(monkeypatch):
    _FakeCuda().install(monkeypatch)
    ticks: list[str] = []
    ceilings = Ceilings(copy_bytes_per_s=1e12, matmul_flops_per_s=1e15)
    rows = harness.run_cases([_fake_case()], Options(quick=True, device="cpu"), ceilings, ticks.append)
    by_impl = {r.impl: r for r in rows}
    assert len(ticks) == len(rows) == 5
    # 40 kB per set; 2x the fake 1 MiB L2 needs 53 sets.
    assert by_impl["eager"].sets == 53
    assert by_impl["eager"].method == "graph" and by_impl["eager"].status == "ok"
    assert by_impl["no graph"].method == "events" and by_impl["no graph"].status == "ok"
    assert by_impl["broken"].status.startswith("RuntimeError: boom") and math.isnan(by_impl["broken"].median_us)
    eager = by_impl["eager"]
    assert eager.median_us > 0 and eager.peak_mb == pytest.approx(4.0)
    assert eager.gbps == pytest.approx(80_000 / (eager.median_us * 1e-6) / 1e9)
    assert eager.pct_ceiling == pytest.approx(100 * eager.gbps * 1e9 / 1e12)
    assert eager.speedup_eager == pytest.approx(1.0)
    mine = by_impl["mine"]
    assert mine.speedup_compile == pytest.approx(by_impl["torch.compile"].median_us / mine.median_us)


def test_harness_times_host_ahead_impls_behind_a_sleep(monkeypatch):
    """An eager case's ``host_ahead`` implementations are timed like the others, each timed call enqueued behind a
    sleep kernel of at least twice its host time (method ``queued``)."""
    _FakeCuda().install(monkeypatch)
    slept: list[int] = []
    monkeypatch.setattr(torch.cuda, "_sleep", slept.append, raising=False)
    calls = {"eager": 0, "mine": 0}

    def counted(name):
        def fn(x):
            calls[name] += 1
            return x * 2

        return fn

    case = _fake_case()
    case.impls = {name: counted(name) for name in calls}
    case.method, case.rotate, case.host_ahead, case.compile_impl = "eager", False, frozenset({"mine"}), None
    ceilings = Ceilings(copy_bytes_per_s=1e12, matmul_flops_per_s=1e15)
    rows = harness.run_cases([case], Options(quick=True, device="cpu"), ceilings, lambda _: None)
    by_impl = {r.impl: r for r in rows}
    assert by_impl["mine"].method == "queued" and by_impl["eager"].method == "eager"
    assert all(r.status == "ok" and r.median_us > 0 for r in rows)
    assert len(slept) >= 5 and min(slept) >= 2e6  # one sleep per timed call (quick: >= 5), >= 1 ms at 2 GHz


def _replay_log(monkeypatch) -> list[int]:
    """The fake device's graphs, numbered in capture order, log each replay."""
    fake, log = _FakeCuda(), []
    fake.install(monkeypatch)
    captured = itertools.count()

    class LoggedGraph(_FakeCuda.CUDAGraph):
        def __init__(self) -> None:
            self.number = next(captured)

        def replay(self) -> None:
            log.append(self.number)

    monkeypatch.setattr(torch.cuda, "CUDAGraph", LoggedGraph)
    return log


def _graph_case() -> Case:
    case = _fake_case()
    case.impls = {name: case.impls[name] for name in ("eager", "torch.compile", "mine")}
    return case


def test_harness_replays_the_graphs_of_a_case_in_rounds_of_varying_order(monkeypatch):
    log = _replay_log(monkeypatch)
    rows = harness.run_cases([_graph_case()], Options(quick=True, device="cpu"), Ceilings(1e12, 1e15))
    assert [(r.method, r.status) for r in rows] == [("graph", "ok")] * 3
    timed = log[3 + 3 * 3 :]  # after a check replay per capture and 3 probe replays per graph (_choose_reps)
    rounds = [timed[i : i + 3] for i in range(0, len(timed), 3)]
    assert len(rounds) >= 5 and all(sorted(r) == [0, 1, 2] for r in rounds)  # each graph once a round
    before_first = {a for a, b in zip(timed, timed[1:]) if b == 0 and a != 0}
    assert before_first == {1, 2}  # graph 0 comes right after each of the others in some rounds: orders vary


def test_harness_graph_leaves_the_rounds_after_its_own_count_of_replays(monkeypatch):
    """A slow graph (fewer replays fit the time budget) stops early instead of taking the fast ones' count."""
    log = _replay_log(monkeypatch)
    counts = {0: 5, 1: 12, 2: 12}
    monkeypatch.setattr(harness, "_choose_reps", lambda fn, quick: counts[fn.__self__.number])
    rows = harness.run_cases([_graph_case()], Options(quick=True, device="cpu"), Ceilings(1e12, 1e15))
    assert [(r.method, r.status) for r in rows] == [("graph", "ok")] * 3
    timed = log[3:]  # after a check replay per capture (the probe replays are stubbed out)
    assert [timed.count(n) for n in (0, 1, 2)] == [5, 12, 12]
    assert sorted(timed[:15]) == [0] * 5 + [1] * 5 + [2] * 5  # the first 5 rounds hold all three


def test_harness_times_a_graph_alone_when_keeping_it_would_not_fit(monkeypatch):
    log = _replay_log(monkeypatch)
    monkeypatch.setattr(harness, "_interleave_budget", lambda: 0.0)
    rows = harness.run_cases([_graph_case()], Options(quick=True, device="cpu"), Ceilings(1e12, 1e15))
    assert [(r.method, r.status) for r in rows] == [("graph", "ok")] * 3
    assert log == sorted(log)  # each graph replayed to the end before the next was captured


def test_bench_command_end_to_end_with_fake_cuda(monkeypatch, tmp_path, capsys):
    """The bench command's glue (case listing, ceilings, progress, table, files) on a fake device."""
    fake = _FakeCuda()
    fake.install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sparsefuse._backend, "INTERPRET", False)  # bench refuses to time interpreted kernels
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU 9000")
    monkeypatch.setattr(harness, "measure_ceilings", lambda quick=False: Ceilings(2.0e12, 5.0e14))
    monkeypatch.setitem(harness.WORKLOADS, "fake", lambda options: [_fake_case()])
    monkeypatch.setenv("SPARSEFUSE_COMMIT", "feedbee")
    rc = main(["bench", "fake", "--quick", "--out", str(tmp_path)], allow_reexec=False)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "copy ceiling: 2000 GB/s" in out and "matmul ceiling: 500 TFLOP/s" in out
    assert "[5/5] fake 10000 float32 fwd broken" in out  # progress lines (output is not a terminal)
    assert "1 of 5 measurements failed" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "fake-Fake-GPU-9000-quick.csv",
        "fake-Fake-GPU-9000-quick.md",
        "fake-Fake-GPU-9000-quick.png",
    ]


def test_overhead_workload_lists_eager_and_graph_cases():
    cases = harness.WORKLOADS["overhead"](Options(quick=True, device="cpu"))
    assert {c.method for c in cases} == {"eager", "graph"} and not any(c.rotate for c in cases)
    snake = [c for c in cases if c.shape.startswith("snake")]
    assert [c.shape.rsplit(" ", 2)[-2:] for c in snake] == [["eager", "calls"], ["graph", "replay"]]
    assert {"sparsefuse", "eager", "SNAC TorchScript snake"} <= set(snake[0].impls)
    assert harness.WORKLOAD_INFO["overhead"].title.startswith("Time per small call")


def test_harness_eager_method_times_plain_calls(monkeypatch):
    _FakeCuda().install(monkeypatch)
    case = _fake_case()
    case.method, case.rotate = "eager", False
    case.impls = {"eager": case.impls["eager"], "no graph": case.impls["no graph"]}
    rows = harness.run_cases([case], Options(quick=True, device="cpu"), Ceilings(1e12, 1e15))
    assert [(r.method, r.sets, r.status) for r in rows] == [("eager", 1, "ok"), ("eager", 1, "ok")]


def test_bench_shapes_filter_runs_only_matching_cases(monkeypatch, tmp_path, capsys):
    fake = _FakeCuda()
    fake.install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sparsefuse._backend, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU 9000")
    monkeypatch.setattr(harness, "measure_ceilings", lambda quick=False: Ceilings(2.0e12, 5.0e14))
    other = dataclasses.replace(_fake_case(), shape="other")
    monkeypatch.setitem(harness.WORKLOADS, "fake", lambda options: [_fake_case(), other])
    rc = main(["bench", "fake", "--quick", "--no-plot", "--out", str(tmp_path), "--shapes", "^oth"], allow_reexec=False)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert {r.shape for r in report.read_csv(tmp_path / "fake-Fake-GPU-9000-quick.csv")} == {"other"}
    assert main(["bench", "fake", "--out", str(tmp_path), "--shapes", "("], allow_reexec=False) == 2
    assert "not a regular expression" in capsys.readouterr().out


def test_a_row_out_of_gpu_memory_says_where_the_memory_was():
    """A failed row's status keeps the figures of torch's out-of-memory message (the request, free memory, the
    process's use, live tensors, the allocator's cache): they tell a leak across cases from one large case."""
    from sparsefuse.bench.harness import _short_error

    message = (
        "CUDA out of memory. Tried to allocate 3.73 GiB. GPU 0 has a total capacity of 139.80 GiB of which 2.13 GiB "
        "is free. Including non-PyTorch memory, this process has 137.65 GiB memory in use. Of the allocated memory "
        "120.30 GiB is allocated by PyTorch, and 15.20 GiB is reserved by PyTorch but unallocated. If reserved ..."
    )
    assert _short_error(torch.OutOfMemoryError(message)) == (
        "OutOfMemoryError: tried 3.73 GiB, free 2.13 GiB, in use 137.65 GiB, allocated 120.30 GiB, cached 15.20 GiB"
    )
    assert _short_error(ValueError("first line\nsecond")) == "ValueError: first line"
