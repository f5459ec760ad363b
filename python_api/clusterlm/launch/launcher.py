"""Processes: the one torchrun launcher and the one process-group initialiser of ``train`` and ``select``.

Launching. ``clusterlm train --nproc N`` and ``clusterlm select --nproc N`` both run torch's own launcher
(``python -m torch.distributed.run``, what ``torchrun`` runs) in a subprocess::

    python -m torch.distributed.run --nproc-per-node N --standalone -m clusterlm.train ARGS
    python -m torch.distributed.run --nproc-per-node 8 --nnodes 2 --rdzv-backend c10d \\
        --rdzv-endpoint node0:29500 --rdzv-id run1 -m clusterlm.train ARGS        # on every node

(:func:`torchrun_command`, :func:`spawn`). One process on one node is ``python -m <module> ARGS``.

Supervision. :func:`spawn` runs torch's launcher in-process in a small agent (``python -c ... run_agent``,
the same arguments), whose ranks are forked from one preloaded fork server (:mod:`clusterlm.launch.ranks`: the
imports are paid once per run, not once per rank and restart): the agent gets SIGTERM when the launching process
dies (``PR_SET_PDEATHSIG`` on Linux, a watchdog thread elsewhere) and passes it on to its ranks;
every rank (:func:`exit_with_supervisor`, from :func:`init_distributed` and the trainer) exits within a fraction
of a second once its parent (the fork server, or torchrun run by hand), the agent or the launching process is
gone, so a SIGKILLed launcher leaves no rank training on unsupervised. Each rank runs in a session of its own, so
the ranks are tied to processes, not to a process group.

Preemption. SIGTERM, SIGUSR1 or SIGINT to the launching process, to the agent, to the ranks or to all of them is one
preemption (:mod:`clusterlm.launch.preemption`): the launching process passes its first signal on to the agent, the
agent to the ranks, and each waits for what it started; a second signal to the launching process kills the agent
and the ranks at once.

Failures. A rank that fails calls :func:`report_failure`: its one line (``clusterlm train: error (rank 1
of 2): ...``) and exit status (2: a user error, 1: a failure) go to the error file torchrun gives it
(``TORCHELASTIC_ERROR_FILE``, with a timestamp in nanoseconds). The agent reads the error files of all
failed ranks when the run fails and prints only the first failure's line (later ones are the others
noticing the lost peer, e.g. gloo's "connection closed"), instead of torchrun's ``ChildFailedError``
report; a crash's traceback is kept in a file the line names. The other ranks are stopped by the agent, so
none waits in a collective for a rank that is gone.

Joining. Every rank calls :func:`init_distributed`: under torchrun (:data:`TORCHRUN_ENV` set, world size
> 1) it joins the env:// process group — nccl on CUDA (this rank's device ``LOCAL_RANK``), gloo on CPU —
and returns where the process sits (:class:`DistInfo`); otherwise it returns rank 0 of 1 without a group.
:func:`is_main`, :func:`barrier`, :func:`all_gather_floats` and :func:`all_gather_objects` work with or
without a group.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from clusterlm.config.files import checksum
from clusterlm.launch import ranks as rank_start
from clusterlm.launch.environment import (
    AGENT_PID_ENV,
    LAUNCHER_PID_ENV,
    TORCHRUN_ENV,
    env_pid,
    restart_count,
    under_torchrun,
)
from clusterlm.launch.failures import first_failure
from clusterlm.launch.preemption import (
    PREEMPTED_EXIT,
    SHUTDOWN_MARGIN_S,
    PreemptionWatch,
    preemption_signals_blocked,
    unblock_preemption_signals,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "AGENT_PID_ENV", "CONFIG_SHA_ENV", "LAUNCHER_PID_ENV", "PACKAGE_ENTRY", "TORCHRUN_ENV", "DistInfo", "SpawnFailed",
    "checked_by_launcher",
    "all_gather_floats", "all_gather_objects", "barrier", "check_config_file",
    "exit_with_supervisor", "in_process_group", "init_distributed", "is_main", "pid_alive",
    "run_agent", "spawn", "spawn_with_config", "torchrun_command", "under_torchrun",
]

# The -m entry points of the two multi-process commands.
PACKAGE_ENTRY = "clusterlm"  # `python -m clusterlm <command>` on every rank (the package entry: no runpy warning)
# sha256 of the config file a launcher wrote for its ranks (clusterlm <command> --config FILE): checked by each rank
CONFIG_SHA_ENV = "CLUSTERLM_CONFIG_SHA256"
# The signals torchrun's agent handles and passes on to the ranks (they checkpoint on SIGTERM, SIGUSR1 and SIGINT).
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
TORCH_SHUTDOWN_TIMEOUT_S = 30  # torchrun's --shutdown-timeout when none is given
# How often a rank looks whether its supervisor is still there (seconds).
WATCH_INTERVAL = 0.2
# The agent: torch's launcher in this process (see run_agent); its arguments are torchrun's. It needs this module and
# torch's launcher only; importing the package costs nothing more (clusterlm/__init__.py loads its public names lazily).
_AGENT_CODE = ("import sys; from clusterlm.launch.exiting import run_and_exit; "
               "from clusterlm.launch.launcher import run_agent; run_and_exit(lambda: run_agent(sys.argv[1:]))")
_PR_SET_PDEATHSIG = 1


# ---------------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------------


def torchrun_command(
    argv: Sequence[str],
    nproc: int,
    *,
    module: str = PACKAGE_ENTRY,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "clusterlm",
    max_restarts: int = 0,
    shutdown_timeout: float | None = None,
) -> list[str]:
    """The ``python -m torch.distributed.run ... -m MODULE ARGV`` command line.

    Args:
        argv: the module's arguments.
        nproc: processes on this node.
        module: the ``-m`` module every rank runs (``clusterlm``, the package entry, with the command first).
        nnodes: nodes; > 1 needs ``rdzv_endpoint`` (c10d rendezvous), 1 runs ``--standalone``.
        rdzv_endpoint: ``host:port`` of the rendezvous.
        rdzv_id: run id shared by the nodes.
        max_restarts: restarts of every rank after a failure (torchrun's ``--max-restarts``: its elastic agent).
        shutdown_timeout: seconds the ranks get to finish after SIGTERM / SIGUSR1 before SIGKILL (torchrun's
            ``--shutdown-timeout``; the preemption grace); None: torchrun's default.

    Raises:
        ValueError: ``nnodes > 1`` without an endpoint.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(int(nproc)),
           "--signals-to-handle", FORWARDED_SIGNALS]  # SIGUSR1 too: SLURM's ahead-of-time preemption notice
    if max_restarts:
        cmd += ["--max-restarts", str(int(max_restarts))]
    if shutdown_timeout is not None:
        cmd += ["--shutdown-timeout", str(int(math.ceil(shutdown_timeout)))]
    if nnodes > 1:
        if not rdzv_endpoint:
            raise ValueError(
                f"{module.rsplit('.', 1)[-1]}: --nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (a node all others "
                "can reach), got none."
            )
        cmd += ["--nnodes", str(int(nnodes)), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
                "--rdzv-id", rdzv_id]
    else:
        cmd.append("--standalone")
    return [*cmd, "-m", module, *argv]


