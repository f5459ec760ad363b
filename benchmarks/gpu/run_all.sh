#!/usr/bin/env bash
# Everything a CUDA machine should run, in one go: build the extension with its CUDA part, record the
# environment, run the GPU tests, run the GPU benchmarks.
#
#   bash benchmarks/gpu/run_all.sh DIR
#
# Run from anywhere; it works in the repository that holds it. Writes at most 7 files, all directly in
# DIR: gpu_env.txt, build.log, gpu_tests.log, bench.log, gpu_kmeans.json, gpu_features.json (when
# benchmarks/gpu/bench_features_gpu.py exists) and run_all.log (each step's exit status and time).
# A failed step does not stop the later ones; the script exits 1 at the end if any step failed.
#
# Time: the steps share a budget of RUN_ALL_BUDGET seconds (default 540, under the device tool's
# 10-minute limit); each step is killed at its own cap or when the budget runs out. About 6 minutes
# on an H200 with 16 cores. PYTHON (default python3) is the interpreter that holds torch.
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: bash benchmarks/gpu/run_all.sh DIR" >&2
  exit 2
fi
OUT_DIR=$1
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
PY=${PYTHON:-python3}
BUDGET=${RUN_ALL_BUDGET:-540}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO:$REPO/python_api${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # the GPU runs the Triton kernels, not the interpreter

LOG="$OUT_DIR/run_all.log"
: >"$LOG"
FAILED=()

note() { echo "[run_all $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

# run_step NAME CAP_SECONDS LOGFILE COMMAND...: runs COMMAND with its output appended to LOGFILE,
# killed after min(CAP, what is left of the budget); records the exit status.
run_step() {
  local name=$1 cap=$2 logfile=$3
  shift 3
  local left=$((BUDGET - SECONDS))
  local limit=$((cap < left ? cap : left))
  if ((limit < 10)); then
    note "$name: SKIPPED (time budget of ${BUDGET}s used up)"
    FAILED+=("$name")
    return 0
  fi
  note "$name: start (limit ${limit}s): $*"
  local start=$SECONDS status=0
  echo "===== $name: $* =====" >>"$logfile"
  timeout --kill-after=10 "$limit" "$@" >>"$logfile" 2>&1 || status=$?
  if ((status == 124 || status == 137)); then
    note "$name: TIMED OUT after $((SECONDS - start))s (exit $status)"
  else
    note "$name: exit $status after $((SECONDS - start))s"
  fi
  if ((status != 0)); then
    FAILED+=("$name")
    tail -n 25 "$logfile" | sed "s/^/    [$name] /" | tee -a "$LOG" >/dev/null
  fi
  return 0
}

# ---- environment
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "repo: $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
  echo "host: $(uname -a)"
  echo "cpus: $(nproc)"
  echo "python: $(command -v "$PY") $("$PY" --version 2>&1)"
  echo "nvcc: $( (command -v nvcc || ls /usr/local/cuda/bin/nvcc) 2>/dev/null | head -n 1)"
  (nvcc --version || /usr/local/cuda/bin/nvcc --version) 2>&1 | tail -n 2 || true
  echo
  nvidia-smi 2>&1 || echo "nvidia-smi failed"
  echo
  "$PY" - <<'EOF' 2>&1 || true
import importlib
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs", p.total_memory // 2**20, "MiB")
for name in ("triton", "numpy", "pybind11", "pytest", "hypothesis", "scipy", "faiss"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:  # noqa: BLE001
        print(name, "missing:", type(exc).__name__)
EOF
} >"$OUT_DIR/gpu_env.txt" 2>&1
note "environment written to gpu_env.txt"

# ---- build the extension in place, CUDA part required
run_step build 300 "$OUT_DIR/build.log" \
  env CLUSTER_KERNELS_CUDA=1 "$PY" setup.py build_ext --inplace
if ! "$PY" -c "import cluster_kernels._C as C, sys; sys.exit(0 if C.has_cuda and C.cuda_device_count() > 0 else 1)" \
  >>"$OUT_DIR/build.log" 2>&1; then
  note "build: cluster_kernels._C does not import with a working CUDA part (see build.log)"
  [[ " ${FAILED[*]} " == *" build "* ]] || FAILED+=("build")
else
  note "build: cluster_kernels._C imports, has_cuda and sees a device"
fi

# ---- GPU tests
run_step gpu_tests 200 "$OUT_DIR/gpu_tests.log" \
  "$PY" -m pytest -q -x tests/cluster_kernels/test_kmeans_cuda.py tests/cluster_kernels/test_project_linear_grads.py \
  tests/cluster_kernels/test_lm_head_features.py

# ---- benchmarks
run_step bench_kmeans 200 "$OUT_DIR/bench.log" "$PY" benchmarks/gpu/bench_kmeans_gpu.py --out "$OUT_DIR"
if [[ -f benchmarks/gpu/bench_features_gpu.py ]]; then
  run_step bench_features 180 "$OUT_DIR/bench.log" "$PY" benchmarks/gpu/bench_features_gpu.py --out "$OUT_DIR"
else
  note "bench_features: benchmarks/gpu/bench_features_gpu.py not present, skipped"
fi

if ((${#FAILED[@]})); then
  note "FAILED steps: ${FAILED[*]} (total ${SECONDS}s)"
  exit 1
fi
note "all steps passed (total ${SECONDS}s)"
