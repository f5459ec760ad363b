#!/usr/bin/env bash
# Everything a CUDA machine should run, in one go (issue 21, item 6): build the extension with its CUDA part,
# run the GPU tests (the kernels' first-use self-checks included), the K-means and features GPU benchmarks,
# `clusterlm select` on SmolLM2-135M in bfloat16 on the GPU, and the features check (GPU bf16 features against
# CPU float32 features of the same examples, cosine per example; the features' tokens/s against a plain bf16
# forward over the same tokens).
#
#   bash benchmarks/gpu/run_all.sh OUT
#
# Run from anywhere; it works in the repository that holds it and writes only under OUT:
#   gpu_env.txt        machine, driver, torch / triton / nvcc versions
#   build.log          CLUSTER_KERNELS_CUDA=1 pip install --no-build-isolation --no-deps -e .
#   gpu_tests.log      pytest of the CUDA K-means, both Triton kernels and the self-checks, on the GPU
#   bench.log          both benchmarks' output; gpu_kmeans.json and gpu_features.json are their results
#   select/, select.log  clusterlm select --device cuda --dtype bfloat16: its plan and features, its output
#   features_check.log, gpu_features_check.json   the features check (benchmarks/gpu/compare_features.py)
#   tasks.log, gpu_tasks.json   HumanEval pass@1 of the base SmolLM2 on the GPU (benchmarks/bench_tasks.py)
#   steps.tsv          one line per step: name, exit status, seconds
#   summary.txt        the steps and the key numbers, written last
# A failed step does not stop the later ones; the script exits 1 at the end if any step failed.
#
# Time: the steps share RUN_ALL_BUDGET seconds (default 620: about 10 minutes with the set-up); each is killed
# at its own cap or when the budget runs out. PYTHON is the interpreter that holds torch (default: the
# repository's .venv made by `make install`, else python3). The SmolLM2 steps need the model converted once
# on that machine (`make real-model`); without it they fail with the one-line message saying so.
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: bash benchmarks/gpu/run_all.sh OUT" >&2
  exit 2
fi
OUT_DIR=$1
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
if [[ -n "${PYTHON:-}" ]]; then
  PY=$PYTHON
elif [[ -x "$REPO/.venv/bin/python" ]]; then
  PY=$REPO/.venv/bin/python
else
  PY=python3
fi
BUDGET=${RUN_ALL_BUDGET:-620}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO:$REPO/python_api${PYTHONPATH:+:$PYTHONPATH}"
export CLUSTERLM_HOME=${CLUSTERLM_HOME:-$HOME/.cache/clusterlm}
unset TRITON_INTERPRET # the GPU runs the Triton kernels, not the interpreter

LOG="$OUT_DIR/run_all.log"
STEPS="$OUT_DIR/steps.tsv"
: >"$LOG"
printf 'step\tstatus\tseconds\n' >"$STEPS"
FAILED=()

