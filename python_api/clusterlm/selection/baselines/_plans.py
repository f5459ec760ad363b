"""What every baseline shares to turn its selection into a :class:`clusterlm.plan.Plan`.

- :func:`check_world_size` / :func:`check_seed`: the argument checks (named after the calling baseline).
- :func:`budget_count`: the number to select (ratio or count, rounded down to a multiple of the world size).
- :func:`resolve_amount` / :meth:`Amount.take`: every baseline's budget, examples or tokens (below).
- :func:`plan_from_selection`: one pseudo-cluster, weight 1 each; with ``token_balance`` the selection is
  dealt to ranks by :func:`clusterlm.selection.allocation.allocate` (``"stratified"``) and visited in the
  token-balanced order (:func:`clusterlm.selection.allocation.visit_order`), exactly like a CluSTER plan, so a
  comparison differs only in *which* examples are trained on; without it one random permutation is cut
  into K contiguous parts (a ``DistributedSampler``'s split).
- :func:`make_plan`: :func:`plan_from_selection` plus the stage timings of a model-based baseline.

Token budget (``token_ratio`` / ``token_budget``, prompt + answer tokens, :func:`clusterlm.data.lengths_of`).
Every baseline orders the data (random: a seeded permutation; longest / IFD / LESS: their ranking; S2L: a
round-robin over its clusters) and keeps a prefix of that order whose length is a multiple of the world size
``K``, so every rank trains the same number of examples as DDP's lock-step needs. The prefix is the cluster
method's rule (:func:`clusterlm.config.budget.count_for_tokens`) applied to the ``K`` interleaved streams
``order[r::K]``: ``m`` examples of every stream (``m K`` in all, the first ``m K`` of the order) whose tokens
come closest to the budget, so the selection meets it within one example per rank (the ``K`` examples at
positions ``[m K, (m + 1) K)`` or ``[(m - 1) K, m K)``), above or below, as the cluster method's does within one
example per cluster. With ``token_balance`` the stratified allocation deals the prefix in a snake order of
decreasing length, so rank token totals differ by at most the longest minus the shortest selected example;
without it ranks get a random split (equal counts, tokens as they fall). ``stats["token_budget"]`` records the
requested and selected tokens as the cluster method's plan does.

The random and full-data baselines (:mod:`clusterlm.selection.baselines.random`) and the model-based ones (S2L,
IFD, LESS) all build their plans here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from clusterlm.config.budget import count_for_tokens, resolve_any_budget, resolve_budget
from clusterlm.data import fingerprint, lengths_of
from clusterlm.plan import Plan
from clusterlm.selection.allocation import allocate, balance_stats, selection_weights, visit_order

__all__ = [
    "STREAM_RANDOM", "Amount", "budget_count", "check_seed", "check_world_size", "make_plan", "plan_from_selection",
    "prefix_for_tokens", "resolve_amount",
]

# Mixed into the seed so the baselines' draws are not the same stream as other seed-0 generators (the random
# baseline's sample uses [seed, STREAM_RANDOM], every baseline's rank split [seed, STREAM_RANDOM, 1]).
STREAM_RANDOM = 0x7A4D0


def check_world_size(world_size: Any, n: int, who: str) -> int:
    """``world_size`` as an int.

    Raises:
        ValueError: not a positive int, or more ranks than examples.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"{who}: world_size must be a positive int (number of ranks), got {world_size!r}.")
    if n < world_size:
        raise ValueError(
            f"{who}: the data set has {n} examples, fewer than world_size={world_size}; every rank needs at least one. "
            "Use fewer ranks or more data."
        )
    return int(world_size)


