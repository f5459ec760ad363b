"""GPU benchmark of capacity-constrained K-means: the CUDA path vs the C++/OpenMP path vs faiss-gpu.

Run on a CUDA machine, from the repository root, after building the extension with its CUDA part
(``benchmarks/gpu/run_all.sh`` does both)::

    python benchmarks/gpu/bench_kmeans_gpu.py --out DIR

Writes ``DIR/gpu_kmeans.json`` (the ``benchmarks/results`` format, rendered into BENCHMARKS.md by
``benchmarks/render_benchmarks.py``) and prints the tables. ``--smoke`` runs one tiny size; without a
CUDA device it prints "no CUDA device", writes a JSON that says the run was skipped, and exits 0.

What is measured:

* ``capacity_kmeans`` end to end on the Gaussian mixture of ``benchmarks/kmeans_anchors.py`` (d=128,
  K=8, unequal components), caps ``ceil(n/K)`` (exact balance) and ``ceil(1.5 n/K)``, with
  n_init=1, max_iter=20, seed 0: ``backend="cuda"`` (CUDA events around the call, data already on
  the GPU) and ``backend="cpu"`` (wall clock, OpenMP on every core); faiss-gpu's unconstrained
  k-means when it imports. Median of 3 after an untimed warm-up on a 20 000-point slice; a CPU
  configuration whose first run exceeds ``--cpu-budget`` seconds is timed once. Each CUDA result is
  checked against the CPU one (same labels, inertia). Without faiss-gpu, torch's own unconstrained Lloyd
  iterations (:func:`torch_lloyd`: cuBLAS distances + argmin) are timed instead.
* The distance kernel alone (``sqdist_tile_kernel``, float32, K=8, d=128), read from the PyTorch
  profiler's CUDA activity trace of ``assign_with_capacity``, against the floor of reading x once and
  writing D once at the device-to-device copy bandwidth measured in the same run (and the FP32 FMA
  floor at the datasheet 67 TFLOP/s).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))  # the CPU path on every core

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import kmeans_anchors as anchors  # noqa: E402
import torch  # noqa: E402

from cluster_kernels import _backend, assign_with_capacity, capacity_kmeans  # noqa: E402

D, K, N_INIT, MAX_ITER, SEED = 128, 8, 1, 20, 0
FP32_PEAK = 67e12  # H100/H200 SXM datasheet, FP32 non-tensor FLOP/s (an FMA counts 2)
OUT_NAME = "gpu_kmeans.json"
COMMAND = "python benchmarks/gpu/bench_kmeans_gpu.py --out DIR"


def machine() -> str:
    """GPU name, driver, CPU cores and threads, library versions."""
    parts = []
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name(0))
        try:
            driver = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
            parts.append(f"driver {driver or 'unknown'}")
        except (OSError, subprocess.SubprocessError):
            parts.append("driver unknown")
    else:
        parts.append("no CUDA device")
    mod = _backend.native()
    threads = mod.max_threads() if mod is not None else 1
    parts.append(
        f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), CPU path on {threads} threads"
    )
    parts.append(f"torch {torch.__version__}, python {platform.python_version()}")
    return "; ".join(parts)


def time_cuda(fn) -> tuple[float, object]:
    """Seconds of one call between CUDA events on the current stream, and its result."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3, out


