r"""Capacity-constrained K-means over ``torch.distributed`` ranks, streaming each rank's shard in chunks.

What every rank holds
---------------------
Rank ``r`` passes its contiguous row block ``x_local`` of the global data: rows ``[offset_r, offset_r +
n_r)``, the offsets being the prefix sums of the block sizes in rank order. The block is read
``chunk_rows`` rows at a time into reused buffers: rows of a ``np.memmap`` come from its file through
``preadv`` (no page of the map stays resident; without a file the map is read and its pages handed back
with ``MADV_DONTNEED``), so ``n x d`` may exceed memory. Per local point a rank keeps O(k) bytes:
label, auction object, own distance, ``m = n_candidates`` exact float64 distances (``_Candidates``) and,
by default, a 16-bit quantised copy of its distance row (``_Quantized``: ``2 k + 16`` bytes, lower
bounds within 1/65535 of the row's spread). No float64 ``n x K`` distance matrix exists.

The algorithm is the one of :mod:`cluster_kernels.kmeans` (its float64 reference), run globally:

* **Init**: greedy k-means++ (the reference's draws from the splitmix64 stream, ``_kmeans_plusplus``)
  on a sample gathered once: ``init_sample_size`` rows whose global indices are
  ``sorted(numpy.random.default_rng(seed).choice(n, size, replace=False))`` — every rank draws the same
  indices and contributes the rows it holds, so the sample depends on the data, ``seed`` and the size,
  never on the number of ranks. When the size is ``>= n`` the sample is the whole data set in order and
  the init is the single-process one. Rank 0 seeds, then broadcasts the centroids.
* **Lloyd iteration**: one pass over the chunks computes the distances (centred float64,
  ``|x|^2 - 2 x.c + |c|^2`` as the reference) and refills the exact values and bounds; the eviction
  auction assigns; a second pass sums each cluster's rows; the ``K x d`` float64 sums and the ``K``
  counts are all-reduced. Empty clusters are re-seeded at the globally farthest point, as the reference.
* **Auction** (the floor auction, then the general one with dummy units when lower bounds bind): prices,
  counts, eps and dummy units are global — every rank computes the same values from all-reduced counts —
  and argmins, regrets and re-bids are local. A round needs, per over-full cluster, the ``excess``
  members with the smallest ``(regret, global index)``: :func:`_select` finds that threshold with a
  distributed selection (each rank first cuts its candidates to ``excess`` per cluster; while a rank
  still holds more than ``GATHER_LIMIT``, the weighted median of the ranks' local quantile guesses is
  taken as pivot and the candidates on its wrong side dropped — one ``world x G x 3`` all-gather and one
  ``G``-count all-reduce per step; the survivors are all-gathered). A reverse step (a price drop that
  pulls ``r`` points into an under-full cluster) is the same selection over the gaps of every point. The
  eps schedule, reverse steps and dummy rules are the reference's, so on the same data every rank takes
  the decisions the single process takes.
* **Exact values on demand**: a query (cheapest cluster, cheapest other cluster, distance to a given
  cluster) is answered from the ``m`` exact values when its answer is provably below the bounds on the
  other clusters (the quantised row, or one per-point bound ``min_unlisted(D + q0)`` lowered by the
  largest price drop since; both less a small margin for rounding); otherwise the point's row is
  recomputed from its data row (a "refresh") and its exact values become its cheapest clusters at the
  current prices. Answers are those the full float64 matrix would give.

Equality with the single-process K-means
----------------------------------------
The decisions are the reference's; the float64 numbers behind them differ only in rounding: the mean
and the centroid sums are all-reduced (another summation order than one process), distances come from
chunked matrix products and row norms from ``einsum``. So centroids agree with
``capacity_kmeans(x, ..., backend="torch")`` to ~1e-12 relative, and labels are identical unless two
decisions are within rounding of a tie (duplicated points, regrets equal to ~1e-13). The tests check
identical labels on 2 and 3 gloo processes, float32 and float64, exact balance, a 1.5 N/K cap and both
bounds, against the torch reference and the C++ path.

Communication per Lloyd iteration: ``K * d + K`` float64 all-reduced for the centroid update, ``K``
int64 counts per auction round or reverse step, and per selection step ``world * G * 3`` int64 gathered
plus ``G`` counts reduced (``G`` = clusters being cut); see ``docs/scaling.md``. Threads: the matrix
products run in torch (``torch.set_num_threads``); the rest is numpy on one thread per process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cluster_kernels.kmeans import (
    EPS_FINAL,
    EPS_SHRINK,
    EPS_START,
    EPS_WARM,
    MAX_ROUNDS,
    N_LOCAL_TRIALS_BASE,
    KMeansResult,
    SplitMix64,
    _bounds,
    _cheapest_dummy_object,
    _check_int,
    _check_k,
    _check_metric,
    _check_tol,
    _Objects,
    run_seed,
)

__all__ = ["DistributedKMeansResult", "allgather_rows", "distributed_capacity_kmeans", "shard_rows"]

OP = "distributed_capacity_kmeans"
CHUNK_BYTES = 8 << 20  # default float64 bytes of one chunk of prepared rows
GATHER_LIMIT = 1 << 10  # a rank all-gathers its selection candidates once it holds at most this many
SAMPLE_PER_CLUSTER = 256  # default k-means++ sample: this many rows per cluster (faiss's training default)
DEFAULT_CANDIDATES = 4  # exact distances kept per point (all of them when k <= 2 * this)
_I64_MAX = np.iinfo(np.int64).max
_MARGIN = 1e-12  # relative slack of a candidate-list bound, far above the rounding of D + q
_QUERY_BLOCK = 1 << 13  # points per vectorised candidate-list query (bounds the temporaries)
_FAULT_BLOCK = max(mmap.PAGESIZE, 1 << 16)  # Linux maps up to 64 KiB of cached pages around a fault
_SCATTER_ROWS = 16  # scattered rows read from a memory map between two releases (when no file path is known)
_LEVELS = 65535  # codes of the quantised distances (uint16)


@dataclass
class DistributedKMeansResult(KMeansResult):
    """:class:`~cluster_kernels.kmeans.KMeansResult` of this rank's rows, plus where they sit globally.

    ``labels`` and ``distances`` cover the local rows only; ``centroids``, ``sizes``, ``inertia``,
    ``history``, ``n_iter`` and ``converged`` are global and identical on every rank.

    Attributes:
        offset: global index of the first local row.
        n_total: number of rows over all ranks.
        stats: measurements of the run: ``iteration_s`` (wall seconds per Lloyd iteration of the best
            run), ``rounds`` (auction rounds per iteration), ``refreshed`` (distance rows recomputed
            because a candidate list could not answer), ``collectives`` / ``comm_bytes`` (per iteration,
            this rank), ``init_s``, ``prepare_s``, ``finish_s``, ``world_size``.
    """

    offset: int = 0
    n_total: int = 0
    stats: dict[str, Any] = field(default_factory=dict)


def shard_rows(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """Contiguous row range ``[start, stop)`` of ``rank`` when ``n`` rows are split as evenly as possible.

    The first ``n % world_size`` ranks get one row more. Any contiguous split works with
    :func:`distributed_capacity_kmeans`; this is the one the featurization and the CLI use.

    Raises:
        ValueError: ``world_size < 1``, ``rank`` outside ``[0, world_size)`` or ``n < 0``.
    """
    if world_size < 1 or not 0 <= rank < world_size or n < 0:
        raise ValueError(
            f"shard_rows: need n >= 0, world_size >= 1 and 0 <= rank < world_size, got n={n}, "
            f"world_size={world_size}, rank={rank}."
        )
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def allgather_rows(local: Any, group: Any = None) -> np.ndarray:
    """Every rank's row block, concatenated in rank order, on every rank (blocks may differ in length).

    For example the global labels and distances after :func:`distributed_capacity_kmeans`, which the
    selection needs on the rank that writes the plan (``N`` int64 + ``N`` float64: 16 bytes per example).

    Args:
        local: ``(n_r, ...)`` numpy array or CPU tensor; the same dtype and trailing shape on every rank.
        group: process group (default: the default group; without one the block itself is returned).

    Returns:
        numpy array ``(sum n_r, ...)``.

    Raises:
        ValueError: ranks disagree on the dtype or the trailing shape.
    """
    a = np.ascontiguousarray(local.detach().cpu().numpy() if isinstance(local, torch.Tensor) else local)
    comm = _Comm(group)
    if comm.world == 1:
        return a
    code = np.frombuffer(f"{a.dtype.str}{a.shape[1:]}".encode().ljust(64)[:64], dtype=np.uint8)
    meta = comm.gather(np.concatenate([[len(a)], code]).astype(np.int64))
    if (meta[:, 1:] != meta[0, 1:]).any():
        raise ValueError("allgather_rows: ranks disagree on the dtype or trailing shape of their blocks; pass "
                         "arrays of one dtype and trailing shape on every rank.")
    sizes = meta[:, 0]
    width = int(sizes.max())
    if width == 0:
        return a
    padded = np.zeros((width, *a.shape[1:]), dtype=a.dtype)
    padded[: len(a)] = a
    rows = comm.gather(padded.reshape(width, -1).view(np.uint8))  # bytes: any dtype travels as is
    return np.concatenate([rows[r, : sizes[r]].reshape(-1).view(a.dtype).reshape(sizes[r], *a.shape[1:])
                           for r in range(comm.world)])


# --------------------------------------------------------------------------------------------------
# Collectives (identity without a process group)
# --------------------------------------------------------------------------------------------------


class _Comm:
    """numpy-in, numpy-out collectives on a process group; world size 1 when none is initialised."""

    def __init__(self, group: Any) -> None:
        dist = torch.distributed
        initialised = dist.is_available() and dist.is_initialized()
        if group is not None and not initialised:
            raise ValueError(f"{OP}: group was given but torch.distributed is not initialised; call "
                             "torch.distributed.init_process_group first, or pass group=None.")
        self.group = group
        self.world = dist.get_world_size(group) if initialised else 1
        self.rank = dist.get_rank(group) if initialised else 0
        self.device = torch.device("cpu")
        if initialised and dist.get_backend(group) == "nccl":
            # NCCL moves CUDA tensors only; the compute stays on the CPU.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.calls = 0
        self.bytes = 0

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        self.calls += 1
        self.bytes += a.nbytes
        # A copy: all_reduce works in place and must not overwrite the caller's array.
        return torch.from_numpy(np.array(a, copy=True, order="C")).to(self.device)

    def sum(self, a: np.ndarray) -> np.ndarray:
        if self.world == 1:
            return a
        t = self._tensor(a)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM, group=self.group)
        return t.cpu().numpy()

    def max(self, a: np.ndarray) -> np.ndarray:
        if self.world == 1:
            return a
        t = self._tensor(a)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return t.cpu().numpy()

    def gather(self, a: np.ndarray) -> np.ndarray:
        """All-gather of equal-shape arrays: ``(world, *a.shape)``."""
        if self.world == 1:
            return a[None]
        t = self._tensor(a)
        out = [torch.empty_like(t) for _ in range(self.world)]
        torch.distributed.all_gather(out, t, group=self.group)
        self.bytes += a.nbytes * (self.world - 1)
        return np.stack([o.cpu().numpy() for o in out])

    def gather_to_root(self, a: np.ndarray) -> np.ndarray | None:
        """Gather of equal-shape arrays on rank 0: ``(world, *a.shape)`` there, None elsewhere."""
        if self.world == 1:
            return a[None]
        t = self._tensor(a)
        out = [torch.empty_like(t) for _ in range(self.world)] if self.rank == 0 else None
        root = 0 if self.group is None else torch.distributed.get_global_rank(self.group, 0)
        torch.distributed.gather(t, out, dst=root, group=self.group)
        return None if out is None else np.stack([o.cpu().numpy() for o in out])

    def broadcast(self, a: np.ndarray, src: int = 0) -> np.ndarray:
        if self.world == 1:
            return a
        t = self._tensor(a)
        g_src = src if self.group is None else torch.distributed.get_global_rank(self.group, src)
        torch.distributed.broadcast(t, src=g_src, group=self.group)
        return t.cpu().numpy()


# --------------------------------------------------------------------------------------------------
# The local shard, read in chunks
# --------------------------------------------------------------------------------------------------


class _Shard:
    """Chunked access to this rank's rows as prepared float64 (centred, or unit rows for cosine).

    Rows of a ``np.memmap`` are read from its file with ``preadv`` into reused buffers (a page fault on the
    map costs more than the copy, and maps a whole block, up to a large folio, that would stay resident);
    without a file behind it, a map is read directly and its pages handed back (``MADV_DONTNEED``) after
    each chunk. Either way the data never stay resident; only one chunk is in memory at a time.
    """

    def __init__(self, x: np.ndarray, chunk_rows: int, spherical: bool) -> None:
        self.x = x
        self.n, self.d = x.shape
        self.row_bytes = self.d * x.itemsize
        self.chunk_rows = chunk_rows
        self.spherical = spherical
        self.mean = torch.zeros(self.d, dtype=torch.float64)
        self._buf: np.ndarray | None = None  # reused chunk of prepared rows (no allocation per chunk)
        self._raw: np.ndarray | None = None  # reused chunk of rows as stored
        mm = getattr(x, "_mmap", None)
        # Copy-on-write maps ("c") may hold the caller's private edits, which only the map shows.
        self._mm = mm if (mm is not None and getattr(x, "mode", "c") != "c" and x.flags.c_contiguous) else None
        self._file: tuple[str, int] | None = None  # (path, file offset of local row 0)
        self._fd: int | None = None
        if self._mm is not None:
            self._base = np.frombuffer(self._mm, dtype=np.uint8).ctypes.data
            offset, path = getattr(x, "offset", None), getattr(x, "filename", None)
            if isinstance(offset, int) and path and hasattr(os, "preadv"):
                # np.memmap maps from the allocation-granularity boundary below its offset.
                self._file = (path, offset - offset % mmap.ALLOCATIONGRANULARITY + x.ctypes.data - self._base)

    def chunks(self) -> Iterator[tuple[int, int]]:
        for s in range(0, self.n, self.chunk_rows):
            yield s, min(self.n, s + self.chunk_rows)

    def release(self, s: int = 0, e: int | None = None) -> None:
        """Hand the pages of rows ``[s, e)`` of a memory map back (they stay in the page cache)."""
        if self._mm is None or self.n == 0:
            return
        e = self.n if e is None else e
        first = self.x.ctypes.data - self._base + s * self.row_bytes
        last = first + (e - s) * self.row_bytes
        # Outward to whole fault-around blocks: a page fault maps the aligned block around it, so pages
        # beside the rows read are resident too (handing back a page that is still needed only costs a
        # re-fault from the page cache).
        start = first // _FAULT_BLOCK * _FAULT_BLOCK
        length = min(len(self._mm), -(-last // _FAULT_BLOCK) * _FAULT_BLOCK) - start
        if length > 0:
            self._mm.madvise(mmap.MADV_DONTNEED, start, length)

    def _pread(self, row: int, out: np.ndarray) -> None:
        """Fill ``out`` (consecutive rows, C-contiguous) from the file, starting at local row ``row``."""
        if self._fd is None:
            self._fd = os.open(self._file[0], os.O_RDONLY)
        want = out.nbytes
        got = os.preadv(self._fd, [memoryview(out.reshape(-1).view(np.uint8))], self._file[1] + row * self.row_bytes)
        if got != want:
            raise OSError(f"{OP}: short read of {self._file[0]} ({got} of {want} bytes); was the file truncated?")

    def block(self, s: int, e: int) -> np.ndarray:
        """Rows ``[s, e)`` (at most ``chunk_rows``) as stored; a reused buffer, valid until the next call."""
        if self._file is None:
            return self.x[s:e]
        if self._raw is None:
            self._raw = np.empty((self.chunk_rows, self.d), dtype=self.x.dtype)
        out = self._raw[: e - s]
        self._pread(s, out)
        return out

    def prepare(self, block: np.ndarray, out: np.ndarray | None = None) -> torch.Tensor:
        """float64 rows minus the mean (one pass, the float32 -> float64 conversion being exact), or unit rows.

        With ``out`` (a reused buffer of at least ``len(block)`` rows) nothing is allocated.
        """
        out = np.empty(block.shape, dtype=np.float64) if out is None else out[: len(block)]
        if self.spherical:
            out[...] = block
            out /= np.sqrt(np.einsum("ij,ij->i", out, out))[:, None]
            return torch.from_numpy(out)
        np.subtract(block, self.mean_np, out=out)
        return torch.from_numpy(out)

    def prepared(self, s: int, e: int) -> torch.Tensor:
        """Prepared rows ``[s, e)`` (at most ``chunk_rows``) in the shard's buffer: valid until the next call."""
        if self._buf is None:
            self._buf = np.empty((self.chunk_rows, self.d), dtype=np.float64)
        rows = self.prepare(self.block(s, e), self._buf)
        self.release(s, e)
        return rows

    @property
    def mean(self) -> torch.Tensor:
        return torch.from_numpy(self.mean_np)

    @mean.setter
    def mean(self, value: torch.Tensor) -> None:
        self.mean_np = np.ascontiguousarray(value.numpy(), dtype=np.float64)

    def rows(self, idx: np.ndarray) -> Iterator[tuple[np.ndarray, torch.Tensor]]:
        """Prepared rows of the sorted local indices ``idx``, ``chunk_rows`` at a time (buffer reused)."""
        if self._buf is None:
            self._buf = np.empty((self.chunk_rows, self.d), dtype=np.float64)
        for s in range(0, len(idx), self.chunk_rows):
            part = idx[s : s + self.chunk_rows]
            yield part, self.prepare(self.take(part), self._buf)

    def take(self, idx: np.ndarray) -> np.ndarray:
        """Rows ``idx`` (sorted local indices) as an in-memory array of the input dtype."""
        raw = np.empty((len(idx), self.d), dtype=self.x.dtype)
        if self._file is None:
            for b in range(0, len(idx), _SCATTER_ROWS):
                sub = idx[b : b + _SCATTER_ROWS]
                raw[b : b + len(sub)] = self.x[sub]
                self.release(int(sub[0]), int(sub[-1]) + 1)
            return raw
        breaks = np.nonzero(np.diff(idx) != 1)[0] + 1  # one read per run of consecutive rows
        for a, b in zip(np.concatenate([[0], breaks]), np.concatenate([breaks, [len(idx)]]), strict=True):
            self._pread(int(idx[a]), raw[a:b])
        return raw

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@functools.cache
def _libc_trim() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def _trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``).

    After a large array is freed, glibc serves arrays up to its size from the heap instead of fresh maps,
    and a heap only shrinks from its top: without this, memory freed by one phase (the init sample, a
    large refresh) stays resident through the whole run.
    """
    trim = _libc_trim()
    if trim is not None:
        trim(0)


def _rownorms(x: torch.Tensor) -> torch.Tensor:
    """``(x * x).sum(1)`` in float64 (numpy's einsum: ~10x faster on CPU, equal up to rounding)."""
    xn = x.numpy()
    return torch.from_numpy(np.einsum("ij,ij->i", xn, xn))


def _sqdist(x: torch.Tensor, c: torch.Tensor, cn: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``|x|^2 - 2 x.c + |c|^2`` clamped at 0, the reference's expression (``cn = (c * c).sum(1)``).

    In place in ``out`` (a reused ``(>= len(x), k)`` buffer) when given: ``x.c``, times -2, plus ``|x|^2``,
    plus ``|c|^2``, the same roundings as the reference's ``|x|^2 - 2 (x.c) + |c|^2``. Only the product runs
    in torch (its threads); the element-wise steps run in numpy, because torch's parallel regions on small
    blocks cost more than they save when cores are shared.
    """
    out = torch.empty(len(x), len(c), dtype=torch.float64) if out is None else out[: len(x)]
    torch.matmul(x, c.T, out=out)
    o = out.numpy()
    o *= -2.0
    o += _rownorms(x).numpy()[:, None]
    o += cn.numpy()[None, :]
    np.maximum(o, 0.0, out=o)
    return out


# --------------------------------------------------------------------------------------------------
# Candidate lists: exact distances of the few clusters that matter, a bound on the rest
# --------------------------------------------------------------------------------------------------


class _Quantized:
    """Lower bounds on a distance matrix, 16 bits per entry: per row, ``D >= lo + code * scale - margin``.

    ``code = floor((D - lo) / scale)`` with ``lo`` the row's minimum and ``scale = (max - lo) / 65535``, so a
    bound is within one step (1/65535 of the row's spread) of the distance; ``margin`` covers the rounding
    of the float64 arithmetic. 2 k + 16 bytes per row instead of 8 k for the matrix itself.
    """

    def __init__(self, n: int, k: int) -> None:
        self.codes = np.zeros((k, n), dtype=np.uint16)  # cluster-major: a column (one cluster) is contiguous
        self.lo = np.zeros(n)
        self.scale = np.zeros(n)
        self.margin = np.zeros(n)

    def store(self, s: int, e: int, d: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """Quantise rows ``[s, e)`` from their distances ``d`` and row minima / maxima."""
        span = hi - lo
        scale = span / _LEVELS
        q = d - lo[:, None]
        np.divide(q, scale[:, None], out=q, where=scale[:, None] > 0)
        q[scale == 0] = 0.0
        np.floor(q, out=q)
        np.clip(q, 0, _LEVELS, out=q)
        self.codes[:, s:e] = q.T
        self.lo[s:e] = lo
        self.scale[s:e] = scale
        self.margin[s:e] = 1e-3 * scale + 1e-15 * (np.abs(lo) + span)

    def rows(self, i: np.ndarray) -> np.ndarray:
        """``(len(i), k)`` float64 lower bounds of the rows ``i``."""
        out = self.codes[:, i].T.astype(np.float64)
        out *= self.scale[i, None]
        out += (self.lo[i] - self.margin[i])[:, None]
        return out

    def column(self, i: np.ndarray | None, j: int) -> np.ndarray:
        """Lower bounds of column ``j`` for rows ``i`` (None: all)."""
        sel = slice(None) if i is None else i
        out = self.codes[j, sel].astype(np.float64)
        out *= self.scale[sel]
        out += self.lo[sel] - self.margin[sel]
        return out


class _Candidates:
    """Exact float64 distances of the few clusters that matter per local point, and bounds on the rest.

    Per point: ``m`` clusters with exact distances (``idx``, ``val``; at build the ``m`` cheapest at the
    prices ``q0`` of that moment), and lower bounds on every other cluster: one per point (``lb`` =
    cheapest unlisted ``D + q0``, loosened by the largest price drop since) and, with ``approx``, one per
    cluster from a 16-bit quantised copy of the distances (:class:`_Quantized`). A query the
    exact values cannot settle recomputes the point's row from its data ("refresh"): it is answered from
    the row, and the point's exact values become its cheapest clusters at the current prices.
    """

    def __init__(self, shard: _Shard, k: int, m: int, approx: bool) -> None:
        self.shard, self.k, self.m = shard, k, m
        n = shard.n
        self.idx = np.empty((n, m), dtype=np.int16 if k < 2**15 else np.int32)
        self.val = np.empty((n, m), dtype=np.float64)
        self.approx = _Quantized(n, k) if (approx and m < k) else None
        self.lb = np.full(n, np.inf)
        self.q0 = np.zeros(k)
        self.refreshed = 0
        self.cent: torch.Tensor | None = None
        self.cn: torch.Tensor | None = None
        self.dbuf = torch.empty(shard.chunk_rows, k, dtype=torch.float64)  # reused distance block

    def reset(self, cent: torch.Tensor, q0: np.ndarray) -> None:
        self.cent, self.cn = cent, (cent * cent).sum(1)
        self.q0 = np.asarray(q0, dtype=np.float64).copy()

    def fill(self, s: int, e: int, dist: torch.Tensor) -> tuple[float, float]:
        """Build the exact values of rows ``[s, e)`` from their distance block ``(e - s, k)``.

        Returns:
            the largest row spread ``max_l D - min_l D`` and the largest distance of the block.
        """
        d = dist.numpy()
        lo, hi = d.min(1), d.max(1)
        spread = float((hi - lo).max()) if len(d) else 0.0
        largest = float(hi.max()) if len(d) else 0.0
        if self.m == self.k:
            self.idx[s:e] = np.arange(self.k)
            self.val[s:e] = d
            return spread, largest
        cost = d + self.q0
        # The m cheapest in any order, and at position m the cheapest of the rest (the bound lb).
        part = np.argpartition(cost, self.m, axis=1)
        self.idx[s:e] = part[:, : self.m]
        self.val[s:e] = np.take_along_axis(d, part[:, : self.m], axis=1)
        self.lb[s:e] = np.take_along_axis(cost, part[:, self.m : self.m + 1], axis=1)[:, 0]
        if self.approx is not None:
            self.approx.store(s, e, d, lo, hi)
        return spread, largest

    def _keep(self, i: np.ndarray, d: np.ndarray, cost: np.ndarray) -> None:
        """Keep for points i the m clusters of smallest ``cost`` (any order), and lb from the rest."""
        part = np.argpartition(cost, self.m - 1, axis=1)[:, : self.m]
        self.idx[i] = part
        self.val[i] = np.take_along_axis(d, part, axis=1)
        rest = d + self.q0
        np.put_along_axis(rest, part, np.inf, axis=1)
        self.lb[i] = rest.min(1)

    def point_lower(self, i: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Lower bound on ``D_il + q_l`` for every unlisted cluster ``l`` of points ``i``: one number per point,
        ``min_unlisted(D + q0)`` lowered by the largest price drop since the lists were built."""
        delta = max(0.0, float(np.max(self.q0 - q))) if self.k else 0.0
        lb = self.lb[i]
        out = np.full(len(i), np.inf)
        fin = np.isfinite(lb)
        out[fin] = lb[fin] - delta - _MARGIN * (np.abs(lb[fin]) + delta)
        return out

    def unlisted_lower(self, i: np.ndarray, q: np.ndarray, ids: np.ndarray,
                       exclude: np.ndarray | None = None) -> np.ndarray:
        """Lower bound on ``min D_il + q_l`` over clusters ``l`` neither listed for point i nor ``exclude[i]``."""
        if self.approx is None:
            return self.point_lower(i, q)
        low = self.approx.rows(i)
        low += q
        np.put_along_axis(low, ids, np.inf, axis=1)
        if exclude is not None:
            low[np.arange(len(i)), exclude] = np.inf
        return low.min(1)

    def lower(self, i: np.ndarray | None, j: int, q: np.ndarray) -> np.ndarray:
        """Lower bound on ``D_ij + q_j`` of points ``i`` (None: all), for any cluster j."""
        if self.approx is None:
            return self.point_lower(np.arange(self.shard.n) if i is None else i, q)
        out = self.approx.column(i, j)
        out += q[j]
        return out

    def refresh(self, i: np.ndarray, q: np.ndarray, keep: int | None = None) -> np.ndarray:
        """Recompute the distance rows of the distinct local points ``i`` (sorted); keep as their exact values
        the cheapest clusters at prices ``q`` (cluster ``keep`` among them). Returns the ``(len(i), k)`` rows,
        or with ``keep`` only their column ``keep`` (``(len(i),)``: a pull may refresh many points)."""
        out = np.empty((len(i), self.k) if keep is None else len(i))
        for s in range(0, len(i), self.shard.chunk_rows):
            part = i[s : s + self.shard.chunk_rows]
            (rows,) = [r for _, r in self.shard.rows(part)]
            d = _sqdist(rows, self.cent, self.cn, self.dbuf).numpy()  # scratch: edited in place below
            # Values already handed out stay as they were, so every (point, cluster) has one distance.
            np.put_along_axis(d, self.idx[part].astype(np.int64), self.val[part], axis=1)
            cost = d + q
            if keep is not None:
                cost[:, keep] = -np.inf
            self._keep(part, d, cost)
            out[s : s + len(part)] = d if keep is None else d[:, keep]
        self.refreshed += len(i)
        return out

    def best(self, i: np.ndarray, q: np.ndarray, exclude: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        """Cheapest cluster of each point (lowest index on ties) at prices ``q``, optionally excluding one.

        Returns:
            cluster (int64), cost ``D + q`` and distance ``D`` of it, per point (cost inf when nothing is left).
        """
        if len(i) <= _QUERY_BLOCK:
            return self._best(i, q, exclude)
        parts = [self._best(i[s : s + _QUERY_BLOCK], q, None if exclude is None else exclude[s : s + _QUERY_BLOCK])
                 for s in range(0, len(i), _QUERY_BLOCK)]
        return tuple(np.concatenate([p[c] for p in parts]) for c in range(3))

    def _best(self, i: np.ndarray, q: np.ndarray, exclude: np.ndarray | None) -> tuple[np.ndarray, ...]:
        ids = self.idx[i].astype(np.int64)
        v0 = self.val[i]
        v = v0 + q[ids]
        if exclude is not None:
            v[ids == exclude[:, None]] = np.inf
        cost = v.min(1)
        arg = np.where(v == cost[:, None], ids, self.k).min(1)
        dval = v0[np.arange(len(i)), np.argmax(ids == arg[:, None], axis=1)]
        if self.m == self.k:
            return arg, cost, dval
        ok = cost < self.point_lower(i, q)  # cheap: one bound per point
        if self.approx is not None and not ok.all():  # then the per-cluster quantised bounds
            redo = np.nonzero(~ok)[0]
            ok[redo] = cost[redo] < self.unlisted_lower(i[redo], q, ids[redo],
                                                        None if exclude is None else exclude[redo])
        bad = np.nonzero(~ok)[0]
        if len(bad):
            order = np.argsort(i[bad])
            bad = bad[order]
            r0 = self.refresh(i[bad], q)
            r = r0 + q
            if exclude is not None:
                r[np.arange(len(bad)), exclude[bad]] = np.inf
            a = r.argmin(1)  # the first minimum: the lowest index on ties
            ar = np.arange(len(bad))
            arg[bad], cost[bad], dval[bad] = a, r[ar, a], r0[ar, a]
        return arg, cost, dval

    def lookup(self, i: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Distances ``D_ij`` of points ``i`` to cluster ``j`` where listed (NaN elsewhere), and the mask."""
        out = np.full(len(i), np.nan)
        hit = self.idx[i] == j
        has = hit.any(1)
        out[has] = self.val[i[has], np.argmax(hit[has], axis=1)]
        return out, has

    def exact(self, i: np.ndarray, j: int, q: np.ndarray) -> np.ndarray:
        """Exact ``D_ij`` of the distinct points ``i``, refreshing those where j is not listed."""
        out, has = self.lookup(i, j)
        miss = np.nonzero(~has)[0]
        if len(miss):
            miss = miss[np.argsort(i[miss])]
            out[miss] = self.refresh(i[miss], q, keep=j)
        return out


# --------------------------------------------------------------------------------------------------
# Distributed selection of the t-th smallest (value, global index) per group
# --------------------------------------------------------------------------------------------------


def _key_le(val: np.ndarray, gid: np.ndarray, tv: np.ndarray, tg: np.ndarray) -> np.ndarray:
    return (val < tv) | ((val == tv) & (gid <= tg))


def _count_le(val: np.ndarray, gid: np.ndarray, pv: float, pg: int) -> int:
    """Entries ``<= (pv, pg)`` of arrays sorted by ``(val, gid)``."""
    left = int(np.searchsorted(val, pv, side="left"))
    right = int(np.searchsorted(val, pv, side="right"))
    return left + int(np.searchsorted(gid[left:right], pg, side="right"))


def _cut(grp: np.ndarray, val: np.ndarray, gid: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, ...]:
    """Keep, per group g, the entries whose value is at most the t[g]-th smallest (ties kept), in O(n)."""
    if len(t) == 1:
        kth = val[np.argpartition(val, t[0] - 1)[t[0] - 1]]
        keep = np.nonzero(val <= kth)[0]
        return grp[keep], val[keep], gid[keep]
    small = grp.astype(np.int16 if len(t) < 2**15 else np.int64)
    order = np.argsort(small, kind="stable")  # radix sort for 16-bit keys
    starts = np.searchsorted(small[order], np.arange(len(t) + 1), side="left")
    keep = []
    for g in range(len(t)):
        part = order[starts[g] : starts[g + 1]]
        if len(part) > t[g]:
            v = val[part]
            kth = v[np.argpartition(v, t[g] - 1)[t[g] - 1]]
            part = part[v <= kth]
        keep.append(part)
    idx = np.concatenate(keep) if keep else np.zeros(0, dtype=np.int64)
    return grp[idx], val[idx], gid[idx]


def _select(comm: _Comm, grp: np.ndarray, val: np.ndarray, gid: np.ndarray,
            t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per group g, the ``t[g]``-th smallest ``(val, gid)`` over all ranks (``(inf, int64 max)`` if fewer).

    Args:
        grp, val, gid: this rank's candidates (group in ``[0, G)``, float64 value, unique global index).
        t: (G,) int64 ranks wanted, ``>= 1``.

    Returns:
        (G,) threshold values and global indices, identical on every rank.
    """
    n_groups = len(t)
    tv = np.full(n_groups, np.inf)
    tg = np.full(n_groups, _I64_MAX, dtype=np.int64)
    if len(val) > 2 * int(t.sum()) + 4096:
        grp, val, gid = _cut(grp, val, gid, t)
    order = np.lexsort((gid, val, grp))
    grp, val, gid = grp[order], val[order], gid[order]
    groups = np.arange(n_groups)
    lo = np.searchsorted(grp, groups, side="left")
    hi = np.minimum(np.searchsorted(grp, groups, side="right"), lo + t)  # a rank gives at most t[g]
    if comm.world == 1:
        ok = hi - lo >= t
        tv[ok], tg[ok] = val[(lo + t - 1)[ok]], gid[(lo + t - 1)[ok]]
        return tv, tg
    need = t.astype(np.int64).copy()
    bound = int(t.sum())
    if bound <= GATHER_LIMIT:
        # No rank holds more than sum(t) candidates: one all-gather of that width settles it.
        return _gather_select(comm, grp, val, gid, lo, hi, need, bound, tv, tg)
    prev_total = None
    while True:
        local = hi - lo
        counts = comm.gather(np.append(local, local.sum()).astype(np.int64))
        total_g = counts[:, :n_groups].sum(0)
        short = (need > total_g) & (total_g > 0)
        if short.any():  # fewer candidates than wanted anywhere: the answer is "all", nothing to send
            hi[short] = lo[short]
            continue
        total = int(total_g.sum())
        if int(counts[:, n_groups].max()) <= GATHER_LIMIT or (prev_total is not None and total >= prev_total):
            break
        prev_total = total
        # Pivot per group: the weighted median (weights: candidates held) of the ranks' local guesses of
        # where the need-th smallest lies.
        pos = lo + np.minimum(np.maximum(local - 1, 0), (local * (need - 1)) // np.maximum(total_g, 1))
        has = local > 0
        piv = np.zeros((n_groups, 3), dtype=np.int64)
        piv[has, 0] = val[pos[has]].view(np.int64)
        piv[has, 1] = gid[pos[has]]
        piv[:, 2] = local
        allp = comm.gather(piv)
        le_local = np.zeros(n_groups, dtype=np.int64)
        pv = np.zeros(n_groups)
        pg = np.zeros(n_groups, dtype=np.int64)
        active = (total_g > 0) & (need <= total_g)
        for g in np.nonzero(active)[0]:
            w = allp[:, g, 2]
            keys = [(allp[r, g, 0 : 1].view(np.float64)[0], allp[r, g, 1]) for r in range(comm.world)]
            ranks = sorted((keys[r][0], keys[r][1], r) for r in range(comm.world) if w[r] > 0)
            acc, half = 0, (w.sum() + 1) // 2
            for v, gi, r in ranks:
                acc += w[r]
                if acc >= half:
                    pv[g], pg[g] = v, gi
                    break
            le_local[g] = _count_le(val[lo[g] : hi[g]], gid[lo[g] : hi[g]], pv[g], pg[g])
        le = comm.sum(le_local)
        for g in np.nonzero(active)[0]:
            if le[g] >= need[g]:
                hi[g] = lo[g] + le_local[g]
            else:
                lo[g] += le_local[g]
                need[g] -= le[g]
    return _gather_select(comm, grp, val, gid, lo, hi, need, int(counts[:, n_groups].max()), tv, tg)


def _gather_select(comm: _Comm, grp: np.ndarray, val: np.ndarray, gid: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                   need: np.ndarray, width: int, tv: np.ndarray, tg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All-gather every rank's window ``[lo, hi)`` per group (``width`` >= the largest) and pick the need-th."""
    n_groups = len(need)
    groups = np.arange(n_groups)
    if width == 0:
        return tv, tg
    pack = np.full((width, 3), -1, dtype=np.int64)
    sel = np.concatenate([np.arange(lo[g], hi[g]) for g in range(n_groups)]) if n_groups else np.zeros(0, np.int64)
    sel = sel.astype(np.int64)
    pack[: len(sel), 0] = grp[sel]
    pack[: len(sel), 1] = val[sel].view(np.int64)
    pack[: len(sel), 2] = gid[sel]
    allw = comm.gather(pack).reshape(-1, 3)
    allw = allw[allw[:, 0] >= 0]
    wv = allw[:, 1].copy().view(np.float64)
    o = np.lexsort((allw[:, 2], wv, allw[:, 0]))
    wg, wv, wi = allw[o, 0], wv[o], allw[o, 2]
    start = np.searchsorted(wg, groups, side="left")
    stop = np.searchsorted(wg, groups, side="right")
    ok = stop - start >= need
    tv[ok], tg[ok] = wv[(start + need - 1)[ok]], wi[(start + need - 1)[ok]]
    return tv, tg


# --------------------------------------------------------------------------------------------------
# The eviction auctions (the reference's, with global prices and local points)
# --------------------------------------------------------------------------------------------------


class _Auction:
    """Floor and general auctions over the local points; prices, counts and eps identical on all ranks."""

    def __init__(self, comm: _Comm, cands: _Candidates, offset: int, n_total: int, k: int) -> None:
        self.comm, self.cands, self.offset, self.n_total, self.k = comm, cands, offset, n_total, k
        n = cands.shard.n
        self.n = n
        self.all = np.arange(n)
        self.gall = offset + self.all  # global indices of the local points
        self.zeros = np.zeros(n, dtype=np.int64)
        self.own_d = np.zeros(n)  # distance of each point to the cluster of its current object
        self.span = 0.0
        self.amax = 0.0

    def counts(self, obj: np.ndarray, m: int) -> np.ndarray:
        return self.comm.sum(np.bincount(obj, minlength=m).astype(np.int64))

    def schedule(self, prices: np.ndarray, warm: bool) -> tuple[float, float]:
        """(first eps, final eps), as :func:`cluster_kernels.kmeans._eps_schedule` on the global matrix."""
        span = self.span if self.span > 0 else 1.0
        pmax = float(np.abs(prices).max()) if len(prices) else 0.0
        eps_final = max(EPS_FINAL * span, 64 * np.finfo(np.float64).eps * (self.amax + pmax + span))
        return max((EPS_WARM if warm else EPS_START) * span, eps_final), eps_final

    def gidx(self, i: np.ndarray) -> np.ndarray:
        return self.offset + i.astype(np.int64)

    # ---- floor auction (upper bounds only) --------------------------------------------------------

    def floor(self, hi: np.ndarray, prices: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, int]:
        k = self.k
        warm = prices is not None and len(prices) == k
        prices = prices.astype(np.float64).copy() if warm else np.zeros(k)
        eps, eps_final = self.schedule(prices, warm)
        slack = int(hi.sum()) - self.n_total
        obj = self._floor_start(None, prices, eps, hi, slack)
        rounds = 0
        while True:
            while True:
                counts = self.counts(obj, k)
                over = np.nonzero(counts > hi)[0]
                if not len(over):
                    break
                rounds += 1
                if rounds > MAX_ROUNDS:
                    raise RuntimeError(f"{OP}: the auction did not terminate (internal error)")
                slot = np.full(k, -1, dtype=np.int64)
                slot[over] = np.arange(len(over))
                members = np.nonzero(slot[obj] >= 0)[0]
                j = obj[members]
                own = self.own_d[members] + prices[j]
                _, second, _ = self.cands.best(members, prices, exclude=j)
                regret = second - own
                tv, tg = _select(self.comm, slot[j], regret, self.gidx(members), counts[over] - hi[over])
                new_prices = prices.copy()
                new_prices[over] = prices[over] + tv + eps
                s = slot[j]
                ev = members[_key_le(regret, self.gidx(members), tv[s], tg[s])]
                prices = new_prices
                obj[ev], _, self.own_d[ev] = self.cands.best(ev, prices)
            if eps <= eps_final:
                break
            eps = max(eps / EPS_SHRINK, eps_final)
            obj = self._floor_start(obj, prices, eps, hi, slack)
        return obj, prices, rounds

    def _floor_start(self, obj: np.ndarray | None, prices: np.ndarray, eps: float, hi: np.ndarray,
                     slack: int) -> np.ndarray:
        """Phase start: argmin (first phase) or the violators move; then reverse steps (prices in place)."""
        k = self.k
        best, best_cost, best_d = self.cands.best(self.all, prices)
        if obj is None:
            obj = best
            self.own_d = best_d
        else:
            viol = self.own_d + prices[obj] > best_cost + eps
            obj = np.where(viol, best, obj)
            self.own_d = np.where(viol, best_d, self.own_d)
        if slack <= 0:
            return obj
        counts = self.counts(obj, k)
        for pass_ in range(10**9):
            changed = False
            for j in range(k):
                if counts[j] >= hi[j] or prices[j] <= 0:
                    continue
                changed = True
                if pass_ >= 4 * k:  # safety net, as the reference
                    prices[j] = 0.0
                    continue
                self._pull(obj, counts, prices, j, int(hi[j] - counts[j]), eps)
            if not changed:
                return obj
            if pass_ >= 4 * k:
                obj, _, self.own_d = self.cands.best(self.all, prices)
                counts = self.counts(obj, k)
        return obj

    def _pull(self, obj: np.ndarray, counts: np.ndarray, prices: np.ndarray, j: int, r: int, eps: float) -> None:
        """Reverse step for under-full cluster j: lower its price to pull in the r smallest gaps."""
        # Keys: the gap (D_ij + p_j) - own cost where D_ij is known exactly, else a lower bound of it (inf for
        # j's members). The r-th smallest key is then at most the true threshold; keys at or below it are
        # made exact and the selection repeated until every key at or below the threshold is exact.
        exact = np.zeros(self.n, dtype=bool)
        dij = np.full(self.n, np.nan)
        if self.cands.approx is None:
            dij, exact = self.cands.lookup(self.all, j)
        gap = self.cands.lower(None, j, prices)
        gap[exact] = dij[exact] + prices[j]
        gap -= self.own_d + prices[obj]
        gap[obj == j] = np.inf
        while True:
            tv, tg = _select(self.comm, self.zeros, gap, self.gall, np.array([r], dtype=np.int64))
            if self.cands.m == self.k:  # complete lists: every key is exact on every rank
                break
            low = np.nonzero(~exact & (gap <= tv[0]))[0]
            if int(self.comm.sum(np.array([len(low)], dtype=np.int64))[0]) == 0:
                break
            dij[low] = self.cands.exact(low, j, prices)
            exact[low] = True
            gap[low] = (dij[low] + prices[j]) - (self.own_d[low] + prices[obj[low]])
        near = np.nonzero(gap <= tv[0])[0]
        pick = near[_key_le(gap[near], self.gidx(near), tv[0], tg[0])]
        drop = tv[0] + eps
        if drop >= prices[j]:
            d0 = prices[j]
            prices[j] = 0.0
            pick = pick[gap[pick] - d0 < -eps]
        else:
            prices[j] -= drop
        dec = self.counts(obj[pick], self.k)
        counts -= dec
        counts[j] += int(dec.sum())
        obj[pick] = j
        self.own_d[pick] = dij[pick]

    # ---- general auction (lower and upper bounds, dummy units) ------------------------------------

    def general(self, lo: np.ndarray, hi: np.ndarray, prices: np.ndarray | None) -> tuple[np.ndarray, np.ndarray,
                                                                                          int]:
        objs = _Objects(lo, hi)
        m, ocl, cap = objs.m, objs.cluster, objs.cap
        warm = prices is not None and len(prices) == m
        prices = prices.astype(np.float64).copy() if warm else np.zeros(m)
        eps, eps_final = self.schedule(prices, warm)
        # Objects of each cluster in index order (mandatory first), and each object's sibling.
        first = np.full(self.k, -1, dtype=np.int64)
        second = np.full(self.k, -1, dtype=np.int64)
        for o in range(m - 1, -1, -1):
            second[ocl[o]] = first[ocl[o]]
            first[ocl[o]] = o
        sib = np.where(first[ocl] == np.arange(m), second[ocl], first[ocl])

        def cluster_prices(p: np.ndarray) -> np.ndarray:
            q = np.full(self.k, np.inf)
            np.minimum.at(q, ocl, p)
            return q

        def best_object(i: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            cl, cost, dval = self.cands.best(i, cluster_prices(p))
            o1 = first[cl]
            o2 = second[cl]
            # Lowest object index among the tied ones (the reference's argmin over objects).
            take_first = (dval + p[o1] == cost) | (o2 < 0)
            return np.where(take_first, o1, o2), cost, dval

        dummies = np.zeros(m, dtype=np.int64)
        n_dummy = int(hi.sum()) - self.n_total
        obj, _, self.own_d = best_object(self.all, prices)
        real = self.counts(obj, m)
        for o in sorted(range(m), key=lambda o: (prices[o], o)):
            if objs.dummy_ok[o] and n_dummy - dummies.sum() > 0:
                dummies[o] = min(max(cap[o] - real[o], 0), n_dummy - dummies.sum())
        if dummies.sum() < n_dummy:
            dummies[_cheapest_dummy_object(prices, objs.dummy_ok)] += n_dummy - dummies.sum()

        rounds = 0
        while True:
            while True:
                units = real + dummies
                over = np.nonzero(units > cap)[0]
                if not len(over):
                    break
                rounds += 1
                if rounds > MAX_ROUNDS:
                    raise RuntimeError(f"{OP}: the auction did not terminate (internal error)")
                slot = np.full(m, -1, dtype=np.int64)
                slot[over] = np.arange(len(over))
                members = np.nonzero(slot[obj] >= 0)[0]
                mo = obj[members]
                own = self.own_d[members] + prices[mo]
                _, other, _ = self.cands.best(members, cluster_prices(prices), exclude=ocl[mo])
                has_sib = sib[mo] >= 0
                sib_cost = np.where(has_sib, self.own_d[members] + prices[np.maximum(sib[mo], 0)], np.inf)
                regret = np.minimum(other, sib_cost) - own
                excess = units[over] - cap[over]
                rho = np.full(len(over), np.inf)
                for s, o in enumerate(over):
                    dst = _cheapest_dummy_object(prices, objs.dummy_ok, exclude=o)
                    if dummies[o] > 0 and dst >= 0:
                        rho[s] = prices[dst] - prices[o]
                s_of = slot[mo]
                below = self.comm.sum(np.bincount(s_of[regret < rho[s_of]], minlength=len(over)).astype(np.int64))
                # Eviction order: reals with regret < rho, then the dummies (first on equal regret), then the rest.
                n_real = np.where(excess <= below, excess, np.maximum(excess - dummies[over], below))
                n_dum = excess - n_real
                want = np.nonzero(n_real > 0)[0]
                tv = np.full(len(over), np.inf)
                tg = np.full(len(over), _I64_MAX, dtype=np.int64)
                if len(want):
                    remap = np.full(len(over), -1, dtype=np.int64)
                    remap[want] = np.arange(len(want))
                    keep = remap[s_of] >= 0
                    tv_w, tg_w = _select(self.comm, remap[s_of[keep]], regret[keep], self.gidx(members[keep]),
                                         n_real[want])
                    tv[want], tg[want] = tv_w, tg_w
                last = np.where((n_dum > 0) & (n_real <= below), rho, tv)
                new_prices = prices.copy()
                new_prices[over] = prices[over] + last + eps
                if not np.isfinite(new_prices).all():
                    raise RuntimeError(f"{OP}: infinite price (internal error)")
                ev = members[(n_real[s_of] > 0) & _key_le(regret, self.gidx(members), tv[s_of], tg[s_of])]
                prices = new_prices
                obj[ev], _, self.own_d[ev] = best_object(ev, prices)
                moves = [(o, int(n_dum[s])) for s, o in enumerate(over) if n_dum[s] > 0]
                if moves:
                    dst = _cheapest_dummy_object(prices, objs.dummy_ok)
                    for src, cnt in moves:
                        dummies[src] -= cnt
                        dummies[dst] += cnt
                real = self.counts(obj, m)
            if eps <= eps_final:
                break
            eps = max(eps / EPS_SHRINK, eps_final)
            best, best_cost, best_d = best_object(self.all, prices)
            viol = self.own_d + prices[obj] > best_cost + eps
            obj = np.where(viol, best, obj)
            self.own_d = np.where(viol, best_d, self.own_d)
            real = self.counts(obj, m)
            cheapest = _cheapest_dummy_object(prices, objs.dummy_ok)
            for o in range(m):
                if dummies[o] > 0 and prices[o] > prices[cheapest] + eps:
                    dummies[cheapest] += dummies[o]
                    dummies[o] = 0
        return ocl[obj], prices, rounds

    def assign(self, lo: np.ndarray, hi: np.ndarray, state: dict | None) -> tuple[np.ndarray, dict, int]:
        """The reference's :func:`~cluster_kernels.kmeans.assign_ref` on the global problem."""
        state = dict(state or {})
        labels, state["floor"], rounds = self.floor(hi, state.get("floor"))
        if (self.counts(labels, self.k) >= lo).all():
            return labels, state, rounds
        labels, state["general"], more = self.general(lo, hi, state.get("general"))
        return labels, state, rounds + more


# --------------------------------------------------------------------------------------------------
# Lloyd iterations
# --------------------------------------------------------------------------------------------------


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
    return x


def _progress(enabled: bool, total: int, desc: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="it", disable=not enabled, dynamic_ncols=True, leave=False)


class _Lloyd:
    """One rank's side of the Lloyd iterations on prepared data."""

    def __init__(self, comm: _Comm, shard: _Shard, k: int, lo: np.ndarray, hi: np.ndarray, offset: int,
                 n_total: int, n_candidates: int, approx: bool) -> None:
        self.comm, self.shard, self.k, self.lo, self.hi = comm, shard, k, lo, hi
        m = k if k <= 2 * n_candidates else n_candidates
        self.cands = _Candidates(shard, k, m, approx)
        self.auction = _Auction(comm, self.cands, offset, n_total, k)
        self.offset, self.n_total = offset, n_total

    def distance_pass(self, cent: torch.Tensor, q0: np.ndarray, labels: np.ndarray | None) -> np.ndarray | None:
        """Candidate lists for the new centroids, the global cost span, and D[i, previous label]."""
        self.cands.reset(cent, q0)
        span = amax = 0.0
        prev = np.empty(self.shard.n) if labels is not None else None
        for s, e in self.shard.chunks():
            d = _sqdist(self.shard.prepared(s, e), cent, self.cands.cn, self.cands.dbuf)
            spread, largest = self.cands.fill(s, e, d)
            span, amax = max(span, spread), max(amax, largest)
            if prev is not None:
                prev[s:e] = np.take_along_axis(d.numpy(), labels[s:e, None], axis=1)[:, 0]
        g = self.comm.max(np.array([span, amax]))
        self.auction.span, self.auction.amax = float(g[0]), float(g[1])
        return prev

    def update_centroids(self, labels: np.ndarray, old: torch.Tensor, own: np.ndarray, spherical: bool) -> torch.Tensor:
        """Cluster means from all-reduced float64 sums; empty clusters re-seeded as the reference does."""
        k, d = self.k, self.shard.d
        sums = torch.zeros(k, d, dtype=torch.float64)
        for s, e in self.shard.chunks():
            # index_put_ with accumulate (not index_add_, whose threads crawl on shared cores); float64 sums.
            sums.index_put_((torch.from_numpy(labels[s:e]),), self.shard.prepared(s, e), accumulate=True)
        flat = np.concatenate([sums.numpy().ravel(), np.bincount(labels, minlength=k).astype(np.float64)])
        flat = self.comm.sum(flat)
        sums = torch.from_numpy(flat[: k * d].reshape(k, d).copy())
        counts = flat[k * d :].astype(np.int64)
        cent = sums / torch.from_numpy(np.maximum(counts, 1)).to(torch.float64)[:, None]
        empty = np.nonzero(counts == 0)[0]
        if len(empty):
            far = own.copy()
            for j in empty:
                movable = counts[labels] > 1
                cand = np.where(movable, far, -1.0)
                i = int(np.argmax(cand)) if len(cand) else -1
                mine = np.array([cand[i] if i >= 0 else -np.inf, self.offset + i if i >= 0 else _I64_MAX],
                                dtype=np.float64)
                allc = self.comm.gather(mine)
                # The reference's argmax: the largest value, the lowest global index among equal ones.
                best_r = min(range(self.comm.world), key=lambda r: (-allc[r, 0], allc[r, 1]))
                if allc[best_r, 0] == -1.0:  # nothing movable: argmax of all -1 is global row 0
                    best_r = 0
                    i = 0
                row = np.zeros(d + 1)
                if self.comm.rank == best_r:
                    (_, x_i), = self.shard.rows(np.array([i]))
                    row[:d] = x_i[0].numpy()
                    row[d] = labels[i]
                    far[i] = -1.0
                row = self.comm.sum(row)
                cent[j] = torch.from_numpy(row[:d].copy())
                counts[int(row[d])] -= 1
        if spherical:
            cent = cent / cent.norm(dim=1, keepdim=True).clamp_min(1e-30)
        return cent

    def own_distances(self, cent: torch.Tensor, labels: np.ndarray) -> tuple[np.ndarray, float]:
        """Exact ``|x - c_label|^2`` per local point and the global ``sum |x|^2 - 2 x.c + |c|^2`` (restart choice)."""
        _trim_heap()
        own = np.empty(self.shard.n)
        formula = 0.0
        c_np = cent.numpy()
        cn = np.einsum("ij,ij->i", c_np, c_np)
        cbuf = np.empty((self.shard.chunk_rows, self.shard.d))  # reused: no allocation per chunk
        for s, e in self.shard.chunks():
            x = self.shard.prepared(s, e).numpy()
            lab = labels[s:e]
            c = np.take(c_np, lab, axis=0, out=cbuf[: e - s])
            xc = np.einsum("ij,ij->i", x, c)
            formula += float(np.maximum(np.einsum("ij,ij->i", x, x) - 2.0 * xc + cn[lab], 0.0).sum())
            np.subtract(x, c, out=c)
            own[s:e] = np.einsum("ij,ij->i", c, c)
        return own, float(self.comm.sum(np.array([formula]))[0])

    def run(self, cent: torch.Tensor, *, spherical: bool, max_iter: int, tol: float, bar: Any,
            stats: dict[str, Any]) -> tuple[np.ndarray, torch.Tensor, list[float], int, bool]:
        """The reference's Lloyd loop (``capacity_kmeans_ref``) for one start."""
        if spherical:
            cent = cent / cent.norm(dim=1, keepdim=True).clamp_min(1e-30)
        state: dict | None = None
        labels: np.ndarray | None = None
        history: list[float] = []
        converged = False
        n_iter = 0
        for n_iter in range(1, max_iter + 1):  # noqa: B007 - n_iter is reported after the loop
            t0 = time.perf_counter()
            calls0, bytes0, exp0 = self.comm.calls, self.comm.bytes, self.cands.refreshed
            floor_prices = (state or {}).get("floor")
            prev_d = self.distance_pass(cent, floor_prices if floor_prices is not None else np.zeros(self.k), labels)
            new_labels, state, rounds = self.auction.assign(self.lo, self.hi, state)
            own_new = self.auction.own_d.copy()
            local = [float(own_new.sum())]
            if labels is not None:
                local += [float(prev_d.sum()), float((new_labels != labels).sum())]
            g = self.comm.sum(np.array(local))
            cost = float(g[0])
            own = own_new
            changed = None
            if labels is not None:
                prev_cost = float(g[1])
                changed = float(g[2])
                if cost > prev_cost:
                    new_labels, cost, own, changed = labels, prev_cost, prev_d, 0.0
            same = labels is not None and changed == 0.0
            improved = history[-1] - cost if history else math.inf
            labels = new_labels
            history.append(cost)
            cent = self.update_centroids(labels, cent, own, spherical)
            _trim_heap()
            stats["iteration_s"].append(time.perf_counter() - t0)
            stats["rounds"].append(int(rounds))
            stats["refreshed"].append(int(self.cands.refreshed - exp0))
            stats["collectives"].append(self.comm.calls - calls0)
            stats["comm_bytes"].append(self.comm.bytes - bytes0)
            bar.update(1)
            bar.set_postfix({"objective": f"{cost / (2.0 if spherical else 1.0):.6g}", "rounds": rounds})
            if same or improved <= tol * abs(history[-2] if len(history) > 1 else cost):
                converged = True
                break
        return labels, cent, history, n_iter, converged


def _kmeans_plusplus(x: torch.Tensor, k: int, rng: SplitMix64) -> torch.Tensor:
    """:func:`~cluster_kernels.kmeans.kmeans_plusplus_ref` with the trials of a step in one matrix product.

    The same draws from ``rng`` and the same choices (up to the rounding of the distances), several times
    faster: row norms are computed once and the candidates' distances together.
    """
    n = x.shape[0]
    trials = N_LOCAL_TRIALS_BASE + int(math.log(k))
    xn = _rownorms(x)

    def dist_to(rows: list[int]) -> torch.Tensor:
        return torch.from_numpy(np.maximum(xn.numpy()[:, None] - 2.0 * (x @ x[rows].T).numpy()
                                           + xn.numpy()[rows][None, :], 0.0))

    first = min(int(rng.uniform() * n), n - 1)
    centers = [first]
    closest = dist_to([first])[:, 0]
    for _ in range(1, k):
        cum = torch.cumsum(closest, 0)
        total = float(cum[-1])
        cands = []
        for _t in range(trials):
            r = rng.uniform() * total
            cands.append(min(int(torch.searchsorted(cum, torch.tensor(r, dtype=cum.dtype), right=True)), n - 1))
        dc = dist_to(cands)
        best_pot, best_t, best_d = math.inf, -1, closest
        for t in range(trials):
            nd = torch.minimum(closest, dc[:, t])
            pot = float(nd.sum())
            if pot < best_pot:
                best_pot, best_t, best_d = pot, t, nd
        centers.append(cands[best_t])
        closest = best_d
    return x[centers].clone()


def _init_sample(comm: _Comm, shard: _Shard, sizes: np.ndarray, size: int, seed: int) -> torch.Tensor | None:
    """Prepared rows of the k-means++ sample, in global order, on rank 0 (None on the other ranks)."""
    n_total = int(sizes.sum())
    if size >= n_total:
        wanted = np.arange(n_total, dtype=np.int64)
    else:
        wanted = np.sort(np.random.default_rng(seed).choice(n_total, size=size, replace=False)).astype(np.int64)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    counts = np.diff(np.searchsorted(wanted, bounds))  # sample rows held by each rank (known everywhere)
    offset = int(bounds[comm.rank])
    mine = wanted[(wanted >= offset) & (wanted < offset + shard.n)] - offset
    block = np.zeros((int(counts.max()), shard.d), dtype=shard.x.dtype)
    block[: len(mine)] = shard.take(mine)
    gathered = comm.gather_to_root(block)
    if gathered is None:
        return None
    return shard.prepare(np.concatenate([gathered[r, : counts[r]] for r in range(comm.world)]))


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
    n_candidates: int = DEFAULT_CANDIDATES,
    approx_distances: bool = True,
    progress: bool = True,
) -> DistributedKMeansResult:
    """Capacity-constrained K-means of data sharded over the ranks of a process group, out of core.

    Every rank calls it with its own contiguous row block; the result is the one
    :func:`~cluster_kernels.capacity_kmeans` gives on the concatenated data with the same arguments
    (``backend="torch"``; see the module docstring for what "the same" means under rounding). Without an
    initialised process group it runs as world size 1.

    Args:
        x_local: ``(n_r, d)`` float32/float64 numpy array, ``np.memmap`` (read ``chunk_rows`` rows at a
            time from its file; nothing of it stays resident) or CPU tensor: global rows
            ``[offset_r, offset_r + n_r)``, offsets in rank order. Never modified.
        k: number of clusters, ``1 <= k <= n`` (n = rows over all ranks).
        min_size, max_size: int or ``(k,)`` ints, global bounds per cluster (defaults 0 and n).
        metric: "sqeuclidean", or "cosine" (spherical k-means on L2-normalised rows).
        n_init: k-means++ restarts (one shared sample); the lowest inertia wins.
        max_iter: Lloyd iterations per restart.
        tol: stop when the objective falls by less than ``tol`` (relative) or no label changes.
        seed: seed of the sample and of the splitmix64 stream of k-means++.
        init: "k-means++", or a ``(k, d)`` array of initial centroids, the same on every rank.
        group: process group (default: the default group when initialised).
        chunk_rows: rows read and processed at once (default: about 8 MiB of float64 rows).
        init_sample_size: rows gathered for k-means++ (default ``min(n, 256 k)``; ``>= n`` uses all
            rows and reproduces the single-process init).
        n_candidates: clusters whose exact float64 distance is kept per point (all when
            ``k <= 2 n_candidates``); other distances are recomputed from the data row when needed.
        approx_distances: keep a 16-bit quantised ``(n_r, k)`` copy of the distances (``2 k + 16`` bytes
            per row, lower bounds within 1/65535 of each row's spread) to tell which exact distances a
            decision needs. Without it each point keeps one lower bound: less memory, but on
            high-dimensional data, where many clusters are nearly equidistant, most rows get recomputed.
        progress: tqdm bar on rank 0 (Lloyd iterations, global objective, auction rounds).

    Returns:
        :class:`DistributedKMeansResult`: ``labels`` (n_r,) int64 and ``distances`` (n_r,) of the local
        rows; ``centroids`` (k, d) in the input dtype, ``sizes`` (k,) int64, ``inertia``, ``history``
        global. Arrays follow the input type (numpy in, numpy out; a tensor in, tensors out).

    Raises:
        TypeError: x_local not a float32/float64 array, bad argument types.
        ValueError: ranks disagree on d, dtype or arguments, NaN/Inf rows (the global row is named),
            k outside [1, n], infeasible bounds, unknown metric, zero rows with ``metric="cosine"``.
    """
    t_start = time.perf_counter()
    is_tensor = isinstance(x_local, torch.Tensor)
    x = _as_local_array(x_local)
    if x.ndim != 2:
        raise ValueError(f"{OP}: x_local must be 2-D (n_local, d), got shape {x.shape}; reshape it.")
    _check_metric(metric, OP)
    n_init = _check_int(n_init, "n_init", 1, OP)
    max_iter = _check_int(max_iter, "max_iter", 1, OP)
    n_candidates = _check_int(n_candidates, "n_candidates", 1, OP)
    tol = _check_tol(tol, OP)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"{OP}: k must be an int, got {type(k).__name__} {k!r}.")
    comm = _Comm(group)
    n_local, d = x.shape
    spherical = metric == "cosine"

    # Handshake: every rank must agree on the shape, dtype and arguments, or all raise the same error.
    mine = np.array([n_local, d, x.itemsize, int(k), n_init, max_iter, int(seed) % (1 << 62),
                     int(spherical)], dtype=np.int64)
    every = comm.gather(mine)
    names = ["rows", "d", "itemsize", "k", "n_init", "max_iter", "seed", "metric"]
    for c in range(1, len(names)):
        if len(set(every[:, c].tolist())) > 1:
            raise ValueError(f"{OP}: ranks disagree on {names[c]}: {every[:, c].tolist()} (rank order); every rank "
                             "must pass rows of the same dimension and dtype, and the same arguments.")
    sizes_all = every[:, 0]
    n_total = int(sizes_all.sum())
    offset = int(sizes_all[: comm.rank].sum())
    k = _check_k(k, n_total, OP)
    lo, hi = _bounds(min_size, max_size, k, n_total, OP)
    if chunk_rows is None:
        chunk_rows = max(1024, CHUNK_BYTES // max(1, 8 * d))
    chunk_rows = _check_int(chunk_rows, "chunk_rows", 1, OP)
    if init_sample_size is None:
        init_sample_size = min(n_total, SAMPLE_PER_CLUSTER * k)
    init_sample_size = _check_int(init_sample_size, "init_sample_size", k, OP)
    init_t = None
    if not isinstance(init, str):
        init_t = torch.as_tensor(np.asarray(init.detach().cpu() if isinstance(init, torch.Tensor) else init),
                                 dtype=torch.float64)
        if tuple(init_t.shape) != (k, d) or not bool(torch.isfinite(init_t).all()):
            raise ValueError(f"{OP}: init must be a finite (k, d) = ({k}, {d}) array, got shape {tuple(init_t.shape)}.")
    elif init != "k-means++":
        raise ValueError(f"{OP}: init must be 'k-means++' or a (k, d) array of centroids, got {init!r}.")

    shard = _Shard(x, chunk_rows, spherical)
    try:
        # Pass 0: finiteness, zero rows (cosine) and the global mean.
        total = np.zeros(d)
        bad = _I64_MAX
        bad_zero = _I64_MAX
        for s, e in shard.chunks():
            block = shard.block(s, e)
            finite = np.isfinite(block).all(axis=1)
            if not finite.all():
                bad = min(bad, offset + s + int(np.argmin(finite)))
            if spherical:
                zero = ~(block != 0).any(axis=1)
                if zero.any():
                    bad_zero = min(bad_zero, offset + s + int(np.argmax(zero)))
            elif finite.all():
                total += block.sum(0, dtype=np.float64)
            shard.release(s, e)
        flags = comm.sum(total)
        worst = comm.max(-np.array([bad, bad_zero], dtype=np.int64))
        if -worst[0] != _I64_MAX:
            raise ValueError(
                f"{OP}: x contains NaN or Inf (first bad global row: {-worst[0]}); remove or impute those rows."
            )
        if -worst[1] != _I64_MAX:
            raise ValueError(f"{OP}: metric='cosine' needs non-zero rows, global row {-worst[1]} is all zeros.")
        if not spherical:
            shard.mean = torch.from_numpy(flags[:d] / n_total)
        prepare_s = time.perf_counter() - t_start

        t0 = time.perf_counter()
        starts: list[torch.Tensor] = []
        if init_t is not None:
            starts.append(init_t - shard.mean)
        else:
            sample = _init_sample(comm, shard, sizes_all, init_sample_size, int(seed))
            for run in range(n_init):
                cent = np.zeros((k, d))
                if comm.rank == 0:
                    cent = _kmeans_plusplus(sample, k, SplitMix64(run_seed(seed, run))).numpy()
                starts.append(torch.from_numpy(comm.broadcast(np.ascontiguousarray(cent)).copy()))
            del sample
        init_s = time.perf_counter() - t0
        _trim_heap()

        lloyd = _Lloyd(comm, shard, k, lo, hi, offset, n_total, n_candidates, bool(approx_distances))
        best = None
        stats: dict[str, Any] = {}
        for run, cent in enumerate(starts):
            run_stats: dict[str, Any] = {"iteration_s": [], "rounds": [], "refreshed": [], "collectives": [],
                                         "comm_bytes": []}
            desc = f"capacity k-means ({comm.world} ranks)"
            if len(starts) > 1:
                desc += f" run {run + 1}/{len(starts)}"
            bar = _progress(progress and comm.rank == 0, max_iter, desc)
            try:
                labels, cent, history, n_iter, converged = lloyd.run(cent, spherical=spherical, max_iter=max_iter,
                                                                     tol=float(tol), bar=bar, stats=run_stats)
            finally:
                bar.close()
            t_fin = time.perf_counter()
            own, final = lloyd.own_distances(cent, labels)
            run_stats["finish_s"] = time.perf_counter() - t_fin
            if best is None or final < best[0]:
                best = (final, labels, cent, history, n_iter, converged, own)
                stats = run_stats
        _, labels, cent, history, n_iter, converged, own = best

        scale = 0.5 if spherical else 1.0  # |a - b|^2 = 2 - 2 cos for unit vectors
        own = own * scale
        sizes = comm.sum(np.bincount(labels, minlength=k).astype(np.int64))
        inertia = float(comm.sum(np.array([own.sum()]))[0])
        centroids = (cent + shard.mean).numpy().astype(x.dtype)
        stats.update(init_s=init_s, prepare_s=prepare_s, world_size=comm.world, n_candidates=lloyd.cands.m,
                     chunk_rows=chunk_rows, init_sample_size=min(init_sample_size, n_total),
                     total_s=time.perf_counter() - t_start)

        def out(a: np.ndarray) -> Any:
            return torch.from_numpy(np.ascontiguousarray(a)) if is_tensor else a

        return DistributedKMeansResult(
            labels=out(labels.astype(np.int64)),
            centroids=out(centroids),
            distances=out(own.astype(x.dtype)),
            inertia=inertia,
            sizes=out(sizes),
            n_iter=int(n_iter),
            converged=bool(converged),
            history=[h * scale for h in history],
            offset=offset,
            n_total=n_total,
            stats=stats,
        )
    finally:
        shard.close()
