"""The case set run under AddressSanitizer/UBSan (tests/reliability/build_sanitized.py), one child process.

``main(so_path, names)`` puts the sanitized extension in place of ``cluster_kernels._C`` and runs the cases;
each prints ``START <name>`` before and ``CASE <name> ok`` after, so a crash names the case it happened in. A
case catches the clean refusals it expects (a ValueError naming the range or the argument) itself; any exception
that escapes is printed as ``CASE <name> FAIL ...`` and makes the child exit with status 1.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback

import numpy as np

REFUSED = (ValueError,)


def _mixture(n_per: int, d: int, k: int, seed: int, dtype=np.float64) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=6.0, size=(k, d))
    x = np.concatenate([c + rng.normal(size=(n_per, d)) for c in centres])
    return x[rng.permutation(len(x))].astype(dtype)


def _kmeans(x, k, **kw):
    from cluster_kernels import capacity_kmeans

    r = capacity_kmeans(x, k, backend="cpu", **kw)
    sizes = np.bincount(r.labels, minlength=k)
    assert sizes.sum() == len(x) and np.isfinite(r.distances).all(), (sizes, r.distances)
    return r


def case_kmeans_f32_balanced():
    _kmeans(_mixture(25, 3, 4, 0, np.float32), 4, min_size=25, max_size=25, n_init=2)


def case_kmeans_f64_bounds():
    _kmeans(_mixture(30, 5, 3, 1), 5, min_size=12, max_size=25)


def case_kmeans_cosine():
    _kmeans(_mixture(20, 6, 3, 2, np.float32), 3, metric="cosine", max_size=25)


def case_kmeans_k1():
    _kmeans(_mixture(7, 2, 1, 3), 1)


def case_kmeans_k_equals_n():
    _kmeans(_mixture(3, 4, 3, 4), 9, min_size=1, max_size=1)


def case_kmeans_odd_shapes():
    # d = 1 and d = 17, k = 9 and 13: remainders of the 8-wide (float32) and 4-wide (float64) tiles.
    _kmeans(_mixture(11, 1, 9, 5, np.float32), 9, max_size=12)
    _kmeans(_mixture(10, 17, 13, 6), 13, min_size=9, max_size=11)


def case_kmeans_explicit_init():
    x = _mixture(15, 3, 3, 7)
    _kmeans(x, 3, init=x[[0, 20, 40]].copy(), min_size=15, max_size=15)


def case_kmeans_duplicates():
    x = np.repeat(_mixture(5, 2, 2, 8), 6, axis=0)
    _kmeans(x, 4, min_size=15, max_size=15)


def case_assign_bounds():
    from cluster_kernels import assign_with_capacity

    x = _mixture(20, 4, 3, 9, np.float32)
    lab, dist = assign_with_capacity(x, x[:5].copy(), min_size=10, max_size=14, backend="cpu")
    sizes = np.bincount(lab, minlength=5)
    assert (sizes >= 10).all() and (sizes <= 14).all() and np.isfinite(dist).all()


def case_auction_shapes():
    from cluster_kernels import _C

    rng = np.random.default_rng(10)
    for n, k in ((1, 1), (7, 3), (64, 8), (200, 13)):
        cost = rng.random((n, k))
        for general in (False, True):
            lo = np.full(k, n // k // 2, dtype=np.int64)
            hi = np.full(k, -(-n // k), dtype=np.int64)
            labels, _, _ = _C.auction_assign(cost, lo, hi, general)
            sizes = np.bincount(labels, minlength=k)
            assert (sizes >= lo).all() and (sizes <= hi).all(), (n, k, sizes)


def case_auction_huge_and_tiny_costs():
    from cluster_kernels import _C

    rng = np.random.default_rng(11)
    for scale in (1e-300, 1e-150, 1e150, 1e300):
        cost = rng.random((40, 4)) * scale
        labels, _, _ = _C.auction_assign(cost, np.zeros(4, np.int64), np.full(4, 10, np.int64), False)
        assert (np.bincount(labels, minlength=4) == 10).all()


def case_auction_nonfinite_costs():
    from cluster_kernels import _C

    for bad in (np.inf, -np.inf, np.nan, 1e308):
        cost = np.random.default_rng(12).random((30, 3))
        cost[4, 1] = bad
        try:
            _C.auction_assign(cost, np.zeros(3, np.int64), np.full(3, 10, np.int64), False)
        except REFUSED:
            continue
        raise AssertionError(f"auction_assign accepted a cost of {bad}")


def case_auction_block_one_process():
    from cluster_kernels import _C
    from cluster_kernels._collectives import AuctionComm, Comm

    cost = np.random.default_rng(13).random((50, 5))
    out = _C.auction_block(cost, np.full(5, 10, np.int64), np.full(5, 10, np.int64), AuctionComm(Comm(None)), 0, 50)
    assert (np.bincount(out["labels"], minlength=5) == 10).all()


def case_kmeans_huge_float32():
    # Former heap corruption ("munmap_chunk(): invalid pointer"): float32 rows of magnitude 1e19 and above.
    for scale in (1e19, 1e20, 1e30, 1e38):
        try:
            _kmeans(_mixture(20, 3, 3, 14, np.float32) * np.float32(scale / 20), 3, min_size=20, max_size=20)
        except REFUSED:
            pass


def case_kmeans_huge_float64():
    for scale in (1e154, 1e200, 1e300):
        try:
            _kmeans(_mixture(20, 3, 3, 15) * (scale / 20), 3, min_size=20, max_size=20)
        except REFUSED:
            pass


def case_kmeans_tiny():
    _kmeans(_mixture(20, 3, 3, 16, np.float32) * np.float32(1e-40), 3, min_size=20, max_size=20)
    _kmeans(_mixture(20, 3, 3, 16) * 1e-300, 3, min_size=20, max_size=20)


def case_assign_huge():
    from cluster_kernels import assign_with_capacity

    x = _mixture(20, 3, 3, 17, np.float32)
    for scale in (1e15, 1e19, 1e30):
        try:
            lab, dist = assign_with_capacity(x * np.float32(scale), x[:3] * np.float32(scale), min_size=20,
                                             max_size=20, backend="cpu")
        except REFUSED:
            continue
        # Formerly: a cluster left empty and inf distances, silently.
        assert (np.bincount(lab, minlength=3) == 20).all() and np.isfinite(dist).all(), (scale, lab, dist)


def case_native_unscaled_huge():
    # The extension called directly (no rescaling in Python) must refuse, never corrupt memory.
    from cluster_kernels import _C

    lo, hi = np.full(3, 20, np.int64), np.full(3, 20, np.int64)
    for x in (_mixture(20, 3, 3, 18, np.float32) * np.float32(1e20), _mixture(20, 3, 3, 18) * 1e200):
        for fn, args in ((_C.kmeans_cpu, (x, 3, lo, hi, False, 2, 20, 1e-4, 0)),
                         (_C.assign_cpu, (x, x[:3].copy(), lo, hi, False))):
            try:
                fn(*args)
            except REFUSED:
                pass


def case_native_nonfinite_input():
    from cluster_kernels import _C

    lo, hi = np.zeros(3, np.int64), np.full(3, 30, np.int64)
    x = _mixture(10, 3, 3, 19)
    for bad in (np.nan, np.inf):
        y = x.copy()
        y[3, 2] = bad
        for fn, args in ((_C.kmeans_cpu, (y, 3, lo, hi, False, 1, 10, 1e-4, 0)),
                         (_C.assign_cpu, (x, y[2:5].copy(), lo, hi, False)),
                         (_C.assign_cpu, (y, x[:3].copy(), lo, hi, False))):
            try:
                fn(*args)
            except REFUSED:
                continue
            raise AssertionError(f"the extension accepted an input with {bad}")


def case_distributed_one_process():
    from cluster_kernels import distributed_capacity_kmeans

    for x in (_mixture(20, 4, 3, 20, np.float32), _mixture(20, 4, 3, 20) * 1e-200, _mixture(20, 4, 3, 20) * 1e150):
        r = distributed_capacity_kmeans(x, 3, min_size=20, max_size=20, progress=False, chunk_rows=16)
        assert (np.bincount(r.labels, minlength=3) == 20).all()


CASES = {name[5:]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}


def _install(so: str) -> None:
    spec = importlib.util.spec_from_file_location("cluster_kernels._C", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["cluster_kernels._C"] = mod
    import cluster_kernels  # noqa: F401 - the package, after its _C is in place

    cluster_kernels._C = mod


def main(so: str, names: list[str] | None = None) -> None:
    _install(so)
    failed = 0
    for name in names or list(CASES):
        print(f"START {name}", flush=True)
        try:
            CASES[name]()
            print(f"CASE {name} ok", flush=True)
        except Exception as exc:  # noqa: BLE001 - reported, the case fails
            failed += 1
            print(f"CASE {name} FAIL {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc()
    sys.exit(1 if failed else 0)
