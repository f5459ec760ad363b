"""``clusterlm compare`` with several evaluation sets: ``--eval-data name=path`` parsing, the overlap check against the
training data (and LESS's validation examples), every set reported per method, and records keyed by the sets."""

from __future__ import annotations

import json

import pytest
from tiny_cases import run_compare as _compare

import clusterlm.cli.commands as cli
from clusterlm.cli.options import parse_config
from clusterlm.comparison import output as compare_output
from clusterlm.comparison import run as compare_run
from clusterlm.comparison import statistics as compare_stats
from clusterlm.comparison.evaluation import EvalSet, check_overlap, eval_sets_of, parse_eval_set, read_eval_sets
from clusterlm.config.comparison import CompareConfig
from clusterlm.data import read_data


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def _pr(i: int, extra: str = "") -> dict:
    return {"prompt": f"Write function number {i}{extra}", "response": f"def f{i}():\n    return {i}\n"}


# ---------------------------------------------------------------------------------------------------------------------
# parsing


def test_eval_data_values_parse_into_named_sets(tmp_path):
    assert parse_eval_set("code=data/heldout.jsonl") == EvalSet("code", "data/heldout.jsonl", named=True)
    assert parse_eval_set(" math_2-b = x.parquet ") == EvalSet("math_2-b", "x.parquet")
    # a bare path is named after its file stem (characters outside letters, digits, _ and - become _)
    assert parse_eval_set("runs/heldout_48_max256.jsonl") == EvalSet("heldout_48_max256",
                                                                     "runs/heldout_48_max256.jsonl", named=False)
    assert parse_eval_set("held out.v2.jsonl").name == "held_out_v2"
    assert parse_eval_set("9lives.jsonl").name == "_9lives"
    # an '=' inside a directory name is part of the path, not a name
    assert parse_eval_set("runs/lr=2e-5/heldout.jsonl") == EvalSet("heldout", "runs/lr=2e-5/heldout.jsonl", False)
    odd = tmp_path / "a=b.jsonl"  # an existing file whose name holds '='
    odd.write_text("{}\n")
    assert parse_eval_set(str(odd)).path == str(odd) and not parse_eval_set(str(odd)).named
    for bad in ("my set=x.jsonl", "a.b=x.jsonl", "1st=x.jsonl", "=x.jsonl", "code=", ""):
        with pytest.raises(ValueError, match="--eval-data"):
            parse_eval_set(bad)


def test_duplicate_names_and_missing_files_are_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    one, two = _jsonl(a / "heldout.jsonl", [_pr(1)]), _jsonl(b / "heldout.jsonl", [_pr(2)])
    with pytest.raises(ValueError, match="'heldout' more than once"):
        eval_sets_of([one, two], None)  # two bare paths with the same stem
    with pytest.raises(ValueError, match="'x' more than once"):
        eval_sets_of([f"x={one}", f"x={two}"], None)
    assert [s.name for s in eval_sets_of([one, f"other={two}"], None)] == ["heldout", "other"]
    assert eval_sets_of(None, one) == [EvalSet("heldout", one, named=False)]  # the default set
    assert eval_sets_of(f"code={one}", None) == [EvalSet("code", one)]  # a plain string (Python callers)
    with pytest.raises(FileNotFoundError, match="--eval-data gone: no such file"):
        eval_sets_of([one, f"gone={tmp_path / 'gone.jsonl'}"], None)


def _main(argv: list[str]) -> int:
    try:
        return cli.main(["compare", *argv])
    except SystemExit as e:
        return int(e.code)


