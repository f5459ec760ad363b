"""The CUDA path of capacity-constrained K-means (csrc/cuda: lloyd.cu, auction.cu and the files they use).

* Compiling every ``.cu`` file of csrc/cuda (the ones setup.py builds) with the build's nvcc flags
  (cluster_kernels/_cuda_build.py), without a warning from our sources and without spills, needs only a CUDA
  toolkit and is tested with the other GPU compiles in test_aot_compile.py.
* Every other test needs a CUDA GPU and an extension built with its CUDA part. The CUDA code repeats
  every decision of the C++/OpenMP path (csrc/cpu/lloyd.cpp) with the arithmetic of its portable distance
  loop, so the CPU side of these comparisons runs that loop (``CLUSTER_KERNELS_BLAS=0``: its BLAS tiles
  round differently) and on the same inputs the labels are the CPU's; costs are also checked against the
  float64 torch reference.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from cluster_kernels import _backend, assign_with_capacity, capacity_kmeans
from cluster_kernels.kmeans_reference import assign_ref

REPO = Path(__file__).resolve().parents[2]
CU_SOURCES = sorted((REPO / "csrc" / "cuda").glob("*.cu"))


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    mod = _backend.native()
    if mod is None or not getattr(mod, "has_cuda", False):
        return "needs a CUDA GPU and cluster_kernels._C built with its CUDA part (CLUSTER_KERNELS_CUDA=1)"
    return None


GPU_SKIP = _gpu_skip_reason()


@pytest.fixture(autouse=True)
def _portable_cpu_distances(monkeypatch):
    """The CPU path of every comparison runs the distance loop the CUDA kernels mirror (no BLAS tiles)."""
    monkeypatch.setenv("CLUSTER_KERNELS_BLAS", "0")
needs_gpu = pytest.mark.skipif(GPU_SKIP is not None, reason=GPU_SKIP or "")


# --------------------------------------------------------------------------------------------------
# Compile-only (no GPU needed)
# --------------------------------------------------------------------------------------------------


def test_every_cuda_source_is_built() -> None:
    """setup.py compiles every .cu file of csrc/cuda (the split of the Lloyd driver, the auction, the helpers)."""
    want = {"lloyd.cu", "auction.cu", "floor_auction.cu", "dummy_auction.cu", "device_utils.cu"}
    assert {p.name for p in CU_SOURCES} >= want
    assert 'glob("*.cu")' in (REPO / "setup.py").read_text()


@pytest.mark.skipif(
    torch.cuda.is_available() or not _backend.has_cuda_native(),
    reason="only for an extension built with CUDA on a machine without a GPU",
)
def test_device_count_is_zero_without_gpu() -> None:
    """Without a driver or a GPU the count is 0, not an exception."""
    assert _backend.native().cuda_device_count() == 0


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def blobs(n: int, d: int, k: int, seed: int, dtype: torch.dtype, *, spread: float = 10.0) -> torch.Tensor:
    """Well-separated Gaussian blobs of unequal sizes (shares 3 : 2 : 1 : ... : 1), rows shuffled."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(k, d, generator=g, dtype=torch.float64) * spread + 3.0
    share = torch.tensor([3.0, 2.0] + [1.0] * max(k - 2, 0))[:k]
    comp = torch.multinomial(share / share.sum(), n, replacement=True, generator=g)
    x = centres[comp] + 0.3 * torch.randn(n, d, generator=g, dtype=torch.float64)
    return x.to(dtype)


def bounds(case: str, n: int, k: int) -> dict:
    """Keyword bounds for capacity_kmeans / assign_with_capacity."""
    if case == "none":
        return {}
    if case == "exact":
        return {"max_size": math.ceil(n / k)}
    if case == "slack":
        return {"max_size": math.ceil(1.5 * n / k)}
    if case == "minmax":  # lower bounds that bind on unequal blobs: the general auction runs
        return {"min_size": int(0.8 * n / k), "max_size": math.ceil(1.2 * n / k)}
    raise ValueError(case)


