"""Selection: exact budgets, weights, within-cluster picks, the paper preset, allocation, determinism (through
select / select_from_features; the picking and allocation functions alone: test_picking.py, test_allocation.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster_kernels import capacity_kmeans
from clusterlm.selection.select import select, select_from_features


def _mixture(n: int, d: int = 8, k: int = 4, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((k, d)) * 3
    comp = rng.choice(k, size=n, p=rng.dirichlet(np.ones(k) * 2))
    return (centers[comp] + rng.standard_normal((n, d))).astype(np.float32)


def _lengths(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + 1).integers(8, 400, size=n).astype(np.int64)


def _check_plan_invariants(plan, n: int, world_size: int) -> None:
    per_rank = [len(r) for r in plan.rank_indices]
    assert len(set(per_rank)) == 1, per_rank
    allidx = np.concatenate(plan.rank_indices)
    assert len(np.unique(allidx)) == len(allidx)
    assert allidx.min() >= 0 and allidx.max() < n
    sel = plan.weights > 0
    assert sel.sum() == len(allidx) and sel[allidx].all()
    assert plan.weights[allidx].mean() == pytest.approx(1.0, rel=1e-12)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(40, 400),
    world_size=st.integers(1, 5),
    ratio=st.floats(0.05, 1.0),
    clusters_per_rank=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_default_preset_meets_budget_exactly(n, world_size, ratio, clusters_per_rank, seed):
    n_clusters = world_size * clusters_per_rank
    requested = max(1, round(ratio * n))
    if requested < n_clusters or n < n_clusters:
        return
    x = _mixture(n, seed=seed)
    plan = select_from_features(x, world_size=world_size, ratio=ratio, lengths=_lengths(n, seed), seed=seed,
                                clusters_per_rank=clusters_per_rank)
    _check_plan_invariants(plan, n, world_size)
    per_cluster = requested // n_clusters
    assert plan.n_selected == per_cluster * n_clusters
    assert requested - plan.n_selected < n_clusters  # "exact up to world_size rounding"
    assert (plan.cluster_sizes >= per_cluster).all()
    assert plan.cluster_sizes.max() <= math.ceil(1.5 * n / n_clusters)
    # every rank trains on whole clusters
    for r in plan.rank_indices:
        assert len(np.unique(plan.cluster_labels[r])) == clusters_per_rank


def test_budget_argument_is_exact_when_divisible():
    x = _mixture(300)
    plan = select_from_features(x, world_size=3, budget=90)
    assert plan.n_selected == 90 and [len(r) for r in plan.rank_indices] == [30, 30, 30]
    assert "rounding" not in plan.stats
    plan = select_from_features(x, world_size=4, budget=90)
    assert plan.n_selected == 88 and "88 selected" in plan.stats["rounding"]


def test_weights_are_k_nk_over_n_for_cluster_per_rank():
    n, k = 500, 4
    plan = select_from_features(_mixture(n), world_size=k, ratio=0.3, lengths=_lengths(n))
    for rank, idx in enumerate(plan.rank_indices):
        (cluster,) = np.unique(plan.cluster_labels[idx])
        n_k = int((plan.cluster_labels == cluster).sum())
        assert plan.cluster_sizes[cluster] == n_k
        np.testing.assert_allclose(plan.weights[idx], k * n_k / n, rtol=1e-12)
        assert cluster == rank  # one cluster per rank: cluster k -> rank k


def test_farthest_matches_brute_force():
    n = 240
    x = _mixture(n, seed=3)
    plan = select_from_features(x, world_size=3, ratio=0.25, seed=5)
    km = capacity_kmeans(x, 3, min_size=plan.stats["per_cluster"], max_size=math.ceil(1.5 * n / 3), n_init=3, seed=5)
    np.testing.assert_array_equal(plan.cluster_labels, km.labels)
    for c in range(3):
        members = np.flatnonzero(km.labels == c)
        d = ((x[members].astype(np.float64) - km.centroids[c].astype(np.float64)) ** 2).sum(1)
        brute = set(members[np.argsort(-d, kind="stable")[: plan.stats["per_cluster"]]].tolist())
        got = set(np.flatnonzero((plan.weights > 0) & (plan.cluster_labels == c)).tolist())
        assert got == brute


def _paper_reimplementation(x: np.ndarray, k: int, ratio: float, seed: int):
    """The paper preset's steps on this library's exact capacity K-means (``clustering="exact"``), written out."""
    n = len(x)
    xn = x / np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True) if k > 1 else x
    km = capacity_kmeans(xn.astype(np.float32), k, max_size=math.ceil(1.5 * n / k), n_init=10, seed=seed)
    sizes = np.bincount(km.labels, minlength=k)
    m = int(sizes.min() * ratio)
    picks, weights = [], np.zeros(n)
    for c in range(k):
        members = np.flatnonzero(km.labels == c)
        order = sorted(members.tolist(), key=lambda i: (-float(km.distances[i]), i))
        picks.append(np.array(order[:m]))
        weights[order[:m]] = k * sizes[c] / n
    return picks, weights, km.labels


def test_paper_preset_exact_clustering_matches_direct_reimplementation():
    # The authors' own K-means (the default, clustering="authors") is tested in test_paper_preset.py.
    x = _mixture(400, d=16, k=3, seed=7) * 5.0
    plan = select_from_features(x, world_size=3, ratio=0.31, preset="paper", seed=2, clustering="exact")
    picks, weights, labels = _paper_reimplementation(x, 3, 0.31, seed=2)
    np.testing.assert_array_equal(plan.cluster_labels, labels)
    for rank in range(3):
        assert sorted(plan.rank_indices[rank].tolist()) == sorted(picks[rank].tolist())
    np.testing.assert_allclose(plan.weights, weights, rtol=1e-12)
    assert plan.n_selected < round(0.31 * 400) and "paper preset" in plan.stats["rounding"]


def test_paper_preset_refuses_overrides():
    with pytest.raises(ValueError, match="fixes allocation"):
        select_from_features(_mixture(100), world_size=2, ratio=0.3, preset="paper", allocation="stratified")


def test_stratified_allocation_gives_every_rank_every_cluster():
    n = 600
    plan = select_from_features(_mixture(n, k=3), world_size=2, ratio=0.3, clusters_per_rank=2,
                                allocation="stratified", lengths=_lengths(n))
    _check_plan_invariants(plan, n, 2)
    counts = np.stack([np.bincount(plan.cluster_labels[r], minlength=4) for r in plan.rank_indices])
    assert (np.abs(counts[0] - counts[1]) <= 1).all()
    assert (counts > 0).all()


def test_deterministic_under_seed_and_seed_matters():
    x = _mixture(300, seed=1)
    a = select_from_features(x, world_size=3, ratio=0.2, seed=4, lengths=_lengths(300))
    b = select_from_features(x, world_size=3, ratio=0.2, seed=4, lengths=_lengths(300))
    for ra, rb in zip(a.rank_indices, b.rank_indices, strict=True):
        np.testing.assert_array_equal(ra, rb)
    np.testing.assert_array_equal(a.weights, b.weights)
    c = select_from_features(x, world_size=3, ratio=0.2, seed=5, lengths=_lengths(300), within_cluster="random")
    assert any(not np.array_equal(ra, rc) for ra, rc in zip(a.rank_indices, c.rank_indices, strict=True))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ratio": 0.3, "budget": 10}, "exactly one of ratio"),
        ({"ratio": 1.5}, "ratio must be in"),
        ({"budget": 1000}, "budget must be an int"),
        ({"ratio": 0.01}, "less than one example"),
        ({"ratio": 0.3, "within_cluster": "closest"}, "within_cluster must be one of"),
        ({"ratio": 0.3, "max_cluster_size": "big"}, "max_cluster_size must be"),
        ({"ratio": 0.3, "preset": "fast"}, "preset must be one of"),
    ],
)
def test_errors_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        select_from_features(_mixture(100), world_size=4, **kwargs)


def _tiny_llama_and_examples(n: int, lengths: tuple[int, int], prompt_div: int, *, vocab: int, hidden: int,
                             positions: int, seed: int):
    """A random one-layer Llama and ``n`` random examples whose first ``1/prompt_div`` is prompt."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                   max_position_embeddings=positions, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(n):
        t = int(rng.integers(*lengths))
        ids = rng.integers(0, vocab, size=t).astype(np.int64)
        labels = ids.copy()
        labels[: t // prompt_div] = -100
        data.append({"input_ids": ids, "labels": labels})
    return model, data


def test_select_end_to_end_with_a_tiny_model(tmp_path):
    model, data = _tiny_llama_and_examples(64, (6, 30), 2, vocab=97, hidden=32, positions=64, seed=0)
    plan, feats = select(model, data, world_size=2, ratio=0.25, dim=16, progress=False, return_features=True)
    assert feats.shape == (64, 16)
    _check_plan_invariants(plan, 64, 2)
    assert plan.n_selected == 16 and set(plan.timings) >= {"features", "kmeans", "picks", "total"}
    plan.save(tmp_path / "plan")
    from clusterlm.plan import Plan

    loaded = Plan.load(tmp_path / "plan")
    loaded.verify(data, world_size=2)
    with pytest.raises(ValueError, match="world size"):
        loaded.verify(data, world_size=4)
    data[3] = {"input_ids": data[3]["input_ids"][:-1], "labels": data[3]["labels"][:-1]}
    with pytest.raises(ValueError):
        loaded.verify(data)
    again = select(model, [dict(d) for d in data], world_size=2, ratio=0.25, dim=16, progress=False)
    assert again.fingerprint != plan.fingerprint


def test_default_preset_token_balance_evens_rank_totals():
    n = 1200
    x = _mixture(n, k=2, seed=11)
    lengths = np.where(x[:, 0] > np.median(x[:, 0]), 300, 100) + _lengths(n) // 10  # length tied to a cluster
    plain = select_from_features(x, world_size=2, ratio=0.3, lengths=lengths, token_balance_slack=0.0)
    balanced = select_from_features(x, world_size=2, ratio=0.3, lengths=lengths)
    assert (balanced.stats["token_balance"]["rank_tokens_max_over_mean"]
            < plain.stats["token_balance"]["rank_tokens_max_over_mean"])
    np.testing.assert_array_equal(np.bincount(balanced.cluster_labels[balanced.weights > 0]),
                                  np.bincount(plain.cluster_labels[plain.weights > 0]))


def test_feature_tokens_resolve_per_preset():
    from clusterlm.config.selection import resolve_feature_tokens
    from clusterlm.selection.features import DEFAULT_FEATURE_TOKENS

    assert resolve_feature_tokens("default", None) == DEFAULT_FEATURE_TOKENS
    assert resolve_feature_tokens("paper", None) is None
    assert resolve_feature_tokens("default", "all") is None and resolve_feature_tokens("paper", "all") is None
    assert resolve_feature_tokens("default", 7) == 7
    with pytest.raises(ValueError, match="preset='paper' featurizes whole examples"):
        resolve_feature_tokens("paper", 64)
    for bad in (1, 0, 3.5, True, "some"):
        with pytest.raises(ValueError, match="feature_tokens must be"):
            resolve_feature_tokens("default", bad)


def test_select_records_the_feature_window_and_all_means_whole_examples():
    model, data = _tiny_llama_and_examples(24, (20, 90), 3, vocab=53, hidden=16, positions=128, seed=2)
    windowed, fw = select(model, data, world_size=2, ratio=0.5, dim=8, progress=False, return_features=True)
    whole, fa = select(model, data, world_size=2, ratio=0.5, dim=8, feature_tokens="all", progress=False,
                       return_features=True)
    assert windowed.config["features"]["max_tokens"] == 64 and whole.config["features"]["max_tokens"] is None
    long = [i for i, d in enumerate(data) if len(d["input_ids"]) > 64]
    short = [i for i, d in enumerate(data) if len(d["input_ids"]) <= 64]
    assert long and short
    np.testing.assert_allclose(fw[short], fa[short], atol=1e-6)
    assert np.abs(fw[long] - fa[long]).max() > 1e-3


# ---------------------------------------------------------------------------------------------------
# Token budget
# ---------------------------------------------------------------------------------------------------


def _farthest_prefix_tokens(plan, lengths: np.ndarray, n_clusters: int) -> np.ndarray:
    """tokens[m] = tokens of the m farthest members of every cluster together (ties by index), by brute force."""
    cap = int(plan.cluster_sizes.min())
    out = np.zeros(cap + 1, dtype=np.int64)
    for c in range(n_clusters):
        members = np.flatnonzero(plan.cluster_labels == c)
        order = sorted(members.tolist(), key=lambda i: (-plan.distances[i], i))
        out[1:] += np.cumsum(lengths[order[:cap]])
    return out


@settings(max_examples=20, deadline=None)
@given(n=st.integers(60, 300), world_size=st.integers(1, 4), token_ratio=st.floats(0.05, 0.9),
       seed=st.integers(0, 2**16))
def test_token_budget_is_met_up_to_one_example_per_cluster(n, world_size, token_ratio, seed):
    lengths = _lengths(n, seed)
    x = _mixture(n, seed=seed)
    target = round(token_ratio * int(lengths.sum()))
    if round(target / lengths.mean()) < world_size:
        return
    # Without token balancing the picks are the pure farthest-first prefixes: check the count exactly.
    plan = select_from_features(x, world_size=world_size, lengths=lengths, token_ratio=token_ratio, seed=seed,
                                token_balance_slack=0.0)
    _check_plan_invariants(plan, n, world_size)
    m = plan.stats["per_cluster"]
    tokens = _farthest_prefix_tokens(plan, lengths, world_size)
    got = int(lengths[np.concatenate(plan.rank_indices)].sum())
    assert got == tokens[m] == plan.stats["token_budget"]["selected_tokens"]
    assert plan.stats["token_budget"]["requested_tokens"] == target
    if m < len(tokens) - 1:  # the count is the closest of "largest within budget" and one more
        below = int(np.searchsorted(tokens, target, side="right")) - 1
        best = min((below, below + 1), key=lambda k: (abs(int(tokens[min(k, len(tokens) - 1)]) - target), k))
        assert m == max(1, best)
    # weights keep their meaning: K n_k / N for one cluster per rank
    for idx in plan.rank_indices:
        k = plan.cluster_labels[idx[0]]
        assert (plan.cluster_labels[idx] == k).all()
        assert np.allclose(plan.weights[idx], world_size * plan.cluster_sizes[k] / n)
    assert plan.config["token_ratio"] == pytest.approx(token_ratio)


def test_token_budget_with_balancing_keeps_equal_ranks_and_is_deterministic(tmp_path):
    n, lengths = 800, _lengths(800, 3)
    x = _mixture(n, seed=3)
    a = select_from_features(x, world_size=4, lengths=lengths, token_ratio=0.31, seed=5)
    b = select_from_features(x, world_size=4, lengths=lengths, token_ratio=0.31, seed=5)
    _check_plan_invariants(a, n, 4)
    assert all(np.array_equal(p, q) for p, q in zip(a.rank_indices, b.rank_indices, strict=True))
    assert np.array_equal(a.weights, b.weights)
    stats = a.stats["token_budget"]
    # Balancing swaps a few picks: the total stays within one example per cluster of the budget.
    assert abs(stats["selected_tokens"] - stats["requested_tokens"]) <= 4 * lengths.max()
    assert abs(stats["relative_error"]) < 0.05
    pure = select_from_features(x, world_size=4, lengths=lengths, token_ratio=0.31, seed=5, token_balance_slack=0.0)
    spread = a.stats["token_balance"]["rank_tokens_max_over_mean"]
    assert spread <= pure.stats["token_balance"]["rank_tokens_max_over_mean"] + 1e-12
    assert f"token budget: {stats['selected_tokens']:,} of {stats['requested_tokens']:,}" in a.summary()
    a.save(tmp_path / "plan")
    loaded = type(a).load(tmp_path / "plan")
    assert loaded.stats["token_budget"] == stats and loaded.config["token_ratio"] == pytest.approx(0.31)
    # token_budget (a count) equals the same budget given as a ratio
    c = select_from_features(x, world_size=4, lengths=lengths, token_budget=stats["requested_tokens"], seed=5)
    assert all(np.array_equal(p, q) for p, q in zip(a.rank_indices, c.rank_indices, strict=True))


def test_token_budget_buys_fewer_examples_when_picks_are_long():
    # Far-from-centroid members are made long: the same share of tokens is fewer examples than of examples.
    n = 600
    x = _mixture(n, seed=11)
    rough = select_from_features(x, world_size=2, ratio=0.31, seed=0)
    lengths = np.full(n, 50, dtype=np.int64)
    for c in range(2):  # the far half of every cluster is long
        members = rough.cluster_labels == c
        lengths[members & (rough.distances > np.median(rough.distances[members]))] = 300
    by_examples = select_from_features(x, world_size=2, lengths=lengths, ratio=0.31, seed=0)
    by_tokens = select_from_features(x, world_size=2, lengths=lengths, token_ratio=0.31, seed=0)
    tok_ex = int(lengths[np.concatenate(by_examples.rank_indices)].sum())
    tok_tok = by_tokens.stats["token_budget"]["selected_tokens"]
    assert tok_ex > 1.3 * 0.31 * lengths.sum()
    assert abs(tok_tok / (0.31 * lengths.sum()) - 1) < 0.05
    assert by_tokens.n_selected < by_examples.n_selected


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ratio": 0.3, "token_ratio": 0.3}, "exactly one of ratio / budget"),
        ({"token_ratio": 0.2, "token_budget": 100}, "exactly one of"),
        ({"token_ratio": 1.5}, "token_ratio must be in"),
        ({"token_budget": 0}, "token_budget must be an int"),
        ({"token_ratio": 0.3, "preset": "paper"}, "preset='paper'"),
    ],
)
def test_token_budget_errors_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        select_from_features(_mixture(100), world_size=2, lengths=_lengths(100), **kwargs)
