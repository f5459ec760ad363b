"""The reference trainer's loop, one rank: :func:`train_rank` (every process of a run calls it).

The code reads top to bottom: :func:`train_rank` checks, joins the process group and takes the out directory's
lock (:mod:`clusterlm.training.checks`); :func:`prepare` builds what the loop reads (:class:`Run`: plan, data, model
(:mod:`clusterlm.training.model`), optimizer, schedule); :func:`start` resumes or starts (:class:`State`: what the loop
advances); :func:`loop` runs the steps with evaluations and checkpoints on schedule; :func:`finish` evaluates,
saves and summarises. The method (the weighted loss, DDP/FSDP, checkpoints, resume) is described in
docs/training.md and :mod:`clusterlm.training.run`.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from clusterlm.config.training import TRAIN_CONFIG, TrainConfig
from clusterlm.data import CHAT_TEMPLATE_MODES, load_data
from clusterlm.engine.fsdp import save_full_model, shard_model
from clusterlm.engine.step import (
    CKPT_DIR,
    CKPT_VERSION,
    EVAL_EXAMPLES,
    LATEST,
    build_optimizer,
    build_scheduler,
    evaluate,
    find_checkpoint,
    make_micro_batches,
    resume,
    rng_state,
    save_checkpoint,
    save_sharded_checkpoint,
    seed_everything,
    train_step,
    trainable_state,
)
from clusterlm.fileio import atomic_write_json, atomic_write_text, storage_errors
from clusterlm.launch.environment import restart_count
from clusterlm.launch.failures import stamp_failure
from clusterlm.launch.hangs import Progress, is_timeout
from clusterlm.launch.launcher import (
    DistInfo,
    all_gather_objects,
    exit_with_supervisor,
    in_process_group,
    under_torchrun,
)
from clusterlm.launch.preemption import PreemptionWatch, TrainPreempted, record_preemption
from clusterlm.models import check_model_id
from clusterlm.plan import Plan
from clusterlm.plan.sampler import PlanSampler
from clusterlm.tasks import run_tasks
from clusterlm.training.checks import (
    PlanBuilder,
    baseline,
    check_out_dir,
    load_eval_data,
    load_plan,
    lock_out,
    max_length_of,
    plan_digest,
    plan_world_size,
    setup_distributed,
    uses_fsdp,
    verify_plan,
    world_size_error,
)
from clusterlm.training.metrics import (
    CURVE,
    METRICS,
    SUMMARY,
    MetricsLog,
    plot_training,
    step_record,
    summarize,
    summary_text,
)
from clusterlm.training.model import bf16_cpu_warning, build_model, use_bf16
from clusterlm.training.reporting import Reporters

__all__ = ["INITIAL_EVAL_EXAMPLES", "INITIAL_TASK_RECORDS", "TASK_RECORDS", "Run", "State", "evaluate_tasks",
           "train_rank", "versions"]
TASK_RECORDS = "task_records.json"  # in OUT: the last task evaluation's metrics and per-problem records
INITIAL_TASK_RECORDS = "initial_task_records.json"  # in OUT: the same before training (initial_task_eval)

INITIAL_EVAL_EXAMPLES = "eval_examples_initial.json"  # the per-example losses of the evaluation before training


@dataclass
class Run:
    """What one rank's run builds once: options, place, data, model, optimizer; the loop only reads it."""

    config: TrainConfig
    di: DistInfo
    out: Path
    plan: Plan
    data: Any
    eval_data: Any
    model: torch.nn.Module
    ddp_model: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampler: PlanSampler
    pad_id: int
    autocast_dtype: torch.dtype | None
    total_steps: int
    steps_per_epoch: int
    max_length: int
    model_id: str
    setup: dict[str, Any]
    watch: PreemptionWatch | None = None  # SIGTERM/SIGUSR1/SIGINT: checkpoint this step, stop (launch.preemption)
    progress: Progress | None = None  # this rank's step and operation, for a hang's message (clusterlm.launch.hangs)

    @property
    def per_step(self) -> int:
        return self.config.micro_batch_size * self.config.grad_accum

    def say(self, message: str) -> None:
        if self.di.is_main:
            print(message, flush=True)


