"""Distributed capacity K-means: identical labels to the single process on 2 and 3 gloo ranks, out of core."""

from __future__ import annotations

import math
import os
import threading

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import cluster_kernels._collectives as coll
import cluster_kernels.distributed as dist_mod
from cluster_kernels import _backend, capacity_kmeans
from cluster_kernels.distributed import DistributedKMeansResult, distributed_capacity_kmeans, shard_rows
from cluster_kernels.kmeans_reference import assign_ref

N = 300  # divisible by every k below, so min_size = max_size = N / k is exact balance
SPLITS = {2: [110, 190], 3: [60, 140, 100]}  # unequal shards, in rank order
HAS_CPU = _backend.native() is not None

# name -> (dtype, k, bounds, init, extra keyword arguments)
CASES = {
    "exact-f64-kmeans++": ("float64", 4, "exact", "all-rows", {"n_init": 2}),
    "cap1.5-f32-kmeans++": ("float32", 5, "cap1.5", "all-rows", {}),
    "cap1.5-f64-init-pivots": ("float64", 5, "cap1.5", "explicit", {"gather_limit": 3}),
    "exact-f32-init": ("float32", 4, "exact", "explicit", {}),
    "min-size-f64-init": ("float64", 4, "min", "explicit", {"max_iter": 3}),
    "cosine-f32-kmeans++": ("float32", 4, "cap1.2", "all-rows", {"metric": "cosine"}),
    "sampled-init-f32": ("float32", 4, "cap1.5", "sample", {}),
}


def blobs(n: int = N, d: int = 6, seed: int = 0) -> np.ndarray:
    """Gaussian blobs of unequal sizes (half the points in one), so every capacity binds."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(6, d)) * 2.5
    comp = np.where(rng.random(n) < 0.5, 0, rng.integers(1, 6, n))
    return centres[comp] + rng.normal(size=(n, d))


def case_kwargs(name: str, x: np.ndarray) -> tuple[int, dict]:
    dtype, k, bounds, init, extra = CASES[name]
    n = len(x)
    kw: dict = {"n_init": 1, "max_iter": 12, "seed": 7, **extra}
    kw.pop("gather_limit", None)
    if bounds == "exact":
        kw["min_size"] = kw["max_size"] = n // k
    elif bounds.startswith("cap"):
        kw["max_size"] = math.ceil(float(bounds[3:]) * n / k)
    else:  # both bounds, the lower one binding: the general auction (with dummy units) runs
        kw["min_size"], kw["max_size"] = 40 * n // N, 100 * n // N
    if init == "explicit":
        kw["init"] = x[[3 * j + 1 for j in range(k)]] + 0.25
    return k, kw


def distributed_kwargs(name: str) -> dict:
    init = CASES[name][3]
    return {"init_sample_size": N if init == "all-rows" else 40, "chunk_rows": 37, "progress": False}


def _worker(rank: int, init_file: str, data_dir: str) -> None:
    """Rank ``rank`` of 3: the cases on all 3 ranks, then on the subgroup of ranks 0 and 1 (``group=``)."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=3)
    try:
        pair = torch.distributed.new_group([0, 1])  # every rank must take part in creating it
        for world, group in ((3, None), (2, pair)):
            if rank >= world:
                continue
            start = sum(SPLITS[world][:rank])
            stop = start + SPLITS[world][rank]
            out: dict[str, np.ndarray] = {}
            for name in CASES:
                full = np.load(os.path.join(data_dir, f"{CASES[name][0]}.npy"), mmap_mode="r")
                k, kw = case_kwargs(name, np.asarray(full))
                # A tiny gather limit forces the pivot narrowing of the distributed selection.
                coll.GATHER_LIMIT = CASES[name][4].get("gather_limit", 1 << 10)
                res = distributed_capacity_kmeans(full[start:stop], k, group=group, **kw, **distributed_kwargs(name))
                out[f"{name}/labels"] = res.labels
                out[f"{name}/distances"] = res.distances
                out[f"{name}/centroids"] = res.centroids
                out[f"{name}/sizes"] = res.sizes
                out[f"{name}/scalars"] = np.array([res.inertia, res.n_iter, res.offset, res.n_total])
                out[f"{name}/history"] = np.array(res.history)
            if world == 3:
                # Errors are raised on every rank alike (no rank left waiting in a collective).
                x = np.load(os.path.join(data_dir, "float64.npy"))[start:stop]
                for tag, bad in (("dim", x[:, : 5 if rank == 1 else 6]), ("nan", x.copy())):
                    if tag == "nan" and rank == world - 1:
                        bad[2, 1] = np.nan
                    try:
                        distributed_capacity_kmeans(bad, 3, progress=False)
                        out[f"error/{tag}"] = np.array("no error")
                    except ValueError as exc:
                        out[f"error/{tag}"] = np.array(str(exc))
            np.savez(os.path.join(data_dir, f"world{world}_rank{rank}.npz"), **out)
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dist_kmeans")
    x = blobs()
    np.save(path / "float64.npy", x)
    np.save(path / "float32.npy", x.astype(np.float32))
    return path


