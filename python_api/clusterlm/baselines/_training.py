"""Shared machinery of the model-based baselines (S2L, IFD, LESS): batched per-example losses, a small
single-process training loop with checkpoint callbacks, and building the final :class:`Plan`.

One piece of code serves S2L's proxy training and LESS's LoRA warm-up: :func:`train_loop` reuses the
reference trainer's optimizer (:func:`clusterlm.train.build_optimizer`, AdamW with decay on matrices
only), schedule (:func:`clusterlm.train.lr_factor`) and step (:func:`clusterlm.train.forward_backward`
with weight-1 micro-batches from :func:`clusterlm.train.make_micro_batches`), so the baselines train
the way the trainer does, in one process.

:func:`example_losses` runs forwards only, on batches of examples of similar length (sorted by length,
cut at ``batch_tokens`` padded tokens) so little compute goes to padding; the loss is
:func:`clusterlm.loss.per_example_loss` (mean next-token cross entropy over answer tokens).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from clusterlm.plan import Plan

__all__ = ["budget_count", "example_losses", "length_batches", "make_plan", "pad_id_of", "stage", "train_loop"]


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
    batch_tokens: int = 8192,
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
    from clusterlm.data import collate
    from clusterlm.loss import per_example_loss

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
    *,
    epochs: int,
    lr: float,
    micro_batch_size: int = 8,
    warmup_ratio: float = 0.03,
    schedule: str = "linear",
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    seed: int = 0,
    pad_id: int | None = None,
    checkpoint_steps: Sequence[int] = (),
    on_checkpoint: Callable[[int, float, torch.optim.Optimizer], None] | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Train ``model`` in place on ``examples[indices]`` in one process (plain mean loss, AdamW).

    Every epoch visits ``indices`` in a fresh random order (seeded); one optimizer step per
    ``micro_batch_size`` examples; linear warm-up over ``warmup_ratio`` of the steps, then ``schedule``
    decay to 0 (the trainer's :func:`clusterlm.train.lr_factor`).

    Args:
        model: the model to train (its trainable parameters are optimised), on its device.
        examples: indexable example dicts.
        indices: (n,) int64 which examples to train on.
        epochs: passes over ``indices``.
        lr: peak learning rate.
        micro_batch_size: examples per step.
        warmup_ratio / schedule / weight_decay / max_grad_norm: as the trainer's options.
        seed: order of the examples (and dropout, through a forked RNG).
        pad_id: padding id (default the model's).
        checkpoint_steps: after these optimizer steps (1-based) ``on_checkpoint(step, mean_lr, optimizer)`` is
            called, ``mean_lr`` = the mean learning rate of the steps since the previous checkpoint (LESS reads
            the Adam moments from ``optimizer``).
        on_checkpoint: the callback (e.g. per-example losses or gradients of the current model).
        autocast_dtype: e.g. ``torch.bfloat16``; None for none.

    Returns:
        ``{"steps", "optimizer" (the AdamW, holding the Adam moments), "losses" (per step), "lrs"}``.

    Raises:
        ValueError: empty ``indices`` or ``epochs < 1``.
    """
    from clusterlm.train import build_optimizer, forward_backward, lr_factor, make_micro_batches

    indices = np.asarray(indices, dtype=np.int64)
    if len(indices) == 0 or epochs < 1:
        raise ValueError(f"train_loop: need examples and epochs >= 1, got {len(indices)} examples, epochs={epochs}.")
    pad = pad_id_of(model, pad_id)
    device = next(model.parameters()).device
    args = SimpleNamespace(lr=lr, weight_decay=weight_decay, optimizer="adamw", beta1=0.9, beta2=0.999)
    optimizer = build_optimizer(model, args)
    steps_per_epoch = -(-len(indices) // micro_batch_size)
    total = epochs * steps_per_epoch
    warmup = int(warmup_ratio * total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total, warmup, schedule, 0.0))
    ones = np.ones(int(max(indices.max() + 1, 1)), dtype=np.float64)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED7]))
    marks = set(int(s) for s in checkpoint_steps)
    losses: list[float] = []
    lrs: list[float] = []
    since: list[float] = []
    step = 0
    model.train()
    with torch.random.fork_rng(devices=[]):  # dropout stream: seeded, caller's RNG untouched
        torch.manual_seed(seed)
        for _ in range(epochs):
            order = indices[rng.permutation(len(indices))]
            for s in range(0, len(order), micro_batch_size):
                idx = order[s : s + micro_batch_size]
                micro = make_micro_batches(examples, idx, ones, micro_batch_size, pad, device)
                stats = forward_backward(model, micro, n_step=len(idx), autocast_dtype=autocast_dtype)
                if max_grad_norm > 0:
                    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
                lr_now = scheduler.get_last_lr()[0]
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                losses.append(stats["loss"])
                lrs.append(lr_now)
                since.append(lr_now)
                if step in marks and on_checkpoint is not None:
                    on_checkpoint(step, float(np.mean(since)), optimizer)
                    since = []
    model.eval()
    return {"steps": step, "optimizer": optimizer, "losses": losses, "lrs": lrs}


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


def budget_count(n: int, world_size: int, ratio: float | None, budget: int | None, who: str) -> tuple[int, dict]:
    """The number to select (rounded down to a multiple of ``world_size``) and the rounding statistics.

    Raises:
        ValueError: bad ratio/budget (same rules as :func:`clusterlm.select.resolve_budget`), or fewer than
            one example per rank.
    """
    from clusterlm.baselines.random import _check_world_size
    from clusterlm.select import resolve_budget

    _check_world_size(world_size, n, who)
    try:
        requested = resolve_budget(n, ratio, budget)
    except ValueError as e:
        raise ValueError(str(e).replace("select:", f"{who}:", 1)) from None
    count = requested - requested % world_size
    if count == 0:
        raise ValueError(
            f"{who}: a budget of {requested} examples gives less than one example to each of {world_size} ranks; "
            f"raise ratio/budget to at least {world_size}."
        )
    stats: dict[str, Any] = {"requested": int(requested)}
    if count != requested:
        stats["rounding"] = (
            f"{requested} requested -> {count} selected (the total is a multiple of world_size = {world_size})"
        )
    return count, stats


def make_plan(
    dataset: Any,
    selected: np.ndarray,
    world_size: int,
    *,
    seed: int,
    config: dict[str, Any],
    stats: dict[str, Any],
    timings: dict[str, float],
    t0: float,
    model_id: str,
    token_balance: bool = True,
) -> Plan:
    """The :class:`Plan` of a baseline's selection: weight 1 each, stratified over ranks.

    Reuses the random baseline's plan builder (:func:`clusterlm.baselines.random._plan_from_selection`, a
    private helper of this package): one pseudo-cluster, :func:`clusterlm.allocation.allocate` with
    ``"stratified"`` and the token-balanced visit order, so every baseline trains with the same per-step
    token balance. ``timings`` (the stages) are recorded with ``"total"`` = wall time since ``t0``
    (everything: proxy training / warm-up / forwards / clustering).
    """
    from clusterlm.baselines.random import _plan_from_selection

    selected = np.sort(np.asarray(selected, dtype=np.int64))
    assert len(np.unique(selected)) == len(selected) and len(selected) % world_size == 0
    plan = _plan_from_selection(dataset, selected, world_size, seed=seed, token_balance=token_balance,
                                config=config, stats=stats, t0=t0, model_id=model_id)
    plan.timings = {**{k: float(v) for k, v in timings.items()}, "total": time.perf_counter() - t0}
    return plan