note() { echo "[run_all $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

# run_step NAME CAP_SECONDS LOGFILE COMMAND...: runs COMMAND with its output appended to LOGFILE, killed after
# min(CAP, what is left of the budget); records the exit status and the time in steps.tsv.
run_step() {
  local name=$1 cap=$2 logfile=$3
  shift 3
  local left=$((BUDGET - SECONDS))
  local limit=$((cap < left ? cap : left))
  if ((limit < 10)); then
    note "$name: SKIPPED (time budget of ${BUDGET}s used up)"
    printf '%s\tskipped\t0\n' "$name" >>"$STEPS"
    FAILED+=("$name")
    return 0
  fi
  note "$name: start (limit ${limit}s): $*"
  local start=$SECONDS status=0
  echo "===== $name: $* =====" >>"$logfile"
  timeout --kill-after=10 "$limit" "$@" >>"$logfile" 2>&1 || status=$?
  local took=$((SECONDS - start))
  if ((status == 124 || status == 137)); then
    note "$name: TIMED OUT after ${took}s (exit $status)"
  else
    note "$name: exit $status after ${took}s"
  fi
  printf '%s\t%s\t%s\n' "$name" "$status" "$took" >>"$STEPS"
  if ((status != 0)); then
    FAILED+=("$name")
    tail -n 25 "$logfile" | sed "s/^/    [$name] /" >>"$LOG"
  fi
  return 0
}

# ---- environment
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "repo: $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
  echo "host: $(uname -a)"
  echo "cpus: $(nproc)"
  echo "python: $PY ($("$PY" --version 2>&1))"
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
for name in ("triton", "numpy", "transformers", "pybind11", "pytest", "hypothesis"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:  # noqa: BLE001
        print(name, "missing:", type(exc).__name__)
EOF
} >"$OUT_DIR/gpu_env.txt" 2>&1
note "environment written to gpu_env.txt (python: $PY)"

# The GPU's architecture for nvcc (e.g. 90 on an H100/H200); the build's default (90) when torch cannot tell.
ARCH=$("$PY" -c "import torch; c = torch.cuda.get_device_capability(0); print(f'{c[0]}{c[1]}')" 2>/dev/null || echo 90)

# ---- build the extension with its CUDA part into the interpreter's environment (an editable install)
run_step build 240 "$OUT_DIR/build.log" \
  env CLUSTER_KERNELS_CUDA=1 CLUSTER_KERNELS_CUDA_ARCH="$ARCH" "$PY" -m pip install --no-build-isolation --no-deps -e .
run_step build_check 30 "$OUT_DIR/build.log" \
  "$PY" -c "import cluster_kernels._C as C, sys; print('has_cuda', C.has_cuda, 'devices', C.cuda_device_count()); \
sys.exit(0 if C.has_cuda and C.cuda_device_count() > 0 else 1)"

# ---- GPU tests: the CUDA K-means, both Triton kernels (float32 and bf16), the first-use self-checks
run_step gpu_tests 150 "$OUT_DIR/gpu_tests.log" \
  "$PY" -m pytest -q -p no:cacheprovider tests/cluster_kernels/test_kmeans_cuda.py \
  tests/cluster_kernels/test_project_linear_grads.py tests/cluster_kernels/test_lm_head_features.py \
  tests/cluster_kernels/test_selfcheck.py

# ---- benchmarks (each writes its JSON under OUT)
run_step bench_kmeans 120 "$OUT_DIR/bench.log" "$PY" benchmarks/gpu/bench_kmeans_gpu.py --out "$OUT_DIR"
run_step bench_features 90 "$OUT_DIR/bench.log" "$PY" benchmarks/gpu/bench_features_gpu.py --out "$OUT_DIR"

# ---- select on SmolLM2-135M in bfloat16 on the GPU, on the demo data
TRAIN=$("$PY" -c "from clusterlm.data.demo import demo_data; print(demo_data(verbose=False).train)" 2>>"$LOG" || true)
if [[ -z "$TRAIN" ]]; then
  note "demo data could not be built (see run_all.log); the select and features steps will fail"
  TRAIN=missing-demo-data.jsonl
fi
run_step select 100 "$OUT_DIR/select.log" \
  "$PY" -m clusterlm select --model smollm2-135m-instruct --device cuda --dtype bfloat16 --data "$TRAIN" \
  --world-size 2 --ratio 0.3 --out "$OUT_DIR/select" --no-progress

# ---- the features check: cosine per example against CPU float32, tokens/s against a plain bf16 forward
run_step features_check 120 "$OUT_DIR/features_check.log" \
  "$PY" benchmarks/gpu/compare_features.py --model smollm2-135m-instruct --data "$TRAIN" --out "$OUT_DIR" \
  --device cuda --dtype bfloat16
# Task metrics on the GPU: HumanEval pass@1 (all 164 problems, greedy, bf16) of the base SmolLM2, generation batched
# on the device, every program through the sandbox; the evaluation seconds per problem against the CPU's.
run_step tasks 150 "$OUT_DIR/tasks.log" \
  "$PY" benchmarks/bench_tasks.py --stage base --task-limit 0 --device cuda --work "$OUT_DIR/tasks" \
  --out "$OUT_DIR/gpu_tasks.json"

# ---- summary (written last; reads only files under OUT)
"$PY" - "$OUT_DIR" "$SECONDS" "${FAILED[*]:-}" <<'EOF' >"$OUT_DIR/summary.txt" 2>&1 || true
import json, sys
from pathlib import Path
out, seconds, failed = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split()
print(f"run_all: {seconds} s in all; failed steps: {', '.join(failed) if failed else 'none'}")
print((out / "steps.tsv").read_text().rstrip())
env = (out / "gpu_env.txt").read_text().splitlines()
print("\n".join(line for line in env if line.startswith(("device", "torch", "triton", "date"))))
check = out / "gpu_features_check.json"
if check.exists():
    r = json.loads(check.read_text())
    c = r["cosine"]
    print(f"features on {r['device']} {r['dtype']} vs {r['ref']}: cosine per example min {c['min']:.5f}, "
          f"median {c['median']:.5f}, {c['below_goal']} of {c['n']} below {c['goal']}")
    print(f"features {r['features_tokens_per_s']:,.0f} tokens/s vs plain forward {r['forward_tokens_per_s']:,.0f}: "
          f"{r['speed_ratio']:.3f}x (goal >= {r['speed_goal']}); backends {r['backends']}")
for name in ("gpu_kmeans.json", "gpu_features.json"):
    p = out / name
    if p.exists():
        for t in json.loads(p.read_text()).get("targets", []):
            print(f"{name}: {t['goal']}: {t['measured']} ({'met' if t['met'] else 'NOT met'})")
tests = out / "gpu_tests.log"
if tests.exists():
    tail = [line for line in tests.read_text().splitlines() if " passed" in line or " failed" in line]
    print("gpu tests:", tail[-1] if tail else "no pytest summary line")
EOF
cat "$OUT_DIR/summary.txt" >>"$LOG"

if ((${#FAILED[@]})); then
  note "FAILED steps: ${FAILED[*]} (total ${SECONDS}s)"
  exit 1
fi
note "all steps passed (total ${SECONDS}s)"
