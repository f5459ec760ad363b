"""Assembling a feature store: its shards checked and streamed into ``features.npy``, once, by one process.

:class:`StoreAssembly` is the part of :class:`clusterlm.selection.store.FeatureStore` that reads a shard back
(:meth:`~StoreAssembly.read_shard`) and finalizes the store (:meth:`~StoreAssembly.finalize`): preallocated, plain
writes, atomic rename; others that finalize the same store meanwhile wait and return its result.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from clusterlm.fileio import FileLock, StorageError, atomic_write
from clusterlm.selection.store.files import FEATURES, FINALIZE, kept, npy_header, preallocate, write_all

__all__ = ["StoreAssembly"]


class StoreAssembly:
    """Reading shards back and assembling ``features.npy`` (a part of
    :class:`~clusterlm.selection.store.FeatureStore`)."""

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
            start = index * self.stored_shard_size()
            return self.features()[start : start + rec["rows"]]
        old = self._old_features() if rec.get("file") == FEATURES else None
        rows, problem = self._rows_of(int(index), rec, old)
        if rows is None:
            raise ValueError(self._drop({int(index): problem}))
        return rows

    def _old_features(self) -> np.ndarray | None:
        try:
            return np.load(self.path / FEATURES, mmap_mode="r", allow_pickle=False)
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
        key = FINALIZE
        lock = FileLock(self._claim_path(key), remove=True)
        lock.acquire(blocking=True)
        self._claims[key] = lock
        try:
            if self.reload().complete:  # another process finished it while we waited
                return self._finalized(n_examples)
            self._check_shards_for(n_examples)
            self._assemble(self._read_manifest(), n_examples)
            self._assemble_signals(self._read_manifest(), n_examples)  # signals.npy when every shard has them
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
        header = npy_header((n_examples, dim))
        need = len(header) + n_examples * dim * 4
        target = self.path / FEATURES
        old = self._old_features() if any(r.get("file") == FEATURES for r in shards.values()) else None
        bad: dict[int, str] = {}

        def write(f: Any) -> None:  # plain writes to the file's descriptor (no memory map: no SIGBUS)
            fd = f.fileno()
            preallocate(fd, need)
            write_all(fd, header)
            for i in range(-(-n_examples // self.shard_size)):
                rows, problem = self._rows_of(i, shards[str(i)], old)
                if rows is None:
                    bad[i] = problem
                elif not bad:  # once one is bad the file is lost anyway: only check the rest
                    write_all(fd, rows)
            if bad:
                raise ValueError(self._drop(bad))

        try:
            atomic_write(target, write, size=need)
        except StorageError as err:
            raise kept(err, target) from err
        st = os.stat(target)
        self._verified = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
