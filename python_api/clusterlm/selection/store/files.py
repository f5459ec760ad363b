"""The feature store's files: their names and format version, and npy files written and checked by hand.

An npy header is written and read here (:func:`npy_header`, :func:`npy_layout`: the data must be all there), rows
are checksummed as stored (:func:`rows_sha256`), and ``features.npy`` is written with plain writes into a
preallocated file (:func:`write_all`, :func:`preallocate`), never through a writable memory map, so a full disk is an
``OSError`` naming the file (:func:`kept`), not a SIGBUS.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
from pathlib import Path
from typing import Any

import numpy as np

from clusterlm.fileio import StorageError

__all__ = [
    "BROKEN", "FEATURES", "FINALIZE", "MANIFEST", "READABLE", "SIGNALS", "SIGNALS_KEY", "STORE_FORMAT", "STORE_VERSION",
    "kept", "npy_header", "npy_layout", "preallocate", "rows_sha256", "signal_rows_sha256", "write_all",
]

STORE_FORMAT = "clusterlm.features"  # the on-disk name: kept when the module moved (stores written earlier read)
STORE_VERSION = 2  # 2: every shard record carries the sha256 of its rows; 1: "clusterlm.features/1", optional
READABLE = (1, 2)
MANIFEST = "manifest.json"
FEATURES = "features.npy"
FINALIZE = "features"  # the claim of the process assembling features.npy
# Per-example signals (clusterlm.selection.signals): float64 (rows, 2) per shard in shard_<index>.signals.npy, then
# signals.npy (N, 2) once complete; a shard record that has them carries their checksum under SIGNALS_KEY. Optional:
# records without it (an older clusterlm's) read as before, and the store then has no signals.
SIGNALS = "signals.npy"
SIGNALS_KEY = "signals_sha256"
_NO_FALLOCATE = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}
BROKEN = "is truncated or not a clusterlm feature file"


def npy_header(shape: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return buf.getvalue()


def npy_layout(path: Path) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, data offset) from an npy header, checking that the file holds all the data.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not an npy file, or shorter than its header says.
    """
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
        except (ValueError, OSError, EOFError, SyntaxError) as exc:
            raise ValueError(f"no valid npy header ({exc})") from None
        offset = f.tell()
        size = os.fstat(f.fileno()).st_size
    need = offset + int(np.prod(shape)) * dtype.itemsize
    if fortran or size < need:
        raise ValueError(f"{size} bytes, its header promises {need}")
    return tuple(shape), dtype, offset


def rows_sha256(rows: np.ndarray) -> str:
    """sha256 of float32 rows as stored (C order, little endian), the same for a shard and its block."""
    data = np.ascontiguousarray(rows, dtype="<f4")
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()


def signal_rows_sha256(rows: np.ndarray) -> str:
    """sha256 of float64 signal rows as stored (C order, little endian), the same for a shard and its block."""
    data = np.ascontiguousarray(rows, dtype="<f8")
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()


def write_all(fd: int, data: Any) -> None:
    view = memoryview(np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data).cast("B")
    step = 1 << 24
    while view:
        n = os.write(fd, view[:step])
        view = view[n:]


def preallocate(fd: int, size: int) -> None:
    """Reserve ``size`` bytes up front, so a full disk fails here; a no-op where the file system cannot."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:  # pragma: no cover - macOS, Windows
        return
    try:
        fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in _NO_FALLOCATE:
            raise


def kept(err: StorageError, target: Path) -> StorageError:
    """A full or failing disk while writing ``target`` (the StorageError of :func:`clusterlm.fileio.atomic_write`:
    what ran out, where, bytes needed), saying that the stored shards are kept."""
    kept = "; the partial file was removed and the stored shards are kept, so a rerun finishes the store"
    return StorageError(err.errno, f"FeatureStore: {err.message}{kept}.", str(target))
