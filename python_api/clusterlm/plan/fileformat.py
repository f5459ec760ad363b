"""The plan's files: plan.json and plan.npz, their checksums, and every check of reading them back.

A :class:`clusterlm.plan.Plan` is saved as (``Plan.save(dir)`` -> :func:`write_plan_files`)::

    plan.json   format, version, model id, world size, data fingerprint, selection config, timings,
                stats, cluster sizes, a per-cluster and per-rank summary of weights and tokens,
                ``arrays``: the file name and sha256 of plan.npz and the sha256 of each of its arrays
                (``arrays.checksums``), and ``checksums``: the sha256 of every other field's content
    plan.npz    rank_indices (K, m) int64, weights (N,) float64, cluster_labels (N,) int64,
                distances (N,) float64, lengths (N,) int64, cluster_sizes (C,) int64; and, when the plan
                has them (:data:`SIGNAL_ARRAYS`), grad_norms (N,) float64 and losses (N,) float64

Both are written to temporary files and renamed into place (npz first); nothing is pickled and the
arrays are read back with ``allow_pickle=False``.

Which file holds what: the arrays (rank lists, weights, labels, distances, lengths, cluster sizes) are
plan.npz's; world size, model id, fingerprint, config, timings and stats are plan.json's. plan.json's
``n_examples``, ``n_selected``, ``per_rank``, ``cluster_sizes``, ``clusters`` and ``ranks`` only summarise
the arrays (:data:`SUMMARY_FIELDS`), and ``Plan.load`` checks them against plan.npz
(:meth:`PlanFiles.check_summaries`), so an edited weight, label or count in plan.json is refused (naming the
field), not ignored. Each field's checksum (of its content, so re-indenting or reordering plan.json is a
supported edit) refuses any other edit; to change a plan, load it, change it and save it. A plan.npz of
another save, a truncated or foreign file and a field of the wrong type are refused in one ``ValueError``
naming the file and the field; an array in plan.npz that is not a plan's is ignored with a warning naming it.

Signals. ``grad_norms`` and ``losses`` (each example's gradient-feature norm and loss, from the featurizer) are
optional arrays of plan.npz, checksummed like the others when present: a plan without them (made without features,
or by an older clusterlm) loads as before, so they need no new version; an older clusterlm reading a plan with them
warns that it ignores them.

Versions. Version 2 (:data:`PLAN_VERSION`, written now) always carries the checksums: a version-2 plan.json
without them was edited and is refused. Version 1 is still read: the checksums are checked where it has them
(the last version-1 clusterlm wrote them), and a version-1 plan without them loads with a warning (its
summaries are still checked against plan.npz); saving it again writes version 2.

:func:`read_plan_meta` is the same check of plan.json alone (format, version, field types, checksums), for a
caller that needs a field before it reads the arrays (the launcher's world size).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clusterlm.fileio import atomic_write_bytes, read_versioned_json

__all__ = [
    "ARRAY_NAMES", "PLAN_FORMAT", "PLAN_JSON", "PLAN_NPZ", "PLAN_VERSION", "READABLE_VERSIONS", "SIGNAL_ARRAYS",
    "SUMMARY_FIELDS", "PlanFiles", "plan_dir_hint", "read_plan_files", "read_plan_meta", "write_plan_files",
]

PLAN_FORMAT = "clusterlm.plan"
PLAN_VERSION = 2  # 2: checksummed (plan.json's fields, plan.npz and its arrays); 1: checksums optional
READABLE_VERSIONS = (1, 2)
PLAN_JSON = "plan.json"
PLAN_NPZ = "plan.npz"
ARRAY_NAMES = ("rank_indices", "weights", "cluster_labels", "distances", "lengths", "cluster_sizes")
SIGNAL_ARRAYS = ("grad_norms", "losses")  # optional arrays: the per-example signals of the features
# plan.json fields that summarise plan.npz (checked against it on load); "arrays" and "checksums" carry checksums.
SUMMARY_FIELDS = ("n_examples", "n_selected", "per_rank", "cluster_sizes", "clusters", "ranks")
_NOT_SUMMED = ("arrays", "checksums")
_BROKEN = "truncated or not a clusterlm plan file"
_EDIT_FIX = (
    "plan.json is not meant to be edited by hand (re-indenting or reordering it is fine): load the plan with "
    "clusterlm.plan.Plan.load, change it and save it with Plan.save (which records new checksums), or make it "
    "again (clusterlm select)."
)
_TYPE_FIX = "Restore plan.json as it was saved, or make the plan again (clusterlm select)."
_MISSING = object()


# ---- writing ---------------------------------------------------------------------------------------------


def _digest(value: Any) -> str:
    """sha256 of a JSON value's content (key order and layout do not count)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def _array_digest(arr: np.ndarray) -> str:
    """sha256 of an array's dtype, shape and bytes."""
    h = hashlib.sha256(f"{arr.dtype.str}{arr.shape}".encode())
    h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def write_plan_files(directory: str | os.PathLike, fields: dict[str, Any], arrays: dict[str, np.ndarray]) -> Path:
    """Write ``plan.json`` and ``plan.npz`` (version :data:`PLAN_VERSION`, checksummed) into ``directory``.

    The directory is created if needed; existing plan files there are replaced, each atomically, plan.npz
    first: a crash between the two renames leaves an old plan.json whose checksum refuses the new plan.npz.

    Args:
        directory: the plan directory.
        fields: plan.json's fields in file order (JSON values), without ``format``, ``version``, ``arrays`` and
            ``checksums``, which are added here.
        arrays: plan.npz's arrays (:data:`ARRAY_NAMES`, and those of :data:`SIGNAL_ARRAYS` the plan has).

    Returns:
        The directory.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    npz = buf.getvalue()
    meta = json.loads(json.dumps({"format": PLAN_FORMAT, "version": PLAN_VERSION, **fields}))  # what a reader gets
    meta["arrays"] = {
        "file": PLAN_NPZ,
        "sha256": hashlib.sha256(npz).hexdigest(),
        "checksums": {k: _array_digest(v) for k, v in arrays.items()},
    }
    meta["checksums"] = {k: _digest(v) for k, v in meta.items() if k not in _NOT_SUMMED}
    text = json.dumps(meta, indent=2) + "\n"
    atomic_write_bytes(path / PLAN_NPZ, npz)
    atomic_write_bytes(path / PLAN_JSON, text.encode("utf-8"))
    return path


# ---- plan.json -------------------------------------------------------------------------------------------


def plan_dir_hint(path: str | os.PathLike) -> str | None:
    """What to say when ``path`` is a file (``out/plan.npz``) where a plan directory is wanted; None otherwise.

    The hint reads after the path: ``"<path> is a file, not a plan directory: pass the directory out/ ..."``.
    """
    path = Path(path)
    if not path.is_file():
        return None
    hint = (f"is a file, not a plan directory: pass the directory {path.parent}{os.sep} that holds {PLAN_JSON} and "
            f"{PLAN_NPZ}")
    if not (path.parent / PLAN_JSON).is_file():
        hint += f" (there is no {PLAN_JSON} beside it: make a plan with clusterlm select --out {path.parent})"
    return hint


def _locate(path: str | os.PathLike) -> tuple[Path, Path]:
    """(plan directory, plan.json) of a plan directory or its plan.json.

    Raises:
        FileNotFoundError: no plan.json there (or ``path`` is another file of a plan: says to pass its directory).
    """
    path = Path(path)
    directory = path.parent if path.suffix == ".json" and not path.is_dir() else path
    json_path = path if directory is not path else directory / PLAN_JSON
    if not json_path.is_file():
        hint = plan_dir_hint(path) if directory is path else None
        if hint:
            raise FileNotFoundError(f"Plan.load: {path} {hint}.")
        raise FileNotFoundError(
            f"Plan.load: no plan at {json_path}; pass the directory written by Plan.save (it holds {PLAN_JSON} "
            f"and {PLAN_NPZ})."
        )
    return directory, json_path


def _field_error(where: Path, name: str, problem: str) -> ValueError:
    return ValueError(f"Plan.load: {where}: field {name!r} {problem}")


def _type_error(where: Path, name: str, problem: str) -> ValueError:
    return _field_error(where, name, f"{problem} {_TYPE_FIX}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_fields(meta: dict[str, Any], where: Path) -> None:
    """Every field Plan.load reads is there and of its type; the error names the field."""
    if "world_size" not in meta:
        raise _type_error(where, "world_size", "is missing: it must be the number of ranks the plan is for.")
    if not _is_int(meta["world_size"]) or meta["world_size"] < 1:
        got = meta["world_size"]
        raise _type_error(where, "world_size", f"must be a positive int, the number of ranks; got {got!r}.")
    fp = meta.get("fingerprint", _MISSING)
    if fp is _MISSING:
        raise _type_error(where, "fingerprint", "is missing: it must be the data fingerprint {'size', 'sha256'}.")
    if not isinstance(fp, dict) or "size" not in fp or "sha256" not in fp:
        raise _type_error(where, "fingerprint", f"must be {{'size': N, 'sha256': hex}}, got {fp!r}.")
    if not _is_int(fp["size"]) or fp["size"] < 0:
        raise _type_error(where, "fingerprint.size", f"must be an int >= 0, got {fp['size']!r}.")
    if not isinstance(fp["sha256"], str):
        raise _type_error(where, "fingerprint.sha256", f"must be a str, got {fp['sha256']!r}.")
    if not isinstance(meta.get("model_id", ""), str):
        raise _type_error(where, "model_id", f"must be a str, got {meta['model_id']!r}.")
    for name in ("config", "timings", "stats", "arrays", "checksums"):
        if meta.get(name) is not None and not isinstance(meta[name], dict):
            raise _type_error(where, name, f"must be a dict, got {type(meta[name]).__name__}.")
    arrays = meta.get("arrays") or {}
    for key, kind in (("file", str), ("sha256", str), ("checksums", dict)):
        if arrays.get(key) is not None and not isinstance(arrays[key], kind):
            raise _type_error(where, f"arrays.{key}", f"must be a {kind.__name__}, got {arrays[key]!r}.")
    if meta["version"] >= 2:  # checksummed: what carries the checksums cannot be missing
        for name, present in (("checksums", "checksums" in meta), ("arrays.sha256", "sha256" in arrays),
                              ("arrays.checksums", "checksums" in arrays)):
            if not present:
                raise _field_error(where, name, f"is missing: a version-{meta['version']} plan.json records it on "
                                                f"save, so it was removed afterwards. {_EDIT_FIX}")


def _check_checksums(meta: dict[str, Any], where: Path) -> set[str] | None:
    """Compare every field with its checksum; None for a plan without checksums (version 1 only).

    Returns:
        The summary fields (:data:`SUMMARY_FIELDS`) whose checksum differs: Plan.load names what differs in them
        once plan.npz is read.

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
            if name in SUMMARY_FIELDS:
                changed.add(name)
                continue
            raise _field_error(where, name, f"was changed after the plan was saved (its checksum differs). {_EDIT_FIX}")
    return changed


