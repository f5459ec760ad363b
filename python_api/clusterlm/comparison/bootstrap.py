"""Differences of held-out loss with 95 % intervals: a two-level bootstrap over seeds and evaluation examples.

A method's held-out loss is the mean over its seeds of the token-weighted answer loss on one evaluation set:
``L = mean_s sum_i S[s, i] / sum_i T[s, i]`` with ``S[s, i]`` the summed token loss of evaluation example ``i``
in the run with seed ``s`` and ``T[s, i]`` its answer tokens. Two sources of chance move ``L``: the training seed
(which examples a method draws, initialisation, data order) and the evaluation sample (another set of held-out
examples from the same distribution would give another number). :func:`bootstrap_delta` resamples both, in two
levels, ``n_boot`` times:

1. the seeds, with replacement (``n_seeds`` of them). When both methods ran the same seeds the draw is shared
   (*paired*: seed ``s`` of one method is compared with seed ``s`` of the other; their trainer runs share the
   seed's data order and initialisation, so their chance parts partly cancel); otherwise each method's seeds are
   drawn on their own;
2. the evaluation examples, with replacement, one draw per replicate shared by every seed and both methods
   (every run is evaluated on the same examples, so the example draw is paired too).

The interval is the 2.5 and 97.5 percentiles of the replicated difference. Known answers: identical runs give
the zero-width interval [0, 0]; a constant shift ``c`` of every example's loss gives [c, c].

:func:`seeds_to_resolve` turns the measured variances into the number of seeds per method at which the
interval's half-width would come down to a given fraction (1 %) of the reference loss; the evaluation-sample
part does not shrink with seeds, so the answer is None when that part alone is wider.

Pure numpy and deterministic under ``seed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Delta", "Z95", "bootstrap_delta", "bootstrap_loss", "interval_text", "run_loss", "seeds_to_resolve"]

Z95 = 1.959963984540054  # the two-sided 95 % normal quantile
_CHUNK = 256  # replicates per block (bounds the (replicates, examples) count matrix)


@dataclass(frozen=True)
class Delta:
    """The difference ``A - B`` of two methods' held-out loss, with its bootstrap interval.

    Attributes:
        delta: the measured difference (mean over A's seeds minus mean over B's seeds).
        low / high: the 95 % interval (2.5 and 97.5 percentiles of the bootstrap replicates).
        paired: the seeds were resampled together (both methods ran the same seeds).
        seed_var: variance of the difference per seed (paired: of the per-seed differences; else the sum of both
            methods' per-seed variances), ddof 1; nan with one seed on either side.
        eval_var: variance of the difference from the evaluation sample alone (seeds fixed).
        n_seeds: seeds of A (= of B when paired).
        n_examples: evaluation examples resampled.
    """

    delta: float
    low: float
    high: float
    paired: bool
    seed_var: float
    eval_var: float
    n_seeds: int
    n_examples: int = 1

    @property
    def distinguishable(self) -> bool:
        """The interval excludes 0."""
        return self.low > 0 or self.high < 0


def run_loss(loss_sums: Any, tokens: Any) -> np.ndarray:
    """Token-weighted loss of every run: ``sum_i S[s, i] / sum_i T[s, i]`` for (runs, examples) arrays."""
    s, t = _as_2d(loss_sums, "loss_sums"), _as_2d(tokens, "tokens")
    return s.sum(axis=1) / t.sum(axis=1)


def _as_2d(x: Any, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] < 1:
        raise ValueError(f"stats: {name} must be a (seeds, examples) array with at least one of each, got shape "
                         f"{a.shape}.")
    return a


def _check_pair(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> None:
    if a[0].shape != a[1].shape or b[0].shape != b[1].shape:
        raise ValueError(f"stats: loss sums and tokens must have the same shape, got {a[0].shape} / {a[1].shape} "
                         f"and {b[0].shape} / {b[1].shape}.")
    if a[0].shape[1] != b[0].shape[1]:
        raise ValueError(f"stats: both methods must be evaluated on the same examples, got {a[0].shape[1]} and "
                         f"{b[0].shape[1]}; evaluate every method on one evaluation set.")
    if (a[1].sum(axis=1) <= 0).any() or (b[1].sum(axis=1) <= 0).any():
        raise ValueError("stats: a run has no answer tokens in its evaluation set; its loss is undefined.")


def _replicate_losses(s: np.ndarray, t: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """(seeds, replicates) token-weighted losses under example multiplicities ``counts`` (replicates, examples)."""
    den = t @ counts.T
    return (s @ counts.T) / np.where(den > 0, den, np.nan)


def bootstrap_delta(loss_sums_a: Any, tokens_a: Any, loss_sums_b: Any, tokens_b: Any, *, seeds_a: Any = None,
                    seeds_b: Any = None, n_boot: int = 2000, seed: int = 0) -> Delta:
    """The difference ``A - B`` of held-out loss with a two-level (seeds, then examples) bootstrap interval.

    Args:
        loss_sums_a / tokens_a: (seeds of A, examples) summed token loss and answer tokens of every example.
        loss_sums_b / tokens_b: the same for B, on the same examples (same column order).
        seeds_a / seeds_b: the seed of every row; when both are given and hold the same seeds, rows are matched by
            seed and the seed draw is paired. None: unpaired.
        n_boot: bootstrap replicates.
        seed: seeds the resampling (the result is a pure function of the inputs and ``seed``).

    Returns:
        The :class:`Delta`.

    Raises:
        ValueError: shapes that do not match, a run without answer tokens, ``n_boot < 1``.
    """
    a = (_as_2d(loss_sums_a, "loss_sums_a"), _as_2d(tokens_a, "tokens_a"))
    b = (_as_2d(loss_sums_b, "loss_sums_b"), _as_2d(tokens_b, "tokens_b"))
    _check_pair(a, b)
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 1:
        raise ValueError(f"stats: n_boot must be an int >= 1, got {n_boot!r}.")
    paired = seeds_a is not None and seeds_b is not None and sorted(seeds_a) == sorted(seeds_b)
    if paired:
        order = [list(seeds_b).index(s) for s in seeds_a]  # B's rows in A's seed order
        b = (b[0][order], b[1][order])
    la, lb = run_loss(*a), run_loss(*b)
    delta = float(la.mean() - lb.mean())
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xB007]))
    n_ex, na, nb = a[0].shape[1], a[0].shape[0], b[0].shape[0]
    reps, eval_only = [], []
    for start in range(0, n_boot, _CHUNK):
        m = min(_CHUNK, n_boot - start)
        counts = rng.multinomial(n_ex, np.full(n_ex, 1.0 / n_ex), size=m).astype(np.float64)
        ra, rb = _replicate_losses(*a, counts), _replicate_losses(*b, counts)  # (seeds, m)
        ja = rng.integers(0, na, size=(m, na))
        jb = ja if paired else rng.integers(0, nb, size=(m, nb))
        cols = np.arange(m)[:, None]
        reps.append(ra.T[cols, ja].mean(axis=1) - rb.T[cols, jb].mean(axis=1))
        eval_only.append(ra.mean(axis=0) - rb.mean(axis=0))
    rep, ev = np.concatenate(reps), np.concatenate(eval_only)
    low, high = (float(v) for v in np.nanpercentile(rep, [2.5, 97.5]))
    if paired:
        seed_var = float(np.var(la - lb, ddof=1)) if na > 1 else math.nan
    else:
        seed_var = float(np.var(la, ddof=1) + np.var(lb, ddof=1)) if na > 1 and nb > 1 else math.nan
    return Delta(delta=delta, low=low, high=high, paired=paired, seed_var=seed_var,
                 eval_var=float(np.nanvar(ev)), n_seeds=na, n_examples=n_ex)


def bootstrap_loss(loss_sums: Any, tokens: Any, *, n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """One method's held-out loss (mean over seeds) with its two-level bootstrap 95 % interval.

    Returns:
        ``(loss, low, high)``.
    """
    s = _as_2d(loss_sums, "loss_sums")
    zero = np.zeros((1, s.shape[1]))  # a reference of loss 0 on the same examples: the difference is the loss
    d = bootstrap_delta(s, tokens, zero, zero + 1.0, n_boot=n_boot, seed=seed)
    return d.delta, d.low, d.high


def seeds_to_resolve(d: Delta, reference_loss: float, fraction: float = 0.01) -> int | None:
    """Seeds per method at which the 95 % interval's half-width would be ``fraction`` of ``reference_loss``.

    The half-width is modelled as ``Z95 * sqrt(seed_var / n + eval_var)``: the seed part shrinks with ``n``
    seeds, the evaluation-sample part does not.

    Returns:
        The count (at least 2), or None when it cannot be told (one seed: no seed variance measured) or no
        number of seeds is enough (the evaluation set alone is too small: the fix is more evaluation examples).
    """
    if not math.isfinite(d.seed_var) or not math.isfinite(reference_loss) or reference_loss <= 0:
        return None
    room = (fraction * reference_loss / Z95) ** 2 - d.eval_var
    if room <= 0:
        return None
    return max(2, math.ceil(d.seed_var / room))


def interval_text(d: Delta, digits: int = 4) -> str:
    """``-0.0005 [-0.0210, +0.0200]``."""
    return f"{d.delta:+.{digits}f} [{d.low:+.{digits}f}, {d.high:+.{digits}f}]"

