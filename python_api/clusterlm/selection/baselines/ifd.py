"""IFD baseline: keep the examples whose instruction helps the model least (highest IFD, IFD <= 1).

Source: Li, Zhang, Li, Chen, Chen, Wang, Wang, Zhou, Xiao, "From Quantity to Quality: Boosting LLM
Performance with Self-Guided Data Selection for Instruction Tuning" (Cherry LLM), NAACL 2024
(arXiv:2308.12032), §2.3-2.4. Re-implementation, step by step:

1. *Conditioned answer score* ``s(A|Q)``: the mean cross entropy of the answer tokens given the
   instruction, ``-1/|A| sum_t log p(a_t | Q, a_<t)`` — one forward of the example as it is (§2.3,
   eq. 1-2).
2. *Direct answer score* ``s(A)``: the same mean over the answer tokens with the instruction removed
   (§2.3, eq. 3): the sequence is the first token of the example (``<s>``, never predicted) followed
   by the answer tokens only (positions whose label is not -100), labels on those tokens.
3. ``IFD(Q, A) = s(A|Q) / s(A)`` (§2.4, eq. 4).
4. Examples with ``IFD > 1`` are dropped: the instruction does not help predict the answer, so the
   pair is deemed misaligned (§2.4, and the authors' Superfiltering follow-up).
5. Keep the ``budget`` examples with the highest IFD (§2.4: "select the samples with the top IFD
   scores"). When fewer than ``budget`` have ``IFD <= 1`` the shortfall is filled with the dropped ones of
   lowest IFD (closest to 1), stated in ``plan.stats``, so every baseline trains on the same number of
   examples. A token budget (``token_ratio`` / ``token_budget``) takes the same order (IFD <= 1 highest first,
   then the dropped closest to 1) until the budget is met, the cluster method's rule
   (:mod:`clusterlm.selection.baselines._plans`): within one example per rank of the budget.

The paper scores with a briefly pre-experienced model; we score with the model being fine-tuned (the
setting of the CluSTER paper's comparison). Both passes are batched by length
(:func:`clusterlm.selection.baselines._training.example_losses`). Selection time = both forward passes + ranking.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from cluster_kernels.lm_head_features import IGNORE_INDEX
from clusterlm.data import lengths_of
from clusterlm.plan import Plan
from clusterlm.selection.baselines._plans import make_plan, resolve_amount
from clusterlm.selection.baselines._training import example_losses, stage

__all__ = ["answer_only", "ifd_order", "ifd_plan", "ifd_select", "ifd_stats"]


def answer_only(example: dict[str, Any]) -> dict[str, np.ndarray]:
    """The example without its prompt: first token (never predicted) + the answer tokens, labels on them.

    An example whose first label is already an answer token (no prompt) is returned unchanged.
    """
    ids = np.asarray(example["input_ids"], dtype=np.int64)
    labels = np.asarray(example["labels"], dtype=np.int64)
    if labels[0] != IGNORE_INDEX:
        return {"input_ids": ids, "labels": labels}
    keep = np.flatnonzero(labels != IGNORE_INDEX)
    new_ids = np.concatenate([ids[:1], ids[keep]])
    new_labels = np.concatenate([[IGNORE_INDEX], labels[keep]]).astype(np.int64)
    return {"input_ids": new_ids, "labels": new_labels}


def ifd_order(loss_given_prompt: np.ndarray, loss_answer_only: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Steps 3-5 as a ranking: IFD <= 1 highest first, then the dropped (IFD > 1) closest to 1 first.

    Args:
        loss_given_prompt: (N,) ``s(A|Q)``.
        loss_answer_only: (N,) ``s(A)`` (> 0).

    Returns:
        ``(order int64, ifd (N,) float64)``; ties by index.
    """
    cond = np.asarray(loss_given_prompt, dtype=np.float64)
    direct = np.asarray(loss_answer_only, dtype=np.float64)
    ifd = cond / np.maximum(direct, 1e-12)
    idx = np.arange(len(ifd))
    ok = idx[ifd <= 1.0]
    ok = ok[np.lexsort((ok, -ifd[ok]))]  # highest IFD first, ties by index
    over = idx[ifd > 1.0]
    over = over[np.lexsort((over, ifd[over]))]  # closest to 1 first
    return np.concatenate([ok, over]).astype(np.int64), ifd


