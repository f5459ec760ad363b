"""The authors' selection, step by step: what ``preset="paper"`` runs by default (``clustering="authors"``).

Source: kaist-dmlab/CluSTER, ``src/CluSTER/call_back.py`` (commit 802b136): the callback
``PruneAndClusteringinwithMeanCallback.on_train_begin``, which calls ``_kmeans_prune_equalize_interleave``,
which calls ``kmeans_soft_cap_fit_predict`` when a cluster is too large. Each step below names the lines it
follows. On the same features this module selects the same examples with the same weights as their code
(``tests/clusterlm/test_paper_preset.py`` checks it against an independent transcription of theirs).

1. Features: the proxy ``mean_t (p_t(y_t) - 1) h_t`` over answer tokens (``jvp_proxy_raw``), normalised with
   ``F.normalize`` when the world size is above 1 (``jvp_proxy_normalized``; ``remove_mean`` is switched off
   for ``ws > 1``) — :func:`normalize_rows`. With world size 1 their code keeps every example with weight 1
   (the ``world_size <= 1`` early return): no selection.
2. K-means: ``sklearn.cluster.KMeans(n_clusters=K, n_init=10, random_state=seed)`` (``max_iter`` 300, the
   default) on float32 features, with ``seed = args.seed + epoch`` (42 at the first epoch: :data:`PAPER_SEED`);
   the distance of every example is the float32 squared distance to its centre (the second, winning
   definition of ``_pairwise_sqdist_to_centers``) — :func:`sklearn_kmeans`, :func:`sqdist_to_assigned`.
3. Soft cap, only when ``max(sizes) > sum(sizes) * 1.5 / K``: their code fits the same ``KMeans`` again (same
   data, same ``random_state``: the same centres, so the first fit is reused here), then ``cap =
   ceil(1.5 N / K)``; every point's ``min(8, K)`` nearest centres (``argpartition`` + ``argsort`` in chunks of
   20 000 rows, squared distances as ``|x|^2 + |c|^2 - 2 x.c`` in float32); all (point, candidate) pairs sorted
   by distance with a stable mergesort; greedily, a point takes its candidate while that centre has room;
   left-over points (possible only for K > 8) take their nearest centre with room over all K; a last-resort
   pass without the cap (unreachable with a 1.5 cap, kept for fidelity). Distances are then taken to the
   *uncapped* centres, with no refit — :func:`soft_cap_assign`.
4. Picks: per cluster, members sorted by distance ascending (Python's stable sort: ties keep index order);
   ``m = min(sizes)``, ``m_adj = m * pct // 100`` with the ratio as an integer percentage (their ``--ratio``);
   ``--prune close`` (the README's setting) keeps ``lst[-m_adj:]``, the ``m_adj`` farthest (among equal
   distances the higher index wins) — :func:`paper_picks`.
5. Rank weight ``K * n_k / N`` with the post-cap sizes (``rank_weights`` in ``on_train_begin``); cluster ``k``
   trains on rank ``k``.

Their known bugs are not copied:

- ``m_adj = 0`` makes ``lst[-0:]`` keep every example of every cluster; here it raises with a message.
- With ``dataloader_drop_last`` their count is rounded down to a multiple of ``per_device_batch * world_size``;
  it is off by default and not reproduced.
- Their sampler interleaves the clusters (position ``p`` holds cluster ``p mod K``) and relies on
  accelerate's sharding to send position ``p`` to rank ``p mod K``; with a per-device batch size above 1
  accelerate shards whole batches, so rank ``k`` no longer trains on cluster ``k``. Here cluster ``k`` is
  always rank ``k``'s list (:class:`clusterlm.plan.sampler.PlanSampler`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from clusterlm.config.defaults import PAPER_CAP, PAPER_N_INIT, PAPER_SEED
from clusterlm.config.selection import paper_percentage

__all__ = [
    "PAPER_CAP",
    "PAPER_N_INIT",
    "PAPER_SEED",
    "AuthorsClustering",
    "authors_clustering",
    "normalize_rows",
    "paper_percentage",
    "paper_picks",
    "sklearn_kmeans",
    "soft_cap_assign",
    "sqdist_to_assigned",
]

PAPER_MAX_ITER = 300  # sklearn's default, and what their refit passes
PAPER_TOPK = 8  # nearest centres per point considered by the greedy pass
CHUNK_ROWS = 20_000  # their distance chunk; kept so float32 BLAS results are computed on the same blocks


def normalize_rows(x: np.ndarray) -> np.ndarray:
    """``torch.nn.functional.normalize(x, dim=1)`` in float32: ``x / max(|x|, 1e-12)`` per row."""
    return torch.nn.functional.normalize(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), dim=1).numpy()


def sklearn_kmeans(x: np.ndarray, k: int, seed: int) -> Any:
    """Their ``KMeans(n_clusters=k, n_init=10, random_state=seed)``, fitted on float32 ``x``.

    Raises:
        ImportError: scikit-learn is missing (the message names the install).
    """
    try:
        from sklearn.cluster import KMeans
    except ImportError as e:  # an optional dependency of this preset only
        raise ImportError(
            "select: preset='paper' runs the authors' K-means (scikit-learn), which is not installed: "
            "pip install 'scikit-learn>=1.4' (or pip install 'cluster-kernels[paper]'), or pass "
            "clustering='exact' to use this library's capacity K-means instead."
        ) from e
    km = KMeans(n_clusters=k, n_init=PAPER_N_INIT, random_state=seed, max_iter=PAPER_MAX_ITER, init="k-means++")
    km.fit(np.asarray(x, dtype=np.float32))
    return km


def sqdist_to_assigned(x: np.ndarray, centers: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Float32 squared distance of every row to its assigned centre (their ``_pairwise_sqdist_to_centers``)."""
    diff = np.asarray(x, dtype=np.float32) - np.asarray(centers, dtype=np.float32)[np.asarray(labels, np.int32)]
    return np.einsum("nd,nd->n", diff, diff).astype(np.float32)


