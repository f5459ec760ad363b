"""PlanSampler: the rank's indices, one shared permutation per epoch, determinism, exact mid-epoch resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from clusterlm.plan import Plan
from clusterlm.plan.sampler import PlanSampler
from clusterlm.selection.allocation import selection_weights


def _plan(n: int = 120, world_size: int = 3, per_rank: int = 25, seed: int = 0) -> Plan:
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    ranks = [perm[r * per_rank:(r + 1) * per_rank].astype(np.int64) for r in range(world_size)]
    labels = np.zeros(n, dtype=np.int64)
    for r, idx in enumerate(ranks):
        labels[idx] = r
    sel = np.concatenate(ranks)
    return Plan(world_size=world_size, rank_indices=ranks, weights=selection_weights(labels, sel, world_size),
                cluster_labels=labels, distances=np.zeros(n), cluster_sizes=np.bincount(labels, minlength=world_size),
                lengths=rng.integers(1, 50, size=n), fingerprint={"size": n, "sha256": "ab" * 32}, model_id="m")


class _Range(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def test_yields_the_ranks_indices_every_epoch():
    plan = _plan()
    for rank in range(3):
        s = PlanSampler(plan, rank, seed=1)
        assert len(s) == 25
        for epoch in range(3):
            s.set_epoch(epoch)
            out = list(s)
            assert len(out) == 25 and sorted(out) == sorted(plan.indices(rank).tolist())
            assert all(isinstance(i, int) for i in out)


def test_one_shared_permutation_of_positions_across_ranks():
    plan = _plan()
    for epoch in (0, 1, 5):
        positions = []
        for rank in range(3):
            s = PlanSampler(plan, rank, seed=7)
            s.set_epoch(epoch)
            where = {int(v): j for j, v in enumerate(plan.indices(rank))}
            positions.append([where[i] for i in s])
        assert positions[0] == positions[1] == positions[2]
        assert positions[0] != list(range(25))  # really permuted


def test_order_depends_on_seed_and_epoch_only():
    plan = _plan()
    a, b = PlanSampler(plan, 0, seed=3), PlanSampler(plan, 0, seed=3)
    a.set_epoch(4)
    b.set_epoch(4)
    assert list(a) == list(b) == a.order(4).tolist()
    assert a.order(4).tolist() != a.order(5).tolist()
    assert a.order(4).tolist() != PlanSampler(plan, 0, seed=4).order(4).tolist()
    assert list(a) == list(a)  # iterating twice in one epoch repeats the same order


def test_no_shuffle_keeps_plan_order():
    plan = _plan()
    s = PlanSampler(plan, 2, epoch_shuffle=False, seed=9)
    s.set_epoch(3)
    assert list(s) == plan.indices(2).tolist()


def test_works_as_a_dataloader_sampler():
    plan = _plan()
    s = PlanSampler(plan, 1, seed=2)
    s.set_epoch(1)
    loader = DataLoader(_Range(plan.n_examples), sampler=s, batch_size=4)
    got = torch.cat(list(loader)).tolist()
    assert got == s.order(1).tolist() and len(loader) == 7


def test_resume_mid_epoch_continues_exactly():
    plan = _plan()
    full = {}
    ref = PlanSampler(plan, 0, seed=5)
    for epoch in (2, 3):
        ref.set_epoch(epoch)
        full[epoch] = list(ref)

    # first run: epoch 2, trains 4 batches of 3 and checkpoints (the loader has fetched ahead by then)
    s = PlanSampler(plan, 0, seed=5)
    s.set_epoch(2)
    loader = DataLoader(_Range(plan.n_examples), sampler=s, batch_size=3)
    it = iter(loader)
    trained = []
    for _ in range(4):
        batch = next(it).tolist()
        trained += batch
        s.advance(len(batch))
    next(it)  # fetched but never trained on: must not count
    state = s.state_dict()
    assert state["epoch"] == 2 and state["position"] == 12

    # restart: a fresh sampler restored from the checkpoint
    r = PlanSampler(plan, 0, seed=5)
    r.load_state_dict(state)
    r.set_epoch(2)  # the trainer's loop calls set_epoch(epoch) again: keeps the position
    assert len(r) == 13
    loader = DataLoader(_Range(plan.n_examples), sampler=r, batch_size=3)
    rest = torch.cat(list(loader)).tolist()
    assert trained + rest == full[2]
    r.set_epoch(3)
    assert len(r) == 25 and list(r) == full[3]


def test_state_dict_roundtrip_and_position_bookkeeping():
    plan = _plan()
    s = PlanSampler(plan, 2, seed=0)
    s.set_epoch(1)
    list(s)
    s.advance(10)
    s.advance(15)
    assert s.position == 25
    with pytest.raises(ValueError, match="passes the end of the epoch"):
        s.advance(1)
    s.set_epoch(2)
    assert s.position == 0 and len(s) == 25
    # an iteration restarts the count at the resume point
    s.load_state_dict({"epoch": 2, "position": 5})
    assert len(s) == 20
    assert list(s) == s.order(2)[5:].tolist()
    assert len(s) == 25 and s.position == 5  # the offset applied to that one iteration only


@pytest.mark.parametrize(
    "state, match",
    [
        ({"epoch": 1}, "lacks 'position'"),
        ({"epoch": 1, "position": 26}, r"position in \[0, 25\]"),
        ({"epoch": -1, "position": 0}, "epoch >= 0"),
        ({"epoch": 1, "position": 0, "rank": 1}, "rank saved 1, this sampler 0"),
        ({"epoch": 1, "position": 0, "seed": 3}, "seed saved 3"),
        ({"epoch": 1, "position": 0, "data_sha256": "ff"}, "data_sha256"),
    ],
)
def test_load_state_dict_errors(state, match):
    s = PlanSampler(_plan(), 0, seed=0)
    with pytest.raises(ValueError, match=match):
        s.load_state_dict(state)


def test_argument_errors():
    plan = _plan()
    for rank in (-1, 3, 1.0, True):
        with pytest.raises(ValueError, match=r"rank must be an int in \[0, 3\)"):
            PlanSampler(plan, rank)
    with pytest.raises(TypeError, match="clusterlm.plan.Plan"):
        PlanSampler({"rank_indices": []}, 0)
    with pytest.raises(ValueError, match="seed"):
        PlanSampler(plan, 0, seed=-1)
    s = PlanSampler(plan, 0)
    with pytest.raises(ValueError, match="epoch"):
        s.set_epoch(-2)
    with pytest.raises(ValueError, match="non-negative"):
        s.advance(-1)
