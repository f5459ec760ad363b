"""Reference trainer (DDP, or FSDP2 with ``--fsdp``) that consumes a plan: every rank trains on its own plan list,
with the plan's weights.

Launch::

    # one process (CPU, or one GPU)
    python -m clusterlm.train --plan runs/demo/plan --model tiny-llama --data train.jsonl --out runs/train

    # N processes on this machine: --nproc spawns torch's launcher (python -m torch.distributed.run)
    clusterlm train --plan runs/demo/plan --model tiny-llama --data train.jsonl --out runs/train --nproc 2
    # ... which is the same as
    torchrun --standalone --nproc-per-node 2 -m clusterlm.train --plan runs/demo/plan --model tiny-llama \\
        --data train.jsonl --out runs/train

    # 2 nodes x 8 GPUs: the same command on every node; the endpoint is host:port of one of them, --out
    # on a file system all nodes share (checkpoints are written by global rank 0, read by every rank)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29500 --rdzv-id run1 \\
        -m clusterlm.train --plan plan16/ --model /models/llama --data train.jsonl --out /shared/run1
    # ... or through the CLI on every node:
    clusterlm train --nproc 8 --nnodes 2 --rdzv-endpoint node0:29500 --rdzv-id run1 --plan plan16/ ...

    # baselines, through the same trainer (the plan is built on the fly and saved to OUT/plan)
    clusterlm train --plan full ...            # all data
    clusterlm train --plan random:0.31 ...     # uniform 31 % (random:5000 = 5000 examples)

The options are ``clusterlm train``'s (:mod:`clusterlm.cli`, which also resolves the baseline specs: it
passes :func:`clusterlm.baselines.baseline_plan` as :func:`train`'s ``build_plan``); ``python -m
clusterlm.train`` is that command. :func:`launch` starts the ranks from Python (:mod:`clusterlm.launch`).

Backend: nccl when CUDA is available (one GPU per local rank), gloo on CPU. The world size (processes
in all) must equal the plan's; a mismatch is refused before anything is loaded, naming both.

One optimizer step, per rank: the next ``micro_batch_size * grad_accum`` examples of the rank's plan
list (a :class:`clusterlm.sampler.PlanSampler`; the last step of an epoch may be shorter), in
micro-batches. Each micro-batch's loss is ``sum_b w_b * loss_b / n_step`` (``loss_b`` = mean answer-token
cross entropy, :func:`clusterlm.loss.per_example_loss`; ``n_step`` = examples in the step), so the
step's gradient is that of ``mean_b(w_b * loss_b)`` over the step — with full micro-batches exactly
``weighted_loss / grad_accum``. Gradients are synchronised once per step (``no_sync`` on the other
micro-batches) and DDP averages them over the K ranks: ``(1/K) sum_k mean_{b in k}(w_b g_b)``. With one
cluster per rank and ``w = K n_k / N`` (the plan's weights) that is ``sum_k (n_k / N) g_k``, the
full-data gradient with every cluster represented by its selected examples (DESIGN.md §4). Then
gradient clipping, the optimizer step and the learning-rate schedule (warm-up, then cosine / linear /
constant decay). The step, the optimizer, the schedule, the evaluation and the checkpoint files are
:mod:`clusterlm.engine`'s; the records :mod:`clusterlm.metrics`'.

``--fsdp`` shards weights, gradients and optimizer state over the ranks instead of replicating them
(:mod:`clusterlm.fsdp`: FSDP2, one unit per decoder block plus the root; with bf16 a mixed-precision policy
of bfloat16 weights and compute and float32 gradient reduction replaces autocast). The step is the same
engine step: each micro-batch's gradients are reduce-scattered (averaged over the ranks, as DDP's
all-reduce), so the sharded gradient is the same ``sum_k (n_k / N) g_k``. Checkpoints are then sharded
directories (``ckpt/step_0000040/``), written by every rank; the final model is gathered to rank 0 and saved
as a normal Hugging Face directory. Refused before any model loads: --fsdp on one process, a model whose
decoder blocks cannot be found, --resume of a DDP checkpoint with --fsdp or the reverse.

Files in ``--out``::

    args.json        the arguments, world size, plan, versions
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
    plan/            the plan, when --plan names a baseline

Before anything is loaded every option is checked (ranges, files that must exist, an ``--out`` that is a
writable directory), and the run takes the lock of ``--out`` (``OUT/.clusterlm.lock``, global rank 0, for the
run's life): a second run, ``--resume`` or ``--overwrite`` there while it lives is refused, naming the pid
that holds it; the lock of a dead run is no obstacle. A rank started by ``clusterlm train --nproc N`` (or
torchrun) exits as soon as its launcher is gone (:func:`clusterlm.launch.exit_with_supervisor`). A full
disk (or quota, file size limit, I/O error) at any write — checkpoint, metrics record, summary, plan, curve,
model — ends the run with one line naming the file and what ran out (:class:`clusterlm._io.StorageError`);
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

The code reads top to bottom: setup (arguments, processes, the out directory), data (plan, examples),
model, the loop (:class:`Run` holds what is built once, :class:`State` what the loop advances),
checkpoint, teardown.
"""

from __future__ import annotations

