"""The selection report (clusterlm.plan.report): the PCA map's coordinates, report_data.npz, report.png."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clusterlm.plan import Plan
from clusterlm.plan.report import MAX_MAP_POINTS, REPORT_DATA, REPORT_PNG, draw_report, pca_2d, save_report_data
from clusterlm.selection.allocation import selection_weights

PNG = b"\x89PNG\r\n\x1a\n"


# ---- pca_2d -----------------------------------------------------------------------------------------------


def test_pca_of_points_on_a_plane_recovers_their_coordinates():
    rng = np.random.default_rng(0)
    a, b = rng.normal(0, 10, 200), rng.normal(0, 1, 200)  # spread 10 along u, 1 along v
    a, b = a - a.mean(), b - b.mean()
    b -= (a @ b) / (a @ a) * a  # uncorrelated in the sample too: then u and v are exactly the components
    u = np.array([1.0, 2.0, 2.0, 0.0]) / 3
    v = np.array([2.0, -1.0, 0.0, 0.0]) / np.sqrt(5)
    x = 5.0 + np.outer(a, u) + np.outer(b, v)
    index, coords = pca_2d(x)
    assert index.tolist() == list(range(200)) and coords.dtype == np.float32 and coords.shape == (200, 2)
    # up to sign, the coordinates are the centred a and b
    for got, want in ((coords[:, 0], a), (coords[:, 1], b)):
        sign = np.sign(got @ want)
        np.testing.assert_allclose(sign * got, want, rtol=1e-4, atol=1e-4)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(3, 80), d=st.integers(2, 6), seed=st.integers(0, 2**31 - 1))
def test_pca_components_are_uncorrelated_sorted_and_keep_the_most_variance(n, d, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)) * rng.uniform(0.1, 5.0, d)
    _, coords = pca_2d(x)
    c = coords.astype(np.float64)
    assert abs(c.mean(0)).max() <= 1e-4 * max(1.0, abs(c).max())  # centred
    cov = c.T @ c
    scale = max(cov[0, 0], 1e-12)
    assert abs(cov[0, 1]) <= 1e-4 * scale and cov[0, 0] >= cov[1, 1] * (1 - 1e-5)
    centred = x - x.mean(0)
    top = np.sort(np.linalg.eigvalsh(centred.T @ centred))[::-1][:2]
    np.testing.assert_allclose(np.diag(cov), top, rtol=1e-3, atol=1e-6 * top[0])


def test_pca_subsamples_with_a_seed_and_keeps_signs_deterministic():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((50, 3)).astype(np.float32)
    index, coords = pca_2d(x, max_points=20, seed=3)
    again_index, again = pca_2d(x, max_points=20, seed=3)
    other_index, _ = pca_2d(x, max_points=20, seed=4)
    assert len(index) == 20 and index.dtype == np.int64 and (np.diff(index) > 0).all() and index.max() < 50
    assert index.tolist() == again_index.tolist() != other_index.tolist()
    np.testing.assert_array_equal(coords, again)
    # the sign rule fixes the axes (the covariance is the same for -x), so -x gives the mirrored map
    _, flipped = pca_2d(-x)
    np.testing.assert_allclose(flipped, -pca_2d(x)[1], rtol=1e-4, atol=1e-5)
    assert MAX_MAP_POINTS == 20_000


def test_pca_of_degenerate_inputs():
    index, coords = pca_2d(np.array([[1.0], [3.0], [5.0]]))  # one feature: it is the first coordinate
    assert index.tolist() == [0, 1, 2]
    np.testing.assert_allclose(coords, [[-2, 0], [0, 0], [2, 0]])
    _, one = pca_2d(np.array([[1.0, 2.0, 3.0]]))  # one point
    np.testing.assert_array_equal(one, [[0.0, 0.0]])


# ---- report_data.npz and report.png ---------------------------------------------------------------------


def _plan(n: int = 60) -> Plan:
    rng = np.random.default_rng(2)
    labels = np.arange(n) % 3
    picks = [rng.permutation(np.flatnonzero(labels == c))[: [6, 4, 2][c]] for c in range(3)]
    ranks = [np.concatenate([picks[0][:3], picks[1][:2], picks[2][:1]]),
             np.concatenate([picks[0][3:], picks[1][2:], picks[2][1:]])]
    lengths = rng.integers(5, 50, size=n)
    return Plan(world_size=2, rank_indices=ranks, weights=selection_weights(labels, np.concatenate(picks), 3),
                cluster_labels=labels, distances=rng.random(n), cluster_sizes=np.bincount(labels, minlength=3),
                lengths=lengths, fingerprint={"size": n, "sha256": hashlib.sha256(b"report").hexdigest()},
                model_id="tiny@0123456789ab", config={"method": "cluster", "preset": "default"})


def test_save_report_data_stores_the_map_beside_the_plan(tmp_path: Path):
    x = np.random.default_rng(0).standard_normal((30, 5))
    path = save_report_data(tmp_path, x, seed=1)
    assert path == tmp_path / REPORT_DATA
    index, coords = pca_2d(x, seed=1)
    with np.load(path, allow_pickle=False) as data:
        np.testing.assert_array_equal(data["index"], index)
        np.testing.assert_array_equal(data["coords"], coords)
    assert sorted(p.name for p in tmp_path.iterdir()) == [REPORT_DATA]  # no temporary file left


@pytest.mark.parametrize("with_map", [True, False])
def test_draw_report_draws_a_saved_plan_with_or_without_its_map(tmp_path: Path, with_map: bool):
    plan = _plan()
    plan.save(tmp_path)
    if with_map:
        save_report_data(tmp_path, np.random.default_rng(0).standard_normal((60, 4)))
    out = draw_report(tmp_path)  # the plan is loaded from the directory
    assert out == tmp_path / REPORT_PNG and out.read_bytes()[:8] == PNG
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # atomic: no temporary file left
    again = draw_report(tmp_path, plan)  # an already-loaded plan draws the same figure
    assert again == out and out.read_bytes()[:8] == PNG
