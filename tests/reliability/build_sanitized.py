"""An AddressSanitizer + UBSan build of ``cluster_kernels._C`` (its CPU sources) and a case set run under it.

``python tests/reliability/build_sanitized.py`` (``make sanitize``) builds the extension from the same sources
as setup.py (``csrc/cpu/*.cpp`` and ``csrc/bindings.cpp``, no CUDA) with ``-fsanitize=address,undefined``,
caches it under ``build/sanitize-<hash of sources and flags>/``, and runs every case of :data:`CASES` in one
child process with ``LD_PRELOAD`` of the compiler's libasan (Python itself is not instrumented) and
``ASAN_OPTIONS=detect_leaks=0`` (the interpreter leaks by design). A memory error or undefined behaviour aborts
the child with a sanitizer report; the child prints one ``CASE <name> <outcome>`` line per case it finished.

tests/reliability/test_kmeans_sanitizers.py drives the same functions from pytest.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SAN_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
# -g1: line tables (file:line in reports) at a fraction of -g's compile time. The pybind11 glue (bindings.cpp, 3/4
# of the build time) compiles at -O0, the kernels at -O1 (ASan's recommended level); both are instrumented.
COMPILE_FLAGS = ["-std=c++17", "-g1", "-fPIC", "-fopenmp", "-fvisibility=hidden", "-DCLUSTER_KERNELS_NO_CLONES"]
OPT_LEVEL = {"bindings.cpp": "-O0"}  # others: -O1
SAN_OPTIONS = {
    "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:halt_on_error=1:exitcode=99",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=98",
}
REPORT_MARKERS = ("ERROR: AddressSanitizer", "runtime error:", "SUMMARY: AddressSanitizer",
                  "SUMMARY: UndefinedBehaviorSanitizer")


def sources() -> list[Path]:
    return sorted((REPO / "csrc" / "cpu").glob("*.cpp")) + [REPO / "csrc" / "bindings.cpp"]


def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def runtime_library(cxx: str) -> str | None:
    """The compiler's shared libasan (what LD_PRELOAD needs), or None."""
    for name in ("libasan.so", "libclang_rt.asan-x86_64.so"):
        out = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        if out and os.path.isabs(out) and os.path.exists(out):
            return os.path.realpath(out)
    return None


def cxx_runtime(cxx: str) -> str | None:
    """The compiler's shared C++ runtime (libstdc++ / libc++), or None."""
    for name in ("libstdc++.so", "libc++.so"):
        out = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        if out and os.path.isabs(out) and os.path.exists(out):
            return os.path.realpath(out)
    return None


def _pybind_include() -> str:
    import pybind11  # noqa: PLC0415 - a build dependency, only needed here

    return pybind11.get_include()


def _key(cxx: str) -> str:
    h = hashlib.sha256()
    for src in sources() + sorted((REPO / "csrc" / "cpu").glob("*.h")) + sorted((REPO / "csrc" / "common").glob("*.h")):
        h.update(src.name.encode())
        h.update(src.read_bytes())
    h.update(" ".join([cxx, *SAN_FLAGS, *COMPILE_FLAGS, str(OPT_LEVEL), sys.version, _pybind_include()]).encode())
    return h.hexdigest()[:16]


def unsupported_reason() -> str | None:
    """Why no sanitizer build can be made here (None: it can)."""
    cxx = compiler()
    if cxx is None:
        return "no C++ compiler (g++ / clang++) found"
    if runtime_library(cxx) is None:
        return f"{cxx} has no shared AddressSanitizer runtime (libasan.so)"
    probe = subprocess.run([cxx, *SAN_FLAGS, "-x", "c++", "-fPIC", "-shared", "-o", os.devnull, "-"],
                           input="int f(int x){return x+1;}\n", capture_output=True, text=True)
    if probe.returncode != 0:
        return f"{cxx} rejects {' '.join(SAN_FLAGS)}: {probe.stderr.strip()[-300:]}"
    return None


def build(out_root: Path | None = None) -> tuple[Path, float]:
    """The sanitized extension (built once per source hash); returns its path and the build seconds (0: cached).

    Objects go to a private directory and the library is renamed into place, so concurrent sessions never see a
    half-written file.
    """
    cxx = compiler()
    assert cxx is not None
    root = (out_root or REPO / "build") / f"sanitize-{_key(cxx)}"
    so = root / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))
    if so.exists():
        return so, 0.0
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="objects-", dir=root))
    t0 = time.perf_counter()
    try:
        inc = ["-I", str(REPO / "csrc"), "-I", _pybind_include(), "-I", sysconfig.get_paths()["include"]]
        objs, procs = [], []
        for src in sources():  # one compiler per source, in parallel
            obj = work / (src.stem + ".o")
            objs.append(obj)
            opt = OPT_LEVEL.get(src.name, "-O1")
            cmd = [cxx, opt, *COMPILE_FLAGS, *SAN_FLAGS, *inc, "-c", str(src), "-o", str(obj)]
            procs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        for cmd, proc in procs:
            log = proc.communicate()[0]
            if proc.returncode != 0:
                raise RuntimeError(f"sanitizer build failed: {' '.join(cmd)}\n{log[-4000:]}")
        tmp = work / so.name
        link = [cxx, "-shared", "-fopenmp", *SAN_FLAGS, *map(str, objs), "-o", str(tmp)]
        proc = subprocess.run(link, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"sanitizer link failed: {' '.join(link)}\n{proc.stderr[-4000:]}")
        tmp.replace(so)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return so, time.perf_counter() - t0


def child_env(cxx: str) -> dict[str, str]:
    """The environment of a child process running sanitized code in the (uninstrumented) interpreter."""
    env = dict(os.environ, **SAN_OPTIONS)
    # libasan first; libstdc++ with it, so that ASan's __cxa_throw interceptor finds the real one (the interpreter
    # does not link libstdc++, and an exception thrown by the extension would abort in the interceptor).
    env["LD_PRELOAD"] = " ".join(filter(None, [runtime_library(cxx), cxx_runtime(cxx)]))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


def run_cases(so: Path, names: list[str] | None = None, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """Run the cases (all by default) under the sanitizers in a child process."""
    cxx = compiler()
    assert cxx is not None
    env = child_env(cxx)
    cmd = [sys.executable, "-c", f"import sanitizer_cases as c; c.main({str(so)!r}, {names!r})"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=str(REPO))


def sanitizer_report(text: str) -> str | None:
    """The first sanitizer report in a child's output, or None."""
    for marker in REPORT_MARKERS:
        at = text.find(marker)
        if at >= 0:
            return text[max(0, at - 200): at + 3000]
    return None


def main() -> int:
    why = unsupported_reason()
    if why:
        print(f"sanitizer build skipped: {why}")
        return 0
    so, secs = build()
    print(f"sanitized extension: {so} ({'cached' if secs == 0 else f'built in {secs:.1f} s'})")
    t0 = time.perf_counter()
    proc = run_cases(so)
    print(proc.stdout, end="")
    report = sanitizer_report(proc.stdout + proc.stderr)
    print(f"cases ran in {time.perf_counter() - t0:.1f} s, exit status {proc.returncode}")
    if report or proc.returncode != 0:
        print(report or proc.stderr[-4000:], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