import gc
import hashlib
import importlib.metadata
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from clusterlm._io import (
    DirLock,
    LockedError,
    atomic_write_json,
    atomic_write_text,
    lock_holder,
    remove_temporaries,
    storage_errors,
)
from clusterlm.data import CHAT_TEMPLATE_MODES, DEFAULT_MAX_LENGTH, load_data
from clusterlm.engine import (
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
from clusterlm.fsdp import (
    CPU_ALLOCATOR_ENV,
    check_blocks,
    checkpoint_kind,
    remove_partial_checkpoints,
    save_full_model,
    shard_model,
)
from clusterlm.launch import (
    TRAIN_MODULE,
    DistInfo,
    all_gather_objects,
    exit_with_supervisor,
    in_process_group,
    init_distributed,
    spawn,
    stamp_failure,
    strip_options,
    under_torchrun,
)
from clusterlm.metrics import CURVE, METRICS, SUMMARY, MetricsLog, plot_training, step_record, summarize, summary_text
from clusterlm.models import BUILTIN_MODELS, GGUF_MODELS, check_model_id, load_model, resolve_dtype
from clusterlm.plan import Plan
from clusterlm.planfile import plan_dir_hint, read_plan_meta
from clusterlm.sampler import PlanSampler

__all__ = [
    "CKPT_DIR", "CURVE", "LATEST", "LAUNCHER_OPTIONS", "METRICS", "SUMMARY", "Run", "State", "build_model",
    "check_checkpoint_kind", "check_fsdp", "check_inputs", "check_out_location", "check_unlocked",
    "cpu_has_native_bf16", "launch", "load_plan", "lock_out", "plan_world_size", "setup_distributed", "train",
    "uses_fsdp", "validate_args", "verify_plan", "weights_dtype", "world_size_error", "INITIAL_EVAL_EXAMPLES",
]

CPUINFO = "/proc/cpuinfo"
INITIAL_EVAL_EXAMPLES = "eval_examples_initial.json"  # the per-example losses of the evaluation before training
# x86 flags of native bf16 arithmetic (AVX512-BF16, AMX), and aarch64's BF16 extension ("Features" line).
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
# Half the relative spacing of representable values: smaller relative updates round to no change.
_WEIGHT_DTYPE_RESOLUTION = {"bfloat16": "2^-8 (0.4 %)", "float16": "2^-11 (0.05 %)"}
# Options of `clusterlm train` for the launching process only (the ranks never see them).
LAUNCHER_OPTIONS = ("--nproc", "--nnodes", "--rdzv-endpoint", "--rdzv-id")

# Numeric options: (flag, attribute, low, high, low allowed, high allowed, what it is); high inf = any finite value.
_RANGES = (
    ("--lr", "lr", 0.0, math.inf, False, False, "the peak learning rate"),
    ("--warmup-ratio", "warmup_ratio", 0.0, 1.0, True, False, "warm-up as a fraction of all steps"),
    ("--min-lr-ratio", "min_lr_ratio", 0.0, 1.0, True, True, "the final learning rate over the peak"),
    ("--beta1", "beta1", 0.0, 1.0, True, False, "AdamW's first-moment decay"),
    ("--beta2", "beta2", 0.0, 1.0, True, False, "AdamW's second-moment decay"),
    ("--weight-decay", "weight_decay", 0.0, math.inf, True, False, "decoupled weight decay"),
    ("--max-grad-norm", "max_grad_norm", 0.0, math.inf, True, False, "gradient clipping, 0 turns it off"),
    ("--lora-dropout", "lora_dropout", 0.0, 1.0, True, False, "dropout of the LoRA inputs"),
)

# A baseline plan from the tokenised data: (spec, dataset, world_size, seed=) -> Plan.
PlanBuilder = Callable[..., Plan]


# ---------------------------------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------------------------------


def _range_error(flag: str, value: float, low: float, high: float, low_ok: bool, high_ok: bool, what: str) -> str:
    bounds = [f"{'>=' if low_ok else '>'} {low:g}"]
    bounds.append("finite" if math.isinf(high) else f"{'<=' if high_ok else '<'} {high:g}")
    return f"train: {flag} {value!r} is out of range: it must be {' and '.join(bounds)} ({what})."


def validate_args(args: Any) -> None:
    """Refuse options that cannot train (or not well); runs before anything is loaded.

    Raises:
        ValueError: a number out of range (``--lr`` not > 0, a ratio outside [0, 1), a beta outside [0, 1),
            negative decay or clipping, ``--lora-alpha`` not > 0, ...), LoRA without target modules,
            ``--device cuda`` without CUDA, ``--dtype bfloat16/float16`` without LoRA (full fine-tuning
            of low-precision weights).
    """
    for flag, attr, low, high, low_ok, high_ok, what in _RANGES:
        value = getattr(args, attr, None)
        if value is None:
            continue
        inside = (value >= low if low_ok else value > low) and (value <= high if high_ok else value < high)
        if not (math.isfinite(value) and inside):
            raise ValueError(_range_error(flag, value, low, high, low_ok, high_ok, what))
    if getattr(args, "lora_r", 0):
        alpha = getattr(args, "lora_alpha", None)
        if alpha is not None and not (math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"train: --lora-alpha {alpha!r} is out of range: it must be > 0 and finite (the LoRA "
                             "scale is alpha / r; the default is 2 * r).")
        targets = getattr(args, "lora_targets", "all-linear")
        if targets != "all-linear" and not [t for t in str(targets).split(",") if t.strip()]:
            raise ValueError(f"train: --lora-targets {targets!r} names no module; give comma-separated module names "
                             "(q_proj,v_proj) or all-linear.")
    if getattr(args, "device", "auto") == "cuda" and not torch.cuda.is_available():
        raise ValueError("train: --device cuda but torch sees no CUDA device; use --device cpu or auto.")
    dtype = getattr(args, "dtype", "auto")
    if dtype in _WEIGHT_DTYPE_RESOLUTION and not getattr(args, "lora_r", 0):
        raise ValueError(
            f"train: --dtype {dtype} without LoRA trains the weights themselves in {dtype}, where an update "
            f"smaller than about {_WEIGHT_DTYPE_RESOLUTION[dtype]} of a weight rounds away, as most AdamW steps at "
            "fine-tuning learning rates do, so the model barely learns; use --dtype float32 (or auto) with --bf16 on "
            f"(bf16 autocast over float32 weights), or a LoRA run on the {dtype} base (--lora-r 16)."
        )


def plan_world_size(plan_dir: str | os.PathLike) -> int:
    """World size recorded in a plan directory's plan.json, read once plan.json passed Plan.load's checks
    (:func:`clusterlm.planfile.read_plan_meta`): a damaged or hand-edited plan is refused naming the field,
    before any advice about process counts."""
    return int(read_plan_meta(plan_dir)["world_size"])


def world_size_error(plan_ws: int, world_size: int, how: str) -> ValueError:
    """The refusal of a plan made for another world size (``how``: where this run's size comes from)."""
    return ValueError(
        f"train: the plan is for world size {plan_ws} but this run has world size {world_size} ({how}); run "
        f"with {plan_ws} processes in all (--nproc {plan_ws}, or torchrun --nproc-per-node x --nnodes = {plan_ws}), "
        "or make a plan for this world size (clusterlm select --world-size)."
    )


def setup_distributed(args: Any) -> DistInfo:
    """Join the process group (:func:`clusterlm.launch.init_distributed`: nccl on CUDA, gloo on CPU), set the
    CPU threads and deterministic algorithms.

    Raises:
        ValueError: ``--nproc x --nnodes`` under torchrun that differs from its world size; ``--device cuda``
            without CUDA.
    """
    if args.nproc is not None and under_torchrun():
        expected, world_size = args.nproc * args.nnodes, int(os.environ["WORLD_SIZE"])
        if expected != world_size:
            raise ValueError(
                f"train: --nproc {args.nproc} x --nnodes {args.nnodes} = {expected} differs from torchrun's world size "
                f"{world_size}; drop --nproc under torchrun or make them agree."
            )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train: --device cuda but torch sees no CUDA device; use --device cpu or auto.")
    di = init_distributed(device=args.device)
    use_cuda = di.device.type == "cuda"
    if not use_cuda:
        torch.set_num_threads(args.threads or 1)
    if args.deterministic == "on" or (args.deterministic == "auto" and not use_cuda):
        if use_cuda:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    return di


def check_inputs(args: Any, *, plan_dir: bool) -> None:
    """Refuse missing inputs and an output location that cannot take the run; before any model is loaded.

    Args:
        args: the trainer's options (``data``, ``eval_data``, ``plan``, ``resume``, ``out``).
        plan_dir: ``--plan`` must be a plan directory (not a baseline spec).

    Raises:
        FileNotFoundError: no ``--data`` / ``--eval-data`` / ``--resume`` checkpoint, no plan in ``--plan``.
        ValueError: ``--out`` is a file, lies under a file, or is not writable (:func:`check_out_location`); the
            checkpoint to resume is a DDP one with ``--fsdp`` or a sharded one without (:func:`check_checkpoint_kind`).
    """
    for flag, value in (("--data", getattr(args, "data", None)), ("--eval-data", getattr(args, "eval_data", None))):
        if isinstance(value, (str, os.PathLike)) and value and not Path(value).exists():
            raise FileNotFoundError(f"train: {flag} {value}: no such file or directory.")
    if plan_dir and not (Path(args.plan) / "plan.json").is_file():
        hint = plan_dir_hint(args.plan)  # out/plan.npz given: pass out/
        raise FileNotFoundError(f"train: --plan {args.plan} {hint}." if hint else (
            f"train: --plan {args.plan}: no plan there (no plan.json); make one with clusterlm select --out "
            f"{args.plan}, or train a baseline: --plan full, --plan random:<ratio>."
        ))
    resume_from = getattr(args, "resume", None)
    if resume_from is not None:
        found = find_checkpoint(args.out, resume_from)  # FileNotFoundError for a --resume PATH that is none
        if found is not None:
            check_checkpoint_kind(found, fsdp=uses_fsdp(args))
    check_out_location(Path(args.out))


def uses_fsdp(args: Any) -> bool:
    """The run shards the model with FSDP2 (``--fsdp``)."""
    return bool(getattr(args, "fsdp", False))


def check_checkpoint_kind(path: Path, *, fsdp: bool) -> None:
    """Refuse to resume a DDP checkpoint (one file) with --fsdp, or a sharded one (a directory) without.

    Raises:
        ValueError: the mismatch, in one line.
    """
    kind = checkpoint_kind(path)
    if kind == "ddp" and fsdp:
        raise ValueError(f"train: --resume {path} is a DDP checkpoint (one file) but this run has --fsdp, which "
                         "resumes sharded checkpoints (a directory); resume it without --fsdp, or start afresh with "
                         "--overwrite.")
    if kind == "fsdp" and not fsdp:
        raise ValueError(f"train: --resume {path} is a sharded FSDP checkpoint (a directory) but this run has no "
                         "--fsdp; resume it with --fsdp, or start afresh with --overwrite.")


def check_fsdp(args: Any, world_size: int) -> None:
    """The --fsdp checks that need no model: 2 processes or more, and decoder blocks the sharding can find
    (:func:`clusterlm.fsdp.check_blocks`, on the model's config); nothing without --fsdp.

    Raises:
        ValueError: one process, or a model whose blocks cannot be found (naming the attribute looked at).
    """
    if not uses_fsdp(args):
        return
    if args.model not in BUILTIN_MODELS and args.model not in GGUF_MODELS:
        check_blocks(args.model)
    if world_size < 2:
        raise ValueError("train: --fsdp shards the model over the ranks and needs at least 2 processes (--nproc 2, "
                         "or torchrun); one process trains the whole model anyway: drop --fsdp.")


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
    for d in (out, out / CKPT_DIR, out / "plan"):
        remove_temporaries(d)
    remove_partial_checkpoints(out / CKPT_DIR)
    return lock


def check_out_dir(out: Path, args: Any, di: DistInfo) -> None:
    """Refuse to mix a new run into an old one's files; --overwrite clears them."""
    old = [p for p in (out / METRICS, out / CKPT_DIR, out / SUMMARY) if p.exists()]
    if not old or args.resume is not None:
        return
    if not args.overwrite:
        raise ValueError(
            f"train: {out} holds an earlier run ({', '.join(p.name for p in old)}); pass --resume to continue it, "
            "--overwrite to start afresh there, or another --out."
        )
    if di.is_main:
        for p in old:
            shutil.rmtree(p) if p.is_dir() else p.unlink()


# ---------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------


def max_length_of(args: Any, plan_dir: bool) -> int:
    """--max-length, else the plan directory's recorded data max_length, else the select default."""
    if args.max_length is not None:
        return args.max_length
    if plan_dir:
        try:
            meta = json.loads((Path(args.plan) / "plan.json").read_text(encoding="utf-8"))
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


def load_eval_data(args: Any, tokenizer: Any, max_length: int) -> Any:
    """The tokenised --eval-data (its first --eval-max-examples), None without it."""
    if not args.eval_data:
        return None
    eval_data = load_data(args.eval_data, tokenizer, max_length=max_length, progress=False,
                          chat_template=CHAT_TEMPLATE_MODES[args.chat_template])
    if args.eval_max_examples is not None and args.eval_max_examples < len(eval_data):
        eval_data = [eval_data[i] for i in range(args.eval_max_examples)]
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


def baseline(build_plan: PlanBuilder, args: Any, dataset: Any, di: DistInfo, model_id: str, out: Path) -> Plan:
    """The plan of a baseline spec (``--plan full`` / ``random:...``), built from the data; rank 0 saves OUT/plan."""
    plan = build_plan(args.plan, dataset, di.world_size, seed=args.seed)
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


# ---------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------


def weights_dtype(dtype: str, lora: bool, device: torch.device) -> torch.dtype:
    """The dtype training loads the weights in: ``--dtype`` as given, and for ``"auto"`` float32 when the weights
    themselves train (full fine-tuning) and the frozen LoRA base in :func:`clusterlm.models.resolve_dtype`'s choice
    (bfloat16 on a CUDA device that supports it, else float32)."""
    return resolve_dtype(dtype, device) if dtype != "auto" or lora else torch.float32


def build_model(args: Any, di: DistInfo) -> tuple[torch.nn.Module, Any, str]:
    """Load the model (optionally with LoRA) on this rank's device; ``(model, tokenizer, model_id)``.

    The weights go straight from the files to ``di.device`` in :func:`weights_dtype` (no float32 host copy); under
    FSDP they load on the host and each shard moves to the device as it is sharded (:func:`clusterlm.fsdp.shard_model`).
    """
    dtype = weights_dtype(args.dtype, args.lora_r > 0, di.device)
    torch.manual_seed(args.seed)  # the same LoRA initialisation on every rank (DDP broadcasts rank 0's anyway)
    model, tokenizer, model_id = load_model(args.model, dtype=dtype, device=None if uses_fsdp(args) else di.device)
    if args.gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs (LoRA) and DDP. transformers 5 renamed the call.
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.config.use_cache = False
    if args.lora_r > 0:
        model = add_lora(model, args)
    if not uses_fsdp(args):  # FSDP moves each shard to the device as it shards (shard_model)
        model.to(di.device)
    model.train()
    return model, tokenizer, model_id


def add_lora(model: torch.nn.Module, args: Any) -> torch.nn.Module:
    """The PEFT LoRA model of --lora-r/--lora-alpha/--lora-dropout/--lora-targets.

    Raises:
        ValueError: peft made the adapters low-precision (they would barely learn).
    """
    from peft import LoraConfig, get_peft_model

    targets: str | list[str] = args.lora_targets
    if targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha or 2 * args.lora_r,
                        lora_dropout=args.lora_dropout, target_modules=targets, task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    low = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad and p.dtype != torch.float32})
    if low:  # validate_args allowed the low-precision base on the promise of float32 adapters
        raise ValueError(
            f"train: peft made the LoRA adapters {', '.join(low)} (--dtype {args.dtype}); they "
            "would barely learn. Use --dtype float32 (with --bf16 on), or a peft that keeps adapters in "
            "float32 (autocast_adapter_dtype)."
        )
    return model


