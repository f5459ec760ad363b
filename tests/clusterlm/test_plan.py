"""Plan: invariants, save/load (no pickle, atomic, versioned), verify, summary, token stats. (The weight rule,
selection_weights, is tested in test_allocation.py.)"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from tiny_cases import random_examples

from clusterlm.plan import Plan
from clusterlm.plan.fileformat import PLAN_VERSION
from clusterlm.selection.allocation import selection_weights


def _fingerprint_scheme(examples) -> dict:
    """The contract's fingerprint scheme (clusterlm.data.fingerprint), for tests that must not depend on it."""
    digest = hashlib.sha256()
    for ex in examples:
        ids = np.asarray(ex["input_ids"], dtype=np.int64)
        labels = np.asarray(ex["labels"], dtype=np.int64)
        digest.update(np.int64(len(ids)).tobytes())
        digest.update(ids.tobytes())
        digest.update(labels.tobytes())
    return {"size": len(examples), "sha256": digest.hexdigest()}


def _examples(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    return random_examples(n, seed, lengths=(3, 12), ids=(0, 100), prompt_div=2)


class _Data:
    """A data set that fingerprints itself (the SFTDataset protocol)."""

    def __init__(self, examples):
        self.examples = examples

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]

    def fingerprint(self):
        return _fingerprint_scheme(self.examples)


