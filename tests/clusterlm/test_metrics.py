"""What a training run records (clusterlm.training.metrics): metrics.jsonl, the step record, the loss windows, the
summary
and its printed lines, the training curve. One process, no model."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from clusterlm.engine.step import CKPT_DIR
from clusterlm.launch.launcher import DistInfo
from clusterlm.training import metrics as M

CPU = DistInfo(0, 1, 0, None, torch.device("cpu"))

# ---- moved here from test_train_warnings.py ------------------------------------------------------------


def test_loss_windows():
    assert M.loss_windows([]) is None
    assert M.loss_windows([3.0, 2.0, 1.0]) == (3.0, 1.0, 1)  # < 10 steps: single steps
    losses = list(np.arange(25, dtype=float))  # 25 // 5 = 5 steps
    assert M.loss_windows(losses) == (2.0, 22.0, 5)
    first, last, w = M.loss_windows(list(np.arange(200, dtype=float)))  # capped at 10
    assert (first, last, w) == (4.5, 194.5, 10)


def _record(step: int, loss: float) -> dict:
    return {"kind": "train", "step": step, "loss": loss, "step_tokens": [10], "step_padded_tokens": [12],
            "step_time": [0.1]}


def test_summary_reports_window_means_and_keeps_single_step_fields():
    from types import SimpleNamespace

    rng = np.random.default_rng(0)
    losses = (np.linspace(2.0, 1.0, 30) + rng.normal(0, 0.3, 30)).tolist()
    records = [_record(i + 1, v) for i, v in enumerate(losses)]
    args = SimpleNamespace(plan="full", micro_batch_size=4, grad_accum=1)
    plan = SimpleNamespace(config={"method": "full"}, per_rank=120)
    di = DistInfo(0, 1, 0, None, torch.device("cpu"))
    s = M.summarize(records, {"tokens": 300, "train_time": 3.0}, args, di, plan, 30, 4.0, None)
    assert s["first_train_loss"] == losses[0] and s["final_train_loss"] == losses[-1]
    assert s["train_loss_window"] == 6
    assert s["train_loss_first_window"] == pytest.approx(np.mean(losses[:6]))
    assert s["train_loss_last_window"] == pytest.approx(np.mean(losses[-6:]))
    text = M.summary_text(s, Path("out"))
    line = next(x for x in text.splitlines() if x.startswith("train loss"))
    assert line == (f"train loss (weighted, mean of first/last 6 steps): {np.mean(losses[:6]):.4f} -> "
                    f"{np.mean(losses[-6:]):.4f}")


# ---- loss windows --------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=120))
def test_loss_windows_are_the_means_of_equal_first_and_last_windows(losses):
    first, last, w = M.loss_windows(losses)
    assert w == min(M.LOSS_WINDOW_MAX, max(1, len(losses) // 5))
    assert first == pytest.approx(np.mean(losses[:w])) and last == pytest.approx(np.mean(losses[-w:]))


# ---- MetricsLog ---------------------------------------------------------------------------------------


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_metrics_log_appends_records_and_a_resumed_run_rewrites_the_file(tmp_path: Path):
    path = tmp_path / M.METRICS
    log = M.MetricsLog(path, True)
    assert path.read_text() == ""  # created empty at the start
    for step in (1, 2, 3):
        log.append({"kind": "train", "step": step})
    assert _lines(path) == log.records == [{"kind": "train", "step": s} for s in (1, 2, 3)]
    resumed = M.MetricsLog(path, True, log.records[:2])  # a resume from step 2 drops step 3 from the file
    assert _lines(path) == [{"kind": "train", "step": 1}, {"kind": "train", "step": 2}]
    resumed.append({"kind": "eval", "step": 2, "eval_loss": 1.5})
    assert _lines(path)[-1] == {"kind": "eval", "step": 2, "eval_loss": 1.5} and len(_lines(path)) == 3


def test_metrics_log_of_other_ranks_keeps_records_but_writes_nothing(tmp_path: Path):
    log = M.MetricsLog(tmp_path / M.METRICS, False, [{"kind": "train", "step": 1}])
    log.append({"kind": "train", "step": 2})
    assert [r["step"] for r in log.records] == [1, 2] and not (tmp_path / M.METRICS).exists()


# ---- step_record ---------------------------------------------------------------------------------------


def test_step_record_on_one_process_and_the_counters():
    stats = {"loss": 1.25, "loss_unweighted": 1.5, "tokens": 40, "padded_tokens": 48, "lr": 1e-3, "grad_norm": 0.7}
    counters = {"tokens": 100, "train_time": 2.0}
    rec = M.step_record(stats, 0.5, 0.4, CPU, 7, 1.25, counters)
    assert counters == {"tokens": 140, "train_time": 2.5}
    assert rec == {"kind": "train", "step": 7, "epoch": 1.25, "loss": 1.25, "loss_unweighted": 1.5, "lr": 1e-3,
                   "grad_norm": 0.7, "tokens": 140, "step_tokens": [40], "step_padded_tokens": [48],
                   "step_time": [0.5], "step_cpu_time": [0.4], "tokens_per_s": 80.0, "elapsed": 2.5}
    json.dumps(rec)  # a JSON line as it is


# ---- summarize / summary_text ------------------------------------------------------------------------------


def _run(n_steps: int, evals: list[tuple[int, float]]) -> tuple[list[dict], dict]:
    records = [{"kind": "train", "step": i + 1, "loss": 2.0 - 0.1 * i, "step_tokens": [10, 30],
                "step_padded_tokens": [32, 32], "step_time": [0.1, 0.3]} for i in range(n_steps)]
    records += [{"kind": "eval", "step": s, "eval_loss": v} for s, v in evals]
    args = SimpleNamespace(plan="plans/p", micro_batch_size=2, grad_accum=3)
    plan = SimpleNamespace(config={"method": "cluster"}, per_rank=12)
    di = DistInfo(0, 2, 0, None, torch.device("cpu"))
    return records, M.summarize(records, {"tokens": 400, "train_time": 4.0}, args, di, plan, 5, 6.0, None)


def test_summarize_known_answers():
    _, s = _run(4, [(0, 3.0), (4, 2.5)])
    assert s["steps"] == 4 and s["total_steps"] == 5 and s["world_size"] == 2 and s["device"] == "cpu"
    assert s["plan"] == "plans/p" and s["plan_method"] == "cluster" and s["examples_per_rank"] == 12
    assert s["examples_per_step"] == 2 * 3 * 2
    assert s["tokens"] == 400 and s["tokens_per_s"] == 100.0 and s["wall_time_s"] == 6.0
    assert s["mean_step_time_s"] == pytest.approx(0.3)  # the slowest rank's time per step
    assert s["step_token_max_over_mean"] == pytest.approx(30 / 20)
    assert s["step_padded_token_max_over_mean"] == pytest.approx(1.0)
    assert s["initial_eval_loss"] == 3.0 and s["final_eval_loss"] == 2.5
    assert s["first_train_loss"] == 2.0 and s["final_train_loss"] == pytest.approx(1.7)
    assert s["resumed_from"] is None
    json.dumps(s)


def test_summary_without_a_step_0_evaluation_shows_the_last_one_alone():
    _, s = _run(2, [(2, 2.0)])
    assert s["initial_eval_loss"] is None and s["final_eval_loss"] == 2.0
    assert "held-out loss (answer tokens): 2.0000" in M.summary_text(s, Path("out")).splitlines()


def test_summarize_without_steps():
    _, s = _run(0, [(3, 2.0)])
    assert s["steps"] == 0 and s["mean_step_time_s"] is None and s["step_token_max_over_mean"] is None
    assert s["first_train_loss"] is None and s["train_loss_window"] is None
    text = M.summary_text(s, Path("out"))
    assert "train loss" not in text and "per-step tokens" not in text


def test_summary_text_names_every_file():
    _, s = _run(3, [(0, 3.0), (3, 2.25)])
    lines = M.summary_text(s, Path("out")).splitlines()
    assert lines[0] == "" and lines[1].startswith("trained 3 steps on 2 rank(s) (12 examples per step) in 4.0 s")
    assert "train loss (weighted, first/last step): 2.0000 -> 1.8000" in lines
    assert "held-out loss (answer tokens): 3.0000 -> 2.2500" in lines
    assert "per-step tokens across ranks, max/mean: 1.500 (padded 1.000)" in lines
    assert lines[-4:] == [f"metrics: {Path('out') / M.METRICS}", f"summary: {Path('out') / M.SUMMARY}",
                          f"curve:   {Path('out') / M.CURVE}", f"ckpt:    {Path('out') / CKPT_DIR}"]


# ---- plot_training -------------------------------------------------------------------------------------


def test_plot_training_writes_a_png_and_nothing_without_steps(tmp_path: Path):
    records, _ = _run(60, [(0, 3.0), (30, 2.5), (60, 2.0)])
    for r in records:
        r["tokens_per_s"] = 1000.0
    path = M.plot_training(records, tmp_path / "sub" / M.CURVE)
    assert path == tmp_path / "sub" / M.CURVE
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in path.parent.iterdir()] == [M.CURVE]  # no temporary file left
    assert M.plot_training([{"kind": "eval", "step": 0, "eval_loss": 1.0}], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()