def cpu_has_native_bf16(cpuinfo: str | os.PathLike = CPUINFO) -> bool | None:
    """Whether this CPU does bf16 arithmetic natively, from the flags in ``/proc/cpuinfo``.

    Args:
        cpuinfo: the file to read (``/proc/cpuinfo``).

    Returns:
        True / False from the ``flags`` (x86) or ``Features`` (aarch64) lines; None when unknown (not
        Linux, the file is unreadable or has no flags line).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            flags.update(value.split())
    if not flags:
        return None
    return not flags.isdisjoint(_NATIVE_BF16_FLAGS)


def _use_bf16(mode: str, device: torch.device) -> bool:
    """--bf16: ``on``, ``off``, or ``auto`` = on for CUDA devices with bf16 (never on CPU)."""
    if mode == "auto":
        return device.type == "cuda" and torch.cuda.is_bf16_supported()
    return mode == "on"


def _bf16_cpu_warning(use_bf16: bool, device: torch.device, cpuinfo: str | os.PathLike = CPUINFO) -> str | None:
    """The warning for bf16 autocast on a CPU without native bf16 (None when it does not apply)."""
    if not use_bf16 or device.type != "cpu" or cpu_has_native_bf16(cpuinfo) is not False:
        return None
    return (
        "train: warning: --bf16 on autocasts to bfloat16 on a CPU without native bf16 (no avx512_bf16 / amx_bf16 "
        f"in {cpuinfo}), where bf16 is emulated and training is about an order of magnitude slower than float32 "
        "(measured: 12x for SmolLM2-135M on AVX2); use --bf16 off."
    )


# ---------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------


@dataclass
class Run:
    """What one rank's run builds once: options, place, data, model, optimizer; the loop only reads it."""

    args: Any
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

    @property
    def per_step(self) -> int:
        return self.args.micro_batch_size * self.args.grad_accum

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


