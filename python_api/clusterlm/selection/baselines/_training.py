"""Shared machinery of the model-based baselines (S2L, IFD, LESS): batched per-example losses and a small
single-process training loop with checkpoint callbacks.

One loop serves S2L's proxy training and LESS's LoRA warm-up: :func:`train_loop` is built from the
training engine the reference trainer uses (:mod:`clusterlm.engine.step`:
:func:`~clusterlm.engine.step.build_optimizer`,
AdamW with decay on matrices only; :func:`~clusterlm.engine.step.build_scheduler`; the step
:func:`~clusterlm.engine.step.train_step` on weight-1 micro-batches from
:func:`~clusterlm.engine.step.make_micro_batches`), so the baselines train the way the trainer does, in one
process. Their plans are built by :mod:`clusterlm.selection.baselines._plans`.

:func:`example_losses` runs forwards only, on batches of examples of similar length (sorted by length,
cut at ``batch_tokens`` padded tokens) so little compute goes to padding; the loss is
:func:`clusterlm.engine.loss.per_example_loss` (mean next-token cross entropy over answer tokens).

Settings travel as frozen dataclasses (:class:`TrainLoopConfig` here,
:class:`~clusterlm.selection.baselines.less.LessConfig`,
:class:`~clusterlm.selection.baselines.s2l.S2LConfig`); :func:`apply_settings` lays a call's keyword overrides over one,
so
``train_loop(model, data, idx, epochs=2, lr=1e-3)`` and ``train_loop(model, data, idx, TrainLoopConfig(2, 1e-3))``
are the same call.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from clusterlm.config.baselines import LOSS_BATCH_TOKENS, MICRO_BATCH_SIZE, TrainLoopConfig
from clusterlm.data import collate
from clusterlm.engine.loss import per_example_loss
from clusterlm.engine.step import build_optimizer, build_scheduler, make_micro_batches, train_step

__all__ = [
    "LOSS_BATCH_TOKENS", "MICRO_BATCH_SIZE", "TrainLoopConfig", "example_losses", "length_batches",
    "pad_id_of", "stage", "train_loop",
]


def pad_id_of(model: Any, pad_id: int | None) -> int:
    """``pad_id`` if given, else the model config's pad token id, else 0 (padding is masked anyway)."""
    if pad_id is not None:
        return int(pad_id)
    value = getattr(getattr(model, "config", None), "pad_token_id", None)
    return int(value) if value is not None else 0


