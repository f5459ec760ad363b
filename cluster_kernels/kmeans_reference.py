r"""The float64 reference of capacity-constrained K-means: the oracle the tests compare the native code with.

Maths
-----
For fixed centroids :math:`c_1..c_K` and per-cluster bounds :math:`lo_j \le |C_j| \le hi_j`, the
assignment minimising :math:`\sum_i D_{i,\ell(i)}` with :math:`D_{ij} = \|x_i - c_j\|^2` is a
transportation problem. Its dual has one price :math:`\lambda_j` per cluster; every point takes
:math:`\arg\min_j D_{ij} + \lambda_j`. We find the prices with epsilon-scaling *eviction auctions*
(eps shrinks by ``EPS_SHRINK`` per phase from ``EPS_START`` — ``EPS_WARM`` when prices are kept
from the previous Lloyd iteration — down to ``EPS_FINAL``, all relative to the cost range):

1. **Floor auction** for the problem without lower bounds. Prices are >= 0 and a cluster with a
   positive price must be exactly full (complementary slackness). A round: every over-full cluster
   evicts its ``excess`` members with the smallest ``(regret, index)`` (regret = second-best cost
   minus own cost) and raises its price by the last evicted regret plus eps; all over-full
   clusters at once (Jacobi, the GPU form); evicted points re-bid at the new prices. Members never
   leave otherwise, so full clusters stay full and the phase ends when none is over-full. Each
   phase starts from the exact argmin; a cluster then below its cap with a positive price lowers
   its price just enough to pull in its deficit (a reverse step; it stops at 0, where room is
   allowed). Slack capacity costs nothing: an arrival at a cluster with room is absorbed.
2. If that solution meets the lower bounds it is optimal for the full problem (it is optimal for a
   relaxation). Otherwise the **general auction** runs: each cluster is split into a mandatory part
   (``lo_j`` slots, real points only) and an optional part (``hi_j - lo_j`` slots), and
   ``sum(hi) - n`` zero-cost dummy units fill the free optional slots, so every part ends exactly
   full; the same eviction rounds apply (dummies are evicted first on equal regret).

Both end with every point within eps of its cheapest cluster, so the assignment costs at most
``OPT + (n + dummies) * eps_final``: the LP optimum in practice (the tests compare with HiGHS). The floor
auction also certifies: once eps is at most ``EPS_CERTIFY`` of the cost range, after each phase it looks for
prices under which its labels are exactly optimal (:func:`_exact_prices_ref`: difference constraints between
the clusters, Bellman-Ford); when they exist the labels are the LP optimum exactly, those prices are kept for
the next warm start, and the remaining phases, which could only confirm it, are skipped.

The native CPU auction (csrc/cpu/working_set.cpp, ``WorkingSet``) also solves warm floor problems on a *working
set* when the caps leave at least an eighth of the rows free and ``n >= 4096``: every row is held at its cheapest
cluster at the previous prices except the 1/32 with the smallest margin (second-cheapest less cheapest cost, and
more when the last call's set was larger); the caps lose the held rows, the floor auction runs on the set, and any
held row no longer at a cheapest cluster at the prices found joins the set for another solve. When none is left,
those prices certify the whole assignment (every row at its best, every cluster with a positive price full), so it
is optimal for the whole problem: the labels are the reference's wherever the optimum is unique, while prices and
round counts differ (the tests compare those with the reference with the working set off). A set that grows past a
quarter of the rows falls back to the whole problem, and the next 1, 2, 4, ... calls solve whole directly; so does
the call after a cold start. Late Lloyd iterations, whose prices move little, gain the most.

Lloyd iterations alternate this assignment with the centroid update (cluster means; renormalised
for ``metric="cosine"``); the previous labels stay when the new assignment would not lower the
objective, so the objective never increases. Initialisation is greedy k-means++ (``2 + ln K`` local
trials, as scikit-learn does) with a splitmix64 stream, so a seed gives the same centroids
everywhere. The reference centres the data (in float64) before distances ``|x|^2 - 2 x.c + |c|^2`` are
formed; the native CPU path centres too (in the data's dtype, for float32 precision) unless the mean is already
small next to the spread (``|mean|^2`` at most a quarter of the mean squared distance to the mean), where it
uses the rows in place: the rounding bound grows by at most that quarter and no ``n x d`` copy is made
(csrc/cpu/prepare.cpp, ``kCentreRatio``). The centred rows are formed tile by tile inside the distance
passes, never stored: no ``n x d`` copy is made either way.

Numerical range: the objective is scale-equivariant, so data whose largest ``|entry|`` (explicit
centroids included) lies outside ``[2^-24, 2^24]`` are first multiplied by a power of two ``2^-e``
that brings it into ``[0.5, 1)`` (exact: powers of two commute with rounding), and distances,
inertia, history and centroids are reported in the caller's units. So ``x * 2^m`` gives bit for bit
the labels of ``x``, float32 products never over- or underflow, and any finite input is clustered
unless its squared distances cannot be represented: ``metric="sqeuclidean"`` refuses (``ValueError``
naming the range) data whose squared extent ``sum_j (max_j - min_j)^2`` exceeds half the dtype's
largest value (float32: ~1.7e38, i.e. entries up to ~1e18; float64: ~9e307) or whose ``n`` times
squared extent exceeds half float64's (the inertia). Reported distances below the dtype's smallest
subnormal are 0. See ``cluster_kernels._checks.data_scale``.

Where each function is implemented natively
-------------------------------------------
The C++ (csrc/cpu) and CUDA (csrc/cuda) files of the same name port these functions; csrc/common holds what both
share (parameters, state, result; the auction objects; the certificate's exact prices).

==============================  ====================================================  ==========================
reference function              csrc/cpu                                              csrc/cuda
==============================  ====================================================  ==========================
``prepare_rows``                prepare.cpp (rows centred per tile, never copied)     prepare.cu
``sqdist_ref``                  distance_tiles.cpp                                    distance_tiles.cu
``kmeans_plusplus``             kmeans_plusplus.cpp                                   kmeans_plusplus.cu
``update_centroids_ref``        centroids.cpp                                         centroids.cu
``capacity_kmeans_ref``         lloyd.cpp                                             lloyd.cu
``assign_ref``                  auction.cpp                                           auction.cu
``_eps_schedule``               auction_steps.cpp (eps_schedule)                      auction_steps.cu
``_floor_auction_ref``          floor_auction.cpp (+ working_set.cpp, heaps.cpp)      floor_auction.cu
``_floor_start_ref``            floor_auction.cpp (start, bid_all)                    floor_auction.cu
``_floor_pull_ref``             reverse_step.cpp                                      reverse_step.cu
``_floor_round_ref``            floor_auction.cpp (round) + heaps.cpp                 floor_auction.cu
``_exact_prices_ref``           certificate.cpp + common/certificate.h                certificate.cu
``_Objects``                    common/auction_objects.h (Objects)                    (the same header)
``_dummy_auction_ref``          dummy_auction.cpp                                     dummy_auction.cu
``_dummy_round_ref``            dummy_auction.cpp (round, split_evictions)            dummy_auction.cu
``SplitMix64``, ``run_seed``    common/params.h                                       (the same header)
==============================  ====================================================  ==========================
"""