def spawn(
    module: str,
    argv: Sequence[str],
    nproc: int,
    *,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "clusterlm",
    env: Mapping[str, str] | None = None,
    max_restarts: int = 0,
    shutdown_timeout: float | None = None,
) -> int:
    """Run ``python -m MODULE ARGV`` on ``nproc`` processes of this node (and ``nnodes`` nodes); the exit status.

    More than one process (or node) goes through torch's launcher (the arguments of :func:`torchrun_command`),
    run by the agent (:func:`run_agent`), which dies with this process and reduces a failed run to the first
    failing rank's line; one process is a plain child process (it exits when this one dies,
    :func:`exit_with_supervisor`). ``OMP_NUM_THREADS`` defaults to 1 (torch's launcher would set it with a
    warning; the ranks set torch's thread count themselves). The first SIGTERM, SIGUSR1 or SIGINT to this process
    is passed on to the child (the agent passes it to the ranks: they checkpoint and exit), and this process waits
    for it; a second one, or ``shutdown_timeout`` + :data:`SHUTDOWN_MARGIN_S` seconds without the child gone, kills
    the child and its ranks and ends this process (:class:`~clusterlm.launch.preemption.PreemptionWatch`, main
    thread).

    Args:
        module: ``clusterlm`` (the package entry) with the command (``train``, ``select``) first in argv.
        argv: the module's arguments.
        nproc / nnodes / rdzv_endpoint / rdzv_id / max_restarts / shutdown_timeout: see :func:`torchrun_command`
            (restarts need torch's launcher, so ``max_restarts`` > 0 uses it for one process too).
        env: extra environment variables for the processes.

    Returns:
        The exit status: 0, the first failing rank's (2: a user error, 1: a failure), ``PREEMPTED_EXIT`` (75) when
        a preemption signal stopped the ranks, 128 + N for signal N.

    Raises:
        ValueError: ``nproc`` or ``nnodes`` below 1.
    """
    if nproc < 1 or nnodes < 1:
        raise ValueError(f"{module.rsplit('.', 1)[-1]}: --nproc and --nnodes must be >= 1, got {nproc} and {nnodes}.")
    full_env = {**os.environ, **(env or {})}
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env[LAUNCHER_PID_ENV] = str(os.getpid())
    full_env.pop(AGENT_PID_ENV, None)
    agent = not (nproc == 1 and nnodes == 1 and not max_restarts)
    if not agent:
        cmd = [sys.executable, "-m", module, *argv]
    else:
        torchrun = torchrun_command(argv, nproc, module=module, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint,
                                    rdzv_id=rdzv_id, max_restarts=max_restarts, shutdown_timeout=shutdown_timeout)
        cmd = [sys.executable, "-c", _AGENT_CODE, *torchrun[3:]]  # torchrun[:3]: python -m torch.distributed.run
    started: list[subprocess.Popen] = []
    grace = (TORCH_SHUTDOWN_TIMEOUT_S if shutdown_timeout is None else shutdown_timeout) + SHUTDOWN_MARGIN_S
    watch = PreemptionWatch(grace, window=0.0, forward=lambda signum: _signal_child(started, signum),
                            stop=lambda: _kill_child(started))
    try:
        # the agent starts with them blocked: it unblocks them once it handles them (run_agent); one that comes
        # here meanwhile is passed on when the block ends
        with preemption_signals_blocked() if agent else contextlib.nullcontext():
            started.append(subprocess.Popen(cmd, env=full_env))
        if watch.noted() and not agent:  # it came before the child was there to take it
            _signal_child(started, watch.signal)
        rc = started[0].wait()
    finally:
        watch.close()
    return 128 - rc if rc < 0 else rc  # killed by signal N: the shell's 128 + N


