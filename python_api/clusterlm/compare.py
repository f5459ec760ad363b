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
- ``longest``: the examples with the most answer tokens at the same example budget
  (:func:`clusterlm.baselines.longest_plan`);
- ``s2l`` / ``ifd`` / ``less``: :mod:`clusterlm.baselines.s2l`, :mod:`.ifd`, :mod:`.less`;
- a cluster method with selection settings, ``cluster[feature_tokens=32,within_cluster=kcenter]``
  (:func:`parse_method`): any :class:`clusterlm.SelectConfig` setting but the budget, world size and seed; its
  label is the spec as written.

``--ratios 0.1,0.2,0.31`` runs every method at each budget (full data once, at ratio 1); the cluster methods'
features are computed once per model, data and feature settings into ``OUT/features/`` and reused by every
cluster method and ratio with those settings (a reusing unit is still charged the features' computing time).

For every ``(ratio, method, seed)``: the selection runs in this process on the loaded model and is timed
(wall clock of the selection call: everything a method needs — features, forwards, proxy training,
LoRA warm-up, clustering; model and data loading, common to all methods, are not counted); its plan
is saved to ``OUT/runs/<method>-r<ratio>-s<seed>/plan`` (full data: ``full-s<seed>``) and trained by the
reference trainer (:func:`clusterlm.train.launch`, ``--nproc`` = world size) with identical hyper-parameters, seed and
held-out data for every method; training seconds = the trainer's ``train_time_s`` (the sum over steps
of the slowest rank's step time: training proper, without model loading and evaluation); total =
selection + training. Held-out loss = the trainer's final token-weighted answer loss on the
evaluation data (default: the demo held-out split minus the last ``--n-validation`` examples, which
LESS uses as its validation set, so no method is evaluated on examples it saw; by default 32 when LESS is
among the methods and 0 otherwise, and the value is part of the settings key, so records evaluated on
other examples are never mixed).

Selection runs with ``world_size x --threads`` torch threads on CPU: the CPU budget the training ranks
have together.

Resumable: each finished ``(ratio, method, seed)`` is appended to ``OUT/compare_state.jsonl`` with a key of the
settings at its ratio (with its per-example held-out losses); a rerun with the same settings skips those and
runs the rest (a unit killed mid-way is redone from its start). Outputs: ``compare.json`` (records, per-method
mean/std and the differences to random and to full data with their 95 % intervals, per ratio; the
``frontier``), ``eval_losses.json`` (every unit's per-example losses), ``compare.md`` (tables and one
``verdict:`` line per method) and ``compare.png`` (time bars, held-out loss with std error bars, the frontier).
Intervals: :mod:`clusterlm.stats` (two-level bootstrap over seeds and evaluation examples, paired by seed when
the methods ran the same seeds).

Several evaluation sets: ``--eval-data code=a.jsonl --eval-data math=b.jsonl`` (:mod:`clusterlm.compare_eval`; a bare
path is named after its file stem). The first is primary: ``eval_loss``, the intervals vs random / full, the
verdicts and the frontier are its. Every run evaluates every set (the trainer evaluates them together from one
tokenised file, ``OUT/eval_sets/``, so one evaluation gives every set's per-example losses, before training too);
each method's summary gains ``eval_sets: {name: {loss, ci95, initial_loss, delta_vs_random, ci95_vs_random,
delta_vs_full, ...}}``, ``compare.md`` a table per set, ``eval_losses.json`` each unit's losses per set. No
evaluation example may also be a training example, nor one of LESS's validation examples: checked on the raw
records' whitespace-normalised text before any model work (:func:`clusterlm.compare_eval.check_overlap`). With
several sets the settings key holds their names and content hashes; one set keys by its path, as before.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clusterlm._io import atomic_write_text
from clusterlm.baselines import full_plan, ifd_plan, less_plan, longest_plan, random_plan, s2l_plan
from clusterlm.compare_eval import (
    content_hash,
    eval_layout,
    eval_losses_file,
    eval_set_tables,
    eval_sets_of,
    on_set,
    read_eval_sets,
    set_losses,
    without_examples,
)
from clusterlm.config import SelectConfig
from clusterlm.data import CHAT_TEMPLATE_MODES, load_data
from clusterlm.demo import demo_data
from clusterlm.engine import CKPT_DIR, EVAL_EXAMPLES
from clusterlm.metrics import SUMMARY
from clusterlm.models import load_model, resolve_device
from clusterlm.select import feature_settings, select
from clusterlm.stats import Delta, bootstrap_delta, bootstrap_loss, interval_text, seeds_to_resolve
from clusterlm.store import FeatureStore
from clusterlm.train import INITIAL_EVAL_EXAMPLES, launch

__all__ = ["EVAL_LOSSES", "METHODS", "N_VALIDATION", "STATE", "MethodSpec", "delta_between", "frontier", "goals",
           "markdown_table", "parse_method", "parse_methods",
           "selection_tokens", "read_state", "run_compare", "summarize", "verdicts"]

METHODS = ("full", "random", "longest", "cluster", "cluster-tokens", "cluster-whole", "cluster-paper",
           "cluster-paper-exact", "s2l", "ifd", "less")
CLUSTER_METHODS = {  # compare method -> select() arguments besides the budget
    "cluster": {},
    "cluster-tokens": {},
    "cluster-whole": {"feature_tokens": "all"},
    "cluster-paper": {"preset": "paper"},
    "cluster-paper-exact": {"preset": "paper", "clustering": "exact"},
}
STATE = "compare_state.jsonl"
EVAL_LOSSES = "eval_losses.json"  # every unit's per-example held-out losses, next to compare.json
FEATURES = "features"  # OUT/features/<key>: feature stores shared by the cluster units with the same feature settings
# Settings compare itself gives every selection: a method variant may not set them.
COMPARE_SETS = ("world_size", "ratio", "budget", "token_ratio", "token_budget", "seed")
N_BOOT = 2000  # bootstrap replicates of every interval
N_VALIDATION = 32  # LESS's validation examples (the tail of the held-out data) when --n-validation is not given


