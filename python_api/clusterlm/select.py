"""CluSTER selection: gradient features -> capacity-constrained K-means -> balanced picks -> a Plan.

The method (DESIGN.md §1), one call::

    plan = clusterlm.select(model, dataset, world_size=4, ratio=0.31)
    plan.save("plan/")

Two presets.

``preset="paper"`` selects what the authors' code selects (:mod:`clusterlm.paper` documents every step with
its source lines in kaist-dmlab/CluSTER):

1. feature = ``mean_t (p_t(y_t) - 1) h_t`` over answer tokens, from one forward pass (their gradient
   proxy; dimension = hidden size), L2-normalised when ``world_size > 1``;
2. ``clustering="authors"`` (default): scikit-learn ``KMeans(n_clusters=K, n_init=10, random_state=seed)``
   with the authors' seed default 42, and, only when the largest cluster exceeds ``1.5 N / K``, their greedy
   soft cap at ``ceil(1.5 N / K)`` without a refit. ``clustering="exact"``: this library's capacity K-means
   with every cluster capped at ``ceil(1.5 N / K)`` (:func:`cluster_kernels.capacity_kmeans`, 10 restarts),
   which meets the cap exactly at the same or a lower objective; the later steps are the same;
3. ``m`` = smallest cluster size; from every cluster keep the ``m * pct // 100`` points farthest from
   its centroid (``pct`` = the ratio as a whole percentage, as their ``--ratio``; ties: the higher index);
4. cluster ``k`` is trained by rank ``k`` with loss weight ``K * n_k / N``. With world size 1 the authors keep
   every example with weight 1, and so does this preset.

The selected total is therefore ``K * (m * pct // 100)``, usually below ``ratio * N`` (the authors'
behaviour; :attr:`Plan.stats` states the shortfall, and ``Plan.stats["clustering"]`` which clustering ran and
whether the cap bound).

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
to the budget, within one example per cluster (:func:`clusterlm.budget.count_for_tokens`); the K-means lower
bound uses the count the budget buys at the mean length. Token balancing and the weights work as for an example budget:
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
from dataclasses import dataclass
from typing import Any

import numpy as np

from cluster_kernels import capacity_kmeans
from clusterlm.allocation import ALLOCATIONS, allocate, balance_stats, cluster_owners, rebalance_tokens, visit_order
from clusterlm.budget import check_int, cluster_size_bound, count_for_tokens, resolve_any_budget, resolve_budget
from clusterlm.data import fingerprint, lengths_of
from clusterlm.features import LAYER_PRESETS, GradientFeaturizer
from clusterlm.models import compute_model_id
from clusterlm.paper import (
    PAPER_CAP,
    PAPER_N_INIT,
    PAPER_SEED,
    authors_clustering,
    normalize_rows,
    paper_percentage,
    paper_picks,
)
from clusterlm.picking import WITHIN_CLUSTER, l2_normalise, pick_in_cluster
from clusterlm.plan import Plan, selection_weights

__all__ = [
    "CLUSTERINGS",
    "PRESETS",
    "build_featurizer",
    "check_select_args",
    "resolve_seed",
    "resolve_feature_tokens",
    "select",
    "select_from_features",
]

PRESETS = ("default", "paper")
DEFAULT_DIM = (32, 32)
# The default preset's feature window (tokens per example; benchmarks/bench_compare.py measures it).
DEFAULT_FEATURE_TOKENS = 64
# Token balancing may exchange up to this fraction of each cluster's pick (its last, least-far members)
# for the next candidates in pick order, so that every rank trains on about the same number of tokens.
TOKEN_BALANCE_SLACK = 0.1
CLUSTERINGS = ("authors", "exact")


# ---------------------------------------------------------------------------------------------------
# Selection from fixed features
# ---------------------------------------------------------------------------------------------------


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
    seed: int | None = None,
    clustering: str | None = None,
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
    cluster_fn: Callable[..., Any] | None = None,
) -> Plan:
    """Cluster fixed per-example features and build the :class:`Plan` (steps 2-4 of the method).

    Args:
        features: (N, d) float32/float64 array (numpy, memmap or CPU tensor).
        world_size: number of ranks K.
        lengths: (N,) tokens per example (for token balancing and statistics); default all ones.
        ratio / budget: fraction or number of examples to keep (exactly one of these four).
        token_ratio / token_budget: fraction or number of *tokens* (prompt + answer, ``lengths``) to keep
            instead: every cluster gives the same count, chosen so that the selected tokens meet the
            budget up to one example per cluster (:func:`clusterlm.budget.count_for_tokens`; the result is in
            ``Plan.stats["token_budget"]``). Default preset only.
        preset: ``"default"`` or ``"paper"`` (see the module docstring; the paper preset fixes
            ``max_cluster_size``, ``min_cluster_size``, ``within_cluster``, ``allocation``,
            ``clusters_per_rank`` and normalises the features when ``world_size > 1``).
        seed: seeds K-means, random picks and visit orders (default: 0; 42 for ``"paper"``, the authors' default).
        clustering: ``"authors"`` (the paper preset's default: their sklearn K-means and greedy soft cap,
            :mod:`clusterlm.paper`) or ``"exact"`` (this library's capacity K-means, the only choice of the
            default preset: the cap is met exactly and the objective is the same or lower).
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
        cluster_fn: replaces the in-process K-means (used by the distributed selection):
            ``cluster_fn(n_clusters, *, min_size, max_size, n_init, max_iter, seed, l2_normalize)`` returning
            an object with ``labels`` and ``distances`` for all N rows, ``inertia``, ``n_iter``, ``converged``.

    Returns:
        The Plan (per-rank indices of equal length, weights, labels, distances, statistics).

    Raises:
        ValueError / TypeError: bad arguments (each names the argument and the fix), a budget that
            leaves no example per cluster, bounds no clustering can meet.
    """
    x = _check_features(features)
    lengths = _check_lengths(lengths, x.shape[0])
    seed = resolve_seed(preset, seed)
    s = _resolve_settings(
        x.shape[0], lengths, world_size=world_size, clusters_per_rank=clusters_per_rank, preset=preset,
        clustering=clustering,
        ratio=ratio, budget=budget, token_ratio=token_ratio, token_budget=token_budget,
        max_cluster_size=max_cluster_size, min_cluster_size=min_cluster_size, within_cluster=within_cluster,
        allocation=allocation, token_balance=token_balance, token_balance_slack=token_balance_slack, n_init=n_init,
    )
    stage: dict[str, float] = dict(timings or {})
    if s.clustering == "authors":
        x = normalize_rows(x) if s.normalize else np.asarray(x, dtype=np.float32)  # their F.normalize, float32
    elif s.normalize and cluster_fn is None:
        x = l2_normalise(x)
    t0 = time.perf_counter()
    km = _cluster(x, s, seed=seed, max_iter=int(max_iter), kmeans_backend=kmeans_backend, cluster_fn=cluster_fn)
    stage["kmeans"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    picked = _pick(x, km, s, lengths, seed=seed)
    stage["picks"] = time.perf_counter() - t0
    stage["total"] = sum(v for k, v in stage.items() if k != "total")
    config = {
        "method": "cluster",
        "preset": preset,
        "world_size": s.world_size,
        "ratio": None if s.ratio is None else float(s.ratio),
        "budget": None if budget is None else int(budget),
        "token_ratio": None if token_ratio is None else float(token_ratio),
        "token_budget": None if token_budget is None else int(token_budget),
        "seed": seed,
        "clustering": s.clustering,
        "max_cluster_size": max_cluster_size,
        "min_cluster_size": min_cluster_size,
        "within_cluster": within_cluster,
        "allocation": allocation,
        "token_balance": s.token_balance,
        "clusters_per_rank": s.clusters_per_rank,
        "token_balance_slack": float(token_balance_slack) if s.rebalance else 0.0,
        "n_init": s.n_init,
        "max_iter": int(max_iter),
        "feature_dim": int(x.shape[1]),
        "normalized_in_select": s.normalize,
        **dict(extra_config or {}),
    }
    return _assemble_plan(km, s, picked, lengths, seed=seed, config=config, timings=stage,
                          fingerprint=fingerprint, model_id=model_id)


@dataclass
class _Settings:
    """What the preset and the arguments resolve to, before any clustering."""

    preset: str
    world_size: int
    clusters_per_rank: int
    n_clusters: int
    requested: int  # examples requested (for a token budget: what it buys at the mean length)
    tokens: int | None  # the token budget, or None for an example budget
    ratio: float | None  # the paper preset's ratio (a budget is converted to one)
    lo: int | None
    hi: int | None
    n_init: int
    within_cluster: str
    allocation: str
    token_balance: bool
    token_balance_slack: float
    per_cluster: int  # the default preset's per-cluster pick (the paper preset's comes after clustering)
    normalize: bool  # L2-normalise the features before K-means (the paper preset with world_size > 1)
    clustering: str  # "authors" (sklearn K-means + their greedy soft cap) or "exact" (capacity K-means)
    percentage: int | None  # the paper preset's ratio as their integer --ratio (0.31 -> 31)

    @property
    def rebalance(self) -> bool:
        """Exchange picks for equal rank token totals (cluster-per-rank allocation only)."""
        return (self.token_balance and self.allocation == "cluster-per-rank" and self.world_size > 1
                and self.token_balance_slack > 0)

    def spare(self, per_cluster: int) -> int:
        """Candidates per cluster beyond the pick that token balancing may swap in."""
        return math.ceil(self.token_balance_slack * per_cluster) if self.rebalance else 0


def _check_features(features: Any) -> np.ndarray:
    if hasattr(features, "detach"):
        features = features.detach().cpu().numpy()
    x = np.asarray(features)
    if x.ndim != 2 or x.dtype not in (np.float32, np.float64):
        raise ValueError(f"select: features must be a (N, d) float32/float64 array, got {x.shape} {x.dtype}.")
    return x


def _check_lengths(lengths: Any, n: int) -> np.ndarray:
    lengths = np.ones(n, dtype=np.int64) if lengths is None else np.asarray(lengths, dtype=np.int64)
    if lengths.shape != (n,):
        raise ValueError(f"select: lengths must have shape ({n},) like the features' rows, got {lengths.shape}.")
    return lengths


def _check_choices(preset: str, allocation: str, within_cluster: str, token_balance_slack: float) -> None:
    if preset not in PRESETS:
        raise ValueError(f"select: preset must be one of {PRESETS}, got {preset!r}.")
    if allocation not in ALLOCATIONS:
        raise ValueError(f"select: allocation must be one of {ALLOCATIONS}, got {allocation!r}.")
    if within_cluster not in WITHIN_CLUSTER:
        raise ValueError(f"select: within_cluster must be one of {WITHIN_CLUSTER}, got {within_cluster!r}.")
    if not 0 <= token_balance_slack <= 1:
        raise ValueError(f"select: token_balance_slack must be in [0, 1], got {token_balance_slack!r}.")


def _check_paper_fixed(**given: Any) -> None:
    """The paper preset fixes these arguments to their defaults: refuse any other value."""
    fixed = {"max_cluster_size": "1.5x", "min_cluster_size": "budget", "within_cluster": "farthest",
             "allocation": "cluster-per-rank", "clusters_per_rank": 1}
    for name, default in fixed.items():
        if given[name] != default:
            raise ValueError(
                f"select: preset='paper' reproduces the authors' algorithm, which fixes {name}; got "
                f"{name}={given[name]!r}. Use preset='default' to change it."
            )


def resolve_seed(preset: str, seed: int | None) -> int:
    """The seed a selection uses: ``seed``, or the preset's default (42 for ``"paper"``, as the authors', else 0).

    Raises:
        ValueError: ``seed`` is not None or an int >= 0.
    """
    if seed is None:
        return PAPER_SEED if preset == "paper" else 0
    return check_int(seed, "seed", 0)


def _check_clustering(preset: str, clustering: str | None) -> str:
    if clustering is None:
        return "authors" if preset == "paper" else "exact"
    if clustering not in CLUSTERINGS:
        raise ValueError(f"select: clustering must be one of {CLUSTERINGS}, got {clustering!r}.")
    if clustering == "authors" and preset != "paper":
        raise ValueError(
            "select: clustering='authors' (sklearn K-means + the authors' greedy cap) belongs to preset='paper'; "
            "the default preset clusters with exact capacities (clustering='exact')."
        )
    return clustering


def _resolve_features(preset: str, features: Any) -> str | list[str]:
    """``features`` checked (a preset name or a non-empty list of module names), or the preset's default."""
    if features is None:
        return "paper" if preset == "paper" else "lm_head"
    if isinstance(features, str):
        if features not in LAYER_PRESETS:
            raise ValueError(
                f"select: features must be one of {LAYER_PRESETS} or a list of module names, got {features!r}; "
                "pass module names as a list (features=['model.layers.0.mlp.down_proj']; on the command line "
                "--features a,b)."
            )
    elif not isinstance(features, Sequence) or not features or not all(isinstance(f, str) and f for f in features):
        raise TypeError(
            f"select: features must be a preset name or a non-empty list of module names, got {features!r}."
        )
    elif len(set(features)) != len(features):
        raise ValueError(f"select: features lists a module twice: {list(features)}.")
    if preset == "paper" and features != "paper":
        raise ValueError(
            f"select: preset='paper' uses the authors' gradient proxy (features='paper'), got features={features!r}; "
            "use preset='default' for other features."
        )
    return features if isinstance(features, str) else list(features)


