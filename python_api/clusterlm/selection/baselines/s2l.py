"""S2L baseline: cluster the loss trajectories of a small proxy model, sample clusters evenly.

Source: Yang, Mishra, Chiang, Mirzasoleiman, "SmallToLarge (S2L): Scalable Data Selection for
Fine-tuning Large Language Models by Summarizing Training Trajectories of Small Models", NeurIPS 2024
(arXiv:2403.07384), Algorithm 1. Small-scale re-implementation, step by step:

1. *Train a small proxy model on the full data, saving checkpoints* (Alg. 1 line 1; the paper trains
   Pythia-70M for the Pythia/Llama targets). Ours: the same family with fewer layers — the target
   model's config with ``num_hidden_layers = proxy_layers`` (default half), initialised from the
   target's embeddings, first layers, final norm and output layer (so a pre-trained target gives a
   pre-trained proxy, as the paper's pre-trained Pythia-70M), trained with the trainer's optimizer
   (:func:`clusterlm.selection.baselines._training.train_loop`) for ``proxy_epochs`` epochs; ``n_checkpoints``
   evenly spaced checkpoints.
2. *Record the per-example loss at every checkpoint* (Alg. 1 line 2: the loss trajectory
   ``L_i = (l_i^1, ..., l_i^T)``): mean answer-token loss, batched by length
   (:func:`clusterlm.selection.baselines._training.example_losses`).
3. *K-means on the trajectories* (line 3) with ``k = n_clusters`` (100, the paper's value; at most N):
   :func:`cluster_kernels.capacity_kmeans` without size bounds is plain K-means (k-means++, Lloyd).
4. *Balanced sampling, smallest cluster first* (lines 4-10): with the clusters sorted by size ascending,
   cluster ``c`` gets ``R_c = remaining_budget // remaining_clusters`` examples drawn uniformly at random
   (all of it when it is smaller). Clusters of size <= ``skip_size`` (2) are skipped (outlier
   trajectories); a shortfall left by small clusters and rounding is filled uniformly at random from the
   examples not yet taken.
   A token budget (``token_ratio`` / ``token_budget``) samples in the same spirit as a prefix: the clusters'
   members (each cluster in a seeded random order) are taken round-robin, one from every cluster per lap, the
   largest cluster first in a lap (the clusters Alg. 1 visits last get its rounding remainder), then the members
   of the skipped clusters in random order (:func:`balanced_cluster_order`). The first ``c`` of that order take
   from every cluster exactly as many as Alg. 1 with budget ``c`` (equal counts, small clusters whole); the
   token budget keeps the prefix closest to it, within one example per rank (the cluster method's rule,
   :mod:`clusterlm.selection.baselines._plans`). S2L balances example counts over clusters, not tokens.
5. The selection becomes a :class:`Plan` (weight 1 each, stratified allocation to ranks) so the same
   trainer trains it.

Selection time includes everything: the proxy's construction and training, the loss forwards at every
checkpoint, K-means and sampling (``plan.timings``).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np
import torch

from cluster_kernels import capacity_kmeans
from clusterlm.config.baselines import S2LConfig
from clusterlm.data import lengths_of
from clusterlm.plan import Plan
from clusterlm.selection.baselines._plans import make_plan, resolve_amount
from clusterlm.selection.baselines._training import (
    example_losses,
    stage,
    train_loop,
)

__all__ = ["S2LConfig", "balanced_cluster_order", "balanced_cluster_sample", "build_proxy", "s2l_plan"]

_STREAM_S2L = 0x52C1


def build_proxy(model: torch.nn.Module, n_layers: int | None = None) -> torch.nn.Module:
    """A copy of ``model`` with only its first ``n_layers`` decoder layers (default half, at least 1).

    Works for Hugging Face decoder-only models whose config has ``num_hidden_layers`` and whose layer
    parameters are named ``...layers.<i>....`` (Llama, Mistral, Qwen, GPT-NeoX style). Parameters of the
    kept layers, embeddings, final norm and output layer are copied from ``model``.

    Raises:
        ValueError: ``n_layers`` outside ``[1, num_hidden_layers]``; a config without ``num_hidden_layers``.
    """
    config = copy.deepcopy(model.config)
    total = getattr(config, "num_hidden_layers", None)
    if total is None:
        raise ValueError(f"s2l: the model config ({type(config).__name__}) has no num_hidden_layers; pass a proxy.")
    n_layers = max(1, total // 2) if n_layers is None else int(n_layers)
    if not 1 <= n_layers <= total:
        raise ValueError(f"s2l: proxy_layers must be in [1, {total}] (the model's layers), got {n_layers}.")
    config.num_hidden_layers = n_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[:n_layers]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        proxy = type(model)(config)
    state = model.state_dict()
    own = proxy.state_dict()
    missing = [k for k in own if k not in state or state[k].shape != own[k].shape]
    assert not missing, f"proxy parameters without a source in the model: {missing[:4]}"
    proxy.load_state_dict({k: state[k] for k in own})
    device = next(model.parameters()).device
    return proxy.to(device=device, dtype=next(model.parameters()).dtype)


def balanced_cluster_sample(
    labels: np.ndarray, count: int, *, seed: int = 0, skip_size: int = S2LConfig.skip_size
) -> tuple[np.ndarray, dict[str, Any]]:
    """S2L's sampling (Alg. 1 lines 4-10): clusters smallest first, ``remaining // clusters_left`` each.

    Args:
        labels: (N,) int64 cluster of every example (any non-negative ids).
        count: examples to select, ``<= N``.
        seed: seed of the random draws.
        skip_size: clusters of at most this size are skipped.

    Returns:
        ``(selected, stats)``: sorted unique int64 indices (exactly ``count``) and
        ``{"per_cluster": [[cluster, size, taken], ...] in visit order, "skipped_clusters", "filled"}``.
    """
    labels = np.asarray(labels, dtype=np.int64)
    rng = np.random.default_rng(np.random.SeedSequence([seed, _STREAM_S2L]))
    ids, sizes = np.unique(labels, return_counts=True)
    order = np.lexsort((ids, sizes))  # size ascending, ties by cluster id
    visit = [(int(ids[j]), int(sizes[j])) for j in order if sizes[j] > skip_size]
    skipped = int(len(ids) - len(visit))
    taken: list[np.ndarray] = []
    per_cluster = []
    remaining = count
    for pos, (c, size) in enumerate(visit):
        share = remaining // (len(visit) - pos)
        members = np.flatnonzero(labels == c)
        take = members if size <= share else rng.choice(members, size=share, replace=False)
        taken.append(np.asarray(take, dtype=np.int64))
        per_cluster.append([c, size, len(take)])
        remaining -= len(take)
    selected = np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)
    filled = 0
    if remaining > 0:  # small clusters and rounding leave some budget: fill it uniformly at random
        rest = np.setdiff1d(np.arange(len(labels), dtype=np.int64), selected)
        extra = rng.choice(rest, size=remaining, replace=False)
        selected = np.concatenate([selected, extra])
        filled = int(remaining)
    selected = np.sort(selected)
    assert len(selected) == count and len(np.unique(selected)) == count
    return selected, {"per_cluster": per_cluster, "skipped_clusters": skipped, "filled": filled}


def _visit_order(labels: np.ndarray, skip_size: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Cluster ids and sizes, and Alg. 1's visit order: positions of the clusters above ``skip_size``, smallest
    first (ties by id)."""
    ids, sizes = np.unique(labels, return_counts=True)
    order = np.lexsort((ids, sizes))
    return ids, sizes, [int(j) for j in order if sizes[j] > skip_size]


