"""One rank's side of the distributed Lloyd iterations: its distance rows, the native auction, the centroid sums.

Per Lloyd iteration a rank streams its shard twice (:class:`~cluster_kernels._shard.Shard`): once for the
float64 distances of its rows to the centroids (centred ``|x|^2 - 2 x.c + |c|^2``, the reference's
expression), kept as its ``(n_r, k)`` block of the global cost matrix, and once for the cluster sums. The
assignment is the auction of the single-process C++ path (``cluster_kernels._C.auction_block``, csrc/cpu/
auction.cpp) on that block, with the collectives of :class:`~cluster_kernels._collectives.AuctionComm`.
The k-means++ sample (gathered on rank 0) is drawn here too.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from cluster_kernels import _backend
from cluster_kernels._collectives import I64_MAX, OP, AuctionComm, Comm
from cluster_kernels._shard import Shard, trim_heap


def rownorms(x: torch.Tensor) -> torch.Tensor:
    """``(x * x).sum(1)`` in float64 (numpy's einsum: ~10x faster on CPU, equal up to rounding)."""
    xn = x.numpy()
    return torch.from_numpy(np.einsum("ij,ij->i", xn, xn))


def sqdist(x: torch.Tensor, c: torch.Tensor, cn: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``|x|^2 - 2 x.c + |c|^2`` clamped at 0, the reference's expression (``cn = (c * c).sum(1)``).

    In place in ``out`` (``(>= len(x), k)``) when given: ``x.c``, times -2, plus ``|x|^2``, plus ``|c|^2``, the
    same roundings as the reference's ``|x|^2 - 2 (x.c) + |c|^2``. Only the product runs in torch (its
    threads); the element-wise steps run in numpy, because torch's parallel regions on small blocks cost
    more than they save when cores are shared.
    """
    out = torch.empty(len(x), len(c), dtype=torch.float64) if out is None else out[: len(x)]
    torch.matmul(x, c.T, out=out)
    o = out.numpy()
    o *= -2.0
    o += rownorms(x).numpy()[:, None]
    o += cn.numpy()[None, :]
    np.maximum(o, 0.0, out=o)
    return out


def progress(enabled: bool, total: int, desc: str) -> Any:
    """A tqdm bar of Lloyd iterations (a silent one when not enabled)."""
    return tqdm(total=total, desc=desc, unit="it", disable=not enabled, dynamic_ncols=True, leave=False)


class Lloyd:
    """One rank's side of the Lloyd iterations on prepared data (the reference's ``capacity_kmeans_ref``)."""

    def __init__(self, comm: Comm, shard: Shard, k: int, lo: np.ndarray, hi: np.ndarray, offset: int,
                 n_total: int) -> None:
        self.comm, self.shard, self.k, self.lo, self.hi = comm, shard, k, lo, hi
        self.offset, self.n_total = offset, n_total
        self.native = _backend.require_cpu_native(OP)
        self.auction_comm = AuctionComm(comm)
        self.dist = np.empty((shard.n, k))  # this rank's rows of the global float64 cost matrix

    def distance_pass(self, cent: torch.Tensor) -> None:
        """The distances of every local row to the centroids, into :attr:`dist`."""
        cn = (cent * cent).sum(1)
        block = torch.from_numpy(self.dist)
        for s, e in self.shard.chunks():
            sqdist(self.shard.prepared(s, e), cent, cn, block[s:e])

    def own(self, labels: np.ndarray) -> np.ndarray:
        """Distance of every local row to the cluster ``labels`` gives it."""
        return np.take_along_axis(self.dist, labels[:, None], axis=1)[:, 0]

    def assign(self, state: dict) -> tuple[np.ndarray, dict, int]:
        """The auction on the global cost matrix (warm-started from ``state``); every rank gets its labels."""
        out = self.native.auction_block(self.dist, self.lo, self.hi, self.auction_comm, self.offset, self.n_total,
                                        state.get("floor"), state.get("general"), torch.get_num_threads(),
                                        state.get("working"))
        state = {"floor": out["floor_prices"], "working": out["working"]}
        if len(out["general_prices"]):
            state["general"] = out["general_prices"]
        return out["labels"], state, int(out["rounds"])

    def update_centroids(self, labels: np.ndarray, own: np.ndarray, spherical: bool) -> torch.Tensor:
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
            self._reseed(cent, empty, counts, labels, own)
        if spherical:
            cent = cent / cent.norm(dim=1, keepdim=True).clamp_min(1e-30)
        return cent

    def _reseed(self, cent: torch.Tensor, empty: np.ndarray, counts: np.ndarray, labels: np.ndarray,
                own: np.ndarray) -> None:
        """Each empty cluster takes the globally farthest point among clusters of size > 1 (in place)."""
        d = self.shard.d
        far = own.copy()
        for j in empty:
            movable = counts[labels] > 1
            cand = np.where(movable, far, -1.0)
            i = int(np.argmax(cand)) if len(cand) else -1
            mine = np.array([cand[i] if i >= 0 else -np.inf, self.offset + i if i >= 0 else I64_MAX],
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

    def own_distances(self, cent: torch.Tensor, labels: np.ndarray) -> tuple[np.ndarray, float]:
        """Exact ``|x - c_label|^2`` per local point and the global ``sum |x|^2 - 2 x.c + |c|^2`` (restart choice)."""
        trim_heap()
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
        state: dict = {}
        labels: np.ndarray | None = None
        history: list[float] = []
        converged = False
        n_iter = 0
        for n_iter in range(1, max_iter + 1):  # noqa: B007 - n_iter is reported after the loop
            t0 = time.perf_counter()
            calls0, bytes0 = self.comm.calls, self.comm.bytes
            self.distance_pass(cent)
            new_labels, state, rounds = self.assign(state)
            own = self.own(new_labels)
            cost, labels, own, same = self._keep_better(labels, new_labels, own)
            improved = history[-1] - cost if history else math.inf
            history.append(cost)
            cent = self.update_centroids(labels, own, spherical)
            trim_heap()
            stats["iteration_s"].append(time.perf_counter() - t0)
            stats["rounds"].append(int(rounds))
            stats["collectives"].append(self.comm.calls - calls0)
            stats["comm_bytes"].append(self.comm.bytes - bytes0)
            bar.update(1)
            shown = cost / 2.0 if spherical else self.shard.scale.up_sq(cost)  # the caller's units
            bar.set_postfix({"objective": f"{shown:.6g}", "rounds": rounds})
            if same or improved <= tol * abs(history[-2] if len(history) > 1 else cost):
                converged = True
                break
        return labels, cent, history, n_iter, converged

    def _keep_better(self, labels: np.ndarray | None, new_labels: np.ndarray,
                     own_new: np.ndarray) -> tuple[float, np.ndarray, np.ndarray, bool]:
        """The new labels unless the previous ones cost less (the objective never increases).

        Returns the global objective, the labels kept, their distances, and whether no label changed.
        """
        local = [float(own_new.sum())]
        if labels is not None:
            prev_d = self.own(labels)
            local += [float(prev_d.sum()), float((new_labels != labels).sum())]
        g = self.comm.sum(np.array(local))
        if labels is None:
            return float(g[0]), new_labels, own_new, False
        if float(g[0]) > float(g[1]):
            return float(g[1]), labels, prev_d, True
        return float(g[0]), new_labels, own_new, float(g[2]) == 0.0


# --------------------------------------------------------------------------------------------------
# Seeding
# --------------------------------------------------------------------------------------------------


def init_sample(comm: Comm, shard: Shard, sizes: np.ndarray, size: int, seed: int) -> torch.Tensor | None:
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
