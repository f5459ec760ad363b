"""ClusterSFTTrainer (TRL's SFTTrainer on a plan) on CPU: TRL-tokenised plans, plan order per rank, the DDP
gradient identity under 2 gloo processes on `messages` and `prompt`/`completion` data, resume, refusals."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl")

import datasets  # noqa: E402
import tiny_sft  # noqa: E402
from trl import SFTConfig  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from clusterlm.data import collate, load_data  # noqa: E402
from clusterlm.engine.loss import per_example_loss, weighted_loss  # noqa: E402
from clusterlm.integrations.hf import WEIGHT_KEY  # noqa: E402
from clusterlm.integrations.trl import ClusterSFTTrainer, sft_examples  # noqa: E402
from clusterlm.models import compute_model_id  # noqa: E402
from clusterlm.plan import Plan  # noqa: E402
from clusterlm.plan.sampler import PlanSampler  # noqa: E402


def _config(out, kind: str, **kw) -> SFTConfig:
    base = dict(output_dir=str(out), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-3,
                lr_scheduler_type="constant", logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                seed=0, disable_tqdm=True, dataloader_num_workers=0, gradient_checkpointing=False, max_grad_norm=0.0,
                assistant_only_loss=kind == "messages", max_length=None, bf16=False)
    base.update(kw)
    return SFTConfig(**base)


class Recording(ClusterSFTTrainer):
    """Records the data set index of every example a training micro-batch carried (by its TRL tokens)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._key = {tuple(ex["input_ids"].tolist()): i for i, ex in enumerate(self.plan_examples())}
        self.seen: list[int] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if WEIGHT_KEY in inputs and model.training:
            ids, mask = inputs["input_ids"], inputs["attention_mask"].bool()
            self.seen += [self._key[tuple(ids[r][mask[r]].tolist())] for r in range(len(ids))]
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def _setup(tmp_path, kind: str, world_size: int = 2):
    """Tokenizer, raw rows, TRL's examples of them, and a two-cluster plan of those examples."""
    tok = tiny_sft.tokenizer()
    raw = datasets.Dataset.from_list(tiny_sft.records(kind))
    model = tiny_sft.model(len(tok))
    examples = sft_examples(model, raw, args=_config(tmp_path / "prep", kind), processing_class=tok)
    return tok, raw, examples, tiny_sft.two_cluster_plan(examples, world_size, model_id=compute_model_id(model))


def test_sft_examples_are_what_trl_trains_on(tmp_path):
    tok = tiny_sft.tokenizer()
    model = tiny_sft.model(len(tok))
    for kind in ("messages", "prompt-completion"):
        raw = tiny_sft.records(kind)
        examples = sft_examples(model, raw, args=_config(tmp_path, kind), processing_class=tok)
        assert len(examples) == len(raw)
        for i in (0, 5):  # only the answer is trained: the assistant turn / the completion, plus eos
            ex = examples[i]
            trained = tok.decode(ex["input_ids"][ex["labels"] != -100])
            answer = raw[i]["messages"][1]["content"] if kind == "messages" else raw[i]["completion"]
            assert trained.strip() == answer.strip() + "</s>"
        if kind == "prompt-completion":  # clusterlm.load_data renders it through the chat template, TRL does not
            ours = load_data(raw, tok, max_length=None, progress=False)
            assert ours.fingerprint() != examples.fingerprint()
    # an SFTDataset is accepted (TRL leaves its input_ids/labels as they are)
    again = sft_examples(model, examples, args=_config(tmp_path, "tokenized"), processing_class=tok)
    assert again.fingerprint() == examples.fingerprint()


