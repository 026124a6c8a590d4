"""Benchmark workload ``model``: a whole sparse ReLU Llama with :func:`sparsefuse.integrations.transformers.patch_llama`
against the same model unpatched, in prefill and in decode.

Models: :func:`sparsefuse.ffn.synthetic.synthetic_llama` at the TwELL paper's SparseLM-1.5B shape (hidden 2048, FFN
5632, 28 layers, 32 KV heads, vocab 49152, tied embeddings) and the 8B shape (hidden 4096, FFN 14336, 32 layers, 8 KV
heads), SDPA attention, bf16 (the first requested dtype when ``--dtype`` excludes bf16), each with ~30 gate non-zeros
per token (``nnz=30``, heavy-tailed as in a trained sparse model) and with plain random weights (``dense``, ~50% firing:
what the patch costs when the FFN is not sparse). The patched model is a deep copy of the unpatched one (same weights);
only one pair is alive at a time.

Scenarios (``shape`` label ``"<model> <sparsity> <phase> B=.. S=.. <timing>"``):

* ``prefill B, S``  one forward over B x S tokens, ``use_cache=False``, logits of the last token only
  (``logits_to_keep=1``; where transformers lacks it, the last hidden state through ``lm_head``): a real prefill
  does not write the [B, S, vocab] logits.
* ``decode B``      one decode step of B sequences (one new token each) with a transformers ``StaticCache`` holding
  a context of 512 tokens that the unpatched model prefilled; the step writes slot 512 and the cache is rewound
  after it (in place, on the device), so every timed step is the same step.

Each scenario is timed several ways, one case each (rows ``unpatched`` and ``patched``, the speed-up column is
unpatched time / patched time):

* ``eager``    plain calls from Python (harness method ``"eager"``): what a user's loop gets, host included
* ``graph``    CUDA-graph replay of one call: GPU time only
* ``compile``  (full run only) the model under ``torch.compile``, default mode for prefill and
               ``mode="reduce-overhead"`` (its own CUDA graphs) for decode, timed as plain calls
* ``FFN``      every layer's MLP on that layer's real input (captured by hooks during one unpatched forward of the
               same scenario), all layers in one CUDA graph: the model's FFN time. Cheaper than the profiler, and
               on the same inputs for both rows, so its speed-up is the FFN's own ratio.
* ``FFN-eager``, ``FFN-compile``  the same MLP calls timed as the ``eager`` and ``compile`` rows are (plain calls;
               under torch.compile in that row's mode): the FFN's share and ratio in each timing mode.

:func:`summary` joins them: FFN share = FFN time (unpatched) / whole-model time (unpatched), each row against the
FFN row of its own timing, and the Amdahl bound
``1 / (1 - share + share / ffn_speedup)``; :func:`plot` draws tokens/s per prefill shape and against the decode
batch. ``--quick``: SparseLM-1.5B, nnz=30, prefill (4, 2048), decode B in {1, 8}, eager and graph.

``--checkpoint PATH`` benches a trained model instead (a ``{"config", "state_dict"}`` file such as the training
example's ``model-l1.pt``: sparsity learned, not synthesised), sparsity label ``learned``, fed what it was trained on
where its vocabulary is bytes (windows of the standard library's ``.py`` files), random tokens otherwise.
"""

from __future__ import annotations

import copy
import gc
import inspect
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..harness import Case, Options, Result, register
from . import liger_peer

MODELS = ("SparseLM-1.5B", "8B")
SPARSITIES: tuple[float | None, ...] = (30.0, None)  # mean gate non-zeros per token; None: plain random weights
PREFILL: list[tuple[int, int]] = [(1, 512), (4, 2048), (16, 2048)]  # (batch, sequence)
DECODE_BATCHES = [1, 8, 32]
CONTEXT = 512  # tokens already in the KV cache of a decode step
METHODS = ("eager", "graph", "compile")
QUICK_MODELS, QUICK_SPARSITIES = ("SparseLM-1.5B",), (30.0,)
QUICK_PREFILL, QUICK_DECODE_BATCHES, QUICK_METHODS = [(4, 2048)], [1, 8], ("eager", "graph")
IMPLS = ("unpatched", "patched")