def check_seed(seed: Any, who: str) -> int:
    """``seed`` as an int.

    Raises:
        ValueError: not a non-negative int.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"{who}: seed must be a non-negative int, got {seed!r}.")
    return int(seed)


def budget_count(n: int, world_size: int, ratio: float | None, budget: int | None, who: str) -> tuple[int, dict]:
    """The number to select (rounded down to a multiple of ``world_size``) and the rounding statistics.

    Raises:
        ValueError: bad ratio/budget (same rules as :func:`clusterlm.config.budget.resolve_budget`), or fewer than
            one example per rank.
    """
    check_world_size(world_size, n, who)
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


@dataclass(frozen=True)
class Amount:
    """A baseline's resolved budget: ``count`` examples (an example budget) or ``tokens`` (a token budget).

    Attributes:
        count: examples to select, a multiple of the world size; None for a token budget.
        tokens: tokens requested (prompt + answer); None for an example budget.
        stats: what the plan's ``stats`` start with (``requested``, ``rounding``).
        record: what the plan's ``config`` records of the budget (``ratio``, ``budget``; with a token budget also
            ``token_ratio``, ``token_budget``).
    """

    count: int | None
    tokens: int | None
    stats: dict[str, Any] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)

    def take(self, order: np.ndarray, lengths: np.ndarray, world_size: int) -> tuple[np.ndarray, dict[str, Any]]:
        """The selection: the first ``count`` of ``order``, or the prefix a token budget buys.

        Args:
            order: (M,) int64 example indices, best (or drawn) first, no repeats; ``M >= count``.
            lengths: (N,) tokens per example.
            world_size: ranks K.

        Returns:
            ``(selected, stats)``: sorted int64 indices (a multiple of K long) and ``stats`` plus, for a token
            budget, ``stats["token_budget"]`` (:func:`prefix_for_tokens`).
        """
        order = np.asarray(order, dtype=np.int64)
        stats = dict(self.stats)
        if self.tokens is None:
            assert self.count is not None and len(order) >= self.count
            count = self.count
        else:
            count, stats["token_budget"] = prefix_for_tokens(order, lengths, world_size, self.tokens)
        return np.sort(order[:count]), stats


def resolve_amount(
    lengths: np.ndarray,
    world_size: int,
    ratio: float | None,
    budget: int | None,
    token_ratio: float | None,
    token_budget: int | None,
    who: str,
) -> Amount:
    """Check the budget arguments of baseline ``who`` (exactly one of the four) against the data.

    Args:
        lengths: (N,) tokens per example (prompt + answer).
        world_size: ranks K.
        ratio / budget: fraction or number of examples; token_ratio / token_budget: fraction or number of tokens.
        who: the baseline, named in errors (``"random_plan"``).

    Returns:
        The :class:`Amount`.

    Raises:
        ValueError: not exactly one budget, a fraction outside (0, 1], a count outside [1, N] (tokens: [1, total
            tokens]), fewer examples than ranks, an example budget below the world size.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    world_size = check_world_size(world_size, n, who)
    try:
        tokens = resolve_any_budget(n, lengths, ratio, budget, token_ratio, token_budget, "default")
    except ValueError as e:
        raise ValueError(str(e).replace("select:", f"{who}:", 1)) from None
    record: dict[str, Any] = {"ratio": None if ratio is None else float(ratio),
                              "budget": None if budget is None else int(budget)}
    if tokens is None:
        count, stats = budget_count(n, world_size, ratio, budget, who)
        return Amount(count=count, tokens=None, stats=stats, record=record)
    record.update(token_ratio=None if token_ratio is None else float(token_ratio),
                  token_budget=None if token_budget is None else int(token_budget))
    # Examples the token budget buys at the mean length (what ``requested`` means for the cluster method too).
    estimate = min(n, max(world_size, round(tokens / max(float(lengths.mean()), 1.0))))
    return Amount(count=None, tokens=tokens, stats={"requested": int(estimate)}, record=record)


