"""``clusterlm train --fsdp`` (FSDP2): 2 gloo ranks on CPU against the DDP trainer, sharded checkpoints and exact
resume, the final Hugging Face directory, the gradient identity, Adafactor on shards, and the refusals.

Tolerances. FSDP reduce-scatters where DDP all-reduces and sums the gradient norm shard by shard, so float32
results differ in the last bits: per-step losses within 1e-5 (observed <= 1.2e-6 on losses of about 8 over 5
AdamW steps), gradient norms within 1e-4 relative. A resumed FSDP run equals the uninterrupted one to 1e-6 (as the
DDP test asks; observed: bit for bit). The gradient identity holds to 1e-6 (float64 toy model).
"""

from __future__ import annotations

import gc
import json
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import test_train
import torch
from test_train import MAX_LENGTH, _config, _records, _tiny_model, _ToyLM, _train, _weight_plan

from clusterlm.cli import commands as cli
from clusterlm.cli.options import parse_config
from clusterlm.comparison import run as compare_run
from clusterlm.config.training import LATEST, TRAIN_CONFIG, TrainConfig
from clusterlm.engine.fsdp import (
    STATE_FILE,
    ShardedAdafactor,
    decoder_blocks,
    remove_partial_checkpoints,
)
from clusterlm.engine.step import (
    CKPT_DIR,
    build_optimizer,
    evaluate,
    find_checkpoint,
    forward_backward,
    make_micro_batches,
)
from clusterlm.launch.launcher import SpawnFailed
from clusterlm.training import run as train_launch
from clusterlm.training.metrics import SUMMARY

STEPS = 5
env = test_train.env  # the 2-rank demo subset and plans of the DDP trainer's tests (a session fixture)


def _argv(env, out: Path, *extra: str) -> list[str]:
    # 40 examples per rank, 4 per step in 2 micro-batches (gradient accumulation), held-out evaluation
    return ["--plan", str(env.plans[2]), "--model", "tiny-llama", "--data", str(env.train), "--out", str(out),
            "--max-length", str(MAX_LENGTH), "--no-progress", "--eval-data", str(env.heldout), "--max-steps",
            str(STEPS), "--micro-batch-size", "2", "--grad-accum", "2", "--lr", "3e-3", "--warmup-steps", "2",
            "--log-every", "1", *extra]


def _launch(argv: list[str], nproc: int) -> int:
    """:func:`clusterlm.train` of ``clusterlm train ARGV`` on ``nproc`` ranks: 0, or the failed ranks' status."""
    try:
        train_launch.train(_config(argv).replace(nproc=nproc))
    except SpawnFailed as e:
        return e.code
    return 0


@pytest.fixture(scope="module")
def runs(env):
    """The same 5 steps under DDP and under FSDP (checkpoints at 2, 4, 5; the final model), on 2 gloo ranks."""
    ddp, fsdp = env.root / "fsdp_ref_ddp", env.root / "fsdp_run"
    assert train_launch.train(_config(_argv(env, ddp)).replace(nproc=2)).steps == STEPS
    assert train_launch.train(_config(_argv(env, fsdp, "--fsdp", "--save-every", "2", "--keep-checkpoints", "3"))
                              .replace(nproc=2)).steps == STEPS
    return SimpleNamespace(ddp=ddp, fsdp=fsdp)


# ---------------------------------------------------------------------------------------------------
# 2 ranks: FSDP = DDP, sharded checkpoints, exact resume, the final model
# ---------------------------------------------------------------------------------------------------