def whole_model_impls(device: str) -> tuple[str, ...]:
    """The whole-model rows: unpatched, patched, and Liger-Kernel's fused norms and rotary where it is installed and
    can run (a CUDA device): the dense peer an LLM user already runs (:mod:`.liger_peer`)."""
    return IMPLS + (("liger",) if liger_peer.runs_on(device) else ())


_SHAPE = re.compile(
    r"^(?P<model>\S+) (?P<sparsity>\S+) (?P<phase>prefill|decode) B=(?P<batch>\d+)(?: S=(?P<seq>\d+))? (?P<how>\S+)$"
)


def sparsity_label(mean_nnz: float | str | None) -> str:
    if isinstance(mean_nnz, str):
        return mean_nnz
    return "dense" if mean_nnz is None else f"nnz={mean_nnz:g}"


def parse_shape(shape: str) -> dict[str, str] | None:
    """The parts of a shape label (model, sparsity, phase, batch, seq or None, how), or None for another label."""
    match = _SHAPE.match(shape)
    return match.groupdict() if match else None


# ----------------------------------------------------------------------------------------------------------------
# Models and calls (transformers' cache and logits keywords differ between versions: read from the signatures)
# ----------------------------------------------------------------------------------------------------------------


def uniform_token_ids(model: torch.nn.Module, shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """[B, S] int64 token ids drawn uniformly from the model's vocabulary, on its device."""
    return torch.randint(0, model.config.vocab_size, shape, generator=generator).to(model.device)


class _ModelPair:
    """The unpatched model of one (shape, sparsity) and its patched deep copy, built on first use; asking for
    another key frees this pair first (two 8B pairs do not fit on an 80 GB GPU beside each other). Compiled
    wrappers are kept here too, so that they are freed with their model."""

    def __init__(
        self, build: Callable[[str, float | None], torch.nn.Module], text: torch.Tensor | None = None, liger=False
    ) -> None:
        self.build, self.liger = build, liger  # liger: build Liger-Kernel's copy too (row "liger")
        self.text = text  # [T] uint8 corpus the model was trained on (byte vocabulary), or None: random tokens
        self.key: tuple[str, float | None] | None = None
        self.models: dict[str, torch.nn.Module] = {}
        self.compiled: dict[tuple[str, str], Callable[..., Any]] = {}

    @property
    def impls(self) -> tuple[str, ...]:
        return IMPLS + (("liger",) if self.liger else ())

    def get(self, key: tuple[str, float | None]) -> dict[str, torch.nn.Module]:
        if key != self.key:
            self.models, self.compiled, self.key = {}, {}, None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            from ...integrations.transformers import patch_llama

            model = self.build(*key).eval()
            self.models = {"unpatched": model, "patched": patch_llama(copy.deepcopy(model))}
            if self.liger:
                self.models["liger"] = liger_peer.liger_copy(model)
            self.key = key
        return self.models

    def token_ids(self, model: torch.nn.Module, shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
        """[B, S] int64 token ids on the model's device: random windows of the corpus, else uniform tokens."""
        batch, seq = shape
        if self.text is None or self.text.numel() <= seq:
            return uniform_token_ids(model, shape, generator)
        starts = torch.randint(0, self.text.numel() - seq, (batch, 1), generator=generator)
        return self.text[starts + torch.arange(seq)].long().to(model.device)

    def compile(self, key: tuple[str, float | None], impl: str, mode: str, ffn: bool = False) -> Callable[..., Any]:
        """The model under torch.compile, as a user compiles it: straight away, no eager call first (the patched
        FFN decides its method when the compiled graph runs, from each layer's firing counted then); with ``ffn``,
        every layer's MLP (:func:`run_mlps`, the ``FFN-compile`` rows) instead."""
        model = self.get(key)[impl]
        if (impl, mode, ffn) not in self.compiled:
            target = (lambda *xs: run_mlps(model, xs)) if ffn else model
            self.compiled[(impl, mode, ffn)] = torch.compile(target, mode=None if mode == "default" else mode)
        return self.compiled[(impl, mode, ffn)]


def _params(fn: Callable[..., Any]) -> set[str]:
    return set(inspect.signature(fn).parameters)


def _cache_keyword(model: torch.nn.Module) -> str:
    return "cache" if "cache" in _params(model.forward) else "past_key_values"


def prefill_logits(model: torch.nn.Module, input_ids: torch.Tensor, call: Callable[..., Any] | None = None) -> Any:
    """Logits [B, 1, vocab] of the last token of one forward over ``input_ids`` [B, S], no KV cache written.
    ``call`` (default: the model) is what runs it, e.g. its torch.compile wrapper."""
    call = model if call is None else call  # not `call or model`: a compiled module defines __len__
    with torch.no_grad():  # the patched MLP runs its sparse kernels only when no gradient is wanted
        params = _params(model.forward)
        for keyword in ("logits_to_keep", "num_logits_to_keep"):
            if keyword in params:
                return call(input_ids=input_ids, use_cache=False, **{keyword: 1}).logits
        hidden = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
        return model.lm_head(hidden[:, -1:])


class DecodeState:
    """A StaticCache holding ``context`` tokens (prefilled by ``model``) for ``batch`` sequences, and the inputs of
    the next step: token ids [B, 1] and their position. :meth:`step` runs that step and rewinds the cache in place
    (transformers versions that count the filled length on the device), so it can be repeated and captured."""

    def __init__(
        self,
        model: torch.nn.Module,
        batch: int,
        context: int,
        generator: torch.Generator,
        token_ids: Callable[[torch.nn.Module, tuple[int, int], torch.Generator], torch.Tensor] | None = None,
    ) -> None:
        from transformers import StaticCache

        token_ids = uniform_token_ids if token_ids is None else token_ids
        device = model.device
        kwargs: dict[str, Any] = {"config": model.config, "max_cache_len": context + 1}
        params = _params(StaticCache.__init__)
        if "max_batch_size" in params:  # older transformers allocate the cache up front
            kwargs.update(max_batch_size=batch, device=device, dtype=model.dtype)
        self.cache = StaticCache(**kwargs)
        self.cache_keyword = _cache_keyword(model)
        self.with_cache_position = "cache_position" in _params(model.model.forward)
        ids = token_ids(model, (batch, context + 1), generator)  # the context, then each sequence's next token
        self.context_ids = ids[:, :context].contiguous()
        with torch.no_grad():
            model(
                input_ids=self.context_ids, use_cache=True, **self._cache_kwargs(torch.arange(context, device=device))
            )
        self.lengths = [
            layer.cumulative_length
            for layer in getattr(self.cache, "layers", [])
            if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)
        ]
        self.input_ids = ids[:, context:].contiguous()
        self.position_ids = torch.full((batch, 1), context, device=device, dtype=torch.long)
        self.cache_position = torch.tensor([context], device=device)

    def _cache_kwargs(self, cache_position: torch.Tensor) -> dict[str, Any]:
        kwargs: dict[str, Any] = {self.cache_keyword: self.cache}
        if self.with_cache_position:
            kwargs["cache_position"] = cache_position
        return kwargs

    def step(self, call: Callable[..., Any]) -> torch.Tensor:
        """Logits [B, 1, vocab] of the next token; ``call`` is the model or its compiled wrapper."""
        with torch.no_grad():
            logits = call(
                input_ids=self.input_ids,
                position_ids=self.position_ids,
                use_cache=True,
                **self._cache_kwargs(self.cache_position),
            ).logits
            if self.lengths:
                torch._foreach_sub_(self.lengths, 1)  # one launch for every layer's length
        return logits


def mlp_inputs(model: torch.nn.Module, run: Callable[[], Any]) -> tuple[torch.Tensor, ...]:
    """Each layer's MLP input during ``run()`` (one forward of ``model``), in layer order."""
    captured: list[torch.Tensor] = []
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda module, args: captured.append(args[0].detach().clone()))
        for layer in model.model.layers
    ]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return tuple(captured)


