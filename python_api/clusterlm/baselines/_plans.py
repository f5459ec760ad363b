"""What every baseline shares to turn its selection into a :class:`clusterlm.plan.Plan`.

- :func:`check_world_size` / :func:`check_seed`: the argument checks (named after the calling baseline).
- :func:`budget_count`: the number to select (ratio or count, rounded down to a multiple of the world size).
- :func:`plan_from_selection`: one pseudo-cluster, weight 1 each; with ``token_balance`` the selection is
  dealt to ranks by :func:`clusterlm.allocation.allocate` (``"stratified"``) and visited in the
  token-balanced order (:func:`clusterlm.allocation.visit_order`), exactly like a CluSTER plan, so a
  comparison differs only in *which* examples are trained on; without it one random permutation is cut
  into K contiguous parts (a ``DistributedSampler``'s split).
- :func:`make_plan`: :func:`plan_from_selection` plus the stage timings of a model-based baseline.

The random and full-data baselines (:mod:`clusterlm.baselines.random`) and the model-based ones (S2L,
IFD, LESS) all build their plans here.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from clusterlm.allocation import allocate, balance_stats, selection_weights, visit_order
from clusterlm.budget import resolve_budget
from clusterlm.data import fingerprint, lengths_of
from clusterlm.plan import Plan

__all__ = ["STREAM_RANDOM", "budget_count", "check_seed", "check_world_size", "make_plan", "plan_from_selection"]

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
        ValueError: bad ratio/budget (same rules as :func:`clusterlm.budget.resolve_budget`), or fewer than
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