def _read_checked_meta(json_path: Path) -> tuple[dict[str, Any], set[str] | None]:
    """plan.json read and checked (format, version, field types, checksums); with the changed summaries."""
    meta, _ = read_versioned_json(
        json_path, PLAN_FORMAT, READABLE_VERSIONS, who="Plan.load", what="clusterlm plan file",
        fix="Save the plan again, or pass the directory Plan.save wrote.",
        version_fix="make the plan again with this clusterlm, or use the clusterlm that wrote it",
    )
    _check_fields(meta, json_path)
    return meta, _check_checksums(meta, json_path)


def read_plan_meta(path: str | os.PathLike) -> dict[str, Any]:
    """plan.json of a plan directory (or the file itself), checked as ``Plan.load`` checks it before the arrays.

    For a caller that needs a field before it loads the plan (the launcher's world size): a truncated, foreign,
    hand-edited (checksum) or ill-typed plan.json is refused here, before anything is decided from it.

    Raises:
        FileNotFoundError: no plan.json there.
        ValueError: as :func:`read_plan_files`, for plan.json's own problems (names the file and the field).
    """
    _, json_path = _locate(path)
    return _read_checked_meta(json_path)[0]


# ---- plan.npz --------------------------------------------------------------------------------------------


def _broken_npz(npz_path: Path, why: Any) -> ValueError:
    return ValueError(f"Plan.load: {npz_path} is {_BROKEN} ({why}). Save the plan again (or copy plan.npz again).")


