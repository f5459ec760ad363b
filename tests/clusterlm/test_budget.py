"""Selection budgets (clusterlm.config.budget): example and token budgets, the per-cluster count for a token budget,
cluster-size bounds. Known answers and properties; no clustering."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clusterlm.config.budget import (
    check_int,
    cluster_size_bound,
    count_for_tokens,
    resolve_any_budget,
    resolve_budget,
    resolve_token_budget,
)

# ---- check_int ------------------------------------------------------------------------------------


def test_check_int_accepts_ints_from_low_and_returns_a_python_int():
    assert check_int(1, "n") == 1
    assert check_int(0, "n", 0) == 0
    got = check_int(np.int64(7), "n")
    assert got == 7 and type(got) is int


@pytest.mark.parametrize("value", [0, -1, True, False, 1.0, 2.5, "3", None, np.float32(3.0)])
def test_check_int_refuses_naming_the_argument_and_the_bound(value):
    with pytest.raises(ValueError, match=r"select: clusters_per_rank must be an int >= 1, got "):
        check_int(value, "clusters_per_rank")


# ---- resolve_budget -------------------------------------------------------------------------------


def test_resolve_budget_known_answers():
    assert resolve_budget(100, 0.31, None) == 31
    assert resolve_budget(100, 1.0, None) == 100
    assert resolve_budget(10, 0.01, None) == 1  # never below one example
    assert resolve_budget(7, 0.5, None) == 4  # round(3.5): Python's round, half to even
    assert resolve_budget(9, 0.5, None) == 4  # round(4.5) == 4
    assert resolve_budget(100, None, 100) == 100
    assert type(resolve_budget(100, None, np.int64(5))) is int


@pytest.mark.parametrize(
    ("ratio", "budget", "match"),
    [
        (None, None, "exactly one of ratio"),
        (0.5, 10, "exactly one of ratio"),
        (0.0, None, r"ratio must be in \(0, 1\]"),
        (1.5, None, r"ratio must be in \(0, 1\]"),
        (True, None, r"ratio must be in \(0, 1\]"),
        ("0.5", None, r"ratio must be in \(0, 1\]"),
        (None, 0, r"budget must be an int in \[1, 50\]"),
        (None, 51, r"budget must be an int in \[1, 50\]"),
        (None, 2.0, r"budget must be an int in \[1, 50\]"),
        (None, True, r"budget must be an int in \[1, 50\]"),
    ],
)
def test_resolve_budget_errors_name_the_argument(ratio, budget, match):
    with pytest.raises(ValueError, match=match):
        resolve_budget(50, ratio, budget)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 10**7), ratio=st.floats(1e-9, 1.0, exclude_min=False))
def test_resolve_budget_is_the_nearest_count_within_the_data(n, ratio):
    got = resolve_budget(n, ratio, None)
    assert 1 <= got <= n
    assert got == 1 or abs(got - ratio * n) <= 0.5


# ---- resolve_token_budget ---------------------------------------------------------------------------


def test_resolve_token_budget_known_answers():
    lengths = np.array([10, 20, 30, 40])  # 100 tokens
    assert resolve_token_budget(lengths, None, None) is None
    assert resolve_token_budget(lengths, 0.25, None) == 25
    assert resolve_token_budget(lengths, 0.001, None) == 1
    assert resolve_token_budget(lengths, None, 100) == 100
    assert resolve_token_budget(lengths, None, 1) == 1


@pytest.mark.parametrize(
    ("token_ratio", "token_budget", "match"),
    [
        (0.5, 10, "at most one of token_ratio and token_budget"),
        (0.0, None, r"token_ratio must be in \(0, 1\]"),
        (1.01, None, r"token_ratio must be in \(0, 1\]"),
        (False, None, r"token_ratio must be in \(0, 1\]"),
        (None, 0, r"token_budget must be an int in \[1, 100\]"),
        (None, 101, r"token_budget must be an int in \[1, 100\]"),
        (None, 50.0, r"token_budget must be an int in \[1, 100\]"),
    ],
)
def test_resolve_token_budget_errors_name_the_argument(token_ratio, token_budget, match):
    with pytest.raises(ValueError, match=match):
        resolve_token_budget(np.array([10, 20, 30, 40]), token_ratio, token_budget)


# ---- resolve_any_budget ----------------------------------------------------------------------------


def test_resolve_any_budget_returns_the_token_budget_or_none():
    lengths = np.full(20, 5)
    assert resolve_any_budget(20, lengths, 0.5, None, None, None, "default") is None
    assert resolve_any_budget(20, lengths, None, 3, None, None, "default") is None
    assert resolve_any_budget(20, lengths, None, None, 0.1, None, "default") == 10
    assert resolve_any_budget(20, lengths, None, None, None, 40, "default") == 40


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "got none"),
        ({"ratio": 0.5, "token_ratio": 0.5}, "got ratio=0.5, token_ratio=0.5"),
        ({"budget": 3, "token_budget": 10}, "got budget=3, token_budget=10"),
        ({"ratio": 2.0}, r"ratio must be in \(0, 1\]"),  # the example budget is checked too
        ({"budget": 21}, r"budget must be an int in \[1, 20\]"),
    ],
)
def test_resolve_any_budget_wants_exactly_one_valid_budget(kwargs, match):
    args = {"ratio": None, "budget": None, "token_ratio": None, "token_budget": None} | kwargs
    with pytest.raises(ValueError, match=match):
        resolve_any_budget(20, np.full(20, 5), **args, preset="default")


def test_resolve_any_budget_paper_preset_refuses_a_token_budget():
    with pytest.raises(ValueError, match="preset='paper'"):
        resolve_any_budget(20, np.full(20, 5), None, None, 0.5, None, "paper")
    assert resolve_any_budget(20, np.full(20, 5), 0.31, None, None, None, "paper") is None


# ---- count_for_tokens -----------------------------------------------------------------------------


def test_count_for_tokens_known_answers():
    lengths = np.array([10, 10, 10, 10, 1, 1, 1, 1])
    picks = [np.array([0, 1, 2, 3]), np.array([4, 5, 6, 7])]  # 11 tokens per pick position
    assert count_for_tokens(picks, lengths, 22) == 2  # exactly two per cluster
    assert count_for_tokens(picks, lengths, 27) == 2  # 22 is closer than 33
    assert count_for_tokens(picks, lengths, 28) == 3  # 33 is closer than 22
    assert count_for_tokens(picks, lengths, 1) == 1  # never below one per cluster
    assert count_for_tokens(picks, lengths, 10**6) == 4  # capped by the picks
    short = [np.array([0, 1, 2, 3]), np.array([4, 5])]
    assert count_for_tokens(short, lengths, 10**6) == 2  # the smallest cluster's picks bound it


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=5),
    seed=st.integers(0, 2**31 - 1),
    frac=st.floats(0.0, 1.3),
)
def test_count_for_tokens_comes_closest_to_the_budget(sizes, seed, frac):
    """The count is the one of 1..cap whose total is nearest the budget (the lower one on a tie)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 50, size=sum(sizes))
    starts = np.cumsum([0, *sizes])
    picks = [rng.permutation(np.arange(a, b)) for a, b in zip(starts[:-1], starts[1:], strict=True)]
    cap = min(sizes)
    totals = [sum(int(lengths[p[:m]].sum()) for p in picks) for m in range(1, cap + 1)]
    tokens = max(1, int(frac * totals[-1]))
    got = count_for_tokens(picks, lengths, tokens)
    assert 1 <= got <= cap
    misses = [abs(t - tokens) for t in totals]
    assert misses[got - 1] == min(misses)
    assert got == 1 + misses.index(min(misses))


