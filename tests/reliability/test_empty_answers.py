"""Examples whose answer is empty (issue 25, item 2): skipped with one warning, recorded, and trained consistently.

An example with an empty response has nothing to featurize or train on but an end-of-turn token. When every
example is such, the data is refused (``test_models_data.py``); when some are, ``load_data`` skips them with a
warning naming how many and where, and the loaded data set says which (``n_empty``, ``empty_indices``). A plan
indexes the loaded data set, and ``clusterlm train`` loads the file the same way: it trains exactly the plan's
examples, which are the file's examples with an answer, in file order.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli

from clusterlm.data import load_data, read_data
from clusterlm.data.demo import demo_data
from clusterlm.integrations.export import export_files
from clusterlm.plan import Plan

EMPTY = (3, 7, 8)  # record positions with an empty (or blank) response
N = 16


def _record(i: int) -> dict[str, str]:
    response = ("", " \n", "")[EMPTY.index(i)] if i in EMPTY else f"    return x + {i}\n"
    return {"prompt": f"def add_{i}(x):", "response": response}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(with_empty, clean)``: 16 records with a blank line after the 5th (so record 7 is line 9), and the 13
    records with an answer alone."""
    root = tmp_path_factory.mktemp("empty-answers")
    lines = [json.dumps(_record(i)) for i in range(N)]
    with_empty = root / "with-empty.jsonl"
    with_empty.write_text("\n".join(lines[:5]) + "\n\n" + "\n".join(lines[5:]) + "\n", encoding="utf-8")
    clean = root / "clean.jsonl"
    clean.write_text("".join(line + "\n" for i, line in enumerate(lines) if i not in EMPTY), encoding="utf-8")
    return with_empty, clean


@pytest.fixture(scope="module")
def tokenizer():
    return demo_data(verbose=False).load_tokenizer()


def test_some_empty_answers_are_skipped_with_one_warning_naming_count_and_lines(files, tokenizer) -> None:
    with_empty, clean = files
    with pytest.warns(UserWarning) as record:
        data = load_data(with_empty, tokenizer, progress=False)
    messages = [str(w.message) for w in record if "skipped" in str(w.message)]
    assert len(messages) == 1, messages
    msg = messages[0]
    assert "\n" not in msg and str(with_empty) in msg
    assert "skipped 3 of 16 examples with an empty 'response'" in msg and "(lines 4, 9, 10)" in msg
    assert record[0].filename == __file__  # stacklevel: the warning points at the caller of load_data
    assert len(data) == N - len(EMPTY)
    assert data.n_empty == 3 and data.empty_indices == EMPTY
    np.testing.assert_array_equal(data.source_indices, [i for i in range(N) if i not in EMPTY])
    assert "n_empty=3" in repr(data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to skip: no warning
        plain = load_data(clean, tokenizer, progress=False)
    assert plain.n_empty == 0 and plain.empty_indices == () and len(plain.source_indices) == len(plain)
    # the examples kept are exactly the file's examples with an answer, in file order
    assert data.fingerprint() == plain.fingerprint()


def test_empty_answers_of_other_formats_are_skipped(tokenizer) -> None:
    alpaca = [{"instruction": f"add {i}", "input": "", "output": "" if i == 1 else str(i)} for i in range(3)]
    with pytest.warns(UserWarning, match=r"skipped 1 of 3 examples with an empty 'output' .*\(example 1\)"):
        assert load_data(alpaca, tokenizer, progress=False).empty_indices == (1,)
    chat = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": a}]}
            for a in ("a", "", "b", "   ")]
    with pytest.warns(UserWarning, match=r"skipped 2 of 4 examples with only empty assistant turns .*examples 1, 3"):
        assert load_data(chat, tokenizer, progress=False).empty_indices == (1, 3)
    # one empty assistant turn among answered ones is kept: the conversation still has answer text
    mixed = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""},
                           {"role": "user", "content": "again"}, {"role": "assistant", "content": "a"}]}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(load_data(mixed, tokenizer, progress=False)) == 1
    # conversational prompt/completion: the completion's assistant turns count
    trl = [{"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": c}]}
           for c in ("x", "")]
    with pytest.warns(UserWarning, match=r"skipped 1 of 2 examples with an empty 'completion'"):
        assert load_data(trl, tokenizer, progress=False).empty_indices == (1,)


def test_tokenised_data_is_never_skipped() -> None:
    """Token ids carry no answer text to judge; an example without answer tokens is refused as before."""
    ok = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}] * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_data(ok).n_empty == 0
    with pytest.raises(ValueError, match="no answer token"):
        load_data([*ok, {"input_ids": [1, 2], "labels": [-100, -100]}])


def test_read_data_refuses_all_empty_before_any_tokenizer(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "response": ""}) + "\n" for i in range(12)))
    with pytest.raises(ValueError, match=r"all 12 examples have an empty 'response' .*\(lines 1, 2, 3, 4, 5, \.\.\.\)"):
        read_data(path)


def test_select_and_train_use_the_examples_with_an_answer(files, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    """The plan indexes the 13 examples with an answer; ``clusterlm train`` on the same file accepts it (same size
    and content hash) and trains exactly those examples: its tokens are the plan's selected examples' tokens. The
    export with the model pairs the plan's indices with the right records."""
    with_empty, clean = files
    plan_dir, out = tmp_path / "plan", tmp_path / "run"
    with pytest.warns(UserWarning, match="skipped 3 of 16"):
        rc = run_cli(["select", "--model", "tiny-llama", "--data", str(with_empty), "--world-size", "1", "--ratio",
                      "0.5", "--out", str(plan_dir), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    plan = Plan.load(plan_dir)
    assert plan.n_examples == N - len(EMPTY)
    assert plan.config["data"]["n_empty"] == len(EMPTY)  # the plan records the skipped lines
    assert plan.config["data"]["empty_indices"] == list(EMPTY)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = demo_data(verbose=False).load_tokenizer()
    assert plan.fingerprint == load_data(clean, tokenizer, progress=False).fingerprint()
    with pytest.warns(UserWarning, match="skipped 3 of 16"):
        rc = run_cli(["train", "--plan", str(plan_dir), "--model", "tiny-llama", "--data", str(with_empty), "--out",
                      str(out), "--no-progress", "--no-save-model", "--micro-batch-size", "2"])
    assert rc == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    selected = plan.indices(0)
    assert summary["examples_per_rank"] == len(selected) == plan.n_selected
    assert summary["tokens"] == int(plan.lengths[selected].sum())  # one epoch over exactly the plan's examples
    # the export pairs every plan index with its record of the file (the skipped ones left out)
    with pytest.warns(UserWarning, match="skipped 3 of 16"):
        paths, verified = export_files(plan_dir, with_empty, tmp_path / "export", model="tiny-llama")
    rows = [json.loads(line) for line in paths["jsonl"].read_text(encoding="utf-8").splitlines()]
    kept = [i for i in range(N) if i not in EMPTY]
    assert verified and len(rows) == len(selected)
    assert [r["prompt"] for r in rows] == [_record(kept[r["plan_index"]])["prompt"] for r in rows]
