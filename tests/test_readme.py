"""The README's examples run as shown.

The CPU example (a ```python block right after an ``<!-- cpu-example -->`` comment) runs in a fresh interpreter with
warnings turned into errors, so it must finish without a single warning (it sets ``TRITON_INTERPRET=1`` itself, so
the real Triton kernels run). The GPU examples need CUDA and downloaded weights: they are compiled, and every
``sparsefuse`` name they use must exist.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import needs_modern_interpreter

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CPU_MARK = "<!-- cpu-example -->"
_BLOCK = re.compile(r"(?P<mark><!-- cpu-example -->\s*\n)?```python\n(?P<code>.*?)```", re.S)


def _blocks() -> list[tuple[bool, str]]:
    """(is the CPU example, code) for every ```python block of the README, in order."""
    return [(m.group("mark") is not None, m.group("code")) for m in _BLOCK.finditer(README.read_text())]


def _cpu_blocks() -> list[str]:
    return [code for cpu, code in _blocks() if cpu]


def _gpu_blocks() -> list[str]:
    return [code for cpu, code in _blocks() if not cpu]


def test_readme_is_short_and_has_examples() -> None:
    assert README.stat().st_size <= 15 * 1024
    assert len(_cpu_blocks()) >= 1
    assert len(_gpu_blocks()) >= 4


@needs_modern_interpreter
@pytest.mark.parametrize("index", range(len(_cpu_blocks())))
def test_cpu_example_runs_without_warnings(index: int, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(_cpu_blocks()[index])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the example must set it itself
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-W", "error", str(script)]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Warning" not in result.stderr, result.stderr[-4000:]
    assert "Backend.INTERPRETER" in result.stdout


def _sparsefuse_names(tree: ast.AST) -> list[tuple[str, str | None]]:
    """(module, attribute or None) for every sparsefuse import, and for every ``sparsefuse.a.b`` / ``alias.x``
    attribute chain that starts at a name bound to a sparsefuse module."""
    names: list[tuple[str, str | None]] = []
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "sparsefuse":
                    names.append((a.name, None))
                    aliases[a.asname or "sparsefuse"] = a.name if a.asname else "sparsefuse"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sparsefuse":
            names.extend((node.module, a.name) for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, inner = [], node
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in aliases:
                names.append((aliases[inner.id], ".".join(reversed(chain))))
    return names


def _resolve(module: str, attr: str | None) -> object:
    obj = importlib.import_module(module)
    for part in attr.split(".") if attr else []:
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif isinstance(obj, type(importlib)):
            obj = importlib.import_module(f"{obj.__name__}.{part}")
        else:
            raise AttributeError(f"{module}: no attribute {part!r} on {obj!r}")
    return obj


@pytest.mark.parametrize("index", range(len(_gpu_blocks())))
def test_gpu_example_compiles_and_its_names_exist(index: int) -> None:
    code = _gpu_blocks()[index]
    compile(code, f"README-gpu-example-{index}", "exec")
    for module, attr in _sparsefuse_names(ast.parse(code)):
        _resolve(module, attr)


def test_cpu_example_names_exist() -> None:
    for code in _cpu_blocks():
        for module, attr in _sparsefuse_names(ast.parse(code)):
            _resolve(module, attr)
