"""Command line: ``python -m sparsefuse bench|check`` (also installed as the ``sparsefuse`` script).

    python -m sparsefuse bench [WORKLOAD ...] [--quick] [--dtype float32,float16,bfloat16] [--out DIR] [--no-plot]
    python -m sparsefuse check [WORKLOAD ...] [--device cpu|cuda] [--size small|full] [--dtype ...] [--seed N]

Without a GPU, ``bench`` runs ``check`` on the ops of the named workloads instead (correctness only, no timings),
and refuses the options only a timed run reads (``--out``, ``--no-plot``, ``--shapes``, ``--checkpoint``,
``--merge``) rather than ignore them.

Without a CUDA device both commands run the real Triton kernels through Triton's CPU interpreter. Triton decides
whether kernels are interpreted when sparsefuse is imported, and ``python -m sparsefuse`` has imported the package
before this module runs, so the command re-executes itself once with ``TRITON_INTERPRET=1`` in its environment.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
DEFAULT_OUT = "benchmarks/results"
# bench options that only the timed run on a GPU reads: without one, bench runs `check` instead (no timings, no files)
_GPU_ONLY_BENCH_OPTIONS = {
    "out": "--out",
    "no_plot": "--no-plot",
    "shapes": "--shapes",
    "checkpoint": "--checkpoint",
    "merge": "--merge",
}
_REEXEC_MARK = "_SPARSEFUSE_REEXECUTED"  # guards against a re-exec loop if the interpreter flag is not honoured


def parse_dtypes(text: str) -> tuple[torch.dtype, ...]:
    """``"float32,bf16"`` -> (torch.float32, torch.bfloat16); ValueError naming the accepted spellings."""
    dtypes = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        if part not in _DTYPE_ALIASES:
            raise ValueError(f"unknown dtype {part!r}; use a comma-separated list of {', '.join(_DTYPE_ALIASES)}")
        dtypes.append(_DTYPE_ALIASES[part])
    if not dtypes:
        raise ValueError("--dtype needs at least one dtype")
    return tuple(dict.fromkeys(dtypes))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sparsefuse", description="sparsefuse benchmarks and checks")
    sub = parser.add_subparsers(dest="command", metavar="{bench,check}")

    bench = sub.add_parser("bench", help="time sparsefuse against eager, torch.compile and seed baselines (GPU)")
    from .bench.harness import resolve_workloads

    bench.add_argument(
        "workloads",
        nargs="*",
        metavar="WORKLOAD",
        help=f"workloads to run, default all: {', '.join(resolve_workloads([]))}",
    )
    bench.add_argument("--quick", action="store_true", help="fewer shapes and repetitions (smoke run)")
    bench.add_argument("--dtype", default="float32,float16,bfloat16", help="comma-separated (default: %(default)s)")
    bench.add_argument(
        "--out",
        default=None,  # None, not the path: an --out given on a machine without a GPU is an error (nothing is written)
        help=f"directory for <workload>-<gpu>[-quick].csv/.md/.png (default: {DEFAULT_OUT})",
    )
    bench.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    bench.add_argument(
        "--shapes",
        metavar="REGEX",
        default=None,
        help="run only the cases whose shape label matches REGEX (re.search), e.g. '^8B nnz=30 prefill'",
    )
    bench.add_argument(
        "--checkpoint",
        metavar="PATH",
        default=None,
        help="model workload: bench this saved model ({'config', 'state_dict'}, e.g. the training example's "
        "model-l1.pt: sparsity learned) instead of the synthetic ones",
    )
    bench.add_argument(
        "--merge",
        action="store_true",
        help="merge into the result sets already in --out: re-measured rows replace theirs, other rows are kept "
        "(a grid too long for one machine session, run in parts)",
    )

    check = sub.add_parser(
        "check", help="compare every op (or the ops of the named workloads) with its float64 reference"
    )
    from .bench.check import WORKLOAD_FAMILIES

    check.add_argument(
        "workloads",
        nargs="*",
        metavar="WORKLOAD",
        help=f"check only these workloads' ops, default every op: {', '.join(sorted(WORKLOAD_FAMILIES))}",
    )
    check.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    check.add_argument("--size", choices=("small", "full"), default="small", help="input sizes (default: small)")
    check.add_argument("--dtype", default="float32,float16,bfloat16", help="comma-separated (default: %(default)s)")
    check.add_argument("--seed", type=int, default=None, help="input seed (default: fresh each run, printed)")
    return parser


def bench_option_error(args: argparse.Namespace, has_cuda: bool) -> str | None:
    """Why the bench options given cannot apply (None when they all can): an option is refused, not ignored."""
    given = [flag for dest, flag in _GPU_ONLY_BENCH_OPTIONS.items() if getattr(args, dest) not in (None, False)]
    if not has_cuda and given:
        return (
            f"bench {', '.join(given)}: cannot apply without a CUDA GPU, where bench times nothing and runs "
            "`check --size small` on the workloads' ops instead (no result files, no plot, no model); drop "
            f"{'it' if len(given) == 1 else 'them'}, or run on a GPU"
        )
    if args.checkpoint is not None:
        if args.workloads and "model" not in args.workloads:
            return (
                f"bench --checkpoint applies to the model workload only (it benches that saved model instead of the "
                f"synthetic ones), and the workloads named are {', '.join(args.workloads)}: add `model`, or drop "
                "--checkpoint"
            )
        if not Path(args.checkpoint).is_file():
            return f"bench --checkpoint {args.checkpoint!r}: no such file"
    return None


def _reexec_with_interpreter(argv: Sequence[str], reason: str) -> int:
    """Run this command again with TRITON_INTERPRET=1 (replacing this process where the OS allows)."""
    print(
        f"sparsefuse: {reason}; re-running with TRITON_INTERPRET=1 so the Triton kernels run in the interpreter",
        flush=True,
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", _REEXEC_MARK: "1"}
    cmd = [sys.executable, "-m", "sparsefuse", *argv]
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "posix":
        os.execve(sys.executable, cmd, env)  # does not return
    return subprocess.run(cmd, env=env, check=False).returncode


def main(argv: Sequence[str] | None = None, *, allow_reexec: bool = True) -> int:
    """Entry point; returns the process exit code (0 ok, 1 failures, 2 usage errors)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        dtypes = parse_dtypes(args.dtype)
    except ValueError as exc:
        parser.error(str(exc))

    from .bench.check import ops_for
    from .bench.harness import resolve_workloads

    has_cuda = torch.cuda.is_available()
    names: list[str] = []
    try:
        if args.command == "bench":
            names = resolve_workloads(args.workloads)
        if args.command == "check" or not has_cuda:  # bench without a GPU checks these workloads' ops instead
            ops_for(args.workloads)
    except KeyError as exc:
        parser.error(exc.args[0])

    if args.command == "check" and args.device == "cuda" and not has_cuda:
        parser.error("--device cuda: no CUDA device is available")
    if args.command == "bench" and (problem := bench_option_error(args, has_cuda)) is not None:
        parser.error(problem)

    from . import _backend

    # Kernels on the CPU only run through the interpreter (otherwise the torch reference would be checked against
    # itself): re-execute when there is no GPU, or when check was asked for the CPU explicitly.
    wants_cpu = not has_cuda or (args.command == "check" and args.device == "cpu")
    if wants_cpu and not _backend.INTERPRET and allow_reexec and os.environ.get(_REEXEC_MARK) != "1":
        return _reexec_with_interpreter(argv, "no CUDA device" if not has_cuda else "--device cpu")

    if args.command == "bench" and has_cuda and _backend.INTERPRET:
        parser.error(
            "TRITON_INTERPRET is set: the kernels would run in the CPU interpreter, so GPU timings would "
            "be meaningless; unset it to benchmark"
        )

    from .bench.check import run_check

    if args.command == "check":
        return run_check(device=args.device, size=args.size, dtypes=dtypes, seed=args.seed, workloads=args.workloads)

    if not has_cuda:
        what = f"check --size small {' '.join(args.workloads)}".rstrip()
        print(
            f"sparsefuse bench: timings need a CUDA GPU and none is available; running `{what}` instead "
            "(correctness only, no timings).",
            flush=True,
        )
        return run_check(device="cpu", size="small", dtypes=dtypes, workloads=args.workloads)
    return _bench(names, args, dtypes)