def _check_fraction(value: Any, name: str, example: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1):
        raise ValueError(f"select: {name} must be in (0, 1], got {value!r}; e.g. {name}=0.31 keeps 31 % of {example}.")


def _check_budget_forms(ratio: Any, budget: Any, token_ratio: Any, token_budget: Any, preset: str) -> None:
    """One budget, in range as far as it can be told without the data (the data's size is checked later)."""
    given = {k: v for k, v in (("ratio", ratio), ("budget", budget), ("token_ratio", token_ratio),
                               ("token_budget", token_budget)) if v is not None}
    if len(given) != 1:
        raise ValueError(
            "select: give exactly one of ratio / budget (examples) or token_ratio / token_budget (tokens), got "
            + (", ".join(f"{k}={v!r}" for k, v in given.items()) or "none") + "."
        )
    _check_fraction(ratio, "ratio", "the examples")
    _check_fraction(token_ratio, "token_ratio", "the tokens")
    for name in ("budget", "token_budget"):
        if name in given:
            check_int(given[name], name)
    if preset == "paper":
        if ratio is None:
            raise ValueError(
                f"select: preset='paper' takes ratio= (the authors' --ratio, a whole percentage), got "
                f"{', '.join(f'{k}={v!r}' for k, v in given.items())}; pass ratio=, or use preset='default'."
            )
        paper_percentage(ratio)


