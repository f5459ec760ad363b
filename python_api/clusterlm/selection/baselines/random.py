"""Random and full-data baselines: the plans a CluSTER plan is compared against.

- :func:`full_plan`: every example (the full-data run). DDP steps in lock-step, so every rank needs the
  same count; when N is not a multiple of the world size, ``N mod K`` examples (at most K - 1) are left
  out, chosen uniformly at random by ``seed``, and the plan says which in ``stats["left_out"]``.
- :func:`random_plan`: a uniform sample of the budget (docs/design.md section 6, "random"). The budget is rounded
  down to a multiple of the world size; ``stats["rounding"]`` states it when that changes the count. A token
  budget (``token_ratio`` / ``token_budget``) takes a prefix of one seeded random permutation, the cluster
  method's rule (:mod:`clusterlm.selection.baselines._plans`): within one example per rank of the budget.

Both give every selected example weight 1 (:func:`clusterlm.selection.allocation.selection_weights` with a single
pseudo-cluster), so ``mean_b(w_b * loss_b)`` is the plain mean loss and DDP's gradient average is the
mean gradient of the sample. There is no clustering: ``cluster_labels`` are -1, ``cluster_sizes`` is
empty and ``distances`` are nan.

Allocation to ranks. With ``token_balance=True`` (default) the sample is dealt to ranks in a snake
order of decreasing length (:func:`clusterlm.selection.allocation.allocate` with ``"stratified"``) and visited in
length-quantile-aligned order (:func:`clusterlm.selection.allocation.visit_order`), exactly like a CluSTER plan,
so a comparison differs only in *which* examples are trained on, not in per-step token balance. With
``token_balance=False`` the sample is split like a ``DistributedSampler`` would: one random
permutation cut into K contiguous parts, each visited in its own random order. The allocation and the
argument checks are every baseline's (:mod:`clusterlm.selection.baselines._plans`).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from clusterlm.data import lengths_of
from clusterlm.plan import Plan
from clusterlm.selection.baselines._plans import (
    STREAM_RANDOM,
    check_seed,
    check_world_size,
    plan_from_selection,
    resolve_amount,
)

__all__ = ["full_plan", "random_plan"]

# Mixed into the seed: the full baseline's left-out draw is a stream of its own.
_STREAM_FULL = 0xF011


def full_plan(dataset: Any, world_size: int, *, seed: int = 0, token_balance: bool = True, model_id: str = "") -> Plan:
    """A plan that trains on every example (the full-data baseline).

    Args:
        dataset: a :class:`clusterlm.data.SFTDataset` or a sequence of example dicts (``input_ids``,
            ``labels``); its lengths and fingerprint go into the plan.
        world_size: number of ranks K.
        seed: chooses the ``N mod K`` examples left out (so every rank gets ``N // K``) and the visit order.
        token_balance: deal by length and align length quantiles across ranks (see the module docstring).
        model_id: recorded in the plan (no model is used).

    Returns:
        A :class:`Plan` with ``N - N mod K`` examples of weight 1; ``stats["left_out"]`` lists the left-out
        indices (empty when K divides N).

    Raises:
        ValueError: world_size not a positive int or larger than N; a negative seed.
    """
    t0 = time.perf_counter()
    n = len(dataset)
    world_size = check_world_size(world_size, n, "full_plan")
    seed = check_seed(seed, "full_plan")
    n_left = n % world_size
    rng = np.random.default_rng(np.random.SeedSequence([seed, _STREAM_FULL]))
    left_out = np.sort(rng.choice(n, size=n_left, replace=False)).astype(np.int64) if n_left else np.zeros(0, np.int64)
    keep = np.ones(n, dtype=bool)
    keep[left_out] = False
    stats: dict[str, Any] = {
        "requested": n,
        "left_out": {
            "count": int(n_left),
            "indices": left_out.tolist(),
            "reason": f"N={n} is not a multiple of world_size={world_size}: every rank trains on {n // world_size} "
            f"examples, {n_left} left out at random (seed {seed})" if n_left else "none: world_size divides N",
        },
    }
    if n_left:
        stats["rounding"] = stats["left_out"]["reason"]
    return plan_from_selection(
        dataset, np.flatnonzero(keep).astype(np.int64), world_size, seed=seed, token_balance=token_balance,
        config={"method": "full", "ratio": 1.0, "budget": None}, stats=stats, t0=t0, model_id=model_id,
    )


def random_plan(
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
    """A uniform random sample of the budget (the random baseline), allocated to ranks.

    Args:
        dataset: a :class:`clusterlm.data.SFTDataset` or a sequence of example dicts.
        world_size: number of ranks K.
        ratio / budget: fraction in (0, 1] or number of examples to keep. The count is rounded down to a
            multiple of K (stated in ``stats["rounding"]``).
        token_ratio / token_budget: fraction in (0, 1] or number of tokens (prompt + answer) to keep instead:
            the prefix of one seeded random permutation closest to the budget, ``m`` examples per rank (within
            one example per rank; ``stats["token_budget"]``). Exactly one of the four budgets.
        seed: seed of the sample and of the visit order.
        token_balance: deal by length and align length quantiles across ranks (see the module docstring).
        model_id: recorded in the plan (no model is used).

    Returns:
        A :class:`Plan` whose selected examples all have weight 1.

    Raises:
        ValueError: not exactly one of ratio/budget/token_ratio/token_budget, a fraction outside (0, 1], a
            budget outside [1, N] or below the world size, a token budget outside [1, total tokens], world_size
            not a positive int or larger than N, a negative seed.
    """
    t0 = time.perf_counter()
    n = len(dataset)
    world_size = check_world_size(world_size, n, "random_plan")
    seed = check_seed(seed, "random_plan")
    lengths = lengths_of(dataset)
    amount = resolve_amount(lengths, world_size, ratio, budget, token_ratio, token_budget, "random_plan")
    rng = np.random.default_rng(np.random.SeedSequence([seed, STREAM_RANDOM]))
    if amount.count is not None:  # the example budget's draw, unchanged
        selected, stats = np.sort(rng.choice(n, size=amount.count, replace=False)).astype(np.int64), amount.stats
    else:
        selected, stats = amount.take(rng.permutation(n), lengths, world_size)
    return plan_from_selection(
        dataset, selected, world_size, seed=seed, token_balance=token_balance,
        config={"method": "random", **amount.record}, stats=stats, t0=t0, model_id=model_id,
    )
