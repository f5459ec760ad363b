"""Token budgets of the baselines (``token_ratio`` / ``token_budget``): every method keeps a prefix of its own
order, ``m`` examples per rank, whose prompt + answer tokens come closest to the budget (the cluster method's
rule, :func:`clusterlm.config.budget.count_for_tokens`), so the selection is within one example per rank of it, and
the plan records the requested and selected tokens as the cluster method's does."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_cases import baseline_examples as _examples  # tiny_model: the fixture of conftest.py

from clusterlm.data import lengths_of
from clusterlm.plan import Plan
from clusterlm.selection.baselines import baseline_plan, ifd_plan, less_plan, longest_plan, random_plan, s2l_plan
from clusterlm.selection.baselines._plans import prefix_for_tokens, resolve_amount
from clusterlm.selection.baselines._training import example_losses
from clusterlm.selection.baselines.ifd import answer_only, ifd_order
from clusterlm.selection.baselines.longest import answer_tokens
from clusterlm.selection.baselines.s2l import balanced_cluster_order, balanced_cluster_sample

IGNORE = -100
TOKEN_KEYS = {"requested_tokens", "selected_tokens", "relative_error", "one_example_per_cluster_tokens", "note"}


def _check_tokens(plan: Plan, data: list, world_size: int, requested: int, method: str) -> np.ndarray:
    """The plan is valid, has equal counts per rank, and meets ``requested`` tokens within one example per rank."""
    lengths = lengths_of(data)
    selected = np.sort(np.concatenate(plan.rank_indices))
    plan.verify(data, world_size)
    assert plan.config["method"] == method and len(np.unique(selected)) == len(selected)
    assert len({len(r) for r in plan.rank_indices}) == 1
    np.testing.assert_array_equal(plan.weights[selected], 1.0)
    record = plan.stats["token_budget"]
    assert set(record) == TOKEN_KEYS
    got = int(lengths[selected].sum())
    assert record["requested_tokens"] == requested and record["selected_tokens"] == got
    assert record["relative_error"] == pytest.approx(got / requested - 1.0)
    # within one example per rank: the K longest examples bound the distance to the budget
    assert abs(got - requested) <= np.sort(lengths)[-world_size:].sum()
    if plan.config["token_balance"]:  # stratified snake: rank totals within the longest minus the shortest pick
        rank_tokens = [int(lengths[r].sum()) for r in plan.rank_indices]
        assert max(rank_tokens) - min(rank_tokens) <= lengths[selected].max() - lengths[selected].min()
    assert "token budget:" in plan.summary()
    return selected


def _prefix_sums(order: np.ndarray, lengths: np.ndarray, world_size: int) -> np.ndarray:
    """P[j] = tokens of the first j K of ``order``, j = 0 .. len(order) // K."""
    cap = len(order) // world_size
    return np.concatenate([[0], np.cumsum(lengths[order[: cap * world_size]])[world_size - 1 :: world_size]])


# ---------------------------------------------------------------------------------------------- the rule


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=60),
    world_size=st.integers(1, 5),
    fraction=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_prefix_is_the_multiple_of_the_world_size_closest_to_the_budget(lengths, world_size, fraction, seed):
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) < world_size:
        world_size = len(lengths)
    order = np.random.default_rng(seed).permutation(len(lengths))
    tokens = max(1, round(fraction * int(lengths.sum())))
    count, record = prefix_for_tokens(order, lengths, world_size, tokens)
    m, rest = divmod(count, world_size)
    prefix = _prefix_sums(order, lengths, world_size)
    cap = len(prefix) - 1
    assert rest == 0 and 1 <= m <= cap
    assert record["selected_tokens"] == prefix[m] == lengths[order[:count]].sum()
    assert record["requested_tokens"] == tokens
    # closest among the counts a rank-balanced prefix can have (at least one per rank) ...
    assert abs(prefix[m] - tokens) == np.abs(prefix[1:] - tokens).min()
    # ... and within one example per rank: the budget lies between the neighbouring prefixes
    assert prefix[m - 1] <= tokens
    assert m == cap or tokens < prefix[m + 1]


def test_the_rule_is_the_cluster_methods_count_for_tokens():
    from clusterlm.config.budget import count_for_tokens

    lengths = np.array([10, 3, 7, 7, 1, 20, 4, 9, 2, 5], dtype=np.int64)
    order = np.array([5, 0, 7, 2, 3, 9, 6, 1, 8, 4])
    for tokens in (1, 15, 30, 47, 60, 68):
        count, _ = prefix_for_tokens(order, lengths, 2, tokens)
        assert count == 2 * count_for_tokens([order[0::2], order[1::2]], lengths, tokens)
    # 20 + 10 | 9 + 7 | 7 + 5 | ...: 30 tokens -> the first two; 40 -> 46 is closer than 30 -> the first four
    assert prefix_for_tokens(order, lengths, 2, 30)[0] == 2 and prefix_for_tokens(order, lengths, 2, 40)[0] == 4