def _signal_child(started: list[subprocess.Popen], signum: int) -> None:
    if started and started[0].poll() is None:
        started[0].send_signal(signum)


def _kill_child(started: list[subprocess.Popen]) -> None:
    """SIGKILL the child and, first, the ranks under it (they would exit on their own within WATCH_INTERVAL)."""
    if not started:
        return
    for pid in rank_start.rank_pids(started[0].pid).values():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        started[0].kill()
    except OSError:
        pass


class SpawnFailed(RuntimeError):
    """The spawned processes failed with exit status ``code``; the failing rank's line is printed already."""

    def __init__(self, code: int, command: str = "clusterlm") -> None:
        super().__init__(f"{command}: the processes failed with exit status {code} (the failing rank's message is "
                         "above)")
        self.code = code


def spawn_with_config(command: str, config_path: Path, sha256: str, nproc: int, *,
                      env: Mapping[str, str] | None = None, **launch: Any) -> None:
    """Run ``clusterlm COMMAND --config CONFIG_PATH`` on ``nproc`` processes (:func:`spawn`); every rank reads its
    settings from that file after checking its sha256 (:func:`check_config_file`), never from a rebuilt command line.
    ``launch``: :func:`spawn`'s keyword options (``nnodes``, ``rdzv_endpoint``, ``max_restarts``, ...).

    Raises:
        SpawnFailed: a rank failed (its line is printed already); ``.code`` is the exit status.
    """
    rc = spawn(PACKAGE_ENTRY, [command, "--config", str(config_path)], nproc,
               env={**(env or {}), CONFIG_SHA_ENV: sha256}, **launch)
    if rc != 0:
        raise SpawnFailed(rc, f"clusterlm {command}")