@dataclass
class State:
    """What the loop advances, and a checkpoint saves: step, epoch, metrics, token and time counters."""

    log: MetricsLog
    step: int = 0
    epoch: int = 0
    counters: dict[str, Any] = field(default_factory=lambda: {"tokens": 0, "train_time": 0.0})
    resumed_from: str | None = None
    reporters: Reporters | None = None


def train_rank(config: TrainConfig, *, build_plan: PlanBuilder | None = None) -> dict[str, Any]:
    """Train one rank (call it in every process of the run); returns the summary (on every rank).

    Args:
        config: the run's settings.
        build_plan: builds the plan from the tokenised data when ``config.plan`` names a baseline, not a
            directory (:func:`clusterlm.training.run.train` passes
            :func:`clusterlm.selection.baselines.baseline_plan` for ``full`` / ``random:...``); None: ``config.plan``
            is a plan directory.

    Raises:
        ValueError / FileNotFoundError: bad arguments, a plan that does not fit the run or the data, an
            out directory holding another run, a checkpoint from a different setup.
        LockedError: another live run holds ``--out``.
        StorageError: the disk filled (or a quota, the file size limit, an I/O error) while writing.
    """
    t_start = time.perf_counter()
    exit_with_supervisor()  # a rank of a launcher that is gone must not train on
    if restart_count() and config.resume is None:  # torchrun restarted the ranks (--max-restarts): continue
        config = config.replace(resume=LATEST)
    plan_ws = plan_world_size(config.plan) if build_plan is None else None
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if plan_ws is not None and plan_ws != world_size:  # before any process group or model is made
        raise world_size_error(plan_ws, world_size, "torchrun" if under_torchrun() else "a single process")
    lock = lock_out(Path(config.out)) if int(os.environ.get("RANK", "0")) == 0 else None
    # Process-wide torch settings this function changes; restored at the end (train may run inside a caller).
    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    had_group = in_process_group()  # a caller's group stays; one made here is destroyed at the end
    run = state = progress = None
    watch = PreemptionWatch(config.preemption_grace)
    try:
        di = setup_distributed(config)
        progress = Progress(Path(config.out), di.rank, di.world_size)
        run = prepare(config, di, build_plan)
        run.watch, run.progress = watch, progress
        state = start(run)
        loop(run, state)
        return finish(run, state, time.perf_counter() - t_start)
    except BaseException as e:
        if progress is not None and is_timeout(e):  # name the rank that is behind, not gloo's "Timed out waiting"
            hang = RuntimeError(progress.explain(config.dist_timeout))
            stamp_failure(hang)
            raise hang from e
        stamp_failure(e)  # before the group goes down and the other ranks fail on the lost peer
        raise
    finally:
        watch.close()
        if progress is not None:
            progress.close()  # however the run ends (clusterlm.launch.hangs)
        # DDP's reducer holds the process group: release it while the group is up, so that the group's
        # destructor does not run after destroy_process_group (gloo can deadlock there joining its workers).
        run = state = None
        gc.collect()
        if not had_group and in_process_group():
            torch.distributed.destroy_process_group()
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1], warn_only=saved[2])
        if lock is not None:
            lock.release()


