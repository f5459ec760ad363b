"""Before a unit's selection is timed: the processes an earlier unit's training started are gone.

A training unit with several ranks runs through the launch agent, whose ranks are forked from a preloaded fork server
(:mod:`clusterlm.launch.ranks`). ``train()`` returns when the agent has exited, but its fork server, orphaned then,
still tears down an interpreter that imported torch and transformers: about a second of one core after every
training (measured: 1.0-1.2 CPU-s, gone 1.1-1.3 s after ``train()`` returned, on 2 cores). A selection timed in that
second shares the CPUs with it, and a selection on ``world_size x threads`` torch threads, whose OpenMP threads wait
for each other, is slowed far more than that second: compare charged 2.0 s for a cluster selection that takes 1.0 s
alone (BENCHMARKS.md, ``bench_quality``). :func:`wait_for_launched` waits for them first; the wait is charged to no
method.

Every process a launch of this process started carries ``CLUSTERLM_LAUNCHER_PID`` = this process's pid in its
environment (:data:`clusterlm.launch.environment.LAUNCHER_PID_ENV`), which is how they are found (``/proc``; where
there is none, nothing is waited for).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from clusterlm.launch.environment import LAUNCHER_PID_ENV

__all__ = ["launched_processes", "wait_for_launched"]


def launched_processes(launcher: int | None = None) -> list[int]:
    """Pids of the live processes whose environment names ``launcher`` (default: this process) as their launcher;
    [] without ``/proc``."""
    mark = f"{LAUNCHER_PID_ENV}={os.getpid() if launcher is None else launcher}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if int(entry.name) != os.getpid() and mark in (entry / "environ").read_bytes().split(b"\0") \
                    and _running(entry):
                found.append(int(entry.name))
        except (OSError, ValueError):  # gone meanwhile, or another user's
            continue
    return found


def _running(entry: Path) -> bool:
    """Not a zombie (an exited process its parent has not reaped yet uses no CPU)."""
    return (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def wait_for_launched(timeout: float = 30.0) -> float:
    """Wait (at most ``timeout`` seconds) until no process this process launched is running; the seconds waited."""
    t0 = time.perf_counter()
    delay = 0.01
    while launched_processes() and time.perf_counter() - t0 < timeout:
        time.sleep(delay)
        delay = min(2 * delay, 0.1)
    return time.perf_counter() - t0
