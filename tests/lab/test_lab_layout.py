"""What separates the lab (benchmarks/lab/) from the installed package: sparsefuse never imports it and reads only
its own few environment variables, ``python -m sparsefuse bench`` lists no lab workload, and ``python -m
benchmarks.lab`` is the same command line with the lab's workloads added."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "sparsefuse"
# Every SPARSEFUSE_* variable the package reads, and where it is documented. The lab's knobs
# (benchmarks/lab/train_knobs.py) stay out of it.
PACKAGE_VARIABLES = {
    "SPARSEFUSE_FAST_LAUNCH",  # docs/design/host-overhead.md
    "SPARSEFUSE_FAST_INTERPRETER",  # docs/architecture.md
    "SPARSEFUSE_COMMIT",  # scripts/gpu_check.sh, scripts/gpu_multi.sh
    "SPARSEFUSE_POISON_OUTPUTS",  # tests/conftest.py turns it on
}


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_package_never_imports_the_lab():
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            assert not any(n == "benchmarks" or n.startswith("benchmarks.") for n in names), (path, names)


def test_the_package_reads_only_its_own_environment_variables():
    found = {name for path in _sources() for name in re.findall(r"\bSPARSEFUSE_[A-Z0-9_]+", path.read_text())}
    assert found == PACKAGE_VARIABLES


def _help(module: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "_SPARSEFUSE_REEXECUTED"}
    proc = subprocess.run(
        [sys.executable, "-m", module, "bench", "--help"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return " ".join(proc.stdout.split())


def test_bench_help_lists_the_lab_workloads_only_through_the_lab():
    package, lab = _help("sparsefuse"), _help("benchmarks.lab")
    assert "ffn_train" in package and "ffn_products" not in package
    assert "ffn_train" in lab and "ffn_products" in lab
