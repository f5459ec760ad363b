"""Collectives of the distributed K-means: numpy-in, numpy-out wrappers of ``torch.distributed``, row sharding,
and the distributed selection of the t-th smallest key that the auction's evictions and reverse steps need.

Without an initialised process group everything runs as world size 1 (each collective is the identity).
:class:`AuctionComm` is the object the native auction (``cluster_kernels._C.auction_block``) calls back for
its collectives; it exchanges nothing on one process, so the auction then never calls it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

OP = "distributed_capacity_kmeans"
GATHER_LIMIT = 1 << 10  # a rank all-gathers its selection candidates once it holds at most this many
I64_MAX = np.iinfo(np.int64).max


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
    comm = Comm(group)
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


class Comm:
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


def key_le(val: np.ndarray, gid: np.ndarray, tv: np.ndarray, tg: np.ndarray) -> np.ndarray:
    return (val < tv) | ((val == tv) & (gid <= tg))


def count_le(val: np.ndarray, gid: np.ndarray, pv: float, pg: int) -> int:
    """Entries ``<= (pv, pg)`` of arrays sorted by ``(val, gid)``."""
    left = int(np.searchsorted(val, pv, side="left"))
    right = int(np.searchsorted(val, pv, side="right"))
    return left + int(np.searchsorted(gid[left:right], pg, side="right"))


def cut(grp: np.ndarray, val: np.ndarray, gid: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, ...]:
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


def select(comm: Comm, grp: np.ndarray, val: np.ndarray, gid: np.ndarray,
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
    tg = np.full(n_groups, I64_MAX, dtype=np.int64)
    if len(val) > 2 * int(t.sum()) + 4096:
        grp, val, gid = cut(grp, val, gid, t)
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
        return gather_select(comm, grp, val, gid, lo, hi, need, bound, tv, tg)
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
        _narrow(comm, val, gid, lo, hi, need, total_g)
    return gather_select(comm, grp, val, gid, lo, hi, need, int(counts[:, n_groups].max()), tv, tg)


def _narrow(comm: Comm, val: np.ndarray, gid: np.ndarray, lo: np.ndarray, hi: np.ndarray, need: np.ndarray,
            total_g: np.ndarray) -> None:
    """One pivot step of :func:`select`: drop, per group, the candidates on the wrong side of a pivot.

    The windows ``[lo, hi)`` of the sorted candidates and the ranks still wanted (``need``) shrink in place.
    The pivot of a group is the weighted median (weights: candidates held) of the ranks' local guesses of
    where the need-th smallest lies.
    """
    n_groups = len(need)
    local = hi - lo
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
        le_local[g] = count_le(val[lo[g] : hi[g]], gid[lo[g] : hi[g]], pv[g], pg[g])
    le = comm.sum(le_local)
    for g in np.nonzero(active)[0]:
        if le[g] >= need[g]:
            hi[g] = lo[g] + le_local[g]
        else:
            lo[g] += le_local[g]
            need[g] -= le[g]

def gather_select(comm: Comm, grp: np.ndarray, val: np.ndarray, gid: np.ndarray, lo: np.ndarray, hi: np.ndarray,
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


class AuctionComm:
    """The collectives of the native auction (``_C.auction_block``) over a :class:`Comm`.

    The auction runs in C++ on this rank's cost rows and calls back, with the GIL, ``sum`` (int64 counts),
    ``max`` (float64: the cost span, the regret bounds) and ``select`` (the evicted or pulled points'
    threshold); ``distributed`` is False on one process, where it calls nothing.
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.distributed = comm.world > 1

    def sum(self, a: np.ndarray) -> np.ndarray:
        return self.comm.sum(a)

    def max(self, a: np.ndarray) -> np.ndarray:
        return self.comm.max(a)

    def select(self, grp: np.ndarray, val: np.ndarray, gid: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, ...]:
        return select(self.comm, grp, val, gid, t)
