"""FeatureStore: per-example features on disk, written in shards, resumable, read out of core.

Layout of a store directory::

    manifest.json        format and version, feature dim, shard size, the producing configuration, per-shard records
                         (file, rows, sha256 of the shard's input data, sha256 of its float32 rows),
                         n_examples and ``complete`` when done
    shard_00000.npy      float32 (shard_size, dim) for examples [0, shard_size), ... (while running)
    shard_00000.claim    while a process computes shard 0: its claim (locked; pid and host inside)
    features.npy         float32 (n_examples, dim), written when the run completes; read as np.memmap

Crash safety: a shard is written to a temporary file, fsync'ed and renamed into place
(:func:`clusterlm._io.atomic_write`), and only then recorded in the manifest (itself replaced atomically).
A run killed at any point leaves complete shards and a manifest that lists only complete shards; a restart
skips them and recomputes the rest, so the result is identical to an uninterrupted run. The final
``features.npy`` is assembled shard by shard into a temporary file and renamed; shard files are removed only
after the manifest says ``complete``. Nothing half-written is ever listed.

Integrity: every shard record holds the sha256 of the shard's float32 rows (``sha256``), the same bytes
``features.npy`` holds at rows ``[index * shard_size, ...)``, so one checksum covers a row block in both
files. A shard is checked when it is read and when ``features.npy`` is assembled; ``features.npy`` is
checked block by block the first time :meth:`FeatureStore.features` opens it (once per file and store
object; ``verify=False`` skips it). A block that fails (a bit flip, a truncated or missing file) is
dropped from the manifest with a message naming it, and the next run of the featurizer on the store
recomputes just that block (blocks that fail in ``features.npy`` are re-listed as incomplete; their
sound neighbours are kept and read back from ``features.npy``). ``begin`` drops truncated or missing
shard files up front (a warning), so the same run recomputes them.

Versions: the manifest names its format and version (``"format": "clusterlm.features", "version": 2``;
read by :func:`clusterlm._io.read_versioned_json`, like plan.json). Version 2 is checksummed: a record without
its ``sha256`` fails its check like a bit flip (the block is dropped and recomputed). Stores of version 1
(``"format": "clusterlm.features/1"``, records that may lack ``sha256``) still read, with a warning that
their integrity cannot be checked; a resumed version-1 store stays version 1.

Full disks: ``features.npy`` is preallocated (``os.posix_fallocate``, where the file system has it) and
written with plain writes, never through a writable memory map, so a full disk is an ``OSError``
(ENOSPC / EDQUOT / EIO) naming the file and the bytes needed, not a SIGBUS; the temporary file is removed
and the shards are kept, so a rerun with space finishes the store.

Reads: ``features()`` returns a read-only ``np.memmap`` (nothing loaded until indexed), and
``iter_blocks`` streams fixed-size row blocks, so N may exceed memory.

Several writers: processes (ranks) may write disjoint shards of one store at the same time. Every
manifest update re-reads the manifest under an exclusive lock of the store directory (a blocking
:class:`clusterlm._io.FileLock`), so no writer's record is lost; a temporary file is locked by its writer
until it is renamed into place (:func:`clusterlm._io.atomic_write`), and the clean-up on ``begin`` removes
only temporary files and claims nobody holds (those of killed writers; :func:`clusterlm._io.remove_stale`). A
restarted writer therefore never disturbs one still running. ``reload()`` re-reads the manifest to see
what the others have finished.

Claims: so that two processes that fill the same shards (two ``select`` runs on one store) do every
shard once, a shard is claimed while it is computed: ``shard_<index>.claim``, a
:class:`clusterlm._io.FileLock` holding its holder's pid and host (the lock dies with the process, so a
killed writer's claim is free at once). :meth:`FeatureStore.claim` takes a claim if nobody holds it (False:
done, or a live process computes it); :meth:`wait_for_shards` waits for the shards others compute and
returns those left to do. :meth:`FeatureStore.shard_record` --
what the featurizers ask before computing a shard -- claims an unrecorded shard for its caller, and when
a live process holds it, waits for that process's record instead of computing it a second time.
``write_shard`` releases the claim, and ``finalize`` runs once (the others wait and return its result).
(Without ``fcntl``, or where the file system refuses ``flock``, there is no locking: claims always
succeed and one writer at a time is assumed.)
"""

