"""The shipped examples run end to end at their smallest size (CPU; the GPU sizes are run by hand)."""

import csv
import importlib.util
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_sparse_llama_tiny(tmp_path):
    # dense MLPs: the interpreter runs the hybrid step's kernels too slowly for a whole-model loop in CI (a patched
    # model's hybrid training step is covered in tests/integrations); 2 sequences a step, as the interpreter runs
    # the fused rotary embedding one program per token
    example = _load("train_sparse_llama")
    args = ["--size", "tiny", "--steps", "6", "--batch", "2", "--log-every", "2", "--out", str(tmp_path)]
    assert example.main(args) == 0
    with (tmp_path / "log.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {float(r["l1"]) for r in rows} == {0.0, 0.3}
    assert all(math.isfinite(float(r["loss"])) and 0 < float(r["nnz_fraction"]) <= 1 for r in rows)
    assert (tmp_path / "model-l1.pt").stat().st_size > 0
    assert (tmp_path / "curves.png").exists() or importlib.util.find_spec("matplotlib") is None


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_train_sparse_llama_distributed_follows_one_process(tmp_path, engine):
    """torchrun with two CPU processes (gloo; DistributedDataParallel, or FSDP2's fully_shard), each on half of the
    same global batch: the logged loss follows the single-process run step for step."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    from conftest import loopback_env

    # gloo, also on a GPU host; one sequence per process a step (the interpreter's rotary embedding: above)
    common = ["--size", "tiny", "--steps", "3", "--batch", "2", "--log-every", "1", "--device", "cpu"]
    log = tmp_path / "torchrun.log"
    # A gloo process may abort in its teardown when a peer closes its connections first ("terminate called without
    # an active exception", after the run has finished and written its files): that alone earns one more try.
    for _attempt in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
        cmd += ["--master_port", str(port)]
        cmd += [str(EXAMPLES / "train_sparse_llama.py"), "--distributed", "--engine", engine, *common]
        cmd += ["--out", str(tmp_path / engine)]
        # output to files and the run in its own process group: on a timeout the workers torchrun started are
        # killed too (left alive, they would hold captured pipes open and the test would wait for them forever)
        with log.open("w") as out:
            proc = subprocess.Popen(
                cmd, env=loopback_env(OMP_NUM_THREADS="1"), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                returncode = proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                returncode = None
        text = log.read_text()
        if returncode == 0 or "final:" not in text or "terminate called without an active exception" not in text:
            break
    assert returncode == 0, f"torchrun returned {returncode}:\n" + log.read_text()[-6000:]
    assert _load("train_sparse_llama").main([*common, "--out", str(tmp_path / "one")]) == 0

    def losses(run):
        with (tmp_path / run / "log.csv").open() as f:
            return [(float(r["l1"]), int(r["step"]), float(r["loss"])) for r in csv.DictReader(f)]

    several, one = losses(engine), losses("one")
    assert [r[:2] for r in several] == [r[:2] for r in one]
    for (_, step, a), (_, _, b) in zip(several, one):
        assert a == pytest.approx(b, rel=1e-4), (step, a, b)
    # the L1 run's weights, gathered whole (FSDP2's shards) and written by process 0, are the one process's (by norm:
    # AdamW's update of an entry whose gradient is near zero turns rounding into ~lr-sized differences)
    state = torch.load(tmp_path / engine / "model-l1.pt")["state_dict"]
    reference = torch.load(tmp_path / "one" / "model-l1.pt")["state_dict"]
    assert state.keys() == reference.keys()
    for name, value in reference.items():
        assert state[name].shape == value.shape, name
        assert float((state[name] - value).norm() / value.norm()) < 1e-3, name
