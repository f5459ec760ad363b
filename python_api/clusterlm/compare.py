"""``clusterlm compare``: every selection method through the same trainer and evaluation, side by side.

Run::

    clusterlm compare --model tiny-llama-pretrained --ratio 0.31 --world-size 2 --seeds 3 --out runs/compare
    clusterlm compare --data train.jsonl --eval-data heldout.jsonl --model /models/llama --methods random,cluster

Methods (``--methods``, comma-separated; default all):

- ``full``: all data (:func:`clusterlm.baselines.full_plan`);
- ``random``: uniform sample at the budget (:func:`clusterlm.baselines.random_plan`);
- ``cluster``: CluSTER, the ``default`` preset (:func:`clusterlm.select.select`);
- ``cluster-whole``: CluSTER, the ``default`` preset with whole-example features (``feature_tokens="all"``
  instead of the 64-token feature window: what the window costs in quality, and saves in time);
- ``cluster-tokens``: CluSTER, the ``default`` preset with a token budget (``token_ratio=--ratio``: the
  same share of the *tokens*, not of the examples; training cost follows tokens);
- ``cluster-paper``: CluSTER, the ``paper`` preset: the authors' selection as their code runs it (sklearn
  K-means and their greedy 1.5 N / K cap, :mod:`clusterlm.paper`);
- ``cluster-paper-exact``: the ``paper`` preset on this library's exact capacity K-means
  (``clustering="exact"``): the same steps, the cap met exactly;
- ``s2l`` / ``ifd`` / ``less``: :mod:`clusterlm.baselines.s2l`, :mod:`.ifd`, :mod:`.less`.

For every ``(method, seed)``: the selection runs in this process on the loaded model and is timed
(wall clock of the selection call: everything a method needs — features, forwards, proxy training,
LoRA warm-up, clustering; model and data loading, common to all methods, are not counted); its plan
is saved to ``OUT/runs/<method>-s<seed>/plan`` and trained by the reference trainer
(:func:`clusterlm.train.launch`, ``--nproc`` = world size) with identical hyper-parameters, seed and
held-out data for every method; training seconds = the trainer's ``train_time_s`` (the sum over steps
of the slowest rank's step time: training proper, without model loading and evaluation); total =
selection + training. Held-out loss = the trainer's final token-weighted answer loss on the
evaluation data (default: the demo held-out split minus the last ``--n-validation`` examples, which
LESS uses as its validation set, so no method is evaluated on examples it saw; by default 32 when LESS is
among the methods and 0 otherwise, and the value is part of the settings key, so records evaluated on
other examples are never mixed).

Selection runs with ``world_size x --threads`` torch threads on CPU: the CPU budget the training ranks
have together.

Resumable: each finished ``(method, seed)`` is appended to ``OUT/compare_state.jsonl`` with a key of the
settings; a rerun with the same settings skips those and runs the rest (a unit killed mid-way is
redone from its start). Outputs: ``compare.json`` (records and per-method mean/std), ``compare.md``
(the table) and ``compare.png`` (time bars and held-out loss with std error bars).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clusterlm._io import atomic_write_text
from clusterlm.baselines import full_plan, ifd_plan, less_plan, random_plan, s2l_plan
from clusterlm.config import SelectConfig
from clusterlm.data import CHAT_TEMPLATE_MODES, load_data
from clusterlm.demo import demo_data
from clusterlm.engine import CKPT_DIR
from clusterlm.metrics import SUMMARY
from clusterlm.models import load_model, resolve_device
from clusterlm.select import select
from clusterlm.train import launch

__all__ = ["METHODS", "N_VALIDATION", "STATE", "goals", "markdown_table", "read_state", "run_compare", "summarize"]

METHODS = ("full", "random", "cluster", "cluster-tokens", "cluster-whole", "cluster-paper", "cluster-paper-exact",
           "s2l", "ifd", "less")
CLUSTER_METHODS = {  # compare method -> select() arguments besides the budget
    "cluster": {},
    "cluster-tokens": {},
    "cluster-whole": {"feature_tokens": "all"},
    "cluster-paper": {"preset": "paper"},
    "cluster-paper-exact": {"preset": "paper", "clustering": "exact"},
}
STATE = "compare_state.jsonl"
N_VALIDATION = 32  # LESS's validation examples (the tail of the held-out data) when --n-validation is not given


def _settings(args: argparse.Namespace, data_path: str, eval_path: str) -> dict[str, Any]:
    keys = ("model", "ratio", "world_size", "epochs", "max_steps", "micro_batch_size", "lr", "warmup_ratio",
            "max_length", "n_validation", "eval_max_examples", "threads", "device", "dtype", "s2l_clusters",
            "s2l_epochs", "less_epochs", "less_dim", "bf16", "lora_r", "chat_template")
    out = {k: getattr(args, k) for k in keys}
    out["data"] = str(Path(data_path).resolve())
    out["eval_data"] = str(Path(eval_path).resolve())
    return out


def _key(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def read_state(path: Path) -> list[dict[str, Any]]:
    """The unit records of a compare state file (``OUT/compare_state.jsonl``), oldest first; [] if none."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill: that unit is redone
    return out


