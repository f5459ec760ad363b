"""CluSTER selection: gradient features -> capacity-constrained K-means -> balanced picks -> a Plan.

The method (docs/design.md section 1), one call::

    plan = clusterlm.select(model, dataset, world_size=4, ratio=0.31)
    plan.save("plan/")

Two presets.

``preset="paper"`` selects what the authors' code selects (:mod:`clusterlm.selection.paper` documents every step with
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
(:mod:`clusterlm.selection.allocation`): equal rank token totals by exchanging at most ``token_balance_slack``
(10 %) of each cluster's least-far picks for its next-farthest members, and visit orders that align
length quantiles across ranks.

Token budget (default preset): ``token_ratio=`` / ``token_budget=`` instead of ``ratio=`` / ``budget=``.
Training cost follows tokens, and far-from-centroid picks are longer than average (8 % more tokens than a
random sample of as many examples on the demo data), so the count per cluster ``m`` (the same for every
cluster, hence every rank) is chosen after clustering as the one whose farthest-first picks total closest
to the budget, within one example per cluster (:func:`clusterlm.config.budget.count_for_tokens`); the K-means lower
bound uses the count the budget buys at the mean length. Token balancing and the weights work as for an example budget:
the weights are still ``(n_c / N)(S / s_c)`` with counts, because the loss is a mean over examples (each
example's loss is its own answer-token mean), so the estimate of the full-data gradient is unchanged.
``Plan.stats["token_budget"]`` records the requested and selected tokens.

Weights: example ``i`` of cluster ``c`` gets ``(n_c / N) * (S / s_c)`` (``S`` selected in all, ``s_c``
from cluster ``c``), which is ``K n_k / N`` for one cluster per rank; with ``mean_b(w_b * loss_b)`` on
every rank, DDP's gradient average estimates the full-data gradient ``sum_c (n_c / N) g_c``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from cluster_kernels import capacity_kmeans, has_cuda_kmeans
from clusterlm.config.budget import count_for_tokens
from clusterlm.config.selection import ResolvedSelection, SelectConfig, check_lengths
from clusterlm.data import fingerprint, lengths_of
from clusterlm.models import compute_model_id
from clusterlm.plan import Plan
from clusterlm.selection.allocation import (
    allocate,
    balance_stats,
    cluster_owners,
    rebalance_tokens,
    selection_weights,
    visit_order,
)
from clusterlm.selection.features import GradientFeaturizer
from clusterlm.selection.paper import authors_clustering, normalize_rows, paper_picks
from clusterlm.selection.picking import SIGNAL_PICKS, l2_normalize, needs_signals, pick_in_cluster
from clusterlm.selection.signals import ExampleSignals

__all__ = [
    "ClusterFn", "build_featurizer", "check_store_signals", "feature_settings", "featurizer_record", "kmeans_device",
    "select", "select_from_features",
]

# ---------------------------------------------------------------------------------------------------
# Selection from fixed features
# ---------------------------------------------------------------------------------------------------

# The distributed K-means (clusterlm.selection.distributed.DistributedClustering) or any other clustering of all N rows:
# ``cluster_fn(n_clusters, *, min_cluster_size, max_cluster_size, n_init, max_iter, seed, normalize)`` returning an
# object with ``labels`` and ``distances`` for all rows, ``inertia``, ``n_iter``, ``converged``.
ClusterFn = Callable[..., Any]


def select_from_features(
    features: Any,
    config: SelectConfig | None = None,
    *,
    lengths: Any = None,
    fingerprint: Mapping[str, Any] | None = None,
    model_id: str = "",
    timings: Mapping[str, float] | None = None,
    extra_config: Mapping[str, Any] | None = None,
    cluster_fn: ClusterFn | None = None,
    resolved: ResolvedSelection | None = None,
    device: Any = None,
    signals: ExampleSignals | None = None,
    **overrides: Any,
) -> Plan:
    """Cluster fixed per-example features and build the :class:`Plan` (steps 2-4 of the method).

    Args:
        features: (N, d) float32/float64 array (numpy, memmap or a torch tensor on any device).
        config: the selection settings (:class:`clusterlm.SelectConfig`); ``overrides`` (any of its fields,
            e.g. ``world_size=4, ratio=0.31``) are applied on top.
        lengths: (N,) tokens per example (for token balancing and statistics); default all ones.
        fingerprint: the data set's fingerprint (``{"size", "sha256"}``) recorded in the plan.
        model_id: recorded in the plan.
        timings: earlier stage timings (e.g. features) to record with this call's.
        extra_config: more configuration to record.
        cluster_fn: replaces the in-process K-means (the distributed selection passes
            :class:`clusterlm.selection.distributed.DistributedClustering`); see :data:`ClusterFn`.
        resolved: ``config.resolve(N, lengths)`` when the caller resolved it already (before computing the
            features), so the settings are validated once.
        device: where the in-process K-means runs (:func:`kmeans_device`): on a CUDA device the (normalised)
            features are copied there once and the CUDA K-means runs when ``kmeans_backend`` is ``"cuda"``, or
            ``"auto"`` with the CUDA part of ``cluster_kernels._C`` built; None: the device of ``features`` (a CUDA
            tensor's, else the CPU). Picks and the plan are computed on the host copy.
        signals: every example's gradient norm and loss (:class:`clusterlm.selection.signals.ExampleSignals`, from
            ``GradientFeaturizer.featurize(..., return_signals=True)`` or ``FeatureStore.signals()``): the
            signal picks (``within_cluster="loss"``, ...) rank by them, and the plan keeps them
            (``Plan.grad_norms``, ``Plan.losses``). Not needed by the geometric picks.

    Returns:
        The Plan (per-rank indices of equal length, weights, labels, distances, statistics).

    Raises:
        ValueError / TypeError: bad settings (each names the setting and the fix), a budget that leaves no
            example per cluster, bounds no clustering can meet, a signal pick without ``signals``.
    """
    config = (config or SelectConfig()).replace(**overrides)
    if device is None and hasattr(features, "device"):
        device = features.device
    x = _check_features(features)
    s = config.resolve(x.shape[0], lengths) if resolved is None else resolved
    if s.n != x.shape[0]:
        raise ValueError(f"select: the settings were resolved for {s.n} examples, the features have {x.shape[0]} "
                         "rows; resolve them for these features (config.resolve(len(features), lengths)).")
    lengths = check_lengths(lengths, x.shape[0])
    _check_signals(signals, s, x.shape[0])
    stage: dict[str, float] = dict(timings or {})
    if s.clustering == "authors":
        x = normalize_rows(x) if s.normalize else np.asarray(x, dtype=np.float32)  # their F.normalize, float32
    elif s.normalize and cluster_fn is None:
        x = l2_normalize(x)
    t0 = time.perf_counter()
    km = _cluster(x, s, seed=s.seed, max_iter=int(config.max_iter), kmeans_backend=config.kmeans_backend,
                  cluster_fn=cluster_fn, device=kmeans_device(device, config.kmeans_backend))
    stage["kmeans"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    picked = _pick(x, km, s, lengths, seed=s.seed, signals=signals)
    stage["picks"] = time.perf_counter() - t0
    stage["total"] = sum(v for k, v in stage.items() if k != "total")
    record = config.record(s, x.shape[1]) | dict(extra_config or {})
    return _assemble_plan(km, s, picked, lengths, seed=s.seed, config=record, timings=stage,
                          fingerprint=fingerprint, model_id=model_id, signals=signals)


def _check_signals(signals: Any, s: ResolvedSelection, n: int) -> None:
    """The signals are one per example (or absent), and present where the pick ranks by them."""
    if signals is not None and not isinstance(signals, ExampleSignals):
        raise TypeError(f"select: signals must be a clusterlm.selection.signals.ExampleSignals or None, got "
                        f"{type(signals).__name__}.")
    if signals is not None and len(signals) != n:
        raise ValueError(f"select: signals has {len(signals)} examples, the features {n} rows; pass the signals "
                         "computed with these features.")
    if signals is None and needs_signals(s.within_cluster) and s.preset.picks != "paper":
        raise ValueError(f"select: within_cluster={s.within_cluster!r} ranks by each example's "
                         f"{SIGNAL_PICKS[s.within_cluster]}, computed with the features; select_from_features got "
                         "no signals: pass signals= (GradientFeaturizer.featurize(..., return_signals=True)), or use "
                         "select() / clusterlm select, which compute them.")


def _check_features(features: Any) -> np.ndarray:
    if hasattr(features, "detach"):
        features = features.detach().cpu().numpy()
    x = np.asarray(features)
    if x.ndim != 2 or x.dtype not in (np.float32, np.float64):
        raise ValueError(f"select: features must be a (N, d) float32/float64 array, got {x.shape} {x.dtype}.")
    return x


def kmeans_device(device: Any, kmeans_backend: str = "auto") -> torch.device | None:
    """The CUDA device the in-process K-means runs on, or None for the host.

    CUDA when ``device`` is a CUDA device and ``kmeans_backend`` is ``"cuda"``, or ``"auto"`` with the CUDA K-means
    built (:func:`cluster_kernels.has_cuda_kmeans`; without it the host's C++ path beats the float64 reference on
    the GPU). ``"cpu"`` / ``"torch"`` keep the host. An explicit ``"cuda"`` without a CUDA ``device`` asks the
    dispatcher as given (its error says what is missing).
    """
    on_gpu = device is not None and torch.device(device).type == "cuda"
    wanted = kmeans_backend == "cuda" or (kmeans_backend == "auto" and has_cuda_kmeans())
    return torch.device(device) if on_gpu and wanted else None


def _to_device(x: np.ndarray, device: torch.device) -> torch.Tensor:
    """The one host-to-device copy of the features for the CUDA K-means."""
    return torch.from_numpy(np.ascontiguousarray(x)).to(device)


def _on_host(km: Any) -> Any:
    """A K-means result whose torch fields (CUDA tensors) are numpy arrays, as the picks and the plan expect."""
    host = {f: getattr(km, f).cpu().numpy() for f in ("labels", "centroids", "distances", "sizes")
            if isinstance(getattr(km, f, None), torch.Tensor)}
    return replace(km, **host) if host else km


def _cluster(x: np.ndarray, s: ResolvedSelection, *, seed: int, max_iter: int, kmeans_backend: str,
             cluster_fn: Callable[..., Any] | None, device: torch.device | None = None) -> Any:
    """Capacity K-means on the features (or ``cluster_fn``, the distributed one); labels and distances.

    The paper preset's world size 1 clusters nothing (the authors keep all data); its ``"authors"`` clustering is
    sklearn's, on the full features in this process, also under a distributed selection (deterministic, so every
    process computes the same).
    """
    if s.preset.picks == "paper" and s.world_size == 1:
        return _one_cluster(len(x))
    if s.clustering == "authors":
        return authors_clustering(x, s.n_clusters, seed)
    if cluster_fn is not None:
        return cluster_fn(s.n_clusters, min_cluster_size=s.min_cluster_size, max_cluster_size=s.max_cluster_size,
                          n_init=s.n_init, max_iter=max_iter, seed=seed, normalize=s.normalize)
    data = x if device is None else _to_device(x, device)
    return _on_host(capacity_kmeans(data, s.n_clusters, min_size=s.min_cluster_size, max_size=s.max_cluster_size,
                                    n_init=s.n_init, max_iter=max_iter, seed=seed, backend=kmeans_backend))


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


def _paper_pick(km: Any, s: ResolvedSelection) -> _Picked:
    """The authors' step 4 (:func:`clusterlm.selection.paper.paper_picks`); world size 1 keeps every example."""
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


