"""ClusterTrainer / ClusterSFTTrainer selecting at train begin featurize the model where and as the Trainer placed it:
its device and dtype, never a float32 or host copy (issue 21)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_hf as hf_t  # noqa: E402

import clusterlm.integrations.hf as hf  # noqa: E402
from clusterlm.integrations.hf import ClusterTrainer  # noqa: E402


def _recording_select(monkeypatch, run_real: bool = True) -> list[dict]:
    """Patch the select the trainers call: record the model's device/dtype and the dtype asked for."""
    seen: list[dict] = []
    real = hf.select

    def spy(model, data, **kwargs):
        p = next(model.parameters())
        seen.append({"model": model, "device": p.device, "dtype": p.dtype, "asked": kwargs.get("dtype")})
        if not run_real:
            raise _Stop
        return real(model, data, **kwargs)

    monkeypatch.setattr(hf, "select", spy)
    return seen


class _Stop(Exception):
    pass


SELECT_NO_HASH = {"budget": 8, "progress": False, "model_id": "tiny"}  # an id given: no weights to hash


def test_cluster_trainer_features_in_the_trainers_dtype_on_its_device(tmp_path, monkeypatch):
    seen = _recording_select(monkeypatch)
    model = hf_t._model().to(torch.bfloat16)
    trainer = ClusterTrainer(model=model, args=hf_t._args(tmp_path, max_steps=1), train_dataset=hf_t._examples(),
                             select_kwargs={"budget": 8, "dim": (4, 4), "progress": False})
    trainer.prepare_plan()
    assert len(seen) == 1 and seen[0]["model"] is trainer.accelerator.unwrap_model(trainer.model)
    assert seen[0]["dtype"] is torch.bfloat16 and seen[0]["device"] == trainer.args.device
    assert seen[0]["asked"] is None  # no dtype forced: the featurizer runs in the model's own
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # nothing converted behind the Trainer's back
    assert trainer.plan.n_selected == 8


def test_a_model_already_on_an_accelerator_is_not_moved_to_the_cpu(tmp_path, monkeypatch):
    """The Trainer placed the model on its device (meta stands in for cuda here): selection leaves it there."""
    seen = _recording_select(monkeypatch, run_real=False)
    trainer = ClusterTrainer(model=hf_t._model(), args=hf_t._args(tmp_path, max_steps=1),
                             train_dataset=hf_t._examples(), select_kwargs=SELECT_NO_HASH)
    model = trainer.accelerator.unwrap_model(trainer.model).to("meta")
    moves = []
    monkeypatch.setattr(model, "to", lambda *a, **k: moves.append((a, k)) or model)
    monkeypatch.setattr(type(trainer.args), "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(_Stop):
        trainer._select_plan(model)
    assert seen[0]["device"].type == "meta" and moves == []


def test_an_unplaced_fsdp_model_features_on_the_accelerator_and_goes_back(tmp_path, monkeypatch):
    """Under FSDP the gathered copy sits on the host: it visits the rank's device for the features, then returns."""
    seen = _recording_select(monkeypatch, run_real=False)
    trainer = ClusterTrainer(model=hf_t._model(), args=hf_t._args(tmp_path, max_steps=1),
                             train_dataset=hf_t._examples(), select_kwargs=SELECT_NO_HASH)
    model = trainer.accelerator.unwrap_model(trainer.model)
    moves = []
    monkeypatch.setattr(model, "to", lambda *a, **k: moves.append(a[0]) or model)
    monkeypatch.setattr(type(trainer.args), "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(trainer, "is_fsdp_enabled", True, raising=False)
    with pytest.raises(_Stop):
        trainer._select_plan(model)
    assert moves == [torch.device("cuda", 0), "cpu"] and len(seen) == 1


def test_cluster_sft_trainer_features_in_the_trainers_dtype(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    import test_trl as trl_t
    import tiny_sft

    from clusterlm.integrations.trl import ClusterSFTTrainer

    seen = _recording_select(monkeypatch)
    tok = tiny_sft.tokenizer()
    model = tiny_sft.model(len(tok)).to(torch.bfloat16)
    trainer = ClusterSFTTrainer(model=model, args=trl_t._config(tmp_path, "messages"),
                                train_dataset=tiny_sft.records("messages"), processing_class=tok,
                                select_kwargs={"budget": 8, "dim": (4, 4), "progress": False})
    trainer.prepare_plan()
    assert len(seen) == 1 and seen[0]["dtype"] is torch.bfloat16 and seen[0]["device"] == trainer.args.device
    assert seen[0]["asked"] is None and trainer.plan.n_selected == 8
    assert {p.dtype for p in trainer.accelerator.unwrap_model(trainer.model).parameters()} == {torch.bfloat16}
