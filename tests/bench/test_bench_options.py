"""``python -m sparsefuse bench`` refuses an option that cannot apply (exit 2, a message naming it and why) instead
of ignoring it: the options only a timed run reads, on a machine without a GPU, and ``--checkpoint`` beside
workloads other than ``model``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sparsefuse.__main__ import main


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv, allow_reexec=False)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.fixture
def checkpoint(tmp_path: Path) -> str:
    path = tmp_path / "model-l1.pt"
    path.write_bytes(b"not read: the options are checked first")
    return str(path)


@pytest.mark.parametrize(
    "option",
    [["--checkpoint", "CKPT"], ["--out", "results"], ["--shapes", "prefill"], ["--merge"], ["--no-plot"]],
    ids=lambda option: option[0],
)
def test_gpu_only_options_are_refused_without_a_gpu(option, checkpoint, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    option = [checkpoint if word == "CKPT" else word for word in option]
    err = _refused(["bench", "model", *option], capsys)
    assert f"bench {option[0]}: cannot apply without a CUDA GPU" in err and "drop it" in err


def test_several_refused_options_are_named_together(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _refused(["bench", "snake", "--out", "x", "--no-plot", "--quick"], capsys)
    assert "bench --out, --no-plot: cannot apply" in err and "drop them" in err


def test_checkpoint_needs_the_model_workload(checkpoint, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    err = _refused(["bench", "snake", "celu", "--checkpoint", checkpoint], capsys)
    assert "--checkpoint applies to the model workload only" in err and "snake, celu" in err


def test_checkpoint_must_exist(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    missing = str(tmp_path / "missing.pt")
    assert f"--checkpoint {missing!r}: no such file" in _refused(["bench", "model", "--checkpoint", missing], capsys)


def test_bench_without_a_gpu_still_takes_quick_and_dtype(monkeypatch):
    """The check bench runs instead is already the small one, in the dtypes asked for."""
    from sparsefuse.bench import check

    seen: list[torch.dtype] = []
    monkeypatch.setattr(
        check,
        "check_op",
        lambda name, op, shape, dtype, *a: seen.append(dtype) or check.CheckResult(name, "", "1", "x", ["k"], []),
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "celu", "--quick", "--dtype", "float16"], allow_reexec=False) == 0
    assert seen and set(seen) == {torch.float16}
