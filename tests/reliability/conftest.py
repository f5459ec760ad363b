"""Shared fixtures of the reliability tests: a tiny training set, the ``clusterlm train`` command line on it, and the
uninterrupted runs (a 2-rank training, a selection) that the interrupted ones of test_faults.py and test_signals.py
must equal."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cli_helpers import reference_train, train_losses
from filelock import FileLock

N_EXAMPLES = 16


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory, demo: Any) -> SimpleNamespace:
    """16 prompt/response records in ``train.jsonl``; ``argv(out, *extra)`` trains tiny-llama on them.

    ``--plan full`` (the baseline is built from the data, for any world size), no progress bar, no final model. The
    commands run in the session's ``CLUSTERLM_HOME`` (``demo``: tiny-llama built once for the whole suite), never in
    ``~/.cache/clusterlm``.
    """
    root = tmp_path_factory.mktemp("reliability")
    data = root / "train.jsonl"
    records = [{"prompt": f"def add_{i}(x):", "response": f"    return x + {i}\n"} for i in range(N_EXAMPLES)]
    data.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")

    def argv(out: str | Path, *extra: str) -> list[str]:
        return ["--plan", "full", "--model", "tiny-llama", "--data", str(data), "--out", str(out), "--no-progress",
                "--no-save-model", *extra]

    return SimpleNamespace(root=root, data=data, argv=argv)


def _shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory all pytest-xdist workers of this session see (their temporary directories' parent)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _once(shared: Path, name: str, make) -> Path:
    """``shared/name``, made by ``make(path)`` by the first worker that asks (under a file lock); its ``.done``
    marker, written last, says it is complete (a worker that failed half-way leaves none: the next one redoes it)."""
    out = shared / name
    with FileLock(str(shared / f"{name}.lock")):
        if not (shared / f"{name}.done").exists():
            shutil.rmtree(out, ignore_errors=True)
            make(out)
            (shared / f"{name}.done").touch()
    return out


@pytest.fixture(scope="session")
def train_reference(tiny: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The uninterrupted reference run (:func:`reference_train`), once per session: its ``out``, its step ``losses``."""

    def make(out: Path) -> None:
        proc = subprocess.run(reference_train(tiny, out), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]  # the run's own error line, not only its exit status

    out = _once(_shared_dir(tmp_path_factory), "train_reference", make)
    return SimpleNamespace(out=out, losses=train_losses(out))


@pytest.fixture(scope="session")
def select_reference(tiny: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """``clusterlm select`` for 2 ranks on the tiny data, uninterrupted and in this process (2 selection processes
    write the 1-process plan: tests/clusterlm/test_select_distributed.py), once per session: ``argv`` (without
    ``--out``) and the plan directory ``out``."""
    from clusterlm.cli import commands as cli

    argv = ["select", "--model", "tiny-llama", "--data", str(tiny.data), "--world-size", "2", "--ratio", "0.5",
            "--no-progress", "--batch-tokens", "64"]

    def make(out: Path) -> None:
        assert cli.main([*argv, "--out", str(out)]) == 0

    return SimpleNamespace(argv=argv, out=_once(_shared_dir(tmp_path_factory), "select_reference", make))