from __future__ import annotations

import math

import numpy as np
import torch

EPS_START = 0.1  # cold-start eps, as a fraction of the cost range
EPS_WARM = 1e-2  # warm-start eps (prices kept from the previous Lloyd iteration); see BENCHMARKS.md (issue 22)
EPS_FINAL = 1e-10  # final eps, as a fraction of the cost range (float64 costs)
EPS_SHRINK = 8.0
EPS_CERTIFY = 1e-4  # from this eps on, the floor auction checks after each phase whether its labels are optimal
MAX_ROUNDS = 1_000_000  # internal safety net; the auction terminates long before
N_LOCAL_TRIALS_BASE = 2



# --------------------------------------------------------------------------------------------------
# Auctions and Lloyd iterations (float64 torch; the test oracle and the fallback on any device)
# --------------------------------------------------------------------------------------------------


class _Objects:
    """Split of each cluster into a mandatory part (lo slots) and an optional part (hi - lo slots)."""

    def __init__(self, lo: np.ndarray, hi: np.ndarray):
        cluster, cap, dummy_ok = [], [], []
        for j in range(len(lo)):
            if lo[j] > 0:
                cluster.append(j), cap.append(int(lo[j])), dummy_ok.append(False)
            if hi[j] > lo[j]:
                cluster.append(j), cap.append(int(hi[j] - lo[j])), dummy_ok.append(True)
        self.cluster = np.asarray(cluster, dtype=np.int64)
        self.cap = np.asarray(cap, dtype=np.int64)
        self.dummy_ok = np.asarray(dummy_ok, dtype=bool)
        self.m = len(cluster)


