"""The ``train`` workload's distributed mode: the same training step on several GPUs, under DDP or FSDP2.

Launched by ``torchrun`` (``WORLD_SIZE`` and ``LOCAL_RANK`` in the environment), ``sparsefuse bench train`` runs
these cases instead of the single-GPU ones::

    torchrun --nproc_per_node 2 -m sparsefuse bench train --dtype bfloat16 --out OUT
    torchrun --nproc_per_node 2 -m sparsefuse bench train --shapes fsdp2 ...   # one engine

Every process builds the same synthetic 1.5B-shape Llama (``nnz=30``, full depth; 8 layers with ``--quick``),
takes rank 0's weights, and wraps it in ``DistributedDataParallel`` or FSDP2 (``fully_shard`` per run of 3
decoder layers kept gathered from forward to backward, then the root): both engines, each a case of its own, so
``--shapes`` picks one. Each process trains on its own micro-batch of ``B x S`` tokens (B and S as one GPU's rows:
the global batch grows with the processes), patched (``patch_llama(train_method="hybrid")``; ``down_layout="row"``
under FSDP2, which shards contiguous parameters only) vs unpatched, same step as on one GPU (AdamW at ``lr=0``), as
:data:`SETUP` says. No compiled, ``no FFN`` or largest-batch rows.

Rows (shape label ``"<layers>L nnz=30 B=<per GPU> S=.. <engine> x<GPUs>"``, method ``wall``, rank 0's clock):
tokens/s is per GPU (one process's tokens over the step time); the note names the GPU kind and count, the peak
memory per GPU (the maximum over the ranks) and the gradient check (:func:`grad_agreement`) of that model, run
before its first timed step. The harness runs the same number of steps in every process (``wall`` times a fixed
count), which the collectives need; the scaling efficiency (tokens/s per GPU at N over that at 1) is computed from
the rows of an N=1 and an N run merged into one set (:func:`summary_lines`).
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import gc
import math
import os
import re
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ...ffn.hybrid.graphed import GRAPH_EVENTS
from ...integrations._llama import FSDP2_LAYERS_PER_UNIT, FSDP2_RESHARD_AFTER_FORWARD
from ..harness import Case, Options, Result
from . import train_setup as setup
from .step_anatomy import StepAnatomy, describe, gpu_bound_ms, profile_steps

ENGINES = ("ddp", "fsdp2")
PROFILE_STEPS = 3


@dataclasses.dataclass(frozen=True)
class Setup:
    """How the distributed mode's steps run: what the committed rows measured. The lab
    (benchmarks/lab/train_knobs.py) replaces :data:`SETUP` to measure other setups."""

    # FSDP2 as shard_llama_fsdp2 runs it for a patched model (units of 3 decoder layers, kept gathered from forward
    # to backward; its docstring says why), given to the unpatched one too.
    layers_per_unit: int = FSDP2_LAYERS_PER_UNIT
    reshard_after_forward: bool = FSDP2_RESHARD_AFTER_FORWARD
    # patch_llama's train_cuda_graph: None is the library's default (replay where the host would pace the step: the
    # 1.5B shape)
    train_cuda_graph: bool | None = None
    # The backward on the calling thread (torch.autograd.set_multithreading_enabled(False)) rather than on
    # autograd's per-GPU worker thread, for both models: the engines' hooks run Python in the backward, which costs
    # less host time on the calling thread. On 2 H200s (FFN steps replayed) the patched step took 146 / 156 ms
    # (1 / 2 GPUs) under DDP that way against 152 / 161 ms on the worker thread; under FSDP2 over 2 GPUs 162 against
    # 171 ms (rank 0's host 128 against 149 ms a step); the unpatched steps, bound by their GPU work, did not move
    # (DDP 198-203 ms either way, FSDP2 over one GPU 200-203 ms).
    single_thread_backward: bool = True
    # Training steps per timed call: the harness synchronizes around each call, so 1 times every step from an idle
    # GPU (a loop that reads its loss each step) and more lets the host run ahead into the next step.
    steps_per_sync: int = 1
    note: str = ""  # words added after the engine in each row's note (the lab's CPU pinning)
    # each row's note adds the anatomy of its step by rank (step_anatomy: three more steps per row, under
    # torch.profiler); the lab turns it on
    profile: bool = False


SETUP = Setup()


def fsdp_label(n_layers: int | None = None) -> str:
    """The FSDP2 setup in words for a row's note (empty for torch's own: one layer per unit, resharded), for a model
    of ``n_layers`` decoder layers (a unit holds at most all of them)."""
    per_unit = min(SETUP.layers_per_unit, n_layers or SETUP.layers_per_unit)
    parts = [f"{per_unit} layers per unit"] if per_unit > 1 else []
    parts += [] if SETUP.reshard_after_forward else ["no reshard after forward"]
    return f" ({', '.join(parts)})" if parts else ""


# DDP as docs/training.md advises for a patched model, given to the unpatched one too: fewer, larger buckets (100 MB,
# ~27 all-reduces a step at the 1.5B shape, not ~110) and gradients that are views of them (no copy into the bucket).
# Each all-reduce and each copy costs host time in the backward; the patched step runs close to its host's pace, so
# on 2 H200s it took 162 ms with torch's defaults and 146 ms with these, against 143 ms without DDP.
DDP_OPTIONS = {"bucket_cap_mb": 100, "gradient_as_bucket_view": True}
GRAD_CHECK_BATCH = 1  # sequences per process in the gradient check (its one-process reference takes N of them)
# The L1 coefficient of the gradient check of the patched model: large enough that the L1 term's gradient (a
# per-rank mean, like the LM loss) is a visible part of the gate's gradient; the timed steps use train's.
GRAD_CHECK_L1 = 0.3
# Added to twice the error of re-batching alone (see GradAgreement): fp32 on CPUs, bf16/fp16 on GPUs.
GRAD_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
TIMEOUT = timedelta(minutes=5)  # a collective a peer never joins fails in minutes, not in NCCL's default 10
SHAPE_PATTERN = re.compile(r"^(?P<case>.+) (?P<engine>\w+) x(?P<gpus>\d+)$")


@dataclasses.dataclass(frozen=True)
class World:
    """This process's place: ``rank`` of ``size`` processes, on ``device`` (``cuda:<local rank>`` or the CPU)."""

    rank: int
    size: int
    device: torch.device


