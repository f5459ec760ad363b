"""Preemption: on SIGTERM or SIGUSR1 every rank finishes its step, rank 0 checkpoints it, and the run ends with
:data:`PREEMPTED_EXIT` and one line saying how to resume.

SLURM, Kubernetes and spot instances send SIGTERM before they kill a job (SLURM can send SIGUSR1 ahead of time,
``--signal=USR1@120``). torchrun's agent passes the signal to every rank (:mod:`clusterlm.launch.launcher` asks it to handle
SIGUSR1 too, and gives the ranks the grace as its shutdown timeout). A rank's :class:`PreemptionWatch` only notes
the signal; after each step the ranks agree on it with one tiny all-reduce (a rank may see the signal a step after
another), so all stop after the same step. A second signal, or a grace period that runs out, ends the process at
once: every file the trainer writes is written atomically (temporary file, then rename), so none is left half
written, and the previous checkpoint stays loadable.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

from clusterlm.fileio import atomic_write_text

__all__ = ["PREEMPTED", "PREEMPTED_EXIT", "PREEMPTION_SIGNALS", "Preempted", "PreemptionWatch", "read_preempted",
           "record_preemption"]

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: "try again later" — a preempted run is resumed, not failed
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED = "preempted.json"  # in OUT: the step, checkpoint and signal of the last preemption (rank 0 writes it)


class Preempted(Exception):  # noqa: N818 - what happened, not an error: the run ends as asked
    """The run stopped on a preemption signal after checkpointing ``step`` to ``checkpoint``."""

    def __init__(self, out: str | os.PathLike, step: int, checkpoint: str | None, signal_name: str) -> None:
        self.out, self.step, self.checkpoint, self.signal_name = Path(out), int(step), checkpoint, signal_name
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (no step had finished)"
        super().__init__(f"preempted ({signal_name}) after step {step}: {where}; resume with: clusterlm train "
                         f"--config {self.out / 'train_config.yaml'} --resume")

    def record(self) -> dict[str, Any]:
        return {"step": self.step, "checkpoint": self.checkpoint, "signal": self.signal_name, "time": time.time()}


def read_preempted(out: str | os.PathLike, since: float = 0.0) -> Preempted | None:
    """The preemption rank 0 recorded in ``out`` at or after time ``since`` (None when there is none)."""
    try:
        rec = json.loads((Path(out) / PREEMPTED).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if float(rec.get("time", 0)) < since:
        return None
    return Preempted(out, rec["step"], rec.get("checkpoint"), rec.get("signal", "SIGTERM"))


class PreemptionWatch:
    """Notes SIGTERM / SIGUSR1 in this process (main thread; a no-op elsewhere) for ``grace`` seconds.

    The first signal sets :attr:`signal` and starts the grace timer; a second one, or the timer, ends the process
    at once with status 128 + the signal (as the default action would). :meth:`close` restores the handlers.
    """

    def __init__(self, grace: float) -> None:
        self.grace = float(grace)
        self.signal: int | None = None
        self._saved: dict[int, Any] = {}
        self._timer: threading.Timer | None = None
        if threading.current_thread() is threading.main_thread():
            self._saved = {sig: signal.signal(sig, self._handle) for sig in PREEMPTION_SIGNALS}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal is not None:  # the second signal: no more grace
            os._exit(128 + signum)
        self.signal = signum
        self._timer = threading.Timer(self.grace, os._exit, args=(128 + signum,))
        self._timer.daemon = True
        self._timer.start()

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else ""

    def agreed(self, device: torch.device, distributed: bool) -> bool:
        """True when any rank got a preemption signal (one all-reduce of one number when ``distributed``)."""
        flag = torch.tensor([0 if self.signal is None else int(self.signal)], dtype=torch.int32, device=device)
        if distributed:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.item() and self.signal is None:
            self.signal = int(flag.item())  # another rank's signal: stop with it (this rank's grace is the same)
        return bool(flag.item())

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved = {}


def record_preemption(exc: Preempted) -> None:
    """Rank 0: write ``OUT/preempted.json`` (what the launcher reads to report the preemption)."""
    atomic_write_text(exc.out / PREEMPTED, json.dumps(exc.record()) + "\n")
