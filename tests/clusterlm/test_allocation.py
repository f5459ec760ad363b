"""Allocation to ranks (clusterlm.selection.allocation): cluster-per-rank and stratified deals, visit orders, token
rebalancing, balance statistics and the selection weights ``(n_c / N) (S / s_c)``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clusterlm.selection.allocation import (
    ALLOCATIONS,
    BALANCE_BATCH_SIZES,
    allocate,
    balance_stats,
    cluster_owners,
    rebalance_tokens,
    selection_weights,
    visit_order,
)

# ---- moved here from test_select.py (allocation) and test_plan.py (selection_weights) ----------------


def test_token_balance_orders_reduce_step_imbalance():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 1000, size=4000)
    lists = [np.arange(r, 4000, 4) for r in range(4)]
    plain = visit_order(lists, lengths, token_balance=False, seed=0)
    balanced = visit_order(lists, lengths, token_balance=True, seed=0)
    for a, b in zip(balanced, lists, strict=True):
        assert sorted(a.tolist()) == sorted(b.tolist())

    def worst(order, batch):
        t = np.stack([lengths[o] for o in order])[:, : (1000 // batch) * batch].reshape(4, -1, batch).sum(2)
        return float((t.max(0) / t.mean(0)).mean())

    assert worst(balanced, 8) < 1.05 < worst(plain, 8)


def test_allocate_cluster_per_rank_balances_tokens_over_several_clusters():
    lengths = np.array([100] * 10 + [10] * 10 + [50] * 10 + [60] * 10)
    groups = [np.arange(0, 10), np.arange(10, 20), np.arange(20, 30), np.arange(30, 40)]
    ranks = allocate(groups, 2, lengths)
    totals = sorted(int(lengths[r].sum()) for r in ranks)
    assert totals == [1100, 1100]


def test_rebalance_tokens_equalises_ranks_and_only_touches_the_boundary():
    rng = np.random.default_rng(3)
    lengths = rng.integers(20, 600, size=3000)
    lengths[1500:] = lengths[1500:] * 9 // 10  # cluster 1 holds somewhat shorter examples
    picks = [np.arange(0, 1500)[rng.permutation(1500)][:330], np.arange(1500, 3000)[rng.permutation(1500)][:330]]
    groups, pools = [p[:300] for p in picks], [p[300:] for p in picks]
    new, info = rebalance_tokens(groups, pools, [0, 1], lengths, 2, [30, 30])
    before = [int(lengths[g].sum()) for g in groups]
    after = [int(lengths[g].sum()) for g in new]
    assert abs(after[0] - after[1]) < abs(before[0] - before[1]) / 3
    assert info["rank_tokens_after"] == after
    for g, n, p in zip(groups, new, picks, strict=True):
        assert len(n) == len(g) and len(set(n.tolist())) == len(n)
        np.testing.assert_array_equal(n[:270], g[:270])  # the 270 first picks never move
        assert set(n.tolist()) <= set(p.tolist())


# ---- selection_weights


def test_selection_weights_formula_by_hand():
    # clusters: 0 has 6 examples, 1 has 2; select 2 from each: S = 4.
    labels = np.array([0, 0, 0, 0, 0, 0, 1, 1])
    w = selection_weights(labels, [0, 1, 6, 7], 2)
    np.testing.assert_allclose(w, [6 / 8 * 4 / 2] * 2 + [0] * 4 + [2 / 8 * 4 / 2] * 2)
    assert w[[0, 1, 6, 7]].mean() == pytest.approx(1.0, rel=1e-15)
    # The same selection as a boolean mask.
    mask = np.zeros(8, bool)
    mask[[0, 1, 6, 7]] = True
    np.testing.assert_array_equal(selection_weights(labels, mask, 2), w)


def test_selection_weights_one_cluster_per_rank_is_k_nk_over_n():
    rng = np.random.default_rng(3)
    k, m = 4, 5
    labels = rng.integers(0, k, size=200)
    while np.bincount(labels, minlength=k).min() < m:
        labels = rng.integers(0, k, size=200)
    sel = np.concatenate([np.flatnonzero(labels == c)[:m] for c in range(k)])
    w = selection_weights(labels, sel, k)
    sizes = np.bincount(labels, minlength=k)
    np.testing.assert_allclose(w[sel], (k * sizes / 200)[labels[sel]], rtol=1e-14)


def test_selection_weights_unrepresented_cluster_gets_no_weight_and_mean_stays_one():
    labels = np.array([0, 0, 1, 1, 1, 2, 2, 2, 2])
    w = selection_weights(labels, [0, 2, 3], 3)  # cluster 2 not selected
    assert (w[5:] == 0).all()
    # renormalised over the represented clusters (N' = 5): (2/5)*(3/1), (3/5)*(3/2)
    np.testing.assert_allclose(w[[0, 2, 3]], [2 / 5 * 3, 3 / 5 * 1.5, 3 / 5 * 1.5])
    assert w[[0, 2, 3]].mean() == pytest.approx(1.0, rel=1e-15)


@pytest.mark.parametrize(
    "labels, selected, n_clusters, match",
    [
        ([0, 1, 2], [0], 2, r"labels must lie in \[0, 2\)"),
        ([0, -1, 1], [0], 2, "pass zeros and n_clusters=1"),
        ([0, 1, 1], [0, 0], 2, "unique"),
        ([0, 1, 1], [3], 2, r"indices must lie in \[0, 3\)"),
        ([0, 1, 1], np.zeros(2, bool), 2, r"shape \(3,\)"),
        ([0, 1, 1], np.zeros(3, bool), 2, "empty"),
        ([0, 1, 1], [0], 0, "n_clusters"),
        ([0.0, 1.0], [0], 2, "integer"),
    ],
)
def test_selection_weights_errors(labels, selected, n_clusters, match):
    with pytest.raises(ValueError, match=match):
        selection_weights(np.asarray(labels), selected, n_clusters)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 60),
    c=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
    frac=st.floats(0.05, 1.0),
)
def test_selection_weights_property(n, c, seed, frac):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, c, size=n)
    sel = rng.permutation(n)[: max(1, int(frac * n))]
    w = selection_weights(labels, sel, c)
    assert w[sel].mean() == pytest.approx(1.0, rel=1e-12)
    assert (w >= 0).all() and (np.delete(w, sel) == 0).all()
    # equal weight inside a cluster; ratio between clusters is (n_a / s_a) / (n_b / s_b)
    sizes, chosen = np.bincount(labels, minlength=c), np.bincount(labels[sel], minlength=c)
    for cl in np.unique(labels[sel]):
        ws = w[sel][labels[sel] == cl]
        np.testing.assert_allclose(ws, ws[0])
        first = labels[sel[0]]
        assert ws[0] * chosen[cl] / sizes[cl] == pytest.approx(w[sel[0]] * chosen[first] / sizes[first])


# ---- cluster_owners / allocate ------------------------------------------------------------------------


def test_one_cluster_per_rank_goes_to_the_rank_of_its_number():
    groups = [np.arange(i * 5, i * 5 + 5) for i in range(4)]
    lengths = np.arange(20)[::-1].copy()  # lengths do not matter with one cluster per rank
    assert cluster_owners(groups, 4, lengths) == [0, 1, 2, 3]
    ranks = allocate(groups, 4, lengths)
    assert [r.tolist() for r in ranks] == [g.tolist() for g in groups]
    assert all(r.dtype == np.int64 for r in ranks)


def test_several_clusters_per_rank_are_dealt_longest_first_to_the_lightest_rank():
    # cluster tokens: 40, 30, 20, 10, 5, 5 over 2 ranks of 3 clusters each
    lengths = np.array([40, 30, 20, 10, 5, 5])
    groups = [np.array([i]) for i in range(6)]
    # 40 -> r0; 30 -> r1; 20 -> r1 (30 < 40); 10 -> r0 (40 < 50); 5 -> r0 (50 = 50, lower rank); 5 -> r1 (full r0)
    assert cluster_owners(groups, 2, lengths) == [0, 1, 1, 0, 0, 1]
    ranks = allocate(groups, 2, lengths)
    assert [int(lengths[r].sum()) for r in ranks] == [55, 55]


def test_allocate_respects_given_owners():
    groups = [np.array([0, 1]), np.array([2, 3]), np.array([4, 5]), np.array([6, 7])]
    ranks = allocate(groups, 2, np.ones(8, dtype=np.int64), owners=[1, 0, 0, 1])
    assert [r.tolist() for r in ranks] == [[2, 3, 4, 5], [0, 1, 6, 7]]


@settings(max_examples=60, deadline=None)
@given(world_size=st.integers(1, 5), per_rank=st.integers(1, 4), size=st.integers(1, 6),
       seed=st.integers(0, 2**31 - 1))
def test_cluster_per_rank_gives_every_rank_whole_clusters_of_equal_count(world_size, per_rank, size, seed):
    rng = np.random.default_rng(seed)
    n_clusters = world_size * per_rank
    perm = rng.permutation(n_clusters * size)
    groups = [perm[c * size : (c + 1) * size] for c in range(n_clusters)]
    lengths = rng.integers(1, 100, size=n_clusters * size)
    owners = cluster_owners(groups, world_size, lengths)
    assert sorted(np.bincount(owners, minlength=world_size).tolist()) == [per_rank] * world_size
    ranks = allocate(groups, world_size, lengths)
    assert {len(r) for r in ranks} == {per_rank * size}
    assert sorted(np.concatenate(ranks).tolist()) == sorted(perm.tolist())
    for c, g in enumerate(groups):  # each cluster whole on its owner's list
        assert set(g.tolist()) <= set(ranks[owners[c]].tolist())


@settings(max_examples=60, deadline=None)
@given(world_size=st.integers(1, 5), sizes=st.lists(st.integers(0, 9), min_size=1, max_size=5),
       seed=st.integers(0, 2**31 - 1))
def test_stratified_splits_every_cluster_evenly(world_size, sizes, seed):
    rng = np.random.default_rng(seed)
    extra = (-sum(sizes)) % world_size  # make the total a multiple of the world size
    sizes = [*sizes[:-1], sizes[-1] + extra]
    if sum(sizes) == 0:
        sizes[-1] = world_size
    perm = rng.permutation(sum(sizes))
    starts = np.cumsum([0, *sizes])
    groups = [perm[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]
    lengths = rng.integers(1, 100, size=sum(sizes))
    ranks = allocate(groups, world_size, lengths, allocation="stratified")
    assert {len(r) for r in ranks} == {sum(sizes) // world_size}
    assert sorted(np.concatenate(ranks).tolist()) == sorted(perm.tolist())
    for g in groups:  # every rank the same count of every cluster, or one more
        counts = [len(set(g.tolist()) & set(r.tolist())) for r in ranks]
        assert max(counts) - min(counts) <= 1


def test_stratified_gives_every_rank_the_same_count_of_every_cluster():
    groups = [np.array([0, 1]), np.array([2, 3]), np.array([4, 5])]
    ranks = allocate(groups, 3, np.ones(6, dtype=np.int64), allocation="stratified")
    for g in groups:
        counts = [len(set(g.tolist()) & set(r.tolist())) for r in ranks]
        assert max(counts) - min(counts) <= 1, counts


@pytest.mark.parametrize(
    ("groups", "world_size", "allocation", "match"),
    [
        ([np.arange(3)], 2, "stratified", "3 selected examples cannot be split evenly over 2 ranks"),
        ([np.arange(2), np.arange(2, 5)], 2, "cluster-per-rank",
         r"equal selected size, got 2 clusters of sizes \[2, 3\]"),
        ([np.arange(2)] * 3, 2, "cluster-per-rank", "multiple of world_size=2 clusters"),
        ([np.arange(2)], 1, "round-robin", r"allocation must be one of \('cluster-per-rank', 'stratified'\)"),
    ],
)
def test_allocate_refusals_name_the_cause(groups, world_size, allocation, match):
    with pytest.raises(ValueError, match=match):
        allocate(groups, world_size, np.ones(10, dtype=np.int64), allocation=allocation)
    assert ALLOCATIONS == ("cluster-per-rank", "stratified")


# ---- visit_order --------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(world_size=st.integers(1, 4), m=st.integers(0, 30), seed=st.integers(0, 2**31 - 1),
       token_balance=st.booleans())
def test_visit_order_permutes_each_list_deterministically(world_size, m, seed, token_balance):
    rng = np.random.default_rng(seed)
    lists = list(rng.permutation(world_size * m).reshape(world_size, m))
    lengths = rng.integers(1, 50, size=world_size * m)
    order = visit_order(lists, lengths, token_balance=token_balance, seed=seed)
    again = visit_order(lists, lengths, token_balance=token_balance, seed=seed)
    for o, a, r in zip(order, again, lists, strict=True):
        assert sorted(o.tolist()) == sorted(r.tolist()) and o.tolist() == a.tolist()


def test_token_balanced_order_puts_the_same_length_quantile_at_every_position():
    rng = np.random.default_rng(5)
    lengths = rng.permutation(400) + 1  # distinct lengths
    lists = [np.arange(r, 400, 4) for r in range(4)]
    order = visit_order(lists, lengths, token_balance=True, seed=3)
    ranks_by_length = [np.argsort(np.argsort(-lengths[o], kind="stable"), kind="stable") for o in order]
    for q in ranks_by_length[1:]:  # position j holds the pi(j)-th longest example on every rank
        np.testing.assert_array_equal(q, ranks_by_length[0])
    assert ranks_by_length[0].tolist() != list(range(100))  # not a length curriculum
    other = visit_order(lists, lengths, token_balance=True, seed=4)
    assert other[0].tolist() != order[0].tolist()  # the seed matters


# ---- rebalance_tokens ---------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(size=st.integers(2, 20), pool=st.integers(0, 10), seed=st.integers(0, 2**31 - 1))
def test_rebalance_keeps_sizes_and_swaps_only_boundary_picks_with_their_own_pool(size, pool, seed):
    rng = np.random.default_rng(seed)
    n = 4 * (size + pool)
    perm = rng.permutation(n)
    lengths = rng.integers(1, 200, size=n)
    chunks = perm.reshape(4, size + pool)
    groups, pools = [c[:size] for c in chunks], [c[size:] for c in chunks]
    n_free = [int(rng.integers(0, size + 1)) for _ in range(4)]
    new, info = rebalance_tokens(groups, pools, [0, 1, 0, 1], lengths, 2, n_free)
    before = info["rank_tokens_before"]
    after = info["rank_tokens_after"]
    assert sum(before) == int(lengths[np.concatenate(groups)].sum())
    assert after == [int(lengths[np.concatenate([new[0], new[2]])].sum()),
                     int(lengths[np.concatenate([new[1], new[3]])].sum())]
    assert abs(after[0] - after[1]) <= abs(before[0] - before[1])  # never further apart
    for g, p, k, out, swaps in zip(groups, pools, n_free, new, info["swaps_per_cluster"], strict=True):
        assert len(out) == len(g) and len(set(out.tolist())) == len(out)
        assert out[: len(g) - k].tolist() == g[: len(g) - k].tolist()  # fixed picks stay, in place
        assert set(out.tolist()) <= set(g.tolist()) | set(p.tolist())
        assert swaps == len(set(out.tolist()) - set(g.tolist())) <= min(k, len(p))


# ---- balance_stats ------------------------------------------------------------------------------------


def test_balance_stats_known_answer():
    lengths = np.array([10, 30, 20, 20, 5, 5, 40, 10])
    stats = balance_stats([np.array([0, 1, 4, 5]), np.array([2, 3, 6, 7])], lengths)
    assert stats["rank_tokens"] == [50, 90]
    assert stats["rank_tokens_max_over_mean"] == pytest.approx(90 / 70)
    # per step of 1: max/mean of (10,20) (30,20) (5,40) (5,10)
    ratios = np.array([20 / 15, 30 / 25, 40 / 22.5, 10 / 7.5])
    one = stats["step_max_over_mean@1"]
    assert one["mean"] == pytest.approx(ratios.mean()) and one["max"] == pytest.approx(ratios.max())
    assert one["p95"] == pytest.approx(np.quantile(ratios, 0.95))
    assert stats["step_max_over_mean@4"]["mean"] == pytest.approx(90 / 70)  # one step of 4
    assert "step_max_over_mean@16" not in stats  # fewer than 16 examples per rank: no step of 16
    assert BALANCE_BATCH_SIZES == (1, 4, 16)