def balanced_cluster_order(
    labels: np.ndarray, *, seed: int = 0, skip_size: int = S2LConfig.skip_size
) -> np.ndarray:
    """S2L's sampling as an order (module docstring, step 4): every prefix is a balanced sample.

    Args:
        labels: (N,) int64 cluster of every example (any non-negative ids).
        seed: seed of the random order within clusters and of the skipped clusters' members.
        skip_size: clusters of at most this size come last (Alg. 1 skips them and fills from them).

    Returns:
        (N,) int64, a permutation of ``arange(N)``: round-robin over the clusters above ``skip_size`` (largest
        first in a lap), then the skipped clusters' members in random order. Its first ``c`` take from each of
        those clusters as many as :func:`balanced_cluster_sample` with ``count = c``.
    """
    labels = np.asarray(labels, dtype=np.int64)
    rng = np.random.default_rng(np.random.SeedSequence([seed, _STREAM_S2L, 1]))
    ids, _, visit = _visit_order(labels, skip_size)
    lap_position = np.full(len(ids), -1, dtype=np.int64)
    lap_position[visit[::-1]] = np.arange(len(visit))  # Alg. 1 visits the largest last: they get the remainder
    cluster = np.searchsorted(ids, labels)
    within = np.zeros(len(labels), dtype=np.int64)  # each example's lap: its rank in its cluster's random order
    for j in visit:
        members = np.flatnonzero(cluster == j)
        within[rng.permutation(members)] = np.arange(len(members))
    kept = np.flatnonzero(lap_position[cluster] >= 0)
    kept = kept[np.lexsort((lap_position[cluster[kept]], within[kept]))]  # lap by lap, in lap order
    rest = rng.permutation(np.flatnonzero(lap_position[cluster] < 0))
    return np.concatenate([kept, rest]).astype(np.int64)


def _sample_stats(labels: np.ndarray, selected: np.ndarray, skip_size: int) -> dict[str, Any]:
    """:func:`balanced_cluster_sample`'s statistics of a selection (per visited cluster, skipped, filled)."""
    ids, sizes, visit = _visit_order(labels, skip_size)
    taken = np.bincount(np.searchsorted(ids, labels[selected]), minlength=len(ids))
    per_cluster = [[int(ids[j]), int(sizes[j]), int(taken[j])] for j in visit]
    return {"per_cluster": per_cluster, "skipped_clusters": int(len(ids) - len(visit)),
            "filled": int(len(selected) - sum(t for _, _, t in per_cluster))}


