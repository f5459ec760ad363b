"""Competitors ("anchors") for the capacity-constrained K-means benchmarks, and the data they run on.

Every method has one signature::

    run_<method>(x, k, max_size, *, n_init, max_iter, seed) -> MethodResult

``x`` is a float32 ``(n, d)`` numpy array, ``max_size`` the per-cluster capacity (ignored by the
unconstrained methods), and the returned ``MethodResult`` holds the int64 labels ``(n,)``, the
centroids ``(k, d)`` the method reports (the ones its labels were assigned to), the wall-clock
seconds of the method alone (imports, data generation and quality metrics are outside the timer)
and a dict of method-specific facts. A few take one extra keyword: ``n_jobs``
(k-means-constrained), ``subsample`` (faiss), ``cap_factor`` (the CluSTER recipe). ``METHODS``
maps the names used on the command line of ``compare_kmeans.py`` to these functions.

All quality numbers come from one helper, :func:`quality`, so the methods are measured the same
way: inertia against the method's own centroids, and inertia after recomputing the cluster means
(the fair comparison when a method does not refit its centroids, like the CluSTER recipe).

``python benchmarks/kmeans_anchors.py --self-check`` checks the vectorised greedy re-assignment
against a plain loop that walks the pair list one pair at a time.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
from scipy import sparse

SIZE_RATIO = 4.0  # largest / smallest mixture component
SEPARATION = 4.0  # mean distance between component centres, in noise standard deviations
RECIPE_N_INIT = 10  # the CluSTER authors' KMeans restarts
RECIPE_MAX_ITER = 300  # scikit-learn's default, which the authors keep
RECIPE_N_NEAREST = 8  # centroids listed per point in the authors' greedy walk

# ----------------------------------------------------------------------------------------------
# data


def component_sizes(n: int, k: int = 8, size_ratio: float = SIZE_RATIO) -> np.ndarray:
    """Sizes of ``k`` mixture components summing to ``n``, geometric from largest to smallest.

    Component ``i`` gets a share proportional to ``size_ratio ** (-i / (k - 1))``, so the largest is
    ``size_ratio`` times the smallest (up to rounding). For k=8 and ratio 4 the largest holds
    about 1.8 N/K points, so the CluSTER recipe's 1.5 N/K cap is exceeded and its re-assignment runs.

    Returns:
        int64 array ``(k,)``, non-increasing, summing to ``n`` (largest-remainder rounding).
    """
    share = size_ratio ** (-np.arange(k) / max(k - 1, 1))
    exact = n * share / share.sum()
    sizes = np.floor(exact).astype(np.int64)
    # Largest remainder, ties to the lower index, so the rounding is deterministic.
    short = n - int(sizes.sum())
    sizes[np.argsort(-(exact - sizes), kind="stable")[:short]] += 1
    return sizes


def gaussian_mixture(
    n: int, d: int = 128, k: int = 8, seed: int = 0, *, size_ratio: float = SIZE_RATIO, separation: float = SEPARATION
) -> np.ndarray:
    """Isotropic Gaussian mixture with unequal component sizes, rows in random order.

    Each component has unit variance per coordinate; centres are N(0, s^2 I) with
    ``s = separation / sqrt(2 d)``, so two centres are on average ``separation`` noise standard
    deviations apart. Values are O(1), where k-means-constrained's integer costs
    (Euclidean distance x 1000, rounded) are accurate, so that anchor is not handicapped by scale.

    Args:
        n, d, k: points, dimension, components.
        seed: the only source of randomness; the same arguments give bit-identical data.
        size_ratio: largest / smallest component size (see :func:`component_sizes`).
        separation: mean centre distance in noise standard deviations.

    Returns:
        float32 array ``(n, d)``.
    """
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((k, d)) * (separation / math.sqrt(2 * d))
    component = np.repeat(np.arange(k), component_sizes(n, k, size_ratio))
    rng.shuffle(component)
    x = rng.standard_normal((n, d), dtype=np.float32)
    x += centres.astype(np.float32)[component]
    return x


def capacity(n: int, k: int, factor: float) -> int:
    """``ceil(factor * n / k)`` computed exactly (``factor`` read as the decimal it prints as)."""
    return math.ceil(Fraction(str(factor)) * n / k)


# ----------------------------------------------------------------------------------------------
# quality, measured the same way for every method


def inertia(x: np.ndarray, labels: np.ndarray, centroids: np.ndarray, chunk: int = 32768) -> float:
    """Sum of squared Euclidean distances of each point to the centroid of its cluster (fp64)."""
    c = np.asarray(centroids, dtype=np.float64)
    total = 0.0
    for start in range(0, len(x), chunk):
        diff = x[start : start + chunk].astype(np.float64) - c[labels[start : start + chunk]]
        total += float(np.einsum("ij,ij->", diff, diff))
    return total


def cluster_means(x: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    """Mean of each cluster ``(k, d)`` in fp64 (zeros for an empty cluster, which no point uses)."""
    counts = np.bincount(labels, minlength=k).astype(np.float64)
    # A one-hot matrix product is a fixed-order, any-k way to sum rows per label.
    onehot = sparse.csr_matrix((np.ones(len(labels)), (labels, np.arange(len(labels)))), shape=(k, len(labels)))
    sums = np.asarray(onehot @ x.astype(np.float64))
    return sums / np.maximum(counts, 1.0)[:, None]


def quality(x: np.ndarray, labels: np.ndarray, centroids: np.ndarray | None, k: int, max_size: int) -> dict[str, Any]:
    """Quality of one clustering, identical for every method.

    Returns:
        dict with ``inertia`` (against the method's own centroids; the cluster means when it
        reports none), ``inertia_refit`` (against the cluster means of its labels), ``sizes``
        (list of k ints), ``max_size``/``min_size`` and ``capacity_met`` (largest cluster
        <= ``max_size``).
    """
    labels = np.asarray(labels, dtype=np.int64)
    if labels.shape != (len(x),) or labels.min() < 0 or labels.max() >= k:
        raise ValueError(f"quality: labels must be ({len(x)},) in [0, {k}); got {labels.shape}")
    means = cluster_means(x, labels, k)
    sizes = np.bincount(labels, minlength=k)
    return {
        "inertia": inertia(x, labels, means if centroids is None else centroids),
        "inertia_refit": inertia(x, labels, means),
        "sizes": [int(s) for s in sizes],
        "max_size": int(sizes.max()),
        "min_size": int(sizes.min()),
        "capacity_met": bool(sizes.max() <= max_size),
    }


# ----------------------------------------------------------------------------------------------
# the CluSTER authors' greedy soft-cap re-assignment (docs/design.md section 1)


def _nearest_pairs(dist: np.ndarray, n_nearest: int) -> tuple[np.ndarray, np.ndarray]:
    """Each point's ``n_nearest`` centroids (ascending distance, ties by centroid index) and the
    position of every (point, centroid) pair in the global walk order."""
    n, k = dist.shape
    m = min(n_nearest, k)
    nearest = np.argsort(dist, axis=1, kind="stable")[:, :m]
    pair_dist = np.take_along_axis(dist, nearest, axis=1)
    # Pairs are listed point-major, then sorted by distance with a stable sort: ties keep
    # (point index, rank) order, as a stable sort of the authors' pair list does.
    order = np.argsort(pair_dist.ravel(), kind="stable")
    position = np.empty(n * m, dtype=np.int64)
    position[order] = np.arange(n * m)
    return nearest, position.reshape(n, m)


def _take_leftovers(dist: np.ndarray, labels: np.ndarray, room: np.ndarray) -> None:
    """Points still unassigned (label -1), in index order, take their nearest centroid with room."""
    for i in np.flatnonzero(labels < 0):
        open_dist = np.where(room > 0, dist[i], np.inf)
        c = int(np.argmin(open_dist))
        labels[i] = c
        room[c] -= 1


def greedy_capacity_assign(
    dist: np.ndarray, max_size: int | np.ndarray, n_nearest: int = RECIPE_N_NEAREST
) -> np.ndarray:
    """The CluSTER recipe's greedy re-assignment of points to fixed centroids under a cap.

    Semantics (docs/design.md section 1): for every point its ``min(n_nearest, k)`` nearest centroids;
    all (point, centroid) pairs sorted by distance ascending (stable); walking that list, an
    unassigned point takes the centroid if it still has room; points left over take the nearest
    centroid with room, in index order.

    The walk is sequential, but its result only depends on when each centroid fills up. This
    computes it in at most k+1 vectorised rounds: given the fill positions known so far, every point
    takes its first pair whose centroid is not yet full at that position; among the centroids that
    would then receive more than ``max_size`` points, the one that fills earliest has its fill
    position fixed (the walk agrees with this simulation up to that position); repeat until no
    centroid overflows. ``_greedy_capacity_assign_loop`` is the literal walk, used to check this.

    Args:
        dist: ``(n, k)`` distances of points to centroids (any monotone distance gives the same result).
        max_size: capacity per centroid, int or int array ``(k,)``; ``sum >= n``.
        n_nearest: pairs listed per point (the authors use 8).

    Returns:
        int64 labels ``(n,)``.

    Raises:
        ValueError: when the capacities cannot hold ``n`` points.
    """
    n, k = dist.shape
    cap = np.broadcast_to(np.asarray(max_size, dtype=np.int64), (k,)).copy()
    if cap.sum() < n:
        raise ValueError(f"greedy_capacity_assign: capacities sum to {cap.sum()} < n={n}")
    nearest, position = _nearest_pairs(dist, n_nearest)
    # Walk position of the pair that fills each centroid; a zero-capacity centroid is full from the start.
    full_at = np.where(cap > 0, np.iinfo(np.int64).max, -1)
    rows = np.arange(n)
    for _ in range(k + 1):  # every round fixes one centroid's fill position, so k+1 rounds suffice
        valid = position <= full_at[nearest]
        has = valid.any(axis=1)
        first = valid.argmax(axis=1)  # within a row, positions increase with rank
        take = nearest[rows, first]
        when = position[rows, first]
        take_has, when_has = take[has], when[has]
        counts = np.bincount(take_has, minlength=k)
        over = np.flatnonzero(counts > cap)
        if over.size == 0:
            break
        fills = np.array([np.partition(when_has[take_has == c], cap[c] - 1)[cap[c] - 1] for c in over])
        c_first = over[np.argmin(fills)]
        full_at[c_first] = fills.min()
    else:
        raise RuntimeError("greedy_capacity_assign: no fixed point after k+1 rounds (a bug)")
    labels = np.where(has, take, -1).astype(np.int64)
    if not has.all():
        room = cap - np.bincount(labels[has], minlength=k)
        _take_leftovers(dist, labels, room)
    return labels


def _greedy_capacity_assign_loop(dist: np.ndarray, max_size: int | np.ndarray, n_nearest: int = 8) -> np.ndarray:
    """Literal pair-by-pair walk of :func:`greedy_capacity_assign` (the reference it is checked against)."""
    n, k = dist.shape
    room = np.broadcast_to(np.asarray(max_size, dtype=np.int64), (k,)).copy()
    nearest, position = _nearest_pairs(dist, n_nearest)
    m = nearest.shape[1]
    order = np.argsort(position.ravel())
    labels = np.full(n, -1, dtype=np.int64)
    for q in order.tolist():
        i, c = divmod(q, m)[0], int(nearest.flat[q])
        if labels[i] < 0 and room[c] > 0:
            labels[i] = c
            room[c] -= 1
    _take_leftovers(dist, labels, room)
    return labels


@dataclass
class MethodResult:
    """What every benchmarked method returns.

    Attributes:
        labels: int64 ``(n,)``.
        centroids: ``(k, d)`` centroids the labels were assigned to, or None (quality then uses means).
        seconds: wall-clock seconds of the method alone.
        info: method-specific facts (iterations, whether the recipe's re-assignment ran, ...).
    """

    labels: np.ndarray
    centroids: np.ndarray | None
    seconds: float
    info: dict[str, Any] = field(default_factory=dict)


def cluster_greedy_recipe(
    x: np.ndarray,
    k: int,
    cap_factor: float = 1.5,
    seed: int = 0,
    *,
    max_size: int | None = None,
    n_init: int = RECIPE_N_INIT,
    max_iter: int = RECIPE_MAX_ITER,
    n_nearest: int = RECIPE_N_NEAREST,
) -> MethodResult:
    """The CluSTER authors' clustering step, exactly as docs/design.md section 1 describes it.

    scikit-learn ``KMeans(k, init="k-means++", n_init=10)`` (``max_iter``, ``tol`` at sklearn's
    defaults, as the authors leave them). If its largest cluster exceeds ``cap_factor N / K``, a
    fresh KMeans is fitted (same constructor arguments, so with the same ``seed`` sklearn
    reproduces the first fit; its cost is paid again, as in the authors' code) and its points are
    greedily re-assigned under the cap ``ceil(cap_factor N / K)`` by :func:`greedy_capacity_assign`
    (the ``min(8, k)`` nearest centroids of every point, Euclidean distances from
    ``KMeans.transform``). Centroids are not refitted: the returned centroids are the fresh KMeans'
    ones, and inertia is measured against them.

    Args:
        x: float32 ``(n, d)``.
        k: clusters (the authors' K = world size).
        cap_factor: the soft cap in units of N/K (1.5 in the authors' code).
        seed: ``random_state`` of both KMeans fits.
        max_size: when given, replaces both the threshold ``cap_factor N / K`` and the cap.
        n_init, max_iter: KMeans settings (authors: 10 restarts, sklearn's default 300 iterations).
        n_nearest: centroids listed per point in the greedy walk (authors: 8).

    Returns:
        MethodResult; ``info`` says whether the re-assignment ran and the largest cluster before it.
    """
    from sklearn.cluster import KMeans

    n = len(x)
    # The authors test "largest > 1.5 N / K" (a real number), then cap at its ceiling.
    threshold = Fraction(str(cap_factor)) * n / k if max_size is None else Fraction(int(max_size))
    cap = capacity(n, k, cap_factor) if max_size is None else int(max_size)
    t0 = time.perf_counter()
    first = KMeans(n_clusters=k, init="k-means++", n_init=n_init, max_iter=max_iter, random_state=seed).fit(x)
    largest = int(np.bincount(first.labels_, minlength=k).max())
    if largest <= threshold:
        seconds = time.perf_counter() - t0
        info = {"reassigned": False, "largest_before": largest, "cap": cap, "n_iter": int(first.n_iter_)}
        return MethodResult(first.labels_.astype(np.int64), first.cluster_centers_, seconds, info)
    fresh = KMeans(n_clusters=k, init="k-means++", n_init=n_init, max_iter=max_iter, random_state=seed).fit(x)
    labels = greedy_capacity_assign(fresh.transform(x), cap, n_nearest=n_nearest)
    seconds = time.perf_counter() - t0
    info = {"reassigned": True, "largest_before": largest, "cap": cap, "n_iter": int(fresh.n_iter_)}
    return MethodResult(labels, fresh.cluster_centers_, seconds, info)


# ----------------------------------------------------------------------------------------------
# the methods, one signature


def run_ours(x: np.ndarray, k: int, max_size: int, *, n_init: int, max_iter: int, seed: int) -> MethodResult:
    """``cluster_kernels.capacity_kmeans`` on the C++/OpenMP backend (k-means++ init, default tol)."""
    from cluster_kernels import capacity_kmeans

    t0 = time.perf_counter()
    res = capacity_kmeans(x, k, max_size=max_size, n_init=n_init, max_iter=max_iter, seed=seed, backend="cpu")
    seconds = time.perf_counter() - t0
    info = {"n_iter": int(res.n_iter), "converged": bool(res.converged), "reported_inertia": float(res.inertia)}
    return MethodResult(np.asarray(res.labels, dtype=np.int64), np.asarray(res.centroids), seconds, info)


def run_kmeans_constrained(
    x: np.ndarray, k: int, max_size: int, *, n_init: int, max_iter: int, seed: int, n_jobs: int = 1
) -> MethodResult:
    """k-means-constrained's ``KMeansConstrained`` (min-cost flow per assignment step, same cap).

    ``n_jobs`` runs its restarts in parallel processes: its only way to use more than one core.
    joblib's memory-mapping of large arguments is turned off for it: k-means-constrained writes into
    its input, which fails on joblib's read-only memmaps ("buffer source array is read-only").
    """
    import joblib
    from k_means_constrained import KMeansConstrained

    t0 = time.perf_counter()
    model = KMeansConstrained(
        n_clusters=k,
        size_min=None,
        size_max=max_size,
        n_init=n_init,
        max_iter=max_iter,
        random_state=seed,
        n_jobs=n_jobs,
    )
    with joblib.parallel_config(max_nbytes=None):
        model.fit(x)
    seconds = time.perf_counter() - t0
    info = {"n_iter": int(model.n_iter_), "n_jobs": n_jobs}
    return MethodResult(np.asarray(model.labels_, dtype=np.int64), model.cluster_centers_, seconds, info)


def run_faiss(
    x: np.ndarray, k: int, max_size: int, *, n_init: int, max_iter: int, seed: int, subsample: bool = False
) -> MethodResult:
    """faiss-cpu ``Kmeans`` (unconstrained): training plus the search that labels every point.

    faiss always runs ``niter`` iterations (no convergence test) and by default trains on at most
    256 points per centroid (2 048 for K=8). ``subsample=False`` raises that limit so it clusters
    all n points, the same work as the other methods; ``subsample=True`` keeps faiss's default.
    """
    import faiss

    xc = np.ascontiguousarray(x, dtype=np.float32)
    kwargs: dict[str, Any] = {"niter": max_iter, "nredo": n_init, "seed": seed, "verbose": False}
    if not subsample:
        kwargs["max_points_per_centroid"] = -(-len(x) // k) + 1
    t0 = time.perf_counter()
    km = faiss.Kmeans(x.shape[1], k, **kwargs)
    km.train(xc)
    _, labels = km.index.search(xc, 1)
    seconds = time.perf_counter() - t0
    info = {"n_iter": max_iter, "trained_on": min(len(x), k * km.cp.max_points_per_centroid)}
    return MethodResult(labels[:, 0].astype(np.int64), km.centroids, seconds, info)


def run_faiss_default(x: np.ndarray, k: int, max_size: int, *, n_init: int, max_iter: int, seed: int) -> MethodResult:
    """faiss with its default training subsample (256 points per centroid); see :func:`run_faiss`."""
    return run_faiss(x, k, max_size, n_init=n_init, max_iter=max_iter, seed=seed, subsample=True)


def run_sklearn(x: np.ndarray, k: int, max_size: int, *, n_init: int, max_iter: int, seed: int) -> MethodResult:
    """scikit-learn ``KMeans`` (Lloyd, k-means++ init, unconstrained)."""
    from sklearn.cluster import KMeans

    t0 = time.perf_counter()
    model = KMeans(n_clusters=k, n_init=n_init, max_iter=max_iter, random_state=seed).fit(x)
    seconds = time.perf_counter() - t0
    return MethodResult(model.labels_.astype(np.int64), model.cluster_centers_, seconds, {"n_iter": int(model.n_iter_)})


def run_cluster_recipe(
    x: np.ndarray, k: int, max_size: int, *, n_init: int, max_iter: int, seed: int, cap_factor: float | None = None
) -> MethodResult:
    """:func:`cluster_greedy_recipe` with the cap ``ceil(cap_factor N/K)`` (and the authors' test
    ``largest > cap_factor N/K``) when ``cap_factor`` is given, else with ``max_size`` for both.
    ``n_init``/``max_iter`` are ignored: the recipe keeps the authors' own settings (10 restarts,
    sklearn's default 300 iterations).

    Raises:
        ValueError: when ``max_size`` is not ``ceil(cap_factor N/K)``.
    """
    if cap_factor is None:
        return cluster_greedy_recipe(x, k, seed=seed, max_size=max_size)
    if capacity(len(x), k, cap_factor) != max_size:
        raise ValueError(f"run_cluster_recipe: max_size={max_size} is not ceil({cap_factor} N/K)")
    return cluster_greedy_recipe(x, k, cap_factor, seed)


@dataclass(frozen=True)
class Method:
    """A benchmarked method: its runner, whether it honours ``max_size``, and a table label."""

    run: Callable[..., MethodResult]
    constrained: bool
    label: str
    module: str  # the import that must succeed for the method to run


METHODS: dict[str, Method] = {
    "ours": Method(run_ours, True, "ours: capacity_kmeans (CPU)", "cluster_kernels"),
    "k-means-constrained": Method(run_kmeans_constrained, True, "k-means-constrained (MCF)", "k_means_constrained"),
    "cluster-recipe": Method(run_cluster_recipe, True, "CluSTER recipe: sklearn n_init=10 + greedy cap", "sklearn"),
    "faiss": Method(run_faiss, False, "faiss-cpu Kmeans, all points (unconstrained)", "faiss"),
    "faiss-default": Method(run_faiss_default, False, "faiss-cpu Kmeans, default subsample (unconstrained)", "faiss"),
    "sklearn": Method(run_sklearn, False, "scikit-learn KMeans (unconstrained)", "sklearn"),
}


# ----------------------------------------------------------------------------------------------
# self-check


def _self_check(trials: int = 300) -> None:
    """The vectorised greedy walk equals the literal loop (random and tied distances, m < k, caps)."""
    rng = np.random.default_rng(0)
    for t in range(trials):
        n, k = int(rng.integers(1, 300)), int(rng.integers(1, 12))
        dist = rng.integers(0, 4, size=(n, k)).astype(float) if t % 2 else rng.random((n, k))
        cap = rng.integers(0, n + 1, size=k)
        cap[rng.integers(k)] += max(0, n - int(cap.sum()))  # make the caps feasible
        m = int(rng.integers(1, k + 1))
        fast, slow = greedy_capacity_assign(dist, cap, m), _greedy_capacity_assign_loop(dist, cap, m)
        assert np.array_equal(fast, slow), f"trial {t}: n={n} k={k} m={m}"
        assert (np.bincount(fast, minlength=k) <= cap).all()
    print(f"greedy_capacity_assign: vectorised == loop on {trials} random instances")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--self-check", action="store_true", help="check the vectorised greedy walk")
    if parser.parse_args().self_check:
        _self_check()
