"""Numerical range of capacity-constrained K-means: any finite input clusters as its rescaled copy does, or is
refused with a ValueError naming the range; bad arguments are refused with a message naming the argument.

The objective is scale-equivariant, so ``x * s`` must give the labels of ``x``. For a power of two ``s`` the
backends rescale by another power of two (exact), so labels, distances and inertia are bit for bit those of the
unscaled run, in the caller's units; for an arbitrary factor the rounding of ``x * s`` may only relabel. Inputs
whose squared distances cannot be represented in the dtype (float32 beyond ~1e18, float64 beyond ~1e152 for this
mixture) are refused. Before the fix, float32 rows of magnitude 1e19+ (float64 1e154+) crashed the process
(heap corruption), ``assign_with_capacity`` left a cluster empty with inf distances, tiny float32 data clustered
differently and the torch backend returned inf distances.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster_kernels import _backend, assign_with_capacity, capacity_kmeans, distributed_capacity_kmeans

C = _backend.native()
needs_native = pytest.mark.skipif(C is None, reason="cluster_kernels._C is not built")
BACKENDS = ["torch"] + (["cpu"] if C is not None else [])
DTYPES = [np.float32, np.float64]
SIZE = 20
K = 3
FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
RANGE = r"out of the accepted range"
# Power-of-two exponents and decimal exponents fuzzed per dtype: |x| over about 1e-38..1e38 (float32), and
# 1e-300..1e300 (float64), up to where the entries of the mixture (|x| < 13) stay finite. float32 powers stop at
# 2^-110 so that no entry of the mixture turns subnormal.
POW2 = {np.float32: (-110, 123), np.float64: (-990, 1010)}
DEC = {np.float32: (-38.0, 36.5), np.float64: (-300.0, 300.0)}


@functools.cache
def mixture(dtype: type) -> np.ndarray:
    """Three well separated blobs of SIZE points in 3-d (exact sizes make every label unambiguous)."""
    rng = np.random.default_rng(1234)
    centres = np.array([[0.0, 0.0, 0.0], [9.0, 9.0, 0.0], [-9.0, 9.0, 4.0]])
    x = np.concatenate([c + rng.normal(size=(SIZE, 3)) for c in centres])
    return x[rng.permutation(len(x))].astype(dtype)


def scaled(dtype: type, s: float) -> np.ndarray:
    return (mixture(dtype).astype(np.float64) * s).astype(dtype)


def run_kmeans(x: np.ndarray, backend: str, **kw):
    return capacity_kmeans(x, K, min_size=SIZE, max_size=SIZE, n_init=2, seed=3, backend=backend, **kw)


@functools.cache
def base_kmeans(dtype: type, backend: str):
    return run_kmeans(mixture(dtype), backend)


@functools.cache
def base_distributed(dtype: type):
    return distributed_capacity_kmeans(mixture(dtype), K, min_size=SIZE, max_size=SIZE, progress=False, chunk_rows=16)


def same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal up to a renaming of the clusters."""
    pairs = set(zip(a.tolist(), b.tolist(), strict=True))
    return len(pairs) == len(set(a.tolist())) == len(set(b.tolist()))


def refused_only_when_huge(exc: ValueError, s: float, dtype: type) -> None:
    assert "range" in str(exc), str(exc)
    assert s > (1e15 if dtype == np.float32 else 1e140), f"refused a scale of {s}: {exc}"


def check_powers_of_two(res, base, m: int, dtype: type) -> None:
    """Labels identical; distances, inertia, centroids the unscaled ones times the power of two."""
    np.testing.assert_array_equal(res.labels, base.labels)
    assert res.inertia == math.ldexp(base.inertia, 2 * m), (res.inertia, base.inertia, m)
    tiny = np.finfo(dtype).smallest_subnormal
    expect = np.ldexp(base.distances.astype(np.float64), 2 * m).astype(dtype)
    np.testing.assert_allclose(res.distances, expect, rtol=4 * np.finfo(dtype).eps, atol=2 * tiny)
    np.testing.assert_allclose(res.centroids, np.ldexp(base.centroids.astype(np.float64), m).astype(dtype),
                               rtol=4 * np.finfo(dtype).eps, atol=2 * tiny)
    assert np.isfinite(res.distances).all()


