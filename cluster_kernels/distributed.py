r"""Capacity-constrained K-means over ``torch.distributed`` ranks, streaming each rank's shard in chunks.

What every rank holds
---------------------
Rank ``r`` passes its contiguous row block ``x_local`` of the global data: rows ``[offset_r, offset_r +
n_r)``, the offsets being the prefix sums of the block sizes in rank order. The block is read
``chunk_rows`` rows at a time into reused buffers (:mod:`cluster_kernels._shard`): rows of a ``np.memmap``
come from its file through ``preadv`` (no page of the map stays resident; without a file the map is read
and its pages handed back with ``MADV_DONTNEED``), so ``n x d`` may exceed memory. Per local point a rank
keeps its row of the float64 cost matrix (``8 k`` bytes), its label and a few auction scalars: the
``(n_r, k)`` block of the global ``(n, k)`` matrix, as the single-process path keeps the whole matrix.

The algorithm is the one of :mod:`cluster_kernels.kmeans` (its float64 reference), run globally:

* **Init**: greedy k-means++ (the reference's draws from the splitmix64 stream) on a sample gathered once:
  ``init_sample_size`` rows whose global indices are
  ``sorted(numpy.random.default_rng(seed).choice(n, size, replace=False))`` — every rank draws the same
  indices and contributes the rows it holds, so the sample depends on the data, ``seed`` and the size,
  never on the number of ranks. When the size is ``>= n`` the sample is the whole data set in order and
  the init is the single-process one. Rank 0 seeds, then broadcasts the centroids.
* **Lloyd iteration** (:mod:`cluster_kernels._dist_lloyd`): one pass over the chunks computes the
  distances (centred float64, ``|x|^2 - 2 x.c + |c|^2`` as the reference) into the rank's cost block; the
  eviction auction assigns; a second pass sums each cluster's rows; the ``K x d`` float64 sums and the
  ``K`` counts are all-reduced. Empty clusters are re-seeded at the globally farthest point, as the
  reference.
* **Auction**: the C++ auction of the single-process path (``cluster_kernels._C.auction_block``,
  csrc/cpu/auction.cpp and its files), written once for one process and for one rank of many. Prices, counts, eps and
  dummy units are global — every rank computes the same values from all-reduced counts — and argmins,
  regrets, gaps and re-bids are local. A round needs, per over-full cluster, the ``excess`` members with
  the smallest ``(regret, global index)``; each rank cuts its members to its ``excess`` smallest and
  :func:`cluster_kernels._collectives.select` finds the global threshold (while a rank still holds more
  than ``GATHER_LIMIT`` candidates, the weighted median of the ranks' local quantile guesses is taken as
  pivot and the candidates on its wrong side dropped — one ``world x G x 3`` all-gather and one
  ``G``-count all-reduce per step; the survivors are all-gathered). A reverse step (a price drop that
  pulls ``r`` points into an under-full cluster) is the same selection over the gaps of every point. On
  one process the auction exchanges nothing and is exactly the one of ``capacity_kmeans``.

Equality with the single-process K-means
----------------------------------------
The decisions are the reference's; the float64 numbers behind them differ only in rounding: the mean
and the centroid sums are all-reduced (another summation order than one process), distances come from
chunked matrix products and row norms from ``einsum``. So centroids agree with
``capacity_kmeans(x, ..., backend="torch")`` to ~1e-12 relative, and labels are identical unless two
decisions are within rounding of a tie (duplicated points, regrets equal to ~1e-13). The tests check
identical labels on 1, 2 and 3 gloo processes, float32 and float64, exact balance, a 1.5 N/K cap and both
bounds, against the torch reference and the C++ path.

Communication per Lloyd iteration: ``K * d + K`` float64 all-reduced for the centroid update, ``K``
int64 counts per auction round or reverse step, and per selection step ``world * G * 3`` int64 gathered
plus ``G`` counts reduced (``G`` = clusters being cut); see ``docs/scaling.md``. Threads: the matrix
products run in torch and the auction in OpenMP, both with ``torch.get_num_threads()`` threads.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cluster_kernels import _backend, _collectives
from cluster_kernels._checks import bounds, check_int, check_k, check_metric, check_tol, working_frame
from cluster_kernels._collectives import GATHER_LIMIT, I64_MAX, OP, allgather_rows, shard_rows  # noqa: F401
from cluster_kernels._dist_lloyd import Lloyd, init_sample, progress
from cluster_kernels._shard import Shard, trim_heap
from cluster_kernels.kmeans import KMeansResult
from cluster_kernels.kmeans_reference import SplitMix64, kmeans_plusplus, run_seed

__all__ = ["DistributedKMeansResult", "allgather_rows", "distributed_capacity_kmeans", "shard_rows"]

CHUNK_BYTES = 8 << 20  # default float64 bytes of one chunk of prepared rows
SAMPLE_PER_CLUSTER = 256  # default k-means++ sample: this many rows per cluster (faiss's training default)
# GATHER_LIMIT (re-exported above) is read by cluster_kernels._collectives.select: change it there.


@dataclass
class DistributedKMeansResult(KMeansResult):
    """:class:`~cluster_kernels.kmeans.KMeansResult` of this rank's rows, plus where they sit globally.

    ``labels`` and ``distances`` cover the local rows only; ``centroids``, ``sizes``, ``inertia``,
    ``history``, ``n_iter`` and ``converged`` are global and identical on every rank.

    Attributes:
        offset: global index of the first local row.
        n_total: number of rows over all ranks.
        stats: measurements of the run: ``iteration_s`` (wall seconds per Lloyd iteration of the best
            run), ``rounds`` (auction rounds per iteration), ``collectives`` / ``comm_bytes`` (per iteration,
            this rank), ``init_s``, ``prepare_s``, ``finish_s``, ``total_s``, ``world_size``, ``chunk_rows``,
            ``init_sample_size``.
    """

    offset: int = 0
    n_total: int = 0
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Setup:
    """The checked arguments, identical on every rank."""

    k: int
    lo: np.ndarray
    hi: np.ndarray
    sizes: np.ndarray  # rows of every rank, in rank order
    offset: int
    chunk_rows: int
    init_sample_size: int
    init: torch.Tensor | None  # explicit initial centroids, float64 (caller's frame, then the working frame)

    @property
    def n_total(self) -> int:
        return int(self.sizes.sum())


def _as_local_array(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{OP}: x_local must be float32 or float64, got dtype {x.dtype}; convert it with .float().")
        return x.detach().cpu().numpy()
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{OP}: x_local must be a numpy array, np.memmap or CPU tensor, got {type(x).__name__}.")
    if x.dtype not in (np.float32, np.float64):
        raise TypeError(
            f"{OP}: x_local must be float32 or float64, got dtype {x.dtype}; convert it with "
            "x_local.astype(np.float32)."
        )
    if x.ndim != 2:
        raise ValueError(f"{OP}: x_local must be 2-D (n_local, d), got shape {x.shape}; reshape it.")
    if x.shape[1] == 0:
        raise ValueError(f"{OP}: x_local must have at least one column (d >= 1), got shape {x.shape}.")
    return x


def _check_scalars(k: Any, metric: str, n_init: Any, max_iter: Any, tol: Any) -> tuple[int, int, float]:
    """The arguments that need no other rank, checked: ``n_init``, ``max_iter`` and ``tol`` as numbers."""
    check_metric(metric, OP)
    n_init = check_int(n_init, "n_init", 1, OP)
    max_iter = check_int(max_iter, "max_iter", 1, OP)
    tol = check_tol(tol, OP)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"{OP}: k must be an int, got {type(k).__name__} {k!r}.")
    return n_init, max_iter, tol


def _handshake(comm: _collectives.Comm, x: np.ndarray, k: Any, n_init: int, max_iter: int, seed: int,
               spherical: bool) -> np.ndarray:
    """Every rank's row count; all ranks raise the same error unless they agree on d, dtype and arguments."""
    n_local, d = x.shape
    mine = np.array([n_local, d, x.itemsize, int(k), n_init, max_iter, int(seed) % (1 << 62), int(spherical)],
                    dtype=np.int64)
    every = comm.gather(mine)
    names = ["rows", "d", "itemsize", "k", "n_init", "max_iter", "seed", "metric"]
    for c in range(1, len(names)):
        if len(set(every[:, c].tolist())) > 1:
            raise ValueError(f"{OP}: ranks disagree on {names[c]}: {every[:, c].tolist()} (rank order); every rank "
                             "must pass rows of the same dimension and dtype, and the same arguments.")
    return every[:, 0]


