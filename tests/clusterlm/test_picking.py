"""Within-cluster picks (clusterlm.selection.picking): farthest / nearest / random / k-center and the picks on the
per-example signals (gradient norm, loss, their rank combinations with the distance, alternation), ties, pick order,
determinism, the cluster sizes and per-rank balance a selection keeps whatever the pick, and the row normalisation the
selection applies to features."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from clusterlm.selection.picking import SIGNAL_PICKS, WITHIN_CLUSTER, kcenter, l2_normalize, pick_in_cluster
from clusterlm.selection.select import select_from_features
from clusterlm.selection.signals import ExampleSignals


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
                                         r"'kcenter', 'grad-norm', .*\), got 'middle'"):
        pick_in_cluster(np.arange(3), np.zeros(3), 1, method="middle")
    assert WITHIN_CLUSTER == ("farthest", "nearest", "random", "kcenter", *SIGNAL_PICKS)


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


# ---- the picks on the per-example signals ------------------------------------------------------------------------


def _signals(grad_norm, loss) -> ExampleSignals:
    return ExampleSignals(np.asarray(grad_norm, dtype=np.float64), np.asarray(loss, dtype=np.float64))


# 6 members (0..5; example 6 is not one): distances, gradient norms and losses with ties
DIST = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0, 9.0])
SIG = _signals([1.0, 2.0, 6.0, 6.0, 3.0, 0.5, 99.0], [0.1, 3.0, 2.0, 2.0, 5.0, 0.2, 99.0])
MEMBERS = np.array([4, 0, 5, 2, 3, 1])  # any order: the result does not depend on it


@pytest.mark.parametrize(("method", "expected"), [
    ("grad-norm", [2, 3, 4, 1, 0, 5]),  # 6, 6 (tie: index 2 first), 3, 2, 1, 0.5
    ("loss", [4, 1, 2, 3, 5, 0]),  # 5, 3, 2, 2 (tie: index), 0.2, 0.1
    # rank sums (farthest rank + loss rank): 0: 0+5, 1: 1+1, 2: 2+2, 3: 3+3, 4: 4+0, 5: 5+4 -> 1 (2), then 2 and 4
    # (4 each: farther first, 2), 0 (5), 3 (6), 5 (9)
    ("rank-farthest-loss", [1, 2, 4, 0, 3, 5]),
    # grad-norm ranks: 2: 0, 3: 1, 4: 2, 1: 3, 0: 4, 5: 5 -> sums 0: 4, 1: 4, 2: 2, 3: 4, 4: 6, 5: 10
    ("rank-farthest-grad-norm", [2, 0, 1, 3, 4, 5]),
    # the highest loss (4), the farthest (0), the next loss (1), the next farthest (2), loss (3), farthest (5)
    ("alternate-loss-farthest", [4, 0, 1, 2, 3, 5]),
])
def test_signal_picks_known_answers(method, expected):
    got = pick_in_cluster(MEMBERS, DIST, 6, method=method, signals=SIG)
    assert got.dtype == np.int64 and got.tolist() == expected
    assert pick_in_cluster(MEMBERS[::-1], DIST, 6, method=method, signals=SIG).tolist() == expected
    for m in range(1, 6):  # every prefix is the smaller pick
        assert pick_in_cluster(MEMBERS, DIST, m, method=method, signals=SIG).tolist() == expected[:m]


def test_a_signal_pick_without_signals_says_what_it_needs():
    with pytest.raises(ValueError, match=r"within_cluster='loss' ranks by each example's loss.*signals="):
        pick_in_cluster(MEMBERS, DIST, 2, method="loss")


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 40), seed=st.integers(0, 2**31 - 1), method=st.sampled_from(list(SIGNAL_PICKS)))
def test_signal_picks_are_rankings_of_distinct_members(n, seed, method):
    rng = np.random.default_rng(seed)
    dist = rng.integers(0, 4, size=n).astype(np.float64)  # small integers: ties happen
    sig = _signals(rng.integers(0, 4, size=n), rng.integers(0, 4, size=n))
    members = np.sort(rng.choice(n, size=int(rng.integers(2, n + 1)), replace=False))
    m = int(rng.integers(1, len(members)))
    small = pick_in_cluster(members, dist, m, method=method, signals=sig)
    large = pick_in_cluster(members, dist, m + 1, method=method, signals=sig)
    assert large[:m].tolist() == small.tolist()
    assert len(set(large.tolist())) == m + 1 and set(large.tolist()) <= set(members.tolist())
    if method in ("grad-norm", "loss"):
        score = sig.column(SIGNAL_PICKS[method])
        rest = np.setdiff1d(members, small)
        assert score[small].min() >= score[rest].max()


# ---- a selection with every pick: deterministic, cluster sizes and per-rank balance as for farthest -------------

N, DIM = 240, 6


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, DIM)).astype(np.float32)
    lengths = rng.integers(20, 200, size=N)
    sig = _signals(rng.gamma(2.0, 1.0, size=N), rng.gamma(3.0, 0.5, size=N))
    return x, lengths, sig


@pytest.mark.parametrize("budget", [{"ratio": 0.3}, {"token_ratio": 0.3}])
@pytest.mark.parametrize("method", WITHIN_CLUSTER)
def test_every_pick_keeps_the_cluster_sizes_weights_and_rank_balance(method, budget):
    x, lengths, sig = _inputs()
    common = dict(world_size=3, seed=4, lengths=lengths, signals=sig, **budget)
    ref = select_from_features(x, within_cluster="farthest", **common)
    plan = select_from_features(x, within_cluster=method, **common)
    again = select_from_features(x, within_cluster=method, **common)  # deterministic under the seed
    assert [r.tolist() for r in plan.rank_indices] == [r.tolist() for r in again.rank_indices]
    # the clustering does not depend on the pick; the signals ride along in the plan
    np.testing.assert_array_equal(plan.cluster_labels, ref.cluster_labels)
    np.testing.assert_array_equal(plan.cluster_sizes, ref.cluster_sizes)
    np.testing.assert_array_equal(plan.losses, sig.loss)
    np.testing.assert_array_equal(plan.grad_norms, sig.grad_norm)
    # one cluster per rank, every rank the same count, and the weights K n_k / N on every rank
    per_rank = {len(r) for r in plan.rank_indices}
    assert len(per_rank) == 1
    if "ratio" in budget:
        assert plan.per_rank == ref.per_rank
    for r, idx in enumerate(plan.rank_indices):
        labels = set(plan.cluster_labels[idx].tolist())
        assert len(labels) == 1
        k = labels.pop()
        np.testing.assert_allclose(plan.rank_weights(r), 3 * plan.cluster_sizes[k] / N)
        assert len(idx) <= plan.cluster_sizes[k]


def test_random_pick_is_deterministic_under_its_seed_and_moves_with_it():
    x, lengths, sig = _inputs()
    a, b, c = (select_from_features(x, world_size=2, ratio=0.25, seed=s, lengths=lengths, within_cluster="random",
                                    signals=sig) for s in (1, 1, 2))
    assert [r.tolist() for r in a.rank_indices] == [r.tolist() for r in b.rank_indices]
    assert [r.tolist() for r in a.rank_indices] != [r.tolist() for r in c.rank_indices]


def test_the_loss_pick_keeps_each_clusters_highest_losses():
    x, lengths, sig = _inputs(1)
    plan = select_from_features(x, world_size=2, ratio=0.25, seed=0, lengths=lengths, within_cluster="loss",
                                signals=sig, token_balance=False)
    for idx in plan.rank_indices:
        k = plan.cluster_labels[idx[0]]
        rest = np.setdiff1d(np.flatnonzero(plan.cluster_labels == k), idx)
        assert sig.loss[idx].min() >= sig.loss[rest].max()
    assert "selected mean loss" in plan.summary()


def test_select_from_features_refuses_a_signal_pick_without_signals_before_clustering():
    x, lengths, _ = _inputs()
    with pytest.raises(ValueError, match="within_cluster='rank-farthest-loss' ranks by each example's loss"):
        select_from_features(x, world_size=2, ratio=0.25, lengths=lengths, within_cluster="rank-farthest-loss")
    with pytest.raises(ValueError, match="signals has 3 examples, the features 240 rows"):
        select_from_features(x, world_size=2, ratio=0.25, lengths=lengths, signals=_signals([1, 2, 3], [1, 2, 3]))
    plan = select_from_features(x, world_size=2, ratio=0.25, lengths=lengths)  # geometric picks need none
    assert plan.losses is None and plan.grad_norms is None
