"""Knobs of the ``train`` workload's distributed mode (sparsefuse.bench.workloads.train_dist), each read from an
environment variable that ``torchrun`` passes to every process: FSDP2's units, the FFN replay, the backward's
thread, CPU pinning and steps per timed call. ``python -m benchmarks.lab bench train`` under ``torchrun`` applies
them (:func:`apply`) before the bench starts; unset, each is the package's :class:`~train_dist.Setup` default::

    SPARSEFUSE_FSDP_LAYERS_PER_UNIT=1 SPARSEFUSE_FSDP_RESHARD_AFTER_FORWARD=1 \\
        torchrun --nproc_per_node 2 -m benchmarks.lab bench train --dtype bfloat16 --shapes fsdp2 --out OUT

Every reader raises ValueError naming its variable for a bad value.
"""

from __future__ import annotations

import dataclasses
import os

from sparsefuse.bench.workloads import train_dist

DEFAULT = train_dist.Setup()
FSDP_UNIT_ENV = "SPARSEFUSE_FSDP_LAYERS_PER_UNIT"  # decoder layers per FSDP2 unit
FSDP_RESHARD_ENV = "SPARSEFUSE_FSDP_RESHARD_AFTER_FORWARD"  # "1" or "0": FSDP2's reshard_after_forward
CUDA_GRAPH_ENV = "SPARSEFUSE_TRAIN_CUDA_GRAPH"  # "1" / "0": patched models replay their FFN steps or never do
# Training steps per timed call (1 times each step from an idle GPU; more let the host run ahead). On 2 H100s DDP's
# patched scaling measured 0.92 and 1.06 in two runs of 1 step per call, 0.98 in one of more: the host's pace moves
# it more than the regime does.
STEPS_ENV = "SPARSEFUSE_TRAIN_STEPS_PER_SYNC"
# "1": each process keeps to its own share of the CPUs it may use (split evenly by local rank, in order), set before
# the process group starts its threads. A diagnostic for a step bound by its hosts: on 2 H200s it did not change the
# patched FSDP2 step.
PIN_CPUS_ENV = "SPARSEFUSE_TRAIN_PIN_CPUS"
# "1" or "0": the backward on the calling thread or on autograd's worker thread (train_dist.Setup says why "1")
SINGLE_THREAD_BACKWARD_ENV = "SPARSEFUSE_TRAIN_SINGLE_THREAD_BACKWARD"
# "1": each distributed row's note adds its step's compute, NCCL and idle time by rank (three more steps under
# torch.profiler: sparsefuse/bench/workloads/step_anatomy.py)
PROFILE_ENV = "SPARSEFUSE_TRAIN_PROFILE"
KNOBS = (
    FSDP_UNIT_ENV,
    FSDP_RESHARD_ENV,
    CUDA_GRAPH_ENV,
    STEPS_ENV,
    PIN_CPUS_ENV,
    SINGLE_THREAD_BACKWARD_ENV,
    PROFILE_ENV,
)


def fsdp_layers_per_unit() -> int:
    """Decoder layers per FSDP2 unit: ``SPARSEFUSE_FSDP_LAYERS_PER_UNIT``, else the package's default."""
    return _count_from_env(FSDP_UNIT_ENV, DEFAULT.layers_per_unit)


def steps_per_sync() -> int:
    """Training steps per timed call: ``SPARSEFUSE_TRAIN_STEPS_PER_SYNC``, else 1 (see :data:`STEPS_ENV`)."""
    return _count_from_env(STEPS_ENV, DEFAULT.steps_per_sync)


def _count_from_env(name: str, default: int) -> int:
    """The environment variable ``name`` as a positive integer, ``default`` when unset; ValueError otherwise."""
    value = os.environ.get(name, str(default))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
    return int(value)


def _flag_from_env(name: str, default: bool) -> bool:
    """The environment variable ``name`` as a flag ("1" or "0"), ``default`` when unset; ValueError otherwise."""
    value = os.environ.get(name, str(int(default)))
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1; got {value!r}")
    return value == "1"


def fsdp_reshard_after_forward() -> bool:
    """FSDP2's ``reshard_after_forward`` for the decoder layers' units: ``SPARSEFUSE_FSDP_RESHARD_AFTER_FORWARD``
    ("1" or "0"), else the package's default."""
    return _flag_from_env(FSDP_RESHARD_ENV, DEFAULT.reshard_after_forward)


def pin_cpus() -> bool:
    """Whether each process keeps to its own share of the CPUs: ``SPARSEFUSE_TRAIN_PIN_CPUS`` ("1" or "0", default
    "0"; Linux only)."""
    pinned = _flag_from_env(PIN_CPUS_ENV, False)
    if pinned and not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"{PIN_CPUS_ENV}=1 needs os.sched_setaffinity (Linux)")
    return pinned


def single_thread_backward() -> bool:
    """Whether the training steps run their backward on the calling thread: ``SPARSEFUSE_TRAIN_SINGLE_THREAD_BACKWARD``
    ("1" or "0", default the package's: "1")."""
    return _flag_from_env(SINGLE_THREAD_BACKWARD_ENV, DEFAULT.single_thread_backward)


def train_cuda_graph() -> bool | None:
    """Whether the patched models replay their sparse FFN steps from CUDA graphs (``patch_llama``'s
    ``train_cuda_graph``): ``SPARSEFUSE_TRAIN_CUDA_GRAPH`` ("1" or "0"); unset: None, the library's default."""
    if CUDA_GRAPH_ENV not in os.environ:
        return None
    return _flag_from_env(CUDA_GRAPH_ENV, False)


def train_profile() -> bool:
    """Whether each distributed row's note adds its step's anatomy by rank: ``SPARSEFUSE_TRAIN_PROFILE`` ("1" or
    "0", default "0")."""
    return _flag_from_env(PROFILE_ENV, False)


def cpu_share(cpus: list[int], local_rank: int, local_size: int) -> list[int]:
    """Local rank ``local_rank``'s share of ``cpus`` split among ``local_size`` processes: consecutive runs of
    near-equal length (the first ones one longer), at least one CPU each (shared round-robin past one per process)."""
    if len(cpus) < local_size:
        return [cpus[local_rank % len(cpus)]]
    per, extra = divmod(len(cpus), local_size)
    start = local_rank * per + min(local_rank, extra)
    return cpus[start : start + per + (local_rank < extra)]


def setup_from_env() -> train_dist.Setup:
    """The package's setup with every knob set in the environment applied (the CPU pinning's words not yet)."""
    return dataclasses.replace(
        DEFAULT,
        layers_per_unit=fsdp_layers_per_unit(),
        reshard_after_forward=fsdp_reshard_after_forward(),
        train_cuda_graph=train_cuda_graph(),
        single_thread_backward=single_thread_backward(),
        steps_per_sync=steps_per_sync(),
        profile=train_profile(),
    )


def apply() -> train_dist.Setup:
    """Installs :func:`setup_from_env` as the distributed mode's setup and, under ``torchrun`` with
    ``SPARSEFUSE_TRAIN_PIN_CPUS=1``, pins this process to its share of the CPUs (before the process group starts
    its threads: call it first); the setup installed."""
    setup = setup_from_env()
    if pin_cpus() and train_dist.launched():
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        os.sched_setaffinity(0, cpu_share(sorted(os.sched_getaffinity(0)), int(os.environ["LOCAL_RANK"]), local_size))
        setup = dataclasses.replace(setup, note=f", CPUs pinned: {len(os.sched_getaffinity(0))} per process")
    train_dist.SETUP = setup
    return setup


__all__ = ["KNOBS", "apply", "cpu_share", "setup_from_env"]
