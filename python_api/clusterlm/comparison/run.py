"""``clusterlm compare``: every selection method through the same trainer and evaluation, side by side.

Run, from Python::

    import clusterlm
    result = clusterlm.compare(clusterlm.CompareConfig(methods=("random", "cluster"), seeds=(0, 1),
                                                       train={"max_steps": 20}))
    print(result.markdown())

or from the shell::

    clusterlm compare --model tiny-llama-pretrained --ratio 0.31 --world-size 2 --seeds 3 --out runs/compare
    clusterlm compare --data train.jsonl --eval-data heldout.jsonl --model /models/llama --methods random,cluster
    clusterlm compare --config cmp.yaml

Methods (``--methods``, comma-separated; default all):

- ``full``: all data (:func:`clusterlm.selection.baselines.full_plan`);
- ``random``: uniform sample at the budget (:func:`clusterlm.selection.baselines.random_plan`);
- ``cluster``: CluSTER, the ``default`` preset (:func:`clusterlm.selection.select.select`);
- ``cluster-whole``: CluSTER, the ``default`` preset with whole-example features (``feature_tokens="all"``
  instead of the 64-token feature window: what the window costs in quality, and saves in time);
- ``cluster-tokens``: CluSTER, the ``default`` preset with a token budget (``token_ratio=--ratio``: the
  same share of the *tokens*, not of the examples; training cost follows tokens);
- ``cluster-paper``: CluSTER, the ``paper`` preset: the authors' selection as their code runs it (sklearn
  K-means and their greedy 1.5 N / K cap, :mod:`clusterlm.selection.paper`);
- ``cluster-paper-exact``: the ``paper`` preset on this library's exact capacity K-means
  (``clustering="exact"``): the same steps, the cap met exactly;
- ``longest``: the examples with the most answer tokens at the same example budget
  (:func:`clusterlm.selection.baselines.longest_plan`);
- ``s2l`` / ``ifd`` / ``less``: :mod:`clusterlm.selection.baselines.s2l`, :mod:`.ifd`, :mod:`.less`;
- a cluster method with selection settings, ``cluster[feature_tokens=32,within_cluster=kcenter]``
  (:func:`parse_method`): any :class:`clusterlm.SelectConfig` setting but the budget, world size and seed; its
  label is the spec as written.

``--ratios 0.1,0.2,0.31`` runs every method at each budget (full data once, at ratio 1); the cluster methods'
features are computed once per model, data and feature settings into ``OUT/features/`` and reused by every
cluster method and ratio with those settings (a reusing unit is still charged the features' computing time).

For every ``(ratio, method, seed)``: the selection runs in this process on the loaded model and is timed (wall clock
of the selection call: everything a method needs — features, forwards, proxy training, LoRA warm-up, clustering; model
and data loading, common to all methods, are not counted); its plan is saved to
``OUT/runs/<method>-r<ratio>-s<seed>/plan`` (full data: ``full-s<seed>``) and trained by the reference trainer
(:func:`clusterlm.train`, ``nproc`` = world size) with identical hyper-parameters, seed and held-out data for every
method; training seconds = the trainer's ``train_time_s`` (the sum over steps of the slowest rank's step time:
training proper, without model loading and evaluation); total = selection + training. Held-out loss = the trainer's
final token-weighted answer loss on the evaluation data (default: the demo held-out split minus the last
``--n-validation`` examples, which LESS uses as its validation set, so no method is evaluated on examples it saw; by
default 32 when LESS is among the methods and 0 otherwise, and the value is part of the settings key, so records
evaluated on other examples are never mixed).

Selection runs with ``world_size x --threads`` torch threads on CPU (the training ranks' CPUs together), once the
processes of the previous unit's training have exited (:mod:`clusterlm.comparison.settle`).

Resumable: each finished ``(ratio, method, seed)`` is appended to ``OUT/compare_state.jsonl`` with a key of the
settings at its ratio (with its per-example held-out losses); a rerun with the same settings skips those and
runs the rest (a unit stopped in its training, by a preemption signal or a kill, resumes it from its checkpoint;
one stopped earlier is redone; a preemption signal exits 75). Outputs: ``compare.json`` (records, per-method
mean/std and the differences to random and to full data with their 95 % intervals, per ratio; the
``frontier``), ``eval_losses.json`` (every unit's per-example losses), ``compare.md`` (tables and one
``verdict:`` line per method) and ``compare.png`` (:mod:`clusterlm.comparison.plot`).
Intervals: :mod:`clusterlm.comparison.bootstrap` (two-level bootstrap over seeds and evaluation examples, paired
by seed when the methods ran the same seeds).

Several evaluation sets: ``--eval-data code=a.jsonl --eval-data math=b.jsonl``
(:mod:`clusterlm.comparison.evaluation`; a bare path is named after its file stem). The first is primary:
``eval_loss``, the intervals vs random / full, the verdicts and the frontier are its. Every run evaluates every set
(the trainer evaluates them together from one tokenised file, ``OUT/eval_sets/``, so one evaluation gives every
set's per-example losses, before training too); each method's summary gains ``eval_sets: {name: {loss, ci95,
initial_loss, delta_vs_random, ci95_vs_random, delta_vs_full, ...}}``, ``compare.md`` a table per set,
``eval_losses.json`` each unit's losses per set. No evaluation example may also be a training example, nor one of
LESS's validation examples: checked on the raw records' whitespace-normalised text before any model work
(:func:`clusterlm.comparison.evaluation.check_overlap`). With several sets the settings key holds their names and
content hashes; one set keys by its path, as before.

The settings: :mod:`clusterlm.config.comparison`; the statistics: :mod:`clusterlm.comparison.statistics`; the outputs:
:mod:`clusterlm.comparison.output`; the picture: :mod:`clusterlm.comparison.plot`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clusterlm.comparison.evaluation import (
    EvalSet,
    content_hash,
    eval_layout,
    eval_losses_file,
    eval_sets_of,
    read_eval_sets,
    set_losses,
)
from clusterlm.comparison.metrics import item_scores
from clusterlm.comparison.output import FEATURES, CompareResult, build_result, markdown_table
from clusterlm.comparison.plot import plot_compare
from clusterlm.comparison.settle import wait_for_launched
from clusterlm.config.comparison import (
    CLUSTER_METHODS,
    COMPARE_CONFIG,
    METHODS,
    N_VALIDATION,
    CompareConfig,
    budget_of,
    method_config,
    parse_method,
)
from clusterlm.data import CHAT_TEMPLATE_MODES, load_data
from clusterlm.data.demo import demo_data
from clusterlm.engine.step import CKPT_DIR, EVAL_EXAMPLES, LATEST, find_checkpoint
from clusterlm.fileio import atomic_write_text
from clusterlm.launch.launcher import SpawnFailed
from clusterlm.launch.preemption import Interrupted, Preempted, PreemptionWatch, interrupt
from clusterlm.models import load_model, resolve_device
from clusterlm.plan import Plan
from clusterlm.selection.baselines import full_plan, ifd_plan, less_plan, longest_plan, random_plan, s2l_plan
from clusterlm.selection.select import feature_settings, select
from clusterlm.selection.store import FeatureStore
from clusterlm.training.loop import INITIAL_EVAL_EXAMPLES, TASK_RECORDS
from clusterlm.training.run import train

__all__ = ["EVAL_LOSSES", "STATE", "compare", "read_state", "selected_tokens", "selection_threads", "selection_tokens"]

STATE = "compare_state.jsonl"
UNIT_SELECTION = "selection.json"  # in a unit's run directory: its selection's timings, for a resumed training
EVAL_LOSSES = "eval_losses.json"  # every unit's per-example held-out losses, next to compare.json


def _settings(config: CompareConfig, data_path: str, eval_path: str,
              eval_key: list[list[str]] | None = None) -> dict[str, Any]:
    """The settings a record is keyed by; several evaluation sets add their names and content hashes (one set keys
    by its path, as before, so the records of an earlier compare are reused)."""
    t = config.train
    out = {"model": config.model, "ratio": config.ratio, "world_size": config.world_size, "epochs": t.epochs,
           "max_steps": t.max_steps, "micro_batch_size": t.micro_batch_size, "lr": t.lr, "warmup_ratio": t.warmup_ratio,
           "max_length": t.max_length, "n_validation": config.n_validation, "eval_max_examples": t.eval_max_examples,
           "threads": t.threads, "device": t.device, "dtype": config.dtype, "s2l_clusters": config.s2l_clusters,
           "s2l_epochs": config.s2l_epochs, "less_epochs": config.less_epochs, "less_dim": config.less_dim,
           "bf16": t.bf16, "lora_r": t.lora_r, "chat_template": t.chat_template}
    out["data"] = str(Path(data_path).resolve())
    out["eval_data"] = str(Path(eval_path).resolve())
    if eval_key:
        out["eval_sets"] = eval_key
    if config.budget != "examples":  # (example budgets key as before: earlier records stay reusable)
        out["budget"] = config.budget
    if t.tasks.eval_task:  # (runs without tasks key as before)
        out["tasks"] = t.tasks.to_dict()
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


def _select(method: str, model: Any, data: Any, validation: Any, config: CompareConfig, ratio: float, seed: int,
            model_id: str, feature_store: Path | None = None) -> Any:
    """The plan of ``method`` at ``ratio`` (a :data:`METHODS` name or a variant, :func:`parse_method`; the call that
    is timed), at the budget :func:`clusterlm.config.comparison.budget_of` gives it."""
    ws = config.world_size
    spec = parse_method(method)
    method = spec.base
    budget = budget_of(spec, ratio, config.budget)
    if method == "full":
        return full_plan(data, ws, seed=seed, model_id=model_id)
    if method == "random":
        return random_plan(data, ws, **budget, seed=seed, model_id=model_id)
    if method == "longest":
        return longest_plan(data, ws, **budget, seed=seed, model_id=model_id)
    if method in CLUSTER_METHODS:
        return select(model, data, method_config(spec, ws, ratio, seed, config.budget), model_id=model_id,
                      progress=False, feature_store=feature_store)
    if method == "s2l":
        return s2l_plan(model, data, ws, **budget, seed=seed, lr=config.train.lr,
                        micro_batch_size=config.train.micro_batch_size, n_clusters=config.s2l_clusters,
                        proxy_epochs=config.s2l_epochs, model_id=model_id)
    if method == "ifd":
        return ifd_plan(model, data, ws, **budget, seed=seed, model_id=model_id)
    if method == "less":
        return less_plan(model, data, ws, **budget, seed=seed, validation=validation, lr=config.train.lr,
                         warmup_epochs=config.less_epochs, micro_batch_size=config.train.micro_batch_size,
                         dim=config.less_dim, model_id=model_id)
    raise ValueError(f"compare: unknown method {method!r}; choose from {', '.join(METHODS)}.")


def compare(config: CompareConfig | Mapping[str, Any]) -> CompareResult:
    """Run (or continue) the comparison of ``config``: every method at every ratio and seed, selected here and
    trained by the reference trainer with the same settings, then summarised.

    Units already recorded in ``OUT/compare_state.jsonl`` with the same settings are not run again, so a rerun
    after an interruption continues where it stopped.

    Args:
        config: the comparison's settings (:class:`clusterlm.CompareConfig`: model, data, held-out data, methods,
            seeds, ratios, world size, ``out``, and ``train``, the training settings every run shares), or a mapping
            of them (read as ``CompareConfig.from_dict`` reads it: unknown names are refused).

    Returns:
        The :class:`CompareResult` (``summary``, ``frontier``, ``verdicts``, ``records``): the content of
        ``OUT/compare.json``. ``OUT`` also gets ``compare.md`` (the tables and one ``verdict:`` line per method),
        ``compare.png``, ``eval_losses.json`` (every run's per-example held-out losses), ``compare_config.yaml``
        (the resolved settings) and ``runs/`` (each run's plan and training outputs).

    Raises:
        TypeError: ``config`` is not a :class:`clusterlm.CompareConfig` or a mapping of its settings, or a setting
            has the wrong type.
        ValueError: a bad setting (ratio(s), world size, method names or settings), a budget a cluster method
            cannot meet on this data, too few evaluation examples, or an evaluation example that is also a training
            example.
        FileNotFoundError: the data or the held-out data is missing.
        RuntimeError: a training run failed (its output is above; rerun to continue from the runs done).
    """
    config = CompareConfig.coerce(config, "clusterlm.compare(clusterlm.CompareConfig(methods=('random', 'cluster'), "
                                          "seeds=(0, 1)))")
    config.check()
    config, eval_sets = _resolved(config)
    data_path, eval_path = _data_paths(config, eval_sets)
    eval_meta = [{"name": s.name, "path": str(Path(s.path).resolve()), "primary": i == 0, "examples": len(raw),
                  "sha256": content_hash(raw)} for i, (s, raw) in enumerate(read_eval_sets(
                      eval_sets, data_path, n_validation=config.n_validation,
                      eval_max_examples=config.train.eval_max_examples))]
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    config.save(out / COMPARE_CONFIG)
    eval_key = [[m["name"], m["sha256"]] for m in eval_meta] if len(eval_meta) > 1 else None
    settings = _settings(config, data_path, eval_path, eval_key)
    # full data: ratio 1 whatever the ratios
    keys = {r: _key({**settings, "ratio": r}) for r in [*config.all_ratios, 1.0]}
    state_path = out / STATE
    wanted = _units(config)
    ratio_of = {k: r for r, k in keys.items()}  # records of other settings have other keys: kept apart
    earlier = {(ratio_of[r["key"]], r["method"], r["seed"]): r for r in read_state(state_path)
               if r.get("key") in ratio_of}
    done = {u: {**earlier[u], "ratio": u[0]} for u in wanted if u in earlier}
    todo = [u for u in wanted if u not in done]
    print(f"compare: {len(config.methods)} method(s) x {len(config.seeds)} seed(s) x {len(config.all_ratios)} "
          "ratio(s); "
          f"{len(done)} done earlier (in {state_path}), {len(todo)} to run")
    if todo:
        _run_units(config, (eval_sets, data_path, eval_path), keys, todo, done, len(wanted))
    records = [done[u] for u in wanted]
    result = build_result(list(config.methods), list(config.seeds), config.all_ratios, settings, keys, records,
                          eval_meta, decide_by=config.decide_by)
    atomic_write_text(out / EVAL_LOSSES, json.dumps(eval_losses_file(records, [m["name"] for m in eval_meta])) + "\n")
    atomic_write_text(out / "compare.json", json.dumps(result, indent=2) + "\n")
    atomic_write_text(out / "compare.md", markdown_table(result) + "\n")
    plot_compare(result, out / "compare.png")
    return CompareResult(result)


def _run_units(config: CompareConfig, inputs: tuple[Any, ...], keys: dict[float, str],
               todo: list[tuple[float, str, int]], done: dict[Any, Any], n_units: int) -> None:
    """Run the units ``todo`` on ``inputs`` (eval sets, data and held-out paths), each recorded in STATE and ``done``.
    A preemption signal stops a selection at once (its stored features are kept), a training after its step (the
    trainer's own watch): :class:`Preempted`; the stopped unit's training resumes on the rerun."""
    out = Path(config.out)
    saved_threads = torch.get_num_threads()  # the selection sets its own; the caller's is restored, error or not
    watch = PreemptionWatch(config.train.preemption_grace, forward=interrupt)
    unit = ""
    try:
        session = _Session.load(config, *inputs, work=out)
        session.check_budgets()
        for ratio, method, seed in todo:
            unit = _run_name(ratio, method, seed)
            record = {"key": keys[ratio], "ratio": ratio,
                      **session.run_unit(method, seed, out / "runs" / unit, done, ratio=ratio,
                                         store_root=out / FEATURES, key=keys[ratio])}
            _append_state(out / STATE, record)
            done[(ratio, method, seed)] = record
    except (Preempted, Interrupted) as e:
        where = f"in unit {unit} {e.stopped}" if isinstance(e, Preempted) else f"during {unit or 'the setup'}"
        raise Preempted(f"{where}; {len(done)} of {n_units} units done ({out / STATE})",
                        f"clusterlm compare --config {out / COMPARE_CONFIG}", e.signal_name) from None
    finally:
        watch.close()
        torch.set_num_threads(saved_threads)


def _stopped_unit(run_dir: Path, key: str) -> tuple[float, float, bool] | None:
    """(selection s charged, measured, features reused) of a unit of settings ``key`` stopped after a checkpoint."""
    try:
        rec = json.loads((run_dir / UNIT_SELECTION).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if rec.get("key") != key or find_checkpoint(run_dir / "train", LATEST) is None:
        return None
    return float(rec["selection_s"]), float(rec["measured_s"]), bool(rec["reused"])


def _units(config: CompareConfig) -> list[tuple[float, str, int]]:
    """(ratio, method, seed) of every unit, seed-major (an interrupted run has every method at its first seeds);
    full data runs once per seed, at ratio 1."""
    units = []
    for seed in config.seeds:
        if "full" in config.methods:
            units.append((1.0, "full", seed))
        units += [(r, m, seed) for r in config.all_ratios for m in config.methods if m != "full"]
    return units


def _run_name(ratio: float, method: str, seed: int) -> str:
    slug = parse_method(method).slug
    return f"{slug}-s{seed}" if method == "full" else f"{slug}-r{ratio:g}-s{seed}"


def _resolved(config: CompareConfig) -> tuple[CompareConfig, list[EvalSet]]:
    """``config`` with its ratio the first of ``ratios`` and the default ``n_validation`` filled in; the evaluation
    sets (the demo held-out split where none is given)."""
    ratios = config.all_ratios
    if config.n_validation is None:  # the held-out tail is LESS's only when it runs; explicit values always hold
        config = config.replace(n_validation=N_VALIDATION if "less" in config.methods else 0)
    config = config.replace(ratio=ratios[0], ratios=tuple(ratios) if config.ratios else None)
    default = None if config.eval_data else str(demo_data().heldout)
    return config, eval_sets_of(None if config.eval_data is None else list(config.eval_data), default)


def _data_paths(config: CompareConfig, sets: list[EvalSet]) -> tuple[str, str]:
    """Training and held-out data files (the demo splits where not given)."""
    data_path, eval_path = config.data, sets[0].path if sets else None
    if data_path is None or eval_path is None:
        demo = demo_data()
        data_path = data_path or str(demo.train)
        eval_path = eval_path or str(demo.heldout)
    return data_path, eval_path


def selection_threads(config: CompareConfig) -> int:
    """torch CPU threads of the selection: the CPU budget the training ranks have together (world size x threads
    per rank; a rank's default is 1)."""
    return max(1, (config.train.threads or 1) * config.world_size)


@dataclass
class _Session:
    """The model and data every unit shares, loaded once; :meth:`run_unit` selects, trains and records."""

    config: CompareConfig
    eval_sets: list[EvalSet]
    data_path: str
    eval_path: str
    model: Any
    model_id: str
    data: Any
    validation: list[Any]
    n_eval: int
    use_cuda: bool
    model_load_s: float = 0.0  # loading the selection model: once, shared by every unit
    # What the trainer evaluates: the primary set's file (None) or every set's evaluated examples in one file, and
    # (name, start, stop) of each set's examples in the trainer's per-example losses.
    train_eval_path: str | None = None
    eval_slices: tuple[tuple[str, int, int], ...] = ()

    @classmethod
    def load(cls, config: CompareConfig, eval_sets: list[EvalSet], data_path: str, eval_path: str,
             work: Path | None = None) -> _Session:
        """The selection model, the training data and every evaluation set (several: tokenised into one file under
        ``work`` that the trainer evaluates, :func:`eval_layout`)."""
        device = resolve_device(config.train.device)
        use_cuda = device.type == "cuda"
        if not use_cuda:
            torch.set_num_threads(selection_threads(config))
        # the selection model (features, S2L's and LESS's proxies), straight onto its device in --dtype
        t0 = time.perf_counter()
        model, tokenizer, model_id = load_model(config.model, device=device, dtype=config.dtype)
        model_load_s = time.perf_counter() - t0
        rendering = CHAT_TEMPLATE_MODES[config.train.chat_template]
        data = load_data(data_path, tokenizer, max_length=config.train.max_length, progress=False,
                         chat_template=rendering)
        eval_set = load_data(eval_path, tokenizer, max_length=config.train.max_length, progress=False,
                             chat_template=rendering)
        print(f"   data: {len(data)} training / {len(eval_set)} held-out examples, rendering {data.rendering!r}")
        n_eval_all = len(eval_set)
        # Every method is evaluated on the same examples: the validation tail is held back whichever methods run.
        n_validation = config.n_validation
        if n_validation < 0 or n_validation >= n_eval_all:
            raise ValueError(f"compare: --n-validation must be in [0, {n_eval_all}) (the eval data's size), got "
                             f"{n_validation}.")
        validation = [eval_set[i] for i in range(n_eval_all - n_validation, n_eval_all)]
        n_eval = n_eval_all - n_validation
        if config.train.eval_max_examples:
            n_eval = min(n_eval, config.train.eval_max_examples)
        path, slices = eval_layout(eval_sets, tokenizer, eval_set, n_eval,
                                   Path(config.out) if work is None else work, max_length=config.train.max_length,
                                   eval_max_examples=config.train.eval_max_examples, chat_template=rendering)
        return cls(config, eval_sets, data_path, eval_path, model, model_id, data, validation, n_eval, use_cuda,
                   model_load_s, train_eval_path=path, eval_slices=slices)

    def check_budgets(self) -> None:
        """Every cluster method at every ratio against the data (examples per cluster, size bounds), before any
        selection: one line naming the method and ratio."""
        for label in self.config.methods:
            spec = parse_method(label)
            for ratio in self.config.all_ratios if spec.base in CLUSTER_METHODS else ():
                try:
                    method_config(spec, self.config.world_size, ratio, 0, self.config.budget).resolve(
                        len(self.data), self.data.lengths)
                except ValueError as e:
                    raise ValueError(f"compare: {label} at ratio {ratio:g} of {len(self.data)} examples: "
                                     f"{str(e).removeprefix('select: ')}") from None

    def feature_store(self, method: str, seed: int, root: Path) -> Path | None:
        """The feature store of a cluster unit: one per model, data and feature settings, shared by every cluster
        method and ratio with those settings (None for the other methods)."""
        spec = parse_method(method)
        if spec.base not in CLUSTER_METHODS:
            return None
        select_config = method_config(spec, self.config.world_size, self.config.ratio, seed, self.config.budget)
        s = select_config.resolve(len(self.data), self.data.lengths)
        what = {"model": self.model_id, "data": self.data.fingerprint()["sha256"], "dtype": self.config.dtype,
                "batch_tokens": select_config.batch_tokens, **feature_settings(s, select_config)}
        return root / _key(what)

    def _timed_select(self, method: str, seed: int, store: Path | None = None) -> tuple[Any, float]:
        wait_for_launched()  # the last training's fork server tears down for ~1 s: not on this selection's CPUs
        if not self.use_cuda:  # the trainer restores its own thread count; set ours again per unit
            torch.set_num_threads(selection_threads(self.config))
        else:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        plan = _select(method, self.model, self.data, self.validation, self.config, self.config.ratio, seed,
                       self.model_id, feature_store=store)
        if self.use_cuda:
            torch.cuda.synchronize()
        return plan, time.perf_counter() - t0

    def run_unit(self, method: str, seed: int, run_dir: Path, done: dict[Any, Any], *, ratio: float | None = None,
                 store_root: Path | None = None, key: str = "") -> dict[str, Any]:
        """Select with ``method`` at ``ratio`` (default ``--ratio``), train on the plan, return the unit's record
        (without the settings key); cluster methods keep their features under ``store_root``. A unit of settings
        ``key`` whose training stopped after a checkpoint (a preemption, a kill) resumes it with its selection."""
        if ratio is not None:
            self.config = self.config.replace(ratio=ratio)
        config = self.config
        selected = _stopped_unit(run_dir, key)  # its training stopped after a checkpoint (a preemption): resumed
        if selected is not None:
            plan, (selection_s, measured_s, reused) = Plan.load(run_dir / "plan"), selected
            print(f"\n== {method}, seed {seed}: selected before it stopped; training resumes ==")
        else:
            plan, selection_s, measured_s, reused = self._select_unit(method, seed, run_dir, key, store_root)
        print(f"== {method}, seed {seed}: training ({config.world_size} rank(s)) ==")
        # The loss before training is the same for every unit (same model, same held-out data): measured once.
        base = next((r for r in done.values() if r.get("initial_eval_loss") is not None), None)
        unit = config.train.replace(
            plan=str(run_dir / "plan"), model=config.model, data=self.data_path, out=str(run_dir / "train"),
            eval_data=self.train_eval_path or self.eval_path, eval_max_examples=self.eval_slices[-1][2], seed=seed,
            nproc=config.world_size, overwrite=True, save_model=False, keep_checkpoints=1,
            initial_eval=base is None, resume=None if selected is None else LATEST)
        try:
            summary = train(unit).summary
        except SpawnFailed as e:
            raise RuntimeError(f"compare: training {method} (seed {seed}) failed with status {e.code}; its output is "
                               f"above. Rerun the same command to continue with the units not yet done.") from None
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
            "n_examples": len(self.data), "n_eval": self.n_eval, "n_validation": config.n_validation,
            "fraction": plan.n_selected / len(self.data), "steps": summary["steps"],
            "tokens": summary["tokens"], "timings": plan.timings, "plan_config": plan.config,
            "features_reused": reused, "selection_measured_s": measured_s, "model_load_s": self.model_load_s,
            "selection_tokens": selection_tokens(method, plan, self.data.lengths),
            **selected_tokens(plan, self.data.lengths), **task_fields(run_dir / "train", summary),
        }

    def _select_unit(self, method: str, seed: int, run_dir: Path, key: str,
                     store_root: Path | None) -> tuple[Any, float, float, bool]:
        """A new unit's selection, in an empty ``run_dir``: the plan (saved there), the seconds charged and measured,
        whether the features were reused; recorded in ``run_dir/selection.json`` for a resumed training."""
        if run_dir.exists():
            shutil.rmtree(run_dir)  # a unit killed before its first checkpoint starts again
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
        atomic_write_text(run_dir / UNIT_SELECTION, json.dumps({"key": key, "selection_s": selection_s,
                                                                "measured_s": measured_s, "reused": reused}) + "\n")
        print(f"   {plan.n_selected} of {len(self.data)} examples selected in {selection_s:.2f} s")
        return plan, selection_s, measured_s, reused

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


def selected_tokens(plan: Any, lengths: Any) -> dict[str, Any]:
    """The plan's budget in tokens: ``selected_tokens`` (prompt + answer tokens of the selected examples, once) and,
    with a token budget, ``requested_tokens`` (the plan's record)."""
    chosen = np.unique(np.concatenate([np.asarray(plan.indices(r), dtype=np.int64) for r in range(plan.world_size)]))
    out: dict[str, Any] = {"selected_tokens": int(np.asarray(lengths, dtype=np.int64)[chosen].sum())}
    requested = (plan.stats.get("token_budget") or {}).get("requested_tokens")
    if requested is not None:
        out["requested_tokens"] = int(requested)
    return out


def selection_tokens(method: str, plan: Any, lengths: Any) -> int | None:
    """Tokens the selection's model read, in the units of tokens trained: a cluster method reads every example's
    feature window (``min(length, window)`` tokens, :func:`clusterlm.selection.features.feature_window`; the whole
    example without a window); full, random and longest read none; None for S2L, IFD and LESS (proxy training and
    several passes: not counted)."""
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


def task_fields(train_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """A unit's task metrics for its record: ``task_metrics`` (after training), ``task_scores`` (per metric, a
    score per problem: :func:`clusterlm.comparison.metrics.item_scores`), ``task_eval_s``; {} without tasks."""
    metrics = summary.get("task_metrics")
    if not metrics:
        return {}
    path = train_dir / TASK_RECORDS
    records = json.loads(path.read_text(encoding="utf-8"))["records"] if path.is_file() else {}
    return {"task_metrics": metrics, "task_scores": item_scores(records, metrics),
            "initial_task_metrics": summary.get("initial_task_metrics"),
            "task_eval_s": float(summary.get("task_eval_time_s") or 0.0)}