def test_wrong_budget_combinations_name_the_arguments():
    data = _examples(20)
    total = int(lengths_of(data).sum())
    with pytest.raises(ValueError, match=r"random_plan: give exactly one of ratio / budget .*token_ratio.*got "
                                         r"ratio=0\.3, token_ratio=0\.3"):
        random_plan(data, 2, ratio=0.3, token_ratio=0.3)
    with pytest.raises(ValueError, match="longest_plan: give exactly one .* got token_ratio=0.3, token_budget=100"):
        longest_plan(data, 2, token_ratio=0.3, token_budget=100)
    with pytest.raises(ValueError, match="random_plan: give exactly one .* got none"):
        random_plan(data, 2)
    with pytest.raises(ValueError, match=r"random_plan: token_ratio must be in \(0, 1\], got 1.5"):
        random_plan(data, 2, token_ratio=1.5)
    with pytest.raises(ValueError, match=rf"longest_plan: token_budget must be an int in \[1, {total}\]"):
        longest_plan(data, 2, token_budget=total + 1)
    with pytest.raises(ValueError, match="random_plan: token_budget must be an int"):
        random_plan(data, 2, token_budget=True)
    # the model baselines check the budget before any model work (model=None is never touched)
    with pytest.raises(ValueError, match="ifd_plan: give exactly one .* got budget=4, token_budget=100"):
        ifd_plan(None, data, 2, budget=4, token_budget=100)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="s2l_plan: token_ratio must be in"):
        s2l_plan(None, data, 2, token_ratio=0.0, trajectories=np.zeros((20, 2)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="less_plan: give exactly one .* got ratio=0.5, token_budget=10"):
        less_plan(None, data, 2, ratio=0.5, token_budget=10, validation=data[:2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fewer than world_size=30"):
        resolve_amount(lengths_of(data), 30, None, None, 0.5, None, "random_plan")


# ---------------------------------------------------------------------------------------------- no model


@pytest.mark.parametrize("token_balance", [True, False])
def test_random_meets_the_budget_per_rank_and_is_seeded(token_balance):
    data = _examples(48)
    lengths = lengths_of(data)
    total = int(lengths.sum())
    plan = random_plan(data, 2, token_ratio=0.31, seed=5, token_balance=token_balance)
    selected = _check_tokens(plan, data, 2, round(0.31 * total), "random")
    assert plan.config["token_ratio"] == 0.31 and plan.config["token_budget"] is None
    assert plan.config["ratio"] is None and plan.config["budget"] is None
    again = random_plan(data, 2, token_ratio=0.31, seed=5, token_balance=token_balance)
    for a, b in zip(plan.rank_indices, again.rank_indices, strict=True):
        np.testing.assert_array_equal(a, b)
    others = {tuple(np.sort(np.concatenate(random_plan(data, 2, token_ratio=0.31, seed=s).rank_indices)))
              for s in range(4)}
    assert len(others | {tuple(selected)}) > 1  # the seed decides the sample
    by_count = random_plan(data, 2, token_budget=500, seed=5, token_balance=token_balance)
    _check_tokens(by_count, data, 2, 500, "random")
    assert by_count.config["token_budget"] == 500 and by_count.config["token_ratio"] is None


def test_the_whole_data_rounds_to_the_world_size():
    data = _examples(49)
    total = int(lengths_of(data).sum())
    plan = random_plan(data, 2, token_ratio=1.0)
    assert plan.n_selected == 48  # a multiple of the world size; the budget is missed by the one left out
    assert plan.stats["token_budget"]["selected_tokens"] < total == plan.stats["token_budget"]["requested_tokens"]
    assert random_plan(data, 4, token_budget=1).n_selected == 4  # at least one example per rank


def test_longest_takes_the_longest_answers_until_the_budget():
    data = _examples(48, seed=1)
    answers = answer_tokens(data)
    plan = longest_plan(data, 4, token_budget=400, seed=2)
    selected = _check_tokens(plan, data, 4, 400, "longest")
    rest = np.setdiff1d(np.arange(len(data)), selected)
    assert answers[selected].min() >= answers[rest].max()  # a prefix of the ranking
    assert plan.stats["answer_tokens"]["shortest_selected"] == answers[selected].min()
    same = longest_plan(data, 4, token_budget=400, seed=2)
    np.testing.assert_array_equal(np.concatenate(plan.rank_indices), np.concatenate(same.rank_indices))


def test_s2l_token_budget_on_hand_made_trajectories():
    rng = np.random.default_rng(1)
    sizes = [3, 6, 9, 30]
    levels = [[5.0, 4.0, 3.0], [1.0, 1.0, 1.0], [4.0, 1.0, 0.5], [2.0, 2.5, 3.0]]
    traj = np.concatenate([np.array(lv) + 0.01 * rng.standard_normal((s, 3))
                           for s, lv in zip(sizes, levels, strict=True)])
    data = _examples(len(traj))
    total = int(lengths_of(data).sum())
    kwargs = dict(token_ratio=0.35, n_clusters=4, trajectories=traj, seed=0)
    plan = s2l_plan(None, data, 2, **kwargs)  # type: ignore[arg-type]
    _check_tokens(plan, data, 2, round(0.35 * total), "s2l")
    again = s2l_plan(None, data, 2, **kwargs)  # type: ignore[arg-type]
    np.testing.assert_array_equal(np.concatenate(plan.rank_indices), np.concatenate(again.rank_indices))
    taken = np.array([t for _, _, t in plan.stats["per_cluster"]])
    whole = np.array([t == s for _, s, t in plan.stats["per_cluster"]])
    assert taken.sum() + plan.stats["filled"] == plan.n_selected and plan.stats["filled"] == 0
    # S2L's balance: the clusters not taken whole get equal counts (up to one), at least any whole cluster's
    assert taken[~whole].max() - taken[~whole].min() <= 1
    assert not whole.any() or taken[~whole].min() >= taken[whole].max()
    assert plan.config["token_ratio"] == 0.35 and plan.config["n_clusters"] == 4


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 12), min_size=1, max_size=7), skip=st.integers(0, 3),
       seed=st.integers(0, 1000))