def test_refusals(tmp_path):
    kind = "prompt-completion"
    tok, raw, examples, plan = _setup(tmp_path, kind, world_size=1)
    model = tiny_sft.model(len(tok))
    for flag, why in (("packing", "packing=True merges several examples"), ("shuffle_dataset", "reorders")):
        with pytest.raises(ValueError, match=why):
            ClusterSFTTrainer(model=model, args=_config(tmp_path, kind, **{flag: True}), train_dataset=raw,
                              processing_class=tok, plan=plan)
    # a plan made with clusterlm.load_data's tokens: refused after TRL's tokenisation, saying how to make one
    ours = load_data(raw, tok, max_length=None, progress=False)
    wrong = tiny_sft.two_cluster_plan(ours, 1)
    trainer = ClusterSFTTrainer(model=model, args=_config(tmp_path, kind), train_dataset=raw,
                                processing_class=tok, plan=wrong)
    with pytest.raises(ValueError, match="content hash differs.*sft_examples"):
        trainer.train()
    # a plan selected with other weights: refused unless allow_other_model
    other = copy.deepcopy(plan)
    other.model_id = compute_model_id(tiny_sft.model(len(tok), seed=1))
    trainer = ClusterSFTTrainer(model=model, args=_config(tmp_path, kind), train_dataset=raw,
                                processing_class=tok, plan=other)
    with pytest.raises(ValueError, match="allow_other_model=True"):
        trainer.train()
    ClusterSFTTrainer(model=model, args=_config(tmp_path, kind), train_dataset=raw, processing_class=tok,
                      plan=other, allow_other_model=True).prepare_plan()


