"""S2L, IFD and LESS baselines: valid plans at the exact budget, determinism, and each algorithm's core
checked against a direct small reference (hand-made trajectories / losses, per-example autograd)."""

from __future__ import annotations

import copy
import dataclasses
import inspect

import numpy as np
import pytest
import torch
from tiny_cases import baseline_examples as _examples  # tiny_model: the fixture of conftest.py

from clusterlm.plan import Plan
from clusterlm.selection.baselines._training import TrainLoopConfig, example_losses, train_loop
from clusterlm.selection.baselines.ifd import answer_only, ifd_plan, ifd_select
from clusterlm.selection.baselines.less import (
    LESS_DIM,
    LessConfig,
    adam_precondition,
    less_plan,
    less_scores,
    lora_gradient_features,
    lora_model,
    lora_params,
)
from clusterlm.selection.baselines.s2l import S2LConfig, balanced_cluster_sample, build_proxy, s2l_plan

IGNORE = -100


def _check_plan(plan: Plan, data: list, world_size: int, count: int, method: str) -> np.ndarray:
    selected = np.concatenate(plan.rank_indices)
    assert plan.config["method"] == method
    assert len(selected) == count == plan.n_selected and len(np.unique(selected)) == count
    assert len({len(r) for r in plan.rank_indices}) == 1 and plan.world_size == world_size
    np.testing.assert_array_equal(plan.weights[selected], 1.0)
    assert (plan.weights > 0).sum() == count
    plan.verify(data, world_size)
    assert plan.timings["total"] >= max(v for k, v in plan.timings.items() if k != "total") - 1e-9
    return np.sort(selected)


def _direct_loss(model: torch.nn.Module, ex: dict[str, np.ndarray]) -> float:
    ids = torch.as_tensor(ex["input_ids"])[None]
    labels = torch.as_tensor(ex["labels"])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    return float(torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE))


# ---------------------------------------------------------------------------------------------------- S2L


def test_s2l_sampling_visits_smallest_first_and_splits_the_remaining_budget():
    sizes = {7: 1, 3: 2, 5: 3, 1: 10, 2: 20}  # cluster id -> size
    labels = np.concatenate([np.full(s, c) for c, s in sizes.items()])
    selected, stats = balanced_cluster_sample(labels, 12, seed=0)
    # skip 7 (1) and 3 (2); 5: 12 // 3 = 4 > 3 -> all 3; 1: 9 // 2 = 4; 2: 5 // 1 = 5
    assert stats["per_cluster"] == [[5, 3, 3], [1, 10, 4], [2, 20, 5]]
    assert stats["skipped_clusters"] == 2 and stats["filled"] == 0
    counts = {c: int((labels[selected] == c).sum()) for c in sizes}
    assert counts == {7: 0, 3: 0, 5: 3, 1: 4, 2: 5}
    # a shortfall (only small clusters left) is filled at random from the rest
    selected, stats = balanced_cluster_sample(np.array([0, 1, 1, 2, 2, 2]), 5, seed=3)
    assert stats["per_cluster"] == [[2, 3, 3]] and stats["filled"] == 2
    assert len(selected) == 5 and {3, 4, 5} <= set(selected.tolist())
    again, _ = balanced_cluster_sample(np.array([0, 1, 1, 2, 2, 2]), 5, seed=3)
    np.testing.assert_array_equal(selected, again)


def test_s2l_plan_on_hand_made_trajectories_matches_the_reference_split():
    rng = np.random.default_rng(1)
    sizes = [3, 6, 9, 30]
    levels = [[5.0, 4.0, 3.0], [1.0, 1.0, 1.0], [4.0, 1.0, 0.5], [2.0, 2.5, 3.0]]  # well-separated shapes
    traj = np.concatenate([np.array(lv) + 0.01 * rng.standard_normal((s, 3))
                           for s, lv in zip(sizes, levels, strict=True)])
    group = np.repeat(np.arange(4), sizes)
    data = _examples(len(traj))
    plan = s2l_plan(None, data, 2, budget=16, n_clusters=4, trajectories=traj, seed=0)  # type: ignore[arg-type]
    selected = _check_plan(plan, data, 2, 16, "s2l")
    # reference: sizes 3, 6, 9, 30 -> 16//4=4 -> all 3; 13//3=4; 9//2=4; 5//1=5
    assert np.bincount(group[selected], minlength=4).tolist() == [3, 4, 4, 5]