def train(args: Any, *, build_plan: PlanBuilder | None = None) -> dict[str, Any]:
    """Train one rank (call it in every process of the run); returns the summary (on every rank).

    Args:
        args: the options of ``clusterlm train`` (an argparse namespace or any object with them).
        build_plan: builds the plan from the tokenised data when ``args.plan`` names a baseline, not a
            directory (``clusterlm.cli`` passes :func:`clusterlm.baselines.baseline_plan` for ``full`` /
            ``random:...``); None: ``args.plan`` is a plan directory.

    Raises:
        ValueError / FileNotFoundError: bad arguments, a plan that does not fit the run or the data, an
            out directory holding another run, a checkpoint from a different setup.
        LockedError: another live run holds ``--out``.
        StorageError: the disk filled (or a quota, the file size limit, an I/O error) while writing.
    """
    t_start = time.perf_counter()
    exit_with_supervisor()  # a rank of a launcher that is gone must not train on
    validate_args(args)
    check_inputs(args, plan_dir=build_plan is None)
    plan_ws = plan_world_size(args.plan) if build_plan is None else None
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if plan_ws is not None and plan_ws != world_size:  # before any process group or model is made
        raise world_size_error(plan_ws, world_size, "torchrun" if under_torchrun() else "a single process")
    check_fsdp(args, world_size)
    lock = lock_out(Path(args.out)) if int(os.environ.get("RANK", "0")) == 0 else None
    # Process-wide torch settings this function changes; restored at the end (train may run inside a caller).
    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    had_group = in_process_group()  # a caller's group stays; one made here is destroyed at the end
    run = state = None
    try:
        di = setup_distributed(args)
        run = prepare(args, di, build_plan)
        state = start(run)
        loop(run, state)
        return finish(run, state, time.perf_counter() - t_start)
    except BaseException as e:
        stamp_failure(e)  # before the group goes down and the other ranks fail on the lost peer
        raise
    finally:
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