def run_mlps(model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every layer's MLP on its own input (what the FFN rows time)."""
    with torch.no_grad():
        return [layer.mlp(x) for layer, x in zip(model.model.layers, inputs)]


# ----------------------------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------------------------


def whole_model_case(
    label: str,
    dtype: torch.dtype,
    how: str,
    tokens: int,
    make_inputs,
    impls,
    workload: str = "model",
    method: str | None = None,
    **extra: Any,
) -> Case:
    """A whole-model case (``model``, ``generate``): rows per implementation against the unpatched model, no byte
    or FLOP floor, one input set (the weights are what is read). ``method``: the harness's timing, by default
    plain calls for ``eager``/``compile`` (and their ``FFN-`` rows) and a CUDA graph otherwise."""
    return Case(
        workload=workload,
        shape=f"{label} {how}",
        dtype=dtype,
        direction="fwd",
        bytes_moved=0,
        flops=0,
        ceiling="none",
        make_inputs=make_inputs,
        impls=impls,
        method=method or ("eager" if how.removeprefix("FFN-") in ("eager", "compile") else "graph"),
        rotate=False,
        eager_impl="unpatched",
        compile_impl=None,
        tokens=tokens,
        **extra,
    )


def _scenario_cases(
    pair: _ModelPair,
    key: tuple[str, float | None],
    phase: str,
    batch: int,
    seq: int,
    methods: Sequence[str],
    dtype: torch.dtype,
    seed: int,
) -> list[Case]:
    """The cases of one (model, phase, batch[, seq]): one per timing method, then the FFN case."""
    label = f"{key[0]} {sparsity_label(key[1])} {phase} B={batch}" + (f" S={seq}" if phase == "prefill" else "")

    def generator() -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    mode = "default" if phase == "prefill" else "reduce-overhead"  # torch.compile's, for the compiled rows
    if phase == "prefill":
        tokens = batch * seq

        def make_inputs() -> tuple[torch.Tensor]:
            model = pair.get(key)["unpatched"]
            return (pair.token_ids(model, (batch, seq), generator()),)

        def whole(impl: str, how: str) -> Callable[..., Any]:
            if how == "compile":
                return lambda ids: prefill_logits(pair.get(key)[impl], ids, pair.compile(key, impl, mode))
            return lambda ids: prefill_logits(pair.get(key)[impl], ids)

        def make_ffn_inputs() -> tuple[torch.Tensor, ...]:
            model = pair.get(key)["unpatched"]
            (ids,) = make_inputs()
            return mlp_inputs(model, lambda: prefill_logits(model, ids))

    else:
        tokens = batch

        def make_inputs() -> tuple[DecodeState]:
            return (DecodeState(pair.get(key)["unpatched"], batch, CONTEXT, generator(), pair.token_ids),)

        def whole(impl: str, how: str) -> Callable[..., Any]:
            if how == "compile":
                return lambda state: state.step(pair.compile(key, impl, mode))
            return lambda state: state.step(pair.get(key)[impl])

        def make_ffn_inputs() -> tuple[torch.Tensor, ...]:
            model = pair.get(key)["unpatched"]
            (state,) = make_inputs()
            return mlp_inputs(model, lambda: state.step(model))

    cases = [
        whole_model_case(
            label,
            dtype,
            how,
            tokens,
            make_inputs,
            {impl: liger_peer.peer(impl, whole(impl, how)) for impl in pair.impls},
        )
        for how in methods
    ]
    # the FFN alone in every timing of the whole-model rows (its share and ratio in that mode): in one CUDA graph
    # ("FFN"), plain calls ("FFN-eager") and compiled ("FFN-compile")
    for how in ("graph", *(h for h in methods if h != "graph")):
        if how == "compile":
            ffn = {impl: (lambda *xs, impl=impl: pair.compile(key, impl, mode, ffn=True)(*xs)) for impl in IMPLS}
        else:
            ffn = {impl: (lambda *xs, impl=impl: run_mlps(pair.get(key)[impl], xs)) for impl in IMPLS}
        name = "FFN" if how == "graph" else f"FFN-{how}"
        cases.append(whole_model_case(label, dtype, name, tokens, make_ffn_inputs, ffn))
    return cases


def load_checkpoint(path: Path, dtype: torch.dtype, device: str, config_only: bool = False) -> Any:
    """The ``LlamaForCausalLM`` saved at ``path`` as ``{"config": dict, "state_dict": ...}`` (the training example's
    ``model-l1.pt``; a patched model's state_dict has the unpatched keys), in eval mode on ``device`` in ``dtype``;
    with ``config_only`` its ``LlamaConfig`` alone."""
    from transformers import LlamaConfig, LlamaForCausalLM

    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or not {"config", "state_dict"} <= saved.keys():
        raise ValueError(
            f"--checkpoint {str(path)!r}: expected a dict with 'config' and 'state_dict' (as saved by "
            f"examples/train_sparse_llama.py), got {type(saved).__name__}"
            + (f" with keys {sorted(saved)}" if isinstance(saved, dict) else "")
        )
    config = LlamaConfig(**saved["config"])
    if config_only:
        return config
    model = LlamaForCausalLM(config)
    model.load_state_dict(saved["state_dict"])
    return model.to(device=device, dtype=dtype).eval()


def stdlib_text(limit: int) -> torch.Tensor:
    """[<= limit] uint8: the standard library's ``.py`` files in sorted order, the training example's corpus."""
    import sysconfig

    chunks, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "site-packages" not in path.parts and total < limit:
            chunks.append(path.read_bytes())
            total += len(chunks[-1])
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8)


