"""Benchmark output: the printed table, and one CSV / markdown / PNG set per workload, ``<workload>-<gpu>``.

Everything here is pure formatting over :class:`~sparsefuse.bench.harness.Result` rows and a metadata dict, so it
runs (and is tested) without a GPU. :func:`read_csv` and :func:`read_meta` load a written set back, so its markdown
and plot can be regenerated from the CSV (:func:`rewrite_from_csv`).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import math
import os
import re
import subprocess
import textwrap
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from .harness import WORKLOAD_INFO, Ceilings, Result, WorkloadInfo

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
    "write_set",
    "write_results",
    "auto_summary",
    "read_csv",
    "read_meta",
    "rewrite_from_csv",
]

TABLE_HEADERS = [
    "workload",
    "shape",
    "dtype",
    "dir",
    "impl",
    "method",
    "median us",
    "rate",
    "% ceil",
    "vs eager",
    "vs compile",
    "peak MB",
    "note",
]
# Every Result field except the two that only say which rows the speed-ups divide by.
_CSV_FIELDS = [f.name for f in dataclasses.fields(Result) if f.name not in ("eager_impl", "compile_impl")]
_CHOICE_SEPARATOR = ";"  # between the names in the auto_choices column


def sanitize(name: str) -> str:
    """A file-name-safe form: letters, digits, '.', '_' and '-' only (runs of anything else become one '-')."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "unknown"


def result_stem(gpu: str, workload: str, quick: bool = False) -> str:
    """File stem ``<workload>-<gpu>``, ``-quick`` appended for a --quick run so that a smoke run never overwrites a
    full run's files. One set per workload and GPU: a later full run of a workload replaces its set."""
    return f"{sanitize(workload)}-{sanitize(gpu)}" + ("-quick" if quick else "")


def git_commit() -> str:
    """$SPARSEFUSE_COMMIT, else ``git rev-parse --short HEAD`` of the source tree, else "unknown"."""
    if os.environ.get("SPARSEFUSE_COMMIT"):
        return os.environ["SPARSEFUSE_COMMIT"]
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
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
    elif math.isfinite(r.tokens_per_s) and not math.isfinite(r.tflops):
        rate = _num(r.tokens_per_s, ".0f", " tok/s")
    else:
        rate = _num(r.tflops, ".1f", " TFLOP/s")
    return [
        r.workload,
        r.shape,
        r.dtype,
        r.direction,
        r.impl,
        r.method or "-",
        _num(r.median_us, ".1f" if r.median_us < 1e5 else ".0f"),
        rate,
        _num(r.pct_ceiling, ".0f", "%"),
        _num(r.speedup_eager, ".2f", "x"),
        _num(r.speedup_compile, ".2f", "x"),
        _num(r.peak_mb, ".1f"),
        r.note if r.status == "ok" else r.status,
    ]


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
            row = {k: getattr(r, k) for k in _CSV_FIELDS}
            row["auto_choices"] = _CHOICE_SEPARATOR.join(r.auto_choices)
            writer.writerow(row)


def read_csv(path: str | Path) -> list[Result]:
    """Rows of a CSV written by :func:`write_csv` (columns it lacks keep their defaults)."""
    types = {f.name: f.type for f in dataclasses.fields(Result)}
    rows = []
    with Path(path).open(newline="") as f:
        for record in csv.DictReader(f):
            values: dict[str, Any] = {}
            for key, text in record.items():
                if key not in types or key in ("eager_impl", "compile_impl"):
                    continue
                kind = str(types[key])
                if key == "auto_choices":
                    values[key] = tuple(c for c in text.split(_CHOICE_SEPARATOR) if c)
                elif kind == "float":
                    values[key] = float(text) if text not in ("", "nan") else math.nan
                elif kind == "int":
                    values[key] = int(float(text)) if text else 0
                else:
                    values[key] = text
            rows.append(Result(**values))
    return rows


def read_meta(path: str | Path) -> dict[str, str]:
    """The ``| **key** | value |`` metadata table of a markdown report written by :func:`write_markdown`."""
    meta = {}
    for line in Path(path).read_text().splitlines():
        match = re.match(r"^\| \*\*(.+?)\*\* \| (.*) \|$", line)
        if match:
            meta[match.group(1)] = match.group(2).replace("\\|", "|")
    return meta


