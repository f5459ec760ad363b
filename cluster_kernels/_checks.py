"""Argument checks shared by the single-process and the distributed K-means (one message per mistake, everywhere).

Each check raises a ``TypeError``/``ValueError`` that names the operation and the argument, says what was
expected and what was given, and how to fix it.

Numerical range (:func:`data_scale`): the K-means objective is scale-equivariant, so every backend clusters
``x * 2**-e`` (an exact power-of-two rescaling) when the largest ``|entry|`` of the data (and of explicit
centroids) lies outside ``[2**-SAFE_EXPONENT, 2**SAFE_EXPONENT]``, and reports distances and centroids in the
caller's units. Powers of two commute with floating-point rounding, so the labels are bit for bit those of any
power-of-two rescaled copy. Inputs whose squared distances cannot be represented are refused up front.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

METRICS = ("sqeuclidean", "cosine")
SAFE_EXPONENT = 24  # data whose largest |entry| lies in [2^-24, 2^24] are clustered as given (no rescaling)


def check_matrix(x: Any, name: str, op: str, *, finite: bool = True) -> torch.Tensor:
    """``x`` as a 2-D float32/float64 tensor (a numpy array is wrapped, not copied), finite unless ``finite`` is
    False (the caller then checks it with :func:`check_finite_columns` from the column ranges it needs anyway)."""
    if isinstance(x, np.ndarray):
        if x.dtype not in (np.float32, np.float64):
            raise TypeError(
                f"{op}: {name} must be float32 or float64, got dtype {x.dtype}; convert it with "
                f"{name}.astype(np.float32)."
            )
        with warnings.catch_warnings():
            # Read-only inputs (np.memmap of a feature store) are never written; no copy needed.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            t = torch.from_numpy(x)
    elif isinstance(x, torch.Tensor):
        if x.dtype not in (torch.float32, torch.float64):
            raise TypeError(
                f"{op}: {name} must be float32 or float64, got dtype {x.dtype}; convert it with {name}.float()."
            )
        t = x.detach()
    else:
        raise TypeError(f"{op}: {name} must be a numpy array or a torch tensor, got {type(x).__name__}.")
    if t.ndim != 2:
        raise ValueError(f"{op}: {name} must be 2-D (n, d), got shape {tuple(t.shape)}; reshape it to (n, d).")
    if t.shape[1] == 0:
        raise ValueError(f"{op}: {name} must have at least one column (d >= 1), got shape {tuple(t.shape)}.")
    if finite and not bool(torch.isfinite(t).all()):
        _raise_nonfinite(t, name, op)
    return t


def _raise_nonfinite(t: torch.Tensor, name: str, op: str) -> None:
    bad = int((~torch.isfinite(t)).any(dim=1).nonzero()[0, 0])
    raise ValueError(f"{op}: {name} contains NaN or Inf (first bad row: {bad}); remove or impute those rows.")


def check_finite_columns(t: torch.Tensor, col_min: np.ndarray, col_max: np.ndarray, name: str, op: str) -> None:
    """Raise the NaN/Inf error of :func:`check_matrix` for ``t`` given its column ranges (:func:`column_range`).

    Minima and maxima propagate NaN and keep an infinity, so they are all finite exactly when every entry is:
    the full scan for the first bad row runs only when there is one (on large inputs ``isfinite`` costs more
    than the rest of a K-means' input checks).
    """
    if not (np.isfinite(col_min).all() and np.isfinite(col_max).all()):
        _raise_nonfinite(t, name, op)


def size_bounds(value: Any, k: int, n: int, name: str, op: str, default: int) -> np.ndarray:
    """Per-cluster bound as an int64 (k,) array."""
    if value is None:
        return np.full(k, default, dtype=np.int64)
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    _check_int64_range(arr, value, name, n, op)
    if arr.dtype.kind not in "iu" and not (arr.dtype.kind == "f" and np.all(arr == np.round(arr))):
        raise TypeError(f"{op}: {name} must be an int or a sequence of ints, got {value!r}.")
    arr = arr.astype(np.int64)
    if arr.ndim == 0:
        arr = np.full(k, int(arr), dtype=np.int64)
    if arr.shape != (k,):
        raise ValueError(f"{op}: {name} must be an int or have one entry per cluster ({k}), got shape {arr.shape}.")
    if (arr < 0).any():
        raise ValueError(f"{op}: {name} must be >= 0, got {arr.tolist()}.")
    return arr


def _check_int64_range(arr: np.ndarray, value: Any, name: str, n: int, op: str) -> None:
    """Refuse integers (or integral floats) a bound cannot hold: outside int64, as numpy stores the bounds."""
    if arr.dtype.kind == "O":  # Python ints beyond int64 (numpy keeps them as objects)
        entries = [v for v in arr.ravel().tolist() if isinstance(v, int) and not isinstance(v, bool)]
    elif arr.dtype.kind in "fu":
        entries = [v for v in arr.ravel().tolist() if isinstance(v, (int, float)) and math.isfinite(v)]
    else:
        return
    bad = [v for v in entries if not -(2**63) <= v < 2**63]
    if bad:
        shown = int(bad[0]) if float(bad[0]).is_integer() else bad[0]
        raise ValueError(
            f"{op}: {name} = {shown} is out of range: a bound must be an int in [0, 2**63 - 1] (any bound above "
            f"n = {n} acts as n); pass {name}=None for no bound."
        )


def bounds(min_size: Any, max_size: Any, k: int, n: int, op: str) -> tuple[np.ndarray, np.ndarray]:
    """Feasible per-cluster bounds ``(lo, hi)``, int64 ``(k,)`` each, ``hi`` clipped to ``n``."""
    lo = size_bounds(min_size, k, n, "min_size", op, 0)
    hi = np.minimum(size_bounds(max_size, k, n, "max_size", op, n), n)
    if (lo > hi).any():
        j = int(np.argmax(lo > hi))
        raise ValueError(f"{op}: min_size ({lo[j]}) > max_size ({hi[j]}) for cluster {j}; lower min_size.")
    if int(hi.sum()) < n:
        raise ValueError(
            f"{op}: infeasible capacities: k * max_size = {int(hi.sum())} < n = {n}, so some points would have no "
            f"cluster; raise max_size to at least ceil(n / k) = {math.ceil(n / k)}."
        )
    if int(lo.sum()) > n:
        raise ValueError(
            f"{op}: infeasible capacities: k * min_size = {int(lo.sum())} > n = {n}; lower min_size to at most "
            f"floor(n / k) = {n // k}."
        )
    return lo, hi


def check_k(k: Any, n: int, op: str) -> int:
    """The number of clusters as an int in ``[1, n]``."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"{op}: k must be an int, got {type(k).__name__} {k!r}.")
    k = int(k)
    if k < 1:
        raise ValueError(f"{op}: k must be >= 1, got {k}.")
    if k > n:
        raise ValueError(f"{op}: number of points (n={n}) must be at least the number of clusters (k={k}); lower k.")
    return k


def check_int(value: Any, name: str, minimum: int, op: str) -> int:
    """``value`` as an int ``>= minimum`` (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{op}: {name} must be an int >= {minimum}, got {value!r}.")
    return int(value)


def check_tol(tol: Any, op: str) -> float:
    """``tol`` as a finite float ``>= 0`` (NaN and Inf refused)."""
    if (isinstance(tol, bool) or not isinstance(tol, (int, float, np.integer, np.floating)) or not math.isfinite(tol)
            or tol < 0):
        raise ValueError(f"{op}: tol must be a finite float >= 0, got {tol!r}.")
    return float(tol)


def check_metric(metric: str, op: str) -> None:
    """Raise unless ``metric`` is one of :data:`METRICS`."""
    if metric not in METRICS:
        raise ValueError(f"{op}: metric must be one of {METRICS}, got {metric!r}.")


def times_pow2(a: Any, p: int) -> Any:
    """``a * 2**p`` for a numpy array or torch tensor, exact (in two steps, so neither factor over- or underflows).

    Keeps the dtype; the product is exact unless it leaves the dtype's normal range.
    """
    if p == 0:
        return a
    h = p // 2
    return (a * 2.0**h) * 2.0 ** (p - h)


@dataclass(frozen=True)
class DataScale:
    """How :func:`data_scale` maps the data into the working range: clustering runs on ``x * 2**-exponent``."""

    exponent: int = 0

    def down(self, a: Any) -> Any:
        """Caller's units -> working frame (``a * 2**-exponent``; the input itself when exponent is 0)."""
        return times_pow2(a, -self.exponent)

    def up(self, a: Any) -> Any:
        """Working frame -> caller's units, for coordinates (centroids)."""
        return times_pow2(a, self.exponent)

    def up_sq(self, a: Any) -> Any:
        """Working frame -> caller's units, for squared distances (distances, inertia, history)."""
        return times_pow2(a, 2 * self.exponent)


def data_scale(col_min: Any, col_max: Any, n: int, dtype: Any, spherical: bool, op: str, name: str = "x") -> DataScale:
    """The working frame of data whose per-column minima and maxima are ``col_min``/``col_max`` (float64 (d,)).

    Include explicit centroids (``init``, ``centroids``) in the minima and maxima: they are distances' other end.
    The exponent is 0 (no rescaling) when the largest ``|entry|`` M lies in ``[2**-SAFE_EXPONENT,
    2**SAFE_EXPONENT]``, else ``e`` with ``M * 2**-e`` in ``[0.5, 1)``. For ``metric="sqeuclidean"`` the accepted
    range is: the squared extent ``E = sum_j (max_j - min_j)**2`` (the largest possible squared distance) at most
    half the largest finite value of ``dtype``, and ``n * E`` (the largest possible inertia) at most half the largest
    float64; otherwise a ``ValueError`` names the range. Cosine distances lie in [0, 2]: any finite data are
    accepted. Distances below the dtype's smallest subnormal are reported as 0.
    """
    lo = np.asarray(col_min, dtype=np.float64)
    hi = np.asarray(col_max, dtype=np.float64)
    big = float(max(np.abs(lo).max(initial=0.0), np.abs(hi).max(initial=0.0)))
    e_m = math.frexp(big)[1] if big > 0 else 0
    exponent = 0 if -SAFE_EXPONENT <= e_m <= SAFE_EXPONENT else e_m
    if spherical or e_m <= 0:
        return DataScale(exponent)
    extent = float(np.square(times_pow2(hi, -e_m) - times_pow2(lo, -e_m)).sum())  # in units of 4**e_m, <= 4 d
    fmax = float(np.finfo(dtype).max)
    limit = math.ldexp(fmax / 2, -2 * e_m)
    inertia_limit = math.ldexp(float(np.finfo(np.float64).max) / 2, -2 * e_m)
    if extent > limit or extent * n > inertia_limit:
        true_extent = _scientific(extent, 2 * e_m)
        dt = np.dtype(dtype).name
        f64_half = float(np.finfo(np.float64).max) / 2
        raise ValueError(
            f"{op}: {name} is out of the accepted range: its squared extent sum_j (max_j - min_j)^2 = {true_extent} "
            f"(over n = {n} rows) would overflow the squared distances; the accepted range is squared extent <= "
            f"{fmax / 2:.3g} (half of {dt}'s largest value) and n * squared extent <= {f64_half:.3g} (float64, the "
            f"inertia). Divide {name} by a constant (the labels do not change)"
            + (" or pass float64." if dt == "float32" else ".")
        )
    return DataScale(exponent)


def column_range(a: Any) -> tuple[np.ndarray, np.ndarray]:
    """Per-column minima and maxima (float64 numpy) of a 2-D numpy array or torch tensor with at least one row."""
    if isinstance(a, torch.Tensor):
        return a.amin(dim=0).double().cpu().numpy(), a.amax(dim=0).double().cpu().numpy()
    return a.min(axis=0).astype(np.float64), a.max(axis=0).astype(np.float64)


def working_frame(col_min: Any, col_max: Any, n: int, dtype: Any, spherical: bool, op: str, name: str,
                  other: Any = None) -> tuple[DataScale, Any]:
    """:func:`data_scale` of data with these column ranges and explicit centroids ``other`` (float64, or None).

    Returns the scale and ``other`` in the working frame. Squared Euclidean: one frame for both (the centroids
    are the distances' other end, so they count in the range). Cosine: each is rescaled by its own power of two
    (a row's direction does not change), so large centroids never push small rows into underflow.
    """
    if other is not None and len(other):
        o_min, o_max = column_range(other)
        if spherical:
            other = data_scale(o_min, o_max, len(other), np.float64, True, op, name).down(other)
        else:
            col_min, col_max = np.minimum(col_min, o_min), np.maximum(col_max, o_max)
    scale = data_scale(col_min, col_max, n, dtype, spherical, op, name)
    return scale, (other if other is None or spherical else scale.down(other))


def _scientific(mantissa: float, p: int) -> str:
    """``mantissa * 2**p`` (``mantissa > 0``) in scientific notation, also beyond float64's range."""
    exp10 = math.log10(mantissa) + p * math.log10(2.0)
    whole = math.floor(exp10)
    return f"{10 ** (exp10 - whole):.3g}e{whole:+d}"