@dataclass(frozen=True)
class MethodSpec:
    """One ``--methods`` entry: a method name and, for the cluster methods, selection settings.

    Attributes:
        label: the entry as written (``cluster[feature_tokens=32]``): its name in every table.
        base: the method (:data:`METHODS`).
        overrides: :class:`clusterlm.SelectConfig` settings on top of the method's own (cluster methods only).
    """

    label: str
    base: str
    overrides: tuple[tuple[str, Any], ...] = ()

    @property
    def slug(self) -> str:
        """The label as a file name (run directories)."""
        return re.sub(r"[^A-Za-z0-9._-]+", "_", self.label).strip("_")


def _split_top(value: str, sep: str = ",") -> list[str]:
    """Split at ``sep`` outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in value:
        depth += (ch == "[") - (ch == "]")
        if ch == sep and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [*parts, cur]


def _setting_value(text: str) -> Any:
    """``32`` -> 32, ``0.5`` -> 0.5, ``true``/``false`` -> bool, ``none`` -> None, anything else the string."""
    low = text.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_method(spec: str) -> MethodSpec:
    """``name`` or ``name[key=value,...]`` as a :class:`MethodSpec`; the settings are checked by
    :class:`clusterlm.SelectConfig` (names and values) without any data.

    Raises:
        ValueError: an unknown method, settings on a method that is not a cluster method, a malformed setting,
            a setting compare gives itself (budget, world size, seed), or a value the selection refuses.
        TypeError: an unknown setting name.
    """
    label = spec.strip()
    m = re.fullmatch(r"([A-Za-z0-9_-]+)(?:\[(.*)\])?", label)
    if m is None or m.group(1) not in METHODS:
        raise ValueError(f"compare: unknown method {label!r}; choose from {', '.join(METHODS)}, optionally with "
                         "selection settings: cluster[feature_tokens=32].")
    base, body = m.group(1), m.group(2)
    if body is None:
        return MethodSpec(label, base)
    if base not in CLUSTER_METHODS:
        raise ValueError(f"compare: method {label!r}: only the cluster methods ({', '.join(CLUSTER_METHODS)}) take "
                         "selection settings in brackets.")
    overrides: dict[str, Any] = {}
    for item in (i.strip() for i in _split_top(body.replace(";", ","))):
        key, eq, text = item.partition("=")
        if not eq or not key.strip() or not text.strip():
            raise ValueError(f"compare: method {label!r}: settings are key=value, got {item!r}; e.g. "
                             "cluster[feature_tokens=32,within_cluster=kcenter].")
        overrides[key.strip()] = _setting_value(text.strip())
    fixed = sorted(set(overrides) & set(COMPARE_SETS))
    if fixed:
        raise ValueError(f"compare: method {label!r} sets {', '.join(fixed)}, which compare sets for every method; "
                         "use --ratio/--ratios, --world-size, --seeds instead.")
    out = MethodSpec(label, base, tuple(sorted(overrides.items())))
    _check_variant(out, 1, 0.5)  # names (TypeError) and values, before any data or model
    return out


def _check_variant(spec: MethodSpec, world_size: int, ratio: float) -> None:
    """The variant's settings as :class:`SelectConfig` checks them (errors name the method as written)."""
    try:
        _method_config(spec, world_size, ratio, 0).check()
    except (TypeError, ValueError) as e:
        raise type(e)(f"compare: method {spec.label!r}: {str(e).removeprefix('select: ')}") from None


def parse_methods(value: str) -> list[str]:
    """A ``--methods`` value (comma list, commas inside brackets belong to a method's settings) as labels.

    Raises:
        ValueError / TypeError: an empty list, a method given twice, or a bad entry (:func:`parse_method`).
    """
    labels = [parse_method(v).label for v in _split_top(value) if v.strip()]
    if not labels:
        raise ValueError(f"compare: --methods needs at least one method, got {value!r}.")
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise ValueError(f"compare: --methods lists {', '.join(twice)} more than once.")
    return labels


def _method_config(spec: MethodSpec, world_size: int, ratio: float, seed: int) -> SelectConfig:
    """The :class:`SelectConfig` of a cluster method at this budget and seed."""
    budget = {"token_ratio": ratio} if spec.base == "cluster-tokens" else {"ratio": ratio}
    return SelectConfig(world_size=world_size, seed=seed, **CLUSTER_METHODS[spec.base], **budget).replace(
        **dict(spec.overrides))