def prepare(args: Any, di: DistInfo, build_plan: PlanBuilder | None) -> Run:
    """Out directory, plan, model, data, optimizer and schedule of this rank."""
    out = Path(args.out)
    check_out_dir(out, args, di)
    out.mkdir(parents=True, exist_ok=True)
    progress = di.is_main and not args.no_progress
    plan = load_plan(args.plan, di) if build_plan is None else None  # a damaged plan fails before the model loads
    seed_everything(args.seed)
    model, tokenizer, model_id = build_model(args, di)
    if plan is not None:  # a plan selected with other weights would estimate another model's gradient
        check_model_id(plan.model_id, model, who="train", allow_other_model=args.allow_other_model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    max_length = max_length_of(args, build_plan is None)
    data = load_data(args.data, tokenizer, max_length=max_length, progress=progress,
                     chat_template=CHAT_TEMPLATE_MODES[args.chat_template])
    if plan is None:
        plan = baseline(build_plan, args, data, di, model_id, out)
    plan = verify_plan(plan, data, di)
    sampler = PlanSampler(plan, di.rank, epoch_shuffle=not args.no_epoch_shuffle, seed=args.seed)
    eval_data = load_eval_data(args, tokenizer, max_length)
    steps_per_epoch = math.ceil(plan.per_rank / (args.micro_batch_size * args.grad_accum))
    total_steps = args.max_steps or args.epochs * steps_per_epoch
    warmup = args.warmup_steps if args.warmup_steps is not None else int(args.warmup_ratio * total_steps)
    use_bf16 = _use_bf16(args.bf16, di.device)
    ddp_model = model
    if uses_fsdp(args):  # bf16: the FSDP mixed-precision policy instead of autocast
        ddp_model = model = shard_model(model, di, bf16=use_bf16)
    elif di.distributed:
        ddp_model = DDP(model, device_ids=[di.local_rank] if di.device.type == "cuda" else None)
    optimizer = build_optimizer(model, lr=args.lr, weight_decay=args.weight_decay, kind=args.optimizer,
                                betas=(args.beta1, args.beta2))
    scheduler = build_scheduler(optimizer, total_steps=total_steps, warmup=warmup, schedule=args.lr_schedule,
                                min_ratio=args.min_lr_ratio)
    setup = {"world_size": di.world_size, "micro_batch_size": args.micro_batch_size, "grad_accum": args.grad_accum,
             "seed": args.seed, "epoch_shuffle": not args.no_epoch_shuffle, "plan_digest": plan_digest(plan),
             "lora_r": args.lora_r, **({"fsdp": True} if uses_fsdp(args) else {})}
    run = Run(args=args, di=di, out=out, plan=plan, data=data, eval_data=eval_data, model=model, ddp_model=ddp_model,
              tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler, sampler=sampler, pad_id=pad_id,
              autocast_dtype=torch.bfloat16 if use_bf16 and not uses_fsdp(args) else None, total_steps=total_steps,
              steps_per_epoch=steps_per_epoch, max_length=max_length, model_id=model_id, setup=setup)
    bf16_warning = _bf16_cpu_warning(use_bf16, di.device)
    if bf16_warning:
        run.say(bf16_warning)
    return run


def start(run: Run) -> State:
    """Resume from a checkpoint (--resume) or start at step 0; opens metrics.jsonl."""
    args, di = run.args, run.di
    ckpt_path = find_checkpoint(run.out, args.resume) if args.resume is not None else None
    if args.resume is not None and ckpt_path is None:
        run.say(f"--resume: no checkpoint in {run.out / CKPT_DIR}; starting from step 0")
    if ckpt_path is None:
        torch.manual_seed(args.seed + di.rank)  # per-rank dropout streams (nanoGPT's seed offset)
        state = State(log=MetricsLog(run.out / METRICS, di.is_main))
    else:
        ckpt = resume(ckpt_path, setup=run.setup, model=run.model, optimizer=run.optimizer, scheduler=run.scheduler,
                      sampler=run.sampler, rank=di.rank, device=di.device, strict=args.lora_r == 0)
        state = State(log=MetricsLog(run.out / METRICS, di.is_main, list(ckpt["metrics"])), step=int(ckpt["step"]),
                      epoch=int(ckpt["sampler"]["epoch"]), counters=dict(ckpt["counters"]),
                      resumed_from=str(ckpt_path))
        run.say(f"resumed from {ckpt_path} (step {state.step}, epoch {state.epoch}, position {run.sampler.position})")
    write_args(run, state)
    n_trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    run.say(f"train: {di.world_size} rank(s) on {di.device.type} ({'nccl' if di.device.type == 'cuda' else 'gloo'}"
            f"{'' if di.distributed else ', no process group'}{', FSDP2' if uses_fsdp(args) else ''}), plan "
            f"{args.plan}: {run.plan.per_rank} examples per "
            f"rank, {run.per_step} per step ({args.micro_batch_size} x {args.grad_accum}), {run.total_steps} steps; "
            f"{n_trainable:,} trainable parameters{f' (LoRA r={args.lora_r})' if args.lora_r else ''}")
    return state


def loop(run: Run, state: State) -> None:
    """Optimizer steps until ``total_steps``, epoch after epoch, with evaluations and checkpoints on schedule."""
    if state.step == 0 and not run.args.no_initial_eval:
        evaluate_now(run, state)
    bar = None
    if run.di.is_main and not run.args.no_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=run.total_steps, initial=state.step, desc="train", unit="step", dynamic_ncols=True)
    while state.step < run.total_steps:
        run.sampler.set_epoch(state.epoch)
        for idx in steps_of(np.fromiter(iter(run.sampler), dtype=np.int64), run.per_step):
            record = step(run, state, idx)
            report(run, state, record, bar)
            if run.args.eval_every and state.step % run.args.eval_every == 0 and state.step < run.total_steps:
                evaluate_now(run, state)
            if (run.args.save_every and state.step % run.args.save_every == 0) or state.step == run.total_steps:
                checkpoint(run, state)
            if state.step >= run.total_steps:
                break
        if run.sampler.position >= run.plan.per_rank:
            state.epoch += 1
    if bar is not None:
        bar.close()


