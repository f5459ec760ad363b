"""The BLAS of the native distance tiles: numpy's bundled OpenBLAS, found at run time and handed to the extension.

The C++ K-means (csrc/cpu/distance_tiles.cpp) computes each tile of distances ``|x|^2 + |c|^2 - 2 x c^T`` with one
``cblas_?gemm`` call whose address it receives from here (csrc/cpu/blas.h). Why numpy's OpenBLAS:

* numpy is a dependency of the package, and its wheels ship an OpenBLAS with exported CBLAS symbols and thread
  controls (``numpy.libs/libscipy_openblas64_*.so``: ILP64, symbols ``scipy_cblas_sgemm64_`` ...), so the
  extension needs no BLAS at build time and still imports where there is none;
* its thread count can be pinned: the K-means runs one single-threaded GEMM per fixed block of rows on each
  OpenMP thread, so the products, hence the labels, do not depend on the number of threads (while a native call
  runs, :func:`one_thread` holds OpenBLAS at one thread and restores it afterwards);
* torch's MKL exports only Fortran symbols and its results may depend on memory alignment (MKL's CNR modes).

Where none is found (another numpy build, macOS Accelerate, ``CLUSTER_KERNELS_BLAS=0``) the extension runs its
portable tile loop instead: the same algorithm and guarantees, slower.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ENV = "CLUSTER_KERNELS_BLAS"  # "0" / "off": no BLAS, the portable tile loop
# (symbol prefix, suffix, 64-bit integers) of the OpenBLAS builds numpy ships or links.
_SYMBOLS = (("scipy_", "64_", True), ("scipy_", "", False), ("", "64_", True), ("", "", False))


@dataclass(frozen=True)
class OpenBlas:
    """One OpenBLAS library: its file, the GEMM addresses and its thread controls."""

    path: str
    sgemm: int
    dgemm: int
    ilp64: bool
    get_threads: Any  # int openblas_get_num_threads(void)
    set_threads: Any  # void openblas_set_num_threads(int)


def _candidates() -> list[Path]:
    """OpenBLAS files of numpy's wheel (Linux, Windows, macOS layouts), then any OpenBLAS already loaded."""
    root = Path(np.__file__).resolve().parent
    found: list[Path] = []
    for folder in (root.parent / "numpy.libs", root / ".dylibs"):
        if folder.is_dir():
            found += sorted(p for p in folder.iterdir() if "openblas" in p.name.lower())
    maps = Path("/proc/self/maps")
    if maps.exists():
        for line in maps.read_text().splitlines():
            path = line.split()[-1] if line.split() else ""
            if "openblas" in path.lower() and path.startswith("/") and Path(path) not in found:
                found.append(Path(path))
    return found


def _open(path: Path) -> OpenBlas | None:
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None
    for prefix, suffix, ilp64 in _SYMBOLS:
        try:
            sgemm = getattr(lib, f"{prefix}cblas_sgemm{suffix}")
            dgemm = getattr(lib, f"{prefix}cblas_dgemm{suffix}")
            get_threads = getattr(lib, f"{prefix}openblas_get_num_threads{suffix}")
            set_threads = getattr(lib, f"{prefix}openblas_set_num_threads{suffix}")
        except AttributeError:
            continue
        get_threads.restype = ctypes.c_int
        set_threads.argtypes = [ctypes.c_int]
        address = ctypes.cast(sgemm, ctypes.c_void_p).value, ctypes.cast(dgemm, ctypes.c_void_p).value
        return OpenBlas(str(path), int(address[0]), int(address[1]), ilp64, get_threads, set_threads)
    return None


@functools.cache
def openblas() -> OpenBlas | None:
    """numpy's OpenBLAS (or another loaded one with CBLAS symbols and thread controls), or None."""
    for path in _candidates():
        lib = _open(path)
        if lib is not None:
            return lib
    return None


def gemm() -> tuple[int, int, bool] | None:
    """``(cblas_sgemm address, cblas_dgemm address, ILP64)`` for the extension, or None (portable loop)."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    lib = openblas()
    return None if lib is None else (lib.sgemm, lib.dgemm, lib.ilp64)


_lock = threading.Lock()
_holders = 0
_saved = 1


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Hold OpenBLAS at one thread while a native K-means call runs (nested and concurrent calls share it)."""
    global _holders, _saved
    lib = openblas()
    if lib is None:
        yield
        return
    with _lock:
        if _holders == 0:
            _saved = int(lib.get_threads())
            lib.set_threads(1)
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                lib.set_threads(_saved)
