"""The C++ K-means under AddressSanitizer and UBSan: memory errors and undefined behaviour cannot come back unnoticed.

The extension's CPU sources are built once with ``-fsanitize=address,undefined`` (build_sanitized.py, cached under
``build/sanitize-<hash>``; ~35 s on 2 cores, made before the session's workers start when missing: tests/prebuild.py)
and the case set of sanitizer_cases.py runs in one child process with libasan preloaded. Each case is one test
here; a crash fails the case it happened in (and names the cases it kept from running). A canary checks that the
harness really catches a heap overflow. Skipped where the compiler has no sanitizer runtime. Before the fix, four
cases crashed (heap-buffer-overflow in count_objects and kmeans_plusplus, a null reference in the restart selection)
and one accepted non-finite costs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import build_sanitized as bs  # noqa: E402 - the helper next to this file
import sanitizer_cases  # noqa: E402

WHY_NOT = bs.unsupported_reason()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no sanitizer build: {WHY_NOT}")

CANARY = r"""
#include <climits>
#define EXPORT extern "C" __attribute__((visibility("default")))
EXPORT int ck_canary_heap(int i) { int* a = new int[4](); int v = a[i]; delete[] a; return v; }
EXPORT int ck_canary_ub(int i) { return i + INT_MAX; }
"""


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The sanitized extension, and the outcome of every case run under it in one child process."""
    so, build_s = bs.build()
    proc = bs.run_cases(so)
    out = proc.stdout + proc.stderr
    outcome = {}
    running = None
    for line in proc.stdout.splitlines():
        if line.startswith("START "):
            running = line.split()[1]
        elif line.startswith("CASE "):
            name, status = line.split()[1:3]
            outcome[name] = line
            running = None if status == "ok" else running
    return {"so": so, "build_s": build_s, "proc": proc, "out": out, "outcome": outcome, "crashed_in": running,
            "report": bs.sanitizer_report(out)}


@pytest.mark.parametrize("name", list(sanitizer_cases.CASES))
def test_case_is_clean_under_sanitizers(sanitized, name):
    line = sanitized["outcome"].get(name)
    if line is None:
        where = sanitized["crashed_in"]
        detail = sanitized["report"] or sanitized["out"][-3000:]
        if where == name:
            pytest.fail(f"case {name} crashed the sanitized child:\n{detail}")
        pytest.fail(f"case {name} did not run: the child crashed in case {where}:\n{detail[:1500]}")
    assert line == f"CASE {name} ok", line + "\n" + sanitized["out"][-3000:]


def test_child_exits_cleanly_without_reports(sanitized):
    proc = sanitized["proc"]
    assert sanitized["report"] is None, sanitized["report"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(sanitized["outcome"]) == len(sanitizer_cases.CASES)


@pytest.mark.parametrize("fn, needle", [("ck_canary_heap", "canary.cpp:4"),  # ASan, or UBSan's object-size check
                                        ("ck_canary_ub", "signed integer overflow")])
def test_harness_catches_a_planted_bug(tmp_path, fn, needle):
    """The same flags, preload and options report a planted heap overflow / signed overflow (no silent pass)."""
    cxx = bs.compiler()
    src, lib = tmp_path / "canary.cpp", tmp_path / "canary.so"
    src.write_text(CANARY)
    subprocess.run([cxx, *bs.COMPILE_FLAGS, *bs.SAN_FLAGS, "-shared", str(src), "-o", str(lib)], check=True)
    code = f"import ctypes; ctypes.CDLL({str(lib)!r}).{fn}(4)"
    env = bs.child_env(cxx)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    report = bs.sanitizer_report(proc.stderr)
    assert proc.returncode != 0 and report is not None and needle in report, proc.stderr[-2000:]
