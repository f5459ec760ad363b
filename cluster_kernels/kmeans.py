"""Capacity-constrained K-means, the public API: :func:`capacity_kmeans`, :func:`assign_with_capacity`, the backend
choice and the argument checks.

Every backend computes the same thing: K-means whose cluster sizes satisfy ``min_size <= sizes <= max_size``
exactly, each assignment step optimal for its cost matrix. ``backend="cpu"`` runs the C++/OpenMP kernels of
``cluster_kernels._C`` (csrc/cpu), ``"cuda"`` its CUDA kernels (csrc/cuda) and ``"torch"`` the float64 reference
(:mod:`cluster_kernels.kmeans_reference`, whose docstring has the maths, the numerical range and a table of which
native file implements which of its functions).

Numerical range: data whose largest ``|entry|`` lies outside ``[2^-24, 2^24]`` are first rescaled by a power of two
(exact), and results are reported in the caller's units; ``metric="sqeuclidean"`` refuses data whose squared
distances cannot be represented (``cluster_kernels._checks.data_scale``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cluster_kernels import _backend, _blas
from cluster_kernels._checks import (  # noqa: F401 - METRICS stays importable from here
    METRICS,
    DataScale,
    bounds,
    check_finite_columns,
    check_int,
    check_k,
    check_matrix,
    check_metric,
    check_tol,
    column_range,
    working_frame,
)
from cluster_kernels._selfcheck import kmeans_backend
from cluster_kernels.kmeans_reference import assign_ref, capacity_kmeans_ref, prepare_rows, sqdist_ref


@dataclass
class KMeansResult:
    """Result of :func:`capacity_kmeans`.

    Attributes:
        labels: (n,) int64 cluster of each point.
        centroids: (k, d) centroids in the input dtype (unit norm for ``metric="cosine"``).
        distances: (n,) distance of each point to its own centroid (squared Euclidean, or cosine
            distance ``1 - cos``).
        inertia: sum of ``distances``.
        sizes: (k,) int64 cluster sizes; ``min_size <= sizes <= max_size`` always holds.
        n_iter: Lloyd iterations of the best run.
        converged: whether the best run met ``tol`` before ``max_iter``.
        history: objective after each assignment step of the best run (never increases).
    """

    labels: Any
    centroids: Any
    distances: Any
    inertia: float
    sizes: Any
    n_iter: int
    converged: bool
    history: list[float]


# --------------------------------------------------------------------------------------------------
# Launchers of the native kernels (csrc/cpu/lloyd.cpp, csrc/cuda/lloyd.cu)
# --------------------------------------------------------------------------------------------------


def _result_from_native(x: Any, t: torch.Tensor, k: int, labels: torch.Tensor, centroids: torch.Tensor,
                        distances: torch.Tensor, out: dict, scale: DataScale, spherical: bool) -> KMeansResult:
    """The result in the caller's units: the kernels ran on ``x * 2**-scale.exponent`` (float64 outputs)."""
    sq = (lambda v: v) if spherical else scale.up_sq  # cosine distances and unit centroids have no unit
    sizes = torch.bincount(labels, minlength=k)
    return KMeansResult(
        labels=_to_output(x, labels),
        centroids=_to_output(x, (centroids if spherical else scale.up(centroids)).to(t.dtype)),
        distances=_to_output(x, sq(distances).to(t.dtype)),
        inertia=float(sq(float(out["inertia"]))),
        sizes=_to_output(x, sizes),
        n_iter=int(out["n_iter"]),
        converged=bool(out["converged"]),
        history=[float(sq(float(h))) for h in out["history"]],
    )


def _native_kmeans(choice: str, x: Any, t: torch.Tensor, k: int, lo: np.ndarray, hi: np.ndarray, *, spherical: bool,
                   n_init: int, max_iter: int, tol: float, seed: int, init: torch.Tensor | None,
                   scale: DataScale) -> KMeansResult:
    """The C++/CUDA Lloyd loop on ``t`` and ``init`` (already in the working frame of ``scale``)."""
    seed_u64 = seed % (1 << 64)
    if choice == "cpu":
        mod = _backend.require_cpu_native("capacity_kmeans")
        xn = t.contiguous().numpy()
        init_n = init.to(t.dtype).contiguous().cpu().numpy() if init is not None else None
        with _blas.one_thread():
            out = mod.kmeans_cpu(xn, k, lo, hi, spherical, n_init, max_iter, tol, seed_u64, init_n, 0, _blas.gemm())
        return _result_from_native(
            x, t, k, torch.from_numpy(out["labels"]), torch.from_numpy(out["centroids"]),
            torch.from_numpy(out["distances"]), out, scale, spherical,
        )
    mod = _backend.require_cuda_native("capacity_kmeans")
    xc = t.contiguous()
    n, d = xc.shape
    dev = xc.device
    labels = torch.empty(n, dtype=torch.int64, device=dev)
    cent = torch.empty(k, d, dtype=torch.float64, device=dev)
    dist = torch.empty(n, dtype=torch.float64, device=dev)
    init_c = init.to(device=dev, dtype=t.dtype).contiguous() if init is not None else None
    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream(dev).cuda_stream
        out = mod.kmeans_cuda(
            xc.data_ptr(), xc.dtype == torch.float64, n, d, k, lo, hi, spherical, n_init, max_iter, tol, seed_u64,
            init_c.data_ptr() if init_c is not None else 0, labels.data_ptr(), cent.data_ptr(), dist.data_ptr(),
            stream, dev.index if dev.index is not None else torch.cuda.current_device(),
        )
    return _result_from_native(x, t, k, labels, cent, dist, out, scale, spherical)