def test_bad_eval_data_is_one_line_before_any_model_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(compare_run, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    train = _jsonl(tmp_path / "train.jsonl", [_pr(i) for i in range(8)])
    held = _jsonl(tmp_path / "held.jsonl", [_pr(i) for i in range(100, 104)])
    leak = _jsonl(tmp_path / "leak.jsonl", [_pr(100 + i) for i in range(3)] + [_pr(5), _pr(6)])
    base = ["--data", train, "--methods", "random", "--seeds", "1", "--out", str(tmp_path / "cmp"), "--max-steps", "1"]
    cases = [(["--eval-data", "bad name=x.jsonl"], "not a simple name"),
             (["--eval-data", f"a={held}", "--eval-data", f"a={leak}"], "'a' more than once"),
             (["--eval-data", f"a={tmp_path / 'nope.jsonl'}"], "no such file"),
             (["--eval-data", held, "--eval-data", f"leak={leak}"], "shares 2 of its 5 examples with the training")]
    for extra, message in cases:
        assert _main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (extra, err)
    with pytest.raises(ValueError, match=r"examples 3, 4 \(0-based"):
        read_eval_sets([EvalSet("leak", leak)], train)


# ---------------------------------------------------------------------------------------------------------------------
# the overlap check


def test_overlap_catches_exact_and_whitespace_copies_in_any_format(tmp_path):
    train = read_data([_pr(i) for i in range(6)])
    exact = read_data([_pr(50), _pr(3), _pr(51)])
    with pytest.raises(ValueError, match=r"'exact' \(e\.jsonl\) shares 1 of its 3 examples .*: example 1 \(0-based"):
        check_overlap(train, [(EvalSet("exact", "e.jsonl"), exact)])
    # only whitespace differs (runs of spaces, tabs, newlines, leading / trailing): still the same example
    spaced = dict(prompt="  Write function   number 4\n", response="def f4():\n\treturn 4   \n\n")
    with pytest.raises(ValueError, match="shares 1 of its 2 examples"):
        check_overlap(train, [(EvalSet("spaced", "s"), read_data([_pr(60), spaced]))])
    # the same example in another record format (Alpaca, chat) is the same conversation
    alpaca = read_data([{"instruction": "Write function number 2", "input": "", "output": "def f2():\n return 2"}])
    chat = read_data([{"messages": [{"role": "user", "content": "Write function number 1"},
                                    {"role": "assistant", "content": "def f1():\n    return 1\n"}]}])
    for name, raw in (("alpaca", alpaca), ("chat", chat)):
        with pytest.raises(ValueError, match=f"'{name}'.*shares 1 of its 1 examples"):
            check_overlap(train, [(EvalSet(name, "x"), raw)])
    # no overlap: a different word, or a different answer, is another example
    other = read_data([_pr(1, " quickly"), dict(_pr(2), response="def f2():\n    return 3\n")])
    check_overlap(train, [(EvalSet("clean", "c"), other), (EvalSet("exact0", "e"), read_data([_pr(70)]))])


def test_validation_examples_must_not_be_evaluated(tmp_path):
    train = read_data([_pr(i) for i in range(4)])
    primary = read_data([_pr(i) for i in range(10, 16)])
    second = (EvalSet("second", "s"), read_data([_pr(20), _pr(15)]))  # _pr(15): the primary's last example
    sets = [(EvalSet("primary", "p"), primary), second]
    check_overlap(train, sets, n_validation=0)  # no validation examples: nothing to leak
    check_overlap(train, sets[:1], n_validation=2)
    with pytest.raises(ValueError, match=r"1 evaluated example\(s\) of set 'second' .*LESS's 2 validation"):
        check_overlap(train, sets, n_validation=2)
    check_overlap(train, sets, n_validation=2, eval_max_examples=1)  # the copy is not among the evaluated ones


# ---------------------------------------------------------------------------------------------------------------------
# the summary per set (known answers) and a real run with two sets


def _record(method: str, seed: int, shift: float, more_shift: float, n: int = 5) -> dict:
    def examples(s: float) -> dict:
        tokens = [2 + i for i in range(n)]
        return {"loss_sums": [(1.5 + 0.1 * i + s + 0.01 * seed) * t for i, t in enumerate(tokens)], "tokens": tokens}

    main, more = examples(shift), examples(more_shift)
    return {"method": method, "seed": seed, "selection_s": 1.0, "train_s": 5.0, "total_s": 6.0, "tokens": 10,
            "fraction": 0.3, "n_eval": n, "initial_eval_loss": 3.0, "eval_examples": main,
            "eval_loss": sum(main["loss_sums"]) / sum(main["tokens"]),
            "eval_sets": {"more": {"eval_loss": sum(more["loss_sums"]) / sum(more["tokens"]), "n_eval": n,
                                   "initial_eval_loss": 4.0, "eval_examples": more}}}


def test_every_set_gets_its_loss_interval_and_differences():
    recs = [_record("random", s, 0.0, 0.0) for s in (0, 1)] + [_record("cluster", s, 0.0, 0.2) for s in (0, 1)]
    summary = compare_stats.summarize(recs, ["random", "cluster"], ["code", "more"])
    row = summary["cluster"]
    code, more = row["eval_sets"]["code"], row["eval_sets"]["more"]
    assert code["loss"] == pytest.approx(row["eval_loss"]) and code["delta_vs_random"] == row["delta_vs_random"] == 0
    assert code["ci95_vs_random"] == [0, 0] and code["initial_loss"] == 3.0 and more["initial_loss"] == 4.0
    assert more["delta_vs_random"] == pytest.approx(0.2) and more["ci95_vs_random"] == pytest.approx([0.2, 0.2])
    assert more["ci95"][0] <= more["loss"] <= more["ci95"][1] and more["n_eval"] == 5
    assert "delta_vs_full" not in more and more["paired_vs_random"]
    meta = [{"name": "code", "primary": True, "evaluated": 5}, {"name": "more", "primary": False, "evaluated": 5}]
    md = compare_output.markdown_table({"settings": {"ratio": 0.3, "world_size": 1, "model": "m"}, "seeds": [0, 1],
                                 "summary": summary, "eval_sets": meta})
    assert "#### evaluation set code (primary): 5 examples evaluated; before training 3.0000" in md
    assert "| cluster | " in md and "| +0.2000 [+0.2000, +0.2000] | - |" in md
    # one set: compare.md as before (no per-set tables)
    assert "#### evaluation set" not in compare_output.markdown_table(
        {"settings": {"ratio": 0.3, "world_size": 1, "model": "m"}, "seeds": [0, 1], "summary": summary,
         "eval_sets": meta[:1]})


@pytest.fixture()
def sets(demo, tmp_path):
    lines = demo.heldout.read_text(encoding="utf-8").splitlines(keepends=True)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(demo.train.read_text(encoding="utf-8").splitlines(keepends=True)[:24]), encoding="utf-8")
    code, more = tmp_path / "code.jsonl", tmp_path / "more.jsonl"
    code.write_text("".join(lines[:8]), encoding="utf-8")
    more.write_text("".join(lines[8:13]), encoding="utf-8")
    return train, code, more


