"""One ``clusterlm select`` run, stage by stage: load -> features (store, resume) -> cluster -> plan -> save/report.

The same route for one process and for ``N`` processes (:class:`SelectJob` ``nproc``, or a launch by hand with
``torchrun --nproc-per-node N -m clusterlm select ARGS``)::

    job = SelectJob(model="tiny-llama", data="train.jsonl", out="plan/", config=SelectConfig(world_size=2, ratio=0.31))
    plan = run_select(job)

1. check: every setting (:meth:`clusterlm.SelectConfig.check`), the data file and the output directories,
   before any model or data loads;
2. load: the data file is read before the model (a bad file fails fast), then the model on its device and
   dtype (:func:`clusterlm.models.load_model`), then the tokenised data; the settings are resolved against
   the data (:meth:`clusterlm.SelectConfig.resolve`) before any feature is computed;
3. features: into ``OUT/features`` (or ``feature_store``), resumable; with ``N`` processes each featurizes
   its shards (:func:`clusterlm.selection.distributed.featurize_sharded`);
4. cluster and pick: :func:`clusterlm.selection.select.select_from_features`, with the distributed K-means
   (:class:`clusterlm.selection.distributed.DistributedClustering`) under ``N`` processes; the plan carries its data
   record from the start;
5. save: ``plan.json`` / ``plan.npz`` and ``report.png`` (rank 0).

With ``nproc > 1`` and no process group yet, :func:`run_select` starts the processes itself through torch's
launcher (:func:`clusterlm.launch.launcher.spawn`, running ``python -m clusterlm select``) and returns the plan rank 0
wrote. The plan equals the single-process one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from clusterlm.config.selection import SELECT_CONFIG, ResolvedSelection, SelectJob
from clusterlm.data import CHAT_TEMPLATE_MODES, load_data, read_data
from clusterlm.fileio import atomic_write_json, storage_errno, storage_error
from clusterlm.launch.failures import removed_if_empty
from clusterlm.launch.launcher import (
    DistInfo,
    SpawnFailed,
    barrier,
    checked_by_launcher,
    init_distributed,
    spawn_with_config,
    under_torchrun,
)
from clusterlm.launch.preemption import (
    DEFAULT_GRACE_S,
    PREEMPTED_EXIT,
    SHUTDOWN_MARGIN_S,
    Preempted,
    PreemptionWatch,
)
from clusterlm.models import load_model, resolve_device
from clusterlm.plan import Plan
from clusterlm.plan.report import draw_report, save_report_data
from clusterlm.selection.distributed import DistributedClustering, featurize_sharded
from clusterlm.selection.select import (
    build_featurizer,
    check_store_signals,
    feature_settings,
    featurizer_record,
    select_from_features,
)
from clusterlm.selection.store import FeatureStore

__all__ = ["SELECT_CONFIG", "STORE_KEY", "SelectJob", "SpawnFailed", "check_job", "run_select", "writable_dir"]

STORE_KEY = "clusterlm_select.json"  # in OUT/features: what the features there were computed from


def writable_dir(path: str | os.PathLike, option: str) -> Path:
    """``path`` as a directory this process can write into: created when missing, checked with a probe file.

    Raises:
        ValueError: ``path`` is a file, sits under a file, or cannot be created or written (one line naming
            ``option`` and the path).
        StorageError: the disk (or quota) is full.
    """
    if not str(path).strip():
        raise ValueError(f"{option} is empty; give a directory (created when missing).")
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ValueError(f"{option} {p} is not a directory (it is a file); give a directory (created when missing).")
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".clusterlm-probe-", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        if storage_errno(err) is not None:
            raise storage_error(err, p) from err
        blocker = next((q for q in p.parents if q.exists() and not q.is_dir()), None)
        if blocker is not None:
            raise ValueError(f"{option} {p} is not a directory: {blocker} is a file; give another path.") from err
        raise ValueError(
            f"{option} {p} is not writable ({err.strerror or err}); give a directory you can write to."
        ) from err
    return p


def check_job(job: SelectJob) -> None:
    """Every setting and the output locations, before any model or data loads.

    Raises:
        ValueError / TypeError: a bad setting (named); FileNotFoundError: no such data file.
    """
    job.check()
    resolve_device(job.device)  # --device cuda without CUDA: one line now, never a silent CPU run
    if isinstance(job.data, (str, os.PathLike)) and not Path(job.data).expanduser().exists():
        raise FileNotFoundError(f"select: --data {job.data}: no such file or directory.")
    writable_dir(job.out, "--out")
    if job.feature_store:
        writable_dir(job.feature_store, "--feature-store")


def run_select(job: SelectJob) -> Plan:
    """Run the selection of ``job`` (module docstring); returns the plan (also saved in ``job.out``).

    Raises:
        ValueError / TypeError / FileNotFoundError: bad settings or inputs, before any model work where they can
            be told without the data.
        SpawnFailed: the processes of an ``nproc > 1`` run failed (their line is printed already).
    """
    with removed_if_empty(job.out or ".", _wrote_output):
        if not checked_by_launcher():  # a launched rank's job was checked by its launcher
            check_job(job)
        if under_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
            return _select_rank(job)
        if job.nproc > 1:
            return _spawn(job)
        return _select(job, None)


def _wrote_output(out: Path) -> bool:
    """A selection's first output: a plan, or a feature shard (kept: a rerun resumes from it)."""
    store = out / "features"
    return (out / "plan.json").exists() or (store / "features.npy").exists() or any(store.glob("shard_*.npy"))