def _cheapest_dummy_object(prices: np.ndarray, dummy_ok: np.ndarray, exclude: int = -1) -> int:
    """The cheapest object that may hold dummies, other than ``exclude`` (lowest index on ties); -1 if none."""
    best, best_p = -1, math.inf
    for o in range(len(prices)):
        if dummy_ok[o] and o != exclude and prices[o] < best_p:
            best, best_p = o, prices[o]
    return best


def _eps_schedule(dist: torch.Tensor, prices: np.ndarray, warm: bool) -> tuple[float, float, float]:
    """(first eps, final eps, span): eps relative to the largest per-point cost range, the span (as
    csrc/cpu/auction_steps.cpp)."""
    cost_span = float((dist.max(dim=1).values - dist.min(dim=1).values).max()) if dist.shape[0] else 0.0
    span = cost_span if cost_span > 0 else 1.0
    pmax = float(np.abs(prices).max()) if len(prices) else 0.0
    eps_final = max(EPS_FINAL * span, 64 * np.finfo(np.float64).eps * (float(dist.abs().max()) + pmax + span))
    return max((EPS_WARM if warm else EPS_START) * span, eps_final), eps_final, span


def _exact_prices_ref(dist: torch.Tensor, hi: np.ndarray, prices: np.ndarray, eps: float,
                      obj: torch.Tensor) -> np.ndarray | None:
    """The floor auction's certificate after a phase: exact prices for the labels ``obj``, or None.

    The labels (no cluster above its cap) are optimal, exactly, iff prices ``x >= 0`` with ``x[j] = 0`` below
    the cap exist under which every point sits at its exact argmin of ``dist + x``: difference constraints on
    ``y = x - prices``, ``y[a] - y[b] <= (dist[i, b] + p[b]) - (dist[i, a] + p[a])`` for the points i of a, solved
    by Bellman-Ford (Jacobi sweeps from ``y = 0``; a node T holds the bounds). Only the pairs whose smallest such
    difference lies below the reach ``2 (k + 1) eps`` are used; the others cannot bind when no ``y`` fell by the
    reach, which is checked. None when a negative cycle remains (the labels are not optimal) or that check fails.
    Mirrors csrc/common/certificate.h, exact_prices.
    """
    n, k = dist.shape
    reach = 2.0 * float(k + 1) * eps
    p_t = torch.as_tensor(prices, device=dist.device)
    gap = (dist + p_t) - (dist.gather(1, obj[:, None]) + p_t[obj][:, None])
    gap[torch.arange(n, device=dist.device), obj] = math.inf
    gap = torch.where(gap < reach, gap, torch.full_like(gap, math.inf))
    slack = torch.full((k, k), math.inf, dtype=torch.float64, device=dist.device)
    slack.scatter_reduce_(0, obj[:, None].expand(n, k), gap, reduce="amin")
    slack = slack.cpu().numpy()
    counts = np.bincount(obj.cpu().numpy(), minlength=k)
    below = counts < hi
    y = np.zeros(k + 1)  # y[k]: the node T of the bounds
    for _ in range(k + 2):
        nxt = y.copy()
        nxt[:k] = np.minimum(nxt[:k], (y[None, :k] + slack).min(axis=1))
        nxt[k] = min(nxt[k], float((y[:k] + prices).min()))
        nxt[:k][below] = np.minimum(nxt[:k][below], y[k] - prices[below])
        if np.array_equal(nxt, y):
            break
        y = nxt
    else:
        return None
    if not -y.min() < reach:
        return None
    return (prices + y[:k]) - y[k]


