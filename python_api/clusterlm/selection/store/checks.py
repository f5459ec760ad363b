"""The feature store's integrity: shards and ``features.npy`` blocks checked against their checksums.

A block that fails (a bit flip, a truncated or missing file) is dropped from the manifest with a message naming it,
so that the next run of the featurizer recomputes just that block (:class:`StoreChecks`, a part of
:class:`clusterlm.selection.store.FeatureStore`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from clusterlm.selection.store.files import BROKEN, FEATURES, npy_layout, rows_sha256

__all__ = ["StoreChecks"]


class StoreChecks:
    """Checks of a :class:`~clusterlm.selection.store.FeatureStore` against its manifest (the store's state and manifest
    methods are used as they are)."""

    def _drop_unreadable(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Drop the records whose files are missing or shorter than their rows (under the directory lock)."""
        bad: dict[int, str] = {}
        layouts: dict[str, Any] = {}
        for key, rec in manifest["shards"].items():
            name = rec.get("file") or self._shard_path(int(key)).name
            if name not in layouts:
                try:
                    layouts[name] = npy_layout(self.path / name)
                except FileNotFoundError:
                    layouts[name] = "is missing"
                except (ValueError, OSError) as exc:
                    layouts[name] = f"{BROKEN} ({exc})"
            layout = layouts[name]
            if isinstance(layout, str):
                bad[int(key)] = layout
                continue
            shape, dtype, _ = layout
            start = int(key) * self.shard_size if name == FEATURES else 0
            if dtype != np.float32 or len(shape) != 2 or shape[1] != manifest["dim"] or shape[0] < start + rec["rows"]:
                want = f"{rec['rows']} rows of dim {manifest['dim']}"
                bad[int(key)] = f"{BROKEN} (shape {shape}, {dtype}; expected {want})"
        bad = self._unreadable_signals(manifest) | bad
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
            if rec.get("file", FEATURES) != FEATURES:
                (self.path / rec["file"]).unlink(missing_ok=True)
                self._signals_path(int(i)).unlink(missing_ok=True)
        self._write_manifest(manifest)
        return manifest

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
        if name == FEATURES:
            if old is None:
                return None, f"(rows in {FEATURES}) {BROKEN}"
            start = index * self.stored_shard_size()
            rows = old[start : start + rec["rows"]]
        else:
            try:
                rows = np.load(self.path / name, mmap_mode="r", allow_pickle=False)
            except FileNotFoundError:
                return None, f"({name}) is missing"
            except (ValueError, OSError, EOFError) as exc:
                return None, f"({name}) {BROKEN} ({exc})"
        if rows.dtype != np.float32 or rows.shape != (rec["rows"], self.dim):
            return None, f"({name}) {BROKEN} (shape {rows.shape} {rows.dtype}, expected ({rec['rows']}, {self.dim}))"
        if "sha256" not in rec:
            if self._checksummed():
                return None, f"({name}) has no checksum (no 'sha256' in its record in manifest.json)"
            self._warn_unchecked()
        elif rows_sha256(rows) != rec["sha256"]:
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
                    shards = {k: dict(r, file=FEATURES) for k, r in manifest["shards"].items() if int(k) not in bad}
                    self._write_manifest(dict(manifest, shards=shards, complete=False, n_examples=None))
                else:
                    self._drop_records(manifest, bad)
        except OSError as exc:  # a read-only store: say what is wrong all the same
            unsaved = f" (could not record that in {self.manifest_path}: {exc}; delete the store to start over)"
        self._verified = None
        parts = []
        for i, problem in sorted(bad.items())[:5]:
            first = i * self.stored_shard_size()
            span = f"rows {first}..{first + rows.get(i, self.stored_shard_size()) - 1}"
            parts.append(f"{span} (shard {i}) {problem}" if reopen else f"shard {i} {problem}")
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        where = self.path / FEATURES if reopen else self.path
        what, it = ("these rows", "them") if reopen or len(bad) > 1 else ("the shard", "it")
        what = "the shards" if len(bad) > 1 and not reopen else what
        return (
            f"FeatureStore: {where}: {'; '.join(parts)}{more}. Dropped {what} from the store: rerun the "
            f"featurizer with this store to recompute {it} (the other rows are kept){unsaved}."
        )

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
            start = int(key) * self.stored_shard_size()
            if rows_sha256(feats[start : start + rec["rows"]]) != rec["sha256"]:
                bad[int(key)] = "do not match their checksum (sha256 in manifest.json; a bit flip on disk)"
        if bad:
            raise ValueError(self._drop(bad, reopen=True))
        self._verified = stamp