def prepare(config: TrainConfig, di: DistInfo, build_plan: PlanBuilder | None) -> Run:
    """Out directory, plan, model, data, optimizer and schedule of this rank."""
    out = Path(config.out)
    check_out_dir(out, config, di)
    out.mkdir(parents=True, exist_ok=True)
    progress = di.is_main and config.progress
    plan = load_plan(config.plan, di) if build_plan is None else None  # a damaged plan fails before the model loads
    seed_everything(config.seed)
    model, tokenizer, model_id = build_model(config, di)
    if plan is not None:  # a plan selected with other weights would estimate another model's gradient
        check_model_id(plan.model_id, model, who="train", allow_other_model=config.allow_other_model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    max_length = max_length_of(config, build_plan is None)
    data = load_data(config.data, tokenizer, max_length=max_length, progress=progress,
                     chat_template=CHAT_TEMPLATE_MODES[config.chat_template])
    if plan is None:
        plan = baseline(build_plan, config, data, di, model_id, out)
    plan = verify_plan(plan, data, di)
    sampler = PlanSampler(plan, di.rank, epoch_shuffle=config.epoch_shuffle, seed=config.seed)
    eval_data = load_eval_data(config, tokenizer, max_length)
    steps_per_epoch = math.ceil(plan.per_rank / (config.micro_batch_size * config.grad_accum))
    total_steps = config.max_steps or config.epochs * steps_per_epoch
    warmup = config.warmup_steps if config.warmup_steps is not None else int(config.warmup_ratio * total_steps)
    bf16 = use_bf16(config.bf16, di.device)
    ddp_model = model
    if uses_fsdp(config):  # bf16: the FSDP mixed-precision policy instead of autocast
        ddp_model = model = shard_model(model, di, bf16=bf16)
    elif di.distributed:
        ddp_model = DDP(model, device_ids=[di.local_rank] if di.device.type == "cuda" else None)
    optimizer = build_optimizer(model, lr=config.lr, weight_decay=config.weight_decay, kind=config.optimizer,
                                betas=(config.beta1, config.beta2))
    scheduler = build_scheduler(optimizer, total_steps=total_steps, warmup=warmup, schedule=config.lr_schedule,
                                min_ratio=config.min_lr_ratio)
    setup = {"world_size": di.world_size, "micro_batch_size": config.micro_batch_size, "grad_accum": config.grad_accum,
             "seed": config.seed, "epoch_shuffle": config.epoch_shuffle, "plan_digest": plan_digest(plan),
             "lora_r": config.lora_r, **({"fsdp": True} if uses_fsdp(config) else {})}
    run = Run(config=config, di=di, out=out, plan=plan, data=data, eval_data=eval_data, model=model,
              ddp_model=ddp_model, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler, sampler=sampler,
              pad_id=pad_id,
              autocast_dtype=torch.bfloat16 if bf16 and not uses_fsdp(config) else None, total_steps=total_steps,
              steps_per_epoch=steps_per_epoch, max_length=max_length, model_id=model_id, setup=setup)
    bf16_warning = bf16_cpu_warning(bf16, di.device)
    if bf16_warning:
        run.say(bf16_warning)
    return run


def start(run: Run) -> State:
    """Resume from a checkpoint (--resume) or start at step 0; opens metrics.jsonl."""
    config, di = run.config, run.di
    ckpt_path = find_checkpoint(run.out, config.resume) if config.resume is not None else None
    if config.resume is not None and ckpt_path is None:
        run.say(f"--resume: no checkpoint in {run.out / CKPT_DIR}; starting from step 0")
    if ckpt_path is None:
        torch.manual_seed(config.seed + di.rank)  # per-rank dropout streams (nanoGPT's seed offset)
        reporters = Reporters(config.report_to, run.out, config.to_dict(), di.is_main)
        state = State(log=MetricsLog(run.out / METRICS, di.is_main, sink=reporters.log), reporters=reporters)
    else:
        ckpt = resume(ckpt_path, setup=run.setup, model=run.model, optimizer=run.optimizer, scheduler=run.scheduler,
                      sampler=run.sampler, rank=di.rank, device=di.device, strict=config.lora_r == 0)
        reporters = Reporters(config.report_to, run.out, config.to_dict(), di.is_main, resumed_at=int(ckpt["step"]))
        state = State(log=MetricsLog(run.out / METRICS, di.is_main, list(ckpt["metrics"]), sink=reporters.log),
                      reporters=reporters, step=int(ckpt["step"]),
                      epoch=int(ckpt["sampler"]["epoch"]), counters=dict(ckpt["counters"]),
                      resumed_from=str(ckpt_path))
        run.say(f"resumed from {ckpt_path} (step {state.step}, epoch {state.epoch}, position {run.sampler.position})")
    write_args(run, state)
    n_trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    run.say(f"train: {di.world_size} rank(s) on {di.device.type} ({'nccl' if di.device.type == 'cuda' else 'gloo'}"
            f"{'' if di.distributed else ', no process group'}{', FSDP2' if uses_fsdp(config) else ''}), plan "
            f"{config.plan}: {run.plan.per_rank} examples per rank, {run.per_step} per step "
            f"({config.micro_batch_size} x {config.grad_accum}), {run.total_steps} steps; "
            f"{n_trainable:,} trainable parameters{f' (LoRA r={config.lora_r})' if config.lora_r else ''}")
    return state


def loop(run: Run, state: State) -> None:
    """Optimizer steps until ``total_steps``, epoch after epoch, with evaluations and checkpoints on schedule."""
    if state.step == 0 and run.config.initial_eval:
        evaluate_now(run, state)
    if state.step == 0 and run.config.tasks.initial_task_eval:
        evaluate_tasks(run, state)
    bar = None
    if run.di.is_main and run.config.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=run.total_steps, initial=state.step, desc="train", unit="step", dynamic_ncols=True)
    while state.step < run.total_steps:
        run.sampler.set_epoch(state.epoch)
        for idx in steps_of(np.fromiter(iter(run.sampler), dtype=np.int64), run.per_step):
            record = step(run, state, idx)
            report(run, state, record, bar)
            if run.config.eval_every and state.step % run.config.eval_every == 0 and state.step < run.total_steps:
                evaluate_now(run, state)
            saved = (run.config.save_every and state.step % run.config.save_every == 0) or state.step == run.total_steps
            if saved:
                checkpoint(run, state)
            if state.step >= run.total_steps:
                break
            if run.watch is not None and preemption_agreed(run, state):
                if not saved:
                    checkpoint(run, state)
                raise preempted(run, state)
        if run.sampler.position >= run.plan.per_rank:
            state.epoch += 1
    if bar is not None:
        bar.close()


