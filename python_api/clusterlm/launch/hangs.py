"""A rank that hangs, named: every rank keeps its progress (step and operation) in ``OUT/.ranks/``, and a rank whose
collective times out (the process group's timeout, ``--dist-timeout``) says which operation did not complete and
which rank(s) are behind, in one line, instead of torch's "Timed out waiting 20000ms for recv".

The progress is written by a daemon thread at most once a second (a stopped or hung rank's thread stops with it, or
keeps showing where it stands), so the step loop pays only an assignment per operation. A rank removes its file
when its run ends, however it ends (the last one out removes the directory); the files of ranks that were killed
are removed by ``clusterlm train``'s launching process (:func:`remove_progress`), and a file left by a run started
otherwise is overwritten by the rank of the same number in the next run in that OUT.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

from clusterlm.fileio import atomic_write_text

__all__ = ["PROGRESS_DIR", "Progress", "is_timeout", "remove_progress"]

PROGRESS_DIR = ".ranks"  # in OUT: one small JSON file per rank
_INTERVAL = 1.0  # seconds between progress writes
_TIMEOUT_WORDS = ("timed out", "timeout", "watchdog caught collective operation")


def is_timeout(exc: BaseException) -> bool:
    """True for the error torch raises when a collective waits longer than the process group's timeout (gloo:
    "Timed out waiting ...ms"; nccl: the watchdog's "Watchdog caught collective operation timeout")."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(w in text for w in _TIMEOUT_WORDS)


class Progress:
    """This rank's step and operation, written to ``OUT/.ranks/rank_<r>.json`` by a daemon thread."""

    def __init__(self, out: Path, rank: int, world_size: int) -> None:
        self.dir = Path(out) / PROGRESS_DIR
        self.rank, self.world_size = rank, world_size
        self.step, self.op, self.since = 0, "starting", time.time()
        self._written: tuple[int, str] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if world_size > 1:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._run, name="clusterlm-progress", daemon=True)
            self._thread.start()

    def mark(self, step: int, op: str) -> None:
        """This rank is now at ``op`` of ``step`` (e.g. "the gradient all-reduce")."""
        self.step, self.op, self.since = step, op, time.time()

    def _path(self, rank: int) -> Path:
        return self.dir / f"rank_{rank}.json"

    def _run(self) -> None:
        self._write()  # at once: a rank that hangs before the first interval is still named, with its pid
        while not self._stop.wait(_INTERVAL):
            self._write()

    def _write(self) -> None:
        now = (self.step, self.op)
        if now == self._written:
            return
        try:
            atomic_write_text(self._path(self.rank), json.dumps({"step": self.step, "op": self.op,
                                                                 "since": self.since, "pid": os.getpid()}))
            self._written = now
        except OSError:
            pass  # progress is a diagnosis aid: a write that fails must not end the run

    def explain(self, timeout: float | None) -> str:
        """The line for a collective that timed out here: this rank's operation, and the ranks behind it."""
        self._write()
        waited = f"{timeout:g} s" if timeout else "the process group's timeout"
        behind = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            try:
                rec = json.loads(self._path(r).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                behind.append(f"rank {r} (no progress recorded)")
                continue
            ago = time.time() - float(rec.get("since", time.time()))
            if (rec["step"], rec["op"]) == (self.step, self.op):  # it got here too, then stopped inside it
                where = "it reached the same operation"
            else:
                where = f"its last progress was {rec['op']} of step {rec['step']}"
            behind.append(f"rank {r} (pid {rec.get('pid', '?')}; {where}, {ago:.0f} s ago)")
        who = "; ".join(behind)
        return (f"rank {self.rank} waited {waited} in {self.op} of step {self.step} (--dist-timeout) for {who}: it "
                "is stopped or hung (SIGSTOP, a deadlock, a GPU fault); the run ends (continue it with --resume, or "
                "let --max-restarts restart it)")

    def close(self) -> None:
        """Stop the thread and remove this rank's file (and the directory, when it is the last)."""
        self._stop.set()
        if self._thread is None:
            return
        self._thread.join(timeout=2 * _INTERVAL)
        self._path(self.rank).unlink(missing_ok=True)
        try:
            self.dir.rmdir()
        except OSError:  # another rank's file is still there (or it is gone already)
            pass


def remove_progress(out: str | os.PathLike) -> None:
    """Remove ``OUT/.ranks`` (the launching process, once its ranks are gone: killed ones leave their files)."""
    shutil.rmtree(Path(out) / PROGRESS_DIR, ignore_errors=True)