@pytest.fixture(scope="module")
def references(data_dir):
    """Single-process results per case: the torch reference, and the C++ path for explicit inits."""
    refs = {}
    for name in CASES:
        x = np.load(data_dir / f"{CASES[name][0]}.npy")
        k, kw = case_kwargs(name, x)
        if CASES[name][3] == "sample":  # the sample does not depend on the world size: compare with one rank
            refs[name] = {"torch": distributed_capacity_kmeans(x, k, **kw, **distributed_kwargs(name))}
            continue
        refs[name] = {"torch": capacity_kmeans(x, k, backend="torch", **kw)}
        if HAS_CPU and CASES[name][3] == "explicit":
            refs[name]["cpu"] = capacity_kmeans(x, k, backend="cpu", **kw)
    return refs


@pytest.fixture(scope="module")
def gloo_results(data_dir, tmp_path_factory):
    mp.spawn(_worker, args=(str(tmp_path_factory.mktemp("gloo") / "init"), str(data_dir)), nprocs=3, join=True)
    return {w: [dict(np.load(data_dir / f"world{w}_rank{r}.npz")) for r in range(w)] for w in (2, 3)}


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_ranks_give_the_single_process_labels(world, gloo_results, references):
    ranks = gloo_results[world]
    for name in CASES:
        dtype = CASES[name][0]
        tol = 1e-10 if dtype == "float64" else 1e-6
        labels = np.concatenate([r[f"{name}/labels"] for r in ranks])
        distances = np.concatenate([r[f"{name}/distances"] for r in ranks])
        for backend, ref in references[name].items():
            assert np.array_equal(labels, ref.labels), (name, backend, world, np.nonzero(labels != ref.labels)[0])
            if backend == "cpu":
                continue  # its float32 distances are computed in float32: labels are the contract
            np.testing.assert_allclose(distances, ref.distances, rtol=tol, atol=tol, err_msg=name)
            for r in ranks:
                np.testing.assert_allclose(r[f"{name}/centroids"], ref.centroids, rtol=tol, atol=tol, err_msg=name)
                np.testing.assert_array_equal(r[f"{name}/sizes"], ref.sizes)
                inertia, n_iter, _, n_total = r[f"{name}/scalars"]
                assert n_total == N and n_iter == ref.n_iter, (name, n_iter, ref.n_iter)
                assert inertia == pytest.approx(ref.inertia, rel=1e-10)
                np.testing.assert_allclose(r[f"{name}/history"], ref.history, rtol=1e-10)
        offsets = [int(r[f"{name}/scalars"][2]) for r in ranks]
        assert offsets == list(np.cumsum([0] + SPLITS[world][:-1]))
        _, kw = case_kwargs(name, blobs())
        sizes = ranks[0][f"{name}/sizes"]
        assert (sizes <= kw.get("max_size", N)).all() and (sizes >= kw.get("min_size", 0)).all()
    if world == 3:
        for r in ranks:
            assert "ranks disagree on d: [6, 5" in str(r["error/dim"])
            assert f"first bad global row: {N - SPLITS[world][-1] + 2}" in str(r["error/nan"])


