"""Random and full-data baseline plans: counts, left-out examples, weights, uniformity, allocation, specs."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_cases import random_examples

from clusterlm.data import fingerprint
from clusterlm.plan import Plan
from clusterlm.selection.baselines import baseline_plan, full_plan, is_baseline_spec, random_plan


def _examples(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    return random_examples(n, seed, lengths=(6, 300), ids=(0, 1000), prompt_div=3)


def _check_baseline(plan: Plan, data: list, world_size: int) -> np.ndarray:
    selected = np.concatenate(plan.rank_indices)
    assert plan.world_size == world_size and len({len(r) for r in plan.rank_indices}) == 1
    assert len(np.unique(selected)) == len(selected)
    np.testing.assert_array_equal(plan.weights[selected], 1.0)
    assert (plan.weights > 0).sum() == len(selected)
    assert (plan.cluster_labels == -1).all() and len(plan.cluster_sizes) == 0 and np.isnan(plan.distances).all()
    np.testing.assert_array_equal(plan.lengths, [len(e["input_ids"]) for e in data])
    plan.verify(data, world_size)  # fingerprint of the data set recorded
    return selected


@pytest.mark.parametrize(("n", "world_size"), [(96, 4), (103, 4), (50, 3), (7, 7), (10, 1)])
def test_full_plan_takes_everything_but_at_most_world_size_minus_one(n, world_size, tmp_path):
    data = _examples(n)
    plan = full_plan(data, world_size, seed=3)
    selected = _check_baseline(plan, data, world_size)
    left = plan.stats["left_out"]
    assert left["count"] == n % world_size <= world_size - 1
    assert len(selected) == n - n % world_size
    assert sorted(set(range(n)) - set(selected.tolist())) == left["indices"]
    assert ("rounding" in plan.stats) == bool(n % world_size)
    assert plan.config["method"] == "full"
    again = Plan.load(plan.save(tmp_path / "p"))
    for a, b in zip(plan.rank_indices, again.rank_indices, strict=True):
        np.testing.assert_array_equal(a, b)


def test_full_plan_left_out_depends_on_seed_only():
    data = _examples(103)
    a, b, c = (full_plan(data, 4, seed=s) for s in (0, 0, 1))
    assert a.stats["left_out"]["indices"] == b.stats["left_out"]["indices"]
    picks = {tuple(full_plan(data, 4, seed=s).stats["left_out"]["indices"]) for s in range(8)}
    assert len(picks) > 1 and c.stats["left_out"]["count"] == 3


def test_random_plan_counts_and_rounding():
    data = _examples(200)
    plan = random_plan(data, 4, ratio=0.31, seed=0)
    _check_baseline(plan, data, 4)
    assert plan.n_selected == 60 and "62 requested -> 60 selected" in plan.stats["rounding"]
    plan = random_plan(data, 4, budget=40, seed=0)
    assert plan.n_selected == 40 and "rounding" not in plan.stats
    assert plan.config["method"] == "random" and plan.config["budget"] == 40


def test_random_plan_is_uniform_and_seeded():
    data = _examples(40)
    counts = np.zeros(40)
    trials = 400
    for seed in range(trials):
        counts[np.concatenate(random_plan(data, 2, ratio=0.25, seed=seed).rank_indices)] += 1
    # each example is in a sample of 10/40 with probability 1/4: binomial(400, 0.25), sd ~ 8.7
    assert np.abs(counts - trials / 4).max() < 5 * np.sqrt(trials * 0.25 * 0.75)
    a, b = random_plan(data, 2, ratio=0.25, seed=7), random_plan(data, 2, ratio=0.25, seed=7)
    for x, y in zip(a.rank_indices, b.rank_indices, strict=True):
        np.testing.assert_array_equal(x, y)


def test_token_balance_aligns_lengths_across_ranks():
    data = _examples(400, seed=5)
    balanced = random_plan(data, 4, ratio=0.5, seed=0, token_balance=True)
    plain = random_plan(data, 4, ratio=0.5, seed=0, token_balance=False)
    assert sorted(np.concatenate(balanced.rank_indices).tolist()) == sorted(np.concatenate(plain.rank_indices).tolist())
    assert balanced.step_token_ratio(4).mean() < 1.05 < plain.step_token_ratio(4).mean()
    tokens = balanced.per_rank_tokens()
    assert tokens.max() / tokens.mean() < 1.02
    assert balanced.config["allocation"] == "stratified" and plain.config["allocation"] == "random-split"


def test_argument_errors_name_the_argument():
    data = _examples(10)
    with pytest.raises(ValueError, match="random_plan: give exactly one of ratio"):
        random_plan(data, 2, ratio=0.5, budget=4)
    with pytest.raises(ValueError, match="random_plan: ratio must be in"):
        random_plan(data, 2, ratio=1.5)
    with pytest.raises(ValueError, match="at least 4"):
        random_plan(data, 4, budget=3)
    with pytest.raises(ValueError, match="fewer than world_size=11"):
        full_plan(data, 11)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        full_plan(data, 0)
    with pytest.raises(ValueError, match="seed"):
        random_plan(data, 2, ratio=0.5, seed=-1)


def test_baseline_specs():
    data = _examples(100)
    assert is_baseline_spec("full") and is_baseline_spec("random:0.3") and not is_baseline_spec("runs/plan")
    assert baseline_plan("full", data, 4).n_selected == 100
    assert baseline_plan("random:0.31", data, 2).n_selected == 30
    assert baseline_plan("random:1.0", data, 2).n_selected == 100
    assert baseline_plan("random:12", data, 4).n_selected == 12
    with pytest.raises(ValueError, match="random:<ratio>"):
        baseline_plan("random:lots", data, 2)
    with pytest.raises(ValueError, match="unknown baseline"):
        baseline_plan("s2l", data, 2)
    assert fingerprint(data) == baseline_plan("full", data, 1).fingerprint