def bound_arrays(case: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    kw = bounds(case, n, k)
    lo = np.full(k, kw.get("min_size", 0), dtype=np.int64)
    hi = np.full(k, min(kw.get("max_size", n), n), dtype=np.int64)
    return lo, hi


def assert_sizes(labels: torch.Tensor, k: int, case: str) -> None:
    n = labels.numel()
    lo, hi = bound_arrays(case, n, k)
    sizes = torch.bincount(labels.cpu(), minlength=k).numpy()
    assert sizes.sum() == n
    assert (sizes >= lo).all() and (sizes <= hi).all(), f"sizes {sizes.tolist()} outside [{lo[0]}, {hi[0]}]"


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


def cuda_auction(mod, dist: torch.Tensor, lo: np.ndarray, hi: np.ndarray) -> tuple[torch.Tensor, int]:
    """_C.auction_assign_cuda on a CUDA float64 cost matrix; returns labels (on the GPU) and rounds."""
    d = dist.contiguous()
    n, k = d.shape
    labels = torch.empty(n, dtype=torch.int64, device=d.device)
    rounds = mod.auction_assign_cuda(
        d.data_ptr(), n, k, lo, hi, labels.data_ptr(), torch.cuda.current_stream(d.device).cuda_stream, d.device.index
    )
    torch.cuda.synchronize(d.device)
    return labels, rounds


# --------------------------------------------------------------------------------------------------
# The auction alone
# --------------------------------------------------------------------------------------------------

AUCTION_CASES = [
    # (n, k, bounds case, integer costs: many exact ties)
    (1001, 7, "exact", False),
    (999, 5, "slack", False),
    (1003, 6, "minmax", False),
    (501, 3, "exact", True),
    (777, 4, "minmax", True),
    (7, 7, "exact", False),
    (301, 1, "none", False),
]


@needs_gpu
@pytest.mark.parametrize(("n", "k", "case", "ties"), AUCTION_CASES)
def test_auction_cuda_matches_cpu_and_reference(n: int, k: int, case: str, ties: bool) -> None:
    mod = _backend.native()
    g = torch.Generator().manual_seed(n * 31 + k)
    dist = torch.randint(0, 5, (n, k), generator=g).double() if ties else torch.rand(n, k, generator=g).double() * 10
    lo, hi = bound_arrays(case, n, k)

    labels_cpu, rounds_cpu, _ = mod.auction_assign(dist.numpy(), lo, hi)
    labels_gpu, rounds_gpu = cuda_auction(mod, dist.cuda(), lo, hi)
    labels_ref, _, _ = assign_ref(dist, lo, hi)

    assert labels_gpu.device.type == "cuda"
    assert_sizes(labels_gpu, k, case)

    def cost(lab) -> float:
        return float(dist.gather(1, torch.as_tensor(lab).cpu().view(-1, 1)).sum())

    assert rel(cost(labels_gpu), cost(labels_cpu)) <= 1e-9
    assert rel(cost(labels_gpu), cost(labels_ref)) <= 1e-9
    # Same decisions as the CPU code, so the same labels and rounds.
    assert torch.equal(labels_gpu.cpu(), torch.from_numpy(labels_cpu))
    assert rounds_gpu == rounds_cpu


# --------------------------------------------------------------------------------------------------
# Lloyd iterations
# --------------------------------------------------------------------------------------------------

KMEANS_CASES = [
    ("exact", "sqeuclidean"),
    ("slack", "sqeuclidean"),
    ("minmax", "sqeuclidean"),
    ("none", "sqeuclidean"),
    ("exact", "cosine"),
    ("minmax", "cosine"),
]


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(("case", "metric"), KMEANS_CASES)
def test_kmeans_cuda_matches_cpu(dtype: torch.dtype, case: str, metric: str) -> None:
    n, d, k = 2001, 37, 5
    x = blobs(n, d, k, seed=1, dtype=dtype)
    kw = dict(bounds(case, n, k), metric=metric, n_init=2, max_iter=30, seed=3)
    cpu = capacity_kmeans(x, k, backend="cpu", **kw)
    xg = x.cuda()
    xg_before = xg.clone()
    gpu = capacity_kmeans(xg, k, backend="cuda", **kw)

    assert torch.equal(xg, xg_before), "the input was modified"
    for t in (gpu.labels, gpu.centroids, gpu.distances, gpu.sizes):
        assert t.device == xg.device
    assert gpu.centroids.dtype == dtype and gpu.distances.dtype == dtype and gpu.labels.dtype == torch.int64
    assert_sizes(gpu.labels, k, case)
    assert torch.equal(gpu.labels.cpu(), cpu.labels)
    assert rel(gpu.inertia, cpu.inertia) <= 1e-5
    assert gpu.n_iter == cpu.n_iter and gpu.converged == cpu.converged
    assert len(gpu.history) == len(cpu.history)
    # Bit-identical where the CPU build runs its FMA (x86-64-v3) clone; 1e-6 leaves room for one without.
    assert all(rel(a, b) <= 1e-6 for a, b in zip(gpu.history, cpu.history, strict=True))
    scale = float(cpu.centroids.abs().max())
    assert float((gpu.centroids.cpu().double() - cpu.centroids.double()).abs().max()) <= 1e-6 * scale
    assert torch.allclose(gpu.distances.cpu().double(), cpu.distances.double(), rtol=1e-5, atol=1e-6 * scale**2)
    # The inertia is the sum of the returned distances.
    assert rel(gpu.inertia, float(gpu.distances.double().sum())) <= 1e-5


@needs_gpu
def test_kmeans_cuda_close_to_float64_reference() -> None:
    """Well-separated data: the CUDA path finds the reference's partition, at the reference's inertia."""
    n, d, k = 1501, 19, 4
    x = blobs(n, d, k, seed=5, dtype=torch.float64)
    kw = dict(max_size=math.ceil(1.5 * n / k), n_init=2, max_iter=30, seed=0)
    ref = capacity_kmeans(x, k, backend="torch", **kw)
    gpu = capacity_kmeans(x.cuda(), k, backend="cuda", **kw)
    assert rel(gpu.inertia, ref.inertia) <= 1e-5
    # Same partition up to the numbering of the clusters.
    pairs = torch.stack([gpu.labels.cpu(), ref.labels]).T.unique(dim=0)
    assert pairs.shape[0] == k


@needs_gpu
def test_kmeans_cuda_deterministic_any_stream_and_init() -> None:
    n, d, k = 3001, 24, 6
    x = blobs(n, d, k, seed=2, dtype=torch.float32).cuda()
    kw = dict(max_size=math.ceil(n / k), n_init=2, max_iter=25, seed=11)
    a = capacity_kmeans(x, k, backend="cuda", **kw)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        b = capacity_kmeans(x, k, backend="cuda", **kw)
    stream.synchronize()
    for name in ("labels", "centroids", "distances", "sizes"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.history == b.history and a.inertia == b.inertia

    init = a.centroids.clone()
    init_before = init.clone()
    c = capacity_kmeans(x, k, init=init, backend="cuda", **kw)
    c_cpu = capacity_kmeans(x.cpu(), k, init=init.cpu(), backend="cpu", **kw)
    assert torch.equal(init, init_before)
    assert torch.equal(c.labels.cpu(), c_cpu.labels)
    assert rel(c.inertia, c_cpu.inertia) <= 1e-5


@needs_gpu
@pytest.mark.parametrize(
    ("n", "d", "k", "case"),
    [(7, 1, 7, "exact"), (9, 3, 1, "none"), (101, 1, 3, "minmax"), (257, 2, 16, "exact"), (60_001, 16, 8, "slack")],
    ids=["n=k", "k=1", "d=1", "k=16", "many-chunks"],
)
def test_kmeans_cuda_shapes(n: int, d: int, k: int, case: str) -> None:
    x = blobs(n, d, k, seed=n, dtype=torch.float32, spread=4.0)
    kw = dict(bounds(case, n, k), n_init=1, max_iter=15, seed=7)
    cpu = capacity_kmeans(x, k, backend="cpu", **kw)
    gpu = capacity_kmeans(x.cuda(), k, backend="cuda", **kw)
    assert_sizes(gpu.labels, k, case)
    assert rel(gpu.inertia, cpu.inertia) <= 1e-5
    assert torch.equal(gpu.labels.cpu(), cpu.labels)


@needs_gpu
def test_kmeans_cuda_cosine_zero_row_raises() -> None:
    x = torch.randn(50, 4, device="cuda")
    x[7] = 0.0
    with pytest.raises(ValueError, match="non-zero rows"):
        capacity_kmeans(x, 3, metric="cosine", backend="cuda")


# --------------------------------------------------------------------------------------------------
# Assignment to fixed centroids
# --------------------------------------------------------------------------------------------------


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(("case", "metric"), [("exact", "sqeuclidean"), ("minmax", "sqeuclidean"), ("slack", "cosine")])
def test_assign_with_capacity_cuda_matches_cpu(dtype: torch.dtype, case: str, metric: str) -> None:
    n, d, k = 1999, 13, 5
    x = blobs(n, d, k, seed=4, dtype=dtype)
    g = torch.Generator().manual_seed(9)
    centroids = (x[torch.randperm(n, generator=g)[:k]] + 0.1).to(dtype)
    kw = dict(bounds(case, n, k), metric=metric)
    lab_cpu, dist_cpu = assign_with_capacity(x, centroids, backend="cpu", **kw)
    xg, cg = x.cuda(), centroids.cuda()
    xg_before, cg_before = xg.clone(), cg.clone()
    lab_gpu, dist_gpu = assign_with_capacity(xg, cg, backend="cuda", **kw)
    assert torch.equal(xg, xg_before) and torch.equal(cg, cg_before)
    assert lab_gpu.device == xg.device and dist_gpu.device == xg.device and dist_gpu.dtype == dtype
    assert_sizes(lab_gpu, k, case)
    assert torch.equal(lab_gpu.cpu(), lab_cpu)
    assert torch.allclose(dist_gpu.cpu().double(), dist_cpu.double(), rtol=1e-6, atol=1e-9)


# --------------------------------------------------------------------------------------------------
# The GPU benchmark's CPU-side logic (no GPU needed)
# --------------------------------------------------------------------------------------------------


def test_gpu_benchmark_imports_and_its_torch_reference_is_lloyd() -> None:
    """benchmarks/gpu/bench_kmeans_gpu.py imports anywhere; its torch reference runs Lloyd iterations."""
    import importlib.util

    path = REPO / "benchmarks" / "gpu" / "bench_kmeans_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_kmeans_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    x = blobs(600, 5, 3, seed=2, dtype=torch.float64)
    labels, cent, obj = bench.torch_lloyd(x, x[:3].clone(), 10)
    ref = capacity_kmeans(x, 3, init=x[:3].clone(), max_iter=10, tol=0.0, backend="torch")
    assert torch.equal(labels, ref.labels)
    assert obj == pytest.approx(ref.inertia, rel=1e-9)
    assert torch.allclose(cent, ref.centroids, atol=1e-9)
