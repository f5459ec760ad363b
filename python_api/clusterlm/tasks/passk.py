"""The unbiased pass@k estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code", eq. 1).

With ``n`` samples of a problem of which ``c`` pass, ``pass@k = 1 - C(n - c, k) / C(n, k)``: the chance that at
least one of ``k`` samples drawn without replacement from the ``n`` passes. It is computed as the product
``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``, which neither overflows nor loses precision for large ``n``
(the binomials themselves grow past any float).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = ["mean_pass_at_k", "pass_at_k"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem with ``n`` samples, ``c`` of them correct.

    Raises:
        ValueError: not ``0 <= c <= n`` and ``1 <= k <= n``.
        TypeError: a value that is not an int.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"pass_at_k: {name} must be an int, got {value!r}.")
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k: expected 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}.")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    # 1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k / i)
    log_fail = math.fsum(math.log1p(-k / i) for i in range(n - c + 1, n + 1))
    return -math.expm1(log_fail)


def mean_pass_at_k(counts: Iterable[tuple[int, int]], ks: Sequence[int]) -> dict[int, float]:
    """The mean over problems of :func:`pass_at_k` for each ``k`` in ``ks``, from ``(n, c)`` per problem.

    Returns:
        ``{k: mean pass@k}``; a ``k`` larger than some problem's ``n`` is left out (it is not defined there); an
        empty ``counts`` gives NaN for every ``k``.
    """
    pairs = list(counts)
    out: dict[int, float] = {}
    for k in ks:
        if pairs and any(n < k for n, _ in pairs):
            continue
        out[k] = math.fsum(pass_at_k(n, c, k) for n, c in pairs) / len(pairs) if pairs else math.nan
    return out
