"""Benchmark workload ``train``: one training step of a whole ReLU Llama -- forward, backward, AdamW -- with the
sparse training layer (:func:`sparsefuse.integrations.transformers.patch_llama` with ``train_method="hybrid"``)
against the same model unpatched, eager and compiled.

Models: :func:`sparsefuse.ffn.synthetic.synthetic_llama` at the TwELL paper's SparseLM-1.5B shape (hidden 2048, FFN
5632, full multi-head attention) at full depth (28 layers) and at 8 layers, bf16, SDPA attention, in train mode;
``nnz=30`` (~30 gate non-zeros per token, heavy-tailed, as in a model trained with L1) and ``dense`` (plain random
weights, ~50% firing: the start of training). The patched model is a deep copy of the unpatched one. The step: ``loss =
LM loss (+ 2e-5 * the L1 term of every patched layer)``, ``backward``, fused ``AdamW.step`` with ``lr=0`` (all the
optimizer's work, weights unchanged, so the gates keep their sparsity over the timed steps),
``zero_grad(set_to_none=False)``.

Rows (shape label ``"<layers>L <sparsity> B=.. S=.."``; speed-up = unpatched eager time / row time):

* ``unpatched``          the model as transformers builds it, eager
* ``unpatched compile``  its forward under ``torch.compile`` (8 layers only: compiling 24 costs minutes)
* ``patched``            after ``patch_llama(model, train_method="hybrid")``, eager: the sparse FFN, and the norms and
                         the rotary embedding fused (``fuse=True``, the default); at this layer shape the FFN steps
                         replay from CUDA graphs by default (``train_cuda_graph=None``)
* ``patched no replay``  the same model and optimizer, its sparse FFN steps launched eagerly
                         (``train_cuda_graph=False``: ~16 Triton launches and their Python a layer, each way)
* ``fused only``         the unpatched model with only the norms and the rotary embedding fused (``fuse_norms``,
                         ``fuse_rotary``; dense FFN): how much of ``patched``'s gain is not the FFN's (at full
                         depth on GPUs of >= 100 GiB only: a fourth resident model and its AdamW state)
* ``patched compile``    its forward under ``torch.compile`` after one eager step (8 layers only)
* ``liger``, ``liger compile``  where Liger-Kernel is installed: the unpatched model with Liger's fused RMSNorm,
                         rotary embedding and fused linear cross entropy (its globals in force for its own steps
                         only: :mod:`.liger_peer`), eager and compiled; where ``fused only`` runs (a further model)
* ``patched + liger loss``  the patched model and optimizer with Liger's fused linear cross entropy as the loss (no
                         [tokens, vocab] logits kept; norms and rotary still patch_llama's), where the Liger rows
                         run: the two composed, as a trainer would run them
* ``no FFN``             the unpatched model with every MLP's forward replaced by zeros (its weights still in
                         AdamW): the FFN's share of the step is ``1 - no FFN / unpatched``, by subtraction

And per model at ~30 non-zeros, the **largest micro-batch** (shape label ``"<layers>L nnz=30 S=.. largest B"``, method
``wall``): each of ``unpatched`` and ``patched`` alone on the GPU, the batch doubled from B until a step runs out of
memory, then bisected; the row times a step at that batch (its note names it; tokens/s counts its tokens).

``peak MB`` is the step's allocator high-water mark above what was allocated before it (weights, gradients and
optimizer state are allocated by then): the activations kept for the backward and the step's transients.
``--quick``: 8 layers, nnz=30, B=4 S=2048.

Under ``torchrun`` the workload runs its distributed mode instead (DDP and FSDP2 over the launched processes, one
GPU each; rows tagged with the engine and the GPU count): :mod:`.train_dist`.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..harness import Case, Options, Result, register
from . import liger_peer
from . import train_setup as setup
from .liger_peer import peer

FUSED_ONLY_MIN_GIB = 100  # GPU memory the full-depth "fused only" row needs beside the other three models
LARGEST_BATCH_CAP = 128  # micro-batches tried at most (sequences)
FIT_STEPS = 3  # training steps a micro-batch must run to count as fitting (the first steps at a size differ)


class _Models:
    """The trainers of one (layers, sparsity), built on first use; another key frees them first."""

    def __init__(self, build: Callable[[int, float | None], torch.nn.Module]) -> None:
        self.build, self.key, self.trainers = build, None, {}

    def get(self, key: tuple, impl: str, alone: bool = False) -> setup.Trainer:
        """The trainer of ``impl`` on the model of ``key`` ((layers, sparsity), built on first use). ``alone``: the
        implementation's model is the only one resident (patched in place, no unpatched copy kept)."""
        if key != self.key:
            self.trainers, self.key = {}, None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.key = key
        if impl == "patched no replay":  # the patched model and optimizer, its FFN steps launched eagerly
            return _Varied(self.get(key, "patched", alone), _no_replay)
        if impl == "patched + liger loss":  # the same, its loss Liger's fused linear cross entropy
            return _Varied(self.get(key, "patched", alone), liger_peer.liger_loss)
        if impl not in self.trainers:
            from ...integrations.transformers import patch_llama

            if impl.startswith("patched"):
                base = self._base() if alone else copy.deepcopy(self._base())
                model = patch_llama(base, train_method="hybrid")
            elif impl == "fused only":
                from ...integrations.transformers import fuse_norms, fuse_rotary

                model = copy.deepcopy(self._base())
                fuse_norms(model)
                fuse_rotary(model)
            elif impl == "no FFN":
                model = _without_ffn(copy.deepcopy(self._base()))
            elif impl.startswith("liger"):
                model = liger_peer.liger_training_copy(self._base())
            else:
                model = self._base()
            self.trainers[impl] = setup.Trainer(model, compiled=impl.endswith("compile"), l1=impl.startswith("patched"))
            if alone:
                self.trainers.pop("base", None)
        return self.trainers[impl]

    def _base(self) -> torch.nn.Module:
        if "base" not in self.trainers:
            self.trainers["base"] = self.build(*self.key[:2])
        return self.trainers["base"]