def check_select_args(
    *,
    world_size: Any,
    ratio: Any = None,
    budget: Any = None,
    token_ratio: Any = None,
    token_budget: Any = None,
    preset: str = "default",
    features: Any = None,
    feature_tokens: Any = None,
    seed: Any = None,
    clustering: str | None = None,
    max_cluster_size: Any = "1.5x",
    min_cluster_size: Any = "budget",
    within_cluster: str = "farthest",
    allocation: str = "cluster-per-rank",
    clusters_per_rank: Any = 1,
    token_balance_slack: float = TOKEN_BALANCE_SLACK,
    n: int | None = None,
    lengths: Any = None,
) -> None:
    """Check the arguments of :func:`select` before the expensive stages.

    Without ``n``: every check that needs no data, before a model or data set is loaded. With ``n`` (the
    number of examples) and ``lengths`` (their tokens) also what needs the data's size: a budget above it,
    more clusters than examples, cluster-size bounds that no clustering can meet; :func:`select` runs this
    before computing any feature.

    Raises:
        ValueError / TypeError: the first bad argument, named, with the fix.
    """
    if preset not in PRESETS:
        raise ValueError(f"select: preset must be one of {PRESETS}, got {preset!r}.")
    _check_choices(preset, allocation, within_cluster, token_balance_slack)
    _resolve_features(preset, features)
    check_int(world_size, "world_size")
    check_int(clusters_per_rank, "clusters_per_rank")
    resolve_seed(preset, seed)
    _check_clustering(preset, clustering)
    _check_budget_forms(ratio, budget, token_ratio, token_budget, preset)
    for name, value in (("max_cluster_size", max_cluster_size), ("min_cluster_size", min_cluster_size)):
        cluster_size_bound(value, name, 1, 1, 1)  # the form only; the values are checked against the data later
    if preset == "paper":
        _check_paper_fixed(max_cluster_size=max_cluster_size, min_cluster_size=min_cluster_size,
                           within_cluster=within_cluster, allocation=allocation, clusters_per_rank=clusters_per_rank)
    resolve_feature_tokens(preset, feature_tokens)
    if n is not None:
        if n == 0:
            raise ValueError("select: the data set is empty.")
        _resolve_settings(
            n, _check_lengths(lengths, n), world_size=world_size, clusters_per_rank=clusters_per_rank, preset=preset,
            clustering=clustering, ratio=ratio, budget=budget, token_ratio=token_ratio, token_budget=token_budget,
            max_cluster_size=max_cluster_size, min_cluster_size=min_cluster_size, within_cluster=within_cluster,
            allocation=allocation, token_balance=None, token_balance_slack=token_balance_slack, n_init=None,
        )