def _synthetic_llama() -> Callable[..., torch.nn.Module]:
    from ...ffn.synthetic import synthetic_llama

    return synthetic_llama


def _summary(rows: Sequence[Result]) -> list[str]:
    return summary(rows)


def _plot(rows: Sequence[Result], meta: dict[str, str], path: Any) -> bool:
    return plot(rows, meta, Path(path))


@register(
    "model",
    "Sparse ReLU Llama, whole model: patch_llama (TwELL FFN) vs the same model unpatched, prefill and decode",
    "model, sparsity, phase, batch B (x sequence S), timing",
    summary=_summary,
    plot=_plot,
)
def model_cases(options: Options) -> list[Case]:
    try:
        import transformers  # noqa: F401
    except ImportError:
        options.log("model: skipped (the `transformers` package is not installed: pip install transformers)")
        return []
    # bf16 is the design point; another dtype only when bf16 was not asked for (e.g. float32 on the CPU in tests).
    dtype = torch.bfloat16 if torch.bfloat16 in options.dtypes else options.dtypes[0]
    quick = options.quick
    if options.checkpoint is not None:
        path = Path(options.checkpoint)
        models, sparsities = (path.stem,), ("learned",)
        config = load_checkpoint(path, torch.float32, "cpu", config_only=True)
        text = stdlib_text(16 << 20) if config.vocab_size == 256 else None

        def build(shape: str, mean_nnz: float | str | None) -> torch.nn.Module:
            return load_checkpoint(path, dtype, options.device)

    else:
        try:
            build_llama = _synthetic_llama()
        except ImportError as exc:
            options.log(f"model: skipped (sparsefuse.ffn.synthetic.synthetic_llama is unavailable: {exc})")
            return []
        models = QUICK_MODELS if quick else MODELS
        sparsities, text = QUICK_SPARSITIES if quick else SPARSITIES, None

        def build(shape: str, mean_nnz: float | str | None) -> torch.nn.Module:
            return build_llama(shape, mean_nnz=mean_nnz, dtype=dtype, device=options.device)

    pair = _ModelPair(build, text, liger="liger" in whole_model_impls(options.device))
    methods = QUICK_METHODS if quick else METHODS
    cases: list[Case] = []
    for model in models:  # cases of one model pair stay together: it is built once
        for mean_nnz in sparsities:
            key = (model, mean_nnz)
            for batch, seq in QUICK_PREFILL if quick else PREFILL:
                cases += _scenario_cases(pair, key, "prefill", batch, seq, methods, dtype, seed=len(cases))
            for batch in QUICK_DECODE_BATCHES if quick else DECODE_BATCHES:
                cases += _scenario_cases(pair, key, "decode", batch, 0, methods, dtype, seed=len(cases))
    return cases


