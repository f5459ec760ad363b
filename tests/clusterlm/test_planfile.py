"""clusterlm.plan.fileformat: the plan's files (version 2 checksummed, version 1 still read) and their checks."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from clusterlm.plan import Plan
from clusterlm.plan.fileformat import (
    ARRAY_NAMES,
    PLAN_FORMAT,
    PLAN_VERSION,
    READABLE_VERSIONS,
    SUMMARY_FIELDS,
    plan_dir_hint,
    read_plan_files,
    read_plan_meta,
    write_plan_files,
)
from clusterlm.selection.allocation import selection_weights

N = 12


def _plan() -> Plan:
    labels = np.arange(N) % 3
    picked = np.arange(6, dtype=np.int64)
    return Plan(world_size=2, rank_indices=list(picked.reshape(2, 3)), weights=selection_weights(labels, picked, 3),
                cluster_labels=labels, distances=np.linspace(0, 1, N), cluster_sizes=np.bincount(labels),
                lengths=np.arange(N) + 1, fingerprint={"size": N, "sha256": "ab" * 32}, model_id="m@0123456789ab",
                config={"ratio": 0.5}, stats={"note": "x"})


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    return _plan().save(tmp_path / "p")


def _meta(d: Path) -> dict:
    return json.loads((d / "plan.json").read_text())


def _write(d: Path, meta: dict) -> None:
    (d / "plan.json").write_text(json.dumps(meta, indent=2))


def test_the_current_version_is_2_and_checksummed(saved):
    meta = _meta(saved)
    assert PLAN_VERSION == 2 and READABLE_VERSIONS == (1, 2)
    assert meta["format"] == PLAN_FORMAT and meta["version"] == PLAN_VERSION
    assert set(meta["arrays"]["checksums"]) == set(ARRAY_NAMES) and len(meta["arrays"]["sha256"]) == 64
    assert set(meta["checksums"]) == set(meta) - {"arrays", "checksums"}
    assert set(SUMMARY_FIELDS) <= set(meta)


def test_write_plan_files_writes_the_fields_in_order_after_format_and_version(tmp_path):
    arrays = {k: np.arange(3, dtype=np.int64) for k in ARRAY_NAMES}
    d = write_plan_files(tmp_path / "x", {"world_size": 1, "model_id": "m"}, arrays)
    assert list(_meta(d))[:4] == ["format", "version", "world_size", "model_id"]
    with np.load(d / "plan.npz", allow_pickle=False) as npz:
        assert sorted(npz.files) == sorted(ARRAY_NAMES)


@pytest.mark.parametrize("removed", ["checksums", "arrays.sha256", "arrays.checksums"])
def test_a_version_2_plan_without_its_checksums_is_refused_not_read_as_old(saved, removed):
    meta = _meta(saved)
    if removed == "checksums":
        meta.pop("checksums")
    else:
        meta["arrays"].pop(removed.split(".")[1])
    _write(saved, meta)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not the "no checksums" warning of version 1
        with pytest.raises(ValueError, match=rf"plan\.json: field '{removed}' is missing: a version-2 plan\.json"):
            Plan.load(saved)


def test_a_version_1_plan_with_checksums_is_checked_and_loads_silently(saved):
    meta = _meta(saved)
    meta["version"] = 1
    _write(saved, meta)
    with pytest.raises(ValueError, match=r"field 'version' was changed after the plan was saved"):
        Plan.load(saved)  # the version itself is under its checksum: an edit of it is refused
    meta["checksums"]["version"] = hashlib.sha256(b"1").hexdigest()  # what the last version-1 clusterlm wrote
    _write(saved, meta)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = Plan.load(saved)
    assert plan.version == 1
    plan.save(saved)
    assert _meta(saved)["version"] == 2 and Plan.load(saved).version == 2


def test_read_plan_meta_checks_plan_json_without_the_arrays(saved):
    (saved / "plan.npz").unlink()  # not read
    assert read_plan_meta(saved)["world_size"] == 2
    assert read_plan_meta(saved / "plan.json")["world_size"] == 2
    meta = _meta(saved)
    meta["world_size"] = 4
    _write(saved, meta)
    with pytest.raises(ValueError, match=r"field 'world_size' was changed after the plan was saved"):
        read_plan_meta(saved)
    meta["world_size"] = -1
    _write(saved, meta)
    with pytest.raises(ValueError, match=r"field 'world_size' must be a positive int.*got -1\. Restore plan\.json"):
        read_plan_meta(saved)


def test_read_plan_files_returns_both_files_checked(saved):
    files = read_plan_files(saved)
    assert files.json_path == saved / "plan.json" and files.npz_path == saved / "plan.npz"
    assert sorted(files.arrays) == sorted(ARRAY_NAMES) and files.changed == frozenset()
    plan = _plan()
    files.check_summaries(plan._summary_fields())
    summaries = plan._summary_fields()
    summaries["n_selected"] += 1
    with pytest.raises(ValueError, match=r"field 'n_selected' is 6 but .*plan\.npz gives 7"):
        files.check_summaries(summaries)


def test_plan_dir_hint_names_the_directory_for_a_file_of_a_plan(saved, tmp_path):
    assert plan_dir_hint(saved) is None and plan_dir_hint(tmp_path / "nothing") is None
    assert plan_dir_hint(saved / "plan.npz") == (
        f"is a file, not a plan directory: pass the directory {saved}/ that holds plan.json and plan.npz")
    lone = tmp_path / "lone.npz"
    lone.write_bytes(b"x")
    assert "there is no plan.json beside it: make a plan with clusterlm select --out" in plan_dir_hint(lone)


def test_the_plan_refuses_a_version_it_does_not_handle():
    plan = _plan()
    with pytest.raises(ValueError, match=r"Plan\.version: this clusterlm handles plan format versions \(1, 2\)"):
        Plan(**{**plan.__dict__, "version": 3})
    with pytest.raises(ValueError, match=r"Plan\.version"):
        Plan(**{**plan.__dict__, "version": True})
