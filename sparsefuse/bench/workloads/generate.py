"""Benchmark workload ``generate``: a user's ``model.generate`` end to end -- greedy, a static KV cache, 128 new
tokens after a 512-token prompt -- for a sparse ReLU Llama patched by
:func:`sparsefuse.integrations.transformers.patch_llama` against the same model unpatched.

Models: :func:`sparsefuse.ffn.synthetic.synthetic_llama` at the paper's SparseLM-1.5B shape (batches 1, 8, 32) and
the 8B shape (batch 1), ~30 gate non-zeros per token, bf16. Ways to run it (``shape`` label
``"<model> nnz=30 generate B=.. P=.. N=.. <how>"``):

* ``eager``    ``model.generate`` as called from Python (transformers' own compile of a static-cache decode off)
* ``graph``    the forward under ``torch.compile(backend="cudagraphs")``: CUDA graphs of each step, no compiler
               fusions (what CUDA-graph replay alone gives)
* ``compile``  the forward under ``torch.compile(mode="reduce-overhead")``: Inductor plus its CUDA graphs

Each row's time is the whole ``generate`` call (host clock, method ``wall``); tokens/s counts the new tokens of
all sequences. The patched row's note says whether its greedy tokens equal the unpatched model's, or where they
first differ (bf16 rounds the two models' logits differently; they agree token for token in fp32, which the test
suite checks). ``--quick``: SparseLM-1.5B at batches 1 and 8, 32 new tokens, eager and graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..harness import Case, Options, register
from .liger_peer import peer
from .model import _ModelPair, _synthetic_llama, uniform_token_ids, whole_model_case, whole_model_impls

SCENARIOS = [("SparseLM-1.5B", 1), ("SparseLM-1.5B", 8), ("SparseLM-1.5B", 32), ("8B", 1)]  # (model, batch)
QUICK_SCENARIOS = [("SparseLM-1.5B", 1), ("SparseLM-1.5B", 8)]
PROMPT, NEW_TOKENS, QUICK_NEW_TOKENS = 512, 128, 32
HOWS, QUICK_HOWS = ("eager", "graph", "compile"), ("eager", "graph")
MEAN_NNZ = 30.0


def greedy_generate(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int, forward=None) -> torch.Tensor:
    """``model.generate`` greedy with a static cache, exactly ``new_tokens`` new tokens ([B, new_tokens]);
    ``forward``: a compiled forward to run the steps with (None: the model's own, transformers' compile off)."""
    original = model.forward
    if forward is not None:
        model.forward = forward
    try:
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            cache_implementation="static",
            disable_compile=True,
            pad_token_id=0,
        )
    finally:
        model.forward = original
    return out[:, prompt.shape[1] :]


def first_divergence(got: torch.Tensor, want: torch.Tensor) -> int | None:
    """The first new-token position where two [B, N] greedy generations differ in any sequence (None: none)."""
    differs = (got != want).any(dim=0).nonzero()
    return None if differs.numel() == 0 else int(differs[0])


class _Generations:
    """The compiled forwards of a model pair and the tokens each implementation generated last (for the notes)."""

    def __init__(self, pair: _ModelPair) -> None:
        self.pair = pair
        self.key: tuple[str, float] | None = None  # the model pair the forwards below were compiled for
        self.forwards: dict[tuple[str, str], Callable[..., Any]] = {}
        self.tokens: dict[str, torch.Tensor] = {}

    def run(self, key: tuple[str, float], impl: str, how: str, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
        model = self.pair.get(key)[impl]
        if key != self.key:  # another pair: the compiled forwards of the last one go with it
            self.key, self.forwards, self.tokens = key, {}, {}
        forward = None
        if how != "eager":
            if (impl, how) not in self.forwards:
                options = {"backend": "cudagraphs"} if how == "graph" else {"mode": "reduce-overhead"}
                self.forwards[(impl, how)] = torch.compile(model.forward, **options)
            forward = self.forwards[(impl, how)]
        self.tokens[impl] = greedy_generate(model, prompt, new_tokens, forward)
        return self.tokens[impl]

    def note(self, impl: str) -> str:
        if impl == "unpatched" or not {impl, "unpatched"} <= set(self.tokens):
            return ""
        at = first_divergence(self.tokens[impl], self.tokens["unpatched"])
        return "greedy tokens equal the unpatched model's" if at is None else f"greedy tokens first differ at {at}"


@register(
    "generate",
    "Sparse ReLU Llama: model.generate (greedy, static cache), patch_llama vs unpatched",
    "model generate B=batch P=prompt N=new tokens",
)
def generate_cases(options: Options) -> list[Case]:
    try:
        import transformers  # noqa: F401
    except ImportError:
        options.log("generate: skipped (the `transformers` package is not installed: pip install transformers)")
        return []
    try:
        build_llama = _synthetic_llama()
    except ImportError as exc:
        options.log(f"generate: skipped (sparsefuse.ffn.synthetic.synthetic_llama is unavailable: {exc})")
        return []
    dtype = torch.bfloat16 if torch.bfloat16 in options.dtypes else options.dtypes[0]
    impls = whole_model_impls(options.device)
    pair = _ModelPair(
        lambda shape, mean_nnz: build_llama(shape, mean_nnz=mean_nnz, dtype=dtype, device=options.device),
        liger="liger" in impls,
    )
    runs = _Generations(pair)
    new_tokens = QUICK_NEW_TOKENS if options.quick else NEW_TOKENS
    cases = []
    for model, batch in QUICK_SCENARIOS if options.quick else SCENARIOS:
        key = (model, MEAN_NNZ)
        for how in QUICK_HOWS if options.quick else HOWS:
            seed = len(cases)

            def make_inputs(key=key, batch=batch, seed=seed) -> tuple[torch.Tensor]:
                unpatched = pair.get(key)["unpatched"]
                return (uniform_token_ids(unpatched, (batch, PROMPT), torch.Generator().manual_seed(seed)),)

            calls = {
                impl: peer(
                    impl, lambda prompt, impl=impl, key=key, how=how: runs.run(key, impl, how, prompt, new_tokens)
                )
                for impl in impls
            }
            label = f"{model} nnz={MEAN_NNZ:g} generate B={batch} P={PROMPT} N={new_tokens}"
            tokens = batch * new_tokens
            cases.append(
                whole_model_case(
                    label, dtype, how, tokens, make_inputs, calls, "generate", method="wall", impl_note=runs.note
                )
            )
    return cases
