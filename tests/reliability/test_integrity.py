"""Integrity of what clusterlm writes, as a careless or unlucky user meets it (issue 15, classes 5, 6).

Plans: a hand-edited plan.json, a plan.npz from another save, truncated / empty / foreign files, a field of the
wrong type, a plan made with another model. Feature stores: a bit flip in a shard or in features.npy, a truncated
or missing shard, a full disk (ENOSPC) or an I/O error while features.npy is assembled. Every case must end in one
clear message naming the file and what is wrong (or be repaired by the next run), never in NaN features, a
``BadZipFile`` traceback or a SIGBUS. Files of the previous version (no checksums) still load, with a warning.
"""

from __future__ import annotations

import errno
import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

import clusterlm.selection.store.feature_store as feature_store_mod
from clusterlm.plan import Plan
from clusterlm.selection.allocation import selection_weights
from clusterlm.selection.store import FeatureStore

# ---- plans -------------------------------------------------------------------------------------------------


def make_plan(seed: int = 0, n: int = 30, world_size: int = 2, per_rank: int = 5, model_id: str = "tiny@0123456789ab"):
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % 3)
    picked = rng.permutation(n)[: world_size * per_rank].astype(np.int64)
    return Plan(
        world_size=world_size,
        rank_indices=list(picked.reshape(world_size, per_rank)),
        weights=selection_weights(labels, picked, 3),
        cluster_labels=labels,
        distances=rng.random(n),
        cluster_sizes=np.bincount(labels, minlength=3),
        lengths=rng.integers(1, 50, n),
        fingerprint={"size": n, "sha256": f"{seed:064x}"},
        model_id=model_id,
        config={"method": "test", "ratio": 0.3},
        timings={"features": 1.0},
        stats={"note": "ok"},
    )


@pytest.fixture
def saved(tmp_path) -> Path:
    return make_plan().save(tmp_path / "plan")


def _edit_json(d: Path, edit) -> None:
    meta = json.loads((d / "plan.json").read_text())
    edit(meta)
    (d / "plan.json").write_text(json.dumps(meta, indent=2))


def _make_old(d: Path) -> None:
    """What the previous clusterlm wrote: format version 1, no checksums over plan.json, no per-array checksums."""

    def strip(meta):
        meta["version"] = 1
        meta.pop("checksums", None)
        meta["arrays"].pop("checksums", None)

    _edit_json(d, strip)


def _set(path: str, value):
    """An edit of plan.json: set ``meta[a][b]...`` (path "a.b.0.c") to ``value``."""

    def edit(meta):
        *parents, last = path.split(".")
        obj = meta
        for key in parents:
            obj = obj[int(key)] if isinstance(obj, list) else obj[key]
        if isinstance(obj, list):
            obj[int(last)] = value
        else:
            obj[last] = value

    return edit


def _clusters_weight(meta):
    meta["clusters"][0]["weight"] = 2.0 * meta["clusters"][0]["weight"]


def _ranks_weight(meta):
    meta["ranks"][1]["weight_mean"] = 1.5


def _ranks_labels(meta):
    meta["ranks"][0]["clusters"] = {"0": meta["ranks"][0]["examples"]}


def _cluster_sizes(meta):
    meta["cluster_sizes"] = meta["cluster_sizes"][::-1] if meta["cluster_sizes"][0] != meta["cluster_sizes"][-1] \
        else [s + 1 for s in meta["cluster_sizes"]]


def _clusters_selected(meta):
    meta["clusters"][1]["selected"] += 1


# Edits of the summaries plan.json holds next to plan.npz's arrays (the arrays win; the edit must not be ignored).
SUMMARY_EDITS = [
    (_clusters_weight, r"field 'clusters\[0\]\.weight'"),
    (_ranks_weight, r"field 'ranks\[1\]\.weight_mean'"),
    (_ranks_labels, r"field 'ranks\[0\]\.clusters"),
    (_cluster_sizes, r"field 'cluster_sizes"),
    (_clusters_selected, r"field 'clusters\[1\]\.selected'"),
    (_set("n_selected", 11), r"field 'n_selected'"),
]


@pytest.mark.parametrize("old", [False, True], ids=["checksummed", "old-format"])
@pytest.mark.parametrize(("edit", "field"), SUMMARY_EDITS, ids=[m for _, m in SUMMARY_EDITS])
def test_a_hand_edited_summary_in_plan_json_is_refused_naming_the_field(saved, edit, field, old):
    if old:
        _make_old(saved)
    _edit_json(saved, edit)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the old format's "no checksums" warning
        with pytest.raises(ValueError, match=r"plan\.json: " + field) as err:
            Plan.load(saved)
    assert "plan.npz" in str(err.value)  # says which file holds the real values


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (_set("world_size", 3), "world_size"),
        (_set("model_id", "other@ffffffffffff"), "model_id"),
        (_set("fingerprint.sha256", "0" * 63 + "1"), "fingerprint"),
        (_set("config.ratio", 0.9), "config"),
        (_set("stats.note", "edited"), "stats"),
        (_set("learning_rate", 1e-4), "learning_rate"),
    ],
    ids=["world_size", "model_id", "fingerprint", "config", "stats", "added-field"],
)
def test_an_edited_field_is_caught_by_the_checksum(saved, edit, field):
    _edit_json(saved, edit)
    with pytest.raises(ValueError, match=rf"plan\.json: field '{field}' .*(changed|added) after the plan was saved"):
        Plan.load(saved)


