"""Crash-safe file writes: the one atomic-write helper every module uses, and the lock of a run directory.

A file is written to a temporary sibling (same directory, so the rename cannot cross file systems),
flushed and fsync'ed, renamed over the target with :func:`os.replace`, and the directory is fsync'ed so
the rename itself survives a power cut. Readers therefore see the old file or the new one, never half of
one; on any error the temporary file is removed and the target is untouched.

Running out of room. A write that fails for want of space or with an I/O error — ``ENOSPC`` (disk full),
``EDQUOT`` (quota), ``EFBIG`` (file size limit, ``ulimit -f``), ``EIO`` — raises :class:`StorageError`, an
:class:`OSError` with the same ``errno`` whose message says what ran out and where, e.g. ``no space left on
device writing runs/a/ckpt/step_0000040.pt (22,144,005 bytes (21.1 MiB) needed, 0 bytes free there): free
space there or choose another output directory``. :func:`storage_errors` turns such failures of any other
writer (a library that writes a directory itself) into the same error; :func:`append_text` appends a record
to a log and takes a cut-off record back out when the disk fills in the middle of it.

Run directories. :class:`DirLock` is an exclusive ``flock`` on ``DIR/.clusterlm.lock`` that names its holder
(pid and host) for the life of a run; a second run is refused with :class:`LockedError` naming that pid. The
kernel drops the lock with its process, so the file of a dead run locks nothing. Where ``fcntl`` is missing
(Windows) nothing is locked.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "LOCK_FILE", "STORAGE_ERRNOS", "DirLock", "LockedError", "StorageError", "append_text", "atomic_write",
    "atomic_write_bytes", "atomic_write_json", "atomic_write_text", "fsync_dir", "lock_holder",
    "remove_temporaries", "storage_errno", "storage_error", "storage_errors",
]

# errno -> (what ran out, what to do)
_STORAGE = {
    errno.ENOSPC: ("no space left on device", "free space there or choose another output directory"),
    errno.EDQUOT: ("disk quota exceeded", "free space within your quota or choose another output directory"),
    errno.EFBIG: ("file size limit exceeded (ulimit -f, or the file system's largest file)",
                  "raise the limit (ulimit -f unlimited) or choose another output directory"),
    errno.EIO: ("I/O error", "the disk or network file system failed; check it (dmesg) or choose another output "
                "directory"),
}
STORAGE_ERRNOS = frozenset(_STORAGE)
LOCK_FILE = ".clusterlm.lock"
# Temporary siblings of atomic_write: ".<name>.<random>.tmp".
_TEMPORARY = re.compile(r"^\..+\.tmp$")


# ---------------------------------------------------------------------------------------------------
# Out of space
# ---------------------------------------------------------------------------------------------------


class StorageError(OSError):
    """A write failed for want of space (ENOSPC, EDQUOT, EFBIG) or with an I/O error (EIO).

    ``errno`` is the original one, ``filename`` the file (or directory) being written; ``str()`` is the
    whole message (what ran out, where, how much was needed and is free, what to do).
    """

    def __init__(self, code: int, message: str, filename: str) -> None:
        super().__init__(code, message, filename)
        self.message = message

    def __str__(self) -> str:
        return self.message


def storage_errno(exc: BaseException) -> int | None:
    """The ENOSPC / EDQUOT / EFBIG / EIO behind ``exc``, None when it is another failure.

    Looks at messages of native writers (``... (os error 28)``) and, from an ``OSError`` or a
    ``RuntimeError``, down the exception chain (torch.save reports a failed write as a ``RuntimeError`` whose
    context is the ``OSError``); another exception (a ``ValueError`` raised while handling a full disk) is
    its own failure.
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return e.errno
        match = re.search(r"\(os error (\d+)\)|\[Errno (\d+)\]", str(e))
        if match and int(match.group(1) or match.group(2)) in STORAGE_ERRNOS:
            return int(match.group(1) or match.group(2))
        if not isinstance(e, (OSError, RuntimeError)):
            return None
        e = e.__cause__ or e.__context__
    return None


def _size(n: int) -> str:
    text = f"{n:,} bytes"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{text} ({n / scale:.1f} {unit})"
    return text


def _free(path: Path) -> int | None:
    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return None


def storage_error(exc: BaseException, path: str | os.PathLike, *, needed: int | None = None,
                  written: int | None = None) -> BaseException:
    """``exc`` as a :class:`StorageError` about writing ``path`` when it is one (else ``exc`` itself).

    Args:
        exc: what the write raised.
        path: the file (or directory) being written — the target, not a temporary sibling.
        needed: bytes the write needs, when known.
        written: bytes written before it failed, when ``needed`` is not known.
    """
    code = storage_errno(exc)
    if code is None or isinstance(exc, StorageError):
        return exc
    what, hint = _STORAGE[code]
    details = []
    if needed is not None:
        details.append(f"{_size(needed)} needed")
    elif written:
        details.append(f"more than {_size(written)} needed")
    free = _free(Path(path)) if code == errno.ENOSPC else None  # (a quota is not the disk's free space)
    if free is not None:
        details.append(f"{_size(free)} free there")
    where = f" ({', '.join(details)})" if details else ""
    return StorageError(code, f"{what} writing {path}{where}: {hint}", str(path))


