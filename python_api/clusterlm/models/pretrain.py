"""A short causal-LM pre-training run on the demo's ``pretrain.txt``: the ``"tiny-llama-pretrained"`` base model.

Fine-tuning comparisons need a base model that already knows something about the domain: on a
randomly initialised model every selection method mostly measures how fast the model learns token
frequencies. ``pretrain.txt`` (:mod:`clusterlm.data.demo`) is standard-library source from files that
neither the train nor the held-out split uses, so the base model never saw the fine-tuning answers.

The run: the ``"tiny-llama"`` architecture (:func:`tiny_llama_config`, owned here and used by
:mod:`clusterlm.models` for the random-weight ``"tiny-llama"``) and initial weights (seed 0), the demo
tokenizer, the text cut into blocks of ``block_size`` tokens each starting with ``<s>`` (so the model
learns the position the fine-tuning examples start from), the last ``eval_fraction`` of the blocks
held out; ``steps`` AdamW steps of ``batch_size`` blocks (peak ``lr``, linear warm-up then cosine decay;
gradient clipping at 1) in one process with a fixed number of threads and a private RNG stream. The
optimizer (decay on matrices only), the schedule and the step are the trainer's (:mod:`clusterlm.engine.step`);
the loss is the model's own causal-LM loss on whole blocks (every token is an answer here).
:func:`build_tiny_llama_pretrained` writes the result as a ``save_pretrained`` directory plus
``pretrain.json`` (losses before/after, settings, seconds);
:func:`clusterlm.models.load_model` builds it once under the demo directory (a file lock, an atomic
rename) and every later call, in any process, loads those files.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clusterlm.data.demo import DemoData
from clusterlm.engine.step import build_optimizer, build_scheduler, optimizer_step
from clusterlm.models.directory import save_model_dir

__all__ = ["PRETRAIN_DEFAULTS", "build", "build_tiny_llama_pretrained", "pretrain_causal_lm", "tiny_llama_config",
           "token_blocks"]

PRETRAIN_DEFAULTS: dict[str, Any] = {"block_size": 256, "batch_size": 8, "steps": 200, "lr": 3e-3,
                                     "warmup_steps": 20, "eval_fraction": 0.05, "seed": 0, "threads": 2}


def tiny_llama_config(vocab_size: int, bos_token_id: int, eos_token_id: int, pad_token_id: int) -> Any:
    """The ``LlamaConfig`` of ``"tiny-llama"`` (and of its pre-trained variant) for a tokenizer with these ids."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )


def token_blocks(token_ids: list[int] | np.ndarray, block_size: int, bos_id: int) -> np.ndarray:
    """Cut a token stream into ``(n_blocks, block_size)`` int64 blocks, each ``<s>`` + ``block_size - 1`` tokens.

    Raises:
        ValueError: ``block_size < 2`` or a stream shorter than one block.
    """
    if block_size < 2:
        raise ValueError(f"pretrain: block_size must be >= 2, got {block_size}.")
    ids = np.asarray(token_ids, dtype=np.int64)
    body = block_size - 1
    n_blocks = len(ids) // body
    if n_blocks == 0:
        raise ValueError(f"pretrain: the text has {len(ids)} tokens, fewer than one block of {body}; use more text.")
    blocks = ids[: n_blocks * body].reshape(n_blocks, body)
    return np.concatenate([np.full((n_blocks, 1), bos_id, dtype=np.int64), blocks], axis=1)