def _sqdist_block(xb: np.ndarray, centers: np.ndarray) -> np.ndarray:
    """(M, K) float32 squared distances ``|x|^2 + |c|^2 - 2 x.c``, the expansion their greedy pass uses."""
    x2 = np.sum(xb * xb, axis=1, keepdims=True)
    c2 = np.sum(centers * centers, axis=1, keepdims=True).T
    return x2 + c2 - 2.0 * (xb @ centers.T)


def _nearest_centres(x: np.ndarray, centers: np.ndarray, topk: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the ``topk`` nearest centres in ascending distance, and those distances (float32)."""
    n = len(x)
    idx_out = np.empty((n, topk), dtype=np.int32)
    dist_out = np.empty((n, topk), dtype=np.float32)
    for s in range(0, n, CHUNK_ROWS):
        e = min(n, s + CHUNK_ROWS)
        dist = _sqdist_block(x[s:e], centers)
        idx = np.argpartition(dist, kth=topk - 1, axis=1)[:, :topk]
        near = np.take_along_axis(dist, idx, axis=1)
        order = np.argsort(near, axis=1)
        idx_out[s:e] = np.take_along_axis(idx, order, axis=1)
        dist_out[s:e] = np.take_along_axis(near, order, axis=1)
    return idx_out, dist_out


def soft_cap_assign(x: np.ndarray, centers: np.ndarray, cap: int, topk: int = PAPER_TOPK) -> np.ndarray:
    """Their greedy capped re-assignment to fixed centres (step 3 of the module docstring); int32 labels."""
    x = np.asarray(x, dtype=np.float32)
    centers = np.asarray(centers, dtype=np.float32)
    n, k = len(x), len(centers)
    topk = min(int(topk), k)
    near_idx, near_dist = _nearest_centres(x, centers, topk)
    labels = np.full(n, -1, dtype=np.int32)
    counts = np.zeros(k, dtype=np.int64)
    # Pairs (point, candidate rank) in row-major order, then stably sorted by distance.
    order = np.argsort(near_dist.reshape(-1), kind="mergesort")
    left = n
    for point, cand in zip((order // topk).tolist(), (order % topk).tolist(), strict=True):
        if labels[point] != -1:
            continue
        centre = near_idx[point, cand]
        if counts[centre] < cap:
            labels[point] = centre
            counts[centre] += 1
            left -= 1
            if left == 0:
                break
    if left:  # their fallback: the nearest centre with room over all K, points in index order
        rest = np.flatnonzero(labels == -1)
        for s in range(0, len(rest), CHUNK_ROWS):
            ids = rest[s : s + CHUNK_ROWS]
            ranked = np.argsort(_sqdist_block(x[ids], centers), axis=1)
            for row, point in enumerate(ids.tolist()):
                for centre in ranked[row].tolist():
                    if counts[centre] < cap:
                        labels[point] = centre
                        counts[centre] += 1
                        left -= 1
                        break
    if left:  # their last resort (unreachable with a 1.5 cap): the nearest centre, ignoring the cap
        rest = np.flatnonzero(labels == -1)
        labels[rest] = np.argmin(_sqdist_block(x[rest], centers), axis=1).astype(np.int32)
    return labels


@dataclass
class AuthorsClustering:
    """The result of :func:`authors_clustering`, shaped like :class:`cluster_kernels.KMeansResult`.

    ``labels`` int64 (N,); ``distances`` float32 (N,) squared distances to the (uncapped) centres;
    ``cap_bound``: the largest sklearn cluster exceeded ``1.5 N / K``, so the soft cap re-assigned points;
    ``sizes_before_cap``: sklearn's cluster sizes.
    """

    labels: np.ndarray
    distances: np.ndarray
    centroids: np.ndarray
    inertia: float
    n_iter: int
    converged: bool
    cap: int
    cap_bound: bool
    sizes_before_cap: list[int] = field(default_factory=list)


def authors_clustering(x: np.ndarray, k: int, seed: int) -> AuthorsClustering:
    """Steps 2-3 of the module docstring on (already normalised) float32 features ``x`` (N, d)."""
    x = np.asarray(x, dtype=np.float32)
    n = len(x)
    km = sklearn_kmeans(x, k, seed)
    centers = km.cluster_centers_.astype(np.float32)
    labels = km.labels_.astype(np.int32)
    sizes = np.bincount(labels, minlength=k)
    cap = int(np.ceil(PAPER_CAP * (n / k)))  # their (1 + eps) * (N / K) with eps = 0.5
    bound = bool(sizes.max() > sizes.sum() * PAPER_CAP / k)
    if bound:
        labels = soft_cap_assign(x, centers, cap)
    dist = sqdist_to_assigned(x, centers, labels)
    return AuthorsClustering(
        labels=labels.astype(np.int64), distances=dist, centroids=centers, inertia=float(dist.astype(np.float64).sum()),
        n_iter=int(km.n_iter_), converged=int(km.n_iter_) < PAPER_MAX_ITER, cap=cap, cap_bound=bound,
        sizes_before_cap=sizes.astype(int).tolist(),
    )


def paper_picks(labels: np.ndarray, distances: np.ndarray, k: int, pct: int) -> tuple[list[np.ndarray], int]:
    """Step 4: per cluster the ``m * pct // 100`` farthest members (ties: higher index), and that count.

    Raises:
        ValueError: the count is 0 (their code would keep every example instead).
    """
    labels = np.asarray(labels)
    sizes = np.bincount(labels, minlength=k)
    m = int(sizes.min())
    count = m * int(pct) // 100
    if count < 1:
        raise ValueError(
            f"select: preset='paper' keeps smallest cluster {m} x {pct} // 100 = 0 examples per cluster (the "
            "authors' code would then keep every example); raise the ratio or use preset='default'."
        )
    picks = []
    for c in range(k):
        members = np.flatnonzero(labels == c)
        ascending = members[np.argsort(np.asarray(distances)[members], kind="stable")]
        picks.append(ascending[-count:][::-1].copy())  # farthest first (pick order)
    return picks, count
