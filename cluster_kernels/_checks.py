"""Argument checks shared by the single-process and the distributed K-means (one message per mistake, everywhere).

Each check raises a ``TypeError``/``ValueError`` that names the operation and the argument, says what was
expected and what was given, and how to fix it.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import torch

METRICS = ("sqeuclidean", "cosine")


def check_matrix(x: Any, name: str, op: str) -> torch.Tensor:
    """``x`` as a 2-D finite float32/float64 tensor (a numpy array is wrapped, not copied)."""
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
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).any(dim=1).nonzero()[0, 0])
        raise ValueError(f"{op}: {name} contains NaN or Inf (first bad row: {bad}); remove or impute those rows.")
    return t


def size_bounds(value: Any, k: int, n: int, name: str, op: str, default: int) -> np.ndarray:
    """Per-cluster bound as an int64 (k,) array."""
    if value is None:
        return np.full(k, default, dtype=np.int64)
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
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
    """``tol`` as a float ``>= 0``."""
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or tol < 0:
        raise ValueError(f"{op}: tol must be a float >= 0, got {tol!r}.")
    return float(tol)


def check_metric(metric: str, op: str) -> None:
    """Raise unless ``metric`` is one of :data:`METRICS`."""
    if metric not in METRICS:
        raise ValueError(f"{op}: metric must be one of {METRICS}, got {metric!r}.")
