"""Shared fixtures of the reliability tests: a tiny training set and the ``clusterlm train`` command line on it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

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
