#!/usr/bin/env bash
# One call on a GPU machine: the whole test suite on CUDA (compiled kernels, GPU-only tests included), every op under
# compute-sanitizer (memcheck and racecheck), then the benchmarks.
# Usage: scripts/gpu_check.sh OUT_DIR [bench arguments...]
# Runs from the repository root with the machine's python3 (torch + triton preinstalled); sparsefuse is used from
# the source tree, no install. Results land in OUT_DIR with the names benchmarks/results/ keeps, so they can be
# copied over as they are: <workload>-<gpu>.{csv,md,png} per workload, gpu-tests-<gpu>.log, plus env-<gpu>.txt and
# bench-<gpu>.log (the console output).
# The result headers name the commit from SPARSEFUSE_COMMIT, else from git in this tree: where the tree was copied
# without its current .git (a copy of the working tree), pass SPARSEFUSE_COMMIT=$(git rev-parse --short HEAD) from the checkout.
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [bench args...]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 SPARSEFUSE_TEST_DEVICE=cuda
unset TRITON_INTERPRET
PY=${PYTHON:-python3}
# The GPU's name as the bench command writes it into file names (sparsefuse.bench.report.sanitize).
gpu=$($PY -c 'import torch; from sparsefuse.bench.report import sanitize; print(sanitize(torch.cuda.get_device_name()))')

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  $PY -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
} 2>&1 | tee "$out/env-$gpu.txt"

# The whole suite takes over 9 minutes on one H100 with 14 workers (the SPLADE head's opcheck and float64 gradient
# tests are the longest, ~3.5 min each: every shape compiles its kernels): where one call may run 10 minutes at most, run
# it in parts with TESTS (paths or -k expressions pytest takes; TESTS=0 skips the suite), SANITIZE=0 and BENCH=0.
# With several GPUs visible and TESTS unset, the test files are shared out over the GPUs (balanced by size, one
# pytest per GPU side by side, PYTEST_WORKERS each), then tests/distributed runs with every GPU visible; GPUS=1
# keeps one pytest on GPU 0.
# TESTS_DEADLINE_S: each pytest of the suite is interrupted (SIGINT) after that many seconds, so a run cut by the
# machine's time limit still ends with pytest's summary, naming the failures seen so far.
# PYTEST_ARGS: more pytest arguments for the suite (-v names each test as it finishes, so that a cut run's log
# tells which tests never ran).
# test_shards N [without-distributed]: the test files in N lines of about equal source size (the largest file first,
# into the lightest shard); with "without-distributed", tests/distributed is left out (it runs on its own).
test_shards() {
  $PY - "$@" <<'PYTHON'
import sys
from pathlib import Path

n, skip = int(sys.argv[1]), "without-distributed" in sys.argv[2:]
files = sorted(
    (f for f in Path("tests").rglob("test_*.py") if not (skip and "distributed" in f.parts)),
    key=lambda f: (-f.stat().st_size, str(f)),
)
shards, loads = [[] for _ in range(n)], [0] * n
for f in files:
    i = loads.index(min(loads))
    shards[i].append(str(f))
    loads[i] += f.stat().st_size
print("\n".join(" ".join(s) for s in shards))
PYTHON
}
# PART=K/N (TESTS unset): only the K-th of N shares of the test files, so that calls of 10 minutes at most run
# the whole suite in N calls (PART=1/3, 2/3, 3/3 on one H200 with 16 workers).
if [ -n "${PART:-}" ] && [ -z "${TESTS:-}" ]; then
  if ! [[ "$PART" =~ ^([0-9]+)/([0-9]+)$ ]] || [ "${BASH_REMATCH[1]}" -lt 1 ] || [ "${BASH_REMATCH[1]}" -gt "${BASH_REMATCH[2]}" ]; then
    echo "gpu_check: PART must be K/N with 1 <= K <= N; got '$PART'" >&2
    exit 2
  fi
  TESTS=$(test_shards "${BASH_REMATCH[2]}" | sed -n "${BASH_REMATCH[1]}p")
  echo "gpu_check: PART $PART: $TESTS"
fi
ngpu=${GPUS:-$($PY -c 'import torch; print(torch.cuda.device_count())')}
deadline=()
[ -n "${TESTS_DEADLINE_S:-}" ] && deadline=(timeout -s INT -k 30 "$TESTS_DEADLINE_S")
log="$out/gpu-tests-$gpu.log"
tests_status=0
if [ "${TESTS:-}" = 0 ]; then
  echo "gpu_check: TESTS=0: the test suite skipped"
elif [ -n "${TESTS:-}" ] || [ "$ngpu" -le 1 ]; then
  ${deadline[@]+"${deadline[@]}"} $PY -m pytest ${TESTS:-tests} -q -rf -n ${PYTEST_WORKERS:-8} -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$log"
  tests_status=${PIPESTATUS[0]}
