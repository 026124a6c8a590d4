#!/usr/bin/env bash
# Sparse training on several GPUs, one call on a machine with N >= 2 GPUs (~6-8 minutes on 2 H100s or H200s):
#   1. the GPU tests of tests/distributed: the bench's distributed mode on a tiny model over NCCL, and the sparse
#      step on a GPU that is not the current one;
#   2. `sparsefuse bench train` under torchrun on 1 GPU and on all N, DDP and FSDP2, patched vs unpatched, bf16,
#      the 1.5B shape at full depth (24 layers), B=4 x S=2048 tokens per GPU; both runs merged into one set,
#      train_multi-<gpu>.{csv,md,png}, whose summary gives tokens/s per GPU, the patched speed-up, the scaling
#      efficiency (tokens/s per GPU at N over that at 1), and per row the peak memory per GPU (max over ranks) and
#      the gradient check against one process (same seed, same global batch);
#   3. the shipped example under torchrun on all N GPUs, DDP then FSDP2, the hybrid sparse step, EXAMPLE_STEPS
#      steps per run (one run without L1, one with).
# Usage: scripts/gpu_multi.sh OUT_DIR
# Runs from the repository root with the machine's python3 (torch + triton preinstalled); sparsefuse from the source
# tree, no install. As scripts/gpu_check.sh: pass SPARSEFUSE_COMMIT=$(git rev-parse --short HEAD) where the tree was
# copied without its .git. Knobs: NGPU (default: every visible GPU), ENGINES (default ddp,fsdp2: the bench's
# --shapes picks their cases), BENCH_ARGS (e.g. --quick: 8 layers, fewer timed steps), EXAMPLE_STEPS (150),
# TESTS=0 / BENCH=0 / EXAMPLE=0 to skip a part, DEADLINE_S (560: the whole script stays inside a 10-minute call; a
# part that would pass it is cut short or skipped, and says so). The lab's knobs (benchmarks/lab/train_knobs.py:
# SPARSEFUSE_FSDP_LAYERS_PER_UNIT, SPARSEFUSE_FSDP_RESHARD_AFTER_FORWARD, SPARSEFUSE_TRAIN_CUDA_GRAPH,
# SPARSEFUSE_TRAIN_PIN_CPUS, SPARSEFUSE_TRAIN_SINGLE_THREAD_BACKWARD, SPARSEFUSE_TRAIN_STEPS_PER_SYNC, and
# SPARSEFUSE_TRAIN_PROFILE: each row's note adds its step's compute, NCCL, exposed NCCL and idle time by rank, from 3
# more steps under torch.profiler, and the summary the GPU-bound speed-up and scaling): with any of them set the
# bench runs as python -m benchmarks.lab, which applies them.
set -uo pipefail
out=${1:?usage: scripts/gpu_multi.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 SPARSEFUSE_TEST_DEVICE=cuda
# NVLink multicast stays off on these machines (it can take a shared host's GPUs out of service): keep it so in
# every process started here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET
PY=${PYTHON:-python3}
gpu=$($PY -c 'import torch; from sparsefuse.bench.report import sanitize; print(sanitize(torch.cuda.get_device_name()))')
ngpu=${NGPU:-$($PY -c 'import torch; print(torch.cuda.device_count())')}
torchrun="$PY -m torch.distributed.run --standalone"
deadline=${DEADLINE_S:-560}
status=0
# OUT_DIR is kept small (a remote machine may return only a few files): every part logs to one file, and what is not a result (the bench's
# own sets, the example's checkpoints and plots) stays in a scratch folder outside OUT_DIR.
log="$out/gpu-multi-$gpu.log"
scratch=$(mktemp -d)

# Seconds a part may take: its own cap, less where the deadline is nearer (0: skip it). 50 s are kept for stopping
# a part cut short: torchrun gives its workers 30 s to stop before it kills them.
budget() {
  local left=$((deadline - SECONDS - 50))
  if [ "$left" -lt 30 ]; then echo 0; elif [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}

# part NAME CAP LOG COMMAND...: the command under its budget, its output on the console and in LOG; a part that
# fails, is cut short or is skipped makes the script fail.
part() {
  local name=$1 cap=$2 log=$3
  shift 3
  local s
  s=$(budget "$cap")
  if [ "$s" = 0 ]; then
    echo "gpu_multi: $name skipped: the deadline (${deadline} s) is near" | tee -a "$log"
    status=1
    return
  fi
  echo "gpu_multi: $name (at most $s s)"
  timeout --kill-after=45 "$s" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then echo "gpu_multi: $name cut at $s s" | tee -a "$log"; fi
  echo "gpu_multi: $name exit $rc after ${SECONDS} s in all"
  [ "$rc" = 0 ] || status=1
}

{ nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  $PY -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl",
    torch.cuda.nccl.version(), "triton", triton.__version__, "GPUs", torch.cuda.device_count())'
} 2>&1 | tee "$out/env-multi-$gpu.txt"
if [ "$ngpu" -lt 2 ]; then
  echo "gpu_multi: $ngpu GPU visible: the N-GPU runs need 2 or more (the 1-GPU bench run still runs)"
fi

if [ "${TESTS:-1}" != 0 ]; then
  part "tests" 180 "$log" $PY -m pytest tests/distributed -q -rfs -p no:cacheprovider
fi

if [ "${BENCH:-1}" != 0 ]; then
  # Both runs write one set (--merge) in a folder of their own; it is written out as train_multi below, so that the
  # single-GPU train set keeps its name.
  sets="$scratch/bench-multi"
  engines=()  # the cases' shape labels end in "<engine> x<GPUs>"
  [ -n "${ENGINES:-}" ] && engines=(--shapes " (${ENGINES//,/|}) x[0-9]+\$")
  cli=sparsefuse
  for knob in $($PY -c 'from benchmarks.lab.train_knobs import KNOBS; print(*KNOBS)'); do
    [ -n "${!knob+set}" ] && cli=benchmarks.lab
  done
  for n in $(printf '%s\n' 1 "$ngpu" | sort -nu); do
    part "bench train x$n" 200 "$log" \
      $torchrun --nproc_per_node "$n" -m $cli bench train --dtype bfloat16 --out "$sets" --merge --no-plot \
      "${engines[@]}" ${BENCH_ARGS:-}
  done
  suffix=$(case " ${BENCH_ARGS:-} " in *" --quick "*) echo -quick ;; esac)
  # the set, plus the finished cases of a run cut short (the bench keeps them in partial-<gpu>.csv)
  $PY - "$sets" "$out" "$gpu" "$suffix" <<'PYTHON' || status=1