def test_one_process_matches_the_reference_with_tiny_chunks():
    # Both bounds bind (the general auction runs) and 9-row chunks split every pass.
    x = blobs(280, d=5, seed=3)
    kw = {"max_size": 40, "min_size": 39, "n_init": 1, "max_iter": 15, "seed": 1}
    ref = capacity_kmeans(x, 7, backend="torch", **kw)
    got = distributed_capacity_kmeans(x, 7, chunk_rows=9, init_sample_size=280, progress=False, **kw)
    assert isinstance(got, DistributedKMeansResult)
    np.testing.assert_array_equal(got.labels, ref.labels)
    np.testing.assert_allclose(got.centroids, ref.centroids, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(got.history, ref.history, rtol=1e-10)
    assert got.n_iter == ref.n_iter and sum(got.stats["rounds"]) > 0
    assert got.offset == 0 and got.n_total == 280 and got.stats["world_size"] == 1


def test_removed_candidate_list_arguments_are_unknown_keywords():
    x = blobs(120, d=4, seed=6)
    kw = {"max_size": 25, "max_iter": 6, "init_sample_size": 120, "progress": False}
    for name, value in (("n_candidates", 2), ("approx_distances", False)):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
            distributed_capacity_kmeans(x, 5, **{name: value}, **kw)


def test_tensor_in_tensor_out_and_identical_to_numpy():
    x = blobs(120, seed=5).astype(np.float32)
    a = distributed_capacity_kmeans(x, 3, max_size=45, max_iter=10, progress=False)
    b = distributed_capacity_kmeans(torch.from_numpy(x), 3, max_size=45, max_iter=10, progress=False)
    assert isinstance(b.labels, torch.Tensor) and b.centroids.dtype == torch.float32
    np.testing.assert_array_equal(a.labels, b.labels.numpy())
    assert a.labels.dtype == np.int64 and a.distances.dtype == np.float32 and a.sizes.sum() == 120


def _rss_file_kb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    pytest.skip("no RssFile in /proc/self/status")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_a_memory_mapped_shard_is_streamed_and_its_pages_released(tmp_path):
    rng = np.random.default_rng(0)
    x = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32, shape=(32768, 256))
    for s in range(0, 32768, 4096):
        x[s : s + 4096] = rng.normal(size=(4096, 256))
    x.flush()
    del x
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")  # 32 MiB
    before = _rss_file_kb()
    res = distributed_capacity_kmeans(mapped, 4, max_size=8192, max_iter=2, chunk_rows=1024, progress=False)
    after = _rss_file_kb()
    assert res.sizes.tolist() == [8192] * 4
    assert after - before < 8 * 1024, (before, after)  # pages of at most a few 1 MiB chunks stay mapped
    touched = float(np.asarray(mapped).sum())  # control: reading everything maps all 32 MiB
    assert np.isfinite(touched) and _rss_file_kb() - before > 24 * 1024


def test_bad_arguments_raise_with_the_fix():
    x = blobs(50)
    with pytest.raises(TypeError, match="float32 or float64"):
        distributed_capacity_kmeans(x.astype(np.int64), 2, progress=False)
    with pytest.raises(ValueError, match="2-D"):
        distributed_capacity_kmeans(x[:, 0], 2, progress=False)
    with pytest.raises(ValueError, match="at least the number of clusters"):
        distributed_capacity_kmeans(x, 51, progress=False)
    with pytest.raises(ValueError, match="infeasible capacities"):
        distributed_capacity_kmeans(x, 5, max_size=9, progress=False)
    with pytest.raises(ValueError, match=r"init must be a finite \(k, d\)"):
        distributed_capacity_kmeans(x, 2, init=x[:3], progress=False)
    with pytest.raises(ValueError, match="not initialised"):
        distributed_capacity_kmeans(x, 2, group=object(), progress=False)
    with pytest.raises(ValueError, match="cosine' needs non-zero rows, global row 4"):
        z = x.copy()
        z[4] = 0
        distributed_capacity_kmeans(z, 2, metric="cosine", progress=False)


def test_allgather_rows_concatenates_blocks_of_any_length_in_rank_order(monkeypatch):
    np.testing.assert_array_equal(dist_mod.allgather_rows(torch.arange(4)), np.arange(4))  # no group: the block
    blocks = [np.arange(6, dtype=np.float32).reshape(3, 2), np.zeros((0, 2), np.float32), np.ones((2, 2), np.float32)]
    comms = threading.local()
    monkeypatch.setattr(coll, "Comm", lambda group: comms.comm)

    def gather(blocks: list[np.ndarray]):
        def rank_fn(r: int, comm: ThreadComm):
            comms.comm = comm
            return dist_mod.allgather_rows(blocks[r])

        return run_threads(len(blocks), rank_fn)

    for got in gather(blocks):
        np.testing.assert_array_equal(got, np.concatenate(blocks))
        assert got.dtype == np.float32
    with pytest.raises(ValueError, match="disagree on the dtype"):
        gather([blocks[0], blocks[2].astype(np.float64)])