def test_an_edited_world_size_in_an_old_plan_is_refused_naming_the_field(saved):
    _make_old(saved)
    _edit_json(saved, _set("world_size", 3))
    with pytest.warns(UserWarning, match="no checksums"), pytest.raises(ValueError, match=r"field 'world_size'"):
        Plan.load(saved)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("2", r"plan\.json: field 'world_size' must be a positive int.*got '2'"),
        (2.0, r"plan\.json: field 'world_size' must be a positive int.*got 2\.0"),
        (None, r"plan\.json: field 'world_size' must be a positive int.*got None"),
        ("missing", r"plan\.json: field 'world_size' is missing"),
    ],
    ids=["str", "float", "null", "missing"],
)
def test_a_world_size_of_the_wrong_type_or_missing_names_the_field(saved, value, match):
    _edit_json(saved, (lambda m: m.pop("world_size")) if value == "missing" else _set("world_size", value))
    with pytest.raises(ValueError, match=match):
        Plan.load(saved)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_set("fingerprint", "abc"), r"field 'fingerprint' must be"),
        (_set("fingerprint.size", "30"), r"field 'fingerprint\.size' must be"),
        (_set("model_id", 7), r"field 'model_id' must be a str"),
        (_set("config", [1, 2]), r"field 'config' must be a dict"),
        (_set("arrays", "plan.npz"), r"field 'arrays' must be a dict"),
    ],
    ids=["fingerprint", "fingerprint.size", "model_id", "config", "arrays"],
)
def test_other_fields_of_the_wrong_type_name_the_field(saved, edit, match):
    _edit_json(saved, edit)
    with pytest.raises(ValueError, match=r"plan\.json: " + match):
        Plan.load(saved)