def preemption_agreed(run: Run, state: State) -> bool:
    """Whether any rank got a preemption signal (every rank asks after every step: one all-reduce of one number)."""
    if run.progress is not None:
        run.progress.mark(state.step, "the preemption check")
    return run.watch.agreed(run.di.device, run.di.distributed)


def preempted(run: Run, state: State) -> TrainPreempted:
    """The :class:`TrainPreempted` of this step (rank 0 records it in OUT for the launcher, and says it)."""
    found = find_checkpoint(run.out, LATEST)
    exc = TrainPreempted(run.out, state.step, None if found is None else str(found), run.watch.signal_name)
    if run.di.is_main:
        record_preemption(exc)
    return exc


def steps_of(order: np.ndarray, per_step: int) -> Iterator[np.ndarray]:
    """The epoch's remaining order cut into steps of ``per_step`` examples (the last may be shorter)."""
    for s in range(0, len(order), per_step):
        yield order[s : s + per_step]


def step(run: Run, state: State, idx: np.ndarray) -> dict[str, Any]:
    """One optimizer step on this rank's examples ``idx``; returns (and logs) its metrics record."""
    t0, c0 = time.perf_counter(), time.process_time()
    if run.progress is not None:
        run.progress.mark(state.step + 1, "the forward, backward and gradient all-reduce")
    micro = make_micro_batches(run.data, idx, run.plan.weights, run.config.micro_batch_size, run.pad_id, run.di.device)
    stats = train_step(run.model, run.optimizer, run.scheduler, micro, n_step=len(idx),
                       max_grad_norm=run.config.max_grad_norm, autocast_dtype=run.autocast_dtype,
                       ddp_model=run.ddp_model)
    if run.di.device.type == "cuda":
        torch.cuda.synchronize(run.di.device)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    run.sampler.advance(len(idx))
    state.step += 1
    epoch = state.epoch + run.sampler.position / run.plan.per_rank
    if run.progress is not None:
        run.progress.mark(state.step, "the all-gather of the step's metrics")
    record = step_record(stats, dt, cpu, run.di, state.step, epoch, state.counters)
    state.log.append(record)
    return record