def _spawn(job: SelectJob) -> Plan:
    """Start ``job.nproc`` ranks on the job's config file (OUT/select_config.yaml); the plan rank 0 wrote."""
    env = {"CLUSTERLM_DEBUG": "1"} if job.debug else None  # the ranks show tracebacks too
    path = Path(job.out) / SELECT_CONFIG
    try:
        spawn_with_config("select", path, job.save(path), job.nproc, env=env, max_restarts=job.max_restarts,
                          shutdown_timeout=DEFAULT_GRACE_S + SHUTDOWN_MARGIN_S)
    except SpawnFailed as e:
        if e.code == PREEMPTED_EXIT:  # the ranks stopped on a preemption signal (they print nothing)
            raise _preempted(job, "") from None
        raise
    return Plan.load(job.out)


def _select_rank(job: SelectJob) -> Plan:
    """One rank of a process group. On a preemption signal (SIGTERM, SIGUSR1, SIGINT: to this rank, or passed on by
    the agent) it stops after the feature shard in flight, or before the clustering, with :class:`Preempted`; the
    stored shards are kept and a rerun completes the same plan. An error after the signal is the preemption too
    (a peer that stopped ended a collective here). ``DEFAULT_GRACE_S`` without stopping ends the rank at once."""
    watch = PreemptionWatch(DEFAULT_GRACE_S)

    def stop() -> None:
        if watch.noted():
            raise _preempted(job, watch.signal_name)

    try:
        return _select(job, init_distributed(timeout=job.dist_timeout), stop)
    except Preempted:
        raise
    except Exception:
        if watch.noted():
            raise _preempted(job, watch.signal_name) from None
        raise
    finally:
        watch.close()


def _preempted(job: SelectJob, signal_name: str) -> Preempted:
    """The preemption of ``job``: the features stored so far, and how to continue."""
    store = _store_path(job)
    try:
        rows = FeatureStore(store).rows_done()
    except (OSError, ValueError):
        rows = 0
    config = Path(job.out) / SELECT_CONFIG  # kept with OUT once a shard is stored there (else OUT is removed)
    kept = config.is_file() and _wrote_output(Path(job.out))
    return Preempted(f"with the features of {rows} examples stored in {store} (a rerun reuses them)",
                     f"clusterlm select --config {config}" if kept else "the same command", signal_name)


class _StopsOnPreemption:
    """A featurizer that calls ``stop()`` after each feature shard it stores (``stop`` raises on a preemption)."""

    def __init__(self, featurizer: Any, stop: Callable[[], None]) -> None:
        self._featurizer, self._stop = featurizer, stop

    def __getattr__(self, name: str) -> Any:
        return getattr(self._featurizer, name)

    def featurize_shards(self, *args: Any, on_shard: Callable[[int], None] | None = None, **kwargs: Any) -> Any:
        def stored(index: int) -> None:
            if on_shard is not None:
                on_shard(index)
            self._stop()

        return self._featurizer.featurize_shards(*args, on_shard=stored, **kwargs)


def _stage(show: bool, step: str, text: str) -> float:
    if show:
        print(f"[{step}] {text}", flush=True)
    return time.perf_counter()


