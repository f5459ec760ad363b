"""``clusterlm compare``: a real tiny comparison (random + cluster, real selection and training), then a
rerun that recomputes nothing, and a rerun after a lost record that recomputes exactly that unit."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from tiny_cases import run_compare as _compare

import clusterlm.cli.commands as cli
from clusterlm.cli.options import parse_config
from clusterlm.comparison import output as compare_output
from clusterlm.comparison import run as compare_run
from clusterlm.comparison import statistics as compare_stats
from clusterlm.config import comparison as compare_config
from clusterlm.config.comparison import CompareConfig


def _argv(tmp_path, data, heldout) -> list[str]:
    return ["--data", str(data), "--eval-data", str(heldout), "--model", "tiny-llama", "--methods", "random,cluster",
            "--seeds", "1", "--world-size", "1", "--max-steps", "2", "--micro-batch-size", "4", "--n-validation", "2",
            "--out", str(tmp_path / "cmp")]


def _with(config: CompareConfig, **over) -> CompareConfig:
    """``config`` with ``over`` applied: CompareConfig fields directly, training settings to its ``train``."""
    names = {f.name for f in dataclasses.fields(CompareConfig)}
    train = {k: v for k, v in over.items() if k not in names}
    return config.replace(**{k: v for k, v in over.items() if k in names}, train=config.train.replace(**train))


def _args(tmp_path, data, heldout, **over) -> CompareConfig:
    """The CompareConfig ``clusterlm compare`` builds from the small settings' options, with ``over`` applied."""
    config = cli.compare_config(parse_config(cli.compare_parser(), _argv(tmp_path, data, heldout)))
    return _with(config, **over)


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
    assert _compare(args) == 0
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
    # every unit's per-example held-out losses next to compare.json; the interval of cluster vs random in the summary
    units = json.loads((out / compare_run.EVAL_LOSSES).read_text())["units"]
    assert [len(u["tokens"]) for u in units] == [10, 10] and all(t > 0 for t in units[0]["tokens"])
    assert sum(units[1]["loss_sums"]) / sum(units[1]["tokens"]) == pytest.approx(result["records"][1]["eval_loss"])
    row = result["summary"]["cluster"]
    assert row["ci95_vs_random"][0] <= row["delta_vs_random"] <= row["ci95_vs_random"][1]
    assert row["interval_vs_random"] == "seeds x eval examples" and "delta_vs_full" not in row
    assert "verdict: cluster vs random: " in (out / "compare.md").read_text()
    state = (out / compare_run.STATE).read_text()
    assert len(state.splitlines()) == 2

    # a rerun with the same settings: nothing is selected or trained again
    calls: list[str] = []
    real_select, real_train = compare_run._select, compare_run.train
    monkeypatch.setattr(compare_run, "_select", lambda m, *a, **k: (calls.append(m), real_select(m, *a, **k))[1])
    monkeypatch.setattr(compare_run, "train", lambda *a, **k: (calls.append("train"), real_train(*a, **k))[1])
    assert _compare(args) == 0
    assert calls == [] and (out / compare_run.STATE).read_text() == state
    assert "2 done earlier" in capsys.readouterr().out

    # a unit whose record is lost (killed before it was written) is the only one redone
    (out / compare_run.STATE).write_text(state.splitlines(keepends=True)[0])
    assert _compare(args) == 0
    assert calls == ["cluster", "train"]
    assert len((out / compare_run.STATE).read_text().splitlines()) == 2

    # other settings do not reuse the records
    other = _args(tmp_path, train, heldout, methods=("random",), max_steps=1)
    calls.clear()
    assert _compare(other) == 0
    assert calls == ["random", "train"]


def _main(tmp_path, data, heldout, *extra: str) -> int:
    """``clusterlm compare`` with the small settings and ``extra``: its exit status (a parse error's too)."""
    try:
        return cli.main(["compare", *_argv(tmp_path, data, heldout), *extra])
    except SystemExit as e:
        return int(e.code)


