"""Capacity-constrained K-means: optimality, capacities, monotonicity, determinism, backends, errors."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog
from scipy.sparse import coo_matrix, vstack

from cluster_kernels import _backend, assign_with_capacity, capacity_kmeans
from cluster_kernels.kmeans_reference import N_LOCAL_TRIALS_BASE, SplitMix64, assign_ref, kmeans_plusplus, run_seed

C = _backend.native()
needs_native = pytest.mark.skipif(C is None, reason="cluster_kernels._C is not built")
CPU_BACKENDS = ["torch"] + (["cpu"] if C is not None else [])


def lp_optimum(cost: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> float:
    """Exact optimum of the transportation LP (HiGHS); its vertices are integral."""
    n, k = cost.shape
    cols = np.arange(n * k)
    a_eq = coo_matrix((np.ones(n * k), (np.repeat(np.arange(n), k), cols)), shape=(n, n * k))
    a_size = coo_matrix((np.ones(n * k), (np.tile(np.arange(k), n), cols)), shape=(k, n * k))
    res = linprog(cost.ravel(), A_ub=vstack([a_size, -a_size]), b_ub=np.concatenate([hi, -lo]), A_eq=a_eq,
                  b_eq=np.ones(n), bounds=(0, None), method="highs")
    assert res.status == 0, res.message
    return float(res.fun)


@st.composite
def transport_instances(draw):
    n = draw(st.integers(1, 60))
    k = draw(st.integers(1, min(n, 8)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["uniform", "ties", "duplicates", "tiny", "huge"]))
    cost = rng.random((n, k))
    if kind == "ties":
        cost = np.round(cost * 3) / 3
    elif kind == "duplicates":
        cost[n // 2 :] = cost[: n - n // 2]
    elif kind == "tiny":
        cost = cost * 1e-6
    elif kind == "huge":
        cost = cost * 1e8
    lo = np.zeros(k, dtype=np.int64)
    if draw(st.booleans()):
        lo = rng.integers(0, n // k + 1, size=k)
    hi = np.maximum(lo, rng.integers(math.ceil(n / k), n + 1, size=k))
    if draw(st.booleans()):
        hi = np.maximum(lo, np.full(k, math.ceil(n / k)))
    if hi.sum() < n:
        hi = np.full(k, n)
    return cost, lo.astype(np.int64), hi.astype(np.int64)


def check_assignment(cost, lo, hi, labels):
    sizes = np.bincount(labels, minlength=cost.shape[1])
    assert (sizes >= lo).all() and (sizes <= hi).all(), (sizes, lo, hi)
    got = cost[np.arange(cost.shape[0]), labels].sum()
    opt = lp_optimum(cost, lo, hi)
    assert got <= opt + 1e-9 * max(1.0, abs(opt)), (got, opt)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(transport_instances(), st.booleans())
def test_reference_assignment_is_lp_optimal(inst, force_general):
    cost, lo, hi = inst
    labels, _, _ = assign_ref(torch.from_numpy(cost), lo, hi, force_general=force_general)
    check_assignment(cost, lo, hi, labels.numpy())


@needs_native
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(transport_instances(), st.booleans())
def test_native_assignment_is_lp_optimal(inst, force_general):
    cost, lo, hi = inst
    labels, _, _ = C.auction_assign(cost, lo, hi, force_general)
    check_assignment(cost, lo, hi, labels)


@needs_native
def test_native_assignment_matches_reference_on_larger_inputs():
    rng = np.random.default_rng(3)
    for n, k, f in [(3001, 7, 1.0), (2500, 5, 1.2), (4000, 16, 1.5)]:
        cost = rng.standard_normal((n, k)) ** 2
        hi = np.full(k, math.ceil(f * n / k))
        lo = np.zeros(k, dtype=np.int64)
        ref, _, _ = assign_ref(torch.from_numpy(cost), lo, hi)
        nat, _, _ = C.auction_assign(cost, lo, hi, False)
        rows = np.arange(n)
        np.testing.assert_allclose(cost[rows, nat].sum(), cost[rows, ref.numpy()].sum(), rtol=1e-10)


def blobs(n: int, d: int, k: int, seed: int, dtype=np.float64, spread: float = 8.0) -> np.ndarray:
    """Gaussian mixture with unequal component sizes."""
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.ones(k))
    comp = rng.choice(k, size=n, p=weights)
    centers = rng.standard_normal((k, d)) * spread
    return (centers[comp] + rng.standard_normal((n, d))).astype(dtype)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(5, 300),
    d=st.integers(1, 9),
    k=st.integers(1, 6),
    slack=st.sampled_from([1.0, 1.2, 2.0, None]),
    with_min=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_capacities_always_hold(backend, n, d, k, slack, with_min, seed):
    k = min(k, n)
    x = blobs(n, d, k, seed)
    max_size = None if slack is None else math.ceil(slack * n / k)
    min_size = n // (2 * k) if with_min else None
    res = capacity_kmeans(x, k, min_size=min_size, max_size=max_size, n_init=1, max_iter=15, seed=seed,
                          backend=backend)
    sizes = np.bincount(res.labels, minlength=k)
    np.testing.assert_array_equal(sizes, res.sizes)
    assert sizes.sum() == n
    if max_size is not None:
        assert sizes.max() <= max_size
    if min_size is not None:
        assert sizes.min() >= min_size
    assert all(b <= a * (1 + 1e-12) + 1e-9 for a, b in zip(res.history, res.history[1:], strict=False)), res.history
    np.testing.assert_allclose(res.distances.sum(), res.inertia, rtol=1e-9)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exact_balance_and_objective_never_increases(backend, dtype):
    x = blobs(997, 13, 6, seed=1, dtype=dtype)
    res = capacity_kmeans(x, 6, min_size=997 // 6, max_size=math.ceil(997 / 6), n_init=2, max_iter=40, backend=backend)
    assert res.sizes.max() - res.sizes.min() <= 1
    assert np.all(np.diff(res.history) <= 1e-9 * res.history[0])
    assert res.labels.dtype == np.int64 and res.centroids.dtype == dtype and res.distances.dtype == dtype


@needs_native
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kw", [dict(max_size=170), dict(min_size=150, max_size=151), dict(min_size=120, max_size=200),
                                dict(min_size=140), dict()])
def test_native_matches_reference(dtype, kw):
    x = blobs(901, 17, 6, seed=4, dtype=dtype, spread=4.0)
    ref = capacity_kmeans(x, 6, n_init=2, max_iter=30, seed=5, backend="torch", **kw)
    nat = capacity_kmeans(x, 6, n_init=2, max_iter=30, seed=5, backend="cpu", **kw)
    rtol = 1e-6 if dtype == np.float32 else 1e-9
    np.testing.assert_allclose(nat.inertia, ref.inertia, rtol=rtol)
    assert (nat.labels == ref.labels).mean() > 0.99
    np.testing.assert_array_equal(np.sort(nat.sizes), np.sort(ref.sizes))


@needs_native
def test_cosine_metric():
    x = blobs(600, 8, 4, seed=2)
    nat = capacity_kmeans(x, 4, metric="cosine", max_size=160, seed=1, backend="cpu")
    ref = capacity_kmeans(x, 4, metric="cosine", max_size=160, seed=1, backend="torch")
    np.testing.assert_allclose(np.linalg.norm(nat.centroids, axis=1), 1.0, rtol=1e-9)
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    cos = 1 - np.sum(xn * nat.centroids[nat.labels], axis=1)
    np.testing.assert_allclose(nat.distances, cos, atol=1e-9)
    np.testing.assert_allclose(nat.inertia, ref.inertia, rtol=1e-9)
    assert nat.sizes.max() <= 160


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_deterministic_under_seed(backend):
    x = blobs(800, 10, 5, seed=9, dtype=np.float32)
    a = capacity_kmeans(x, 5, max_size=170, seed=3, backend=backend)
    b = capacity_kmeans(x, 5, max_size=170, seed=3, backend=backend)
    np.testing.assert_array_equal(a.labels, b.labels)
    np.testing.assert_array_equal(a.centroids, b.centroids)


@needs_native
def test_bit_identical_across_thread_counts(tmp_path):
    """Labels and centroids do not depend on the OpenMP thread count (fixed-order reductions)."""
    script = (
        "import numpy as np, sys\n"
        "from cluster_kernels import capacity_kmeans\n"
        "rng = np.random.default_rng(0)\n"
        "x = rng.standard_normal((20000, 24)).astype(np.float32)\n"
        "r = capacity_kmeans(x, 7, max_size=3500, min_size=2000, n_init=2, max_iter=20, backend='cpu')\n"
        "u = capacity_kmeans(x + 4.0, 7, n_init=2, max_iter=20, backend='cpu')\n"  # argmin with the sums, centred
        "v = capacity_kmeans(x, 7, n_init=1, max_iter=20, backend='cpu')\n"  # the same, rows used in place
        "np.save(sys.argv[1], np.concatenate([a.astype(np.float64).ravel() for a in (r.labels, r.centroids, u.labels,"
        " u.centroids, v.labels, v.centroids)]))\n"
    )
    outs = []
    for threads in (1, 2, 3):
        path = tmp_path / f"t{threads}.npy"
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        subprocess.run([sys.executable, "-c", script, str(path)], check=True, env=env)
        outs.append(np.load(path))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


@needs_native
@pytest.mark.parametrize("kw", [dict(), dict(max_size=1000)])
def test_a_far_mean_is_removed_before_the_float32_distances(kw):
    """Rows far from the origin next to their spread are centred before the float32 GEMM (else |x|^2 + |c|^2 -
    2 x.c would lose the distances to rounding); rows near it are used in place. Both match the reference."""
    x = blobs(4000, 16, 5, seed=7, dtype=np.float32, spread=2.0)
    for data in (x, (x + 30000.0).astype(np.float32)):
        init = data[:5].copy()
        nat = capacity_kmeans(data, 5, init=init, max_iter=15, backend="cpu", **kw)
        ref = capacity_kmeans(data, 5, init=init, max_iter=15, backend="torch", **kw)
        assert (nat.labels == ref.labels).mean() > 0.999
        np.testing.assert_allclose(nat.inertia, ref.inertia, rtol=1e-6)
        np.testing.assert_allclose(nat.centroids, ref.centroids, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_torch_in_torch_out_and_input_untouched(backend):
    x = torch.from_numpy(blobs(300, 5, 3, seed=0)).T.contiguous().T  # non-contiguous view
    before = x.clone()
    res = capacity_kmeans(x, 3, max_size=110, backend=backend)
    assert isinstance(res.labels, torch.Tensor) and res.labels.dtype == torch.int64
    assert isinstance(res.centroids, torch.Tensor) and res.centroids.dtype == torch.float64
    assert torch.equal(x, before)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_explicit_init_and_assign_with_capacity(backend):
    x = blobs(400, 6, 4, seed=8)
    init = x[:4].copy()
    res = capacity_kmeans(x, 4, init=init, max_size=100, backend=backend)
    assert res.sizes.max() <= 100
    labels, dist = assign_with_capacity(x, res.centroids, max_size=100, min_size=100, backend=backend)
    assert np.bincount(labels, minlength=4).tolist() == [100] * 4
    cost = ((x[:, None, :] - res.centroids[None]) ** 2).sum(-1)
    np.testing.assert_allclose(dist, cost[np.arange(400), labels], rtol=1e-9)
    np.testing.assert_allclose(dist.sum(), lp_optimum(cost, np.full(4, 100), np.full(4, 100)), rtol=1e-9)


def test_empty_clusters_are_reseeded():
    x = np.concatenate([np.zeros((50, 2)), np.ones((50, 2)) * 10])
    x = x + np.random.default_rng(0).standard_normal(x.shape) * 1e-3
    init = np.array([[0.0, 0.0], [10.0, 10.0], [100.0, 100.0]])  # the third attracts nothing
    for backend in CPU_BACKENDS:
        res = capacity_kmeans(x, 3, init=init, backend=backend, max_iter=10)
        assert (res.sizes > 0).all(), res.sizes


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(k=0), ValueError, "k must be >= 1"),
        (dict(k=11), ValueError, r"n=10\) must be at least the number of clusters \(k=11\)"),
        (dict(k=2.5), TypeError, "k must be an int"),
        (dict(k=3, max_size=3), ValueError, r"k \* max_size = 9 < n = 10.*ceil\(n / k\) = 4"),
        (dict(k=3, min_size=4), ValueError, r"k \* min_size = 12 > n = 10"),
        (dict(k=3, min_size=-1), ValueError, "min_size must be >= 0"),
        (dict(k=3, max_size=[4, 4]), ValueError, "one entry per cluster"),
        (dict(k=3, min_size=4, max_size=3), ValueError, r"min_size \(4\) > max_size \(3\)"),
        (dict(k=3, metric="l1"), ValueError, "metric must be one of"),
        (dict(k=3, backend="gpu"), ValueError, "backend must be one of"),
        (dict(k=3, backend="triton"), RuntimeError, "no Triton kernel"),
        (dict(k=3, n_init=0), ValueError, "n_init must be an int >= 1"),
        (dict(k=3, init=np.zeros((2, 4))), ValueError, r"init must have shape \(k, d\) = \(3, 4\)"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    x = np.random.default_rng(0).standard_normal((10, 4))
    with pytest.raises(exc, match=match):
        capacity_kmeans(x, **kwargs)


def test_bad_inputs():
    with pytest.raises(TypeError, match="float32 or float64"):
        capacity_kmeans(np.zeros((10, 3), dtype=np.int64), 2)
    with pytest.raises(ValueError, match="must be 2-D"):
        capacity_kmeans(np.zeros(10), 2)
    bad = np.zeros((10, 3))
    bad[4, 1] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf.*row: 4"):
        capacity_kmeans(bad, 2)
    with pytest.raises(TypeError, match="numpy array or a torch tensor"):
        capacity_kmeans([[1.0, 2.0]], 1)
    with pytest.raises(ValueError, match="centroids have 2 dimensions but x has 3"):
        assign_with_capacity(np.zeros((10, 3)), np.zeros((2, 2)))
    with pytest.raises(ValueError, match="non-zero rows"):
        capacity_kmeans(np.zeros((10, 3)), 2, metric="cosine", backend="torch")


def test_missing_backends_say_how_to_get_them(monkeypatch):
    monkeypatch.setattr(_backend, "native", lambda: None)
    x = np.random.default_rng(0).standard_normal((10, 4))
    with pytest.raises(RuntimeError, match="pip install -e"):
        capacity_kmeans(x, 2, backend="cpu")
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        capacity_kmeans(x, 2, backend="cuda")
    res = capacity_kmeans(x, 2, backend="auto")  # falls back to the reference
    assert res.sizes.sum() == 10


def kmeans_plusplus_oracle(x: torch.Tensor, k: int, rng: SplitMix64) -> torch.Tensor:
    """Greedy k-means++ in float64, one candidate at a time: the oracle of ``kmeans.kmeans_plusplus``."""
    n = x.shape[0]
    trials = N_LOCAL_TRIALS_BASE + int(math.log(k))

    def sqdist(c: torch.Tensor) -> torch.Tensor:
        return ((x * x).sum(1)[:, None] - 2.0 * (x @ c.T) + (c * c).sum(1)[None, :]).clamp_min(0.0)

    first = min(int(rng.uniform() * n), n - 1)
    centers = [x[first]]
    closest = sqdist(x[first : first + 1])[:, 0]
    for _ in range(1, k):
        cum = torch.cumsum(closest, 0)
        total = float(cum[-1])
        cands = [min(int(torch.searchsorted(cum, torch.tensor(rng.uniform() * total, dtype=cum.dtype), right=True)),
                     n - 1) for _ in range(trials)]
        best_pot, best_c, best_d = math.inf, -1, None
        for cand in cands:
            nd = torch.minimum(closest, sqdist(x[cand : cand + 1])[:, 0])
            if float(nd.sum()) < best_pot:
                best_pot, best_c, best_d = float(nd.sum()), cand, nd
        centers.append(x[best_c])
        closest = best_d
    return torch.stack(centers)


@pytest.mark.parametrize("k", [1, 2, 7, 30])
def test_kmeans_plusplus_picks_the_oracles_centres(k):
    x = torch.from_numpy(blobs(700, 9, 5, seed=k))
    x = x - x.mean(0)
    for run in range(3):
        got = kmeans_plusplus(x, k, SplitMix64(run_seed(11, run)))
        want = kmeans_plusplus_oracle(x, k, SplitMix64(run_seed(11, run)))
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _near_tie_rows(x: np.ndarray, c: np.ndarray, got: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows whose labels differ, and whether each is a near-tie of the float64 reference: the reference's own
    cost gap between the two clusters below the float32 rounding of the distances (d u (|x|^2 + |c_a|^2 + |c_b|^2),
    u = 2^-24, with a factor 8 for the centring and the two distances)."""
    mean = x.astype(np.float64).mean(0)
    xc, cc = x.astype(np.float64) - mean, c.astype(np.float64) - mean
    rows = np.nonzero(got != ref)[0]
    cost = ((xc[rows, None, :] - cc[None]) ** 2).sum(-1)
    gap = np.abs(cost[np.arange(len(rows)), got[rows]] - cost[np.arange(len(rows)), ref[rows]])
    scale = (xc[rows] ** 2).sum(1) + (cc[got[rows]] ** 2).sum(1) + (cc[ref[rows]] ** 2).sum(1)
    return rows, gap <= 8 * x.shape[1] * 2.0**-24 * scale


