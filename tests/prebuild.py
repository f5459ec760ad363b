"""What a session on a fresh machine does once before its tests: the bytecode of the processes' imports, and the
suite's compiles, started in the background when the session starts, on the cores the tests leave idle.

Bytecode: :func:`warm_imports` (called by conftest.py in the controlling process before the workers start) imports
:data:`WARM_IMPORTS` once in a child process, unless their bytecode exists already (a developer's second session).

Two modules compile before they test: the compile gate (tests/cluster_kernels/test_aot_compile.py: every Triton
config of the gate for every target, ptxas's report of each) and the sanitizer build
(tests/reliability/test_kmeans_sanitizers.py: the C++ sources with ``-fsanitize=address,undefined``). Both cache what
they compile (``$CLUSTER_KERNELS_AOT_CACHE``; ``build/sanitize-<hash>``), so on a developer's machine only the first
session pays; on a fresh machine (CI) the session pays them in full: about 130 s of a core for the Triton compiles and
60 s for the sanitizer build, taken from the other worker's tests.

The suite's tests leave about a third of the cores idle (they wait on ranks, signals and timeouts). So the
controlling pytest process starts this file at the lowest priority (nice 19) when the session begins; it compiles into
the same caches, and the two modules run last (:data:`LAST_MODULES` in conftest.py). Their fixtures call
:func:`wait_for_prebuild` first: it raises the background job to normal priority, waits until it has ended, and the
fixture then compiles whatever is still missing itself (nothing, when the background job finished). The gate's checks
are unchanged: every compile it reads was made by the same code in this session or an earlier one, under the same key.

Run by hand it compiles the same set in the foreground::

    .venv/bin/python tests/prebuild.py
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODULES = ("tests/cluster_kernels/test_aot_compile.py", "tests/reliability/test_kmeans_sanitizers.py")
LOCK_ENV = "CLUSTER_KERNELS_TEST_PREBUILD_LOCK"  # the lock file the background job holds while it runs
PGID_ENV = "CLUSTER_KERNELS_TEST_PREBUILD_PGID"  # its process group (the compilers it starts are in it)


# What the suite's processes import (the workers, the doc runner, every rank and launcher of every run), in one
# process before the workers start. On a fresh machine no module has its bytecode yet (pip installs none) and
# matplotlib has no font cache: the first processes of a session would each compile torch, transformers and the
# rest for themselves, side by side (measured: import torch + transformers' model code + the trainer, 4.9 s with
# bytecode, 21.9 s without), and the session's first modules ran 2x slower than on a warm machine.
WARM_IMPORTS = ("torch", "transformers", "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
                "torch.distributed.run", "torch.distributed.elastic.agent.server.local_elastic_agent",
                "clusterlm.launch.ranks", "clusterlm.cli.commands", "clusterlm.training.loop",
                "clusterlm.selection.pipeline", "clusterlm.comparison.run", "clusterlm.integrations.hf",
                "clusterlm.integrations.trl", "matplotlib.pyplot", "hypothesis", "peft")
# Modules whose bytecode tells that the imports above ran in this environment before.
WARM_SENTINELS = ("transformers.modeling_utils", "torch.distributed.run", "matplotlib.pyplot")


def warm() -> bool:
    """Whether every sentinel module has its bytecode already (found without importing it)."""
    import importlib.util

    for name in WARM_SENTINELS:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None or not os.path.exists(importlib.util.cache_from_source(spec.origin)):
            return False
    return True


def warm_imports() -> None:
    """Import :data:`WARM_IMPORTS` once in a child process (writing their bytecode and matplotlib's font cache),
    unless a session did it before; a module that fails to import is left to the test that needs it."""
    if sys.flags.dont_write_bytecode or os.environ.get("PYTHONDONTWRITEBYTECODE") or warm():
        return
    code = ("import importlib\n"
            f"for name in {WARM_IMPORTS!r}:\n"
            "    try:\n        importlib.import_module(name)\n"
            "    except Exception:\n        pass\n")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=600, check=False)


def selected(args: list[str], root: Path) -> bool:
    """Whether pytest's ``args`` (paths, node ids) select one of :data:`MODULES` (an empty list selects all)."""
    if not args:
        return True
    for arg in args:
        path = Path(arg.split("::")[0])
        path = (path if path.is_absolute() else Path.cwd() / path).resolve()
        for module in MODULES:
            target = (root / module).resolve()
            if target == path or path in target.parents:
                return True
    return False


def start() -> subprocess.Popen | None:
    """Start the background compiles (nice 19, own process group) and export the lock and group to the workers.

    The lock is taken here, before the job starts, and handed to it: a worker that waits can never find it free
    before the job has begun. Returns the process, or None where no lock can be taken (no ``fcntl``)."""
    fd, lock = tempfile.mkstemp(prefix="clusterlm_prebuild_", suffix=".lock")
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], cwd=REPO, pass_fds=(fd,),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=lambda: os.nice(19))
    finally:
        os.close(fd)  # the child's copy of the open file holds the lock until it exits
    os.environ[LOCK_ENV], os.environ[PGID_ENV] = lock, str(proc.pid)
    return proc


def stop(proc: subprocess.Popen | None) -> None:
    """End the background job and its compilers (the session is over), and remove its lock file."""
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, 9)
    proc.wait()
    with contextlib.suppress(OSError, KeyError):
        os.unlink(os.environ.pop(LOCK_ENV))


def wait_for_prebuild() -> None:
    """Wait until the session's background compiles have ended (at once when none was started), at full priority."""
    lock = os.environ.get(LOCK_ENV)
    if not lock or not os.path.exists(lock):
        return
    with contextlib.suppress(OSError, ValueError):  # lowering a nice value needs privileges: then it only waits
        os.setpriority(os.PRIO_PGRP, int(os.environ[PGID_ENV]), 0)
    with open(lock) as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # granted when the job has exited (its process held the lock)
        fcntl.flock(f, fcntl.LOCK_UN)


def main() -> int:
    """Compile what the two modules compile, into their caches; a failure is left for the module to report."""
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path[:0] = [str(REPO / "tests" / "reliability"), str(REPO / "benchmarks"), str(REPO)]
    status = 0
    try:
        import build_sanitized

        if build_sanitized.unsupported_reason() is None:
            build_sanitized.build()
    except Exception:  # noqa: BLE001 - the sanitizer module builds again and reports the error itself
        status = 1
    try:
        import ptxas_report

        targets = [cc for cc in ptxas_report.TRITON_TARGETS if ptxas_report.triton_supports(cc)]
        workers = int(os.environ.get("CLUSTER_KERNELS_AOT_WORKERS", "2"))
        if targets:
            ptxas_report.run_jobs(ptxas_report.triton_jobs("gate", targets), workers)
        if ptxas_report.find_nvcc() is not None:
            ptxas_report.cuda_compiles(ptxas_report.CUDA_ARCHS, workers)
    except Exception:  # noqa: BLE001 - as above: the gate compiles what is missing and fails there
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