def test_frontier_over_ratios_with_longest_and_a_variant_reuses_features(small_demo, tmp_path, monkeypatch):
    train, heldout = small_demo
    variant = "cluster[feature_tokens=8,within_cluster=kcenter]"
    args = _args(tmp_path, train, heldout, methods=("random", "longest", variant), ratios=(0.2, 0.31), max_steps=1,
                 n_validation=0)
    assert _compare(args) == 0
    out = tmp_path / "cmp"
    result = json.loads((out / "compare.json").read_text())
    assert [(p["ratio"], p["method"]) for p in result["frontier"]] == [(r, m) for r in (0.2, 0.31)
                                                                      for m in ("random", "longest", variant)]
    assert set(result["summary_by_ratio"]) == {"0.2", "0.31"} and result["summary"] == result["summary_by_ratio"]["0.2"]
    recs = {(r["ratio"], r["method"]): r for r in result["records"]}
    # longest trains the most answer tokens at the same example count
    assert recs[(0.31, "longest")]["n_selected"] == recs[(0.31, "random")]["n_selected"]
    assert recs[(0.31, "longest")]["tokens"] >= recs[(0.31, "random")]["tokens"]
    # the variant's settings reached the selection; its features were computed at 0.2 and reused at 0.31, and the
    # reusing unit is charged the features' computing time
    assert recs[(0.2, variant)]["plan_config"]["within_cluster"] == "kcenter"
    assert recs[(0.2, variant)]["plan_config"]["features"]["max_tokens"] == 8
    assert not recs[(0.2, variant)]["features_reused"] and recs[(0.31, variant)]["features_reused"]
    assert recs[(0.31, variant)]["selection_s"] >= recs[(0.31, variant)]["selection_measured_s"]
    first, again = recs[(0.2, variant)], recs[(0.31, variant)]
    assert again["timings"]["features"] == pytest.approx(first["timings"]["features"])
    assert again["timings"]["features_read"] < again["timings"]["features"]
    # selection cost in training units: the feature window's tokens read (8 per example at most), none for random
    from clusterlm.data import load_data
    from clusterlm.models import load_model

    lengths = load_data(str(train), load_model("tiny-llama")[1], max_length=None, progress=False).lengths
    assert first["selection_tokens"] == int(np.minimum(lengths, 8).sum())
    assert recs[(0.2, "random")]["selection_tokens"] == 0 and recs[(0.2, "longest")]["selection_tokens"] == 0
    row = result["summary"][variant]
    assert set(row["selection_split_s"]) >= {"features", "kmeans", "picks"} and row["model_load_s"] > 0
    md = (out / "compare.md").read_text()
    assert "### frontier" in md and f"verdict: {variant} vs random: " in md and "reused" in md
    assert "| tokens read by selection |" in md and "model load (once" in md
    assert (out / "compare.png").stat().st_size > 0
    assert (out / "runs" / f"{compare_config.parse_method(variant).slug}-r0.31-s0" / "plan").is_dir()
    # one of the ratios again: every unit is reused (records are kept per ratio)
    monkeypatch.setattr(compare_run, "_select", lambda *a, **k: pytest.fail("selected again"))
    again = compare_run.compare(_args(tmp_path, train, heldout, methods=("random", "longest", variant), ratios=(0.31,),
                                      max_steps=1, n_validation=0))
    assert [r["ratio"] for r in again.data["records"]] == [0.31] * 3


