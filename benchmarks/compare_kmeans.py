"""Capacity-constrained K-means on CPU, side by side with its anchors, measured in one run.

Full run (on a quiet machine; writes benchmarks/results/kmeans.json, then BENCHMARKS.md)::

    python benchmarks/compare_kmeans.py

Smoke run (seconds; writes outside benchmarks/results, so BENCHMARKS.md is left alone)::

    python benchmarks/compare_kmeans.py --sizes 2000 --repeats 1 --budget-s 120 --out /tmp/kmeans.json

Data: :func:`kmeans_anchors.gaussian_mixture` (d=128, K=8, unequal component sizes). For every n and
every cap ``max_size = ceil(f N/K)`` (f = 1.0, exact balance, and 1.5) it times ours
(``capacity_kmeans``, CPU backend), k-means-constrained (min-cost flow, same cap), the CluSTER
authors' recipe (sklearn KMeans n_init=10 + greedy re-assignment under the cap; docs/design.md section 1;
the authors' own setting is f = 1.5), and the unconstrained faiss-cpu and scikit-learn KMeans
(run once per n, shown in both cap sections). Ours, k-means-constrained, faiss and sklearn use the
same ``--n-init`` / ``--max-iter`` (default 3 / 50).

Each (method, n, cap) runs in its own process with ``--threads`` set for every threading library,
after an untimed warm-up on 2 000 points, for up to ``--repeats`` timed repetitions (median
reported); the process is killed when it passes ``--budget-s`` (reported as skipped with the time it
reached), fewer repetitions are run when they would not fit in the budget, and a size is not even
started when linear extrapolation from a smaller size already passes the budget. The script prints
the tables and the issue's targets with measured ratios, writes ``--out`` (format in
``render_benchmarks.py``; the extra key ``raw`` keeps every measurement) and, when ``--out`` is in
``benchmarks/results``, regenerates BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import kmeans_anchors as anchors
import render_benchmarks
from _machine import machine_description

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = render_benchmarks.RESULTS_DIR / "kmeans.json"
# Fastest first, so a budget-limited run reports the cheap methods before the slow ones.
METHOD_ORDER = ["ours", "faiss", "faiss-default", "sklearn", "cluster-recipe", "k-means-constrained"]
THREAD_ENV = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)
WARMUP_POINTS = 2000
# Another repetition is started only when elapsed + SAFETY * (slowest repetition) fits in the budget.
SAFETY = 1.25
# Targets of the issue.
SPEEDUP_VS_KMC = 100.0
INERTIA_SLACK_VS_KMC = 0.005
MAX_RATIO_VS_FAISS = 3.0
N_TARGET_KMC, N_TARGET_RECIPE, RECIPE_CAP = 20_000, 200_000, 1.5


def _log(msg: str) -> None:
    print(f"[compare_kmeans] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# worker: one (method, n, cap) in its own process


def _worker(spec: dict[str, Any]) -> None:
    """Generate the data, warm up, run the timed repetitions; one JSON line per repetition."""
    t_start = time.monotonic()
    method = anchors.METHODS[spec["method"]]
    n, d, k, f = spec["n"], spec["d"], spec["k"], spec["cap_factor"]
    kwargs: dict[str, Any] = {"n_init": spec["n_init"], "max_iter": spec["max_iter"], "seed": spec["seed"]}
    if spec["method"] == "k-means-constrained":
        # Its restarts in parallel processes are its only way to use the cores the others use.
        kwargs["n_jobs"] = max(1, min(spec["threads"], spec["n_init"]))
    if spec["method"] == "cluster-recipe":
        kwargs["cap_factor"] = f  # the authors' test is largest > f N/K, before rounding the cap up
    if spec["method"].startswith("faiss"):
        import faiss

        faiss.omp_set_num_threads(spec["threads"])
    x = anchors.gaussian_mixture(n, d, k, spec["seed"])
    # Untimed warm-up: lazy imports, thread pools and (k-means-constrained) its worker processes.
    w = min(n, WARMUP_POINTS)
    method.run(x[:w], k, w if f is None else anchors.capacity(w, k, f), **kwargs)
    max_size = n if f is None else anchors.capacity(n, k, f)
    times: list[float] = []
    with open(spec["result_path"], "a", encoding="utf-8") as out:
        for rep in range(spec["repeats"]):
            res = method.run(x, k, max_size, **kwargs)
            times.append(res.seconds)
            q = anchors.quality(x, res.labels, res.centroids, k, max_size)
            out.write(json.dumps({"rep": rep, "seconds": res.seconds, "quality": q, "info": res.info}) + "\n")
            out.flush()
            elapsed = time.monotonic() - t_start
            if rep + 1 < spec["repeats"] and elapsed + SAFETY * max(times) > spec["budget_s"]:
                note = (
                    f"{elapsed:.0f} s of the {spec['budget_s']:.0f} s budget used, the slowest took "
                    f"{max(times):.0f} s: no room for another"
                )
                out.write(json.dumps({"stopped": note}) + "\n")
                break


# ----------------------------------------------------------------------------------------------
# parent: schedule cells, enforce the budget


def _thread_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({name: str(threads) for name in THREAD_ENV})
    return env


def _run_cell(spec: dict[str, Any], budget_s: float, env: dict[str, str]) -> dict[str, Any]:
    """Run one (method, n, cap) in a child process; kill it (its whole process group) past the budget."""
    with tempfile.TemporaryDirectory(prefix="compare_kmeans_") as tmp:
        spec = dict(spec, result_path=str(Path(tmp) / "reps.jsonl"))
        stderr_path = Path(tmp) / "stderr.txt"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
        t0 = time.monotonic()
        with open(stderr_path, "w") as err:
            # A new session makes the child a process-group leader, so killing the group also ends
            # the processes it started (k-means-constrained's joblib workers).
            proc = subprocess.Popen(cmd, env=env, stdout=err, stderr=subprocess.STDOUT, start_new_session=True)
            killed = False
            try:
                proc.wait(timeout=budget_s)
            except subprocess.TimeoutExpired:
                killed = True
            except BaseException:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
            if killed:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        reached = time.monotonic() - t0
        lines = Path(spec["result_path"]).read_text().splitlines() if Path(spec["result_path"]).exists() else []
        records = [json.loads(line) for line in lines]
        stderr_tail = stderr_path.read_text(errors="replace").strip().splitlines()[-1:] or [""]
    reps = [r for r in records if "rep" in r]
    stopped = [r["stopped"] for r in records if "stopped" in r]
    cell: dict[str, Any] = {"wall_s": reached, "times": [r["seconds"] for r in reps], "reps_planned": spec["repeats"]}
    if reps:
        cell.update(
            status="ok", median_s=statistics.median(cell["times"]), quality=reps[0]["quality"], info=reps[0]["info"]
        )
        inertias = [r["quality"]["inertia"] for r in reps]
        if max(inertias) - min(inertias) > 1e-9 * abs(max(inertias)):
            cell["quality_note"] = f"inertia varied across repetitions ({min(inertias):.7g} .. {max(inertias):.7g})"
        if killed:
            cell["reps_note"] = (
                f"{len(reps)} of {spec['repeats']} repetitions: killed at the {budget_s:.0f} s budget during the next"
            )
        elif len(reps) < spec["repeats"]:
            cell["reps_note"] = f"{len(reps)} of {spec['repeats']} repetitions: {stopped[0] if stopped else ''}"
    elif killed:
        cell.update(
            status="skipped", lower_bound_s=reached, reason=f"skipped (> {budget_s:.0f} s, reached {reached:.0f} s)"
        )
    else:
        cell.update(status="failed", reason=f"failed (exit {proc.returncode}): {stderr_tail[0][:200]}")
    return cell


def _extrapolated_skip(cells: dict[tuple, dict], key: tuple, budget_s: float) -> dict[str, Any] | None:
    """A skip record when linear extrapolation from a smaller n of the same (method, cap) passes the budget."""
    method, n, f = key
    smaller = sorted((kn, c) for (km, kn, kf), c in cells.items() if km == method and kf == f and kn < n)
    for n0, c in reversed(smaller):
        # A skipped size gives a lower bound on its time, which is enough to skip a larger one.
        t0 = c.get("median_s") if c["status"] == "ok" else c.get("lower_bound_s")
        if t0 is None:
            continue
        predicted = t0 * n / n0
        if predicted > budget_s:
            return {
                "status": "skipped",
                "wall_s": 0.0,
                "times": [],
                "reps_planned": 0,
                "lower_bound_s": predicted,
                "reason": f"skipped (predicted >= {predicted:.0f} s > {budget_s:.0f} s budget: "
                f"{'>= ' if c['status'] == 'skipped' else ''}{t0:.0f} s at n={n0:,}, scaled linearly)",
            }
        return None
    return None


# ----------------------------------------------------------------------------------------------
# report


def _fmt_s(t: float) -> str:
    return f"{t:.3g}" if t < 1000 else f"{t:,.0f}"


def _fmt_inertia(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1e4 else f"{v:.6g}"


def _pct(a: float, b: float) -> str:
    return f"{100.0 * (a / b - 1.0):+.3f} %"


def _cap_text(f: float) -> str:
    """``N/K`` for f = 1, else ``1.5 N/K``."""
    return "N/K" if f == 1.0 else f"{f:g} N/K"


def _label(name: str, f: float | None) -> str:
    if name == "cluster-recipe" and f != RECIPE_CAP:
        return f"CluSTER greedy recipe at this cap (the authors use {_cap_text(RECIPE_CAP)})"
    if name == "cluster-recipe":
        return f"CluSTER recipe (official): sklearn n_init={anchors.RECIPE_N_INIT} + greedy cap"
    return anchors.METHODS[name].label


def _cell_for(cells: dict[tuple, dict], name: str, n: int, f: float) -> dict[str, Any] | None:
    return cells.get((name, n, f if anchors.METHODS[name].constrained else None))


def build_sections(args: argparse.Namespace, cells: dict[tuple, dict]) -> list[dict[str, Any]]:
    """The setup table, then one table per (n, cap)."""
    k = args.k
    sizes_text = "; ".join(
        f"n={n:,}: " + " / ".join(f"{s:,}" for s in anchors.component_sizes(n, k)) for n in args.sizes
    )
    kmc_jobs = max(1, min(args.threads, args.n_init))
    setup = {
        "heading": "Setup",
        "columns": ["setting", "value"],
        "rows": [
            [
                "data",
                f"gaussian_mixture: float32, d={args.d}, {k} isotropic unit-variance components, centres "
                f"{anchors.SEPARATION:g} noise sd apart on average, sizes geometric with largest/smallest = "
                f"{anchors.SIZE_RATIO:g}, seed {args.seed}",
            ],
            ["component sizes", sizes_text],
            [
                "ours, k-means-constrained, faiss, sklearn",
                f"n_init={args.n_init}, max_iter={args.max_iter}, "
                f"seed={args.seed}; tol 1e-4 where the method has one (faiss has none: it always runs max_iter)",
            ],
            [
                "CluSTER recipe",
                f"sklearn KMeans(k-means++, n_init={anchors.RECIPE_N_INIT}, max_iter={anchors.RECIPE_MAX_ITER}); "
                "when its largest cluster exceeds f N/K, a fresh identical KMeans is fitted and its points "
                f"greedily re-assigned under the cap ({anchors.RECIPE_N_NEAREST} nearest centroids per point; "
                "docs/design.md section 1); centroids not refitted",
            ],
            [
                "faiss",
                "random-sample init (faiss default); 'all points' raises max_points_per_centroid so all n "
                "points are clustered; 'default subsample' trains on 256 points per centroid, then labels all",
            ],
            ["k-means-constrained", f"n_jobs={kmc_jobs} (restarts in parallel processes, its only multi-core path)"],
            ["threads", f"{args.threads} for every method ({', '.join(THREAD_ENV[:3])}, ...)"],
            [
                "time",
                f"wall clock of the method call (data in, labels out); median of up to {args.repeats} "
                f"repetitions, each (method, n, cap) in a fresh process after an untimed warm-up on "
                f"{WARMUP_POINTS:,} points; budget {args.budget_s:.0f} s per (method, n, cap)",
            ],
            [
                "inertia",
                "sum of squared distances to the method's own centroids (the recipe: the not-refitted "
                "KMeans centroids, as the authors use them); 'means refit': to the means of its clusters",
            ],
        ],
        "notes": [],
    }
    columns = [
        "method",
        "time (s)",
        "reps",
        "time / ours",
        "inertia",
        "vs ours",
        "inertia, means refit",
        "vs ours (refit)",
        "max size",
        "min size",
        "capacity met",
    ]
    sections = [setup]
    for n in args.sizes:
        for f in args.cap_factors:
            cap = anchors.capacity(n, k, f)
            ours = _cell_for(cells, "ours", n, f) if "ours" in args.methods else None
            ours_ok = ours if ours and ours["status"] == "ok" else None
            rows, notes = [], []
            for name in args.methods:
                c = _cell_for(cells, name, n, f)
                label = _label(name, f)
                if c is None:
                    continue
                if c["status"] != "ok":
                    rows.append([label, c["reason"]] + ["–"] * (len(columns) - 2))
                    continue
                q = c["quality"]
                # Ratios to ours; ours' own row reads "ref".
                base = ours_ok if name != "ours" else None
                ref = "ref" if name == "ours" else "–"
                rows.append(
                    [
                        label,
                        _fmt_s(c["median_s"]),
                        str(len(c["times"])),
                        f"{c['median_s'] / base['median_s']:.3g}" if base else ref,
                        _fmt_inertia(q["inertia"]),
                        _pct(q["inertia"], base["quality"]["inertia"]) if base else ref,
                        _fmt_inertia(q["inertia_refit"]),
                        _pct(q["inertia_refit"], base["quality"]["inertia_refit"]) if base else ref,
                        f"{q['max_size']:,}",
                        f"{q['min_size']:,}",
                        "yes" if q["max_size"] <= cap else f"no (> {cap:,})",
                    ]
                )
                for key in ("reps_note", "quality_note"):
                    if key in c:
                        notes.append(f"{label}: {c[key]}")
                info = c.get("info", {})
                if name == "cluster-recipe":
                    limit = f"{_cap_text(f)} = {f * n / k:,.6g}"
                    notes.append(
                        f"{label}: first KMeans' largest cluster {info['largest_before']:,} "
                        + (
                            f"> {limit}: fresh KMeans + greedy re-assignment under {cap:,} ran"
                            if info["reassigned"]
                            else f"<= {limit}: no re-assignment needed"
                        )
                    )
                if name == "ours" and "reported_inertia" in info:
                    rel = abs(info["reported_inertia"] / q["inertia"] - 1.0)
                    if rel > 1e-4:
                        notes.append(
                            f"ours reports inertia {info['reported_inertia']:.7g}; measured here "
                            f"{q['inertia']:.7g} (relative difference {rel:.1e})"
                        )
            heading = f"n = {n:,}, d = {args.d}, K = {k}, max_size = ceil({_cap_text(f)}) = {cap:,}"
            heading += " (exact balance)" if f == 1.0 else ""
            sections.append({"heading": heading, "columns": columns, "rows": rows, "notes": notes})
    return sections


def _nearest(sizes: list[int], wanted: int) -> int:
    return wanted if wanted in sizes else min(sizes, key=lambda n: (abs(n - wanted), n))


def build_targets(args: argparse.Namespace, cells: dict[tuple, dict]) -> list[dict[str, Any]]:
    """The issue's targets with the ratios measured in this run (met / missed and by how much)."""
    targets = []

    def ok(name: str, n: int, f: float) -> dict[str, Any] | None:
        c = _cell_for(cells, name, n, f) if name in args.methods else None
        return c if c and c["status"] == "ok" else None

    def why_not(name: str, n: int, f: float) -> str:
        c = _cell_for(cells, name, n, f) if name in args.methods else None
        return f"{name}: " + (c["reason"] if c else "not run (see --methods)")

    def n_text(n: int, wanted: int) -> str:
        return f"n={n:,}" + ("" if n == wanted else f" (the issue's n={wanted:,} was not run)")

    n1 = _nearest(args.sizes, N_TARGET_KMC)
    for f in args.cap_factors:
        goal = (
            f"{n_text(n1, N_TARGET_KMC)}, cap ceil({_cap_text(f)}): ours >= {SPEEDUP_VS_KMC:.0f}x faster than "
            f"k-means-constrained, inertia within {100 * INERTIA_SLACK_VS_KMC:.1f} % of it or lower"
        )
        ours, kmc = ok("ours", n1, f), ok("k-means-constrained", n1, f)
        if ours and kmc:
            speed = kmc["median_s"] / ours["median_s"]
            excess = ours["quality"]["inertia"] / kmc["quality"]["inertia"] - 1.0
            met_speed, met_quality = speed >= SPEEDUP_VS_KMC, excess <= INERTIA_SLACK_VS_KMC
            measured = (
                f"{speed:.3g}x faster ({_fmt_s(ours['median_s'])} s vs {_fmt_s(kmc['median_s'])} s); "
                f"inertia {100 * excess:+.3f} % vs k-means-constrained"
            )
            if not met_speed:
                measured += f"; speed short by {SPEEDUP_VS_KMC / speed:.2f}x"
            if not met_quality:
                measured += f"; inertia {100 * (excess - INERTIA_SLACK_VS_KMC):.3f} points over the allowance"
            targets.append({"goal": goal, "measured": measured, "met": met_speed and met_quality})
        elif ours and (c := _cell_for(cells, "k-means-constrained", n1, f)) and c["status"] == "skipped":
            bound = c["lower_bound_s"] / ours["median_s"]
            targets.append(
                {
                    "goal": goal,
                    "met": False,
                    "measured": (
                        f"not verified: k-means-constrained {c['reason']}, so ours ({_fmt_s(ours['median_s'])} s) is "
                        f">= {bound:.3g}x faster, but its inertia is unknown"
                    ),
                }
            )
        else:
            targets.append(
                {
                    "goal": goal,
                    "met": False,
                    "measured": "not measured: "
                    + "; ".join(why_not(m, n1, f) for m in ("ours", "k-means-constrained") if not ok(m, n1, f)),
                }
            )

    n2 = _nearest(args.sizes, N_TARGET_RECIPE)
    if RECIPE_CAP in args.cap_factors:
        f = RECIPE_CAP
        goal = (
            f"{n_text(n2, N_TARGET_RECIPE)}, cap ceil({_cap_text(f)}): ours faster than the official CluSTER "
            f"recipe, with lower inertia"
        )
        ours, rec = ok("ours", n2, f), ok("cluster-recipe", n2, f)
        if ours and rec:
            speed = rec["median_s"] / ours["median_s"]
            diff = ours["quality"]["inertia"] / rec["quality"]["inertia"] - 1.0
            diff_refit = ours["quality"]["inertia_refit"] / rec["quality"]["inertia_refit"] - 1.0
            measured = (
                f"{speed:.3g}x faster ({_fmt_s(ours['median_s'])} s vs {_fmt_s(rec['median_s'])} s); "
                f"inertia {100 * diff:+.3f} % vs the recipe ({100 * diff_refit:+.3f} % with both "
                f"recipes' means refit)"
            )
            if speed <= 1.0:
                measured += f"; slower by {1 / speed:.2f}x"
            targets.append({"goal": goal, "measured": measured, "met": speed > 1.0 and diff < 0.0})
        else:
            targets.append(
                {
                    "goal": goal,
                    "met": False,
                    "measured": "not measured: "
                    + "; ".join(why_not(m, n2, f) for m in ("ours", "cluster-recipe") if not ok(m, n2, f)),
                }
            )

    for n in args.sizes:
        for f in args.cap_factors:
            goal = (
                f"n={n:,}, cap ceil({_cap_text(f)}): ours within {MAX_RATIO_VS_FAISS:g}x of faiss's unconstrained "
                f"time (all points, n_init={args.n_init}, max_iter={args.max_iter})"
            )
            ours, fa = ok("ours", n, f), ok("faiss", n, f)
            if ours and fa:
                ratio = ours["median_s"] / fa["median_s"]
                measured = f"ours {_fmt_s(ours['median_s'])} s = {ratio:.3g}x faiss's {_fmt_s(fa['median_s'])} s"
                if ratio > MAX_RATIO_VS_FAISS:
                    measured += f"; over by {ratio / MAX_RATIO_VS_FAISS:.2f}x"
                targets.append({"goal": goal, "measured": measured, "met": ratio <= MAX_RATIO_VS_FAISS})
            else:
                targets.append(
                    {
                        "goal": goal,
                        "met": False,
                        "measured": "not measured: "
                        + "; ".join(why_not(m, n, f) for m in ("ours", "faiss") if not ok(m, n, f)),
                    }
                )
    return targets