def _settings(args: argparse.Namespace, data_path: str, eval_path: str,
              eval_key: list[list[str]] | None = None) -> dict[str, Any]:
    """The settings a record is keyed by; several evaluation sets add their names and content hashes (one set keys
    by its path, as before, so the records of an earlier compare are reused)."""
    keys = ("model", "ratio", "world_size", "epochs", "max_steps", "micro_batch_size", "lr", "warmup_ratio",
            "max_length", "n_validation", "eval_max_examples", "threads", "device", "dtype", "s2l_clusters",
            "s2l_epochs", "less_epochs", "less_dim", "bf16", "lora_r", "chat_template")
    out = {k: getattr(args, k) for k in keys}
    out["data"] = str(Path(data_path).resolve())
    out["eval_data"] = str(Path(eval_path).resolve())
    if eval_key:
        out["eval_sets"] = eval_key
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
            model_id: str, feature_store: Path | None = None) -> Any:
    """The plan of ``method`` (a :data:`METHODS` name or a variant, :func:`parse_method`; the call that is timed)."""
    ws, ratio = args.world_size, args.ratio
    spec = parse_method(method)
    method = spec.base
    if method == "full":
        return full_plan(data, ws, seed=seed, model_id=model_id)
    if method == "random":
        return random_plan(data, ws, ratio=ratio, seed=seed, model_id=model_id)
    if method == "longest":
        return longest_plan(data, ws, ratio=ratio, seed=seed, model_id=model_id)
    if method in CLUSTER_METHODS:
        return select(model, data, _method_config(spec, ws, ratio, seed), model_id=model_id, progress=False,
                      feature_store=feature_store)
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
    if getattr(args, "fsdp", False):
        argv += ["--fsdp"]
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
        ValueError: bad arguments (ratio(s), world size, method settings, too few evaluation examples).
        RuntimeError: a training run failed (its output is above; rerun to continue).
    """
    args = _checked(args)
    data_path, eval_path = _data_paths(args)
    eval_meta = [{"name": s.name, "path": str(Path(s.path).resolve()), "primary": i == 0, "examples": len(raw),
                  "sha256": content_hash(raw)} for i, (s, raw) in enumerate(read_eval_sets(
                      args.eval_sets, data_path, n_validation=args.n_validation,
                      eval_max_examples=args.eval_max_examples))]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    eval_key = [[m["name"], m["sha256"]] for m in eval_meta] if len(eval_meta) > 1 else None
    settings = _settings(args, data_path, eval_path, eval_key)
    keys = {r: _key({**settings, "ratio": r}) for r in [*args.ratios, 1.0]}  # full data: ratio 1 whatever --ratios
    state_path = out / STATE
    wanted = _units(args)
    ratio_of = {k: r for r, k in keys.items()}  # records of other settings have other keys: kept apart
    earlier = {(ratio_of[r["key"]], r["method"], r["seed"]): r for r in read_state(state_path)
               if r.get("key") in ratio_of}
    done = {u: {**earlier[u], "ratio": u[0]} for u in wanted if u in earlier}
    todo = [u for u in wanted if u not in done]
    print(f"compare: {len(args.methods)} method(s) x {len(args.seeds)} seed(s) x {len(args.ratios)} ratio(s); "
          f"{len(done)} done earlier (in {state_path}), {len(todo)} to run")
    if todo:
        saved_threads = torch.get_num_threads()
        session = _Session.load(args, data_path, eval_path, run_here, work=out)
        session.check_budgets()
        for ratio, method, seed in todo:
            run_dir = out / "runs" / _run_name(ratio, method, seed)
            record = {"key": keys[ratio], "ratio": ratio,
                      **session.run_unit(method, seed, run_dir, done, ratio=ratio, store_root=out / FEATURES)}
            _append_state(state_path, record)
            done[(ratio, method, seed)] = record
        torch.set_num_threads(saved_threads)
    records = [done[u] for u in wanted]
    result = _result(args, settings, keys, records, eval_meta)
    atomic_write_text(out / EVAL_LOSSES, json.dumps(eval_losses_file(records, [m["name"] for m in eval_meta])) + "\n")
    atomic_write_text(out / "compare.json", json.dumps(result, indent=2) + "\n")
    atomic_write_text(out / "compare.md", markdown_table(result) + "\n")
    plot_compare(result, out / "compare.png")
    return result


def _units(args: argparse.Namespace) -> list[tuple[float, str, int]]:
    """(ratio, method, seed) of every unit, seed-major (an interrupted run has every method at its first seeds);
    full data runs once per seed, at ratio 1."""
    units = []
    for seed in args.seeds:
        if "full" in args.methods:
            units.append((1.0, "full", seed))
        units += [(r, m, seed) for r in args.ratios for m in args.methods if m != "full"]
    return units


def _run_name(ratio: float, method: str, seed: int) -> str:
    slug = parse_method(method).slug
    return f"{slug}-s{seed}" if method == "full" else f"{slug}-r{ratio:g}-s{seed}"


def _result(args: argparse.Namespace, settings: dict[str, Any], keys: dict[float, str],
            records: list[dict[str, Any]], eval_meta: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """``compare.json``: the settings, the evaluation sets, per ratio the per-method summary, the frontier, the
    records (without their per-example losses: ``eval_losses.json``)."""
    first = records[0] if records else {}
    sets_of_first = first.get("eval_sets") or {}
    eval_meta = [{**m, "evaluated": first.get("n_eval") if m["primary"] else  # the primary: without LESS's tail
                  sets_of_first.get(m["name"], {}).get("n_eval")} for m in eval_meta or []]
    names = [m["name"] for m in eval_meta]
    full = [r for r in records if r["method"] == "full"]
    by_ratio = {}
    for ratio in args.ratios:
        at = [r for r in records if r["method"] != "full" and r["ratio"] == ratio] + full
        by_ratio[f"{ratio:g}"] = summarize(at, args.methods, names)
    summary = by_ratio[f"{args.ratios[0]:g}"]
    reused = sum(1 for r in records if r.get("features_reused"))
    return {"settings": {**settings, "ratio": args.ratios[0], "ratios": args.ratios}, "key": keys[args.ratios[0]],
            "methods": args.methods, "seeds": args.seeds, "ratios": args.ratios, "summary": summary,
            "summary_by_ratio": by_ratio, "frontier": frontier(records, args.methods, args.ratios),
            "features_note": _features_note(records, reused), "goals": goals(summary), "eval_sets": eval_meta,
            "records": [without_examples(r) for r in records]}


def _features_note(records: list[dict[str, Any]], reused: int) -> str:
    n_cluster = sum(1 for r in records if parse_method(r["method"]).base in CLUSTER_METHODS)
    if not n_cluster:
        return ""
    return (f"features: computed once per model, data and feature settings (preset, features, window, seed) into "
            f"OUT/{FEATURES}/ and reused by every cluster method and ratio with those settings: {reused} of "
            f"{n_cluster} cluster unit(s) read stored features; their selection seconds still include the time the "
            f"features took when computed, so every unit is charged its full selection cost.")


def _checked(args: argparse.Namespace) -> argparse.Namespace:
    """Refuse bad options before any model work; fill in the default ``n_validation``."""
    ratios = list(getattr(args, "ratios", None) or [args.ratio])
    bad = [r for r in ratios if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1]
    if bad or len(set(ratios)) != len(ratios):
        flag = "--ratios" if getattr(args, "ratios", None) else "--ratio"
        raise ValueError(f"compare: {flag} must be distinct fractions in (0, 1], got {ratios}; e.g. --ratios 0.2,0.31.")
    args = argparse.Namespace(**{**vars(args), "ratios": [float(r) for r in ratios], "ratio": float(ratios[0])})
    if args.world_size < 1:
        raise ValueError(f"compare: --world-size must be >= 1, got {args.world_size}.")
    if args.max_steps and "full" in args.methods:
        raise ValueError(
            f"compare: --max-steps {args.max_steps} with method 'full' would train full data for as many steps as the "
            "subsets, so 'total vs full' would mean nothing; drop --max-steps (use a smaller --data) or drop 'full'."
        )
    for label in args.methods:  # variants' settings against this world size and budget, before any model work
        spec = parse_method(label)
        for ratio in args.ratios if spec.base in CLUSTER_METHODS else ():
            _check_variant(spec, args.world_size, ratio)
    if args.n_validation is None:  # the held-out tail is LESS's only when it runs; explicit values always hold
        args = argparse.Namespace(**{**vars(args), "n_validation": N_VALIDATION if "less" in args.methods else 0})
    default = None if args.eval_data else str(demo_data().heldout)
    return argparse.Namespace(**{**vars(args), "eval_sets": eval_sets_of(args.eval_data, default)})


def _data_paths(args: argparse.Namespace) -> tuple[str, str]:
    """Training and held-out data files (the demo splits where not given)."""
    sets = getattr(args, "eval_sets", None)
    data_path, eval_path = args.data, sets[0].path if sets else args.eval_data
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
    model_load_s: float = 0.0  # loading the selection model: once, shared by every unit
    # What the trainer evaluates: the primary set's file (None) or every set's evaluated examples in one file, and
    # (name, start, stop) of each set's examples in the trainer's per-example losses.
    train_eval_path: str | None = None
    eval_slices: tuple[tuple[str, int, int], ...] = ()

    @classmethod
    def load(cls, args: argparse.Namespace, data_path: str, eval_path: str,
             run_here: Callable[[list[str]], int] | None, work: Path | None = None) -> _Session:
        """The selection model, the training data and every evaluation set (several: tokenised into one file under
        ``work`` that the trainer evaluates, :func:`eval_layout`)."""
        device = resolve_device(args.device)
        use_cuda = device.type == "cuda"
        if not use_cuda:
            torch.set_num_threads(max(1, args.threads * args.world_size))
        # the selection model (features, S2L's and LESS's proxies), straight onto its device in --dtype
        t0 = time.perf_counter()
        model, tokenizer, model_id = load_model(args.model, device=device, dtype=getattr(args, "dtype", "auto"))
        model_load_s = time.perf_counter() - t0
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
        path, slices = eval_layout(getattr(args, "eval_sets", ()), tokenizer, eval_set, n_eval,
                                   Path(args.out) if work is None else work, max_length=args.max_length,
                                   eval_max_examples=args.eval_max_examples, chat_template=rendering)
        return cls(args, data_path, eval_path, model, model_id, data, validation, n_eval, use_cuda, run_here,
                   model_load_s, train_eval_path=path, eval_slices=slices)

    def check_budgets(self) -> None:
        """Every cluster method at every ratio against the data (examples per cluster, size bounds), before any
        selection: one line naming the method and ratio."""
        for label in self.args.methods:
            spec = parse_method(label)
            for ratio in self.args.ratios if spec.base in CLUSTER_METHODS else ():
                try:
                    _method_config(spec, self.args.world_size, ratio, 0).resolve(len(self.data), self.data.lengths)
                except ValueError as e:
                    raise ValueError(f"compare: {label} at ratio {ratio:g} of {len(self.data)} examples: "
                                     f"{str(e).removeprefix('select: ')}") from None

    def feature_store(self, method: str, seed: int, root: Path) -> Path | None:
        """The feature store of a cluster unit: one per model, data and feature settings, shared by every cluster
        method and ratio with those settings (None for the other methods)."""
        spec = parse_method(method)
        if spec.base not in CLUSTER_METHODS:
            return None
        config = _method_config(spec, self.args.world_size, self.args.ratio, seed)
        s = config.resolve(len(self.data), self.data.lengths)
        what = {"model": self.model_id, "data": self.data.fingerprint()["sha256"], "dtype": self.args.dtype,
                "batch_tokens": config.batch_tokens, **feature_settings(s, config)}
        return root / _key(what)

    def _timed_select(self, method: str, seed: int, store: Path | None = None) -> tuple[Any, float]:
        if not self.use_cuda:  # the trainer restores its own thread count; set ours again per unit
            torch.set_num_threads(max(1, self.args.threads * self.args.world_size))
        else:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        plan = _select(method, self.model, self.data, self.validation, self.args, seed, self.model_id,
                       feature_store=store)
        if self.use_cuda:
            torch.cuda.synchronize()
        return plan, time.perf_counter() - t0

    def run_unit(self, method: str, seed: int, run_dir: Path, done: dict[Any, Any], *, ratio: float | None = None,
                 store_root: Path | None = None) -> dict[str, Any]:
        """Select with ``method`` at ``ratio`` (default ``--ratio``), train on the plan, return the unit's record
        (without the settings key); cluster methods keep their features under ``store_root``."""
        if ratio is not None:
            self.args = argparse.Namespace(**{**vars(self.args), "ratio": ratio})
        args = self.args
        if run_dir.exists():
            shutil.rmtree(run_dir)  # a unit killed mid-way starts again
        run_dir.mkdir(parents=True)
        print(f"\n== {method}, seed {seed}: selection ==")
        if method == "less" and not self.validation:
            raise ValueError("compare: less needs --n-validation >= 1 validation examples.")
        store = None if store_root is None else self.feature_store(method, seed, store_root)
        reused = store is not None and FeatureStore(store).complete
        plan, selection_s = self._timed_select(method, seed, store)
        measured_s = selection_s
        if store is not None:
            selection_s = _charge_features(store, plan, selection_s, reused)
        plan.save(run_dir / "plan")
        print(f"   {plan.n_selected} of {len(self.data)} examples selected in {selection_s:.2f} s")
        print(f"== {method}, seed {seed}: training ({args.world_size} rank(s)) ==")
        # The loss before training is the same for every unit (same model, same held-out data): measured once.
        base = next((r for r in done.values() if r.get("initial_eval_loss") is not None), None)
        argv = _train_argv(args, run_dir / "plan", run_dir / "train", self.data_path,
                           self.train_eval_path or self.eval_path, self.eval_slices[-1][2], seed,
                           initial_eval=base is None)
        rc = launch(argv, args.world_size, run_here=self.run_here)
        if rc != 0:
            raise RuntimeError(f"compare: training {method} (seed {seed}) failed with status {rc}; its output is "
                               f"above. Rerun the same command to continue with the units not yet done.")
        summary = json.loads((run_dir / "train" / SUMMARY).read_text(encoding="utf-8"))
        evals = self.evaluations(run_dir / "train", summary, base)
        # The unit is recorded by the caller; its final checkpoint (weights + optimizer: 1.6 GB for a 135M model) is
        # not needed to resume the comparison.
        shutil.rmtree(run_dir / "train" / CKPT_DIR, ignore_errors=True)
        print(f"   trained {summary['steps']} steps in {summary['train_time_s']:.1f} s; held-out loss "
              f"{evals['eval_loss']:.4f}" + "".join(f"; {n} {v['eval_loss']:.4f}"
                                                   for n, v in (evals.get("eval_sets") or {}).items()))
        return {
            "method": method, "seed": seed, "selection_s": selection_s,
            "train_s": summary["train_time_s"], "train_wall_s": summary["wall_time_s"],
            "total_s": selection_s + summary["train_time_s"], **evals, "n_selected": int(plan.n_selected),
            "n_examples": len(self.data), "n_eval": self.n_eval, "n_validation": args.n_validation,
            "fraction": plan.n_selected / len(self.data), "steps": summary["steps"],
            "tokens": summary["tokens"], "timings": plan.timings, "plan_config": plan.config,
            "features_reused": reused, "selection_measured_s": measured_s, "model_load_s": self.model_load_s,
            "selection_tokens": selection_tokens(method, plan, self.data.lengths),
        }

    def evaluations(self, train_dir: Path, summary: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
        """A trained unit's held-out losses: the primary set's (``eval_loss``, ``initial_eval_loss``,
        ``eval_examples``) and, with several sets, each other set's under ``eval_sets`` (the same three, and
        ``n_eval``). The losses before training come from this run when it measured them (``base`` None), else from
        ``base``, the unit that did (same model, same examples)."""
        per_example = json.loads((train_dir / EVAL_EXAMPLES).read_text(encoding="utf-8"))
        if self.train_eval_path is None:
            return {"eval_loss": summary["final_eval_loss"],
                    "initial_eval_loss": summary["initial_eval_loss"] if base is None else base["initial_eval_loss"],
                    "eval_examples": {"loss_sums": per_example["loss_sums"], "tokens": per_example["tokens"]}}
        if len(per_example["tokens"]) != self.eval_slices[-1][2]:
            raise RuntimeError(f"compare: the trainer evaluated {len(per_example['tokens'])} examples of "
                               f"{self.train_eval_path}, {self.eval_slices[-1][2]} expected.")
        sets, primary = set_losses(per_example, self.eval_slices), self.eval_slices[0][0]
        if base is None:  # this run measured the losses before training
            path = train_dir / INITIAL_EVAL_EXAMPLES
            before = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
            initial = {n: v["eval_loss"] for n, v in set_losses(before, self.eval_slices).items()} if before else {}
        else:
            initial = {n: v.get("initial_eval_loss") for n, v in (base.get("eval_sets") or {}).items()}
            initial[primary] = base["initial_eval_loss"]
        for name, v in sets.items():
            v["initial_eval_loss"] = initial.get(name)
        first = sets.pop(primary)
        return {"eval_loss": first["eval_loss"], "initial_eval_loss": first["initial_eval_loss"],
                "eval_examples": first["eval_examples"], "eval_sets": sets}


def selection_tokens(method: str, plan: Any, lengths: Any) -> int | None:
    """Tokens the selection's model read, in the units of tokens trained: a cluster method reads every example's
    feature window (``min(length, window)`` tokens, :func:`clusterlm.features.feature_window`; the whole example
    without a window); full, random and longest read none; None for S2L, IFD and LESS (proxy training and several
    passes: not counted)."""
    base = parse_method(method).base
    if base in ("full", "random", "longest"):
        return 0
    if base not in CLUSTER_METHODS:
        return None
    window = (plan.config.get("features") or {}).get("max_tokens")
    lengths = np.asarray(lengths, dtype=np.int64)
    return int(lengths.sum() if window is None else np.minimum(lengths, int(window)).sum())


def _charge_features(store: Path, plan: Any, measured_s: float, reused: bool) -> float:
    """The selection seconds a unit is charged: as measured when it computed its features (their time is kept
    next to the store), else the measured time with the stored features' read replaced by their computing time."""
    cost = store / "compare_features_s.json"
    features_s = float(plan.timings.get("features", 0.0))
    if not reused or not cost.is_file():
        atomic_write_text(cost, json.dumps({"features_s": features_s}) + "\n")
        return measured_s
    computed_s = float(json.loads(cost.read_text(encoding="utf-8"))["features_s"])
    plan.timings = {**plan.timings, "features": computed_s, "features_read": features_s}
    return measured_s - features_s + computed_s


