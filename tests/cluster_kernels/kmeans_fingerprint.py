"""Fingerprint of the native K-means and auction: every label, price and round count of a fixed case matrix.

A refactor of csrc/ that must not change any result saves the fingerprint before and compares after::

    .venv/bin/python tests/cluster_kernels/kmeans_fingerprint.py save /tmp/kmeans_before.npz
    # ... change the code, rebuild ...
    .venv/bin/python tests/cluster_kernels/kmeans_fingerprint.py compare /tmp/kmeans_before.npz

The matrix: the Lloyd loop (``_C.kmeans_cpu``) and the fixed-centroid assignment (``_C.assign_cpu``) on centred
data (rows used in place), off-centre data (the centred frame), float64 and cosine, for no bounds, caps, exact
balance and random lower and upper bounds, on 1, 2 and 3 threads, with and without the BLAS; the auction alone
(floor and general); warm sequences with and without the working set, on 1 to 3 threads; rows split over three
ranks (threads); and ``distributed_capacity_kmeans`` on three ranks. Bit-for-bit equality is required (floats
compared as bytes).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_auction_speedups import capacity_bounds, lloyd_like_costs  # noqa: E402
from test_distributed import _auction_instances, run_threads  # noqa: E402

import cluster_kernels._collectives as coll  # noqa: E402
from cluster_kernels import _backend, _blas, distributed_capacity_kmeans  # noqa: E402

C = _backend.native()


def _data(kind: str, n: int, d: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    comp = rng.choice(8, size=n, p=rng.dirichlet(np.full(8, 0.7)))
    x = rng.standard_normal((n, d)) + 2.0 * rng.standard_normal((8, d))[comp]
    if kind == "offset":
        x = x + 6.0  # |mean|^2 well above the spread: the centred frame
    return x.astype(np.float64 if kind == "float64" else np.float32)


def _bounds(kind: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    if kind == "none":
        return np.zeros(k, np.int64), np.full(k, n, np.int64)
    return capacity_bounds(kind, n, k, seed=3)


def kmeans_cases(out: dict) -> None:
    n, d, k = 4500, 24, 8
    for data in ("centred", "offset", "float64", "cosine"):
        x = _data(data, n, d, 1)
        for bkind in ("none", "cap", "exact", "both"):
            lo, hi = _bounds(bkind, n, k)
            for threads in (1, 2, 3):
                for use_blas in (True, False):
                    if not use_blas and threads == 2:
                        continue
                    key = f"km/{data}/{bkind}/t{threads}/blas{int(use_blas)}"
                    blas = _blas.gemm() if use_blas else None
                    with _blas.one_thread():
                        r = C.kmeans_cpu(x, k, lo, hi, data == "cosine", 2, 25, 1e-4, 7, None, threads, blas)
                        init = x[[3, 400, 900, 1500, 2100, 2900, 3300, 4100]] + 0.25
                        ri = C.kmeans_cpu(x, k, lo, hi, data == "cosine", 1, 25, 0.0, 0, init, threads, blas)
                        al, ad = C.assign_cpu(x, r["centroids"].astype(x.dtype), lo, hi, data == "cosine", threads,
                                              blas)
                    for tag, res in (("pp", r), ("init", ri)):
                        for f in ("labels", "centroids", "distances"):
                            out[f"{key}/{tag}/{f}"] = np.asarray(res[f])
                        out[f"{key}/{tag}/history"] = np.asarray(res["history"])
                        out[f"{key}/{tag}/counts"] = np.array(
                            [res["n_iter"], res["auction_rounds"], res["auction_pulls"], res["auction_pull_scans"],
                             res["auction_working_calls"], res["auction_working_solves"],
                             res["auction_working_whole"], res["auction_working_rows"], int(res["converged"])])
                        out[f"{key}/{tag}/inertia"] = np.array([res["inertia"]])
                    out[f"{key}/assign/labels"] = al
                    out[f"{key}/assign/distances"] = ad


def auction_cases(out: dict) -> None:
    for e, (cost, lo, hi) in enumerate(_auction_instances(0, 30)):
        for general in (False, True):
            labels, rounds, used = C.auction_assign(cost, lo, hi, general)
            out[f"auction/{e}/g{int(general)}/labels"] = labels
            out[f"auction/{e}/g{int(general)}/rounds"] = np.array([rounds, int(used)])


def _block(cost, lo, hi, state, working_set, threads, comm=None, offset=0, n_total=None):
    comm = coll.AuctionComm(comm if comm is not None else coll.Comm(None))
    return C.auction_block(cost, lo, hi, comm, offset, len(cost) if n_total is None else n_total,
                           state.get("floor"), state.get("general"), threads, state.get("working"), working_set)


def _record(out: dict, key: str, r: dict) -> dict:
    out[f"{key}/labels"] = r["labels"]
    out[f"{key}/floor"] = r["floor_prices"]
    out[f"{key}/general"] = r["general_prices"]
    out[f"{key}/counts"] = np.array([r["rounds"], int(r["used_general"]), r["pulls"], r["pull_scans"],
                                     r["working_calls"], r["working_solves"], r["working_whole"], *r["working"]])
    return {"floor": r["floor_prices"], "general": r["general_prices"], "working": r["working"]}


def warm_cases(out: dict) -> None:
    for seed, (kind, ties) in enumerate([("cap", False), ("cap", True), ("exact", False), ("both", False)]):
        n, k = 6000 + 97 * seed, 9 + seed
        lo, hi = capacity_bounds(kind, n, k, seed)
        costs = lloyd_like_costs(seed, n, k, 7, ties, dim=4, spread=1.5, drifts=(0.3, 0.3, 0.03))
        for working_set in (True, False):
            for threads in (1, 2, 3):
                state: dict = {}
                for step, cost in enumerate(costs):
                    key = f"warm/{seed}/ws{int(working_set)}/t{threads}/{step}"
                    state = _record(out, key, _block(cost, lo, hi, state, working_set, threads))


def rank_cases(out: dict) -> None:
    for e, (cost, lo, hi) in enumerate(_auction_instances(1, 18)):
        n = len(cost)
        cut = sorted(np.random.default_rng(n).integers(0, n + 1, size=2).tolist())
        edges = [0, *cut, n]

        def rank_fn(r, comm, edges=edges, cost=cost, lo=lo, hi=hi):
            s, t = edges[r], edges[r + 1]
            return _block(np.ascontiguousarray(cost[s:t]), lo, hi, {}, True, 0, comm, s, len(cost))

        parts = run_threads(3, rank_fn)
        for r, p in enumerate(parts):
            _record(out, f"ranks/{e}/{r}", p)
    # Warm sequences over ranks (the working set's distributed path).
    n, k = 6100, 10
    lo, hi = capacity_bounds("cap", n, k)
    costs = lloyd_like_costs(5, n, k, 5, False, dim=4, spread=1.5, drifts=(0.3, 0.3, 0.03))
    edges = [0, 2000, 4100, n]

    def warm_rank(r, comm):
        state: dict = {}
        got = []
        for cost in costs:
            s, t = edges[r], edges[r + 1]
            res = _block(np.ascontiguousarray(cost[s:t]), lo, hi, state, True, 0, comm, s, n)
            state = {"floor": res["floor_prices"], "general": res["general_prices"], "working": res["working"]}
            got.append(res)
        return got

    for r, seq in enumerate(run_threads(3, warm_rank)):
        for step, res in enumerate(seq):
            _record(out, f"warm_ranks/{r}/{step}", res)


def distributed_cases(out: dict) -> None:
    x = _data("offset", 3000, 12, 4).astype(np.float64)
    comms = threading.local()
    saved = coll.Comm
    coll.Comm = lambda group: comms.comm
    try:
        for kw in ({"max_size": 450}, {"min_size": 300, "max_size": 420}):
            def rank_fn(r, comm, kw=kw):
                comms.comm = comm
                s, t = [0, 900, 2100, 3000][r : r + 2]
                return distributed_capacity_kmeans(x[s:t], 8, n_init=1, max_iter=15, seed=3, progress=False, **kw)

            for r, res in enumerate(run_threads(3, rank_fn)):
                key = f"dist/{len(kw)}/{r}"
                out[f"{key}/labels"] = np.asarray(res.labels)
                out[f"{key}/centroids"] = np.asarray(res.centroids)
                out[f"{key}/history"] = np.asarray(res.history)
    finally:
        coll.Comm = saved


def fingerprint() -> dict:
    out: dict = {}
    for part in (kmeans_cases, auction_cases, warm_cases, rank_cases, distributed_cases):
        part(out)
        print(f"[fingerprint] {part.__name__}: {len(out)} arrays so far", file=sys.stderr, flush=True)
    return out


def compare(before: dict, after: dict) -> list[str]:
    bad = [f"missing: {key}" for key in before if key not in after]
    for key, want in before.items():
        got = after.get(key)
        if got is None:
            continue
        got = np.asarray(got)
        if got.shape != want.shape or got.dtype != want.dtype or got.tobytes() != want.tobytes():
            bad.append(f"differs: {key}")
    return bad


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] not in ("save", "compare"):
        print(__doc__)
        return 2
    if C is None:
        print("cluster_kernels._C is not built: run `make install` first", file=sys.stderr)
        return 2
    path = Path(sys.argv[2])
    now = fingerprint()
    if sys.argv[1] == "save":
        np.savez_compressed(path, **{k: np.asarray(v) for k, v in now.items()})
        print(f"saved {len(now)} arrays to {path}")
        return 0
    before = dict(np.load(path))
    bad = compare(before, now)
    for line in bad[:50]:
        print(line)
    print(f"{len(before)} arrays compared: {'all identical' if not bad else f'{len(bad)} differ'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
