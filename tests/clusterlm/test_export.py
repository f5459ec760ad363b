"""clusterlm.integrations.export: a plan as one data set in interleaved global order with a weight column.

Accelerate's batch sharding and DistributedSampler(shuffle=False) hand every rank exactly its plan-sampler
order; the CLI writes save_to_disk + JSONL + a manifest; a plain transformers.Trainer and an accelerate loop
trained on the export under 2 gloo processes see their plan lists and produce the DDP gradient
sum_k (n_k / N) g_k."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")

import tiny_sft  # noqa: E402
from accelerate.data_loader import prepare_data_loader  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from clusterlm.cli.commands import main  # noqa: E402
from clusterlm.data import SFTDataset, load_data  # noqa: E402
from clusterlm.integrations.export import EXPORT_COLUMNS, ExportConfig, export_files, export_order, plan_to_dataset  # noqa: E402
from clusterlm.plan import Plan  # noqa: E402
from clusterlm.plan.sampler import PlanSampler  # noqa: E402


def _data() -> tuple[SFTDataset, Plan]:
    data = load_data(tiny_sft.token_examples(), max_length=None, progress=False)
    return data, tiny_sft.two_cluster_plan(data)


def _expected(plan: Plan, rank: int, epochs: int, per_epoch: int | None = None, seed: int = 0) -> list[int]:
    sampler = PlanSampler(plan, rank, seed=seed)
    return [int(i) for e in range(epochs) for i in sampler.order(e)[:per_epoch]]


def _rows_of(loader) -> list[int]:
    return [int(i) for batch in loader for i in batch]


@pytest.mark.parametrize("batch_size", [1, 2, 4])
def test_accelerate_sharding_gives_every_rank_its_plan_order(batch_size):
    data, plan = _data()
    ds = plan_to_dataset(plan, data, batch_size=batch_size, epochs=2)
    assert len(ds) == 2 * plan.n_selected
    assert set(EXPORT_COLUMNS) | {"weight", "input_ids", "labels"} == set(ds.column_names)
    index = np.array(ds["plan_index"])
    np.testing.assert_array_equal(ds["weight"], plan.weights[index])
    for rank in range(2):
        expected = _expected(plan, rank, epochs=2)
        # Accelerate's default: rank r takes the r-th batch of B rows of every group of K batches
        rows = _rows_of(prepare_data_loader(DataLoader(range(len(ds)), batch_size=batch_size), num_processes=2,
                                            process_index=rank, put_on_device=False))
        assert index[rows].tolist() == expected
        assert set(np.array(ds["plan_rank"])[rows].tolist()) == {rank}
        # split_batches: the loader's batch of K*B rows is cut into K slices of B
        rows = _rows_of(prepare_data_loader(DataLoader(range(len(ds)), batch_size=2 * batch_size), num_processes=2,
                                            process_index=rank, split_batches=True, put_on_device=False))
        assert index[rows].tolist() == expected
        if batch_size == 1:  # DistributedSampler deals rows r, r+K, ...
            sampler = DistributedSampler(range(len(ds)), num_replicas=2, rank=rank, shuffle=False)
            assert index[list(sampler)].tolist() == expected
    # the epochs are reshuffled (like the plan sampler), and shuffle=False repeats the plan order
    assert _expected(plan, 0, 1) != _expected(plan, 0, 2)[4:]
    flat = plan_to_dataset(plan, data, batch_size=batch_size, epochs=2, shuffle=False)
    rows = _rows_of(prepare_data_loader(DataLoader(range(len(flat)), batch_size=batch_size), num_processes=2,
                                        process_index=1, put_on_device=False))
    assert np.array(flat["plan_index"])[rows].tolist() == plan.indices(1).tolist() * 2


def test_layout_refusals_and_drop_last():
    data, plan = _data()
    with pytest.raises(ValueError, match="not a multiple of batch_size=3.*drop_last=True"):
        export_order(plan, batch_size=3)
    order = export_order(plan, batch_size=3, epochs=2, drop_last=True, seed=5)
    assert len(order["plan_index"]) == 2 * 2 * 3
    rank1 = order["plan_index"][order["plan_rank"] == 1].tolist()
    assert rank1 == _expected(plan, 1, epochs=2, per_epoch=3, seed=5)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        export_order(plan, batch_size=0)
    # other data, a raw source of another size, and a column that is already there
    other = load_data(tiny_sft.token_examples(seed=1), max_length=None, progress=False)
    with pytest.raises(ValueError, match="content hash differs"):
        plan_to_dataset(plan, other)
    with pytest.raises(ValueError, match="made for 16 examples, the data set has 15 rows"):
        plan_to_dataset(plan, [{"prompt": "p", "response": "r"}] * 15)
    # raw rows of a plan whose selection skipped empty answers: the count gap is explained, with the fix
    plan.config["data"] = {"n_empty": 2}
    with pytest.raises(ValueError, match="skipped the 2 rows with an empty answer; pass the model") as info:
        plan_to_dataset(plan, [{"prompt": "p", "response": "r"}] * 18)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="made for 16 examples, the data set has 17 rows"):
        plan_to_dataset(plan, [{"prompt": "p", "response": "r"}] * 17)
    del plan.config["data"]
    with pytest.raises(ValueError, match=r"already has the column\(s\) \['weight'\]"):
        plan_to_dataset(plan, [{"prompt": "p", "response": "r", "weight": 1.0}] * 16)


def test_export_config_plus_overrides_is_the_keyword_call(tmp_path):
    data, plan = _data()
    config = ExportConfig(batch_size=3, drop_last=True)
    by_config = export_order(plan, config, epochs=2, seed=5)
    by_keyword = export_order(plan, batch_size=3, epochs=2, drop_last=True, seed=5)
    assert by_config.keys() == by_keyword.keys()
    for name in by_keyword:
        np.testing.assert_array_equal(by_config[name], by_keyword[name])
    assert config.epochs == 1 and config.replace(epochs=2).epochs == 2  # overrides make a copy
    ds = plan_to_dataset(plan, data, ExportConfig(batch_size=2, weight_column="w"), epochs=2)
    assert ds.to_dict() == plan_to_dataset(plan, data, batch_size=2, epochs=2, weight_column="w").to_dict()
    # the files: the manifest records the same settings either way
    plan.save(tmp_path / "plan")
    tokenized = tmp_path / "tok.jsonl"
    tokenized.write_text("".join(json.dumps(ex) + "\n" for ex in tiny_sft.token_examples()))
    export_files(tmp_path / "plan", str(tokenized), tmp_path / "a", batch_size=2, epochs=3, seed=7, shuffle=False)
    _, verified = export_files(tmp_path / "plan", str(tokenized), tmp_path / "b",
                               ExportConfig(batch_size=2, epochs=3, shuffle=False), seed=7)
    assert verified
    assert (tmp_path / "a" / "train.jsonl").read_text() == (tmp_path / "b" / "train.jsonl").read_text()
    manifest = json.loads((tmp_path / "b" / "export.json").read_text())
    assert manifest == json.loads((tmp_path / "a" / "export.json").read_text())
    assert (manifest["batch_size"], manifest["epochs"], manifest["seed"], manifest["shuffle"]) == (2, 3, 7, False)


def test_export_unknown_settings_are_named():
    data, plan = _data()
    with pytest.raises(TypeError, match=r"unknown setting\(s\) batchsize; the settings are batch_size, epochs, .*"
                                        r"\(ExportConfig\)"):
        export_order(plan, batchsize=2)
    with pytest.raises(TypeError, match=r"unknown setting\(s\) max_len"):  # before the plan is read
        export_files("no-such-plan", data, "out", max_len=16)
    with pytest.raises(TypeError, match="config must be an ExportConfig or None, got int"):
        plan_to_dataset(plan, data, 2)


def test_cli_export_writes_dataset_jsonl_and_manifest(tmp_path, capsys):
    data, plan = _data()
    plan.save(tmp_path / "plan")
    # a tokenised JSONL file: the fingerprint is verified
    tokenized = tmp_path / "tok.jsonl"
    tokenized.write_text("".join(json.dumps(ex) + "\n" for ex in tiny_sft.token_examples()))
    assert main(["export", "--plan", str(tmp_path / "plan"), "--data", str(tokenized), "--out", str(tmp_path / "e"),
                 "--batch-size", "2", "--epochs", "3", "--seed", "7"]) == 0
    assert "plan fingerprint verified" in capsys.readouterr().out
    saved = datasets.load_from_disk(str(tmp_path / "e" / "dataset"))
    lines = [json.loads(line) for line in (tmp_path / "e" / "train.jsonl").read_text().splitlines()]
    expected = plan_to_dataset(plan, data, batch_size=2, epochs=3, seed=7)
    assert saved["plan_index"] == [r["plan_index"] for r in lines] == expected["plan_index"]
    assert [r["weight"] for r in lines] == expected["weight"] and lines[0]["input_ids"] == expected[0]["input_ids"]
    manifest = json.loads((tmp_path / "e" / "export.json").read_text())
    assert manifest["rows"] == 3 * plan.n_selected and manifest["batch_size"] == 2 and manifest["world_size"] == 2
    assert manifest["content_verified"] is True and manifest["plan_fingerprint"] == plan.fingerprint
    # raw records (a save_to_disk directory of them): exported as they are, only their number is checked
    raw = datasets.Dataset.from_list([{"prompt": f"p{i}", "response": f"r{i}"} for i in range(16)])
    raw.save_to_disk(str(tmp_path / "raw"))
    assert main(["export", "--plan", str(tmp_path / "plan"), "--data", str(tmp_path / "raw"), "--out",
                 str(tmp_path / "e2"), "--no-shuffle"]) == 0
    assert "only their number" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "e2" / "train.jsonl").read_text().splitlines()]
    interleaved = [int(i) for pair in zip(plan.indices(0), plan.indices(1), strict=True) for i in pair]
    assert [r["prompt"] for r in rows] == [f"p{i}" for i in interleaved]
    assert [r["plan_rank"] for r in rows] == [0, 1] * plan.per_rank
    # --model: raw rows are tokenised as clusterlm select does, verified, and exported with their tokens
    tok = tiny_sft.tokenizer()
    tiny_sft.model(len(tok), dtype=torch.float32).save_pretrained(str(tmp_path / "model"))
    tok.save_pretrained(str(tmp_path / "model"))
    records = [{"prompt": f"why {w}", "response": f" the {w}"} for w in tiny_sft.WORDS[:16]]
    (tmp_path / "raw.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tokens = load_data(records, tok, max_length=None, progress=False)
    tiny_sft.two_cluster_plan(tokens).save(tmp_path / "plan2")
    assert main(["export", "--plan", str(tmp_path / "plan2"), "--data", str(tmp_path / "raw.jsonl"), "--out",
                 str(tmp_path / "e3"), "--model", str(tmp_path / "model")]) == 0
    assert "plan fingerprint verified" in capsys.readouterr().out
    first = json.loads((tmp_path / "e3" / "train.jsonl").read_text().splitlines()[0])
    assert first["prompt"] == records[first["plan_index"]]["prompt"]
    assert first["input_ids"] == tokens[first["plan_index"]]["input_ids"].tolist()
    # other data than the plan's: one line and exit status 2 (clusterlm's user errors)
    assert main(["export", "--plan", str(tmp_path / "plan2"), "--data", str(tmp_path / "raw.jsonl"), "--out",
                 str(tmp_path / "e4"), "--model", str(tmp_path / "model"), "--chat-template", "off"]) == 2
    assert "clusterlm export: error: " in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# 2 processes: a plain transformers.Trainer and an accelerate loop on the export
# ---------------------------------------------------------------------------------------------------

_RANKS_SCRIPT = r'''
import json, sys
from pathlib import Path
import datasets, torch
import tiny_sft
from accelerate import Accelerator
from transformers import Trainer, TrainerCallback, TrainingArguments
import clusterlm

out = Path(sys.argv[1])
ds = datasets.load_from_disk(str(out / "export" / "dataset"))


def collate(rows):  # pad the tokens, keep the weight and the source row
    batch = clusterlm.collate(rows)
    batch["weight"] = torch.tensor([r["weight"] for r in rows], dtype=torch.float64)
    batch["plan_index"] = torch.tensor([r["plan_index"] for r in rows])
    return batch


class WeightedTrainer(Trainer):
    """The README's plain-Trainer recipe: loss = mean_b(weight_b * loss_b), counted per example."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.model_accepts_loss_kwargs = False  # no token count: the Trainer divides by the accumulation steps
        self.seen = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.seen += inputs.pop("plan_index").tolist()
        weights, labels = inputs.pop("weight"), inputs.pop("labels")
        logits = model(**inputs).logits
        loss = clusterlm.weighted_loss(clusterlm.per_example_loss(logits, labels), weights)
        return (loss, None) if return_outputs else loss


