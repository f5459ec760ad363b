"""The reference trainer's checks and setup, before the first step: settings against the run, the out directory
and its lock, the process group, the plan and the held-out data (:mod:`clusterlm.training.loop` calls them in order).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from clusterlm.config.defaults import CHAT_TEMPLATE_MODES, CKPT_DIR, DEFAULT_MAX_LENGTH
from clusterlm.config.training import TrainConfig
from clusterlm.fileio import DirLock, LockedError, lock_holder, remove_temporaries
from clusterlm.launch.launcher import DistInfo, init_distributed, under_torchrun
from clusterlm.plan import Plan
from clusterlm.plan.fileformat import plan_dir_hint, read_plan_meta
from clusterlm.training.metrics import METRICS, SUMMARY

# torch, the engine, the models and the data loaders are imported where a check needs them: the process that
# launches the ranks (`clusterlm train --nproc N`) runs check_inputs and check_unlocked only, and starts sooner
# without them (torch alone is ~2 s of a core).

__all__ = ["PlanBuilder", "baseline", "check_checkpoint_kind", "check_inputs", "check_out_dir",
           "check_out_location", "check_unlocked", "load_eval_data", "load_plan", "lock_out", "max_length_of",
           "plan_digest", "plan_world_size", "setup_distributed", "uses_fsdp", "verify_plan", "world_size_error"]

# A baseline plan from the tokenised data: (spec, dataset, world_size, seed=) -> Plan.
PlanBuilder = Callable[..., Plan]


def plan_world_size(plan_dir: str | os.PathLike) -> int:
    """World size recorded in a plan directory's plan.json, read once plan.json passed Plan.load's checks
    (:func:`clusterlm.plan.fileformat.read_plan_meta`): a damaged or hand-edited plan is refused naming the field,
    before any advice about process counts."""
    return int(read_plan_meta(plan_dir)["world_size"])


def world_size_error(plan_ws: int, world_size: int, how: str) -> ValueError:
    """The refusal of a plan made for another world size (``how``: where this run's size comes from)."""
    return ValueError(
        f"train: the plan is for world size {plan_ws} but this run has world size {world_size} ({how}); run "
        f"with {plan_ws} processes in all (--nproc {plan_ws}, or torchrun --nproc-per-node x --nnodes = {plan_ws}), "
        "or make a plan for this world size (clusterlm select --world-size)."
    )


def setup_distributed(config: TrainConfig) -> DistInfo:
    """Join the process group (:func:`clusterlm.launch.launcher.init_distributed`: nccl on CUDA, gloo on CPU), set the
    CPU threads and deterministic algorithms.

    Raises:
        ValueError: ``--nproc x --nnodes`` under torchrun that differs from its world size; ``--device cuda``
            without CUDA.
    """
    if config.nproc is not None and under_torchrun():
        expected, world_size = config.nproc * config.nnodes, int(os.environ["WORLD_SIZE"])
        if expected != world_size:
            raise ValueError(
                f"train: --nproc {config.nproc} x --nnodes {config.nnodes} = {expected} differs from torchrun's world "
                f"size {world_size}; drop --nproc under torchrun or make them agree."
            )
    import torch

    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train: --device cuda but torch sees no CUDA device; use --device cpu or auto.")
    di = init_distributed(device=config.device, timeout=config.dist_timeout)
    use_cuda = di.device.type == "cuda"
    if not use_cuda:
        torch.set_num_threads(config.threads or 1)
    if config.deterministic == "on" or (config.deterministic == "auto" and not use_cuda):
        if use_cuda:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    return di


def check_inputs(config: TrainConfig, *, plan_dir: bool) -> None:
    """Refuse missing inputs and an output location that cannot take the run; before any model is loaded.

    Args:
        config: the run's settings (``data``, ``eval_data``, ``plan``, ``resume``, ``out``).
        plan_dir: ``--plan`` must be a plan directory (not a baseline spec).

    Raises:
        FileNotFoundError: no ``--data`` / ``--eval-data`` / ``--resume`` checkpoint, no plan in ``--plan``.
        ValueError: ``--out`` is a file, lies under a file, or is not writable (:func:`check_out_location`); the
            checkpoint to resume is a DDP one with ``--fsdp`` or a sharded one without (:func:`check_checkpoint_kind`);
            with ``--fsdp``, a model whose decoder blocks cannot be found (:func:`clusterlm.engine.fsdp.check_blocks`).
    """
    for flag, value in (("--data", getattr(config, "data", None)), ("--eval-data", getattr(config, "eval_data", None))):
        if isinstance(value, (str, os.PathLike)) and value and not Path(value).exists():
            raise FileNotFoundError(f"train: {flag} {value}: no such file or directory.")
    if plan_dir and not (Path(config.plan) / "plan.json").is_file():
        hint = plan_dir_hint(config.plan)  # out/plan.npz given: pass out/
        raise FileNotFoundError(f"train: --plan {config.plan} {hint}." if hint else (
            f"train: --plan {config.plan}: no plan there (no plan.json); make one with clusterlm select --out "
            f"{config.plan}, or train a baseline: --plan full, --plan random:<ratio>."
        ))
    resume_from = getattr(config, "resume", None)
    if resume_from is not None:
        from clusterlm.engine.step import find_checkpoint

        found = find_checkpoint(config.out, resume_from)  # FileNotFoundError for a --resume PATH that is none
        if found is not None:
            check_checkpoint_kind(found, fsdp=uses_fsdp(config))
    if uses_fsdp(config):
        from clusterlm.engine.fsdp import check_blocks
        from clusterlm.models import BUILTIN_MODELS, GGUF_MODELS

        if config.model not in BUILTIN_MODELS and config.model not in GGUF_MODELS:
            check_blocks(config.model)  # decoder blocks the sharding can find, from the model's config file
    check_out_location(Path(config.out))


def uses_fsdp(config: TrainConfig) -> bool:
    """The run shards the model with FSDP2 (``--fsdp``)."""
    return bool(getattr(config, "fsdp", False))


def check_checkpoint_kind(path: Path, *, fsdp: bool) -> None:
    """Refuse to resume a DDP checkpoint (one file) with --fsdp, or a sharded one (a directory) without.

    Raises:
        ValueError: the mismatch, in one line.
    """
    from clusterlm.engine.fsdp import checkpoint_kind

    kind = checkpoint_kind(path)
    if kind == "ddp" and fsdp:
        raise ValueError(f"train: --resume {path} is a DDP checkpoint (one file) but this run has --fsdp, which "
                         "resumes sharded checkpoints (a directory); resume it without --fsdp, or start afresh with "
                         "--overwrite.")
    if kind == "fsdp" and not fsdp:
        raise ValueError(f"train: --resume {path} is a sharded FSDP checkpoint (a directory) but this run has no "
                         "--fsdp; resume it with --fsdp, or start afresh with --overwrite.")


def check_out_location(out: Path) -> None:
    """``out`` is (or can become) a directory this process can write; it is created.

    Raises:
        ValueError: ``out`` is a file, lies under a file, or cannot be written (permissions, a read-only
            file system).
    """
    if out.exists() and not out.is_dir():
        raise ValueError(f"train: --out {out} is a file, not a directory; choose another --out.")
    ancestor = next((p for p in out.parents if p.exists()), None)
    if ancestor is not None and not ancestor.is_dir():
        raise ValueError(f"train: --out {out}: {ancestor} is a file, not a directory; choose another --out.")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise ValueError(f"train: --out {out} is not writable ({e.strerror or e}); choose another --out.") from None


def _locked(out: Path, holder: str) -> LockedError:
    return LockedError(out, holder, f"train: --out {out} is in use by another run ({holder}); wait for it to end or "
                       "stop it, or choose another --out.")


def check_unlocked(out: str | os.PathLike) -> None:
    """Refuse an ``out`` that a live run holds (the launcher asks before it starts any rank).

    Raises:
        LockedError: naming the holder's pid.
    """
    holder = lock_holder(out)
    if holder is not None:
        raise _locked(Path(out), holder)


def lock_out(out: Path) -> DirLock:
    """Take the lock of the run directory ``out`` for this run (rank 0); removes what dead runs left half-written.

    Raises:
        LockedError: another live run holds it (the message names its pid).
    """
    try:
        lock = DirLock(out).acquire()
    except LockedError as e:
        raise _locked(out, e.holder) from None
    from clusterlm.engine.fsdp import remove_partial_checkpoints

    for d in (out, out / CKPT_DIR, out / "plan"):
        remove_temporaries(d)
    remove_partial_checkpoints(out / CKPT_DIR)
    return lock


def check_out_dir(out: Path, config: TrainConfig, di: DistInfo) -> None:
    """Refuse to mix a new run into an old one's files; --overwrite clears them."""
    old = [p for p in (out / METRICS, out / CKPT_DIR, out / SUMMARY) if p.exists()]
    if not old or config.resume is not None:
        return
    if not config.overwrite:
        raise ValueError(
            f"train: {out} holds an earlier run ({', '.join(p.name for p in old)}); pass --resume to continue it, "
            "--overwrite to start afresh there, or another --out."
        )
    if di.is_main:
        for p in old:
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def max_length_of(config: TrainConfig, plan_dir: bool) -> int:
    """--max-length, else the plan directory's recorded data max_length, else the select default."""
    if config.max_length is not None:
        return config.max_length
    if plan_dir:
        try:
            meta = json.loads((Path(config.plan) / "plan.json").read_text(encoding="utf-8"))
            recorded = (meta.get("config") or {}).get("data", {}).get("max_length")
            if recorded:
                return int(recorded)
        except (OSError, ValueError, AttributeError):
            pass
    return DEFAULT_MAX_LENGTH


def load_plan(plan_dir: str | os.PathLike, di: DistInfo) -> Plan:
    """Read a plan directory and check its world size.

    Raises:
        FileNotFoundError / ValueError: a missing or damaged plan (:meth:`Plan.load`); a world size that
            differs from this run's.
    """
    plan = Plan.load(plan_dir)
    if plan.world_size != di.world_size:
        raise world_size_error(plan.world_size, di.world_size, "processes started")
    return plan


def load_eval_data(config: TrainConfig, tokenizer: Any, max_length: int) -> Any:
    """The tokenised --eval-data (its first --eval-max-examples), None without it."""
    if not config.eval_data:
        return None
    from clusterlm.data import load_data

    eval_data = load_data(config.eval_data, tokenizer, max_length=max_length, progress=False,
                          chat_template=CHAT_TEMPLATE_MODES[config.chat_template])
    if config.eval_max_examples is not None and config.eval_max_examples < len(eval_data):
        eval_data = [eval_data[i] for i in range(config.eval_max_examples)]
    return eval_data


def verify_plan(plan: Plan, dataset: Any, di: DistInfo) -> Plan:
    """Check ``plan`` against the tokenised data before the first step.

    Raises:
        ValueError: per-rank lists of unequal length; data the plan was not made for (:meth:`Plan.verify`).
    """
    counts = sorted({len(plan.indices(r)) for r in range(plan.world_size)})
    if len(counts) != 1:  # Plan validates this too; DDP would hang on it, so it is checked here again
        raise ValueError(f"train: every rank must visit the same number of examples, the plan has {counts}.")
    plan.verify(dataset, di.world_size)
    return plan


def baseline(build_plan: PlanBuilder, config: TrainConfig, dataset: Any, di: DistInfo, model_id: str,
             out: Path) -> Plan:
    """The plan of a baseline spec (``--plan full`` / ``random:...``), built from the data; rank 0 saves OUT/plan."""
    plan = build_plan(config.plan, dataset, di.world_size, seed=config.seed)
    plan.model_id = model_id
    if di.is_main:
        plan.save(out / "plan")
    return plan


def plan_digest(plan: Plan) -> str:
    """sha256 of the per-rank lists and weights: what a resumed run must train on."""
    h = hashlib.sha256()
    h.update(np.stack(plan.rank_indices).astype(np.int64).tobytes())
    h.update(np.ascontiguousarray(plan.weights, dtype=np.float64).tobytes())
    return h.hexdigest()