_METHOD_NOTE = (
    "Median time per call. `graph`: one CUDA graph replaying one call per rotated input set (inputs together "
    "exceed 2x L2; the graphs of a case replayed in rounds of varying order); `events`: plain calls (graph capture "
    "failed; Python launch overhead included); `eager`: plain back-to-back calls, on purpose (host overhead "
    "included); `queued`: the same calls each enqueued behind a sleep kernel, so that the host is ahead: the eager "
    "path's GPU time; `wall`: whole calls between synchronizations. Rates use the minimal bytes moved (each input read "
    "once, each output written once); `% ceil` is relative to the ceiling measured in the same run (above). "
    "Speed-ups divide the eager / torch.compile time of the same case by this row's time. How to read these "
    "files: docs/performance.md."
)


def auto_summary(rows: Sequence[Result]) -> list[str]:
    """Markdown lines: per row that picks its own method (``auto_choices``), its time against the fastest of the
    methods it picks among, timed in the same case. Empty when no row picks."""
    times: dict[tuple[str, str, str, str], dict[str, float]] = {}
    for r in rows:
        if r.status == "ok":
            times.setdefault((r.workload, r.shape, r.dtype, r.direction), {})[r.impl] = r.median_us
    lines = []
    for r in rows:
        case = times.get((r.workload, r.shape, r.dtype, r.direction), {})
        chosen = {c: case[c] for c in r.auto_choices if c in case}
        if r.status != "ok" or not chosen:
            continue
        best = min(chosen, key=chosen.get)
        lines.append(
            f"| {r.shape} | {r.dtype} | {r.impl} | {r.median_us:.1f} | {best} | {chosen[best]:.1f} | "
            f"{chosen[best] / r.median_us:.2f} |"
        )
    if not lines:
        return []
    ratios = [float(line.rsplit("|", 2)[1]) for line in lines]
    head = [
        "## Is auto's pick the fastest method?",
        "",
        f"{len(lines)} cases; auto's time within 10% of the fastest of its choices in "
        f"{sum(x >= 0.9 for x in ratios)}, worst {min(ratios):.2f}. Last column: fastest choice's time / auto's "
        "time (1.00: auto picked the fastest or ties with it; auto's small cost of deciding is included).",
        "",
        "| shape | dtype | auto row | auto us | fastest choice | its us | fastest / auto |",
        "|---|---|---|---|---|---|---|",
    ]
    return head + lines + [""]


def write_markdown(rows: Sequence[Result], meta: dict[str, str], path: Path, plot_name: str | None) -> None:
    workloads = list(dict.fromkeys(r.workload for r in rows))
    info = WORKLOAD_INFO.get(workloads[0]) if len(workloads) == 1 else None
    parts = [f"# sparsefuse benchmark: {', '.join(workloads) or '-'} on {meta.get('GPU', 'unknown GPU')}", ""]
    if info is not None:
        parts += [info.title + f" (shape: {info.shape}).", ""]
    parts.append(_markdown_table(["", ""], [[f"**{k}**", v] for k, v in meta.items()]))
    parts += ["", _METHOD_NOTE, ""]
    if plot_name:
        parts += [f"![{', '.join(workloads)}]({plot_name})", ""]
    parts += auto_summary(rows)
    if info is not None and info.summary is not None:
        parts += info.summary(rows)
    parts += [_markdown_table(TABLE_HEADERS, (format_row(r) for r in rows)), ""]
    path.write_text("\n".join(parts))


_SWEEP = re.compile(r"^(?P<series>.+) (?P<param>\w+)=(?P<value>\S+)$")  # e.g. "twell nnz=32": series "twell"


def _panel_prefix(shape: str) -> tuple[str, str]:
    """(panel, x label) of a shape label: a leading word that is not a size ("L0 sweep ...", "jumprelu ...",
    "snake ...") names a panel of its own; sizes ("1x64x236", "B=32 ...") share one."""
    first, _, rest = shape.partition(" ")
    if rest and "=" not in first and not first[:1].isdigit():
        if rest.startswith("sweep "):  # "L0 sweep B=32 ...": the panel is the L0 sweep
            return f"{first} sweep", rest.removeprefix("sweep ")
        return first, rest
    return "", shape


