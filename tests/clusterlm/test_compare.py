"""``clusterlm compare``: a real tiny comparison (random + cluster, real selection and training), then a
rerun that recomputes nothing, and a rerun after a lost record that recomputes exactly that unit."""

from __future__ import annotations

import argparse
import json
import math

import pytest

import clusterlm.cli as cli
import clusterlm.compare as compare


def _args(tmp_path, data, heldout, **over) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_compare_args(parser)
    argv = ["--data", str(data), "--eval-data", str(heldout), "--model", "tiny-llama", "--methods", "random,cluster",
            "--seeds", "1", "--world-size", "1", "--max-steps", "2", "--micro-batch-size", "4", "--n-validation", "2",
            "--out", str(tmp_path / "cmp"), "--no-progress"]
    args = parser.parse_args(argv)
    for k, v in over.items():
        setattr(args, k, v)
    return args


@pytest.fixture()
def small_demo(demo, tmp_path):
    train = tmp_path / "train.jsonl"
    heldout = tmp_path / "heldout.jsonl"
    train.write_text("".join(demo.train.read_text(encoding="utf-8").splitlines(keepends=True)[:40]), encoding="utf-8")
    heldout.write_text("".join(demo.heldout.read_text(encoding="utf-8").splitlines(keepends=True)[:10]),
                       encoding="utf-8")
    return train, heldout


def test_compare_runs_real_methods_and_resumes_without_recomputing(small_demo, tmp_path, monkeypatch, capsys):
    train, heldout = small_demo
    args = _args(tmp_path, train, heldout, n_validation=None)  # the default: no LESS, no validation tail
    assert cli.cmd_compare(args) == 0
    out = tmp_path / "cmp"
    result = json.loads((out / "compare.json").read_text())
    assert [r["method"] for r in result["records"]] == ["random", "cluster"]
    for r in result["records"]:
        assert r["n_selected"] == round(0.31 * 40) and r["steps"] == 2 and r["train_s"] > 0
        # LESS does not run: no validation examples are taken from the held-out set
        assert r["n_validation"] == 0 and r["n_eval"] == 10
        assert math.isfinite(r["eval_loss"]) and r["eval_loss"] < r["initial_eval_loss"]
        assert r["total_s"] == pytest.approx(r["selection_s"] + r["train_s"])
    assert result["records"][1]["timings"]["features"] > 0  # the cluster selection really featurized
    assert "cluster_total_over_random_total" in result["goals"]
    assert (out / "compare.png").stat().st_size > 0 and "| cluster |" in (out / "compare.md").read_text()
    state = (out / compare.STATE).read_text()
    assert len(state.splitlines()) == 2

    # a rerun with the same settings: nothing is selected or trained again
    calls: list[str] = []
    real_select, real_launch = compare._select, compare.launch
    monkeypatch.setattr(compare, "_select", lambda m, *a, **k: (calls.append(m), real_select(m, *a, **k))[1])
    monkeypatch.setattr(compare, "launch", lambda *a, **k: (calls.append("train"), real_launch(*a, **k))[1])
    assert cli.cmd_compare(args) == 0
    assert calls == [] and (out / compare.STATE).read_text() == state
    assert "2 done earlier" in capsys.readouterr().out

    # a unit whose record is lost (killed before it was written) is the only one redone
    (out / compare.STATE).write_text(state.splitlines(keepends=True)[0])
    assert cli.cmd_compare(args) == 0
    assert calls == ["cluster", "train"]
    assert len((out / compare.STATE).read_text().splitlines()) == 2

    # other settings do not reuse the records
    other = _args(tmp_path, train, heldout, methods=["random"], max_steps=1)
    calls.clear()
    assert cli.cmd_compare(other) == 0
    assert calls == ["random", "train"]


