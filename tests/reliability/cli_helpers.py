"""What the reliability tests share to drive the real command line in this process."""

from __future__ import annotations

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
