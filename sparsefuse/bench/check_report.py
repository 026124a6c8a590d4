"""What ``python -m sparsefuse check`` prints: one line per checked (op, dtype, shape), and a closing tally that
counts passes, failures and skips apart (a skipped case was not checked, so it never reads as a pass)."""

from __future__ import annotations

import dataclasses
import math

from sparsefuse.testing import Comparison


@dataclasses.dataclass
class CheckResult:
    op: str
    dtype: str
    shape: str
    backend: str
    kernels: list[str]
    outputs: list[tuple[str, Comparison]]  # one per compared output (y, grad_x, ...)
    error: str = ""  # an exception raised by the op, or "no kernel launched"

    @property
    def passed(self) -> bool:
        return not self.error and all(c.ok for _, c in self.outputs)


def format_result(r: CheckResult) -> str:
    status = "PASS" if r.passed else "FAIL"
    head = f"{status}  {r.op:<24} {r.dtype:<9} {r.shape:<12}"
    if r.error:
        return f"{head} {r.error}  backend={r.backend}"

    def badness(named: tuple[str, Comparison]) -> tuple[bool, float]:
        # A failing output first, else the largest error; NaN (a NaN mismatch) counts as infinite.
        rel = named[1].max_rel_error
        return (not named[1].ok, math.inf if math.isnan(rel) else rel)

    worst = max(r.outputs, key=badness, default=None)
    err = f"max rel err {worst[1].max_rel_error:.2e} ({worst[0]})" if worst else "(no outputs)"
    line = f"{head} {err}  backend={r.backend}  kernels={','.join(r.kernels) or '-'}"
    for _, c in r.outputs:
        if not c.ok:
            line += f"\n      {c.message}"
    return line


def format_skip(op: str, dtype: str, why: str) -> str:
    return f"SKIP  {op:<24} {dtype:<9} ({why})"


def tally(passed: int, failed: int, skipped: dict[str, int]) -> str:
    """The closing line: "all passed (N cases)" only when nothing failed or was skipped; else each count, and why cases
    were skipped (``skipped``: reason -> cases)."""
    n_skipped = sum(skipped.values())
    if not failed and not n_skipped:
        return f"all passed ({passed} cases)"
    parts = [f"{failed} FAILED"] if failed else []
    parts.append(f"{passed} passed")
    if n_skipped:
        whys = "; ".join(f"{n}: {why}" if len(skipped) > 1 else why for why, n in skipped.items())
        parts.append(f"{n_skipped} skipped ({whys})")
    return ", ".join(parts)