def _check_bounds(lo: int | None, hi: int | None, n: int, n_clusters: int, min_cluster_size: Any,
                  max_cluster_size: Any) -> None:
    """Cluster-size bounds that some clustering of ``n`` examples into ``n_clusters`` clusters meets."""
    shown_lo = f"min_cluster_size={min_cluster_size!r}" + (f" (= {lo})" if str(lo) != str(min_cluster_size) else "")
    shown_hi = f"max_cluster_size={max_cluster_size!r}" + (f" (= {hi})" if str(hi) != str(max_cluster_size) else "")
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"select: {shown_lo} is above {shown_hi}; lower min_cluster_size or raise max_cluster_size.")
    if hi is not None and hi * n_clusters < n:
        raise ValueError(
            f"select: {shown_hi} x {n_clusters} clusters holds {hi * n_clusters} of the {n} examples; raise "
            f"max_cluster_size to at least {math.ceil(n / n_clusters)} (or 'none')."
        )
    if lo is not None and lo * n_clusters > n:
        raise ValueError(
            f"select: {shown_lo} x {n_clusters} clusters needs {lo * n_clusters} examples, the data has {n}; lower "
            f"min_cluster_size to at most {n // n_clusters}."
        )


def _resolve_settings(n: int, lengths: np.ndarray, *, world_size: Any, clusters_per_rank: Any, preset: str,
                      clustering: str | None, ratio: Any, budget: Any, token_ratio: Any, token_budget: Any,
                      max_cluster_size: Any, min_cluster_size: Any, within_cluster: str, allocation: str,
                      token_balance: bool | None, token_balance_slack: float, n_init: int | None) -> _Settings:
    """Check every argument and resolve the preset: budgets, K-means bounds and restarts, token balance."""
    _check_choices(preset, allocation, within_cluster, token_balance_slack)
    world_size = check_int(world_size, "world_size")
    clusters_per_rank = check_int(clusters_per_rank, "clusters_per_rank")
    n_clusters = world_size * clusters_per_rank
    if n < n_clusters:
        raise ValueError(
            f"select: {n} examples cannot fill {n_clusters} clusters (world_size={world_size} x "
            f"clusters_per_rank={clusters_per_rank}); use fewer ranks or more data."
        )
    tokens = resolve_any_budget(n, lengths, ratio, budget, token_ratio, token_budget, preset)
    if tokens is None:
        requested = resolve_budget(n, ratio, budget)
    else:
        # Examples the token budget buys at the mean length: the per-cluster lower bound for K-means.
        requested = min(n, max(n_clusters, round(tokens / max(float(lengths.mean()), 1.0))))
    common = {"preset": preset, "world_size": world_size, "clusters_per_rank": clusters_per_rank,
              "n_clusters": n_clusters, "requested": requested, "tokens": tokens, "within_cluster": within_cluster,
              "allocation": allocation, "token_balance_slack": float(token_balance_slack),
              "clustering": _check_clustering(preset, clustering)}
    if preset == "paper":
        _check_paper_fixed(max_cluster_size=max_cluster_size, min_cluster_size=min_cluster_size,
                           within_cluster=within_cluster, allocation=allocation, clusters_per_rank=clusters_per_rank)
        _check_budget_forms(ratio, budget, token_ratio, token_budget, preset)  # the paper preset takes ratio= only
        return _Settings(
            **common, ratio=float(ratio), percentage=paper_percentage(ratio), lo=None,
            hi=math.ceil(PAPER_CAP * n / n_clusters), n_init=PAPER_N_INIT if n_init is None else int(n_init),
            token_balance=bool(token_balance), per_cluster=0, normalize=world_size > 1,
        )
    per_cluster = requested // n_clusters
    if per_cluster < 1:
        raise ValueError(
            f"select: a budget of {requested} examples gives less than one example to each of {n_clusters} "
            f"clusters; raise ratio/budget to at least {n_clusters} examples or use fewer clusters."
        )
    lo = cluster_size_bound(min_cluster_size, "min_cluster_size", n, n_clusters, per_cluster)
    hi = cluster_size_bound(max_cluster_size, "max_cluster_size", n, n_clusters, per_cluster)
    _check_bounds(lo, hi, n, n_clusters, min_cluster_size, max_cluster_size)
    return _Settings(
        **common, ratio=ratio, lo=lo, hi=hi,
        n_init=3 if n_init is None else int(n_init),
        token_balance=True if token_balance is None else bool(token_balance),
        per_cluster=per_cluster, normalize=False, percentage=None,
    )


