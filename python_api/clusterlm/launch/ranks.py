"""How the agent of ``clusterlm train|select --nproc N`` starts its ranks: forked from one preloaded fork server.

Every rank needs torch, transformers' model code (which imports torch's compiler stack) and this package: about 6
CPU-seconds of imports per process, more than a short run's training. torch's launcher can start the ranks as a
*function* under a :mod:`multiprocessing` start method instead of a command line; with ``forkserver`` one server
process, started by the agent and importing :data:`PRELOAD` once, forks every rank of every attempt (restarts
included), so each rank starts with those modules imported. The fork server is a fresh, single-threaded interpreter
that never touches CUDA (tests/reliability/test_rank_start.py checks the imports call no ``torch.cuda`` function),
the start method PyTorch documents as safe for CUDA in the children. Everything else is torch's launcher as
``torchrun`` runs it (:func:`launch`): rendezvous, restarts, signals, the error files.

A rank (:func:`rank_main`) then does what ``python -u -m clusterlm <command> --config FILE`` does, in a session of its
own as torchrun starts a command (a terminal's Ctrl-C reaches the launcher, which stops the ranks), named
``clusterlm-r<RANK>`` for ``top``/``ps -o comm`` (its command line is the fork server's), and with the exit handlers
of an ordinary interpreter run at the end (a forked process skips them).

``torchrun -m clusterlm ...`` run by hand starts its ranks as commands, as before.

Preemption in the agent (:mod:`clusterlm.launch.preemption`): torch's launcher would stop the ranks on the first
SIGTERM / SIGINT (and die on a second, leaving them to exit unsupervised, unsaved). Here the agent's
:class:`~clusterlm.launch.preemption.PreemptionWatch` (:func:`watch_agent_signals`) passes the first signal on to
every rank, now and any it starts later, and the agent waits for them to exit, without restarts; a rank that exits
with ``PREEMPTED_EXIT`` (it stopped on a signal only it got) is passed on the same way. The fork server and
multiprocessing's resource tracker start with these signals blocked (:func:`start_fork_server`): a group signal
must not end them (the ranks are the fork server's children and exit when it does).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import runpy
import signal
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from clusterlm.launch.environment import process_stopped
from clusterlm.launch.failures import first_failure
from clusterlm.launch.preemption import (
    PREEMPTED_EXIT,
    PREEMPTION_SIGNALS,
    PreemptionWatch,
    preemption_signals_blocked,
    unblock_preemption_signals,
)

__all__ = ["KILLED_STOPPED", "PRELOAD", "RANK_NAME", "START_METHOD", "adapt_torch_agent", "agent_preempted", "launch",
           "rank_main", "rank_pids", "start_fork_server", "stop_fork_server", "watch_agent_signals"]

# What the fork server imports before it forks a rank: all a rank of train or select imports (the CLI, the trainer
# and the selection with torch and transformers; model code pulls torch's compiler stack, ~2 s of it). The CLI module
# imports its commands lazily, so they are named here. ImportErrors are skipped.
PRELOAD = ("clusterlm.launch.ranks", "clusterlm.cli.commands", "clusterlm.training.loop",
           "clusterlm.selection.baselines", "clusterlm.selection.pipeline", "transformers.modeling_utils")
START_METHOD = "forkserver"
# A rank's process name: this prefix and its RANK (at most 15 bytes: Linux's limit)
RANK_NAME = "clusterlm-r"
_PR_SET_NAME = 15
KILLED_STOPPED: set[int] = set()  # pids of stopped ranks the agent in this process killed (never a run's cause)
# The agent in this process: its PreemptionWatch, torch's agent whose ranks run now, the ranks told of the preemption
_agent_watch: list[PreemptionWatch] = []
_running_agent: list[Any] = []
_told: set[int] = set()


def start_fork_server() -> None:
    """Start the fork server now (:func:`launch` does, before the rendezvous: the server imports :data:`PRELOAD`
    while the agent meets the other nodes), with unbuffered output in the ranks (``python -u``). Idempotent."""
    import multiprocessing
    from multiprocessing import forkserver, resource_tracker

    os.environ["PYTHONUNBUFFERED"] = "1"  # read when the server's interpreter starts; the ranks inherit its streams
    multiprocessing.get_context(START_METHOD).set_forkserver_preload(list(PRELOAD))
    # Both inherit the blocked preemption signals and keep them blocked: a group signal (Ctrl-C, SLURM's) leaves them
    # be. The resource tracker unblocks SIGINT and SIGTERM in this thread once it has started: blocked again here.
    # Its stderr is /dev/null: after a second signal killed this agent it would warn of the semaphores it cleans up.
    with preemption_signals_blocked(), _stderr_to_devnull():
        resource_tracker.ensure_running()
    with preemption_signals_blocked():
        forkserver.ensure_running()


def stop_fork_server() -> None:
    """SIGKILL this process's fork server, when it runs: the agent's, once its ranks have ended (still preloading
    after a preemption, or idle, it would keep the run's output streams open for a second or more after the run
    ended)."""
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@contextlib.contextmanager
def _stderr_to_devnull() -> Iterator[None]:
    """File descriptor 2 of this process is /dev/null while the block runs (what a process started meanwhile gets)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def launch(argv: Sequence[str]) -> None:
    """torch's launcher (``torchrun ARGV``, a ``-m MODULE ARGS`` command) with every rank forked from the fork server.

    What ``torch.distributed.run.run`` does, the entry point aside: ``--standalone`` is a c10d rendezvous on a free
    local port, and each rank runs :func:`rank_main` ``(MODULE, *ARGS)`` under the ``forkserver`` start method.

    Raises:
        ValueError: ARGV does not run a module (``-m``).
        torch's ``ChildFailedError`` / ``SignalException``: as ``torchrun`` raises them.
    """
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    args = parse_args(list(argv))
    if not args.module:
        raise ValueError(f"launch: the ranks run a module (-m MODULE ...), got {list(argv)}")
    if args.standalone:  # as torchrun: one node, a c10d rendezvous on a port the OS picks
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    # the preemption signals are the agent's own (watch_agent_signals), not torch's "stop the ranks now"
    preemption = {s.name for s in PREEMPTION_SIGNALS}
    args.signals_to_handle = ",".join(s for s in args.signals_to_handle.split(",") if s.strip() not in preemption)
    config, _, _ = config_from_args(args)
    config.start_method = START_METHOD
    start_fork_server()
    elastic_launch(config=config, entrypoint=rank_main)(args.training_script, *args.training_script_args)


