"""Every option defined once: the command lines of select, train and compare are generated from the config
dataclasses, config files hold the same names, and the resolved config loads back as the same object (issue 35).

No model or data is loaded here: parsing, config files and their checks only.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from clusterlm.cli import commands as cli
from clusterlm.cli.options import option_fields, parse_config
from clusterlm.config.comparison import TRAIN_PER_UNIT, CompareConfig, compare_train_defaults
from clusterlm.config.demo import DemoConfig
from clusterlm.config.export import ExportConfig, ExportJob
from clusterlm.config.files import checksum, field_help
from clusterlm.config.selection import SelectConfig
from clusterlm.config.tasks import TaskConfig
from clusterlm.config.training import TrainConfig
from clusterlm.launch.launcher import CONFIG_SHA_ENV, check_config_file
from clusterlm.selection.pipeline import SelectJob

PARSERS = {"select": (cli.select_parser, [SelectJob, SelectConfig], ()),
           "train": (cli.train_parser, [TrainConfig, TaskConfig], ()),
           "compare": (cli.compare_parser, [CompareConfig, TrainConfig, TaskConfig], TRAIN_PER_UNIT),
           "export": (cli.export_parser, [ExportJob, ExportConfig], ()),
           "demo": (cli.demo_parser, [DemoConfig], ())}


def _dests(parser) -> dict[str, list[str]]:
    """dest -> option strings, over every option but --help and --config."""
    out: dict[str, list[str]] = {}
    for action in parser._actions:
        if action.dest in ("help", "config"):
            continue
        out.setdefault(action.dest, []).extend(action.option_strings)
    return out


@pytest.mark.parametrize("command", list(PARSERS))
def test_every_field_has_one_option_and_every_option_one_field(command):
    build, classes, train_excluded = PARSERS[command]
    dests = _dests(build())
    fields = []
    for cls in classes:
        exclude = train_excluded if cls is TrainConfig and command == "compare" else ()
        fields += [f.name for f in option_fields(cls, exclude)]
    assert len(fields) == len(set(fields)), f"{command}: a field name appears in two configs"
    assert sorted(dests) == sorted(fields), f"{command}: options {sorted(set(dests) ^ set(fields))} have no twin"
    for name, strings in dests.items():
        dashed = f"--{name.replace('_', '-')}"
        assert dashed in strings or f"--no-{name.replace('_', '-')}" in strings, (name, strings)


@pytest.mark.parametrize("cls", [SelectJob, SelectConfig, TrainConfig, CompareConfig, TaskConfig, ExportJob,
                                 ExportConfig, DemoConfig])
def test_every_option_has_help_from_the_docstring(cls):
    helps = field_help(cls)
    missing = [f.name for f in option_fields(cls) if not helps.get(f.name)]
    assert not missing, f"{cls.__name__}: no Attributes entry for {missing}"


def test_old_spellings_still_parse():
    values = cli.train_parser().parse_into(
        ["--plan", "p", "--model", "m", "--data", "d", "--out", "o", "--model-dtype", "float32", "--no-progress",
         "--no-epoch-shuffle", "--no-initial-eval", "--no-save-model", "--resume", "--overwrite", "--fsdp"])[0]
    config = cli.train_config(values)
    assert (config.dtype, config.progress, config.epoch_shuffle, config.initial_eval, config.save_model) == (
        "float32", False, False, False, False)
    assert (config.resume, config.overwrite, config.fsdp) == ("latest", True, True)
    job = cli.select_job(cli.select_parser().parse_into(
        ["--model", "m", "--data", "d", "--out", "o", "--world-size", "2", "--ratio", "0.31",
         "--max-cluster-size", "100", "--dim", "32x32", "--token-balance", "off", "--no-progress"])[0])
    assert job.config.max_cluster_size == 100 and job.config.dim == (32, 32) and job.config.token_balance is False
    assert job.progress is False and job.config.ratio == 0.31
    cmp = cli.compare_config(cli.compare_parser().parse_into(
        ["--methods", "random,cluster[feature_tokens=32]", "--seeds", "3", "--lr", "1e-3", "--eval-data", "a=x.jsonl",
         "--eval-data", "b=y.jsonl", "--no-progress", "--max-steps", "2"])[0])
    assert cmp.methods == ("random", "cluster[feature_tokens=32]") and cmp.seeds == (0, 1, 2)
    assert cmp.eval_data == ("a=x.jsonl", "b=y.jsonl")
    assert (cmp.train.lr, cmp.train.max_steps, cmp.train.warmup_ratio, cmp.train.threads) == (1e-3, 2, 0.03, 1)


def test_a_bad_value_is_one_line_naming_the_option(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["select", "--ratio", "31", "--model", "m", "--data", "d", "--out", "o", "--world-size", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --ratio" in err[0] and "0.31" in err[0], err


def test_missing_required_settings_are_named(capsys, tmp_path):
    assert cli.main(["train", "--model", "tiny-llama"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("clusterlm train: error: train: --plan, --data, --out are required"), err


def test_config_file_with_an_override(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("plan: p\nmodel: tiny-llama\ndata: d.jsonl\nout: o\nlr: 1.0e-4\nmax_steps: 7\n"
                    "report_to: [tensorboard]\n", encoding="utf-8")
    values = cli.train_parser().parse_into(["--config", str(path), "--lr", "2e-4"])[0]
    config = cli.train_config(values)
    assert (config.lr, config.max_steps, config.report_to, config.plan) == (2e-4, 7, ("tensorboard",), "p")
    saved = tmp_path / "out.yaml"
    config.save(saved)
    assert TrainConfig.load(saved) == config
    # a JSON file works the same way
    js = tmp_path / "run.json"
    js.write_text(json.dumps({"plan": "p", "model": "m", "data": "d", "out": "o", "seed": 3}), encoding="utf-8")
    assert cli.train_config(cli.train_parser().parse_into(["--config", str(js)])[0]).seed == 3


def test_unknown_key_names_the_closest_field(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("plan: p\nmodel: m\ndata: d\nout: o\nlearning_rate: 1.0e-4\nmicro_batchsize: 2\n", encoding="utf-8")
    assert cli.main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'learning_rate'" in err[0] and str(path) in err[0], err
    path.write_text("plan: p\nmicro_batchsize: 2\n", encoding="utf-8")
    assert cli.main(["train", "--config", str(path)]) == 2
    assert "did you mean 'micro_batch_size'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="did you mean 'max_steps'"):
        TrainConfig.from_dict({"max_step": 3})


def test_bad_config_files_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("plan: [unclosed\n", encoding="utf-8")
    assert cli.main(["train", "--config", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n", encoding="utf-8")
    assert cli.main(["train", "--config", str(lst)]) == 2
    assert "expected a mapping" in capsys.readouterr().err
    assert cli.main(["train", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    txt = tmp_path / "run.txt"
    txt.write_text("plan: p\n", encoding="utf-8")
    assert cli.main(["train", "--config", str(txt)]) == 2
    assert ".yaml, .yml or .json" in capsys.readouterr().err


def test_compare_config_file_nested_or_flat_and_round_trip(tmp_path):
    nested = tmp_path / "cmp.yaml"
    nested.write_text("methods: [random, longest]\nseeds: [0, 5]\nbudget: tokens\ntrain:\n  lr: 0.001\n"
                      "  max_steps: 3\n", encoding="utf-8")
    flat = tmp_path / "flat.yaml"
    flat.write_text("methods: random,longest\nseeds: [0, 5]\nbudget: tokens\nlr: 0.001\nmax_steps: 3\n",
                    encoding="utf-8")
    a = cli.compare_config(cli.compare_parser().parse_into(["--config", str(nested)])[0])
    b = cli.compare_config(cli.compare_parser().parse_into(["--config", str(flat)])[0])
    assert a == b and a.train.lr == 1e-3 and a.train.warmup_ratio == 0.03 and a.seeds == (0, 5)
    assert CompareConfig.load(nested) == a  # the Python loader reads the nested form
    a.save(tmp_path / "resolved.yaml")
    assert CompareConfig.load(tmp_path / "resolved.yaml") == a
    # the trainer settings compare sets per unit are not options (model, data, ... are CompareConfig's own)
    own = {f.name for f in dataclasses.fields(CompareConfig)}
    assert not (set(TRAIN_PER_UNIT) - own) & set(_dests(cli.compare_parser()))


def test_select_job_round_trip(tmp_path):
    job = SelectJob(model="tiny-llama", data="d.jsonl", out=str(tmp_path),
                    config=SelectConfig(world_size=2, token_ratio=0.3, dim=(16, 8), features=["lm_head"]))
    job.save(tmp_path / "select_config.yaml")
    assert SelectJob.load(tmp_path / "select_config.yaml") == dataclasses.replace(
        job, config=dataclasses.replace(job.config, features=["lm_head"]))
    values = cli.select_parser().parse_into(["--config", str(tmp_path / "select_config.yaml"), "--seed", "4"])[0]
    assert cli.select_job(values).config.seed == 4 and cli.select_job(values).config.dim == (16, 8)


def test_rank_config_checksum(tmp_path, monkeypatch):
    path = tmp_path / "train_config.yaml"
    sha = TrainConfig(plan="p", model="m", data="d", out="o").save(path)
    assert sha == checksum(path.read_text(encoding="utf-8"))
    monkeypatch.setenv(CONFIG_SHA_ENV, sha)
    check_config_file(path)
    path.write_text(path.read_text(encoding="utf-8") + "lr: 1.0\n", encoding="utf-8")
    with pytest.raises(ValueError, match="changed after the launcher wrote it"):
        check_config_file(path)


def test_check_refuses_bad_values():
    base = TrainConfig(plan="p", model="m", data="d", out="o")
    with pytest.raises(ValueError, match="--lr 0.0 is out of range"):
        base.replace(lr=0.0).check()
    with pytest.raises(ValueError, match="--report-to"):
        base.replace(report_to=("tensorbord",)).check()
    with pytest.raises(TypeError, match="micro_batch_size must be an int"):
        base.replace(micro_batch_size="4").check()
    with pytest.raises(ValueError, match="--budget must be one of"):
        CompareConfig(budget="flops").check()
    assert compare_train_defaults().progress is False


# ---------------------------------------------------------------------------------------------------------------------
# Three bad inputs a probe found accepted (issue 51): a key written twice, an empty list item, a dict for a config


@pytest.mark.parametrize("suffix, text, line", [
    (".yaml", "model: tiny-llama\nlr: 1e-4\nmodel: other\n", "(line 3)"),
    (".yaml", "train:\n  lr: 1e-4\n  lr: 2e-4\n", "(line 3)"),
    (".json", '{"model": "a", "model": "b"}', ""),
])
def test_a_key_written_twice_in_a_config_file_is_refused(tmp_path, capsys, suffix, text, line):
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    key = "lr" if "train:" in text else "model"
    with pytest.raises(ValueError, match=f"the key '{key}' is written twice"):
        TrainConfig.load(path) if "train:" not in text else CompareConfig.load(path)
    command = "compare" if "train:" in text else "train"
    assert cli.main([command, "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--config {path}: the key '{key}' is written twice" in err and line in err


@pytest.mark.parametrize("argv", [["--seeds", "0,,1"], ["--seeds", ",1"], ["--ratios", "0.1,,0.2"],
                                  ["--methods", "random,,cluster"], ["--report-to", "tensorboard,"]])
def test_an_empty_item_in_a_list_option_is_refused_naming_it(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        parse_config(cli.compare_parser(), argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[0]}" in err and "empty item" in err, err
    assert parse_config(cli.compare_parser(), ["--seeds", "5,"])["seeds"] == [5]  # one seed: a trailing comma


def test_train_and_compare_take_their_config_or_a_mapping_and_refuse_the_rest(tmp_path):
    import clusterlm

    for call, expected in ((clusterlm.train, "TrainConfig"), (clusterlm.compare, "CompareConfig")):
        for bad in (["plan"], 3, "run.yaml", None):
            with pytest.raises(TypeError, match=f"config must be a clusterlm.{expected}"):
                call(bad)
    with pytest.raises(ValueError, match="unknown setting 'bogus' for TrainConfig"):
        clusterlm.train({"plan": "p", "model": "m", "data": "d", "out": str(tmp_path), "bogus": 1})
    with pytest.raises(ValueError, match="--data, --out are required|--plan"):  # the mapping is checked as a config
        clusterlm.train({"model": "tiny-llama"})


def test_compare_reads_back_the_config_file_it_writes(tmp_path):
    """OUT/compare_config.yaml is what a preempted compare says to resume with (``--config``): it parses back to
    the same config, its training section without the settings compare gives each unit, its task section nested."""
    config = cli.compare_config(parse_config(cli.compare_parser(), [
        "--seeds", "2", "--lr", "1e-3", "--eval-task", "mini=p.jsonl", "--allow-code-execution",
        "--decide-by", "mini/pass@1", "--task-limit", "5"]))
    path = tmp_path / "compare_config.yaml"
    config.save(path)
    assert cli.compare_config(parse_config(cli.compare_parser(), ["--config", str(path)])) == config
    assert CompareConfig.load(path) == config
    assert "plan" not in CompareConfig.load(path).to_dict()["train"]
