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

Locks. :class:`FileLock` is the one lock implementation: an exclusive ``flock`` of a file (or a directory),
blocking or not, with the holder's record (pid, host, since) written into the file and a same-file check, so
a lock file that its releaser removed is never locked by mistake. The kernel drops a lock with its process, so
the file of a dead process locks nothing. :class:`DirLock` is the lock of a run directory
(``DIR/.clusterlm.lock``, held for the life of a run; a second run is refused with :class:`LockedError` naming
the holder's pid); the feature store claims its shards with :class:`FileLock` and serialises its manifest
updates with a blocking :class:`FileLock` of its directory. A temporary file of :func:`atomic_write` is locked
by its writer until it is renamed into place, so :func:`remove_temporaries` and :func:`remove_stale` (the
clean-ups after a killed run) take only what nobody holds. Where ``fcntl`` is missing (Windows) or the file
system refuses ``flock``, nothing is locked (one writer at a time is assumed).

Versioned JSON. :func:`read_versioned_json` reads a JSON object that names its format and version (plan.json,
a feature store's manifest.json) and refuses, in one line naming the file, one that is truncated, foreign or of
a version this clusterlm does not read.
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
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import IO, Any

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "LOCK_FILE", "STORAGE_ERRNOS", "DirLock", "FileLock", "LockedError", "StorageError", "append_text",
    "atomic_write", "atomic_write_bytes", "atomic_write_json", "atomic_write_text", "fsync_dir", "holder_record",
    "lock_holder", "read_versioned_json", "remove_stale", "remove_temporaries", "same_file", "storage_errno",
    "storage_error", "storage_errors",
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
        fd, tmp, lock = _temporary(path)
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
        os.replace(tmp, path)  # while the temporary file is still locked: no clean-up takes it meanwhile
    except BaseException as e:
        _remove(tmp)
        err = storage_error(e, path, needed=size, written=written)
        if err is e:
            raise
        raise err from e
    finally:
        if lock is not None:
            os.close(lock)
    fsync_dir(path.parent)
    return path


def _temporary(path: Path) -> tuple[int, str, int | None]:
    """A new temporary sibling of ``path``: (fd, name, lock fd).

    The lock fd (a duplicate that holds the file's ``flock``; None where nothing can be locked) keeps the file
    from the clean-ups of other processes (:func:`remove_stale`) until the caller closes it, after the rename.
    """
    while True:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        state = _flock(fd, blocking=False)
        if state is None:
            return fd, tmp, None
        if state and same_file(fd, tmp):
            try:
                return fd, tmp, os.dup(fd)
            except OSError:
                os.close(fd)
                _remove(tmp)
                raise
        os.close(fd)  # a clean-up took it for a dead writer's file and removes it: make another


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
    """Remove what interrupted :func:`atomic_write` calls left in ``directory`` (``.<name>.<random>.tmp``).

    A writer holds its temporary file's lock until the rename, so a live writer's file is left alone
    (:func:`remove_stale`).
    """
    removed = []
    with contextlib.suppress(OSError):
        for p in Path(directory).iterdir():
            if _TEMPORARY.match(p.name) and p.is_file() and remove_stale(p):
                removed.append(p)
    return removed


# ---------------------------------------------------------------------------------------------------
# Locks
# ---------------------------------------------------------------------------------------------------


class LockedError(RuntimeError):
    """The directory is held by another live process (``holder``: its pid and host, as it wrote them)."""

    def __init__(self, directory: str | os.PathLike, holder: str, message: str | None = None) -> None:
        super().__init__(message or f"{directory} is in use by another run ({holder})")
        self.directory = str(directory)
        self.holder = holder


def _flock(fd: int, *, blocking: bool, shared: bool = False) -> bool | None:
    """``flock`` ``fd``: True taken, False held elsewhere (only when not blocking), None where nothing can be
    locked (no ``fcntl``, or a file system that refuses ``flock``)."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB))
        return True
    except BlockingIOError:
        return False
    except OSError:  # pragma: no cover - a file system without flock (some network file systems)
        return None


def same_file(fd: int, path: str | os.PathLike) -> bool:
    """``fd`` is still the file at ``path`` (it was not removed or replaced since it was opened)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _record(raw: bytes) -> dict[str, Any]:
    """A lock file's holder record: ``{"pid", "host", "since"}`` (JSON; an older clusterlm wrote 'PID HOST')."""
    text = raw.decode(errors="replace").strip()
    try:
        record = json.loads(text)
    except ValueError:
        parts = text.split()
        if not parts or not parts[0].isdigit():
            return {}
        return {"pid": int(parts[0]), "host": parts[1] if len(parts) > 1 else None}
    return dict(record) if isinstance(record, dict) else {}


def holder_record(path: str | os.PathLike) -> dict[str, Any] | None:
    """``{"pid", "host", "since"}`` of the live process that holds ``path``'s lock ({} when it wrote none
    readable), None when no live process holds it (probes the lock; nothing is taken)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        if _flock(fd, blocking=False, shared=True) is not False:
            return None  # (closing the fd drops the probe's shared lock)
        return _record(os.pread(fd, 4096, 0))
    finally:
        os.close(fd)


def remove_stale(path: str | os.PathLike) -> bool:
    """Remove ``path`` unless a live process holds its lock (a writer's temporary file, a claim); True when removed.

    Where nothing can be locked every such file is stale. A file that was replaced meanwhile is left alone.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        if _flock(fd, blocking=False) is False or not same_file(fd, path):
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return True
    finally:
        os.close(fd)


class FileLock:
    """An exclusive ``flock`` of one file (or directory), held from :meth:`acquire` until :meth:`release`.

    The holder writes its record ``{"pid", "host", "since"}`` into the file (:func:`holder_record` reads it), so
    a process refused the lock can say who holds it. A file removed by its releaser between this process's open
    and its lock is not locked by mistake: the lock is taken again on the file now at the path (same-file
    check). Use as ``with FileLock(p):`` (waits) or ``FileLock(p).acquire()`` (does not).

    Args:
        path: the lock file (created if missing; its directory must exist) or, with ``directory=True``, an
            existing directory (locked as it is; no record).
        directory: lock the directory ``path`` itself.
        remove: :meth:`release` removes the file (a claim: the file means nothing once released).
    """

    def __init__(self, path: str | os.PathLike, *, directory: bool = False, remove: bool = False) -> None:
        self.path = Path(path)
        self.directory = directory
        self.remove = remove
        self._fd: int | None = None
        self._unlocked = False  # acquired where nothing can be locked

    def acquire(self, *, blocking: bool = False) -> bool:
        """Take the lock; ``blocking``: wait while another process holds it.

        Returns:
            True when this object holds it now (also where nothing can be locked); False when another live
            process holds it (only without ``blocking``).

        Raises:
            OSError: the file cannot be opened or created (its directory is missing or not writable).
        """
        if self.held:
            return True
        if fcntl is None:  # pragma: no cover - Windows
            self._unlocked = True
            return True
        flags = (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)) if self.directory else (os.O_RDWR | os.O_CREAT)
        while True:
            fd = os.open(self.path, flags, 0o644)
            state = _flock(fd, blocking=blocking)
            if state is False:
                os.close(fd)
                return False
            if state is None or self.directory or same_file(fd, self.path):
                break
            os.close(fd)  # removed by its releaser after we opened it: lock the file now there
        if not self.directory:
            with contextlib.suppress(OSError):  # who holds it, for the others' messages (a courtesy)
                info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
                os.ftruncate(fd, 0)
                os.pwrite(fd, info.encode(), 0)
        self._fd = fd
        return True

    def release(self) -> None:
        """Drop the lock (removing the file first when ``remove``); nothing happens when it is not held."""
        self._unlocked = False
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if self.remove and same_file(fd, self.path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)  # before unlocking: a waiter then finds the file gone and makes a new one
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    @property
    def held(self) -> bool:
        """This object holds the lock (or acquired it where nothing can be locked)."""
        return self._fd is not None or self._unlocked

    def __enter__(self) -> FileLock:
        self.acquire(blocking=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _describe(record: dict[str, Any]) -> str:
    """'pid 1234' (and 'on host X' when that is not this host) from a holder record."""
    if not record.get("pid"):
        return "pid unknown"
    host = record.get("host")
    where = f" on host {host}" if host and host != socket.gethostname() else ""
    return f"pid {record['pid']}{where}"


def lock_holder(directory: str | os.PathLike) -> str | None:
    """Who holds ``directory``'s lock ('pid 1234'), None when no live process does (it is not taken)."""
    record = holder_record(Path(directory) / LOCK_FILE)
    return None if record is None else _describe(record)


class DirLock:
    """An exclusive lock on ``directory`` (a :class:`FileLock` of ``DIR/.clusterlm.lock``), held until
    :meth:`release`.

    Use as ``with DirLock(out):`` or ``lock = DirLock(out).acquire()``. The directory is created if needed.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self._lock = FileLock(self.path)

    def acquire(self) -> DirLock:
        """Take the lock without waiting.

        Raises:
            LockedError: another live process holds it (the message names its pid).
        """
        if self._lock.held:
            return self
        with storage_errors(self.path):
            self.directory.mkdir(parents=True, exist_ok=True)
            taken = self._lock.acquire()
        if not taken:
            raise LockedError(self.directory, _describe(holder_record(self.path) or {}))
        return self

    def release(self) -> None:
        """Drop the lock (the file stays: removing it would race a process that just opened it)."""
        self._lock.release()

    @property
    def held(self) -> bool:
        return self._lock.held

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# ---------------------------------------------------------------------------------------------------
# Versioned JSON files
# ---------------------------------------------------------------------------------------------------


def read_versioned_json(path: str | os.PathLike, kind: str, supported: Collection[int], *, who: str, what: str,
                        fix: str, version_fix: str = "use the clusterlm that wrote it") -> tuple[dict[str, Any], int]:
    """A JSON object of format ``kind`` in a version this clusterlm reads, and that version.

    The object names its format and version (``{"format": kind, "version": N, ...}``); a format spelled
    ``"kind/N"`` without a version (the feature store's version 1) is version N.

    Args:
        path: the file.
        kind: the format it must name (``"clusterlm.plan"``).
        supported: the versions this clusterlm reads.
        who: what reads it, the start of every message (``"Plan.load"``).
        what: what the file is, for messages (``"clusterlm plan file"``).
        fix: what to do about a truncated or foreign file (a sentence).
        version_fix: what to do about a version not in ``supported`` (a clause).

    Returns:
        (the object, its version).

    Raises:
        FileNotFoundError: no such file (the caller knows what to make).
        ValueError: not JSON (truncated, empty, binary), not an object of format ``kind``, or a version not in
            ``supported``; one line naming the file.
    """
    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{who}: {path} is not valid JSON ({e}): it is truncated or not a {what}. {fix}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{who}: {path} is not a {what} (it holds a JSON {type(obj).__name__}, not an object "
                         f"of format {kind!r}). {fix}")
    found, version = obj.get("format"), obj.get("version")
    if isinstance(found, str) and version is None and found.startswith(f"{kind}/") and found[len(kind) + 1:].isdigit():
        found, version = kind, int(found[len(kind) + 1:])
    if found != kind:
        raise ValueError(f"{who}: {path} is not a {what} (its format is {found!r}, {kind!r} expected). {fix}")
    if type(version) is not int or version not in supported:
        readable = " or ".join(str(v) for v in sorted(supported))
        raise ValueError(f"{who}: {path} has format version {version!r}; this clusterlm reads version {readable}: "
                         f"{version_fix}.")
    return obj, version