def report(run: Run, state: State, record: dict[str, Any], bar: Any) -> None:
    """The progress bar, or a log line every --log-every steps."""
    if bar is not None:
        bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)
        bar.update(1)
    elif state.step % run.config.log_every == 0 or state.step == run.total_steps:
        run.say(f"step {state.step}/{run.total_steps}  loss {record['loss']:.4f}  lr {record['lr']:.3g}  "
                f"{record['tokens_per_s']:,.0f} tok/s")


def evaluate_now(run: Run, state: State) -> None:
    """Held-out loss at this step (nothing without --eval-data), logged as an ``eval`` record."""
    if run.eval_data is None:
        return
    if run.progress is not None:
        run.progress.mark(state.step, "the evaluation")
    t0 = time.perf_counter()
    per_example = torch.zeros(2, len(run.eval_data), dtype=torch.float64, device=run.di.device)
    loss, n_tok = evaluate(run.model, run.eval_data, run.di, batch_size=run.config.eval_batch_size, pad_id=run.pad_id,
                           autocast_dtype=run.autocast_dtype, per_example=per_example)
    if run.di.is_main:  # per-example summed token loss and answer tokens of this (the latest) evaluation; the one
        # before training also on its own (clusterlm compare's per-set losses of the base model)
        record = {"step": state.step, "loss_sums": per_example[0].tolist(), "tokens": per_example[1].long().tolist()}
        for name in (EVAL_EXAMPLES, INITIAL_EVAL_EXAMPLES) if state.step == 0 else (EVAL_EXAMPLES,):
            atomic_write_json(run.out / name, record, indent=None)
    state.log.append({"kind": "eval", "step": state.step, "eval_loss": loss, "eval_tokens": n_tok,
                      "eval_time": time.perf_counter() - t0})
    run.say(f"step {state.step}: held-out loss {loss:.4f} ({n_tok} answer tokens)")


def evaluate_tasks(run: Run, state: State) -> None:
    """Task metrics of the model at this step (code pass@k, lm-eval tasks: :func:`clusterlm.tasks.run_tasks`), logged
    as a ``task`` record with their per-problem records in ``OUT/task_records.json`` (before training also in
    ``initial_task_records.json``). Rank 0 alone evaluates (generation needs the whole model in one process): after
    training the other ranks finish; before it they wait at the first step (within --dist-timeout)."""
    if not run.config.tasks.eval_task or not run.di.is_main:
        return
    if run.progress is not None:
        run.progress.mark(state.step, "the task evaluation")
    model = getattr(run.model, "module", run.model)  # DDP's wrapper: generate with the model itself
    was_training = model.training
    try:
        results = run_tasks(model, run.tokenizer, run.config.tasks, device=run.di.device,
                            progress=run.config.progress, chat_template=CHAT_TEMPLATE_MODES[run.config.chat_template])
    finally:
        model.train(was_training)
    record = {"step": state.step, "metrics": results.metrics, "records": results.records}
    for name in (TASK_RECORDS, INITIAL_TASK_RECORDS) if state.step == 0 else (TASK_RECORDS,):
        atomic_write_json(run.out / name, record, indent=None)
    state.log.append({"kind": "task", "step": state.step, "metrics": results.metrics, "task_time": results.seconds})
    shown = ", ".join(f"{k} {v:.4f}" for k, v in results.metrics.items())
    run.say(f"step {state.step}: {shown} (tasks evaluated in {results.seconds:.1f} s)")


