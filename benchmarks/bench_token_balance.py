"""Token balance across ranks: a token-balanced plan vs the plain cluster order, trained on 2 CPU ranks.

Run from the repository root::

    .venv/bin/python benchmarks/bench_token_balance.py                 # writes benchmarks/results/token_balance.json
    .venv/bin/python benchmarks/bench_token_balance.py --steps 10 --out /tmp/tb.json   # smoke

What is compared. One CluSTER feature extraction of the demo data set (``clusterlm.data.demo``, the
``tiny-llama`` model, world size 2, ratio 0.31, default preset) and two plans from the same features,
K-means and seed (:func:`clusterlm.selection.select.select_from_features`):

- ``token_balance=True`` (the default): rank token totals equalised by exchanging up to
  ``token_balance_slack`` of each cluster's pick for its next candidates, and a visit order in which the
  ranks hold examples of the same length quantile at every position (one shared random permutation of
  length-sorted lists, :func:`clusterlm.selection.allocation.visit_order`);
- ``token_balance=False`` ("plain cluster order"): the farthest picks as they are, every rank's list
  shuffled independently.

Both plans train every rank on its own cluster with the same weights; they share all but the few
exchanged examples (the count is printed in the table notes).

Each plan is trained by the reference trainer (:func:`clusterlm.train`, 2 gloo ranks, 1 thread each),
``--repeats`` times with the plans alternating, for ``--steps`` optimizer steps of
``--micro-batch-size`` examples per rank, without evaluation. From its ``metrics.jsonl``: per step and
rank the real (attention-mask) tokens and the padded tokens ``B x T_max`` (what the CPU computes), the
max/mean ratio of each across the ranks, and the step time (the slowest rank's, since DDP waits for
it) and the slowest rank's CPU time per step (its compute, without the waiting; robust to other load
on a shared machine). The plan's own prediction (:meth:`clusterlm.plan.Plan.step_token_ratio` over the whole epoch) is
shown next to it. The first ``--warmup`` steps of every run are left out of the time statistics
(allocator and thread warm-up).

The goal (issue 5): per-step max/mean token ratio <= 1.05 with ``token_balance=True``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _machine import machine_description

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "results" / "token_balance.json"
GOAL = 1.05


def make_plans(work: Path, ratio: float, max_length: int, seed: int) -> tuple[dict[str, Path], Any, dict[str, int]]:
    """Featurize once, save the token-balanced and the plain plan; returns their directories, the demo data
    and how many selected examples the two plans share (same rank)."""
    from clusterlm.data import load_data
    from clusterlm.data.demo import demo_data
    from clusterlm.models import load_model
    from clusterlm.selection.select import select, select_from_features

    demo = demo_data()
    model, tokenizer, model_id = load_model("tiny-llama")
    data = load_data(demo.train, tokenizer, max_length=max_length, progress=False)
    t0 = time.perf_counter()
    balanced, feats = select(model, data, world_size=2, ratio=ratio, seed=seed, token_balance=True, progress=False,
                             model_id=model_id, return_features=True)
    print(f"selection: {time.perf_counter() - t0:.1f} s, {balanced.n_selected} of {len(data)} examples", flush=True)
    plain = select_from_features(feats, world_size=2, ratio=ratio, lengths=data.lengths, seed=seed,
                                 token_balance=False, fingerprint=data.fingerprint(), model_id=model_id)
    dirs = {}
    for name, plan in (("token_balance", balanced), ("plain", plain)):
        plan.config["data"] = {"source": str(demo.train), "max_length": max_length}
        dirs[name] = plan.save(work / f"plan_{name}")
    shared = sum(len(np.intersect1d(a, b)) for a, b in zip(balanced.rank_indices, plain.rank_indices, strict=True))
    return dirs, demo, {"selected": balanced.n_selected, "shared": int(shared)}


def run_training(plan_dir: Path, out: Path, demo: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train 2 gloo ranks on the plan; returns the train records of metrics.jsonl."""
    from clusterlm import TrainConfig, train
    from clusterlm.launch.launcher import SpawnFailed
    from clusterlm.training.metrics import METRICS

    config = TrainConfig(plan=str(plan_dir), model="tiny-llama", data=str(demo.train), out=str(out),
                         max_length=args.max_length, max_steps=args.steps, micro_batch_size=args.micro_batch_size,
                         lr=1e-3, seed=args.seed, progress=False, save_model=False, log_every=max(1, args.steps // 4),
                         overwrite=True, nproc=2)
    try:
        train(config)
    except SpawnFailed as e:
        raise SystemExit(f"bench_token_balance: training on {plan_dir} failed with status {e.code}") from None
    lines = (out / METRICS).read_text(encoding="utf-8").splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def measure(records: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Per-step token ratios and step times from the trainer's records."""
    tokens = np.array([r["step_tokens"] for r in records], dtype=np.float64)
    padded = np.array([r["step_padded_tokens"] for r in records], dtype=np.float64)
    times = np.array([max(r["step_time"]) for r in records], dtype=np.float64)[warmup:]
    ratio = tokens.max(1) / tokens.mean(1)
    pratio = padded.max(1) / padded.mean(1)
    return {
        "steps": len(records),
        "ratio_mean": float(ratio.mean()), "ratio_p95": float(np.quantile(ratio, 0.95)),
        "ratio_max": float(ratio.max()),
        "padded_ratio_mean": float(pratio.mean()), "padded_ratio_p95": float(np.quantile(pratio, 0.95)),
        "step_time_mean": float(times.mean()), "step_time_median": float(np.median(times)),
        "tokens_per_s": float(tokens[warmup:].sum() / times.sum()),
        "final_loss": records[-1]["loss"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per plan")
    p.add_argument("--micro-batch-size", type=int, default=8, help="examples per rank and step")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the time statistics")
    p.add_argument("--repeats", type=int, default=2, help="training runs per plan, alternating the plans")
    p.add_argument("--ratio", type=float, default=0.31)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from clusterlm.plan import Plan

    with tempfile.TemporaryDirectory(prefix="bench_tb_") as tmp:
        work = Path(tmp)
        dirs, demo, overlap = make_plans(work, args.ratio, args.max_length, args.seed)
        runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in dirs}
        # Alternate the two plans (A B A B ...) so that drifting load on a shared machine hits both alike.
        for rep in range(args.repeats):
            for name, plan_dir in dirs.items():
                runs[name].append(run_training(plan_dir, work / f"run_{name}_{rep}", demo, args))
        results = {}
        for name, plan_dir in dirs.items():
            predicted = Plan.load(plan_dir).step_token_ratio(args.micro_batch_size)
            per_run = [measure(records, args.warmup) for records in runs[name]]
            assert all(r["ratio_mean"] == per_run[0]["ratio_mean"] for r in per_run)  # same steps every repeat
            times = np.concatenate([[max(r["step_time"]) for r in records[args.warmup:]] for records in runs[name]])
            cpu = np.concatenate([[max(r["step_cpu_time"]) for r in records[args.warmup:]] for records in runs[name]])
            tokens = sum(sum(sum(r["step_tokens"]) for r in records[args.warmup:]) for records in runs[name])
            results[name] = {**per_run[0], "step_time_mean": float(times.mean()), "step_cpu_mean": float(cpu.mean()),
                             "step_time_median": float(np.median(times)), "tokens_per_s": float(tokens / times.sum()),
                             "step_time_mean_per_repeat": [r["step_time_mean"] for r in per_run],
                             "plan_ratio_mean": float(predicted.mean()), "plan_ratio_max": float(predicted.max())}
            print(name, json.dumps(results[name]), flush=True)

    tb, plain = results["token_balance"], results["plain"]
    cols = ["visit order", "steps", "tokens max/mean (mean)", "p95", "max", "padded max/mean (mean)",
            "plan's prediction (mean over the epoch)", "step time mean (s)", "step time median (s)",
            "slowest rank's CPU time per step (s)", "tokens/s", "loss at the last step"]

    def row(label: str, r: dict[str, Any]) -> list[Any]:
        return [label, r["steps"], round(r["ratio_mean"], 4), round(r["ratio_p95"], 4), round(r["ratio_max"], 4),
                round(r["padded_ratio_mean"], 4), round(r["plan_ratio_mean"], 4), round(r["step_time_mean"], 4),
                round(r["step_time_median"], 4), round(r["step_cpu_mean"], 4), round(r["tokens_per_s"], 1),
                round(r["final_loss"], 4)]

    speedup = plain["step_time_mean"] / tb["step_time_mean"]
    cpu_speedup = plain["step_cpu_mean"] / tb["step_cpu_mean"]
    result = {
        "title": "Token balance across ranks: token-balanced visit order vs plain cluster order (2 CPU ranks)",
        "date": datetime.date.today().isoformat(),
        "machine": machine_description("2 ranks x 1 thread", ["torch", "transformers"]),
        "command": shlex.join(["python", "benchmarks/bench_token_balance.py", *(argv if argv is not None
                                                                                 else sys.argv[1:])]),
        "sections": [
            {
                "heading": "Setup",
                "columns": ["setting", "value"],
                "rows": [
                    ["data", f"clusterlm demo train split ({demo.train.name}), max_length {args.max_length}"],
                    ["selection", f"CluSTER default preset, tiny-llama features, world size 2, ratio {args.ratio}, "
                                  f"seed {args.seed}; one feature extraction and K-means, token_balance on / off; "
                                  f"{overlap['shared']} of {overlap['selected']} selected examples shared (same rank)"],
                    ["training", f"python -m torch.distributed.run --nproc-per-node 2 -m clusterlm train (gloo, 1 "
                                 f"thread per rank), {args.steps} steps, micro-batch {args.micro_batch_size} per rank, "
                                 "AdamW lr 1e-3, no evaluation"],
                    ["step time", f"slowest rank's wall time per optimizer step, pooled over {args.repeats} runs of "
                                  f"each plan, the plans alternating (A B A B); the first {args.warmup} steps of each "
                                  "run excluded"],
                ],
                "notes": [],
            },
            {
                "heading": f"Per-step tokens across ranks and step time ({args.micro_batch_size} examples per rank "
                           "and step)",
                "columns": cols,
                "rows": [row("token_balance=True", tb), row("plain cluster order", plain)],
                "notes": [
                    "tokens = real (attention-mask) tokens of a rank's step; padded = micro-batch size x longest "
                    "sequence, what the CPU computes. Ratios are max over ranks / mean over ranks, per step.",
                    "CPU time: process CPU seconds of a rank's step (forward, backward, optimizer; waiting for the "
                    "other rank costs little CPU), the slowest rank's per step: a load-independent measure of "
                    "the straggler cost, since other processes on a shared machine stretch wall times.",
                    f"slowest-rank CPU time plain / token-balanced = {cpu_speedup:.3f}; wall step time plain / "
                    f"token-balanced = {speedup:.3f}; wall per run (s): token-balanced "
                    f"{[round(t, 3) for t in tb['step_time_mean_per_repeat']]}, plain "
                    f"{[round(t, 3) for t in plain['step_time_mean_per_repeat']]}",
                ],
            },
        ],
        "targets": [
            {
                "goal": f"token_balance=True: per-step max/mean token ratio across ranks <= {GOAL}",
                "measured": f"mean {tb['ratio_mean']:.4f}, p95 {tb['ratio_p95']:.4f}, max {tb['ratio_max']:.4f} over "
                            f"{tb['steps']} steps (plain order: mean {plain['ratio_mean']:.4f}); step time "
                            f"{tb['step_time_mean']:.3f} s vs {plain['step_time_mean']:.3f} s plain "
                            f"({speedup:.2f}x wall), slowest rank's CPU time {tb['step_cpu_mean']:.3f} s vs "
                            f"{plain['step_cpu_mean']:.3f} s ({cpu_speedup:.2f}x)",
                "met": bool(tb["ratio_mean"] <= GOAL),
            }
        ],
        "raw": {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "results": results},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_name(args.out.name + ".tmp")
    tmp_out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp_out, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