def _clustering_stats(km: Any, s: ResolvedSelection) -> dict[str, Any]:
    """Which clustering ran and whether the 1.5 N / K cap bound (``Plan.stats["clustering"]``)."""
    sizes = np.bincount(np.asarray(km.labels, dtype=np.int64), minlength=s.n_clusters)
    if s.world_size == 1:
        return {"method": "none (world size 1)", "cap": None, "cap_bound": False}
    if s.clustering == "authors":
        return {"method": "authors: sklearn KMeans(n_init=10) + greedy soft cap", "cap": km.cap,
                "cap_bound": km.cap_bound, "sizes_before_cap": km.sizes_before_cap}
    bound = bool(s.max_cluster_size is not None and sizes.max() >= s.max_cluster_size)
    return {"method": "exact: capacity K-means", "cap": s.max_cluster_size, "cap_bound": bound}


def _pick(x: np.ndarray, km: Any, s: ResolvedSelection, lengths: np.ndarray, *, seed: int,
          signals: ExampleSignals | None = None) -> _Picked:
    """Step 3: the per-cluster count, the picks in every cluster, token rebalancing."""
    if s.preset.picks == "paper":
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
        return [pick_in_cluster(mem, dist, min(depth, len(mem)), method=s.within_cluster, features=x, rng=rng,
                                signals=signals) for mem in members]

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