# ----------------------------------------------------------------------------------------------
# main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    p = argparse.ArgumentParser(description="Capacity-constrained K-means: ours vs anchors, side by side.")
    p.add_argument("--sizes", type=int, nargs="+", default=[20_000, 200_000], help="numbers of points n")
    p.add_argument("--methods", nargs="+", default=METHOD_ORDER, choices=METHOD_ORDER, help="methods to run")
    p.add_argument("--cap-factors", type=float, nargs="+", default=[1.0, 1.5], help="caps ceil(f N/K)")
    p.add_argument("--threads", type=int, default=cores, help="threads for every method (default: all cores)")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions per (method, n, cap); median")
    p.add_argument("--budget-s", type=float, default=600.0, help="wall-clock limit per (method, n, cap)")
    p.add_argument("--n-init", type=int, default=3, help="restarts of ours, k-means-constrained, faiss, sklearn")
    p.add_argument("--max-iter", type=int, default=50, help="iterations of ours, k-means-constrained, faiss, sklearn")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and of every method")
    p.add_argument("--d", type=int, default=128, help="dimension")
    p.add_argument("--k", type=int, default=8, help="clusters")
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="result JSON (rendered into BENCHMARKS.md when it is in benchmarks/results)",
    )
    p.add_argument("--no-render", action="store_true", help="do not regenerate BENCHMARKS.md")
    p.add_argument(
        "--no-extrapolate",
        action="store_true",
        help="run every size even when a smaller one predicts it passes the budget",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sizes = sorted(set(args.sizes))
    args.methods = [m for m in METHOD_ORDER if m in args.methods]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        try:
            _worker(json.loads(args.worker))
        except BaseException:
            traceback.print_exc()
            return 1
        return 0

    env = _thread_env(args.threads)
    cells: dict[tuple, dict] = {}
    t_run = time.monotonic()
    for n in args.sizes:
        for name in args.methods:
            method = anchors.METHODS[name]
            for f in args.cap_factors if method.constrained else [None]:
                key = (name, n, f)
                cap_text = "unconstrained" if f is None else f"cap {_cap_text(f)}"
                if importlib.util.find_spec(method.module) is None:
                    cells[key] = {
                        "status": "unavailable",
                        "times": [],
                        "wall_s": 0.0,
                        "reason": f"not installed ({method.module})",
                    }
                    _log(f"n={n:,} {name} {cap_text}: {cells[key]['reason']}")
                    continue
                skip = None if args.no_extrapolate else _extrapolated_skip(cells, key, args.budget_s)
                if skip:
                    cells[key] = skip
                else:
                    spec = {
                        "method": name,
                        "n": n,
                        "d": args.d,
                        "k": args.k,
                        "cap_factor": f,
                        "n_init": args.n_init,
                        "max_iter": args.max_iter,
                        "seed": args.seed,
                        "repeats": args.repeats,
                        "budget_s": args.budget_s,
                        "threads": args.threads,
                    }
                    cells[key] = _run_cell(spec, args.budget_s, env)
                c = cells[key]
                if c["status"] == "ok":
                    _log(
                        f"n={n:,} {name} {cap_text}: {c['median_s']:.3g} s (median of {len(c['times'])}; "
                        f"{c['wall_s']:.0f} s with setup)"
                    )
                else:
                    _log(f"n={n:,} {name} {cap_text}: {c['reason']}")

    cmd_args = list(argv) if argv is not None else sys.argv[1:]
    result = {
        "title": "Capacity-constrained K-means on CPU: ours vs k-means-constrained, the CluSTER recipe, faiss, "
        "scikit-learn",
        "date": datetime.date.today().isoformat(),
        "machine": machine_description(
            f"{args.threads} threads used",
            ["numpy", "scikit-learn", ("faiss-cpu", "faiss-gpu", "faiss"), "k-means-constrained", "ortools"],
        ),
        "command": shlex.join(["python", "benchmarks/compare_kmeans.py", *cmd_args]),
        "sections": build_sections(args, cells),
        "targets": build_targets(args, cells),
        "raw": {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "worker"},
            "total_wall_s": time.monotonic() - t_run,
            "cells": [{"method": m, "n": n, "cap_factor": f, **c} for (m, n, f), c in cells.items()],
        },
    }
    print(render_benchmarks.render_result(result, str(args.out)))

    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, args.out)
    _log(f"wrote {args.out}")
    if args.no_render:
        return 0
    if args.out.resolve().parent == render_benchmarks.RESULTS_DIR.resolve():
        _log(f"wrote {render_benchmarks.write()}")
    else:
        _log(f"BENCHMARKS.md not regenerated: {args.out} is outside {render_benchmarks.RESULTS_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