def time_cpu(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def repeat(timer, fn, reps: int, budget: float) -> tuple[float, int, object]:
    """Median seconds over up to ``reps`` calls (one call when the first exceeds ``budget``)."""
    times, out = [], None
    for r in range(reps):
        t, out = timer(fn)
        times.append(t)
        if r == 0 and t > budget:
            break
    return statistics.median(times), len(times), out


def copy_bandwidth(n_bytes: int) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), median of 10 copies."""
    a = torch.empty(n_bytes // 4, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    times = [time_cuda(lambda: b.copy_(a))[0] for _ in range(10)]
    return 2 * a.numel() * 4 / statistics.median(times)


# ---- sections -----------------------------------------------------------------------------------------


def section_end_to_end(sizes: list[int], reps: int, cpu_budget: float, d: int) -> tuple[dict, list[dict], dict]:
    rows, raw = [], []
    facts: dict = {}
    warm = torch.from_numpy(anchors.gaussian_mixture(20_000, d, K, SEED + 1))
    for backend, data in (("cuda", warm.cuda()), ("cpu", warm)):
        capacity_kmeans(data, K, max_size=math.ceil(20_000 / K), n_init=1, max_iter=3, backend=backend)
    try:
        import faiss  # noqa: F401

        have_faiss = faiss.get_num_gpus() > 0
        faiss_note = (
            "faiss-gpu: unconstrained k-means (faiss.Kmeans, gpu=True), for reference."
            if have_faiss
            else "faiss imports but sees no GPU (a CPU-only build): skipped."
        )
    except Exception as exc:  # noqa: BLE001 - any import failure means "no faiss-gpu"
        have_faiss, faiss_note = False, f"faiss-gpu not importable here ({type(exc).__name__}): skipped."
    for n in sizes:
        x = anchors.gaussian_mixture(n, d, K, SEED)
        xt, xg = torch.from_numpy(x), torch.from_numpy(x).cuda()
        for factor in (1.0, 1.5):
            cap = anchors.capacity(n, K, factor)
            kw = dict(max_size=cap, n_init=N_INIT, max_iter=MAX_ITER, seed=SEED)
            run_gpu = functools.partial(capacity_kmeans, xg, K, backend="cuda", **kw)
            run_cpu = functools.partial(capacity_kmeans, xt, K, backend="cpu", **kw)
            t_gpu, reps_gpu, gpu = repeat(time_cuda, run_gpu, reps, 1e9)
            t_cpu, reps_cpu, cpu = repeat(time_cpu, run_cpu, reps, cpu_budget)
            same = bool(torch.equal(gpu.labels.cpu(), cpu.labels))
            dev = abs(gpu.inertia - cpu.inertia) / abs(cpu.inertia)
            sizes_ok = int(gpu.sizes.max()) <= cap
            label = f"{factor:g} N/K"
            rows.append(
                [
                    n,
                    f"{cap} ({label})",
                    "cuda",
                    t_gpu,
                    gpu.n_iter,
                    t_gpu / gpu.n_iter,
                    gpu.inertia,
                    t_cpu / t_gpu,
                    same and sizes_ok,
                ]
            )
            rows.append([n, f"{cap} ({label})", "cpu", t_cpu, cpu.n_iter, t_cpu / cpu.n_iter, cpu.inertia, 1.0, None])
            raw.append(
                {
                    "n": n,
                    "cap": cap,
                    "cuda_s": t_gpu,
                    "cuda_reps": reps_gpu,
                    "cpu_s": t_cpu,
                    "cpu_reps": reps_cpu,
                    "same_labels": same,
                    "inertia_rel_dev": dev,
                    "caps_met": sizes_ok,
                    "cuda_iters": gpu.n_iter,
                    "cpu_iters": cpu.n_iter,
                }
            )
            facts[(n, factor)] = raw[-1]
            print(
                f"n={n} cap={cap}: cuda {t_gpu:.3f}s cpu {t_cpu:.3f}s ({t_cpu / t_gpu:.1f}x) same labels {same}",
                flush=True,
            )
        if have_faiss:
            import faiss

            def run_faiss(x=x, n=n):
                km = faiss.Kmeans(d, K, niter=MAX_ITER, nredo=N_INIT, seed=SEED, gpu=True, verbose=False)
                km.train(x)
                return km

            t_f, _, km = repeat(time_cpu, run_faiss, reps, cpu_budget)
            rows.append([n, "none", "faiss-gpu", t_f, MAX_ITER, t_f / MAX_ITER, float(km.obj[-1]), None, None])
        else:  # torch's own matrix product + argmin, unconstrained, from the same first rows
            init = xg[:K].clone()
            t_t, _, out = repeat(time_cuda, lambda xg=xg, init=init: torch_lloyd(xg, init, MAX_ITER), reps, 1e9)
            rows.append([n, "none", "torch addmm+argmin", t_t, MAX_ITER, t_t / MAX_ITER, out[2], None, None])
        del xg, run_gpu
        torch.cuda.empty_cache()
    section = {
        "heading": f"capacity_kmeans end to end (Gaussian mixture, d={d}, K={K}, n_init={N_INIT}, "
        f"max_iter={MAX_ITER}, seed {SEED})",
        "columns": [
            "n",
            "max_size",
            "method",
            "median s",
            "iterations",
            "s / iteration",
            "inertia",
            "speed-up vs cpu",
            "same labels as cpu, caps met",
        ],
        "rows": rows,
        "notes": [
            f"Median of {reps} runs after an untimed warm-up (a CPU configuration slower than {cpu_budget:g} s on "
            "its first run is timed once; `raw` in the JSON has the counts).",
            "cuda: CUDA events around the call, data already on the GPU; cpu: wall clock, OpenMP on every core.",
            "Both paths stop at the same iteration (same decisions), so per-iteration times compare directly.",
            faiss_note,
            "Without faiss-gpu: torch addmm+argmin, unconstrained Lloyd iterations in plain torch (cuBLAS "
            "distances, argmin, index_add means) from the first K rows, as the reference for the GEMM-bound part.",
        ],
    }
    return section, raw, facts


def torch_lloyd(x: torch.Tensor, init: torch.Tensor, iters: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Unconstrained Lloyd iterations in plain torch (the reference where faiss-gpu is missing): distances
    ``|x|^2 - 2 x c^T + |c|^2`` by one matrix product (cuBLAS on a GPU), argmin, cluster means by index_add
    (an empty cluster keeps its centroid). Returns labels, centroids and the final objective."""
    c = init.clone()
    xn = (x * x).sum(1, keepdim=True)
    for _ in range(iters):
        dist = torch.addmm(xn, x, c.T, alpha=-2.0).add_((c * c).sum(1)[None, :])
        labels = dist.argmin(1)
        sums = torch.zeros_like(c).index_add_(0, labels, x)
        counts = torch.bincount(labels, minlength=len(c)).to(x.dtype)[:, None]
        c = torch.where(counts > 0, sums / counts.clamp_min(1), c)
    dist = torch.addmm(xn, x, c.T, alpha=-2.0).add_((c * c).sum(1)[None, :])
    best, labels = dist.min(1)
    return labels, c, float(best.clamp_min(0).sum())