@needs_native
def test_float32_gemm_labels_differ_from_the_float64_reference_only_at_near_ties():
    """The BLAS distance tiles of float32 data: a label may differ from the float64 reference only where the
    reference's own gap between the two clusters is below float32 rounding; such rows are counted."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((20_000, 48)).astype(np.float32)
    c = (x[:40] + 0.05 * rng.standard_normal((40, 48))).astype(np.float32)
    got, _ = assign_with_capacity(x, c, backend="cpu")
    ref, _ = assign_with_capacity(x, c, backend="torch")
    rows, near = _near_tie_rows(x, c, got, ref)
    assert near.all(), f"{(~near).sum()} of {len(rows)} differing rows are not near-ties"
    assert len(rows) <= 0.001 * len(x), f"{len(rows)} near-ties in {len(x)} rows"


@needs_native
def test_gemm_tiles_and_the_portable_loop_agree_except_near_ties(monkeypatch):
    from cluster_kernels import _blas

    if _blas.gemm() is None:
        pytest.skip("no BLAS found: only the portable loop runs here")
    x = blobs(30_000, 32, 12, seed=3, dtype=np.float32, spread=1.0)
    kw = dict(max_size=math.ceil(1.2 * 30_000 / 12), n_init=1, max_iter=1, seed=2, backend="cpu")
    tiles = capacity_kmeans(x, 12, **kw)
    monkeypatch.setenv("CLUSTER_KERNELS_BLAS", "0")
    loop = capacity_kmeans(x, 12, **kw)
    np.testing.assert_array_equal(tiles.sizes, loop.sizes)
    # One assignment from the same k-means++ centroids; only rounding of float32 dot products differs.
    assert (tiles.labels != loop.labels).mean() <= 0.001
    np.testing.assert_allclose(tiles.inertia, loop.inertia, rtol=1e-6)
