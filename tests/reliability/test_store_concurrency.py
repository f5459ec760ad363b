"""Several processes on one feature store (issue 15, class 8): shards are claimed, so work is done once.

Two ``select`` runs started on one store directory used to compute every shard twice and the second died when
the first completed the store. Now a shard is claimed (a per-shard file, ``flock``-ed while it is computed): a
writer waits for, or skips, a shard a live process holds and takes it over when that process dies; the store is
finalized once. Tests run real processes (two featurizing runs of a tiny Llama; fast writers that drive the store
API with a fake feature function) and threads (``flock`` is per open file, so two stores in one process contend).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from clusterlm.selection.store import FeatureStore

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "python_api"),
                                                     os.environ.get("PYTHONPATH", "")]))
pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "win32", reason="POSIX flock")

DIM, SHARD = 3, 2


def fake(i: int, rows: int = SHARD) -> np.ndarray:
    return np.random.default_rng(i).standard_normal((rows, DIM)).astype(np.float32)


# A writer that loads in no time: only clusterlm.selection.store (and clusterlm.fileio) are imported, not the package.
FAST_PRELUDE = textwrap.dedent(
    f"""
    import json, os, sys, time, types
    pkg = types.ModuleType("clusterlm"); pkg.__path__ = [{str(REPO / "python_api" / "clusterlm")!r}]
    sys.modules["clusterlm"] = pkg
    import numpy as np
    from clusterlm.selection.store import FeatureStore
    DIM, SHARD = {DIM}, {SHARD}
    def fake(i, rows=SHARD):
        return np.random.default_rng(i).standard_normal((rows, DIM)).astype(np.float32)
    """
)

HOLDER = FAST_PRELUDE + textwrap.dedent(
    """
    store = FeatureStore(sys.argv[1], shard_size=SHARD)
    store.begin(dim=DIM, config={"fake": 1})
    assert store.claim(int(sys.argv[2]))
    print("claimed", flush=True)
    time.sleep(120)
    """
)

SPLITTER = FAST_PRELUDE + textwrap.dedent(
    """
    path, n_shards, go, log = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    store = FeatureStore(path, shard_size=SHARD)
    store.begin(dim=DIM, config={"fake": 1})
    while not os.path.exists(go):
        time.sleep(0.005)
    mine, todo = [], list(range(n_shards))
    while todo:  # skip what another live writer holds; then wait for it, and do what its writer left
        for i in todo:
            if store.claim(i):
                time.sleep(0.03)  # a shard takes a while to compute
                store.write_shard(i, fake(i), data_sha256=f"h{i}")
                mine.append(i)
        todo = store.wait_for_shards(todo)
    store.finalize(n_shards * SHARD)
    with open(log, "w") as f:
        json.dump(mine, f)
    """
)

LATE_WRITER = FAST_PRELUDE + textwrap.dedent(
    """
    store = FeatureStore(sys.argv[1], shard_size=SHARD)
    store.begin(dim=DIM, config={"fake": 1})
    assert store.claim(0)
    print("claimed", flush=True)
    time.sleep(0.5)
    store.write_shard(0, fake(0), data_sha256="h0")
    """
)

# What one "select" run does: featurize 200 examples into the store (a tiny causal LM, no transformers import).
MODEL_AND_DATA = textwrap.dedent(
    """
    import numpy as np, torch
    from torch import nn

    class TinyLM(nn.Module):
        def __init__(self, vocab=50, hidden=8):
            super().__init__()
            self.embed, self.mix = nn.Embedding(vocab, hidden), nn.Linear(hidden, hidden)
            self.lm_head = nn.Linear(hidden, vocab, bias=False)
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        def get_input_embeddings(self):
            return self.embed
        def get_output_embeddings(self):
            return self.lm_head
        def forward(self, input_ids, attention_mask=None, use_cache=False):
            h = torch.tanh(self.mix(self.embed(input_ids)))
            return self.lm_head(torch.cumsum(h, dim=1) / torch.arange(1, h.shape[1] + 1)[:, None])

    rng = np.random.default_rng(0)
    data = []
    for _ in range(200):
        n = int(rng.integers(3, 12)); ids = rng.integers(0, 50, n); labels = ids.copy(); labels[: n // 2] = -100
        data.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    """
)

FEATURIZE = MODEL_AND_DATA + textwrap.dedent(
    """
    import json, os, sys, time
    torch.set_num_threads(1)
    from clusterlm.selection.features import GradientFeaturizer
    from clusterlm.selection.store import FeatureStore

    store_dir, go, log = sys.argv[1], sys.argv[2], sys.argv[3]
    computed = []
    original = FeatureStore.write_shard
    def write_shard(self, index, *args, **kwargs):
        time.sleep(0.02)  # both runs overlap for the whole store
        original(self, index, *args, **kwargs)
        computed.append(index)
    FeatureStore.write_shard = write_shard
    feat = GradientFeaturizer(TinyLM(), features="lm_head", dim=(4, 4))
    while not os.path.exists(go):
        time.sleep(0.005)
    out = feat.featurize(data, store=FeatureStore(store_dir, shard_size=8), batch_tokens=64, progress=False)
    with open(log, "w") as f:
        json.dump({"computed": computed, "shape": list(out.shape)}, f)
    """
)


def _spawn(script: Path, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(script), *map(str, args)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(procs: list[subprocess.Popen], timeout: float = 120) -> None:
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_two_featurizing_runs_on_one_store_both_finish_and_compute_every_shard_once(tmp_path):
    import torch

    from clusterlm.selection.features import GradientFeaturizer

    script = tmp_path / "featurize.py"
    script.write_text(FEATURIZE)
    go = tmp_path / "go"
    procs = [_spawn(script, tmp_path / "store", go, tmp_path / f"log{r}.json") for r in range(2)]
    time.sleep(0.2)
    go.touch()
    _finish(procs)
    logs = [json.loads((tmp_path / f"log{r}.json").read_text()) for r in range(2)]
    assert all(log["shape"] == [200, 16] for log in logs)
    computed = sorted(logs[0]["computed"] + logs[1]["computed"])
    assert computed == list(range(25)), computed  # every shard once: none twice, none lost
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the runs: a thread count can change float summation order
    try:
        ns: dict = {}
        exec(MODEL_AND_DATA, ns)
        expected = GradientFeaturizer(ns["TinyLM"](), features="lm_head", dim=(4, 4)).featurize(
            ns["data"], shard_size=8, batch_tokens=64, progress=False)
    finally:
        torch.set_num_threads(threads)
    store = FeatureStore(tmp_path / "store", shard_size=8)
    np.testing.assert_array_equal(store.features(), expected)
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["features.npy", "manifest.json", "signals.npy"]


def test_two_writers_that_skip_claimed_shards_split_the_work(tmp_path):
    script = tmp_path / "split.py"
    script.write_text(SPLITTER)
    go = tmp_path / "go"
    procs = [_spawn(script, tmp_path / "store", 30, go, tmp_path / f"log{r}.json") for r in range(2)]
    time.sleep(0.3)
    go.touch()
    _finish(procs)
    mine = [json.loads((tmp_path / f"log{r}.json").read_text()) for r in range(2)]
    assert sorted(mine[0] + mine[1]) == list(range(30)), mine
    assert mine[0] and mine[1], mine  # both did part of it
    feats = FeatureStore(tmp_path / "store", shard_size=SHARD).features()
    np.testing.assert_array_equal(feats, np.concatenate([fake(i) for i in range(30)]))


def test_a_killed_writers_claim_is_taken_over(tmp_path):
    script = tmp_path / "hold.py"
    script.write_text(HOLDER)
    holder = _spawn(script, tmp_path, 3)
    try:
        assert holder.stdout.readline().strip() == "claimed", holder.stderr.read()
        store = FeatureStore(tmp_path, shard_size=SHARD)
        store.begin(dim=DIM, config={"fake": 1})  # a (re)starting writer's clean-up spares a live claim
        assert not store.claim(3)
        assert store.claim_holder(3)["pid"] == holder.pid
        assert store.claim(2)  # others are free
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert store.claim(3)  # the holder died: its claim is stale
        store.write_shard(3, fake(3), data_sha256="h3")
        assert store.claim_holder(3) is None and store.shard_record(3)["rows"] == SHARD
        assert not store.claim(3)  # done: nothing to claim
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_a_dead_writers_shard_is_recomputed_by_the_next_featurize_loop(tmp_path):
    script = tmp_path / "hold.py"
    script.write_text(HOLDER)
    holder = _spawn(script, tmp_path, 1)
    try:
        assert holder.stdout.readline().strip() == "claimed"
    finally:
        holder.kill()
        holder.wait()
    store = FeatureStore(tmp_path, shard_size=SHARD)
    store.begin(dim=DIM, config={"fake": 1})
    assert store.shard_record(1) is None  # not waited for: the holder is gone
    store.write_shard(1, fake(1), data_sha256="h1")


def test_shard_record_waits_for_a_live_holder_and_returns_what_it_wrote(tmp_path):
    script = tmp_path / "late.py"
    script.write_text(LATE_WRITER)
    writer = _spawn(script, tmp_path)
    try:
        assert writer.stdout.readline().strip() == "claimed"
        t0 = time.perf_counter()
        store = FeatureStore(tmp_path, shard_size=SHARD)
        store.begin(dim=DIM, config={"fake": 1})
        record = store.shard_record(0)  # waits instead of computing it a second time
        waited = time.perf_counter() - t0
    finally:
        _finish([writer])
    assert record is not None and record["data_sha256"] == "h0" and waited >= 0.3


def test_in_one_process_a_store_object_never_waits_for_another(tmp_path):
    a = FeatureStore(tmp_path, shard_size=SHARD)
    a.begin(dim=DIM, config={"fake": 1})
    assert a.shard_record(0) is None  # a claims shard 0 ... and is left alone (an inspection, an exception)
    b = FeatureStore(tmp_path, shard_size=SHARD)
    b.begin(dim=DIM, config={"fake": 1})
    assert b.shard_record(0) is None and b.claim(0)  # b computes it: no deadlock on its own process
    b.write_shard(0, fake(0), data_sha256="h0")
    assert FeatureStore(tmp_path, shard_size=SHARD).shard_record(0)["data_sha256"] == "h0"  # read-only: no claim


def test_concurrent_finalize_assembles_once_and_both_get_the_features(tmp_path):
    store = FeatureStore(tmp_path, shard_size=SHARD)
    store.begin(dim=DIM, config={"fake": 1})
    for i in range(20):
        store.write_shard(i, fake(i), data_sha256=f"h{i}")
    results, errors = [], []

    def run():
        try:
            results.append(np.array(FeatureStore(tmp_path, shard_size=SHARD).finalize(40)))
        except Exception as e:  # pragma: no cover - the failure being tested for
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    expected = np.concatenate([fake(i) for i in range(20)])
    assert len(results) == 4 and all(np.array_equal(r, expected) for r in results)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["features.npy", "manifest.json"]