def adapt_torch_agent() -> None:
    """Make torch's elastic agent (in this process) report every failed rank, spare no stopped one, say why it
    restarts, and wait for preempted ranks. Idempotent.

    Watching the ranks (``LocalElasticAgent._monitor_workers``): as soon as one rank has failed, a rank stopped by
    SIGSTOP is the hung one (the others timed out waiting for it) and gets SIGKILL at once, before torch's
    multiprocessing sends SIGTERM to the rest and waits for them (continued, the stopped rank would take that
    SIGTERM as a preemption and wait in a collective with the dead rank). The result then names every rank that
    failed, not only the one torch's multiprocessing saw first, so :func:`first_failure` can pick the cause; when a
    restart follows (``--max-restarts``), one line names the failure and the restart. Closing the ranks on a signal
    (``MultiprocessContext._close``), a stopped rank is continued, so that it can exit. Once the run is preempted
    (:func:`agent_preempted`, or a rank exited with ``PREEMPTED_EXIT``) the agent passes the signal on to every rank
    and reports the run as running until all have exited on their own (torch's multiprocessing would stop the others
    at the first exit, in the middle of rank 0's checkpoint); then it fails without a restart.
    """
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

    if getattr(LocalElasticAgent._monitor_workers, "_clusterlm", False):
        return
    monitor, start = LocalElasticAgent._monitor_workers, LocalElasticAgent._start_workers
    close = MultiprocessContext._close

    def closing(self: Any, *args: Any, **kwargs: Any) -> None:
        for pid in (self.pids().values() if self._pc is not None else ()):
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
        close(self, *args, **kwargs)

    def starting(self: Any, worker_group: Any) -> Any:
        if agent_preempted():  # the signal came before the ranks: none is started
            raise SystemExit(PREEMPTED_EXIT)
        _running_agent[:] = [self]
        return start(self, worker_group)

    def monitored(self: Any, worker_group: Any) -> Any:
        processes = _processes(self._pcontext)
        if _preempted(processes):
            self._remaining_restarts = 0  # a preempted run resumes later, by the user's or the scheduler's hand
            if any(p.exitcode is None for p in processes):
                return RunResult(state=WorkerState.HEALTHY)
        elif any(p.exitcode not in (None, 0) for p in processes):
            for p in processes:
                if p.exitcode is None and process_stopped(p.pid):
                    try:
                        os.kill(p.pid, signal.SIGKILL)
                        KILLED_STOPPED.add(p.pid)
                    except OSError:  # it ended in between
                        pass
        result = monitor(self, worker_group)
        if result.is_failed():
            result.failures = _all_failures(self._pcontext, worker_group) or result.failures
            remaining, total = self._remaining_restarts, worker_group.spec.max_restarts
            if remaining > 0 and result.failures:
                line, _ = first_failure(result.failures, KILLED_STOPPED)
                print(f"{line}; restarting every rank from the latest checkpoint (restart {total - remaining + 1} "
                      f"of {total})", file=sys.stderr, flush=True)
        return result

    monitored._clusterlm = True  # type: ignore[attr-defined]
    LocalElasticAgent._monitor_workers = monitored  # type: ignore[method-assign]
    LocalElasticAgent._start_workers = starting  # type: ignore[method-assign]
    MultiprocessContext._close = closing  # type: ignore[method-assign]


