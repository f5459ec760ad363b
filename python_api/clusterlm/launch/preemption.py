"""Preemption: a SIGTERM, SIGUSR1 or SIGINT that reaches any process of a run (the launcher, its agent, the ranks,
or all of them at once) is one preemption: every rank finishes its step, rank 0 checkpoints it, and the run ends
with :data:`PREEMPTED_EXIT` and one line saying how to resume.

Who gets the signal. SLURM (time limit, preemption, ``scancel``, ``--signal=USR1@120``) signals every process of the
job step; a terminal's Ctrl-C the foreground process group (the launcher and its agent: each rank runs in a session
of its own); ``kill PID`` and Kubernetes one process. So each process of a run holds a :class:`PreemptionWatch`:

* ``clusterlm train|select --nproc N`` (:func:`clusterlm.launch.launcher.spawn`) passes the first signal to its
  agent, waits for the ranks and reports the preemption;
* the agent (:func:`clusterlm.launch.launcher.run_agent`) passes it to the ranks and waits for them to exit (it neither
  stops them at once nor restarts them); a rank that exits with :data:`PREEMPTED_EXIT` is a preemption too, passed
  on to the others. Its fork server and multiprocessing's resource tracker start with these signals blocked, so a
  group signal does not end them;
* a rank notes it; after each step the ranks agree on it with one tiny all-reduce (a rank may see the signal a
  step after another), so all stop after the same step.

A signal that reaches a process again within :data:`DUPLICATE_WINDOW_S` of its first is the same preemption (a
group signal reaches a rank directly and once more through its agent, torchrun or SLURM's step); a later one, or
a grace period (``--preemption-grace``) that runs out, ends the process at once (a launcher or agent kills its ranks
first): every file the trainer writes is written atomically (temporary file, then rename), so none is left half
written, and the previous checkpoint stays loadable. The launcher takes every signal after its first as the second
(nothing forwards to it), so a second Ctrl-C ends a run at once.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusterlm.fileio import atomic_write_text
from clusterlm.launch.environment import LAUNCHER_PID_ENV, env_pid, under_torchrun

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_GRACE_S", "DUPLICATE_WINDOW_S", "PREEMPTED", "PREEMPTED_EXIT", "PREEMPTION_SIGNALS",
           "SHUTDOWN_MARGIN_S", "Interrupted", "Preempted", "PreemptionWatch", "TrainPreempted", "interrupt",
           "launched", "preemption_signals_blocked", "read_preempted", "record_preemption",
           "unblock_preemption_signals"]

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: "try again later" — a preempted run is resumed, not failed
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
PREEMPTED = "preempted.json"  # in OUT: the step, checkpoint and signal of the last preemption (rank 0 writes it)
# Seconds after a process's first preemption signal within which another is the same one, passed on by a launcher
# (measured: a forwarded copy arrives within 0.05 s of the direct one, on 2 busy cores).
DUPLICATE_WINDOW_S = 1.0
DEFAULT_GRACE_S = 60.0  # the grace of a run without --preemption-grace (clusterlm select's ranks)
# Seconds an agent waits beyond its ranks' grace before it kills them (and a launching process beyond its agent's).
SHUTDOWN_MARGIN_S = 10.0


class Preempted(Exception):  # noqa: N818 - what happened, not an error: the run ends as asked
    """The run stopped on a preemption signal after saving its work; ``str()`` is the line saying how to resume.

    Args:
        stopped: where it stopped and what it kept ("after step 7: checkpoint run/ckpt/step_0000007.pt").
        resume: the command that continues it.
        signal_name: "SIGTERM", ...; "" when this process did not learn which.
    """

    def __init__(self, stopped: str, resume: str, signal_name: str = "") -> None:
        self.stopped, self.resume, self.signal_name = stopped, resume, signal_name
        super().__init__(f"preempted{f' ({signal_name})' if signal_name else ''} {stopped}; resume with: {resume}")


class TrainPreempted(Preempted):
    """Training stopped on a preemption signal after checkpointing ``step`` to ``checkpoint``."""

    def __init__(self, out: str | os.PathLike, step: int, checkpoint: str | None, signal_name: str) -> None:
        self.out, self.step, self.checkpoint = Path(out), int(step), checkpoint
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (no step had finished)"
        super().__init__(f"after step {step}: {where}",
                         f"clusterlm train --config {self.out / 'train_config.yaml'} --resume", signal_name)

    def record(self) -> dict[str, Any]:
        return {"step": self.step, "checkpoint": self.checkpoint, "signal": self.signal_name, "time": time.time()}


class Interrupted(BaseException):  # noqa: N818 - not an Exception: no ``except Exception`` of the work may take it
    """A preemption signal, raised at once in the main thread by :func:`interrupt` (the ``forward`` of a
    :class:`PreemptionWatch` over work that can stop anywhere and keeps what it stored, e.g. a selection)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signal_name = signal.Signals(signum).name


