"""The native auction's shortcuts (issue 22) take the decisions of the full eps schedule.

csrc/cpu/floor_auction.cpp stops an auction once every point sits at its exact argmin with nothing over capacity
(the later eps phases would move nothing), keeps each point's second-cheapest cost between rounds while the
prices it depends on stay, makes its reverse steps from a column-major copy with a per-thread preselection
(re-reading only the rows an earlier scan for the same cluster kept, while a bound allows), and builds member
lists in parallel. None of that may change a label, a price or a round count: these tests
run warm-started sequences of assignments (as Lloyd iterations do, where the shortcuts matter most) and compare
every step with the float64 reference, which runs every phase, across thread counts and across ranks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_distributed import ThreadComm, run_threads

import cluster_kernels._collectives as coll
from cluster_kernels import _backend
from cluster_kernels.kmeans_reference import _exact_prices_ref, assign_ref

C = _backend.native()
pytestmark = pytest.mark.skipif(C is None, reason="cluster_kernels._C is not built")


def lloyd_like_costs(seed: int, n: int, k: int, steps: int, ties: bool, *, dim: int = 3, spread: float = 2.0,
                     drifts: tuple[float, ...] = (0.05,)) -> list[np.ndarray]:
    """Squared distances of a Gaussian mixture (Dirichlet sizes) to centroids that drift a little per step.

    The centroids move by ``drifts[step]`` (the last entry for the later steps) times a standard normal, as
    Lloyd's do: far at first, then little. With ties, costs are rounded to a coarse grid so that many gaps,
    regrets and argmins are equal.
    """
    rng = np.random.default_rng(seed)
    comp = rng.choice(k, size=n, p=rng.dirichlet(np.full(k, 0.7)))
    x = rng.standard_normal((n, dim)) + spread * rng.standard_normal((k, dim))[comp]
    c = x[rng.choice(n, k, replace=False)]
    out = []
    for step in range(steps):
        d = ((x[:, None, :] - c[None, :, :]) ** 2).sum(-1)
        out.append(np.round(d * 2.0) / 2.0 if ties else d)
        c = c + drifts[min(step, len(drifts) - 1)] * rng.standard_normal(c.shape)
    return out


def capacity_bounds(kind: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) for "cap" (ceil(1.5 n / k)), "exact" (n // k .. ceil(n / k)) or "both" (random, from ``seed``)."""
    if kind == "cap":
        return np.zeros(k, np.int64), np.full(k, math.ceil(1.5 * n / k), np.int64)
    if kind == "exact":
        return np.full(k, n // k, np.int64), np.full(k, math.ceil(n / k), np.int64)
    rng = np.random.default_rng(seed)  # "both": random lower and upper bounds
    hi = rng.integers(math.ceil(n / k), math.ceil(1.4 * n / k) + 1, size=k)
    hi[0] += max(0, n - int(hi.sum()))
    lo = np.minimum(rng.integers(0, n // k + 1, size=k), hi)
    return lo.astype(np.int64), hi.astype(np.int64)


def _native_step(cost, lo, hi, prices, n_threads=0, comm=None, offset=0, n_total=None):
    comm = coll.AuctionComm(comm if comm is not None else coll.Comm(None))
    return C.auction_block(cost, lo, hi, comm, offset, len(cost) if n_total is None else n_total, prices[0],
                           prices[1], n_threads)


CASES = [(seed, kind, ties) for seed, kind in enumerate(["cap", "exact", "both", "cap", "exact", "both"])
         for ties in (False, True)]


@pytest.mark.parametrize("seed,kind,ties", CASES)
def test_warm_started_sequences_match_the_full_schedule(seed, kind, ties):
    n, k = 500 + 37 * seed, 6 + seed % 3
    lo, hi = capacity_bounds(kind, n, k, seed)
    state: dict = {}
    prices = (None, None)
    for step, cost in enumerate(lloyd_like_costs(seed, n, k, 4, ties)):
        ref, state, ref_rounds = assign_ref(torch.from_numpy(cost), lo, hi, state)
        got = _native_step(cost, lo, hi, prices)
        if ties and got["used_general"]:
            # With tied costs the general auction's optimum is not unique, and the reference's float64 torch
            # sums pick another optimal assignment (before these shortcuts too): compare the objective.
            rows = np.arange(n)
            assert cost[rows, got["labels"]].sum() == pytest.approx(cost[rows, ref.numpy()].sum(), rel=1e-12)
        else:
            np.testing.assert_array_equal(got["labels"], ref.numpy(), err_msg=f"step {step}")
        if not got["used_general"]:  # the reference counts the general auction's rounds its own way
            assert got["rounds"] == ref_rounds, f"step {step}"
        sizes = np.bincount(got["labels"], minlength=k)
        assert (sizes >= lo).all() and (sizes <= hi).all()
        prices = (got["floor_prices"], got["general_prices"])


@pytest.mark.parametrize("kind", ["cap", "exact"])
def test_labels_and_prices_do_not_depend_on_the_thread_count(kind):
    n, k = 3000, 12
    lo, hi = capacity_bounds(kind, n, k, 0)
    runs = {}
    for threads in (1, 2, 3):
        prices, seq = (None, None), []
        for cost in lloyd_like_costs(7, n, k, 3, ties=False):
            got = _native_step(cost, lo, hi, prices, n_threads=threads)
            prices = (got["floor_prices"], got["general_prices"])
            seq.append((got["labels"], got["rounds"], *prices))
        runs[threads] = seq
    for threads in (2, 3):
        for (a, ra, fa, ga), (b, rb, fb, gb) in zip(runs[1], runs[threads], strict=True):
            np.testing.assert_array_equal(a, b)
            assert ra == rb
            np.testing.assert_array_equal(fa, fb)
            np.testing.assert_array_equal(ga, gb)


@pytest.mark.parametrize("kind,ties", [("cap", False), ("exact", True), ("both", False)])
def test_ranks_take_the_one_process_decisions_when_warm_started(kind, ties):
    # Ranks are threads (test_distributed.ThreadComm); the early exit is a global decision, so every rank
    # must stop in the same phase, and the rows a rank caches must not change what the others see.
    n, k = 700, 7
    lo, hi = capacity_bounds(kind, n, k, 3)
    cut = [0, 250, 250, n]  # three ranks, one of them without rows
    one_prices = (None, None)
    rank_prices = [(None, None)] * 3
    for cost in lloyd_like_costs(11, n, k, 4, ties):
        one = _native_step(cost, lo, hi, one_prices)
        one_prices = (one["floor_prices"], one["general_prices"])

        def rank_fn(r: int, comm: ThreadComm, cost=cost):
            s, e = cut[r], cut[r + 1]
            return _native_step(np.ascontiguousarray(cost[s:e]), lo, hi, rank_prices[r], comm=comm, offset=s,
                                n_total=n)

        parts = run_threads(3, rank_fn)
        np.testing.assert_array_equal(np.concatenate([p["labels"] for p in parts]), one["labels"])
        for r, p in enumerate(parts):
            assert p["rounds"] == one["rounds"] and p["used_general"] == one["used_general"]
            np.testing.assert_array_equal(p["floor_prices"], one["floor_prices"])
            np.testing.assert_array_equal(p["general_prices"], one["general_prices"])
            rank_prices[r] = (p["floor_prices"], p["general_prices"])


def _cap_instance(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n, k = 400 + 31 * seed, 5 + seed
    lo, hi = capacity_bounds("cap", n, k, seed)
    return lloyd_like_costs(seed, n, k, 1, ties=False)[0], lo, hi


@pytest.mark.parametrize("seed", range(4))
def test_the_certificate_gives_exact_prices_for_optimal_labels(seed):
    # The floor auction ends early when its labels are already optimal: exact_prices (csrc/common/certificate.h,
    # _exact_prices_ref) must then return prices under which every point sits at its exact argmin, with
    # positive prices on full clusters only (complementary slackness with no eps).
    cost, lo, hi = _cap_instance(seed)
    labels, state, _ = assign_ref(torch.from_numpy(cost), lo, hi)
    span = float((cost.max(1) - cost.min(1)).max())
    exact = _exact_prices_ref(torch.from_numpy(cost), hi, state["floor"], 1e-6 * span, labels)
    assert exact is not None
    reduced = cost + exact
    rows = np.arange(len(cost))
    assert (reduced[rows, labels.numpy()] <= reduced.min(1) + 1e-12 * span).all()
    sizes = np.bincount(labels.numpy(), minlength=len(hi))
    assert (exact >= 0).all() and (exact[sizes < hi] == 0).all()


@pytest.mark.parametrize("seed", range(4))
def test_the_certificate_refuses_labels_that_are_not_optimal(seed):
    # Two points of clusters a and b swapped where that costs more: the cycle a -> b -> a is negative, so no
    # prices exist, whatever the prices given and however far the reach goes.
    cost, lo, hi = _cap_instance(seed)
    labels, state, _ = assign_ref(torch.from_numpy(cost), lo, hi)
    lab = labels.numpy().copy()
    i = int(np.flatnonzero(lab == lab[0])[0])
    j = int(np.flatnonzero(lab != lab[0])[0])
    a, b = lab[i], lab[j]
    assert cost[i, b] + cost[j, a] > cost[i, a] + cost[j, b]  # the optimum is unique on these costs
    lab[i], lab[j] = b, a
    span = float((cost.max(1) - cost.min(1)).max())
    assert _exact_prices_ref(torch.from_numpy(cost), hi, state["floor"], span, torch.from_numpy(lab)) is None


def test_native_warm_sequences_end_with_exact_prices():
    # On costs without ties every warm-started step here is certified (its labels are optimal once eps is below
    # EPS_CERTIFY of the span): the native prices are then exact, not within eps_final of it.
    n, k = 3000, 12
    lo, hi = capacity_bounds("cap", n, k, 0)
    prices = (None, None)
    rows = np.arange(n)
    for cost in lloyd_like_costs(5, n, k, 4, ties=False):
        got = _native_step(cost, lo, hi, prices)
        prices = (got["floor_prices"], got["general_prices"])
        reduced = cost + got["floor_prices"]
        span = float((cost.max(1) - cost.min(1)).max())
        assert (reduced[rows, got["labels"]] <= reduced.min(1) + 1e-12 * span).all()


@pytest.mark.parametrize("ties", [False, True])
def test_reverse_steps_reuse_kept_rows_and_take_the_decisions_of_scans(ties):
    # A reverse step of cluster j keeps the rows with the smallest gaps its scan found; j's next reverse steps
    # re-read only those and the rows moved since, while a bound proves the r smallest gaps are among them
    # (FloorAuction::kept_candidates). The warm sequences must reuse rows that way and still match the
    # reference, which scans every row each time, label for label and round for round.
    n, k = 4000, 16
    lo, hi = capacity_bounds("cap", n, k, 0)
    state: dict = {}
    prices = (None, None)
    pulls = scans = 0
    for step, cost in enumerate(lloyd_like_costs(21, n, k, 5, ties)):
        ref, state, ref_rounds = assign_ref(torch.from_numpy(cost), lo, hi, state)
        got = _native_step(cost, lo, hi, prices)
        np.testing.assert_array_equal(got["labels"], ref.numpy(), err_msg=f"step {step}")
        assert got["rounds"] == ref_rounds, f"step {step}"
        np.testing.assert_array_equal(got["floor_prices"], state["floor"])
        prices = (got["floor_prices"], got["general_prices"])
        pulls += got["pulls"]
        scans += got["pull_scans"]
        assert 0 <= got["pull_scans"] <= got["pulls"]
    assert scans > 0 and pulls > scans, (pulls, scans)