def test_reformatting_plan_json_is_a_supported_edit(saved):
    meta = json.loads((saved / "plan.json").read_text())
    (saved / "plan.json").write_text(json.dumps(dict(reversed(list(meta.items()))), indent=7, sort_keys=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = Plan.load(saved)
    np.testing.assert_array_equal(back.weights, make_plan().weights)


def test_a_plan_npz_from_another_plan_is_refused_naming_the_arrays(saved, tmp_path):
    other = make_plan(seed=1).save(tmp_path / "other")
    (saved / "plan.npz").write_bytes((other / "plan.npz").read_bytes())
    with pytest.raises(ValueError, match=r"does not belong to .*plan\.json.*'weights'"):
        Plan.load(saved)


def test_a_swapped_npz_with_its_hash_copied_too_is_still_refused(saved, tmp_path):
    other = make_plan(seed=1).save(tmp_path / "other")
    (saved / "plan.npz").write_bytes((other / "plan.npz").read_bytes())
    sha = json.loads((other / "plan.json").read_text())["arrays"]["sha256"]
    _edit_json(saved, _set("arrays.sha256", sha))
    with pytest.raises(ValueError, match=r"plan\.npz.*'weights'"):
        Plan.load(saved)


def _truncate_half(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _truncate_tail(p: Path) -> None:  # the zip directory at the end is lost
    p.write_bytes(p.read_bytes()[:-30])


def _empty(p: Path) -> None:
    p.write_bytes(b"")


def _foreign(p: Path) -> None:
    p.write_bytes(b"this is not a zip file at all\n" * 10)


def _lone_npy(p: Path) -> None:
    with open(p, "wb") as f:
        np.save(f, np.arange(3))


BROKEN_NPZ = [_truncate_half, _truncate_tail, _empty, _foreign, _lone_npy]


@pytest.mark.parametrize("old", [False, True], ids=["with-hash", "without-hash"])
@pytest.mark.parametrize("damage", BROKEN_NPZ, ids=[f.__name__.strip("_") for f in BROKEN_NPZ])
def test_a_truncated_or_foreign_plan_npz_is_one_clear_error(saved, damage, old):
    if old:
        _edit_json(saved, lambda m: (m.pop("checksums"), m["arrays"].pop("checksums"), m["arrays"].pop("sha256"),
                                     m.update(version=1)))
    damage(saved / "plan.npz")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"plan\.npz.*truncated or not a clusterlm plan file"):
            Plan.load(saved)


@pytest.mark.parametrize(
    "text",
    ["", '{"format": "clusterlm.plan", "vers', "format: clusterlm.plan\nversion: 1\n", "\x00\xff\xfe garbage"],
    ids=["empty", "truncated", "yaml", "binary"],
)
def test_a_truncated_empty_or_non_json_plan_json_is_one_clear_error(saved, text):
    (saved / "plan.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=r"plan\.json.*truncated or not a clusterlm plan file"):
        Plan.load(saved)


def test_json_that_is_not_an_object_is_not_a_plan(saved):
    (saved / "plan.json").write_text("[1, 2, 3]")
    with pytest.raises(ValueError, match="not a clusterlm plan"):
        Plan.load(saved)


def test_a_plan_of_the_previous_version_still_loads_with_a_warning(saved):
    _make_old(saved)
    with pytest.warns(UserWarning, match=r"no checksums"):
        back = Plan.load(saved)
    np.testing.assert_array_equal(back.weights, make_plan().weights)
    # saving it again adds them: the next load is silent
    back.save(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Plan.load(saved)


def test_check_model_refuses_another_model_and_names_both_and_the_opt_out(saved):
    plan = Plan.load(saved)
    with pytest.raises(ValueError, match=r"made with model tiny@0123456789ab.*this is model big@ffffffffffff.*"
                                         r"--allow-other-model.*allow_other_model=True"):
        plan.check_model("big@ffffffffffff")
    with pytest.warns(UserWarning, match="made with model tiny@0123456789ab"):
        assert plan.check_model("big@ffffffffffff", allow_other_model=True) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan.check_model("tiny@0123456789ab") is True
        assert plan.check_model("./my-copy@0123456789ab") is True  # the label is informative; the hash decides


@pytest.mark.parametrize("how", ["missing", "empty"])
def test_an_old_plan_without_a_model_id_is_accepted_with_a_warning(saved, how):
    _make_old(saved)
    _edit_json(saved, (lambda m: m.pop("model_id")) if how == "missing" else _set("model_id", ""))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = Plan.load(saved)
    with pytest.warns(UserWarning, match="no model id"):
        assert plan.check_model("tiny@0123456789ab") is False


# ---- feature stores ----------------------------------------------------------------------------------------

DIM, SHARD, N = 3, 4, 14  # 4 shards, the last one of 2 rows


def fake(i: int, rows: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal((rows, DIM)).astype(np.float32)


REFERENCE = np.concatenate([fake(i, min(SHARD, N - i * SHARD)) for i in range(-(-N // SHARD))])


def fill(path: Path, computed: list | None = None) -> np.ndarray:
    """The featurizer's protocol with a fake feature function: begin, compute what is not stored, finalize."""
    store = FeatureStore(path, shard_size=SHARD)
    store.begin(dim=DIM, config={"fake": 1})
    for i in range(-(-N // SHARD)):
        if store.shard_record(i) is None:
            store.write_shard(i, fake(i, min(SHARD, N - i * SHARD)), data_sha256=f"h{i}")
            if computed is not None:
                computed.append(i)
    return store.finalize(N)


def _partial(path: Path) -> FeatureStore:
    store = FeatureStore(path, shard_size=SHARD)
    store.begin(dim=DIM, config={"fake": 1})
    for i in range(4):
        store.write_shard(i, fake(i, min(SHARD, N - i * SHARD)), data_sha256=f"h{i}")
    return store


def _flip(p: Path, offset_from_end: int, mask: int = 0x01) -> None:
    raw = bytearray(p.read_bytes())
    raw[-offset_from_end] ^= mask
    p.write_bytes(bytes(raw))


@pytest.mark.parametrize(("offset", "mask"), [(1, 0x7F), (9, 0x01)], ids=["to-nan", "low-bit"])
def test_a_bit_flip_in_a_shard_is_refused_the_shard_dropped_and_a_rerun_recomputes_it(tmp_path, offset, mask):
    store = _partial(tmp_path)
    _flip(tmp_path / "shard_00001.npy", offset, mask)
    with pytest.raises(ValueError, match=r"shard 1 .*shard_00001\.npy.*checksum.*rerun.*recompute"):
        store.finalize(N)
    assert not store.reload().complete and store.shard_record(1) is None and not list(tmp_path.glob("*.tmp"))
    computed: list[int] = []
    np.testing.assert_array_equal(fill(tmp_path, computed), REFERENCE)
    assert computed == [1]


def test_reading_a_bit_flipped_shard_is_refused(tmp_path):
    store = _partial(tmp_path)
    _flip(tmp_path / "shard_00002.npy", 5)
    with pytest.raises(ValueError, match=r"shard 2 .*checksum"):
        store.read_shard(2)
    np.testing.assert_array_equal(store.read_shard(0), fake(0, SHARD))


@pytest.mark.parametrize(("offset", "rows"), [(1, "12..13"), (4 * SHARD * DIM + 2, "8..11")], ids=["last", "third"])
def test_a_bit_flip_in_features_npy_is_refused_and_a_rerun_recomputes_only_its_rows(tmp_path, offset, rows):
    fill(tmp_path)
    _flip(tmp_path / "features.npy", offset, 0x7F)
    with pytest.raises(ValueError, match=rf"features\.npy.*rows {rows}.*rerun.*recompute"):
        FeatureStore(tmp_path, shard_size=SHARD).features()
    computed: list[int] = []
    np.testing.assert_array_equal(fill(tmp_path, computed), REFERENCE)
    assert computed == [int(rows.split("..")[0]) // SHARD]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["features.npy", "manifest.json"]


@pytest.mark.parametrize("damage", [_truncate_half, _empty, _foreign], ids=["truncated", "empty", "foreign"])
def test_a_truncated_features_npy_is_one_clear_error_and_a_rerun_recomputes(tmp_path, damage):
    fill(tmp_path)
    damage(tmp_path / "features.npy")
    with pytest.raises(ValueError, match=r"features\.npy.*truncated or not a clusterlm feature file"):
        FeatureStore(tmp_path, shard_size=SHARD).features()
    np.testing.assert_array_equal(fill(tmp_path), REFERENCE)


@pytest.mark.parametrize("damage", ["truncated", "empty", "header-only", "missing"])
def test_a_truncated_or_missing_shard_is_dropped_on_resume_and_recomputed(tmp_path, damage):
    _partial(tmp_path)
    p = tmp_path / "shard_00002.npy"
    if damage == "missing":
        p.unlink()
    else:
        keep = {"truncated": p.stat().st_size - 7, "empty": 0, "header-only": 128}[damage]
        p.write_bytes(p.read_bytes()[:keep])
    computed: list[int] = []
    with pytest.warns(UserWarning, match=r"shard 2 .*(truncated|missing).*recompute"):
        feats = fill(tmp_path, computed)
    np.testing.assert_array_equal(feats, REFERENCE)
    assert computed == [2]


def test_a_store_of_the_previous_version_still_reads_with_a_warning(tmp_path):
    fill(tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    for rec in manifest["shards"].values():
        rec.pop("sha256", None)
    manifest.pop("version")
    manifest["format"] = "clusterlm.features/1"  # how version 1 named its format
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match="no checksums"):
        feats = FeatureStore(tmp_path, shard_size=SHARD).features()
    np.testing.assert_array_equal(feats, REFERENCE)


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _unsupported(*args, **kwargs):
    raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))


def _fail_writes_after(n_ok: int, code: int):
    real, calls = os.write, [0]

    def write(fd, data):
        calls[0] += 1
        if calls[0] > n_ok:
            raise OSError(code, os.strerror(code))
        return real(fd, data)

    return write


@pytest.mark.parametrize(
    ("fallocate", "write_errno", "match"),
    [
        (_enospc, None, "no space left"),
        (_unsupported, errno.ENOSPC, "no space left"),
        (_unsupported, errno.EDQUOT, "quota"),
        (_unsupported, errno.EIO, "I/O error"),
    ],
    ids=["fallocate-ENOSPC", "write-ENOSPC", "write-EDQUOT", "write-EIO"],
)
def test_a_full_disk_while_assembling_features_is_one_clear_oserror_and_leaves_nothing(
    tmp_path, monkeypatch, fallocate, write_errno, match
):
    store = _partial(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    monkeypatch.setattr(os, "posix_fallocate", fallocate, raising=False)
    if write_errno is not None:
        monkeypatch.setattr(os, "write", _fail_writes_after(1, write_errno))
    with pytest.raises(OSError, match=match) as err:
        store.finalize(N)
    monkeypatch.undo()
    need = 128 + N * DIM * 4
    assert err.value.errno == (write_errno or errno.ENOSPC)
    assert "features.npy" in str(err.value) and f"{need:,} bytes" in str(err.value) and str(tmp_path) in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temporary file; the shards are kept
    assert not FeatureStore(tmp_path, shard_size=SHARD).complete
    np.testing.assert_array_equal(fill(tmp_path), REFERENCE)  # with space again, the rerun finishes


def test_a_full_disk_while_writing_a_shard_names_the_shard_and_the_bytes(tmp_path, monkeypatch):
    store = FeatureStore(tmp_path, shard_size=SHARD)
    store.begin(dim=DIM, config={"fake": 1})

    def full(f, arr):
        f.write(b"\x93NUMPY")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(feature_store_mod.np, "save", full)
    with pytest.raises(OSError, match=r"no space left.*shard_00000\.npy.*bytes") as err:
        store.write_shard(0, fake(0, SHARD), data_sha256="h0")
    monkeypatch.undo()
    assert err.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]