def prefix_for_tokens(order: np.ndarray, lengths: np.ndarray, world_size: int, tokens: int
                      ) -> tuple[int, dict[str, Any]]:
    """How many of ``order`` a token budget buys: ``m K`` (``m`` per rank), the cluster method's rule.

    :func:`clusterlm.config.budget.count_for_tokens` over the K streams ``order[r::K]`` (the first ``m`` of every
    stream are the first ``m K`` of ``order``): the selected tokens come closest to ``tokens``, within one
    example per rank; at least one example per rank, at most ``len(order) // K`` per rank.

    Args:
        order: (M,) int64 example indices in selection order, ``M >= K``.
        lengths: (N,) tokens per example.
        world_size: ranks K.
        tokens: the token budget (>= 1).

    Returns:
        ``(count, record)``: ``count = m K`` and ``{"requested_tokens", "selected_tokens", "relative_error",
        "one_example_per_cluster_tokens", "note"}`` (the cluster method's ``stats["token_budget"]`` keys; the
        tolerance is the mean selected length times K, one example per rank).
    """
    order = np.asarray(order, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    assert len(order) >= world_size and tokens >= 1
    streams: Sequence[np.ndarray] = [order[r::world_size] for r in range(world_size)]
    per_rank = count_for_tokens(streams, lengths, int(tokens))
    count = per_rank * world_size
    got = int(lengths[order[:count]].sum())
    record = {
        "requested_tokens": int(tokens), "selected_tokens": got, "relative_error": got / tokens - 1.0,
        "one_example_per_cluster_tokens": float(lengths[order[:count]].mean() * world_size),
        "note": f"token budget {int(tokens)} -> {per_rank} examples for each of {world_size} ranks, the first "
                f"{count} in the method's order (closest to the budget)",
    }
    return count, record


def plan_from_selection(
    dataset: Any,
    selected: np.ndarray,
    world_size: int,
    *,
    seed: int,
    token_balance: bool,
    config: dict[str, Any],
    stats: dict[str, Any],
    t0: float,
    model_id: str,
) -> Plan:
    """Allocate ``selected`` (sorted, a multiple of ``world_size`` long) to ranks and build the Plan."""
    lengths = lengths_of(dataset)
    n = len(lengths)
    assert len(selected) % world_size == 0 and len(selected) > 0
    rng = np.random.default_rng(np.random.SeedSequence([seed, STREAM_RANDOM, 1]))
    if token_balance:
        rank_lists = allocate([selected], world_size, lengths, allocation="stratified")
    else:
        rank_lists = list(rng.permutation(selected).reshape(world_size, -1))
    rank_lists = visit_order(rank_lists, lengths, token_balance=token_balance, seed=seed)
    weights = selection_weights(np.zeros(n, dtype=np.int64), selected, 1)
    stats = {**stats, "selected": int(len(selected)), "token_balance": balance_stats(rank_lists, lengths)}
    config = {**config, "world_size": world_size, "seed": seed, "token_balance": bool(token_balance),
              "allocation": "stratified" if token_balance else "random-split"}
    return Plan(
        world_size=world_size,
        rank_indices=rank_lists,
        weights=weights,
        cluster_labels=np.full(n, -1, dtype=np.int64),
        distances=np.full(n, np.nan, dtype=np.float64),
        cluster_sizes=np.zeros(0, dtype=np.int64),
        lengths=lengths,
        fingerprint=fingerprint(dataset),
        model_id=model_id,
        config=config,
        timings={"total": time.perf_counter() - t0},
        stats=stats,
    )


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
    """The :class:`Plan` of a model-based baseline's selection: :func:`plan_from_selection` (weight 1 each,
    stratified over ranks, token-balanced order) with ``timings`` (the stages) and ``"total"`` = wall time
    since ``t0`` (everything: proxy training / warm-up / forwards / clustering)."""
    selected = np.sort(np.asarray(selected, dtype=np.int64))
    assert len(np.unique(selected)) == len(selected) and len(selected) % world_size == 0
    plan = plan_from_selection(dataset, selected, world_size, seed=seed, token_balance=token_balance,
                               config=config, stats=stats, t0=t0, model_id=model_id)
    plan.timings = {**{k: float(v) for k, v in timings.items()}, "total": time.perf_counter() - t0}
    return plan