def _even_groups(groups: list[np.ndarray], per_cluster: int, sizes: np.ndarray,
                 s: ResolvedSelection) -> list[np.ndarray]:
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


def _assemble_plan(km: Any, s: ResolvedSelection, picked: _Picked, lengths: np.ndarray, *, seed: int,
                   config: dict[str, Any], timings: dict[str, float], fingerprint: Mapping[str, Any] | None,
                   model_id: str, signals: ExampleSignals | None = None) -> Plan:
    """Step 4: weights, rank lists and visit orders, statistics, the Plan (with the signals, when given)."""
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
                "min_size": s.min_cluster_size, "max_size": s.max_cluster_size},
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
        grad_norms=None if signals is None else signals.grad_norm,
        losses=None if signals is None else signals.loss,
    )


# ---------------------------------------------------------------------------------------------------
# The whole method
# ---------------------------------------------------------------------------------------------------


def build_featurizer(model: Any, s: ResolvedSelection, config: SelectConfig, *, dtype: Any = None) -> Any:
    """The :class:`clusterlm.GradientFeaturizer` that :func:`select` uses for the resolved settings ``s``."""
    if s.features == "paper":
        # The paper normalises in the selection step (only when world_size > 1); keep raw features here.
        return GradientFeaturizer(model, features="paper", seed=s.seed, dtype=dtype, normalize=False,
                                  feature_tokens=s.feature_tokens)
    return GradientFeaturizer(model, features=s.features, dim=config.dim, seed=s.seed, dtype=dtype, normalize=True,
                              feature_tokens=s.feature_tokens)