def _explicit_init(init: Any, k: int, d: int) -> torch.Tensor | None:
    """``init`` as float64 ``(k, d)`` centroids, or None for k-means++."""
    if isinstance(init, str):
        if init != "k-means++":
            raise ValueError(f"{OP}: init must be 'k-means++' or a (k, d) array of centroids, got {init!r}.")
        return None
    init_t = torch.as_tensor(np.asarray(init.detach().cpu() if isinstance(init, torch.Tensor) else init),
                             dtype=torch.float64)
    if tuple(init_t.shape) != (k, d) or not bool(torch.isfinite(init_t).all()):
        raise ValueError(f"{OP}: init must be a finite (k, d) = ({k}, {d}) array, got shape {tuple(init_t.shape)}.")
    return init_t


def _check_data(comm: _collectives.Comm, shard: Shard, setup: _Setup) -> None:
    """Pass 0: finiteness, zero rows (cosine), the range (the working frame: ``shard.scale``; ``setup.init`` is
    rescaled into it) and the global mean in that frame (``shard.mean``)."""
    d = shard.d
    total = np.zeros(d)
    col = np.full(2 * d, -np.inf)  # (max, -min) per column
    bad = bad_zero = I64_MAX
    for s, e in shard.chunks():
        block = shard.block(s, e)
        finite = np.isfinite(block).all(axis=1)
        if not finite.all():
            bad = min(bad, setup.offset + s + int(np.argmin(finite)))
        if shard.spherical:
            zero = ~(block != 0).any(axis=1)
            if zero.any():
                bad_zero = min(bad_zero, setup.offset + s + int(np.argmax(zero)))
        elif finite.all():
            with np.errstate(over="ignore"):  # recomputed in the working frame when that is rescaled
                total += block.sum(0, dtype=np.float64)
        if finite.all() and e > s:
            np.maximum(col[:d], block.max(axis=0), out=col[:d])
            np.maximum(col[d:], -block.min(axis=0), out=col[d:])
        shard.release(s, e)
    total = comm.sum(total)
    worst = comm.max(-np.array([bad, bad_zero], dtype=np.int64))
    if -worst[0] != I64_MAX:
        raise ValueError(f"{OP}: x contains NaN or Inf (first bad global row: {-worst[0]}); remove or impute those "
                         "rows.")
    if -worst[1] != I64_MAX:
        raise ValueError(f"{OP}: metric='cosine' needs non-zero rows, global row {-worst[1]} is all zeros.")
    col = comm.max(col)
    shard.scale, setup.init = working_frame(-col[d:], col[:d], setup.n_total, shard.x.dtype, shard.spherical, OP,
                                            "x" if setup.init is None else "x (with init)", setup.init)
    if shard.spherical:
        return
    if shard.scale.exponent:
        total = np.zeros(d)
        for s, e in shard.chunks():
            total += shard.scale.down(shard.block(s, e).astype(np.float64)).sum(0)
            shard.release(s, e)
        total = comm.sum(total)
    shard.mean = torch.from_numpy(total / setup.n_total)