# ----------------------------------------------------------------------------------------------------------------
# Report: summary table and plot
# ----------------------------------------------------------------------------------------------------------------


def _times(rows: Sequence[Result]) -> dict[tuple[str, str, str], Result]:
    """(scenario label, timing, impl) -> row, for the successful model rows."""
    out = {}
    for r in rows:
        parts = parse_shape(r.shape) if r.workload == "model" and r.status == "ok" else None
        if parts and math.isfinite(r.median_us):
            out[(r.shape.rsplit(" ", 1)[0], parts["how"], r.impl)] = r
    return out


def _fmt(value: float, fmt: str, suffix: str = "") -> str:
    return "-" if not math.isfinite(value) else f"{value:{fmt}}{suffix}"


def summary(rows: Sequence[Result]) -> list[str]:
    """Markdown: per scenario and timing, both times, tokens/s, the patched speed-up, peak memory, the FFN's share of
    the unpatched time, the FFN's own speed-up and the whole-model speed-up Amdahl's law allows from those two."""
    times = _times(rows)
    lines = []
    for (label, how, impl), r in times.items():
        patched = times.get((label, how, "patched"))
        if impl != "unpatched" or how.startswith("FFN") or patched is None:
            continue
        ffn_how = f"FFN-{how}" if (label, f"FFN-{how}", "unpatched") in times else "FFN"
        ffn_u, ffn_p = times.get((label, ffn_how, "unpatched")), times.get((label, ffn_how, "patched"))
        share = ffn_u.median_us / r.median_us if ffn_u else math.nan
        ffn_speedup = ffn_u.median_us / ffn_p.median_us if ffn_u and ffn_p else math.nan
        bound = 1 / (1 - share + share / ffn_speedup) if share < 1 else math.nan
        lines.append(
            f"| {label} | {how} | {r.median_us / 1e3:.3f} | {patched.median_us / 1e3:.3f} | "
            f"{r.median_us / patched.median_us:.2f}x | {r.tokens_per_s:.0f} | {patched.tokens_per_s:.0f} | "
            f"{_fmt(r.peak_mb, '.0f')} / {_fmt(patched.peak_mb, '.0f')} | {_fmt(100 * share, '.0f', '%')} | "
            f"{_fmt(ffn_speedup, '.2f', 'x')} | {_fmt(bound, '.2f', 'x')} |"
        )
    if not lines:
        return []
    return [
        "## Whole model: patched vs unpatched",
        "",
        "Speed-up: unpatched time / patched time. FFN share: every layer's MLP on its real input, unpatched, timed "
        "as that row is (`FFN` in one CUDA graph, `FFN-eager` as plain calls, `FFN-compile` compiled) / the "
        "unpatched whole-model time of that row. FFN speed-up: unpatched / patched FFN rows of that timing. "
        "Amdahl bound: "
        "1 / (1 - share + share / FFN speed-up), the whole-model speed-up that FFN speed-up allows. Peak MB: "
        "allocator high-water mark of one call above what was allocated before it (weights and KV cache excluded).",
        "",
        "| scenario | timing | unpatched ms | patched ms | speed-up | unpatched tok/s | patched tok/s | "
        "peak MB (u / p) | FFN share | FFN speed-up | Amdahl bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *lines,
        "",
    ]