def steps_of(order: np.ndarray, per_step: int) -> Iterator[np.ndarray]:
    """The epoch's remaining order cut into steps of ``per_step`` examples (the last may be shorter)."""
    for s in range(0, len(order), per_step):
        yield order[s : s + per_step]


def step(run: Run, state: State, idx: np.ndarray) -> dict[str, Any]:
    """One optimizer step on this rank's examples ``idx``; returns (and logs) its metrics record."""
    t0, c0 = time.perf_counter(), time.process_time()
    micro = make_micro_batches(run.data, idx, run.plan.weights, run.args.micro_batch_size, run.pad_id, run.di.device)
    stats = train_step(run.model, run.optimizer, run.scheduler, micro, n_step=len(idx),
                       max_grad_norm=run.args.max_grad_norm, autocast_dtype=run.autocast_dtype,
                       ddp_model=run.ddp_model)
    if run.di.device.type == "cuda":
        torch.cuda.synchronize(run.di.device)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    run.sampler.advance(len(idx))
    state.step += 1
    epoch = state.epoch + run.sampler.position / run.plan.per_rank
    record = step_record(stats, dt, cpu, run.di, state.step, epoch, state.counters)
    state.log.append(record)
    return record


def report(run: Run, state: State, record: dict[str, Any], bar: Any) -> None:
    """The progress bar, or a log line every --log-every steps."""
    if bar is not None:
        bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)
        bar.update(1)
    elif state.step % run.args.log_every == 0 or state.step == run.total_steps:
        run.say(f"step {state.step}/{run.total_steps}  loss {record['loss']:.4f}  lr {record['lr']:.3g}  "
                f"{record['tokens_per_s']:,.0f} tok/s")