def check_config_file(path: str | os.PathLike) -> None:
    """In a rank started by :func:`spawn_with_config`: the config file is the one its launcher wrote.

    Raises:
        ValueError: the file's sha256 differs from ``CLUSTERLM_CONFIG_SHA256`` (it changed after the launch).
    """
    expected = os.environ.get(CONFIG_SHA_ENV)
    if not expected:
        return
    actual = checksum(Path(path).read_text(encoding="utf-8"))
    if actual != expected:
        raise ValueError(f"--config {path} changed after the launcher wrote it (sha256 {actual[:12]}..., expected "
                         f"{expected[:12]}...); another run wrote to the same --out? Start the run again.")


# ---------------------------------------------------------------------------------------------------
# Supervision: ranks die with their launcher
# ---------------------------------------------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` runs (an exited process that is not yet reaped, a zombie, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc (macOS): kill(pid, 0) is all there is


_watching: set[str] = set()


def _watch(what: str, gone: Callable[[], bool], then: Callable[[], None]) -> None:
    """Run ``then()`` as soon as ``gone()`` (checked now and every WATCH_INTERVAL s, in a daemon thread)."""
    if what in _watching:
        return
    _watching.add(what)
    if gone():
        then()

    def loop() -> None:
        while not gone():
            time.sleep(WATCH_INTERVAL)
        then()

    threading.Thread(target=loop, name=f"clusterlm-{what}", daemon=True).start()


def exit_with_supervisor() -> bool:
    """In a rank: end this process as soon as whoever supervises it is gone; True when something is watched.

    The supervisor is the parent process when it is torch's launcher (under torchrun) or :func:`spawn`'s
    launching process (``CLUSTERLM_LAUNCHER_PID``), and that launching process itself; a process started
    otherwise (a shell's ``python -m clusterlm.train``, a ``nohup`` run) is left alone. Idempotent.
    """
    launcher = env_pid(LAUNCHER_PID_ENV)
    if not under_torchrun() and launcher is None:
        return False
    # The agent's ranks are children of its fork server (clusterlm.launch.ranks), which ends with the agent.
    agent, parent = (env_pid(AGENT_PID_ENV) if under_torchrun() else None), os.getppid()

    def gone() -> bool:
        return (os.getppid() != parent or (agent is not None and not pid_alive(agent))
                or (launcher is not None and not pid_alive(launcher)))

    _watch("supervisor", gone, lambda: os._exit(1))  # nobody waits for this status: the supervisor is gone
    return True


def _die_with_launcher(launcher: int) -> None:
    """The agent: SIGTERM to itself (its watch passes it on to the ranks, which exit anyway: their launcher is gone)
    when ``launcher`` is gone."""
    def gone() -> bool:
        return os.getppid() != launcher or not pid_alive(launcher)

    def stop() -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    if sys.platform.startswith("linux"):
        try:  # the kernel sends it the moment the parent exits
            if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0:
                if gone():  # it died before the request: nothing will be sent
                    stop()
                return
        except (OSError, AttributeError):  # pragma: no cover - no prctl in this libc
            pass
    _watch("launcher", gone, stop)  # pragma: no cover - not Linux


