"""The Python entry points (issue 35): ``clusterlm.train(TrainConfig)`` on 2 gloo ranks with ``report_to`` TensorBoard
and W&B (offline), its typed result, the config file the ranks read; the CLI with ``--config`` and an override;
``clusterlm.compare(CompareConfig)`` against ``clusterlm compare --config`` on the same settings.

One 2-rank run is shared by the training tests (module fixture).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import clusterlm
from clusterlm.cli import commands as cli
from clusterlm.cli.options import parse_config
from clusterlm.training.reporting import TENSORBOARD_DIR

MAX_LENGTH = 96  # = small_sft.max_length (tests/clusterlm/conftest.py)


@pytest.fixture(scope="module")
def api_run(small_sft, tmp_path_factory):
    """``clusterlm.train`` from Python: 2 ranks, a Plan object, TensorBoard and W&B (offline) reporting."""
    out = small_sft.root / "api"
    config = clusterlm.TrainConfig(model="tiny-llama", data=str(small_sft.train), eval_data=str(small_sft.heldout),
                                   out=str(out), nproc=2, max_steps=4, micro_batch_size=2, lr=1e-3, eval_every=2,
                                   max_length=MAX_LENGTH, progress=False, save_model=False,
                                   report_to=("tensorboard", "wandb"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_DIR", str(out))
        result = clusterlm.train(config, plan=small_sft.plan)
    return SimpleNamespace(out=out, config=config, result=result)


def test_train_from_python_returns_a_typed_result(api_run):
    r = api_run.result
    assert isinstance(r, clusterlm.TrainResult) and r.out == api_run.out
    assert r.steps == 4 and len(r.losses) == 4 and all(np.isfinite(r.losses))
    assert sorted(r.eval_losses) == [0, 2, 4] and r.initial_eval_loss == r.eval_losses[0]
    assert r.eval_loss == r.eval_losses[4] < r.initial_eval_loss
    assert r.tokens > 0 and r.train_time_s > 0 and r.summary["world_size"] == 2
    assert r.paths["tensorboard"].is_dir() and r.paths["plan"].is_dir() and "model" not in r.paths
    assert "TrainResult(" in repr(r) and "summary" not in repr(r)


def test_the_ranks_read_the_checksummed_config_file_and_it_loads_back(api_run):
    written = clusterlm.TrainConfig.load(api_run.out / "train_config.yaml")
    assert written == api_run.config.replace(plan=str(api_run.out / "plan"))
    args = json.loads((api_run.out / "args.json").read_text(encoding="utf-8"))
    assert "--config" in args["argv"] and str(api_run.out / "train_config.yaml") in args["argv"]


def test_tensorboard_events_hold_the_logged_losses(api_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(api_run.out / TENSORBOARD_DIR))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "eval/eval_loss"} <= tags
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    assert np.allclose([e.value for e in loss], api_run.result.losses, rtol=1e-6)
    evals = {e.step: e.value for e in acc.Scalars("eval/eval_loss")}
    assert evals.keys() == api_run.result.eval_losses.keys()
    assert np.allclose(list(evals.values()), list(api_run.result.eval_losses.values()), rtol=1e-6)


def _wandb_history(path: Path, key: str) -> list[float]:
    """The values logged under ``key`` in an offline W&B run file (its history items are protobuf records holding
    the key and the value as JSON text: ``0x12 len key 0x82 0x01 len json``); wandb ships no Python reader."""
    data, tag, out = path.read_bytes(), key.encode() + b"\x82\x01", []
    start = data.find(tag)
    while start >= 0:
        n = data[start + len(tag)]
        out.append(float(data[start + len(tag) + 1: start + len(tag) + 1 + n].decode()))
        start = data.find(tag, start + 1)
    return out


def test_wandb_offline_run_logged_the_same_scalars(api_run):
    runs = sorted((api_run.out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list((api_run.out / "wandb").iterdir())
    # each value appears in its history record and again in the run summary that follows it
    for key, logged in (("train/loss", api_run.result.losses), ("eval/eval_loss", api_run.result.eval_losses.values())):
        found = _wandb_history(runs[0], key)
        assert sorted(set(np.round(found, 6))) == sorted(set(np.round(list(logged), 6))), (key, found, logged)


def test_a_missing_reporter_package_is_one_line_naming_the_install(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ImportError, match="pip install wandb"):
        clusterlm.TrainConfig(plan="full", model="m", data="d", out="o", report_to=("wandb",)).check()
    assert cli.main(["train", "--plan", "full", "--model", "tiny-llama", "--data", "d.jsonl", "--out", "o",
                     "--report-to", "wandb"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install wandb" in err[0], err


def test_cli_config_file_with_an_override_trains_and_writes_both(small_sft, tmp_path):
    cfg = tmp_path / "run.yaml"
    out = tmp_path / "cli"
    cfg.write_text(f"plan: random:0.5\nmodel: tiny-llama\ndata: {small_sft.train}\nout: {out}\nmax_steps: 2\n"
                   f"micro_batch_size: 2\nmax_length: {MAX_LENGTH}\nlr: 1.0e-3\nprogress: false\nsave_model: false\n",
                   encoding="utf-8")
    assert cli.main(["train", "--config", str(cfg), "--lr", "2e-4"]) == 0
    written = clusterlm.TrainConfig.load(out / "train_config.yaml")
    assert written.lr == 2e-4 and written.max_steps == 2 and written.plan == "random:0.5"
    lrs = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()
           if json.loads(line)["kind"] == "train"]
    assert max(lrs) <= 2e-4 + 1e-12


def test_compare_from_python_equals_compare_from_a_config_file(small_sft, tmp_path):
    def settings(out: Path) -> dict:
        return {"data": str(small_sft.train), "eval_data": [str(small_sft.heldout)], "methods": ["random", "longest"],
                "seeds": [0], "world_size": 1, "ratio": 0.5, "out": str(out),
                "train": {"max_steps": 1, "micro_batch_size": 2, "max_length": MAX_LENGTH}}

    cfg = tmp_path / "cmp.yaml"
    import yaml

    cfg.write_text(yaml.safe_dump(settings(tmp_path / "a")), encoding="utf-8")
    assert cli.main(["compare", "--config", str(cfg)]) == 0
    result = clusterlm.compare(clusterlm.CompareConfig.from_dict(settings(tmp_path / "b")))
    assert isinstance(result, clusterlm.CompareResult)
    from_cli = json.loads((tmp_path / "a" / "compare.json").read_text(encoding="utf-8"))
    timing = {"selection_s", "train_s", "total_s", "train_wall_s", "selection_measured_s", "model_load_s", "timings",
              "selection_s_std", "train_s_std", "total_s_std", "selection_split_s"}

    def deterministic(summary: dict) -> dict:
        return {m: {k: v for k, v in row.items() if k not in timing and "ci95" not in k and "seeds_for" not in k}
                for m, row in summary.items()}

    assert deterministic(result.summary) == deterministic(from_cli["summary"])
    assert result.data["key"] == from_cli["key"] != ""  # the same settings key (outputs differ only by OUT)
    assert result.markdown().startswith("Comparison at ratio(s) 0.5") and result.to_json().startswith("{")
    assert clusterlm.CompareConfig.load(tmp_path / "b" / "compare_config.yaml") == clusterlm.CompareConfig.from_dict(
        settings(tmp_path / "b")).replace(n_validation=0)


def test_a_train_mapping_in_python_is_the_command_lines_training_settings():
    """``CompareConfig(train={"max_steps": 5})`` is ``clusterlm compare --max-steps 5`` (compare's training defaults
    underneath, so the same records are reused); a whole ``TrainConfig`` is taken as it is."""
    argv = ["--data", "train.jsonl", "--eval-data", "heldout.jsonl", "--methods", "random,cluster", "--seeds", "1",
            "--max-steps", "5", "--out", "cmp/"]
    from_cli = cli.compare_config(parse_config(cli.compare_parser(), argv))
    from_python = clusterlm.CompareConfig(data="train.jsonl", eval_data=["heldout.jsonl"],
                                          methods=["random", "cluster"], seeds=[0], out="cmp/",
                                          train={"max_steps": 5})
    assert from_python == from_cli
    assert from_python.train.warmup_ratio == 0.03 and from_python.train.threads == 1
    whole = from_python.replace(train=clusterlm.TrainConfig(max_steps=5))
    assert whole.train == clusterlm.TrainConfig(max_steps=5) != from_cli.train