def _metric(group: Sequence[Result], meta: dict[str, str]) -> tuple[Callable[[Result], float], str, float | None, str]:
    """(value of a row, y label, ceiling line or None, its label) for one panel: the rate against the ceiling
    measured in the run where the minimal cost bounds every row; else (a sparse op beats the dense bytes / FLOPs
    count) the speed-up over the case's eager row; else the time."""
    ceiling, copy = group[0].ceiling, _leading_number(meta.get("copy ceiling", ""))
    matmul = _leading_number(meta.get("matmul ceiling", ""))
    if (
        ceiling == "copy"
        and all(math.isfinite(r.gbps) for r in group)
        and max(r.gbps for r in group) <= 1.1 * (copy or math.inf)
    ):
        return (
            (lambda r: r.gbps),
            "GB/s: minimal bytes moved / time (higher is better)",
            copy,
            "copy ceiling (measured in this run)",
        )
    if (
        ceiling == "matmul"
        and all(math.isfinite(r.tflops) for r in group)
        and max(r.tflops for r in group) <= 1.1 * (matmul or math.inf)
    ):
        return (
            (lambda r: r.tflops),
            "TFLOP/s: minimal FLOPs / time (higher is better)",
            matmul,
            "bf16 matmul ceiling (measured in this run)",
        )
    eager = {(r.shape, r.dtype, r.direction): r.median_us for r in group if r.impl == (r.eager_impl or "eager")}
    if len(eager) == len({(r.shape, r.dtype, r.direction) for r in group}):
        return (
            (lambda r: eager[(r.shape, r.dtype, r.direction)] / r.median_us),
            "speed-up over eager (eager time / time), log scale",
            None,
            "",
        )
    return (lambda r: r.median_us), "microseconds per call (lower is better)", None, ""


def _panels(rows: Sequence[Result]) -> dict[tuple[str, ...], list[Result]]:
    """Rows grouped into panels: per (dtype, direction, panel prefix); a workload whose implementations form a sweep
    ("<method> <param>=<value>") gets one panel per shape, with the sweep parameter on the x axis."""
    sweep = any(_SWEEP.match(r.impl) for r in rows)
    panels: dict[tuple[str, ...], list[Result]] = {}
    for r in rows:
        if r.status != "ok" or not math.isfinite(r.median_us):
            continue
        prefix = r.shape if sweep else _panel_prefix(r.shape)[0]
        panels.setdefault((r.workload, r.dtype, r.direction, prefix), []).append(r)
    return panels


def _draw_bars(ax: Any, group: Sequence[Result], meta: dict[str, str], color: Callable[[str], Any]) -> str:
    value, ylabel, ceiling, ceiling_label = _metric(group, meta)
    shapes = list(dict.fromkeys(_panel_prefix(r.shape)[1] for r in group))
    impls = list(dict.fromkeys(r.impl for r in group))
    width = 0.84 / len(impls)
    for j, impl in enumerate(impls):
        values = {_panel_prefix(r.shape)[1]: value(r) for r in group if r.impl == impl}
        xs = [i + (j - (len(impls) - 1) / 2) * width for i in range(len(shapes))]
        ax.bar(xs, [values.get(s, math.nan) for s in shapes], width, label=impl, color=color(impl))
    if ceiling:
        ax.axhline(ceiling, color="black", linestyle="--", linewidth=1, label=ceiling_label)
    if max(map(len, shapes)) > 18:  # long labels (many sizes): wrapped, so neighbours and panels never overlap
        ax.set_xticks(range(len(shapes)), [textwrap.fill(t, 16) for t in shapes], fontsize=6.5)
    else:
        ax.set_xticks(range(len(shapes)), shapes, rotation=20 if len(shapes) > 2 else 0, ha="right", fontsize=7)
    if ylabel.startswith("speed-up"):
        ax.set_yscale("log")
        ax.axhline(1.0, color="black", linewidth=0.8)
    elif ylabel.startswith("micro"):
        times = [value(r) for r in group]
        if max(times) > 30 * min(times):
            ax.set_yscale("log")
            ylabel = "microseconds per call, log scale (lower is better)"
    return ylabel