def test_compare_argument_errors(small_demo, tmp_path, capsys, monkeypatch):
    train, heldout = small_demo
    monkeypatch.setattr("clusterlm.comparison.run._select", lambda *a, **k: pytest.fail("selected"))
    assert _main(tmp_path, train, heldout, "--ratio", "1.5") == 2
    assert _main(tmp_path, train, heldout, "--n-validation", "10", "--methods", "random,less") == 2
    assert _main(tmp_path, train, heldout, "--n-validation", "10") == 2  # explicit: always held back
    # full data trains as many steps as its data: --max-steps would make "total vs full" meaningless
    assert _main(tmp_path, train, heldout, "--methods", "full,random") == 2
    # a ratio that leaves a cluster method less than one example per rank: before any selection, naming both
    capsys.readouterr()
    assert _main(tmp_path, train, heldout, "--world-size", "4", "--ratios", "0.05,0.5") == 2
    err = capsys.readouterr().err
    assert "cluster at ratio 0.05 of 40 examples" in err and len(err.strip().splitlines()) == 1
    for bad in ("random,nope", "cluster[nope=1]", "cluster[within_cluster=sideways]", "random[feature_tokens=8]",
                "cluster[ratio=0.2]", "cluster[feature_tokens]", "cluster,cluster", "cluster-paper[feature_tokens=32]"):
        assert _main(tmp_path, train, heldout, "--methods", bad) == 2, bad
        err = capsys.readouterr().err
        assert "--methods" in err and len(err.strip().splitlines()) == 1, (bad, err)
    for bad in ("0,0.2", "0.2,0.2", "1.5", "0.2,x", ""):
        assert _main(tmp_path, train, heldout, "--ratios", bad) == 2, bad
        assert "--ratios" in capsys.readouterr().err


def test_max_steps_with_full_is_refused_before_any_work(small_demo, tmp_path, capsys, monkeypatch):
    train, heldout = small_demo
    monkeypatch.setattr("clusterlm.comparison.run.load_model", lambda *a, **k: pytest.fail("loaded a model"))
    assert _main(tmp_path, train, heldout, "--methods", "full,cluster") == 2
    err = capsys.readouterr().err
    assert "--max-steps 2 with method 'full'" in err and len(err.strip().splitlines()) == 1
    # a variant's value that only this world size refuses: also before the model
    assert _main(tmp_path, train, heldout, "--methods", "cluster[clusters_per_rank=0]") == 2
    assert "clusters_per_rank" in capsys.readouterr().err


def test_method_variants_parse_into_select_settings():
    spec = compare_config.parse_method(" cluster[feature_tokens=32, within_cluster=kcenter; token_balance=false] ")
    assert spec.label == "cluster[feature_tokens=32, within_cluster=kcenter; token_balance=false]"
    assert spec.base == "cluster" and dict(spec.overrides) == {"feature_tokens": 32, "within_cluster": "kcenter",
                                                                "token_balance": False}
    assert spec.slug == "cluster_feature_tokens_32_within_cluster_kcenter_token_balance_false"
    spec = compare_config.parse_method("cluster[features=all-linear,max_cluster_size=none,token_balance_slack=0.2]")
    assert dict(spec.overrides) == {"features": "all-linear", "max_cluster_size": None, "token_balance_slack": 0.2}
    assert compare_config.parse_methods("random,cluster[feature_tokens=32,n_init=1],cluster-whole") == [
        "random", "cluster[feature_tokens=32,n_init=1]", "cluster-whole"]
    with pytest.raises(TypeError, match="unknown setting"):
        compare_config.parse_method("cluster[feature_tokenz=32]")
    with pytest.raises(ValueError, match="feature_tokens must be"):
        compare_config.parse_method("cluster[feature_tokens=1]")


def _record(method: str, seed: int, shift: float, n: int = 6) -> dict:
    tokens = [3 + i for i in range(n)]
    sums = [(2.0 + 0.1 * i + shift + 0.01 * seed) * t for i, t in enumerate(tokens)]
    return {"method": method, "seed": seed, "selection_s": 1.0, "train_s": 10.0, "total_s": 11.0, "tokens": 100,
            "fraction": 0.3, "eval_loss": sum(sums) / sum(tokens), "eval_examples": {"loss_sums": sums,
                                                                                      "tokens": tokens}}