def _floor_pull_ref(dist: torch.Tensor, obj: torch.Tensor, counts: np.ndarray, prices: np.ndarray, j: int, r: int,
                    eps: float) -> None:
    """Reverse step of the under-full cluster j: lower its price to pull in the ``r`` smallest gaps (in place)."""
    dev = dist.device
    p_t = torch.as_tensor(prices, device=dev)
    gap = ((dist[:, j] + p_t[j]) - (dist.gather(1, obj[:, None])[:, 0] + p_t[obj])).cpu().numpy()
    gap[obj.cpu().numpy() == j] = math.inf
    cand = np.lexsort((np.arange(len(gap)), gap))[:r]
    drop = gap[cand[-1]] + eps
    if drop >= prices[j]:
        d0 = prices[j]
        prices[j] = 0.0
        cand = cand[gap[cand] - d0 < -eps]
    else:
        prices[j] -= drop
    np.subtract.at(counts, obj[torch.as_tensor(cand, device=dev, dtype=torch.long)].cpu().numpy(), 1)
    obj[torch.as_tensor(cand, device=dev, dtype=torch.long)] = j
    counts[j] += len(cand)


def _floor_start_ref(dist: torch.Tensor, hi: np.ndarray, prices: np.ndarray, eps: float,
                     obj: torch.Tensor | None) -> torch.Tensor:
    """Phase start of the floor auction (prices change in place); returns the labels.

    Exact argmin in the first phase (``obj`` None), then only the points violating the new eps move; a
    cluster below its cap with a positive price then lowers its price just enough to pull in its deficit
    (reverse step), stopping at 0 where room is allowed.
    """
    n, k = dist.shape
    dev = dist.device
    c = dist + torch.as_tensor(prices, device=dev)
    best_cost, best = c.min(dim=1)
    if obj is None:
        obj = best
    else:
        obj = torch.where(c.gather(1, obj[:, None])[:, 0] > best_cost + eps, best, obj)
    if int(hi.sum()) - n <= 0:
        return obj
    counts = torch.bincount(obj, minlength=k).cpu().numpy()
    for pass_ in range(10**9):
        changed = False
        for j in range(k):
            if counts[j] >= hi[j] or prices[j] <= 0:
                continue
            changed = True
            if pass_ >= 4 * k:  # safety net, as in csrc/cpu/floor_auction.cpp
                prices[j] = 0.0
                continue
            _floor_pull_ref(dist, obj, counts, prices, j, int(hi[j] - counts[j]), eps)
        if not changed:
            return obj
        if pass_ >= 4 * k:
            obj = torch.argmin(dist + torch.as_tensor(prices, device=dev), dim=1)
            counts = torch.bincount(obj, minlength=k).cpu().numpy()
    return obj