@torch.no_grad()
def _mean_loss(model: torch.nn.Module, blocks: np.ndarray, batch_size: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for s in range(0, len(blocks), batch_size):
        x = torch.as_tensor(blocks[s : s + batch_size])
        total += float(model(input_ids=x, labels=x).loss) * len(x)
        count += len(x)
    model.train()
    return total / max(count, 1)


def pretrain_causal_lm(
    model: torch.nn.Module,
    blocks: np.ndarray,
    *,
    steps: int,
    batch_size: int = 16,
    lr: float = 3e-3,
    warmup_steps: int = 20,
    eval_fraction: float = 0.05,
    seed: int = 0,
) -> dict[str, Any]:
    """Next-token pre-training of ``model`` (in place, CPU or its device) on random batches of ``blocks``.

    Args:
        model: a Hugging Face causal LM.
        blocks: (n, T) int64 token blocks (:func:`token_blocks`).
        steps: optimizer steps.
        batch_size: blocks per step (drawn without replacement within an epoch, seeded).
        lr: peak learning rate (linear warm-up over ``warmup_steps``, cosine decay to 0).
        warmup_steps: warm-up steps.
        eval_fraction: the last fraction of the blocks is held out and only evaluated.
        seed: batch order.

    Returns:
        ``{"train_blocks", "eval_blocks", "eval_loss_before", "eval_loss_after", "train_loss_first",
        "train_loss_last", "seconds"}``.
    """
    t0 = time.perf_counter()
    n_eval = max(1, int(len(blocks) * eval_fraction)) if len(blocks) > 1 else 0
    train_blocks, eval_blocks = blocks[: len(blocks) - n_eval], blocks[len(blocks) - n_eval :]
    device = next(model.parameters()).device
    before = _mean_loss(model, eval_blocks, batch_size) if n_eval else float("nan")
    optimizer = build_optimizer(model, lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    scheduler = build_scheduler(optimizer, total_steps=steps, warmup=warmup_steps, schedule="cosine", min_ratio=0.1)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x9E7]))
    order = rng.permutation(len(train_blocks))
    pos = 0
    losses = []
    model.train()
    for _ in range(steps):
        if pos + batch_size > len(order):
            order, pos = rng.permutation(len(train_blocks)), 0
        x = torch.as_tensor(train_blocks[order[pos : pos + batch_size]], device=device)
        pos += batch_size
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer_step(model, optimizer, scheduler, max_grad_norm=1.0)
        losses.append(float(loss.detach()))
    after = _mean_loss(model, eval_blocks, batch_size) if n_eval else float("nan")
    model.eval()
    return {"train_blocks": len(train_blocks), "eval_blocks": n_eval, "eval_loss_before": before,
            "eval_loss_after": after, "train_loss_first": losses[0] if losses else None,
            "train_loss_last": float(np.mean(losses[-10:])) if losses else None,
            "seconds": time.perf_counter() - t0}


def build_tiny_llama_pretrained(out_dir: Path, demo: DemoData, **overrides: Any) -> dict[str, Any]:
    """Pre-train the ``tiny-llama`` architecture on ``demo.pretrain`` and save it into ``out_dir``.

    Args:
        out_dir: an empty directory (``save_pretrained`` files, tokenizer, ``pretrain.json``).
        demo: the demo data set.
        **overrides: settings of :data:`PRETRAIN_DEFAULTS` (e.g. ``steps=2`` for a smoke run).

    Returns:
        The ``pretrain.json`` content.

    Raises:
        ValueError: an unknown setting.
    """
    from transformers import LlamaForCausalLM

    unknown = set(overrides) - set(PRETRAIN_DEFAULTS)
    if unknown:
        raise ValueError(f"pretrain: unknown settings {sorted(unknown)}; known: {sorted(PRETRAIN_DEFAULTS)}.")
    cfg = {**PRETRAIN_DEFAULTS, **overrides}
    tokenizer = demo.load_tokenizer()
    config = tiny_llama_config(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    text = demo.pretrain.read_text(encoding="utf-8")
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]  # one long stream, cut below
    blocks = token_blocks(ids, cfg["block_size"], tokenizer.bos_token_id)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(cfg["threads"])  # a fixed thread count: the same floating-point sums on every build
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the tiny-llama initialisation
            model = LlamaForCausalLM(config)
            log = pretrain_causal_lm(model, blocks, steps=cfg["steps"], batch_size=cfg["batch_size"], lr=cfg["lr"],
                                     warmup_steps=cfg["warmup_steps"], eval_fraction=cfg["eval_fraction"],
                                     seed=cfg["seed"])
    finally:
        torch.set_num_threads(saved_threads)
    save_model_dir(model, tokenizer, out_dir)
    info = {"settings": cfg, "tokens": len(ids), "source": str(demo.pretrain), **log}
    (Path(out_dir) / "pretrain.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return info


def build(out_dir: Path, demo: DemoData) -> None:
    """The :class:`clusterlm.models.BuiltinModel` builder of ``"tiny-llama-pretrained"`` (default settings)."""
    build_tiny_llama_pretrained(out_dir, demo)
