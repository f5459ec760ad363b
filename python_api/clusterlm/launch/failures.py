"""Failures of a multi-process run in one line: each rank reports its own (:func:`report_failure`, into torchrun's
error file), and the agent prints the first failure of the run (:func:`first_failure`): the rank that died first,
how (exit status or signal name) and its last lines of stderr (:func:`tee_stderr` keeps them next to the error
file), then that the other ranks were stopped.

A rank killed by a signal it did not get from the launcher (SIGKILL: the OOM killer, a bad host; SIGSEGV) cannot
report; it is the cause whenever it is there, before the other ranks' reports, which only notice the lost peer.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

from clusterlm.fileio import atomic_write_text
from clusterlm.launch.environment import AGENT_PID_ENV, env_pid, under_torchrun

__all__ = ["STDERR_TAIL", "first_failure", "removed_if_empty", "report_failure", "reported_by_launcher",
           "stamp_failure", "stderr_tail", "tee_stderr"]

_FAILED_AT = "clusterlm_failed_ns"  # attribute of an exception: when it happened (stamp_failure)
STDERR_TAIL = "stderr.log"  # next to a rank's torchrun error file: a copy of what the rank wrote to stderr
_TAIL_LINES = 5
# Signals the launcher itself stops ranks with: a rank ended by one of them is a consequence, never the cause.
_LAUNCHER_SIGNALS = {int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGHUP), int(signal.SIGQUIT),
                     int(getattr(signal, "SIGUSR1", 10))}


def first_failure(failures: Mapping[int, Any], stopped_by_launcher: Collection[int] = ()) -> tuple[str, int]:
    """The line and exit status that report a failed run: the rank that failed first, how, its last lines of stderr,
    and that the others were stopped.

    Args:
        failures: global rank -> torch's ``ProcessFailure`` (``exitcode``, ``pid``, ``error_file``,
            ``error_file_data``, ``timestamp``).
        stopped_by_launcher: pids the launcher itself killed while closing a failed run (a rank stopped by SIGSTOP:
            :func:`clusterlm.launch.launcher.run_agent`); like the ranks it ended with SIGTERM, never the cause.

    The cause is, in this order: a rank killed by a signal that the launcher does not send (SIGKILL, SIGSEGV, ...:
    it could not report, and the others' reports only notice the lost peer), the earliest; else the rank that
    reported first (:func:`report_failure`, by the nanosecond time of its report); else the earliest exit.
    """
    reported = [(int(_report_of(f).get("time_ns", 0)), rank) for rank, f in failures.items() if _report_of(f)]
    # A killed rank's failure is stamped when the agent saw it (whole seconds): it is the cause unless it came later
    # than the first report (then the agent itself killed it, after it would not stop).
    first_report_s = min(reported)[0] / 1e9 if reported else float("inf")
    killed = [(f.timestamp, rank) for rank, f in failures.items()
              if f.exitcode < 0 and -f.exitcode not in _LAUNCHER_SIGNALS and f.pid not in stopped_by_launcher
              and not _report_of(f)
              and f.timestamp <= first_report_s + 1]
    others = len(failures) - 1
    stopped = f"; the other {others} failed rank(s) were stopped after it" if others else ""
    if not killed and reported:
        _, rank = min(reported)
        mine = _report_of(failures[rank])
        return str(mine["line"]) + stopped, int(mine.get("exit_code", 1))
    _, rank = min(killed) if killed else min((f.timestamp, r) for r, f in failures.items())
    f = failures[rank]
    if f.exitcode < 0:
        how = f"was killed by signal {-f.exitcode} ({f.signal_name()})"
    else:
        how = f"exited with status {f.exitcode}"
    tail = stderr_tail(f.error_file)
    shown = f"; its last lines of stderr: {' | '.join(tail)}" if tail else "; it wrote nothing to stderr before"
    return f"clusterlm: rank {rank} (pid {f.pid}) {how} first{shown}{stopped}", 1


def _report_of(f: Any) -> dict[str, Any]:
    data = f.error_file_data if isinstance(getattr(f, "error_file_data", None), dict) else {}
    mine = data.get("clusterlm")
    return mine if isinstance(mine, dict) and "line" in mine else {}


def stderr_tail(error_file: str | os.PathLike | None, lines: int = _TAIL_LINES) -> list[str]:
    """The last ``lines`` non-blank lines a rank wrote to stderr (:func:`tee_stderr`'s copy next to its error file)."""
    if not error_file:
        return []
    try:
        text = (Path(error_file).parent / STDERR_TAIL).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return [" ".join(line.split())[:300] for line in text.splitlines() if line.strip()][-lines:]


class _Tee:
    """A text stream that writes to ``stream`` and appends every write to ``path`` (flushed, so a rank that is
    SIGKILLed leaves what it wrote)."""

    def __init__(self, stream: Any, path: Path) -> None:
        self._stream = stream
        self._file = open(path, "a", encoding="utf-8", errors="replace")  # noqa: SIM115 - lives with the process

    def write(self, text: str) -> int:
        n = self._stream.write(text)
        try:
            self._file.write(text)
            self._file.flush()
        except (OSError, ValueError):
            pass
        return n

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def tee_stderr() -> bool:
    """In a rank that torchrun started: copy what Python writes to stderr to :data:`STDERR_TAIL` next to the rank's
    error file, so :func:`first_failure` can show a dead rank's last lines. True when set up. Idempotent."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file or isinstance(sys.stderr, _Tee):
        return False
    try:
        os.makedirs(os.path.dirname(error_file), exist_ok=True)
        sys.stderr = _Tee(sys.stderr, Path(error_file).parent / STDERR_TAIL)
    except OSError:
        return False
    return True


def reported_by_launcher() -> bool:
    """True in a rank whose failures :func:`run_agent` reports (it prints nothing itself)."""
    return under_torchrun() and env_pid(AGENT_PID_ENV) is not None


def stamp_failure(exc: BaseException) -> None:
    """Note on ``exc`` when it happened (the first stamp stays), for :func:`report_failure`.

    A rank stamps its failure before it takes its process group down: the other ranks then fail on the lost
    peer, later, and the agent reports the rank that failed first.
    """
    if getattr(exc, _FAILED_AT, None) is None:
        try:
            setattr(exc, _FAILED_AT, time.time_ns())
        except (AttributeError, TypeError):  # pragma: no cover - exceptions with __slots__
            pass


def _record_failure(line: str, code: int, exc: BaseException | None, keep_traceback: bool) -> bool:
    """Write the rank's failure into torchrun's error file (with the traceback of a crash); True when written."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return False
    stack = "".join(traceback.format_exception(exc)) if exc is not None else ""
    if keep_traceback and stack:  # a crash: its traceback in a file of its own, named on the line
        tb_path = os.path.join(os.path.dirname(error_file), "traceback.txt")
        try:
            with open(tb_path, "w", encoding="utf-8") as f:
                f.write(stack)
            line = f"{line} (traceback: {tb_path})"
        except OSError:
            pass
    when = getattr(exc, _FAILED_AT, None) or time.time_ns()
    record = {"message": {"message": line, "extraInfo": {"py_callstack": stack, "timestamp": str(when // 10**9)}},
              "clusterlm": {"line": line, "exit_code": code, "time_ns": when}}
    try:
        os.makedirs(os.path.dirname(error_file), exist_ok=True)
    except OSError:
        return False
    # Atomically, and without the call stack when the whole record does not fit (a full disk, a file size limit):
    # torchrun parses whatever file it finds, and a half-written one crashes its agent.
    for rec in (record, {**record, "message": {**record["message"], "extraInfo": {"timestamp": str(when // 10**9)}}}):
        try:
            atomic_write_text(error_file, json.dumps(rec))
            return True
        except OSError:
            continue
    return False


def report_failure(message: str, code: int, exc: BaseException | None = None, *, keep_traceback: bool = False,
                   prefix: str = "clusterlm") -> int:
    """Report this process's failure in one line, ``PREFIX: error: MESSAGE``; returns ``code``.

    Alone (no torchrun), the line goes to stderr. In a rank it names the rank (``error (rank 1 of 2)``) and
    goes to torchrun's error file; it is printed here too unless the agent reports it
    (:func:`reported_by_launcher`) — under torchrun run by hand by rank 0 only, so that N ranks failing alike
    print one line.

    Args:
        message: what went wrong and what to do.
        code: the exit status (2: a user error, 1: a failure).
        exc: the exception (when it happened: :func:`stamp_failure`).
        keep_traceback: a crash: keep its traceback (in a file next to the error file, named on the line).
        prefix: the command, e.g. ``clusterlm train``.
    """
    if not under_torchrun():
        print(f"{prefix}: error: {message}", file=sys.stderr, flush=True)
        return code
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    line = f"{prefix}: error (rank {rank} of {world}): {message}"
    written = _record_failure(line, code, exc, keep_traceback)
    if not (written and reported_by_launcher()) and (rank == 0 or not written):
        print(line, file=sys.stderr, flush=True)
    return code


@contextlib.contextmanager
def removed_if_empty(out: str | os.PathLike, wrote: Callable[[Path], bool]) -> Iterator[None]:
    """Remove ``out`` when the run that created it fails before ``wrote(out)`` is true (before its first output):
    a failed start leaves no empty directory. A directory that existed before is left as it was, and so is one a
    rank shares with its peers (under torchrun the launcher decides)."""
    out = Path(out)
    created = not out.exists() and not under_torchrun()
    try:
        yield
    except BaseException:
        if created and out.is_dir() and not wrote(out):
            shutil.rmtree(out, ignore_errors=True)
        raise
