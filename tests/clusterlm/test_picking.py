"""Within-cluster picks (clusterlm.selection.picking): farthest / nearest / random / k-center, ties by index, pick
order,
and the row normalisation the selection applies to features."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from clusterlm.selection.picking import WITHIN_CLUSTER, kcenter, l2_normalize, pick_in_cluster


@pytest.mark.parametrize("method", ["farthest", "nearest", "random", "kcenter"])
def test_pick_in_cluster_methods(method):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 3))
    dist = (x**2).sum(1)
    members = np.arange(0, 50, 2)
    got = pick_in_cluster(members, dist, 7, method=method, features=x, rng=np.random.default_rng(1))
    assert len(got) == 7 and len(set(got.tolist())) == 7 and set(got.tolist()) <= set(members.tolist())
    if method == "nearest":
        assert set(got.tolist()) == set(members[np.argsort(dist[members])[:7]].tolist())
    if method == "kcenter":
        # farthest-point traversal: each new point maximises the distance to the ones already picked
        assert got[0] == members[np.argmax(dist[members])]
        for j in range(2, 7):
            gaps = np.min(((x[members][:, None] - x[got[:j]][None]) ** 2).sum(2), axis=1)
            assert gaps.max() == pytest.approx(np.min(((x[got[j]] - x[got[:j]]) ** 2).sum(1)))


# ---- known answers --------------------------------------------------------------------------------


def test_farthest_and_nearest_break_ties_by_index_and_return_pick_order():
    distances = np.array([0.5, 3.0, 1.0, 3.0, 2.0, 1.0, 9.0])  # example 6 is not a member
    members = np.array([5, 3, 1, 0, 2, 4])  # any order: the result does not depend on it
    got = pick_in_cluster(members, distances, 4, method="farthest")
    assert got.dtype == np.int64 and got.tolist() == [1, 3, 4, 2]  # 3.0 (1 before 3), 2.0, then 1.0 (2 before 5)
    assert pick_in_cluster(members, distances, 3, method="nearest").tolist() == [0, 2, 5]
    assert pick_in_cluster(members[::-1], distances, 4, method="farthest").tolist() == got.tolist()


def test_kcenter_known_answer_on_a_line():
    x = np.array([[0.0], [1.0], [10.0], [11.0], [5.0]])
    dist = np.abs(x[:, 0] - 5.4)  # distance to a centroid at 5.4: example 3 (11) is farthest
    # from 11: farthest is 0; then the point farthest from {11, 0} is 5; then 10 vs 1 tie at 1: the lower index
    assert kcenter(x, dist, 5).tolist() == [3, 0, 4, 1, 2]
    assert kcenter(x, dist, 1).tolist() == [3]


def test_random_pick_is_a_seeded_sample_without_repeats():
    members = np.arange(100, 140)
    dist = np.zeros(140)
    a = pick_in_cluster(members, dist, 10, method="random", rng=np.random.default_rng(7))
    b = pick_in_cluster(members, dist, 10, method="random", rng=np.random.default_rng(7))
    c = pick_in_cluster(members, dist, 10, method="random", rng=np.random.default_rng(8))
    assert a.tolist() == b.tolist() != c.tolist()
    assert len(set(a.tolist())) == 10 and set(a.tolist()) <= set(members.tolist())


def test_unknown_method_names_the_setting_and_the_choices():
    with pytest.raises(ValueError, match=r"within_cluster must be one of \('farthest', 'nearest', 'random', "
                                         r"'kcenter'\), got 'middle'"):
        pick_in_cluster(np.arange(3), np.zeros(3), 1, method="middle")
    assert WITHIN_CLUSTER == ("farthest", "nearest", "random", "kcenter")


# ---- properties -----------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(n=st.integers(2, 40), d=st.integers(1, 4), seed=st.integers(0, 2**31 - 1),
       method=st.sampled_from(["farthest", "nearest", "kcenter"]))
def test_deterministic_picks_grow_by_prefix(n, d, seed, method):
    """Picking m + 1 keeps the first m picks: the pick order is a ranking (what token budgets rely on)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 4, size=(n, d)).astype(np.float64)  # small integers: ties happen
    dist = np.sqrt((x**2).sum(1))
    members = np.sort(rng.choice(n, size=int(rng.integers(2, n + 1)), replace=False))
    m = int(rng.integers(1, len(members)))
    small = pick_in_cluster(members, dist, m, method=method, features=x)
    large = pick_in_cluster(members, dist, m + 1, method=method, features=x)
    assert large[:m].tolist() == small.tolist()
    assert len(set(large.tolist())) == m + 1 and set(large.tolist()) <= set(members.tolist())


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 30), seed=st.integers(0, 2**31 - 1))
def test_farthest_picks_dominate_the_rest(n, seed):
    rng = np.random.default_rng(seed)
    dist = rng.integers(0, 5, size=n).astype(np.float64)
    members = np.arange(n)
    m = int(rng.integers(1, n))
    got = pick_in_cluster(members, dist, m, method="farthest")
    rest = np.setdiff1d(members, got)
    assert dist[got].min() >= dist[rest].max()
    assert (np.diff(dist[got]) <= 0).all()  # in decreasing distance


@settings(max_examples=100, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 20), st.integers(1, 6)),
                  elements=st.floats(-1e6, 1e6, width=32)))
def test_l2_normalize_gives_unit_rows_in_the_same_direction(x):
    y = l2_normalize(x)
    assert y.dtype == np.float32 and y.shape == x.shape
    norms = np.linalg.norm(x.astype(np.float64), axis=1)
    zero = norms == 0
    assert (y[zero] == 0).all()
    np.testing.assert_allclose(np.linalg.norm(y[~zero].astype(np.float64), axis=1), 1.0, rtol=1e-5)
    # same direction: y * |x| == x
    np.testing.assert_allclose(y[~zero] * norms[~zero, None], x[~zero], rtol=1e-5, atol=1e-6 * norms.max())


def test_l2_normalize_known_rows():
    y = l2_normalize(np.array([[3, 4], [0, 0], [0, -2]]))
    np.testing.assert_array_equal(y, np.array([[0.6, 0.8], [0, 0], [0, -1]], dtype=np.float32))
