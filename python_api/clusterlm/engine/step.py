"""The training engine: the pieces every training loop of clusterlm is built from.

Four loops use it — the reference trainer (:mod:`clusterlm.train`, DDP or FSDP2), the demo pre-training
(:mod:`clusterlm.models.pretrain`), S2L's proxy training and LESS's LoRA warm-up (both
:func:`clusterlm.selection.baselines._training.train_loop`) — so they share one optimizer (AdamW with weight decay on
matrices only, as nanoGPT; or Adafactor), one learning-rate schedule and one optimizer step:

- batches: :func:`make_micro_batches` (collated examples with their plan weights);
- the step: :func:`forward_backward` (micro-batch loss ``sum_b w_b loss_b / n_step`` of the per-example
  answer-token losses, gradients accumulated, DDP synchronised once per step; an FSDP2 model reduce-scatters
  after every micro-batch, :mod:`clusterlm.engine.fsdp`), :func:`optimizer_step` (clip, step, schedule, zero),
  :func:`train_step` (both);
- evaluation: :func:`evaluate` (token-weighted held-out answer-token loss, sharded over ranks);
- optimizer and schedule: :func:`build_optimizer`, :func:`lr_factor`, :func:`build_scheduler`;
- checkpoints: :func:`save_checkpoint` (one file, atomic, through :mod:`clusterlm.fileio`),
  :func:`save_sharded_checkpoint` (an FSDP2 model: a directory of shards, atomic),
  :func:`find_checkpoint`, :func:`resume` (either kind), with :func:`trainable_state`, :func:`rng_state` /
  :func:`set_rng_state` and :func:`seed_everything`.

Everything takes keyword arguments (no argparse namespace) and works on one process, inside DDP, or on an
FSDP2-sharded model (``fully_shard``: every rank runs the same forward passes).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cluster_kernels.lm_head_features import IGNORE_INDEX
from clusterlm.config.defaults import CKPT_DIR, LATEST
from clusterlm.data import collate
from clusterlm.engine.fsdp import (
    STATE_FILE,
    ShardedAdafactor,
    is_dtensor,
    is_sharded,
    load_sharded_checkpoint,
    write_sharded_checkpoint,
)
from clusterlm.engine.loss import per_example_loss, weighted_loss
from clusterlm.fileio import atomic_write, atomic_write_text, storage_errors
from clusterlm.launch.launcher import DistInfo

__all__ = [
    "CKPT_DIR", "CKPT_VERSION", "EVAL_EXAMPLES", "LATEST", "answer_losses", "autocast", "build_optimizer",
    "build_scheduler",
    "evaluate", "find_checkpoint", "forward_backward", "lr_factor", "make_micro_batches", "optimizer_step",
    "resume", "rng_state", "save_checkpoint", "save_sharded_checkpoint", "seed_everything", "set_rng_state",
    "train_step", "trainable_state",
]

EVAL_EXAMPLES = "eval_examples.json"  # the latest evaluation's per-example losses (written by the trainer)
CKPT_VERSION = 1


# ---------------------------------------------------------------------------------------------------
# Batches and losses
# ---------------------------------------------------------------------------------------------------


def make_micro_batches(
    dataset: Any, indices: Sequence[int], weights: np.ndarray, micro_batch_size: int, pad_id: int, device: torch.device
) -> list[dict[str, torch.Tensor]]:
    """Collate one step's examples into micro-batches.

    Args:
        dataset: indexable examples (``{"input_ids", "labels"}`` int64 arrays).
        indices: (n_step,) data-set indices of the step, in order.
        weights: (N,) per-example plan weights.
        micro_batch_size: examples per micro-batch (the last one may be smaller).
        pad_id: padding token id.
        device: where the tensors go.

    Returns:
        Micro-batches with ``input_ids``, ``attention_mask``, ``labels`` (B, T) int64 (right-padded, -100
        on padding) and ``weights`` (B,) float32.
    """
    weights = np.asarray(weights)
    out = []
    for s in range(0, len(indices), micro_batch_size):
        idx = [int(i) for i in indices[s : s + micro_batch_size]]
        batch = collate([dataset[i] for i in idx], pad_id=pad_id)
        batch["weights"] = torch.as_tensor(weights[idx], dtype=torch.float32)
        out.append({k: v.to(device, non_blocking=True) for k, v in batch.items()})
    return out


def answer_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """:func:`clusterlm.engine.loss.per_example_loss`, with 0 (and no gradient) for rows without an answer token."""
    has_answer = (labels[:, 1:] != IGNORE_INDEX).any(dim=1)
    if bool(has_answer.all()):
        return per_example_loss(logits, labels)
    losses = torch.zeros(labels.shape[0], dtype=torch.promote_types(logits.dtype, torch.float32),
                         device=logits.device)
    if bool(has_answer.any()):
        losses = losses.index_put((has_answer.nonzero().flatten(),),
                                  per_example_loss(logits[has_answer], labels[has_answer]))
    return losses


def autocast(device_type: str, dtype: torch.dtype | None) -> Any:
    """``torch.autocast`` to ``dtype`` (e.g. bfloat16); a no-op context for None."""
    return torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


# ---------------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------------


def forward_backward(
    model: torch.nn.Module,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    *,
    n_step: int,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Forward and backward passes of one optimizer step on this rank (gradients accumulate in ``.grad``).

    Micro-batch loss ``sum_b w_b loss_b / n_step``; DDP gradient synchronisation (``no_sync``) only on the
    last micro-batch. After it, ``.grad`` on every rank holds the mean over ranks of each rank's
    ``grad mean_b(w_b * loss_b)`` (see :mod:`clusterlm.train`). An FSDP2 model (no ``no_sync``)
    reduce-scatters the gradients after every micro-batch and accumulates the shards: the same mean over
    ranks, sharded, without ever holding a whole unsharded gradient.

    Args:
        model: the (DDP-wrapped, FSDP2-sharded or plain) causal LM, in train mode.
        micro_batches: from :func:`make_micro_batches`.
        n_step: examples in the step on this rank (the sum of the micro-batch sizes).
        autocast_dtype: e.g. ``torch.bfloat16`` for autocast; None for none.

    Returns:
        ``{"loss": weighted objective, "loss_unweighted": mean per-example loss, "examples", "tokens"
        (attention-mask tokens), "padded_tokens"}``, for this rank.
    """
    assert n_step == sum(int(mb["input_ids"].shape[0]) for mb in micro_batches)
    device_type = micro_batches[0]["input_ids"].device.type
    no_sync: Callable[[], Any] = getattr(model, "no_sync", contextlib.nullcontext)
    # Summed on the device and read once at the end: a .item() per micro-batch would stall a GPU.
    sums = torch.zeros(3, dtype=torch.float64, device=micro_batches[0]["input_ids"].device)
    padded = 0
    for i, mb in enumerate(micro_batches):
        sync = i == len(micro_batches) - 1
        with contextlib.nullcontext() if sync else no_sync():
            with autocast(device_type, autocast_dtype):
                logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
            losses = answer_losses(logits, mb["labels"])
            loss = weighted_loss(losses, mb["weights"]) * (losses.shape[0] / n_step)
            loss.backward()
        sums += torch.stack([loss.detach().double(), losses.detach().double().sum() / n_step,
                             mb["attention_mask"].sum().double()])
        padded += mb["attention_mask"].numel()
    loss_sum, plain, tokens = sums.tolist()
    return {"loss": loss_sum, "loss_unweighted": plain, "examples": n_step, "tokens": int(tokens),
            "padded_tokens": int(padded)}


