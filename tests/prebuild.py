"""The suite's compiles, done once at the start of a session, before the workers start, when a cache lacks them.

Two modules compile before they test: the compile gate (tests/cluster_kernels/test_aot_compile.py: every Triton
config of the gate for sm_80 and sm_90, ptxas's report of each) and the sanitizer build
(tests/reliability/test_kmeans_sanitizers.py: the C++ sources with ``-fsanitize=address,undefined``). Both cache what
they compile (``$CLUSTER_KERNELS_AOT_CACHE``; ``build/sanitize-<hash>``), so on a developer's machine only the first
session pays; on a fresh machine (CI) about 90 s of a core for the Triton compiles and 60 s for the sanitizer build.

Where a session pays them matters on 2 cores. Inside their modules they ran beside the other worker's tests, and
compiles beside a test's two gloo ranks slow the ranks far more than their CPU share: a rank that waits on its
peer at every collective loses its turn to the compiler (measured on 2 cores: the README's blocks take 73 s alone,
96 s beside a SCHED_IDLE job and 125 s beside a nice-19 one). So the controlling pytest process runs this file
first, when the session selects either module, on both cores, with nothing else running; the modules then read
the caches (and compile whatever is still missing themselves, so running one alone works the same). A stamp in
``build/`` keyed by the sources (:func:`stamp`) lets later sessions skip even the cache check (~5 s of a core).

Run by hand it compiles the same set::

    .venv/bin/python tests/prebuild.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODULES = ("tests/cluster_kernels/test_aot_compile.py", "tests/reliability/test_kmeans_sanitizers.py")


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


def stamp() -> Path:
    """The file that says this checkout's compiles are in the caches: keyed by what they are made from (the kernel
    and C++ sources, the scripts that compile them, Triton's version) and by the compile cache's location.

    A compiler that changed under an unchanged stamp only means the modules compile what is missing themselves."""
    import hashlib
    from importlib import metadata

    h = hashlib.sha256(os.environ.get("CLUSTER_KERNELS_AOT_CACHE", "").encode())
    files = sorted([*(REPO / "csrc").rglob("*"), *(REPO / "cluster_kernels").glob("*.py"),
                    REPO / "benchmarks" / "ptxas_report.py", REPO / "tests" / "reliability" / "build_sanitized.py"])
    for f in files:
        if f.is_file():
            h.update(f.relative_to(REPO).as_posix().encode() + b"\0" + f.read_bytes())
    try:
        h.update(metadata.version("triton").encode())
    except metadata.PackageNotFoundError:
        pass
    return REPO / "build" / f"prebuild-{h.hexdigest()[:16]}.done"


def prebuild() -> None:
    """Run :func:`main` in a child process and wait for it, unless :func:`stamp` says an earlier session did (a
    failure is left for the modules to report)."""
    done = stamp()
    if done.exists():
        return
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve())], cwd=REPO, stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800, check=False)
    if proc.returncode == 0:
        done.parent.mkdir(parents=True, exist_ok=True)
        done.touch()


def main() -> int:
    """Compile what the two modules compile, into their caches (nothing when they hold it already)."""
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

        ptxas_report.gate_triton_rows()
        if ptxas_report.find_nvcc() is not None:
            ptxas_report.gate_cuda_records()
    except Exception:  # noqa: BLE001 - as above: the gate compiles what is missing and fails there
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
