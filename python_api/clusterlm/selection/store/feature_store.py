"""FeatureStore: the store's directory and manifest, starting or resuming it, writing shards, reading features.

Claims are :class:`~clusterlm.selection.store.claims.ShardClaims`', checks
:class:`~clusterlm.selection.store.checks.StoreChecks`', the
assembly of ``features.npy`` :class:`~clusterlm.selection.store.assembly.StoreAssembly`'s; the file formats are
:mod:`clusterlm.selection.store.files`'. The :mod:`clusterlm.selection.store` docstring describes the layout and the
guarantees.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from clusterlm.fileio import FileLock, StorageError, atomic_write, atomic_write_bytes, read_versioned_json, remove_stale
from clusterlm.selection.store.assembly import StoreAssembly
from clusterlm.selection.store.checks import StoreChecks
from clusterlm.selection.store.claims import ShardClaims
from clusterlm.selection.store.files import (
    BROKEN,
    FEATURES,
    MANIFEST,
    READABLE,
    SIGNALS_KEY,
    STORE_FORMAT,
    STORE_VERSION,
    kept,
    npy_header,
    rows_sha256,
)
from clusterlm.selection.store.signals import StoreSignals

__all__ = ["FeatureStore"]


class FeatureStore(ShardClaims, StoreChecks, StoreAssembly, StoreSignals):
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
        return self.path / MANIFEST

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
                    self.manifest_path, STORE_FORMAT, READABLE, who="FeatureStore", what="clusterlm feature store",
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

    def _cleanup(self, manifest: dict[str, Any]) -> None:
        """Remove what a killed run may have left: temporary files and claims nobody holds, shards of a
        completed store. Runs under the directory lock."""
        for p in [*self.path.glob("*.tmp"), *self.path.glob("*.claim")]:
            remove_stale(p)  # a live writer holds its file's lock
        if manifest.get("complete"):
            for p in self.path.glob("shard_*.npy"):
                p.unlink(missing_ok=True)

    def _shard_path(self, index: int) -> Path:
        return self.path / f"shard_{index:05d}.npy"

    def write_shard(self, index: int, features: np.ndarray, *, data_sha256: str, signals: np.ndarray | None = None
                    ) -> None:
        """Atomically write shard ``index`` (rows ``index * shard_size ...``), record it, release its claim.

        Args:
            index: shard number.
            features: ``(rows, dim)`` array; rows == shard_size except for the last shard.
            data_sha256: fingerprint of the shard's input examples (checked when resuming).
            signals: the shard's per-example signals, ``(rows, 2)`` float64 (gradient norm, loss:
                :class:`clusterlm.selection.signals.ExampleSignals`), written before the features and checksummed in
                the record; None: a shard without them (the store then has no signals, :meth:`signals`).

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
        signals_sha256 = None if signals is None else self._write_signals_shard(index, signals, len(features))
        target = self._shard_path(index)
        try:
            need = len(npy_header(features.shape)) + features.nbytes
            atomic_write(target, lambda f: np.save(f, features), size=need)
        except StorageError as err:
            raise kept(err, target) from err
        record = {
            "file": target.name,
            "rows": len(features),
            "data_sha256": data_sha256,
            "sha256": rows_sha256(features),
        }
        if signals_sha256 is not None:
            record[SIGNALS_KEY] = signals_sha256
        with self._locked():
            manifest = self.reload()._read_manifest()  # other writers may have added shards meanwhile
            if manifest.get("complete"):
                raise ValueError(f"FeatureStore: {self.path} was completed meanwhile; it takes no more shards.")
            manifest = dict(manifest)
            manifest["shards"] = dict(manifest["shards"])
            manifest["shards"][str(index)] = record
            self._write_manifest(manifest)
        self.release(index)

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
        target = self.path / FEATURES
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
                f"FeatureStore: {target} {BROKEN} ({problem}); the store is marked incomplete: rerun the "
                "featurizer with this store to recompute the features."
            )
        if verify:
            self._verify_features(feats, manifest, target)
        return feats

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