def optimizer_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, *, max_grad_norm: float
) -> tuple[float, float]:
    """Clip the gradients (``max_grad_norm > 0``), step the optimizer and the schedule, zero the gradients.

    Returns:
        ``(lr, grad_norm)``: the learning rate the step used and the gradient norm before clipping (nan
        without clipping).
    """
    grad_norm = float("nan")
    if max_grad_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
        grad_norm = float(norm.full_tensor() if is_dtensor(norm) else norm)  # sharded: the global norm
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return lr, grad_norm


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    *,
    n_step: int,
    max_grad_norm: float,
    autocast_dtype: torch.dtype | None = None,
    ddp_model: torch.nn.Module | None = None,
) -> dict[str, float]:
    """One optimizer step: :func:`forward_backward` (through ``ddp_model`` when given), then :func:`optimizer_step`.

    Returns:
        :func:`forward_backward`'s numbers plus ``"lr"`` and ``"grad_norm"``.
    """
    stats = forward_backward(ddp_model if ddp_model is not None else model, micro_batches, n_step=n_step,
                             autocast_dtype=autocast_dtype)
    lr, grad_norm = optimizer_step(model, optimizer, scheduler, max_grad_norm=max_grad_norm)
    return {**stats, "lr": lr, "grad_norm": grad_norm}


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    dataset: Any,
    di: DistInfo,
    *,
    batch_size: int,
    pad_id: int,
    autocast_dtype: torch.dtype | None = None,
    per_example: torch.Tensor | None = None,
) -> tuple[float, int]:
    """Held-out answer-token loss: token-weighted mean over the data set, sharded over ranks.

    Rank ``r`` evaluates examples ``r, r + K, ...`` (longest first, for little padding); the sums of
    token losses and answer tokens are all-reduced. Examples without answer tokens count nothing. A sharded
    (FSDP2) model's forward is a collective, so there every rank runs as many forward passes as rank 0 (the
    extra ones on one example, not counted).

    ``per_example``: a zeroed (2, len(dataset)) float64 tensor on the device, filled with every example's summed
    token loss (row 0) and answer tokens (row 1), all-reduced too (``clusterlm compare``'s intervals).

    Returns:
        ``(loss, answer_tokens)``; loss is nan when the set has no answer token.
    """
    was_training = model.training
    model.eval()
    mine = list(range(di.rank, len(dataset), di.world_size))
    mine.sort(key=lambda i: -len(dataset[i]["input_ids"]))
    batches = [mine[s : s + batch_size] for s in range(0, len(mine), batch_size)]
    rounds = len(batches)
    if di.distributed and is_sharded(model):
        rounds = math.ceil(math.ceil(len(dataset) / di.world_size) / batch_size)
    total = torch.zeros(2, dtype=torch.float64, device=di.device)  # [sum of token NLL, answer tokens]
    for j in range(rounds):
        counted = j < len(batches)
        batch = collate([dataset[i] for i in (batches[j] if counted else [0])], pad_id=pad_id)
        batch = {k: v.to(di.device) for k, v in batch.items()}
        counts = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1)
        with autocast(di.device.type, autocast_dtype):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        if not counted:
            continue
        losses = answer_losses(logits, batch["labels"])
        total[0] += (losses.double() * counts.double()).sum()
        total[1] += counts.sum().double()
        if per_example is not None:
            idx = torch.tensor(batches[j], device=di.device)
            per_example[:, idx] = torch.stack([losses.double() * counts.double(), counts.double()])
    if di.distributed:
        torch.distributed.all_reduce(total)
        if per_example is not None:
            torch.distributed.all_reduce(per_example)
    model.train(was_training)
    n_tokens = int(total[1].item())
    return (float(total[0].item()) / n_tokens if n_tokens else float("nan")), n_tokens


