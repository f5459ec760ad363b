"""Regenerate ``docs/report.png``, the README's picture: the plan report of the built-in demo.

Usage (from the repository root, after ``make install``)::

    .venv/bin/python docs/make_report_png.py            # runs the demo's selection, copies its report.png
    .venv/bin/python docs/make_report_png.py --from runs/demo   # reuse an earlier ``make demo`` output

The selection is the one ``make demo`` runs (``clusterlm demo``: the built-in data set, the tiny Llama, 2 ranks
at 31 %); the training part of the demo is skipped (``--train-steps 0``), the picture shows the plan only.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DOCS = Path(__file__).resolve().parent
TARGET = DOCS / "report.png"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", type=Path, default=None,
                        help="an existing demo output directory (holding plan/report.png); default: run the demo")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        source = args.source
        if source is None:
            source = Path(tmp) / "demo"
            cmd = [sys.executable, "-m", "clusterlm", "demo", "--out", str(source), "--train-steps", "0",
                   "--no-progress"]
            subprocess.run(cmd, check=True)
        report = source / "plan" / "report.png"
        if not report.is_file():
            print(f"make_report_png: {report} not found (run `make demo` or drop --from)", file=sys.stderr)
            return 1
        shutil.copyfile(report, TARGET)
    print(f"make_report_png: wrote {TARGET.relative_to(DOCS.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