def test_shard_rows_split_contiguously_and_evenly():
    parts = [shard_rows(10, 3, r) for r in range(3)]
    assert parts == [(0, 4), (4, 7), (7, 10)]
    assert shard_rows(2, 4, 3) == (2, 2)
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        shard_rows(10, 2, 2)


class ThreadComm:
    """The collectives of ``cluster_kernels._collectives.Comm`` between threads (one per simulated rank)."""

    def __init__(self, rank: int, world: int, slots: list, barrier: threading.Barrier) -> None:
        self.rank, self.world, self.slots, self.barrier = rank, world, slots, barrier
        self.calls = self.bytes = 0

    def gather(self, a: np.ndarray) -> np.ndarray:
        self.calls += 1
        self.slots[self.rank] = np.array(a, copy=True)
        self.barrier.wait()
        out = np.stack(self.slots)
        self.barrier.wait()
        return out

    def sum(self, a: np.ndarray) -> np.ndarray:
        return self.gather(a).sum(0)

    def max(self, a: np.ndarray) -> np.ndarray:
        return self.gather(a).max(0)

    def broadcast(self, a: np.ndarray, src: int = 0) -> np.ndarray:
        return self.gather(a)[src]

    def gather_to_root(self, a: np.ndarray) -> np.ndarray | None:
        every = self.gather(a)
        return every if self.rank == 0 else None


def run_threads(world: int, fn) -> list:
    """``fn(rank, comm)`` on ``world`` threads sharing a ThreadComm; their results in rank order."""
    results: list = [None] * world
    errors: list = []
    slots: list = [None] * world
    barrier = threading.Barrier(world)

    def run(r: int) -> None:
        try:
            results[r] = fn(r, ThreadComm(r, world, slots, barrier))
        except BaseException as exc:  # noqa: BLE001 - reported below, and the other ranks released
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return results


