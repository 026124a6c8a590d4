"""``python -m sparsefuse check``'s closing line counts skips as skips: "all passed" only when every case ran and
passed."""

from __future__ import annotations

import torch

from sparsefuse import _backend
from sparsefuse.bench import check
from sparsefuse.bench.check_report import tally


def test_tally_names_failures_and_skips():
    assert tally(40, 0, {}) == "all passed (40 cases)"
    assert tally(40, 0, {"no GPU": 7}) == "40 passed, 7 skipped (no GPU)"
    assert tally(38, 2, {}) == "2 FAILED, 38 passed"
    assert tally(38, 2, {"a": 5, "b": 1}) == "2 FAILED, 38 passed, 6 skipped (5: a; 1: b)"


def _stub_checks(monkeypatch) -> list[tuple[str, str]]:
    """check_op replaced by a passing stand-in that records (op, dtype) (no kernels run)."""
    ran: list[tuple[str, str]] = []

    def passing(name, op, shape, dtype, device, gen):
        ran.append((name, str(dtype)))
        return check.CheckResult(name, str(dtype).removeprefix("torch."), "1", "interpreter", ["k"], [])

    monkeypatch.setattr(check, "check_op", passing)
    return ran


def test_skipped_cases_are_reported_as_skipped(monkeypatch):
    """Where bf16 tl.dot cannot be trusted, the ops using it are skipped in bf16 and the tally says so."""
    ran = _stub_checks(monkeypatch)
    monkeypatch.setattr(_backend, "BF16_DOT_OK", False)
    lines: list[str] = []
    rc = check.run_check(device="cpu", dtypes=(torch.float32, torch.bfloat16), seed=0, out=lines.append)
    assert rc == 0
    dot_ops = [name for name, op in check.OPS.items() if op.uses_tl_dot]
    skipped = [line for line in lines if line.startswith("SKIP")]
    assert len(skipped) == len(dot_ops) and all("bfloat16" in line for line in skipped)
    assert not any(name in dot_ops and dtype == "torch.bfloat16" for name, dtype in ran)
    n_skipped = sum(len(check.OPS[name].small) for name in dot_ops)
    assert lines[-1] == f"{len(ran)} passed, {n_skipped} skipped ({skipped[0].split('(', 1)[1]}"
    assert not any("all passed" in line for line in lines)


def test_bf16_dot_ops_run_where_the_interpreter_is_corrected(monkeypatch):
    ran = _stub_checks(monkeypatch)
    monkeypatch.setattr(_backend, "BF16_DOT_OK", True)
    lines: list[str] = []
    assert check.run_check(device="cpu", dtypes=(torch.bfloat16,), seed=0, out=lines.append) == 0
    assert {name for name, _ in ran} == set(check.OPS)
    assert not any(line.startswith("SKIP") for line in lines)
    assert lines[-1] == f"all passed ({len(ran)} cases)"