# ---------------------------------------------------------------------------------------------------
# Optimizer and schedule
# ---------------------------------------------------------------------------------------------------


def build_optimizer(
    model: torch.nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.0,
    kind: str = "adamw",
    betas: tuple[float, float] = (0.9, 0.999),
) -> torch.optim.Optimizer:
    """AdamW (decoupled decay on matrices only, not biases/norms, as nanoGPT) or Adafactor over the trainable
    parameters (:class:`clusterlm.engine.fsdp.ShardedAdafactor`, the same algorithm, for FSDP2-sharded parameters).

    Raises:
        ValueError: the model has no trainable parameters.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("train: the model has no trainable parameters (check --lora-targets).")
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if kind == "adafactor":
        sharded = any(is_dtensor(p) for p in params)
        return ShardedAdafactor(groups, lr=lr) if sharded else torch.optim.Adafactor(groups, lr=lr)
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


def lr_factor(step: int, total_steps: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Learning rate / peak at ``step`` (0-based): linear warm-up, then cosine/linear decay to ``min_ratio``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    if schedule == "linear":
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, *, total_steps: int, warmup: int, schedule: str = "cosine",
    min_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """The :func:`lr_factor` schedule over ``total_steps`` steps as a ``LambdaLR``."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps, warmup, schedule, min_ratio)
    )