def _bench(names: list[str], args: argparse.Namespace, dtypes: tuple[torch.dtype, ...]) -> int:
    from .bench.harness import WORKLOADS, Options, l2_cache_bytes, measure_ceilings, run_cases
    from .bench.report import (
        environment,
        format_ceilings,
        make_console,
        print_table,
        sanitize,
        write_csv,
        write_results,
    )

    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        console = make_console()
    except ImportError:
        console = None  # plain prints instead

    def say(message: str) -> None:
        if console is not None:
            console.print(message, markup=False, highlight=False)
        else:
            print(message, flush=True)

    options = Options(quick=args.quick, dtypes=dtypes, log=say, checkpoint=args.checkpoint)
    cases = [case for name in names for case in WORKLOADS[name](options)]
    if args.shapes is not None:
        try:
            wanted = re.compile(args.shapes)
        except re.error as exc:
            say(f"sparsefuse bench: --shapes {args.shapes!r} is not a regular expression: {exc}")
            return 2
        cases = [case for case in cases if wanted.search(case.shape)]
    if not cases:
        say("sparsefuse bench: nothing to run")
        return 1
    gpu = torch.cuda.get_device_name()
    out_dir = Path(args.out or DEFAULT_OUT)
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out_dir / f"partial-{sanitize(gpu)}.csv"  # a killed run still leaves its rows here

    say(f"sparsefuse bench on {gpu}: {len(cases)} cases; measuring ceilings ...")
    ceilings = measure_ceilings(quick=args.quick)
    for key, value in format_ceilings(ceilings).items():
        say(f"{key}: {value}")

    total = sum(len(c.impls) for c in cases)
    # Under torchrun every process runs the cases (a workload's distributed mode) and the first one reports.
    reporting = int(os.environ.get("RANK", "0")) == 0
    save_partial = (lambda rows: write_csv(rows, partial)) if reporting else None
    if console is not None and console.is_terminal:
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task("benchmarking", total=total)
            rows = run_cases(
                cases, options, ceilings, lambda label: bar.update(task, advance=1, description=label), save_partial
            )
    else:
        done = [0]

        def tick(label: str) -> None:
            done[0] += 1
            print(f"[{done[0]}/{total}] {label}", flush=True)

        rows = run_cases(cases, options, ceilings, tick, save_partial)

    if not reporting:
        return 1 if all(r.status != "ok" for r in rows) else 0
    meta = environment(ceilings, gpu, l2_cache_bytes())
    print_table(rows, meta, console)
    for path in write_results(rows, meta, out_dir, quick=args.quick, plot=not args.no_plot, merge=args.merge):
        say(f"wrote {path}")
    partial.unlink(missing_ok=True)
    failed = [r for r in rows if r.status != "ok"]
    if failed:
        say(f"{len(failed)} of {len(rows)} measurements failed (see the note column)")
    return 1 if len(failed) == len(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
