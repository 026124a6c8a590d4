"""Benchmark workload ``train``: one training step of a whole ReLU Llama -- forward, backward, AdamW -- with the
sparse training layer (:func:`sparsefuse.integrations.transformers.patch_llama` with ``train_method="hybrid"``)
against the same model unpatched, eager and compiled.

Models: :func:`sparsefuse.ffn.synthetic.synthetic_llama` at the 1.5B shape (hidden 2048, FFN 5632) at full depth
(24 layers) and at 8 layers, bf16, SDPA attention, in train mode; ``nnz=30`` (~30 gate non-zeros per token,
heavy-tailed, as in a model trained with L1) and ``dense`` (plain random weights, ~50% firing: the start of
training). The patched model is a deep copy of the unpatched one. The step: ``loss = LM loss (+ 2e-5 * the L1 term
of every patched layer)``, ``backward``, fused ``AdamW.step`` with ``lr=0`` (all the optimizer's work, weights
unchanged, so the gates keep their sparsity over the timed steps), ``zero_grad(set_to_none=False)``.

Rows (shape label ``"<layers>L <sparsity> B=.. S=.."``; speed-up = unpatched eager time / row time):

* ``unpatched``          the model as transformers builds it, eager
* ``unpatched compile``  its forward under ``torch.compile`` (8 layers only: compiling 24 costs minutes)
* ``patched``            after ``patch_llama(model, train_method="hybrid")``, eager
* ``patched compile``    its forward under ``torch.compile`` after one eager step (8 layers only)

``peak MB`` is the step's allocator high-water mark above what was allocated before it (weights, gradients and
optimizer state are allocated by then): the activations kept for the backward and the step's transients.
``--quick``: 8 layers, nnz=30, B=4 S=2048.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable

import torch

from ..harness import Case, Options, register

MODEL_SHAPE: str | dict = "1.5B"  # a synthetic_llama shape (tests use a tiny dict)
LAYERS = (24, 8)  # full depth, and a depth where compiling is affordable
SPARSITIES: tuple[float | None, ...] = (30.0, None)
BATCHES: list[tuple[int, int]] = [(4, 2048)]
L1_COEFFICIENT = 2e-5  # the TwELL paper's
QUICK = ((8,), (30.0,), [(4, 2048)])


class _Trainer:
    """A model, its AdamW and (optionally) its compiled forward: one training step per call."""

    def __init__(self, model: torch.nn.Module, compiled: bool, l1: bool) -> None:
        self.model = model.train()
        self.forward, self.compile_on_first_step = model, compiled
        fused = next(model.parameters()).is_cuda
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, fused=fused)
        self.l1 = l1

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        from ...integrations.transformers import l1_loss

        loss = self.forward(input_ids=ids, labels=ids).loss
        if self.compile_on_first_step:  # one eager step first, as the docs tell users: auto's choices settle
            self.forward, self.compile_on_first_step = torch.compile(self.model), False
        if self.l1:
            loss = loss + L1_COEFFICIENT * l1_loss(self.model)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        return loss.detach()


class _Models:
    """The trainers of one (layers, sparsity), built on first use; another key frees them first."""

    def __init__(self, build: Callable[[int, float | None], torch.nn.Module]) -> None:
        self.build, self.key, self.trainers = build, None, {}

    def get(self, key: tuple[int, float | None], impl: str) -> _Trainer:
        if key != self.key:
            self.trainers, self.key = {}, None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.key = key
        if impl not in self.trainers:
            from ...integrations.transformers import patch_llama

            if impl.startswith("patched"):
                model = patch_llama(copy.deepcopy(self._base()), train_method="hybrid")
            else:
                model = self._base()
            self.trainers[impl] = _Trainer(model, compiled=impl.endswith("compile"), l1=impl.startswith("patched"))
        return self.trainers[impl]

    def _base(self) -> torch.nn.Module:
        if "base" not in self.trainers:
            self.trainers["base"] = self.build(*self.key)
        return self.trainers["base"]


def _case(models: _Models, key: tuple[int, float | None], batch: int, seq: int, dtype: torch.dtype) -> Case:
    layers, mean_nnz = key
    impls = ["unpatched", "patched"] + (["unpatched compile", "patched compile"] if layers <= 8 else [])

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
        impls={impl: (lambda ids, impl=impl: models.get(key, impl).step(ids)) for impl in impls},
        method="eager",
        rotate=False,
        eager_impl="unpatched",
        compile_impl="unpatched compile" if layers <= 8 else None,
        tokens=batch * seq,
    )


@register(
    "train",
    "Whole-model training step (forward, backward, AdamW) of a ReLU Llama: patch_llama(train_method='hybrid') vs "
    "unpatched eager and compiled",
    "layers, gate sparsity, batch x sequence",
)
def train_cases(options: Options) -> list[Case]:
    try:
        from ...ffn.synthetic import synthetic_llama
    except ImportError as exc:  # transformers missing
        options.log(f"train: skipped ({exc})")
        return []
    dtype = torch.bfloat16 if torch.bfloat16 in options.dtypes else options.dtypes[0]

    def build(layers: int, mean_nnz: float | None) -> torch.nn.Module:
        return synthetic_llama(
            MODEL_SHAPE, num_hidden_layers=layers, mean_nnz=mean_nnz, dtype=dtype, device=options.device
        )

    models = _Models(build)
    layer_set, sparsities, batches = QUICK if options.quick else (LAYERS, SPARSITIES, BATCHES)
    return [
        _case(models, (layers, nnz), batch, seq, dtype)
        for layers in layer_set
        for nnz in sparsities
        for batch, seq in batches
    ]


__all__ = ["train_cases"]
