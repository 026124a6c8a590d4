"""CPU tensors without TRITON_INTERPRET run the plain-torch reference with ONE warning per process, whichever and
however many ops fall back (not one per op), pointing at the caller's line. Run in fresh interpreters without
TRITON_INTERPRET (the interpreter flag is read once, at import)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Several different ops (forward and backward), each of which falls back on CPU tensors; every warning is recorded
# ("always": Python's own once-per-location filter hides nothing), and their count and locations printed.
SEVERAL_OPS = """
import warnings
import torch, sparsefuse

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    x = torch.randn(2, 8, 64)
    sparsefuse.snake(x, torch.rand(8) + 0.5)
    sparsefuse.celu(x, alpha=0.5)
    sparsefuse.rms_norm(torch.randn(4, 64), 64, torch.ones(64))
    acts = torch.relu(torch.randn(4, 512) - 2.5).requires_grad_()
    sparsefuse.sparse_decode(acts, torch.randn(512, 64)).sum().backward()
    sparsefuse.splade_pool(torch.randn(2, 16, 32), torch.randn(100, 32), torch.zeros(100), torch.ones(2, 16))
    sparsefuse.snake(x, torch.rand(8) + 0.5)
print(sparsefuse.backend_for(x))
for w in caught:
    print("WARNING", w.filename, w.lineno, w.message)
print("COUNT", len(caught))
"""

SPARSE_DECODE_ALONE = """
import warnings
import torch, sparsefuse

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    acts = torch.relu(torch.randn(4, 512) - 2.5)
    sparsefuse.sparse_decode(acts, torch.randn(512, 64))
    sparsefuse.sparse_decode(acts, torch.randn(512, 64), method="exact")
for w in caught:
    print("WARNING", w.filename, w.lineno, w.message)
print("COUNT", len(caught))
"""


def _run(code: str, tmp_path: Path) -> list[str]:
    script = tmp_path / "fallback.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout.splitlines()


def _warnings(lines: list[str]) -> list[str]:
    count = next(int(line.split()[1]) for line in lines if line.startswith("COUNT"))
    found = [line for line in lines if line.startswith("WARNING")]
    assert len(found) == count
    return found


def test_one_fallback_warning_per_process(tmp_path: Path) -> None:
    lines = _run(SEVERAL_OPS, tmp_path)
    assert "Backend.TORCH" in lines
    found = _warnings(lines)
    assert len(found) == 1, "\n".join(found)
    assert "sparsefuse.snake" in found[0] and "plain-torch reference" in found[0]
    # it points at the script's line that called the first op, not into sparsefuse or torch
    assert found[0].split()[1] == str(tmp_path / "fallback.py")


def test_sparse_decode_warns_once_on_cpu(tmp_path: Path) -> None:
    """The README's promise: sparse_decode on CPU tensors falls back to the reference with a one-time warning."""
    found = _warnings(_run(SPARSE_DECODE_ALONE, tmp_path))
    assert len(found) == 1, "\n".join(found)
    assert "sparsefuse.sparse_decode" in found[0] and "plain-torch reference" in found[0]
