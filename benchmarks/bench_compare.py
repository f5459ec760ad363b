"""End-to-end comparison: CluSTER vs full data, random, S2L, IFD and LESS, selection + training + held-out loss.

Run from the repository root::

    .venv/bin/python benchmarks/bench_compare.py                        # the issue's workload -> results/compare.json
    .venv/bin/python benchmarks/bench_compare.py --train-examples 400 --seeds 1 --out /tmp/c.json   # reduced scale

Workload (issue 6): the built-in standard-library code data set (:mod:`clusterlm.data.demo`, train split;
held-out split for evaluation minus the last ``--n-validation`` examples, LESS's validation set); the
base model ``tiny-llama-pretrained`` (:mod:`clusterlm.models.pretrain`: a short causal-LM pre-training on the
demo's ``pretrain.txt``, standard-library source disjoint from both splits; built once and cached under
the demo directory, its build time is not part of any method's time); ratio 0.31, world size 2 (two
gloo CPU ranks, or two GPUs), 3 seeds. All seven methods run side by side in one
:func:`clusterlm.compare` (same trainer, hyper-parameters, seeds and evaluation), resumable
in ``--work`` (a killed benchmark continues where it stopped).

Goals, from the measured means:

- cluster selection seconds <= 1/5 of the fastest of S2L, IFD, LESS;
- cluster total (selection + training at 31 %) <= 0.40 x full-data training, and <= 1.1 x random total;
- cluster held-out loss within 2 % of full data, and not above random's by more than random's std.

``--train-examples N`` runs at a reduced scale (the first N examples of the train split); the JSON
states the scale.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from _machine import machine_description

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "compare.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-llama-pretrained")
    p.add_argument("--ratio", type=float, default=0.31)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--methods", default="full,random,cluster,cluster-whole,cluster-paper,s2l,ifd,less")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--n-validation", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads per training rank")
    p.add_argument("--train-examples", type=int, default=None, help="reduced scale: first N train examples")
    p.add_argument("--work", default=str(ROOT / "runs" / "bench_compare"), help="compare's output dir (resumable)")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    return p


def _goal(goal: str, measured: str, met: bool | None) -> dict[str, Any]:
    return {"goal": goal, "measured": measured, "met": met}


def targets(summary: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's five goals from the per-method means (a goal whose methods did not run is not met: None).

    The ratios are :func:`clusterlm.comparison.statistics.goals`'s; this adds the wording, the inputs and the verdicts.
    """
    from clusterlm.comparison.statistics import goals

    g = goals(summary)
    out = []
    c = summary.get("cluster")
    base = [m for m in ("s2l", "ifd", "less") if m in summary]
    if c and base:
        fastest = min(base, key=lambda m: summary[m]["selection_s"])
        r = g["cluster_selection_over_fastest_baseline"]
        out.append(_goal("cluster selection time <= 1/5 of the fastest of s2l, ifd, less",
                         f"{c['selection_s']:.2f} s vs {fastest} {summary[fastest]['selection_s']:.2f} s = {r:.3f}x "
                         f"(s2l {summary.get('s2l', {}).get('selection_s', float('nan')):.1f} s, ifd "
                         f"{summary.get('ifd', {}).get('selection_s', float('nan')):.1f} s, less "
                         f"{summary.get('less', {}).get('selection_s', float('nan')):.1f} s)", r <= 0.2))
    if c and "full" in summary:
        f = summary["full"]
        r = g["cluster_total_over_full_train"]
        out.append(_goal("cluster (select + train at 31 %) total wall <= 0.40x full-data training",
                         f"{c['total_s']:.1f} s vs full {f['train_s']:.1f} s = {r:.3f}x", r <= 0.40))
        rel = g["cluster_loss_rel_to_full"]
        out.append(_goal("held-out loss of cluster @31 % within 2 % of full data",
                         f"{c['eval_loss']:.4f} ± {c['eval_loss_std']:.4f} vs full {f['eval_loss']:.4f} ± "
                         f"{f['eval_loss_std']:.4f}: {100 * rel:+.2f} %", rel <= 0.02))
    if c and "random" in summary:
        rd = summary["random"]
        r = g["cluster_total_over_random_total"]
        out.append(_goal("cluster total <= 1.1x random @31 % total",
                         f"{c['total_s']:.1f} s vs random {rd['total_s']:.1f} s = {r:.3f}x", r <= 1.1))
        diff = g["cluster_loss_minus_random"]
        out.append(_goal("held-out loss of cluster not worse than random @31 % beyond one standard deviation",
                         f"cluster {c['eval_loss']:.4f} - random {rd['eval_loss']:.4f} = {diff:+.4f}; random's std "
                         f"{rd['eval_loss_std']:.4f}", diff <= rd["eval_loss_std"]))
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from clusterlm.cli.commands import compare_config, compare_parser
    from clusterlm.comparison.run import compare
    from clusterlm.config.comparison import METHODS
    from clusterlm.data.demo import demo_data
    from clusterlm.models import load_model

    t_start = time.perf_counter()
    demo = demo_data()
    t0 = time.perf_counter()
    _, _, model_id = load_model(args.model)  # builds (pre-trains) a built-in once; not part of any method's time
    base_seconds = time.perf_counter() - t0
    pretrain_info = None
    info_path = demo.root / args.model / "pretrain.json"
    if info_path.is_file():
        pretrain_info = json.loads(info_path.read_text(encoding="utf-8"))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = str(demo.train)
    scale = "full demo train split"
    if args.train_examples:
        lines = demo.train.read_text(encoding="utf-8").splitlines(keepends=True)[: args.train_examples]
        subset = work / f"train_first{args.train_examples}.jsonl"
        subset.write_text("".join(lines), encoding="utf-8")
        data, scale = str(subset), f"reduced: first {len(lines)} examples of the demo train split"
    from clusterlm.cli.options import parse_config

    cargv = ["--data", data, "--eval-data", str(demo.heldout), "--model", args.model, "--ratio", str(args.ratio),
             "--world-size", str(args.world_size), "--methods", args.methods, "--seeds", str(args.seeds),
             "--out", str(work), "--epochs", str(args.epochs), "--micro-batch-size", str(args.micro_batch_size),
             "--lr", str(args.lr), "--max-length", str(args.max_length), "--n-validation", str(args.n_validation),
             "--threads", str(args.threads)]
    if args.max_steps:
        cargv += ["--max-steps", str(args.max_steps)]
    config = compare_config(parse_config(compare_parser(), cargv))  # what `clusterlm compare CARGV` runs
    result = compare(config).data
    summary = result["summary"]
    n_train = result["records"][0]["n_examples"] if result["records"] else 0
    cols = ["method", "fraction", "tokens trained", "selection s", "training s", "total s", "held-out loss", "seeds"]
    rows = [[m, round(r["fraction"], 4), f"{r['tokens']:,.0f}", f"{r['selection_s']:.2f} ± {r['selection_s_std']:.2f}",
             f"{r['train_s']:.1f} ± {r['train_s_std']:.1f}", f"{r['total_s']:.1f} ± {r['total_s_std']:.1f}",
             f"{r['eval_loss']:.4f} ± {r['eval_loss_std']:.4f}", r["seeds"]] for m, r in summary.items()]
    stage_rows = []
    for m in summary:
        recs = [r for r in result["records"] if r["method"] == m]
        keys = sorted({k for r in recs for k in r["timings"]})
        stage_rows.append([m, ", ".join(f"{k} {sum(r['timings'].get(k, 0.0) for r in recs) / len(recs):.2f}"
                                        for k in keys)])
    base_note = f"base model {model_id}"
    if pretrain_info:
        base_note += (f", pre-trained {pretrain_info['settings']['steps']} steps on {pretrain_info['tokens']:,} tokens "
                      f"of pretrain.txt in {pretrain_info['seconds']:.0f} s (held-out block loss "
                      f"{pretrain_info['eval_loss_before']:.3f} -> {pretrain_info['eval_loss_after']:.3f}); cached")
    cap = f", at most {args.max_steps} steps" if args.max_steps else ""
    out = {
        "title": "compare: CluSTER vs full data, random, S2L, IFD, LESS (selection + training + held-out loss)",
        "date": datetime.date.today().isoformat(),
        "machine": machine_description(
            f"{args.world_size} ranks x {args.threads} thread(s)", ["torch", "transformers", "peft"]
        ),
        "command": shlex.join(["python", "benchmarks/bench_compare.py", *(argv if argv is not None else sys.argv[1:])]),
        "sections": [
            {
                "heading": "Setup",
                "columns": ["setting", "value"],
                "rows": [
                    ["data", f"clusterlm demo ({scale}: {n_train} examples), max_length {args.max_length}; held-out "
                             f"split for evaluation minus its last {args.n_validation} examples (LESS's validation "
                             "set)"],
                    ["model", base_note],
                    ["training", f"clusterlm.train, {args.world_size} rank(s) x {args.threads} thread(s), "
                                 f"{args.epochs} epoch(s) over each selection{cap}, "
                                 f"micro-batch {args.micro_batch_size} per rank, AdamW lr {args.lr}, warm-up 3 %, "
                                 "cosine decay; identical for every method"],
                    ["methods", f"{', '.join(m for m in METHODS if m in summary)} at ratio {args.ratio}; seeds "
                                f"0..{args.seeds - 1} (selection and training seed)"],
                    ["timing", "selection = wall time of the selection call (features / forwards / proxy training / "
                               "LoRA warm-up / clustering), model and data loading excluded for all; training = "
                               "trainer's train_time_s (sum of the slowest rank's step times, no evaluation)"],
                    ["base model build", f"{base_seconds:.1f} s in this run (0 when cached), not counted"],
                ],
                "notes": [],
            },
            {"heading": "Results (mean ± std over seeds)", "columns": cols, "rows": rows,
             "notes": [f"full training = {summary['full']['train_s']:.1f} s" if "full" in summary else ""]},
            {"heading": "Selection stages (seconds, mean over seeds)", "columns": ["method", "stages"],
             "rows": stage_rows, "notes": []},
        ],
        "targets": targets(summary),
        "raw": {"config": vars(args), "compare": result, "pretrain": pretrain_info,
                "total_wall_s": time.perf_counter() - t_start},
    }
    return write_and_report(out, Path(args.out))


def write_and_report(out: dict[str, Any], path: Path) -> int:
    """Write a compare result file and print its goals with their verdicts; returns 0."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return print_targets(out, path)


def print_targets(out: dict[str, Any], path: Path) -> int:
    """Print a written result's goals with their verdicts; returns 0."""
    for t in out["targets"]:
        print(f"[{'met' if t['met'] else 'NOT met'}] {t['goal']}: {t['measured']}")
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
