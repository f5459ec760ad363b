"""Crash-safe file writes: the one atomic-write helper every module uses.

A file is written to a temporary sibling (same directory, so the rename cannot cross file systems),
flushed and fsync'ed, renamed over the target with :func:`os.replace`, and the directory is fsync'ed so
the rename itself survives a power cut. Readers therefore see the old file or the new one, never half of
one; on any error the temporary file is removed and the target is untouched.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_json", "atomic_write_text", "fsync_dir"]


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory, so renames into it are durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> Path:
    """Write ``path`` atomically through ``write(binary_file)``; returns the path.

    Raises:
        OSError: the directory is missing or not writable, or the disk is full; the target is unchanged and
            no temporary file is left behind.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_write`)."""
    return atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically (see :func:`atomic_write`)."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 2, sort_keys: bool = True) -> Path:
    """Write ``obj`` as JSON (plus a newline) to ``path`` atomically (see :func:`atomic_write`)."""
    return atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n")
