"""The ``train`` bench workload's distributed mode (sparsefuse.bench.workloads.train_dist) on the CPU: two
processes under torchrun over gloo, a tiny synthetic Llama, DDP and FSDP2, patched (the sparse training layer's
kernels, through the interpreter) and unpatched; and the gradient check's arithmetic on its own."""

import dataclasses
import json
import math
import threading
import types
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, torchrun

pytest.importorskip("transformers")

from sparsefuse.bench.workloads import train_dist  # noqa: E402

WORKER = Path(__file__).resolve().parent / "train_bench_worker.py"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_train_bench_distributed_mode_two_processes(tmp_path, device):
    """Both engines' cases, tagged with the engine and the process count; every step finite; the patched and
    unpatched losses of a rank's micro-batch agree (same weights: the patched loss adds 2e-5 * L1), as do the
    engines' (same weights and tokens); each model's gradients after one step equal one process's (fp32). On
    ``cuda``: one GPU per process, NCCL."""
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "rows.json"
    log = tmp_path / "torchrun.log"
    returncode = torchrun([str(WORKER), str(out), device], log)
    assert returncode == 0, f"torchrun returned {returncode}:\n" + log.read_text()[-6000:]
    result = json.loads(out.read_text())
    assert result["world"] == 2
    rows = result["rows"]
    assert set(rows) == {"2L nnz=6 B=2 S=16 ddp x2", "2L nnz=6 B=2 S=16 fsdp2 x2"}
    where = "CPU; peak n/a" if device == "cpu" else f"{torch.cuda.get_device_name(0)}; peak/GPU "
    for shape, impls in rows.items():
        assert set(impls) == {"unpatched", "patched"}
        engine = shape.split()[-2]
        for impl, row in impls.items():
            assert row["method"] == "wall" and row["tokens"] == 2 * 16
            assert all(math.isfinite(v) for v in row["losses"]), (shape, impl, row)
            # the defaults, on a model of 2 layers: one unit of both
            label = " (2 layers per unit, no reshard after forward)" if engine == "fsdp2" else ""
            label += ", backward on the calling thread"
            assert row["note"].startswith(f"{engine}{label} on 2x {where}"), row["note"]
            assert row["note"].endswith(": ok"), (shape, impl, row["note"])
            error = float(row["note"].split("grads vs 1 process ")[1].split()[0])
            assert error < 1e-5, (shape, impl, row["note"])
        assert impls["patched"]["losses"][0] == pytest.approx(impls["unpatched"]["losses"][0], rel=1e-3)
        assert not impls["unpatched"]["launched"], impls["unpatched"]["launched"]
        if impls["patched"]["backend"] != "torch":  # (CPU tensors without the interpreter run the torch reference)
            # the sparse training step in both layers, forward and backward, at each of the two steps
            launched = impls["patched"]["launched"]
            assert launched.get("block_sddmm_kernel") == launched.get("transposed_matmul_kernel") == 4, launched
    ddp, fsdp = rows["2L nnz=6 B=2 S=16 ddp x2"], rows["2L nnz=6 B=2 S=16 fsdp2 x2"]
    for impl in ("unpatched", "patched"):
        assert ddp[impl]["losses"] == pytest.approx(fsdp[impl]["losses"], rel=1e-4), impl


def test_fsdp_label_names_the_setup_unless_it_is_torchs_own(monkeypatch):
    assert train_dist.fsdp_label() == " (3 layers per unit, no reshard after forward)"
    assert train_dist.fsdp_label(n_layers=2) == " (2 layers per unit, no reshard after forward)"
    torchs = dataclasses.replace(train_dist.SETUP, layers_per_unit=1, reshard_after_forward=True)
    monkeypatch.setattr(train_dist, "SETUP", torchs)
    assert train_dist.fsdp_label() == ""


def test_trainer_turns_autograd_multithreading_off_for_its_backward_when_asked():
    """Autograd's multithreading is off while the step's backward runs (so a CUDA backward runs on the calling
    thread), and back to what it was after, also when the backward raises."""
    from sparsefuse.bench.workloads.train_setup import Trainer

    seen = []

    class Probe(torch.autograd.Function):
        fail = False

        @staticmethod
        def forward(ctx, a):
            return a.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append((torch._C._is_multithreading_enabled(), threading.get_ident()))
            if Probe.fail:
                raise RuntimeError("probe")
            return grad

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3, device=DEVICE))

        def forward(self, input_ids, labels):
            return types.SimpleNamespace(loss=Probe.apply(self.w * input_ids).sum())

    ids = torch.arange(3.0, device=DEVICE)
    caller = threading.get_ident()
    for single in (True, False):
        Trainer(Tiny(), compiled=False, l1=False, single_thread_backward=single).step(ids)
        multithreaded, thread = seen.pop()
        assert multithreaded is not single and torch._C._is_multithreading_enabled()
        if single or DEVICE == "cpu":  # a CUDA backward runs on autograd's worker thread unless told
            assert thread == caller
        else:
            assert thread != caller
    Probe.fail = True
    with pytest.raises(RuntimeError, match="probe"):
        Trainer(Tiny(), compiled=False, l1=False, single_thread_backward=True).step(ids)
    assert torch._C._is_multithreading_enabled()