def _draw_sweep(ax: Any, group: Sequence[Result], color: Callable[[str], Any]) -> tuple[str, str]:
    """Bars per sweep method at each parameter value, as speed-up over the case's eager row; the other rows
    (eager, torch.compile, yardsticks) as horizontal lines."""
    times = {r.impl: r.median_us for r in group}
    eager = times.get(group[0].eager_impl or "eager") or times.get("eager")
    if not eager:  # a set read back from its CSV names no eager row: its time is any row's time x its speed-up
        refs = [r.median_us * r.speedup_eager for r in group if math.isfinite(r.speedup_eager) and r.speedup_eager > 0]
        eager = refs[0] if refs else max(times.values())
    series: dict[str, dict[str, float]] = {}
    param = ""
    for impl, t in times.items():
        match = _SWEEP.match(impl)
        if match:
            param = match.group("param")
            series.setdefault(match.group("series"), {})[match.group("value")] = eager / t
    # numbers in numeric order first, then labels (e.g. nnz=30, nnz=half) in text order
    values = sorted(
        {v for points in series.values() for v in points},
        key=lambda v: (0, float(v), "") if _is_number(v) else (1, 0.0, v),
    )
    width = 0.84 / max(1, len(series))
    for j, (name, points) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(values))]
        ax.bar(xs, [points.get(v, math.nan) for v in values], width, label=name, color=color(name))
    styles = ["--", ":", "-.", (0, (5, 1))]
    for k, impl in enumerate(i for i in times if not _SWEEP.match(i)):
        ax.axhline(eager / times[impl], color=color(impl), linestyle=styles[k % len(styles)], linewidth=1.2, label=impl)
    ax.set_yscale("log")
    ax.set_xticks(range(len(values)), values, fontsize=8)
    return f"mean {param} per token" if param == "nnz" else param, "speed-up over eager (eager time / time), log"


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def write_plot(rows: Sequence[Result], meta: dict[str, str], path: Path) -> bool:
    """One figure per file: a panel per (dtype, direction, group of shapes), bars per implementation, the measured
    ceiling as a dashed line, one legend below the panels. Returns False if matplotlib is missing or nothing
    succeeded."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    custom = {WORKLOAD_INFO[r.workload].plot for r in rows if r.workload in WORKLOAD_INFO}
    if len(custom) == 1 and None not in custom:  # one workload that draws its own plot
        return custom.pop()(rows, meta, path)
    panels = _panels(rows)
    if not panels:
        return False
    workloads = list(dict.fromkeys(key[0] for key in panels))
    info = (
        WORKLOAD_INFO.get(workloads[0], WorkloadInfo(workloads[0]))
        if len(workloads) == 1
        else WorkloadInfo(", ".join(workloads))
    )
    palette = plt.get_cmap("tab20").colors
    colors: dict[str, Any] = {}

    def color(name: str) -> Any:
        return colors.setdefault(name, palette[(2 * len(colors) + len(colors) // 10) % len(palette)])

    bars = max(len({r.shape for r in g}) * len({r.impl for r in g}) for g in panels.values())
    ncols = 1 if bars > 40 or len(panels) == 1 else min(3 if len(panels) >= 6 else 2, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    panel_width = min(22.0, max(6.5, 0.16 * bars + 2)) if ncols == 1 else 6.5
    fig, axes = plt.subplots(nrows, ncols, figsize=(panel_width * ncols, 3.9 * nrows + 1.6), squeeze=False)
    for ax, ((_workload, dtype, direction, prefix), group) in zip(axes.flat, panels.items()):
        if any(_SWEEP.match(r.impl) for r in group):
            xlabel, ylabel = _draw_sweep(ax, group, color)
            ax.set_title(f"{prefix}  {dtype}  {direction}", fontsize=9)
        else:
            ylabel = _draw_bars(ax, group, meta, color)
            xlabel = info.shape
            ax.set_title("  ".join(p for p in (prefix, dtype, direction) if p), fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    handles: dict[str, Any] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    width = fig.get_size_inches()[0]
    column_inches = 0.07 * max(map(len, handles)) + 0.6  # fontsize 8 text plus the marker
    legend_cols = max(1, min(len(handles), int(width / column_inches)))
    legend_rows = math.ceil(len(handles) / max(1, legend_cols))
    height = fig.get_size_inches()[1]
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncols=legend_cols, fontsize=8, frameon=False)
    subtitle = (
        f"{meta.get('GPU', '?')}, torch {meta.get('torch', '?')}, triton {meta.get('triton', '?')}, "
        f"{meta.get('date', '')}"
    )
    fig.suptitle(f"{info.title}\n{subtitle}", fontsize=10)
    fig.tight_layout(rect=(0, (0.3 * legend_rows + 0.2) / height, 1, 1 - 0.7 / height))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _leading_number(text: str) -> float | None:
    match = re.match(r"\s*([0-9.]+)", text)
    return float(match.group(1)) if match else None


def write_set(
    rows: Sequence[Result], meta: dict[str, str], out_dir: str | Path, stem: str, plot: bool = True
) -> list[Path]:
    """Write <stem>.csv, <stem>.md and (unless plot=False, or without matplotlib) <stem>.png; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, md, png = out / f"{stem}.csv", out / f"{stem}.md", out / f"{stem}.png"
    write_csv(rows, csv_path)
    plotted = plot and write_plot(rows, meta, png)
    write_markdown(rows, meta, md, png.name if plotted else None)
    return [csv_path, md] + ([png] if plotted else [])