def s2l_plan(
    model: torch.nn.Module,
    dataset: Any,
    world_size: int,
    ratio: float | None = None,
    budget: int | None = None,
    config: S2LConfig | None = None,
    *,
    token_ratio: float | None = None,
    token_budget: int | None = None,
    model_id: str = "",
    trajectories: np.ndarray | None = None,
    **overrides: Any,
) -> Plan:
    """The S2L selection (module docstring), as a plan.

    Args:
        model: the target model (Hugging Face causal LM); the proxy is derived from it, it is not changed.
        dataset: tokenised examples (:class:`clusterlm.data.SFTDataset` or example dicts).
        world_size: ranks K.
        ratio / budget: fraction or number of examples; rounded down to a multiple of K.
        config: the settings (:class:`S2LConfig`); ``overrides`` (any of its fields, e.g. ``n_clusters=50,
            lr=1e-3``) are applied on top.
        token_ratio / token_budget: fraction or number of tokens (prompt + answer) instead of ratio / budget: a
            prefix of :func:`balanced_cluster_order`, within one example per rank (``stats["token_budget"]``).
            Exactly one of the four.
        model_id: recorded in the plan.
        trajectories: (N, T) precomputed loss trajectories (skips steps 1-2; for tests and reuse).

    Returns:
        The :class:`Plan`; ``config["method"] == "s2l"``, ``timings`` with ``proxy_train``, ``losses``,
        ``kmeans``, ``sample`` and ``selection`` (the total).

    Raises:
        ValueError: not exactly one budget, a bad budget / world size / proxy_layers, or ``trajectories`` of the
            wrong shape.
        TypeError: an unknown setting (the message lists the settings).
    """
    c = S2LConfig.merged(config, overrides)
    t0 = time.perf_counter()
    n = len(dataset)
    lengths = lengths_of(dataset)
    amount = resolve_amount(lengths, world_size, ratio, budget, token_ratio, token_budget, "s2l_plan")
    timings: dict[str, float] = {}
    if trajectories is None:
        trajectories = _loss_trajectories(model, dataset, c, timings)
    traj = np.asarray(trajectories, dtype=np.float64)
    if traj.ndim != 2 or traj.shape[0] != n:
        raise ValueError(f"s2l_plan: trajectories must have shape (N={n}, T), got {traj.shape}.")
    k = min(int(c.n_clusters), n)
    with stage(timings, "kmeans"):
        result = capacity_kmeans(np.ascontiguousarray(traj), k, seed=c.seed, n_init=3)
    labels = np.asarray(result.labels, dtype=np.int64)
    with stage(timings, "sample"):
        if amount.count is not None:  # Alg. 1 as published
            selected, sample_stats = balanced_cluster_sample(labels, amount.count, seed=c.seed, skip_size=c.skip_size)
            stats = dict(amount.stats)
        else:
            order = balanced_cluster_order(labels, seed=c.seed, skip_size=c.skip_size)
            selected, stats = amount.take(order, lengths, world_size)
            sample_stats = _sample_stats(labels, selected, c.skip_size)
    stats.update(sample_stats)
    stats["trajectory_length"] = int(traj.shape[1])
    record = {"method": "s2l", **amount.record, "n_clusters": k, "skip_size": int(c.skip_size),
              "proxy_layers": c.proxy_layers, "proxy_epochs": int(c.proxy_epochs),
              "n_checkpoints": int(c.n_checkpoints), "lr": float(c.lr), "micro_batch_size": int(c.micro_batch_size),
              "source": "Yang et al., SmallToLarge (S2L), NeurIPS 2024, Algorithm 1"}
    return make_plan(dataset, selected, world_size, seed=c.seed, config=record, stats=stats, timings=timings, t0=t0,
                     model_id=model_id, token_balance=c.token_balance)


def _loss_trajectories(model: torch.nn.Module, dataset: Any, c: S2LConfig, timings: dict[str, float]) -> np.ndarray:
    """Steps 1-2: train the proxy, recording every example's loss at each checkpoint; (N, T) float64."""
    n = len(dataset)
    with stage(timings, "proxy_build"):
        proxy = build_proxy(model, c.proxy_layers)
    cols: list[np.ndarray] = []
    steps_total = c.proxy_epochs * -(-n // c.micro_batch_size)
    marks = sorted({max(1, round(steps_total * (j + 1) / c.n_checkpoints)) for j in range(c.n_checkpoints)})

    def record(step: int, mean_lr: float, optimizer: Any) -> None:
        with stage(timings, "losses"):
            cols.append(example_losses(proxy, dataset, batch_tokens=c.batch_tokens, autocast_dtype=c.autocast_dtype))

    t_train = time.perf_counter()
    train_loop(proxy, dataset, np.arange(n), c.proxy_training(marks), on_checkpoint=record)
    timings["proxy_train"] = time.perf_counter() - t_train - timings.get("losses", 0.0)
    return np.stack(cols, axis=1)
