"""The distributed training bench's settings (:mod:`.train_dist`), each read from an environment variable that
``torchrun`` passes to every process: the engines, FSDP2's units, the FFN replay, the backward's thread, CPU pinning,
steps per timed call and the step anatomy. Every reader raises ValueError naming its variable for a bad value."""

from __future__ import annotations

import os

from ...integrations._llama import FSDP2_LAYERS_PER_UNIT, FSDP2_RESHARD_AFTER_FORWARD

ENGINES = ("ddp", "fsdp2")
ENGINES_ENV = "SPARSEFUSE_TRAIN_ENGINES"
# FSDP2 as shard_llama_fsdp2 runs it for a patched model (units of 3 decoder layers, kept gathered from forward to
# backward; its docstring says why), given to the unpatched one too.
FSDP_LAYERS_PER_UNIT = FSDP2_LAYERS_PER_UNIT
FSDP_UNIT_ENV = "SPARSEFUSE_FSDP_LAYERS_PER_UNIT"  # overrides FSDP_LAYERS_PER_UNIT
FSDP_RESHARD_AFTER_FORWARD = FSDP2_RESHARD_AFTER_FORWARD
FSDP_RESHARD_ENV = "SPARSEFUSE_FSDP_RESHARD_AFTER_FORWARD"  # "1" or "0": overrides FSDP_RESHARD_AFTER_FORWARD
CUDA_GRAPH_ENV = "SPARSEFUSE_TRAIN_CUDA_GRAPH"  # "1" / "0": patched models replay their FFN steps or never do
# Training steps per timed call (default 1): the harness synchronizes around each call, so 1 times every step from an
# idle GPU (a loop that reads its loss each step) and more lets the host run ahead into the next step (a loop that
# does not). On 2 H100s DDP's patched scaling measured 0.92 and 1.06 in two runs of the first, 0.98 in one of the
# second: the host's pace moves it more than the regime does.
STEPS_ENV = "SPARSEFUSE_TRAIN_STEPS_PER_SYNC"
PROFILE_ENV = "SPARSEFUSE_TRAIN_PROFILE"  # "1": each row's note adds its step's anatomy by rank (step_anatomy)
PROFILE_STEPS = 3
# "1": each process keeps to its own share of the CPUs it may use (split evenly by local rank, in order), set before
# the process group starts its threads. A diagnostic for a step bound by its hosts: on 2 H200s it did not change the
# patched FSDP2 step (docs/training.md).
PIN_CPUS_ENV = "SPARSEFUSE_TRAIN_PIN_CPUS"
# "1" or "0" (default "1"): whether the backward runs on the calling thread (torch.autograd.
# set_multithreading_enabled(False)) rather than on autograd's per-GPU worker thread, for both models. The engines'
# hooks run Python in the backward, which costs less host time on the calling thread. On 2 H200s (FFN steps
# replayed) the patched step took 146 / 156 ms (1 / 2 GPUs) under DDP that way against 152 / 161 ms on the worker
# thread; under FSDP2 over 2 GPUs 162 against 171 ms (rank 0's host 128 against 149 ms a step); the unpatched steps,
# bound by their GPU work, did not move (DDP 198-203 ms either way, FSDP2 over one GPU 200-203 ms).
SINGLE_THREAD_BACKWARD_ENV = "SPARSEFUSE_TRAIN_SINGLE_THREAD_BACKWARD"


def engines_from_env() -> tuple[str, ...]:
    """The engines ``SPARSEFUSE_TRAIN_ENGINES`` names (comma-separated; default both); ValueError for others."""
    names = tuple(e.strip() for e in os.environ.get(ENGINES_ENV, ",".join(ENGINES)).split(",") if e.strip())
    unknown = [e for e in names if e not in ENGINES]
    if unknown or not names:
        raise ValueError(f"{ENGINES_ENV}: engines must be among {', '.join(ENGINES)}; got {names!r}")
    return names


def fsdp_layers_per_unit() -> int:
    """Decoder layers per FSDP2 unit: ``SPARSEFUSE_FSDP_LAYERS_PER_UNIT``, else :data:`FSDP_LAYERS_PER_UNIT`."""
    return _count_from_env(FSDP_UNIT_ENV, FSDP_LAYERS_PER_UNIT)


def steps_per_sync() -> int:
    """Training steps per timed call: ``SPARSEFUSE_TRAIN_STEPS_PER_SYNC``, else 1 (see :data:`STEPS_ENV`)."""
    return _count_from_env(STEPS_ENV, 1)


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
    ("1" or "0"), else :data:`FSDP_RESHARD_AFTER_FORWARD`."""
    return _flag_from_env(FSDP_RESHARD_ENV, FSDP_RESHARD_AFTER_FORWARD)


def train_profile() -> bool:
    """Whether each row's note adds the anatomy of its step by rank: ``SPARSEFUSE_TRAIN_PROFILE`` ("1" or "0",
    default "0"; three more steps per row, under torch.profiler)."""
    return _flag_from_env(PROFILE_ENV, False)


def pin_cpus() -> bool:
    """Whether each process keeps to its own share of the CPUs: ``SPARSEFUSE_TRAIN_PIN_CPUS`` ("1" or "0", default
    "0"; Linux only)."""
    pinned = _flag_from_env(PIN_CPUS_ENV, False)
    if pinned and not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"{PIN_CPUS_ENV}=1 needs os.sched_setaffinity (Linux)")
    return pinned


def single_thread_backward() -> bool:
    """Whether the training steps run their backward on the calling thread: ``SPARSEFUSE_TRAIN_SINGLE_THREAD_BACKWARD``
    ("1" or "0", default "1"; see its comment above)."""
    return _flag_from_env(SINGLE_THREAD_BACKWARD_ENV, True)


def cpu_share(cpus: list[int], local_rank: int, local_size: int) -> list[int]:
    """Local rank ``local_rank``'s share of ``cpus`` split among ``local_size`` processes: consecutive runs of
    near-equal length (the first ones one longer), at least one CPU each (shared round-robin past one per process)."""
    if len(cpus) < local_size:
        return [cpus[local_rank % len(cpus)]]
    per, extra = divmod(len(cpus), local_size)
    start = local_rank * per + min(local_rank, extra)
    return cpus[start : start + per + (local_rank < extra)]


def train_cuda_graph() -> bool | None:
    """Whether the patched models replay their sparse FFN steps from CUDA graphs (``patch_llama``'s
    ``train_cuda_graph``): ``SPARSEFUSE_TRAIN_CUDA_GRAPH`` ("1" or "0"); unset: None, the library's default (replay
    where the host would pace the step: the 1.5B shape)."""
    if CUDA_GRAPH_ENV not in os.environ:
        return None
    return _flag_from_env(CUDA_GRAPH_ENV, False)


def fsdp_label(n_layers: int | None = None) -> str:
    """The FSDP2 setup in words for a row's note (empty for torch's own: one layer per unit, resharded), for a model
    of ``n_layers`` decoder layers (a unit holds at most all of them)."""
    per_unit = min(fsdp_layers_per_unit(), n_layers or fsdp_layers_per_unit())
    parts = [f"{per_unit} layers per unit"] if per_unit > 1 else []
    parts += [] if fsdp_reshard_after_forward() else ["no reshard after forward"]
    return f" ({', '.join(parts)})" if parts else ""