def _floor_round_ref(dist: torch.Tensor, hi: np.ndarray, prices: np.ndarray, eps: float, obj: torch.Tensor,
                     over: list[int], counts: torch.Tensor) -> np.ndarray:
    """One forward round: every over-full cluster evicts its ``excess`` smallest (regret, index) members and
    raises its price past the last of them; the evicted re-bid (``obj`` in place). Returns the new prices."""
    dev = dist.device
    idx = torch.arange(dist.shape[0], device=dev)
    c = dist + torch.as_tensor(prices, device=dev)
    new_prices = prices.copy()
    evicted = []
    for j in over:
        members = idx[obj == j]
        other = c[members].clone()
        other[:, j] = math.inf
        regret = (other.min(dim=1).values - c[members, j]).cpu().numpy()
        excess = int(counts[j]) - int(hi[j])
        order = np.lexsort((members.cpu().numpy(), regret))[:excess]
        new_prices[j] = prices[j] + regret[order[-1]] + eps
        evicted.append(members[torch.as_tensor(order, device=dev, dtype=torch.long)])
    ev = torch.cat(evicted)
    obj[ev] = torch.argmin(dist[ev] + torch.as_tensor(new_prices, device=dev), dim=1)
    return new_prices


def _floor_auction_ref(dist: torch.Tensor, hi: np.ndarray, prices: np.ndarray | None) -> tuple[torch.Tensor, np.ndarray,
                                                                                                 int]:
    """The problem without lower bounds, in the floor form of the dual (prices >= 0, and a cluster
    with a positive price is exactly full). Returns labels, prices, rounds."""
    k = dist.shape[1]
    warm = prices is not None and len(prices) == k
    prices = prices.astype(np.float64).copy() if warm else np.zeros(k)
    eps, eps_final, span = _eps_schedule(dist, prices, warm)
    hi_t = torch.as_tensor(hi, device=dist.device)
    obj = _floor_start_ref(dist, hi, prices, eps, None)
    rounds = 0
    while True:
        while True:
            counts = torch.bincount(obj, minlength=k)
            over = torch.nonzero(counts > hi_t)[:, 0].tolist()
            if not over:
                break
            rounds += 1
            if rounds > MAX_ROUNDS:
                raise RuntimeError("assign_ref: the auction did not terminate (internal error)")
            prices = _floor_round_ref(dist, hi, prices, eps, obj, over, counts)
        if eps <= eps_final:
            break
        if eps <= EPS_CERTIFY * span:
            exact = _exact_prices_ref(dist, hi, prices, eps, obj)
            if exact is not None:
                prices = exact
                break
        eps = max(eps / EPS_SHRINK, eps_final)
        obj = _floor_start_ref(dist, hi, prices, eps, obj)
    return obj, prices, rounds


def assign_ref(
    dist: torch.Tensor, lo: np.ndarray, hi: np.ndarray, state: dict | None = None, force_general: bool = False
) -> tuple[torch.Tensor, dict, int]:
    """Optimal capacity-constrained assignment by eps-scaling eviction auctions (reference).

    The problem without lower bounds is solved first (floor auction); when its solution meets the
    lower bounds it is optimal, otherwise the general auction with dummy units runs.

    Args:
        dist: (n, k) float64 costs.
        lo, hi: (k,) int64 bounds with ``sum(lo) <= n <= sum(hi)``.
        state: prices from a previous call (warm start), as returned.
        force_general: run the general auction directly (tests).

    Returns:
        labels (n,) int64 on dist's device, state for the next call, auction rounds.
    """
    state = dict(state or {})
    rounds = 0
    if not force_general:
        labels, state["floor"], rounds = _floor_auction_ref(dist, hi, state.get("floor"))
        if (torch.bincount(labels, minlength=dist.shape[1]).cpu().numpy() >= lo).all():
            return labels, state, rounds
    labels, state["general"], more = _dummy_auction_ref(dist, lo, hi, state.get("general"))
    return labels, state, rounds + more


