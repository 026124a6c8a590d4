"""The ``model`` benchmark workload without a GPU: its registration, its case lists (quick and full; listing builds
no model), that its unpatched and patched implementations compute the same logits on a tiny random ReLU Llama
(Triton interpreter, float32), and its summary table and plot from fake rows."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import sparsefuse.ffn.synthetic
import sparsefuse.integrations.transformers
from sparsefuse._backend import track_launches
from sparsefuse.bench import check, harness, report
from sparsefuse.bench import workloads as _workloads  # noqa: F401  (registers every workload)
from sparsefuse.bench.harness import Options, Result
from sparsefuse.bench.workloads import model as workload

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def tiny_llama(shape, *, mean_nnz=30.0, dtype=torch.float32, device="cpu", seed=0, **_):
    """Stand-in for sparsefuse.ffn.synthetic.synthetic_llama: a tiny random ReLU Llama."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        hidden_act="relu",
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def _never_built(*args, **kwargs):
    raise AssertionError("listing cases must not build a model")


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(sparsefuse.ffn.synthetic, "synthetic_llama", tiny_llama, raising=False)
    monkeypatch.setattr(workload, "CONTEXT", 6)
    monkeypatch.setattr(workload, "QUICK_PREFILL", [(2, 7)])
    monkeypatch.setattr(workload, "QUICK_DECODE_BATCHES", [1, 3])


def test_model_workload_is_registered():
    assert "model" in harness.resolve_workloads([])
    info = harness.WORKLOAD_INFO["model"]
    assert info.summary is not None and info.plot is not None
    # `check model` / GPU-less `bench model`: the FFN ops and the fused norm and rotary embedding patch_llama installs
    assert check.ops_for(["model"]) == [*check.ops_for(["ffn"]), "rms_norm fwd+bwd", "rotary fwd+bwd"]


@pytest.mark.parametrize("quick", [True, False])
def test_cases_are_listed_without_building_models(monkeypatch, quick):
    monkeypatch.setattr(sparsefuse.ffn.synthetic, "synthetic_llama", _never_built, raising=False)
    cases = harness.WORKLOADS["model"](Options(quick=quick, device="cpu"))
    hows = (
        ("eager", "graph", "FFN", "FFN-eager")
        if quick
        else ("eager", "graph", "compile", "FFN", "FFN-eager", "FFN-compile")
    )
    scenarios = 3 if quick else 2 * 2 * (3 + 3)  # (models x sparsities) x (prefill shapes + decode batches)
    assert len(cases) == scenarios * len(hows)
    parts = [workload.parse_shape(c.shape) for c in cases]
    assert all(parts) and [p["how"] for p in parts[: len(hows)]] == list(hows)
    assert {p["model"] for p in parts} == ({"SparseLM-1.5B"} if quick else {"SparseLM-1.5B", "8B"})
    assert {p["sparsity"] for p in parts} == ({"nnz=30"} if quick else {"nnz=30", "dense"})
    for case, p in zip(cases, parts):
        assert case.dtype == torch.bfloat16 and set(case.impls) == {"unpatched", "patched"}
        assert case.eager_impl == "unpatched" and case.compile_impl is None and not case.rotate
        assert case.method == ("eager" if p["how"] in ("eager", "compile", "FFN-eager", "FFN-compile") else "graph")
        assert case.tokens == int(p["batch"]) * (int(p["seq"]) if p["phase"] == "prefill" else 1)
    quick_shapes = {(p["phase"], p["batch"], p["seq"]) for p in parts}
    if quick:
        assert quick_shapes == {("prefill", "4", "2048"), ("decode", "1", None), ("decode", "8", None)}


def test_skipped_without_synthetic_llama(monkeypatch):
    monkeypatch.delattr(sparsefuse.ffn.synthetic, "synthetic_llama", raising=False)
    notes: list[str] = []
    assert harness.WORKLOADS["model"](Options(quick=True, device="cpu", log=notes.append)) == []
    assert notes and "synthetic_llama is unavailable" in notes[0]