# --------------------------------------------------------------------------------------------------
# Magnitude fuzzing
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@FUZZ
@given(data=st.data())
def test_capacity_kmeans_power_of_two_scales_are_exact(backend, dtype, data):
    m = data.draw(st.integers(*POW2[dtype]), label="exponent")
    try:
        res = run_kmeans(scaled(dtype, math.ldexp(1.0, m)), backend)
    except ValueError as exc:
        refused_only_when_huge(exc, math.ldexp(1.0, m), dtype)
        return
    check_powers_of_two(res, base_kmeans(dtype, backend), m, dtype)
    assert (res.sizes == SIZE).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@FUZZ
@given(data=st.data())
def test_capacity_kmeans_arbitrary_scales_keep_the_partition(backend, dtype, data):
    s = 10.0 ** data.draw(st.floats(*DEC[dtype]), label="log10 scale")
    try:
        res = run_kmeans(scaled(dtype, s), backend)
    except ValueError as exc:
        refused_only_when_huge(exc, s, dtype)
        return
    base = base_kmeans(dtype, backend)
    assert same_partition(res.labels, base.labels)
    assert (res.sizes == SIZE).all() and np.isfinite(res.distances).all()
    expect = base.inertia * s * s
    if 1e-290 < expect < 1e290:  # float64 inertia, the caller's units
        assert res.inertia == pytest.approx(expect, rel=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@FUZZ
@given(data=st.data())
def test_assign_with_capacity_scales(dtype, data):
    """Every backend: the labels of the unscaled data, no empty cluster, finite distances (or a range error)."""
    pow2 = data.draw(st.booleans(), label="power of two")
    m = data.draw(st.integers(*POW2[dtype]), label="exponent")
    s = math.ldexp(1.0, m) if pow2 else 10.0 ** data.draw(st.floats(*DEC[dtype]), label="log10 scale")
    base = base_kmeans(dtype, BACKENDS[-1])
    cent = (base.centroids.astype(np.float64) * s).astype(dtype)
    for backend in BACKENDS:
        try:
            labels, dist = assign_with_capacity(scaled(dtype, s), cent, min_size=SIZE, max_size=SIZE, backend=backend)
        except ValueError as exc:
            refused_only_when_huge(exc, s, dtype)
            continue
        np.testing.assert_array_equal(labels, base.labels)
        assert np.isfinite(dist).all()
        if pow2:
            np.testing.assert_allclose(dist, np.ldexp(base.distances.astype(np.float64), 2 * m).astype(dtype),
                                       rtol=1e-5, atol=2 * np.finfo(dtype).smallest_subnormal)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@FUZZ
@given(data=st.data())
def test_distributed_one_process_scales(dtype, data):
    pow2 = data.draw(st.booleans(), label="power of two")
    m = data.draw(st.integers(*POW2[dtype]), label="exponent")
    s = math.ldexp(1.0, m) if pow2 else 10.0 ** data.draw(st.floats(*DEC[dtype]), label="log10 scale")
    try:
        res = distributed_capacity_kmeans(scaled(dtype, s), K, min_size=SIZE, max_size=SIZE, progress=False,
                                          chunk_rows=16)
    except ValueError as exc:
        refused_only_when_huge(exc, s, dtype)
        return
    base = base_distributed(dtype)
    if pow2:
        check_powers_of_two(res, base, m, dtype)
    else:
        assert same_partition(res.labels, base.labels)
    assert (res.sizes == SIZE).all() and np.isfinite(res.distances).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("s", [1e-40, 1e-30, 1e30, 1e36], ids=lambda s: f"{s:g}")
def test_cosine_accepts_any_finite_magnitude(backend, s):
    """Cosine distances have no unit: every finite magnitude is accepted, with any magnitude of centroids."""
    shifted = mixture(np.float64) + 20.0  # away from the origin: distinct directions
    x = shifted.astype(np.float32)
    base = capacity_kmeans(x, K, min_size=SIZE, max_size=SIZE, metric="cosine", backend=backend)
    res = capacity_kmeans((shifted * s).astype(np.float32), K, min_size=SIZE, max_size=SIZE, metric="cosine",
                          backend=backend)
    assert same_partition(res.labels, base.labels) and np.isfinite(res.distances).all()
    np.testing.assert_allclose(res.inertia, base.inertia, rtol=1e-3, atol=1e-6)
    labels, dist = assign_with_capacity(x, base.centroids.astype(np.float64) * 1e300, min_size=SIZE, max_size=SIZE,
                                        metric="cosine", backend=backend)
    np.testing.assert_array_equal(labels, base.labels)
    np.testing.assert_allclose(dist, base.distances, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_explicit_init_is_rescaled_with_the_data(backend):
    base = base_kmeans(np.float64, backend)
    for m in (-900, -60, 60, 400):
        s = math.ldexp(1.0, m)
        res = run_kmeans(scaled(np.float64, s), backend, init=base.centroids * s)
        np.testing.assert_array_equal(res.labels, base.labels)
        assert res.inertia == pytest.approx(base.inertia * s * s, rel=1e-12)


# --------------------------------------------------------------------------------------------------
# The former failures, one by one
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, s", [(np.float32, 1e19), (np.float32, 1e30), (np.float64, 1e154),
                                      (np.float64, 1e300)], ids=["f32-1e19", "f32-1e30", "f64-1e154", "f64-1e300"])
