"""Which within-cluster pick to make the default: every pick at equal tokens, against random, longest and IFD.

Run from the repository root::

    .venv/bin/python benchmarks/bench_quality.py                      # both stages -> results/quality.json
    .venv/bin/python benchmarks/bench_quality.py --stage demo         # stage 1 only (resumable)
    .venv/bin/python benchmarks/bench_quality.py --stage real         # stage 2, on stage 1's best picks
    .venv/bin/python benchmarks/bench_quality.py --report-only        # the result file from the units done so far
    .venv/bin/python benchmarks/bench_quality.py --smoke --work /tmp/q --out /tmp/q.json   # minutes: the code path

Every comparison is one :func:`clusterlm.compare` (the same trainer, settings, seeds and evaluation for every method)
at equal tokens (``--budget tokens``: every method selects ``--ratio`` of the training tokens, within one example per
cluster or rank), so a pick that prefers short or long examples is not rewarded for training on more or fewer tokens.

Stages (each resumable: a killed run continues with the units not done; the result file is written after each):

1. ``demo``: the demo base model (``tiny-llama-pretrained``, built once), all 3,815 demo training examples, 3 epochs,
   ratio 0.31, ``--seeds`` (5) seeds: random, longest, IFD, cluster (the ``farthest`` pick) and
   ``cluster[within_cluster=P]`` for every signal pick P (:mod:`clusterlm.selection.picking`). The picks share their
   features per seed (one featurization, charged to every unit that reads it). About 2.3 hours on 2 cores: 45 units
   of ~170 s (3 epochs at 31 % of the tokens, 2 gloo ranks), IFD's selection ~55 s a seed, and the base model's
   pre-training once (~7 min).
2. ``real``: SmolLM2-135M-Instruct (bench_real's setting: ``--real-train-examples`` drawn with seed 0 from the demo
   examples that fit ``--real-max-length`` tokens of its chat template, 1 epoch, lr 1e-4), ``--real-seeds`` (3) seeds:
   random, longest, cluster and the ``--real-picks`` (2) best picks of stage 1 by held-out loss (or ``--real-methods``).
   About 1 hour on 2 cores (15 units of ~3-4 minutes).

Held-out sets (compare's ``--eval-data NAME=PATH``, the first primary): ``heldout``, the demo held-out split (other
files of the standard library than the training functions), and ``thirdparty``: instructions made the same way
(:func:`clusterlm.data.demo.extract_functions`) from the functions of third-party packages installed beside clusterlm
(:data:`THIRD_PARTY`): another source than the training data. Examples that also occur in the training data are left
out (compare refuses them).

Each stage's table: per method the selected and trained tokens, the selection seconds (charged, as compare charges
them), the held-out loss on each set with the paired difference to random and to longest and its 95 % interval
(compare's two-level bootstrap over seeds and evaluation examples), and the seeds; the notes hold compare's
``verdict:`` lines. The regression row (``Selection time inside compare vs alone``): the cluster selection's feature
seconds inside compare against the same ``select()`` in this process on the same model, data and threads, after
compare (a compare that shared its CPUs with leftover processes charged 2x, BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import shlex
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_description  # noqa: E402
from bench_compare import print_targets  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "quality.json"
DEMO_MODEL, REAL_MODEL = "tiny-llama-pretrained", "smollm2-135m-instruct"
SIGNAL_PICKS = ("grad-norm", "loss", "rank-farthest-loss", "rank-farthest-grad-norm", "alternate-loss-farthest")
PICKS = tuple(f"cluster[within_cluster={p}]" for p in SIGNAL_PICKS)
DEMO_METHODS = ("random", "longest", "ifd", "cluster", *PICKS)
# Third-party packages that come with transformers and datasets (another source of code than the standard library)
THIRD_PARTY = ("packaging", "filelock", "tqdm", "huggingface_hub", "jinja2", "yaml", "requests", "urllib3", "fsspec")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", choices=("all", "demo", "real"), default="all")
    p.add_argument("--ratio", type=float, default=0.31)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per training rank")
    p.add_argument("--seeds", type=int, default=5, help="seeds of the demo stage")
    p.add_argument("--model", default=DEMO_MODEL, help="the demo stage's model")
    p.add_argument("--train-examples", type=int, default=None, help="demo stage: the first N training examples")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--max-steps", type=int, default=None, help="cap on steps per unit (smoke runs)")
    p.add_argument("--eval-max-examples", type=int, default=None, help="evaluated examples per set (smoke runs)")
    p.add_argument("--thirdparty-examples", type=int, default=256, help="examples of the third-party held-out set")
    p.add_argument("--real-seeds", type=int, default=3)
    p.add_argument("--real-picks", type=int, default=2, help="stage 1's best picks that stage 2 runs")
    p.add_argument("--real-methods", default="", help="stage 2's methods instead (comma list)")
    p.add_argument("--real-train-examples", type=int, default=256)
    p.add_argument("--real-eval-examples", type=int, default=48)
    p.add_argument("--real-max-length", type=int, default=256)
    p.add_argument("--real-epochs", type=int, default=1)
    p.add_argument("--real-lr", type=float, default=1e-4)
    p.add_argument("--real-micro-batch-size", type=int, default=4)
    p.add_argument("--work", default=str(ROOT / "runs" / "bench_quality"), help="compare's output dirs (resumable)")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--report-only", action="store_true", help="write --out from the units finished in --work")
    p.add_argument("--smoke", action="store_true",
                   help="the code path in minutes: tiny-llama, 300 examples, 2 seeds, 3 steps, 24 evaluated examples")
    p.add_argument("--note", action="append", default=[], help="a note under the first table (repeatable)")
    return p


def smoke(args: argparse.Namespace) -> argparse.Namespace:
    """The smoke configuration: every stage and table on a tiny scale (numbers mean nothing)."""
    return argparse.Namespace(**{**vars(args), "model": "tiny-llama", "train_examples": 300, "seeds": 2,
                                 "max_steps": 3, "eval_max_examples": 24, "thirdparty_examples": 48, "real_seeds": 2,
                                 "real_picks": 1, "real_train_examples": 48, "real_eval_examples": 16})


# ---- data ----------------------------------------------------------------------------------------------------------


def third_party_records(n: int, exclude: set[str], tokenizer: Any, max_length: int, chat: bool | None
                        ) -> tuple[list, dict]:
    """``n`` instruction records from :data:`THIRD_PARTY` (round robin over the packages, each in a fixed hash order),
    none also in the training data (``exclude``: compare's example hashes), each fitting ``max_length`` tokens."""
    from clusterlm.comparison.evaluation import example_hashes
    from clusterlm.data import load_data, read_data
    from clusterlm.data.demo import extract_functions

    site = Path(sysconfig.get_paths()["purelib"])
    pools, seen = [], set()
    for pkg in THIRD_PARTY:
        if not (site / pkg).is_dir():
            continue
        found, _, _ = extract_functions(site / pkg)
        items = [ex for exs in found.values() for ex in exs]
        items.sort(key=lambda ex: hashlib.sha256(f"{pkg}/{ex.path}:{ex.qualname}".encode()).hexdigest())
        pools.append([(pkg, {"prompt": ex.prompt, "response": ex.response}) for ex in items])
    picked: list[tuple[str, dict]] = []
    for i in range(max((len(p) for p in pools), default=0)):
        for pool in pools:
            if i < len(pool) and pool[i][1]["response"] not in seen:
                seen.add(pool[i][1]["response"])
                picked.append(pool[i])
    records = [r for _, r in picked]
    hashes = example_hashes(read_data(records))
    lengths = load_data(records, tokenizer, max_length=None, progress=False, chat_template=chat).lengths
    keep = [i for i, (h, t) in enumerate(zip(hashes, lengths, strict=True)) if h not in exclude and t <= max_length][:n]
    used = sorted({picked[i][0] for i in keep})
    return [records[i] for i in keep], {"examples": len(keep), "packages": used, "of": len(records),
                                        "tokens": int(np.asarray(lengths)[keep].sum())}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def demo_files(args: argparse.Namespace, work: Path) -> tuple[Path, Path, Path, dict[str, Any]]:
    """Stage 1's training file (all demo examples, or the first ``--train-examples``), the demo held-out split and
    the third-party set."""
    from clusterlm.comparison.evaluation import example_hashes
    from clusterlm.data import read_data
    from clusterlm.data.demo import demo_data

    demo = demo_data()
    train = demo.train
    if args.train_examples:
        lines = demo.train.read_text(encoding="utf-8").splitlines(keepends=True)[: args.train_examples]
        train = work / f"train_first{args.train_examples}.jsonl"
        train.write_text("".join(lines), encoding="utf-8")
    records = [json.loads(line) for line in train.read_text(encoding="utf-8").splitlines() if line.strip()]
    exclude = set(example_hashes(read_data(train)))
    tp, info = third_party_records(args.thirdparty_examples, exclude, demo.load_tokenizer(), args.max_length,
                                   None)  # compare's default rendering (auto)
    third = write_jsonl(work / f"thirdparty_{len(tp)}.jsonl", tp)
    return train, demo.heldout, third, {"train": {"file": str(train), "examples": len(records)}, "thirdparty": info}


def real_files(args: argparse.Namespace, work: Path) -> tuple[Path, Path, Path, dict[str, Any]]:
    """Stage 2's subsets (bench_real's rule: drawn with seed 0 among the examples that fit the chat template's
    ``--real-max-length``) and its third-party set (same rule)."""
    from bench_real import write_subsets

    from clusterlm.comparison.evaluation import example_hashes
    from clusterlm.data import read_data
    from clusterlm.models import load_model

    _, tokenizer, _ = load_model(REAL_MODEL)
    sub = argparse.Namespace(train_examples=args.real_train_examples, eval_examples=args.real_eval_examples,
                             n_validation=0, max_length=args.real_max_length)
    train, heldout, picked = write_subsets(sub, work, tokenizer)
    tp, info = third_party_records(args.thirdparty_examples, set(example_hashes(read_data(train))), tokenizer,
                                   args.real_max_length, True)
    return train, heldout, write_jsonl(work / f"thirdparty_{len(tp)}_chat.jsonl", tp), {**picked, "thirdparty": info}


# ---- the comparisons ------------------------------------------------------------------------------------------------


def run_compare(args: argparse.Namespace, work: Path, files: tuple[Path, Path, Path], methods: list[str], seeds: int,
                real: bool) -> dict[str, Any]:
    """``clusterlm compare`` at equal tokens on ``files`` (train, primary held-out, third-party) into ``work``."""
    from clusterlm.cli.commands import compare_config, compare_parser
    from clusterlm.cli.options import parse_config
    from clusterlm.comparison.run import compare

    train, heldout, third = files
    cargv = ["--data", str(train), "--eval-data", f"heldout={heldout}", "--eval-data", f"thirdparty={third}",
             "--model", REAL_MODEL if real else args.model, "--ratio", str(args.ratio), "--budget", "tokens",
             "--world-size", str(args.world_size), "--methods", ",".join(methods), "--seeds", str(seeds),
             "--out", str(work), "--threads", str(args.threads), "--n-validation", "0",
             "--epochs", str(args.real_epochs if real else args.epochs),
             "--micro-batch-size", str(args.real_micro_batch_size if real else args.micro_batch_size),
             "--lr", str(args.real_lr if real else args.lr),
             "--max-length", str(args.real_max_length if real else args.max_length)]
    if real:
        cargv += ["--chat-template", "on"]
    if args.max_steps:
        cargv += ["--max-steps", str(args.max_steps)]
    if args.eval_max_examples:
        cargv += ["--eval-max-examples", str(args.eval_max_examples)]
    return compare(compare_config(parse_config(compare_parser(), cargv))).data


def finished(work: Path) -> list[dict[str, Any]]:
    """The unit records of ``work``'s compare state with the settings of its newest record (per-example losses kept)."""
    from clusterlm.comparison.run import STATE, read_state

    records = read_state(work / STATE)
    newest = records[-1]["key"] if records else None
    return [r for r in records if r["key"] == newest]


def best_picks(records: list[dict[str, Any]], k: int) -> list[str]:
    """The ``k`` cluster methods (the farthest pick included) with the lowest mean primary held-out loss."""
    means = {}
    for m in ("cluster", *PICKS):
        losses = [r["eval_loss"] for r in records if r["method"] == m]
        if losses:
            means[m] = float(np.mean(losses))
    return sorted(means, key=means.get)[:k]


# ---- the tables -----------------------------------------------------------------------------------------------------


def _on_set(records: list[dict[str, Any]], name: str | None) -> list[dict[str, Any]]:
    """Records as :func:`clusterlm.comparison.statistics.delta_between` reads them, for evaluation set ``name``."""
    if name is None:
        return records
    return [{"seed": r["seed"], "eval_loss": r["eval_sets"][name]["eval_loss"],
             "eval_examples": r["eval_sets"][name].get("eval_examples")}
            for r in records if name in r.get("eval_sets", {})]


def _vs(records: list[dict[str, Any]], method: str, ref: str, name: str | None) -> str:
    from clusterlm.comparison.statistics import delta_between

    mine = _on_set([r for r in records if r["method"] == method], name)
    theirs = _on_set([r for r in records if r["method"] == ref], name)
    d = delta_between(mine, theirs) if method != ref else None
    return "–" if d is None else f"{d.delta:+.4f} [{d.low:+.4f}, {d.high:+.4f}]"


def stage_section(heading: str, records: list[dict[str, Any]], methods: list[str]) -> dict[str, Any] | None:
    """One stage's table (module docstring) and compare's verdicts as its notes."""
    from clusterlm.comparison.statistics import summarize, verdicts

    methods = [m for m in methods if any(r["method"] == m for r in records)]
    if not methods:
        return None
    summary = summarize(records, methods, ["heldout", "thirdparty"])
    rows = []
    for m, s in summary.items():
        loss = f"{s['eval_loss']:.4f} ± {s['eval_loss_std']:.4f}" if s["seeds"] > 1 else f"{s['eval_loss']:.4f}"
        tp = (s.get("eval_sets") or {}).get("thirdparty", {})
        sel = [r.get("selected_tokens", 0) for r in records if r["method"] == m]
        rows.append([m, f"{np.mean(sel):,.0f}", f"{s['tokens']:,.0f}", f"{s['selection_s']:.2f}", loss,
                     _vs(records, m, "random", None), _vs(records, m, "longest", None),
                     f"{tp['loss']:.4f}" if tp.get("loss") is not None else "–",
                     _vs(records, m, "random", "thirdparty"), s["seeds"]])
    best = min(summary, key=lambda m: summary[m]["eval_loss"])
    vs_longest = "" if best == "longest" else f"; vs longest {_vs(records, best, 'longest', None)}"
    notes = [f"lowest held-out loss at equal tokens: {best} ({summary[best]['eval_loss']:.4f}){vs_longest}"]
    notes += verdicts(summary)
    return {"heading": heading, "columns": ["method", "selected tokens", "tokens trained", "selection s",
                                            "held-out loss", "vs random [95 % CI]", "vs longest [95 % CI]",
                                            "third-party loss", "third-party vs random [95 % CI]", "seeds"],
            "rows": rows, "notes": notes}


def selection_alone(args: argparse.Namespace, train: Path, reps: int = 3) -> dict[str, Any]:
    """The cluster selection's feature seconds outside compare: ``select()`` in this process on the model and data
    of stage 1, with compare's selection threads, after compare's processes are gone (median of ``reps``)."""
    import torch

    from clusterlm.comparison.settle import wait_for_launched
    from clusterlm.config.comparison import method_config, parse_method
    from clusterlm.data import load_data
    from clusterlm.models import load_model
    from clusterlm.selection.select import select

    wait_for_launched()
    saved = torch.get_num_threads()
    torch.set_num_threads(args.world_size * args.threads)
    try:
        model, tokenizer, model_id = load_model(args.model, dtype="auto")
        data = load_data(str(train), tokenizer, max_length=args.max_length, progress=False, chat_template=None)
        seconds = []
        for seed in range(reps):
            with tempfile.TemporaryDirectory() as store:
                plan = select(model, data, method_config(parse_method("cluster"), args.world_size, args.ratio, seed,
                                                         "tokens"), model_id=model_id, progress=False,
                              feature_store=store)
            seconds.append(plan.timings["features"])
    finally:
        torch.set_num_threads(saved)
    return {"features_s": float(np.median(seconds)), "all": seconds, "threads": args.world_size * args.threads}


def selection_in_compare(args: argparse.Namespace, files: tuple[Path, Path, Path], reps: int = 3) -> dict[str, Any]:
    """The same cluster selection's feature seconds inside ``compare``, measured in this run right before
    :func:`selection_alone` (the machine's speed drifts between runs: only side-by-side seconds compare): compare
    with the cluster method alone, ``reps`` seeds (features computed per seed), one training step per unit."""
    with tempfile.TemporaryDirectory() as tmp:
        quick = argparse.Namespace(**{**vars(args), "max_steps": 1, "eval_max_examples": 8})
        run_compare(quick, Path(tmp), files, ["cluster"], reps, real=False)
        seconds = [r["timings"]["features"] for r in finished(Path(tmp)) if not r.get("features_reused")]
    return {"features_s": float(np.median(seconds)), "all": seconds}


def regression_section(records: list[dict[str, Any]], alone: dict[str, Any] | None,
                       inside: dict[str, Any] | None) -> tuple[dict, list[dict]]:
    """The cluster selection's feature seconds inside compare against the same selection alone, side by side in
    this run (and, for reference, in the study's units); its target: within 1.25x."""
    units = [r["timings"]["features"] for r in records
             if r["method"] in ("cluster", *PICKS) and not r.get("features_reused") and "features" in r["timings"]]
    ifd = [r["selection_s"] for r in records if r["method"] == "ifd"]
    rows = [["cluster features inside compare (measured beside the next row)",
             f"{inside['features_s']:.2f} s (median of {len(inside['all'])})" if inside else "–"],
            ["the same select() alone, same model, data and threads",
             f"{alone['features_s']:.2f} s (median of {len(alone['all'])}, {alone['threads']} threads)" if alone
             else "–"],
            ["cluster features in the study's units (other days, other load: for reference)",
             f"{np.median(units):.2f} s (median of {len(units)})" if units else "–"],
            ["IFD's selection inside compare (for scale)", f"{np.median(ifd):.2f} s" if ifd else "–"]]
    targets = []
    if inside and alone:
        ratio = inside["features_s"] / alone["features_s"]
        targets.append({"goal": "the cluster selection inside compare within 1.25x the same selection alone",
                        "measured": f"{inside['features_s']:.2f} s vs {alone['features_s']:.2f} s = {ratio:.2f}x",
                        "met": ratio <= 1.25})
    return {"heading": "Selection time inside compare vs alone", "columns": ["what", "feature seconds"],
            "rows": rows, "notes": ["compare waits for the previous unit's training processes (the launch's fork "
                                    "server) to exit before it times a selection; without that wait the first "
                                    "second of every selection shared the CPUs with them"]}, targets


def quality_target(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Whether stage 1's best signal pick beats the farthest pick with a resolved interval."""
    from clusterlm.comparison.statistics import delta_between

    best = next((m for m in best_picks(records, len(PICKS) + 1) if m != "cluster"), None)
    if best is None or not any(r["method"] == "cluster" for r in records):
        return []
    d = delta_between([r for r in records if r["method"] == best], [r for r in records if r["method"] == "cluster"])
    if d is None:
        return []
    return [{"goal": "a signal pick below the farthest pick's held-out loss at equal tokens (interval below 0)",
             "measured": f"{best} - cluster = {d.delta:+.4f} [{d.low:+.4f}, {d.high:+.4f}]", "met": bool(d.high < 0)}]


def write_result(args: argparse.Namespace, argv: list[str] | None, info: dict[str, Any], demo: list[dict[str, Any]],
                 real: list[dict[str, Any]], alone: dict[str, Any] | None, inside: dict[str, Any] | None,
                 t_start: float) -> dict[str, Any]:
    """Write ``--out`` from the units done so far (after each stage: a cut run still reports)."""
    demo_info, real_info = info.get("demo", {}), info.get("real", {})
    setup = [["budget", f"--budget tokens at ratio {args.ratio}: every method selects that share of the training "
                        "tokens"],
             ["demo stage", f"{args.model}, {demo_info.get('train', {}).get('examples', '?')} training examples, "
                            f"{args.epochs} epoch(s), micro-batch {args.micro_batch_size}, lr {args.lr}, max length "
                            f"{args.max_length}, seeds 0..{args.seeds - 1}"
                            + (f", at most {args.max_steps} steps" if args.max_steps else "")],
             ["real stage", f"{REAL_MODEL}, {args.real_train_examples} training examples that fit "
                            f"{args.real_max_length} tokens (seed 0), chat template, {args.real_epochs} epoch(s), lr "
                            f"{args.real_lr}, seeds 0..{args.real_seeds - 1}"],
             ["held-out sets", "heldout: the demo held-out split (other standard-library files; primary); thirdparty: "
                               "the same kind of instructions from third-party packages "
                               f"({', '.join((demo_info or real_info).get('thirdparty', {}).get('packages', []))})"
                               + (f", at most {args.eval_max_examples} evaluated per set" if args.eval_max_examples
                                  else "")],
             ["training", f"clusterlm.train, {args.world_size} ranks x {args.threads} thread(s), identical for every "
                          "method; selection s = compare's charge (features computed once per seed are charged to "
                          "every pick that reads them)"]]
    sections = [{"heading": "Setup", "columns": ["setting", "value"], "rows": setup, "notes": list(args.note)}]
    s1 = stage_section(f"Demo model at equal tokens ({args.seeds} seeds)", demo, list(DEMO_METHODS))
    if s1:
        sections.append(s1)
    s2 = stage_section(f"SmolLM2-135M-Instruct at equal tokens ({args.real_seeds} seeds)", real,
                       list(dict.fromkeys(r["method"] for r in real)))
    if s2:
        sections.append(s2)
    reg, reg_targets = regression_section(demo, alone, inside)
    sections.append(reg)
    out = {"title": "Within-cluster picks at equal tokens: gradient norm, loss and their combinations with the "
                    "distance (quality study)",
           "date": datetime.date.today().isoformat(),
           "machine": machine_description(f"{args.world_size} ranks x {args.threads} thread(s)",
                                          ["torch", "transformers"]),
           "command": shlex.join(["python", "benchmarks/bench_quality.py",
                                  *(argv if argv is not None else sys.argv[1:])]),
           "sections": sections, "targets": quality_target(demo) + reg_targets,
           "raw": {"config": vars(args), "data": info, "alone": alone, "inside": inside, "demo_records": demo,
                   "real_records": real, "total_wall_s": time.perf_counter() - t_start}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args = smoke(args)
    t_start = time.perf_counter()
    work = Path(args.work)
    (work / "demo").mkdir(parents=True, exist_ok=True)
    (work / "real").mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {}
    demo_paths = demo_files(args, work / "demo")
    info["demo"] = demo_paths[3]
    alone = inside = None
    if args.report_only and finished(work / "real"):  # the real stage's subsets, as its run described them
        info["real"] = real_files(args, work / "real")[3]
    if not args.report_only and args.stage in ("all", "demo"):
        run_compare(args, work / "demo", demo_paths[:3], list(DEMO_METHODS), args.seeds, real=False)
    demo = finished(work / "demo")
    if demo and (not args.report_only or args.stage != "real"):
        inside = selection_in_compare(args, demo_paths[:3])
        alone = selection_alone(args, demo_paths[0])
    write_result(args, argv, info, demo, finished(work / "real"), alone, inside, t_start)
    if not args.report_only and args.stage in ("all", "real"):
        methods = [m for m in args.real_methods.split(",") if m] or ["random", "longest", "cluster", *[
            m for m in best_picks(demo, args.real_picks + 1) if m != "cluster"][: args.real_picks]]
        real_paths = real_files(args, work / "real")
        info["real"] = real_paths[3]
        run_compare(args, work / "real", real_paths[:3], methods, args.real_seeds, real=True)
    out = write_result(args, argv, info, demo, finished(work / "real"), alone, inside, t_start)
    for section in out["sections"][1:]:
        print(f"\n{section['heading']}")
        for row in section["rows"]:
            print("  " + " | ".join(str(c) for c in row))
        for note in section["notes"]:
            print(f"  - {note}")
    return print_targets(out, Path(args.out))


if __name__ == "__main__":
    sys.exit(main())
