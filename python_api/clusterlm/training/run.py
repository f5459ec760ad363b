"""Reference trainer (DDP, or FSDP2 with ``--fsdp``) that consumes a plan: every rank trains on its own plan list,
with the plan's weights.

Launch, from Python (a script or a notebook cell)::

    import clusterlm
    config = clusterlm.TrainConfig(plan="runs/demo/plan", model="tiny-llama", data="train.jsonl", out="runs/train",
                                   nproc=2, max_steps=40)
    result = clusterlm.train(config)        # a TrainResult: losses, held-out losses, timings, paths

or from the shell::

    # one process (CPU, or one GPU)
    clusterlm train --plan runs/demo/plan --model tiny-llama --data train.jsonl --out runs/train
    clusterlm train --config run.yaml --lr 2e-4          # a config file, one setting overridden

    # N processes on this machine: --nproc spawns torch's launcher (python -m torch.distributed.run)
    clusterlm train --plan runs/demo/plan --model tiny-llama --data train.jsonl --out runs/train --nproc 2
    # ... which is the same as
    torchrun --standalone --nproc-per-node 2 -m clusterlm train --plan runs/demo/plan --model tiny-llama \\
        --data train.jsonl --out runs/train

    # 2 nodes x 8 GPUs: the same command on every node; the endpoint is host:port of one of them, --out
    # on a file system all nodes share (checkpoints are written by global rank 0, read by every rank)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29500 --rdzv-id run1 \\
        -m clusterlm train --plan plan16/ --model /models/llama --data train.jsonl --out /shared/run1
    # ... or through the CLI on every node:
    clusterlm train --nproc 8 --nnodes 2 --rdzv-endpoint node0:29500 --rdzv-id run1 --plan plan16/ ...

    # baselines, through the same trainer (the plan is built on the fly and saved to OUT/plan)
    clusterlm train --plan full ...            # all data
    clusterlm train --plan random:0.31 ...     # uniform 31 % (random:5000 = 5000 examples)

The settings are :class:`clusterlm.TrainConfig`'s fields (``clusterlm train``'s options are generated from
them). With ``nproc > 1`` :func:`train` writes the resolved config to ``OUT/train_config.yaml`` and starts the
ranks through torch's launcher (:func:`clusterlm.launch.launcher.spawn_with_config`): every rank reads that file, after
checking its sha256 against the one the launcher passed (``CLUSTERLM_CONFIG_SHA256``), so no setting travels
as a rebuilt command line.

Backend: nccl when CUDA is available (one GPU per local rank), gloo on CPU. The world size (processes
in all) must equal the plan's; a mismatch is refused before anything is loaded, naming both.

One optimizer step, per rank: the next ``micro_batch_size * grad_accum`` examples of the rank's plan
list (a :class:`clusterlm.plan.sampler.PlanSampler`; the last step of an epoch may be shorter), in
micro-batches. Each micro-batch's loss is ``sum_b w_b * loss_b / n_step`` (``loss_b`` = mean answer-token
cross entropy, :func:`clusterlm.engine.loss.per_example_loss`; ``n_step`` = examples in the step), so the
step's gradient is that of ``mean_b(w_b * loss_b)`` over the step — with full micro-batches exactly
``weighted_loss / grad_accum``. Gradients are synchronised once per step (``no_sync`` on the other
micro-batches) and DDP averages them over the K ranks: ``(1/K) sum_k mean_{b in k}(w_b g_b)``. With one
cluster per rank and ``w = K n_k / N`` (the plan's weights) that is ``sum_k (n_k / N) g_k``, the
full-data gradient with every cluster represented by its selected examples (docs/design.md). Then
gradient clipping, the optimizer step and the learning-rate schedule (warm-up, then cosine / linear /
constant decay). The step, the optimizer, the schedule, the evaluation and the checkpoint files are
:mod:`clusterlm.engine.step`'s; the records :mod:`clusterlm.training.metrics`'.

``--fsdp`` shards weights, gradients and optimizer state over the ranks instead of replicating them
(:mod:`clusterlm.engine.fsdp`: FSDP2, one unit per decoder block plus the root; with bf16 a mixed-precision policy
of bfloat16 weights and compute and float32 gradient reduction replaces autocast). The step is the same
engine step: each micro-batch's gradients are reduce-scattered (averaged over the ranks, as DDP's
all-reduce), so the sharded gradient is the same ``sum_k (n_k / N) g_k``. Checkpoints are then sharded
directories (``ckpt/step_0000040/``), written by every rank; the final model is gathered to rank 0 and saved
as a normal Hugging Face directory. Refused before any model loads: --fsdp on one process, a model whose
decoder blocks cannot be found, --resume of a DDP checkpoint with --fsdp or the reverse.

Files in ``--out``::

    train_config.yaml  the resolved TrainConfig (clusterlm train --config reads it back)
    args.json        the settings, world size, plan, versions
    metrics.jsonl    one JSON record per line: {"kind": "train", "step", "epoch", "loss" (the weighted
                     objective, mean over ranks), "loss_unweighted", "lr", "grad_norm", "tokens" (answer +
                     prompt tokens so far, all ranks), "step_tokens" / "step_padded_tokens" / "step_time" /
                     "step_cpu_time" (per rank; CPU time excludes waiting for other ranks), "tokens_per_s",
                     "elapsed"}; and {"kind": "eval", "step", "eval_loss"
                     (token-weighted mean answer-token loss of --eval-data), "eval_tokens", "eval_time"}
    summary.json     wall time, tokens/s, first/last train loss (single steps, and means over the first/last
                     ``train_loss_window`` steps), held-out loss before/after, ...
    training.png     loss curve (train and held-out) and throughput
    ckpt/            step_0000040.pt ... (the last --keep-checkpoints) and ``latest`` (name of the newest);
                     with --fsdp step_0000040/ directories (shards of every rank and trainer_state.pt)
    model/           the final weights (save_pretrained; the adapter only with LoRA) and tokenizer
    plan/            the plan, when --plan names a baseline (or a Plan object was passed to train())
    tensorboard/     event files, with --report-to tensorboard

Before anything is loaded every option is checked (ranges, files that must exist, an ``--out`` that is a
writable directory), and the run takes the lock of ``--out`` (``OUT/.clusterlm.lock``, global rank 0, for the
run's life): a second run, ``--resume`` or ``--overwrite`` there while it lives is refused, naming the pid
that holds it; the lock of a dead run is no obstacle. A rank started by ``clusterlm train --nproc N`` (or
torchrun) exits as soon as its launcher is gone (:func:`clusterlm.launch.launcher.exit_with_supervisor`). A full
disk (or quota, file size limit, I/O error) at any write — checkpoint, metrics record, summary, plan, curve,
model — ends the run with one line naming the file and what ran out (:class:`clusterlm.fileio.StorageError`);
no temporary file is left and the previous checkpoint stays loadable.

Checkpoints hold model (trainable parameters), optimizer, scheduler, sampler position (epoch,
position), step, the python / numpy / torch (and CUDA) RNG states of every rank and the metrics so
far. Global rank 0 writes them to a temporary file and renames it into place, then updates ``latest`` the
same way, so a run killed at any moment leaves a loadable checkpoint. ``--resume`` continues from
``latest`` (or a given file): metrics.jsonl is rewritten to the checkpoint's step and the run goes on
exactly as the uninterrupted one would have (on CPU with deterministic algorithms and a fixed number
of threads per rank, the loss curve matches step for step; the test kills both ranks with SIGKILL).

The plan is checked before the first step: world size, equal per-rank list lengths, and
:meth:`clusterlm.plan.Plan.verify` against the tokenised data (size and content hash) — so ``--max-length``
must be the one the plan was made with (the default takes it from the plan).

Precision. ``--bf16 on`` autocasts to bfloat16 over float32 weights; ``auto`` turns it on only on CUDA
GPUs with bf16. On a CPU without native bf16 instructions (no ``avx512_bf16`` / ``amx_bf16``) bf16
autocast is emulated and a step is about an order of magnitude slower than float32, so the trainer warns.
Pure low-precision weights (``--dtype bfloat16/float16``) are refused for full fine-tuning: AdamW
updates below the weights' resolution round away. With LoRA the frozen base may be bf16/fp16 (peft keeps
the adapters in float32); ``--dtype auto`` (the default) is float32 for full fine-tuning and, with LoRA, bfloat16
on a CUDA device that supports it (:func:`weights_dtype`). The weights load straight onto the rank's device in
that dtype (FSDP: on the host, then each shard moves as it is sharded).

The rank's code: :mod:`clusterlm.training.loop` (the loop), :mod:`clusterlm.training.checks` (checks and setup),
:mod:`clusterlm.training.model` (the model); the settings: :mod:`clusterlm.config.training`."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clusterlm.config.baselines import is_baseline_spec
from clusterlm.config.defaults import LATEST
from clusterlm.config.training import TRAIN_CONFIG, TrainConfig
from clusterlm.launch.failures import removed_if_empty
from clusterlm.launch.hangs import remove_progress
from clusterlm.launch.launcher import SpawnFailed, checked_by_launcher, spawn_with_config, under_torchrun
from clusterlm.launch.preemption import PREEMPTED_EXIT, SHUTDOWN_MARGIN_S, Preempted, read_preempted
from clusterlm.plan import Plan
from clusterlm.training.checks import check_inputs, check_unlocked, plan_world_size, world_size_error
from clusterlm.training.metrics import CURVE, METRICS, SUMMARY

# The trainer (torch, the engine, the models) is imported by the process that trains: the one that only launches
# ranks (`clusterlm train --nproc N`) checks the inputs, writes the config and waits, without it.

__all__ = ["SpawnFailed", "TrainResult", "train"]


@dataclass(frozen=True)
class TrainResult:
    """What a training run gives back (read from the run directory's files by the process that called
    :func:`train`).

    Attributes:
        out: the run directory.
        steps: optimizer steps taken.
        losses: the weighted training objective of every step (mean over ranks), step 1 first.
        eval_losses: ``{step: held-out loss}`` of every evaluation (step 0: before training).
        initial_eval_loss / eval_loss: held-out loss before the first and after the last step (None without
            eval_data).
        train_time_s: training seconds (sum over steps of the slowest rank's step time).
        wall_time_s: the run's wall time on rank 0 (loading and evaluation included).
        tokens: prompt + answer tokens trained (all ranks).
        task_metrics / initial_task_metrics: ``{"humaneval/pass@1": 0.07, ...}`` after the last step and before the
            first (with initial_task_eval); empty without tasks.
        summary: everything of ``summary.json``.
        paths: ``metrics``, ``summary``, ``curve``, ``config`` (train_config.yaml), ``checkpoints``, ``model``
            (when written), ``tensorboard`` (with report_to tensorboard).
    """

    out: Path
    steps: int
    losses: tuple[float, ...]
    eval_losses: dict[int, float]
    initial_eval_loss: float | None
    eval_loss: float | None
    train_time_s: float
    wall_time_s: float
    tokens: int
    summary: dict[str, Any] = field(repr=False)
    paths: dict[str, Path] = field(repr=False)
    task_metrics: dict[str, float] = field(default_factory=dict)
    initial_task_metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def read(cls, out: str | os.PathLike, summary: dict[str, Any] | None = None) -> TrainResult:
        """The result of the run in ``out`` (``summary``: the one :func:`train_rank` returned, else summary.json).

        Raises:
            FileNotFoundError: no summary.json there (the run did not finish).
        """
        out = Path(out)
        if summary is None:
            summary = json.loads((out / SUMMARY).read_text(encoding="utf-8"))
        records = []
        if (out / METRICS).is_file():
            records = [json.loads(line) for line in (out / METRICS).read_text(encoding="utf-8").splitlines() if line]
        paths = {"metrics": out / METRICS, "summary": out / SUMMARY, "curve": out / CURVE, "config": out / TRAIN_CONFIG,
                 "checkpoints": out / "ckpt"}
        paths |= {name: out / name for name in ("model", "tensorboard", "plan") if (out / name).exists()}
        return cls(out=out, steps=int(summary.get("steps") or 0),
                   losses=tuple(float(r["loss"]) for r in records if r.get("kind") == "train"),
                   eval_losses={int(r["step"]): float(r["eval_loss"]) for r in records if r.get("kind") == "eval"},
                   initial_eval_loss=summary.get("initial_eval_loss"), eval_loss=summary.get("final_eval_loss"),
                   train_time_s=float(summary.get("train_time_s") or 0.0),
                   wall_time_s=float(summary.get("wall_time_s") or 0.0), tokens=int(summary.get("tokens") or 0),
                   summary=summary, paths=paths, task_metrics=dict(summary.get("task_metrics") or {}),
                   initial_task_metrics=dict(summary.get("initial_task_metrics") or {}))


def train(config: TrainConfig | Mapping[str, Any], plan: Plan | None = None) -> TrainResult:
    """Train on a plan with the reference trainer: in this process, or on ``config.nproc`` ranks it starts.

    Under torchrun (every rank calls it) each process trains its rank. Otherwise ``nproc`` > 1 (or ``nnodes`` > 1)
    writes ``OUT/train_config.yaml`` and starts the ranks through torch's launcher; one process trains here.

    Args:
        config: the run's settings (``plan``, ``model``, ``data``, ``out`` required), or a mapping of them.
        plan: a :class:`clusterlm.Plan` to train on instead of ``config.plan`` (saved to ``OUT/plan`` first).

    Returns:
        The :class:`TrainResult` (losses, held-out losses, timings, paths).

    Raises:
        TypeError: ``config`` is not a :class:`clusterlm.TrainConfig` or a mapping of its settings.
        ValueError / TypeError / FileNotFoundError: a bad setting or input (:meth:`TrainConfig.check`,
            :func:`clusterlm.training.checks.check_inputs`), before any process starts.
        ImportError: report_to names a package that is not installed.
        LockedError: another live run holds ``out``.
        SpawnFailed: a rank of a launched run failed (its message is printed already); ``.code`` is the status.
        Preempted: SIGTERM, SIGUSR1 or SIGINT stopped the run after a checkpoint (:mod:`clusterlm.launch.preemption`).
    """
    config = TrainConfig.coerce(config, "clusterlm.train(clusterlm.TrainConfig(plan=..., model=..., data=..., "
                                        "out=...))")
    with removed_if_empty(config.out or ".", lambda out: (out / METRICS).exists()):
        if plan is not None:
            config = _with_plan(config, plan)
        if not checked_by_launcher():  # checked once, where the job starts; a launched rank has its launcher's
            config.check()
            check_inputs(config, plan_dir=not is_baseline_spec(config.plan))
        return _train(config)



def _train(config: TrainConfig) -> TrainResult:
    nproc, nnodes = config.nproc or 1, config.nnodes
    if under_torchrun() or (nproc == 1 and nnodes == 1 and not config.max_restarts):
        from clusterlm.selection.baselines import baseline_plan
        from clusterlm.training.loop import train_rank

        build_plan = baseline_plan if is_baseline_spec(config.plan) else None
        return TrainResult.read(config.out, train_rank(config, build_plan=build_plan))
    if nnodes == 1:  # (the other nodes of a run find the lock taken by its rank 0)
        check_unlocked(config.out)
    plan_ws = None if is_baseline_spec(config.plan) else plan_world_size(config.plan)
    if plan_ws is not None and plan_ws != nproc * nnodes:  # fail before starting processes
        raise world_size_error(plan_ws, nproc * nnodes, f"--nproc {nproc} x --nnodes {nnodes}")
    env = None
    if config.fsdp:
        import torch

        from clusterlm.engine.fsdp import CPU_ALLOCATOR_ENV

        if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
            env = dict(CPU_ALLOCATOR_ENV)
    path = Path(config.out) / TRAIN_CONFIG
    sha = config.save(path)
    started = time.time()
    try:  # the agent gets the grace as its shutdown timeout, and a little more for the ranks to exit
        spawn_with_config("train", path, sha, nproc, nnodes=nnodes, rdzv_endpoint=config.rdzv_endpoint,
                          rdzv_id=config.rdzv_id, env=env, max_restarts=config.max_restarts,
                          shutdown_timeout=config.preemption_grace + SHUTDOWN_MARGIN_S)
    except SpawnFailed as e:
        preempted = read_preempted(config.out, since=started)  # the ranks checkpointed and stopped on a signal
        if preempted is None and e.code == PREEMPTED_EXIT:
            preempted = _preempted_before_a_step(config)
        if preempted is not None:
            raise preempted from None
        raise
    finally:
        remove_progress(config.out)  # those of ranks that were killed (the others removed theirs)
    return TrainResult.read(config.out)


def _preempted_before_a_step(config: TrainConfig) -> Preempted:
    """A preemption that ended the ranks before they checkpointed a step (none recorded it: they were stopped before
    their first step, or the grace ran out)."""
    from clusterlm.engine.step import find_checkpoint

    out = Path(config.out)
    found = find_checkpoint(out, LATEST)  # an earlier one
    where = f"the latest checkpoint is {found}" if found else "no checkpoint"
    if found is None and not (out / METRICS).exists():  # nothing of this run is kept (OUT goes if it made it)
        return Preempted(f"before the ranks checkpointed a step: {where}", "the same command")
    return Preempted(f"before the ranks checkpointed a step: {where}",
                     f"clusterlm train --config {out / TRAIN_CONFIG} --resume")


def _with_plan(config: TrainConfig, plan: Plan) -> TrainConfig:
    """``config`` training on ``plan``, saved to ``OUT/plan``.

    Raises:
        TypeError: ``plan`` is not a Plan; ValueError: no ``out`` to save it in.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"train: plan must be a clusterlm.Plan (or None to use config.plan), got "
                        f"{type(plan).__name__}.")
    if config.out is None:
        raise ValueError("train: config.out is required to save the plan the ranks read (OUT/plan).")
    plan_dir = Path(config.out) / "plan"
    plan.save(plan_dir)
    return config.replace(plan=str(plan_dir))