def _cluster(x: np.ndarray, s: _Settings, *, seed: int, max_iter: int, kmeans_backend: str,
             cluster_fn: Callable[..., Any] | None) -> Any:
    """Capacity K-means on the features (or ``cluster_fn``, the distributed one); labels and distances.

    The paper preset's world size 1 clusters nothing (the authors keep all data); its ``"authors"`` clustering is
    sklearn's, on the full features in this process, also under a distributed selection (deterministic, so every
    process computes the same).
    """
    if s.preset == "paper" and s.world_size == 1:
        return _one_cluster(len(x))
    if s.clustering == "authors":
        return authors_clustering(x, s.n_clusters, seed)
    if cluster_fn is not None:
        return cluster_fn(s.n_clusters, min_size=s.lo, max_size=s.hi, n_init=s.n_init, max_iter=max_iter, seed=seed,
                          l2_normalize=s.normalize)
    return capacity_kmeans(x, s.n_clusters, min_size=s.lo, max_size=s.hi, n_init=s.n_init, max_iter=max_iter,
                           seed=seed, backend=kmeans_backend)


@dataclass
class _OneCluster:
    """Every example in cluster 0 at distance 0: the paper preset's world size 1, where nothing is selected away."""

    labels: np.ndarray
    distances: np.ndarray
    inertia: float = 0.0
    n_iter: int = 0
    converged: bool = True


