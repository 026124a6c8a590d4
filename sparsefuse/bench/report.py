"""Benchmark output: the printed table, and CSV / markdown / PNG files named after the GPU.

Everything here is pure formatting over :class:`~sparsefuse.bench.harness.Result` rows and a metadata dict, so it
runs (and is tested) without a GPU.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import math
import os
import re
import subprocess
from pathlib import Path
from typing import Any, Iterable, Sequence

from .harness import Ceilings, Result

__all__ = [
    "TABLE_HEADERS",
    "sanitize",
    "result_stem",
    "git_commit",
    "environment",
    "format_ceilings",
    "format_row",
    "make_console",
    "print_table",
    "write_csv",
    "write_markdown",
    "write_plot",
    "write_results",
]

TABLE_HEADERS = [
    "workload", "shape", "dtype", "dir", "impl", "method", "median us", "rate", "% ceil",
    "vs eager", "vs compile", "peak MB", "note",
]  # fmt: skip
# Every Result field except the two that only say which rows the speed-ups divide by.
_CSV_FIELDS = [f.name for f in dataclasses.fields(Result) if f.name not in ("eager_impl", "compile_impl")]


def sanitize(name: str) -> str:
    """A file-name-safe form: letters, digits, '.', '_' and '-' only (runs of anything else become one '-')."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "unknown"


def result_stem(gpu: str, workloads: Sequence[str] = (), quick: bool = False) -> str:
    """File stem ``bench-<gpu>``; a run of selected workloads appends their names and a --quick run "-quick", so
    that partial or smoke runs never overwrite a full run's files."""
    stem = f"bench-{sanitize(gpu)}"
    if workloads:
        stem += "-" + sanitize("_".join(workloads))
    return stem + ("-quick" if quick else "")


def git_commit() -> str:
    """$SPARSEFUSE_COMMIT, else ``git rev-parse --short HEAD`` of the source tree, else "unknown"."""
    if os.environ.get("SPARSEFUSE_COMMIT"):
        return os.environ["SPARSEFUSE_COMMIT"]
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
        return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(ceilings: Ceilings, gpu: str, l2_bytes: int) -> dict[str, str]:
    """Metadata for the report header (versions, commit, date, measured ceilings)."""
    import torch
    import triton

    import sparsefuse

    return {
        "GPU": gpu,
        "L2 cache": f"{l2_bytes / 1e6:.0f} MB",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "CUDA": str(torch.version.cuda),
        "sparsefuse": sparsefuse.__version__,
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        **format_ceilings(ceilings),
    }


def format_ceilings(ceilings: Ceilings) -> dict[str, str]:
    return {
        "copy ceiling": f"{ceilings.copy_bytes_per_s / 1e9:.0f} GB/s (device-to-device copy, read + write)",
        "matmul ceiling": f"{ceilings.matmul_flops_per_s / 1e12:.0f} TFLOP/s (bf16 8192^3 torch.matmul)",
    }


def _num(value: float, fmt: str, suffix: str = "") -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:{fmt}}{suffix}"


def format_row(r: Result) -> list[str]:
    """One table row (strings, in TABLE_HEADERS order)."""
    if r.ceiling == "matmul" and math.isfinite(r.tflops):
        rate = _num(r.tflops, ".1f", " TFLOP/s")
    elif math.isfinite(r.gbps):
        rate = _num(r.gbps, ".0f", " GB/s")
    else:
        rate = _num(r.tflops, ".1f", " TFLOP/s")
    return [
        r.workload, r.shape, r.dtype, r.direction, r.impl, r.method or "-",
        _num(r.median_us, ".1f" if r.median_us < 1e5 else ".0f"), rate, _num(r.pct_ceiling, ".0f", "%"),
        _num(r.speedup_eager, ".2f", "x"), _num(r.speedup_compile, ".2f", "x"), _num(r.peak_mb, ".1f"),
        "" if r.status == "ok" else r.status,
    ]  # fmt: skip