def test_summary_intervals_and_verdicts_on_known_records():
    recs = [_record(m, s, shift) for m, shift in (("random", 0.0), ("cluster", 0.0), ("longest", 0.05))
            for s in (0, 1, 2)]
    summary = compare_stats.summarize(recs, ["random", "cluster", "longest"])
    assert summary["cluster"]["delta_vs_random"] == 0 and summary["cluster"]["ci95_vs_random"] == [0, 0]
    assert summary["longest"]["delta_vs_random"] == pytest.approx(0.05)
    assert summary["longest"]["ci95_vs_random"] == pytest.approx([0.05, 0.05])
    assert summary["cluster"]["paired_vs_random"]
    assert summary["cluster"]["interval_vs_random"] == "seeds x eval examples"
    lines = compare_stats.verdicts(summary)
    assert lines[0] == "verdict: random: the reference."
    assert lines[1].startswith("verdict: cluster vs random: +0.0000 [+0.0000, +0.0000], not distinguishable at 3 "
                               "seeds;")
    assert "longest vs random: +0.0500 [+0.0500, +0.0500], higher (worse) held-out loss than random; 1.00x" in lines[2]
    # records without per-example losses (an older compare) resample the seeds only; other seeds: unpaired
    old = [{k: v for k, v in r.items() if k != "eval_examples"} for r in recs]
    old = [dict(r, seed=r["seed"] + 10) if r["method"] == "cluster" else r for r in old]
    row = compare_stats.summarize(old, ["random", "cluster"])["cluster"]
    assert row["interval_vs_random"] == "seeds only" and not row["paired_vs_random"]


def test_frontier_has_a_point_per_ratio_and_method_with_full_once():
    recs = [dict(_record("full", 0, -0.1), ratio=1.0)]
    recs += [dict(_record(m, 0, shift), ratio=r) for r, shift in ((0.2, 0.1), (0.5, 0.0))
             for m in ("random", "cluster")]
    points = compare_stats.frontier(recs, ["full", "random", "cluster"], [0.2, 0.5])
    assert [(p["ratio"], p["method"]) for p in points] == [(1.0, "full"), (0.2, "random"), (0.2, "cluster"),
                                                          (0.5, "random"), (0.5, "cluster")]
    for p, r in zip(points, recs, strict=True):
        assert p["eval_loss"] == pytest.approx(r["eval_loss"]) and p["ci95"][0] <= p["eval_loss"] <= p["ci95"][1]
        assert p["total_s"] == 11.0


def test_table_prints_no_spread_for_one_seed():
    rec = {"method": "random", "seed": 0, "selection_s": 0.5, "train_s": 10.0, "total_s": 10.5, "eval_loss": 1.25,
           "tokens": 100, "fraction": 0.31}
    one = {"settings": {"ratio": 0.31, "world_size": 2, "model": "m"}, "seeds": [0],
           "summary": compare_stats.summarize([rec], ["random"])}
    assert "±" not in compare_output.markdown_table(one) and "| 1.2500 |" in compare_output.markdown_table(one)
    two = dict(one, seeds=[0, 1], summary=compare_stats.summarize([rec, dict(rec, seed=1, eval_loss=1.35)], ["random"]))
    assert "1.3000 ± 0.0707" in compare_output.markdown_table(two)


def test_cluster_tokens_method_selects_by_token_budget(small_demo, tmp_path):
    from clusterlm.data import load_data
    from clusterlm.models import load_model

    train, heldout = small_demo
    args = _args(tmp_path, train, heldout, world_size=2)
    model, tokenizer, model_id = load_model("tiny-llama")
    data = load_data(str(train), tokenizer, max_length=None, progress=False)
    plan = compare_run._select("cluster-tokens", model, data, [], args, args.ratio, 0, model_id)
    assert plan.config["token_ratio"] == pytest.approx(0.31) and plan.config["ratio"] is None
    stats = plan.stats["token_budget"]
    assert stats["requested_tokens"] == round(0.31 * int(data.lengths.sum()))
    assert abs(stats["selected_tokens"] - stats["requested_tokens"]) <= 2 * int(data.lengths.max())


def test_pretrain_builder_trains_and_saves_a_loadable_base_model(demo, tmp_path):
    import numpy as np
    from transformers import AutoModelForCausalLM

    from clusterlm.models import BUILTIN_MODELS
    from clusterlm.models.pretrain import build_tiny_llama_pretrained, token_blocks

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
