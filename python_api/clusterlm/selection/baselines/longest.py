"""The length baseline: the examples with the most answer tokens, at the same example budget.

Selecting by length is a strong and nearly free baseline for instruction-tuning data selection: the longest
answers carry the most supervision. :func:`longest_plan` keeps the ``count`` examples with the most answer
(trained) tokens, ``count`` being the same example budget as every other method (a ratio or a count, rounded down
to a multiple of the world size, :func:`clusterlm.selection.baselines._plans.budget_count`). It therefore trains more
tokens than a random sample of as many examples; ``clusterlm compare``'s frontier shows what that costs.

A token budget (``token_ratio`` / ``token_budget``, prompt + answer tokens) takes the examples in the same order
(most answer tokens first) until the budget is met, the cluster method's rule
(:mod:`clusterlm.selection.baselines._plans`): within one example per rank of the budget.

Ties in answer length are broken by a seeded random draw, so seeds differ only there (and in the visit order).
Every selected example has weight 1 and the selection is allocated like the random baseline's
(:func:`clusterlm.selection.baselines._plans.plan_from_selection`), so a comparison differs only in which examples
train.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from clusterlm.data import IGNORE_INDEX, lengths_of
from clusterlm.plan import Plan
from clusterlm.selection.baselines._plans import (
    STREAM_RANDOM,
    check_seed,
    check_world_size,
    plan_from_selection,
    resolve_amount,
)

__all__ = ["answer_tokens", "longest_plan"]

# Mixed into the seed: the tie-breaking draw is a stream of its own.
_STREAM_LONGEST = 0x1049


def answer_tokens(dataset: Any) -> np.ndarray:
    """``(N,)`` int64 answer (trained) tokens per example: labels other than -100.

    Raises:
        ValueError: an example without ``labels``.
    """
    if hasattr(dataset, "n_answer_tokens"):
        return np.asarray(dataset.n_answer_tokens, dtype=np.int64)
    out = np.zeros(len(dataset), dtype=np.int64)
    for i in range(len(dataset)):
        labels = dataset[i].get("labels") if hasattr(dataset[i], "get") else None
        if labels is None:
            raise ValueError(f"longest_plan: example {i} has no 'labels' (-100 on prompt tokens); tokenise the data "
                             "with clusterlm.data.load_data.")
        out[i] = int((np.asarray(labels) != IGNORE_INDEX).sum())
    return out


def longest_plan(
    dataset: Any,
    world_size: int,
    ratio: float | None = None,
    budget: int | None = None,
    *,
    token_ratio: float | None = None,
    token_budget: int | None = None,
    seed: int = 0,
    token_balance: bool = True,
    model_id: str = "",
) -> Plan:
    """The ``count`` examples with the most answer tokens (the length baseline), allocated to ranks.

    Args:
        dataset: a :class:`clusterlm.data.SFTDataset` or a sequence of example dicts (``input_ids``, ``labels``).
        world_size: number of ranks K.
        ratio / budget: fraction in (0, 1] or number of examples to keep; rounded down to a multiple of K
            (stated in ``stats["rounding"]``).
        token_ratio / token_budget: fraction in (0, 1] or number of tokens (prompt + answer) to keep instead: the
            longest answers first until the budget is met, within one example per rank (``stats["token_budget"]``).
            Exactly one of the four budgets.
        seed: breaks ties in answer length and seeds the visit order.
        token_balance: deal by length and align length quantiles across ranks (as the random baseline).
        model_id: recorded in the plan (no model is used).

    Returns:
        A :class:`Plan` whose selected examples all have weight 1; ``stats["answer_tokens"]`` gives the selected
        and the data set's mean answer length.

    Raises:
        ValueError: not exactly one of ratio/budget/token_ratio/token_budget, a fraction outside (0, 1], a budget
            outside [1, N] or below the world size, a token budget outside [1, total tokens], world_size not a
            positive int or larger than N, a negative seed.
    """
    t0 = time.perf_counter()
    n = len(dataset)
    world_size = check_world_size(world_size, n, "longest_plan")
    seed = check_seed(seed, "longest_plan")
    lengths = lengths_of(dataset)
    amount = resolve_amount(lengths, world_size, ratio, budget, token_ratio, token_budget, "longest_plan")
    answers = answer_tokens(dataset)
    tie_break = np.random.default_rng(np.random.SeedSequence([seed, STREAM_RANDOM, _STREAM_LONGEST])).random(n)
    order = np.lexsort((tie_break, -answers))  # most answer tokens first, ties in a seeded random order
    selected, stats = amount.take(order, lengths, world_size)
    stats["answer_tokens"] = {"selected_mean": float(answers[selected].mean()), "data_mean": float(answers.mean()),
                              "shortest_selected": int(answers[selected].min())}
    return plan_from_selection(
        dataset, selected, world_size, seed=seed, token_balance=token_balance,
        config={"method": "longest", **amount.record},
        stats=stats, t0=t0, model_id=model_id,
    )
