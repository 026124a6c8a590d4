"""Test configuration.

CPU runs (CI) execute the real Triton kernels through Triton's interpreter; GPU runs (scripts/gpu_check.sh sets
SPARSEFUSE_TEST_DEVICE=cuda) compile them. Both variables must be set before sparsefuse (and triton) is imported,
which is why this happens at the top of conftest. Every kernel output is NaN-poisoned before launch.
"""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

DEVICE = os.environ.get("SPARSEFUSE_TEST_DEVICE", "cpu")
if DEVICE != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # the interpreter without its discarded work (sparsefuse/_fast_interpreter.py), here and in the processes the
    # tests start
    os.environ.setdefault("SPARSEFUSE_FAST_INTERPRETER", "1")
os.environ.setdefault("SPARSEFUSE_POISON_OUTPUTS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import sparsefuse  # noqa: E402
from sparsefuse import Backend  # noqa: E402

EXPECTED_BACKEND = Backend.TRITON if DEVICE == "cuda" else Backend.INTERPRETER

# Tests that run whole programs through the interpreter in a subprocess (the README's CPU example, the CLI's check)
# need a Triton whose interpreter can loop over a runtime kernel argument; older ones raise on range(n). The GPU
# image may carry such a Triton; its compiled kernels are unaffected.
needs_modern_interpreter = pytest.mark.skipif(
    tuple(int(v) for v in __import__("triton").__version__.split(".")[:2]) < (3, 7),
    reason="Triton < 3.7's interpreter cannot loop over a runtime kernel argument (range(n) raises)",
)


# The longest tests on a 2-core CI machine (minutes each under the interpreter), longest first: collected before the
# rest, so that xdist's workers start them early rather than one worker running them alone at the end.
LONG_FIRST = (
    "test_compiles_for_sm90.py::",
    "test_properties.py::test_random_cases[",
    "test_examples.py::",
    "distributed/",
)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:  # the longest first; the rest in their order (the sort is stable)
        return next((i for i, long in enumerate(LONG_FIRST) if long in item.nodeid), len(LONG_FIRST))

    items.sort(key=rank)
    cuda = DEVICE == "cuda" and torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run scripts/gpu_check.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(skip_gpu)


def loopback_env(**extra: str) -> dict[str, str]:
    """The environment for processes that meet over gloo on this machine: rendezvous and gloo's own sockets on the
    loopback interface. Left to itself gloo binds to whatever the hostname resolves to, which on a sandboxed CI
    machine can be an address nothing connects through, and the processes then wait out the 30-minute timeout."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", **extra)
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def torchrun(args: list[str], log: Path, nprocs: int = 2, seconds: float = 240, **env: str) -> int | None:
    """``torchrun --nproc_per_node nprocs`` on loopback (``env`` added to :func:`loopback_env`'s), in its own session
    so that a timeout kills the workers too (left alive they would hold the log open and the test would wait for
    them). None on a timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nprocs)]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(port), *args]
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, env=loopback_env(OMP_NUM_THREADS="1", **env), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            return proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


@pytest.fixture
def device() -> torch.device:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.fail("SPARSEFUSE_TEST_DEVICE=cuda but no CUDA device is visible")
    return torch.device(DEVICE)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def plan():
    """``plan(**changes)``: :func:`sparsefuse.planning` with these changes for the rest of the test (the planner's
    knobs are steered this way, never by patching a module constant)."""
    import contextlib

    from sparsefuse import planning

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(planning(**changes))


@pytest.fixture(autouse=True)
def _fresh_planners():
    """Every test starts with no memoised pick, estimate or warm-up left by another."""
    from sparsefuse._plan.planner import _PLANNERS

    for planner in _PLANNERS.values():
        planner.clear()


@pytest.fixture(autouse=True)
def _training_steps_launch_eagerly():
    """hybrid_mlp's default replays a GPU layer's block step from CUDA graphs (CPU tensors never): the tests of the
    eager step count its launches on either device, so the default's choice is pinned to the eager step here (no
    layer is small enough to replay). The tests of replays ask for them (``cuda_graph=True``) or set the knob
    (tests/ffn/test_hybrid_graphed.py tests the choice itself)."""
    from sparsefuse import planning

    with planning(hybrid_mlp={"replay_max_gate_flop": -1.0}):
        yield


@pytest.fixture
def listed(monkeypatch):
    """Every LongRows allocated in the test, in order; ``int(l.count)`` is how many units its launch listed (and
    ``int(l.dense_used)`` how many splits have dense units, where the scan lists them)."""
    from sparsefuse.sparse import long_rows

    made = []
    allocate = long_rows.LongRows.allocate

    def recorded(*args, **kwargs):
        made.append(allocate(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(long_rows.LongRows, "allocate", staticmethod(recorded))
    return made


def assert_backend(*tensors: torch.Tensor) -> None:
    """The kernels under test must be the Triton ones (compiled or interpreted), never the torch reference."""
    assert sparsefuse.backend_for(*tensors) is EXPECTED_BACKEND