def _parse_npz(npz_path: Path, raw: bytes) -> tuple[dict[str, np.ndarray], list[str]]:
    """The arrays of plan.npz (bytes ``raw``), without pickle, and the names of arrays that are not a plan's.

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
        missing = [k for k in ARRAY_NAMES if k not in npz.files]
        if missing:
            raise ValueError(f"Plan.load: {npz_path} lacks the arrays {missing}. Save the plan again.")
        data = {}
        for k in (*ARRAY_NAMES, *(name for name in SIGNAL_ARRAYS if name in npz.files)):
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
        extra = sorted(k for k in npz.files if k not in ARRAY_NAMES and k not in SIGNAL_ARRAYS)
    return data, extra


def _read_arrays(npz_path: Path, json_path: Path, record: dict[str, Any]) -> tuple[dict[str, np.ndarray], list[str]]:
    """plan.npz's arrays, checked against the checksums plan.json's ``arrays`` recorded (where it has them); and
    the names of arrays that are not a plan's."""
    if not npz_path.is_file():
        raise FileNotFoundError(f"Plan.load: {npz_path} is missing; plan.json alone is not a plan. Save it again.")
    raw = npz_path.read_bytes()
    whole = record.get("sha256")
    data, extra = _parse_npz(npz_path, raw)  # a truncated file is named as such, whatever its checksum
    sums = record.get("checksums") or {}
    differ = [k for k in data if k in sums and _array_digest(data[k]) != sums[k]]
    # the optional arrays: present in plan.npz exactly when the checksums list them (else another save's plan.npz)
    differ += [k for k in SIGNAL_ARRAYS if sums and (k in data) != (k in sums)]
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
    return data, extra


