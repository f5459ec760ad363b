"""Where a process sits among the launcher's processes, read from its environment (no imports of torch).

torchrun sets :data:`TORCHRUN_ENV` in every rank; :func:`clusterlm.launch.launcher.spawn` sets
:data:`LAUNCHER_PID_ENV` for what it starts, and its agent :data:`AGENT_PID_ENV`. :mod:`clusterlm.launch.launcher`
(starting processes) and :mod:`clusterlm.launch.failures` (reporting them) both read these.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["AGENT_PID_ENV", "LAUNCHER_PID_ENV", "RESTART_ENV", "TORCHRUN_ENV", "env_pid", "process_stopped",
           "restart_count", "under_torchrun"]

# What torchrun sets in every rank's environment (the rendezvous address included).
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# Set by spawn for what it starts: the pid of the launching process; and by the agent: its own pid.
LAUNCHER_PID_ENV = "CLUSTERLM_LAUNCHER_PID"
AGENT_PID_ENV = "CLUSTERLM_AGENT_PID"
# torchrun's count of restarts of the worker group (0 in the first attempt; --max-restarts)
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


def under_torchrun() -> bool:
    """True in a process that torchrun (``torch.distributed.run``) started: all of :data:`TORCHRUN_ENV` set."""
    return all(k in os.environ for k in TORCHRUN_ENV)


def env_pid(name: str) -> int | None:
    """The pid in environment variable ``name``, None when unset or not a number."""
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def restart_count() -> int:
    """How many times torchrun restarted this worker group (0: the first attempt, or not under torchrun)."""
    try:
        return int(os.environ.get(RESTART_ENV, "0"))
    except ValueError:
        return 0


def process_stopped(pid: int) -> bool:
    """True while process ``pid`` is stopped (SIGSTOP, SIGTSTP, a debugger): state T or t in ``/proc/PID/stat``;
    False where there is no /proc or the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:][:1] in ("T", "t")  # after "(comm)", which may hold spaces and parentheses