class GradOfFirstStep(TrainerCallback):
    grad = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        if self.grad is None:  # DDP has averaged the gradients over the ranks by now
            self.grad = torch.cat([p.grad.flatten() for p in model.parameters()]).tolist()


grab = GradOfFirstStep()
args = TrainingArguments(output_dir=str(out / "hf"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         num_train_epochs=1, train_sampling_strategy="sequential", remove_unused_columns=False,
                         learning_rate=1e-3, max_grad_norm=0.0, report_to=[], use_cpu=True, save_strategy="no",
                         disable_tqdm=True, ddp_backend="gloo", ddp_find_unused_parameters=False, logging_steps=1)
trainer = WeightedTrainer(model=tiny_sft.model(128), args=args, train_dataset=ds, data_collator=collate,
                          callbacks=[grab])
trainer.train()
rank = args.process_index

# the same with a hand-written accelerate loop: prepare() shards the batches, one optimizer step = 2 micro-batches
accelerator = Accelerator(cpu=True)
model = tiny_sft.model(128)
model, loader = accelerator.prepare(model, torch.utils.data.DataLoader(ds, batch_size=2, collate_fn=collate))
seen, micro = [], []
for batch in loader:
    seen += batch.pop("plan_index").tolist()
    micro.append(batch)
for j, batch in enumerate(micro[:2]):
    weights, labels = batch.pop("weight"), batch.pop("labels")
    loss = clusterlm.weighted_loss(clusterlm.per_example_loss(model(**batch).logits, labels), weights) / 2
    if j == 0:
        with accelerator.no_sync(model):
            accelerator.backward(loss)
    else:
        accelerator.backward(loss)
grad = torch.cat([p.grad.flatten() for p in accelerator.unwrap_model(model).parameters()]).tolist()
(out / f"rank{rank}.json").write_text(json.dumps({"trainer_seen": trainer.seen, "trainer_grad": grab.grad,
                                                  "loop_seen": seen, "loop_grad": grad}))
'''


@pytest.mark.slow
def test_trainer_and_accelerate_loop_on_the_export_train_the_plan(tmp_path):
    data, plan = _data()
    plan.save(tmp_path / "plan")
    ds = plan_to_dataset(plan, data, batch_size=2, epochs=2)
    ds.save_to_disk(str(tmp_path / "export" / "dataset"))
    tiny_sft.run_two_ranks(_RANKS_SCRIPT, tmp_path)

    expected_grad = tiny_sft.expected_gradient(tiny_sft.model(128), data, plan)
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank in range(2):
        assert out[rank]["trainer_seen"] == out[rank]["loop_seen"] == _expected(plan, rank, epochs=2)
    tol = 1e-6 * max(1.0, expected_grad.abs().max().item())
    for key in ("trainer_grad", "loop_grad"):
        g0, g1 = torch.tensor(out[0][key], dtype=torch.float64), torch.tensor(out[1][key], dtype=torch.float64)
        assert torch.equal(g0, g1), key
        assert (g0 - expected_grad).abs().max().item() <= tol, key
    # the weights matter: the unweighted average of the two ranks' gradients is far from it
    plain = tiny_sft.expected_gradient(tiny_sft.model(128), data, tiny_sft.equal_size_plan(plan))
    assert (plain - expected_grad).abs().max().item() > 100 * tol