def evaluate_now(run: Run, state: State) -> None:
    """Held-out loss at this step (nothing without --eval-data), logged as an ``eval`` record."""
    if run.eval_data is None:
        return
    t0 = time.perf_counter()
    per_example = torch.zeros(2, len(run.eval_data), dtype=torch.float64, device=run.di.device)
    loss, n_tok = evaluate(run.model, run.eval_data, run.di, batch_size=run.args.eval_batch_size, pad_id=run.pad_id,
                           autocast_dtype=run.autocast_dtype, per_example=per_example)
    if run.di.is_main:  # per-example summed token loss and answer tokens of this (the latest) evaluation; the one
        # before training also on its own (clusterlm compare's per-set losses of the base model)
        record = {"step": state.step, "loss_sums": per_example[0].tolist(), "tokens": per_example[1].long().tolist()}
        for name in (EVAL_EXAMPLES, INITIAL_EVAL_EXAMPLES) if state.step == 0 else (EVAL_EXAMPLES,):
            atomic_write_json(run.out / name, record, indent=None)
    state.log.append({"kind": "eval", "step": state.step, "eval_loss": loss, "eval_tokens": n_tok,
                      "eval_time": time.perf_counter() - t0})
    run.say(f"step {state.step}: held-out loss {loss:.4f} ({n_tok} answer tokens)")


# ---------------------------------------------------------------------------------------------------
# Checkpoint
# ---------------------------------------------------------------------------------------------------


def checkpoint(run: Run, state: State) -> None:
    """Every rank's generator states to rank 0; it writes the checkpoint (:func:`~clusterlm.engine.save_checkpoint`).
    With --fsdp every rank writes its shards (:func:`~clusterlm.engine.save_sharded_checkpoint`)."""
    rng = all_gather_objects(rng_state(run.di.device), run.di)
    ckpt = None
    if run.di.is_main:
        ckpt = {"version": CKPT_VERSION, "step": state.step, "setup": run.setup,
                "sampler": {"epoch": run.sampler.epoch, "position": run.sampler.position},
                "scheduler": run.scheduler.state_dict(), "rng": rng, "metrics": state.log.records,
                "counters": state.counters}
    if uses_fsdp(run.args):
        save_sharded_checkpoint(run.out, ckpt, state.step, run.args.keep_checkpoints, model=run.model,
                                optimizer=run.optimizer, only_trainable=run.args.lora_r > 0, di=run.di)
    elif ckpt is not None:
        ckpt["model"] = trainable_state(run.model, only_trainable=run.args.lora_r > 0)
        ckpt["optimizer"] = run.optimizer.state_dict()
        save_checkpoint(run.out, ckpt, state.step, run.args.keep_checkpoints)


# ---------------------------------------------------------------------------------------------------
# Teardown
# ---------------------------------------------------------------------------------------------------