def _dummy_evict_ref(c: torch.Tensor, members: torch.Tensor, o: int, excess: int, n_dummies: int,
                     rho: float) -> tuple[torch.Tensor, int, float]:
    """Evictions of the over-full object o: the ``excess`` smallest (regret, index) units, dummies first on
    equal regret. Returns the real members evicted, the dummies evicted and the last evicted regret."""
    own = c[members, o]
    other = c[members].clone()
    other[:, o] = math.inf
    regret = (other.min(dim=1).values - own).cpu().numpy()
    order = np.lexsort((members.cpu().numpy(), regret))
    n_real_ev = n_dum_ev = 0
    last = -math.inf
    for _ in range(excess):
        if n_dum_ev < n_dummies and (n_real_ev >= len(order) or rho <= regret[order[n_real_ev]]):
            n_dum_ev += 1
            last = rho
        else:
            last = regret[order[n_real_ev]]
            n_real_ev += 1
    return members[torch.as_tensor(order[:n_real_ev], device=c.device, dtype=torch.long)], n_dum_ev, last


def _dummy_round_ref(dist: torch.Tensor, objs: _Objects, prices: np.ndarray, eps: float, obj: torch.Tensor,
                     dummies: np.ndarray, over: np.ndarray, units: np.ndarray) -> np.ndarray:
    """One forward round of the general auction (``obj`` and ``dummies`` in place); returns the new prices."""
    dev = dist.device
    ocl = torch.as_tensor(objs.cluster, device=dev)
    idx = torch.arange(dist.shape[0], device=dev)
    c = dist[:, ocl] + torch.as_tensor(prices, device=dev)
    new_prices = prices.copy()
    evicted = []  # real points leaving an over-full object this round
    dummy_moves = []  # (source object, count)
    for o in over:
        dst_dummy = _cheapest_dummy_object(prices, objs.dummy_ok, exclude=o)
        rho = prices[dst_dummy] - prices[o] if (dummies[o] > 0 and dst_dummy >= 0) else math.inf
        ev, n_dum_ev, last = _dummy_evict_ref(c, idx[obj == o], o, int(units[o] - objs.cap[o]), int(dummies[o]), rho)
        new_prices[o] = prices[o] + last + eps
        evicted.append(ev)
        if n_dum_ev:
            dummy_moves.append((o, n_dum_ev))
    # Evicted units re-bid at the new prices, so no unit ever sits more than eps from its best.
    ev = torch.cat(evicted)
    if len(ev):
        obj[ev] = torch.argmin(dist[ev][:, ocl] + torch.as_tensor(new_prices, device=dev), dim=1)
    if dummy_moves:
        dst = _cheapest_dummy_object(new_prices, objs.dummy_ok)
        for src, cnt in dummy_moves:
            dummies[src] -= cnt
            dummies[dst] += cnt
    return new_prices


def _dummy_auction_ref(
    dist: torch.Tensor, lo: np.ndarray, hi: np.ndarray, prices: np.ndarray | None = None
) -> tuple[torch.Tensor, np.ndarray, int]:
    """The general problem: mandatory/optional objects per cluster, dummies fill free optional slots."""
    n, k = dist.shape
    dev = dist.device
    objs = _Objects(lo, hi)
    m = objs.m
    warm = prices is not None and len(prices) == m
    prices = prices.astype(np.float64).copy() if warm else np.zeros(m)
    ocl = torch.as_tensor(objs.cluster, device=dev)
    eps, eps_final, _ = _eps_schedule(dist, prices, warm)
    cap = objs.cap
    dummies = np.zeros(m, dtype=np.int64)
    n_dummy = int(hi.sum()) - n

    def costs() -> torch.Tensor:
        return dist[:, ocl] + torch.as_tensor(prices, device=dev)

    # Cold and warm start alike: every unit takes its cheapest object.
    obj = torch.argmin(costs(), dim=1)  # argmin returns the first minimum: lowest index on ties
    real = np.bincount(obj.cpu().numpy(), minlength=m)
    for o in sorted(range(m), key=lambda o: (prices[o], o)):
        if objs.dummy_ok[o] and n_dummy - dummies.sum() > 0:
            dummies[o] = min(max(cap[o] - real[o], 0), n_dummy - dummies.sum())
    if dummies.sum() < n_dummy:
        dummies[_cheapest_dummy_object(prices, objs.dummy_ok)] += n_dummy - dummies.sum()

    rounds = 0
    while True:
        # ---- auction rounds at this eps
        while True:
            units = real + dummies
            over = np.nonzero(units > cap)[0]
            if len(over) == 0:
                break
            rounds += 1
            if rounds > MAX_ROUNDS:
                raise RuntimeError("assign_ref: the auction did not terminate (internal error)")
            prices = _dummy_round_ref(dist, objs, prices, eps, obj, dummies, over, units)
            real = np.bincount(obj.cpu().numpy(), minlength=m)
        if eps <= eps_final:
            break
        # ---- next phase: shrink eps, move the units that violate it
        eps = max(eps / EPS_SHRINK, eps_final)
        c = costs()
        best_cost, best = c.min(dim=1)
        own = c.gather(1, obj[:, None])[:, 0]
        obj = torch.where(own > best_cost + eps, best, obj)
        real = np.bincount(obj.cpu().numpy(), minlength=m)
        cheapest = _cheapest_dummy_object(prices, objs.dummy_ok)
        for o in range(m):
            if dummies[o] > 0 and prices[o] > prices[cheapest] + eps:
                dummies[cheapest] += dummies[o]
                dummies[o] = 0
    return ocl[obj], prices, rounds