def kernel_time_us(fn, name: str) -> tuple[float | None, str]:
    """Mean device time (microseconds) of the kernels whose name contains ``name`` in one call of fn."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        total, count = 0.0, 0
        for evt in prof.key_averages():
            if name in evt.key:
                t = getattr(evt, "self_device_time_total", None)
                if t is None:
                    t = getattr(evt, "self_cuda_time_total", 0.0)
                total += float(t)
                count += int(evt.count)
        if count == 0:
            return None, f"no {name} event in the profiler trace"
        return total / count, ""
    except Exception as exc:  # noqa: BLE001 - the profiler is optional here
        return None, f"profiler failed: {type(exc).__name__}: {exc}"


def section_distance_kernel(sizes: list[int], bandwidth: float, d: int) -> tuple[dict, list[dict], dict]:
    rows, raw, notes = [], [], []
    facts: dict = {}
    for n in sizes:
        x = torch.from_numpy(anchors.gaussian_mixture(n, d, K, SEED)).cuda()
        c = x[torch.randperm(n, device="cuda")[:K]].clone()
        call = functools.partial(assign_with_capacity, x, c, backend="cuda")  # unconstrained: one distance pass
        call()
        times = []
        why = ""
        for _ in range(3):
            t, why = kernel_time_us(call, "sqdist_tile_kernel")
            if t is not None:
                times.append(t)
        if not times:
            rows.append([n, None, None, None, None])
            notes.append(f"n={n}: not measured ({why}).")
            continue
        t_us = statistics.median(times)
        n_bytes = n * d * 4 + n * K * 8 + n * 8  # x read, D written, row norms read
        floor_bytes = n_bytes / bandwidth * 1e6
        floor_flops = 2 * n * K * d / FP32_PEAK * 1e6
        floor = max(floor_bytes, floor_flops)
        rows.append([n, t_us, floor_bytes, floor_flops, t_us / floor])
        raw.append(
            {"n": n, "kernel_us": t_us, "bytes": n_bytes, "floor_bytes_us": floor_bytes, "floor_flops_us": floor_flops}
        )
        facts[n] = t_us / floor
    section = {
        "heading": f"Distance kernel alone (sqdist_tile_kernel, float32, K={K}, d={d})",
        "columns": ["n", "kernel us", "bytes floor us", "FMA floor us", "x floor"],
        "rows": rows,
        "notes": [
            "Kernel time from the PyTorch profiler's CUDA activity trace of assign_with_capacity (median of 3 calls).",
            f"Bytes floor: read x and the row norms once, write D once, at the copy bandwidth measured in this run "
            f"({bandwidth / 1e12:.2f} TB/s, read + write). FMA floor: 2 n K d FLOP at {FP32_PEAK / 1e12:g} TFLOP/s.",
        ]
        + notes,
    }
    return section, raw, facts


# ---- main ---------------------------------------------------------------------------------------------


def write(out_dir: Path, result: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / OUT_NAME
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description="GPU benchmark of capacity-constrained K-means")
    parser.add_argument("--out", type=Path, required=True, help=f"directory for {OUT_NAME}")
    parser.add_argument("--smoke", action="store_true", help="one tiny size (exits 0 with a note without a GPU)")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per configuration (median)")
    parser.add_argument("--cpu-budget", type=float, default=25.0, help="seconds above which a CPU run is timed once")
    args = parser.parse_args()
    result = {
        "title": "Capacity-constrained K-means on the GPU (CUDA path)" + (" [smoke]" if args.smoke else ""),
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "command": COMMAND + (" --smoke" if args.smoke else ""),
        "sections": [],
        "targets": [],
    }
    if not torch.cuda.is_available() or not _backend.has_cuda_native():
        why = "no CUDA device" if not torch.cuda.is_available() else "cluster_kernels._C was built without CUDA"
        print(f"bench_kmeans_gpu: {why}; nothing measured (run it on a GPU machine after a CUDA build).")
        result["sections"].append(
            {"heading": "Skipped", "columns": ["reason"], "rows": [[why]], "notes": ["Nothing was measured."]}
        )
        result["skipped"] = why
        print(f"bench_kmeans_gpu: wrote {write(args.out, result)}")
        return 0

    sizes = [20_000] if args.smoke else [200_000, 1_000_000]
    d = 32 if args.smoke else D
    reps = 1 if args.smoke else args.reps
    failed = []
    raw: dict = {}
    bandwidth = copy_bandwidth(64 << 20 if args.smoke else 2 << 30)
    raw["copy_bandwidth_bytes_per_s"] = bandwidth
    e2e = dist = None
    for name, run in (
        ("end_to_end", lambda: section_end_to_end(sizes, reps, args.cpu_budget, d)),
        ("distance_kernel", lambda: section_distance_kernel(sizes, bandwidth, d)),
    ):
        try:
            section, section_raw, facts = run()
            result["sections"].append(section)
            raw[name] = section_raw
            if name == "end_to_end":
                e2e = facts
            else:
                dist = facts
        except Exception as exc:  # noqa: BLE001 - keep the other section's numbers
            traceback.print_exc()
            failed.append(name)
            result["sections"].append(
                {"heading": f"{name}: FAILED", "columns": ["error"], "rows": [[f"{type(exc).__name__}: {exc}"]]}
            )
        write(args.out, dict(result, raw=raw))  # partial results survive a kill by run_all.sh's time budget
    n_top = sizes[-1]
    if e2e:
        exact = e2e.get((n_top, 1.0))
        if exact:
            speed = exact["cpu_s"] / exact["cuda_s"]
            result["targets"].append(
                {
                    "goal": f"CUDA path >= 10x faster than the CPU path at n={n_top}, exact balance",
                    "measured": f"{speed:.1f}x ({exact['cuda_s']:.2f} s vs {exact['cpu_s']:.2f} s)",
                    "met": speed >= 10,
                }
            )
        all_same = all(v["same_labels"] and v["caps_met"] for v in e2e.values())
        worst = max(v["inertia_rel_dev"] for v in e2e.values())
        result["targets"].append(
            {
                "goal": "CUDA labels identical to the CPU path's, caps met, inertia within 1e-5",
                "measured": f"{'identical' if all_same else 'DIFFERENT'} labels, inertia deviation {worst:.1e}",
                "met": all_same and worst <= 1e-5,
            }
        )
    if dist and n_top in dist:
        result["targets"].append(
            {
                "goal": f"distance kernel within 2x of its memory floor at n={n_top}",
                "measured": f"{dist[n_top]:.2f}x the floor",
                "met": dist[n_top] <= 2.0,
            }
        )
    result["raw"] = raw
    print(json.dumps(result["sections"], indent=1))
    print(f"bench_kmeans_gpu: wrote {write(args.out, result)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
