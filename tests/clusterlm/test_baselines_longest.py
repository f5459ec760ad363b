"""The length baseline (:func:`clusterlm.selection.baselines.longest_plan`): the most answer tokens at the example
budget."""

from __future__ import annotations

import numpy as np
import pytest

from clusterlm.selection.baselines import longest_plan
from clusterlm.selection.baselines.longest import answer_tokens


def _data(answers: list[int], prompt: int = 3) -> list[dict]:
    return [{"input_ids": list(range(1, prompt + a + 1)), "labels": [-100] * prompt + [7] * a} for a in answers]


def test_keeps_the_longest_answers_at_the_example_budget():
    answers = [5, 1, 9, 3, 9, 2, 7, 4, 8, 6]
    plan = longest_plan(_data(answers), 2, ratio=0.4, seed=0)
    chosen = np.sort(np.concatenate(plan.rank_indices))
    assert chosen.tolist() == [2, 4, 6, 8]  # answers 9, 9, 7, 8
    assert plan.config["method"] == "longest" and np.all(plan.weights[chosen] == 1)
    assert plan.stats["answer_tokens"]["shortest_selected"] == 7
    # the budget is rounded down to a multiple of the world size, as every baseline's
    assert longest_plan(_data(answers), 2, budget=5).n_selected == 4


def test_ties_are_broken_by_the_seed_and_errors_name_the_baseline():
    data = _data([4] * 12)
    picks = {tuple(np.sort(np.concatenate(longest_plan(data, 1, budget=3, seed=s).rank_indices))) for s in range(6)}
    assert len(picks) > 1  # equal lengths: the seed decides
    assert answer_tokens(data).tolist() == [4] * 12
    with pytest.raises(ValueError, match="longest_plan: seed"):
        longest_plan(data, 1, ratio=0.5, seed=-1)
    with pytest.raises(ValueError, match="no 'labels'"):
        longest_plan([{"input_ids": [1, 2]}] * 4, 1, ratio=0.5)
