"""Within-cluster picks: which members of a cluster a selection keeps, in pick order.

``"farthest"`` (the method's) keeps the members farthest from their centroid; ``"nearest"``, ``"random"``
and ``"kcenter"`` (greedy farthest-point traversal) are ablations. The others use the per-example signals that come
free with the features (:class:`clusterlm.selection.signals.ExampleSignals`; docs/selection.md weighs them against
the literature):

- ``"grad-norm"``: the largest gradient norm first (the feature's norm before normalisation; GraNd, Paul et al.
  2021);
- ``"loss"``: the largest answer-token loss first (loss-based hardness: EL2N's and IFD's numerator);
- ``"rank-farthest-loss"`` / ``"rank-farthest-grad-norm"``: a rank combination (Borda count) of the distance to the
  centroid and the loss / the gradient norm: members ordered by the sum of their two ranks, so a pick is both
  atypical for its cluster and hard, and neither criterion's extremes alone decide;
- ``"alternate-loss-farthest"``: the hardest and the farthest in turn (the hardest remaining, then the farthest
  remaining, ...): half of every prefix is the cluster's highest-loss members, half its farthest.

Every order is a ranking: a prefix of a longer pick is the shorter pick (what the token budget and the token
rebalancing rely on). Ties are broken by distance (farther first, for the combinations) and then by data-set index,
so every pick but ``"random"`` is deterministic, and ``"random"`` is under its generator's seed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from clusterlm.config.defaults import WITHIN_CLUSTER
from clusterlm.selection.signals import ExampleSignals

__all__ = ["SIGNAL_PICKS", "WITHIN_CLUSTER", "kcenter", "l2_normalize", "needs_signals", "pick_in_cluster"]

# The picks that read the per-example signals, and the signal each ranks by.
SIGNAL_PICKS = {"grad-norm": "grad_norm", "loss": "loss", "rank-farthest-loss": "loss",
                "rank-farthest-grad-norm": "grad_norm", "alternate-loss-farthest": "loss"}


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


def _descending(members: np.ndarray, score: np.ndarray) -> np.ndarray:
    """Positions of ``members`` by decreasing ``score`` (ties: the lower data-set index first)."""
    return np.lexsort((members, -score))


def _rank_combination(members: np.ndarray, d: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Positions by the sum of the farthest-first rank and the largest-signal-first rank (Borda count; ties: farther,
    then the lower index)."""
    ranks_d = np.empty(len(members), dtype=np.int64)
    ranks_d[_descending(members, d)] = np.arange(len(members))
    ranks_s = np.empty(len(members), dtype=np.int64)
    ranks_s[_descending(members, s)] = np.arange(len(members))
    return np.lexsort((members, ranks_d, ranks_d + ranks_s))


def _alternate(members: np.ndarray, d: np.ndarray, s: np.ndarray, m: int) -> np.ndarray:
    """The first ``m`` positions taking the largest-signal and the farthest member in turn (the largest signal first),
    each skipping the members already taken."""
    orders, cursor = (_descending(members, s), _descending(members, d)), [0, 0]
    taken = np.zeros(len(members), dtype=bool)
    out = []
    for turn in (k % 2 for k in range(m)):
        order = orders[turn]
        while taken[order[cursor[turn]]]:  # every order holds every member: an untaken one is ahead
            cursor[turn] += 1
        taken[order[cursor[turn]]] = True
        out.append(order[cursor[turn]])
    return np.asarray(out, dtype=np.int64)


def pick_in_cluster(
    members: np.ndarray,
    distances: np.ndarray,
    m: int,
    *,
    method: str = "farthest",
    features: np.ndarray | None = None,
    rng: np.random.Generator | None = None,
    signals: ExampleSignals | None = None,
) -> np.ndarray:
    """Choose ``m`` of one cluster's members.

    Args:
        members: (n_c,) int64 data-set indices of the cluster's members.
        distances: (N,) distance of every example to its own centroid.
        m: how many to keep (``<= n_c``).
        method: ``"farthest"`` / ``"nearest"`` from the centroid (ties by index), ``"random"`` (uniform,
            needs ``rng``), ``"kcenter"`` (greedy farthest-point traversal in feature space, needs
            ``features``; O(m n_c d)), or a pick on the signals (needs ``signals``; module docstring):
            ``"grad-norm"``, ``"loss"``, ``"rank-farthest-loss"``, ``"rank-farthest-grad-norm"``,
            ``"alternate-loss-farthest"`` (each O(n_c log n_c)).
        features: (N, d) features, for ``"kcenter"``.
        rng: numpy Generator, for ``"random"``.
        signals: every example's gradient norm and loss, for the signal picks.

    Returns:
        (m,) int64 data-set indices, in pick order.

    Raises:
        ValueError: an unknown method; a signal pick without ``signals``.
    """
    if method not in WITHIN_CLUSTER:
        raise ValueError(f"select: within_cluster must be one of {WITHIN_CLUSTER}, got {method!r}.")
    assert m <= len(members), "a cluster smaller than its pick; the caller enforces min sizes"
    members = np.asarray(members, dtype=np.int64)
    d = np.asarray(distances, dtype=np.float64)[members]
    if method == "farthest":
        return members[_descending(members, d)[:m]]
    if method == "nearest":
        return members[np.lexsort((members, d))[:m]]
    if method == "random":
        assert rng is not None
        return rng.choice(members, size=m, replace=False)  # draw order: any prefix is a uniform sample
    if method == "kcenter":
        assert features is not None
        return members[kcenter(np.asarray(features)[members], d, m)]
    if signals is None:
        raise ValueError(f"select: within_cluster={method!r} ranks by each example's {SIGNAL_PICKS[method]}, which "
                         "comes with the features; none were given (pass signals=, or select with a model).")
    s = signals.column(SIGNAL_PICKS[method])[members]
    if method in ("grad-norm", "loss"):
        order = _descending(members, s)
    elif method.startswith("rank-"):
        order = _rank_combination(members, d, s)
    else:
        order = _alternate(members, d, s, m)
    return members[order[:m]]


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (zero rows stay zero), float32 (N, d); norms computed in float64."""
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    return (x / np.where(norms > 0, norms, 1.0)).astype(np.float32)


def needs_signals(method: Any) -> bool:
    """True for a within-cluster pick that reads the per-example signals (:data:`SIGNAL_PICKS`)."""
    return method in SIGNAL_PICKS