def test_a_rank_without_rows_still_takes_part(monkeypatch):
    x = blobs(150, seed=2)
    kw = {"max_size": 55, "n_init": 1, "max_iter": 10, "seed": 4}
    ref = capacity_kmeans(x, 3, backend="torch", **kw)
    split = [0, 90, 60]
    comms = threading.local()
    monkeypatch.setattr(coll, "Comm", lambda group: comms.comm)

    def rank_fn(r: int, comm: ThreadComm):
        comms.comm = comm
        start = sum(split[:r])
        return distributed_capacity_kmeans(x[start : start + split[r]], 3, init_sample_size=150, progress=False,
                                           **kw)

    results = run_threads(3, rank_fn)
    assert results[0].labels.shape == (0,) and results[0].offset == 0 and results[1].offset == 0
    np.testing.assert_array_equal(np.concatenate([res.labels for res in results]), ref.labels)
    np.testing.assert_allclose(results[0].centroids, ref.centroids, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("world, gather_limit", [(1, 1 << 15), (3, 1 << 15), (4, 5), (5, 1)])
def test_distributed_selection_finds_the_global_tth_smallest(world, gather_limit, monkeypatch):
    monkeypatch.setattr(coll, "GATHER_LIMIT", gather_limit)
    rng = np.random.default_rng(world)
    n, groups = 600, 6
    grp = rng.integers(0, groups, n)
    val = np.round(rng.normal(size=n), 1)  # many equal values: the global index breaks ties
    gid = rng.permutation(n).astype(np.int64)
    t = np.array([1, 7, 40, 200, 1000, 3], dtype=np.int64)  # group 4 has fewer than 1000 members
    owner = rng.integers(0, world, n)
    results = run_threads(world, lambda r, comm: coll.select(comm, grp[owner == r], val[owner == r],
                                                                  gid[owner == r], t))
    for g in range(groups):
        members = np.nonzero(grp == g)[0]
        order = members[np.lexsort((gid[members], val[members]))]
        want = (val[order[t[g] - 1]], gid[order[t[g] - 1]]) if t[g] <= len(order) else (np.inf, np.iinfo(np.int64).max)
        for r in range(world):
            assert (results[r][0][g], results[r][1][g]) == want, (g, r)


def _auction_instances(seed: int, count: int):
    """Random (cost, lo, hi) of odd shapes: caps that bind, lower bounds that bind (the general auction), both."""
    rng = np.random.default_rng(seed)
    for case in range(count):
        n, k = int(rng.integers(7, 160)), int(rng.integers(1, 8))
        # Clusters of unequal appeal, so caps and lower bounds bind; continuous costs, so no ties.
        cost = (rng.random((n, k)) + 2.0 * rng.random(k)) * rng.choice([1.0, 1e3])
        hi = np.full(k, n, dtype=np.int64)
        lo = np.zeros(k, dtype=np.int64)
        if case % 3 != 1:
            hi = rng.integers(math.ceil(n / k), math.ceil(1.6 * n / k) + 1, size=k)
            hi[0] += max(0, n - int(hi.sum()))
        if case % 3 != 0:
            lo = np.minimum(rng.integers(0, n // k + 1, size=k), hi)
        yield cost, lo.astype(np.int64), hi.astype(np.int64)


@pytest.mark.skipif(not HAS_CPU, reason="cluster_kernels._C is not built")
def test_native_auction_matches_the_reference_on_one_process():
    native = _backend.native()
    for cost, lo, hi in _auction_instances(0, 30):
        ref, _, _ = assign_ref(torch.from_numpy(cost), lo, hi)
        one = native.auction_block(cost, lo, hi, coll.AuctionComm(coll.Comm(None)), 0, len(cost))
        labels, rounds, _ = native.auction_assign(cost, lo, hi)
        np.testing.assert_array_equal(one["labels"], ref.numpy())
        np.testing.assert_array_equal(one["labels"], labels)
        assert one["rounds"] == rounds


@pytest.mark.skipif(not HAS_CPU, reason="cluster_kernels._C is not built")
@pytest.mark.parametrize("gather_limit", [1 << 10, 2])
def test_native_auction_on_rows_split_over_ranks_takes_the_one_process_decisions(gather_limit, monkeypatch):
    # Ranks are threads; the auction's collectives call back into Python (ThreadComm) without the GIL held.
    monkeypatch.setattr(coll, "GATHER_LIMIT", gather_limit)
    native = _backend.native()
    for cost, lo, hi in _auction_instances(1, 18):
        n = len(cost)
        cut = sorted(np.random.default_rng(n).integers(0, n + 1, size=2).tolist())
        bounds_ = [0, *cut, n]  # three ranks, possibly one without rows
        one = native.auction_block(cost, lo, hi, coll.AuctionComm(coll.Comm(None)), 0, n)

        def rank_fn(r: int, comm: ThreadComm, bounds_=bounds_, cost=cost, lo=lo, hi=hi):
            s, e = bounds_[r], bounds_[r + 1]
            return native.auction_block(np.ascontiguousarray(cost[s:e]), lo, hi, coll.AuctionComm(comm), s, len(cost))

        parts = run_threads(3, rank_fn)
        np.testing.assert_array_equal(np.concatenate([p["labels"] for p in parts]), one["labels"])
        for p in parts:
            assert p["rounds"] == one["rounds"] and p["used_general"] == one["used_general"]
            np.testing.assert_array_equal(p["floor_prices"], one["floor_prices"])
            np.testing.assert_array_equal(p["general_prices"], one["general_prices"])


@pytest.mark.skipif(not HAS_CPU, reason="cluster_kernels._C is not built")
def test_one_process_gives_the_labels_of_capacity_kmeans():
    x = blobs(400, d=7, seed=8)
    kw = {"max_size": 120, "n_init": 1, "max_iter": 12, "seed": 2, "init": x[[5, 50, 150, 250]] + 0.1}
    got = distributed_capacity_kmeans(x, 4, chunk_rows=64, progress=False, **kw)
    for backend in ("cpu", "torch"):
        ref = capacity_kmeans(x, 4, backend=backend, **kw)
        np.testing.assert_array_equal(got.labels, ref.labels, err_msg=backend)
        assert got.n_iter == ref.n_iter
        np.testing.assert_allclose(got.history, ref.history, rtol=1e-10)