def test_huge_magnitudes_are_refused_not_inf(backend, dtype, s):
    """Formerly heap corruption (cpu) or inf distances (torch): now a ValueError naming the accepted range."""
    with pytest.raises(ValueError, match=RANGE + r".*accepted range is squared extent <="):
        run_kmeans(scaled(dtype, s), backend)
    cent = (base_kmeans(dtype, backend).centroids.astype(np.float64) * s).astype(dtype)
    with pytest.raises(ValueError, match=r"x \(with the centroids\) is out of the accepted range"):
        assign_with_capacity(scaled(dtype, s), cent, min_size=SIZE, max_size=SIZE, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("s", [1e-25, 1e-40], ids=["1e-25", "1e-40"])
def test_tiny_float32_clusters_as_unscaled(backend, s):
    """Formerly a pair agreement of 0.70 (float32 products underflowed)."""
    res = run_kmeans(scaled(np.float32, s), backend)
    assert same_partition(res.labels, base_kmeans(np.float32, backend).labels)


@needs_native
def test_native_kernels_refuse_what_they_cannot_compute():
    """The extension called directly (no rescaling) refuses with ValueError instead of corrupting memory."""
    lo, hi = np.full(K, SIZE, np.int64), np.full(K, SIZE, np.int64)
    x = scaled(np.float32, 1e20)
    with pytest.raises(ValueError, match="out of the native kernel's range"):
        C.kmeans_cpu(x, K, lo, hi, False, 1, 10, 1e-4, 0)
    with pytest.raises(ValueError, match="out of the native kernel's range"):
        C.assign_cpu(x, x[:K].copy(), lo, hi, False)
    bad = mixture(np.float64).copy()
    bad[7, 1] = np.nan
    with pytest.raises(ValueError, match=r"x contains NaN or Inf \(first bad row: 7\)"):
        C.kmeans_cpu(bad, K, lo, hi, False, 1, 10, 1e-4, 0)
    with pytest.raises(ValueError, match=r"centroids contains NaN or Inf \(first bad row: 1\)"):
        C.assign_cpu(mixture(np.float64), bad[6:9].copy(), lo, hi, False)
    for v in (np.inf, -np.inf, np.nan, 1e308):
        cost = np.random.default_rng(0).random((30, 3))
        cost[11, 2] = v
        with pytest.raises(ValueError, match="cost row 11 has a NaN, an Inf or a"):
            C.auction_assign(cost, np.zeros(3, np.int64), np.full(3, 10, np.int64), False)


# --------------------------------------------------------------------------------------------------
# Refused arguments: the message names the argument
# --------------------------------------------------------------------------------------------------


def _x(n: int = 10, d: int = 3) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((n, d))


def _with(value: float, row: int = 4) -> np.ndarray:
    x = _x()
    x[row, 1] = value
    return x


REFUSALS = {
    "d=0": (lambda: capacity_kmeans(np.zeros((10, 0)), 2), r"x must have at least one column \(d >= 1\)"),
    "d=0 assign": (lambda: assign_with_capacity(np.zeros((10, 0)), np.zeros((2, 0))), "x must have at least one col"),
    "d=0 distributed": (lambda: distributed_capacity_kmeans(np.zeros((10, 0)), 2, progress=False),
                        "x_local must have at least one column"),
    "tol=nan": (lambda: capacity_kmeans(_x(), 2, tol=float("nan")), "tol must be a finite float >= 0, got nan"),
    "tol=inf": (lambda: capacity_kmeans(_x(), 2, tol=float("inf")), "tol must be a finite float >= 0, got inf"),
    "tol=-1": (lambda: capacity_kmeans(_x(), 2, tol=-1.0), "tol must be a finite float >= 0"),
    "tol=nan distributed": (lambda: distributed_capacity_kmeans(_x(), 2, tol=float("nan"), progress=False),
                            "tol must be a finite float"),
    "n_init=0": (lambda: capacity_kmeans(_x(), 2, n_init=0), "n_init must be an int >= 1, got 0"),
    "n_init=0 distributed": (lambda: distributed_capacity_kmeans(_x(), 2, n_init=0, progress=False),
                             "n_init must be an int >= 1"),
    "k>n": (lambda: capacity_kmeans(_x(), 11), r"number of points \(n=10\) must be at least the number of clusters"),
    "k>n assign": (lambda: assign_with_capacity(_x(2), _x(3)), r"\(n=2\) must be at least the number of clusters"),
    "nan row": (lambda: capacity_kmeans(_with(np.nan), 2), r"x contains NaN or Inf \(first bad row: 4\)"),
    "inf row": (lambda: capacity_kmeans(_with(np.inf, 6), 2), r"x contains NaN or Inf \(first bad row: 6\)"),
    "-inf row assign": (lambda: assign_with_capacity(_with(-np.inf, 2), _x(2)), r"x contains NaN or Inf \(first bad "
                        r"row: 2\)"),
    "inf centroids": (lambda: assign_with_capacity(_x(), _with(np.inf, 1)[:2]), r"centroids contains NaN or Inf "
                      r"\(first bad row: 1\)"),
    "nan init": (lambda: capacity_kmeans(_x(), 2, init=_with(np.nan, 0)[:2]), r"init contains NaN or Inf"),
    "nan row distributed": (lambda: distributed_capacity_kmeans(_with(np.nan, 3), 2, progress=False),
                            r"x contains NaN or Inf \(first bad global row: 3\)"),
    "inf init distributed": (lambda: distributed_capacity_kmeans(_x(), 2, init=_with(np.inf, 0)[:2], progress=False),
                             r"init must be a finite \(k, d\)"),
}


# The distributed K-means always needs the extension: no reference-path variant of its cases.
@pytest.mark.parametrize("case, backend", [(c, b) for c in REFUSALS for b in BACKENDS
                                           if not (b == "torch" and "distributed" in c)])
def test_bad_arguments_are_refused_naming_the_argument(case, backend, monkeypatch):
    call, match = REFUSALS[case]
    if backend == "torch":  # the same checks on the reference path (auto picks the extension otherwise)
        monkeypatch.setattr(_backend, "native", lambda: None)
    with pytest.raises(ValueError, match=match):
        call()


def test_torch_tensors_on_the_range_checks():
    """The range check reads torch tensors as numpy arrays (same bounds, same message)."""
    x = torch.from_numpy(scaled(np.float32, 1e30))
    with pytest.raises(ValueError, match=RANGE):
        capacity_kmeans(x, K, backend="torch")
    res = capacity_kmeans(torch.from_numpy(scaled(np.float64, 2.0**-1000)), K, min_size=SIZE, max_size=SIZE,
                          n_init=2, seed=3, backend="torch")
    np.testing.assert_array_equal(res.labels.numpy(), base_kmeans(np.float64, "torch").labels)


# --------------------------------------------------------------------------------------------------
# Issue 25: a bound beyond int64, and backend="cuda" on a numpy array (each message failed before its fix)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, name", [({"max_size": 2**70}, "max_size"), ({"min_size": [0, -(2**64)]}, "min_size"),
                                      ({"max_size": 1e30}, "max_size")], ids=["2**70", "-2**64 in a list", "1e30"])
def test_a_bound_beyond_int64_is_out_of_range_and_the_message_gives_the_range(kw, name):
    """Formerly "max_size must be an int or a sequence of ints, got 1180591620717411303424" (the value is an int)."""
    with pytest.raises(ValueError) as info:
        capacity_kmeans(_x(), 2, **kw)
    msg = str(info.value)
    assert f"{name} = " in msg and "is out of range" in msg and "[0, 2**63 - 1]" in msg, msg
    assert f"pass {name}=None" in msg and "\n" not in msg, msg


def test_backend_cuda_on_a_numpy_array_says_to_pass_a_cuda_tensor_or_use_cpu():
    """Formerly "... got one on cpu; move it with .cuda()", which a numpy array does not have."""
    for call in (lambda: capacity_kmeans(_x(), 2, backend="cuda"),
                 lambda: assign_with_capacity(_x(), _x(2), backend="cuda")):
        with pytest.raises(ValueError) as info:
            call()
        msg = str(info.value)
        assert "got a numpy array" in msg and "CUDA torch tensor" in msg and "backend='cpu'" in msg, msg
        assert ".cuda()" not in msg.replace("torch.from_numpy(x).cuda()", ""), msg
        assert "\n" not in msg
