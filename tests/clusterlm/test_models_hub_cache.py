"""Models by hub id from the local Hugging Face cache (offline), one model id however a model was loaded, and the
trainers' refusal of a plan selected with another model."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import tiny_sft  # noqa: E402
from transformers import AutoModelForCausalLM, TrainingArguments  # noqa: E402

from clusterlm.integrations.hf import ClusterTrainer  # noqa: E402
from clusterlm.models import check_model_id, compute_model_id, hf_hub_cache, load_model, model_hash  # noqa: E402

REPO = "tiny-org/tiny-llama-sft"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache in the hub layout holding one model (save_pretrained into its snapshot)."""
    cache = tmp_path / "hf" / "hub"
    repo = cache / ("models--" + REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    tok = tiny_sft.tokenizer()
    tiny_sft.model(len(tok), dtype=torch.float32).save_pretrained(str(snapshot))
    tok.save_pretrained(str(snapshot))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshot


def test_a_cached_hub_id_loads_offline_and_has_one_model_id(hub_cache, tmp_path):
    assert hf_hub_cache() == hub_cache.parents[2]
    model, tokenizer, model_id = load_model(REPO)
    assert model_id.startswith(f"{REPO}@") and tokenizer.chat_template == tiny_sft.CHAT_TEMPLATE
    # the snapshot directory, a Python object from from_pretrained, a bfloat16 load: the same id
    assert load_model(str(hub_cache))[2] == model_id
    assert compute_model_id(AutoModelForCausalLM.from_pretrained(str(hub_cache))) == model_id
    assert load_model(REPO, dtype="bfloat16")[2] == model_id
    # a copy saved elsewhere has another label but the same weights hash, and the trainers accept it
    model.save_pretrained(str(tmp_path / "copy"))
    tokenizer.save_pretrained(str(tmp_path / "copy"))
    copied = load_model(str(tmp_path / "copy"))
    assert copied[2] == f"{(tmp_path / 'copy').resolve()}@{model_hash(model)}"
    assert check_model_id(model_id, copied[0], who="t")
    # one changed weight is another model
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.model.layers[1].mlp.up_proj.weight[3, 5] += 0.5
    assert model_hash(changed) != model_hash(model)
    with pytest.raises(ValueError, match=r"selected with model tiny-org/tiny-llama-sft@.*allow_other_model=True"):
        check_model_id(model_id, changed, who="t")
    assert check_model_id(model_id, changed, who="t", allow_other_model=True)
    assert not check_model_id("", changed, who="t") and not check_model_id("no-hash", changed, who="t")


def test_an_uncached_hub_id_is_one_line_naming_the_fix(hub_cache):
    with pytest.raises(ValueError) as err:
        load_model("tiny-org/not-downloaded")
    message = str(err.value)
    assert "\n" not in message and "hf download tiny-org/not-downloaded" in message
    assert "holds no snapshot" in message and str(hub_cache.parents[2]) in message
    with pytest.raises(ValueError, match="no config.json in it"):
        load_model(str(hub_cache.parent))  # an existing directory that is no model


def test_cluster_trainer_refuses_a_plan_of_another_model(tmp_path):
    examples = tiny_sft.token_examples(vocab=128)
    model = tiny_sft.model(128, dtype=torch.float32)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True)
    other = compute_model_id(tiny_sft.model(128, seed=1, dtype=torch.float32))
    plan = tiny_sft.two_cluster_plan(examples, world_size=1, model_id=other)
    with pytest.raises(ValueError, match="ClusterTrainer: the plan was selected with model .*allow_other_model"):
        ClusterTrainer(model=model, args=args, train_dataset=examples, plan=plan).prepare_plan()
    ClusterTrainer(model=model, args=args, train_dataset=examples, plan=plan, allow_other_model=True).prepare_plan()
    # the id of the model being trained passes, and so does a plan without a weights hash (nothing to check)
    for model_id in (compute_model_id(model), "tiny", ""):
        plan.model_id = model_id
        ClusterTrainer(model=model, args=args, train_dataset=examples, plan=plan).prepare_plan()
