"""Selection budgets: how many examples (or tokens) a selection keeps, and cluster-size bounds.

``ratio`` / ``budget`` count examples, ``token_ratio`` / ``token_budget`` count tokens (default preset only);
:func:`count_for_tokens` turns a token budget into the per-cluster example count after clustering.
Errors are prefixed ``select:`` because :func:`clusterlm.selection.select.select` is where users meet them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "check_int",
    "cluster_size_bound",
    "count_for_tokens",
    "resolve_any_budget",
    "resolve_budget",
    "resolve_token_budget",
]


def check_int(value: Any, name: str, low: int = 1) -> int:
    """``value`` as an int >= ``low``; ValueError naming ``name`` otherwise (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"select: {name} must be an int >= {low}, got {value!r}.")
    return int(value)


def _is_fraction(value: object) -> bool:
    """A real number in (0, 1] (numpy scalars included, bools and NaN not)."""
    return (not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))
            and 0 < value <= 1)


def resolve_budget(n: int, ratio: float | None, budget: int | None) -> int:
    """Total number of examples requested: ``round(ratio * n)`` or ``budget``.

    Raises:
        ValueError: both or neither given, ratio outside (0, 1], budget outside [1, n].
    """
    if (ratio is None) == (budget is None):
        raise ValueError(
            f"select: give exactly one of ratio (fraction of the data) or budget (number of examples), got "
            f"ratio={ratio!r}, budget={budget!r}."
        )
    if ratio is not None:
        if not _is_fraction(ratio):
            raise ValueError(f"select: ratio must be in (0, 1], got {ratio!r}; e.g. ratio=0.31 keeps 31 %.")
        return max(1, round(float(ratio) * n))
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or not 1 <= budget <= n:
        raise ValueError(f"select: budget must be an int in [1, {n}] (the data set's size), got {budget!r}.")
    return int(budget)


def resolve_token_budget(lengths: np.ndarray, token_ratio: float | None, token_budget: int | None) -> int | None:
    """Tokens requested: ``round(token_ratio * sum(lengths))``, ``token_budget``, or None (an example budget).

    Raises:
        ValueError: both given, token_ratio outside (0, 1], token_budget outside [1, total tokens].
    """
    if token_ratio is None and token_budget is None:
        return None
    total = int(np.asarray(lengths, dtype=np.int64).sum())
    if token_ratio is not None and token_budget is not None:
        raise ValueError(
            f"select: give at most one of token_ratio and token_budget, got token_ratio={token_ratio!r}, "
            f"token_budget={token_budget!r}."
        )
    if token_ratio is not None:
        if not _is_fraction(token_ratio):
            raise ValueError(
                f"select: token_ratio must be in (0, 1], got {token_ratio!r}; e.g. token_ratio=0.31 keeps 31 % of "
                "the tokens."
            )
        return max(1, round(float(token_ratio) * total))
    if isinstance(token_budget, bool) or not isinstance(token_budget, (int, np.integer)) or not (
        1 <= token_budget <= total
    ):
        raise ValueError(
            f"select: token_budget must be an int in [1, {total}] (the data set's tokens), got {token_budget!r}."
        )
    return int(token_budget)


def resolve_any_budget(n: int, lengths: np.ndarray, ratio: Any, budget: Any, token_ratio: Any, token_budget: Any,
                        preset: str) -> int | None:
    """Check that exactly one budget is given; the token budget (None for an example budget)."""
    given = {k: v for k, v in (("ratio", ratio), ("budget", budget), ("token_ratio", token_ratio),
                               ("token_budget", token_budget)) if v is not None}
    if len(given) != 1:
        raise ValueError(
            "select: give exactly one of ratio / budget (examples) or token_ratio / token_budget (tokens), got "
            + (", ".join(f"{k}={v!r}" for k, v in given.items()) or "none")
            + "."
        )
    tokens = resolve_token_budget(lengths, token_ratio, token_budget)
    if tokens is None:
        resolve_budget(n, ratio, budget)
    elif preset == "paper":
        raise ValueError(
            "select: preset='paper' reproduces the authors' example count (int(smallest cluster * ratio)); a token "
            "budget is ours: use preset='default' with token_ratio/token_budget, or ratio with preset='paper'."
        )
    return tokens


def count_for_tokens(picks: Sequence[np.ndarray], lengths: np.ndarray, tokens: int) -> int:
    """The per-cluster count ``m`` whose first-``m`` picks of every cluster come closest to ``tokens`` in all.

    Every cluster gives the same ``m`` (equal counts per rank), so the total is met up to one example per
    cluster: ``m`` is the largest count whose total stays within the budget, or one more when that lands
    closer. Bounded by the smallest ``len(picks[c])`` and at least 1.
    """
    cap = min(len(p) for p in picks)
    assert cap >= 1, "an empty cluster; the caller enforces min sizes"
    # cum[m] = tokens of the first m picks of every cluster together.
    cum = np.zeros(cap + 1, dtype=np.int64)
    for p in picks:
        cum[1:] += np.cumsum(np.asarray(lengths, dtype=np.int64)[p[:cap]])
    m = int(np.searchsorted(cum, tokens, side="right")) - 1  # largest m with cum[m] <= tokens
    if m < cap and abs(int(cum[m + 1]) - tokens) < abs(tokens - int(cum[m])):
        m += 1
    return max(1, m)


def cluster_size_bound(value: Any, name: str, n: int, n_clusters: int, per_cluster: int) -> int | None:
    """``"1.5x"`` (times N / C), ``"budget"`` (the per-cluster pick), an int, or None."""
    if value is None:
        return None
    if isinstance(value, str):
        if value == "budget":
            return per_cluster
        if value.endswith("x"):
            try:
                factor = float(value[:-1])
            except ValueError:
                factor = -1.0
            if factor > 0:
                return math.ceil(factor * n / n_clusters)
        raise ValueError(
            f"select: {name} must be None, an int, 'budget' or a multiple of N / C such as '1.5x', got {value!r}."
        )
    return check_int(value, name, 0)