def plot(rows: Sequence[Result], meta: dict[str, str], path: Path) -> bool:
    """One row of panels per (model, sparsity): tokens/s per prefill shape (bars) and against the decode batch
    (lines, log-log), unpatched and patched per timing method; one legend right of the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[str, str], dict[str, list[tuple[dict[str, str], Result]]]] = {}
    for r in rows:
        parts = parse_shape(r.shape) if r.status == "ok" and math.isfinite(r.tokens_per_s) else None
        if parts and not parts["how"].startswith("FFN"):
            groups.setdefault((parts["model"], parts["sparsity"]), {}).setdefault(parts["phase"], []).append((parts, r))
    if not groups:
        return False
    series = list(dict.fromkeys((p["how"], r.impl) for g in groups.values() for v in g.values() for p, r in v))
    palette = {"unpatched": "tab:gray", "patched": "tab:blue"}
    styles = {"eager": ("-", "o", 0.45), "graph": ("--", "s", 0.8), "compile": (":", "^", 1.0)}
    fig, axes = plt.subplots(len(groups), 2, figsize=(13, 3.8 * len(groups) + 1.0), squeeze=False)
    for (model, sparsity), (ax_p, ax_d) in zip(groups, axes):
        phases = groups[(model, sparsity)]
        prefill = phases.get("prefill", [])
        shapes = list(dict.fromkeys(f"B={p['batch']} S={p['seq']}" for p, _ in prefill))
        width = 0.84 / max(1, len(series))
        for j, (how, impl) in enumerate(series):
            values = {
                f"B={p['batch']} S={p['seq']}": r.tokens_per_s for p, r in prefill if (p["how"], r.impl) == (how, impl)
            }
            xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(shapes))]
            ax_p.bar(
                xs,
                [values.get(s, math.nan) for s in shapes],
                width,
                color=palette.get(impl, "tab:orange"),
                alpha=styles.get(how, ("-", "o", 1.0))[2],
                hatch="//" if how == "compile" else None,
                label=f"{impl}, {how}",
            )
        ax_p.set_xticks(range(len(shapes)), shapes, fontsize=8)
        ax_p.set_title(f"{model} {sparsity}: prefill", fontsize=9)
        ax_p.set_xlabel("prefill batch B x sequence S", fontsize=8)
        ax_p.set_ylabel("tokens/s (higher is better)", fontsize=8)
        for how, impl in series:
            points = sorted(
                (int(p["batch"]), r.tokens_per_s)
                for p, r in phases.get("decode", [])
                if (p["how"], r.impl) == (how, impl)
            )
            if points:
                line, marker, _ = styles.get(how, ("-", "o", 1.0))
                ax_d.plot(
                    *zip(*points),
                    linestyle=line,
                    marker=marker,
                    color=palette.get(impl, "tab:orange"),
                    label=f"{impl}, {how}",
                )
        for ax, phase in ((ax_p, "prefill"), (ax_d, "decode")):
            if not phases.get(phase):  # a set measured in parts can lack a phase: say so, draw no empty axes
                ax.text(0.5, 0.5, f"no {phase} rows in this set", ha="center", fontsize=9, transform=ax.transAxes)
                ax.set_axis_off()
        ax_d.set_xscale("log", base=2)
        ax_d.set_yscale("log")
        ax_d.set_title(f"{model} {sparsity}: one decode step, {CONTEXT} tokens of context", fontsize=9)
        ax_d.set_xlabel("decode batch (sequences, one new token each)", fontsize=8)
        ax_d.set_ylabel("tokens/s = batch / step time", fontsize=8)
        for ax in (ax_p, ax_d):
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
    handles: dict[str, Any] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="center right", fontsize=8, frameon=False, title="model, timing")
    subtitle = (
        f"{meta.get('GPU', '?')}, torch {meta.get('torch', '?')}, {meta.get('date', '')}, "
        f"commit {meta.get('commit', '?')}"
    )
    fig.suptitle(
        "Sparse ReLU Llama, whole model: patched (sparsefuse TwELL FFN) vs unpatched\n" + subtitle, fontsize=10
    )
    fig.tight_layout(rect=(0, 0, 0.83, 1 - 0.6 / fig.get_size_inches()[1]))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
