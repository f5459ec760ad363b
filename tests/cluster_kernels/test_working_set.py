"""Warm auctions on a working set (csrc/cpu/working_set.cpp, WorkingSet) solve the whole problem.

Between Lloyd iterations the native floor auction runs on the rows near a boundary only, holds every other row at
its cheapest cluster at the previous prices, and grows the set until every held row is still at a cheapest cluster
at the prices found. These tests run warm sequences large enough for it (n >= 4096, caps with slack) and check at
every step: the labels are those of the auction on every row (``working_set=False``) where the optimum is unique,
the returned prices certify the labels optimal for the whole problem, the caps hold, and ranks take the decisions
of one process.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from test_auction_speedups import capacity_bounds, lloyd_like_costs
from test_distributed import ThreadComm, run_threads

import cluster_kernels._collectives as coll
from cluster_kernels import _backend

C = _backend.native()
pytestmark = pytest.mark.skipif(C is None, reason="cluster_kernels._C is not built")


def _drifting_costs(seed: int, n: int, k: int, steps: int, ties: bool = False) -> list[np.ndarray]:
    """Lloyd-like costs whose first two steps move prices far and the later ones little."""
    return lloyd_like_costs(seed, n, k, steps, ties, dim=4, spread=1.5, drifts=(0.3, 0.3, 0.03))


def _step(cost, lo, hi, state, working_set=True, comm=None, offset=0, n_total=None, n_threads=0):
    comm = coll.AuctionComm(comm if comm is not None else coll.Comm(None))
    return C.auction_block(cost, lo, hi, comm, offset, len(cost) if n_total is None else n_total, state.get("floor"),
                           None, n_threads, state.get("working"), working_set)


def _next_state(out) -> dict:
    return {"floor": out["floor_prices"], "working": out["working"]}


def _check_certificate(cost: np.ndarray, hi: np.ndarray, out) -> None:
    """The prices returned make the labels optimal for the whole problem (LP complementary slackness)."""
    labels, p = out["labels"], out["floor_prices"]
    n, k = cost.shape
    counts = np.bincount(labels, minlength=k)
    assert (counts <= hi).all()
    assert (p >= 0).all()
    assert (counts[p > 0] == hi[p > 0]).all(), "a cluster with a positive price is not full"
    reduced = cost + p
    slack = reduced[np.arange(n), labels] - reduced.min(1)
    span = (cost.max(1) - cost.min(1)).max()
    assert slack.max() <= 1e-9 * span, f"a row lies {slack.max():.3g} above its cheapest cluster"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_warm_steps_take_the_labels_of_the_auction_on_every_row(seed):
    n, k = 6000 + 131 * seed, 10 + seed
    lo, hi = capacity_bounds("cap", n, k)
    with_set: dict = {}
    every_row: dict = {}
    calls = solves = 0
    for step, cost in enumerate(_drifting_costs(seed, n, k, 9)):
        got = _step(cost, lo, hi, with_set)
        want = _step(cost, lo, hi, every_row, working_set=False)
        np.testing.assert_array_equal(got["labels"], want["labels"], err_msg=f"step {step}")
        _check_certificate(cost, hi, got)
        with_set, every_row = _next_state(got), _next_state(want)
        calls += got["working_calls"]
        solves += got["working_solves"]
        assert want["working_calls"] == 0
    # The call after the cold start solves whole; the others ran on a set, some of them more than once (rows joined).
    assert calls >= 5 and solves > calls


def test_thread_counts_take_the_same_decisions():
    n, k = 7000, 11
    lo, hi = capacity_bounds("cap", n, k)
    states: dict[int, dict] = {1: {}, 2: {}}
    calls = 0
    for step, cost in enumerate(_drifting_costs(6, n, k, 7, ties=True)):  # ties: the key order decides
        outs = {t: _step(cost, lo, hi, states[t], n_threads=t) for t in (1, 2)}
        np.testing.assert_array_equal(outs[1]["labels"], outs[2]["labels"], err_msg=f"step {step}")
        np.testing.assert_array_equal(outs[1]["floor_prices"], outs[2]["floor_prices"])
        np.testing.assert_array_equal(outs[1]["working"], outs[2]["working"])
        assert outs[1]["rounds"] == outs[2]["rounds"] and outs[1]["working_solves"] == outs[2]["working_solves"]
        states = {t: _next_state(outs[t]) for t in (1, 2)}
        calls += outs[1]["working_calls"]
    assert calls > 0


def test_ties_leave_an_optimal_assignment():
    n, k = 5000, 9
    lo, hi = capacity_bounds("cap", n, k)
    with_set: dict = {}
    every_row: dict = {}
    calls = 0
    for cost in _drifting_costs(7, n, k, 8, ties=True):
        got = _step(cost, lo, hi, with_set)
        want = _step(cost, lo, hi, every_row, working_set=False)
        _check_certificate(cost, hi, got)
        rows = np.arange(n)
        assert cost[rows, got["labels"]].sum() == pytest.approx(cost[rows, want["labels"]].sum(), rel=1e-12)
        with_set, every_row = _next_state(got), _next_state(want)
        calls += got["working_calls"]
    assert calls > 0


def test_ranks_take_the_one_process_decisions():
    n, k = 4500, 8
    lo, hi = capacity_bounds("cap", n, k)
    bounds = [0, 1700, 1700, n]  # three ranks, one without rows
    one_state: dict = {}
    rank_states: list[dict] = [{}, {}, {}]
    calls = 0
    for step, cost in enumerate(_drifting_costs(3, n, k, 7)):
        one = _step(cost, lo, hi, one_state)

        def rank_fn(r: int, comm: ThreadComm, cost=cost, rank_states=rank_states):
            s, e = bounds[r], bounds[r + 1]
            return _step(np.ascontiguousarray(cost[s:e]), lo, hi, rank_states[r], comm=comm, offset=s, n_total=n)

        parts = run_threads(3, rank_fn)
        np.testing.assert_array_equal(np.concatenate([p["labels"] for p in parts]), one["labels"], err_msg=f"{step}")
        for p in parts:
            assert p["rounds"] == one["rounds"]
            np.testing.assert_array_equal(p["floor_prices"], one["floor_prices"])
            np.testing.assert_array_equal(p["working"], one["working"])
            assert p["working_solves"] == one["working_solves"]
        one_state = _next_state(one)
        rank_states = [_next_state(p) for p in parts]
        calls += one["working_calls"]
    assert calls > 0


def test_exact_balance_solves_every_row():
    n, k = 5000, 8
    lo, hi = capacity_bounds("exact", n, k)
    state: dict = {}
    for cost in _drifting_costs(4, n, k, 5):
        out = _step(cost, lo, hi, state)
        assert out["working_calls"] == 0
        assert (np.bincount(out["labels"], minlength=k) == n // k).all()
        state = _next_state(out)


def test_a_bad_cost_in_a_held_row_is_refused():
    n, k = 5000, 8
    lo, hi = capacity_bounds("cap", n, k)
    costs = _drifting_costs(5, n, k, 4)
    state: dict = {}
    for cost in costs[:3]:
        state = _next_state(_step(cost, lo, hi, state))
    bad = costs[3].copy()
    bad[4321, 5] = np.nan
    with pytest.raises(ValueError, match="cost row 4321 has a NaN"):
        _step(bad, lo, hi, state)
    with pytest.raises(ValueError, match="working must be the"):
        _step(costs[3], lo, hi, {"floor": state["floor"], "working": np.zeros(2, np.int64)})


def test_capacity_kmeans_runs_its_late_iterations_on_working_sets():
    rng = np.random.default_rng(11)
    n, k, d = 8000, 12, 6
    x = (rng.standard_normal((n, d)) + 1.2 * rng.standard_normal((k, d))[rng.integers(0, k, n)]).astype(np.float32)
    lo, hi = capacity_bounds("cap", n, k)
    out = C.kmeans_cpu(x, k, lo, hi, False, 1, 25, 0.0, 3)
    assert out["auction_working_calls"] > 0
    assert out["auction_working_rows"] < out["auction_working_calls"] * n / 4
    counts = np.bincount(out["labels"], minlength=k)
    assert (counts <= hi).all() and counts.sum() == n
    assert all(b <= a * (1 + 1e-12) for a, b in itertools.pairwise(out["history"])), "the objective rose"