def test_s2l_plan_end_to_end_exact_budget_deterministic(tiny_model):
    data = _examples()
    kwargs = dict(budget=16, n_clusters=6, seed=4, lr=1e-3, n_checkpoints=3)
    a = s2l_plan(tiny_model, data, 2, **kwargs)
    b = s2l_plan(tiny_model, data, 2, **kwargs)
    sel = _check_plan(a, data, 2, 16, "s2l")
    np.testing.assert_array_equal(sel, np.sort(np.concatenate(b.rank_indices)))
    assert {"proxy_train", "losses", "kmeans"} <= set(a.timings) and a.stats["trajectory_length"] == 3
    proxy = build_proxy(tiny_model)
    assert proxy.config.num_hidden_layers == 1
    torch.testing.assert_close(proxy.lm_head.weight, tiny_model.lm_head.weight)
    assert tiny_model.config.num_hidden_layers == 2  # the target is untouched


# ---------------------------------------------------------------------------------------------------- IFD


def test_ifd_ratio_drop_and_ranking_on_hand_computed_losses():
    cond = np.array([0.9, 2.0, 0.3, 0.8, 1.0, 0.6])
    direct = np.array([1.0, 1.0, 1.0, 1.0, 0.5, 2.0])  # IFD = .9, 2, .3, .8, 2, .3
    sel, ifd, stats = ifd_select(cond, direct, 3)
    np.testing.assert_allclose(ifd, [0.9, 2.0, 0.3, 0.8, 2.0, 0.3])
    assert sel.tolist() == [0, 2, 3] and stats["dropped_ifd_gt_1"] == 2 and stats["filled_from_dropped"] == 0
    sel, _, stats = ifd_select(cond, direct, 5)  # 4 with IFD <= 1, one filled from the dropped (tie: lower index)
    assert sel.tolist() == [0, 1, 2, 3, 5] and stats["filled_from_dropped"] == 1


def test_ifd_losses_match_single_example_forwards(tiny_model):
    data = _examples(12, seed=2)
    ex = data[0]
    alone = answer_only(ex)
    keep = ex["labels"] != IGNORE
    np.testing.assert_array_equal(alone["input_ids"], np.concatenate([ex["input_ids"][:1], ex["input_ids"][keep]]))
    assert alone["labels"][0] == IGNORE and (alone["labels"][1:] == ex["input_ids"][keep]).all()
    cond = example_losses(tiny_model, data, batch_tokens=64)
    direct = example_losses(tiny_model, [answer_only(e) for e in data], batch_tokens=64)
    ref_cond = [_direct_loss(tiny_model, e) for e in data]
    ref_direct = [_direct_loss(tiny_model, answer_only(e)) for e in data]
    np.testing.assert_allclose(cond, ref_cond, rtol=1e-5)
    np.testing.assert_allclose(direct, ref_direct, rtol=1e-5)


def test_ifd_plan_exact_budget_and_selects_the_top_ifd(tiny_model):
    data = _examples()
    plan = ifd_plan(tiny_model, data, 2, budget=16, seed=1)
    sel = _check_plan(plan, data, 2, 16, "ifd")
    cond = np.array([_direct_loss(tiny_model, e) for e in data])
    direct = np.array([_direct_loss(tiny_model, answer_only(e)) for e in data])
    ref, _, _ = ifd_select(cond, direct, 16)
    np.testing.assert_array_equal(sel, ref)
    again = ifd_plan(tiny_model, data, 2, budget=16, seed=1)
    np.testing.assert_array_equal(np.concatenate(plan.rank_indices), np.concatenate(again.rank_indices))


# ---------------------------------------------------------------------------------------------------- LESS


def test_less_features_match_per_example_autograd_with_adam_preconditioning(tiny_model):
    from cluster_kernels.projection import random_projection

    data = _examples(6, seed=5)
    peft_model = lora_model(tiny_model, r=2, seed=0, dropout=0.0)
    with torch.no_grad():  # non-zero B so both LoRA matrices get gradients
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    gen = torch.Generator().manual_seed(0)
    params = dict(peft_model.named_parameters())
    state = {name: (0.01 * torch.randn(params[name].shape, generator=gen),
                    1e-4 * torch.rand(params[name].shape, generator=gen)) for name, _ in lora_params(peft_model)}
    dim = 64
    feats = lora_gradient_features(peft_model, data, dim=dim, seed=3, adam_state=state, batch_tokens=64)
    plain = lora_gradient_features(peft_model, data, dim=dim, seed=3, adam_state=None, batch_tokens=64)
    ref_adam, ref_plain = [], []
    for ex in data:
        peft_model.zero_grad(set_to_none=True)
        logits = peft_model(input_ids=torch.as_tensor(ex["input_ids"])[None]).logits[0]
        loss = torch.nn.functional.cross_entropy(logits[:-1], torch.as_tensor(ex["labels"])[1:], ignore_index=IGNORE)
        loss.backward()
        va, vp = torch.zeros(dim, dtype=torch.float64), torch.zeros(dim, dtype=torch.float64)
        for name, _ in lora_params(peft_model):
            g = params[name].grad.double()
            m, v = state[name]
            pre = (0.9 * m.double() + 0.1 * g) / torch.sqrt(0.999 * v.double() + 0.001 * g**2 + 1e-8)
            proj = random_projection(g.numel(), dim, seed=3, name=f"less/{name}", dtype=torch.float64)
            va += pre.flatten() @ proj
            vp += g.flatten() @ proj
        ref_adam.append((va / va.norm()).numpy())
        ref_plain.append((vp / vp.norm()).numpy())
    peft_model.zero_grad(set_to_none=True)
    np.testing.assert_allclose(feats, np.stack(ref_adam), atol=2e-4)
    np.testing.assert_allclose(plain, np.stack(ref_plain), atol=2e-4)
    g = torch.randn(3, 4, generator=gen)
    torch.testing.assert_close(adam_precondition(g, state_m := torch.ones(3, 4), state_m),
                               (0.9 + 0.1 * g) / torch.sqrt(0.999 + 0.001 * g**2 + 1e-8))