else
  mapfile -t shards < <(test_shards "$ngpu" without-distributed)
  pids=()
  for i in "${!shards[@]}"; do
    CUDA_VISIBLE_DEVICES=$i ${deadline[@]+"${deadline[@]}"} $PY -m pytest ${shards[$i]} -q -rf -n ${PYTEST_WORKERS:-8} -p no:cacheprovider ${PYTEST_ARGS:-} \
      >"$out/.tests-$i.log" 2>&1 &
    pids+=($!)
  done
  tests_status=0
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || tests_status=1
    { echo "===== GPU $i: ${shards[$i]}"; cat "$out/.tests-$i.log"; } >>"$log"
    rm -f "$out/.tests-$i.log"
  done
  { echo "===== every GPU: tests/distributed"
    ${deadline[@]+"${deadline[@]}"} $PY -m pytest tests/distributed -q -rf -p no:cacheprovider 2>&1; } \
    | tee -a "$log"
  [ "${PIPESTATUS[0]}" = 0 ] || tests_status=1
  grep -E "^=====|passed|failed|^FAILED|^ERROR" "$log"
fi

# compute-sanitizer over every op: the property tests (random shapes, tails, strides, NaN), memcheck with the caching
# allocator off (an out-of-bounds access inside a cached block would go unseen) at SANITIZE_CASES cases per op, then
# racecheck (shared memory) at RACECHECK_CASES. Workers of pytest -n are child processes: the sanitizer follows them.
# Any memcheck error fails the script. racecheck skips cuBLAS's kernels (names with nvjet, cutlass, gemm: not ours to
# mend) and checks every other kernel the tests launch; one class of report is counted but not failed: two writes
# from the *same instruction* to one shared address, which is how Triton's cross-warp reductions (tl.sum, tl.max)
# store the value every lane holds (triton-lang/triton#4736, #7264) -- no line of ours can cause it. Any other
# hazard fails the script, as does a process that printed as many reports as the print limit (the rest unseen).
# SANITIZE=0 skips both. ~3 min (memcheck) + ~2.5 min (racecheck) on an H100 with 8 workers.
sanitize_status=0
if [ "${SANITIZE:-1}" != 0 ]; then
  if command -v compute-sanitizer >/dev/null 2>&1; then
    props="tests/test_properties.py -q -rf -n ${PYTEST_WORKERS:-8} -p no:cacheprovider"
    { PYTORCH_NO_CUDA_MEMORY_CACHING=1 SPARSEFUSE_PROPERTY_CASES=${SANITIZE_CASES:-10} compute-sanitizer \
        --tool memcheck --error-exitcode 97 --print-limit 50 $PY -m pytest $props
      memcheck=$?
      limit=10000
      SPARSEFUSE_PROPERTY_CASES=${RACECHECK_CASES:-3} compute-sanitizer --tool racecheck --print-limit $limit \
        --kernel-name-exclude kns=nvjet --kernel-name-exclude kns=cutlass --kernel-name-exclude kns=gemm \
        $PY -m pytest $props -k "not larger" >"$out/.racecheck.log" 2>&1
      racecheck_run=$?
      cat "$out/.racecheck.log"
      # each report: "Race reported between <kind> access at <where>" then "and <kind> access at <where>"
      same=$(grep -A1 "Race reported between Write access at" "$out/.racecheck.log" | $PY -c '
import re, sys
lines = sys.stdin.read().splitlines()
first = [re.search(r"Write access at (\S+)", l) for l in lines]
print(sum(1 for i, m in enumerate(first[:-1]) if m and re.search(r"and Write access at " + re.escape(m.group(1)) + r"(\s|$)", lines[i + 1])))')
      total=$(grep -c "Race reported between" "$out/.racecheck.log")
      rm -f "$out/.racecheck.log"
      echo "sanitizer: memcheck exit $memcheck; racecheck run exit $racecheck_run, $total reports, $same of them" \
        "same-instruction writes (Triton's reduction stores)"
      exit $(( memcheck != 0 || racecheck_run != 0 || total != same || total >= limit ))
    } 2>&1 | tee "$out/sanitizer-$gpu.log"
    sanitize_status=${PIPESTATUS[0]}
  else
    echo "gpu_check: compute-sanitizer not found on PATH: sanitizer not run" | tee "$out/sanitizer-$gpu.log"
    sanitize_status=1
  fi
fi

# Each workload runs in its own process: what one leaves on the GPU (caches, pools) cannot starve the next one's
# largest baselines (a combined run once ran out of memory late in the last workload's cases). By default the
# package's workloads; a lab workload named (benchmarks/lab/, e.g. ffn_products) runs through python -m benchmarks.lab.
bench_status=0
if [ "${BENCH:-1}" != 0 ]; then
  options=() workloads=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --dtype|--shapes|--checkpoint|--out) options+=("$1" "${2:-}"); shift 2 || shift ;;
      -*) options+=("$1"); shift ;;
      *) workloads+=("$1"); shift ;;
    esac
  done
  package=$($PY -c 'from sparsefuse.bench.harness import resolve_workloads; print(" ".join(resolve_workloads([])))')
  if [ ${#workloads[@]} -eq 0 ]; then
    read -r -a workloads <<< "$package"
  fi
  : > "$out/bench-$gpu.log"
  for workload in "${workloads[@]}"; do
    case " $package " in *" $workload "*) cli=sparsefuse ;; *) cli=benchmarks.lab ;; esac
    $PY -m $cli bench --out "$out" "${options[@]}" "$workload" 2>&1 | tee -a "$out/bench-$gpu.log"
    status=${PIPESTATUS[0]}
    [ "$status" -ne 0 ] && bench_status=$status
  done
fi

echo "gpu_check: tests exit $tests_status, sanitizer exit $sanitize_status, bench exit $bench_status"
exit $(( tests_status != 0 || sanitize_status != 0 || bench_status != 0 ))