def test_s2l_order_prefixes_are_algorithm_1_samples(sizes, skip, seed):
    labels = np.random.default_rng(seed).permutation(np.repeat(np.arange(len(sizes)), sizes))
    if len(labels) == 0:
        return
    order = balanced_cluster_order(labels, seed=seed, skip_size=skip)
    assert np.array_equal(np.sort(order), np.arange(len(labels)))
    visited = [c for c, s in enumerate(sizes) if s > skip]
    for count in range(1, len(labels) + 1):
        sample, _ = balanced_cluster_sample(labels, count, seed=seed, skip_size=skip)
        a = np.bincount(labels[sample], minlength=len(sizes))[visited]
        b = np.bincount(labels[order[:count]], minlength=len(sizes))[visited]
        np.testing.assert_array_equal(a, b)


def test_token_specs():
    data = _examples(40)
    plan = baseline_plan("random:tokens=0.31", data, 2, seed=3)
    direct = random_plan(data, 2, token_ratio=0.31, seed=3)
    np.testing.assert_array_equal(np.concatenate(plan.rank_indices), np.concatenate(direct.rank_indices))
    assert baseline_plan("random:tokens=300", data, 2).stats["token_budget"]["requested_tokens"] == 300
    assert baseline_plan("random:0.5", data, 2).n_selected == 20 and "token_budget" not in baseline_plan(
        "random:0.5", data, 2).stats
    with pytest.raises(ValueError, match=r"random:tokens=<ratio\|count>"):
        baseline_plan("random:tokens=lots", data, 2)
    with pytest.raises(ValueError, match=r"random_plan: token_ratio must be in"):
        baseline_plan("random:tokens=2.0", data, 2)


# ---------------------------------------------------------------------------------------------- the model


def test_ifd_token_budget_is_a_prefix_of_its_ranking(tiny_model):
    data = _examples(32)
    total = int(lengths_of(data).sum())
    plan = ifd_plan(tiny_model, data, 2, token_ratio=0.4, seed=1)
    selected = _check_tokens(plan, data, 2, round(0.4 * total), "ifd")
    cond = example_losses(tiny_model, data)
    direct = example_losses(tiny_model, [answer_only(ex) for ex in data])
    order, _ = ifd_order(cond, direct)
    np.testing.assert_array_equal(selected, np.sort(order[: len(selected)]))
    assert {"dropped_ifd_gt_1", "filled_from_dropped", "ifd_selected_min"} <= set(plan.stats)
    spec = baseline_plan("ifd:tokens=0.4", data, 2, seed=1, model=tiny_model)
    np.testing.assert_array_equal(np.concatenate(spec.rank_indices), np.concatenate(plan.rank_indices))


def test_less_token_budget(tiny_model):
    data = _examples(16, seed=3)
    kwargs = dict(token_budget=200, validation=data[:2], seed=1, lr=1e-3, warmup_fraction=0.25, warmup_epochs=1,
                  dim=16)
    plan = less_plan(tiny_model, data, 2, **kwargs)
    _check_tokens(plan, data, 2, 200, "less")
    assert plan.config["token_budget"] == 200 and plan.config["ratio"] is None
    again = less_plan(tiny_model, data, 2, **kwargs)
    np.testing.assert_array_equal(np.concatenate(plan.rank_indices), np.concatenate(again.rank_indices))