from __future__ import annotations

import contextlib
import copy
import errno
import hashlib
import io
import json
import logging
import os
import socket
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from clusterlm._io import (
    FileLock,
    StorageError,
    atomic_write,
    atomic_write_bytes,
    holder_record,
    read_versioned_json,
    remove_stale,
)

__all__ = ["STORE_FORMAT", "STORE_VERSION", "FeatureStore"]

STORE_FORMAT = "clusterlm.features"
STORE_VERSION = 2  # 2: every shard record carries the sha256 of its rows; 1: "clusterlm.features/1", optional
_READABLE = (1, 2)
_MANIFEST = "manifest.json"
_FEATURES = "features.npy"
_FINALIZE = "features"  # the claim of the process assembling features.npy
_LOG = logging.getLogger(__name__)
_NO_FALLOCATE = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}
_BROKEN = "is truncated or not a clusterlm feature file"


# ---- npy files: header, layout, checksums, plain writes ----------------------------------------------


def _npy_header(shape: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return buf.getvalue()


def _npy_layout(path: Path) -> tuple[tuple[int, ...], np.dtype, int]:
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


def _rows_sha256(rows: np.ndarray) -> str:
    """sha256 of float32 rows as stored (C order, little endian), the same for a shard and its block."""
    data = np.ascontiguousarray(rows, dtype="<f4")
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()


def _write_all(fd: int, data: Any) -> None:
    view = memoryview(np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data).cast("B")
    step = 1 << 24
    while view:
        n = os.write(fd, view[:step])
        view = view[n:]


def _preallocate(fd: int, size: int) -> None:
    """Reserve ``size`` bytes up front, so a full disk fails here; a no-op where the file system cannot."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:  # pragma: no cover - macOS, Windows
        return
    try:
        fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in _NO_FALLOCATE:
            raise


def _kept(err: StorageError, target: Path) -> StorageError:
    """A full or failing disk while writing ``target`` (the StorageError of :func:`clusterlm._io.atomic_write`:
    what ran out, where, bytes needed), saying that the stored shards are kept."""
    kept = "; the partial file was removed and the stored shards are kept, so a rerun finishes the store"
    return StorageError(err.errno, f"FeatureStore: {err.message}{kept}.", str(target))


class FeatureStore:
    """A directory of feature shards with a manifest; resumable and readable out of core.

    Args:
        path: directory (created on first write).
        shard_size: examples per shard; a killed run loses at most one shard of work. Must match the
            value the store was created with.

    Raises:
        ValueError: non-positive ``shard_size``.
    """

    def __init__(self, path: str | os.PathLike, *, shard_size: int = 1024) -> None:
        if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
            raise ValueError(f"FeatureStore: shard_size must be a positive int, got {shard_size!r}.")
        self.path = Path(path)
        self.shard_size = shard_size
        self._manifest: dict[str, Any] | None = None
        self._claims: dict[int | str, FileLock] = {}  # claim -> its held lock
        self._implicit: int | None = None  # the shard shard_record claimed for its caller
        self._verified: tuple | None = None  # stat of the features.npy whose blocks were checked
        self._warned_unchecked = False
        self._writer = False  # begin() was called: shard_record claims for its caller

    def __repr__(self) -> str:
        state = "complete" if self.complete else f"{len(self._shards())} shard(s)" if self.exists else "empty"
        return f"FeatureStore({str(self.path)!r}, shard_size={self.shard_size}, {state})"

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def close(self) -> None:
        """Release every claim this object holds (also done when it is garbage-collected or the process ends)."""
        for key in list(self._claims):
            self.release(key)

    # ---- manifest ---------------------------------------------------------------------------------

    @property
    def manifest_path(self) -> Path:
        return self.path / _MANIFEST

    @property
    def exists(self) -> bool:
        """True when the directory holds a manifest."""
        return self.manifest_path.is_file()

    def reload(self) -> FeatureStore:
        """Forget the cached manifest, so the next read sees what other processes have written."""
        self._manifest = None
        return self

    def manifest(self) -> dict[str, Any]:
        """A copy of the manifest: format, version, dim, dtype, shard_size, config, shards (index -> record:
        file, rows, data_sha256, sha256), n_examples and complete.

        Read once and cached (:meth:`reload` forgets it, to see what other processes wrote).

        Raises:
            FileNotFoundError: nothing was written to this store yet.
            ValueError: manifest.json is truncated, not a feature store's or of a version this clusterlm does not
                read.
        """
        return copy.deepcopy(self._read_manifest())

    def _read_manifest(self) -> dict[str, Any]:
        if self._manifest is None:
            try:
                manifest, _ = read_versioned_json(
                    self.manifest_path, STORE_FORMAT, _READABLE, who="FeatureStore", what="clusterlm feature store",
                    fix="Delete the directory to start over.",
                    version_fix="use the clusterlm that wrote it, or delete the directory to start over",
                )
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"FeatureStore: no manifest at {self.manifest_path}; nothing was written to this store yet."
                ) from None
            self._manifest = manifest
        return self._manifest

    def _checksummed(self) -> bool:
        """Version 2 or later: every shard record must carry its sha256."""
        return self._read_manifest().get("version", 1) >= 2

    def _locked(self) -> FileLock:
        """The lock of the store directory, for a manifest read-modify-write (``with self._locked():`` waits)."""
        return FileLock(self.path, directory=True)

    def _write_manifest(self, manifest: dict[str, Any]) -> None:
        atomic_write_bytes(self.manifest_path, json.dumps(manifest, indent=1, sort_keys=True).encode())
        self._manifest = manifest

    def _shards(self) -> dict[str, Any]:
        return self._read_manifest()["shards"]

    @property
    def complete(self) -> bool:
        """True when ``features.npy`` holds every example."""
        return self.exists and bool(self._read_manifest().get("complete"))

    @property
    def dim(self) -> int:
        return int(self._read_manifest()["dim"])

    @property
    def config(self) -> dict[str, Any]:
        return dict(self._read_manifest()["config"])

    @property
    def n_examples(self) -> int | None:
        """Number of examples once complete, else None."""
        n = self._read_manifest().get("n_examples")
        return None if n is None else int(n)

    def rows_done(self) -> int:
        """Examples in the shards the manifest lists (every writer's together; all of them once complete)."""
        if not self.exists:
            return 0
        if self.complete:
            return self.n_examples or 0
        return sum(int(r["rows"]) for r in self._shards().values())

    def stored_shard_size(self) -> int:
        """The shard size this store was created with (read from its manifest)."""
        return int(self._read_manifest()["shard_size"])

    # ---- writing ----------------------------------------------------------------------------------

    def begin(self, *, dim: int, config: dict[str, Any]) -> set[int]:
        """Create the store, or check that an existing one was produced by the same configuration.

        Shards whose files are missing or truncated are dropped from the manifest (with a warning), so the
        run recomputes them.

        Args:
            dim: feature dimension.
            config: JSON-serialisable description of what produces the features (model fingerprint,
                layers, projection, ...); a resumed run must match it exactly.

        Returns:
            Indices of shards already complete (skip them).

        Raises:
            ValueError: the existing store has another dim, shard size or configuration (names the field).
        """
        config = json.loads(json.dumps(config))  # normalise tuples etc. to what the manifest stores
        self.path.mkdir(parents=True, exist_ok=True)
        with self._locked():
            self.reload()
            done = self._begin_locked(dim, config)
        self._writer = True
        return done

    def _begin_locked(self, dim: int, config: dict[str, Any]) -> set[int]:
        if not self.exists:
            self._write_manifest(
                {
                    "format": STORE_FORMAT,
                    "version": STORE_VERSION,
                    "dim": int(dim),
                    "dtype": "float32",
                    "shard_size": self.shard_size,
                    "config": config,
                    "shards": {},
                    "n_examples": None,
                    "complete": False,
                }
            )
            return set()
        manifest = self._read_manifest()
        fix = "use another directory, or delete this one to start over"
        if manifest["shard_size"] != self.shard_size:
            raise ValueError(
                f"FeatureStore: {self.path} was written with shard_size={manifest['shard_size']}, "
                f"this run uses {self.shard_size}; pass shard_size={manifest['shard_size']} or {fix}."
            )
        if manifest["dim"] != int(dim):
            raise ValueError(
                f"FeatureStore: {self.path} holds features of dim {manifest['dim']}, this run produces "
                f"dim {dim}; {fix}."
            )
        if manifest["config"] != config:
            keys = sorted(set(manifest["config"]) | set(config))
            diff = [k for k in keys if manifest["config"].get(k) != config.get(k)]
            shown = "; ".join(f"{k}: stored {manifest['config'].get(k)!r} vs now {config.get(k)!r}" for k in diff[:3])
            raise ValueError(f"FeatureStore: {self.path} was written by another configuration ({shown}); {fix}.")
        self._cleanup(manifest)
        if not manifest.get("complete"):
            manifest = self._drop_unreadable(manifest)
        return {int(i) for i in manifest["shards"]}

    def _drop_unreadable(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Drop the records whose files are missing or shorter than their rows (under the directory lock)."""
        bad: dict[int, str] = {}
        layouts: dict[str, Any] = {}
        for key, rec in manifest["shards"].items():
            name = rec.get("file") or self._shard_path(int(key)).name
            if name not in layouts:
                try:
                    layouts[name] = _npy_layout(self.path / name)
                except FileNotFoundError:
                    layouts[name] = "is missing"
                except (ValueError, OSError) as exc:
                    layouts[name] = f"{_BROKEN} ({exc})"
            layout = layouts[name]
            if isinstance(layout, str):
                bad[int(key)] = layout
                continue
            shape, dtype, _ = layout
            start = int(key) * self.shard_size if name == _FEATURES else 0
            if dtype != np.float32 or len(shape) != 2 or shape[1] != manifest["dim"] or shape[0] < start + rec["rows"]:
                want = f"{rec['rows']} rows of dim {manifest['dim']}"
                bad[int(key)] = f"{_BROKEN} (shape {shape}, {dtype}; expected {want})"
        if not bad:
            return manifest
        for i, problem in sorted(bad.items()):
            warnings.warn(
                f"FeatureStore: shard {i} of {self.path} {problem}; dropped it: this run will recompute it.",
                stacklevel=4,
            )
        return self._drop_records(manifest, bad)

    def _drop_records(self, manifest: dict[str, Any], bad: Iterable[int]) -> dict[str, Any]:
        """The manifest without the records ``bad`` (written; their shard files removed). Under the dir lock."""
        manifest = dict(manifest, shards=dict(manifest["shards"]))
        for i in bad:
            rec = manifest["shards"].pop(str(i), None) or {}
            if rec.get("file", _FEATURES) != _FEATURES:
                (self.path / rec["file"]).unlink(missing_ok=True)
        self._write_manifest(manifest)
        return manifest

    def _cleanup(self, manifest: dict[str, Any]) -> None:
        """Remove what a killed run may have left: temporary files and claims nobody holds, shards of a
        completed store. Runs under the directory lock."""
        for p in [*self.path.glob("*.tmp"), *self.path.glob("*.claim")]:
            remove_stale(p)  # a live writer holds its file's lock
        if manifest.get("complete"):
            for p in self.path.glob("shard_*.npy"):
                p.unlink(missing_ok=True)

    def _claim_path(self, key: int | str) -> Path:
        return self.path / (f"shard_{key:05d}.claim" if isinstance(key, int) else f"{key}.claim")

    def claim(self, index: int) -> bool:
        """Claim shard ``index`` for this process to compute it (released by ``write_shard`` or :meth:`release`).

        Returns:
            True when this object now holds the claim and the shard is not stored yet (or another object of
            this process holds it: a process never waits for itself); False when it is stored (or the store
            is complete) or another live process holds the claim. The claim of a process that died is free.
        """
        index = int(index)
        if self.reload().complete or str(index) in self._shards():
            return False
        if index in self._claims:
            return True
        if not self.path.is_dir():
            return True
        lock = FileLock(self._claim_path(index), remove=True)
        if not lock.acquire():
            who = holder_record(self._claim_path(index)) or {}
            return who.get("pid") == os.getpid() and who.get("host") == socket.gethostname()
        self._claims[index] = lock
        if self.reload().complete or str(index) in self._shards():  # finished while we took the lock
            self.release(index)
            return False
        return True

    def release(self, index: int | str) -> None:
        """Give up a claim this object holds (nothing happens when it holds none)."""
        key = int(index) if not isinstance(index, str) else index
        lock = self._claims.pop(key, None)
        if self._implicit == key:
            self._implicit = None
        if lock is not None:
            lock.release()

    def claim_holder(self, index: int) -> dict[str, Any] | None:
        """``{"pid", "host", "since"}`` of the live process (not this object) that holds shard ``index``'s
        claim, or None."""
        if int(index) in self._claims:
            return None
        return holder_record(self._claim_path(int(index)))

    def _held_elsewhere(self, index: int) -> bool:
        """Another live process holds the claim (one of this process is never waited for)."""
        who = self.claim_holder(index)
        return who is not None and (who.get("pid"), who.get("host")) != (os.getpid(), socket.gethostname())

    def wait_for_shards(self, indices: Iterable[int], *, timeout: float | None = None) -> list[int]:
        """Wait while live processes compute any of ``indices``; return those still not stored.

        The returned shards are claimed by nobody (their writer died, or nobody took them): the caller's to
        compute. An empty list means every one is stored.

        Raises:
            TimeoutError: ``timeout`` seconds passed while others still held some.
        """
        pending = [int(i) for i in indices]
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.01
        while True:
            done = self.reload()._shards()
            pending = [i for i in pending if str(i) not in done]
            held = [i for i in pending if self._held_elsewhere(i)]
            if not held:
                return pending
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"FeatureStore: shards {held[:10]} of {self.path} are still being computed.")
            time.sleep(delay)
            delay = min(2 * delay, 0.25)

    def shard_record(self, index: int) -> dict[str, Any] | None:
        """The manifest record of shard ``index`` (file, rows, data_sha256, sha256), or None if not complete.

        On a store this object writes to (after :meth:`begin`), None means "compute it": the shard is then
        claimed for the caller (until its ``write_shard``, the next ``shard_record`` of another shard, or
        :meth:`close`), and while another live process holds the shard's claim this waits for that process's
        record and returns it, so two runs never compute one shard. Without ``begin`` it only reads.
        """
        index = int(index)
        rec = self._shards().get(str(index))
        if rec is not None or self.complete or not self._writer:
            return rec
        if self._implicit is not None and self._implicit != index:
            self.release(self._implicit)  # the caller did not write the last shard it asked about
        announced, delay = False, 0.01
        while True:
            if self.claim(index):
                self._implicit = index
                return None
            rec = self._shards().get(str(index))  # claim() re-read the manifest
            if rec is not None or self.complete:
                return rec
            if not announced:
                who = self.claim_holder(index) or {}
                _LOG.warning(
                    "FeatureStore: shard %d of %s is being computed by process %s on %s; waiting for it.",
                    index,
                    self.path,
                    who.get("pid", "?"),
                    who.get("host", "?"),
                )
                announced = True
            time.sleep(delay)
            delay = min(2 * delay, 0.25)

    def _shard_path(self, index: int) -> Path:
        return self.path / f"shard_{index:05d}.npy"

    def write_shard(self, index: int, features: np.ndarray, *, data_sha256: str) -> None:
        """Atomically write shard ``index`` (rows ``index * shard_size ...``), record it, release its claim.

        Args:
            index: shard number.
            features: ``(rows, dim)`` array; rows == shard_size except for the last shard.
            data_sha256: fingerprint of the shard's input examples (checked when resuming).

        Raises:
            ValueError: wrong shape, non-finite values, or the store is already complete.
            OSError: the disk is full (ENOSPC / EDQUOT) or failing (EIO): names the file and the bytes needed.
        """
        manifest = self._read_manifest()
        if manifest.get("complete"):
            raise ValueError(f"FeatureStore: {self.path} is complete; it takes no more shards.")
        features = np.ascontiguousarray(features, dtype=np.float32)
        if features.ndim != 2 or features.shape[1] != manifest["dim"] or not 0 < len(features) <= self.shard_size:
            raise ValueError(
                f"FeatureStore: shard must have shape (1..{self.shard_size}, {manifest['dim']}), got {features.shape}."
            )
        if not np.isfinite(features).all():
            raise ValueError(f"FeatureStore: shard {index} has non-finite values; refusing to store them.")
        target = self._shard_path(index)
        try:
            need = len(_npy_header(features.shape)) + features.nbytes
            atomic_write(target, lambda f: np.save(f, features), size=need)
        except StorageError as err:
            raise _kept(err, target) from err
        record = {
            "file": target.name,
            "rows": len(features),
            "data_sha256": data_sha256,
            "sha256": _rows_sha256(features),
        }
        with self._locked():
            manifest = self.reload()._read_manifest()  # other writers may have added shards meanwhile
            if manifest.get("complete"):
                raise ValueError(f"FeatureStore: {self.path} was completed meanwhile; it takes no more shards.")
            manifest = dict(manifest)
            manifest["shards"] = dict(manifest["shards"])
            manifest["shards"][str(index)] = record
            self._write_manifest(manifest)
        self.release(index)

    # ---- checking ---------------------------------------------------------------------------------

    def _warn_unchecked(self) -> None:
        if not self._warned_unchecked:
            self._warned_unchecked = True
            warnings.warn(
                f"FeatureStore: {self.path} was written by an older clusterlm: its shard records have no checksums "
                "(no 'sha256' in manifest.json), so bit flips cannot be detected; recompute the store (a new "
                "directory) to get them.",
                stacklevel=4,
            )

    def _rows_of(self, index: int, rec: dict[str, Any], old: np.ndarray | None) -> tuple[np.ndarray | None, str]:
        """Shard ``index``'s rows, checked against its record: (rows, "") or (None, what is wrong)."""
        name = rec.get("file") or self._shard_path(index).name
        if name == _FEATURES:
            if old is None:
                return None, f"(rows in {_FEATURES}) {_BROKEN}"
            start = index * self.shard_size
            rows = old[start : start + rec["rows"]]
        else:
            try:
                rows = np.load(self.path / name, mmap_mode="r", allow_pickle=False)
            except FileNotFoundError:
                return None, f"({name}) is missing"
            except (ValueError, OSError, EOFError) as exc:
                return None, f"({name}) {_BROKEN} ({exc})"
        if rows.dtype != np.float32 or rows.shape != (rec["rows"], self.dim):
            return None, f"({name}) {_BROKEN} (shape {rows.shape} {rows.dtype}, expected ({rec['rows']}, {self.dim}))"
        if "sha256" not in rec:
            if self._checksummed():
                return None, f"({name}) has no checksum (no 'sha256' in its record in manifest.json)"
            self._warn_unchecked()
        elif _rows_sha256(rows) != rec["sha256"]:
            return None, f"({name}) does not match its checksum (sha256 in manifest.json; a bit flip on disk)"
        return rows, ""

    def _drop(self, bad: dict[int, str], *, reopen: bool = False) -> str:
        """Drop the shards ``bad`` from the manifest (``reopen``: the store becomes incomplete, its other blocks
        kept in features.npy); returns the message that says so."""
        manifest = self.reload()._read_manifest()
        rows = {int(k): int(r["rows"]) for k, r in manifest["shards"].items()}
        unsaved = ""
        try:
            with self._locked():
                manifest = self.reload()._read_manifest()
                if reopen:
                    shards = {k: dict(r, file=_FEATURES) for k, r in manifest["shards"].items() if int(k) not in bad}
                    self._write_manifest(dict(manifest, shards=shards, complete=False, n_examples=None))
                else:
                    self._drop_records(manifest, bad)
        except OSError as exc:  # a read-only store: say what is wrong all the same
            unsaved = f" (could not record that in {self.manifest_path}: {exc}; delete the store to start over)"
        self._verified = None
        parts = []
        for i, problem in sorted(bad.items())[:5]:
            first = i * self.shard_size
            span = f"rows {first}..{first + rows.get(i, self.shard_size) - 1}"
            parts.append(f"{span} (shard {i}) {problem}" if reopen else f"shard {i} {problem}")
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        where = self.path / _FEATURES if reopen else self.path
        what, it = ("these rows", "them") if reopen or len(bad) > 1 else ("the shard", "it")
        what = "the shards" if len(bad) > 1 and not reopen else what
        return (
            f"FeatureStore: {where}: {'; '.join(parts)}{more}. Dropped {what} from the store: rerun the "
            f"featurizer with this store to recompute {it} (the other rows are kept){unsaved}."
        )

    # ---- assembling -------------------------------------------------------------------------------

    def read_shard(self, index: int) -> np.ndarray:
        """Shard ``index`` as a read-only memmap (before ``finalize``), or its rows of ``features.npy``.

        Raises:
            KeyError: the shard is not stored.
            ValueError: its file is missing, truncated or fails its checksum (the shard is dropped: a rerun
                recomputes it).
        """
        rec = self._shards().get(str(int(index)))
        if rec is None:
            raise KeyError(f"FeatureStore: shard {index} is not complete in {self.path}.")
        if self.complete:
            start = index * self.shard_size
            return self.features()[start : start + rec["rows"]]
        old = self._old_features() if rec.get("file") == _FEATURES else None
        rows, problem = self._rows_of(int(index), rec, old)
        if rows is None:
            raise ValueError(self._drop({int(index): problem}))
        return rows

    def _old_features(self) -> np.ndarray | None:
        try:
            return np.load(self.path / _FEATURES, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError):
            return None

    def finalize(self, n_examples: int) -> np.memmap:
        """Assemble the shards into ``features.npy`` (checked, streamed, atomic) and mark the store complete.

        One process assembles; others that finalize the same store meanwhile wait and return its result.

        Raises:
            ValueError: shards missing or of the wrong size for ``n_examples``, or shards that fail their
                checksum or are truncated (they are dropped: rerun the featurizer to recompute them).
            OSError: the disk is full or failing: names ``features.npy`` and the bytes needed; the shards
                are kept.
        """
        if self.reload().complete:
            return self._finalized(n_examples)
        self._check_shards_for(n_examples)
        key = _FINALIZE
        lock = FileLock(self._claim_path(key), remove=True)
        lock.acquire(blocking=True)
        self._claims[key] = lock
        try:
            if self.reload().complete:  # another process finished it while we waited
                return self._finalized(n_examples)
            self._check_shards_for(n_examples)
            self._assemble(self._read_manifest(), n_examples)
            with self._locked():
                manifest = dict(self.reload()._read_manifest(), complete=True, n_examples=int(n_examples))
                self._write_manifest(manifest)
                self._cleanup(manifest)
        finally:
            self.release(key)
        return self.features()

    def _finalized(self, n_examples: int) -> np.memmap:
        manifest = self._read_manifest()
        if manifest["n_examples"] != n_examples:
            raise ValueError(
                f"FeatureStore: {self.path} is complete with {manifest['n_examples']} examples, "
                f"not {n_examples}; the data changed; use another directory."
            )
        return self.features()

    def _check_shards_for(self, n_examples: int) -> None:
        shards = self._shards()
        n_shards = -(-n_examples // self.shard_size)
        missing = [i for i in range(n_shards) if str(i) not in shards]
        extra = [int(i) for i in shards if int(i) >= n_shards]
        if missing or extra:
            raise ValueError(
                f"FeatureStore: cannot finalize {self.path} with {n_examples} examples: shards missing "
                f"{missing[:10]} / beyond the end {extra[:10]}."
            )
        for i in range(n_shards):
            want = min(self.shard_size, n_examples - i * self.shard_size)
            if shards[str(i)]["rows"] != want:
                raise ValueError(f"FeatureStore: shard {i} has {shards[str(i)]['rows']} rows, expected {want}.")

    def _assemble(self, manifest: dict[str, Any], n_examples: int) -> None:
        """Write features.npy from the checked shards: preallocated, plain writes, atomically (fsync, rename).

        Raises:
            ValueError: shards that fail their check (dropped from the manifest).
            OSError: a full or failing disk (one message; the temporary file is removed).
        """
        shards, dim = manifest["shards"], manifest["dim"]
        header = _npy_header((n_examples, dim))
        need = len(header) + n_examples * dim * 4
        target = self.path / _FEATURES
        old = self._old_features() if any(r.get("file") == _FEATURES for r in shards.values()) else None
        bad: dict[int, str] = {}

        def write(f: Any) -> None:  # plain writes to the file's descriptor (no memory map: no SIGBUS)
            fd = f.fileno()
            _preallocate(fd, need)
            _write_all(fd, header)
            for i in range(-(-n_examples // self.shard_size)):
                rows, problem = self._rows_of(i, shards[str(i)], old)
                if rows is None:
                    bad[i] = problem
                elif not bad:  # once one is bad the file is lost anyway: only check the rest
                    _write_all(fd, rows)
            if bad:
                raise ValueError(self._drop(bad))

        try:
            atomic_write(target, write, size=need)
        except StorageError as err:
            raise _kept(err, target) from err
        st = os.stat(target)
        self._verified = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    # ---- reading ----------------------------------------------------------------------------------

    def features(self, *, verify: bool = True) -> np.memmap:
        """All features, ``(n_examples, dim)`` float32, as a read-only memmap (loaded lazily).

        Args:
            verify: check every row block against its checksum the first time this object opens this file
                (one sequential read); blocks that fail are dropped, so a rerun of the featurizer recomputes
                them.

        Raises:
            FileNotFoundError: nothing was written to the store.
            ValueError: the store is not complete yet (resume the run that writes it), or features.npy is
                truncated, foreign or fails a checksum (the store then lists the blocks to recompute).
        """
        manifest = self._read_manifest()
        if not manifest.get("complete"):
            raise ValueError(
                f"FeatureStore: {self.path} is not complete; rerun the featurizer with this store to "
                "finish it (completed shards are kept)."
            )
        target = self.path / _FEATURES
        try:
            feats = np.load(target, mmap_mode="r", allow_pickle=False)
            problem = (
                ""
                if feats.dtype == np.float32 and feats.shape == (manifest["n_examples"], manifest["dim"])
                else f"shape {feats.shape} {feats.dtype}, expected ({manifest['n_examples']}, {manifest['dim']})"
            )
        except FileNotFoundError:
            feats, problem = None, "the file is missing"
        except (OSError, ValueError, EOFError) as exc:
            feats, problem = None, str(exc)
        if problem:
            self._drop({int(k): "" for k in manifest["shards"]}, reopen=True)
            raise ValueError(
                f"FeatureStore: {target} {_BROKEN} ({problem}); the store is marked incomplete: rerun the "
                "featurizer with this store to recompute the features."
            )
        if verify:
            self._verify_features(feats, manifest, target)
        return feats

    def _verify_features(self, feats: np.ndarray, manifest: dict[str, Any], target: Path) -> None:
        st = os.stat(target)
        stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if self._verified == stamp:
            return
        bad: dict[int, str] = {}
        for key, rec in manifest["shards"].items():
            if "sha256" not in rec:
                if self._checksummed():
                    bad[int(key)] = "have no checksum (no 'sha256' in their record in manifest.json)"
                else:
                    self._warn_unchecked()
                continue
            start = int(key) * self.shard_size
            if _rows_sha256(feats[start : start + rec["rows"]]) != rec["sha256"]:
                bad[int(key)] = "do not match their checksum (sha256 in manifest.json; a bit flip on disk)"
        if bad:
            raise ValueError(self._drop(bad, reopen=True))
        self._verified = stamp

    def __len__(self) -> int:
        n = self.n_examples
        if n is None:
            raise ValueError(f"FeatureStore: {self.path} is not complete; its length is not known yet.")
        return n

    def iter_blocks(self, block_rows: int = 65536) -> Iterator[np.ndarray]:
        """Yield consecutive ``(<= block_rows, dim)`` in-memory float32 blocks of the features."""
        if block_rows < 1:
            raise ValueError(f"FeatureStore: block_rows must be >= 1, got {block_rows}.")
        feats = self.features()
        for start in range(0, len(feats), block_rows):
            yield np.array(feats[start : start + block_rows])
