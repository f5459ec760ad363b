"""``clusterlm compare`` decides on task metrics: per-problem scores, paired intervals over seeds x problems, the
direction of each metric, ``--decide-by``, and one end-to-end run with a code task on the tiny model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from clusterlm.cli import commands as cli
from clusterlm.cli.options import parse_config
from clusterlm.comparison.metrics import (
    LOSS,
    decided_metric,
    item_scores,
    lower_is_better,
    metric_rows,
    metric_verdicts,
)
from clusterlm.comparison.output import decision_verdicts, with_task_metrics
from clusterlm.comparison.plot import decision_view
from clusterlm.tasks.passk import pass_at_k


def _code_records(passed: dict[str, list[bool]]) -> list[dict]:
    return [{"task_id": tid, "sample": s, "status": "passed" if ok else "failed"}
            for tid, flags in passed.items() for s, ok in enumerate(flags)]


def test_item_scores_give_each_problem_its_pass_at_k_and_each_sample_its_value():
    records = {"code": _code_records({"p/1": [True, False, False, True], "p/0": [False] * 4}),
               "mc": [{"task_id": "mc/1", "task": "mc", "acc": 1.0}, {"task_id": "mc/0", "task": "mc", "acc": 0.0},
                      {"task_id": "mc/2", "task": "mc", "acc": True}]}
    metrics = {"code/pass@1": 0.25, "code/pass@2": 0.5, "code/reference_loss": 1.2, "mc/acc": 2 / 3}
    scores = item_scores(records, metrics)
    assert scores["code/pass@1"] == [0.0, pass_at_k(4, 2, 1)]  # problems in task_id order
    assert scores["code/pass@2"] == [0.0, pass_at_k(4, 2, 2)]
    assert math.isclose(np.mean(scores["code/pass@1"]), 0.25)
    assert scores["mc/acc"] == [0.0, 1.0, 1.0]
    assert "code/reference_loss" not in scores  # no per-problem values: compared over seeds only


def test_direction_of_each_metric():
    assert lower_is_better("humaneval/reference_loss") and lower_is_better("wiki/word_perplexity")
    assert not lower_is_better("humaneval/pass@1") and not lower_is_better("mc/acc")


def _unit(method: str, seed: int, rate: float, n: int = 60) -> dict:
    rng = np.random.default_rng(hash((method, seed)) % 2**32)
    scores = (rng.random(n) < rate).astype(float).tolist()
    return {"method": method, "seed": seed, "task_metrics": {"t/pass@1": float(np.mean(scores)), "t/loss": 1 - rate},
            "task_scores": {"t/pass@1": scores}, "tokens": 1000.0}


def test_a_real_difference_is_resolved_and_said_the_right_way_round():
    records = [_unit(m, s, rate) for m, rate in (("cluster", 0.8), ("random", 0.2)) for s in range(3)]
    rows = metric_rows(records, ["random", "cluster"], "t/pass@1")
    row = rows["cluster"]
    assert row["delta_vs_random"] > 0.4 and row["ci95_vs_random"][0] > 0 and row["paired_vs_random"]
    assert row["interval_vs_random"] == "seeds x problems" and row["problems"] == 60
    assert row["ci95"][0] < row["mean"] < row["ci95"][1]
    line = metric_verdicts(rows, "t/pass@1")[1]
    assert "cluster vs random on t/pass@1" in line and "better t/pass@1 than random (higher)" in line
    # a loss-like metric: lower is better; without per-problem scores the seeds alone are resampled
    loss_rows = metric_rows(records, ["random", "cluster"], "t/loss")
    assert loss_rows["cluster"]["interval_vs_random"] == "seeds only"
    assert "better t/loss than random (lower)" in metric_verdicts(loss_rows, "t/loss")[1]


def test_equal_methods_are_not_distinguishable():
    records = [_unit(m, s, 0.5) for m in ("cluster", "random") for s in range(3)]
    line = metric_verdicts(metric_rows(records, ["random", "cluster"], "t/pass@1"), "t/pass@1")[1]
    assert "not distinguishable at 3 seeds" in line


def test_decide_by_defaults_to_the_first_task_metric_and_refuses_an_unmeasured_one():
    records = [_unit("random", 0, 0.5)]
    assert decided_metric(None, records) == "t/pass@1"
    assert decided_metric(None, [{"method": "random"}]) == LOSS
    assert decided_metric("loss", records) == LOSS
    with pytest.raises(ValueError, match="no unit measured that metric"):
        decided_metric("t/acc", records)


def test_the_quality_panel_draws_the_decided_metric_left_is_better():
    records = [_unit(m, s, rate) for m, rate in (("cluster", 0.8), ("random", 0.2)) for s in range(2)]
    summary = with_task_metrics({"cluster": {"seeds": 2}, "random": {"seeds": 2}}, records, ["random", "cluster"])
    view, what = decision_view({"summary": summary, "decide_by": "t/pass@1"})
    assert view["cluster"]["delta_vs_random"] < 0  # higher pass@1 drawn to the left (better)
    assert "higher is better" in what
    assert decision_verdicts(summary, "t/pass@1")[0].startswith("verdict: cluster vs random on t/pass@1")


def test_decide_by_names_a_task_of_the_comparison():
    values = parse_config(cli.compare_parser(), ["--eval-task", "mini=p.jsonl", "--allow-code-execution",
                                                 "--decide-by", "mini/pass@1"])
    config = cli.compare_config(values)
    assert config.decide_by == "mini/pass@1" and config.train.tasks.eval_task == ("mini=p.jsonl",)
    with pytest.raises(ValueError, match="--decide-by 'other/pass@1'"):
        config.replace(decide_by="other/pass@1").check()
    config.replace(decide_by="loss").check()


PROBLEMS = [
    {"task_id": f"mini/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x plus {i}.\"\"\"\n",
     "canonical_solution": f"    return x + {i}\n", "test": f"def check(f):\n    assert f(1) == {1 + i}\n",
     "entry_point": f"f{i}"} for i in range(3)
]


def test_compare_decides_by_a_code_task_end_to_end(small_sft, tmp_path):
    problems = tmp_path / "mini.jsonl"
    problems.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS), encoding="utf-8")
    out = tmp_path / "cmp"
    argv = ["--model", "tiny-llama", "--data", str(small_sft.train), "--eval-data", str(small_sft.heldout),
            "--world-size", "1", "--ratio", "0.5", "--methods", "random,longest", "--seeds", "2", "--max-steps", "1",
            "--max-length", str(small_sft.max_length), "--eval-task", f"mini={problems}", "--allow-code-execution",
            "--task-max-new-tokens", "8", "--decide-by", "mini/pass@1", "--out", str(out)]
    assert cli.main(["compare", *argv]) == 0
    result = json.loads((out / "compare.json").read_text())
    assert result["decide_by"] == "mini/pass@1"
    row = result["summary"]["longest"]["metrics"]["mini/pass@1"]
    assert row["problems"] == 3 and row["interval_vs_random"] == "seeds x problems" and row["paired_vs_random"]
    assert "mini/reference_loss" in result["summary"]["random"]["metrics"]
    for rec in result["records"]:
        assert len(rec["task_scores"]["mini/pass@1"]) == 3 and rec["task_eval_s"] > 0
        assert math.isclose(np.mean(rec["task_scores"]["mini/pass@1"]), rec["task_metrics"]["mini/pass@1"])
    md = (out / "compare.md").read_text()
    assert "mini/pass@1 [95 %]" in md and "verdict: longest vs random on mini/pass@1" in md
    assert (out / "compare.png").is_file()
