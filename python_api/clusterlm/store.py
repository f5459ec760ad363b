"""FeatureStore: per-example features on disk, written in shards, resumable, read out of core.

Layout of a store directory::

    manifest.json        format, feature dim, shard size, the producing configuration, per-shard records
                         (rows, sha256 of the shard's input data), n_examples and ``complete`` when done
    shard_00000.npy      float32 (shard_size, dim) for examples [0, shard_size), ... (while running)
    features.npy         float32 (n_examples, dim), written when the run completes; read as np.memmap

Crash safety: a shard is written to a temporary file, fsync'ed and renamed into place, and only then
recorded in the manifest (itself replaced atomically). A run killed at any point leaves complete
shards and a manifest that lists only complete shards; a restart skips them and recomputes the rest,
so the result is identical to an uninterrupted run. The final ``features.npy`` is assembled shard by
shard into a temporary file and renamed; shard files are removed only after the manifest says
``complete``. Nothing half-written is ever listed.

Reads: ``features()`` returns a read-only ``np.memmap`` (nothing loaded until indexed), and
``iter_blocks`` streams fixed-size row blocks, so N may exceed memory.

Several writers: processes (ranks) may write disjoint shards of one store at the same time. Every
manifest update re-reads the manifest under an exclusive ``flock`` on the store directory, so no
writer's record is lost; a temporary file is locked by its writer until it is renamed into place, and
the clean-up on ``begin`` removes only temporary files nobody holds (those of killed writers). A
restarted writer therefore never disturbs one still running. ``reload()`` re-reads the manifest to see
what the others have finished. (Without ``fcntl``, or where the file system refuses ``flock``, there is
no locking and one writer at a time is assumed.)
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from clusterlm._io import atomic_write_bytes, fsync_dir

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None

__all__ = ["FeatureStore"]

FORMAT = "clusterlm.features/1"
_MANIFEST = "manifest.json"
_FEATURES = "features.npy"


def _try_flock(fd: int, blocking: bool) -> bool:
    """Exclusive flock on ``fd``; False when it is held elsewhere (non-blocking) or locking is unavailable."""
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        return True
    except BlockingIOError:
        return False
    except OSError:  # pragma: no cover - a file system without flock: no locking
        return False


@contextlib.contextmanager
def _dir_lock(path: Path) -> Iterator[None]:
    """Exclusive lock on the store directory for a manifest read-modify-write (released on close)."""
    if fcntl is None:  # pragma: no cover - not POSIX: one writer at a time
        yield
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        _try_flock(fd, blocking=True)
        yield
    finally:
        os.close(fd)


def _locked_tmp(directory: Path, name: str) -> tuple[int, str]:
    """A new temporary file for ``name``, flock-ed by this process until its fd is closed.

    Created under the directory lock, so a clean-up (which holds that lock) never sees it unlocked.
    """
    with _dir_lock(directory):
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=name + ".", suffix=".tmp")
        _try_flock(fd, blocking=False)
    return fd, tmp


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

    def __repr__(self) -> str:
        state = "complete" if self.complete else f"{len(self._shards())} shard(s)" if self.exists else "empty"
        return f"FeatureStore({str(self.path)!r}, shard_size={self.shard_size}, {state})"

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

    def _read_manifest(self) -> dict[str, Any]:
        if self._manifest is None:
            try:
                manifest = json.loads(self.manifest_path.read_text())
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"FeatureStore: no manifest at {self.manifest_path}; nothing was written to this store yet."
                ) from None
            except json.JSONDecodeError as exc:
                raise ValueError(f"FeatureStore: {self.manifest_path} is not valid JSON ({exc}).") from None
            if manifest.get("format") != FORMAT:
                raise ValueError(
                    f"FeatureStore: {self.manifest_path} has format {manifest.get('format')!r}, expected {FORMAT!r}."
                )
            self._manifest = manifest
        return self._manifest

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

    # ---- writing ----------------------------------------------------------------------------------

    def begin(self, *, dim: int, config: dict[str, Any]) -> set[int]:
        """Create the store, or check that an existing one was produced by the same configuration.

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
        with _dir_lock(self.path):
            self.reload()
            return self._begin_locked(dim, config)

    def _begin_locked(self, dim: int, config: dict[str, Any]) -> set[int]:
        if not self.exists:
            self._write_manifest(
                {
                    "format": FORMAT,
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
        return {int(i) for i in manifest["shards"]}

    def _cleanup(self, manifest: dict[str, Any]) -> None:
        """Remove what a killed run may have left: temporary files nobody holds, shards of a completed store.

        Runs under the directory lock.
        """
        for p in self.path.glob("*.tmp"):
            try:
                fd = os.open(p, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                # A live writer holds its temporary file's lock; without flock every one is stale.
                if fcntl is None or _try_flock(fd, blocking=False):
                    p.unlink(missing_ok=True)
            finally:
                os.close(fd)
        if manifest.get("complete"):
            for p in self.path.glob("shard_*.npy"):
                p.unlink(missing_ok=True)

    def shard_record(self, index: int) -> dict[str, Any] | None:
        """The manifest record of shard ``index`` (rows, data_sha256) or None if not complete."""
        return self._shards().get(str(index))

    def _shard_path(self, index: int) -> Path:
        return self.path / f"shard_{index:05d}.npy"

    def write_shard(self, index: int, features: np.ndarray, *, data_sha256: str) -> None:
        """Atomically write shard ``index`` (rows ``index * shard_size ...``) and record it.

        Args:
            index: shard number.
            features: ``(rows, dim)`` array; rows == shard_size except for the last shard.
            data_sha256: fingerprint of the shard's input examples (checked when resuming).

        Raises:
            ValueError: wrong shape, non-finite values, or the store is already complete.
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
        fd, tmp = _locked_tmp(self.path, target.name)
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, features)
                f.flush()
                os.fsync(f.fileno())
                os.replace(tmp, target)  # while the temporary file is still locked
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        fsync_dir(self.path)
        with _dir_lock(self.path):
            manifest = self.reload()._read_manifest()  # other writers may have added shards meanwhile
            if manifest.get("complete"):
                raise ValueError(f"FeatureStore: {self.path} was completed meanwhile; it takes no more shards.")
            manifest = dict(manifest)
            manifest["shards"] = dict(manifest["shards"])
            manifest["shards"][str(index)] = {"file": target.name, "rows": len(features), "data_sha256": data_sha256}
            self._write_manifest(manifest)

    def read_shard(self, index: int) -> np.ndarray:
        """Shard ``index`` as a read-only memmap (before ``finalize``), or its rows of ``features.npy``."""
        rec = self.shard_record(index)
        if rec is None:
            raise KeyError(f"FeatureStore: shard {index} is not complete in {self.path}.")
        if self.complete:
            start = index * self.shard_size
            return self.features()[start : start + rec["rows"]]
        return np.load(self._shard_path(index), mmap_mode="r")

    def finalize(self, n_examples: int) -> np.memmap:
        """Assemble the shards into ``features.npy`` (streamed, atomic) and mark the store complete.

        Raises:
            ValueError: shards missing or of the wrong size for ``n_examples``.
        """
        manifest = self.reload()._read_manifest()  # shards written by other processes count too
        if manifest.get("complete"):
            if manifest["n_examples"] != n_examples:
                raise ValueError(
                    f"FeatureStore: {self.path} is complete with {manifest['n_examples']} examples, "
                    f"not {n_examples}; the data changed; use another directory."
                )
            return self.features()
        n_shards = -(-n_examples // self.shard_size)
        shards = manifest["shards"]
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
        dim = manifest["dim"]
        target = self.path / _FEATURES
        fd, tmp = _locked_tmp(self.path, _FEATURES)
        try:
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(n_examples, dim))
            for i in range(n_shards):
                start = i * self.shard_size
                out[start : start + shards[str(i)]["rows"]] = np.load(self._shard_path(i), mmap_mode="r")
            out.flush()
            del out
            os.fsync(fd)
            os.replace(tmp, target)  # while the temporary file is still locked
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        fsync_dir(self.path)
        with _dir_lock(self.path):
            manifest = dict(self.reload()._read_manifest(), complete=True, n_examples=int(n_examples))
            self._write_manifest(manifest)
            self._cleanup(manifest)
        return self.features()

    # ---- reading ----------------------------------------------------------------------------------

    def features(self) -> np.memmap:
        """All features, ``(n_examples, dim)`` float32, as a read-only memmap (loaded lazily).

        Raises:
            FileNotFoundError: nothing was written to the store.
            ValueError: the store is not complete yet (resume the run that writes it).
        """
        if not self._read_manifest().get("complete"):
            raise ValueError(
                f"FeatureStore: {self.path} is not complete; rerun the featurizer with this store to "
                "finish it (completed shards are kept)."
            )
        return np.load(self.path / _FEATURES, mmap_mode="r")

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