def _args(tmp_path, train, eval_data: list[str], methods: str) -> CompareConfig:
    """The CompareConfig of ``clusterlm compare``'s options."""
    argv = ["--data", str(train), "--model", "tiny-llama", "--methods", methods, "--seeds", "1", "--world-size", "1",
            "--max-steps", "1", "--micro-batch-size", "4", "--out", str(tmp_path / "cmp")]
    return cli.compare_config(parse_config(cli.compare_parser(), argv + [x for v in eval_data for x in ("--eval-data",
                                                                                                       v)]))


def test_two_sets_are_reported_per_method_and_keyed(sets, tmp_path, monkeypatch):
    train, code, more = sets
    out = tmp_path / "cmp"
    # one bare set: today's compare (the trainer reads the file itself)
    assert _compare(_args(tmp_path, train, [str(code)], "random")) == 0
    alone = json.loads((out / "compare.json").read_text())
    assert [m["name"] for m in alone["eval_sets"]] == ["code"] and "eval_sets" not in alone["settings"]
    assert "eval_sets" not in alone["records"][0] and "#### evaluation set" not in (out / "compare.md").read_text()
    calls: list[str] = []
    real_select = compare_run._select
    monkeypatch.setattr(compare_run, "_select", lambda m, *a, **k: (calls.append(m), real_select(m, *a, **k))[1])
    # one set keys by its path as before: naming it reuses the record
    compare_run.compare(_args(tmp_path, train, [f"code={code}"], "random"))
    assert calls == []

    # two sets: other records (random again), both sets evaluated in every run and reported per method
    assert _compare(_args(tmp_path, train, [f"code={code}", f"more={more}"], "random,longest")) == 0
    assert calls == ["random", "longest"]
    result = json.loads((out / "compare.json").read_text())
    assert [(m["name"], m["primary"], m["evaluated"]) for m in result["eval_sets"]] == [("code", True, 8),
                                                                                        ("more", False, 5)]
    assert [n for n, _ in result["settings"]["eval_sets"]] == ["code", "more"] and result["key"] != alone["key"]
    for m in ("random", "longest"):
        row = result["summary"][m]
        assert set(row["eval_sets"]) == {"code", "more"} and row["eval_sets"]["code"]["loss"] == row["eval_loss"]
        for v in row["eval_sets"].values():
            assert v["ci95"][0] <= v["loss"] <= v["ci95"][1] and v["initial_loss"] > 0
            assert v["ci95_vs_random"][0] <= v["delta_vs_random"] <= v["ci95_vs_random"][1]
    rec = result["records"][0]
    assert rec["n_eval"] == 8 and rec["eval_sets"]["more"]["n_eval"] == 5 and "eval_examples" not in rec
    # the primary set is evaluated exactly as when it was alone (same unit, same seed: same per-example losses)
    losses = json.loads((out / compare_run.EVAL_LOSSES).read_text())
    assert losses["eval_sets"] == ["code", "more"] and [len(u["sets"]["more"]["tokens"]) for u in losses["units"]] == [
        5, 5]
    state = compare_run.read_state(out / compare_run.STATE)
    first = next(r for r in state if r["key"] == alone["key"])["eval_examples"]
    assert losses["units"][0]["tokens"] == first["tokens"]
    assert losses["units"][0]["loss_sums"] == pytest.approx(first["loss_sums"], rel=1e-4)
    assert rec["initial_eval_loss"] == pytest.approx(alone["records"][0]["initial_eval_loss"], rel=1e-4)
    md = (out / "compare.md").read_text()
    assert "#### evaluation set code (primary): 8 examples evaluated" in md and "#### evaluation set more:" in md
    assert "| longest | " in md and "verdict: longest vs random: " in md

    # the same sets again: nothing recomputed; another content under the same name and path: other records
    calls.clear()
    compare_run.compare(_args(tmp_path, train, [f"code={code}", f"more={more}"], "random,longest"))
    assert calls == []
    more.write_text(more.read_text(encoding="utf-8").replace('"response": "', '"response": "# edited\\n', 1))
    monkeypatch.setattr(compare_run, "load_model", lambda *a, **k: (_ for _ in ()).throw(_Recompute()))
    with pytest.raises(_Recompute):
        compare_run.compare(_args(tmp_path, train, [f"code={code}", f"more={more}"], "random,longest"))


class _Recompute(Exception):
    """Raised where compare would load the model to run units again."""