def finish(run: Run, state: State, wall: float) -> dict[str, Any]:
    """The final evaluation, the summary; rank 0 saves the model, the curve and summary.json."""
    if not any(r.get("kind") == "eval" and r["step"] == state.step for r in state.log.records):
        evaluate_now(run, state)
    summary = summarize(state.log.records, state.counters, run.args, run.di, run.plan, run.total_steps, wall,
                        state.resumed_from)
    if uses_fsdp(run.args) and not run.args.no_save_model:  # every rank sends its shards to rank 0
        save_full_model(run.model, run.tokenizer, run.out / "model", run.di)
    if run.di.is_main:
        if not run.args.no_save_model and not uses_fsdp(run.args):
            with storage_errors(run.out / "model"):
                run.model.save_pretrained(run.out / "model")
                run.tokenizer.save_pretrained(run.out / "model")
        plot_training(state.log.records, run.out / CURVE)
        atomic_write_json(run.out / SUMMARY, summary, sort_keys=False)
        run.say(summary_text(summary, run.out))
    return summary


def write_args(run: Run, state: State) -> None:
    """``args.json`` (rank 0): the options, world size, plan configuration, versions."""
    if not run.di.is_main:
        return
    info = {**{k: v for k, v in vars(run.args).items() if k != "func"}, "world_size": run.di.world_size,
            "max_length_used": run.max_length, "total_steps": run.total_steps, "steps_per_epoch": run.steps_per_epoch,
            "model_id": run.model_id, "plan_config": run.plan.config, "resumed_from": state.resumed_from,
            "versions": versions(), "argv": sys.argv}
    atomic_write_text(run.out / "args.json", json.dumps(info, indent=2, default=str) + "\n")


def versions() -> dict[str, str]:
    """python, torch, transformers, peft and cluster-kernels versions."""
    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    for dist_name in ("transformers", "peft", "cluster-kernels"):
        try:
            out[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


# ---------------------------------------------------------------------------------------------------
# Launch from Python
# ---------------------------------------------------------------------------------------------------


def launch(
    argv: Sequence[str],
    nproc: int,
    *,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "clusterlm",
    env: dict[str, str] | None = None,
    run_here: Callable[[list[str]], int] | None = None,
) -> int:
    """Run ``clusterlm train ARGV`` on ``nproc`` processes of this node; the exit status.

    More than one process (or node) goes through torch's own launcher, ``python -m torch.distributed.run``
    (:func:`clusterlm.launch.spawn`); one process is ``python -m clusterlm.train ARGV`` in a child process,
    or ``run_here(ARGV)`` in this one when given.

    Args:
        argv: the trainer's arguments (``--nproc``, ``--nnodes`` and ``--rdzv-*`` in there are dropped).
        nproc: processes on this node.
        nnodes / rdzv_endpoint / rdzv_id: multi-node rendezvous (see :func:`clusterlm.launch.torchrun_command`).
        env: extra environment variables for the ranks.
        run_here: runs the command in this process (the CLI's ``lambda argv: main(["train", *argv])``): one
            process on one node without ``env`` then skips the interpreter start and the imports.

    Returns:
        The exit status (0 on success).
    """
    argv = strip_options(argv, LAUNCHER_OPTIONS)
    if run_here is not None and nproc == 1 and nnodes == 1 and not env:
        return run_here(argv)
    return spawn(TRAIN_MODULE, argv, nproc, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, env=env)


if __name__ == "__main__":  # python -m clusterlm.train / torchrun -m clusterlm.train: the `clusterlm train` command
    from clusterlm.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))


def run(args: Any, rank_argv: Sequence[str], *, build_plan: PlanBuilder | None = None) -> int:
    """``clusterlm train``: train in this process (under torchrun or alone), or start the ranks; the exit status.

    Every check that can fail runs here, before any process starts: one error line instead of one per rank.

    Args:
        args: the parsed ``clusterlm train`` options.
        rank_argv: the command line every rank gets (``args`` without the launcher's options).
        build_plan: builds a baseline plan from the data (``--plan full`` / ``random:...``), None for a plan
            directory.

    Returns:
        0, or the exit status of the ranks.
    """
    nproc = args.nproc or 1
    validate_args(args)
    if not under_torchrun():  # (the ranks check again, with the launched world size)
        check_fsdp(args, nproc * args.nnodes)
    if not under_torchrun() and (nproc > 1 or args.nnodes > 1):
        check_inputs(args, plan_dir=build_plan is None)  # the ranks check again; this fails before any starts
        if args.nnodes == 1:  # (the other nodes of a run find the lock taken by its rank 0)
            check_unlocked(args.out)
        plan_ws = None if build_plan is not None else plan_world_size(args.plan)
        if plan_ws is not None and plan_ws != nproc * args.nnodes:  # fail before starting processes
            raise world_size_error(plan_ws, nproc * args.nnodes, f"--nproc {nproc} x --nnodes {args.nnodes}")
        on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
        env = dict(CPU_ALLOCATOR_ENV) if uses_fsdp(args) and on_cpu else None
        return launch(rank_argv, nproc, nnodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                      env=env)
    train(args, build_plan=build_plan)
    return 0