def _one_cluster(n: int) -> _OneCluster:
    return _OneCluster(labels=np.zeros(n, dtype=np.int64), distances=np.zeros(n, dtype=np.float64))


@dataclass
class _Picked:
    """Step 3's result: the selected examples of every cluster, and what the plan records about them."""

    groups: list[np.ndarray]  # per cluster, in pick order
    per_cluster: int
    owners: Any  # cluster -> rank chosen by token balancing, or None
    stats: dict[str, Any]


def _paper_pick(km: Any, s: _Settings) -> _Picked:
    """The authors' step 4 (:func:`clusterlm.paper.paper_picks`); world size 1 keeps every example."""
    labels = np.asarray(km.labels, dtype=np.int64)
    n = len(labels)
    stats: dict[str, Any] = {"requested": s.requested, "clustering": _clustering_stats(km, s)}
    if s.world_size == 1:
        stats["rounding"] = (f"paper preset, world size 1: the authors' code selects nothing away, all {n} examples "
                             "are kept with weight 1 (ratio ignored)")
        return _Picked(groups=[np.arange(n, dtype=np.int64)], per_cluster=n, owners=None, stats=stats)
    groups, count = paper_picks(labels, np.asarray(km.distances), s.n_clusters, s.percentage)
    m = int(np.bincount(labels, minlength=s.n_clusters).min())
    stats["rounding"] = (f"paper preset: smallest cluster {m} x {s.percentage} // 100 -> {count} per cluster, "
                         f"{count * s.n_clusters} selected of {s.requested} requested")
    return _Picked(groups=groups, per_cluster=count, owners=None, stats=stats)


def _clustering_stats(km: Any, s: _Settings) -> dict[str, Any]:
    """Which clustering ran and whether the 1.5 N / K cap bound (``Plan.stats["clustering"]``)."""
    sizes = np.bincount(np.asarray(km.labels, dtype=np.int64), minlength=s.n_clusters)
    if s.world_size == 1:
        return {"method": "none (world size 1)", "cap": None, "cap_bound": False}
    if s.clustering == "authors":
        return {"method": "authors: sklearn KMeans(n_init=10) + greedy soft cap", "cap": km.cap,
                "cap_bound": km.cap_bound, "sizes_before_cap": km.sizes_before_cap}
    bound = bool(s.hi is not None and sizes.max() >= s.hi)
    return {"method": "exact: capacity K-means", "cap": s.hi, "cap_bound": bound}