def launched() -> bool:
    """Whether this process was started by ``torchrun`` (or another launcher that sets its variables)."""
    return "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def init_world(device_type: str) -> World:
    """The process group of the processes ``torchrun`` started (NCCL on CUDA, gloo on the CPU), initialised once;
    on CUDA the current device is set to ``cuda:<LOCAL_RANK>`` first, since Triton launches on the current device."""
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if device.type == "cuda":
            dist.init_process_group("nccl", timeout=TIMEOUT, device_id=device)
        else:
            dist.init_process_group("gloo", timeout=TIMEOUT)
        atexit.register(_destroy)
    return World(dist.get_rank(), dist.get_world_size(), device)


def _destroy() -> None:
    """At exit: the models released before their group (a DDP reducer freed after ``destroy_process_group`` can
    hang its process; DDP's hooks keep it in reference cycles, hence the collection), then the group."""
    for resident in _RESIDENTS:
        resident.release()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast_(model: nn.Module) -> nn.Module:
    """Every process takes rank 0's parameters and buffers (in place; contiguous tensors: broadcast before a
    column-major re-layout). Models built from the same seed agree already; this makes it a guarantee."""
    if dist.get_world_size() > 1:
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=0)
    return model


def wrap(model: nn.Module, engine: str, world: World) -> nn.Module:
    """``model`` (a transformers causal LM on ``world.device``) under ``engine``: ``"ddp"`` returns a
    ``DistributedDataParallel`` around it; ``"fsdp2"`` applies ``fully_shard`` to each run of
    ``SETUP.layers_per_unit`` decoder layers (with ``SETUP.reshard_after_forward``) and then to the root (in
    place: the model itself is returned, its parameters now sharded DTensors). FSDP2 needs contiguous parameters:
    patch with ``down_layout="row"``."""
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [world.device.index] if world.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, **DDP_OPTIONS)
    if engine == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh

        from ...integrations.transformers import shard_llama_fsdp2

        # a mesh of this process group's device type: left to itself, fully_shard would take a visible GPU
        mesh = DeviceMesh.from_group(dist.group.WORLD, world.device.type)
        return shard_llama_fsdp2(
            model,
            layers_per_unit=SETUP.layers_per_unit,
            reshard_after_forward=SETUP.reshard_after_forward,
            mesh=mesh,
        )
    raise ValueError(f"engine must be one of {', '.join(ENGINES)}; got {engine!r}")