class _Varied:
    """A patched trainer stepped inside ``context(model)``: one model and optimizer for the patched row and its
    variants (a fourth resident 24-layer model would not fit an 80 GB GPU)."""

    def __init__(self, trainer: setup.Trainer, context: Callable[[torch.nn.Module], Any]) -> None:
        self.trainer, self.context = trainer, context

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        with self.context(self.trainer.model):
            return self.trainer.step(ids)


@contextlib.contextmanager
def _no_replay(model: torch.nn.Module) -> Iterator[None]:
    """The patched model's sparse FFN steps launched eagerly (``train_cuda_graph`` off) for the block's duration."""
    from ...nn import SparseGatedMLP

    layers = [m for m in model.modules() if isinstance(m, SparseGatedMLP)]
    chosen = [m.train_cuda_graph for m in layers]
    for m in layers:
        m.train_cuda_graph = False
    try:
        yield
    finally:
        for m, value in zip(layers, chosen):
            m.train_cuda_graph = value


def _gpu_gib() -> float:
    return torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 0.0


def _without_ffn(model: torch.nn.Module) -> torch.nn.Module:
    """Every decoder layer's MLP returns zeros (the residual carries on); its weights keep zero gradients, so AdamW
    still updates them and the step differs from the full one by the FFN's forward and backward only."""
    for layer in model.model.layers:
        layer.mlp.forward = torch.zeros_like
        for p in layer.mlp.parameters():
            p.grad = torch.zeros_like(p)
    return model


def _out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc)


_ALLOCATOR_FIGURES = (
    (r"Tried to allocate ([\d.]+ \w+)", "asked {}"),
    (r"of which ([\d.]+ \w+) is free", "{} free"),
    (r"([\d.]+ \w+) is allocated by PyTorch", "{} allocated"),
    (r"([\d.]+ \w+) is reserved by PyTorch but unallocated", "{} cached"),
)


def out_of_memory_summary(message: str) -> str:
    """The figures of torch's out-of-memory message in a few words (size asked, free, allocated, cached), or its
    first 80 characters where it has none of them."""
    parts = [fmt.format(m.group(1)) for pattern, fmt in _ALLOCATOR_FIGURES if (m := re.search(pattern, message))]
    return ", ".join(parts) if parts else message.strip().splitlines()[0][:80] if message.strip() else "out of memory"


def largest_batch(fits: Callable[[int], bool], start: int, cap: int) -> int:
    """The largest b in [1, cap] with ``fits(b)``, for a ``fits`` true up to some b and false above: doubling from
    ``start`` until a step fails or passes ``cap`` (halving when ``start`` already fails), then bisection between
    the last batch that fitted and the first that did not. 0 when not even 1 fits."""
    b = max(1, min(start, cap))
    if fits(b):
        lo, hi = b, cap + 1
        while 2 * b <= cap:
            b *= 2
            if not fits(b):
                hi = b
                break
            lo = b
    else:
        lo, hi = 0, b
        while b > 1:
            b //= 2
            if fits(b):
                lo = b
                break
            hi = b
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _release(trainer: setup.Trainer) -> None:
    from ...integrations.transformers import release_step

    release_step(trainer.model)


