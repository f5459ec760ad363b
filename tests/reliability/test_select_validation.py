"""``clusterlm select`` fails early, or loses nothing (issue 15, class 4).

Every argument and the output location are checked before any model work: a bad value is one line on stderr
with exit status 2 while loading the model is a trap. What needs the data's size (a budget larger than the data,
cluster bounds no clustering can meet) is checked after loading the data, before any feature is computed.
Features go to ``OUT/features`` (a feature store) by default, so a failure after extraction loses nothing and
the rerun resumes; a rerun with other settings into the same ``OUT`` recomputes instead of failing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from clusterlm.cli import commands as cli
from clusterlm.models import load_model
from clusterlm.plan import Plan
from clusterlm.selection import pipeline
from clusterlm.selection.features import GradientFeaturizer
from clusterlm.selection.store import FeatureStore

N = 16
RECORDS = [{"prompt": f"def add_{i}(x):", "response": f"    return x + {i}\n"} for i in range(N)]


def _run(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as e:  # argparse
        return int(e.code or 0)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("select-validation") / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    load_model("tiny-llama")  # built once, outside the cases
    return path


def _argv(data: Path, out: Path, *extra: str, budget: tuple[str, ...] = ("--ratio", "0.5")) -> list[str]:
    given = {a for a in extra if a.startswith("--")}
    argv = ["select", "--model", "tiny-llama", "--data", str(data), "--out", str(out), "--no-progress"]
    if "--world-size" not in given:
        argv += ["--world-size", "2"]
    if not given & {"--ratio", "--budget", "--token-ratio", "--token-budget"}:
        argv += list(budget)
    return argv + list(extra)


def _one_line(rc: int, err: str, *needles: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, (rc, err)
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("clusterlm select: error: "), lines[0]
    for needle in needles:
        assert needle.lower() in lines[0].lower(), (needle, lines[0])
    return lines[0]


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading a model fails the test: the argument must be refused before it."""

    def trap(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model was loaded before the bad argument was refused")

    monkeypatch.setattr(pipeline, "load_model", trap)  # the select pipeline loads the model (issue 20)


@pytest.fixture
def no_features(monkeypatch: pytest.MonkeyPatch) -> None:
    """Computing features fails the test: the argument must be refused before it."""

    def trap(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("features were computed before the bad argument was refused")

    monkeypatch.setattr(GradientFeaturizer, "featurize", trap)


# (extra arguments, words the one line must contain)
BEFORE_THE_MODEL: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "seed-negative": (("--seed", "-1"), ("--seed", "-1")),
    "seed-not-a-number": (("--seed", "x"), ("--seed", "'x'")),
    "max-cluster-size-word": (("--max-cluster-size", "abc"), ("--max-cluster-size", "abc")),
    "max-cluster-size-negative": (("--max-cluster-size", "-3"), ("--max-cluster-size", "-3")),
    "max-cluster-size-zero-factor": (("--max-cluster-size", "0x"), ("--max-cluster-size", "0x")),
    "min-cluster-size-word": (("--min-cluster-size", "foo"), ("--min-cluster-size", "foo")),
    "world-size-zero": (("--world-size", "0"), ("--world-size", "0")),
    "world-size-negative": (("--world-size", "-2"), ("--world-size",)),
    "ratio-zero": (("--ratio", "0"), ("--ratio", "0")),
    "ratio-above-one": (("--ratio", "1.5"), ("--ratio", "1.5")),
    "ratio-nan": (("--ratio", "nan"), ("--ratio", "nan")),
    "budget-zero": (("--budget", "0"), ("--budget", "0")),
    "token-ratio-two": (("--token-ratio", "2"), ("--token-ratio", "2")),
    "token-budget-zero": (("--token-budget", "0"), ("--token-budget", "0")),
    "clusters-per-rank-zero": (("--clusters-per-rank", "0"), ("--clusters-per-rank", "0")),
    "nproc-zero": (("--nproc", "0"), ("--nproc", "0")),
    "max-length-one": (("--max-length", "1"), ("--max-length", "1")),
    "batch-tokens-zero": (("--batch-tokens", "0"), ("--batch-tokens", "0")),
    "dim-zero": (("--dim", "0"), ("--dim", "0")),
    "dim-word": (("--dim", "big"), ("--dim", "big")),
    "dim-zero-factor": (("--dim", "32x0"), ("--dim", "32x0")),
    "feature-tokens-one": (("--feature-tokens", "1"), ("--feature-tokens", "1")),
    "features-empty-list": (("--features", ","), ("--features",)),
    "paper-with-lm-head-features": (("--preset", "paper", "--features", "lm_head"), ("paper", "features")),
    "paper-with-other-cap": (("--preset", "paper", "--max-cluster-size", "2x"), ("paper", "max_cluster_size")),
    "paper-with-token-budget": (("--preset", "paper", "--token-ratio", "0.3"), ("paper", "token")),
    "paper-with-feature-window": (("--preset", "paper", "--feature-tokens", "64"), ("paper", "feature_tokens")),
    "authors-clustering-default-preset": (("--clustering", "authors"), ("authors", "paper")),
    "ratio-as-a-percentage": (("--ratio", "31"), ("--ratio", "write 0.31")),
    "data-file-missing": (("--data", "/nonexistent/train.jsonl"), ("no such file", "/nonexistent/train.jsonl")),
    "out-empty": (("--out", ""), ("--out", "empty")),
}


@pytest.mark.parametrize("case", list(BEFORE_THE_MODEL))
def test_a_bad_argument_is_refused_before_the_model_loads(case: str, data: Path, tmp_path: Path, no_model: None,
                                                          capsys: pytest.CaptureFixture) -> None:
    extra, needles = BEFORE_THE_MODEL[case]
    argv = _argv(data, tmp_path / "out", *extra)
    for option in ("--data", "--out"):  # the case's value replaces the good one
        if option in extra:
            i = argv.index(option)
            del argv[i:i + 2]
    _one_line(_run(argv), capsys.readouterr().err, *needles)


def _out_is_a_file(tmp_path: Path) -> Path:
    (tmp_path / "taken").write_text("not a directory\n")
    return tmp_path / "taken"


def _out_under_a_file(tmp_path: Path) -> Path:
    return _out_is_a_file(tmp_path) / "plan"


def _out_read_only(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """A directory this process cannot write into: mode 0o555, or as root (who ignores modes) chattr +i."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
        request.addfinalizer(lambda: ro.chmod(0o755))
    elif shutil.which("chattr") and subprocess.run(["chattr", "+i", str(ro)], capture_output=True).returncode == 0:
        request.addfinalizer(lambda: subprocess.run(["chattr", "-i", str(ro)], check=False))
    else:
        pytest.skip("root without chattr +i: no directory is read-only (out-under-a-file covers unwritable paths)")
    return ro / "plan"


OUTS = {  # (the unusable path, what the line says)
    "out-is-a-file": (lambda tmp, request: _out_is_a_file(tmp), "not a directory"),
    "out-under-a-file": (lambda tmp, request: _out_under_a_file(tmp), "not a directory"),
    "out-read-only": (_out_read_only, "not writable"),
}


@pytest.mark.parametrize("option", ["--out", "--feature-store"])
@pytest.mark.parametrize("case", list(OUTS))
def test_an_unusable_output_location_is_refused_before_the_model_loads(
        case: str, option: str, data: Path, tmp_path: Path, no_model: None, request: pytest.FixtureRequest,
        capsys: pytest.CaptureFixture) -> None:
    make, says = OUTS[case]
    bad = make(tmp_path, request)
    argv = _argv(data, bad if option == "--out" else tmp_path / "out")
    if option == "--feature-store":
        argv += ["--feature-store", str(bad)]
    _one_line(_run(argv), capsys.readouterr().err, option, str(bad), says)


# Needs the data's size: refused after loading it, before any feature.
BEFORE_THE_FEATURES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "budget-above-data-size": (("--budget", "1000"), ("budget", "1000", str(N))),
    "token-budget-above-data": (("--token-budget", "10000000"), ("token_budget", "10000000")),
    "more-ranks-than-examples": (("--world-size", "32"), ("32", str(N))),
    "min-cluster-size-above-data": (("--min-cluster-size", "100"), ("min_cluster_size", "100")),
    "max-cluster-size-too-small": (("--max-cluster-size", "1"), ("max_cluster_size", "1")),
    "min-above-max": (("--min-cluster-size", "7", "--max-cluster-size", "6"), ("min_cluster_size", "max_cluster_size")),
    "unknown-feature-module": (("--features", "model.layers.0.mlp.nope"), ("model.layers.0.mlp.nope",)),
    "unknown-feature-name": (("--features", "everything"), ("everything",)),
    "one-unknown-in-comma-list": (("--features", "lm_head,model.layers.9.mlp.down_proj"),
                                  ("model.layers.9.mlp.down_proj",)),
}


@pytest.mark.parametrize("case", list(BEFORE_THE_FEATURES))
def test_a_bound_the_data_cannot_meet_is_refused_before_the_features(
        case: str, data: Path, tmp_path: Path, no_features: None, capsys: pytest.CaptureFixture) -> None:
    extra, needles = BEFORE_THE_FEATURES[case]
    _one_line(_run(_argv(data, tmp_path / "out", *extra)), capsys.readouterr().err, *needles)
    assert not (tmp_path / "out" / "plan.json").exists()


def test_features_survive_a_failure_after_extraction_and_the_rerun_resumes(
        data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"

    def broken_save(self: Plan, directory: Any) -> Path:
        raise RuntimeError("the disk went away")

    with monkeypatch.context() as m:
        m.setattr(Plan, "save", broken_save)
        with pytest.raises(RuntimeError, match="the disk went away"):  # not a user error: the traceback stays
            cli.main(_argv(data, out))
    store = FeatureStore(out / "features")
    assert store.complete and store.n_examples == N

    def no_forward(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the rerun recomputed features that OUT/features holds")

    with monkeypatch.context() as m:
        m.setattr(GradientFeaturizer, "_run_batch", no_forward)
        assert cli.main(_argv(data, out)) == 0
    assert Plan.load(out).n_examples == N
    # Another seed (other projections) into the same OUT: the stale features are recomputed, not an error.
    assert cli.main(_argv(data, out, "--seed", "3")) == 0
    assert Plan.load(out).config["seed"] == 3
    capsys.readouterr()


def test_an_explicit_feature_store_is_used_instead(data: Path, tmp_path: Path) -> None:
    out, store = tmp_path / "out", tmp_path / "my-features"
    assert cli.main(_argv(data, out, "--feature-store", str(store))) == 0
    assert FeatureStore(store).complete and not (out / "features").exists()