def _pick(x: np.ndarray, km: Any, s: _Settings, lengths: np.ndarray, *, seed: int) -> _Picked:
    """Step 3: the per-cluster count, the picks in every cluster, token rebalancing."""
    if s.preset == "paper":
        return _paper_pick(km, s)
    labels = np.asarray(km.labels, dtype=np.int64)
    dist = np.asarray(km.distances, dtype=np.float64)
    sizes = np.bincount(labels, minlength=s.n_clusters).astype(np.int64)
    members = [np.flatnonzero(labels == c) for c in range(s.n_clusters)]
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5E1EC7]))
    stats: dict[str, Any] = {"requested": s.requested, "clustering": _clustering_stats(km, s)}
    per_cluster = s.per_cluster
    if s.requested != per_cluster * s.n_clusters:
        stats["rounding"] = (
            f"{s.requested} requested -> {per_cluster * s.n_clusters} selected ({per_cluster} from each of "
            f"{s.n_clusters} clusters; the total is a multiple of world_size x clusters_per_rank = {s.n_clusters})"
        )

    def ordered(depth: int) -> list[np.ndarray]:
        return [pick_in_cluster(mem, dist, min(depth, len(mem)), method=s.within_cluster, features=x, rng=rng)
                for mem in members]

    if s.tokens is not None:
        # Order more candidates than the estimate (picks may be shorter than average); kcenter is O(m n_c d).
        picks = ordered(3 * per_cluster + s.spare(per_cluster) if s.within_cluster == "kcenter" else len(x))
        estimate, per_cluster = per_cluster, count_for_tokens(picks, lengths, s.tokens)
        picks = [p[: per_cluster + s.spare(per_cluster)] for p in picks]
        stats.pop("rounding", None)
        stats["token_budget_note"] = (f"token budget {s.tokens} -> {per_cluster} examples from each of "
                                      f"{s.n_clusters} clusters (estimate at the mean length: {estimate})")
    else:
        picks = ordered(per_cluster + s.spare(per_cluster))
    groups, owners = [p[:per_cluster] for p in picks], None
    if s.rebalance:
        n_free = [min(s.spare(per_cluster), len(g)) for g in groups]
        owners = cluster_owners(groups, s.world_size, lengths)
        groups, stats["token_rebalance"] = rebalance_tokens(
            groups, [p[per_cluster:] for p in picks], owners, lengths, s.world_size, n_free
        )
    groups = _even_groups(groups, per_cluster, sizes, s)
    return _Picked(groups=groups, per_cluster=per_cluster, owners=owners, stats=stats)


def _even_groups(groups: list[np.ndarray], per_cluster: int, sizes: np.ndarray, s: _Settings) -> list[np.ndarray]:
    """Refuse clusters smaller than the pick (cluster-per-rank), or trim so the ranks get equal counts."""
    if all(len(g) >= per_cluster for g in groups):
        return groups
    if s.allocation == "cluster-per-rank":
        raise ValueError(
            f"select: cluster sizes {sizes.tolist()} include clusters smaller than the per-cluster pick "
            f"{per_cluster}, so ranks would get different counts; keep min_cluster_size='budget' or use "
            "allocation='stratified'."
        )
    # Stratified: trim the largest groups so that the total splits evenly over the ranks.
    total = sum(len(g) for g in groups)
    for c in np.argsort([-len(g) for g in groups], kind="stable")[: total % s.world_size]:
        groups[c] = groups[c][:-1]
    return groups


