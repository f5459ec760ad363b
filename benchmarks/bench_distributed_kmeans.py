"""Distributed capacity K-means on CPU (gloo): wall time per Lloyd iteration, total, peak memory per process.

Full run (about 10 minutes on 2 cores; writes benchmarks/results/distributed_kmeans.json)::

    python benchmarks/bench_distributed_kmeans.py

Quick check (n = 100 000; writes /tmp/distributed_kmeans_small.json, BENCHMARKS.md is left alone)::

    python benchmarks/bench_distributed_kmeans.py --small

Data: a seeded Gaussian mixture with ``--k`` components (sizes geometric, largest = 4 x smallest, as
:func:`kmeans_anchors.gaussian_mixture`), float32, generated once in chunks into a ``.npy`` file under
``--data-dir`` and read by every process as a memory map (each process maps only its own rows). For every
configuration ``P x T`` (P processes of T threads; ``--configs``, default ``1x2`` and ``2x1``), P fresh
worker processes run :func:`cluster_kernels.distributed.distributed_capacity_kmeans` on their contiguous
row blocks (:func:`~cluster_kernels.distributed.shard_rows`) with ``max_size = ceil(cap N / K)``, gloo
between them (torch.distributed env:// rendezvous on 127.0.0.1), ``OMP_NUM_THREADS``/``MKL_NUM_THREADS``
and ``torch.set_num_threads`` set to T. Each worker reports the wall time of the call and of each Lloyd
iteration, auction rounds, collectives and bytes sent, its resident memory just before
the call and its peak (``VmHWM``), and writes its labels; the labels of the configurations are compared.

Targets (the issue's): peak resident memory per process below ``n d 4 / P`` bytes + 20 %; 2 processes of
1 thread within 1.2x the wall time of 1 process of 2 threads.

One process against the single-process K-means (n = 200 000 unless ``--n``; prints the medians and their
ratio, writes /tmp/distributed_kmeans_vs_single.json)::

    python benchmarks/bench_distributed_kmeans.py --vs-single --max-iter 10 --repeats 3

One fresh process of ``--threads`` (default 2) threads loads the data into memory and runs, ``--repeats``
times alternately (so load from other jobs hits both alike), ``capacity_kmeans(x, k, backend="cpu")`` and
``distributed_capacity_kmeans(x, k)`` without a process group, with the same ``max_size``, ``n_init=1``,
``max_iter``, ``seed`` and init (``--init rows``: the same ``k`` random rows, hence the same Lloyd
iterations; ``--init k-means++``: each its own seeding).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _machine import machine_description

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kmeans_anchors  # noqa: E402
import render_benchmarks  # noqa: E402

DEFAULT_OUT = render_benchmarks.RESULTS_DIR / "distributed_kmeans.json"
SEPARATION = 4.0  # mean distance between component centres, in noise standard deviations


# ----------------------------------------------------------------------------------------------
# data


def mixture_file(data_dir: Path, n: int, d: int, k: int, seed: int) -> Path:
    """A float32 ``(n, d)`` Gaussian mixture in ``data_dir`` (generated once, in 65 536-row chunks)."""
    path = data_dir / f"mixture_n{n}_d{d}_k{k}_s{seed}.npy"
    if path.exists():
        return path
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    centres = (rng.standard_normal((k, d)) * (SEPARATION / math.sqrt(2 * d))).astype(np.float32)
    component = rng.permutation(np.repeat(np.arange(k), kmeans_anchors.component_sizes(n, k)))
    tmp = path.with_suffix(".npy.tmp")
    x = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(n, d))
    for c, start in enumerate(range(0, n, 65536)):
        stop = min(n, start + 65536)
        noise = np.random.default_rng([seed, c]).standard_normal((stop - start, d), dtype=np.float32)
        x[start:stop] = centres[component[start:stop]] + noise
    x.flush()
    del x
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------------------------
# one worker process


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from cluster_kernels.distributed import distributed_capacity_kmeans, shard_rows

    if args.world > 1:
        torch.distributed.init_process_group("gloo", rank=args.rank, world_size=args.world)
    x = np.load(args.data, mmap_mode="r")
    n, _ = x.shape
    start, stop = shard_rows(n, args.world, args.rank)
    rss_before = _status_kb("VmRSS")
    t0 = time.perf_counter()
    res = distributed_capacity_kmeans(
        x[start:stop], args.k, max_size=math.ceil(args.cap * n / args.k), max_iter=args.max_iter, seed=0,
        progress=args.rank == 0,
    )
    wall = time.perf_counter() - t0
    np.save(Path(args.result).with_suffix(".labels.npy"), res.labels)
    out = {
        "rank": args.rank, "wall_s": wall, "rss_before_kb": rss_before, "peak_rss_kb": _status_kb("VmHWM"),
        "rows": stop - start, "n_iter": res.n_iter, "converged": res.converged, "inertia": res.inertia,
        "sizes": res.sizes.tolist(), **{k: v for k, v in res.stats.items()},
    }
    Path(args.result).write_text(json.dumps(out))
    if args.world > 1:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(args: argparse.Namespace, data: Path, procs: int, threads: int, work: Path) -> list[dict[str, Any]]:
    """Launch ``procs`` workers of ``threads`` threads; returns their reports in rank order."""
    port = _free_port()
    env_base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(procs))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env_base[var] = str(threads)
    load_before = os.getloadavg()[0]  # other jobs on a shared machine slow every configuration alike
    running = []
    for rank in range(procs):
        result = work / f"p{procs}t{threads}_r{rank}.json"
        cmd = [sys.executable, __file__, "--worker", "--rank", str(rank), "--world", str(procs), "--threads",
               str(threads), "--data", str(data), "--k", str(args.k), "--cap", str(args.cap), "--max-iter",
               str(args.max_iter), "--result", str(result)]
        env = dict(env_base, RANK=str(rank), LOCAL_RANK=str(rank))
        running.append((subprocess.Popen(cmd, env=env), result))
    for proc, _ in running:
        if proc.wait() != 0:
            for other, _ in running:
                other.kill()
            raise RuntimeError(f"bench_distributed_kmeans: a worker of {procs}x{threads} failed "
                               f"(exit {proc.returncode})")
    load_after = os.getloadavg()[0]
    return [json.loads(result.read_text()) | {"labels_file": str(result.with_suffix(".labels.npy")),
                                              "load_before": load_before, "load_after": load_after}
            for _, result in running]


# ----------------------------------------------------------------------------------------------
# one process: distributed_capacity_kmeans vs capacity_kmeans, side by side


def vs_single_worker(args: argparse.Namespace) -> None:
    """Time both calls on the same in-memory data and init, alternately; writes the walls to ``--result``."""
    import torch

    torch.set_num_threads(args.threads)
    from cluster_kernels import capacity_kmeans
    from cluster_kernels.distributed import distributed_capacity_kmeans

    x = np.ascontiguousarray(np.load(args.data), dtype=args.dtype)  # in memory: capacity_kmeans needs it there
    n = len(x)
    kw = {"max_size": math.ceil(args.cap * n / args.k), "max_iter": args.max_iter, "n_init": 1, "seed": 0}
    if args.init == "rows":  # the same k data rows for both: the same Lloyd iterations
        kw["init"] = x[np.random.default_rng(args.seed).choice(n, args.k, replace=False)] + 0.0
    calls = {
        "capacity_kmeans": lambda: capacity_kmeans(x, args.k, backend="cpu", **kw),
        "distributed_capacity_kmeans": lambda: distributed_capacity_kmeans(x, args.k, progress=False, **kw),
    }
    walls: dict[str, list[float]] = {name: [] for name in calls}
    cpus: dict[str, list[float]] = {name: [] for name in calls}
    results = {}
    for _ in range(args.repeats):
        for name, call in calls.items():  # alternately: load from other jobs hits both alike
            t0, c0 = time.perf_counter(), time.process_time()
            results[name] = call()
            walls[name].append(time.perf_counter() - t0)
            cpus[name].append(time.process_time() - c0)  # all threads; less sensitive to a shared machine
    a, b = results["capacity_kmeans"], results["distributed_capacity_kmeans"]
    out = {"walls": walls, "cpu_s": cpus, "n_iter": {name: r.n_iter for name, r in results.items()},
           "inertia": {name: r.inertia for name, r in results.items()},
           "labels_differing": int((np.asarray(a.labels) != np.asarray(b.labels)).sum())}
    Path(args.result).write_text(json.dumps(out))


def run_vs_single(args: argparse.Namespace, data: Path, work: Path) -> dict[str, Any]:
    """One fresh worker of ``--threads`` threads running :func:`vs_single_worker`; prints the medians."""
    result = work / "vs_single.json"
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(args.threads)
    cmd = [sys.executable, __file__, "--vs-single-worker", "--threads", str(args.threads), "--data", str(data),
           "--k", str(args.k), "--cap", str(args.cap), "--max-iter", str(args.max_iter), "--repeats",
           str(args.repeats), "--seed", str(args.seed), "--init", args.init, "--dtype", args.dtype,
           "--result", str(result)]
    subprocess.run(cmd, env=env, check=True)
    out = json.loads(result.read_text())
    med = {name: statistics.median(w) for name, w in out["walls"].items()}
    med_cpu = {name: statistics.median(w) for name, w in out["cpu_s"].items()}
    ratio = med["distributed_capacity_kmeans"] / med["capacity_kmeans"]
    ratio_cpu = med_cpu["distributed_capacity_kmeans"] / med_cpu["capacity_kmeans"]
    for name, w in out["walls"].items():
        print(f"{name:30s} median {med[name]:7.2f} s wall, {med_cpu[name]:7.2f} s CPU;  wall runs "
              f"{' '.join(f'{v:.2f}' for v in w)}  n_iter {out['n_iter'][name]}  inertia {out['inertia'][name]:.6g}")
    print(f"ratio distributed / capacity_kmeans (medians): {ratio:.2f}x wall, {ratio_cpu:.2f}x CPU; per-run wall "
          "ratios " + " ".join(f"{b / a:.2f}" for a, b in zip(out["walls"]["capacity_kmeans"],
                                                            out["walls"]["distributed_capacity_kmeans"], strict=True))
          + f"; labels differing: {out['labels_differing']}")
    return out | {"median_s": med, "median_cpu_s": med_cpu, "ratio": ratio, "ratio_cpu": ratio_cpu}


# ----------------------------------------------------------------------------------------------
# report


def _mb(kb: float) -> str:
    return f"{kb / 1024:,.0f}"


def build_report(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]], n: int, d: int) -> dict[str, Any]:
    data_bytes = n * d * 4
    rows, targets, comm_rows = [], [], []
    walls = {}
    for name, ranks in runs.items():
        procs = len(ranks)
        goal_kb = data_bytes / procs * 1.2 / 1024
        iters = ranks[0]["iteration_s"]
        wall = max(r["wall_s"] for r in ranks)
        walls[name] = wall
        peak = max(r["peak_rss_kb"] for r in ranks)
        rows.append([
            name, procs, ranks[0]["n_iter"], f"{statistics.median(iters):.2f}", f"{iters[0]:.2f}", f"{wall:.1f}",
            " / ".join(_mb(r["peak_rss_kb"]) for r in ranks), " / ".join(_mb(r["rss_before_kb"]) for r in ranks),
            _mb(goal_kb), peak < goal_kb, sum(ranks[0]["rounds"]),
            f"{ranks[0]['load_before']:.1f} / {ranks[0]['load_after']:.1f}",
        ])
        targets.append({
            "goal": f"{name}: peak memory per process below n*d*4/{procs} + 20 % = {_mb(goal_kb)} MB",
            "measured": f"largest peak {_mb(peak)} MB ({peak / goal_kb:.2f}x the goal); "
                        f"{_mb(max(r['rss_before_kb'] for r in ranks))} MB of it is the interpreter with torch",
            "met": bool(peak < goal_kb),
        })
        if procs > 1:
            per_iter_bytes = [b for b in ranks[0]["comm_bytes"]]
            per_iter_calls = [c for c in ranks[0]["collectives"]]
            comm_rows.append([
                name, f"{statistics.mean(per_iter_calls):.0f}", f"{max(per_iter_calls)}",
                f"{statistics.mean(per_iter_bytes) / 1024:,.0f}", f"{max(per_iter_bytes) / 1024:,.0f}",
                f"{(args.k * d + args.k) * 8 / 1024:,.0f}",
            ])
    if "2x1" in walls and "1x2" in walls:
        ratio = walls["2x1"] / walls["1x2"]
        targets.append({
            "goal": "2 processes x 1 thread within 1.2x the wall time of 1 process x 2 threads",
            "measured": f"{walls['2x1']:.1f} s vs {walls['1x2']:.1f} s: {ratio:.2f}x",
            "met": bool(ratio <= 1.2),
        })
    labels = {name: np.concatenate([np.load(r["labels_file"]) for r in ranks]) for name, ranks in runs.items()}
    names = list(labels)
    same_rows = []
    for other in names[1:]:
        diff = int((labels[other] != labels[names[0]]).sum())
        same_rows.append([f"{other} vs {names[0]}", diff, f"{diff / n:.2e}"])
        targets.append({
            "goal": f"identical labels on {other} and {names[0]} (the same result on any number of processes)",
            "measured": f"{diff} of {n:,} labels differ",
            "met": diff == 0,
        })
    setup = [
        ["data", f"Gaussian mixture, float32, n={n:,}, d={d}, {args.k} components (sizes geometric, largest = 4 x "
                 f"smallest), centres {SEPARATION:g} noise sd apart on average, seed {args.seed}; a .npy memory map"],
        ["K-means", f"k={args.k}, max_size=ceil({args.cap:g} N/K)={math.ceil(args.cap * n / args.k):,}, k-means++ "
                    f"on a {min(n, 256 * args.k):,}-row sample (default), n_init=1, max_iter={args.max_iter}, "
                    "tol=1e-4, seed 0, float64 arithmetic, chunks of 16 384 rows"],
        ["processes", "P x T = P worker processes of T threads (torch.set_num_threads, OMP/MKL_NUM_THREADS), gloo on "
                      "127.0.0.1, each a fresh interpreter; rank r holds rows shard_rows(n, P, r)"],
        ["wall time", "of the distributed_capacity_kmeans call (mean pass, init sample, Lloyd iterations, final "
                      "distances), slowest rank; per iteration: rank 0's"],
        ["memory", "VmHWM (peak resident set, file pages included) of each process; 'before' = VmRSS just before "
                   "the call (interpreter, torch, gloo)"],
    ]
    return {
        "title": f"Distributed capacity K-means on CPU (gloo): n = {n:,}, d = {d}, K = {args.k}",
        "date": datetime.date.today().isoformat(),
        "machine": machine_description("P processes x T threads, see Setup", ["torch", "numpy"]),
        "command": "python benchmarks/bench_distributed_kmeans.py " + " ".join(shlex.quote(a) for a in args.argv),
        "sections": [
            {"heading": "Setup", "columns": ["setting", "value"], "rows": setup, "notes": []},
            {
                "heading": f"Wall time and peak memory, cap {args.cap:g} N/K",
                "columns": ["configuration", "processes", "iterations", "median s / iteration", "first iteration s",
                            "total s", "peak RSS per process (MB)", "RSS before the call (MB)",
                            "goal per process (MB)", "memory goal met", "auction rounds",
                            "load average before / after"],
                "rows": rows,
                "notes": [
                    "The rows of the memory-mapped file are read in chunks into reused buffers and nothing of the "
                    "map stays resident; a process holds O(K) bytes per local row: its float64 row of the cost "
                    "matrix (8 K bytes), label and auction state (cluster_kernels/distributed.py, module "
                    "docstring).",
                    "Load average: the machine's 1-minute load when the configuration started / ended (the "
                    "machine is shared; with 2 cores, a load above 2 means the workers did not have their cores "
                    "to themselves).",
                ],
            },
            {
                "heading": "Communication per Lloyd iteration (rank 0)",
                "columns": ["configuration", "collectives (mean)", "collectives (max)", "KiB sent (mean)",
                            "KiB sent (max)", "centroid all-reduce alone (KiB)"],
                "rows": comm_rows,
                "notes": ["Bytes are what rank 0 hands to the collectives (all-reduce inputs, all-gather inputs "
                          "times the other ranks); see docs/scaling.md for the volume on paper."],
            },
            {"heading": "Labels across configurations", "columns": ["pair", "labels differing", "fraction"],
             "rows": same_rows, "notes": []},
        ],
        "targets": targets,
        "raw": runs,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="n = 100 000 and output outside benchmarks/results")
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--cap", type=float, default=1.5, help="max_size = ceil(cap N / K)")
    p.add_argument("--max-iter", type=int, default=20)
    p.add_argument("--seed", type=int, default=0, help="seed of the data")
    p.add_argument("--configs", default="1x2,2x1", help="comma-separated PxT (processes x threads)")
    p.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "clusterlm-bench")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--vs-single", action="store_true",
                   help="one process of --threads threads: distributed_capacity_kmeans vs capacity_kmeans on the same "
                        "data and init, --repeats times alternately (default n = 200 000); prints the medians")
    p.add_argument("--repeats", type=int, default=3, help="--vs-single: timed runs of each call")
    p.add_argument("--init", choices=["rows", "k-means++"], default="rows",
                   help="--vs-single: the same k random rows as init for both, or each call's own k-means++")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="--vs-single: the data's dtype (float64: capacity_kmeans's distances are float64 too)")
    # worker mode (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=None, help="--vs-single: threads of the one process (default 2)")
    p.add_argument("--vs-single-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", default="", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.small:
        args.n = 100_000
    if args.vs_single and "--n" not in args.argv:
        args.n = 200_000
    if args.threads is None:
        args.threads = 2 if args.vs_single or args.vs_single_worker else 1
    if args.out is None and args.vs_single:
        args.out = Path(tempfile.gettempdir()) / "distributed_kmeans_vs_single.json"
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "distributed_kmeans_small.json" if args.small else DEFAULT_OUT
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.vs_single_worker:
        vs_single_worker(args)
        return 0
    t0 = time.perf_counter()
    data = mixture_file(args.data_dir, args.n, args.d, args.k, args.seed)
    print(f"data: {data} ({time.perf_counter() - t0:.1f} s)", flush=True)
    if args.vs_single:
        with tempfile.TemporaryDirectory(prefix="bench_dkm_") as work:
            out = run_vs_single(args, data, Path(work))
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")
        return 0
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_dkm_") as work:
        for spec in args.configs.split(","):
            procs, threads = (int(v) for v in spec.lower().split("x"))
            t = time.perf_counter()
            runs[f"{procs}x{threads}"] = run_config(args, data, procs, threads, Path(work))
            print(f"{procs}x{threads}: {time.perf_counter() - t:.1f} s", flush=True)
        report = build_report(args, runs, args.n, args.d)
    for section in report["sections"][1:]:
        print("\n" + section["heading"])
        print(render_benchmarks.render_table(section["columns"], section["rows"]))
    print()
    for t in report["targets"]:
        print(("MET    " if t["met"] else "MISSED ") + t["goal"] + ": " + t["measured"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