def step_loss(forward: nn.Module, model: nn.Module, ids: torch.Tensor, l1: float) -> torch.Tensor:
    """The training loss of one micro-batch ``ids`` [b, S]: the LM loss through ``forward`` (the wrapped model)
    plus ``l1`` times the L1 term of ``model``'s patched layers (none when ``l1 == 0``). Both are means over the
    micro-batch, so the mean over equal shares is the loss of the whole batch."""
    from ...integrations.transformers import l1_loss

    loss = forward(input_ids=ids, labels=ids).loss
    return loss + l1 * l1_loss(model) if l1 else loss


@dataclasses.dataclass(frozen=True)
class GradAgreement:
    """How far the N-process gradients are from one process's on the whole batch: ``error`` = the largest over the
    parameters of ``|g_N - g_1| / |g_1|`` (2-norms). ``floor``: the same for one process that runs the N shares one
    after another and accumulates (the N-process arithmetic without communication): rounding from re-batching
    alone. Agreement: ``error <= 2 * floor + tolerance`` (fp32: 1e-5; bf16: 1e-2)."""

    error: float
    floor: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.error <= 2 * self.floor + self.tolerance

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "DIFFERS"
        return f"grads vs 1 process {self.error:.1e} (re-batched {self.floor:.1e}): {verdict}"


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient by name, whole (an FSDP2 DTensor gathered: a collective); None where unused."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name] = None if g is None else g.detach().clone()
    return out


def _one_process_grads(model: nn.Module, ids: torch.Tensor, l1: float, chunks: int) -> dict[str, torch.Tensor]:
    """Gradients of one process's step on the whole batch ``ids`` [n * b, S], in ``chunks`` equal shares run one
    after another (each loss divided by ``chunks``), gradients accumulated."""
    model.zero_grad(set_to_none=True)
    for part in ids.chunk(chunks):
        (step_loss(model, model, part, l1) / chunks).backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return grads


def relative_error(grads: dict[str, torch.Tensor | None], reference: dict[str, torch.Tensor | None]) -> float:
    """The largest over parameters of ``|g - g_ref| / |g_ref|`` (2-norms, fp32); inf where only one of them has a
    gradient; 0 for a parameter whose gradients are both zero."""
    worst = 0.0
    for name, ref in reference.items():
        g = grads.get(name)
        if g is None or ref is None:
            if g is not ref:
                return math.inf
            continue
        diff = torch.linalg.vector_norm(g.float() - ref.float()).item()
        scale = torch.linalg.vector_norm(ref.float()).item()
        worst = max(worst, diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))
    return worst


def grad_agreement(
    model: nn.Module, engine: str, world: World, ids: torch.Tensor, l1: float
) -> tuple[nn.Module, GradAgreement]:
    """One training step's gradients under ``engine`` on ``world.size`` processes against one process's.

    Called by every process with the same ``model`` (rank 0's weights: :func:`broadcast_`) and the same global
    batch ``ids`` [world.size * b, S]. One process's reference (a copy of the model, on the whole batch) runs
    first; then ``model`` is wrapped (:func:`wrap`) and each rank takes its share, rows ``[rank * b, (rank + 1) *
    b)``; DDP's gradients are the ranks' average, FSDP2's are gathered whole. Returns the wrapped model (gradients
    cleared, ready to train) and the agreement, the largest over the ranks."""
    n = world.size
    if ids.shape[0] % n:
        raise ValueError(f"grad_agreement: the batch ({ids.shape[0]}) must divide among {n} processes")
    model.train()
    reference = copy.deepcopy(model)
    whole = _one_process_grads(reference, ids, l1, 1)
    rebatched = _one_process_grads(reference, ids, l1, n)
    del reference
    wrapped = wrap(model, engine, world)
    share = ids.shape[0] // n
    step_loss(wrapped, model, ids[world.rank * share : (world.rank + 1) * share], l1).backward()
    errors = torch.tensor(
        [relative_error(_grads(model), whole), relative_error(rebatched, whole)], dtype=torch.float64
    ).to(world.device)
    wrapped.zero_grad(set_to_none=True)
    if n > 1:  # every rank computed its own reference: the worst of them counts
        dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    dtype = next(model.parameters()).dtype
    return wrapped, GradAgreement(float(errors[0]), float(errors[1]), GRAD_TOLERANCE.get(dtype, 1e-2))