def _starts(comm: _collectives.Comm, shard: Shard, setup: _Setup, n_init: int, seed: int) -> list[torch.Tensor]:
    """Initial centroids of every restart (prepared frame), the same on every rank."""
    if setup.init is not None:
        return [setup.init - shard.mean]
    starts = []
    sample = init_sample(comm, shard, setup.sizes, setup.init_sample_size, int(seed))
    for run in range(n_init):
        cent = np.zeros((setup.k, shard.d))
        if comm.rank == 0:
            cent = kmeans_plusplus(sample, setup.k, SplitMix64(run_seed(seed, run))).numpy()
        starts.append(torch.from_numpy(comm.broadcast(np.ascontiguousarray(cent)).copy()))
    return starts


def _best_run(comm: _collectives.Comm, lloyd: Lloyd, starts: list[torch.Tensor], *, spherical: bool, max_iter: int,
              tol: float, show: bool) -> tuple[tuple, dict[str, Any]]:
    """Lloyd iterations from every start; the run of the lowest final objective, and its stats."""
    best, stats = None, {}
    for run, cent in enumerate(starts):
        run_stats: dict[str, Any] = {"iteration_s": [], "rounds": [], "collectives": [], "comm_bytes": []}
        desc = f"capacity k-means ({comm.world} ranks)" + (f" run {run + 1}/{len(starts)}" if len(starts) > 1 else "")
        bar = progress(show and comm.rank == 0, max_iter, desc)
        try:
            labels, cent, history, n_iter, converged = lloyd.run(cent, spherical=spherical, max_iter=max_iter,
                                                                 tol=tol, bar=bar, stats=run_stats)
        finally:
            bar.close()
        t_fin = time.perf_counter()
        own, final = lloyd.own_distances(cent, labels)
        run_stats["finish_s"] = time.perf_counter() - t_fin
        if best is None or final < best[0]:
            best, stats = (final, labels, cent, history, n_iter, converged, own), run_stats
    return best, stats


