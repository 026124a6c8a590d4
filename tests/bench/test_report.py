"""The benchmark report: row formatting, speed-ups against eager and compile, the ceilings' names, the result files
(CSV, markdown, the auto-pick column and summary) and the merge of a partial run into the committed set."""

from __future__ import annotations

import csv
import dataclasses
import math

import pytest

from sparsefuse.bench import harness, report
from sparsefuse.bench import workloads as _workloads  # noqa: F401  (registers every workload: their titles)
from sparsefuse.bench.harness import Ceilings, Result


def _fake_rows() -> list[Result]:
    rows = []
    for shape, scale in (("1x64x1000", 1.0), ("8x512x16384", 10.0)):
        for impl, us in (("sparsefuse", 10.0), ("eager", 30.0), ("torch.compile", 15.0)):
            rows.append(
                Result(
                    "snake",
                    shape,
                    "bfloat16",
                    "fwd",
                    impl,
                    method="graph",
                    sets=4,
                    median_us=us * scale,
                    gbps=1000.0 / us,
                    ceiling="copy",
                    pct_ceiling=33.3,
                    peak_mb=1.5,
                    bytes_moved=100,
                    eager_impl="eager",
                    compile_impl="torch.compile",
                )
            )
    rows.append(
        Result(
            "snake",
            "8x512x16384",
            "bfloat16",
            "fwd",
            "SNAC TorchScript snake",
            status="OutOfMemoryError: out of memory",
        )
    )
    rows.append(
        Result(
            "snac",
            "decode L=59 (5.0 s)",
            "float32",
            "fwd",
            "eager (snac)",
            method="wall",
            median_us=20_000.0,
            eager_impl="eager (snac)",
        )
    )
    rows.append(
        Result(
            "snac",
            "decode L=59 (5.0 s)",
            "float32",
            "fwd",
            "sparsefuse (patched)",
            method="wall",
            median_us=12_000.0,
            eager_impl="eager (snac)",
        )
    )
    harness.fill_relative_columns(rows)
    return rows


def test_format_row_and_speedups():
    rows = _fake_rows()
    row = report.format_row(rows[0])
    assert len(row) == len(report.TABLE_HEADERS)
    assert row[4:9] == ["sparsefuse", "graph", "10.0", "100 GB/s", "33%"]
    assert row[9:11] == ["3.00x", "1.50x"]
    failed = report.format_row(rows[6])
    assert failed[6] == "-" and failed[-1].startswith("OutOfMemoryError")
    patched = rows[-1]
    assert patched.speedup_eager == pytest.approx(20_000 / 12_000) and math.isnan(patched.speedup_compile)


def test_names_and_ceilings():
    assert report.sanitize("NVIDIA H100 80GB HBM3") == "NVIDIA-H100-80GB-HBM3"
    assert report.sanitize("a/b:c (d)") == "a-b-c-d"
    assert report.result_stem("NVIDIA H200", "snake") == "snake-NVIDIA-H200"
    assert report.result_stem("NVIDIA H200", "sae_decode", quick=True) == "sae_decode-NVIDIA-H200-quick"
    text = report.format_ceilings(Ceilings(3.0e12, 7.5e14))
    assert text["copy ceiling"].startswith("3000 GB/s") and text["matmul ceiling"].startswith("750 TFLOP/s")