def checkpoint(run: Run, state: State) -> None:
    """Every rank's generator states to rank 0; it writes the checkpoint
    (:func:`~clusterlm.engine.step.save_checkpoint`). With --fsdp every rank writes its shards
    (:func:`~clusterlm.engine.step.save_sharded_checkpoint`)."""
    if run.progress is not None:
        run.progress.mark(state.step, "the checkpoint")
    rng = all_gather_objects(rng_state(run.di.device), run.di)
    ckpt = None
    if run.di.is_main:
        ckpt = {"version": CKPT_VERSION, "step": state.step, "setup": run.setup,
                "sampler": {"epoch": run.sampler.epoch, "position": run.sampler.position},
                "scheduler": run.scheduler.state_dict(), "rng": rng, "metrics": state.log.records,
                "counters": state.counters}
    if uses_fsdp(run.config):
        save_sharded_checkpoint(run.out, ckpt, state.step, run.config.keep_checkpoints, model=run.model,
                                optimizer=run.optimizer, only_trainable=run.config.lora_r > 0, di=run.di)
    elif ckpt is not None:
        ckpt["model"] = trainable_state(run.model, only_trainable=run.config.lora_r > 0)
        ckpt["optimizer"] = run.optimizer.state_dict()
        save_checkpoint(run.out, ckpt, state.step, run.config.keep_checkpoints)


def finish(run: Run, state: State, wall: float) -> dict[str, Any]:
    """The final evaluation, the summary; rank 0 saves the model, the curve and summary.json."""
    if not any(r.get("kind") == "eval" and r["step"] == state.step for r in state.log.records):
        evaluate_now(run, state)
    if not any(r.get("kind") == "task" and r["step"] == state.step for r in state.log.records):
        evaluate_tasks(run, state)
    summary = summarize(state.log.records, state.counters, run.config, run.di, run.plan, run.total_steps, wall,
                        state.resumed_from)
    if uses_fsdp(run.config) and run.config.save_model:  # every rank sends its shards to rank 0
        save_full_model(run.model, run.tokenizer, run.out / "model", run.di)
    if run.di.is_main:
        if run.config.save_model and not uses_fsdp(run.config):
            with storage_errors(run.out / "model"):
                run.model.save_pretrained(run.out / "model")
                run.tokenizer.save_pretrained(run.out / "model")
        if state.reporters is not None:
            state.reporters.close()
        plot_training(state.log.records, run.out / CURVE)
        atomic_write_json(run.out / SUMMARY, summary, sort_keys=False)
        run.say(summary_text(summary, run.out))
    return summary


def write_args(run: Run, state: State) -> None:
    """``args.json`` (rank 0): the settings, world size, plan configuration, versions; and ``train_config.yaml``, the
    resolved :class:`TrainConfig` (``clusterlm train --config`` and :meth:`TrainConfig.load` read it back)."""
    if not run.di.is_main:
        return
    info = {**run.config.to_dict(), "world_size": run.di.world_size,
            "max_length_used": run.max_length, "total_steps": run.total_steps, "steps_per_epoch": run.steps_per_epoch,
            "model_id": run.model_id, "plan_config": run.plan.config, "resumed_from": state.resumed_from,
            "versions": versions(), "argv": sys.argv}
    atomic_write_text(run.out / "args.json", json.dumps(info, indent=2, default=str) + "\n")
    run.config.save(run.out / TRAIN_CONFIG)


def versions() -> dict[str, str]:
    """python, torch, transformers, peft and cluster-kernels versions."""
    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    for dist_name in ("transformers", "peft", "cluster-kernels"):
        try:
            out[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out

