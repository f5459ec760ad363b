"""Within-cluster picks: which members of a cluster a selection keeps, in pick order.

``"farthest"`` (the method's) keeps the members farthest from their centroid; ``"nearest"``, ``"random"``
and ``"kcenter"`` (greedy farthest-point traversal) are ablations. Ties are broken by data-set index so a
pick is deterministic.
"""

from __future__ import annotations

import numpy as np

from clusterlm.config.defaults import WITHIN_CLUSTER

__all__ = ["WITHIN_CLUSTER", "kcenter", "l2_normalize", "pick_in_cluster"]



def kcenter(x: np.ndarray, dist: np.ndarray, m: int) -> np.ndarray:
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
    return members[kcenter(np.asarray(features)[members], d, m)]


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (zero rows stay zero), float32 (N, d); norms computed in float64."""
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    return (x / np.where(norms > 0, norms, 1.0)).astype(np.float32)