def test_less_scores_are_lr_weighted_mean_cosines():
    rng = np.random.default_rng(0)

    def unit(x: np.ndarray) -> np.ndarray:
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    train = [unit(rng.standard_normal((5, 8))) for _ in range(2)]
    val = [unit(rng.standard_normal((3, 8))) for _ in range(2)]
    scores, w = less_scores(train, val, [3.0, 1.0])
    np.testing.assert_allclose(w, [0.75, 0.25])
    ref = [sum(wc * np.mean([float(train[c][i] @ val[c][j]) for j in range(3)]) for c, wc in enumerate(w))
           for i in range(5)]
    np.testing.assert_allclose(scores, ref, rtol=1e-12)


def test_less_plan_exact_budget_deterministic(tiny_model):
    data = _examples()
    kwargs = dict(budget=16, validation=data[:3], seed=2, lr=1e-3, warmup_fraction=0.25, warmup_epochs=2, dim=32)
    a = less_plan(tiny_model, data, 2, **kwargs)
    b = less_plan(tiny_model, data, 2, **kwargs)
    sel = _check_plan(a, data, 2, 16, "less")
    np.testing.assert_array_equal(sel, np.sort(np.concatenate(b.rank_indices)))
    assert len(a.stats["checkpoint_weights"]) == 2 and {"warmup", "train_gradients", "score"} <= set(a.timings)
    assert not any("lora" in n for n, _ in tiny_model.named_parameters())  # the target is untouched
    with pytest.raises(ValueError, match="validation"):
        less_plan(tiny_model, data, 2, budget=16, validation=[])
    with pytest.raises(ValueError, match="less_plan: ratio"):
        less_plan(tiny_model, data, 2, ratio=1.5, validation=data[:2])


def test_model_baseline_specs(tiny_model):
    from clusterlm.selection.baselines import baseline_plan, is_baseline_spec

    data = _examples()
    plan = baseline_plan("ifd:16", data, 2, seed=1, model=tiny_model)
    direct = ifd_plan(tiny_model, data, 2, budget=16, seed=1)
    np.testing.assert_array_equal(np.concatenate(plan.rank_indices), np.concatenate(direct.rank_indices))
    assert baseline_plan("ifd:0.5", data, 4, model=tiny_model).n_selected == 24
    assert not is_baseline_spec("s2l:0.31")  # built before training, never inside the trainer's ranks
    with pytest.raises(ValueError, match="pass model="):
        baseline_plan("s2l:0.31", data, 2)
    with pytest.raises(ValueError, match="less:<ratio>"):
        baseline_plan("less:many", data, 2, model=tiny_model)


# ---------------------------------------------------------------------------------------------------- settings


def _hand_made_trajectories() -> np.ndarray:
    rng = np.random.default_rng(1)
    levels = [[5.0, 4.0, 3.0], [1.0, 1.0, 1.0], [4.0, 1.0, 0.5]]
    return np.concatenate([np.array(lv) + 0.01 * rng.standard_normal((s, 3))
                           for s, lv in zip([6, 9, 9], levels, strict=True)])