def test_resume_continues_the_plan_order_and_dft_padding_free(tmp_path):
    tok, raw, examples, plan = _setup(tmp_path, "prompt-completion", world_size=1)
    args = _config(tmp_path / "out", "prompt-completion", max_steps=5, save_strategy="steps", save_steps=3)
    first = Recording(model=tiny_sft.model(len(tok)), args=args, train_dataset=raw, processing_class=tok, plan=plan)
    first.train()
    order = [int(i) for e in range(3) for i in PlanSampler(plan, 0, seed=0).order(e)]
    assert first.seen == order[:10]  # 4 steps of 2 per epoch: the checkpoint (step 3) is inside epoch 0
    resumed = Recording(model=tiny_sft.model(len(tok)), args=args, train_dataset=raw, processing_class=tok,
                        plan=plan)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    assert resumed.seen == first.seen[6:10]
    losses = [h["loss"] for h in first.state.log_history if "loss" in h]
    assert len(losses) == 5 and np.isfinite(losses).all()
    # the first logged loss is mean_b(w_b * loss_b) of the first batch, loss_b from the full logits
    # (clusterlm.engine.loss)
    batch = collate([examples[i] for i in order[:2]])
    with torch.no_grad():
        logits = tiny_sft.model(len(tok))(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    per_example = per_example_loss(logits, batch["labels"])
    assert losses[0] == pytest.approx(weighted_loss(per_example, plan.weights[order[:2]]).item(), rel=1e-6)
    assert abs(losses[0] - per_example.mean().item()) > 1e-2  # the weights changed it
    # padding-free batches (one packed row) give the same per-example weighted loss as padded ones
    direct = []
    for extra in ({}, {"padding_free": True}, {"loss_type": "dft"}):
        t = ClusterSFTTrainer(model=tiny_sft.model(len(tok)), train_dataset=raw, processing_class=tok, plan=plan,
                              args=_config(tmp_path / "pf", "prompt-completion", max_steps=1, learning_rate=0.0,
                                           **extra))
        t.train()
        direct.append(t.state.log_history[0]["loss"])
    assert direct[1] == pytest.approx(direct[0], rel=1e-6) and abs(direct[2] - direct[0]) > 1e-3


def test_select_at_train_begin_uses_trl_tokens(tmp_path):
    tok = tiny_sft.tokenizer()
    raw = tiny_sft.records("messages")
    trainer = ClusterSFTTrainer(model=tiny_sft.model(len(tok)), args=_config(tmp_path, "messages"),
                                train_dataset=raw, processing_class=tok,
                                select_kwargs={"budget": 8, "dim": (4, 4), "progress": False})
    trainer.train()
    saved = Plan.load(tmp_path / "plan")
    assert saved.fingerprint == trainer.plan_examples().fingerprint() and saved.n_selected == 8
    assert saved.model_id.split("@")[1] == compute_model_id(tiny_sft.model(len(tok))).split("@")[1]


_RANKS_SCRIPT = r'''
import json, sys
from pathlib import Path
import datasets, torch
import tiny_sft
import test_trl as t
from transformers import AutoTokenizer, TrainerCallback
from clusterlm.plan import Plan

out = Path(sys.argv[1])


class GradOfFirstStep(TrainerCallback):
    grad = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        if self.grad is None:  # DDP has averaged the gradients over the ranks by now
            self.grad = torch.cat([p.grad.flatten() for p in model.parameters()]).tolist()


tok = AutoTokenizer.from_pretrained(str(out / "tok"))
result = {}
for kind in ("messages", "prompt-completion"):
    raw = datasets.load_from_disk(str(out / kind / "raw"))
    plan = Plan.load(out / kind / "plan")
    grab = GradOfFirstStep()
    # one optimizer step = 2 micro-batches of 2 = a rank's whole epoch; the second step starts epoch 1
    args = t._config(out / kind / "run", kind, gradient_accumulation_steps=2, ddp_backend="gloo",
                     ddp_find_unused_parameters=False)
    trainer = t.Recording(model=tiny_sft.model(len(tok)), args=args, train_dataset=raw, processing_class=tok,
                          plan=plan, callbacks=[grab])
    trainer.train()
    result[kind] = {"seen": trainer.seen, "grad": grab.grad, "world_size": args.world_size}
(out / f"rank{args.process_index}.json").write_text(json.dumps(result))
'''


@pytest.mark.slow
def test_two_process_ddp_gradient_and_plan_order(tmp_path):
    """2 gloo ranks: rank r trains exactly its plan list in plan-sampler order, and the DDP gradient of the first
    step is sum_k (n_k / N) g_k (g_k: cluster k's plain mean gradient), on messages and prompt/completion data."""
    tok = tiny_sft.tokenizer()
    tok.save_pretrained(str(tmp_path / "tok"))
    setups = {}
    for kind in ("messages", "prompt-completion"):
        _, raw, examples, plan = _setup(tmp_path / kind, kind)
        raw.save_to_disk(str(tmp_path / kind / "raw"))
        plan.save(tmp_path / kind / "plan")
        setups[kind] = (examples, plan)
    tiny_sft.run_two_ranks(_RANKS_SCRIPT, tmp_path)
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for kind, (examples, plan) in setups.items():
        net = tiny_sft.model(len(tok))
        add_fused_lm_head(net)
        # g_k through TRL's fused LM head (the kernel TRL trains with), and through clusterlm's full-logits loss
        expected = tiny_sft.expected_gradient(net, examples, plan, loss=tiny_sft.trl_loss)
        full_logits = tiny_sft.expected_gradient(net, examples, plan)
        for rank in range(2):
            sampler = PlanSampler(plan, rank, seed=0)
            assert out[rank][kind]["world_size"] == 2
            assert out[rank][kind]["seen"] == sampler.order(0).tolist() + sampler.order(1).tolist(), kind
        g0, g1 = (torch.tensor(out[r][kind]["grad"], dtype=torch.float64) for r in range(2))
        assert torch.equal(g0, g1)
        scale = max(1.0, expected.abs().max().item())
        assert (g0 - expected).abs().max().item() <= 1e-6 * scale, kind
        assert (g0 - full_logits).abs().max().item() <= 1e-5 * scale, kind  # TRL's head multiplies in float32
        # the weights matter: the unweighted average of the two ranks' gradients is far from it
        plain = tiny_sft.expected_gradient(net, examples, tiny_sft.equal_size_plan(plan), loss=tiny_sft.trl_loss)
        assert (g0 - plain).abs().max().item() > 1e-3 * scale, kind
