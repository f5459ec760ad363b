"""The per-example signals of a feature store: gradient norms and losses beside the features, checksummed like them.

:class:`StoreSignals` is the part of :class:`clusterlm.selection.store.FeatureStore` that keeps
:class:`clusterlm.selection.signals.ExampleSignals`: a shard's signals are written (float64 ``(rows, 2)``,
``shard_<index>.signals.npy``) before its features, and its record carries their sha256 (``signals_sha256``); the
store's ``finalize`` assembles them into ``signals.npy`` (``(N, 2)``) once every shard has them; :meth:`signals` reads
them back, checked block by block. A block whose signals are missing or fail their checksum is dropped with its
features, so the next run of the featurizer recomputes both. Records without signals (written by an older clusterlm)
read as before: the store then has no signals (:meth:`signals` returns None).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from clusterlm.fileio import StorageError, atomic_write
from clusterlm.selection.signals import SIGNAL_NAMES, ExampleSignals
from clusterlm.selection.store.files import BROKEN, FEATURES, SIGNALS, SIGNALS_KEY, kept, signal_rows_sha256

__all__ = ["StoreSignals"]

_WIDTH = len(SIGNAL_NAMES)


class StoreSignals:
    """Signals of a :class:`~clusterlm.selection.store.FeatureStore` (its ``path``, ``shard_size``, manifest and
    ``_drop`` are the store's)."""

    def _signals_path(self, index: int) -> Path:
        return self.path / f"shard_{int(index):05d}.signals.npy"

    def _write_signals_shard(self, index: int, signals: Any, rows: int) -> str:
        """Write shard ``index``'s signals atomically (before its features); their sha256 for its record.

        Raises:
            ValueError: not ``(rows, 2)``, or non-finite values.
            OSError: a full or failing disk (names the file).
        """
        arr = np.ascontiguousarray(signals, dtype=np.float64)
        if arr.shape != (rows, _WIDTH) or not np.isfinite(arr).all():
            raise ValueError(f"FeatureStore: the signals of shard {index} must be a finite ({rows}, {_WIDTH}) array "
                             f"of {SIGNAL_NAMES}, got shape {arr.shape}.")
        target = self._signals_path(index)
        try:
            atomic_write(target, lambda f: np.save(f, arr), size=128 + arr.nbytes)
        except StorageError as err:
            raise kept(err, target) from err
        return signal_rows_sha256(arr)

    def _old_signals(self) -> np.ndarray | None:
        try:
            return np.load(self.path / SIGNALS, allow_pickle=False)
        except (OSError, ValueError, EOFError):
            return None

    def _signal_rows_of(self, index: int, rec: dict[str, Any], old: np.ndarray | None
                        ) -> tuple[np.ndarray | None, str]:
        """Shard ``index``'s signals, checked against its record: (rows, "") or (None, what is wrong)."""
        if rec.get("file") == FEATURES:  # a kept block of a reopened store: its signals are signals.npy's rows
            if old is None:
                return None, f"(its signals in {SIGNALS}) {BROKEN}"
            start = index * self.stored_shard_size()  # the store's own (a reader may pass another)
            rows, name = old[start : start + rec["rows"]], SIGNALS
        else:
            name = self._signals_path(index).name
            try:
                rows = np.load(self.path / name, allow_pickle=False)
            except FileNotFoundError:
                return None, f"({name}) is missing"
            except (ValueError, OSError, EOFError) as exc:
                return None, f"({name}) {BROKEN} ({exc})"
        if rows.dtype != np.float64 or rows.shape != (rec["rows"], _WIDTH):
            return None, f"({name}) {BROKEN} (shape {rows.shape} {rows.dtype}, expected ({rec['rows']}, {_WIDTH}))"
        if signal_rows_sha256(rows) != rec[SIGNALS_KEY]:
            return None, f"({name}) does not match its checksum ({SIGNALS_KEY} in manifest.json; a bit flip on disk)"
        return rows, ""

    def _unreadable_signals(self, manifest: dict[str, Any]) -> dict[int, str]:
        """Records whose signals files are missing or truncated (``begin`` drops them: the run recomputes them)."""
        bad: dict[int, str] = {}
        old: np.ndarray | None = None
        for key, rec in manifest["shards"].items():
            if SIGNALS_KEY not in rec:
                continue
            if rec.get("file") == FEATURES:
                old = self._old_signals() if old is None else old
                start, ok = int(key) * self.shard_size, old is not None
                if not ok or old.shape[0] < start + rec["rows"]:
                    bad[int(key)] = f"(its signals in {SIGNALS}) {BROKEN}"
            elif not self._signals_path(int(key)).is_file():
                bad[int(key)] = f"({self._signals_path(int(key)).name}) is missing"
        return bad

    def _assemble_signals(self, manifest: dict[str, Any], n_examples: int) -> None:
        """Write ``signals.npy`` from the shards' checked signals, when every shard has them (else remove it).

        Raises:
            ValueError: shards whose signals fail their check (dropped with their features: a rerun recomputes them).
        """
        shards, target = manifest["shards"], self.path / SIGNALS
        n_shards = -(-n_examples // self.shard_size)
        if not all(SIGNALS_KEY in shards[str(i)] for i in range(n_shards)):
            target.unlink(missing_ok=True)  # an older clusterlm's shards: this store has no signals
            return
        old = self._old_signals() if any(r.get("file") == FEATURES for r in shards.values()) else None
        blocks, bad = [], {}
        for i in range(n_shards):
            rows, problem = self._signal_rows_of(i, shards[str(i)], old)
            if rows is None:
                bad[i] = problem
            else:
                blocks.append(rows)
        if bad:
            raise ValueError(self._drop(bad))
        arr = np.concatenate(blocks) if blocks else np.zeros((0, _WIDTH), dtype=np.float64)
        try:
            atomic_write(target, lambda f: np.save(f, arr), size=128 + arr.nbytes)
        except StorageError as err:
            raise kept(err, target) from err

    def signals(self) -> ExampleSignals | None:
        """Every example's gradient norm and loss (:class:`clusterlm.selection.signals.ExampleSignals`), checked
        block by block against the shard records; None when the store has none (written by an older clusterlm).

        Raises:
            ValueError: the store is not complete, or ``signals.npy`` is missing, truncated or fails a checksum (the
                store is then marked incomplete with those blocks dropped: rerun the featurizer with this store).
        """
        manifest = self._read_manifest()
        if not manifest.get("complete"):
            raise ValueError(f"FeatureStore: {self.path} is not complete; rerun the featurizer with this store to "
                             "finish it (completed shards are kept).")
        shards = manifest["shards"]
        if not manifest["n_examples"]:
            return ExampleSignals.concat([])
        if not shards or not all(SIGNALS_KEY in r for r in shards.values()):
            return None
        old = self._old_signals()
        bad = {}
        for key, rec in shards.items():
            rows, problem = self._signal_rows_of(int(key), dict(rec, file=FEATURES), old)
            if rows is None:
                bad[int(key)] = problem
        if bad:
            raise ValueError(self._drop(bad, reopen=True))
        return ExampleSignals.from_array(old[: manifest["n_examples"]])