def ifd_stats(ifd: np.ndarray, selected: np.ndarray) -> dict[str, Any]:
    """What the plan records of an IFD selection (``stats``): dropped, filled from the dropped, IFD levels."""
    return {"dropped_ifd_gt_1": int((ifd > 1.0).sum()), "filled_from_dropped": int((ifd[selected] > 1.0).sum()),
            "ifd_selected_min": float(ifd[selected].min()), "ifd_median": float(np.median(ifd))}


def ifd_select(loss_given_prompt: np.ndarray, loss_answer_only: np.ndarray, count: int
               ) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Steps 3-5: IFD ratio, drop IFD > 1, the ``count`` highest (shortfall: lowest of the dropped).

    Args:
        loss_given_prompt: (N,) ``s(A|Q)``.
        loss_answer_only: (N,) ``s(A)`` (> 0).
        count: examples to keep (``<= N``).

    Returns:
        ``(selected sorted int64, ifd (N,) float64, stats)``.
    """
    order, ifd = ifd_order(loss_given_prompt, loss_answer_only)
    chosen = order[:count]
    return np.sort(chosen), ifd, ifd_stats(ifd, chosen)


def ifd_plan(
    model: torch.nn.Module,
    dataset: Any,
    world_size: int,
    ratio: float | None = None,
    budget: int | None = None,
    *,
    token_ratio: float | None = None,
    token_budget: int | None = None,
    seed: int = 0,
    batch_tokens: int = 8192,
    autocast_dtype: torch.dtype | None = None,
    token_balance: bool = True,
    model_id: str = "",
) -> Plan:
    """The IFD selection (module docstring), as a plan.

    Args:
        model: the causal LM that scores (not changed).
        dataset: tokenised examples.
        world_size: ranks K.
        ratio / budget: fraction or number of examples; rounded down to a multiple of K.
        token_ratio / token_budget: fraction or number of tokens (prompt + answer) instead: the ranking until the
            budget is met, within one example per rank (``stats["token_budget"]``). Exactly one of the four.
        seed: visit order only (the selection itself is deterministic).
        batch_tokens: padded tokens per forward.
        autocast_dtype: e.g. ``torch.bfloat16`` on GPU.
        token_balance: the random baseline's allocation option.
        model_id: recorded in the plan.

    Returns:
        The :class:`Plan`; ``config["method"] == "ifd"``; ``timings`` ``loss_given_prompt``,
        ``loss_answer_only``, ``rank``, ``selection``.

    Raises:
        ValueError: not exactly one budget, a bad budget or world size.
    """
    t0 = time.perf_counter()
    n = len(dataset)
    lengths = lengths_of(dataset)
    amount = resolve_amount(lengths, world_size, ratio, budget, token_ratio, token_budget, "ifd_plan")
    timings: dict[str, float] = {}
    with stage(timings, "loss_given_prompt"):
        cond = example_losses(model, dataset, batch_tokens=batch_tokens, autocast_dtype=autocast_dtype)
    with stage(timings, "loss_answer_only"):
        direct = example_losses(model, [answer_only(dataset[i]) for i in range(n)], batch_tokens=batch_tokens,
                                autocast_dtype=autocast_dtype)
    with stage(timings, "rank"):
        order, ifd = ifd_order(cond, direct)
        selected, stats = amount.take(order, lengths, world_size)
    stats.update(ifd_stats(ifd, selected))
    config = {"method": "ifd", **amount.record,
              "source": "Li et al., From Quantity to Quality (Cherry LLM, IFD), NAACL 2024, sec. 2.3-2.4"}
    return make_plan(dataset, selected, world_size, seed=seed, config=config, stats=stats, timings=timings, t0=t0,
                     model_id=model_id, token_balance=token_balance)