def _native_assign(choice: str, x: Any, t: torch.Tensor, c: torch.Tensor, k: int, lo: np.ndarray, hi: np.ndarray,
                   spherical: bool, scale: DataScale) -> tuple[Any, Any]:
    """The C++/CUDA assignment of ``t`` to ``c`` (both in the working frame of ``scale``)."""
    sq = (lambda v: v) if spherical else scale.up_sq
    if choice == "cpu":
        mod = _backend.require_cpu_native("assign_with_capacity")
        with _blas.one_thread():
            labels, dist = mod.assign_cpu(
                t.contiguous().numpy(), c.to(t.dtype).contiguous().cpu().numpy(), lo, hi, spherical, 0, _blas.gemm()
            )
        return _to_output(x, torch.from_numpy(labels)), _to_output(x, sq(torch.from_numpy(dist)).to(t.dtype))
    mod = _backend.require_cuda_native("assign_with_capacity")
    xc = t.contiguous()
    n, d = xc.shape
    dev = xc.device
    cc = c.to(device=dev, dtype=t.dtype).contiguous()
    labels = torch.empty(n, dtype=torch.int64, device=dev)
    dist = torch.empty(n, dtype=torch.float64, device=dev)
    with torch.cuda.device(dev):
        mod.assign_cuda(
            xc.data_ptr(), xc.dtype == torch.float64, n, d, cc.data_ptr(), k, lo, hi, spherical, labels.data_ptr(),
            dist.data_ptr(), torch.cuda.current_stream(dev).cuda_stream,
            dev.index if dev.index is not None else torch.cuda.current_device(),
        )
    return _to_output(x, labels), _to_output(x, sq(dist).to(t.dtype))


# --------------------------------------------------------------------------------------------------
# Public dispatchers
# --------------------------------------------------------------------------------------------------


def has_cuda_kmeans() -> bool:
    """Whether ``cluster_kernels._C`` was built with its CUDA K-means (``backend="auto"`` then runs CUDA tensors
    there; without it a CUDA tensor takes the float64 torch reference)."""
    return _backend.has_cuda_native()


def _resolve(op: str, backend: str, device: torch.device, given_numpy: bool = False) -> str:
    _backend.check_backend_name(op, backend)
    if backend == "triton":
        raise _backend.missing_backend_error(
            op, "triton", "K-means has no Triton kernel (it is native C++/CUDA)", 'use backend="cuda", "cpu" or "auto"'
        )
    if backend == "auto":
        if device.type == "cuda":
            if _backend.has_cuda_native():
                choice, why = "cuda", "CUDA tensor and _C has its CUDA part"
            else:
                choice, why = "torch", "CUDA tensor but _C was built without CUDA"
        elif _backend.has_cpu_native():
            choice, why = "cpu", "C++/OpenMP extension available"
        else:
            choice, why = "torch", "cluster_kernels._C not built"
        _backend.log_choice_once(op, device.type, choice, why)
        return choice
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(f"{op}: backend='cpu' needs a CPU input, got a tensor on {device}; move it with .cpu().")
        _backend.require_cpu_native(op)
    if backend == "cuda":
        if given_numpy:
            raise ValueError(f"{op}: backend='cuda' needs a CUDA tensor, got a numpy array; pass a CUDA torch tensor "
                             "(torch.from_numpy(x).cuda()) or use backend='cpu'.")
        if device.type != "cuda":
            raise ValueError(f"{op}: backend='cuda' needs a CUDA tensor, got a tensor on {device}; move it with "
                             ".cuda() or use backend='cpu'.")
        _backend.require_cuda_native(op)
    return backend