import sys
from pathlib import Path

from sparsefuse.bench.report import merge_rows, read_csv, read_meta, write_set
from sparsefuse.bench.workloads.train_dist import summary_lines

sets, out, gpu, suffix = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
full, partial = sets / f"train-{gpu}{suffix}.csv", sets / f"partial-{gpu}.csv"
rows = read_csv(full) if full.exists() else []
if partial.exists():
    print(f"gpu_multi: a bench run was cut short; its finished cases come from {partial}")
    rows = merge_rows(rows, [r for r in read_csv(partial) if r.workload == "train"])
if not rows:
    sys.exit(f"gpu_multi: no bench rows in {sets} (see the log)")
meta = read_meta(full.with_suffix(".md")) if full.exists() else {"GPU": gpu}
for path in write_set(rows, meta, out, f"train_multi-{gpu}{suffix}"):
    print("wrote", path)
print("\n".join(summary_lines(rows)))
PYTHON
fi

if [ "${EXAMPLE:-1}" != 0 ]; then
  for engine in ddp fsdp2; do
    part "example $engine x$ngpu" 90 "$log" \
      $torchrun --nproc_per_node "$ngpu" examples/train_sparse_llama.py --distributed --engine "$engine" \
      --size small --train-method hybrid --steps "${EXAMPLE_STEPS:-150}" --log-every 25 \
      --out "$scratch/example-$engine-x$ngpu"
    cp "$scratch/example-$engine-x$ngpu/log.csv" "$out/example-$engine-x$ngpu-$gpu.csv" 2>/dev/null || status=1
  done
fi

echo "gpu_multi: exit $status after ${SECONDS} s; results in $out"
exit $status
