"""CluSTER selection: gradient features -> capacity-constrained K-means -> balanced picks -> a Plan.

The method (DESIGN.md §1), one call::

    plan = clusterlm.select(model, dataset, world_size=4, ratio=0.31)
    plan.save("plan/")

Two presets.

``preset="paper"`` reproduces the authors' algorithm step by step:

1. feature = ``mean_t (p_t(y_t) - 1) h_t`` over answer tokens, from one forward pass (their gradient
   proxy; dimension = hidden size), L2-normalised when ``world_size > 1``;
2. K-means with ``K = world_size`` and 10 k-means++ restarts, with every cluster capped at
   ``ceil(1.5 N / K)``. Their code fits sklearn K-means and, when the largest cluster exceeds the cap,
   re-assigns points greedily under it without refitting; we solve the capped problem exactly
   (:func:`cluster_kernels.capacity_kmeans`), which reaches the same or a lower objective. This is the
   only difference;
3. ``m`` = smallest cluster size; from every cluster keep the ``int(m * ratio)`` points farthest from
   its centroid;
4. cluster ``k`` is trained by rank ``k`` with loss weight ``K * n_k / N``.

The selected total is therefore ``K * int(m * ratio)``, usually below ``ratio * N`` (the authors'
behaviour; :attr:`Plan.stats` states the shortfall).

``preset="default"`` is our method: projected full last-layer gradients (``features="lm_head"``)
over a feature window of the first ``feature_tokens=64`` answer tokens with a little prompt context
(:class:`clusterlm.GradientFeaturizer` ``max_tokens``: ~3.3x faster featurization on the demo data,
which is the whole selection cost; ``feature_tokens="all"`` featurizes whole examples), exact
capacities with every cluster at least the per-rank budget (``min_cluster_size="budget"``) and
at most ``1.5 N / C``, so the requested ``ratio``/``budget`` is met exactly up to a multiple of
``world_size * clusters_per_rank`` (the rounding is stated in :attr:`Plan.stats`), and token balance
(:mod:`clusterlm.allocation`): equal rank token totals by exchanging at most ``token_balance_slack``
(10 %) of each cluster's least-far picks for its next-farthest members, and visit orders that align
length quantiles across ranks.

Token budget (default preset): ``token_ratio=`` / ``token_budget=`` instead of ``ratio=`` / ``budget=``.
Training cost follows tokens, and far-from-centroid picks are longer than average (8 % more tokens than a
random sample of as many examples on the demo data), so the count per cluster ``m`` (the same for every
cluster, hence every rank) is chosen after clustering as the one whose farthest-first picks total closest
to the budget, within one example per cluster (:func:`count_for_tokens`); the K-means lower bound uses the
count the budget buys at the mean length. Token balancing and the weights work as for an example budget:
the weights are still ``(n_c / N)(S / s_c)`` with counts, because the loss is a mean over examples (each
example's loss is its own answer-token mean), so the estimate of the full-data gradient is unchanged.
``Plan.stats["token_budget"]`` records the requested and selected tokens.

Weights: example ``i`` of cluster ``c`` gets ``(n_c / N) * (S / s_c)`` (``S`` selected in all, ``s_c``
from cluster ``c``), which is ``K n_k / N`` for one cluster per rank; with ``mean_b(w_b * loss_b)`` on
every rank, DDP's gradient average estimates the full-data gradient ``sum_c (n_c / N) g_c``.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from clusterlm.allocation import ALLOCATIONS, allocate, cluster_owners, rebalance_tokens, visit_order
from clusterlm.plan import Plan, selection_weights

__all__ = [
    "PRESETS",
    "WITHIN_CLUSTER",
    "build_featurizer",
    "main",
    "pick_in_cluster",
    "resolve_budget",
    "count_for_tokens",
    "resolve_feature_tokens",
    "resolve_token_budget",
    "select",
    "select_from_features",
]

PRESETS = ("default", "paper")
WITHIN_CLUSTER = ("farthest", "nearest", "random", "kcenter")
DEFAULT_DIM = (32, 32)
# The default preset's feature window (tokens per example; benchmarks/bench_compare.py measures it).
DEFAULT_FEATURE_TOKENS = 64
# Token balancing may exchange up to this fraction of each cluster's pick (its last, least-far members)
# for the next candidates in pick order, so that every rank trains on about the same number of tokens.
TOKEN_BALANCE_SLACK = 0.1
PAPER_CAP = 1.5
PAPER_N_INIT = 10
# Statistics of per-step token balance are reported for these micro-batch sizes.
BALANCE_BATCH_SIZES = (1, 4, 16)


# ---------------------------------------------------------------------------------------------------
# Argument checking
# ---------------------------------------------------------------------------------------------------


def _check_int(value: Any, name: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"select: {name} must be an int >= {low}, got {value!r}.")
    return int(value)


def resolve_budget(n: int, ratio: float | None, budget: int | None) -> int:
    """Total number of examples requested: ``round(ratio * n)`` or ``budget``.

    Raises:
        ValueError: both or neither given, ratio outside (0, 1], budget outside [1, n].
    """
    if (ratio is None) == (budget is None):
        raise ValueError(
            f"select: give exactly one of ratio (fraction of the data) or budget (number of examples), got "
            f"ratio={ratio!r}, budget={budget!r}."
        )
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"select: ratio must be in (0, 1], got {ratio!r}; e.g. ratio=0.31 keeps 31 %.")
        return max(1, round(float(ratio) * n))
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or not 1 <= budget <= n:
        raise ValueError(f"select: budget must be an int in [1, {n}] (the data set's size), got {budget!r}.")
    return int(budget)


def resolve_token_budget(lengths: np.ndarray, token_ratio: float | None, token_budget: int | None) -> int | None:
    """Tokens requested: ``round(token_ratio * sum(lengths))``, ``token_budget``, or None (an example budget).

    Raises:
        ValueError: both given, token_ratio outside (0, 1], token_budget outside [1, total tokens].
    """
    if token_ratio is None and token_budget is None:
        return None
    total = int(np.asarray(lengths, dtype=np.int64).sum())
    if token_ratio is not None and token_budget is not None:
        raise ValueError(
            f"select: give at most one of token_ratio and token_budget, got token_ratio={token_ratio!r}, "
            f"token_budget={token_budget!r}."
        )
    if token_ratio is not None:
        if isinstance(token_ratio, bool) or not isinstance(token_ratio, (int, float)) or not 0 < token_ratio <= 1:
            raise ValueError(
                f"select: token_ratio must be in (0, 1], got {token_ratio!r}; e.g. token_ratio=0.31 keeps 31 % of "
                "the tokens."
            )
        return max(1, round(float(token_ratio) * total))
    if isinstance(token_budget, bool) or not isinstance(token_budget, (int, np.integer)) or not (
        1 <= token_budget <= total
    ):
        raise ValueError(
            f"select: token_budget must be an int in [1, {total}] (the data set's tokens), got {token_budget!r}."
        )
    return int(token_budget)


def _resolve_any_budget(n: int, lengths: np.ndarray, ratio: Any, budget: Any, token_ratio: Any, token_budget: Any,
                        preset: str) -> int | None:
    """Check that exactly one budget is given; the token budget (None for an example budget)."""
    given = {k: v for k, v in (("ratio", ratio), ("budget", budget), ("token_ratio", token_ratio),
                               ("token_budget", token_budget)) if v is not None}
    if len(given) != 1:
        raise ValueError(
            "select: give exactly one of ratio / budget (examples) or token_ratio / token_budget (tokens), got "
            + (", ".join(f"{k}={v!r}" for k, v in given.items()) or "none")
            + "."
        )
    tokens = resolve_token_budget(lengths, token_ratio, token_budget)
    if tokens is None:
        resolve_budget(n, ratio, budget)
    elif preset == "paper":
        raise ValueError(
            "select: preset='paper' reproduces the authors' example count (int(smallest cluster * ratio)); a token "
            "budget is ours: use preset='default' with token_ratio/token_budget, or ratio with preset='paper'."
        )
    return tokens


def count_for_tokens(picks: Sequence[np.ndarray], lengths: np.ndarray, tokens: int) -> int:
    """The per-cluster count ``m`` whose first-``m`` picks of every cluster come closest to ``tokens`` in all.

    Every cluster gives the same ``m`` (equal counts per rank), so the total is met up to one example per
    cluster: ``m`` is the largest count whose total stays within the budget, or one more when that lands
    closer. Bounded by the smallest ``len(picks[c])`` and at least 1.
    """
    cap = min(len(p) for p in picks)
    assert cap >= 1, "an empty cluster; the caller enforces min sizes"
    # cum[m] = tokens of the first m picks of every cluster together.
    cum = np.zeros(cap + 1, dtype=np.int64)
    for p in picks:
        cum[1:] += np.cumsum(np.asarray(lengths, dtype=np.int64)[p[:cap]])
    m = int(np.searchsorted(cum, tokens, side="right")) - 1  # largest m with cum[m] <= tokens
    if m < cap and abs(int(cum[m + 1]) - tokens) < abs(tokens - int(cum[m])):
        m += 1
    return max(1, m)


def _cluster_size_bound(value: Any, name: str, n: int, n_clusters: int, per_cluster: int) -> int | None:
    """``"1.5x"`` (times N / C), ``"budget"`` (the per-cluster pick), an int, or None."""
    if value is None:
        return None
    if isinstance(value, str):
        if value == "budget":
            return per_cluster
        if value.endswith("x"):
            try:
                factor = float(value[:-1])
            except ValueError:
                factor = -1.0
            if factor > 0:
                return math.ceil(factor * n / n_clusters)
        raise ValueError(
            f"select: {name} must be None, an int, 'budget' or a multiple of N / C such as '1.5x', got {value!r}."
        )
    return _check_int(value, name, 0)


def _lengths_of(dataset: Any) -> np.ndarray:
    lengths = getattr(dataset, "lengths", None)
    if lengths is not None:
        return np.asarray(lengths, dtype=np.int64)
    return np.array([len(dataset[i]["input_ids"]) for i in range(len(dataset))], dtype=np.int64)


def _fingerprint_of(dataset: Any) -> dict[str, Any]:
    if hasattr(dataset, "fingerprint"):
        return dict(dataset.fingerprint())
    from clusterlm.data import fingerprint

    return fingerprint(dataset)


# ---------------------------------------------------------------------------------------------------
# Within-cluster selection
# ---------------------------------------------------------------------------------------------------


def _kcenter(x: np.ndarray, dist: np.ndarray, m: int) -> np.ndarray:
    """Greedy k-center (farthest-point traversal) started at the point farthest from the centroid."""
    x = np.asarray(x, dtype=np.float64)
    start = int(np.lexsort((np.arange(len(dist)), -dist))[0])
    chosen = [start]
    gap = ((x - x[start]) ** 2).sum(1)
    for _ in range(m - 1):
        gap[chosen[-1]] = -1.0
        nxt = int(np.argmax(gap))  # first index among ties: deterministic
        chosen.append(nxt)
        gap = np.minimum(gap, ((x - x[nxt]) ** 2).sum(1))
    return np.asarray(chosen, dtype=np.int64)


def pick_in_cluster(
    members: np.ndarray,
    distances: np.ndarray,
    m: int,
    *,
    method: str = "farthest",
    features: np.ndarray | None = None,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """Choose ``m`` of one cluster's members.

    Args:
        members: (n_c,) int64 data-set indices of the cluster's members.
        distances: (N,) distance of every example to its own centroid.
        m: how many to keep (``<= n_c``).
        method: ``"farthest"`` / ``"nearest"`` from the centroid (ties by index), ``"random"`` (uniform,
            needs ``rng``), ``"kcenter"`` (greedy farthest-point traversal in feature space, needs
            ``features``; O(m n_c d)).
        features: (N, d) features, for ``"kcenter"``.
        rng: numpy Generator, for ``"random"``.

    Returns:
        (m,) int64 data-set indices, in pick order.
    """
    if method not in WITHIN_CLUSTER:
        raise ValueError(f"select: within_cluster must be one of {WITHIN_CLUSTER}, got {method!r}.")
    assert m <= len(members), "a cluster smaller than its pick; the caller enforces min sizes"
    members = np.asarray(members, dtype=np.int64)
    d = np.asarray(distances, dtype=np.float64)[members]
    if method == "farthest":
        return members[np.lexsort((members, -d))[:m]]
    if method == "nearest":
        return members[np.lexsort((members, d))[:m]]
    if method == "random":
        assert rng is not None
        return rng.choice(members, size=m, replace=False)  # draw order: any prefix is a uniform sample
    assert features is not None
    return members[_kcenter(np.asarray(features)[members], d, m)]


# ---------------------------------------------------------------------------------------------------
# Token-balance statistics
# ---------------------------------------------------------------------------------------------------


def _balance_stats(rank_lists: Sequence[np.ndarray], lengths: np.ndarray) -> dict[str, Any]:
    tokens = np.stack([lengths[r] for r in rank_lists]).astype(np.float64)  # (K, m)
    totals = tokens.sum(1)
    out: dict[str, Any] = {"rank_tokens": totals.astype(np.int64).tolist(),
                           "rank_tokens_max_over_mean": float(totals.max() / max(totals.mean(), 1.0))}
    m = tokens.shape[1]
    for b in BALANCE_BATCH_SIZES:
        steps = m // b
        if steps == 0:
            continue
        per_step = tokens[:, : steps * b].reshape(len(rank_lists), steps, b).sum(2)
        ratio = per_step.max(0) / np.maximum(per_step.mean(0), 1.0)
        out[f"step_max_over_mean@{b}"] = {
            "mean": float(ratio.mean()), "p95": float(np.quantile(ratio, 0.95)), "max": float(ratio.max())
        }
    return out


# ---------------------------------------------------------------------------------------------------
# Selection from fixed features
# ---------------------------------------------------------------------------------------------------


def _l2_normalise(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    return (x / np.where(norms > 0, norms, 1.0)).astype(np.float32)


def select_from_features(
    features: Any,
    *,
    world_size: int,
    lengths: Any = None,
    ratio: float | None = None,
    budget: int | None = None,
    token_ratio: float | None = None,
    token_budget: int | None = None,
    preset: str = "default",
    seed: int = 0,
    max_cluster_size: int | str | None = "1.5x",
    min_cluster_size: int | str | None = "budget",
    within_cluster: str = "farthest",
    allocation: str = "cluster-per-rank",
    token_balance: bool | None = None,
    clusters_per_rank: int = 1,
    token_balance_slack: float = TOKEN_BALANCE_SLACK,
    n_init: int | None = None,
    max_iter: int = 100,
    kmeans_backend: str = "auto",
    fingerprint: Mapping[str, Any] | None = None,
    model_id: str = "",
    timings: Mapping[str, float] | None = None,
    extra_config: Mapping[str, Any] | None = None,
    clustering: Callable[..., Any] | None = None,
) -> Plan:
    """Cluster fixed per-example features and build the :class:`Plan` (steps 2-4 of the method).

    Args:
        features: (N, d) float32/float64 array (numpy, memmap or CPU tensor).
        world_size: number of ranks K.
        lengths: (N,) tokens per example (for token balancing and statistics); default all ones.
        ratio / budget: fraction or number of examples to keep (exactly one of these four).
        token_ratio / token_budget: fraction or number of *tokens* (prompt + answer, ``lengths``) to keep
            instead: every cluster gives the same count, chosen so that the selected tokens meet the
            budget up to one example per cluster (:func:`count_for_tokens`; the result is in
            ``Plan.stats["token_budget"]``). Default preset only.
        preset: ``"default"`` or ``"paper"`` (see the module docstring; the paper preset fixes
            ``max_cluster_size``, ``min_cluster_size``, ``within_cluster``, ``allocation``,
            ``clusters_per_rank`` and normalises the features when ``world_size > 1``).
        seed: seeds K-means, random picks and visit orders.
        max_cluster_size / min_cluster_size: per-cluster bounds: an int, ``"<f>x"`` (times N / C),
            ``"budget"`` (the per-cluster pick) or None.
        within_cluster: ``"farthest"`` | ``"nearest"`` | ``"random"`` | ``"kcenter"``.
        allocation: ``"cluster-per-rank"`` | ``"stratified"``.
        token_balance: align per-step token counts across ranks (default: True, False for ``"paper"``):
            token-balanced visit orders and, with ``"cluster-per-rank"``, equal rank token totals by
            exchanging up to ``token_balance_slack`` of each cluster's pick (its least-far members) for the
            next candidates in pick order (:func:`clusterlm.allocation.rebalance_tokens`; counts and
            weights are unchanged).
        clusters_per_rank: clusters C / K per rank (C = K * clusters_per_rank).
        token_balance_slack: fraction of each cluster's pick that token balancing may exchange (0 keeps
            the pure pick).
        n_init: k-means++ restarts (default 3; 10 for ``"paper"``).
        max_iter: Lloyd iterations per restart.
        kmeans_backend: backend of :func:`cluster_kernels.capacity_kmeans`.
        fingerprint: the data set's fingerprint (``{"size", "sha256"}``) recorded in the plan.
        model_id: recorded in the plan.
        timings: earlier stage timings (e.g. features) to record with this call's.
        extra_config: more configuration to record.
        clustering: replaces the in-process K-means (used by the distributed selection):
            ``clustering(n_clusters, *, min_size, max_size, n_init, max_iter, seed, l2_normalize)`` returning
            an object with ``labels`` and ``distances`` for all N rows, ``inertia``, ``n_iter``, ``converged``.

    Returns:
        The Plan (per-rank indices of equal length, weights, labels, distances, statistics).

    Raises:
        ValueError / TypeError: bad arguments (each names the argument and the fix), a budget that
            leaves no example per cluster, bounds no clustering can meet.
    """
    from cluster_kernels import capacity_kmeans

    if preset not in PRESETS:
        raise ValueError(f"select: preset must be one of {PRESETS}, got {preset!r}.")
    world_size = _check_int(world_size, "world_size")
    clusters_per_rank = _check_int(clusters_per_rank, "clusters_per_rank")
    if allocation not in ALLOCATIONS:
        raise ValueError(f"select: allocation must be one of {ALLOCATIONS}, got {allocation!r}.")
    if within_cluster not in WITHIN_CLUSTER:
        raise ValueError(f"select: within_cluster must be one of {WITHIN_CLUSTER}, got {within_cluster!r}.")
    if hasattr(features, "detach"):
        features = features.detach().cpu().numpy()
    x = np.asarray(features)
    if x.ndim != 2 or x.dtype not in (np.float32, np.float64):
        raise ValueError(f"select: features must be a (N, d) float32/float64 array, got {x.shape} {x.dtype}.")
    n = x.shape[0]
    lengths = np.ones(n, dtype=np.int64) if lengths is None else np.asarray(lengths, dtype=np.int64)
    if lengths.shape != (n,):
        raise ValueError(f"select: lengths must have shape ({n},) like the features' rows, got {lengths.shape}.")
    n_clusters = world_size * clusters_per_rank
    if n < n_clusters:
        raise ValueError(
            f"select: {n} examples cannot fill {n_clusters} clusters (world_size={world_size} x "
            f"clusters_per_rank={clusters_per_rank}); use fewer ranks or more data."
        )
    tokens_requested = _resolve_any_budget(n, lengths, ratio, budget, token_ratio, token_budget, preset)
    if tokens_requested is None:
        requested = resolve_budget(n, ratio, budget)
    else:
        # Examples the token budget buys at the mean length: the per-cluster lower bound for K-means.
        requested = min(n, max(n_clusters, round(tokens_requested / max(float(lengths.mean()), 1.0))))
    stage: dict[str, float] = dict(timings or {})
    stats: dict[str, Any] = {"requested": requested}

    if preset == "paper":
        fixed = {"max_cluster_size": (max_cluster_size, "1.5x"), "min_cluster_size": (min_cluster_size, "budget"),
                 "within_cluster": (within_cluster, "farthest"), "allocation": (allocation, "cluster-per-rank"),
                 "clusters_per_rank": (clusters_per_rank, 1)}
        for name, (given, default) in fixed.items():
            if given != default:
                raise ValueError(
                    f"select: preset='paper' reproduces the authors' algorithm, which fixes {name}; got "
                    f"{name}={given!r}. Use preset='default' to change it."
                )
        if ratio is None:
            ratio = requested / n  # the authors' code takes a ratio; a budget is converted to one
        if world_size > 1 and clustering is None:
            x = _l2_normalise(x)
        lo, hi = None, math.ceil(PAPER_CAP * n / n_clusters)
        n_init = PAPER_N_INIT if n_init is None else n_init
        token_balance = False if token_balance is None else token_balance
    else:
        per_cluster = requested // n_clusters
        if per_cluster < 1:
            raise ValueError(
                f"select: a budget of {requested} examples gives less than one example to each of {n_clusters} "
                f"clusters; raise ratio/budget to at least {n_clusters} examples or use fewer clusters."
            )
        lo = _cluster_size_bound(min_cluster_size, "min_cluster_size", n, n_clusters, per_cluster)
        hi = _cluster_size_bound(max_cluster_size, "max_cluster_size", n, n_clusters, per_cluster)
        n_init = 3 if n_init is None else n_init
        token_balance = True if token_balance is None else token_balance

    t0 = time.perf_counter()
    if clustering is None:
        km = capacity_kmeans(x, n_clusters, min_size=lo, max_size=hi, n_init=int(n_init), max_iter=int(max_iter),
                             seed=int(seed), backend=kmeans_backend)
    else:
        km = clustering(n_clusters, min_size=lo, max_size=hi, n_init=int(n_init), max_iter=int(max_iter),
                        seed=int(seed), l2_normalize=preset == "paper" and world_size > 1)
    stage["kmeans"] = time.perf_counter() - t0
    labels = np.asarray(km.labels, dtype=np.int64)
    dist = np.asarray(km.distances, dtype=np.float64)
    sizes = np.bincount(labels, minlength=n_clusters).astype(np.int64)
    members = [np.flatnonzero(labels == c) for c in range(n_clusters)]

    t0 = time.perf_counter()
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x5E1EC7]))
    if preset == "paper":
        per_cluster = int(sizes.min() * float(ratio))
        if per_cluster < 1:
            raise ValueError(
                f"select: preset='paper' keeps int(smallest cluster {sizes.min()} * ratio {ratio}) = 0 examples per "
                "cluster; raise the ratio or use preset='default'."
            )
        stats["rounding"] = (
            f"paper preset: smallest cluster {int(sizes.min())} x ratio {float(ratio):g} -> {per_cluster} per cluster, "
            f"{per_cluster * n_clusters} selected of {requested} requested"
        )
    elif requested != per_cluster * n_clusters:
        stats["rounding"] = (
            f"{requested} requested -> {per_cluster * n_clusters} selected ({per_cluster} from each of {n_clusters} "
            f"clusters; the total is a multiple of world_size x clusters_per_rank = {n_clusters})"
        )
    if not 0 <= token_balance_slack <= 1:
        raise ValueError(f"select: token_balance_slack must be in [0, 1], got {token_balance_slack!r}.")
    rebalance = bool(token_balance) and allocation == "cluster-per-rank" and world_size > 1 and token_balance_slack > 0
    n_spare = math.ceil(token_balance_slack * per_cluster) if rebalance else 0
    if tokens_requested is not None:
        # Order more candidates than the estimate (picks may be shorter than average); kcenter is O(m n_c d).
        depth = 3 * per_cluster + n_spare if within_cluster == "kcenter" else n
        picks = [pick_in_cluster(mem, dist, min(depth, len(mem)), method=within_cluster, features=x, rng=rng)
                 for mem in members]
        estimate = per_cluster
        per_cluster = count_for_tokens(picks, lengths, tokens_requested)
        n_spare = math.ceil(token_balance_slack * per_cluster) if rebalance else 0
        picks = [p[: per_cluster + n_spare] for p in picks]
        requested_note = (f"token budget {tokens_requested} -> {per_cluster} examples from each of {n_clusters} "
                          f"clusters (estimate at the mean length: {estimate})")
        stats.pop("rounding", None)
    else:
        picks = [
            pick_in_cluster(mem, dist, min(per_cluster + n_spare, len(mem)), method=within_cluster, features=x,
                            rng=rng)
            for mem in members
        ]
    groups = [p[:per_cluster] for p in picks]
    if rebalance:
        n_free = [min(n_spare, len(g)) for g in groups]
        owners = cluster_owners(groups, world_size, lengths)
        groups, stats["token_rebalance"] = rebalance_tokens(
            groups, [p[per_cluster:] for p in picks], owners, lengths, world_size, n_free
        )
    if any(len(g) < per_cluster for g in groups):
        if allocation == "cluster-per-rank":
            raise ValueError(
                f"select: cluster sizes {sizes.tolist()} include clusters smaller than the per-cluster pick "
                f"{per_cluster}, so ranks would get different counts; keep min_cluster_size='budget' or use "
                "allocation='stratified'."
            )
        # Stratified: trim the largest groups so that the total splits evenly over the ranks.
        total = sum(len(g) for g in groups)
        for c in np.argsort([-len(g) for g in groups], kind="stable")[: total % world_size]:
            groups[c] = groups[c][:-1]
    selected = np.concatenate(groups)
    if tokens_requested is not None:
        got = int(lengths[selected].sum())
        stats["token_budget"] = {
            "requested_tokens": int(tokens_requested), "selected_tokens": got,
            "relative_error": got / tokens_requested - 1.0,
            "one_example_per_cluster_tokens": float(lengths[selected].mean() * n_clusters), "note": requested_note,
        }
    weights = selection_weights(labels, selected, n_clusters)
    rank_lists = allocate(groups, world_size, lengths, allocation=allocation,
                          owners=owners if rebalance else None)
    rank_lists = visit_order(rank_lists, lengths, token_balance=bool(token_balance), seed=int(seed))
    stage["picks"] = time.perf_counter() - t0
    stage["total"] = sum(v for k, v in stage.items() if k != "total")
    stats.update(
        selected=int(len(selected)),
        per_cluster=int(per_cluster),
        token_balance=_balance_stats(rank_lists, lengths),
        kmeans={"inertia": float(km.inertia), "n_iter": int(km.n_iter), "converged": bool(km.converged),
                "min_size": lo, "max_size": hi},
    )
    config = {
        "method": "cluster",
        "preset": preset,
        "world_size": world_size,
        "ratio": None if ratio is None else float(ratio),
        "budget": None if budget is None else int(budget),
        "token_ratio": None if token_ratio is None else float(token_ratio),
        "token_budget": None if token_budget is None else int(token_budget),
        "seed": int(seed),
        "max_cluster_size": max_cluster_size,
        "min_cluster_size": min_cluster_size,
        "within_cluster": within_cluster,
        "allocation": allocation,
        "token_balance": bool(token_balance),
        "clusters_per_rank": clusters_per_rank,
        "token_balance_slack": float(token_balance_slack) if rebalance else 0.0,
        "n_init": int(n_init),
        "max_iter": int(max_iter),
        "feature_dim": int(x.shape[1]),
        "normalized_in_select": preset == "paper" and world_size > 1,
        **dict(extra_config or {}),
    }
    return Plan(
        world_size=world_size,
        rank_indices=rank_lists,
        weights=weights,
        cluster_labels=labels,
        distances=dist,
        cluster_sizes=sizes,
        lengths=lengths,
        fingerprint=dict(fingerprint or {"size": n, "sha256": ""}),
        model_id=model_id,
        config=config,
        timings=stage,
        stats=stats,
    )


# ---------------------------------------------------------------------------------------------------
# The whole method
# ---------------------------------------------------------------------------------------------------


def resolve_feature_tokens(preset: str, feature_tokens: int | str | None) -> int | None:
    """The featurizer's ``max_tokens`` for ``feature_tokens`` under ``preset`` (None = whole examples).

    Raises:
        ValueError: ``feature_tokens`` is not None, ``"all"`` or an int >= 2; a window with the paper preset.
    """
    if feature_tokens is None:
        return None if preset == "paper" else DEFAULT_FEATURE_TOKENS
    if feature_tokens == "all":
        return None
    if isinstance(feature_tokens, bool) or not isinstance(feature_tokens, int) or feature_tokens < 2:
        raise ValueError(
            f"select: feature_tokens must be None (the preset's default), 'all' (whole examples) or an int >= 2, "
            f"got {feature_tokens!r}."
        )
    if preset == "paper":
        raise ValueError(
            f"select: preset='paper' featurizes whole examples (the authors' proxy), got feature_tokens="
            f"{feature_tokens}; use preset='default' for a feature window."
        )
    return feature_tokens


def build_featurizer(model: Any, features: str | Sequence[str], *, dim: Any = None, seed: int = 0, dtype: Any = None,
                     max_tokens: int | None = None) -> Any:
    """The :class:`clusterlm.GradientFeaturizer` that :func:`select` uses for ``features``."""
    from clusterlm.features import GradientFeaturizer

    if features == "paper":
        # The paper normalises in the selection step (only when world_size > 1); keep raw features here.
        return GradientFeaturizer(model, layers="paper", seed=seed, dtype=dtype, normalize=False,
                                  max_tokens=max_tokens)
    return GradientFeaturizer(model, layers=features, dim=DEFAULT_DIM if dim is None else dim, seed=seed,
                              dtype=dtype, normalize=True, max_tokens=max_tokens)


def _model_id(model: Any, featurizer: Any) -> str:
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    return f"{name}@{featurizer.config()['model'][:12]}"


def select(
    model: Any,
    dataset: Any,
    *,
    world_size: int,
    ratio: float | None = None,
    budget: int | None = None,
    token_ratio: float | None = None,
    token_budget: int | None = None,
    preset: str = "default",
    features: str | Sequence[str] | None = None,
    dim: int | tuple[int, int] | None = None,
    feature_tokens: int | str | None = None,
    seed: int = 0,
    max_cluster_size: int | str | None = "1.5x",
    min_cluster_size: int | str | None = "budget",
    within_cluster: str = "farthest",
    allocation: str = "cluster-per-rank",
    token_balance: bool | None = None,
    clusters_per_rank: int = 1,
    token_balance_slack: float = TOKEN_BALANCE_SLACK,
    feature_store: Any = None,
    progress: bool = True,
    batch_tokens: int = 8192,
    dtype: Any = None,
    n_init: int | None = None,
    max_iter: int = 100,
    kmeans_backend: str = "auto",
    model_id: str | None = None,
    return_features: bool = False,
) -> Plan | tuple[Plan, np.ndarray]:
    """Select what every rank trains on: the whole CluSTER method in one call.

    Args:
        model: a Hugging Face causal LM (optionally PEFT-wrapped) on the device to featurize on.
        dataset: tokenised examples: a :class:`clusterlm.data.SFTDataset` or a sequence of dicts with
            ``input_ids`` and ``labels`` (-100 on prompt tokens).
        world_size: number of ranks (GPUs) K that will train.
        ratio / budget: fraction or number of examples to keep (exactly one of these four).
        token_ratio / token_budget: fraction or number of tokens to keep instead (default preset; see
            :func:`select_from_features`): training cost follows tokens, and far-from-centroid picks are
            longer than average.
        preset: ``"default"`` (ours) or ``"paper"`` (the authors' algorithm; module docstring).
        features: gradient features (:class:`clusterlm.GradientFeaturizer` ``layers``): ``"lm_head"``
            (default preset), ``"paper"`` (the paper preset's proxy), ``"all-linear"``, ``"lora"`` or
            module names.
        dim: projected feature size (int or ``(k_o, k_i)``; default ``(32, 32)``).
        feature_tokens: feature window in tokens per example (:class:`clusterlm.GradientFeaturizer`
            ``max_tokens``); None = the preset's (64 for ``"default"``, whole examples for ``"paper"``);
            ``"all"`` = whole examples.
        seed: seeds projections, K-means, random picks and orders.
        max_cluster_size / min_cluster_size / within_cluster / allocation / token_balance /
            clusters_per_rank / token_balance_slack / n_init / max_iter / kmeans_backend: see
            :func:`select_from_features`.
        feature_store: a directory or :class:`clusterlm.FeatureStore`: features are written there shard
            by shard, and a rerun after a crash resumes.
        progress: progress bars.
        batch_tokens: padded tokens per featurization forward.
        dtype: autocast dtype for the forward (e.g. ``torch.bfloat16`` on GPU).
        model_id: recorded in the plan (default: the model's name and a hash of its weights).
        return_features: also return the (N, d) float32 features.

    Returns:
        The :class:`Plan` (and the features when ``return_features``).

    Raises:
        ValueError / TypeError: bad arguments (named, with the fix); malformed examples (named by index).
    """
    if preset not in PRESETS:
        raise ValueError(f"select: preset must be one of {PRESETS}, got {preset!r}.")
    if features is None:
        features = "paper" if preset == "paper" else "lm_head"
    if preset == "paper" and features != "paper":
        raise ValueError(
            f"select: preset='paper' uses the authors' gradient proxy (features='paper'), got features={features!r}; "
            "use preset='default' for other features."
        )
    n = len(dataset)
    if n == 0:
        raise ValueError("select: the data set is empty.")
    # Fail on bad budgets before the expensive stage.
    _resolve_any_budget(n, _lengths_of(dataset), ratio, budget, token_ratio, token_budget, preset)
    _check_int(world_size, "world_size")
    max_tokens = resolve_feature_tokens(preset, feature_tokens)
    featurizer = build_featurizer(model, features, dim=dim, seed=seed, dtype=dtype, max_tokens=max_tokens)
    t0 = time.perf_counter()
    feats = featurizer.featurize(dataset, batch_tokens=batch_tokens, store=feature_store, progress=progress)
    timings = {"features": time.perf_counter() - t0}
    plan = select_from_features(
        feats,
        world_size=world_size,
        lengths=_lengths_of(dataset),
        ratio=ratio,
        budget=budget,
        token_ratio=token_ratio,
        token_budget=token_budget,
        preset=preset,
        seed=seed,
        max_cluster_size=max_cluster_size,
        min_cluster_size=min_cluster_size,
        within_cluster=within_cluster,
        allocation=allocation,
        token_balance=token_balance,
        clusters_per_rank=clusters_per_rank,
        token_balance_slack=token_balance_slack,
        n_init=n_init,
        max_iter=max_iter,
        kmeans_backend=kmeans_backend,
        fingerprint=_fingerprint_of(dataset),
        model_id=model_id or _model_id(model, featurizer),
        timings=timings,
        extra_config={"features": featurizer.config() | {"layers_preset": features if isinstance(features, str)
                                                         else list(features)}},
    )
    return (plan, np.asarray(feats)) if return_features else plan


def main(argv: Sequence[str] | None = None) -> int:
    """``torchrun --nproc-per-node N -m clusterlm.select ARGS``: the arguments of ``clusterlm select``."""
    from clusterlm.cli import build_parser, run_select

    args = build_parser().parse_args(["select", *(sys.argv[1:] if argv is None else argv)])
    run_select(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
