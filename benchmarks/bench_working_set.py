"""The native auction on a working set against the auction on every row, over a long Lloyd run (issue 22).

Run from the repository root::

    python benchmarks/bench_working_set.py                                  # n = 200 000, d = 256, 30 iterations
    python benchmarks/bench_working_set.py --n 20000 --iters 12 --reps 1 --out /tmp/ws.json   # quick

A Lloyd loop on the mixture data of ``bench_kmeans_faiss.py`` (K = 64, cap ceil(1.5 N/K), the same initial
centroids): each iteration forms the float64 cost matrix ``|x|^2 + |c|^2 - 2 x c^T`` with the reference's
``sqdist_ref``, then runs the native auction (``cluster_kernels._C.auction_block``) on it twice, with the
working set and without (``working_set=False``), each warm-started from its own previous call, in alternating
order; the labels must be equal; the centroids are then updated as the reference does (``update_centroids_ref``:
cluster means). Times are per auction call, medians over ``--reps`` runs of the whole loop, grouped by
iterations. The first call (cold prices) is the same for both and is left out.

Writes ``--out`` (default ``benchmarks/results/working_set.json``, rendered into BENCHMARKS.md by
``render_benchmarks.py``) and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import render_benchmarks
from _machine import machine_description
from bench_kmeans_faiss import K, bounds, initial_centroids, make_data

DEFAULT_OUT = render_benchmarks.RESULTS_DIR / "working_set.json"
GROUP = 10  # iterations per row of the table


def run_loop(x: np.ndarray, hi: np.ndarray, iters: int, threads: int) -> dict[str, list]:
    """One Lloyd loop; per iteration the two auctions' seconds, the working-set statistics."""
    import torch

    import cluster_kernels._collectives as coll
    from cluster_kernels import _backend
    from cluster_kernels.kmeans_reference import sqdist_ref, update_centroids_ref

    native = _backend.native()
    if native is None:
        raise SystemExit("bench_working_set: cluster_kernels._C is not built (make install)")
    n = len(x)
    lo = np.zeros(K, np.int64)
    comm = coll.AuctionComm(coll.Comm(None))
    x64 = x.astype(np.float64)
    xt = torch.from_numpy(x64)
    c = initial_centroids(x64)
    states: dict[bool, tuple] = {True: (None, None), False: (None, None)}
    out: dict[str, list] = {"with": [], "every": [], "rows": [], "solves": [], "whole": []}
    for it in range(iters):
        cost = sqdist_ref(xt, torch.from_numpy(c)).numpy()
        got: dict[bool, Any] = {}
        for ws in (True, False) if it % 2 == 0 else (False, True):
            t0 = time.perf_counter()
            got[ws] = native.auction_block(cost, lo, hi, comm, 0, n, states[ws][0], None, threads, states[ws][1], ws)
            seconds = time.perf_counter() - t0
            out["with" if ws else "every"].append(seconds)
            states[ws] = (got[ws]["floor_prices"], got[ws]["working"])
        if not np.array_equal(got[True]["labels"], got[False]["labels"]):
            raise SystemExit(f"bench_working_set: iteration {it + 1}: the two auctions' labels differ")
        w = got[True]
        out["rows"].append(int(w["working"][0]) if w["working_calls"] and not w["working_whole"] else None)
        out["solves"].append(int(w["working_solves"]))
        out["whole"].append(bool(w["working_whole"]) or not w["working_calls"])
        labels = w["labels"]
        own = torch.from_numpy(cost[np.arange(n), labels])
        c = update_centroids_ref(xt, torch.from_numpy(labels), K, torch.from_numpy(c), own, False).numpy()
    return out


def result_of(args: argparse.Namespace, loops: list[dict[str, list]], n: int) -> dict[str, Any]:
    """The result file: per group of iterations, the median milliseconds per call of each auction."""
    iters = args.iters
    med = {key: [statistics.median(loop[key][i] for loop in loops) for i in range(iters)] for key in ("with", "every")}
    first = loops[0]
    rows = []
    for g0 in range(1, iters, GROUP):  # iteration 1 (index 0) is the cold call, the same for both
        g1 = min(g0 + GROUP, iters)
        a = sum(med["with"][g0:g1]) / (g1 - g0)
        b = sum(med["every"][g0:g1]) / (g1 - g0)
        sets = [r for r in first["rows"][g0:g1] if r is not None]
        rows.append([f"{g0 + 1}-{g1}", round(a * 1e3, 1), round(b * 1e3, 1), round(a / b, 3),
                     sum(first["whole"][g0:g1]), round(statistics.mean(sets) / n * 100, 1) if sets else None,
                     sum(first["solves"][g0:g1])])
    total_a, total_b = sum(med["with"][1:]), sum(med["every"][1:])
    rows.append([f"2-{iters}", round(total_a / (iters - 1) * 1e3, 1), round(total_b / (iters - 1) * 1e3, 1),
                 round(total_a / total_b, 3), sum(first["whole"][1:]), None, sum(first["solves"][1:])])
    ratio = total_a / total_b
    return {
        "title": "The auction on a working set against the auction on every row (issue 22)",
        "date": datetime.date.today().isoformat(),
        "machine": machine_description(f"{args.threads} threads (OpenMP)", ["numpy", "torch"]),
        "command": "python " + shlex.join(["benchmarks/bench_working_set.py", *sys.argv[1:]]),
        "sections": [{
            "heading": f"Mixture, n = {n:,}, d = {args.d}, K = {K}, cap ceil(1.5 N/K), {iters} Lloyd iterations",
            "columns": ["iterations", "working set (ms per call)", "every row (ms per call)", "ratio",
                        "calls on every row", "final set (% of rows, mean)", "solves on a set"],
            "rows": rows,
            "notes": [f"Medians over {args.reps} runs of the whole loop, the two auctions alternating on the same "
                      "cost matrices, each warm-started from its own previous call; labels equal at every "
                      "iteration. 'calls on every row': calls of the working-set auction that solved every row "
                      "(the call after the cold start, paused calls, and calls whose set grew past n/4); the "
                      "last three columns are from the first run."],
        }],
        "targets": [{"goal": f"the working set takes at most the time of the auction on every row over {iters} "
                             "iterations", "measured": f"{ratio:.3f}x", "met": ratio <= 1.0}],
        "raw": loops,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    if args.iters < 2:
        ap.error(f"--iters must be at least 2 (the first call is cold and left out); got {args.iters}")
    x = make_data("mixture", args.n, args.d, "float32")
    hi = np.full(K, bounds("cap", args.n)["max_size"], np.int64)
    loops = []
    for rep in range(args.reps):
        loops.append(run_loop(x, hi, args.iters, args.threads))
        print(f"[bench_working_set] run {rep + 1}/{args.reps}: working set {sum(loops[-1]['with'][1:]):.2f} s, "
              f"every row {sum(loops[-1]['every'][1:]):.2f} s", file=sys.stderr, flush=True)
    result = result_of(args, loops, args.n)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(render_benchmarks.render_result(result, str(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