def distributed_capacity_kmeans(
    x_local: Any,
    k: int,
    *,
    min_size: int | Sequence[int] | None = None,
    max_size: int | Sequence[int] | None = None,
    metric: str = "sqeuclidean",
    n_init: int = 1,
    max_iter: int = 100,
    tol: float = 1e-4,
    seed: int = 0,
    init: str | Any = "k-means++",
    group: Any = None,
    chunk_rows: int | None = None,
    init_sample_size: int | None = None,
    progress: bool = True,
) -> DistributedKMeansResult:
    """Capacity-constrained K-means of data sharded over the ranks of a process group, out of core.

    Every rank calls it with its own contiguous row block; the result is the one
    :func:`~cluster_kernels.capacity_kmeans` gives on the concatenated data with the same arguments
    (``backend="torch"``; see the module docstring for what "the same" means under rounding). Without an
    initialised process group it runs as world size 1. Needs the extension ``cluster_kernels._C``.

    Args:
        x_local: ``(n_r, d)`` float32/float64 numpy array, ``np.memmap`` (read ``chunk_rows`` rows at a
            time from its file; nothing of it stays resident) or CPU tensor: global rows
            ``[offset_r, offset_r + n_r)``, offsets in rank order, finite, d >= 1. Never modified. Any
            magnitude is accepted as long as the squared distances fit the dtype (the range of
            :func:`~cluster_kernels.capacity_kmeans`, over all ranks' rows and ``init``): the data are rescaled
            by the same power of two on every rank, and results reported in the caller's units.
        k: number of clusters, ``1 <= k <= n`` (n = rows over all ranks).
        min_size, max_size: int or ``(k,)`` ints, global bounds per cluster (defaults 0 and n).
        metric: "sqeuclidean", or "cosine" (spherical k-means on L2-normalised rows).
        n_init: k-means++ restarts (one shared sample); the lowest inertia wins.
        max_iter: Lloyd iterations per restart.
        tol: finite float >= 0; stop when the objective falls by less than ``tol`` (relative) or no label
            changes.
        seed: seed of the sample and of the splitmix64 stream of k-means++.
        init: "k-means++", or a ``(k, d)`` array of initial centroids, the same on every rank.
        group: process group (default: the default group when initialised).
        chunk_rows: rows read and processed at once (default: about 8 MiB of float64 rows).
        init_sample_size: rows gathered for k-means++ (default ``min(n, 256 k)``; ``>= n`` uses all
            rows and reproduces the single-process init).
        progress: tqdm bar on rank 0 (Lloyd iterations, global objective, auction rounds).

    Returns:
        :class:`DistributedKMeansResult`: ``labels`` (n_r,) int64 and ``distances`` (n_r,) of the local
        rows; ``centroids`` (k, d) in the input dtype, ``sizes`` (k,) int64, ``inertia``, ``history``
        global. Arrays follow the input type (numpy in, numpy out; a tensor in, tensors out).

    Raises:
        TypeError: x_local not a float32/float64 array, bad argument types.
        ValueError: ranks disagree on d, dtype or arguments, NaN/Inf rows (the global row is named),
            k outside [1, n], infeasible bounds, unknown metric, zero rows with ``metric="cosine"``, d = 0,
            ``tol`` NaN/Inf, data out of the accepted range (the message gives it; every rank raises it).
        RuntimeError: ``cluster_kernels._C`` is not built (the message says how to build it).
    """
    t_start = time.perf_counter()
    x = _as_local_array(x_local)
    n_init, max_iter, tol = _check_scalars(k, metric, n_init, max_iter, tol)
    _backend.require_cpu_native(OP)
    comm = _collectives.Comm(group)
    spherical = metric == "cosine"
    sizes = _handshake(comm, x, k, n_init, max_iter, seed, spherical)
    setup = _setup(x, k, sizes, comm.rank, min_size, max_size, chunk_rows, init_sample_size, init)
    shard = Shard(x, setup.chunk_rows, spherical)
    try:
        _check_data(comm, shard, setup)
        prepare_s = time.perf_counter() - t_start
        t0 = time.perf_counter()
        starts = _starts(comm, shard, setup, n_init, int(seed))
        init_s = time.perf_counter() - t0
        trim_heap()
        lloyd = Lloyd(comm, shard, setup.k, setup.lo, setup.hi, setup.offset, setup.n_total)
        best, stats = _best_run(comm, lloyd, starts, spherical=spherical, max_iter=max_iter, tol=float(tol),
                                show=progress)
        stats.update(init_s=init_s, prepare_s=prepare_s, world_size=comm.world, chunk_rows=setup.chunk_rows,
                     init_sample_size=min(setup.init_sample_size, setup.n_total))
        return _result(comm, shard, setup, best, stats, spherical, isinstance(x_local, torch.Tensor), t_start)
    finally:
        shard.close()


