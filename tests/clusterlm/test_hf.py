"""ClusterTrainer (transformers.Trainer) on CPU: plan order and weights reach the loss, training, resume,
Accelerate sharding switched off, mismatch errors, selection at train begin."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from accelerate.data_loader import prepare_data_loader, skip_first_batches  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments  # noqa: E402

from clusterlm.data import collate, fingerprint  # noqa: E402
from clusterlm.engine.loss import per_example_loss, weighted_loss  # noqa: E402
from clusterlm.integrations.hf import WEIGHT_KEY, ClusterTrainer, PlanCollator, PlanWeightedDataset  # noqa: E402
from clusterlm.plan import Plan  # noqa: E402
from clusterlm.plan.sampler import PlanSampler  # noqa: E402
from clusterlm.selection.allocation import selection_weights  # noqa: E402

N, VOCAB = 16, 128


def _model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper initial logits: per-example losses differ, so weighting them shows
        model.lm_head.weight.mul_(30)
    return model


def _examples(n: int = N, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = int(rng.integers(6, 15))
        ids = rng.integers(1, VOCAB, size=t).astype(np.int64)
        labels = ids.copy()
        labels[: int(rng.integers(2, 5))] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _plan(examples: list[dict], world_size: int = 1, seed: int = 0) -> Plan:
    """Cluster 0 = 12 examples, cluster 1 = 4; 4 selected from each, so weights 1.5 and 0.5."""
    n = len(examples)
    rng = np.random.default_rng(seed)
    labels = np.zeros(n, dtype=np.int64)
    labels[rng.permutation(n)[:4]] = 1
    sel = np.concatenate([np.flatnonzero(labels == 0)[:4], np.flatnonzero(labels == 1)[:4]])
    sel = rng.permutation(sel)
    per = len(sel) // world_size
    return Plan(world_size=world_size, rank_indices=[sel[r * per:(r + 1) * per] for r in range(world_size)],
                weights=selection_weights(labels, sel, 2), cluster_labels=labels, distances=np.zeros(n),
                cluster_sizes=np.bincount(labels, minlength=2),
                lengths=np.array([len(e["input_ids"]) for e in examples]), fingerprint=fingerprint(examples),
                model_id="tiny", config={"method": "test"})


def _args(tmp_path, **kw) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=20, learning_rate=3e-3,
                lr_scheduler_type="constant", logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                seed=0, disable_tqdm=True, dataloader_num_workers=0)
    base.update(kw)
    return TrainingArguments(**base)


class _Recording(ClusterTrainer):
    """Records which examples and weights every training micro-batch carried."""

    def __init__(self, *a, examples, **kw):
        super().__init__(*a, **kw)
        self._key = {tuple(e["input_ids"].tolist()): i for i, e in enumerate(examples)}
        self.seen: list[list[int]] = []
        self.seen_weights: list[list[float]] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if WEIGHT_KEY in inputs and model.training:
            ids, mask = inputs["input_ids"], inputs["attention_mask"].bool()
            self.seen.append([self._key[tuple(ids[r][mask[r]].tolist())] for r in range(len(ids))])
            self.seen_weights.append(inputs[WEIGHT_KEY].tolist())
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def _expected_batches(plan: Plan, n_steps: int, batch: int = 4, seed: int = 0) -> list[list[int]]:
    sampler = PlanSampler(plan, 0, seed=seed)
    out, epoch = [], 0
    while len(out) < n_steps:
        order = sampler.order(epoch).tolist()
        out += [order[i:i + batch] for i in range(0, len(order), batch)]
        epoch += 1
    return out[:n_steps]


def test_trains_on_the_plan_with_the_weighted_loss(tmp_path):
    examples = _examples()
    plan = _plan(examples)
    model = _model()
    initial = copy.deepcopy(model)
    trainer = _Recording(model=model, args=_args(tmp_path), train_dataset=examples, plan=plan, examples=examples)
    trainer.train()

    # every step saw the plan's examples in the sampler's per-epoch order, with their plan weights
    expected = _expected_batches(plan, 20)
    assert trainer.seen == expected
    for seen, w in zip(trainer.seen, trainer.seen_weights, strict=True):
        np.testing.assert_allclose(w, plan.weights[seen], rtol=1e-6)
    assert {w for ws in trainer.seen_weights for w in ws} == {1.5, 0.5}

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 20 and np.isfinite(losses).all()
    assert np.mean(losses[-4:]) < 0.8 * np.mean(losses[:4])

    # the first logged loss is mean_b(w_b * loss_b) of the first batch under the initial weights
    batch = collate([examples[i] for i in expected[0]])
    with torch.no_grad():
        logits = initial(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    per_ex = per_example_loss(logits, batch["labels"])
    direct = weighted_loss(per_ex, torch.tensor(plan.weights[expected[0]])).item()
    assert losses[0] == pytest.approx(direct, rel=1e-5)
    assert abs(losses[0] - per_ex.mean().item()) > 1e-2  # the weights changed the loss


def test_gradient_accumulation_divides_by_the_micro_batches(tmp_path):
    examples = _examples()
    plan = _plan(examples)
    initial = _model()
    trainer = ClusterTrainer(model=copy.deepcopy(initial), train_dataset=examples, plan=plan,
                             args=_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                        max_steps=1))
    trainer.train()
    order = PlanSampler(plan, 0, seed=0).order(0)
    expected = 0.0
    for half in (order[:2], order[2:4]):
        batch = collate([examples[i] for i in half])
        with torch.no_grad():
            logits = initial(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        expected += weighted_loss(per_example_loss(logits, batch["labels"]), torch.tensor(plan.weights[half])) / 2
    assert trainer.state.log_history[0]["loss"] == pytest.approx(float(expected), rel=1e-5)


def test_resume_continues_with_the_same_batches(tmp_path):
    examples = _examples()
    plan = _plan(examples)
    args = _args(tmp_path, max_steps=5, save_strategy="steps", save_steps=3)
    first = _Recording(model=_model(), args=args, train_dataset=examples, plan=plan, examples=examples)
    first.train()
    # step 3 ends in the middle of epoch 1 (2 steps per epoch): the resume must skip inside that epoch
    resumed = _Recording(model=_model(), args=args, train_dataset=examples, plan=plan, examples=examples)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    assert resumed.seen == first.seen[3:5] == _expected_batches(plan, 5)[3:5]


def test_accelerate_sharding_is_switched_off(tmp_path, monkeypatch):
    """With several processes Accelerate deals batches round-robin; the plan sampler is per rank already."""
    examples = _examples()
    plan = _plan(examples)
    trainer = ClusterTrainer(model=_model(), args=_args(tmp_path), train_dataset=examples, plan=plan)
    # simulate process 1 of 2 in a single process: Accelerate's own preparation with explicit ranks
    monkeypatch.setattr(trainer.accelerator, "prepare",
                        lambda dl: prepare_data_loader(dl, num_processes=2, process_index=1))
    loader = trainer.get_train_dataloader()
    got = [b[WEIGHT_KEY].numel() for b in loader]
    assert got == [4, 4] and len(loader) == 2  # both batches, not every second one
    # a resumed epoch: Accelerate's set_epoch cannot reach the sampler through SkipBatchSampler(BatchSamplerShard)
    # and falls back to the data set's set_epoch, which forwards it
    skipped = skip_first_batches(loader, 1)
    skipped.set_epoch(3)
    sampler = loader.dataset.sampler
    assert isinstance(sampler, PlanSampler) and sampler.epoch == 3
    assert [b[WEIGHT_KEY].tolist() for b in skipped] == [plan.weights[sampler.order(3)[4:8]].tolist()]
    # what the unpatched preparation would have done
    plain = prepare_data_loader(torch.utils.data.DataLoader(PlanWeightedDataset(examples, plan.weights),
                                                            sampler=PlanSampler(plan, 0), batch_size=4,
                                                            collate_fn=PlanCollator()),
                                num_processes=2, process_index=1)
    assert len(list(plain)) == 1


def test_world_size_and_data_mismatches_are_refused(tmp_path):
    examples = _examples()
    with pytest.raises(ValueError, match="the plan is for world size 2, but this run has args.world_size=1"):
        ClusterTrainer(model=_model(), args=_args(tmp_path), train_dataset=examples, plan=_plan(examples, 2))
    other = _examples(seed=1)
    trainer = ClusterTrainer(model=_model(), args=_args(tmp_path), train_dataset=other, plan=_plan(examples))
    with pytest.raises(ValueError, match="content hash differs"):
        trainer.train()
    with pytest.raises(ValueError, match="plan was made for 16 examples, the data set has 15"):
        ClusterTrainer(model=_model(), args=_args(tmp_path), train_dataset=examples[:15],
                       plan=_plan(examples)).train()
    with pytest.raises(ValueError, match="no plan"):
        ClusterTrainer(model=_model(), args=_args(tmp_path), train_dataset=examples).train()
    with pytest.raises(ValueError, match="not both"):
        ClusterTrainer(model=_model(), args=_args(tmp_path), train_dataset=examples, plan=_plan(examples),
                       select_kwargs={"budget": 8})
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        ClusterTrainer(model=_model(), args=_args(tmp_path, label_smoothing_factor=0.1), train_dataset=examples,
                       plan=_plan(examples))


def test_plan_dir_is_loaded_and_a_custom_collator_keeps_weights(tmp_path):
    examples = _examples()
    plan = _plan(examples)
    plan.save(tmp_path / "saved")
    calls = []

    def my_collate(features):
        calls.append(sorted(features[0]))
        return collate(features, pad_id=0)

    trainer = ClusterTrainer(_model(), _args(tmp_path, max_steps=2), my_collate, examples,
                             plan_dir=tmp_path / "saved")
    trainer.train()
    assert np.array_equal(trainer.plan.weights, plan.weights)
    assert calls and WEIGHT_KEY not in calls[0]  # the user's collator gets the items without the weight
    assert len([h for h in trainer.state.log_history if "loss" in h]) == 2


def test_select_at_train_begin(tmp_path):
    pytest.importorskip("clusterlm.selection.select")
    examples = _examples()
    trainer = ClusterTrainer(model=_model(), args=_args(tmp_path, max_steps=2), train_dataset=examples,
                             select_kwargs={"budget": 8, "dim": (4, 4), "progress": False})
    trainer.train()
    plan_dir = tmp_path / "out" / "plan"
    saved = Plan.load(plan_dir)
    assert saved.n_selected == 8 and saved.world_size == 1 and saved.fingerprint == fingerprint(examples)
    assert np.array_equal(saved.rank_indices[0], trainer.plan.rank_indices[0])
    assert json.loads((plan_dir / "plan.json").read_text())["config"]["budget"] == 8
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and np.isfinite(losses).all()
    # resuming reuses the saved plan instead of selecting again
    again = ClusterTrainer(model=_model(), args=_args(tmp_path, max_steps=2), train_dataset=examples,
                           select_kwargs={"budget": 4})
    again.prepare_plan(resuming=True)
    assert again.plan.n_selected == 8


_DDP_SCRIPT = r'''
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[2])
import test_hf as t
from clusterlm.integrations.hf import ClusterTrainer

examples = t._examples()
plan = t._plan(examples, world_size=2)
args = t._args(__import__("pathlib").Path(sys.argv[1]), max_steps=3, per_device_train_batch_size=2,
               ddp_backend="gloo", ddp_find_unused_parameters=False)
trainer = t._Recording(model=t._model(), args=args, train_dataset=examples, plan=plan, examples=examples)
trainer.train()
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
with open(f"{sys.argv[1]}/rank{args.process_index}.json", "w") as f:
    json.dump({"seen": trainer.seen, "world_size": args.world_size, "losses": losses}, f)
# The Trainer leaves its gloo group up: a rank exiting with it while the peer still runs its last collective
# aborts ("terminate called without an active exception"). Release what holds it, meet, then take it down.
import gc
import torch.distributed as dist
del trainer
gc.collect()
dist.barrier()
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_two_process_ddp_each_rank_trains_on_its_plan_part(tmp_path):
    """torchrun with 2 CPU processes (gloo): rank r sees exactly plan.indices(r) in the shared epoch order."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "ddp_script.py"
    script.write_text(_DDP_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    # own session: on a timeout the launcher and both workers are killed together, no orphans
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         str(script), str(tmp_path), str(Path(__file__).parent)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail("2-process run timed out:\n" + log[-4000:])
    assert proc.returncode == 0, log[-4000:]
    examples = _examples()
    plan = _plan(examples, world_size=2)
    for rank in range(2):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["world_size"] == 2
        order = PlanSampler(plan, rank, seed=0)
        expected = [order.order(0)[0:2].tolist(), order.order(0)[2:4].tolist(), order.order(1)[0:2].tolist()]
        assert out["seen"] == expected
        assert len(out["losses"]) == 3 and np.isfinite(out["losses"]).all()