def test_s2l_config_plus_overrides_is_the_keyword_call_and_records_the_same_settings():
    traj = _hand_made_trajectories()
    data = _examples(len(traj))
    by_keyword = s2l_plan(None, data, 2, budget=12, n_clusters=3, skip_size=1, seed=3, lr=5e-4,  # type: ignore[arg-type]
                          trajectories=traj)
    config = S2LConfig(n_clusters=3, lr=5e-4)
    by_config = s2l_plan(None, data, 2, None, 12, config, skip_size=1, seed=3, trajectories=traj)  # type: ignore[arg-type]
    for a, b in zip(by_keyword.rank_indices, by_config.rank_indices, strict=True):
        np.testing.assert_array_equal(a, b)
    assert by_keyword.config == by_config.config == {
        "method": "s2l", "ratio": None, "budget": 12, "n_clusters": 3, "skip_size": 1, "proxy_layers": None,
        "proxy_epochs": 1, "n_checkpoints": 4, "lr": 5e-4, "micro_batch_size": 8,
        "source": "Yang et al., SmallToLarge (S2L), NeurIPS 2024, Algorithm 1",
        "world_size": 2, "seed": 3, "token_balance": True, "allocation": "stratified"}
    assert config.n_clusters == 3 and config.skip_size == 2  # the overrides made a copy
    assert config.replace(skip_size=1) == S2LConfig(n_clusters=3, lr=5e-4, skip_size=1)
    with pytest.raises(TypeError, match=r"s2l_plan: unknown setting\(s\) clusters; the settings are .*n_clusters"):
        s2l_plan(None, data, 2, budget=12, clusters=3, trajectories=traj)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"s2l_plan: config must be a S2LConfig or None, got dict"):
        s2l_plan(None, data, 2, None, 12, {"n_clusters": 3}, trajectories=traj)  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lr = 1.0  # type: ignore[misc]


def test_less_config_defaults_and_unknown_settings():
    assert LESS_DIM == LessConfig().dim == 1024
    assert inspect.signature(lora_gradient_features).parameters["dim"].default == LESS_DIM
    assert LessConfig().warmup([2, 4]) == TrainLoopConfig(epochs=4, lr=2e-5, micro_batch_size=8, seed=0,
                                                          checkpoint_steps=(2, 4))
    with pytest.raises(TypeError, match=r"less_plan: unknown setting\(s\) dimension, lora_rank; the settings are "
                                        r"seed, warmup_fraction, .*lora_r, .*dim, .*\(LessConfig\)"):
        LessConfig().replace(lora_rank=4, dimension=8)
    data = _examples(8)
    with pytest.raises(TypeError, match=r"unknown setting\(s\) lora_rank"):  # before any model work
        less_plan(None, data, 2, budget=4, validation=data[:2], lora_rank=4)  # type: ignore[arg-type]


def test_less_config_plus_overrides_is_the_keyword_call(tiny_model):
    data = _examples(16, seed=3)
    common = dict(validation=data[:2], model_id="m")
    by_keyword = less_plan(tiny_model, data, 2, budget=8, seed=1, lr=1e-3, warmup_fraction=0.25, warmup_epochs=1,
                           dim=16, **common)
    config = LessConfig(seed=1, lr=1e-3, warmup_fraction=0.25, dim=16)
    by_config = less_plan(tiny_model, data, 2, None, 8, config, warmup_epochs=1, **common)
    for a, b in zip(by_keyword.rank_indices, by_config.rank_indices, strict=True):
        np.testing.assert_array_equal(a, b)
    assert by_keyword.config == by_config.config == {
        "method": "less", "ratio": None, "budget": 8, "warmup_fraction": 0.25, "warmup_epochs": 1, "lr": 1e-3,
        "lora_r": 8, "lora_alpha": 32.0, "lora_targets": "q_proj,k_proj,v_proj,o_proj", "dim": 16,
        "n_validation": 2, "source": "Xia et al., LESS, ICML 2024, sec. 3-4",
        "world_size": 2, "seed": 1, "token_balance": True, "allocation": "stratified"}
    assert by_keyword.stats["checkpoint_weights"] == by_config.stats["checkpoint_weights"]
    assert by_keyword.stats["score_max"] == by_config.stats["score_max"]


def test_train_loop_config_plus_overrides_is_the_keyword_call(tiny_model):
    data = _examples(12, seed=4)
    idx = np.arange(0, 12, 2)
    seen: dict[str, list[int]] = {"keyword": [], "config": []}
    a = train_loop(copy.deepcopy(tiny_model), data, idx, epochs=2, lr=1e-3, micro_batch_size=2, seed=3,
                   checkpoint_steps=(3, 6), on_checkpoint=lambda step, lr, opt: seen["keyword"].append(step))
    config = TrainLoopConfig(epochs=2, lr=1e-3, checkpoint_steps=(3, 6))
    b = train_loop(copy.deepcopy(tiny_model), data, idx, config, micro_batch_size=2, seed=3,
                   on_checkpoint=lambda step, lr, opt: seen["config"].append(step))
    assert a["steps"] == b["steps"] == 6 and seen == {"keyword": [3, 6], "config": [3, 6]}
    assert a["losses"] == b["losses"] and a["lrs"] == b["lrs"]
    with pytest.raises(TypeError, match=r"train_loop: unknown setting\(s\) warmup; the settings are .*warmup_ratio"):
        train_loop(tiny_model, data, idx, epochs=1, lr=1e-3, warmup=0.1)
    with pytest.raises(TypeError, match=r"train_loop: missing required setting\(s\) lr \(TrainLoopConfig\)"):
        train_loop(tiny_model, data, idx, epochs=1)
