"""Sharded featurization: ranks fill one store, resume per shard, write concurrently; the 2-rank select flow."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from cluster_kernels import capacity_kmeans
from cluster_kernels.distributed import allgather_rows, distributed_capacity_kmeans
from clusterlm.fileio import FileLock
from clusterlm.selection.distributed import DistInfo, barrier, featurize_sharded, init_distributed, is_main
from clusterlm.selection.features import GradientFeaturizer
from clusterlm.selection.store import FeatureStore


def tiny_llama(seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM  # here: spawned ranks need not import it

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    return LlamaForCausalLM(cfg)


class TinyLM(nn.Module):
    """A causal LM for spawned ranks that loads in no time: embeddings, a causal running mean, an lm head."""

    def __init__(self, vocab: int = 50, hidden: int = 8, seed: int = 0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.mix = nn.Linear(hidden, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, use_cache: bool = False):
        h = torch.tanh(self.mix(self.embed(input_ids)))
        h = torch.cumsum(h, dim=1) / torch.arange(1, h.shape[1] + 1, dtype=h.dtype)[:, None]
        return self.lm_head(h)


def examples(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(3, 12))
        ids = rng.integers(0, 50, length)
        labels = ids.copy()
        labels[: length // 2] = -100
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


class Counting:
    """A featurizer wrapper that counts shards computed and can fail on the n-th one (a dying rank)."""

    def __init__(self, inner: GradientFeaturizer, fail_at: int | None = None) -> None:
        self.inner, self.fail_at, self.calls = inner, fail_at, 0
        self.feature_dim = inner.feature_dim

    def config(self) -> dict:
        return self.inner.config()

    def featurize_shards(self, data, store, shards, **kwargs):
        computed = []
        for w in shards:  # one shard at a time, so a rank can die between two shards
            if store.shard_record(w) is None:
                self.calls += 1
                if self.calls == self.fail_at:
                    raise RuntimeError("rank killed")
            computed += self.inner.featurize_shards(data, store, range(w, w + 1), **kwargs)
        return computed


def test_ranks_fill_contiguous_shards_and_the_result_equals_one_process(tmp_path):
    feat = GradientFeaturizer(tiny_llama(), features="all-linear", dim=(4, 4))
    data = examples(11)
    parts = [featurize_sharded(feat, data, tmp_path / "s", rank=r, world_size=3, shard_size=2, progress=False)
             for r in range(3)]
    assert [(p.shards, p.start, p.stop) for p in parts] == [(range(0, 2), 0, 4), (range(2, 4), 4, 8),
                                                            (range(4, 6), 8, 11)]
    assert [p.computed for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert not parts[0].complete  # no process group: nobody knows when the others are done
    np.testing.assert_array_equal(np.concatenate([p.local() for p in parts]), feat.featurize(data, progress=False,
                                                                                             shard_size=2))
    full = parts[2].finalize()
    np.testing.assert_array_equal(full, feat.featurize(data, progress=False, shard_size=2))
    np.testing.assert_array_equal(parts[1].local(), full[4:8])
    # The shard records are those of a single-process run on the same store layout.
    single = tmp_path / "single"
    feat.featurize(data, store=FeatureStore(single, shard_size=2), progress=False)
    ours = json.loads((tmp_path / "s" / "manifest.json").read_text())
    theirs = json.loads((single / "manifest.json").read_text())
    assert ours["shards"] == theirs["shards"] and ours["config"] == theirs["config"]


def test_a_restarted_rank_redoes_only_its_unfinished_shards(tmp_path):
    feat = GradientFeaturizer(tiny_llama(), features="lm_head", dim=(4, 2))
    data = examples(14)
    featurize_sharded(feat, data, tmp_path, rank=0, world_size=2, shard_size=2, progress=False)
    dying = Counting(feat, fail_at=3)
    with pytest.raises(RuntimeError, match="rank killed"):
        featurize_sharded(dying, data, tmp_path, rank=1, world_size=2, shard_size=2, progress=False)
    restarted = Counting(feat)
    part = featurize_sharded(restarted, data, tmp_path, rank=1, world_size=2, shard_size=2, progress=False)
    assert part.shards == range(4, 7) and part.computed == [6] and restarted.calls == 1
    np.testing.assert_array_equal(part.finalize(), feat.featurize(data, progress=False, shard_size=2))
    changed = [dict(ex) for ex in data]
    changed[9] = examples(1, seed=5)[0]
    with pytest.raises(ValueError, match="examples 8..9 differ from those stored in shard 4"):
        featurize_sharded(feat, changed, tmp_path, rank=1, world_size=2, progress=False)  # shard size: the store's


def _write_many(path: str, shards: list[int], seed: int) -> None:
    store = FeatureStore(path, shard_size=3)
    store.begin(dim=4, config={"k": 1})
    for i in shards:
        store.write_shard(i, np.full((3, 4), float(i), dtype=np.float32), data_sha256=f"h{i}")
        FeatureStore(path, shard_size=3).begin(dim=4, config={"k": 1})  # a (re)starting writer's clean-up


def test_concurrent_writers_lose_no_shard_and_no_clean_up_hits_a_live_writer(tmp_path):
    ctx = multiprocessing.get_context("fork")
    FeatureStore(tmp_path, shard_size=3).begin(dim=4, config={"k": 1})
    procs = [ctx.Process(target=_write_many, args=(str(tmp_path), list(range(r, 36, 3)), r)) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    store = FeatureStore(tmp_path, shard_size=3)
    assert store.begin(dim=4, config={"k": 1}) == set(range(36))
    feats = store.finalize(108)
    np.testing.assert_array_equal(feats[::3, 0], np.arange(36, dtype=np.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["features.npy", "manifest.json"]


def test_clean_up_spares_a_temporary_file_its_writer_still_holds(tmp_path):
    FeatureStore(tmp_path, shard_size=2).begin(dim=2, config={})
    tmp = tmp_path / ".shard_00003.npy.abc123.tmp"
    writer = FileLock(tmp)  # what clusterlm.fileio.atomic_write holds on its temporary file until the rename
    writer.acquire()
    try:
        FeatureStore(tmp_path, shard_size=2).begin(dim=2, config={})
        assert os.path.exists(tmp)  # a live writer's file stays
    finally:
        writer.release()
    FeatureStore(tmp_path, shard_size=2).begin(dim=2, config={})
    assert not os.path.exists(tmp)  # its writer is gone: stale


def test_without_torchrun_there_is_one_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert init_distributed() == DistInfo(0, 1, 0, None)
    assert is_main()
    barrier()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK, MASTER_ADDR, MASTER_PORT not set; launch the processes with torchrun"):
        init_distributed()
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\)"):
        featurize_sharded(object(), [], "x", rank=2, world_size=2)


def _select_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    info = init_distributed()
    try:
        feat = GradientFeaturizer(TinyLM(), features="lm_head", dim=(4, 4))
        part = featurize_sharded(feat, examples(23), os.path.join(out, "store"), rank=info.rank,
                                 world_size=info.world_size, shard_size=3, progress=info.rank == 0)
        res = distributed_capacity_kmeans(part.local(), 3, max_size=9, init_sample_size=23, progress=False)
        every = allgather_rows(res.labels)  # what the rank writing the plan needs
        np.savez(os.path.join(out, f"rank{rank}.npz"), labels=res.labels, start=part.start, stop=part.stop,
                 complete=part.complete, main=is_main(), backend=info.backend, every=every)
    finally:
        torch.distributed.destroy_process_group()


def test_two_gloo_ranks_featurize_then_cluster_like_one_process(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_select_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    feat = GradientFeaturizer(TinyLM(), features="lm_head", dim=(4, 4))
    # The ranks run 1 thread each; so does the reference: a thread count changes float summation order on
    # some CPUs (seen on AMD EPYC: 1e-8 differences), and the claim is sharded == one process, same settings.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = feat.featurize(examples(23), progress=False, shard_size=3)
    finally:
        torch.set_num_threads(threads)
    stored = FeatureStore(tmp_path / "store", shard_size=3)
    np.testing.assert_array_equal(stored.features(), expected)
    assert [(int(r["start"]), int(r["stop"])) for r in ranks] == [(0, 12), (12, 23)]
    assert all(bool(r["complete"]) for r in ranks) and [bool(r["main"]) for r in ranks] == [True, False]
    assert str(ranks[0]["backend"]) == "gloo"
    ref = capacity_kmeans(expected, 3, max_size=9, n_init=1, backend="torch")
    np.testing.assert_array_equal(np.concatenate([r["labels"] for r in ranks]), ref.labels)
    for r in ranks:
        np.testing.assert_array_equal(r["every"], ref.labels)
