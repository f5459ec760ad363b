"""pytest-benchmark suite: capacity-constrained K-means (ours) vs faiss, scikit-learn, k-means-constrained.

Run from the repository root (after ``pip install -e .``, which builds ``cluster_kernels._C``)::

    .venv/bin/python -m pytest benchmarks/bench_kmeans.py --benchmark-only

One benchmark group per n, so pytest-benchmark prints comparable rows side by side: ours at the caps
``ceil(N/K)`` (exact balance) and ``ceil(1.5 N/K)``, the CluSTER recipe at 1.5 N/K, faiss-cpu and
scikit-learn unconstrained; k-means-constrained only at the small n (it takes minutes at 20 000).
Data, methods and quality measures are those of ``compare_kmeans.py`` (see ``kmeans_anchors.py``),
with the same n_init=3 / max_iter=50. Each benchmark runs ``BENCH_KMEANS_ROUNDS`` (default 3) rounds
after an untimed warm-up on 2 000 points. Sizes can be lowered for a smoke run::

    BENCH_KMEANS_N=3000 BENCH_KMEANS_N_SMALL=2000 .venv/bin/python -m pytest benchmarks/bench_kmeans.py --benchmark-only

Benchmarks of a competitor that is not installed are skipped with the reason. Correctness is
asserted (labels in range, capacities met by the constrained methods, ours' reported inertia equal
to the one measured here); timings are never asserted, machines are too noisy for that.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import kmeans_anchors as anchors
import numpy as np
import pytest

N_MAIN = int(os.environ.get("BENCH_KMEANS_N", "20000"))
N_SMALL = int(os.environ.get("BENCH_KMEANS_N_SMALL", "5000"))
ROUNDS = int(os.environ.get("BENCH_KMEANS_ROUNDS", "3"))
D, K, N_INIT, MAX_ITER, SEED = 128, 8, 3, 50, 0
WARMUP_POINTS = 2000
CAPS = {"exact": 1.0, "1.5x": 1.5}
INSTALL_HINT = {
    "faiss": "pip install faiss-cpu",
    "k_means_constrained": "pip install k-means-constrained",
    "sklearn": "pip install scikit-learn",
}


def _cases() -> list:
    """(n, method, cap name or None) for every benchmark; k-means-constrained only at the small n."""
    cases = []
    for n in sorted({N_SMALL, N_MAIN}):
        cases += [(n, "ours", cap) for cap in CAPS]
        cases += [(n, "faiss", None), (n, "sklearn", None), (n, "cluster-recipe", "1.5x")]
        if n == N_SMALL:
            cases += [(n, "k-means-constrained", cap) for cap in CAPS]
    return [pytest.param(*case, id=f"n{case[0]}-{case[1]}" + (f"-{case[2]}" if case[2] else "")) for case in cases]


@functools.cache
def _data(n: int) -> np.ndarray:
    return anchors.gaussian_mixture(n, D, K, SEED)


@pytest.mark.parametrize(("n", "name", "cap_name"), _cases())
def test_kmeans(benchmark, n: int, name: str, cap_name: str | None) -> None:
    method = anchors.METHODS[name]
    if method.module != "cluster_kernels" and importlib.util.find_spec(method.module) is None:
        pytest.skip(f"{name}: {method.module} is not installed ({INSTALL_HINT.get(method.module, '')})")
    x = _data(n)
    factor = CAPS[cap_name] if cap_name else None
    max_size = n if factor is None else anchors.capacity(n, K, factor)
    kwargs = {"n_init": N_INIT, "max_iter": MAX_ITER, "seed": SEED}
    if name == "cluster-recipe":
        kwargs["cap_factor"] = factor  # the authors' test is largest > f N/K, before rounding the cap up

    # Untimed warm-up: lazy imports and thread pools are not what is measured.
    w = min(n, WARMUP_POINTS)
    method.run(x[:w], K, w if factor is None else anchors.capacity(w, K, factor), **kwargs)

    benchmark.group = f"kmeans n={n} d={D} K={K}"
    result = benchmark.pedantic(method.run, args=(x, K, max_size), kwargs=kwargs, rounds=ROUNDS, iterations=1)

    q = anchors.quality(x, result.labels, result.centroids, K, max_size)
    benchmark.extra_info.update(
        cap=cap_name or "none", max_size=max_size, **{key: q[key] for key in ("inertia", "inertia_refit", "sizes")}
    )
    assert sum(q["sizes"]) == n
    if method.constrained:
        assert q["capacity_met"], f"{name}: largest cluster {q['max_size']} > max_size {max_size}"
    if name == "ours":
        assert result.info["reported_inertia"] == pytest.approx(q["inertia"], rel=1e-3)