@pytest.mark.parametrize("method", ["auto", "twell"])
def test_patched_and_unpatched_compute_the_same_logits(tiny, monkeypatch, method, device):
    """Every case's two implementations agree (tiny model, float32, the Triton interpreter for the patched FFN:
    the default method, and the TwELL kernels forced); a decode step is the last position of a forward over
    context + new token, and repeats identically (the cache is rewound)."""
    if method != "auto":
        patch = sparsefuse.integrations.transformers.patch_llama
        monkeypatch.setattr(
            sparsefuse.integrations.transformers, "patch_llama", lambda model: patch(model, method=method)
        )
    pairs: list[workload._ModelPair] = []
    make_pair = workload._ModelPair
    monkeypatch.setattr(
        workload,
        "_ModelPair",
        lambda build, text=None, liger=False: pairs.append(make_pair(build, text, liger)) or pairs[-1],
    )
    cases = harness.WORKLOADS["model"](Options(quick=True, device=str(device), dtypes=(torch.float32,)))
    assert len(cases) == 12 and all(c.dtype == torch.float32 for c in cases)
    for case in cases:
        inputs = case.make_inputs()
        with track_launches() as launched:
            out = {"patched": case.impls["patched"](*inputs)}
        out["unpatched"] = case.impls["unpatched"](*inputs)
        if method == "twell":
            assert launched, case.shape
        unpatched = out["unpatched"] if isinstance(out["unpatched"], list) else [out["unpatched"]]
        patched = out["patched"] if isinstance(out["patched"], list) else [out["patched"]]
        assert len(unpatched) == len(patched) >= 1
        for u, p in zip(unpatched, patched):
            torch.testing.assert_close(p, u, rtol=1e-4, atol=1e-4, msg=case.shape)
        parts = workload.parse_shape(case.shape)
        if parts["how"].startswith("FFN"):
            assert len(unpatched) == 2  # one output per layer
            continue
        batch = int(parts["batch"])
        assert unpatched[0].shape == (batch, 1, 97)
        if parts["phase"] == "decode" and parts["how"] == "eager":
            (state,) = inputs
            models = pairs[0].models
            again = state.step(models["patched"])
            torch.testing.assert_close(again, out["patched"], rtol=0, atol=0)
            full = torch.cat([state.context_ids, state.input_ids], dim=1)
            reference = workload.prefill_logits(models["unpatched"], full)
            torch.testing.assert_close(out["unpatched"], reference, rtol=1e-4, atol=1e-4)


def test_a_saved_model_is_benched_on_the_text_it_was_trained_on(tiny, tmp_path, device):
    """--checkpoint: the training example's file format ({"config", "state_dict"} of a patched model) is loaded
    into an unpatched Llama; its cases are labelled by the file's name and "learned"; a byte vocabulary is fed
    windows of the standard library's source; both implementations give the same logits."""
    model = tiny_llama("tiny")
    config = model.config.to_dict() | {"vocab_size": 256}
    patched = sparsefuse.integrations.transformers.patch_llama(
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    )
    path = tmp_path / "model-l1.pt"
    torch.save({"config": config, "state_dict": patched.state_dict()}, path)
    options = Options(quick=True, device=str(device), dtypes=(torch.float32,), checkpoint=str(path))
    cases = harness.WORKLOADS["model"](options)
    parts = [workload.parse_shape(c.shape) for c in cases]
    assert {(p["model"], p["sparsity"]) for p in parts} == {("model-l1", "learned")} and len(cases) == 12
    case = next(c for c, p in zip(cases, parts) if p["phase"] == "prefill" and p["how"] == "eager")
    (ids,) = case.make_inputs()
    text = workload.stdlib_text(16 << 20)
    row = bytes(ids[0].tolist())
    assert ids.shape == (2, 7) and row in text.numpy().tobytes()
    torch.testing.assert_close(case.impls["patched"](ids), case.impls["unpatched"](ids), rtol=1e-4, atol=1e-4)


def test_a_checkpoint_of_another_format_is_a_clear_error(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"weight": torch.ones(2)}, path)
    with pytest.raises(ValueError, match=r"--checkpoint .*weights\.pt.*'config' and 'state_dict'.*\['weight'\]"):
        harness.WORKLOADS["model"](Options(quick=True, device="cpu", checkpoint=str(path)))


def _fake_rows() -> list[Result]:
    rows = []
    for label, tokens in (("1.5B nnz=30 prefill B=4 S=2048", 8192), ("1.5B nnz=30 decode B=1", 1)):
        for how, (u, p) in {"eager": (1000.0, 800.0), "graph": (900.0, 600.0), "FFN": (600.0, 300.0)}.items():
            for impl, us in (("unpatched", u), ("patched", p)):
                rows.append(
                    Result(
                        "model",
                        f"{label} {how}",
                        "bfloat16",
                        "fwd",
                        impl,
                        method="graph",
                        median_us=us,
                        tokens_per_s=tokens / (us * 1e-6),
                        peak_mb=10.0,
                        eager_impl="unpatched",
                    )
                )
    harness.fill_relative_columns(rows)
    return rows