def _setup(x: np.ndarray, k: Any, sizes: np.ndarray, rank: int, min_size: Any, max_size: Any, chunk_rows: Any,
           init_sample_size: Any, init: Any) -> _Setup:
    """The arguments that need the global row count, checked."""
    n_total = int(sizes.sum())
    d = x.shape[1]
    k = check_k(k, n_total, OP)
    lo, hi = bounds(min_size, max_size, k, n_total, OP)
    if chunk_rows is None:
        chunk_rows = max(1024, CHUNK_BYTES // max(1, 8 * d))
    chunk_rows = check_int(chunk_rows, "chunk_rows", 1, OP)
    if init_sample_size is None:
        init_sample_size = min(n_total, SAMPLE_PER_CLUSTER * k)
    init_sample_size = check_int(init_sample_size, "init_sample_size", k, OP)
    return _Setup(k=k, lo=lo, hi=hi, sizes=sizes, offset=int(sizes[:rank].sum()), chunk_rows=chunk_rows,
                  init_sample_size=init_sample_size, init=_explicit_init(init, k, d))


def _result(comm: _collectives.Comm, shard: Shard, setup: _Setup, best: tuple, stats: dict[str, Any],
            spherical: bool, is_tensor: bool, t_start: float) -> DistributedKMeansResult:
    """The result of the best run: global sizes and inertia, centroids in the caller's frame and dtype."""
    _, labels, cent, history, n_iter, converged, own = best
    inertia = float(comm.sum(np.array([own.sum()]))[0])  # in the working frame
    if spherical:  # |a - b|^2 = 2 - 2 cos for unit vectors; unit centroids
        own, history, centroids, inertia = own * 0.5, [h * 0.5 for h in history], cent.numpy(), inertia * 0.5
    else:  # back from the working frame to the caller's units
        own, history = shard.scale.up_sq(own), [shard.scale.up_sq(float(h)) for h in history]
        centroids = shard.scale.up((cent + shard.mean).numpy())
        inertia = shard.scale.up_sq(inertia)
    centroids = centroids.astype(shard.x.dtype)
    sizes = comm.sum(np.bincount(labels, minlength=setup.k).astype(np.int64))
    stats["total_s"] = time.perf_counter() - t_start

    def out(a: np.ndarray) -> Any:
        return torch.from_numpy(np.ascontiguousarray(a)) if is_tensor else a

    return DistributedKMeansResult(
        labels=out(labels.astype(np.int64)), centroids=out(centroids), distances=out(own.astype(shard.x.dtype)),
        inertia=float(inertia), sizes=out(sizes), n_iter=int(n_iter), converged=bool(converged),
        history=[float(h) for h in history], offset=setup.offset, n_total=setup.n_total, stats=stats,
    )