def sqdist_ref(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Squared distances ``|x_i|^2 - 2 x_i.c_j + |c_j|^2`` (clamped at 0) of rows to centroids, ``(n, k)``."""
    d = (x * x).sum(1)[:, None] - 2.0 * (x @ c.T) + (c * c).sum(1)[None, :]
    return d.clamp_min_(0.0)


class SplitMix64:
    """The splitmix64 stream used by every backend, so a seed gives the same draws everywhere."""

    MASK = (1 << 64) - 1

    def __init__(self, seed: int):
        self.state = seed & self.MASK

    def next_u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & self.MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self.MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self.MASK
        return z ^ (z >> 31)

    def uniform(self) -> float:
        return (self.next_u64() >> 11) * (1.0 / (1 << 53))


def run_seed(seed: int, run: int) -> int:
    """Seed of restart ``run`` (matches csrc/common/params.h)."""
    return (int(seed) * 0x100000001B3 + run * 0x9E3779B97F4A7C15 + 1) & SplitMix64.MASK


def kmeans_plusplus(x: torch.Tensor, k: int, rng: SplitMix64) -> torch.Tensor:
    """Greedy k-means++ seeding on prepared rows ``x`` (float64, any device). Returns ``(k, d)`` centroids.

    Each step draws ``2 + ln k`` candidates from the splitmix64 stream (probability proportional to the squared
    distance to the closest centre so far) and keeps the one of lowest potential, as scikit-learn does. Row norms
    are computed once and the candidates' distances in one matrix product. The only k-means++ of the Python
    paths (the torch reference and the distributed K-means); the tests check it against a float64 oracle.
    """
    n = x.shape[0]
    trials = N_LOCAL_TRIALS_BASE + int(math.log(k))
    xn = (x * x).sum(1)

    def dist_to(rows: list[int]) -> torch.Tensor:
        idx = torch.as_tensor(rows, device=x.device)
        return (xn[:, None] - 2.0 * (x @ x[idx].T) + xn[idx][None, :]).clamp_min_(0.0)

    first = min(int(rng.uniform() * n), n - 1)
    centers = [first]
    closest = dist_to([first])[:, 0]
    for _ in range(1, k):
        cum = torch.cumsum(closest, 0)
        total = float(cum[-1])
        draws = torch.tensor([rng.uniform() * total for _ in range(trials)], dtype=cum.dtype, device=cum.device)
        cands = torch.searchsorted(cum, draws, right=True).clamp_max_(n - 1).tolist()
        dc = dist_to(cands)
        pots = [float(torch.minimum(closest, dc[:, t]).sum()) for t in range(trials)]
        best_t = min(range(trials), key=lambda t: (pots[t], t))  # the first of the lowest potentials
        centers.append(cands[best_t])
        closest = torch.minimum(closest, dc[:, best_t])
    return x[torch.as_tensor(centers, device=x.device)].clone()


def update_centroids_ref(x: torch.Tensor, labels: torch.Tensor, k: int, old: torch.Tensor, dists: torch.Tensor,
                         spherical: bool) -> torch.Tensor:
    counts = torch.bincount(labels, minlength=k)
    sums = torch.zeros(k, x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, labels, x)
    cent = sums / counts.clamp_min(1)[:, None].to(x.dtype)
    empty = (counts == 0).nonzero()[:, 0].tolist()
    if empty:
        # Re-seed each empty cluster at the point farthest from its centroid among clusters of size > 1.
        d = dists.clone()
        for j in empty:
            movable = counts[labels] > 1
            cand = torch.where(movable, d, torch.full_like(d, -1.0))
            i = int(torch.argmax(cand))
            cent[j] = x[i]
            counts[labels[i]] -= 1
            d[i] = -1.0
    if spherical:
        cent = cent / cent.norm(dim=1, keepdim=True).clamp_min(1e-30)
    return cent


def capacity_kmeans_ref(
    x: torch.Tensor,
    k: int,
    lo: np.ndarray,
    hi: np.ndarray,
    *,
    spherical: bool,
    n_init: int,
    max_iter: int,
    tol: float,
    seed: int,
    init: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, list[float], int, bool]:
    """Float64 reference Lloyd loop on prepared data (centred, or unit rows when spherical).

    Returns labels, centroids (float64, in the prepared frame), objective history, n_iter, converged.
    """
    best = None
    for run in range(n_init if init is None else 1):
        cent = init.clone() if init is not None else kmeans_plusplus(x, k, SplitMix64(run_seed(seed, run)))
        if spherical:
            cent = cent / cent.norm(dim=1, keepdim=True).clamp_min(1e-30)
        state, labels, history, converged = None, None, [], False
        n_iter = 0
        for n_iter in range(1, max_iter + 1):  # noqa: B007 - n_iter is reported after the loop
            d = sqdist_ref(x, cent)
            new_labels, state, _ = assign_ref(d, lo, hi, state)
            cost = float(d.gather(1, new_labels[:, None]).sum())
            if labels is not None:
                prev_cost = float(d.gather(1, labels[:, None]).sum())
                if cost > prev_cost:
                    new_labels, cost = labels, prev_cost
            same = labels is not None and bool(torch.equal(new_labels, labels))
            improved = history[-1] - cost if history else math.inf
            labels = new_labels
            history.append(cost)
            own = d.gather(1, labels[:, None])[:, 0]
            cent = update_centroids_ref(x, labels, k, cent, own, spherical)
            if same or improved <= tol * abs(history[-2] if len(history) > 1 else cost):
                converged = True
                break
        final = sqdist_ref(x, cent).gather(1, labels[:, None]).sum().item()
        if best is None or final < best[0]:
            best = (final, labels, cent, history, n_iter, converged)
    _, labels, cent, history, n_iter, converged = best
    return labels, cent, history, n_iter, converged


def prepare_rows(t: torch.Tensor, spherical: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Centre (or L2-normalise) rows in float64; returns prepared data and the mean (zero if spherical)."""
    x64 = t.to(torch.float64)
    if spherical:
        norms = x64.norm(dim=1, keepdim=True)
        if bool((norms == 0).any()):
            bad = int((norms[:, 0] == 0).nonzero()[0, 0])
            raise ValueError(f"capacity_kmeans: metric='cosine' needs non-zero rows, row {bad} is all zeros.")
        return x64 / norms, torch.zeros(t.shape[1], dtype=torch.float64, device=t.device)
    mean = x64.mean(dim=0)
    return x64 - mean, mean