def test_relative_error_and_verdict():
    """The check compares norms per parameter and takes the worst; a gradient present on one side only, or a
    difference past twice the re-batching error plus the tolerance, fails it."""
    g = torch.Generator().manual_seed(0)
    ref = {"a": torch.randn(8, 4, generator=g), "b": torch.randn(5, generator=g), "unused": None}
    same = {k: (None if v is None else v.clone()) for k, v in ref.items()}
    assert train_dist.relative_error(same, ref) == 0.0
    off = dict(same, b=ref["b"] * 1.01)
    assert train_dist.relative_error(off, ref) == pytest.approx(0.01, rel=1e-4)
    assert train_dist.relative_error(dict(same, unused=torch.zeros(1)), ref) == math.inf
    assert train_dist.relative_error(dict(same, a=None), ref) == math.inf
    zero = {"z": torch.zeros(3)}
    assert train_dist.relative_error(zero, zero) == 0.0
    assert train_dist.relative_error({"z": torch.ones(3)}, zero) == math.inf

    assert train_dist.GradAgreement(3e-3, 2e-3, 1e-2).ok
    assert not train_dist.GradAgreement(5e-2, 2e-3, 1e-2).ok
    assert not train_dist.GradAgreement(math.inf, 0.0, 1e-2).ok
    assert str(train_dist.GradAgreement(1e-7, 5e-8, 1e-5)) == "grads vs 1 process 1.0e-07 (re-batched 5.0e-08): ok"


def _summary_rows(profiled: bool, unprofiled: tuple = ()) -> list:
    """Fake distributed rows of one case and engine at 1 and 2 GPUs; with ``profiled``, notes with an anatomy
    whose GPU-bound steps are unpatched 190 / 199 ms and patched 130 / 137.5 ms (1 / 2 GPUs, the slower rank's).
    ``unprofiled``: the (gpus, impl) rows whose note has no anatomy."""
    from sparsefuse.bench.harness import Result
    from sparsefuse.bench.workloads.step_anatomy import StepAnatomy, describe

    walls = {(1, "unpatched"): 198.0, (1, "patched"): 150.0, (2, "unpatched"): 204.0, (2, "patched"): 165.0}
    bound = {(1, "unpatched"): [190.0], (1, "patched"): [130.0], (2, "unpatched"): [199.0, 198.0]}
    bound[(2, "patched")] = [136.0, 137.5]
    rows = []
    for (gpus, impl), ms in walls.items():
        anatomy = [StepAnatomy(ms, b - 1.5, 10.0, 1.5, 5.0) for b in bound.get((gpus, impl), [])]
        words = describe(anatomy) if profiled and (gpus, impl) not in unprofiled else "peak n/a"
        note = f"ddp on {gpus}x GPU; {words}; grads: ok"
        rows.append(
            Result(
                "train",
                f"24L nnz=30 B=4 S=2048 ddp x{gpus}",
                "bfloat16",
                "fwd+bwd",
                impl,
                method="wall",
                median_us=ms * 1e3,
                tokens_per_s=8192 / (ms * 1e-3),
                note=note,
            )
        )
    return rows


def test_summary_adds_the_gpu_bound_columns_when_the_rows_are_profiled():
    """Wall-clock speed-up and scaling always; with an anatomy in the notes, the GPU-bound speed-up (unpatched over
    patched GPU-bound step) and scaling (1-GPU over N-GPU GPU-bound step) too."""
    plain = "\n".join(train_dist.summary_lines(_summary_rows(profiled=False)))
    assert "| 24L nnz=30 B=4 S=2048 | ddp | 2 | 40157 / 49648 | 1.24x | 0.97 / 0.91 |\n" in plain, plain
    assert "GPU-bound" not in plain
    text = "\n".join(train_dist.summary_lines(_summary_rows(profiled=True)))
    assert "| 24L nnz=30 B=4 S=2048 | ddp | 1 | 41374 / 54613 | 1.32x | 1.00 / 1.00 | 1.46x | 1.00 / 1.00 |" in text
    # 2 GPUs: unpatched 199 ms (the slower rank), patched 137.5 ms
    assert "| 24L nnz=30 B=4 S=2048 | ddp | 2 | 40157 / 49648 | 1.24x | 0.97 / 0.91 | 1.45x | 0.95 / 0.95 |" in text


def test_summary_marks_the_gpu_bound_ratios_a_row_without_anatomy_cannot_give():
    """A set where one row's note has no anatomy (its profile recorded no kernels) still gets the GPU-bound columns,
    with '-' where that row is needed, never 'nan'; malformed anatomy words count as none."""
    text = "\n".join(train_dist.summary_lines(_summary_rows(profiled=True, unprofiled=((1, "unpatched"),))))
    assert "| 24L nnz=30 B=4 S=2048 | ddp | 1 | 41374 / 54613 | 1.32x | 1.00 / 1.00 | - | - / 1.00 |" in text
    assert "| 24L nnz=30 B=4 S=2048 | ddp | 2 | 40157 / 49648 | 1.24x | 0.97 / 0.91 | 1.45x | - / 0.95 |" in text
    assert "nan" not in text
    from sparsefuse.bench.workloads.step_anatomy import gpu_bound_ms

    assert gpu_bound_ms("compute 1.0/2.0, NCCL 3.0/3.0 (exposed 0.5), idle 1.0/1.0") is None  # a rank missing
    assert gpu_bound_ms("compute 1..2, NCCL 3.0 (exposed 0.5), idle 1.0") is None