def length_batches(lengths: np.ndarray, batch_tokens: int, indices: np.ndarray | None = None) -> Iterator[np.ndarray]:
    """Batches of ``indices`` (default all) sorted by length, each at most ``batch_tokens`` padded tokens.

    Args:
        lengths: (N,) int64 tokens per example.
        batch_tokens: padded tokens per batch (a longer single example still forms its own batch).
        indices: which examples (default ``arange(N)``).

    Yields:
        int64 arrays of data-set indices (longest first), together covering ``indices`` once.
    """
    idx = np.arange(len(lengths), dtype=np.int64) if indices is None else np.asarray(indices, dtype=np.int64)
    order = idx[np.lexsort((idx, -lengths[idx]))]
    start = 0
    while start < len(order):
        width = int(lengths[order[start]])  # the longest of the batch: the padded width
        size = max(1, batch_tokens // max(width, 1))
        yield order[start : start + size]
        start += size


def example_losses(
    model: torch.nn.Module,
    examples: Sequence[dict[str, np.ndarray]],
    *,
    batch_tokens: int = LOSS_BATCH_TOKENS,
    pad_id: int | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> np.ndarray:
    """Per-example mean answer-token loss of ``model`` (forwards only, batched by length).

    Args:
        model: a causal LM (Hugging Face, optionally PEFT-wrapped); its device is used.
        examples: indexable ``{"input_ids", "labels"}`` int64 examples, each with an answer token.
        batch_tokens: padded tokens per forward.
        pad_id: padding id (default the model's pad token id, else 0).
        autocast_dtype: e.g. ``torch.bfloat16`` on GPU; None for the model's dtype.

    Returns:
        (N,) float64 losses, in the order of ``examples``.
    """
    pad = pad_id_of(model, pad_id)
    device = next(model.parameters()).device
    lengths = np.array([len(examples[i]["input_ids"]) for i in range(len(examples))], dtype=np.int64)
    out = np.zeros(len(examples), dtype=np.float64)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for idx in length_batches(lengths, batch_tokens):
                batch = collate([examples[int(i)] for i in idx], pad_id=pad)
                batch = {k: v.to(device) for k, v in batch.items()}
                with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16,
                                    enabled=autocast_dtype is not None):
                    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                out[idx] = per_example_loss(logits, batch["labels"]).double().cpu().numpy()
    finally:
        model.train(was_training)
    return out


def train_loop(
    model: torch.nn.Module,
    examples: Sequence[dict[str, np.ndarray]],
    indices: np.ndarray,
    config: TrainLoopConfig | None = None,
    *,
    on_checkpoint: Callable[[int, float, torch.optim.Optimizer], None] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Train ``model`` in place on ``examples[indices]`` in one process (plain mean loss, AdamW).

    Every epoch visits ``indices`` in a fresh random order (seeded); one optimizer step per
    ``micro_batch_size`` examples; linear warm-up over ``warmup_ratio`` of the steps, then ``schedule``
    decay to 0 (the trainer's schedule, :func:`clusterlm.engine.step.lr_factor`).

    Args:
        model: the model to train (its trainable parameters are optimised), on its device.
        examples: indexable example dicts.
        indices: (n,) int64 which examples to train on.
        config: the settings (:class:`TrainLoopConfig`); ``overrides`` (any of its fields, e.g. ``epochs=2,
            lr=1e-3``) are applied on top; without ``config`` they must include ``epochs`` and ``lr``.
        on_checkpoint: called as ``on_checkpoint(step, mean_lr, optimizer)`` after each of the config's
            ``checkpoint_steps``, ``mean_lr`` = the mean learning rate of the steps since the previous checkpoint
            (LESS reads the Adam moments from ``optimizer``; e.g. per-example losses or gradients of the model).

    Returns:
        ``{"steps", "optimizer" (the AdamW, holding the Adam moments), "losses" (per step), "lrs"}``.

    Raises:
        ValueError: empty ``indices`` or ``epochs < 1``.
        TypeError: an unknown setting, or ``epochs`` / ``lr`` missing.
    """
    c = TrainLoopConfig.merged(config, overrides)
    epochs, micro_batch_size, seed = c.epochs, c.micro_batch_size, c.seed
    indices = np.asarray(indices, dtype=np.int64)
    if len(indices) == 0 or epochs < 1:
        raise ValueError(f"train_loop: need examples and epochs >= 1, got {len(indices)} examples, epochs={epochs}.")
    pad = pad_id_of(model, c.pad_id)
    device = next(model.parameters()).device
    optimizer = build_optimizer(model, lr=c.lr, weight_decay=c.weight_decay)
    total = epochs * -(-len(indices) // micro_batch_size)
    scheduler = build_scheduler(optimizer, total_steps=total, warmup=int(c.warmup_ratio * total), schedule=c.schedule)
    ones = np.ones(int(max(indices.max() + 1, 1)), dtype=np.float64)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED7]))
    marks = set(int(s) for s in c.checkpoint_steps)
    losses: list[float] = []
    lrs: list[float] = []
    since: list[float] = []
    model.train()
    with torch.random.fork_rng(devices=[]):  # dropout stream: seeded, caller's RNG untouched
        torch.manual_seed(seed)
        for _ in range(epochs):
            order = indices[rng.permutation(len(indices))]
            for s in range(0, len(order), micro_batch_size):
                idx = order[s : s + micro_batch_size]
                micro = make_micro_batches(examples, idx, ones, micro_batch_size, pad, device)
                stats = train_step(model, optimizer, scheduler, micro, n_step=len(idx),
                                   max_grad_norm=c.max_grad_norm, autocast_dtype=c.autocast_dtype)
                losses.append(stats["loss"])
                lrs.append(stats["lr"])
                since.append(stats["lr"])
                if len(losses) in marks and on_checkpoint is not None:
                    on_checkpoint(len(losses), float(np.mean(since)), optimizer)
                    since = []
    model.eval()
    return {"steps": len(losses), "optimizer": optimizer, "losses": losses, "lrs": lrs}


@contextlib.contextmanager
def stage(timings: dict[str, float], name: str) -> Iterator[None]:
    """Add the wall time of the ``with`` block to ``timings[name]`` (CUDA work synchronised first)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0