class _Engine:
    """One case's models on this process: per implementation (``unpatched``, ``patched``) the model built, given
    rank 0's weights, patched, checked against one process (:func:`grad_agreement`) and wrapped, on first use."""

    def __init__(self, build: Callable[[], nn.Module], engine: str, world: World, seq: int, layers: int) -> None:
        self.build, self.engine, self.world, self.seq, self.layers = build, engine, world, seq, layers
        self.trainers: dict[str, setup.Trainer] = {}
        self.agreement: dict[str, GradAgreement] = {}
        self.before: dict[str, int] = {}  # bytes allocated when the implementation's last step began
        self.last_ids: dict[str, torch.Tensor] = {}  # the tokens of its last step (what the anatomy re-runs)
        # the process-wide replay counters when this case's patched model was built: its note counts its own
        self.events_before: dict[str, int] = {}

    def trainer(self, impl: str) -> setup.Trainer:
        if impl not in self.trainers:
            from ...integrations.transformers import patch_llama

            model = broadcast_(self.build())
            patched = impl == "patched"
            if patched:
                self.events_before = dict(GRAPH_EVENTS)
                layout = "row" if self.engine == "fsdp2" else "column"
                model = patch_llama(
                    model, train_method="hybrid", down_layout=layout, train_cuda_graph=SETUP.train_cuda_graph
                )
            ids = global_batch(model.config.vocab_size, GRAD_CHECK_BATCH * self.world.size, self.seq, seed=1)
            wrapped, self.agreement[impl] = grad_agreement(
                model, self.engine, self.world, ids.to(self.world.device), GRAD_CHECK_L1 if patched else 0.0
            )
            self.trainers[impl] = setup.Trainer(
                model,
                compiled=False,
                l1=patched,
                forward=wrapped,
                single_thread_backward=SETUP.single_thread_backward,
            )
        return self.trainers[impl]

    def step(self, impl: str, ids: torch.Tensor) -> torch.Tensor:
        trainer = self.trainer(impl)
        if self.world.device.type == "cuda":
            self.before[impl] = torch.cuda.memory_allocated()
        self.last_ids[impl] = ids
        return trainer.step(ids)

    def steps(self, impl: str, ids: torch.Tensor, n: int) -> torch.Tensor:
        """``n`` steps on the same tokens, with no synchronization between them; the last loss."""
        for _ in range(n):
            loss = self.step(impl, ids)
        return loss

    def peak_mb(self, impl: str) -> float:
        """The allocator high-water mark since the harness last reset it, above what the implementation's last step
        began with, in MB: the maximum over the ranks (a collective: every rank calls it at the same point)."""
        if self.world.device.type != "cuda":
            return math.nan
        peak = torch.tensor([float(torch.cuda.max_memory_allocated() - self.before.get(impl, 0))], device="cuda")
        if self.world.size > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return float(peak) / 1e6

    def note(self, impl: str) -> str:
        """The row's note (a collective, see :meth:`peak_mb`): GPU kind and count, peak per GPU, gradient check."""
        where = torch.cuda.get_device_name(self.world.device) if self.world.device.type == "cuda" else "CPU"
        peak = self.peak_mb(impl)
        memory = f"peak/GPU {peak:.0f} MB (max over ranks)" if math.isfinite(peak) else "peak n/a"
        engine = self.engine
        if engine == "fsdp2":
            engine += fsdp_label(self.layers)
        anatomy = f"; {self.anatomy(impl)}" if SETUP.profile and impl in self.last_ids else ""
        replays = {k: GRAPH_EVENTS[k] - self.events_before.get(k, 0) for k in ("replay", "copied replay")}
        if impl == "patched" and replays["replay"] > 0:
            # FSDP2 gathers the weights into fresh storage every step: its replays read copies of them
            copied = replays["copied replay"] > 0
            engine += ", FFN steps as CUDA graphs" + (" (weights copied in)" if copied else "")
        engine += SETUP.note
        if SETUP.single_thread_backward:
            engine += ", backward on the calling thread"
        return f"{engine} on {self.world.size}x {where}; {memory}{anatomy}; {self.agreement[impl]}"

    def anatomy(self, impl: str) -> str:
        """:data:`PROFILE_STEPS` more steps of ``impl`` on its last tokens under torch.profiler, each rank's per-step
        compute, collective and idle time (a collective: every rank calls it at the same point)."""
        ids = self.last_ids[impl]
        found = profile_steps(lambda: self.step(impl, ids), PROFILE_STEPS).as_tensor(self.world.device)
        ranks = [found]
        if self.world.size > 1:
            ranks = [torch.empty_like(found) for _ in range(self.world.size)]
            dist.all_gather(ranks, found)
        return describe([StepAnatomy(*(float(v) for v in r.tolist())) for r in ranks])