def _quiet_torchrun() -> None:
    """torch's launcher (and its multiprocessing) logs each rank it stops and its failure report; the agent reports
    instead."""
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith(("torch.distributed", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def run_agent(argv: Sequence[str]) -> int:
    """torch's launcher (``python -m torch.distributed.run ARGV``) in this process, as :func:`spawn` runs it, its ranks
    forked from a preloaded fork server (:func:`clusterlm.launch.ranks.launch`).

    It dies with the launching process (``CLUSTERLM_LAUNCHER_PID``), tells the ranks its pid (so they exit
    when it is gone), reports a failed run by the first failing rank's line (:func:`first_failure`), and on a
    preemption signal (blocked since :func:`spawn` started it, until it watches them) waits for the ranks to stop
    on it (:func:`clusterlm.launch.ranks.watch_agent_signals`; grace: ARGV's ``--shutdown-timeout``).

    Returns:
        The exit status: 0, the first failure's status, ``PREEMPTED_EXIT`` when a preemption stopped the ranks, or
        128 + N when signal N (SIGHUP, SIGQUIT) stopped the run.
    """
    watch = rank_start.watch_agent_signals(_shutdown_timeout(argv) + SHUTDOWN_MARGIN_S)
    try:
        launcher = env_pid(LAUNCHER_PID_ENV)
        if launcher is not None:
            _die_with_launcher(launcher)
        os.environ[AGENT_PID_ENV] = str(os.getpid())
        rank_start.start_fork_server()  # with the signals blocked; it preloads while torch's launcher is imported
        unblock_preemption_signals()  # one that came meanwhile is handled now
        if watch.noted():  # preempted before any rank started: nothing to wait for
            return PREEMPTED_EXIT
        return _launch(argv)
    finally:
        watch.close()
        # Its ranks have ended: the fork server would otherwise tear down its interpreter (torch, transformers: about
        # a second of a core, holding the run's output open) after this process is gone, or go on preloading.
        rank_start.stop_fork_server()


def _launch(argv: Sequence[str]) -> int:
    """:func:`run_agent` once its signals are watched: torch's launcher, quiet, and the run's exit status."""
    saved = os.environ.get("LOGLEVEL")
    os.environ["LOGLEVEL"] = "CRITICAL"  # read once, when torch's launcher modules make their loggers
    try:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher import api  # noqa: F401  (its loggers, made now, stay quiet)
        from torch.distributed.run import parse_args  # noqa: F401
    finally:
        if saved is None:
            os.environ.pop("LOGLEVEL", None)
        else:
            os.environ["LOGLEVEL"] = saved
    _quiet_torchrun()
    rank_start.adapt_torch_agent()
    try:
        rank_start.launch(argv)
    except ChildFailedError as e:
        if rank_start.agent_preempted():  # the ranks stopped on it (the launching process reports it)
            return PREEMPTED_EXIT
        line, code = first_failure(e.failures, rank_start.KILLED_STOPPED)
        print(line, file=sys.stderr, flush=True)
        return code
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


def _shutdown_timeout(argv: Sequence[str]) -> float:
    """torchrun's ``--shutdown-timeout`` in ARGV (:data:`TORCH_SHUTDOWN_TIMEOUT_S` when absent or unreadable)."""
    for i, arg in enumerate(argv[:-1]):
        if arg in ("--shutdown-timeout", "--shutdown_timeout"):
            try:
                return float(argv[i + 1])
            except ValueError:
                break
    return float(TORCH_SHUTDOWN_TIMEOUT_S)


def _torch() -> Any:
    """torch, imported on first use: the agent starts its fork server (which preloads torch) before it imports torch."""
    import torch

    return torch


# ---------------------------------------------------------------------------------------------------
# Joining
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits.

    Attributes:
        rank / world_size / local_rank: torch.distributed coordinates (0 / 1 / 0 without a process group).
        backend: the process group's backend ("gloo", "nccl"), None without a group.
        device: this rank's torch device (``cuda:LOCAL_RANK`` on GPUs).
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str | None
    device: torch.device = field(default_factory=lambda: _torch().device("cpu"))

    @property
    def distributed(self) -> bool:
        """A process group is initialised (collectives go to the other ranks)."""
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        """Global rank 0: the one that logs and writes files."""
        return self.rank == 0


def in_process_group() -> bool:
    """True once a torch.distributed process group is initialised in this process."""
    torch = _torch()
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _use_cuda(device: str) -> bool:
    torch = _torch()
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"init_distributed: device must be 'auto', 'cpu' or 'cuda', got {device!r}.")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("init_distributed: device 'cuda' but torch sees no CUDA device; use --device cpu or auto.")
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def init_distributed(backend: str | None = None, *, device: str = "auto", timeout: float | None = None) -> DistInfo:
    """Join the process group torchrun describes (env://), or run as a single process.

    Without ``WORLD_SIZE`` in the environment (or with ``WORLD_SIZE=1``) no group is initialised and rank 0
    of 1 is returned; an already initialised group is returned as it is. A rank of a launcher exits with it
    (:func:`exit_with_supervisor`).

    Args:
        backend: "gloo", "nccl", ... (default: nccl on CUDA, else gloo).
        device: "auto" (CUDA when available), "cpu" or "cuda". On CUDA the process's device is set to
            ``LOCAL_RANK``.
        timeout: seconds a collective may wait for the other ranks before it fails (the process group's
            timeout; None: torch's default, 30 minutes). A rank that hangs then ends the run in bounded time.

    Returns:
        :class:`DistInfo`.

    Raises:
        ValueError: ``WORLD_SIZE > 1`` but ``RANK``, ``MASTER_ADDR`` or ``MASTER_PORT`` is missing (launch
            with torchrun); nccl or ``device="cuda"`` without CUDA.
    """
    torch = _torch()
    dist = torch.distributed
    exit_with_supervisor()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = _use_cuda(device)
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("init_distributed: backend='nccl' needs CUDA, which is not available; use 'gloo'.")
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if in_process_group():
        return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dist.get_backend(), dev)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if world <= 1:
        return DistInfo(0, 1, 0, None, dev)
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ValueError(
            f"init_distributed: WORLD_SIZE={world} but {', '.join(missing)} not set; launch the processes with "
            "torchrun (it sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)."
        )
    backend = backend or ("nccl" if use_cuda else "gloo")
    extra: dict[str, Any] = {} if timeout is None else {"timeout": timedelta(seconds=float(timeout))}
    if restart_count():
        # A restarted worker group (--max-restarts) meets in a key space of its own: under the first attempt's keys
        # gloo finds the dead ranks' addresses and hangs connecting to them.
        extra |= {"store": _attempt_store(world), "rank": int(os.environ["RANK"]), "world_size": world}
    else:
        extra["init_method"] = "env://"
    dist.init_process_group(backend, device_id=dev if backend == "nccl" else None, **extra)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dist.get_backend(), dev)