class _LargestBatch:
    """The ``largest B`` case's implementations: on its first call an implementation's model is built alone
    (the other one freed), its largest micro-batch searched with real training steps; every call then runs one step
    at that batch."""

    def __init__(self, models: _Models, key: tuple[int, float | None], batch: int, seq: int) -> None:
        self.models, self.key, self.start, self.seq = models, key, batch, seq
        self.batch: dict[str, int] = {}
        # impl -> (smallest batch that ran out of memory, what the allocator said): the note carries it, so a
        # search that stops early explains itself
        self.out_of_memory: dict[str, tuple[int, str]] = {}

    def _ids(self, trainer: setup.Trainer, batch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(batch)
        vocab = trainer.model.config.vocab_size
        return torch.randint(0, vocab, (batch, self.seq), generator=g).to(trainer.model.device)

    def _fits(self, impl: str, trainer: setup.Trainer, batch: int, steps: int = FIT_STEPS) -> bool:
        try:
            for _ in range(steps):
                trainer.step(self._ids(trainer, batch))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return True
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            if not _out_of_memory(exc):
                raise
            if batch < self.out_of_memory.get(impl, (batch + 1, ""))[0]:
                self.out_of_memory[impl] = (batch, out_of_memory_summary(str(exc)))
        # outside the except block: the exception's frames (and the step's tensors) are gone before freeing; the
        # patched layers' L1 terms still hold the failed forward's graph
        _release(trainer)
        trainer.optimizer.zero_grad(set_to_none=False)
        gc.collect()
        torch.cuda.empty_cache()
        return False

    def step(self, impl: str) -> torch.Tensor:
        trainer = self.models.get((*self.key, impl), impl, alone=True)
        if impl not in self.batch:
            self.batch[impl] = largest_batch(lambda b: self._fits(impl, trainer, b), self.start, LARGEST_BATCH_CAP)
        while True:
            if not self.batch[impl]:
                raise RuntimeError(f"train: not even one sequence of {self.seq} tokens fits ({impl})")
            try:
                return trainer.step(self._ids(trainer, self.batch[impl]))
            except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                if not _out_of_memory(exc):
                    raise
            # a batch that fitted its search steps can still run out on a later one (the sparse layer's kept
            # capacity follows the firing it observes): one sequence fewer (its note says the batch timed)
            self.batch[impl] -= 1
            _release(trainer)
            trainer.optimizer.zero_grad(set_to_none=False)
            gc.collect()
            torch.cuda.empty_cache()

    def tokens(self, impl: str) -> int:
        return self.batch.get(impl, 0) * self.seq

    def note(self, impl: str) -> str:
        if impl not in self.batch:
            return ""
        failed = self.out_of_memory.get(impl)
        return f"largest B={self.batch[impl]}" + (f" (B={failed[0]}: {failed[1]})" if failed else "")


def _case(models: _Models, key: tuple[int, float | None], batch: int, seq: int, dtype: torch.dtype) -> Case:
    layers, mean_nnz = key
    compiled = ["unpatched compile", "patched compile"] if layers <= 8 else []
    # each row's model lives with its AdamW state (16 bytes a parameter): a fourth 24-layer model fits 141 GB, not 80
    fused = ["fused only"] if layers <= 8 or _gpu_gib() >= FUSED_ONLY_MIN_GIB else []
    # Liger-Kernel, the dense peer trainers run (where installed; at full depth where a further model fits too)
    liger = (
        ["liger", *(["liger compile"] if compiled else []), "patched + liger loss"]
        if fused and liger_peer.runs_on("cuda" if torch.cuda.is_available() else "cpu")
        else []
    )
    impls = ["unpatched", "patched", "patched no replay", *fused, *liger, *compiled, "no FFN"]

    def make_inputs() -> tuple[torch.Tensor]:
        model = models.get(key, "unpatched").model
        g = torch.Generator().manual_seed(layers)
        return (torch.randint(0, model.config.vocab_size, (batch, seq), generator=g).to(model.device),)

    return Case(
        workload="train",
        shape=f"{layers}L {'dense' if mean_nnz is None else f'nnz={mean_nnz:g}'} B={batch} S={seq}",
        dtype=dtype,
        direction="fwd+bwd",
        bytes_moved=0,
        flops=0,
        ceiling="none",
        make_inputs=make_inputs,
        impls={impl: peer(impl, lambda ids, impl=impl: models.get(key, impl).step(ids)) for impl in impls},
        method="eager",
        rotate=False,
        eager_impl="unpatched",
        compile_impl="unpatched compile" if layers <= 8 else None,
        tokens=batch * seq,
    )


def _largest_batch_case(models: _Models, key: tuple[int, float], batch: int, seq: int, dtype: torch.dtype) -> Case:
    largest = _LargestBatch(models, key, batch, seq)
    return Case(
        workload="train",
        shape=f"{key[0]}L nnz={key[1]:g} S={seq} largest B",
        dtype=dtype,
        direction="fwd+bwd",
        bytes_moved=0,
        flops=0,
        ceiling="none",
        make_inputs=lambda: (torch.zeros(1),),  # each implementation makes its own batch
        impls={impl: (lambda _, impl=impl: largest.step(impl)) for impl in ("unpatched", "patched")},
        method="wall",
        rotate=False,
        eager_impl="unpatched",
        compile_impl=None,
        impl_tokens=largest.tokens,
        impl_note=largest.note,
    )


def summary(rows: list[Result]) -> list[str]:
    """Markdown: per model case, the FFN's share of the unpatched step (by subtraction), the speed-up it bounds
    (Amdahl, for an infinitely fast FFN) and the patched speed-up; per largest-batch case, tokens/s of each."""
    by_shape: dict[str, dict[str, Result]] = {}
    for r in rows:
        if r.status == "ok":
            by_shape.setdefault(r.shape, {})[r.impl] = r
    from .train_dist import is_distributed, summary_lines

    several = summary_lines(rows)  # the rows of the distributed mode, tagged with engine and GPU count
    by_shape = {shape: impls for shape, impls in by_shape.items() if not is_distributed(shape)}
    if not by_shape and several:
        return several
    lines = [
        "FFN share: 1 - (step with every MLP returning zeros) / (unpatched step). Bound: the speed-up of an "
        "infinitely fast FFN, 1 / (1 - share).",
        "",
        "| case | FFN share | bound | patched speed-up | fused-only speed-up | peak MB (unpatched / patched) |",
        "|---|---|---|---|---|---|",
    ]
    for shape, impls in by_shape.items():
        u, p, n = impls.get("unpatched"), impls.get("patched"), impls.get("no FFN")
        if u is None or p is None or shape.endswith("largest B"):
            continue
        share = 1 - n.median_us / u.median_us if n is not None else float("nan")
        fused = impls.get("fused only")
        fused_speedup = f"{u.median_us / fused.median_us:.2f}x" if fused is not None else "-"
        lines.append(
            f"| {shape} | {100 * share:.0f}% | {1 / (1 - share):.2f}x | {u.median_us / p.median_us:.2f}x | "
            f"{fused_speedup} | {u.peak_mb:.0f} / {p.peak_mb:.0f} |"
        )
    for shape, impls in by_shape.items():
        u, p = impls.get("unpatched"), impls.get("patched")
        if shape.endswith("largest B") and u is not None and p is not None:
            lines.append("")
            lines.append(
                f"{shape}: unpatched {u.note}, {u.tokens_per_s:.0f} tok/s; patched {p.note}, "
                f"{p.tokens_per_s:.0f} tok/s ({p.tokens_per_s / u.tokens_per_s:.2f}x)"
            )
    return [*lines, "", *several]


@register(
    "train",
    "Whole-model training step (forward, backward, AdamW) of a ReLU Llama: patch_llama(train_method='hybrid') vs "
    "unpatched eager and compiled",
    "layers, gate sparsity, batch x sequence",
    summary=summary,
)
def train_cases(options: Options) -> list[Case]:
    try:
        from ...ffn.synthetic import synthetic_llama
    except ImportError as exc:  # transformers missing
        options.log(f"train: skipped ({exc})")
        return []
    dtype = torch.bfloat16 if torch.bfloat16 in options.dtypes else options.dtypes[0]
    from .train_dist import distributed_cases, launched

    if launched():  # under torchrun: the distributed mode's cases (module train_dist)
        return distributed_cases(options, dtype)

    def build(layers: int, mean_nnz: float | None) -> torch.nn.Module:
        return synthetic_llama(
            setup.MODEL_SHAPE, num_hidden_layers=layers, mean_nnz=mean_nnz, dtype=dtype, device=options.device
        )

    models = _Models(build)
    layer_set, sparsities, batches = setup.QUICK if options.quick else (setup.LAYERS, setup.SPARSITIES, setup.BATCHES)
    cases = [
        _case(models, (layers, nnz), batch, seq, dtype)
        for layers in layer_set
        for nnz in sparsities
        for batch, seq in batches
    ]
    sparse_levels = [nnz for nnz in sparsities if nnz is not None]
    if sparse_levels:  # the largest micro-batch at the first sparse level, the first sequence length
        batch, seq = batches[0]
        cases += [_largest_batch_case(models, (layers, sparse_levels[0]), batch, seq, dtype) for layers in layer_set]
    return cases


__all__ = ["train_cases"]