def test_fsdp_losses_equal_ddp_losses(runs):
    ddp, fsdp = _records(runs.ddp, "train"), _records(runs.fsdp, "train")
    assert [r["step"] for r in fsdp] == list(range(1, STEPS + 1))
    for a, b in zip(ddp, fsdp, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
        assert abs(a["loss_unweighted"] - b["loss_unweighted"]) <= 1e-5
        assert a["lr"] == b["lr"] and a["tokens"] == b["tokens"] and a["step_tokens"] == b["step_tokens"]
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"]
    assert fsdp[-1]["loss"] < fsdp[0]["loss"] - 0.5  # it learns
    ddp_eval, fsdp_eval = _records(runs.ddp, "eval"), _records(runs.fsdp, "eval")
    assert [r["step"] for r in fsdp_eval] == [0, STEPS]
    assert np.allclose([r["eval_loss"] for r in ddp_eval], [r["eval_loss"] for r in fsdp_eval], rtol=0, atol=1e-5)
    args = json.loads((runs.fsdp / "args.json").read_text())
    assert args["fsdp"] is True and args["world_size"] == 2


def test_sharded_checkpoints_and_exact_resume(env, runs, tmp_path):
    ckpt = runs.fsdp / CKPT_DIR
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == [LATEST, "step_0000002", "step_0000004", "step_0000005"]  # no partial directory left
    assert (ckpt / LATEST).read_text().strip() == "step_0000005"
    for step in ("step_0000002", "step_0000005"):
        files = sorted(p.name for p in (ckpt / step).iterdir())
        assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", STATE_FILE]  # one shard file per rank
    state = torch.load(ckpt / "step_0000002" / STATE_FILE, weights_only=False)
    assert state["step"] == 2 and state["setup"]["fsdp"] is True and len(state["rng"]) == 2
    assert "model" not in state and "optimizer" not in state  # those are the shards

    # resume from step 2 of a copy: steps 3-5 as the uninterrupted run, and a partial directory is cleared
    out = tmp_path / "resumed"
    shutil.copytree(runs.fsdp, out)
    for name in ("step_0000004", "step_0000005", "model"):
        shutil.rmtree(out / CKPT_DIR / name if name.startswith("step") else out / name)
    (out / SUMMARY).unlink()
    (out / CKPT_DIR / LATEST).write_text("step_0000002\n")
    (out / CKPT_DIR / ".step_0000004.partial").mkdir()  # what a run killed while checkpointing leaves
    assert _launch(_argv(env, out, "--fsdp", "--save-every", "2", "--keep-checkpoints", "3", "--resume",
                          "--no-save-model"), 2) == 0
    ref, res = _records(runs.fsdp, "train"), _records(out, "train")
    assert [r["step"] for r in res] == list(range(1, STEPS + 1))
    for a, b in zip(ref, res, strict=True):
        for key in ("loss", "loss_unweighted", "lr", "grad_norm", "tokens"):
            assert abs(a[key] - b[key]) <= 1e-6, (a["step"], key, a[key], b[key])
    assert abs(_records(runs.fsdp, "eval")[-1]["eval_loss"] - _records(out, "eval")[-1]["eval_loss"]) <= 1e-6
    assert not (out / CKPT_DIR / ".step_0000004.partial").exists()
    assert json.loads((out / SUMMARY).read_text())["resumed_from"].endswith("step_0000002")


def test_final_model_is_a_loadable_hugging_face_directory(env, runs):
    from transformers import AutoModelForCausalLM

    from clusterlm.data import load_data
    from clusterlm.launch.launcher import DistInfo
    from clusterlm.models import load_model

    model, tokenizer, _ = load_model(str(runs.fsdp / "model"))
    hf = AutoModelForCausalLM.from_pretrained(str(runs.fsdp / "model"))
    ddp, _, _ = load_model(str(runs.ddp / "model"))
    state, hf_state, ddp_state = model.state_dict(), hf.state_dict(), ddp.state_dict()
    assert set(state) == set(ddp_state) and all(torch.equal(state[k], hf_state[k]) for k in state)
    assert max((state[k] - ddp_state[k]).abs().max().item() for k in state) <= 1e-4  # the trained weights
    heldout = load_data(env.heldout, tokenizer, max_length=MAX_LENGTH, progress=False)
    loss, _ = evaluate(model, heldout, DistInfo(0, 1, 0, None), batch_size=8, pad_id=tokenizer.pad_token_id)
    summary = json.loads((runs.fsdp / SUMMARY).read_text())
    assert abs(loss - summary["final_eval_loss"]) <= 1e-5


def test_lora_adafactor_gradient_checkpointing_bf16(env, tmp_path):
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "lora"
    argv = _argv(env, out, "--fsdp", "--lora-r", "4", "--lora-targets", "q_proj,v_proj", "--optimizer",
                 "adafactor", "--lr", "1e-2", "--gradient-checkpointing", "--bf16", "on", "--save-every", "2",
                 "--eval-max-examples", "8")
    argv[argv.index("--max-steps") + 1] = "3"
    assert _launch(argv, 2) == 0
    train = _records(out, "train")
    assert [r["step"] for r in train] == [1, 2, 3] and np.isfinite([r["loss"] for r in train]).all()
    assert (out / "model" / "adapter_config.json").is_file()  # the adapter, as without --fsdp
    keys = dcp.FileSystemReader(str(out / CKPT_DIR / "step_0000003")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)  # only the trainable parameters are saved
    assert any(k.startswith("optimizer.state.") and k.endswith("row_var") for k in keys)  # Adafactor's factors


# ---------------------------------------------------------------------------------------------------
# The sharded gradient = sum_k (n_k / N) g_k; Adafactor on shards; evaluation with unequal shares
# ---------------------------------------------------------------------------------------------------


class _BlockToyLM(_ToyLM):
    """The toy LM with decoder "blocks" (its Linear layers) for shard_model."""

    _no_split_modules = ["Linear"]


def _toy() -> torch.nn.Module:
    model = _BlockToyLM()
    model.load_state_dict(_tiny_model().float().state_dict())
    return model.double()


def _fsdp_grad_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from clusterlm.engine.fsdp import shard_model
    from clusterlm.launch.launcher import DistInfo

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    di = DistInfo(rank, 2, rank, "gloo")
    examples, plan = _weight_plan()
    model = shard_model(_toy(), di, bf16=False)
    # 5 examples: rank 0 evaluates 3 (2 batches), rank 1 evaluates 2 (1 batch) and runs one extra forward
    evaluation = evaluate(model, examples[:5], di, batch_size=2, pad_id=0)
    idx = plan.indices(rank)
    micro = make_micro_batches(examples, idx, plan.weights, 4, 0, torch.device("cpu"))  # 4, 4, 2: accumulation
    forward_backward(model, micro, n_step=len(idx))
    grads = torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])
    optimizer = build_optimizer(model, lr=1e-2, kind="adafactor")
    optimizer.step()
    params = torch.cat([p.full_tensor().flatten() for p in model.parameters()])
    torch.save({"grads": grads, "params": params, "optimizer": type(optimizer).__name__, "eval": evaluation},
               Path(out_dir) / f"fsdp{rank}.pt")
    # Release what holds the group before it goes down (FSDP's hooks form reference cycles: collect them), and let
    # both ranks finish their last collective first: a peer's group torn down under a running all-gather aborts.
    del model, optimizer
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp_gradient_is_cluster_size_weighted_mean_and_adafactor_matches(tmp_path):
    import torch.multiprocessing as mp

    from clusterlm.engine.loss import per_example_loss
    from clusterlm.launch.launcher import DistInfo

    mp.spawn(_fsdp_grad_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"fsdp{r}.pt", weights_only=False) for r in range(2))
    assert torch.equal(r0["grads"], r1["grads"]) and r0["optimizer"] == "ShardedAdafactor"

    examples, plan = _weight_plan()
    model = _toy()
    expected = torch.zeros_like(r0["grads"])
    for rank in range(2):
        idx = plan.indices(rank)
        (cluster,) = np.unique(plan.cluster_labels[idx])
        n_k = int((plan.cluster_labels == cluster).sum())
        model.zero_grad()
        for i in idx:  # the plain mean gradient of cluster k's selected examples, one at a time
            ids = torch.as_tensor(examples[int(i)]["input_ids"])[None]
            loss = per_example_loss(model(input_ids=ids).logits, torch.as_tensor(examples[int(i)]["labels"])[None])[0]
            (loss / len(idx)).backward()
        expected += (n_k / len(examples)) * torch.cat([p.grad.flatten() for p in model.parameters()])
    assert (r0["grads"] - expected).abs().max().item() <= 1e-6 * max(1.0, expected.abs().max().item())

    # Adafactor on the shards = torch's Adafactor on the whole tensors with the same gradients
    offset = 0
    for p in model.parameters():
        p.grad = r0["grads"][offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    build_optimizer(model, lr=1e-2, kind="adafactor").step()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert (r0["params"] - params).abs().max().item() <= 1e-9 * max(1.0, params.abs().max().item())
    # evaluation with unequal shares per rank equals the single-process one
    loss, n_tok = evaluate(_toy(), examples[:5], DistInfo(0, 1, 0, None), batch_size=2, pad_id=0)
    assert r0["eval"][1] == r1["eval"][1] == n_tok and abs(r0["eval"][0] - loss) <= 1e-9


def test_sharded_adafactor_equals_torch_adafactor_on_plain_tensors():
    torch.manual_seed(0)
    params = [torch.randn(6, 5), torch.randn(7), torch.randn(3, 4, 5)]
    mine = [p.clone().requires_grad_() for p in params]
    ref = [p.clone().requires_grad_() for p in params]
    a = ShardedAdafactor(mine, lr=1e-2, weight_decay=0.1)
    b = torch.optim.Adafactor(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        for p, q, g in zip(mine, ref, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    assert all(torch.equal(p, q) for p, q in zip(mine, ref, strict=True))
    assert all(torch.equal(a.state[p][k], b.state[q][k]) for p, q in zip(mine, ref, strict=True) for k in b.state[q])


# ---------------------------------------------------------------------------------------------------
# Refusals, before any model loads (in this process)
# ---------------------------------------------------------------------------------------------------


def test_blocks_not_found_is_refused_naming_the_attribute(env, tmp_path, capfd):
    from transformers import BioGptConfig

    model_dir = tmp_path / "biogpt"  # a causal LM class without _no_split_modules; its config alone, no weights
    BioGptConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=32).save_pretrained(model_dir)
    t0 = time.perf_counter()
    argv = _argv(env, tmp_path / "a", "--fsdp", "--nproc", "2")
    argv[argv.index("--model") + 1] = str(model_dir)
    assert _train(argv) == 2
    assert time.perf_counter() - t0 < 10
    err = capfd.readouterr().err
    assert "_no_split_modules" in err and "BioGptForCausalLM" in err and "without --fsdp" in err

    toy = _ToyLM()
    toy._no_split_modules = ["LlamaDecoderLayer"]
    with pytest.raises(ValueError, match=r"_no_split_modules.*_ToyLM it lists \['LlamaDecoderLayer'\]"):
        decoder_blocks(toy)
    assert [type(b).__name__ for b in decoder_blocks(_BlockToyLM())] == ["Linear", "Linear"]


def test_resume_across_ddp_and_fsdp_and_world_size_refused(env, tmp_path, capfd):
    ddp_out, fsdp_out = tmp_path / "ddp", tmp_path / "fsdp"
    (ddp_out / CKPT_DIR).mkdir(parents=True)
    (ddp_out / CKPT_DIR / "step_0000002.pt").write_bytes(b"x")
    (ddp_out / CKPT_DIR / LATEST).write_text("step_0000002.pt\n")
    (fsdp_out / CKPT_DIR / "step_0000002").mkdir(parents=True)
    (fsdp_out / CKPT_DIR / "step_0000002" / STATE_FILE).write_bytes(b"x")
    t0 = time.perf_counter()
    assert _train(_argv(env, ddp_out, "--fsdp", "--nproc", "2", "--resume")) == 2
    err = capfd.readouterr().err
    assert "step_0000002.pt is a DDP checkpoint" in err and "--fsdp" in err and len(err.strip().splitlines()) == 1
    assert _train(_argv(env, fsdp_out, "--nproc", "2", "--resume")) == 2
    err = capfd.readouterr().err
    assert "step_0000002 is a sharded FSDP checkpoint" in err and "no --fsdp" in err
    assert _train(_argv(env, fsdp_out, "--nproc", "2", "--resume", str(ddp_out / CKPT_DIR / "step_0000002.pt"),
                        "--fsdp")) == 2
    assert "is a DDP checkpoint" in capfd.readouterr().err
    assert _train(_argv(env, tmp_path / "c", "--fsdp", "--nproc", "3")) == 2  # plan world size 2
    err = capfd.readouterr().err
    assert "world size 2" in err and "world size 3" in err
    assert _train(_argv(env, tmp_path / "d", "--fsdp")) == 2  # one process
    assert "at least 2 processes" in capfd.readouterr().err
    assert time.perf_counter() - t0 < 20  # no process was started, no model loaded


def test_checkpoint_discovery_and_compare_pass_through(env, tmp_path, monkeypatch):
    ckpt = tmp_path / CKPT_DIR
    for step in (2, 4):
        (ckpt / f"step_{step:07d}").mkdir(parents=True)
        (ckpt / f"step_{step:07d}" / STATE_FILE).write_bytes(b"x")
    (ckpt / "step_0000006").mkdir()  # no state file: incomplete, never resumed
    (ckpt / ".step_0000008.partial").mkdir()
    assert find_checkpoint(tmp_path) == ckpt / "step_0000004"
    (ckpt / LATEST).write_text("step_0000002\n")
    assert find_checkpoint(tmp_path) == ckpt / "step_0000002"
    assert find_checkpoint(tmp_path, str(ckpt / "step_0000004")) == ckpt / "step_0000004"
    with pytest.raises(FileNotFoundError, match="sharded checkpoint"):
        find_checkpoint(tmp_path, str(ckpt / "step_0000006"))
    assert remove_partial_checkpoints(ckpt) == [ckpt / ".step_0000008.partial"]

    # --fsdp reaches the config, its file and the ranks that read it
    parser = cli.train_parser()
    config = cli.train_config(parse_config(parser, ["--plan", "p", "--model", "m", "--data", "d", "--out", "o",
                                                    "--fsdp"]))
    assert config.fsdp
    config.save(tmp_path / TRAIN_CONFIG)
    assert TrainConfig.load(tmp_path / TRAIN_CONFIG) == config
    assert cli.train_config(parse_config(parser, ["--config", str(tmp_path / TRAIN_CONFIG)])) == config
    # clusterlm compare --fsdp: every unit's TrainConfig has fsdp=True
    cmp = cli.compare_config(parse_config(cli.compare_parser(), [
        "--model", "tiny-llama", "--data", str(env.train), "--eval-data", str(env.heldout), "--methods", "random",
        "--seeds", "0,", "--world-size", "2", "--max-steps", "1", "--micro-batch-size", "1", "--lr", "1e-4",
        "--out", str(tmp_path / "cmp"), "--fsdp"]))
    assert cmp.train.fsdp
    units = []

    class Stop(Exception):
        pass

    def fake_train(unit, plan=None):
        units.append(unit)
        raise Stop

    monkeypatch.setattr(compare_run, "train", fake_train)
    with pytest.raises(Stop):
        compare_run.compare(cmp)
    (unit,) = units
    assert unit.fsdp and unit.nproc == 2 and unit.lr == 1e-4 and unit.micro_batch_size == 1
