"""ClusterTrainer and ClusterSFTTrainer on FSDP2-sharded models, 2 gloo ranks on CPU.

What Accelerate does not allow on CPU: its FSDP configuration (``TrainingArguments(fsdp=..., fsdp_config={"version":
2})``, i.e. ``accelerate launch`` with ``fsdp_version: 2``) takes effect only on accelerator devices
(``AcceleratorState`` switches ``distributed_type`` to ``FSDP`` for MULTI_GPU / NPU / XPU / ... but never for
MULTI_CPU), so on CPU the settings are silently dropped and the Trainer trains as DDP; the first test pins that
down. The FSDP2 sharding itself runs on CPU, so the integrations are tested on models that are already sharded
when the Trainer gets them (``from_pretrained(distributed_config=DistributedConfig(fsdp_size=2))``, transformers'
own FSDP2, which the Trainer trains without re-wrapping): selection at train begin on the unsharded model (the
plan equals the one selected without FSDP), and the sharded gradient of the first step equal to
``sum_k (n_k / N) g_k`` to 1e-6 (float64 model), as the DDP tests check.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl")

import datasets  # noqa: E402
import tiny_sft  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from clusterlm.integrations.trl import sft_examples  # noqa: E402
from clusterlm.models import compute_model_id  # noqa: E402
from clusterlm.plan import Plan  # noqa: E402
from clusterlm.selection.select import select  # noqa: E402

SELECT = {"budget": 8, "dim": (4, 4), "progress": False, "seed": 0}

_RANKS_SCRIPT = r'''
import json, sys
from pathlib import Path
import datasets, torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, TrainingArguments
from transformers.distributed import DistributedConfig
import tiny_sft
from clusterlm.integrations.hf import ClusterTrainer
from clusterlm.integrations.trl import ClusterSFTTrainer
from trl import SFTConfig

out = Path(sys.argv[1])
select_kwargs = json.loads(sys.argv[2])
select_kwargs["dim"] = tuple(select_kwargs["dim"])


class GradOfFirstStep(TrainerCallback):
    grad = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        if self.grad is None:  # the sharded gradients, reduce-scattered over the ranks; gathered whole here
            full = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
            self.grad = torch.cat([g.flatten() for g in full]).tolist()


def sharded():
    return AutoModelForCausalLM.from_pretrained(str(out / "model"), dtype=torch.float64,
                                                distributed_config=DistributedConfig(fsdp_size=2))


common = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1, learning_rate=1e-3,
              lr_scheduler_type="constant", logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0,
              disable_tqdm=True, dataloader_num_workers=0, max_grad_norm=0.0, ddp_backend="gloo")
result = {}

# Accelerate's FSDP configuration on CPU
args = TrainingArguments(output_dir=str(out / "accel"), fsdp="full_shard",
                         fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}, **common)
tok = AutoTokenizer.from_pretrained(str(out / "tok"))
examples = json.loads((out / "examples.json").read_text())
trainer = ClusterTrainer(model=tiny_sft.model(len(tok)), args=args, train_dataset=examples,
                         select_kwargs=select_kwargs, plan_dir=out / "accel_plan")
result["accelerate"] = {"fsdp_enabled": trainer.is_fsdp_enabled,
                        "distributed_type": str(trainer.accelerator.distributed_type)}

# ClusterTrainer, selecting at train begin, on a sharded model
grab = GradOfFirstStep()
model = sharded()
trainer = ClusterTrainer(model=model, args=TrainingArguments(output_dir=str(out / "hf"), **common),
                         train_dataset=examples, select_kwargs=select_kwargs, callbacks=[grab])
trainer.train()
result["hf"] = {"grad": grab.grad, "sharded": type(next(model.parameters())).__name__,
                "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}

# ClusterSFTTrainer, selecting at train begin on TRL's tokens, on a sharded model
grab = GradOfFirstStep()
raw = datasets.load_from_disk(str(out / "raw"))
config = SFTConfig(output_dir=str(out / "sft"), assistant_only_loss=True, max_length=None, bf16=False, **common)
trainer = ClusterSFTTrainer(model=sharded(), args=config, train_dataset=raw, processing_class=tok,
                            select_kwargs=select_kwargs, callbacks=[grab])
trainer.train()
result["sft"] = {"grad": grab.grad, "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
(out / f"rank{args.process_index}.json").write_text(json.dumps(result))
'''


@pytest.mark.slow
def test_integrations_on_fsdp2_sharded_models(tmp_path):
    tok = tiny_sft.tokenizer()
    tok.save_pretrained(str(tmp_path / "tok"))
    net = tiny_sft.model(len(tok))
    net.save_pretrained(str(tmp_path / "model"))
    examples = tiny_sft.token_examples(16, vocab=len(tok))
    (tmp_path / "examples.json").write_text(json.dumps(examples))
    raw = datasets.Dataset.from_list(tiny_sft.records("messages"))
    raw.save_to_disk(str(tmp_path / "raw"))
    tiny_sft.run_two_ranks(_RANKS_SCRIPT, tmp_path, json.dumps(SELECT), timeout=600)
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    # Accelerate drops its FSDP settings on CPU: no FSDP plugin, a MULTI_CPU (DDP) run
    for r in range(2):
        assert out[r]["accelerate"] == {"fsdp_enabled": False, "distributed_type": "DistributedType.MULTI_CPU"}

    # ClusterTrainer: the plan selected on the gathered full model equals the one selected without FSDP
    assert out[0]["hf"]["sharded"] == "DTensor"
    expected_plan = select(net, examples, world_size=2, model_id=compute_model_id(net), **SELECT)
    plan = Plan.load(tmp_path / "hf" / "plan")
    assert [p.tolist() for p in plan.rank_indices] == [p.tolist() for p in expected_plan.rank_indices]
    assert np.array_equal(plan.weights, expected_plan.weights)
    assert plan.model_id.split("@")[-1] == expected_plan.model_id.split("@")[-1]  # the same weights hash
    g0, g1 = (torch.tensor(out[r]["hf"]["grad"], dtype=torch.float64) for r in range(2))
    assert torch.equal(g0, g1)
    expected = tiny_sft.expected_gradient(net, examples, plan)
    scale = max(1.0, expected.abs().max().item())
    assert (g0 - expected).abs().max().item() <= 1e-6 * scale
    plain = tiny_sft.expected_gradient(net, examples, tiny_sft.equal_size_plan(plan))
    assert (g0 - plain).abs().max().item() > 1e-3 * scale  # the weights matter

    # ClusterSFTTrainer: the same on TRL's tokens, through TRL's fused LM head
    sft_net = tiny_sft.model(len(tok))
    sft_ex = sft_examples(sft_net, raw, args=trl.SFTConfig(output_dir=str(tmp_path / "prep"), assistant_only_loss=True,
                                                           max_length=None, bf16=False, use_cpu=True, report_to=[]),
                          processing_class=tok)
    expected_plan = select(sft_net, sft_ex, world_size=2, model_id=compute_model_id(sft_net), **SELECT)
    plan = Plan.load(tmp_path / "sft" / "plan")
    assert [p.tolist() for p in plan.rank_indices] == [p.tolist() for p in expected_plan.rank_indices]
    g0, g1 = (torch.tensor(out[r]["sft"]["grad"], dtype=torch.float64) for r in range(2))
    assert torch.equal(g0, g1)
    add_fused_lm_head(sft_net)
    expected = tiny_sft.expected_gradient(sft_net, sft_ex, plan, loss=tiny_sft.trl_loss)
    assert (g0 - expected).abs().max().item() <= 1e-6 * max(1.0, expected.abs().max().item())
    for r in range(2):
        assert len(out[r]["hf"]["losses"]) == len(out[r]["sft"]["losses"]) == 1
        assert np.isfinite(out[r]["hf"]["losses"] + out[r]["sft"]["losses"]).all()
