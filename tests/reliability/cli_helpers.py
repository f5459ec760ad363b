"""What the reliability tests share to drive the real command line in this process."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from clusterlm.cli import commands as cli

# The 2-rank run the fault and signal tests interrupt (tests/reliability/conftest.py's train_reference): faults at
# steps 3 to 6 leave 18 steps after them, 6 checkpoints
REFERENCE_STEPS, REFERENCE_SAVE_EVERY = 24, 4


def run_cli(argv: list[str]) -> int:
    """``clusterlm ARGV`` in this process; argparse's exit status when it refuses."""
    try:
        return cli.main(argv)
    except SystemExit as e:
        return int(e.code or 0)


def nonblank_lines(text: str) -> list[str]:
    """The lines of ``text`` that are not blank (what a user sees of an error)."""
    return [line for line in text.splitlines() if line.strip()]


def assert_same_plan(a_dir, b_dir) -> None:
    """Two plan.npz files hold the same selection exactly, and the same per-example diagnostics (distances,
    feature norms, losses: float arrays) to float rounding, as 1 and 2 processes give them
    (tests/clusterlm/test_select_distributed.py)."""
    import numpy as np

    a, b = np.load(Path(a_dir) / "plan.npz"), np.load(Path(b_dir) / "plan.npz")
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        exact = k == "weights" or not np.issubdtype(a[k].dtype, np.floating)
        np.testing.assert_allclose(a[k], b[k], rtol=0 if exact else 1e-5, atol=0, err_msg=k)


def clusterlm_command(*args: str) -> list[str]:
    """``python -m clusterlm ARGS`` with this interpreter."""
    return [sys.executable, "-m", "clusterlm", *args]


def reference_train(tiny: SimpleNamespace, out: Path, *extra: str) -> list[str]:
    """The command line of the reference run (``clusterlm train --nproc 2``, REFERENCE_STEPS steps of one example
    per rank, a checkpoint every REFERENCE_SAVE_EVERY steps, every loss logged) with ``extra`` options."""
    return clusterlm_command("train", *tiny.argv(out, "--nproc", "2", "--max-steps", str(REFERENCE_STEPS),
                                                 "--micro-batch-size", "1", "--lr", "3e-3", "--save-every",
                                                 str(REFERENCE_SAVE_EVERY), "--log-every", "1",
                                                 "--keep-checkpoints", "20", *extra))


def train_losses(out: Path) -> dict[int, float]:
    """Step -> training loss of the records in ``OUT/metrics.jsonl`` so far ({} before the first; a record being
    written is skipped)."""
    try:
        lines = (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        return {}
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return {r["step"]: r["loss"] for r in records if r.get("kind") == "train"}


def checkpoint_weights(out: Path, step: int = REFERENCE_STEPS) -> dict[str, Any]:
    """The model state of ``OUT/ckpt/step_<step>.pt``."""
    import torch

    return torch.load(out / "ckpt" / f"step_{step:07d}.pt", map_location="cpu", weights_only=False)["model"]