# ---------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def trainable_state(model: torch.nn.Module, *, only_trainable: bool) -> dict[str, torch.Tensor]:
    """The model's state dict, or only its trainable entries (LoRA: the adapters)."""
    state = model.state_dict()
    if not only_trainable:
        return state
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in trainable}


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's python / numpy / torch (and CUDA) generator states."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: Mapping[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _checkpoints(ckpt_dir: Path) -> list[Path]:
    """The complete checkpoints in ``ckpt_dir``, oldest first: ``step_*.pt`` files, sharded ``step_*`` directories."""
    if not ckpt_dir.is_dir():
        return []
    return [p for p in sorted(ckpt_dir.glob("step_*"))
            if (p.suffix == ".pt" and p.is_file()) or (p.is_dir() and (p / STATE_FILE).is_file())]


def _point_latest(ckpt_dir: Path, path: Path, keep: int) -> None:
    """``latest`` names ``path``; then only the newest ``keep`` checkpoints stay."""
    atomic_write_text(ckpt_dir / LATEST, path.name + "\n")
    for old in _checkpoints(ckpt_dir)[:-keep]:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def save_checkpoint(out: str | os.PathLike, state: dict[str, Any], step: int, keep: int) -> Path:
    """Atomically write ``ckpt/step_<step, 7 digits>.pt``, point ``ckpt/latest`` at it, keep the newest ``keep``.

    Older checkpoints are removed only once the new one and ``latest`` are in place.

    Raises:
        StorageError: the disk is full (or a quota, the file size limit, an I/O error); it names the file. No
            temporary file is left, ``latest`` still names the previous checkpoint, which is kept.
    """
    ckpt_dir = Path(out) / CKPT_DIR
    with storage_errors(ckpt_dir):
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"step_{step:07d}.pt"
    atomic_write(path, lambda f: torch.save(state, f))
    _point_latest(ckpt_dir, path, keep)
    return path


def save_sharded_checkpoint(
    out: str | os.PathLike,
    state: dict[str, Any] | None,
    step: int,
    keep: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    only_trainable: bool,
    di: DistInfo,
) -> Path:
    """The sharded form of :func:`save_checkpoint` for an FSDP2 model; every rank calls it.

    Writes the directory ``ckpt/step_<step>/`` (:func:`clusterlm.engine.fsdp.write_sharded_checkpoint`: every rank's
    shards of the model and optimizer, and ``state`` from rank 0, renamed into place when complete), then rank 0
    points ``latest`` at it and keeps the newest ``keep``.

    Args:
        state: rank 0's trainer state (step, setup, sampler, scheduler, generators, metrics); None elsewhere.
        only_trainable: save only the trainable parameters (LoRA).

    Raises:
        StorageError: as :func:`save_checkpoint`; no partial directory is left.
    """
    ckpt_dir = Path(out) / CKPT_DIR
    if di.is_main:
        with storage_errors(ckpt_dir):
            ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = write_sharded_checkpoint(ckpt_dir / f"step_{step:07d}", model=model, optimizer=optimizer, state=state,
                                    only_trainable=only_trainable, di=di)
    if di.is_main:
        _point_latest(ckpt_dir, path, keep)
    return path


