"""The lab's knobs of the ``train`` workload's distributed mode (benchmarks/lab/train_knobs.py): each read from its
environment variable, installed as the package's setup, and on the CPU two processes under torchrun over gloo with
torch's own FSDP2 setup and pinned CPUs."""

import json
import math
from pathlib import Path

import pytest
from conftest import torchrun

pytest.importorskip("transformers")

from benchmarks.lab import train_knobs  # noqa: E402
from sparsefuse.bench.workloads import train_dist  # noqa: E402

WORKER = Path(__file__).resolve().parent / "train_knobs_worker.py"


@pytest.fixture
def no_knobs(monkeypatch):
    """No knob in the environment, and the package's setup put back after the test."""
    for name in train_knobs.KNOBS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(train_dist, "SETUP", train_dist.SETUP)


def test_train_bench_fsdp2_torch_default_setup(tmp_path):
    """SPARSEFUSE_FSDP_LAYERS_PER_UNIT=1 and SPARSEFUSE_FSDP_RESHARD_AFTER_FORWARD=1 (torch's own setup: a unit per
    decoder layer, resharded after its forward) override the package's setup; the note names no setup, and each
    model's gradients after one step still equal one process's."""
    out, log = tmp_path / "rows.json", tmp_path / "torchrun.log"
    env = {
        train_knobs.FSDP_UNIT_ENV: "1",
        train_knobs.FSDP_RESHARD_ENV: "1",
        train_knobs.PROFILE_ENV: "1",  # the anatomy's collective on the CPU: no GPU kernels to tell
        train_knobs.PIN_CPUS_ENV: "1",
    }
    returncode = torchrun([str(WORKER), str(out), "cpu", "fsdp2"], log, **env)
    assert returncode == 0, f"torchrun returned {returncode}:\n" + log.read_text()[-6000:]
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"2L nnz=6 B=2 S=16 fsdp2 x2"}
    for impl, row in rows["2L nnz=6 B=2 S=16 fsdp2 x2"].items():
        assert row["note"].startswith("fsdp2, CPUs pinned: "), row["note"]  # torch's setup: no unit label
        assert " per process, backward on the calling thread on 2x CPU" in row["note"], row["note"]
        assert "; anatomy n/a (no GPU kernels recorded); " in row["note"], row["note"]
        assert row["note"].endswith(": ok") and all(math.isfinite(v) for v in row["losses"]), (impl, row)
        assert float(row["note"].split("grads vs 1 process ")[1].split()[0]) < 1e-5, (impl, row["note"])


def test_unset_knobs_leave_the_package_setup(no_knobs):
    assert train_knobs.setup_from_env() == train_dist.Setup()
    assert train_knobs.apply() == train_dist.Setup() and train_dist.SETUP == train_dist.Setup()


def test_apply_installs_the_knobs(no_knobs, monkeypatch):
    monkeypatch.setenv(train_knobs.FSDP_UNIT_ENV, "1")
    monkeypatch.setenv(train_knobs.FSDP_RESHARD_ENV, "1")
    monkeypatch.setenv(train_knobs.CUDA_GRAPH_ENV, "0")
    monkeypatch.setenv(train_knobs.STEPS_ENV, "2")
    monkeypatch.setenv(train_knobs.SINGLE_THREAD_BACKWARD_ENV, "0")
    train_knobs.apply()
    assert train_dist.SETUP == train_dist.Setup(
        layers_per_unit=1,
        reshard_after_forward=True,
        train_cuda_graph=False,
        single_thread_backward=False,
        steps_per_sync=2,
    )
    assert train_dist.fsdp_label() == ""


@pytest.mark.parametrize(
    "name, read, default",
    [
        (train_knobs.FSDP_UNIT_ENV, train_knobs.fsdp_layers_per_unit, train_dist.Setup().layers_per_unit),
        (train_knobs.STEPS_ENV, train_knobs.steps_per_sync, 1),
    ],
)
def test_counts_from_env(name, read, default, monkeypatch):
    monkeypatch.delenv(name, raising=False)
    assert read() == default
    monkeypatch.setenv(name, "4")
    assert read() == 4
    for bad in ("0", "four", "-1"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            read()


def test_fsdp_reshard_from_env(monkeypatch):
    monkeypatch.delenv(train_knobs.FSDP_RESHARD_ENV, raising=False)
    assert not train_knobs.fsdp_reshard_after_forward()
    monkeypatch.setenv(train_knobs.FSDP_RESHARD_ENV, "1")
    assert train_knobs.fsdp_reshard_after_forward()
    for bad in ("", "no", "2"):
        monkeypatch.setenv(train_knobs.FSDP_RESHARD_ENV, bad)
        with pytest.raises(ValueError, match=train_knobs.FSDP_RESHARD_ENV):
            train_knobs.fsdp_reshard_after_forward()


@pytest.mark.parametrize(
    "name, read, default",
    [
        (train_knobs.CUDA_GRAPH_ENV, train_knobs.train_cuda_graph, None),  # unset: the library decides
        (train_knobs.PIN_CPUS_ENV, train_knobs.pin_cpus, False),
        (train_knobs.SINGLE_THREAD_BACKWARD_ENV, train_knobs.single_thread_backward, True),
        (train_knobs.PROFILE_ENV, train_knobs.train_profile, False),
    ],
)
def test_flags_from_env(name, read, default, monkeypatch):
    monkeypatch.delenv(name, raising=False)
    assert read() is default
    monkeypatch.setenv(name, "0")
    assert not read()
    monkeypatch.setenv(name, "1")
    assert read()
    monkeypatch.setenv(name, "on")
    with pytest.raises(ValueError, match=name):
        read()


def test_cpu_share_splits_the_cpus_by_local_rank():
    cpus = [0, 1, 2, 3, 4, 5, 6]
    shares = [train_knobs.cpu_share(cpus, r, 3) for r in range(3)]
    assert shares == [[0, 1, 2], [3, 4], [5, 6]]
    assert [train_knobs.cpu_share([4, 9], r, 3) for r in range(3)] == [[4], [9], [4]]  # fewer CPUs than processes