def interrupt(signum: int) -> None:
    """Raise :class:`Interrupted` (a :class:`PreemptionWatch`'s ``forward``: the first signal stops the work now)."""
    raise Interrupted(signum)


def read_preempted(out: str | os.PathLike, since: float = 0.0) -> TrainPreempted | None:
    """The preemption rank 0 recorded in ``out`` at or after time ``since`` (None when there is none)."""
    try:
        rec = json.loads((Path(out) / PREEMPTED).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if float(rec.get("time", 0)) < since:
        return None
    return TrainPreempted(out, rec["step"], rec.get("checkpoint"), rec.get("signal", "SIGTERM"))


def record_preemption(exc: TrainPreempted) -> None:
    """Rank 0: write ``OUT/preempted.json`` (what the launcher reads to report the preemption)."""
    atomic_write_text(exc.out / PREEMPTED, json.dumps(exc.record()) + "\n")


def launched() -> bool:
    """True in a process that a launcher may pass a signal on to (a rank of torchrun, the agent, spawn's child)."""
    return under_torchrun() or env_pid(LAUNCHER_PID_ENV) is not None


class PreemptionWatch:
    """Notes SIGTERM / SIGUSR1 / SIGINT in this process (main thread; a no-op elsewhere) for ``grace`` seconds.

    The first signal sets :attr:`signal`, starts the grace timer and calls ``forward(signum)`` (a launcher passes it
    on to what it started). Another one within ``window`` seconds is the same preemption and is ignored (default:
    :data:`DUPLICATE_WINDOW_S` in a process that a launcher started, 0 otherwise); a later one, or the timer, calls
    ``stop()`` (a launcher kills what it started) and ends the process at once with status 128 + the signal (as the
    default action would). :meth:`close` restores the handlers.
    """

    def __init__(self, grace: float, *, window: float | None = None, forward: Callable[[int], None] | None = None,
                 stop: Callable[[], None] | None = None) -> None:
        self.grace = float(grace)
        self.window = (DUPLICATE_WINDOW_S if launched() else 0.0) if window is None else float(window)
        self.signal: int | None = None  # the preemption: this process's first signal, or another rank's (agreed)
        self.received_at: float | None = None  # when this process got its first signal itself (monotonic)
        self._forward, self._stop = forward, stop
        self._saved: dict[int, Any] = {}
        self._timer: threading.Timer | None = None
        if threading.current_thread() is threading.main_thread():
            self._saved = {sig: signal.signal(sig, self._handle) for sig in PREEMPTION_SIGNALS}

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.received_at is None:
            self.trigger(signum)
        elif now - self.received_at > self.window:  # a second signal: no more grace
            self.end(signum)

    def trigger(self, signum: int) -> None:
        """What the first signal does (also for a preemption this process learns of otherwise): note it, start the
        grace timer, pass it on."""
        if self.received_at is not None:
            return
        self.received_at = time.monotonic()
        if self.signal is None:
            self.signal = signum
        self._timer = threading.Timer(self.grace, self.end, args=(signum,))
        self._timer.daemon = True
        self._timer.start()
        if self._forward is not None:
            self._forward(signum)

    def end(self, signum: int) -> None:
        """Now: ``stop()``, then exit with status 128 + ``signum``."""
        try:
            if self._stop is not None:
                self._stop()
        finally:
            os._exit(128 + signum)

    def noted(self) -> bool:
        """True once this process got a preemption signal (a method call: a handler that is pending runs first)."""
        return self.signal is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else ""

    def agreed(self, device: torch.device, distributed: bool) -> bool:
        """True when any rank got a preemption signal (one all-reduce of one number when ``distributed``)."""
        import torch  # here: the agent and the launching process import this module without torch

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


@contextmanager
def preemption_signals_blocked() -> Iterator[None]:
    """Block the preemption signals in this thread while the block runs (main thread; a no-op elsewhere): a process
    started meanwhile inherits the mask (the agent until it watches them; its fork server and resource tracker for
    good), and a signal that arrives meanwhile is delivered to this process when the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def unblock_preemption_signals() -> None:
    """Unblock the preemption signals in this thread (a process started with them blocked, once it handles them)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PREEMPTION_SIGNALS)