def _is_checkpoint(path: Path) -> bool:
    return path.is_file() or (path.is_dir() and (path / STATE_FILE).is_file())


def find_checkpoint(out: str | os.PathLike, resume_from: str = LATEST) -> Path | None:
    """The checkpoint to resume: ``resume_from`` itself (a file, or a sharded checkpoint directory), or ``latest``
    in OUT/ckpt (None when there is none).

    Raises:
        FileNotFoundError: ``resume_from`` names no checkpoint.
    """
    if resume_from != LATEST:
        path = Path(resume_from)
        if not _is_checkpoint(path):
            raise FileNotFoundError(f"train: --resume {resume_from}: no such checkpoint file (or sharded checkpoint "
                                    f"directory with {STATE_FILE}).")
        return path
    ckpt_dir = Path(out) / CKPT_DIR
    pointer = ckpt_dir / LATEST
    if pointer.is_file():
        path = ckpt_dir / pointer.read_text(encoding="utf-8").strip()
        if path.name and _is_checkpoint(path):
            return path
    found = _checkpoints(ckpt_dir)
    return found[-1] if found else None


def resume(
    path: Path,
    *,
    setup: Mapping[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    sampler: Any,
    rank: int,
    device: torch.device,
    strict: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint into model, optimizer, scheduler, sampler and this rank's generators.

    Args:
        path: the checkpoint: a file (:func:`save_checkpoint`: ``setup``, ``model``, ``optimizer``,
            ``scheduler``, ``sampler``, ``rng`` (one state per rank), ...), or a sharded directory
            (:func:`save_sharded_checkpoint`: the same without ``model`` and ``optimizer``, which are shards;
            every rank calls it then, with the sharded model).
        setup: this run's settings that decide the data order (must equal the checkpoint's).
        model / optimizer / scheduler / sampler: built as for a fresh run.
        rank / device: whose generator state to restore, and where.
        strict: the checkpoint holds the whole model (False: only its trainable parameters, e.g. LoRA).

    Returns:
        The checkpoint (the caller reads its own entries: ``step``, ``metrics``, ...).

    Raises:
        ValueError: the checkpoint was made with other settings, or lacks trainable parameters of the model.
    """
    sharded = path.is_dir()
    # On CPU first: RNG states must stay CPU tensors; load_state_dict moves the rest where it belongs.
    ckpt = torch.load(path / STATE_FILE if sharded else path, map_location="cpu", weights_only=False)
    differs = [f"{k}: checkpoint {ckpt['setup'].get(k)!r}, now {v!r}" for k, v in setup.items()
               if ckpt["setup"].get(k) != v]
    if differs:
        raise ValueError(
            f"train: cannot resume {path}: it was made with other settings ({'; '.join(differs)}). Resume with the "
            "original plan and settings, or start afresh with --overwrite."
        )
    if sharded:
        load_sharded_checkpoint(path, model=model, optimizer=optimizer, only_trainable=not strict)
    else:
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        if not trainable <= set(ckpt["model"]):
            raise ValueError(f"train: {path} lacks trainable parameters of this model, e.g. "
                             f"{sorted(trainable - set(ckpt['model']))[:3]}; resume with the same --model/--lora-*.")
        model.load_state_dict(ckpt["model"], strict=strict)
        optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    sampler.load_state_dict({"epoch": ckpt["sampler"]["epoch"], "position": ckpt["sampler"]["position"]})
    set_rng_state(ckpt["rng"][rank], device)
    return ckpt