@contextlib.contextmanager
def storage_errors(path: str | os.PathLike) -> Iterator[None]:
    """Turn a full disk (or an I/O error) inside the block into :class:`StorageError` naming ``path``."""
    try:
        yield
    except Exception as e:
        err = storage_error(e, path)
        if err is e:
            raise
        raise err from e


# ---------------------------------------------------------------------------------------------------
# Atomic writes
# ---------------------------------------------------------------------------------------------------


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


def _written(fd: int) -> int | None:
    try:
        return os.fstat(fd).st_size
    except OSError:
        return None


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any], *, size: int | None = None) -> Path:
    """Write ``path`` atomically through ``write(binary_file)``; returns the path.

    Args:
        path: the target file.
        write: writes the content to the binary file it is given.
        size: bytes the content takes, when known (for the message of a full disk).

    Raises:
        StorageError: the disk is full, a quota or the file size limit is reached, or an I/O error; it names
            ``path`` and what ran out. The target is unchanged and no temporary file is left behind.
        OSError: the directory is missing or not writable (likewise nothing is left behind).
    """
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise storage_error(e, path, needed=size) from e
    written = None
    try:
        f = os.fdopen(fd, "wb")
        try:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            written = _written(fd)
            with contextlib.suppress(OSError):
                f.close()  # flushes what is buffered; on a full disk that fails again
            raise
        f.close()  # network file systems report some write errors only here
        os.chmod(tmp, _CREATE_MODE)  # mkstemp creates 0600; a plan or checkpoint gets a normal file's mode
        os.replace(tmp, path)
    except BaseException as e:
        _remove(tmp)
        err = storage_error(e, path, needed=size, written=written)
        if err is e:
            raise
        raise err from e
    fsync_dir(path.parent)
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# What open() would give a new file: 0666 minus the umask (read once: os.umask is process-global).
_CREATE_MODE = 0o666 & ~_umask()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_write`)."""
    return atomic_write(path, lambda f: f.write(data), size=len(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically (see :func:`atomic_write`)."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 2, sort_keys: bool = True) -> Path:
    """Write ``obj`` as JSON (plus a newline) to ``path`` atomically (see :func:`atomic_write`)."""
    return atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n")


def append_text(path: str | os.PathLike, text: str) -> None:
    """Append UTF-8 ``text`` (e.g. one JSON record and its newline) to ``path``, all of it or none of it.

    Raises:
        StorageError: the disk filled (or an I/O error) while appending; what was appended is cut off again,
            so the file ends with its last whole record.
    """
    data = text.encode("utf-8")
    with open(path, "ab") as f:
        start = f.tell()
        try:
            f.write(data)
            f.flush()
        except BaseException as e:
            with contextlib.suppress(OSError, ValueError):
                f.truncate(start)  # a cut-off record would break every reader of the log
            err = storage_error(e, path, needed=len(data))
            if err is e:
                raise
            raise err from e


def remove_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Remove what an interrupted :func:`atomic_write` left in ``directory`` (``.<name>.<random>.tmp``).

    Only for a directory this process owns (under :class:`DirLock`): another writer's live temporary
    file looks the same.
    """
    removed = []
    with contextlib.suppress(OSError):
        for p in Path(directory).iterdir():
            if _TEMPORARY.match(p.name) and p.is_file():
                with contextlib.suppress(OSError):
                    p.unlink()
                    removed.append(p)
    return removed


# ---------------------------------------------------------------------------------------------------
# The lock of a run directory
# ---------------------------------------------------------------------------------------------------


class LockedError(RuntimeError):
    """The directory is held by another live process (``holder``: its pid and host, as it wrote them)."""

    def __init__(self, directory: str | os.PathLike, holder: str, message: str | None = None) -> None:
        super().__init__(message or f"{directory} is in use by another run ({holder})")
        self.directory = str(directory)
        self.holder = holder


def _describe(text: str) -> str:
    """'pid 1234' (and 'on host X' when that is not this host) from a lock file's 'PID HOST' line."""
    parts = text.split()
    if not parts:
        return "pid unknown"
    where = f" on host {parts[1]}" if len(parts) > 1 and parts[1] != socket.gethostname() else ""
    return f"pid {parts[0]}{where}"


def lock_holder(directory: str | os.PathLike) -> str | None:
    """Who holds ``directory``'s lock ('pid 1234'), None when no live process does (it is not taken)."""
    path = Path(directory) / LOCK_FILE
    if fcntl is None or not path.is_file():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _describe(os.pread(fd, 256, 0).decode(errors="replace"))
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


class DirLock:
    """An exclusive lock on ``directory`` (``flock`` of ``DIR/.clusterlm.lock``), held until :meth:`release`.

    Use as ``with DirLock(out):`` or ``lock = DirLock(out).acquire()``. The directory is created if needed.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> DirLock:
        """Take the lock without waiting.

        Raises:
            LockedError: another live process holds it (the message names its pid).
        """
        if fcntl is None or self._fd is not None:
            return self
        with storage_errors(self.path):
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace")
            os.close(fd)
            raise LockedError(self.directory, _describe(holder)) from None
        with contextlib.suppress(OSError):  # the name of the holder is a courtesy; the lock is the flock
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (the file stays: removing it would race a process that just opened it)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
