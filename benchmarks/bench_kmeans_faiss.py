"""Lloyd iterations of ``capacity_kmeans`` (CPU) side by side with faiss, and the cost of the capacities (issue 22).

Run from the repository root (``make bench`` runs it)::

    python benchmarks/bench_kmeans_faiss.py                      # n=200 000 d=256 and n=1 000 000 d=1 024, K=64
    python benchmarks/bench_kmeans_faiss.py --small --out /tmp/k.json   # n=200 000 only, quick

Every configuration runs in its own process with ``--threads`` set for OpenMP, OpenBLAS and faiss. Same data,
same initial centroids (K rows drawn with a fixed seed), 10 Lloyd iterations without early stop (``tol=0``;
ours also stops if no label changes, faiss never), medians of ``--reps`` repetitions that alternate ours and
faiss. faiss: ``faiss.Kmeans(d, K, niter=10, max_points_per_centroid=n)`` trained on all points from the same
centroids, plus the final assignment (``index.search``), unconstrained (faiss has no capacities; float32 only).
One repetition at n = 1 000 000 and for exact balance (whose auction dominates its time).
Per-iteration times divide each call's wall time by its iterations. The phase breakdown (ms per iteration) is
read from the extension's own timers (``cluster_kernels._C.kmeans_cpu(...)["seconds"]``) in one extra call.
Peak memory: the worker's resident high-water mark less the input array.

Writes ``--out`` (default ``benchmarks/results/kmeans_faiss.json``, rendered into BENCHMARKS.md by
``render_benchmarks.py``) and prints the table with every goal marked met or missed by how much.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import render_benchmarks
from _machine import machine_description

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = render_benchmarks.RESULTS_DIR / "kmeans_faiss.json"
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
K, ITERS = 64, 10
# name -> (data, bounds, dtype)
CONFIGS = {
    "random, no capacity": ("random", "none", "float32"),
    "random, cap ceil(1.5 N/K)": ("random", "cap", "float32"),
    "mixture, no capacity": ("mixture", "none", "float32"),
    "mixture, cap ceil(1.5 N/K)": ("mixture", "cap", "float32"),
    "mixture, exact balance": ("mixture", "exact", "float32"),
    "mixture, float64, no capacity": ("mixture", "none", "float64"),
    # Rows far from the origin: the K-means works in the centred frame (formed per distance tile, never copied).
    "offset, no capacity": ("offset", "none", "float32"),
}
GOAL_FAISS, GOAL_CAP, GOAL_EXACT, GOAL_F64 = 1.2, 1.3, 2.0, 2.0


def make_data(kind: str, n: int, d: int, dtype: str):
    """Random normal rows (``offset``: shifted by 3 in every column), or a 64-component Gaussian mixture with
    Dirichlet(0.7) component sizes."""
    import numpy as np

    rng = np.random.default_rng(0)
    if kind in ("random", "offset"):
        x = rng.standard_normal((n, d), dtype=np.float32)
        if kind == "offset":
            x += np.float32(3.0)
    else:
        comp = rng.choice(K, size=n, p=rng.dirichlet(np.full(K, 0.7)))
        x = rng.standard_normal((n, d), dtype=np.float32)
        x += (rng.standard_normal((K, d)) * 0.5).astype(np.float32)[comp]
    return x.astype(dtype, copy=False)


def initial_centroids(x):
    """The K rows every method starts from (a fixed draw)."""
    import numpy as np

    return x[np.random.default_rng(1).choice(len(x), K, replace=False)].copy()


def bounds(kind: str, n: int) -> dict[str, int]:
    if kind == "cap":
        return {"max_size": math.ceil(1.5 * n / K)}
    if kind == "exact":
        return {"min_size": n // K, "max_size": math.ceil(n / K)}
    return {}


def _ours(x, init, kw: dict[str, int]) -> tuple[float, int]:
    from cluster_kernels import capacity_kmeans

    t0 = time.perf_counter()
    res = capacity_kmeans(x, K, init=init, n_init=1, max_iter=ITERS, tol=0.0, backend="cpu", **kw)
    return time.perf_counter() - t0, res.n_iter


def _faiss(x, init) -> float:
    import faiss

    t0 = time.perf_counter()
    km = faiss.Kmeans(x.shape[1], K, niter=ITERS, max_points_per_centroid=len(x), verbose=False)
    km.train(x, init_centroids=init)
    km.index.search(x, 1)
    return time.perf_counter() - t0


def _phases(x, init, kw: dict[str, int]) -> dict[str, float]:
    """ms per iteration of each phase (prepare and finish: ms per call), from the extension's timers."""
    import numpy as np

    from cluster_kernels import _backend, _blas

    n = len(x)
    lo = np.full(K, kw.get("min_size", 0), np.int64)
    hi = np.full(K, kw.get("max_size", n), np.int64)
    with _blas.one_thread():
        out = _backend.native().kmeans_cpu(x, K, lo, hi, False, 1, ITERS, 0.0, 0, init, 0, _blas.gemm())
    per_call = ("prepare", "init", "finish")
    return {k: 1e3 * v / (1 if k in per_call else out["n_iter"]) for k, v in out["seconds"].items()}


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration: warm-up, interleaved repetitions of ours and faiss, phases, peak memory."""
    kind, bkind, dtype = CONFIGS[spec["config"]]
    n, d = spec["n"], spec["d"]
    x = make_data(kind, n, d, dtype)
    init = initial_centroids(x)
    kw = bounds(bkind, n)
    faiss_ok = dtype == "float32" and spec["faiss"]
    if faiss_ok:
        import faiss

        faiss.omp_set_num_threads(spec["threads"])
    w = min(n, 20_000)
    _ours(x[:w], init, bounds(bkind, w))  # untimed warm-up: thread pools, page faults of the code
    ours, theirs, iters = [], [], 0
    for _ in range(spec["reps"]):
        t, iters = _ours(x, init, kw)
        ours.append(t / iters)
        if faiss_ok:
            theirs.append(_faiss(x, init) / ITERS)
    phases = _phases(x, init, kw)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - x.nbytes
    return {"ours_s_per_iter": statistics.median(ours), "faiss_s_per_iter": statistics.median(theirs) if theirs
            else None, "iters": iters, "reps": len(ours), "phases_ms": phases, "peak_bytes_beyond_x": peak}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, **{name: str(spec["threads"]) for name in THREAD_ENV})
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ratio_goal(goal: str, ratio: float | None, limit: float, detail: str) -> dict[str, Any]:
    if ratio is None:
        return {"goal": goal, "measured": "not measured", "met": False}
    verdict = "met" if ratio <= limit else f"missed by {ratio / limit:.2f}x"
    return {"goal": goal, "measured": f"{ratio:.2f}x ({detail}); {verdict}", "met": ratio <= limit}


def targets(results: dict[tuple, dict[str, Any]], sizes: list[tuple[int, int]], threads: list[int]) -> list[dict]:
    """The goals of issue 22, each with the measured ratio."""
    out = []

    def per_iter(n, d, t, config, key="ours_s_per_iter"):
        return results.get((n, d, t, config), {}).get(key)

    for n, d in sizes:
        for t in threads:
            ours, faiss = per_iter(n, d, t, "random, no capacity"), per_iter(n, d, t, "random, no capacity",
                                                                            "faiss_s_per_iter")
            ratio = ours / faiss if ours and faiss else None
            out.append(_ratio_goal(f"unconstrained per iteration <= {GOAL_FAISS}x faiss (n={n}, d={d}, {t} thr)",
                                   ratio, GOAL_FAISS, f"{ours or 0:.3f} s vs {faiss or 0:.3f} s"))
    n, d = sizes[0]
    t = threads[-1]
    base = per_iter(n, d, t, "mixture, no capacity")
    for config, limit in (("mixture, cap ceil(1.5 N/K)", GOAL_CAP), ("mixture, exact balance", GOAL_EXACT),
                          ("mixture, float64, no capacity", GOAL_F64)):
        got = per_iter(n, d, t, config)
        ratio = got / base if got and base else None
        out.append(_ratio_goal(f"{config} <= {limit}x our float32 unconstrained (n={n}, {t} thr)", ratio, limit,
                               f"{got or 0:.3f} s vs {base or 0:.3f} s"))
    return out


def sections(results: dict[tuple, dict[str, Any]]) -> list[dict[str, Any]]:
    rows, phase_rows = [], []
    order = list(CONFIGS)
    for (n, d, t, config), r in sorted(results.items(), key=lambda kv: (*kv[0][:3], order.index(kv[0][3]))):
        if "error" in r:
            rows.append([n, d, t, config, None, None, None, None, f"failed: {r['error']}"])
            continue
        f = r["faiss_s_per_iter"]
        rows.append([n, d, t, config, r["ours_s_per_iter"], r["iters"], f, r["ours_s_per_iter"] / f if f else None,
                     f"{r['peak_bytes_beyond_x'] / 2**20:.0f} MiB"])
        ph = r["phases_ms"]
        phase_rows.append([n, d, t, config] + [ph.get(k) for k in ("distance", "auction", "objective", "update",
                                                                   "prepare", "finish")])
    return [
        {"heading": f"Seconds per Lloyd iteration, K={K}, {ITERS} iterations from the same centroids",
         "columns": ["n", "d", "threads", "data and capacity", "ours s/iter", "our iterations", "faiss s/iter",
                     "ours / faiss", "peak memory beyond x"], "rows": rows,
         "notes": ["faiss is unconstrained (no capacities) and float32 only: its time is the reference for every "
                   "row of the same data.", "Medians of interleaved repetitions (one at n = 1 000 000 and for exact "
                   "balance), each configuration in its own process; peak memory = resident high-water mark of that "
                   "process less the input array (a centred copy of x when one is made, the distance tiles or the "
                   "cost matrix, the centroid sums).", "Rows kept with --keep come from the earlier command in the "
                   "header. Compare ratios (ours and faiss come from the same process), not seconds across runs: "
                   "this shared 2-core machine's speed varies by up to 2x between days."]},
        {"heading": "Where an iteration goes (ours, ms per iteration; prepare and finish: ms per call)",
         "columns": ["n", "d", "threads", "data and capacity", "distance", "auction", "objective", "update",
                     "prepare", "finish"], "rows": phase_rows,
         "notes": ["From the extension's phase timers. distance: the distance tiles (one GEMM each) and, without "
                   "capacities, the fused argmin and cluster sums; auction: the capacity auction on the stored cost "
                   "matrix; update: the centroids (with capacities, after their own pass summing the rows)."]},
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--small", action="store_true", help="n=200 000 only")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--reps", type=int, default=3, help="repetitions at n=200 000 (1 at n=1 000 000)")
    ap.add_argument("--configs", default=";".join(CONFIGS), help="configurations (names), separated by ';'")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--sizes", default="200000x256,1000000x1024",
                    help="n x d, comma-separated (every --configs at the first, 'random, no capacity' at the others)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the rows already in --out (measured earlier) and measure only the missing ones")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    try:
        import faiss  # noqa: F401

        have_faiss = True
    except ImportError:
        have_faiss = False
        print("bench_kmeans_faiss: faiss is not installed (pip install -e '.[bench]'): ours only", file=sys.stderr)
    threads = [int(t) for t in args.threads.split(",")]
    sizes = [tuple(int(v) for v in size.split("x")) for size in args.sizes.split(",")]
    sizes = sizes[:1] if args.small else sizes
    results = _kept(args.out) if args.keep else {}
    command = _command(args)  # before the partial writes below replace the earlier command in --out
    for i, (n, d) in enumerate(sizes):
        configs = args.configs.split(";") if i == 0 else ["random, no capacity"]
        for t in threads:
            for config in configs:
                if "error" not in results.get((n, d, t, config), {"error": ""}):
                    continue  # measured earlier (--keep)
                reps = 1 if n > 200_000 or CONFIGS[config][1] == "exact" else args.reps
                spec = {"config": config, "n": n, "d": d, "threads": t, "faiss": have_faiss, "reps": reps}
                results[(n, d, t, config)] = run(spec)
                print(f"[bench_kmeans_faiss] n={n} d={d} threads={t} {config}: {results[(n, d, t, config)]}",
                      file=sys.stderr, flush=True)
                write(args, results, sizes, threads, command)  # partial results survive a kill
    result = write(args, results, sizes, threads, command)
    print(render_benchmarks.render_result(result, str(args.out)))
    return 0


def _command(args: argparse.Namespace) -> str:
    """This run's command line; with ``--keep``, after the earlier ones whose rows it kept."""
    this = "python " + shlex.join(["benchmarks/bench_kmeans_faiss.py", *sys.argv[1:]])
    if args.keep and args.out.is_file():
        earlier = json.loads(args.out.read_text()).get("command", "")
        if earlier and this not in earlier.split("; then "):
            return f"{earlier}; then {this}"
    return this