def _select(job: SelectJob, info: DistInfo | None, stop: Callable[[], None] | None = None) -> Plan:
    """The stages on this process: alone (``info`` None) or as one rank of a process group (``stop()`` raises
    :class:`Preempted` after a preemption signal; called after each feature shard and before the clustering)."""
    main_rank = info is None or info.rank == 0
    show = main_rank and job.progress
    where = f" on {info.world_size} processes" if info else ""
    t0 = _stage(main_rank, "1/4", f"model {job.model}{where}, device {job.device}, dtype {job.dtype}")
    raw = read_data(job.data)  # a bad data file fails before the model loads
    model, tokenizer, model_id = load_model(job.model, device=job.device, dtype=job.dtype)
    data = load_data(raw, tokenizer, max_length=job.max_length, progress=show,
                     chat_template=CHAT_TEMPLATE_MODES[job.chat_template])
    if main_rank:
        truncated = f", {data.n_truncated} truncated to {job.max_length} tokens" if data.n_truncated else ""
        truncated += f", {data.n_empty} skipped (empty answer)" if getattr(data, "n_empty", 0) else ""
        print(f"      data {job.data}: {len(data)} examples ({data.format}, rendering {data.rendering}), "
              f"{int(data.lengths.sum())} tokens{truncated} [{time.perf_counter() - t0:.1f} s]")
    s = job.config.resolve(len(data), data.lengths)
    featurizer = build_featurizer(model, s, job.config)
    store_dir = _feature_store(job, data, model_id, s) if main_rank else None
    if info is not None:
        barrier()  # rank 0 has emptied a stale OUT/features
        store_dir = _store_path(job)
    _stage(main_rank, "2/4", f"gradient features ({s.features}) -> {store_dir}"
           + (f", sharded over {info.world_size} processes" if info else
              f", K-means, world size {job.config.world_size}"))
    t1 = time.perf_counter()
    feats, cluster_fn, extra = _features(job, featurizer if stop is None else _StopsOnPreemption(featurizer, stop),
                                         data, store_dir, info, show)
    if stop is not None:
        stop()
    signals = FeatureStore(store_dir).signals()  # each example's gradient norm and loss, stored with the features
    check_store_signals(signals, s, store_dir)
    plan = select_from_features(
        feats, job.config, lengths=data.lengths, fingerprint=data.fingerprint(), model_id=model_id,
        timings={"features": time.perf_counter() - t1}, cluster_fn=cluster_fn, resolved=s,
        device=featurizer.device,  # the K-means runs on the model's GPU when it can (select.kmeans_device)
        extra_config={"features": featurizer_record(featurizer, s), **extra, "data": _data_record(job, data)},
        signals=signals,
    )
    if main_rank:
        _save(job, plan, feats, s, t0 if info else None)
    if info is not None:
        barrier()
    return plan


def _features(job: SelectJob, featurizer: Any, data: Any, store_dir: Path, info: DistInfo | None,
              show: bool) -> tuple[Any, Any, dict[str, Any]]:
    """The features of all examples, the clustering to use (None: in this process) and what the plan records."""
    batch_tokens = job.config.batch_tokens or featurizer.auto_batch_tokens()  # None: from free device memory
    if info is None:
        return featurizer.featurize(data, batch_tokens=batch_tokens, store=store_dir, progress=show), None, {}
    part = featurize_sharded(featurizer, data, store_dir, rank=info.rank, world_size=info.world_size,
                             batch_tokens=batch_tokens, progress=show)
    clustering = DistributedClustering(part.local(), n_total=len(data), progress=show)
    return FeatureStore(store_dir).features(), clustering, {"selection_processes": info.world_size}


def _save(job: SelectJob, plan: Plan, feats: Any, s: ResolvedSelection, t_start: float | None) -> None:
    out = Path(job.out)
    _stage(True, "3/4", f"writing {out}/plan.json, plan.npz")
    plan.save(out)
    job.save(out / SELECT_CONFIG)
    save_report_data(out, np.asarray(feats), seed=s.seed)
    _stage(True, "4/4", f"drawing {out}/report.png")
    draw_report(out, plan)
    print()
    print(plan.summary())
    took = f"  [{time.perf_counter() - t_start:.1f} s]" if t_start is not None else ""
    print(f"\nplan:   {out / 'plan.json'} (+ plan.npz)\nreport: {out / 'report.png'}{took}")


def _store_path(job: SelectJob) -> Path:
    return Path(job.feature_store) if job.feature_store else Path(job.out) / "features"


def _feature_store(job: SelectJob, data: Any, model_id: str, s: ResolvedSelection) -> Path:
    """``feature_store``, else ``OUT/features``: emptied first when it holds features of other data or settings.

    A failure after the features are computed loses nothing (the rerun resumes from the store); a rerun with
    another model, data, feature choice or seed into the same OUT recomputes instead of failing on the store.
    """
    store = _store_path(job)
    if job.feature_store:
        return store
    key = json.loads(json.dumps({"model": model_id.rpartition("@")[2], "data": data.fingerprint(),
                                 **feature_settings(s, job.config)}))
    try:
        found = json.loads((store / STORE_KEY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        found = None
    if found == key:
        return store
    if store.exists():
        print(f"      features: {store} holds features of other data or settings; computing them again", flush=True)
        shutil.rmtree(store)
    store.mkdir(parents=True, exist_ok=True)
    atomic_write_json(store / STORE_KEY, key)
    return store


def _data_record(job: SelectJob, data: Any) -> dict[str, Any]:
    """What the plan records about its data: ``train`` takes max_length from it; with rendering, a mismatch of
    ``--max-length`` or ``--chat-template`` can be named instead of a differing content hash."""
    record = {"source": str(job.data), "max_length": job.max_length, "n_truncated": data.n_truncated,
              "format": data.format, "rendering": data.rendering}
    if getattr(data, "n_empty", 0):  # examples skipped for an empty answer (their 0-based lines in the source)
        record |= {"n_empty": int(data.n_empty), "empty_indices": [int(i) for i in data.empty_indices]}
    return record