def watch_agent_signals(grace: float) -> PreemptionWatch:
    """The agent's :class:`PreemptionWatch` (main thread): the first preemption signal goes on to the ranks (and to
    any started later); a second one, or ``grace`` seconds without the ranks gone, kills them and ends the agent."""
    watch = PreemptionWatch(grace, forward=_tell_ranks, stop=_kill_ranks)
    _agent_watch[:] = [watch]
    return watch


def agent_preempted() -> bool:
    """True once the agent in this process got a preemption signal, or a rank exited with ``PREEMPTED_EXIT``."""
    return bool(_agent_watch) and _agent_watch[0].noted()


def _preempted(processes: list[Any]) -> bool:
    """Whether the run is preempted; when it is, every rank has been told (a rank that stopped on a signal only it
    got, exiting with PREEMPTED_EXIT, makes it SIGTERM for the others)."""
    if not _agent_watch:
        return False
    watch = _agent_watch[0]
    if not watch.noted() and any(p.exitcode == PREEMPTED_EXIT for p in processes):
        watch.trigger(signal.SIGTERM)
    if watch.signal is not None:
        _tell_ranks(watch.signal)
    return watch.noted()


def _rank_processes() -> list[Any]:
    return _processes(_running_agent[0]._pcontext) if _running_agent else []


def _tell_ranks(signum: int) -> None:
    """Pass preemption signal ``signum`` on to every rank not told yet (continued, should it be stopped)."""
    for p in _rank_processes():
        if p.pid is not None and p.pid not in _told:
            _told.add(p.pid)
            for sig in (signum, signal.SIGCONT):
                try:
                    os.kill(p.pid, sig)
                except OSError:  # it has exited
                    pass


def _kill_ranks() -> None:
    for p in _rank_processes():
        try:
            os.kill(p.pid, signal.SIGKILL)
        except (OSError, TypeError):
            pass


def _processes(pcontext: Any) -> list[Any]:
    """The rank processes (multiprocessing.Process, by local rank) of torch's process context; [] before a start."""
    pc = getattr(pcontext, "_pc", None)
    return list(pc.processes) if pc is not None else []


def _all_failures(pcontext: Any, worker_group: Any) -> dict[int, Any]:
    """Global rank -> torch's ``ProcessFailure`` for every rank that exited with an error (torch's multiprocessing
    reports only the first it saw); {} when there is nothing to read."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    global_rank = {w.local_rank: w.global_rank for w in worker_group.workers}
    return {global_rank[i]: ProcessFailure(local_rank=i, pid=p.pid, exitcode=p.exitcode,
                                           error_file=pcontext.error_files[i])
            for i, p in enumerate(_processes(pcontext)) if p.exitcode not in (None, 0) and i in global_rank}


def rank_main(module: str, *argv: str) -> None:
    """One rank: ``python -u -m MODULE ARGV`` in this (forked) process; returns on exit status 0.

    Raises:
        SystemExit: the module's non-zero exit status (torch's launcher reports the rank as failed with it).
    """
    import multiprocessing

    os.setsid()
    unblock_preemption_signals()  # blocked in the fork server; this rank handles them as a command would
    _name_process(f"{RANK_NAME}{os.environ.get('RANK', '')}")
    # multiprocessing made the fork server's start method this process's default: back to the platform's, as in a
    # rank started as a command (a lock or a DataLoader worker made here must not go through the fork server)
    multiprocessing.set_start_method(None, force=True)
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    finally:
        # multiprocessing ends a child with os._exit: without this, no atexit handler would run (log handlers'
        # flush, file locks' release, finalizers), unlike in a rank started as a command
        atexit._run_exitfuncs()


def _name_process(name: str) -> None:
    """The process's name in ``/proc/PID/comm`` (what ``top`` and ``ps -o comm`` show), on Linux; else nothing."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - no prctl in this libc
            pass


def rank_pids(pid: int) -> dict[int, int]:
    """RANK -> pid of the ranks running under process ``pid`` (``clusterlm train|select --nproc N``, its agent or its
    fork server), found by their names (:data:`RANK_NAME`) among its descendants in ``/proc``; {} where there is no
    /proc or no rank runs."""
    found, todo = {}, [pid]
    while todo:
        current = todo.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
        try:
            name = Path(f"/proc/{current}/comm").read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            continue
        if current != pid and name.startswith(RANK_NAME) and name[len(RANK_NAME):].isdigit():
            found[int(name[len(RANK_NAME):])] = current
    return found