# ---- cluster_size_bound ---------------------------------------------------------------------------


def test_cluster_size_bound_forms():
    assert cluster_size_bound(None, "max_cluster_size", 100, 4, 10) is None
    assert cluster_size_bound("budget", "min_cluster_size", 100, 4, 10) == 10
    assert cluster_size_bound("1.5x", "max_cluster_size", 100, 4, 10) == math.ceil(1.5 * 100 / 4) == 38
    assert cluster_size_bound("1x", "max_cluster_size", 10, 3, 1) == 4  # ceil(10 / 3)
    assert cluster_size_bound("0.25x", "min_cluster_size", 100, 4, 10) == 7  # ceil(6.25)
    assert cluster_size_bound(0, "min_cluster_size", 100, 4, 10) == 0
    assert cluster_size_bound(np.int32(12), "max_cluster_size", 100, 4, 10) == 12


@pytest.mark.parametrize("value", ["x", "0x", "-1x", "abc", "1.5", "budgetx", -1, 1.5, True])
def test_cluster_size_bound_errors_name_the_argument(value):
    with pytest.raises(ValueError, match="select: max_cluster_size must be"):
        cluster_size_bound(value, "max_cluster_size", 100, 4, 10)


def test_numpy_scalars_are_ratios_too_and_nan_is_not():
    assert resolve_budget(100, np.float32(0.31), None) == resolve_budget(100, 0.31, None) == 31
    assert resolve_budget(100, np.float64(1.0), None) == 100
    assert resolve_token_budget(np.array([10, 30]), np.float64(0.5), None) == 20
    for bad in (float("nan"), np.float64("nan"), np.bool_(True), True):
        with pytest.raises(ValueError, match="ratio must be in"):
            resolve_budget(100, bad, None)