# ---- both files ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanFiles:
    """What :func:`read_plan_files` read: plan.json's fields and plan.npz's arrays, checked against each other.

    Attributes:
        json_path: the plan.json read.
        npz_path: the plan.npz read.
        meta: plan.json's fields.
        arrays: plan.npz's arrays (:data:`ARRAY_NAMES`).
        changed: summary fields whose checksum differs (:meth:`check_summaries` names what differs in them).
    """

    json_path: Path
    npz_path: Path
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]
    changed: frozenset[str]

    def check_summaries(self, summaries: dict[str, Any]) -> None:
        """plan.json's summaries must say what the arrays give (``summaries``: the plan's :data:`SUMMARY_FIELDS`
        as JSON values).

        Raises:
            ValueError: names the first field that differs (or whose checksum differs) and both files.
        """
        for name in SUMMARY_FIELDS:
            if name not in self.meta:
                continue  # a plan.json without it: nothing to disagree (fields the checksums miss were refused)
            diff = _first_difference(self.meta[name], summaries[name], name)
            if diff:
                field_path, found, expected = diff
                raise ValueError(
                    f"Plan.load: {self.json_path}: field {field_path!r} is {found!r} but {self.npz_path} gives "
                    f"{expected!r}: the files disagree (the weights, labels and rank lists are plan.npz's; plan.json "
                    f"only summarises them, and an edit there would be ignored). {_EDIT_FIX}"
                )
        for name in sorted(self.changed):
            problem = "was changed after the plan was saved (its checksum differs)"
            raise _field_error(self.json_path, name, f"{problem}. {_EDIT_FIX}")


def read_plan_files(path: str | os.PathLike, *, stacklevel: int = 2) -> PlanFiles:
    """Read a plan directory (or its plan.json) and check that its two files are the ones saved together.

    Args:
        path: the plan directory or its plan.json.
        stacklevel: of the warnings, as for :func:`warnings.warn` seen from the caller of this function.

    Raises:
        FileNotFoundError: plan.json or plan.npz missing (a file of a plan given instead of its directory: says
            to pass the directory).
        ValueError: not a plan file or a truncated one, an unsupported format version, a field missing or of
            the wrong type, a field edited after the save, arrays that do not belong to this plan.json, a world
            size that disagrees with the rank lists. Each message names the file and the field.

    Warns:
        UserWarning: a version-1 plan without checksums (edits cannot always be detected); arrays in plan.npz
            that are not a plan's (named; they are ignored).
    """
    directory, json_path = _locate(path)
    meta, changed = _read_checked_meta(json_path)
    record = meta.get("arrays") or {}
    if changed is None or not record.get("sha256"):
        warnings.warn(
            f"Plan.load: {json_path} has no checksums (saved by an older clusterlm), so an edit of it or a "
            "plan.npz from another save cannot always be detected. Save the plan again (Plan.load, then "
            "Plan.save) to add them.",
            UserWarning,
            stacklevel=stacklevel + 1,
        )
    npz_path = directory / record.get("file", PLAN_NPZ)
    arrays, extra = _read_arrays(npz_path, json_path, record)
    rank_indices = arrays["rank_indices"]
    if rank_indices.ndim != 2 or rank_indices.shape[0] != meta["world_size"]:
        raise ValueError(
            f"Plan.load: {npz_path}: array 'rank_indices' has shape {rank_indices.shape}, but {json_path}: "
            f"field 'world_size' is {meta['world_size']}: the files disagree (plan.json edited, or plan.npz "
            "from another save). Save the plan again."
        )
    if extra:
        warnings.warn(
            f"Plan.load: {npz_path} holds arrays that are not part of a plan ({', '.join(map(repr, extra))}); they "
            "are ignored. Save the plan again (Plan.load, then Plan.save) to drop them.",
            UserWarning,
            stacklevel=stacklevel + 1,
        )
    return PlanFiles(json_path, npz_path, meta, arrays, frozenset(changed or ()))


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