def _attempt_store(world: int) -> Any:
    """The rendezvous store of this restart attempt: torchrun's store (its agent's, or rank 0's) under a prefix
    of its own (``clusterlm/attempt_<n>``)."""
    torch = _torch()
    dist = torch.distributed
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent and os.environ["RANK"] == "0")
    return dist.PrefixStore(f"clusterlm/attempt_{restart_count()}", store)


def is_main() -> bool:
    """True on rank 0, or when no process group is initialised (write plans, logs and reports only here)."""
    torch = _torch()
    return not in_process_group() or torch.distributed.get_rank() == 0


def barrier() -> None:
    """Wait for every rank (nothing to wait for without a process group)."""
    torch = _torch()
    if in_process_group():
        torch.distributed.barrier()


def all_gather_floats(values: Sequence[float], di: DistInfo) -> np.ndarray:
    """(world_size, len(values)) float64: every rank's values (this rank's alone without a group)."""
    torch = _torch()
    local = torch.tensor(list(values), dtype=torch.float64, device=di.device)
    if not di.distributed:
        return local.cpu().numpy()[None]
    gathered = [torch.empty_like(local) for _ in range(di.world_size)]
    torch.distributed.all_gather(gathered, local)
    return torch.stack(gathered).cpu().numpy()


def all_gather_objects(obj: Any, di: DistInfo) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order."""
    torch = _torch()
    if not di.distributed:
        return [obj]
    out: list[Any] = [None] * di.world_size
    torch.distributed.all_gather_object(out, obj)
    return out


def checked_by_launcher() -> bool:
    """This process is a rank started by :func:`spawn_with_config` on the checksummed config file its launcher
    checked (the command line verified the checksum, :func:`check_config_file`): its config is not checked again."""
    return under_torchrun() and bool(os.environ.get(CONFIG_SHA_ENV))
