"""SelectConfig: one object for every selection setting, presets as data, validated in check() and resolve()."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clusterlm.config.selection import PRESETS, SelectConfig, resolve_feature_tokens, resolve_seed
from clusterlm.selection.features import DEFAULT_FEATURE_TOKENS
from clusterlm.selection.select import select_from_features


def test_the_config_is_frozen_and_overrides_name_unknown_settings():
    c = SelectConfig(world_size=2, ratio=0.3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.ratio = 0.5  # type: ignore[misc]
    assert c.replace(ratio=0.5).ratio == 0.5 and c.ratio == 0.3
    assert c.replace() is c
    with pytest.raises(TypeError, match=r"unknown setting\(s\) ratioo; the settings are .*world_size"):
        c.replace(ratioo=0.5)


def test_presets_are_data():
    paper, default = PRESETS["paper"], PRESETS["default"]
    assert (paper.seed, paper.n_init, paper.clustering, paper.features) == (42, 10, "authors", "paper")
    assert (default.seed, default.n_init, default.clustering, default.feature_tokens) == (0, 3, "exact",
                                                                                          DEFAULT_FEATURE_TOKENS)
    assert resolve_seed("paper", None) == 42 and resolve_seed("default", None) == 0 and resolve_seed("paper", 7) == 7
    assert resolve_feature_tokens("paper", None) is None and resolve_feature_tokens("default", "all") is None


def test_resolve_applies_the_preset_defaults():
    lengths = np.full(100, 10)
    d = SelectConfig(world_size=2, ratio=0.3).resolve(100, lengths)
    assert (d.n, d.n_clusters, d.seed, d.n_init, d.token_balance, d.clustering) == (100, 2, 0, 3, True, "exact")
    assert (d.per_cluster, d.requested, d.min_cluster_size, d.max_cluster_size) == (15, 30, 15, 75)
    p = SelectConfig(world_size=4, ratio=0.31, preset="paper").resolve(100, lengths)
    assert (p.seed, p.n_init, p.token_balance, p.normalize, p.percentage, p.max_cluster_size) == (
        42, 10, False, True, 31, 38)


@pytest.mark.parametrize("setting, match", [
    ({"within_cluster": "median"}, "within_cluster must be one of"),
    ({"preset": "fancy"}, "preset must be one of"),
    ({"world_size": None}, "world_size is required"),
    ({"ratio": 0.3, "budget": 10}, "exactly one of"),
    ({"preset": "paper", "allocation": "stratified"}, "fixes allocation"),
    ({"preset": "paper", "feature_tokens": 32}, "featurizes whole examples"),
    ({"max_iter": 0}, "max_iter must be an int >= 1"),
])
def test_check_refuses_without_data(setting, match):
    config = SelectConfig(world_size=2, ratio=0.3).replace(**setting)
    with pytest.raises(ValueError, match=match):
        config.check()


def test_resolve_refuses_what_needs_the_data():
    with pytest.raises(ValueError, match="cannot fill 8 clusters"):
        SelectConfig(world_size=8, ratio=0.5).resolve(5)
    with pytest.raises(ValueError, match="budget must be an int in"):
        SelectConfig(world_size=2, budget=500).resolve(100)
    with pytest.raises(ValueError, match="the data set is empty"):
        SelectConfig(world_size=2, ratio=0.5).resolve(0)


def test_settings_resolved_for_other_features_are_refused():
    x = np.random.default_rng(0).normal(size=(60, 4))
    config = SelectConfig(world_size=2, ratio=0.5)
    with pytest.raises(ValueError, match="resolved for 50 examples, the features have 60 rows"):
        select_from_features(x, config, resolved=config.resolve(50))


@settings(max_examples=5, deadline=None)
@given(ratio=st.floats(0.05, 1.0), world_size=st.integers(1, 6), seed=st.integers(0, 3))
def test_a_config_and_keyword_overrides_give_the_same_plan(ratio, world_size, seed):
    x = np.random.default_rng(seed).normal(size=(120, 5))
    by_config = select_from_features(x, SelectConfig(world_size=world_size, ratio=ratio, seed=seed, n_init=1))
    by_keywords = select_from_features(x, world_size=world_size, ratio=ratio, seed=seed, n_init=1)
    for r in range(world_size):
        np.testing.assert_array_equal(by_config.indices(r), by_keywords.indices(r))
    assert by_config.config == by_keywords.config
