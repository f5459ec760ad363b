"""Counter-based random projections keyed by ``(seed, layer name)``.

Maths. A projection ``P`` of shape ``(d, k)`` has i.i.d. entries with mean 0 and variance ``1/k``:
Rademacher ``+-1/sqrt(k)`` or Gaussian ``N(0, 1/k)``. Then ``E[P P^T] = I_d`` and for any vectors
``a, b``: ``E[<P^T a, P^T b>] = a^T E[P P^T] b = <a, b>`` (inner products, hence squared distances,
are preserved in expectation; Johnson-Lindenstrauss concentration around it). For the Kronecker
projection ``phi = P_out^T dW P_in`` of a gradient matrix, ``E[<phi_a, phi_b>_F] = <dW_a, dW_b>_F``.

Generator. Entry ``(i, j)`` is a pure function of ``(key, i, j)`` with
``key = blake2b(seed, name)`` and the 64-bit counter ``c = (i << 32) | j`` passed through the
SplitMix64 output function (``z = key + (c + 1) * gamma`` then the 64-bit finaliser; distinct
counters give distinct ``z`` because ``gamma`` is odd and the finaliser is a bijection). So:

- the matrix never depends on the device, the batch size or how rows are chunked: any block
  ``rows=(r0, r1)`` equals the same rows of the full matrix, bit for bit;
- bits are computed with numpy ``uint64`` arithmetic on the CPU (well-defined wrap-around) and the
  Gaussian transform in float64 there too, then cast and moved to the requested device, so a GPU and
  a CPU run see identical matrices;
- ``P(d, k)`` and ``P(d', k)`` share their first ``min(d, d')`` rows.

Gaussian entries use Box-Muller on the two 32-bit halves of the 64-bit word.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

__all__ = ["PROJECTION_KINDS", "projection_key", "random_projection"]

PROJECTION_KINDS = ("rademacher", "gaussian")

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_MAX_DIM = 1 << 32  # the counter packs (row, col) into 32 + 32 bits


def projection_key(seed: int, name: str) -> int:
    """The 64-bit generator key of ``(seed, name)`` (stable across Python versions and machines)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"random_projection: seed must be an int, got {type(seed).__name__}.")
    if not isinstance(name, str):
        raise TypeError(f"random_projection: name must be a str (e.g. a layer name), got {type(name).__name__}.")
    digest = hashlib.blake2b(f"{int(seed)}\x00{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _mix64(key: int, counters: np.ndarray) -> np.ndarray:
    """SplitMix64 output for each counter (uint64 in, uint64 out; wrap-around is intended)."""
    with np.errstate(over="ignore"):
        z = np.uint64(key) + (counters + np.uint64(1)) * _GAMMA
        z = (z ^ (z >> np.uint64(30))) * _MUL1
        z = (z ^ (z >> np.uint64(27))) * _MUL2
        return z ^ (z >> np.uint64(31))


def _check_dim(argname: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"random_projection: {argname} must be an int, got {type(value).__name__}.")
    if not 0 < int(value) < _MAX_DIM:
        raise ValueError(f"random_projection: {argname} must be in [1, 2**32), got {value}.")
    return int(value)


def random_projection(
    d: int,
    k: int,
    *,
    seed: int,
    name: str,
    kind: str = "rademacher",
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    rows: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Random projection matrix ``P`` (d, k) with ``E[P P^T] = I``, a pure function of ``(seed, name)``.

    Args:
        d: input dimension (rows), e.g. a layer's ``d_in`` or ``d_out``.
        k: projected dimension (columns).
        seed: integer seed.
        name: stream name, e.g. ``"model.layers.0.mlp.down_proj/in"``; different names give independent
            matrices.
        kind: ``"rademacher"`` (entries ``+-1/sqrt(k)``) or ``"gaussian"`` (``N(0, 1/k)``).
        device: where the result lives (default CPU); the values do not depend on it.
        dtype: floating dtype of the result (values are computed in float64, then cast).
        rows: optional ``(start, stop)``: only these rows of the full ``(d, k)`` matrix, bit-identical to
            slicing it (for generating a large projection in chunks).

    Returns:
        Tensor of shape ``(stop - start, k)`` (``(d, k)`` without ``rows``) and ``dtype`` on ``device``.

    Raises:
        TypeError: non-integer sizes or seed, non-string name, non-floating dtype.
        ValueError: unknown ``kind``, sizes out of range, ``rows`` outside ``[0, d]``.
    """
    d = _check_dim("d", d)
    k = _check_dim("k", k)
    if kind not in PROJECTION_KINDS:
        raise ValueError(f"random_projection: kind must be one of {PROJECTION_KINDS}, got {kind!r}.")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"random_projection: dtype must be a floating torch.dtype, got {dtype!r}.")
    start, stop = (0, d) if rows is None else (int(rows[0]), int(rows[1]))
    if not 0 <= start <= stop <= d:
        raise ValueError(f"random_projection: rows must satisfy 0 <= start <= stop <= d={d}, got {rows!r}.")
    key = projection_key(seed, name)
    row_idx = np.arange(start, stop, dtype=np.uint64)[:, None]
    col_idx = np.arange(k, dtype=np.uint64)[None, :]
    bits = _mix64(key, (row_idx << np.uint64(32)) | col_idx)
    if kind == "rademacher":
        sign = 1.0 - 2.0 * (bits >> np.uint64(63)).astype(np.float64)
        values = sign * (1.0 / math.sqrt(k))
    else:
        hi = (bits >> np.uint64(32)).astype(np.float64)
        lo = (bits & np.uint64(0xFFFFFFFF)).astype(np.float64)
        u1 = (hi + 1.0) * (1.0 / 4294967296.0)  # in (0, 1]: log is finite
        u2 = lo * (1.0 / 4294967296.0)
        values = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2) * (1.0 / math.sqrt(k))
    return torch.from_numpy(values).to(dtype=dtype, device=device)