def _mean_std(values: list[float]) -> tuple[float, float]:
    arr = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=np.float64)
    if not len(arr):
        return float("nan"), float("nan")
    return float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else 0.0


def summarize(records: list[dict[str, Any]], methods: list[str],
              eval_sets: list[str] | tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Per method: mean and std over seeds of selection / training / total seconds, held-out loss, tokens trained;
    and the held-out loss difference to random and to full data with its 95 % interval (:func:`_vs_reference`).

    ``eval_sets``: the evaluation sets' names, the primary first (the one behind ``eval_loss``): each method's row
    gains ``eval_sets``, per set the held-out loss with its interval and the differences (:func:`_set_summary`).
    """
    out: dict[str, dict[str, Any]] = {}
    by_method = {m: [r for r in records if r["method"] == m] for m in methods}
    for m, rs in by_method.items():
        if not rs:
            continue
        row: dict[str, Any] = {"seeds": len(rs), "fraction": float(np.mean([r["fraction"] for r in rs]))}
        for field in ("selection_s", "train_s", "total_s", "eval_loss", "tokens"):
            row[field], row[f"{field}_std"] = _mean_std([r[field] for r in rs])
        row.update(_selection_cost(rs))
        out[m] = row
    for m, row in out.items():
        for ref in ("random", "full"):
            if by_method.get(ref):
                row.update(_vs_reference(by_method[m], by_method[ref], ref))
        if eval_sets:  # the primary set's differences are the row's own: not bootstrapped twice
            vs_primary = {k: v for k, v in row.items() if "_vs_" in k}
            row["eval_sets"] = {name: _set_summary(by_method, m, name, eval_sets[0],
                                                   vs_primary if name == eval_sets[0] else None)
                                for name in eval_sets}
    return out


def _set_summary(by_method: dict[str, list[dict[str, Any]]], m: str, name: str, primary: str,
                 known_vs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Method ``m`` on evaluation set ``name``: held-out loss (mean, std over seeds) with its 95 % interval
    (:func:`clusterlm.stats.bootstrap_loss`), the loss before training, the examples evaluated, and the difference to
    random and to full data on that set with its interval (:func:`_vs_reference`; ``known_vs``: those already
    computed, for the primary set)."""
    rs = on_set(by_method[m], name, primary)
    if not rs:
        return {"loss": None, "ci95": None}
    loss, std = _mean_std([r["eval_loss"] for r in rs])
    interval = _loss_interval(rs)
    ci95 = None if interval is None else list(interval[1:])
    before = next((r["initial_eval_loss"] for rr in by_method.values() for r in on_set(rr, name, primary)
                   if r.get("initial_eval_loss") is not None), None)
    row = {"loss": loss, "loss_std": std, "ci95": ci95, "initial_loss": before, "n_eval": rs[0].get("n_eval")}
    if known_vs is not None:
        return row | known_vs
    for ref in ("random", "full"):
        ref_rs = on_set(by_method.get(ref) or [], name, primary)
        if ref_rs:
            row.update(_vs_reference(rs, ref_rs, ref))
    return row


def _selection_cost(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """Selection cost in training units: tokens read by the selection (mean over seeds; None when not counted),
    its seconds split by stage (the plan's timings: features, kmeans, picks, ...; mean over seeds), and the
    selection model's load time (once per compare, shared by every method; not in ``selection_s``)."""
    tokens = [r.get("selection_tokens") for r in rs]
    split: dict[str, float] = {}
    for key in sorted({k for r in rs for k in (r.get("timings") or {}) if k != "total"}):
        split[key] = float(np.mean([float((r.get("timings") or {}).get(key, 0.0)) for r in rs]))
    loads = [r["model_load_s"] for r in rs if r.get("model_load_s") is not None]
    return {"selection_tokens": None if None in tokens else float(np.mean(tokens)), "selection_split_s": split,
            "model_load_s": float(np.mean(loads)) if loads else None}


def _loss_arrays(rs: list[dict[str, Any]], per_example: bool) -> tuple[np.ndarray, np.ndarray]:
    """(seeds, examples) summed token losses and answer tokens (one pseudo-example per run without them)."""
    if per_example:
        return (np.asarray([r["eval_examples"]["loss_sums"] for r in rs], dtype=np.float64),
                np.asarray([r["eval_examples"]["tokens"] for r in rs], dtype=np.float64))
    return np.asarray([[r["eval_loss"]] for r in rs], dtype=np.float64), np.ones((len(rs), 1))


def delta_between(rs: list[dict[str, Any]], ref: list[dict[str, Any]]) -> Delta | None:
    """Held-out loss of the units ``rs`` minus that of ``ref`` (compare records of two methods), with the
    two-level bootstrap interval (:func:`clusterlm.stats.bootstrap_delta`: paired by seed when both ran the same
    seeds; over the evaluation examples when every record has its per-example losses, else over seeds only).
    None when a loss is missing."""
    both = rs + ref
    if not rs or not ref or any(r["eval_loss"] is None or not math.isfinite(r["eval_loss"]) for r in both):
        return None
    sizes = {len(r["eval_examples"]["tokens"]) if r.get("eval_examples") else 0 for r in both}
    per_example = 0 not in sizes and len(sizes) == 1
    return bootstrap_delta(*_loss_arrays(rs, per_example), *_loss_arrays(ref, per_example),
                           seeds_a=[r["seed"] for r in rs], seeds_b=[r["seed"] for r in ref], n_boot=N_BOOT, seed=0)


def _vs_reference(rs: list[dict[str, Any]], ref: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """``delta_vs_<name>``, ``ci95_vs_<name>``, whether the seeds were paired, the seeds that would resolve 1 %.

    The interval is :func:`clusterlm.stats.bootstrap_delta`'s (seeds, then evaluation examples; paired by seed when
    both ran the same seeds); runs recorded without per-example losses resample the seeds only.
    """
    d = delta_between(rs, ref)
    if d is None:
        return {f"delta_vs_{name}": None, f"ci95_vs_{name}": None}
    per_example = all(r.get("eval_examples") for r in rs + ref) and d.n_examples > 1
    ref_loss = float(np.mean([r["eval_loss"] for r in ref]))
    return {f"delta_vs_{name}": d.delta, f"ci95_vs_{name}": [d.low, d.high], f"paired_vs_{name}": d.paired,
            f"interval_vs_{name}": "seeds x eval examples" if per_example else "seeds only",
            f"seeds_for_1pct_vs_{name}": seeds_to_resolve(d, ref_loss),
            f"eval_sd_vs_{name}": math.sqrt(d.eval_var),
            f"seed_sd_vs_{name}": None if math.isnan(d.seed_var) else math.sqrt(d.seed_var)}


def _loss_interval(rs: list[dict[str, Any]]) -> tuple[float, float, float] | None:
    """The held-out loss of runs ``rs`` (mean over seeds) with its 95 % interval (:func:`bootstrap_loss`: seeds, then
    evaluation examples when every run has the same per-example losses); None when a run has no finite loss."""
    if any(r["eval_loss"] is None or not math.isfinite(r["eval_loss"]) for r in rs):
        return None
    sizes = {len(r["eval_examples"]["tokens"]) if r.get("eval_examples") else 0 for r in rs}
    return bootstrap_loss(*_loss_arrays(rs, 0 not in sizes and len(sizes) == 1), n_boot=N_BOOT)


def frontier(records: list[dict[str, Any]], methods: list[str], ratios: list[float]) -> list[dict[str, Any]]:
    """Cost and quality of every (ratio, method): tokens trained, selection / training / total seconds and held-out
    loss (means over seeds) with the loss's 95 % interval (seeds, then evaluation examples); full data at ratio 1."""
    points = [(1.0, "full")] if "full" in methods else []
    points += [(r, m) for r in ratios for m in methods if m != "full"]
    out = []
    for ratio, m in points:
        rs = [r for r in records if r["method"] == m and (m == "full" or r["ratio"] == ratio)]
        interval = _loss_interval(rs) if rs else None
        if interval is None:
            continue
        loss, low, high = interval
        row = {"ratio": ratio, "method": m, "seeds": len(rs)}
        row.update({f: float(np.mean([r[f] for r in rs])) for f in ("tokens", "selection_s", "train_s", "total_s")})
        out.append({**row, "eval_loss": loss, "ci95": [low, high]})
    return out


def _verdict_part(m: str, row: dict[str, Any], ref: str, ref_row: dict[str, Any]) -> str:
    """``cluster vs random: -0.0005 [-0.0210, +0.0200], not distinguishable at 3 seeds; 1.39x random's time; ...``"""
    lo, hi = row[f"ci95_vs_{ref}"]
    d = Delta(row[f"delta_vs_{ref}"], lo, hi, row[f"paired_vs_{ref}"], math.nan, math.nan, row["seeds"])
    if not d.distinguishable:
        how = f"not distinguishable at {row['seeds']} seed{'s' if row['seeds'] > 1 else ''}"
    else:
        how = f"{'lower (better)' if d.delta < 0 else 'higher (worse)'} held-out loss than {ref}"
    text = f"{m} vs {ref}: {interval_text(d)}, {how}"
    if ref_row.get("total_s"):
        text += f"; {row['total_s'] / ref_row['total_s']:.2f}x {ref}'s time"
    n = row.get(f"seeds_for_1pct_vs_{ref}")
    if d.distinguishable:
        return text
    if n is not None:
        return text + f"; ~{n} seeds would resolve a 1 % difference"
    if row[f"seed_sd_vs_{ref}"] is None:
        return text + "; one seed: run >= 2 seeds to know how many would resolve 1 %"
    return text + "; the evaluation set alone is too small to resolve 1 % (add evaluation examples)"


def verdicts(summary: dict[str, dict[str, Any]]) -> list[str]:
    """One ``verdict:`` line per method in plain words: its difference to random and to full data, with the
    95 % interval, whether that resolves it, the time ratio and the seeds a 1 % difference would need."""
    lines = []
    for m, row in summary.items():
        parts = [_verdict_part(m, row, ref, summary[ref]) for ref in ("random", "full")
                 if ref in summary and ref != m and row.get(f"ci95_vs_{ref}") is not None]
        if not parts:
            alone = "the reference" if m in ("random", "full") else "no random or full run to compare with"
            parts = [f"{m}: {alone}"]
        lines.append("verdict: " + "; ".join(parts) + ".")
    return lines


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
    """The comparison as markdown: per ratio a table (mean ± std over seeds) and one ``verdict:`` line per method;
    the frontier across ratios; the goals at the first ratio."""
    st = result["settings"]
    by_ratio = result.get("summary_by_ratio") or {f"{st['ratio']:g}": result["summary"]}
    lines = [f"Comparison at ratio(s) {', '.join(by_ratio)}, world size {st['world_size']}, model {st['model']}, "
             f"seeds {result['seeds']}."]
    for ratio, summary in by_ratio.items():
        if len(by_ratio) > 1:
            lines += ["", f"### ratio {ratio}"]
        lines += ["", *_summary_table(summary), "", *verdicts(summary)]
        if len(result.get("eval_sets") or []) > 1:
            lines += eval_set_tables(summary, result["eval_sets"])
    if len(by_ratio) > 1:
        lines += ["", f"### selection cost at ratio {next(iter(by_ratio))}"]
    lines += ["", *_cost_table(next(iter(by_ratio.values())))]
    if len(result.get("frontier") or []) > 1 and len(by_ratio) > 1:
        lines += ["", "### frontier (held-out loss against cost; 95 % interval over seeds and evaluation examples)", "",
                  "| ratio | method | tokens trained | selection s | training s | total s | held-out loss [95 %] |",
                  "|---:|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {p['ratio']:g} | {p['method']} | {p['tokens']:,.0f} | {p['selection_s']:.2f} | "
                  f"{p['train_s']:.1f} | {p['total_s']:.1f} | {p['eval_loss']:.4f} [{p['ci95'][0]:.4f}, "
                  f"{p['ci95'][1]:.4f}] |" for p in result["frontier"]]
    if result.get("features_note"):
        lines += ["", result["features_note"]]
    if result.get("goals"):
        lines += ["", "| ratio | value |", "|---|---:|"]
        lines += [f"| {k} | {v:.4f} |" for k, v in result["goals"].items()]
    return "\n".join(lines)


def _cost_table(summary: dict[str, dict[str, Any]]) -> list[str]:
    """Selection cost in training units: tokens read vs trained, seconds by stage (means over seeds)."""
    rows = [(m, r) for m, r in summary.items() if "selection_split_s" in r]
    loads = [r["model_load_s"] for _, r in rows if r.get("model_load_s") is not None]
    lines = ["| method | tokens read by selection | tokens trained | read / trained | selection s by stage |",
             "|---|---:|---:|---:|---|"]
    for m, r in rows:
        read = r.get("selection_tokens")
        shown = "not counted" if read is None else f"{read:,.0f}"
        ratio = "" if read is None or not r["tokens"] else f"{read / r['tokens']:.2f}"
        stages = ", ".join(f"{k} {v:.2f}" for k, v in r["selection_split_s"].items()) or "-"
        lines.append(f"| {m} | {shown} | {r['tokens']:,.0f} | {ratio} | {stages} |")
    if loads:
        lines += ["", f"model load (once, shared by every method, not in selection s): {max(loads):.2f} s"]
    return lines


def _summary_table(summary: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| method | fraction | tokens trained | selection s | training s | total s | held-out loss |",
             "|---|---:|---:|---:|---:|---:|---:|"]

    def pm(row: dict[str, Any], f: str, digits: int) -> str:
        if row["seeds"] < 2:
            return f"{row[f]:.{digits}f}"  # one seed: no spread to show
        return f"{row[f]:.{digits}f} ± {row[f + '_std']:.{digits}f}"

    for m, row in summary.items():
        lines.append(f"| {m} | {row['fraction']:.3f} | {row['tokens']:,.0f} | {pm(row, 'selection_s', 2)} | "
                     f"{pm(row, 'train_s', 1)} | {pm(row, 'total_s', 1)} | {pm(row, 'eval_loss', 4)} |")
    return lines


def plot_compare(result: dict[str, Any], path: Path) -> Path | None:
    """``compare.png``: at the first ratio, stacked selection + training seconds and held-out loss with std error
    bars; and the frontier: held-out loss against total seconds per method across the ratios, with the 95 %
    intervals and the full-data point."""
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
    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(18, 4.6))
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
    ax1.set_title(f"held-out loss at ratio {result['settings']['ratio']:g} (mean ± std over seeds)")
    ax1.grid(axis="y", alpha=0.3)
    _plot_frontier(ax2, result.get("frontier") or [])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_frontier(ax: Any, points: list[dict[str, Any]]) -> None:
    """Held-out loss against total seconds, one line per method over its ratios (labelled), full data a star."""
    for i, m in enumerate(dict.fromkeys(p["method"] for p in points)):
        ps = sorted((p for p in points if p["method"] == m), key=lambda p: p["ratio"])
        x = [p["total_s"] for p in ps]
        y = np.array([p["eval_loss"] for p in ps])
        err = np.array([[p["eval_loss"] - p["ci95"][0] for p in ps], [p["ci95"][1] - p["eval_loss"] for p in ps]])
        style = ({"marker": "*", "markersize": 14, "color": "black"} if m == "full"
                 else {"marker": "o", "color": f"C{i}"})
        ax.errorbar(x, y, yerr=np.maximum(err, 0), capsize=3, label=m, linestyle="-" if len(ps) > 1 else "none",
                    **style)
        for p in ps if m != "full" else ():
            ax.annotate(f"{p['ratio']:g}", (p["total_s"], p["eval_loss"]), textcoords="offset points", xytext=(4, 4),
                        fontsize=7)
    ax.set_xlabel("total seconds (selection + training, mean over seeds)")
    ax.set_ylabel("held-out answer loss")
    ax.set_title("frontier: loss vs cost per ratio (95 % intervals)")
    ax.grid(alpha=0.3)
    if points:
        ax.legend(fontsize=7)
