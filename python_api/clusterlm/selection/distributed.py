"""Selection on several processes: torch.distributed setup and sharded, resumable featurization.

Launch one process per rank with torchrun (gloo on CPU, nccl on GPUs)::

    torchrun --nproc-per-node 2 my_select.py

and in each process::

    info = init_distributed()                       # env:// from torchrun's variables (clusterlm.launch.launcher)
    part = featurize_sharded(featurizer, dataset, "features/", rank=info.rank, world_size=info.world_size)
    result = distributed_capacity_kmeans(part.local(), k=info.world_size, ...)   # rows part.start:part.stop
    if is_main():
        ...                                         # write the plan once

Rank ``r`` featurizes the contiguous range ``part.shards`` of the store's shards (``shard_size`` examples
each) into the shared :class:`~clusterlm.selection.store.FeatureStore` directory; a shard is recorded only once it
is safely on disk, so a rank that dies is restarted with the same arguments and redoes only its
unfinished shards (the others' work is untouched, even while they run). With a process group, the ranks
then meet at a barrier, rank 0 assembles ``features.npy`` and every rank gets its rows as a read-only
memory map. The features are identical to a single-process ``GradientFeaturizer.featurize`` with the
same store (batches never cross a shard).

The process group (:func:`init_distributed`, :func:`barrier`, :func:`is_main`, :class:`DistInfo`) is
:mod:`clusterlm.launch.launcher`'s, the one the trainer joins too; they are importable from here as well.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from cluster_kernels.distributed import allgather_rows, distributed_capacity_kmeans, shard_rows
from clusterlm.launch.launcher import DistInfo, barrier, in_process_group, init_distributed, is_main
from clusterlm.selection.features import DEFAULT_BATCH_TOKENS, DEFAULT_SHARD_SIZE, progress_bar
from clusterlm.selection.picking import l2_normalize
from clusterlm.selection.store import FeatureStore

# DistInfo, barrier, init_distributed and is_main are clusterlm.launch.launcher's, re-exported for select scripts.
__all__ = [
    "DistInfo", "DistributedClustering", "ShardedFeatures", "barrier", "featurize_sharded", "init_distributed",
    "is_main",
]


@dataclass
class ShardedFeatures:
    """What :func:`featurize_sharded` did on this rank and where its features are.

    Attributes:
        store: the shared store.
        rank, world_size: this process's place.
        shards: the store shards this rank owns (contiguous).
        start, stop: its example rows ``[start, stop)`` (``shards`` times the shard size, cut at the end).
        n_examples: examples in the data set.
        computed: the shards this call computed (the others were already stored).
    """

    store: FeatureStore
    rank: int
    world_size: int
    shards: range
    start: int
    stop: int
    n_examples: int
    computed: list[int] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """True once ``features.npy`` holds every example (after :meth:`finalize`)."""
        return self.store.reload().complete

    def finalize(self) -> np.memmap:
        """Assemble ``features.npy`` once every rank's shards are stored (rank 0 does it after a barrier).

        Raises:
            ValueError: shards are still missing (their ranks have not finished).
        """
        return self.store.reload().finalize(self.n_examples)

    def local(self) -> np.ndarray:
        """This rank's rows ``[start, stop)``: a read-only memory map of ``features.npy`` once complete, else
        its shards concatenated in memory."""
        if self.complete:
            return self.store.features()[self.start : self.stop]
        if not len(self.shards):
            return np.zeros((0, self.store.dim), dtype=np.float32)
        return np.concatenate([self.store.read_shard(i) for i in self.shards])


def featurize_sharded(
    featurizer: Any,
    dataset: Any,
    store_dir: str | os.PathLike | FeatureStore,
    *,
    rank: int,
    world_size: int,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    progress: bool = True,
    shard_size: int | None = None,
) -> ShardedFeatures:
    """Featurize this rank's contiguous range of shards into a shared :class:`FeatureStore`; resumable.

    The store's ``n_shards = ceil(N / shard_size)`` shards are split into ``world_size`` contiguous ranges
    (:func:`cluster_kernels.distributed.shard_rows`); rank ``r`` computes the shards of its range that the
    manifest does not list yet, checking the listed ones against the data (``clusterlm.data.fingerprint``
    of the shard's examples, the scheme of ``GradientFeaturizer.featurize``). With an initialised process
    group of ``world_size`` ranks it then waits for all of them, rank 0 assembles ``features.npy`` and all
    wait again, so the returned :meth:`ShardedFeatures.local` is a memory map on every rank. Without a
    group (ranks run as separate jobs) a single process finalizes itself; otherwise call
    :meth:`ShardedFeatures.finalize` once all ranks are done.

    Args:
        featurizer: a :class:`clusterlm.selection.features.GradientFeaturizer` (anything with ``featurize``,
            ``feature_dim`` and ``config()``).
        dataset: indexable examples (``len`` and ``dataset[i]`` -> dict with ``input_ids`` and ``labels``):
            an ``SFTDataset``, a list of dicts or a ``datasets.Dataset``. Every rank passes the same data.
        store_dir: the shared store directory (or a ``FeatureStore``).
        rank, world_size: this process's rank and the number of ranks.
        batch_tokens: padded tokens per forward, as ``GradientFeaturizer.featurize``.
        progress: a bar on rank 0 showing the examples done over all ranks (read from the manifest).
        shard_size: examples per shard for a new store (default: the store's, else 1024).

    Returns:
        :class:`ShardedFeatures`.

    Raises:
        ValueError: bad rank/world size, a store of another configuration, data that differ from a stored
            shard's (the message names the shard and its examples), a process group of another size.
        TypeError: a dataset without ``len`` / indexing.
    """
    _check_sharding(dataset, rank, world_size)
    store = _open_store(store_dir, shard_size)
    n = len(dataset)
    size = store.shard_size
    first, last = shard_rows(math.ceil(n / size), world_size, rank)
    shards = range(first, last)
    start, stop = first * size, min(n, last * size)
    show = progress and rank == 0
    with progress_bar(n, show, f"featurize ({world_size} ranks)") as bar:
        bar.update(store.rows_done())

        def on_shard(_: int) -> None:
            if show:
                bar.update(store.reload().rows_done() - bar.n)

        computed = featurizer.featurize_shards(dataset, store, shards, batch_tokens=batch_tokens, progress=False,
                                               on_shard=on_shard)
    part = ShardedFeatures(store, rank, world_size, shards, start, stop, n, computed)
    if in_process_group():
        barrier()
        if rank == 0:
            part.finalize()
        barrier()
    elif world_size == 1:
        part.finalize()
    store.reload()
    return part


def _check_sharding(dataset: Any, rank: Any, world_size: Any) -> None:
    op = "featurize_sharded"
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{op}: world_size must be an int >= 1, got {world_size!r}.")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"{op}: rank must be an int in [0, {world_size}), got {rank!r}.")
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TypeError(
            f"{op}: dataset must support len() and dataset[i] (an SFTDataset, a list of dicts or a "
            f"datasets.Dataset), got {type(dataset).__name__}; materialise a stream with list(...)."
        )
    if in_process_group() and torch.distributed.get_world_size() != world_size:
        raise ValueError(
            f"{op}: world_size={world_size} but the process group has {torch.distributed.get_world_size()} ranks; "
            "pass the group's size (init_distributed().world_size)."
        )


def _open_store(store_dir: str | os.PathLike | FeatureStore, shard_size: int | None) -> FeatureStore:
    """The shared store (a new one gets ``shard_size``, default the existing store's, else 1024)."""
    if isinstance(store_dir, FeatureStore):
        return store_dir
    if shard_size is None:
        existing = FeatureStore(store_dir)
        shard_size = existing.stored_shard_size() if existing.exists else DEFAULT_SHARD_SIZE
    return FeatureStore(store_dir, shard_size=shard_size)


@dataclass
class DistributedClustering:
    """The capacity K-means of a sharded selection, as :func:`clusterlm.selection.select.select_from_features` calls it.

    Every rank holds its rows ``x_local`` (:meth:`ShardedFeatures.local`); the K-means runs distributed
    (:func:`cluster_kernels.distributed.distributed_capacity_kmeans`, k-means++ on all ``n_total`` rows so the
    result equals the single-process one) and every rank gets the labels and distances of all rows.

    Attributes:
        x_local: (rows of this rank, d) features.
        n_total: examples over all ranks.
        progress: a progress bar (rank 0).
    """

    x_local: np.ndarray
    n_total: int
    progress: bool = False

    def __call__(self, n_clusters: int, *, min_cluster_size: int | None, max_cluster_size: int | None, n_init: int,
                 max_iter: int, seed: int, normalize: bool) -> Any:
        """Cluster all rows; ``labels`` / ``distances`` for every row, ``inertia``, ``n_iter``, ``converged``."""
        x = l2_normalize(self.x_local) if normalize else self.x_local  # per row: the same as normalising globally
        res = distributed_capacity_kmeans(x, n_clusters, min_size=min_cluster_size, max_size=max_cluster_size,
                                          n_init=n_init, max_iter=max_iter, seed=seed, init_sample_size=self.n_total,
                                          progress=self.progress)
        return SimpleNamespace(labels=allgather_rows(np.asarray(res.labels, dtype=np.int64)),
                               distances=allgather_rows(np.asarray(res.distances, dtype=np.float64)),
                               inertia=res.inertia, n_iter=res.n_iter, converged=res.converged)