def test_write_results(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEFUSE_COMMIT", "abc1234")
    meta = report.environment(Ceilings(3.0e12, 7.5e14), "NVIDIA H100 80GB HBM3", 50 * 10**6)
    assert meta["commit"] == "abc1234"
    rows = _fake_rows()
    paths = report.write_results(rows, meta, tmp_path / "out")
    names = sorted(p.name for p in paths)
    assert names == [f"{w}-NVIDIA-H100-80GB-HBM3.{ext}" for w in ("snac", "snake") for ext in ("csv", "md", "png")]
    for p in paths:
        assert p.stat().st_size > 0
        assert all(c.isalnum() or c in "._-" for c in p.name)
    with (tmp_path / "out" / "snake-NVIDIA-H100-80GB-HBM3.csv").open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == 7 and table[0]["impl"] == "sparsefuse" and float(table[0]["speedup_eager"]) == 3.0
    md = (tmp_path / "out" / "snake-NVIDIA-H100-80GB-HBM3.md").read_text()
    for key in ("GPU", "torch", "triton", "CUDA", "commit", "date", "copy ceiling", "matmul ceiling", "abc1234"):
        assert key in md
    assert "Snake activation" in md and "](snake-NVIDIA-H100-80GB-HBM3.png)" in md
    no_plot = report.write_results(rows, meta, tmp_path / "np", plot=False)
    assert sorted(p.suffix for p in no_plot) == [".csv", ".csv", ".md", ".md"]
    report.print_table(rows, meta)  # rich (or plain) rendering must not choke on brackets in notes
    # a set reads back and regenerates
    again = report.read_csv(tmp_path / "out" / "snake-NVIDIA-H100-80GB-HBM3.csv")
    assert [(r.impl, r.median_us, r.status) for r in again] == [
        (r.impl, r.median_us, r.status) for r in rows if r.workload == "snake"
    ] or math.isnan(again[-1].median_us)
    assert report.read_meta(tmp_path / "out" / "snake-NVIDIA-H100-80GB-HBM3.md")["commit"] == "abc1234"
    assert len(report.rewrite_from_csv(tmp_path / "out" / "snake-NVIDIA-H100-80GB-HBM3.csv")) == 3


def test_auto_pick_column_and_summary(tmp_path):
    """An auto row is compared with the fastest of the methods it picks among, timed in the same case; a sweep
    workload ("<method> nnz=S") plots as speed-ups per sweep value."""
    rows = []
    for nnz, times in ((8, {"twell": 50.0, "block": 80.0, "auto": 52.0}), (512, {"twell": 400.0, "auto": 110.0})):
        for method, us in times.items():
            choices = tuple(f"{m} nnz={nnz}" for m in times if m != "auto") + ("eager",) if method == "auto" else ()
            rows.append(
                Result(
                    "ffn",
                    "M=16 K=64 N=128",
                    "bfloat16",
                    "fwd",
                    f"{method} nnz={nnz}",
                    method="graph",
                    median_us=us,
                    eager_impl="eager",
                    auto_choices=choices,
                )
            )
    rows.append(
        Result(
            "ffn", "M=16 K=64 N=128", "bfloat16", "fwd", "eager", method="graph", median_us=100.0, eager_impl="eager"
        )
    )
    harness.fill_relative_columns(rows)
    by_impl = {r.impl: r for r in rows}
    assert by_impl["auto nnz=8"].auto_vs_best == pytest.approx(50 / 52)
    assert by_impl["auto nnz=512"].auto_vs_best == pytest.approx(100 / 110)
    assert math.isnan(by_impl["twell nnz=8"].auto_vs_best)
    summary = "\n".join(report.auto_summary(rows))
    assert "2 cases" in summary and "| auto nnz=512 | 110.0 | eager | 100.0 | 0.91 |" in summary
    meta = {"GPU": "Fake", "copy ceiling": "1000 GB/s", "matmul ceiling": "100 TFLOP/s"}
    paths = report.write_set(rows, meta, tmp_path, "ffn-Fake")
    assert [p.suffix for p in paths] == [".csv", ".md", ".png"]
    assert report.read_csv(paths[0])[2].auto_choices == ("twell nnz=8", "block nnz=8", "eager")


def test_merge_keeps_rows_not_remeasured_and_replaces_the_others(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEFUSE_COMMIT", "abc1234")
    meta = report.environment(Ceilings(3.0e12, 7.5e14), "NVIDIA H100 80GB HBM3", 50 * 10**6)
    rows = [r for r in _fake_rows() if r.workload == "snake"]
    report.write_results(rows, meta, tmp_path, plot=False)
    remeasured = dataclasses.replace(rows[0], median_us=1.0)
    added = dataclasses.replace(rows[0], shape="2x2x2")
    report.write_results([remeasured, added], meta, tmp_path, plot=False, merge=True)
    merged = report.read_csv(tmp_path / "snake-NVIDIA-H100-80GB-HBM3.csv")
    assert len(merged) == len(rows) + 1
    assert merged[0].median_us == 1.0 and merged[-1].shape == "2x2x2"
    assert [r.median_us for r in merged[1 : len(rows)]] == [r.median_us for r in rows[1:]] or any(
        math.isnan(r.median_us) for r in merged
    )
    assert all("measured at commit" not in r.note for r in merged)  # the same commit: nothing to tell apart
    # a later commit's run: the rows it did not re-measure say which commit they come from
    later = {**meta, "commit": "def5678"}
    report.write_results([dataclasses.replace(rows[0], median_us=2.0)], later, tmp_path, plot=False, merge=True)
    merged = report.read_csv(tmp_path / "snake-NVIDIA-H100-80GB-HBM3.csv")
    assert "measured at commit" not in merged[0].note
    assert all(r.note.endswith("measured at commit abc1234") for r in merged[1:])
    report.write_results([remeasured], meta, tmp_path, plot=False)  # without merge the set is replaced
    assert len(report.read_csv(tmp_path / "snake-NVIDIA-H100-80GB-HBM3.csv")) == 1