def merge_rows(old: Sequence[Result], new: Sequence[Result], old_commit: str | None = None) -> list[Result]:
    """``old`` with every row that ``new`` re-measured (same shape, dtype, direction and implementation) replaced
    in place, then ``new``'s other rows appended. ``old_commit``: the commit the old rows were measured at, noted on
    each old row kept (the set's header then names the new run's commit)."""
    key = lambda r: (r.workload, r.shape, r.dtype, r.direction, r.impl)  # noqa: E731
    fresh = {key(r): r for r in new}
    merged = []
    for r in old:
        if key(r) in fresh:
            merged.append(fresh.pop(key(r)))
            continue
        if old_commit and "measured at commit" not in r.note:
            r = dataclasses.replace(r, note=f"{r.note}; measured at commit {old_commit}".lstrip("; "))
        merged.append(r)
    return merged + [r for r in new if key(r) in fresh]


def write_results(
    rows: Sequence[Result],
    meta: dict[str, str],
    out_dir: str | Path,
    quick: bool = False,
    plot: bool = True,
    merge: bool = False,
) -> list[Path]:
    """One set per workload in the rows, named :func:`result_stem` (``<workload>-<gpu>[-quick]``). ``merge``: rows
    of a set already in ``out_dir`` that these rows do not re-measure are kept (:func:`merge_rows`), each noting
    the commit it was measured at; the metadata (commit, date) is this run's."""
    by_workload: dict[str, list[Result]] = {}
    for r in rows:
        by_workload.setdefault(r.workload, []).append(r)
    gpu = meta.get("GPU", "unknown")
    paths = []
    for workload, group in by_workload.items():
        stem = result_stem(gpu, workload, quick)
        existing = Path(out_dir) / f"{stem}.csv"
        if merge and existing.exists():
            md = existing.with_suffix(".md")
            old_commit = read_meta(md).get("commit") if md.exists() else None
            keep_commit = old_commit if old_commit and old_commit != meta.get("commit") else None
            group = merge_rows(read_csv(existing), group, keep_commit)
        paths += write_set(group, meta, out_dir, stem, plot)
    return paths


def rewrite_from_csv(csv_path: str | Path, plot: bool = True) -> list[Path]:
    """Regenerate the markdown and plot of a written set from its CSV (metadata from its markdown), with its
    workload's own summary and plot."""
    from . import workloads  # noqa: F401  (imports every workload module, which registers its summary and plot)

    csv_path = Path(csv_path)
    meta = read_meta(csv_path.with_suffix(".md"))
    return write_set(read_csv(csv_path), meta, csv_path.parent, csv_path.stem, plot)