def _assemble_plan(km: Any, s: _Settings, picked: _Picked, lengths: np.ndarray, *, seed: int,
                   config: dict[str, Any], timings: dict[str, float], fingerprint: Mapping[str, Any] | None,
                   model_id: str) -> Plan:
    """Step 4: weights, rank lists and visit orders, statistics, the Plan."""
    labels = np.asarray(km.labels, dtype=np.int64)
    sizes = np.bincount(labels, minlength=s.n_clusters).astype(np.int64)
    selected = np.concatenate(picked.groups)
    stats = dict(picked.stats)
    note = stats.pop("token_budget_note", None)
    if s.tokens is not None:
        got = int(lengths[selected].sum())
        stats["token_budget"] = {
            "requested_tokens": int(s.tokens), "selected_tokens": got, "relative_error": got / s.tokens - 1.0,
            "one_example_per_cluster_tokens": float(lengths[selected].mean() * s.n_clusters), "note": note,
        }
    rank_lists = allocate(picked.groups, s.world_size, lengths, allocation=s.allocation, owners=picked.owners)
    rank_lists = visit_order(rank_lists, lengths, token_balance=s.token_balance, seed=seed)
    stats.update(
        selected=int(len(selected)),
        per_cluster=int(picked.per_cluster),
        token_balance=balance_stats(rank_lists, lengths),
        kmeans={"inertia": float(km.inertia), "n_iter": int(km.n_iter), "converged": bool(km.converged),
                "min_size": s.lo, "max_size": s.hi},
    )
    n = len(labels)
    return Plan(
        world_size=s.world_size,
        rank_indices=rank_lists,
        weights=selection_weights(labels, selected, s.n_clusters),
        cluster_labels=labels,
        distances=np.asarray(km.distances, dtype=np.float64),
        cluster_sizes=sizes,
        lengths=lengths,
        fingerprint=dict(fingerprint or {"size": n, "sha256": ""}),
        model_id=model_id,
        config=config,
        timings=timings,
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

    if features == "paper":
        # The paper normalises in the selection step (only when world_size > 1); keep raw features here.
        return GradientFeaturizer(model, layers="paper", seed=seed, dtype=dtype, normalize=False,
                                  max_tokens=max_tokens)
    return GradientFeaturizer(model, layers=features, dim=DEFAULT_DIM if dim is None else dim, seed=seed,
                              dtype=dtype, normalize=True, max_tokens=max_tokens)


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
    seed: int | None = None,
    clustering: str | None = None,
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
        seed: seeds projections, K-means, random picks and orders (default: 0; 42 for ``"paper"``).
        clustering: ``"authors"`` (paper preset default) or ``"exact"``; see :func:`select_from_features`.
        max_cluster_size / min_cluster_size / within_cluster / allocation / token_balance /
            clusters_per_rank / token_balance_slack / n_init / max_iter / kmeans_backend: see
            :func:`select_from_features`.
        feature_store: a directory or :class:`clusterlm.FeatureStore`: features are written there shard
            by shard, and a rerun after a crash resumes.
        progress: progress bars.
        batch_tokens: padded tokens per featurization forward.
        dtype: autocast dtype for the forward (e.g. ``torch.bfloat16`` on GPU).
        model_id: recorded in the plan (default: :func:`clusterlm.models.compute_model_id`, the id the trainers
            check).
        return_features: also return the (N, d) float32 features.

    Returns:
        The :class:`Plan` (and the features when ``return_features``).

    Raises:
        ValueError / TypeError: bad arguments (named, with the fix); malformed examples (named by index).
    """
    # Fail on bad arguments before the expensive stage (also those that need the data's size).
    n = len(dataset)
    check_select_args(
        world_size=world_size, ratio=ratio, budget=budget, token_ratio=token_ratio, token_budget=token_budget,
        preset=preset, features=features, feature_tokens=feature_tokens, seed=seed, clustering=clustering,
        max_cluster_size=max_cluster_size, min_cluster_size=min_cluster_size, within_cluster=within_cluster,
        allocation=allocation, clusters_per_rank=clusters_per_rank, token_balance_slack=token_balance_slack,
        n=n, lengths=lengths_of(dataset) if n else None,
    )
    features = _resolve_features(preset, features)
    seed = resolve_seed(preset, seed)
    max_tokens = resolve_feature_tokens(preset, feature_tokens)
    featurizer = build_featurizer(model, features, dim=dim, seed=seed, dtype=dtype, max_tokens=max_tokens)
    t0 = time.perf_counter()
    feats = featurizer.featurize(dataset, batch_tokens=batch_tokens, store=feature_store, progress=progress)
    timings = {"features": time.perf_counter() - t0}
    plan = select_from_features(
        feats,
        world_size=world_size,
        lengths=lengths_of(dataset),
        ratio=ratio,
        budget=budget,
        token_ratio=token_ratio,
        token_budget=token_budget,
        preset=preset,
        seed=seed,
        clustering=clustering,
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
        fingerprint=fingerprint(dataset),
        model_id=model_id or compute_model_id(model),
        timings=timings,
        extra_config={"features": featurizer.config() | {"layers_preset": features if isinstance(features, str)
                                                         else list(features)}},
    )
    return (plan, np.asarray(feats)) if return_features else plan


if __name__ == "__main__":  # torchrun --nproc-per-node N -m clusterlm.select ARGS (the arguments of `clusterlm select`)
    from clusterlm.cli import main

    sys.exit(main(["select", *sys.argv[1:]]))
