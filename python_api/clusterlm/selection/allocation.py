"""Allocation of selected examples to ranks, and the order in which each rank visits them.

Two allocations:

- ``"cluster-per-rank"`` (the method's): every rank trains on whole clusters, ``clusters_per_rank``
  each. With one cluster per rank, cluster ``k`` goes to rank ``k``; with more, clusters are dealt
  longest-processing-time first (the cluster with the most selected tokens to the rank with the
  fewest tokens that still has a free slot), so rank token totals come out as even as whole clusters
  allow.
- ``"stratified"``: every rank gets a proportional share of every cluster. Each cluster's selected
  examples are dealt to ranks in a snake (0, 1, .., K-1, K-1, .., 0, ..) after sorting them by
  length, and a cluster's remainder goes to the ranks next in turn across clusters, so every rank receives
  the same count (or one more) and almost the same tokens from every cluster.

Token totals. Whole clusters can differ in length (a cluster of long functions): with
``token_balance=True`` and one or more clusters per rank, :func:`rebalance_tokens` exchanges some of a
cluster's last picks (the least far of its farthest examples) for its next candidates in pick order,
moving every rank's total towards the mean; per-cluster counts, and so all weights, are unchanged.

Every rank gets exactly the same number of examples (DDP steps in lock-step); the callers make the
total divisible by the world size.

Visit order. With ``token_balance=True`` rank ``r``'s ``j``-th example is the ``pi(j)``-th longest of
its list, for one random permutation ``pi`` shared by all ranks: at every position the ranks hold
examples of the same length quantile, so any micro-batch of positions has similar token counts on
every rank (the per-step max/mean ratio is what :meth:`clusterlm.plan.Plan.step_token_ratio`
reports), while the order within a rank is still random, not a length curriculum. A
:class:`clusterlm.plan.sampler.PlanSampler` that reshuffles per epoch permutes positions with one shared
permutation, which keeps this alignment. Without token balancing each rank's list is shuffled
independently (what a ``DistributedSampler`` over the rank's examples would do).

Weights. :func:`selection_weights` gives example ``i`` of cluster ``c`` the weight ``(n_c / N) * (S / s_c)``
(``n_c`` the cluster's size, ``S`` the number selected, ``s_c`` the number selected from ``c``): ``K n_k / N``
with one cluster per rank, mean 1 over the selection, so the weighted mean loss estimates the full-data mean
gradient by cluster. Allocation never changes a cluster's count, so the weights hold for any allocation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from clusterlm.config.defaults import ALLOCATIONS

__all__ = [
    "ALLOCATIONS",
    "BALANCE_BATCH_SIZES",
    "allocate",
    "balance_stats",
    "cluster_owners",
    "rebalance_tokens",
    "selection_weights",
    "visit_order",
]

# Statistics of per-step token balance are reported for these micro-batch sizes.
BALANCE_BATCH_SIZES = (1, 4, 16)


def cluster_owners(groups: Sequence[np.ndarray], world_size: int, lengths: np.ndarray) -> list[int]:
    """The rank that trains each cluster (cluster-per-rank allocation; see the module docstring)."""
    owners = [0] * len(groups)
    for r, cs in enumerate(_deal_clusters(groups, world_size, lengths)):
        for c in cs:
            owners[c] = r
    return owners


def _deal_clusters(groups: Sequence[np.ndarray], world_size: int, lengths: np.ndarray) -> list[list[int]]:
    """Which clusters each rank trains on (cluster-per-rank allocation)."""
    n_clusters = len(groups)
    per_rank = n_clusters // world_size
    if per_rank == 1:
        return [[r] for r in range(world_size)]
    tokens = np.array([int(lengths[g].sum()) for g in groups], dtype=np.int64)
    order = sorted(range(n_clusters), key=lambda c: (-tokens[c], c))
    owned: list[list[int]] = [[] for _ in range(world_size)]
    load = np.zeros(world_size, dtype=np.int64)
    for c in order:
        open_ranks = [r for r in range(world_size) if len(owned[r]) < per_rank]
        r = min(open_ranks, key=lambda q: (load[q], q))
        owned[r].append(c)
        load[r] += tokens[c]
    return [sorted(o) for o in owned]


def _stratify(groups: Sequence[np.ndarray], world_size: int, lengths: np.ndarray) -> list[np.ndarray]:
    """Deal each cluster's examples over the ranks: full laps in a snake order of decreasing length, then the
    cluster's remainder (``len(g) mod world_size`` examples, the shortest) to the next ranks of a pointer that runs
    on across clusters. So every rank gets ``len(g) // world_size`` or one more of every cluster, and the extras
    even out over the clusters (the callers make the total a multiple of the world size)."""
    dealt: list[list[int]] = [[] for _ in range(world_size)]
    nxt = 0  # the rank that takes the next remainder example
    for g in groups:
        by_len = g[np.lexsort((g, -lengths[g]))]
        laps = len(by_len) // world_size
        for pos, idx in enumerate(by_len[: laps * world_size]):
            lap, off = divmod(pos, world_size)
            dealt[off if lap % 2 == 0 else world_size - 1 - off].append(int(idx))
        for idx in by_len[laps * world_size:]:
            dealt[nxt].append(int(idx))
            nxt = (nxt + 1) % world_size
    return [np.asarray(d, dtype=np.int64) for d in dealt]


def allocate(
    groups: Sequence[np.ndarray],
    world_size: int,
    lengths: np.ndarray,
    *,
    allocation: str = "cluster-per-rank",
    owners: Sequence[int] | None = None,
) -> list[np.ndarray]:
    """Split selected examples into ``world_size`` equally long per-rank lists (unordered).

    Args:
        groups: per cluster, the int64 indices of its selected examples.
        world_size: number of ranks K.
        lengths: (N,) int64 tokens per example of the whole data set.
        allocation: ``"cluster-per-rank"`` (needs ``len(groups)`` a multiple of K and equal group sizes)
            or ``"stratified"`` (needs the total a multiple of K).
        owners: for ``"cluster-per-rank"``, the rank of every cluster (default :func:`cluster_owners`).

    Returns:
        K int64 arrays of equal length.

    Raises:
        ValueError: unknown allocation, or group sizes that cannot give every rank the same count.
    """
    if allocation not in ALLOCATIONS:
        raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}.")
    total = sum(len(g) for g in groups)
    if allocation == "stratified":
        if total % world_size:
            raise ValueError(
                f"allocation='stratified': {total} selected examples cannot be split evenly over {world_size} "
                "ranks; select a multiple of the world size."
            )
        return _stratify(groups, world_size, lengths)
    if len(groups) % world_size or len({len(g) for g in groups}) > 1:
        raise ValueError(
            f"allocation='cluster-per-rank' needs a multiple of world_size={world_size} clusters of equal "
            f"selected size, got {len(groups)} clusters of sizes {[len(g) for g in groups][:8]}."
        )
    owners = cluster_owners(groups, world_size, lengths) if owners is None else owners
    owned = [[c for c in range(len(groups)) if owners[c] == r] for r in range(world_size)]
    return [np.concatenate([groups[c] for c in cs]).astype(np.int64) for cs in owned]


def visit_order(
    rank_lists: Sequence[np.ndarray], lengths: np.ndarray, *, token_balance: bool = True, seed: int = 0
) -> list[np.ndarray]:
    """Order each rank's list for training (see the module docstring).

    Args:
        rank_lists: K int64 arrays of equal length m.
        lengths: (N,) tokens per example.
        token_balance: align length quantiles across ranks (one shared random permutation of positions)
            instead of independent shuffles.
        seed: seed of the permutations.

    Returns:
        K int64 arrays, each a permutation of the corresponding input.
    """
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x7A1A]))
    if not token_balance:
        return [r[rng.permutation(len(r))] for r in rank_lists]
    m = len(rank_lists[0]) if rank_lists else 0
    shared = rng.permutation(m)
    out = []
    for r in rank_lists:
        by_len = r[np.lexsort((r, -lengths[r]))]  # longest first, ties by index: deterministic
        out.append(by_len[shared])
    return out


def _swap_towards(group: np.ndarray, pool: np.ndarray, n_free: int, lengths: np.ndarray, excess: float
                  ) -> tuple[np.ndarray, np.ndarray, int]:
    """Swap examples of ``group[-n_free:]`` with ones of ``pool`` to change the group's tokens by ``-excess``.

    Pairs the longest outgoing with the shortest incoming examples (or the reverse to add tokens) until
    the cumulative change reaches ``excess``; the last swap is then chosen among the remaining pairs to
    land as close to ``excess`` as one swap can. Returns the new group, the new pool and the swaps made.
    """
    if n_free == 0 or len(pool) == 0 or excess == 0:
        return group, pool, 0
    sign = 1.0 if excess > 0 else -1.0
    fixed, free = group[: len(group) - n_free], group[len(group) - n_free :]
    out_order = free[np.lexsort((free, -sign * lengths[free]))]  # to cut tokens: longest out first
    in_order = pool[np.lexsort((pool, sign * lengths[pool]))]  # ... and shortest in first
    k_max = min(len(out_order), len(in_order))
    gain = sign * (lengths[out_order[:k_max]] - lengths[in_order[:k_max]]).astype(np.float64)
    useful = int(np.argmax(gain <= 0)) if (gain <= 0).any() else k_max  # pairs that still help
    cum = np.cumsum(gain[:useful])
    target = abs(excess)
    k = int(np.searchsorted(cum, target))  # cum[k-1] < target <= cum[k]
    if k >= useful:  # not enough room: take every helpful swap
        n_sw = useful
        outs, ins = out_order[:n_sw], in_order[:n_sw]
    else:
        before = cum[k - 1] if k > 0 else 0.0
        rest = target - before
        # choose the k-th swap among the remaining pairs: the one whose gain is closest to what is left
        rem_out, rem_in = out_order[k:], in_order[k:]
        rem_in = rem_in[np.argsort(lengths[rem_in], kind="stable")]
        in_len = lengths[rem_in].astype(np.float64)
        want = lengths[rem_out].astype(np.float64) - sign * rest  # incoming length giving the exact gain
        pos = np.clip(np.searchsorted(in_len, want), 1, len(in_len) - 1) if len(in_len) > 1 else np.zeros(
            len(want), dtype=np.int64)
        cand = np.stack([pos - (len(in_len) > 1), pos])  # the neighbours around the wanted length
        miss = np.abs(in_len[cand] - want[None, :])
        which = np.argmin(miss, axis=0)
        j_out = int(np.argmin(miss[which, np.arange(len(want))]))
        j_in = int(cand[which[j_out], j_out])
        if miss[which[j_out], j_out] < rest:  # the extra swap improves on stopping here
            outs = np.concatenate([out_order[:k], rem_out[j_out : j_out + 1]])
            ins = np.concatenate([in_order[:k], rem_in[j_in : j_in + 1]])
        else:
            outs, ins = out_order[:k], in_order[:k]
        n_sw = len(outs)
    if n_sw == 0:
        return group, pool, 0
    out_set, in_set = set(outs.tolist()), set(ins.tolist())
    new_free = np.array([i for i in free if i not in out_set] + ins.tolist(), dtype=np.int64)
    new_pool = np.array([i for i in pool if i not in in_set] + outs.tolist(), dtype=np.int64)
    return np.concatenate([fixed, new_free]), new_pool, n_sw


def rebalance_tokens(
    groups: Sequence[np.ndarray],
    pools: Sequence[np.ndarray],
    owners: Sequence[int],
    lengths: np.ndarray,
    world_size: int,
    n_free: Sequence[int],
) -> tuple[list[np.ndarray], dict[str, object]]:
    """Equalise the ranks' token totals by swapping boundary picks for near-boundary alternatives.

    Cluster ``c``'s pick ``groups[c]`` is in pick order (e.g. farthest first); its last ``n_free[c]``
    members may be exchanged with members of ``pools[c]`` (the next candidates in pick order, not
    selected). Swaps stay inside a cluster, so every ``s_c`` (and every weight) is unchanged; only which
    near-boundary examples are taken changes. Each rank moves towards the mean rank total.

    Returns:
        The new groups (same sizes) and statistics (swaps per cluster, rank totals before and after).
    """
    groups = [np.asarray(g, dtype=np.int64) for g in groups]
    pools = [np.asarray(p, dtype=np.int64) for p in pools]
    totals = np.zeros(world_size, dtype=np.float64)
    for c, g in enumerate(groups):
        totals[owners[c]] += lengths[g].sum()
    before = totals.astype(np.int64).tolist()
    target = totals.mean()
    swaps = [0] * len(groups)
    for r in range(world_size):
        for c in [c for c in range(len(groups)) if owners[c] == r]:
            excess = totals[r] - target
            old = lengths[groups[c]].sum()
            groups[c], pools[c], swaps[c] = _swap_towards(groups[c], pools[c], int(n_free[c]), lengths, excess)
            totals[r] += lengths[groups[c]].sum() - old
    return groups, {"swaps_per_cluster": swaps, "rank_tokens_before": before,
                    "rank_tokens_after": totals.astype(np.int64).tolist()}


def balance_stats(rank_lists: Sequence[np.ndarray], lengths: np.ndarray) -> dict[str, Any]:
    """Token totals per rank and per-step max/mean token ratios at :data:`BALANCE_BATCH_SIZES` (plan stats)."""
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


# ---- weights ----------------------------------------------------------------------------------------


def selection_weights(
    labels: np.ndarray | Sequence[int], selected: np.ndarray | Sequence[int], n_clusters: int
) -> np.ndarray:
    """Per-example weights ``w_i = (n_c / N') * (S / s_c)`` of a selection drawn from clusters.

    ``n_c`` is the size of cluster ``c``, ``s_c`` the number of examples selected from it, ``S = sum s_c``.
    ``N'`` is the total size of the clusters that have at least one selected example; it equals ``N``
    whenever every cluster is represented (the method's case). A cluster with nothing selected cannot be
    represented, so it gets no weight and the others are renormalised over ``N'``, which keeps the mean
    weight over the selection exactly 1 (the plan invariant).

    Args:
        labels: (N,) integer cluster of every example, each in ``[0, n_clusters)``. For a selection
            without clustering pass zeros and ``n_clusters=1`` (every selected weight is then 1).
        selected: a boolean mask of shape (N,) or the integer indices of the selected examples (unique).
        n_clusters: number of clusters C (clusters may be empty).

    Returns:
        (N,) float64: the weight of every selected example, 0 elsewhere; mean over the selection is 1.

    Raises:
        ValueError: labels out of range or not 1-D, a mask of the wrong length, indices out of range
            or repeated, an empty selection.
    """
    if isinstance(n_clusters, bool) or not isinstance(n_clusters, (int, np.integer)) or n_clusters < 1:
        raise ValueError(f"selection_weights: n_clusters must be a positive int, got {n_clusters!r}.")
    labels = np.asarray(labels)
    if labels.ndim != 1 or not (np.issubdtype(labels.dtype, np.integer) or labels.size == 0):
        raise ValueError(
            f"selection_weights: labels must be a 1-D integer array, got shape {labels.shape} dtype {labels.dtype}."
        )
    labels = labels.astype(np.int64)
    n = len(labels)
    if n and (labels.min() < 0 or labels.max() >= n_clusters):
        raise ValueError(
            f"selection_weights: labels must lie in [0, {n_clusters}), got values in [{labels.min()}, "
            f"{labels.max()}]; for a selection without clustering pass zeros and n_clusters=1."
        )
    mask = _selection_mask(selected, n, "selection_weights: selected")
    if not mask.any():
        raise ValueError("selection_weights: the selection is empty; select at least one example.")
    sizes = np.bincount(labels, minlength=n_clusters).astype(np.float64)
    chosen = np.bincount(labels[mask], minlength=n_clusters).astype(np.float64)
    represented = chosen > 0
    total = float(chosen.sum())
    per_cluster = np.zeros(n_clusters, dtype=np.float64)
    per_cluster[represented] = (sizes[represented] / sizes[represented].sum()) * (total / chosen[represented])
    weights = np.zeros(n, dtype=np.float64)
    weights[mask] = per_cluster[labels[mask]]
    return weights


def _selection_mask(selected: Any, n: int, what: str) -> np.ndarray:
    sel = np.asarray(selected)
    if sel.dtype == np.bool_:
        if sel.shape != (n,):
            raise ValueError(f"{what}: a boolean mask must have shape ({n},), got {sel.shape}.")
        return sel.copy()
    if sel.ndim != 1 or not (np.issubdtype(sel.dtype, np.integer) or sel.size == 0):
        raise ValueError(f"{what}: expected a boolean mask or 1-D integer indices, got shape {sel.shape} {sel.dtype}.")
    sel = sel.astype(np.int64)
    if sel.size and (sel.min() < 0 or sel.max() >= n):
        raise ValueError(f"{what}: indices must lie in [0, {n}), got values in [{sel.min()}, {sel.max()}].")
    mask = np.zeros(n, dtype=bool)
    mask[sel] = True
    if int(mask.sum()) != sel.size:
        raise ValueError(f"{what}: indices must be unique, got {sel.size - int(mask.sum())} repeated.")
    return mask
