"""Every ``clusterlm`` user error is one line on stderr with exit status 2 (issue 15, class 7).

``clusterlm <command>: error: <message>``, no traceback (``--debug`` shows it); a missing optional package names
its install; Ctrl-C exits with 130; a crash (any other exception) keeps its traceback. ``--features`` takes
comma-separated module names as ``select(features=[...])`` does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import nonblank_lines

from clusterlm.cli import commands as cli
from clusterlm.models import load_model
from clusterlm.plan import Plan
from clusterlm.selection import pipeline

RECORDS = [{"prompt": f"def add_{i}(x):", "response": f"    return x + {i}\n"} for i in range(16)]


def _run(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as e:  # argparse
        return int(e.code or 0)



def _one_line(rc: int, err: str, command: str, *needles: str) -> str:
    lines = nonblank_lines(err)
    assert rc == 2, (rc, err)
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"clusterlm {command}: error: "), lines[0]
    for needle in needles:
        assert needle.lower() in lines[0].lower(), (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli-messages") / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    return path


def _select(data: Path, out: Path, *extra: str) -> list[str]:
    return ["select", "--model", "tiny-llama", "--data", str(data), "--world-size", "2", "--ratio", "0.5",
            "--out", str(out), "--no-progress", *extra]


def test_a_user_error_in_a_real_process_is_one_line_and_exit_status_2(data: Path, tmp_path: Path) -> None:
    argv = ["select", "--model", str(tmp_path / "no-such-model"), "--data", str(data), "--world-size", "2",
            "--ratio", "0.5", "--out", str(tmp_path / "out")]
    proc = subprocess.run([sys.executable, "-m", "clusterlm", *argv], capture_output=True, text=True, timeout=300)
    _one_line(proc.returncode, proc.stderr, "select", "no-such-model")


def _raiser(exc: BaseException) -> Any:
    def run(args: Any) -> Any:
        raise exc

    return run


RAISED = {
    "value-error": (ValueError("select: something is off"), 2, ("something is off",)),
    "type-error": (TypeError("load_data: example 0: 'prompt' must be a string"), 2, ("'prompt' must be a string",)),
    "file-not-found": (FileNotFoundError("Plan.load: no plan.json in runs/x"), 2, ("no plan.json",)),
    "multi-line-message": (ValueError("first part\n(1) second part\n(2) third"), 2, ("first part", "third")),
    "missing-package": (ModuleNotFoundError("No module named 'gguf'", name="gguf"), 2, ("gguf", "pip install")),
    "missing-package-dotted": (ModuleNotFoundError("No module named 'sklearn.cluster'", name="sklearn.cluster"), 2,
                               ("pip install scikit-learn",)),
}


@pytest.mark.parametrize("case", list(RAISED))
def test_user_errors_become_one_line(case: str, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture) -> None:
    exc, status, needles = RAISED[case]
    monkeypatch.setattr(pipeline, "run_select", _raiser(exc))
    rc = _run(_select(data, tmp_path / "out"))
    assert rc == status
    _one_line(rc, capsys.readouterr().err, "select", *needles)


def test_debug_shows_the_traceback(data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(pipeline, "run_select", _raiser(ValueError("select: something is off")))
    for argv in (["--debug", *_select(data, tmp_path)], [*_select(data, tmp_path), "--debug"]):
        assert _run(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" in err and err.rstrip().splitlines()[-1].startswith("clusterlm select: error: ")


def test_ctrl_c_exits_130_without_a_traceback(data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(pipeline, "run_select", _raiser(KeyboardInterrupt()))
    assert _run(_select(data, tmp_path)) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and nonblank_lines(err) == ["clusterlm select: interrupted"]


def test_a_crash_keeps_its_traceback(data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipeline, "run_select", _raiser(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(_select(data, tmp_path))


ARGPARSE = {
    "no-command": ([], "clusterlm", ("command",)),
    "unknown-command": (["selcet"], "clusterlm", ("selcet",)),
    "missing-required": (["select", "--data", "x.jsonl"], "clusterlm select", ("--model",)),
    "unknown-option": (["report", "runs/x", "--colour"], "clusterlm report", ("--colour",)),
    # no budget: SelectConfig's check names the budget settings (an option, or a --config file's field)
    "no-budget": (["select", "--model", "m", "--data", "d", "--world-size", "2", "--out", "o"], "clusterlm select",
                  ("ratio / budget", "token_ratio / token_budget")),
    "demo-ratio": (["demo", "--ratio", "1.5"], "clusterlm demo", ("--ratio", "1.5")),
    "demo-world-size": (["demo", "--world-size", "0"], "clusterlm demo", ("--world-size", "0")),
}


@pytest.mark.parametrize("case", list(ARGPARSE))
def test_command_line_mistakes_are_one_line(case: str, capsys: pytest.CaptureFixture) -> None:
    argv, prog, needles = ARGPARSE[case]
    rc = _run(argv)
    lines = nonblank_lines(capsys.readouterr().err)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_report_and_export_of_a_missing_plan_are_one_line(tmp_path: Path, data: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    _one_line(_run(["report", str(tmp_path / "nothing")]), capsys.readouterr().err, "report", "nothing")
    rc = _run(["export", "--plan", str(tmp_path / "nothing"), "--data", str(data), "--out", str(tmp_path / "e")])
    _one_line(rc, capsys.readouterr().err, "export", "nothing")


def test_features_takes_a_comma_separated_list_of_modules(data: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    load_model("tiny-llama")
    layers = ["model.layers.3.mlp.down_proj", "lm_head"]
    assert cli.main(_select(data, tmp_path / "out", "--features", " , ".join(layers))) == 0
    features = Plan.load(tmp_path / "out").config["features"]
    assert features["layers"] == layers and features["layers_preset"] == layers
    capsys.readouterr()