def test_summary_and_plot(tmp_path):
    rows = _fake_rows()
    assert rows[1].speedup_eager == pytest.approx(1000 / 800)
    assert report.format_row(rows[0])[7] == "8192000 tok/s"
    text = "\n".join(workload.summary(rows))
    # graph: share 600 / 900, FFN speed-up 2, Amdahl bound 1 / (1/3 + 1/3) = 1.5
    assert "| 1.5B nnz=30 prefill B=4 S=2048 | graph | 0.900 | 0.600 | 1.50x | 9102222 | 13653333 |" in text
    assert "| 67% | 2.00x | 1.50x |" in text and "| 60% | 2.00x |" in text
    meta = {"GPU": "Fake GPU", "torch": "2", "commit": "abc"}
    paths = report.write_set(rows, meta, tmp_path, "model-Fake")
    assert [p.suffix for p in paths] == [".csv", ".md", ".png"] and paths[2].stat().st_size > 0
    assert "## Whole model: patched vs unpatched" in paths[1].read_text()
    again = report.read_csv(paths[0])
    assert math.isclose(again[0].tokens_per_s, rows[0].tokens_per_s)


def test_a_set_measured_in_parts_is_plotted_and_rewritten_from_its_csv(tmp_path):
    """A set whose 8B rows have a prefill but no decode (measured in parts, merged) plots without empty axes, and
    rewriting it from its CSV keeps the workload's own summary and plot."""
    rows = _fake_rows()
    rows += [dataclasses.replace(r, shape=r.shape.replace("1.5B", "8B")) for r in rows if "prefill" in r.shape]
    meta = {"GPU": "Fake GPU", "torch": "2", "commit": "abc"}
    paths = report.write_set(rows, meta, tmp_path, "model-Fake")
    assert paths[2].stat().st_size > 0
    first = paths[1].read_text()
    assert report.rewrite_from_csv(paths[0]) == paths
    assert paths[1].read_text() == first and "## Whole model: patched vs unpatched" in first


def test_each_row_takes_the_ffn_rows_of_its_own_timing():
    """An `eager` row's FFN share and ratio come from the `FFN-eager` rows where they exist (the `FFN` rows, in one
    CUDA graph, otherwise); the `graph` row keeps the `FFN` rows."""
    rows = _fake_rows()
    label = "1.5B nnz=30 prefill B=4 S=2048"
    for impl, us in (("unpatched", 700.0), ("patched", 500.0)):
        rows.append(
            Result(
                "model",
                f"{label} FFN-eager",
                "bfloat16",
                "fwd",
                impl,
                method="eager",
                median_us=us,
                tokens_per_s=8192 / (us * 1e-6),
                peak_mb=10.0,
                eager_impl="unpatched",
            )  # fmt: skip
        )
    lines = [line for line in workload.summary(rows) if line.startswith(f"| {label} |")]
    eager = next(line for line in lines if "| eager |" in line)
    graph = next(line for line in lines if "| graph |" in line)
    assert eager.endswith("| 70% | 1.40x | 1.25x |")  # 700 / 1000; 700 / 500; 1 / (0.3 + 0.7 / 1.4)
    assert graph.endswith("| 67% | 2.00x | 1.50x |")
    assert not any("FFN-eager |" in line for line in lines)  # FFN rows are not rows of the table


def test_the_compiled_ffn_rows_compute_the_eager_ones(tiny, monkeypatch, device):
    """`FFN-compile`: every layer's MLP under torch.compile, patched and unpatched, gives the unpatched MLPs' eager
    outputs."""
    monkeypatch.setattr(workload, "QUICK_METHODS", ("eager", "compile"))
    cases = harness.WORKLOADS["model"](Options(quick=True, device=str(device), dtypes=(torch.float32,)))
    by_how = {}
    for case in cases:
        parts = workload.parse_shape(case.shape)
        if parts["phase"] == "prefill" and parts["how"].startswith("FFN"):
            by_how[parts["how"]] = case
    assert set(by_how) == {"FFN", "FFN-eager", "FFN-compile"} and by_how["FFN-compile"].method == "eager"
    inputs = by_how["FFN-compile"].make_inputs()
    unpatched = by_how["FFN-eager"].impls["unpatched"](*inputs)  # transformers' MLPs, eager
    for impl in ("unpatched", "patched"):
        for c, u in zip(by_how["FFN-compile"].impls[impl](*inputs), unpatched, strict=True):
            torch.testing.assert_close(c, u, rtol=1e-4, atol=1e-4, msg=impl)