def _working_frame(op: str, t: torch.Tensor, other: torch.Tensor | None, spherical: bool,
                   name: str) -> tuple[DataScale, torch.Tensor | None]:
    """The power-of-two rescaling of ``t`` and the explicit centroids ``other`` in it (``_checks.working_frame``).

    Also the NaN/Inf check of ``t`` (taken with ``check_matrix(..., finite=False)``), from the same column ranges.
    """
    if other is not None:
        other = other.to(device=t.device, dtype=torch.float64)
    dtype = np.float32 if t.dtype == torch.float32 else np.float64
    col_min, col_max = column_range(t)
    check_finite_columns(t, col_min, col_max, "x", op)
    return working_frame(col_min, col_max, t.shape[0], dtype, spherical, op, name, other)


def _to_output(like: Any, t: torch.Tensor) -> Any:
    if isinstance(like, np.ndarray):
        return t.cpu().numpy()
    return t.to(like.device)


def capacity_kmeans(
    x: Any,
    k: int,
    *,
    min_size: int | Sequence[int] | None = None,
    max_size: int | Sequence[int] | None = None,
    metric: str = "sqeuclidean",
    n_init: int = 3,
    max_iter: int = 100,
    tol: float = 1e-4,
    seed: int = 0,
    init: str | Any = "k-means++",
    backend: str = "auto",
) -> KMeansResult:
    """K-means whose cluster sizes satisfy ``min_size <= sizes <= max_size`` exactly.

    Args:
        x: (n, d) float32/float64 numpy array or torch tensor (CPU, or CUDA for the CUDA path), d >= 1,
            finite; non-contiguous inputs are copied. Never modified. Any magnitude is accepted (it is
            rescaled by a power of two internally) as long as the squared distances fit the dtype: with
            ``metric="sqeuclidean"``, ``sum_j (max_j - min_j)^2 <= finfo(dtype).max / 2`` and ``n`` times that
            ``<= finfo(float64).max / 2`` (module docstring, "Numerical range").
        k: number of clusters, ``1 <= k <= n``.
        min_size: int or (k,) ints, lower bound per cluster (default 0).
        max_size: int or (k,) ints, upper bound per cluster (default n).
        metric: "sqeuclidean", or "cosine" (spherical k-means on L2-normalised rows).
        n_init: k-means++ restarts; the lowest inertia wins.
        max_iter: Lloyd iterations per restart.
        tol: finite float >= 0; stop when the objective falls by less than ``tol`` (relative) or labels
            repeat.
        seed: seed of the splitmix64 stream (same seed and input give identical labels).
        init: "k-means++" or a finite (k, d) array of initial centroids (then ``n_init`` is 1); it counts
            in the range check of ``x``.
        backend: "auto" | "cpu" (C++/OpenMP) | "cuda" | "torch" (float64 reference).

    Returns:
        KMeansResult; arrays follow the input type (numpy in, numpy out; torch in, torch out on
        the input's device); centroids in the input dtype.

    Raises:
        TypeError: x not float32/float64 numpy/torch, k not an int, bounds not ints.
        ValueError: bad shapes (d = 0 included), NaN/Inf in ``x`` or ``init``, ``tol`` NaN/Inf/negative,
            ``n_init`` < 1, k outside [1, n], infeasible bounds, unknown metric/backend, data out of the
            accepted range (the message gives it).
        RuntimeError: an explicitly requested backend is not available (the message says how to get it).
    """
    op = "capacity_kmeans"
    t = check_matrix(x, "x", op, finite=False)  # checked with the column ranges (_working_frame)
    n, d = t.shape
    k = check_k(k, n, op)
    check_metric(metric, op)
    lo, hi = bounds(min_size, max_size, k, n, op)
    n_init = check_int(n_init, "n_init", 1, op)
    max_iter = check_int(max_iter, "max_iter", 1, op)
    tol = check_tol(tol, op)
    init_t = None
    if isinstance(init, str):
        if init != "k-means++":
            raise ValueError(f"{op}: init must be 'k-means++' or a (k, d) array of centroids, got {init!r}.")
    else:
        init_t = check_matrix(init, "init", op)
        if tuple(init_t.shape) != (k, d):
            raise ValueError(f"{op}: init must have shape (k, d) = ({k}, {d}), got {tuple(init_t.shape)}.")
    spherical = metric == "cosine"
    choice = _resolve(op, backend, t.device, isinstance(x, np.ndarray))
    choice = kmeans_backend(op, t.device, choice, capacity_kmeans, _backend.has_cpu_native())  # first-use check
    scale, init_t = _working_frame(op, t, init_t, spherical, "x" if init_t is None else "x (with init)")
    ts = scale.down(t)
    if choice != "torch":
        return _native_kmeans(
            choice, x, ts.cpu() if choice == "cpu" else ts, k, lo, hi, spherical=spherical, n_init=int(n_init),
            max_iter=int(max_iter), tol=float(tol), seed=int(seed), init=init_t, scale=scale,
        )
    xp, mean = prepare_rows(ts, spherical)
    if init_t is not None:
        init_t = init_t - mean
    labels, cent, history, n_iter, converged = capacity_kmeans_ref(
        xp, k, lo, hi, spherical=spherical, n_init=int(n_init), max_iter=int(max_iter), tol=float(tol),
        seed=int(seed), init=init_t,
    )
    return _finish(x, t, xp, mean, labels, cent, k, spherical, history, n_iter, converged, scale)


