"""What the reliability tests share to drive the real command line in this process."""

from __future__ import annotations

from pathlib import Path

from clusterlm.cli import commands as cli


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
