"""Plan: which examples every rank trains on, in which order, with which weights — and its file format.

A plan is what selection produces and what any trainer consumes. It holds, for a data set of N examples
and a world of K ranks, K equally long index lists (rank ``r`` visits ``rank_indices[r]`` in that order),
a per-example weight (0 for unselected examples), the cluster of every example and its squared distance
to its centroid, the original cluster sizes, the token length of every example, and the fingerprint of
the data set it was made for, so a trainer can refuse a plan made for other data.

Weights. For example ``i`` of cluster ``c``: ``w_i = (n_c / N) * (S / s_c)`` with ``n_c`` the size of
cluster ``c``, ``S`` the number of selected examples and ``s_c`` the number selected from ``c``
(:func:`selection_weights`). With one cluster per rank this is the method's rank weight ``K n_k / N``;
in general the weights have mean 1 over the selection, and ``mean_i(w_i * grad_i)`` over the selection
is an unbiased-by-cluster estimate of the full-data mean gradient ``sum_c (n_c / N) * g_c``.

Files (``Plan.save(dir)``)::

    plan.json   format, version, model id, world size, data fingerprint, selection config, timings,
                stats, cluster sizes, a per-cluster and per-rank summary of weights and tokens,
                ``arrays``: the file name and sha256 of plan.npz and the sha256 of each of its arrays
                (``arrays.checksums``), and ``checksums``: the sha256 of every other field's content
    plan.npz    rank_indices (K, m) int64, weights (N,) float64, cluster_labels (N,) int64,
                distances (N,) float64, lengths (N,) int64, cluster_sizes (C,) int64

Both are written to temporary files and renamed into place (npz first); nothing is pickled and the
arrays are read back with ``allow_pickle=False``.

Which file holds what: the arrays (rank lists, weights, labels, distances, lengths, cluster sizes) are
plan.npz's; world size, model id, fingerprint, config, timings and stats are plan.json's. plan.json's
``n_examples``, ``n_selected``, ``per_rank``, ``cluster_sizes``, ``clusters`` and ``ranks`` only summarise
the arrays, and :meth:`Plan.load` checks them against plan.npz, so an edited weight, label or count in
plan.json is refused (naming the field), not ignored. Each field's checksum (of its content, so
re-indenting or reordering plan.json is a supported edit) refuses any other edit; to change a plan, load
it, change it and save it. A plan.npz of another save, a truncated or foreign file and a field of the
wrong type are refused in one ``ValueError`` naming the file and the field. Plans of the previous version
(no checksums) still load, with a warning; their summaries are still checked against plan.npz.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import warnings
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from clusterlm._io import atomic_write_bytes
from clusterlm.data import fingerprint

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "Plan", "same_model", "selection_weights"]

PLAN_FORMAT = "clusterlm.plan"
PLAN_VERSION = 1
_JSON = "plan.json"
_NPZ = "plan.npz"
_ARRAYS = ("rank_indices", "weights", "cluster_labels", "distances", "lengths", "cluster_sizes")
# Mean weight over the selection must be 1; float64 sums of up to millions of weights stay far inside this.
_MEAN_RTOL = 1e-9
# plan.json fields that summarise plan.npz (checked against it on load); "arrays" and "checksums" carry checksums.
_DERIVED = ("n_examples", "n_selected", "per_rank", "cluster_sizes", "clusters", "ranks")
_NOT_SUMMED = ("arrays", "checksums")
_BROKEN = "truncated or not a clusterlm plan file"
_EDIT_FIX = (
    "plan.json is not meant to be edited by hand (re-indenting or reordering it is fine): load the plan with "
    "clusterlm.plan.Plan.load, change it and save it with Plan.save (which records new checksums), or make it "
    "again (clusterlm select)."
)
_MODEL_HASH = re.compile(r"[0-9a-f]{12}")
_MISSING = object()


def selection_weights(
    labels: np.ndarray | Sequence[int], selected: np.ndarray | Sequence[int], n_clusters: int
) -> np.ndarray:
    """Per-example weights ``w_i = (n_c / N') * (S / s_c)`` of a selection drawn from clusters.

    ``n_c`` is the size of cluster ``c``, ``s_c`` the number of examples selected from it, ``S = sum s_c``.
    ``N'`` is the total size of the clusters that have at least one selected example; it equals ``N``
    whenever every cluster is represented (the method's case). A cluster with nothing selected cannot be
    represented, so it gets no weight and the others are renormalised over ``N'``, which keeps the mean
    weight over the selection exactly 1 (the plan invariant).

    Args:
        labels: (N,) integer cluster of every example, each in ``[0, n_clusters)``. For a selection
            without clustering pass zeros and ``n_clusters=1`` (every selected weight is then 1).
        selected: a boolean mask of shape (N,) or the integer indices of the selected examples (unique).
        n_clusters: number of clusters C (clusters may be empty).

    Returns:
        (N,) float64: the weight of every selected example, 0 elsewhere; mean over the selection is 1.

    Raises:
        ValueError: labels out of range or not 1-D, a mask of the wrong length, indices out of range
            or repeated, an empty selection.
    """
    if isinstance(n_clusters, bool) or not isinstance(n_clusters, (int, np.integer)) or n_clusters < 1:
        raise ValueError(f"selection_weights: n_clusters must be a positive int, got {n_clusters!r}.")
    labels = np.asarray(labels)
    if labels.ndim != 1 or not (np.issubdtype(labels.dtype, np.integer) or labels.size == 0):
        raise ValueError(
            f"selection_weights: labels must be a 1-D integer array, got shape {labels.shape} dtype {labels.dtype}."
        )
    labels = labels.astype(np.int64)
    n = len(labels)
    if n and (labels.min() < 0 or labels.max() >= n_clusters):
        raise ValueError(
            f"selection_weights: labels must lie in [0, {n_clusters}), got values in [{labels.min()}, "
            f"{labels.max()}]; for a selection without clustering pass zeros and n_clusters=1."
        )
    mask = _selection_mask(selected, n, "selection_weights: selected")
    if not mask.any():
        raise ValueError("selection_weights: the selection is empty; select at least one example.")
    sizes = np.bincount(labels, minlength=n_clusters).astype(np.float64)
    chosen = np.bincount(labels[mask], minlength=n_clusters).astype(np.float64)
    represented = chosen > 0
    total = float(chosen.sum())
    per_cluster = np.zeros(n_clusters, dtype=np.float64)
    per_cluster[represented] = (sizes[represented] / sizes[represented].sum()) * (total / chosen[represented])
    weights = np.zeros(n, dtype=np.float64)
    weights[mask] = per_cluster[labels[mask]]
    return weights


def _selection_mask(selected: Any, n: int, what: str) -> np.ndarray:
    sel = np.asarray(selected)
    if sel.dtype == np.bool_:
        if sel.shape != (n,):
            raise ValueError(f"{what}: a boolean mask must have shape ({n},), got {sel.shape}.")
        return sel.copy()
    if sel.ndim != 1 or not (np.issubdtype(sel.dtype, np.integer) or sel.size == 0):
        raise ValueError(f"{what}: expected a boolean mask or 1-D integer indices, got shape {sel.shape} {sel.dtype}.")
    sel = sel.astype(np.int64)
    if sel.size and (sel.min() < 0 or sel.max() >= n):
        raise ValueError(f"{what}: indices must lie in [0, {n}), got values in [{sel.min()}, {sel.max()}].")
    mask = np.zeros(n, dtype=bool)
    mask[sel] = True
    if int(mask.sum()) != sel.size:
        raise ValueError(f"{what}: indices must be unique, got {sel.size - int(mask.sum())} repeated.")
    return mask


def _jsonable(obj: Any, where: str) -> Any:
    """Plain JSON types from config/stats values that may hold numpy scalars, arrays, tuples or paths."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, float)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"Plan.{where}: keys must be strings to be stored in plan.json, got {k!r}.")
            out[k] = _jsonable(v, f"{where}[{k!r}]")
        return out
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    raise TypeError(
        f"Plan.{where}: {type(obj).__name__} cannot be stored in plan.json; use numbers, strings, lists and dicts."
    )


def _as_int64(value: Any, name: str) -> np.ndarray:
    arr = np.asarray(value)
    if not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise ValueError(f"Plan.{name}: expected an integer array, got dtype {arr.dtype}.")
    return arr.astype(np.int64, copy=False)


def _as_float64(value: Any, name: str) -> np.ndarray:
    arr = np.asarray(value)
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise ValueError(f"Plan.{name}: expected a float array, got dtype {arr.dtype}.")
    return arr.astype(np.float64, copy=False)



# ---- plan files: checksums and the checks of Plan.load -------------------------------------------------


def _digest(value: Any) -> str:
    """sha256 of a JSON value's content (key order and layout do not count)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def _array_digest(arr: np.ndarray) -> str:
    """sha256 of an array's dtype, shape and bytes."""
    h = hashlib.sha256(f"{arr.dtype.str}{arr.shape}".encode())
    h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def _field_error(where: Path, name: str, problem: str) -> ValueError:
    return ValueError(f"Plan.load: {where}: field {name!r} {problem}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_meta(json_path: Path) -> dict[str, Any]:
    """plan.json parsed, checked to be a plan of this format version."""
    try:
        meta = json.loads(json_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"Plan.load: {json_path} is not valid JSON ({e}): {_BROKEN}. Save the plan again, or pass the "
            "directory Plan.save wrote."
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != PLAN_FORMAT:
        raise ValueError(f"Plan.load: {json_path} is not a clusterlm plan (format {PLAN_FORMAT!r} expected).")
    version = meta.get("version")
    if version != PLAN_VERSION:
        raise ValueError(
            f"Plan.load: {json_path} has plan format version {version!r}; this clusterlm reads version "
            f"{PLAN_VERSION}. Make the plan again with this clusterlm, or use the clusterlm that wrote it."
        )
    return meta


def _check_fields(meta: dict[str, Any], where: Path) -> None:
    """Every field Plan.load reads is there and of its type; the error names the field."""
    if "world_size" not in meta:
        raise _field_error(where, "world_size", "is missing: it must be the number of ranks the plan is for.")
    if not _is_int(meta["world_size"]) or meta["world_size"] < 1:
        got = meta["world_size"]
        raise _field_error(where, "world_size", f"must be a positive int, the number of ranks; got {got!r}.")
    fp = meta.get("fingerprint", _MISSING)
    if fp is _MISSING:
        raise _field_error(where, "fingerprint", "is missing: it must be the data fingerprint {'size', 'sha256'}.")
    if not isinstance(fp, dict) or "size" not in fp or "sha256" not in fp:
        raise _field_error(where, "fingerprint", f"must be {{'size': N, 'sha256': hex}}, got {fp!r}.")
    if not _is_int(fp["size"]) or fp["size"] < 0:
        raise _field_error(where, "fingerprint.size", f"must be an int >= 0, got {fp['size']!r}.")
    if not isinstance(fp["sha256"], str):
        raise _field_error(where, "fingerprint.sha256", f"must be a str, got {fp['sha256']!r}.")
    if not isinstance(meta.get("model_id", ""), str):
        raise _field_error(where, "model_id", f"must be a str, got {meta['model_id']!r}.")
    for name in ("config", "timings", "stats", "arrays", "checksums"):
        if meta.get(name) is not None and not isinstance(meta[name], dict):
            raise _field_error(where, name, f"must be a dict, got {type(meta[name]).__name__}.")
    arrays = meta.get("arrays") or {}
    for key, kind in (("file", str), ("sha256", str), ("checksums", dict)):
        if arrays.get(key) is not None and not isinstance(arrays[key], kind):
            raise _field_error(where, f"arrays.{key}", f"must be a {kind.__name__}, got {arrays[key]!r}.")


def _check_checksums(meta: dict[str, Any], where: Path) -> set[str] | None:
    """Compare every field with its checksum; None for a plan without checksums (the previous version).

    Returns:
        The summary fields (``_DERIVED``) whose checksum differs: Plan.load names what differs in them once
        plan.npz is read.

    Raises:
        ValueError: another field was changed, added or removed after the save (names it).
    """
    sums = meta.get("checksums")
    if sums is None:
        return None
    changed: set[str] = set()
    for name in sorted(set(sums) | {k for k in meta if k not in _NOT_SUMMED}):
        if name not in meta:
            raise _field_error(where, name, f"is missing: it was saved with the plan, then removed. {_EDIT_FIX}")
        if name not in sums:
            raise _field_error(
                where, name, f"was added after the plan was saved (clusterlm would ignore it). {_EDIT_FIX}"
            )
        if _digest(meta[name]) != sums[name]:
            if name in _DERIVED:
                changed.add(name)
                continue
            raise _field_error(where, name, f"was changed after the plan was saved (its checksum differs). {_EDIT_FIX}")
    return changed


def _broken_npz(npz_path: Path, why: Any) -> ValueError:
    return ValueError(f"Plan.load: {npz_path} is {_BROKEN} ({why}). Save the plan again (or copy plan.npz again).")


def _parse_npz(npz_path: Path, raw: bytes) -> dict[str, np.ndarray]:
    """The arrays of plan.npz (bytes ``raw``), without pickle.

    Raises:
        ValueError: truncated, empty or not an npz of a plan (one message naming the file), an array missing,
            or an array of Python objects.
    """
    if not raw.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        raise _broken_npz(npz_path, "empty" if not raw else "not a zip archive of arrays")
    try:
        npz = np.load(io.BytesIO(raw), allow_pickle=False)
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, zlib.error) as e:
        raise _broken_npz(npz_path, e) from None
    with npz:
        missing = [k for k in _ARRAYS if k not in npz.files]
        if missing:
            raise ValueError(f"Plan.load: {npz_path} lacks the arrays {missing}. Save the plan again.")
        data = {}
        for k in _ARRAYS:
            try:
                data[k] = npz[k]
            except ValueError as e:
                if "pickle" in str(e):
                    raise ValueError(
                        f"Plan.load: {npz_path}: array {k!r} holds Python objects (pickle); plan arrays are plain "
                        "numbers, read with allow_pickle=False. Save the plan again."
                    ) from None
                raise _broken_npz(npz_path, e) from None
            except (zipfile.BadZipFile, EOFError, OSError, KeyError, zlib.error) as e:
                raise _broken_npz(npz_path, e) from None
    return data


def _read_arrays(npz_path: Path, json_path: Path, record: dict[str, Any]) -> dict[str, np.ndarray]:
    """plan.npz's arrays, checked against the checksums plan.json's ``arrays`` recorded (where it has them)."""
    if not npz_path.is_file():
        raise FileNotFoundError(f"Plan.load: {npz_path} is missing; plan.json alone is not a plan. Save it again.")
    raw = npz_path.read_bytes()
    whole = record.get("sha256")
    data = _parse_npz(npz_path, raw)  # a truncated file is named as such, whatever its checksum
    sums = record.get("checksums") or {}
    differ = [k for k in _ARRAYS if k in sums and _array_digest(data[k]) != sums[k]]
    if whole and hashlib.sha256(raw).hexdigest() != whole:
        shown = f"; arrays {', '.join(map(repr, differ))} differ" if differ else ""
        raise ValueError(
            f"Plan.load: {npz_path} does not belong to {json_path} (sha256 differs{shown}): the directory holds parts "
            "of two different saves. Save the plan again."
        )
    if differ:
        raise ValueError(
            f"Plan.load: {npz_path}: arrays {', '.join(map(repr, differ))} differ from those saved with {json_path} "
            "(field 'arrays.checksums'): plan.npz comes from another save, or field 'arrays.sha256' was edited. "
            "Save the plan again."
        )
    return data


def _first_difference(found: Any, want: Any, name: str) -> tuple[str, Any, Any] | None:
    """(field path, found, expected) of the first place two JSON values differ (floats to 1e-9), else None."""
    if isinstance(want, dict):
        if not isinstance(found, dict):
            return name, found, want
        for k in sorted(set(found) | set(want)):
            if k not in found or k not in want:
                return f"{name}.{k}", found.get(k), want.get(k)
            diff = _first_difference(found[k], want[k], f"{name}.{k}")
            if diff:
                return diff
        return None
    if isinstance(want, list):
        if not isinstance(found, list) or len(found) != len(want):
            return name, found, want
        for i, (a, b) in enumerate(zip(found, want, strict=True)):
            diff = _first_difference(a, b, f"{name}[{i}]")
            if diff:
                return diff
        return None
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (found, want))
    if numbers and (isinstance(want, float) or isinstance(found, float)):
        return None if math.isclose(found, want, rel_tol=1e-9, abs_tol=1e-12) else (name, found, want)
    return None if found == want and type(found) is type(want) else (name, found, want)


def same_model(a: str, b: str) -> bool:
    """Two model ids name the same model: their weights hashes agree (``label@hash``), else the ids are equal."""
    ha, hb = a.rpartition("@")[2], b.rpartition("@")[2]
    if _MODEL_HASH.fullmatch(ha) and _MODEL_HASH.fullmatch(hb):
        return ha == hb
    return a == b


@dataclass(eq=False)
class Plan:
    """Per-rank example lists, weights and provenance of one selection (see the module docstring).

    Attributes:
        world_size: number of ranks K.
        rank_indices: K int64 arrays of equal length m; rank ``r`` visits ``rank_indices[r]`` in order.
        weights: (N,) float64, 0 for unselected examples, mean 1 over the selected ones.
        cluster_labels: (N,) int64 cluster of every example, -1 when there is no clustering.
        distances: (N,) float64 squared distance to the own centroid (nan when there is none).
        cluster_sizes: (C,) int64 original cluster sizes ``n_c`` (C = 0 without clustering).
        lengths: (N,) int64 tokens per example.
        fingerprint: ``{"size": N, "sha256": ...}`` of the data set (:func:`clusterlm.data.fingerprint`).
        model_id: the model the features came from.
        config: JSON-serialisable selection config.
        timings: stage -> seconds.
        stats: JSON-serialisable statistics.
        version: file format version.

    Raises:
        ValueError: (from :meth:`validate`, run on construction) any broken invariant.
    """

    world_size: int
    rank_indices: list[np.ndarray]
    weights: np.ndarray
    cluster_labels: np.ndarray
    distances: np.ndarray
    cluster_sizes: np.ndarray
    lengths: np.ndarray
    fingerprint: dict
    model_id: str
    config: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        if isinstance(self.rank_indices, np.ndarray) and self.rank_indices.ndim == 2:
            self.rank_indices = list(self.rank_indices)
        if not isinstance(self.rank_indices, (list, tuple)):
            raise ValueError(
                "Plan.rank_indices: expected a list of world_size int64 arrays, got "
                f"{type(self.rank_indices).__name__}."
            )
        self.rank_indices = [_as_int64(r, f"rank_indices[{i}]") for i, r in enumerate(self.rank_indices)]
        self.weights = _as_float64(self.weights, "weights")
        self.cluster_labels = _as_int64(self.cluster_labels, "cluster_labels")
        self.distances = _as_float64(self.distances, "distances")
        self.cluster_sizes = _as_int64(self.cluster_sizes, "cluster_sizes")
        self.lengths = _as_int64(self.lengths, "lengths")
        self.validate()

    # ---- invariants -------------------------------------------------------------------------------

    def validate(self) -> None:
        """Check every internal invariant of the plan.

        Raises:
            ValueError: wrong world size or version, unequal or non-1-D per-rank lists, indices out of
                range or repeated (within or across ranks), arrays whose shapes disagree, negative or
                non-finite weights, weight outside the selection, mean selected weight not 1, cluster
                labels out of range or cluster sizes that disagree with them, negative lengths, a
                fingerprint whose size is not N, or config/timings/stats that cannot be stored as JSON.
        """
        n = self._validate_shapes()
        selected = self._validate_selection(n)
        self._validate_weights(selected)
        self._validate_clusters(n)
        self._validate_records()

    def _validate_shapes(self) -> int:
        """Version, world size, per-rank list shapes and counts, array shapes, fingerprint; returns N."""
        if self.version != PLAN_VERSION:
            raise ValueError(
                f"Plan.version: this clusterlm handles plan format version {PLAN_VERSION}, got {self.version!r}."
            )
        ws = self.world_size
        if isinstance(ws, bool) or not isinstance(ws, (int, np.integer)) or ws < 1:
            raise ValueError(f"Plan.world_size: expected a positive int, got {ws!r}.")
        if len(self.rank_indices) != ws:
            raise ValueError(
                f"Plan.rank_indices: expected {ws} per-rank arrays (world_size), got {len(self.rank_indices)}."
            )
        for r, idx in enumerate(self.rank_indices):
            if idx.ndim != 1:
                raise ValueError(f"Plan.rank_indices[{r}]: expected a 1-D array, got shape {idx.shape}.")
        counts = [len(idx) for idx in self.rank_indices]
        if len(set(counts)) != 1:
            raise ValueError(
                f"Plan.rank_indices: every rank must get the same number of examples (DDP steps in lock-step), "
                f"got {counts}."
            )
        if counts[0] == 0:
            raise ValueError("Plan.rank_indices: the plan selects no examples; every rank needs at least one.")
        n = self.weights.shape[0] if self.weights.ndim == 1 else -1
        if n < 0:
            raise ValueError(f"Plan.weights: expected shape (N,), got {self.weights.shape}.")
        for name in ("cluster_labels", "distances", "lengths"):
            shape = getattr(self, name).shape
            if shape != (n,):
                raise ValueError(f"Plan.{name}: expected shape ({n},) like weights, got {shape}.")
        if self.cluster_sizes.ndim != 1:
            raise ValueError(f"Plan.cluster_sizes: expected shape (C,), got {self.cluster_sizes.shape}.")
        fp = self.fingerprint
        if not isinstance(fp, Mapping) or "size" not in fp or "sha256" not in fp:
            raise ValueError(f"Plan.fingerprint: expected {{'size': N, 'sha256': hex}}, got {self.fingerprint!r}.")
        if int(self.fingerprint["size"]) != n:
            raise ValueError(
                f"Plan.fingerprint: size {self.fingerprint['size']} differs from the {n} examples of the arrays."
            )
        if not isinstance(self.model_id, str):
            raise ValueError(f"Plan.model_id: expected a str, got {type(self.model_id).__name__}.")
        return n

    def _validate_selection(self, n: int) -> np.ndarray:
        """Indices in range and each at most once over all ranks; returns them concatenated."""
        selected = np.concatenate(self.rank_indices)
        if selected.min() < 0 or selected.max() >= n:
            raise ValueError(
                f"Plan.rank_indices: indices must lie in [0, {n}), got values in [{selected.min()}, {selected.max()}]."
            )
        mask = np.zeros(n, dtype=bool)
        mask[selected] = True
        if int(mask.sum()) != selected.size:
            seen = np.bincount(selected, minlength=n)
            dup = np.flatnonzero(seen > 1)
            raise ValueError(
                f"Plan.rank_indices: every example may appear once in the plan; {dup.size} appear more than once "
                f"(first: {dup[:5].tolist()})."
            )
        return selected

    def _validate_weights(self, selected: np.ndarray) -> None:
        """Finite, non-negative, zero outside the selection, mean 1 over it."""
        mask = np.zeros(len(self.weights), dtype=bool)
        mask[selected] = True
        w = self.weights
        if not np.isfinite(w).all():
            raise ValueError(f"Plan.weights: must be finite, got {int((~np.isfinite(w)).sum())} non-finite values.")
        if (w < 0).any():
            raise ValueError(f"Plan.weights: must be >= 0, got minimum {w.min()!r}.")
        outside = np.flatnonzero((w != 0) & ~mask)
        if outside.size:
            raise ValueError(
                f"Plan.weights: unselected examples must have weight 0; {outside.size} have not (first: "
                f"{outside[:5].tolist()})."
            )
        mean = float(w[selected].mean())
        if not math.isclose(mean, 1.0, rel_tol=_MEAN_RTOL, abs_tol=0.0):
            raise ValueError(
                f"Plan.weights: the mean weight over the {selected.size} selected examples must be 1, got {mean!r}; "
                "compute weights with clusterlm.plan.selection_weights."
            )

    def _validate_clusters(self, n: int) -> None:
        """Labels in range, sizes that count them, lengths >= 0."""
        labels = self.cluster_labels
        n_clusters = len(self.cluster_sizes)
        if n and (labels.min() < -1 or labels.max() >= n_clusters):
            raise ValueError(
                f"Plan.cluster_labels: must lie in [-1, {n_clusters}) (C = len(cluster_sizes)), got values in "
                f"[{labels.min()}, {labels.max()}]."
            )
        counted = np.bincount(labels[labels >= 0], minlength=n_clusters)
        if not np.array_equal(counted, self.cluster_sizes):
            raise ValueError(
                "Plan.cluster_sizes: must equal the number of examples per label, got "
                f"{self.cluster_sizes[:8].tolist()} "
                f"but the labels count {counted[:8].tolist()}."
            )
        if n and self.lengths.min() < 0:
            raise ValueError(f"Plan.lengths: must be >= 0, got minimum {self.lengths.min()}.")

    def _validate_records(self) -> None:
        """config / timings / stats: dicts that JSON can store, timings in seconds."""
        for stage, sec in self.timings.items() if isinstance(self.timings, Mapping) else ():
            if isinstance(sec, bool) or not isinstance(sec, (int, float, np.integer, np.floating)):
                raise ValueError(f"Plan.timings: stage {stage!r} must map to seconds (a number), got {sec!r}.")
        for name in ("config", "timings", "stats"):
            value = getattr(self, name)
            if not isinstance(value, Mapping):
                raise ValueError(f"Plan.{name}: expected a dict, got {type(value).__name__}.")
            try:
                _jsonable(value, name)
            except TypeError as e:
                raise ValueError(str(e)) from None

    # ---- accessors --------------------------------------------------------------------------------

    @property
    def n_examples(self) -> int:
        """N, the size of the data set the plan was made for."""
        return int(self.weights.shape[0])

    @property
    def n_selected(self) -> int:
        """S, the number of selected examples over all ranks (world_size * per_rank)."""
        return self.world_size * self.per_rank

    @property
    def per_rank(self) -> int:
        """m, the number of examples every rank visits per epoch."""
        return len(self.rank_indices[0])

    def _check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}) for this plan (world size), got {rank!r}.")
        return int(rank)

    def indices(self, rank: int) -> np.ndarray:
        """(m,) int64 data set indices of ``rank`` in visit order (a read-only view).

        Raises:
            ValueError: rank outside ``[0, world_size)``.
        """
        view = self.rank_indices[self._check_rank(rank)].view()
        view.flags.writeable = False
        return view

    def rank_weights(self, rank: int) -> np.ndarray:
        """(m,) float64 weights of ``rank``'s examples in visit order (``weights[indices(rank)]``).

        Raises:
            ValueError: rank outside ``[0, world_size)``.
        """
        return self.weights[self.indices(rank)]

    def per_rank_tokens(self) -> np.ndarray:
        """(world_size,) int64 total tokens per rank and epoch."""
        return np.array([int(self.lengths[idx].sum()) for idx in self.rank_indices], dtype=np.int64)

    def step_token_ratio(self, batch_size: int) -> np.ndarray:
        """Per-step token imbalance across ranks when every rank takes ``batch_size`` examples per step.

        Step ``j`` covers positions ``[j * batch_size, (j + 1) * batch_size)`` of every rank's list (plan
        order; the last step may be shorter). Its ratio is ``max_r tokens_r / mean_r tokens_r``: 1 is
        perfect balance, and the slowest rank's step takes about that factor longer than the average.

        Args:
            batch_size: examples per rank and step (per-device batch size x gradient accumulation for
                optimizer steps).

        Returns:
            (ceil(m / batch_size),) float64 ratios, each >= 1 (1 where a step has no tokens at all).

        Raises:
            ValueError: batch_size not a positive int.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"step_token_ratio: batch_size must be a positive int, got {batch_size!r}.")
        tokens = self.lengths[np.stack(self.rank_indices)]  # (K, m)
        n_steps = -(-self.per_rank // batch_size)
        padded = np.zeros((self.world_size, n_steps * batch_size), dtype=np.int64)
        padded[:, : self.per_rank] = tokens
        per_step = padded.reshape(self.world_size, n_steps, batch_size).sum(axis=2).astype(np.float64)
        mean = per_step.mean(axis=0)
        ratio = np.ones(n_steps, dtype=np.float64)
        nz = mean > 0
        ratio[nz] = per_step.max(axis=0)[nz] / mean[nz]
        return ratio

    # ---- verification -----------------------------------------------------------------------------

    def verify(self, dataset: Any, world_size: int | None = None) -> None:
        """Refuse to train on data (or a world) the plan was not made for.

        Args:
            dataset: an object with ``.fingerprint() -> {"size", "sha256"}`` (e.g.
                :class:`clusterlm.data.SFTDataset`) or a sequence of example dicts, fingerprinted with
                :func:`clusterlm.data.fingerprint`.
            world_size: number of processes of this run; not checked when None.

        Raises:
            ValueError: naming every difference: data set size, content hash, world size.
        """
        data_fp = fingerprint(dataset)
        problems = []
        plan_size, data_size = int(self.fingerprint["size"]), int(data_fp["size"])
        if plan_size != data_size:
            problems.append(f"plan was made for {plan_size} examples, the data set has {data_size}")
        elif self.fingerprint["sha256"] != data_fp["sha256"]:
            problems.append(self._tokenisation_hint(dataset) or (
                f"content hash differs: plan {str(self.fingerprint['sha256'])[:12]}.., data "
                f"{str(data_fp['sha256'])[:12]}.. — the data changed or is in another order"
            ))
        if world_size is not None and int(world_size) != self.world_size:
            problems.append(f"plan is for world size {self.world_size}, this run has {int(world_size)} processes")
        if problems:
            raise ValueError(
                "Plan.verify: " + "; ".join(problems) + ". Make a new plan for this data and world size "
                "(clusterlm select) or use the data the plan was made for."
            )

    # ---- text summary -----------------------------------------------------------------------------

    def _cluster_rows(self) -> list[tuple[int, int, int, float | None]]:
        n_clusters = len(self.cluster_sizes)
        selected = np.concatenate(self.rank_indices)
        sel_labels = self.cluster_labels[selected]
        ok = sel_labels >= 0
        chosen = np.bincount(sel_labels[ok], minlength=n_clusters)
        wsum = np.bincount(sel_labels[ok], weights=self.weights[selected][ok], minlength=n_clusters)
        rows = []
        for c in range(n_clusters):
            w = float(wsum[c] / chosen[c]) if chosen[c] else None
            rows.append((c, int(self.cluster_sizes[c]), int(chosen[c]), w))
        return rows

    def _rank_rows(self) -> list[dict[str, Any]]:
        rows = []
        for r, idx in enumerate(self.rank_indices):
            labels = self.cluster_labels[idx]
            ids, counts = np.unique(labels[labels >= 0], return_counts=True)
            w = self.weights[idx]
            rows.append(
                {
                    "rank": r,
                    "examples": len(idx),
                    "tokens": int(self.lengths[idx].sum()),
                    "clusters": {str(int(c)): int(k) for c, k in zip(ids, counts, strict=True)},
                    "weight_mean": float(w.mean()),
                    "weight_min": float(w.min()),
                    "weight_max": float(w.max()),
                }
            )
        return rows

    def summary(self) -> str:
        """A plain-text report: per rank (clusters, examples, tokens, weight), per cluster (n_c, s_c,
        weight) and stage timings; the first line states a paper-preset shortfall against the request."""
        n, s = self.n_examples, self.n_selected
        share = f"{100.0 * s / max(n, 1):.1f} %"
        requested = self.stats.get("requested")
        if self.config.get("preset") == "paper" and isinstance(requested, (int, np.integer)) and s < requested:
            # The paper's count is smallest cluster * pct // 100 per cluster: often far below ratio * N.
            share = (f"{share} of N; {int(requested)} = {100.0 * int(requested) / max(n, 1):.1f} % requested: the "
                     "paper preset keeps smallest cluster x pct // 100 per cluster")
        lines = [
            f"plan: {s} of {n} examples selected ({share}), world size {self.world_size}, {self.per_rank} per rank",
            f"model: {self.model_id}   data: sha256 {str(self.fingerprint['sha256'])[:16]}..",
        ]
        scalars = {k: v for k, v in self.config.items() if not isinstance(v, (Mapping, list, tuple, np.ndarray))}
        if scalars:  # nested entries (feature configs, ...) are in plan.json; the summary stays one line
            lines.append("config: " + ", ".join(f"{k}={v}" for k, v in scalars.items()))
        clustering = self.stats.get("clustering")
        if isinstance(clustering, Mapping) and clustering.get("cap") is not None:
            bound = "bound" if clustering.get("cap_bound") else "did not bind"
            lines.append(f"clustering: {clustering.get('method')}; cap {clustering['cap']} per cluster ({bound})")
        lines += ["", f"{'rank':>4}  {'clusters':<20}  {'examples':>8}  {'tokens':>10}  {'weight':>8}"]
        for row in self._rank_rows():
            clusters = row["clusters"]
            text = ",".join(clusters) if len(clusters) <= 6 else f"{len(clusters)} clusters"
            text = text or "-"
            lines.append(
                f"{row['rank']:>4}  {text:<20}  {row['examples']:>8}  {row['tokens']:>10}  {row['weight_mean']:>8.4f}"
            )
        tokens = self.per_rank_tokens()
        if tokens.mean() > 0:
            lines.append(f"token imbalance (max/mean over ranks): {tokens.max() / tokens.mean():.3f}")
        budget = self.stats.get("token_budget")
        if isinstance(budget, Mapping):
            lines.append(f"token budget: {budget['selected_tokens']:,} of {budget['requested_tokens']:,} tokens "
                         f"requested ({100.0 * budget['relative_error']:+.2f} %)")
        cluster_rows = self._cluster_rows()
        lines.append("")
        if cluster_rows:
            lines.append(f"{'cluster':>7}  {'n_c':>8}  {'s_c':>8}  {'weight':>8}")
            shown = cluster_rows if len(cluster_rows) <= 64 else cluster_rows[:64]
            for c, n_c, s_c, w in shown:
                lines.append(f"{c:>7}  {n_c:>8}  {s_c:>8}  {(f'{w:.4f}' if w is not None else '-'):>8}")
            if len(shown) < len(cluster_rows):
                lines.append(f"... {len(cluster_rows) - len(shown)} more clusters")
        else:
            lines.append("no clustering")
        if self.timings:
            lines += ["", f"{'stage':<20}  {'seconds':>10}"]
            for stage, sec in self.timings.items():
                lines.append(f"{stage:<20}  {float(sec):>10.3f}")
        return "\n".join(lines)

    # ---- files ------------------------------------------------------------------------------------

    def _arrays(self) -> dict[str, np.ndarray]:
        return {
            "rank_indices": np.stack(self.rank_indices).astype(np.int64),
            "weights": self.weights,
            "cluster_labels": self.cluster_labels,
            "distances": self.distances,
            "lengths": self.lengths,
            "cluster_sizes": self.cluster_sizes,
        }

    def _npz_bytes(self) -> bytes:
        buf = io.BytesIO()
        np.savez(buf, **self._arrays())
        return buf.getvalue()

    def _summary_fields(self) -> dict[str, Any]:
        """plan.json's summaries of the arrays (``_DERIVED``), as JSON values."""
        return {
            "n_examples": self.n_examples,
            "n_selected": self.n_selected,
            "per_rank": self.per_rank,
            "cluster_sizes": self.cluster_sizes.tolist(),
            "clusters": [
                {"cluster": c, "size": n_c, "selected": s_c, "weight": w} for c, n_c, s_c, w in self._cluster_rows()
            ],
            "ranks": self._rank_rows(),
        }

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``plan.json`` and ``plan.npz`` into ``directory`` (created if needed), atomically.

        Args:
            directory: target directory; existing plan files there are replaced.

        Returns:
            The directory.

        Raises:
            ValueError: the plan breaks an invariant (see :meth:`validate`).
        """
        self.validate()
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        npz = self._npz_bytes()
        summary = self._summary_fields()
        meta = {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "model_id": self.model_id,
            "world_size": int(self.world_size),
            "n_examples": summary["n_examples"],
            "n_selected": summary["n_selected"],
            "per_rank": summary["per_rank"],
            "fingerprint": _jsonable(self.fingerprint, "fingerprint"),
            "config": _jsonable(self.config, "config"),
            "timings": _jsonable(self.timings, "timings"),
            "stats": _jsonable(self.stats, "stats"),
            "cluster_sizes": summary["cluster_sizes"],
            "clusters": summary["clusters"],
            "ranks": summary["ranks"],
        }
        meta = json.loads(json.dumps(meta))  # the checksums are over what a reader gets back
        meta["arrays"] = {
            "file": _NPZ,
            "sha256": hashlib.sha256(npz).hexdigest(),
            "checksums": {k: _array_digest(v) for k, v in self._arrays().items()},
        }
        meta["checksums"] = {k: _digest(v) for k, v in meta.items() if k not in _NOT_SUMMED}
        text = json.dumps(meta, indent=2) + "\n"
        # npz first: a crash between the two renames leaves an old json whose checksum refuses the new npz.
        atomic_write_bytes(path / _NPZ, npz)
        atomic_write_bytes(path / _JSON, text.encode("utf-8"))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """Read a plan written by :meth:`save`, checking that its two files are the ones saved together.

        Args:
            path: the plan directory or its ``plan.json``.

        Returns:
            The validated plan.

        Raises:
            FileNotFoundError: plan.json or plan.npz missing.
            ValueError: not a plan file or a truncated one, an unsupported format version, a field missing or
                of the wrong type, a field edited after the save (its checksum differs, or a summary disagrees
                with plan.npz), arrays that do not belong to this plan.json, or a plan that breaks an
                invariant. Each message names the file and the field.

        Warns:
            UserWarning: a plan of the previous version (no checksums): edits cannot always be detected.
        """
        path = Path(path)
        directory = path.parent if path.suffix == ".json" and not path.is_dir() else path
        json_path = path if directory is not path else directory / _JSON
        if not json_path.is_file():
            raise FileNotFoundError(
                f"Plan.load: no plan at {json_path}; pass the directory written by Plan.save (it holds {_JSON} "
                f"and {_NPZ})."
            )
        meta = _read_meta(json_path)
        _check_fields(meta, json_path)
        changed = _check_checksums(meta, json_path)
        record = meta.get("arrays") or {}
        if changed is None or not record.get("sha256"):
            warnings.warn(
                f"Plan.load: {json_path} has no checksums (saved by an older clusterlm), so an edit of it or a "
                "plan.npz from another save cannot always be detected. Save the plan again (Plan.load, then "
                "Plan.save) to add them.",
                UserWarning,
                stacklevel=2,
            )
        npz_path = directory / record.get("file", _NPZ)
        data = _read_arrays(npz_path, json_path, record)
        rank_indices = data["rank_indices"]
        if rank_indices.ndim != 2 or rank_indices.shape[0] != meta["world_size"]:
            raise ValueError(
                f"Plan.load: {npz_path}: array 'rank_indices' has shape {rank_indices.shape}, but {json_path}: "
                f"field 'world_size' is {meta['world_size']}: the files disagree (plan.json edited, or plan.npz "
                "from another save). Save the plan again."
            )
        plan = cls(
            world_size=int(meta["world_size"]),
            rank_indices=list(rank_indices),
            weights=data["weights"],
            cluster_labels=data["cluster_labels"],
            distances=data["distances"],
            cluster_sizes=data["cluster_sizes"],
            lengths=data["lengths"],
            fingerprint=dict(meta["fingerprint"]),
            model_id=meta.get("model_id", ""),
            config=meta.get("config") or {},
            timings=meta.get("timings") or {},
            stats=meta.get("stats") or {},
            version=meta["version"],
        )
        plan._check_summaries(meta, json_path, npz_path, changed or set())
        return plan

    def _check_summaries(self, meta: dict[str, Any], json_path: Path, npz_path: Path, changed: set[str]) -> None:
        """plan.json's summaries (``_DERIVED``) must say what plan.npz's arrays give; names the first difference."""
        want = self._summary_fields()
        for name in _DERIVED:
            if name not in meta:
                continue  # a plan.json without it: nothing to disagree (fields the checksums miss were refused)
            diff = _first_difference(meta[name], want[name], name)
            if diff:
                field_path, found, expected = diff
                raise ValueError(
                    f"Plan.load: {json_path}: field {field_path!r} is {found!r} but {npz_path} gives {expected!r}: "
                    "the files disagree (the weights, labels and rank lists are plan.npz's; plan.json only "
                    f"summarises them, and an edit there would be ignored). {_EDIT_FIX}"
                )
        for name in sorted(changed):
            problem = "was changed after the plan was saved (its checksum differs)"
            raise _field_error(json_path, name, f"{problem}. {_EDIT_FIX}")

    def _tokenisation_hint(self, dataset: Any) -> str | None:
        """Why the tokens differ, when the plan's recorded tokenisation is not this data's (else None)."""
        recorded = self.config.get("data") if isinstance(self.config, Mapping) else None
        if not isinstance(recorded, Mapping):
            return None
        used, rendering = getattr(dataset, "max_length", None), getattr(dataset, "rendering", None)
        if "max_length" in recorded and recorded["max_length"] != used:
            return (f"the plan was selected on data tokenised with --max-length {recorded['max_length']}, this data "
                    f"with {used}: pass --max-length {recorded['max_length']} (train's default is the plan's)")
        if recorded.get("rendering") and rendering and recorded["rendering"] != rendering:
            return (f"the plan's data was rendered {recorded['rendering']!r}, this data {rendering!r}: pass the "
                    "--chat-template the plan was made with")
        return None

    def check_model(self, model_id: str, *, allow_other_model: bool = False) -> bool:
        """Refuse to use the plan with a model other than the one its features came from.

        Ids compare by their weights hash (``label@hash``, :func:`clusterlm.models.compute_model_id`) when both
        carry one (the label is informative only), else as strings.

        Args:
            model_id: the id of the model about to be trained.
            allow_other_model: use the plan anyway: a warning instead of the error.

        Returns:
            True when the ids agree; False when they could not be compared (the plan has no model id: an old
            plan or one made without a model; a warning says so) or differ and ``allow_other_model`` is set.

        Raises:
            ValueError: the plan was made with another model and ``allow_other_model`` is False.
        """
        mine, theirs = self.model_id or "", model_id or ""
        if not mine or not theirs:
            missing = "this plan has no model id (an old plan, or one made without a model)" if not mine else (
                "no model id given")
            warnings.warn(
                f"Plan.check_model: {missing}; cannot check that the plan was made with model {theirs or '?'}.",
                UserWarning,
                stacklevel=2,
            )
            return False
        if same_model(mine, theirs):
            return True
        if not allow_other_model:
            raise ValueError(
                f"Plan.check_model: the plan was made with model {mine}, this is model {theirs}: another model's "
                "features select other examples. Make a plan with this model (clusterlm select), or pass "
                "--allow-other-model / allow_other_model=True to use it anyway."
            )
        warnings.warn(
            f"Plan.check_model: the plan was made with model {mine}, this is model {theirs}; using it anyway "
            "(allow_other_model=True).",
            UserWarning,
            stacklevel=2,
        )
        return False