def make_plan(n: int = 40, world_size: int = 2, per_rank: int = 6, n_clusters: int = 2, seed: int = 0,
              examples=None) -> Plan:
    """One cluster-per-rank style plan: rank r takes per_rank examples of cluster r % n_clusters."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % n_clusters
    rng.shuffle(labels)
    taken = []
    for r in range(world_size):
        pool = np.setdiff1d(np.flatnonzero(labels == r % n_clusters), np.concatenate(taken) if taken else [])
        taken.append(rng.permutation(pool)[:per_rank].astype(np.int64))
    selected = np.concatenate(taken)
    examples = examples if examples is not None else _examples(n, seed)
    return Plan(
        world_size=world_size,
        rank_indices=taken,
        weights=selection_weights(labels, selected, n_clusters),
        cluster_labels=labels,
        distances=rng.random(n),
        cluster_sizes=np.bincount(labels, minlength=n_clusters),
        lengths=np.array([len(e["input_ids"]) for e in examples], dtype=np.int64),
        fingerprint=_fingerprint_scheme(examples),
        model_id="tiny@abc",
        config={"method": "test", "ratio": 0.3, "dims": (4, 4)},
        timings={"features": 1.5, "kmeans": 0.25},
        stats={"note": "ok", "ratio": np.float64(1.25)},
    )


# ---- invariants ------------------------------------------------------------------------------------


def _fields(plan: Plan) -> dict:
    return {k: getattr(plan, k) for k in ("world_size", "rank_indices", "weights", "cluster_labels", "distances",
                                          "cluster_sizes", "lengths", "fingerprint", "model_id", "config",
                                          "timings", "stats")}


def _mutations():
    def unequal(f):
        f["rank_indices"] = [f["rank_indices"][0], f["rank_indices"][1][:-1]]

    def out_of_range(f):
        f["rank_indices"] = [f["rank_indices"][0].copy(), f["rank_indices"][1].copy()]
        f["rank_indices"][1][0] = 40

    def overlap(f):
        f["rank_indices"] = [f["rank_indices"][0], np.concatenate([f["rank_indices"][0][:1], f["rank_indices"][1][1:]])]

    def negative(f):
        w = f["weights"].copy()
        w[f["rank_indices"][0][0]] = -0.5
        f["weights"] = w

    def outside(f):
        w = f["weights"].copy()
        w[np.flatnonzero(w == 0)[0]] = 0.1
        f["weights"] = w

    def mean(f):
        f["weights"] = f["weights"] * 1.001

    def nan(f):
        w = f["weights"].copy()
        w[f["rank_indices"][0][0]] = np.nan
        f["weights"] = w

    def shapes(f):
        f["lengths"] = f["lengths"][:-1]

    def fp_size(f):
        f["fingerprint"] = {"size": 41, "sha256": "x"}

    def sizes(f):
        f["cluster_sizes"] = f["cluster_sizes"] + 1

    def labels(f):
        lab = f["cluster_labels"].copy()
        lab[0] = 7
        f["cluster_labels"] = lab

    def world(f):
        f["world_size"] = 3

    def config(f):
        f["config"] = {"fn": object()}

    def timing(f):
        f["timings"] = {"features": "slow"}

    def float_idx(f):
        f["rank_indices"] = [r.astype(np.float64) for r in f["rank_indices"]]

    return [
        (unequal, "same number of examples"),
        (out_of_range, r"indices must lie in \[0, 40\)"),
        (overlap, "appear more than once"),
        (negative, ">= 0"),
        (outside, "unselected examples must have weight 0"),
        (mean, "mean weight over the 12 selected examples must be 1"),
        (nan, "finite"),
        (shapes, r"Plan.lengths: expected shape \(40,\)"),
        (fp_size, "size 41 differs"),
        (sizes, "cluster_sizes: must equal"),
        (labels, "cluster_labels: must lie in"),
        (world, "expected 3 per-rank arrays"),
        (config, "cannot be stored in plan.json"),
        (timing, "must map to seconds"),
        (float_idx, "integer array"),
    ]


@pytest.mark.parametrize("mutate, match", _mutations(), ids=lambda x: getattr(x, "__name__", ""))
def test_invalid_plans_are_refused(mutate, match):
    fields = _fields(make_plan())
    mutate(fields)
    with pytest.raises(ValueError, match=match):
        Plan(**fields)


def test_validate_catches_mutation_after_construction_and_save_refuses(tmp_path):
    plan = make_plan()
    plan.weights = plan.weights * 2
    with pytest.raises(ValueError, match="must be 1"):
        plan.save(tmp_path / "p")
    assert not (tmp_path / "p" / "plan.json").exists()


def test_accessors():
    plan = make_plan(n=40, world_size=2, per_rank=6)
    assert plan.n_examples == 40 and plan.n_selected == 12 and plan.per_rank == 6
    idx = plan.indices(1)
    np.testing.assert_array_equal(idx, plan.rank_indices[1])
    with pytest.raises(ValueError):
        idx[0] = 3  # read-only view: a trainer cannot corrupt the plan by accident
    np.testing.assert_array_equal(plan.rank_weights(1), plan.weights[plan.rank_indices[1]])
    for bad in (-1, 2, 1.0, True):
        with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\)"):
            plan.indices(bad)
    np.testing.assert_array_equal(plan.per_rank_tokens(), [plan.lengths[r].sum() for r in plan.rank_indices])


# ---- files -----------------------------------------------------------------------------------------


def test_save_load_roundtrip(tmp_path):
    plan = make_plan(n=40, world_size=2, per_rank=6)
    out = plan.save(tmp_path / "plan")
    assert sorted(p.name for p in out.iterdir()) == ["plan.json", "plan.npz"]  # no temporary files left
    for source in (out, out / "plan.json", str(out)):
        back = Plan.load(source)
        assert back.world_size == 2 and back.model_id == plan.model_id and back.version == PLAN_VERSION
        for name in ("weights", "cluster_labels", "distances", "cluster_sizes", "lengths"):
            a, b = getattr(plan, name), getattr(back, name)
            assert a.dtype == b.dtype and np.array_equal(a, b), name
        for a, b in zip(plan.rank_indices, back.rank_indices, strict=True):
            assert b.dtype == np.int64 and np.array_equal(a, b)
        assert back.fingerprint == plan.fingerprint
        assert back.config == {"method": "test", "ratio": 0.3, "dims": [4, 4]}  # tuples come back as lists
        assert back.timings == plan.timings and back.stats == {"note": "ok", "ratio": 1.25}
    # arrays are plain: readable without pickle, rank_indices as one (K, m) int64 array
    with np.load(out / "plan.npz", allow_pickle=False) as npz:
        assert npz["rank_indices"].shape == (2, 6) and npz["rank_indices"].dtype == np.int64
        assert set(npz.files) == {"rank_indices", "weights", "cluster_labels", "distances", "lengths", "cluster_sizes"}


def test_plan_json_is_human_readable_summary(tmp_path):
    plan = make_plan(n=40, world_size=2, per_rank=6)
    text = (plan.save(tmp_path) / "plan.json").read_text()
    assert text.startswith("{\n  \"format\"")  # indent 2
    meta = json.loads(text)
    assert meta["version"] == PLAN_VERSION and meta["world_size"] == 2 and meta["n_selected"] == 12
    assert meta["cluster_sizes"] == plan.cluster_sizes.tolist()
    assert meta["fingerprint"] == plan.fingerprint and meta["model_id"] == "tiny@abc"
    assert meta["timings"] == {"features": 1.5, "kmeans": 0.25}
    for row in meta["clusters"]:
        c = row["cluster"]
        sel = np.concatenate(plan.rank_indices)
        in_c = sel[plan.cluster_labels[sel] == c]
        assert row["size"] == plan.cluster_sizes[c] and row["selected"] == len(in_c)
        assert row["weight"] == pytest.approx(plan.weights[in_c].mean())
    for row in meta["ranks"]:
        idx = plan.rank_indices[row["rank"]]
        assert row["examples"] == 6 and row["tokens"] == plan.lengths[idx].sum()
        assert row["weight_mean"] == pytest.approx(plan.weights[idx].mean())
        assert sum(row["clusters"].values()) == 6


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no plan at"):
        Plan.load(tmp_path / "nowhere")
    d = make_plan().save(tmp_path / "a")
    meta = json.loads((d / "plan.json").read_text())

    meta_v = dict(meta, version=99)
    (d / "plan.json").write_text(json.dumps(meta_v))
    with pytest.raises(ValueError, match="version 99; this clusterlm reads version 1"):
        Plan.load(d)

    (d / "plan.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="not a clusterlm plan"):
        Plan.load(d)

    (d / "plan.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Plan.load(d)

    # json of one save with the npz of another: refused instead of mixing two plans
    (d / "plan.json").write_text(json.dumps(meta))
    other = make_plan(seed=1).save(tmp_path / "b")
    (d / "plan.npz").write_bytes((other / "plan.npz").read_bytes())
    with pytest.raises(ValueError, match="does not belong to"):
        Plan.load(d)

    (d / "plan.npz").unlink()
    with pytest.raises(FileNotFoundError, match="plan.npz is missing"):
        Plan.load(d)


def test_load_rejects_pickled_arrays(tmp_path):
    d = make_plan().save(tmp_path)
    with np.load(d / "plan.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["weights"] = np.array([object()] * 40, dtype=object)
    np.savez(d / "plan.npz", **arrays)
    meta = json.loads((d / "plan.json").read_text())
    meta["arrays"]["sha256"] = hashlib.sha256((d / "plan.npz").read_bytes()).hexdigest()
    (d / "plan.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="pickle"):
        Plan.load(d)


# ---- verify ----------------------------------------------------------------------------------------


def test_verify_with_a_self_fingerprinting_dataset():
    ex = _examples(40)
    plan = make_plan(examples=ex)
    plan.verify(_Data(ex))
    plan.verify(_Data(ex), world_size=2)
    with pytest.raises(ValueError, match="plan was made for 40 examples, the data set has 39"):
        plan.verify(_Data(ex[:-1]))
    swapped = [ex[1], ex[0], *ex[2:]]
    hash_msg = (r"content hash differs: plan [0-9a-f]{12}\.\., data [0-9a-f]{12}\.\. — "
                "the data changed or is in another order")
    with pytest.raises(ValueError, match=hash_msg):
        plan.verify(_Data(swapped))
    with pytest.raises(ValueError, match="plan is for world size 2, this run has 4 processes"):
        plan.verify(_Data(ex), world_size=4)
    with pytest.raises(ValueError, match="has 39; plan is for world size 2, this run has 1 processes"):
        plan.verify(_Data(ex[:-1]), world_size=1)


def test_verify_with_a_list_uses_clusterlm_data_fingerprint():
    from clusterlm.data import fingerprint

    ex = _examples(40)
    assert fingerprint(ex) == _fingerprint_scheme(ex)  # the contract's scheme, which _Data above follows
    plan = make_plan(examples=ex)
    plan.verify(ex)
    changed = [dict(e) for e in ex]
    changed[5] = {"input_ids": ex[5]["input_ids"], "labels": np.where(ex[5]["labels"] < 0, -100, 0)}
    with pytest.raises(ValueError, match="content hash differs"):
        plan.verify(changed)


# ---- text and token statistics ---------------------------------------------------------------------


def test_summary_reports_ranks_clusters_and_timings():
    plan = make_plan(n=40, world_size=2, per_rank=6)
    text = plan.summary()
    lines = text.splitlines()
    assert "12 of 40 examples selected (30.0 %), world size 2, 6 per rank" in lines[0]
    assert "config: method=test, ratio=0.3" in text and "dims" not in text
    tokens = plan.per_rank_tokens()
    for r in range(2):
        row = next(line for line in lines if line.split()[:1] == [str(r)] and len(line.split()) == 5)
        _, clusters, examples, tok, weight = row.split()
        assert clusters == str(r) and int(examples) == 6 and int(tok) == tokens[r]
        assert float(weight) == pytest.approx(plan.rank_weights(r).mean(), abs=1e-4)
    assert any(line.split() == ["cluster", "n_c", "s_c", "weight"] for line in lines)
    assert any(line.split()[:3] == ["0", "20", "6"] for line in lines)
    assert any(line.split() == ["kmeans", "0.250"] for line in lines)


def test_summary_without_clustering():
    n = 10
    plan = Plan(world_size=1, rank_indices=[np.arange(4)], weights=selection_weights(np.zeros(n, int), np.arange(4), 1),
                cluster_labels=np.full(n, -1), distances=np.full(n, np.nan), cluster_sizes=np.zeros(0, np.int64),
                lengths=np.arange(n), fingerprint={"size": n, "sha256": "0" * 64}, model_id="m")
    assert "no clustering" in plan.summary()


def test_step_token_ratio_by_hand():
    n = 8
    lengths = np.array([10, 20, 30, 40, 5, 5, 7, 100], dtype=np.int64)
    plan = Plan(world_size=2, rank_indices=[np.array([0, 1, 2]), np.array([3, 4, 7])],
                weights=selection_weights(np.zeros(n, int), [0, 1, 2, 3, 4, 7], 1), cluster_labels=np.full(n, -1),
                distances=np.full(n, np.nan), cluster_sizes=np.zeros(0, np.int64), lengths=lengths,
                fingerprint={"size": n, "sha256": ""}, model_id="m")
    # batch 2: step 0 tokens (30, 45), step 1 (the last, shorter) (30, 100)
    np.testing.assert_allclose(plan.step_token_ratio(2), [45 / 37.5, 100 / 65])
    np.testing.assert_allclose(plan.step_token_ratio(1), [40 / 25, 20 / 12.5, 100 / 65])
    np.testing.assert_allclose(plan.step_token_ratio(3), [145 / 102.5])
    np.testing.assert_array_equal(plan.per_rank_tokens(), [60, 145])
    with pytest.raises(ValueError, match="batch_size"):
        plan.step_token_ratio(0)


def test_step_token_ratio_is_one_when_ranks_are_aligned():
    n = 12
    lengths = np.array([5, 9, 2, 7, 1, 3] * 2, dtype=np.int64)
    plan = Plan(world_size=2, rank_indices=[np.arange(6), np.arange(6, 12)],
                weights=np.ones(n), cluster_labels=np.full(n, -1), distances=np.full(n, np.nan),
                cluster_sizes=np.zeros(0, np.int64), lengths=lengths, fingerprint={"size": n, "sha256": ""},
                model_id="m")
    np.testing.assert_allclose(plan.step_token_ratio(4), 1.0)


def test_save_is_atomic_when_the_rename_fails(tmp_path, monkeypatch):
    d = make_plan().save(tmp_path)
    before = {p.name: p.read_bytes() for p in Path(d).iterdir()}

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        make_plan(seed=5).save(d)
    monkeypatch.undo()
    # the old plan is intact and no temporary file is left behind
    assert {p.name: p.read_bytes() for p in Path(d).iterdir()} == before
    assert Plan.load(d).fingerprint == make_plan().fingerprint