def _finish(x, t, xp, mean, labels, cent, k, spherical, history, n_iter, converged, scale) -> KMeansResult:
    """The reference's result in the caller's units (it ran on ``x * 2**-scale.exponent``)."""
    labels = labels.to(device=t.device, dtype=torch.int64)
    cent = cent.to(device=t.device, dtype=torch.float64)
    own = (xp - cent[labels]).pow(2).sum(1)
    if spherical:
        own = own / 2.0  # |a - b|^2 = 2 - 2 cos for unit vectors
        history = [h / 2.0 for h in history]
        inertia = float(own.sum())
    else:  # summed in the working frame: no distance turned subnormal by the rescaling is lost
        inertia = scale.up_sq(float(own.sum()))
        own, cent, mean = scale.up_sq(own), scale.up(cent), scale.up(mean)
        history = [scale.up_sq(float(h)) for h in history]
    sizes = torch.bincount(labels, minlength=k)
    return KMeansResult(
        labels=_to_output(x, labels),
        centroids=_to_output(x, (cent + mean).to(t.dtype)),
        distances=_to_output(x, own.to(t.dtype)),
        inertia=float(inertia),
        sizes=_to_output(x, sizes),
        n_iter=int(n_iter),
        converged=bool(converged),
        history=[float(h) for h in history],
    )


def assign_with_capacity(
    x: Any,
    centroids: Any,
    *,
    min_size: int | Sequence[int] | None = None,
    max_size: int | Sequence[int] | None = None,
    metric: str = "sqeuclidean",
    backend: str = "auto",
) -> tuple[Any, Any]:
    """Optimal assignment of points to fixed centroids under size bounds (no centroid update).

    Args:
        x: (n, d) float32/float64 numpy array or torch tensor, finite, d >= 1; any magnitude whose squared
            distances to the centroids fit the dtype (the range of :func:`capacity_kmeans`, over the rows of
            ``x`` and of ``centroids`` together; none for ``metric="cosine"``).
        centroids: (k, d) finite array/tensor of the same kind.
        min_size, max_size: int or (k,) ints (defaults 0 and n).
        metric: "sqeuclidean" or "cosine".
        backend: "auto" | "cpu" | "cuda" | "torch".

    Returns:
        labels (n,) int64 and distances (n,) to the assigned centroid, minimising their sum
        subject to the bounds; same type/device as ``x``.

    Raises:
        TypeError / ValueError as :func:`capacity_kmeans` (NaN/Inf in ``centroids`` included), plus
        mismatched centroid dimensions.
    """
    op = "assign_with_capacity"
    t = check_matrix(x, "x", op, finite=False)  # checked with the column ranges (_working_frame)
    c = check_matrix(centroids, "centroids", op)
    n, d = t.shape
    if c.shape[1] != d:
        raise ValueError(
            f"{op}: centroids have {c.shape[1]} dimensions but x has {d}; pass centroids of shape (k, {d})."
        )
    k = check_k(c.shape[0], n, op)
    check_metric(metric, op)
    lo, hi = bounds(min_size, max_size, k, n, op)
    choice = _resolve(op, backend, t.device, isinstance(x, np.ndarray))
    choice = kmeans_backend(op, t.device, choice, assign_with_capacity, _backend.has_cpu_native())  # first-use check
    spherical = metric == "cosine"
    scale, c = _working_frame(op, t, c, spherical, "x (with the centroids)")
    ts = scale.down(t)
    if choice != "torch":
        return _native_assign(choice, x, ts.cpu() if choice == "cpu" else ts, c, k, lo, hi, spherical, scale)
    if spherical:
        xp, _ = prepare_rows(ts, True)
        cp = c / c.norm(dim=1, keepdim=True).clamp_min(1e-30)
    else:
        xp, mean = prepare_rows(ts, False)
        cp = c - mean
    labels, _, _ = assign_ref(sqdist_ref(xp, cp), lo, hi)
    own = (xp - cp[labels]).pow(2).sum(1)
    own = own / 2.0 if spherical else scale.up_sq(own)
    return _to_output(x, labels), _to_output(x, own.to(t.dtype))