def make_console() -> Any:
    """A rich Console; 200 columns wide when output is not a terminal (logs, captured output), where rich would
    otherwise fold the table into 80 columns. Raises ImportError without rich."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=200)


def print_table(rows: Sequence[Result], meta: dict[str, str], console: Any = None) -> None:
    """Print the ceilings and the result table (a rich table when rich is installed)."""
    body = [format_row(r) for r in rows]
    try:
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        for key in ("copy ceiling", "matmul ceiling"):
            print(f"{key}: {meta.get(key, '-')}")
        print(_plain_table(TABLE_HEADERS, body))
        return
    console = console or make_console()
    for key in ("GPU", "copy ceiling", "matmul ceiling"):
        console.print(Text(f"{key}: {meta.get(key, '-')}"))
    table = Table(show_lines=False, header_style="bold")
    for i, head in enumerate(TABLE_HEADERS):
        last = i == len(TABLE_HEADERS) - 1
        table.add_column(head, justify="right" if 6 <= i <= 11 else "left", no_wrap=not last, overflow="fold")
    previous: tuple[str, ...] | None = None
    for r, cells in zip(rows, body):
        key = (r.workload, r.shape, r.dtype, r.direction)
        if previous is not None and key != previous:
            table.add_section()  # a rule between cases
        previous = key
        table.add_row(*(Text(c) for c in cells))  # Text: error messages may contain [markup-like] brackets
    console.print(table)


def _plain_table(headers: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in body]
    return "\n".join(lines)


def _markdown_table(headers: Sequence[str], body: Iterable[Sequence[str]]) -> str:
    def esc(cell: str) -> str:
        return cell.replace("|", "\\|")

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def write_csv(rows: Sequence[Result], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=_CSV_FIELDS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: getattr(r, k) for k in _CSV_FIELDS})


def write_markdown(rows: Sequence[Result], meta: dict[str, str], path: Path, plot_name: str | None) -> None:
    parts = [f"# sparsefuse benchmark: {meta.get('GPU', 'unknown GPU')}", ""]
    parts.append(_markdown_table(["", ""], [[f"**{k}**", v] for k, v in meta.items()]))
    parts += [
        "",
        "Median time per call. `graph`: one CUDA graph replaying one call per rotated input set (inputs together "
        "exceed 2x L2); `events`: plain calls (graph capture failed; Python launch overhead included); `wall`: "
        "whole calls between synchronizations. Rates use the minimal bytes moved (each input read once, each "
        "output written once); `% ceil` is relative to the measured ceiling above. Speed-ups divide the eager / "
        "torch.compile time of the same case by this row's time.",
        "",
        _markdown_table(TABLE_HEADERS, (format_row(r) for r in rows)),
        "",
    ]
    if plot_name:
        parts += [f"![throughput]({plot_name})", ""]
    path.write_text("\n".join(parts))


def write_plot(rows: Sequence[Result], meta: dict[str, str], path: Path) -> bool:
    """Grouped bars per shape and implementation, one panel per (workload, dtype, direction). Returns False if
    matplotlib is missing or there is nothing to plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels: dict[tuple[str, str, str], list[Result]] = {}
    for r in rows:
        if r.status == "ok":
            panels.setdefault((r.workload, r.dtype, r.direction), []).append(r)
    if not panels:
        return False
    ncols = min(2, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(8 * ncols, 3.6 * nrows), squeeze=False)
    copy_gbps = _leading_number(meta.get("copy ceiling", ""))
    for ax, ((workload, dtype, direction), group) in zip(axes.flat, panels.items()):
        if any(math.isfinite(r.gbps) for r in group):
            metric, label = (lambda r: r.gbps), "GB/s"
        elif any(math.isfinite(r.tflops) for r in group):
            metric, label = (lambda r: r.tflops), "TFLOP/s"
        else:
            metric, label = (lambda r: r.median_us / 1e3), "ms per call (lower is better)"
        shapes = list(dict.fromkeys(r.shape for r in group))
        impls = list(dict.fromkeys(r.impl for r in group))
        width = 0.8 / len(impls)
        for j, impl in enumerate(impls):
            values = {r.shape: metric(r) for r in group if r.impl == impl}
            xs = [i + (j - (len(impls) - 1) / 2) * width for i in range(len(shapes))]
            ax.bar(xs, [values.get(s, math.nan) for s in shapes], width, label=impl)
        if label == "GB/s" and copy_gbps:
            ax.axhline(copy_gbps, color="black", linestyle="--", linewidth=1, label="copy ceiling")
        ax.set_xticks(range(len(shapes)), shapes, rotation=20, fontsize=8)
        ax.set_ylabel(label)
        ax.set_title(f"{workload}  {dtype}  {direction}", fontsize=10)
        ax.legend(fontsize=7, ncols=2)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"sparsefuse on {meta.get('GPU', '?')}  (torch {meta.get('torch', '?')}, {meta.get('date', '')})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _leading_number(text: str) -> float | None:
    match = re.match(r"\s*([0-9.]+)", text)
    return float(match.group(1)) if match else None


def write_results(
    rows: Sequence[Result], meta: dict[str, str], out_dir: str | Path, stem: str, plot: bool = True
) -> list[Path]:
    """Write <stem>.csv, <stem>.md and (unless plot=False) <stem>.png into out_dir; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / f"{stem}.csv"]
    write_csv(rows, written[0])
    png = out / f"{stem}.png"
    plotted = plot and write_plot(rows, meta, png)
    if plotted:
        written.append(png)
    md = out / f"{stem}.md"
    write_markdown(rows, meta, md, png.name if plotted else None)
    written.insert(1, md)
    return written