def test_compare_argument_errors(small_demo, tmp_path):
    train, heldout = small_demo
    assert cli.cmd_compare(_args(tmp_path, train, heldout, ratio=1.5)) == 2
    assert cli.cmd_compare(_args(tmp_path, train, heldout, n_validation=10, methods=["random", "less"])) == 2
    assert cli.cmd_compare(_args(tmp_path, train, heldout, n_validation=10)) == 2  # explicit: always held back
    # full data trains as many steps as its data: --max-steps would make "total vs full" meaningless
    assert cli.cmd_compare(_args(tmp_path, train, heldout, methods=["full", "random"])) == 2
    with pytest.raises(SystemExit):
        parser = argparse.ArgumentParser()
        cli.add_compare_args(parser)
        parser.parse_args(["--methods", "random,nope"])


def test_max_steps_with_full_is_refused_before_any_work(small_demo, tmp_path, capsys, monkeypatch):
    train, heldout = small_demo
    monkeypatch.setattr("clusterlm.compare.load_model", lambda *a, **k: pytest.fail("loaded a model"))
    assert cli.cmd_compare(_args(tmp_path, train, heldout, methods=["full", "cluster"])) == 2
    err = capsys.readouterr().err
    assert "--max-steps 2 with method 'full'" in err and len(err.strip().splitlines()) == 1


def test_table_prints_no_spread_for_one_seed():
    rec = {"method": "random", "seed": 0, "selection_s": 0.5, "train_s": 10.0, "total_s": 10.5, "eval_loss": 1.25,
           "tokens": 100, "fraction": 0.31}
    one = {"settings": {"ratio": 0.31, "world_size": 2, "model": "m"}, "seeds": [0],
           "summary": compare.summarize([rec], ["random"])}
    assert "±" not in compare.markdown_table(one) and "| 1.2500 |" in compare.markdown_table(one)
    two = dict(one, seeds=[0, 1], summary=compare.summarize([rec, dict(rec, seed=1, eval_loss=1.35)], ["random"]))
    assert "1.3000 ± 0.0707" in compare.markdown_table(two)


def test_cluster_tokens_method_selects_by_token_budget(small_demo, tmp_path):
    from clusterlm.data import load_data
    from clusterlm.models import load_model

    train, heldout = small_demo
    args = _args(tmp_path, train, heldout, world_size=2)
    model, tokenizer, model_id = load_model("tiny-llama")
    data = load_data(str(train), tokenizer, max_length=None, progress=False)
    plan = compare._select("cluster-tokens", model, data, [], args, 0, model_id)
    assert plan.config["token_ratio"] == pytest.approx(0.31) and plan.config["ratio"] is None
    stats = plan.stats["token_budget"]
    assert stats["requested_tokens"] == round(0.31 * int(data.lengths.sum()))
    assert abs(stats["selected_tokens"] - stats["requested_tokens"]) <= 2 * int(data.lengths.max())


def test_pretrain_builder_trains_and_saves_a_loadable_base_model(demo, tmp_path):
    import numpy as np
    from transformers import AutoModelForCausalLM

    from clusterlm.models import BUILTIN_MODELS
    from clusterlm.pretrain import build_tiny_llama_pretrained, token_blocks

    blocks = token_blocks(list(range(10, 30)), 5, bos_id=1)
    assert blocks.shape == (5, 5) and (blocks[:, 0] == 1).all() and blocks[1, 1:].tolist() == [14, 15, 16, 17]
    with pytest.raises(ValueError, match="fewer than one block"):
        token_blocks([1, 2], 8, bos_id=1)
    assert "tiny-llama-pretrained" in BUILTIN_MODELS
    info = build_tiny_llama_pretrained(tmp_path, demo, steps=3, block_size=64, batch_size=4, warmup_steps=0,
                                       eval_fraction=0.002)
    assert info["eval_loss_after"] < info["eval_loss_before"] and info["eval_blocks"] >= 1
    assert json.loads((tmp_path / "pretrain.json").read_text())["settings"]["steps"] == 3
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True)
    assert model.config.hidden_size == 128 and np.isfinite(info["train_loss_last"])
    with pytest.raises(ValueError, match="unknown settings"):
        build_tiny_llama_pretrained(tmp_path, demo, epochs=1)