def global_batch(vocab: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """[batch, seq] int64 token ids on the CPU, the same in every process for the same arguments."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


class _Resident:
    """The one case whose models are alive; another case frees them first (two engines' models need not share
    a GPU)."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.engine: _Engine | None = None

    def get(self, key: tuple, make: Callable[[], _Engine]) -> _Engine:
        if key != self.key:
            self.release()
            self.engine, self.key = make(), key
        return self.engine

    def release(self) -> None:
        self.engine, self.key = None, None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


_RESIDENTS: list[_Resident] = []  # released at exit, before the process group (see _destroy)


def distributed_cases(options: Options, dtype: torch.dtype) -> list[Case]:
    """The cases of one ``torchrun`` launch: per engine, the first layer count of train's (QUICK with ``--quick``)
    at its first sparse level and first batch."""
    from ...ffn.synthetic import synthetic_llama

    world = init_world("cuda" if str(options.device).startswith("cuda") else "cpu")
    layer_set, sparsities, batches = setup.QUICK if options.quick else (setup.LAYERS, setup.SPARSITIES, setup.BATCHES)
    layers, (batch, seq) = layer_set[0], batches[0]
    steps = SETUP.steps_per_sync
    per_sync = f" {steps} steps/sync" if steps > 1 else ""
    nnz = next(s for s in sparsities if s is not None)
    resident = _Resident()
    _RESIDENTS.append(resident)

    def build() -> nn.Module:
        return synthetic_llama(
            setup.MODEL_SHAPE, num_hidden_layers=layers, mean_nnz=nnz, dtype=dtype, device=world.device
        )

    cases = []
    for engine in ENGINES:
        key = (engine, layers, nnz, batch, seq)
        models = lambda key=key, engine=engine: resident.get(key, lambda: _Engine(build, engine, world, seq, layers))  # noqa: E731

        def make_inputs(models=models) -> tuple[torch.Tensor]:
            # both models built and checked here, on the default stream, before the harness's side-stream warm-up
            vocab = models().trainer("unpatched").model.config.vocab_size
            models().trainer("patched")
            ids = global_batch(vocab, batch * world.size, seq, seed=layers)  # this rank's share of one global batch
            return (ids[world.rank * batch : (world.rank + 1) * batch].to(world.device),)

        cases.append(
            Case(
                workload="train",
                shape=f"{layers}L nnz={nnz:g} B={batch} S={seq}{per_sync} {engine} x{world.size}",
                dtype=dtype,
                direction="fwd+bwd",
                bytes_moved=0,
                flops=0,
                ceiling="none",
                make_inputs=make_inputs,
                impls={
                    impl: (lambda ids, impl=impl, m=models: m().steps(impl, ids, steps))
                    for impl in ("unpatched", "patched")
                },
                method="wall",  # a fixed number of steps in every process: the collectives need it
                rotate=False,
                eager_impl="unpatched",
                compile_impl=None,
                tokens=batch * seq * steps,  # per process: tokens/s per GPU
                impl_note=lambda impl, m=models: m().note(impl),
            )
        )
    return cases


def is_distributed(shape: str) -> bool:
    """Whether a shape label is one of this mode's (``"... <engine> x<GPUs>"``)."""
    match = SHAPE_PATTERN.match(shape)
    return match is not None and match["engine"] in ENGINES


def summary_lines(rows: list[Result]) -> list[str]:
    """Markdown for the distributed rows: per case, engine and GPU count, tokens/s per GPU of each implementation,
    the patched speed-up, and the scaling efficiency (tokens/s per GPU at N over that at 1 GPU, same case and
    engine: needs the 1-GPU rows in the same set), and where the rows carry a step anatomy
    (``Setup.profile``, a lab knob) the speed-up and scaling of the GPU-bound step time as well (on a host that
    falls behind its GPU the wall-clock ratios move with the host's pace); then each patched row's note. Nothing
    without such rows."""
    runs: dict[tuple[str, str], dict[int, dict[str, Result]]] = {}
    for r in rows:
        match = SHAPE_PATTERN.match(r.shape)
        if r.status == "ok" and match is not None and match["engine"] in ENGINES:
            runs.setdefault((match["case"], match["engine"]), {}).setdefault(int(match["gpus"]), {})[r.impl] = r
    if not runs:
        return []
    profiled = any(
        gpu_bound_ms(r.note) is not None for by_gpus in runs.values() for g in by_gpus.values() for r in g.values()
    )
    lines = [
        "Several GPUs: each GPU trains its own micro-batch (B per GPU). Scaling efficiency: tokens/s per GPU at N "
        "GPUs over that at 1 GPU (same engine)."
        + (
            " GPU-bound: the same from each step's GPU time alone (the largest over the ranks of compute plus "
            "exposed NCCL, from the profiled steps): the step without the time its GPUs sat idle waiting for their "
            "hosts; '-' where a row has no anatomy."
            if profiled
            else ""
        ),
        "",
        "| case | engine | GPUs | tok/s per GPU (unpatched / patched) | patched speed-up | "
        "scaling eff. (unpatched / patched) |"
        + (" GPU-bound speed-up | GPU-bound scaling eff. (unpatched / patched) |" if profiled else ""),
        "|---|---|---|---|---|---|" + ("---|---|" if profiled else ""),
    ]
    notes = []

    def rate(by_gpus: dict[int, dict[str, Result]], gpus: int, impl: str) -> float:
        r = by_gpus.get(gpus, {}).get(impl)
        return r.tokens_per_s if r is not None else math.nan

    def gpu_bound(by_gpus: dict[int, dict[str, Result]], gpus: int, impl: str) -> float:
        r = by_gpus.get(gpus, {}).get(impl)
        ms = gpu_bound_ms(r.note) if r is not None else None
        return ms if ms is not None and ms > 0 else math.nan

    def ratio(a: float, b: float, suffix: str = "") -> str:
        """a / b to 2 decimals, '-' where either is missing."""
        return f"{a / b:.2f}{suffix}" if math.isfinite(a) and math.isfinite(b) else "-"

    for (case, engine), by_gpus in runs.items():
        for gpus in sorted(by_gpus):
            u, p = rate(by_gpus, gpus, "unpatched"), rate(by_gpus, gpus, "patched")
            eff_u, eff_p = u / rate(by_gpus, 1, "unpatched"), p / rate(by_gpus, 1, "patched")
            row = f"| {case} | {engine} | {gpus} | {u:.0f} / {p:.0f} | {p / u:.2f}x | {eff_u:.2f} / {eff_p:.2f} |"
            if profiled:
                ms_u, ms_p = gpu_bound(by_gpus, gpus, "unpatched"), gpu_bound(by_gpus, gpus, "patched")
                scaling_u = ratio(gpu_bound(by_gpus, 1, "unpatched"), ms_u)
                scaling_p = ratio(gpu_bound(by_gpus, 1, "patched"), ms_p)
                row += f" {ratio(ms_u, ms_p, 'x')} | {scaling_u} / {scaling_p} |"
            lines.append(row)
            if "patched" in by_gpus[gpus]:
                notes.append(f"- {case} {engine} x{gpus} patched: {by_gpus[gpus]['patched'].note}")
    return [*lines, "", *notes, ""]


__all__ = [
    "ENGINES",
    "SETUP",
    "GradAgreement",
    "Setup",
    "World",
    "broadcast_",
    "distributed_cases",
    "fsdp_label",
    "global_batch",
    "grad_agreement",
    "init_world",
    "is_distributed",
    "launched",
    "relative_error",
    "step_loss",
    "summary_lines",
    "wrap",
]