def _append_state(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _select(method: str, model: Any, data: Any, validation: Any, args: argparse.Namespace, seed: int,
            model_id: str) -> Any:
    """The plan of ``method`` (the call that is timed)."""
    ws, ratio = args.world_size, args.ratio
    if method == "full":
        return full_plan(data, ws, seed=seed, model_id=model_id)
    if method == "random":
        return random_plan(data, ws, ratio=ratio, seed=seed, model_id=model_id)
    if method in CLUSTER_METHODS:
        budget = {"token_ratio": ratio} if method == "cluster-tokens" else {"ratio": ratio}
        config = SelectConfig(world_size=ws, seed=seed, **CLUSTER_METHODS[method], **budget)
        return select(model, data, config, model_id=model_id, progress=False)
    if method == "s2l":
        return s2l_plan(model, data, ws, ratio=ratio, seed=seed, lr=args.lr, micro_batch_size=args.micro_batch_size,
                        n_clusters=args.s2l_clusters, proxy_epochs=args.s2l_epochs, model_id=model_id)
    if method == "ifd":
        return ifd_plan(model, data, ws, ratio=ratio, seed=seed, model_id=model_id)
    if method == "less":
        return less_plan(model, data, ws, ratio=ratio, seed=seed, validation=validation, lr=args.lr,
                         warmup_epochs=args.less_epochs, micro_batch_size=args.micro_batch_size, dim=args.less_dim,
                         model_id=model_id)
    raise ValueError(f"compare: unknown method {method!r}; choose from {', '.join(METHODS)}.")


def _train_argv(args: argparse.Namespace, plan_dir: Path, train_dir: Path, data_path: str, eval_path: str,
                n_eval: int, seed: int, initial_eval: bool = True) -> list[str]:
    argv = ["--plan", str(plan_dir), "--model", args.model, "--data", data_path, "--out", str(train_dir),
            "--eval-data", eval_path, "--eval-max-examples", str(n_eval), "--epochs", str(args.epochs),
            "--micro-batch-size", str(args.micro_batch_size), "--lr", str(args.lr), "--warmup-ratio",
            str(args.warmup_ratio), "--seed", str(seed), "--threads", str(args.threads), "--device", args.device,
            "--bf16", args.bf16, "--chat-template", args.chat_template, "--overwrite", "--no-save-model",
            "--no-progress", "--keep-checkpoints", "1"]
    if args.max_length:
        argv += ["--max-length", str(args.max_length)]
    if not initial_eval:
        argv += ["--no-initial-eval"]
    if args.lora_r:
        argv += ["--lora-r", str(args.lora_r)]
    if args.max_steps:
        argv += ["--max-steps", str(args.max_steps)]
    return argv


def run_compare(args: argparse.Namespace, *, run_here: Callable[[list[str]], int] | None = None) -> dict[str, Any]:
    """Run (or continue) the comparison; returns the ``compare.json`` content.

    Args:
        args: the options of ``clusterlm compare`` (:func:`clusterlm.cli.add_compare_args`).
        run_here: trains a one-rank unit in this process (``clusterlm.cli.train_here``; see
            :func:`clusterlm.train.launch`); None starts a child process for it.

    Raises:
        ValueError: bad arguments (ratio, world size, too few evaluation examples).
        RuntimeError: a training run failed (its output is above; rerun to continue).
    """
    args = _checked(args)
    data_path, eval_path = _data_paths(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = _settings(args, data_path, eval_path)
    key = _key(settings)
    state_path = out / STATE
    done = {(r["method"], r["seed"]): r for r in read_state(state_path) if r.get("key") == key}
    # Seed-major: an interrupted run has every method at its first seeds, not some methods at none.
    todo = [(m, s) for s in args.seeds for m in args.methods if (m, s) not in done]
    print(f"compare: {len(args.methods)} method(s) x {len(args.seeds)} seed(s); {len(done)} done earlier "
          f"(in {state_path}), {len(todo)} to run")
    if todo:
        saved_threads = torch.get_num_threads()
        session = _Session.load(args, data_path, eval_path, run_here)
        for method, seed in todo:
            record = {"key": key, **session.run_unit(method, seed, out / "runs" / f"{method}-s{seed}", done)}
            _append_state(state_path, record)
            done[(method, seed)] = record
        torch.set_num_threads(saved_threads)
    records = [done[(m, s)] for m in args.methods for s in args.seeds]
    summary = summarize(records, args.methods)
    result = {"settings": settings, "key": key, "methods": args.methods, "seeds": args.seeds,
              "summary": summary, "goals": goals(summary), "records": records}
    atomic_write_text(out / "compare.json", json.dumps(result, indent=2) + "\n")
    atomic_write_text(out / "compare.md", markdown_table(result) + "\n")
    plot_compare(result, out / "compare.png")
    return result


def _checked(args: argparse.Namespace) -> argparse.Namespace:
    """Refuse bad options before any model work; fill in the default ``n_validation``."""
    if not 0 < args.ratio <= 1:
        raise ValueError(f"compare: --ratio must be in (0, 1], got {args.ratio}.")
    if args.world_size < 1:
        raise ValueError(f"compare: --world-size must be >= 1, got {args.world_size}.")
    if args.max_steps and "full" in args.methods:
        raise ValueError(
            f"compare: --max-steps {args.max_steps} with method 'full' would train full data for as many steps as the "
            "subsets, so 'total vs full' would mean nothing; drop --max-steps (use a smaller --data) or drop 'full'."
        )
    if args.n_validation is None:  # the held-out tail is LESS's only when it runs; explicit values always hold
        args = argparse.Namespace(**{**vars(args), "n_validation": N_VALIDATION if "less" in args.methods else 0})
    return args


def _data_paths(args: argparse.Namespace) -> tuple[str, str]:
    """Training and held-out data files (the demo splits where not given)."""
    data_path, eval_path = args.data, args.eval_data
    if data_path is None or eval_path is None:
        demo = demo_data()
        data_path = data_path or str(demo.train)
        eval_path = eval_path or str(demo.heldout)
    return data_path, eval_path


@dataclass
class _Session:
    """The model and data every unit shares, loaded once; :meth:`run_unit` selects, trains and records."""

    args: argparse.Namespace
    data_path: str
    eval_path: str
    model: Any
    model_id: str
    data: Any
    validation: list[Any]
    n_eval: int
    use_cuda: bool
    run_here: Callable[[list[str]], int] | None

    @classmethod
    def load(cls, args: argparse.Namespace, data_path: str, eval_path: str,
             run_here: Callable[[list[str]], int] | None) -> _Session:
        device = resolve_device(args.device)
        use_cuda = device.type == "cuda"
        if not use_cuda:
            torch.set_num_threads(max(1, args.threads * args.world_size))
        # the selection model (features, S2L's and LESS's proxies), straight onto its device in --dtype
        model, tokenizer, model_id = load_model(args.model, device=device, dtype=getattr(args, "dtype", "auto"))
        rendering = CHAT_TEMPLATE_MODES[args.chat_template]
        data = load_data(data_path, tokenizer, max_length=args.max_length, progress=False, chat_template=rendering)
        eval_set = load_data(eval_path, tokenizer, max_length=args.max_length, progress=False,
                             chat_template=rendering)
        print(f"   data: {len(data)} training / {len(eval_set)} held-out examples, rendering {data.rendering!r}")
        n_eval_all = len(eval_set)
        # Every method is evaluated on the same examples: the validation tail is held back whichever methods run.
        n_validation = args.n_validation
        if n_validation < 0 or n_validation >= n_eval_all:
            raise ValueError(f"compare: --n-validation must be in [0, {n_eval_all}) (the eval data's size), got "
                             f"{n_validation}.")
        validation = [eval_set[i] for i in range(n_eval_all - n_validation, n_eval_all)]
        n_eval = n_eval_all - n_validation
        if args.eval_max_examples:
            n_eval = min(n_eval, args.eval_max_examples)
        return cls(args, data_path, eval_path, model, model_id, data, validation, n_eval, use_cuda, run_here)

    def _timed_select(self, method: str, seed: int) -> tuple[Any, float]:
        if not self.use_cuda:  # the trainer restores its own thread count; set ours again per unit
            torch.set_num_threads(max(1, self.args.threads * self.args.world_size))
        else:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        plan = _select(method, self.model, self.data, self.validation, self.args, seed, self.model_id)
        if self.use_cuda:
            torch.cuda.synchronize()
        return plan, time.perf_counter() - t0

    def run_unit(self, method: str, seed: int, run_dir: Path, done: dict[tuple[str, int], Any]) -> dict[str, Any]:
        """Select with ``method``, train on the plan, return the unit's record (without the settings key)."""
        args = self.args
        if run_dir.exists():
            shutil.rmtree(run_dir)  # a unit killed mid-way starts again
        run_dir.mkdir(parents=True)
        print(f"\n== {method}, seed {seed}: selection ==")
        if method == "less" and not self.validation:
            raise ValueError("compare: less needs --n-validation >= 1 validation examples.")
        plan, selection_s = self._timed_select(method, seed)
        plan.save(run_dir / "plan")
        print(f"   {plan.n_selected} of {len(self.data)} examples selected in {selection_s:.2f} s")
        print(f"== {method}, seed {seed}: training ({args.world_size} rank(s)) ==")
        # The loss before training is the same for every unit (same model, same held-out data): measured once.
        initial = next((r["initial_eval_loss"] for r in done.values() if r.get("initial_eval_loss") is not None),
                       None)
        argv = _train_argv(args, run_dir / "plan", run_dir / "train", self.data_path, self.eval_path, self.n_eval,
                           seed, initial_eval=initial is None)
        rc = launch(argv, args.world_size, run_here=self.run_here)
        if rc != 0:
            raise RuntimeError(f"compare: training {method} (seed {seed}) failed with status {rc}; its output is "
                               f"above. Rerun the same command to continue with the units not yet done.")
        summary = json.loads((run_dir / "train" / SUMMARY).read_text(encoding="utf-8"))
        # The unit is recorded by the caller; its final checkpoint (weights + optimizer: 1.6 GB for a 135M model) is
        # not needed to resume the comparison.
        shutil.rmtree(run_dir / "train" / CKPT_DIR, ignore_errors=True)
        print(f"   trained {summary['steps']} steps in {summary['train_time_s']:.1f} s; held-out loss "
              f"{summary['final_eval_loss']:.4f}")
        return {
            "method": method, "seed": seed, "selection_s": selection_s,
            "train_s": summary["train_time_s"], "train_wall_s": summary["wall_time_s"],
            "total_s": selection_s + summary["train_time_s"], "eval_loss": summary["final_eval_loss"],
            "initial_eval_loss": summary["initial_eval_loss"] if initial is None else initial,
            "n_selected": int(plan.n_selected),
            "n_examples": len(self.data), "n_eval": self.n_eval, "n_validation": args.n_validation,
            "fraction": plan.n_selected / len(self.data), "steps": summary["steps"],
            "tokens": summary["tokens"], "timings": plan.timings, "plan_config": plan.config,
        }


def _mean_std(values: list[float]) -> tuple[float, float]:
    arr = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=np.float64)
    if not len(arr):
        return float("nan"), float("nan")
    return float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else 0.0


def summarize(records: list[dict[str, Any]], methods: list[str]) -> dict[str, dict[str, Any]]:
    """Per method: mean and std over seeds of selection / training / total seconds, held-out loss, tokens trained."""
    out: dict[str, dict[str, Any]] = {}
    for m in methods:
        rs = [r for r in records if r["method"] == m]
        if not rs:
            continue
        row: dict[str, Any] = {"seeds": len(rs), "fraction": float(np.mean([r["fraction"] for r in rs]))}
        for field in ("selection_s", "train_s", "total_s", "eval_loss", "tokens"):
            row[field], row[f"{field}_std"] = _mean_std([r[field] for r in rs])
        out[m] = row
    return out


def goals(summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets as measured ratios (those whose methods are present)."""
    g: dict[str, Any] = {}
    c = summary.get("cluster")
    if c is None:
        return g
    others = [summary[m]["selection_s"] for m in ("s2l", "ifd", "less") if m in summary]
    if others:
        g["cluster_selection_over_fastest_baseline"] = c["selection_s"] / min(others)
    if "full" in summary:
        g["cluster_total_over_full_train"] = c["total_s"] / summary["full"]["train_s"]
        g["cluster_loss_rel_to_full"] = c["eval_loss"] / summary["full"]["eval_loss"] - 1.0
    if "random" in summary:
        r = summary["random"]
        g["cluster_total_over_random_total"] = c["total_s"] / r["total_s"]
        g["cluster_loss_minus_random"] = c["eval_loss"] - r["eval_loss"]
        g["random_loss_std"] = r["eval_loss_std"]
    return g


def markdown_table(result: dict[str, Any]) -> str:
    """The comparison as a markdown table (mean ± std over seeds)."""
    lines = [f"Comparison at ratio {result['settings']['ratio']}, world size {result['settings']['world_size']}, "
             f"model {result['settings']['model']}, seeds {result['seeds']}.", "",
             "| method | fraction | tokens trained | selection s | training s | total s | held-out loss |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    def pm(row: dict[str, Any], f: str, digits: int) -> str:
        if row["seeds"] < 2:
            return f"{row[f]:.{digits}f}"  # one seed: no spread to show
        return f"{row[f]:.{digits}f} ± {row[f + '_std']:.{digits}f}"

    for m, row in result["summary"].items():
        lines.append(f"| {m} | {row['fraction']:.3f} | {row['tokens']:,.0f} | {pm(row, 'selection_s', 2)} | "
                     f"{pm(row, 'train_s', 1)} | "
                     f"{pm(row, 'total_s', 1)} | {pm(row, 'eval_loss', 4)} |")
    if result.get("goals"):
        lines += ["", "| ratio | value |", "|---|---:|"]
        lines += [f"| {k} | {v:.4f} |" for k, v in result["goals"].items()]
    return "\n".join(lines)


def plot_compare(result: dict[str, Any], path: Path) -> Path | None:
    """``compare.png``: stacked selection + training seconds, and held-out loss with std error bars."""
    summary = result["summary"]
    if not summary:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    x = np.arange(len(names))
    sel = np.array([summary[m]["selection_s"] for m in names])
    tr = np.array([summary[m]["train_s"] for m in names])
    loss = np.array([summary[m]["eval_loss"] for m in names])
    loss_std = np.array([summary[m]["eval_loss_std"] for m in names])
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.2))
    ax0.bar(x, sel, color="tab:orange", label="selection")
    ax0.bar(x, tr, bottom=sel, color="tab:blue", label="training")
    ax0.set_xticks(x, names, rotation=20)
    ax0.set_ylabel("seconds (mean over seeds)")
    ax0.set_title("time")
    ax0.legend()
    ax0.grid(axis="y", alpha=0.3)
    ax1.bar(x, loss, yerr=loss_std, capsize=4, color="tab:green")
    finite = loss[np.isfinite(loss)]
    if len(finite):
        span = max(float(finite.max() - finite.min()), 1e-3)
        ax1.set_ylim(float(finite.min()) - span, float(finite.max()) + span)
    ax1.set_xticks(x, names, rotation=20)
    ax1.set_ylabel("held-out answer loss")
    ax1.set_title("held-out loss (mean ± std over seeds)")
    ax1.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
