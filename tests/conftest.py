"""Test-wide setup.

TRITON_INTERPRET is read when a Triton kernel is decorated, so it must be set before any kernel
module is imported: here, at collection start. On CPU-only machines the interpreter runs the
Triton kernels with numpy (small fp32 shapes only).
"""

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# pytest-xdist runs as many workers as cores (`make test`): one OpenMP / torch thread per worker per core. The default
# (a thread per core in every worker) oversubscribes the cores, and OpenMP threads that spin-wait for a busy core
# made the in-process tests 2x slower in CPU time (test_kmeans.py on 2 workers: 90 -> 47 CPU-s). Set before torch and
# the native module load their OpenMP runtimes; the processes the tests start inherit it; a test that is about
# thread counts sets its own.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _XDIST_WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _XDIST_WORKERS)))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest puts tests/ on sys.path for this file; tests/clusterlm (a folder of tests, no __init__.py) would then be
# found as a namespace package `clusterlm` before the installed one, whose __init__ would never run. Import the real
# package first, with the test folders out of the path, so every test sees clusterlm as users do.
_TESTS = Path(__file__).resolve().parent
_saved_path = list(sys.path)
sys.path[:] = [p for p in sys.path if not Path(p or ".").resolve().is_relative_to(_TESTS)]
try:
    import clusterlm  # noqa: E402, F401
finally:
    sys.path[:] = _saved_path

import prebuild  # noqa: E402 - tests/prebuild.py, next to this file

# CI explores a fixed set of hypothesis examples (reproducible runs); local runs stay random so they
# keep finding new cases.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


# `make test` runs the modules on two pytest-xdist workers (--dist loadfile), each module whole on one worker, in
# collection order. The longest modules go first, so that the two workers finish together rather than one running
# a long module alone at the end (measured with --durations; the order changes no result, only the wall time).
# pytest-xdist hands the first module to the first worker and the second to the other: the first builds the demo
# data and tiny-llama (the session's `demo`, ~20 s), so the second must not need them, or that worker would wait.
LONGEST_MODULES = (
    "tests/test_docs.py",
    "tests/cluster_kernels/test_kmeans.py",  # needs no demo: runs while the first worker builds it
    "tests/reliability/test_signals.py",
    "tests/reliability/test_faults.py",  # beside test_signals: the reference run they share is made once (a lock)
    "tests/clusterlm/test_fsdp.py",
    "tests/clusterlm/test_train.py",
    "tests/clusterlm/test_launch_parity.py",
    "tests/clusterlm/test_compare.py",
    "tests/reliability/test_processes.py",
    "tests/clusterlm/test_real_model.py",
    "tests/cluster_kernels/test_distributed.py",
    "tests/reliability/test_disk_full.py",
    "tests/clusterlm/test_api.py",
    "tests/clusterlm/test_fsdp_integrations.py",
    "tests/clusterlm/test_demo.py",
)


def pytest_configure(config):
    """In the controlling process, before the workers start: the compiles of the compile gate and the sanitizer
    build, when the session selects them and a cache lacks them (tests/prebuild.py: on both cores, alone)."""
    if hasattr(config, "workerinput"):
        return
    if prebuild.selected(list(config.args), Path(str(config.rootpath))):
        prebuild.prebuild()


def pytest_collection_modifyitems(config, items):
    root = Path(str(config.rootpath))

    def rank(item) -> int:
        rel = Path(str(item.path)).relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        return LONGEST_MODULES.index(rel) if rel in LONGEST_MODULES else len(LONGEST_MODULES)

    items[:] = sorted(items, key=rank)  # stable: the order within a module and among the others stays


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    """A test, and the library code it runs, leaves torch's thread count as it found it: a leaked count (compare
    failing mid-way once left it at the world size) oversubscribes the cores for every later test and for a user's
    session."""
    before = torch.get_num_threads()
    yield
    after = torch.get_num_threads()
    if after != before:
        torch.set_num_threads(before)
        pytest.fail(f"torch.get_num_threads() is {after} after the test, {before} before: the code under test "
                    "changed it without restoring it")


@pytest.fixture(scope="session")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The demo data set built through the default root (``$CLUSTERLM_HOME/demo-v1``), once per test session:
    ``CLUSTERLM_HOME`` points at a session temporary directory while it is in use (the documentation's blocks and
    the spawned ranks inherit it), so nothing is written to ``~/.cache/clusterlm``. The pytest-xdist workers share
    it (their temporary directories' parent): the first builds, under the demo's lock, and the others reuse it."""
    from clusterlm.data.demo import demo_data

    base = tmp_path_factory.getbasetemp()
    home = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "clusterlm_home"
    home.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CLUSTERLM_HOME", str(home))
        yield demo_data(verbose=False)