def feature_settings(s: ResolvedSelection, config: SelectConfig) -> dict[str, Any]:
    """What decides a selection's features besides the model and the data (the key of a reusable feature store;
    ``signals``: the store keeps each example's gradient norm and loss, so a store of an older clusterlm, which has
    none, is not reused)."""
    return {"features": s.features, "dim": config.dim, "seed": s.seed, "feature_tokens": s.feature_tokens,
            "signals": 1}


def check_store_signals(signals: ExampleSignals | None, s: ResolvedSelection, store: Any) -> None:
    """Refuse a signal pick on a feature store an older clusterlm wrote (it has no signals), naming the fix.

    Raises:
        ValueError: ``signals`` is None and ``s.within_cluster`` ranks by them.
    """
    if signals is None and needs_signals(s.within_cluster) and s.preset.picks != "paper":
        where = getattr(store, "path", store)
        raise ValueError(f"select: within_cluster={s.within_cluster!r} ranks by each example's "
                         f"{SIGNAL_PICKS[s.within_cluster]}, which the feature store {where} does not hold (an older "
                         "clusterlm wrote it); give another --feature-store directory (or delete this one) so that "
                         "the features are computed again with their signals.")


def featurizer_record(featurizer: Any, s: ResolvedSelection) -> dict[str, Any]:
    """What a plan records of the features (``Plan.config["features"]``)."""
    return featurizer.config() | {"layers_preset": s.features if isinstance(s.features, str) else list(s.features)}


def select(
    model: Any,
    dataset: Any,
    config: SelectConfig | None = None,
    *,
    feature_store: Any = None,
    progress: bool = True,
    dtype: Any = None,
    model_id: str | None = None,
    return_features: bool = False,
    **overrides: Any,
) -> Plan | tuple[Plan, np.ndarray]:
    """Select what every rank trains on: the whole CluSTER method in one call.

    Args:
        model: a Hugging Face causal LM (optionally PEFT-wrapped) on the device to featurize on.
        dataset: tokenised examples: a :class:`clusterlm.data.SFTDataset` or a sequence of dicts with
            ``input_ids`` and ``labels`` (-100 on prompt tokens).
        config: the selection settings (:class:`clusterlm.SelectConfig`: world size, budget, preset, features,
            clustering, picks, ...); ``overrides`` (any of its fields, e.g. ``world_size=4, ratio=0.31``) are
            applied on top.
        feature_store: a directory or :class:`clusterlm.FeatureStore`: features are written there shard
            by shard, and a rerun after a crash resumes.
        progress: progress bars.
        dtype: autocast dtype for the forward (e.g. ``torch.bfloat16`` on GPU); None: the model's own.
        model_id: recorded in the plan (default: :func:`clusterlm.models.compute_model_id`, the id the trainers
            check).
        return_features: also return the (N, d) float32 features.

    Returns:
        The :class:`Plan` (and the features when ``return_features``).

    Raises:
        ValueError / TypeError: bad settings (named, with the fix; all checked before any feature is
            computed); malformed examples (named by index).
    """
    config = (config or SelectConfig()).replace(**overrides)
    n = len(dataset)
    s = config.resolve(n, lengths_of(dataset) if n else None)
    featurizer = build_featurizer(model, s, config, dtype=dtype)
    t0 = time.perf_counter()
    feats, signals = featurizer.featurize(dataset, batch_tokens=config.batch_tokens or featurizer.auto_batch_tokens(),
                                          store=feature_store, progress=progress, return_signals=True)
    timings = {"features": time.perf_counter() - t0}
    check_store_signals(signals, s, feature_store)
    plan = select_from_features(
        feats, config, lengths=lengths_of(dataset), fingerprint=fingerprint(dataset),
        model_id=model_id or compute_model_id(model), timings=timings,
        extra_config={"features": featurizer_record(featurizer, s)}, resolved=s, device=featurizer.device,
        signals=signals,
    )
    return (plan, np.asarray(feats)) if return_features else plan

