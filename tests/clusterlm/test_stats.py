"""Known answers of the two-level bootstrap (:mod:`clusterlm.comparison.bootstrap`) on synthetic per-example losses."""

from __future__ import annotations

import numpy as np
import pytest

from clusterlm.comparison.bootstrap import bootstrap_delta, interval_text, run_loss, seeds_to_resolve


def _runs(n_seeds: int, n_ex: int, seed: int, spread: float = 0.05):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(5, 40, size=n_ex).astype(np.float64)
    per_token = 1.5 + rng.normal(0, 0.3, size=n_ex)[None, :] + rng.normal(0, spread, size=(n_seeds, 1))
    return per_token * tokens, np.broadcast_to(tokens, (n_seeds, n_ex)).copy()


def test_identical_runs_give_a_zero_width_interval_at_zero():
    s, t = _runs(3, 50, 0)
    d = bootstrap_delta(s, t, s.copy(), t.copy(), seeds_a=[0, 1, 2], seeds_b=[0, 1, 2], n_boot=300)
    assert d.delta == 0 and d.low == 0 and d.high == 0 and d.paired and not d.distinguishable
    assert d.seed_var == 0 and d.eval_var == 0


def test_a_constant_shift_is_recovered_exactly():
    s, t = _runs(3, 60, 1)
    d = bootstrap_delta(s + 0.02 * t, t, s, t, seeds_a=[0, 1, 2], seeds_b=[0, 1, 2], n_boot=300)
    assert d.delta == pytest.approx(0.02) and d.low == pytest.approx(0.02) and d.high == pytest.approx(0.02)
    assert d.distinguishable and "+0.0200 [+0.0200, +0.0200]" == interval_text(d)


def test_pairing_matches_rows_by_seed_and_unpaired_intervals_cover_seed_noise():
    s, t = _runs(4, 80, 2, spread=0.05)
    # B holds the same seeds in another row order: paired, and the shift is still exact
    order = [2, 0, 3, 1]
    d = bootstrap_delta(s + 0.01 * t, t, s[order], t[order], seeds_a=[0, 1, 2, 3], seeds_b=[2, 0, 3, 1], n_boot=200)
    assert d.paired and d.low == pytest.approx(0.01) and d.high == pytest.approx(0.01)
    # other seeds: unpaired; the seed noise widens the interval, which still covers the true difference 0
    s2, t2 = _runs(4, 80, 3, spread=0.05)
    u = bootstrap_delta(s, t, s2[:, :80], t2, seeds_a=[0, 1, 2, 3], seeds_b=[4, 5, 6, 7], n_boot=500)
    assert not u.paired and u.high - u.low > 0.01 and u.seed_var > 0 and u.eval_var > 0


def test_deterministic_under_seed_and_checks_shapes():
    s, t = _runs(2, 30, 4)
    s2, _ = _runs(2, 30, 5)
    one = bootstrap_delta(s, t, s2, t, n_boot=100, seed=7)
    assert one == bootstrap_delta(s, t, s2, t, n_boot=100, seed=7)
    assert one.low <= one.delta <= one.high
    with pytest.raises(ValueError, match="same examples"):
        bootstrap_delta(s, t, s2[:, :10], t[:, :10])
    with pytest.raises(ValueError, match="n_boot"):
        bootstrap_delta(s, t, s2, t, n_boot=0)
    assert run_loss(s, t) == pytest.approx(s.sum(1) / t.sum(1))


def test_seeds_to_resolve_follows_the_variances():
    s, t = _runs(3, 400, 6, spread=0.05)
    rng = np.random.default_rng(9)
    s2 = s + (rng.normal(0, 0.04, (3, 1)) + rng.normal(0, 0.05, (1, 400))) * t  # seed and per-example differences
    d = bootstrap_delta(s, t, s2, t, seeds_a=[0, 1, 2],
                        seeds_b=[0, 1, 2], n_boot=200)
    n = seeds_to_resolve(d, 1.5)
    room = (0.015 / 1.959963984540054) ** 2 - d.eval_var
    assert d.eval_var > 0 and room > 0 and n == max(2, int(np.ceil(d.seed_var / room)))
    assert seeds_to_resolve(d, 1.5, fraction=1e-6) is None  # the evaluation set alone is too small
    one = bootstrap_delta(s[:1], t[:1], s2[:1], t[:1], n_boot=50)
    assert np.isnan(one.seed_var) and seeds_to_resolve(one, 1.5) is None