def _kept(out: Path) -> dict[tuple, dict[str, Any]]:
    """The rows an earlier run wrote to ``out`` (``--keep``)."""
    if not out.is_file():
        return {}
    raw = json.loads(out.read_text()).get("raw") or []
    return {(r["n"], r["d"], r["threads"], r["config"]): r["result"] for r in raw}


def write(args: argparse.Namespace, results: dict[tuple, dict[str, Any]], sizes: list[tuple[int, int]],
          threads: list[int], command: str) -> dict[str, Any]:
    """The result file of the configurations measured so far (with the rows kept from earlier runs)."""
    sizes = sorted({*sizes, *((n, d) for n, d, _, _ in results)})
    threads = sorted({*threads, *(t for _, _, t, _ in results)})
    result = {"title": "Capacity K-means per Lloyd iteration vs faiss (issue 22)",
              "date": datetime.date.today().isoformat(),
              "machine": machine_description(f"{args.threads} threads (OpenMP, OpenBLAS, faiss)",
                                             ["faiss-cpu", "numpy", "torch"]),
              "command": command,
              "sections": sections(results), "targets": targets(results, sizes, threads),
              "raw": [{"n": n, "d": d, "threads": t, "config": c, "result": r} for (n, d, t, c), r in results.items()]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(main())
