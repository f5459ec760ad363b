"""FeatureStore: atomic shards, resume after SIGKILL bit for bit, out-of-core reads, refusals."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import clusterlm.selection.store as store_mod
import clusterlm.selection.store.feature_store as feature_store_mod
from clusterlm.selection.features import GradientFeaturizer
from clusterlm.selection.store import FeatureStore

REPO = Path(__file__).resolve().parents[2]


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return LlamaForCausalLM(cfg)


def examples(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(3, 12))
        ids = rng.integers(0, 50, length)
        labels = ids.copy()
        labels[: length // 2] = -100
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


# ---- the store on its own ---------------------------------------------------------------------------


def test_shards_assemble_into_a_read_only_memmap_and_stream_in_blocks(tmp_path):
    store = FeatureStore(tmp_path / "s", shard_size=4)
    assert store.begin(dim=3, config={"a": 1}) == set()
    data = np.arange(30, dtype=np.float32).reshape(10, 3)
    for i in (2, 0, 1):  # any order
        store.write_shard(i, data[4 * i : 4 * i + 4], data_sha256=f"h{i}")
    assert not store.complete
    np.testing.assert_array_equal(store.read_shard(1), data[4:8])
    feats = store.finalize(10)
    assert isinstance(feats, np.memmap) and not feats.flags.writeable
    np.testing.assert_array_equal(feats, data)
    assert store.complete and len(store) == 10 and store.dim == 3
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["features.npy", "manifest.json"]
    blocks = list(FeatureStore(tmp_path / "s", shard_size=4).iter_blocks(block_rows=3))
    assert [len(b) for b in blocks] == [3, 3, 3, 1]
    np.testing.assert_array_equal(np.concatenate(blocks), data)
    np.testing.assert_array_equal(store.read_shard(2), data[8:])



def _filled(path: Path) -> FeatureStore:
    store = FeatureStore(path, shard_size=2)
    store.begin(dim=2, config={})
    for i in range(3):
        store.write_shard(i, np.full((2, 2), i, dtype=np.float32), data_sha256=f"h{i}")
    return store


def test_a_new_store_is_version_2_and_its_manifest_is_public_as_a_copy(tmp_path):
    store = _filled(tmp_path)
    manifest = store.manifest()
    assert (manifest["format"], manifest["version"]) == (store_mod.STORE_FORMAT, store_mod.STORE_VERSION) == (
        "clusterlm.features", 2)
    assert sorted(manifest["shards"]) == ["0", "1", "2"] and all("sha256" in r for r in manifest["shards"].values())
    manifest["shards"].clear()
    assert len(store.manifest()["shards"]) == 3 and store.rows_done() == 6 and store.stored_shard_size() == 2


def test_a_version_2_record_without_its_checksum_is_dropped_and_recomputed(tmp_path):
    _filled(tmp_path)
    raw = json.loads((tmp_path / "manifest.json").read_text())
    del raw["shards"]["1"]["sha256"]
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    store = FeatureStore(tmp_path, shard_size=2)
    with pytest.raises(ValueError, match=r"shard 1 \(shard_00001\.npy\) has no checksum.*rerun the featurizer"):
        store.finalize(6)
    assert sorted(store.reload().manifest()["shards"]) == ["0", "2"]


@pytest.mark.parametrize(("fmt", "version", "match"), [
    ("clusterlm.features", 3, r"manifest\.json has format version 3; this clusterlm reads version 1 or 2"),
    ("clusterlm.features/7", None, r"format version 7"),
    ("clusterlm.plan", 2, r"not a clusterlm feature store \(its format is 'clusterlm.plan'"),
])
def test_a_manifest_of_another_version_or_format_is_refused(tmp_path, fmt, version, match):
    _filled(tmp_path)
    raw = json.loads((tmp_path / "manifest.json").read_text())
    raw.update(format=fmt, version=version)
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=match):
        FeatureStore(tmp_path, shard_size=2).begin(dim=2, config={})

def test_a_failed_shard_write_leaves_nothing_half_written(tmp_path, monkeypatch):
    store = FeatureStore(tmp_path, shard_size=2)
    store.begin(dim=2, config={})
    store.write_shard(0, np.ones((2, 2)), data_sha256="a")

    def broken_save(f, arr):
        f.write(b"\x93NUMPY partial")
        raise OSError("disk full")

    monkeypatch.setattr(feature_store_mod.np, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        store.write_shard(1, np.ones((2, 2)), data_sha256="b")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "shard_00000.npy"]
    reopened = FeatureStore(tmp_path, shard_size=2)
    assert reopened.begin(dim=2, config={}) == {0}


def test_stale_temporary_files_are_removed_on_resume(tmp_path):
    store = FeatureStore(tmp_path, shard_size=2)
    store.begin(dim=2, config={})
    (tmp_path / "shard_00001.npy.abc.tmp").write_bytes(b"partial")
    assert FeatureStore(tmp_path, shard_size=2).begin(dim=2, config={}) == set()
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(dim=3, config={"seed": 0}), "holds features of dim 2"),
        (dict(dim=2, config={"seed": 1}), r"another configuration \(seed: stored 0 vs now 1\)"),
    ],
)
def test_resuming_with_another_configuration_is_refused(tmp_path, kwargs, match):
    FeatureStore(tmp_path, shard_size=2).begin(dim=2, config={"seed": 0})
    with pytest.raises(ValueError, match=match):
        FeatureStore(tmp_path, shard_size=2).begin(**kwargs)
    with pytest.raises(ValueError, match="pass shard_size=2"):
        FeatureStore(tmp_path, shard_size=3).begin(dim=2, config={"seed": 0})


def test_store_refuses_bad_shards_and_incomplete_reads(tmp_path):
    store = FeatureStore(tmp_path, shard_size=2)
    with pytest.raises(FileNotFoundError, match="no manifest"):
        store.features()
    store.begin(dim=2, config={})
    with pytest.raises(ValueError, match=r"shape \(1..2, 2\)"):
        store.write_shard(0, np.ones((3, 2)), data_sha256="x")
    with pytest.raises(ValueError, match="non-finite"):
        store.write_shard(0, np.full((2, 2), np.nan), data_sha256="x")
    with pytest.raises(ValueError, match="is not complete"):
        store.features()
    with pytest.raises(ValueError, match="shards missing"):
        store.finalize(3)
    with pytest.raises(ValueError, match="shard_size must be a positive int"):
        FeatureStore(tmp_path, shard_size=0)


# ---- the featurizer writing into a store --------------------------------------------------------------


def test_featurize_into_a_store_equals_featurize_in_memory(tmp_path):
    feat = GradientFeaturizer(tiny_llama(), features="all-linear", dim=(4, 4))
    data = examples(11)
    in_memory = feat.featurize(data, progress=False, shard_size=4)
    stored = feat.featurize(data, store=FeatureStore(tmp_path, shard_size=4), progress=False)
    assert isinstance(stored, np.memmap)
    np.testing.assert_array_equal(stored, in_memory)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["complete"] and manifest["n_examples"] == 11 and len(manifest["shards"]) == 3


def test_a_complete_store_is_returned_without_recomputing(tmp_path, monkeypatch):
    feat = GradientFeaturizer(tiny_llama(), features="lm_head", dim=(2, 2))
    data = examples(5)
    first = np.array(feat.featurize(data, store=str(tmp_path), shard_size=2, progress=False))
    monkeypatch.setattr(GradientFeaturizer, "_run_batch", lambda *a: pytest.fail("recomputed"))
    again = feat.featurize(data, store=str(tmp_path), shard_size=2, progress=False)
    np.testing.assert_array_equal(again, first)


def test_resuming_on_changed_data_is_refused(tmp_path):
    feat = GradientFeaturizer(tiny_llama(), features="lm_head", dim=(2, 2))
    data = examples(6)
    store = FeatureStore(tmp_path, shard_size=2)
    store.begin(dim=feat.feature_dim, config=feat.config())
    feat.featurize(data[:2], store=store, progress=False)  # a complete store of 2 examples
    with pytest.raises(ValueError, match="is complete with 2 examples but the data has more"):
        feat.featurize(data, store=FeatureStore(tmp_path, shard_size=2), progress=False)
    other = FeatureStore(tmp_path / "other", shard_size=2)
    other.begin(dim=feat.feature_dim, config=feat.config())
    other.write_shard(0, np.ones((2, 4)), data_sha256="not the data")
    with pytest.raises(ValueError, match="differ from those stored in shard 0"):
        feat.featurize(data, store=other, progress=False)


def test_a_bad_example_in_a_stream_stops_before_its_shard_is_written(tmp_path):
    feat = GradientFeaturizer(tiny_llama(), features="lm_head", dim=(2, 2))
    data = examples(7)
    data[5]["labels"] = [-100] * len(data[5]["labels"])
    with pytest.raises(ValueError, match="example 5 has no answer token"):
        feat.featurize(iter(data), store=FeatureStore(tmp_path, shard_size=2), progress=False)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert sorted(manifest["shards"]) == ["0", "1"] and not manifest["complete"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "shard_00000.npy", "shard_00000.signals.npy",
                                                          "shard_00001.npy", "shard_00001.signals.npy"]


def test_a_model_of_another_configuration_cannot_resume_a_store(tmp_path):
    data = examples(4)
    GradientFeaturizer(tiny_llama(0), features="lm_head", dim=(2, 2)).featurize(
        data, store=str(tmp_path), shard_size=2, progress=False
    )
    with pytest.raises(ValueError, match="another configuration"):
        GradientFeaturizer(tiny_llama(1), features="lm_head", dim=(2, 2)).featurize(
            data, store=str(tmp_path), shard_size=2, progress=False
        )


CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np, torch
    torch.set_num_threads(1)
    from transformers import LlamaConfig, LlamaForCausalLM
    from clusterlm.selection.features import GradientFeaturizer
    from clusterlm.selection.store import FeatureStore

    resume_dir, fresh_dir, slow = sys.argv[1], sys.argv[2], sys.argv[3] == "slow"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(cfg)
    rng = np.random.default_rng(0)
    data = []
    for _ in range(36):
        n = int(rng.integers(3, 12)); ids = rng.integers(0, 50, n); labels = ids.copy(); labels[: n // 2] = -100
        data.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    if slow:  # widen the window in which the parent's SIGKILL lands mid-run
        original = FeatureStore.write_shard
        def write_shard(self, *args, **kwargs):
            time.sleep(0.15)
            original(self, *args, **kwargs)
            time.sleep(0.1)
        FeatureStore.write_shard = write_shard
    feat = GradientFeaturizer(model, features="all-linear", dim=(4, 4))
    feat.featurize(data, store=FeatureStore(resume_dir, shard_size=3), batch_tokens=20, progress=False)
    if fresh_dir != "-":
        feat.featurize(data, store=FeatureStore(fresh_dir, shard_size=3), batch_tokens=20, progress=False)
    """
)


def test_a_run_killed_at_a_random_time_resumes_to_identical_features(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "python_api"), os.environ.get("PYTHONPATH", "")])
    )
    resumed, fresh = tmp_path / "resumed", tmp_path / "fresh"
    child = subprocess.Popen([sys.executable, str(script), str(resumed), "-", "slow"], env=env)
    try:
        manifest = resumed / "manifest.json"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and child.poll() is None:
            if manifest.is_file() and json.loads(manifest.read_text())["shards"]:
                break
            time.sleep(0.01)
        delay = random.uniform(0.0, 0.8)  # 12 shards at >= 0.25 s each: the run is still going
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL, f"child ended on its own (kill delay {delay:.2f} s)"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    state = json.loads(manifest.read_text())
    assert not state["complete"] and 1 <= len(state["shards"]) < 12, (delay, state["shards"].keys())
    done = subprocess.run([sys.executable, str(script), str(resumed), str(fresh), "fast"], env=env, timeout=300)
    assert done.returncode == 0
    a = np.load(resumed / "features.npy")
    b = np.load(fresh / "features.npy")
    assert a.shape == (36, 16)
    assert a.tobytes() == b.tobytes(), f"resumed run differs (kill delay {delay:.2f} s)"
