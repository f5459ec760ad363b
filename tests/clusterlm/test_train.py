"""The reference DDP trainer: 2-rank gloo runs, weighted gradients, SIGKILL + resume, refusals, options.

Spawned runs are expensive (each rank imports torch and transformers), so one uninterrupted 2-rank run
serves both as the "finishes, loss decreases, metrics written" test and as the reference of the
kill/resume test; the other checks run the trainer in this process (world size 1).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from clusterlm.cli import commands as cli
from clusterlm.cli.options import parse_config
from clusterlm.config.files import checksum
from clusterlm.config.training import LATEST, TRAIN_CONFIG, TrainConfig
from clusterlm.engine.step import CKPT_DIR, forward_backward, make_micro_batches
from clusterlm.fileio import lock_holder
from clusterlm.launch.launcher import FORWARDED_SIGNALS, PACKAGE_ENTRY, pid_alive, torchrun_command
from clusterlm.training import run as train_launch
from clusterlm.training.metrics import CURVE, METRICS, SUMMARY

MAX_LENGTH = 128
N_TRAIN, N_HELDOUT = 160, 32
STEPS, SAVE_EVERY = 12, 3


# ---------------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def env(demo, tmp_path_factory):
    """Short subsets of both demo splits and plans for world size 1 and 2.

    ``demo`` (tests/clusterlm/conftest.py) builds the demo data once per session under a temporary
    ``CLUSTERLM_HOME``, which the spawned ranks inherit.
    """
    from clusterlm.data import load_data
    from clusterlm.models import load_model
    from clusterlm.selection.select import select_from_features

    root = tmp_path_factory.mktemp("train")
    _, tokenizer, _ = load_model("tiny-llama")
    files = {}
    for split, n in (("train", N_TRAIN), ("heldout", N_HELDOUT)):
        records = demo.records(split)
        full = load_data(records, tokenizer, max_length=None, progress=False)
        short = [r for r, length in zip(records, full.lengths, strict=True) if length <= MAX_LENGTH][:n]
        assert len(short) == n
        files[split] = root / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(r) + "\n" for r in short), encoding="utf-8")
    data = load_data(files["train"], tokenizer, max_length=MAX_LENGTH, progress=False)
    feats = np.random.default_rng(0).standard_normal((len(data), 8)).astype(np.float32)
    plans = {}
    for ws in (1, 2):
        plan = select_from_features(feats, world_size=ws, ratio=0.5, lengths=data.lengths,
                                    fingerprint=data.fingerprint(), model_id="test", seed=0)
        plans[ws] = plan.save(root / f"plan{ws}")
    return SimpleNamespace(root=root, train=files["train"], heldout=files["heldout"], plans=plans, data=data)


def _train(argv: list[str]) -> int:
    """``clusterlm train ARGV`` in this process (what ``python -m clusterlm.train ARGV`` runs)."""
    return cli.main(["train", *argv])


def _config(argv: list[str]) -> TrainConfig:
    """The TrainConfig ``clusterlm train ARGV`` runs (its options parsed by
    :func:`clusterlm.cli.commands.train_parser`)."""
    return cli.train_config(parse_config(cli.train_parser(), argv))


def _argv(env, out: Path, plan: str | Path, *extra: str) -> list[str]:
    return ["--plan", str(plan), "--model", "tiny-llama", "--data", str(env.train), "--out", str(out),
            "--max-length", str(MAX_LENGTH), "--no-progress", "--no-save-model", *extra]


def _two_rank_argv(env, out: Path) -> list[str]:
    # 40 examples per rank, 4 per step (2 micro-batches: exercises no_sync) -> 10 steps per epoch, so 12
    # steps cross an epoch boundary (reshuffle) and checkpoints land on both sides of it.
    return _argv(env, out, env.plans[2], "--eval-data", str(env.heldout), "--max-steps", str(STEPS),
                 "--micro-batch-size", "2", "--grad-accum", "2", "--lr", "3e-3", "--warmup-steps", "2",
                 "--eval-every", "6", "--save-every", str(SAVE_EVERY), "--log-every", "1")


def _records(out: Path, kind: str, *, partial_ok: bool = False) -> list[dict]:
    records = []
    for line in (out / METRICS).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            assert partial_ok, f"malformed line in {out / METRICS}: {line!r}"
    return [r for r in records if r["kind"] == kind]


@pytest.fixture(scope="module")
def reference_run(env):
    """One uninterrupted 2-rank gloo run through :func:`clusterlm.train` (torch.distributed.run; a failed rank raises
    SpawnFailed)."""
    out = env.root / "reference"
    t0 = time.perf_counter()
    result = train_launch.train(_config(_two_rank_argv(env, out)).replace(nproc=2))
    assert result.steps == STEPS and result.out == out
    return SimpleNamespace(out=out, seconds=time.perf_counter() - t0, result=result)


# ---------------------------------------------------------------------------------------------------
# 2 ranks: a run, and kill + resume
# ---------------------------------------------------------------------------------------------------


def test_two_rank_gloo_run_finishes_learns_and_writes_metrics(env, reference_run):
    from clusterlm.plan import Plan
    from clusterlm.plan.sampler import PlanSampler

    out = reference_run.out
    train = _records(out, "train")
    evals = _records(out, "eval")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert [r["step"] for r in evals] == [0, 6, 12]
    for r in train:
        assert len(r["step_time"]) == len(r["step_cpu_time"]) == 2 and min(r["step_time"]) > 0
        assert np.isfinite(r["loss"]) and r["tokens_per_s"] > 0
    assert np.mean([r["loss"] for r in train[-3:]]) < np.mean([r["loss"] for r in train[:3]]) - 0.3
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 0.3
    # warm-up then cosine decay
    assert train[0]["lr"] == pytest.approx(1.5e-3) and train[1]["lr"] == pytest.approx(3e-3)
    assert train[-1]["lr"] < train[2]["lr"]

    # Every rank trained on its own plan list, in the PlanSampler order: per-rank token counts match.
    plan = Plan.load(env.plans[2])
    lengths = env.data.lengths
    for rank in range(2):
        sampler = PlanSampler(plan, rank, seed=0)
        order = np.concatenate([sampler.order(0), sampler.order(1)])
        expected = [int(lengths[order[4 * j: 4 * j + 4]].sum()) for j in range(STEPS)]
        assert [r["step_tokens"][rank] for r in train] == expected
    assert sampler.order(0).tolist() != sampler.order(1).tolist()  # reshuffled per epoch

    summary = json.loads((out / SUMMARY).read_text())
    assert summary["steps"] == STEPS and summary["world_size"] == 2
    assert summary["final_eval_loss"] == pytest.approx(evals[-1]["eval_loss"])
    assert summary["tokens"] == train[-1]["tokens"] == sum(sum(r["step_tokens"]) for r in train)
    assert (out / CURVE).stat().st_size > 10_000
    args = json.loads((out / "args.json").read_text())
    assert args["world_size"] == 2 and args["total_steps"] == STEPS
    ckpts = sorted(p.name for p in (out / CKPT_DIR).glob("step_*.pt"))
    assert ckpts == ["step_0000009.pt", "step_0000012.pt"]  # keep the last 2
    assert (out / CKPT_DIR / LATEST).read_text().strip() == "step_0000012.pt"


def _descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (from /proc), children first."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parents.items() if pp in frontier]
        found += kids
        frontier = kids
    return found


def test_sigkill_and_resume_matches_uninterrupted_run(env, reference_run, tmp_path):
    out = tmp_path / "killed"
    log = tmp_path / "killed.log"
    cmd = torchrun_command(["train", *_two_rank_argv(env, out)], 2)
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    first = out / CKPT_DIR / f"step_{SAVE_EVERY:07d}.pt"
    deadline = time.monotonic() + 240
    while not first.exists():
        assert proc.poll() is None, f"run ended before its first checkpoint:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "no checkpoint after 240 s"
        time.sleep(0.01)
    # The ranks run in sessions of their own (torch's launcher): SIGKILL them by pid, then the launcher.
    killed = [*_descendants(proc.pid), proc.pid]
    for pid in killed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    # SIGKILL is delivered at once but a process ends a moment later: until then its lock on OUT is live (the
    # resume below checks the lock in this process before it starts any rank)
    deadline = time.monotonic() + 30
    while any(pid_alive(pid) for pid in killed) or lock_holder(out) is not None:  # the kernel ends them late
        assert time.monotonic() < deadline, f"killed ranks alive or OUT locked ({lock_holder(out)}) after 30 s"
        time.sleep(0.05)
    done = _records(out, "train", partial_ok=True)  # SIGKILL may cut the last line
    assert not (out / SUMMARY).exists() and len(done) < STEPS, "the run finished before it could be killed"

    train_launch.train(_config(_two_rank_argv(env, out) + ["--resume"]).replace(nproc=2))
    ref, res = _records(reference_run.out, "train"), _records(out, "train")
    assert [r["step"] for r in res] == list(range(1, STEPS + 1))
    for a, b in zip(ref, res, strict=True):
        for key in ("loss", "loss_unweighted", "lr", "grad_norm", "tokens"):
            assert abs(a[key] - b[key]) <= 1e-6, (a["step"], key, a[key], b[key])
    ref_eval, res_eval = _records(reference_run.out, "eval"), _records(out, "eval")
    assert [r["step"] for r in res_eval] == [0, 6, 12]
    assert np.allclose([r["eval_loss"] for r in ref_eval], [r["eval_loss"] for r in res_eval], rtol=0, atol=1e-6)
    summary = json.loads((out / SUMMARY).read_text())
    assert summary["resumed_from"] and summary["steps"] == STEPS


# ---------------------------------------------------------------------------------------------------
# DDP gradient = sum_k (n_k / N) * mean gradient of cluster k's selected examples
# ---------------------------------------------------------------------------------------------------


Out = namedtuple("Out", "logits")


class _ToyLM(torch.nn.Module):
    """A tiny causal LM (token + previous token -> logits), float64; avoids importing transformers in the ranks."""

    def __init__(self, vocab: int = 61, dim: int = 16) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Out:
        e = self.emb(input_ids)
        prev = torch.nn.functional.pad(e, (0, 0, 1, 0))[:, :-1]
        return Out(self.head(torch.tanh(e + self.mix(prev))))


def _tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return _ToyLM().double()


def _weight_examples(n: int = 40) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        t = int(rng.integers(6, 20))
        ids = rng.integers(0, 61, size=t).astype(np.int64)
        labels = ids.copy()
        labels[: int(rng.integers(1, t - 2))] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _weight_plan():
    from clusterlm.data import fingerprint
    from clusterlm.selection.select import select_from_features

    examples = _weight_examples()
    feats = np.random.default_rng(2).standard_normal((len(examples), 4)).astype(np.float32)
    lengths = np.array([len(e["input_ids"]) for e in examples])
    return examples, select_from_features(feats, world_size=2, ratio=0.5, lengths=lengths,
                                          fingerprint=fingerprint(examples))


def _ddp_grad_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    examples, plan = _weight_plan()
    model = DDP(_tiny_model())
    idx = plan.indices(rank)
    # micro-batches of 4, 4, 2: accumulation with no_sync and a short last micro-batch
    micro = make_micro_batches(examples, idx, plan.weights, 4, 0, torch.device("cpu"))
    forward_backward(model, micro, n_step=len(idx))
    grads = torch.cat([p.grad.flatten() for p in model.module.parameters()])
    torch.save(grads, Path(out_dir) / f"grad{rank}.pt")
    del model  # DDP's reducer holds the group: release it before the group goes down
    dist.destroy_process_group()


def test_ddp_gradient_is_cluster_size_weighted_mean(tmp_path):
    import torch.multiprocessing as mp

    from clusterlm.engine.loss import per_example_loss

    mp.spawn(_ddp_grad_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    g0, g1 = torch.load(tmp_path / "grad0.pt"), torch.load(tmp_path / "grad1.pt")
    assert torch.equal(g0, g1)

    examples, plan = _weight_plan()
    n = len(examples)
    model = _tiny_model()
    expected = torch.zeros_like(g0)
    clusters = set()
    for rank in range(2):
        idx = plan.indices(rank)
        (cluster,) = np.unique(plan.cluster_labels[idx])
        clusters.add(int(cluster))
        n_k = int((plan.cluster_labels == cluster).sum())
        model.zero_grad()
        for i in idx:  # the plain mean gradient of cluster k's selected examples, one example at a time
            ex = examples[int(i)]
            ids = torch.as_tensor(ex["input_ids"])[None]
            loss = per_example_loss(model(input_ids=ids).logits, torch.as_tensor(ex["labels"])[None])[0]
            (loss / len(idx)).backward()
        g_k = torch.cat([p.grad.flatten() for p in model.parameters()])
        expected += (n_k / n) * g_k
    assert clusters == {0, 1}
    sizes = np.bincount(plan.cluster_labels, minlength=2)
    assert sizes[0] != sizes[1], "the test needs unequal clusters to tell weighted from unweighted averages"
    assert (g0 - expected).abs().max().item() <= 1e-6 * max(1.0, expected.abs().max().item())


# ---------------------------------------------------------------------------------------------------
# Refusals (in this process, world size 1)
# ---------------------------------------------------------------------------------------------------


def test_world_size_mismatch_refused(env, tmp_path, capfd):
    assert _train(_argv(env, tmp_path / "a", env.plans[2])) == 2
    err = capfd.readouterr().err
    assert "world size 2" in err and "world size 1" in err and "--nproc 2" in err
    # the launcher refuses before starting any process
    t0 = time.perf_counter()
    assert _train(_argv(env, tmp_path / "b", env.plans[2], "--nproc", "3")) == 2
    assert time.perf_counter() - t0 < 5
    err = capfd.readouterr().err
    assert "world size 2" in err and "world size 3" in err


def test_tampered_plan_and_changed_data_refused(env, tmp_path, capfd):
    from clusterlm.plan import Plan

    # arrays replaced behind plan.json's back
    bad = tmp_path / "plan"
    shutil.copytree(env.plans[1], bad)
    with np.load(bad / "plan.npz") as z:
        arrays = {k: z[k] for k in z.files}
    arrays["rank_indices"] = arrays["rank_indices"][:, ::-1].copy()
    np.savez(bad / "plan.npz", **arrays)
    assert _train(_argv(env, tmp_path / "a", bad)) == 2
    assert "does not belong" in capfd.readouterr().err

    # data that differs from what the plan was made for (one answer edited)
    lines = env.train.read_text().splitlines()
    record = json.loads(lines[5])
    record["response"] += "    return None\n"
    lines[5] = json.dumps(record)
    changed = tmp_path / "changed.jsonl"
    changed.write_text("\n".join(lines) + "\n")
    argv = _argv(env, tmp_path / "b", env.plans[1])
    argv[argv.index("--data") + 1] = str(changed)
    assert _train(argv) == 2
    assert "content hash differs" in capfd.readouterr().err
    assert Plan.load(env.plans[1]).world_size == 1


# ---------------------------------------------------------------------------------------------------
# Baseline plans, LoRA, Adafactor, resume rules (in this process)
# ---------------------------------------------------------------------------------------------------


def test_baseline_spec_lora_adafactor_and_resume_rules(env, tmp_path, capfd):
    out = tmp_path / "run"
    argv = _argv(env, out, "random:0.5", "--max-steps", "3", "--save-every", "2", "--lora-r", "4",
                 "--lora-targets", "q_proj,v_proj", "--optimizer", "adafactor", "--lr", "1e-2",
                 "--gradient-checkpointing", "--bf16", "on", "--eval-data", str(env.heldout), "--eval-max-examples",
                 "8")
    argv.remove("--no-save-model")
    threads = torch.get_num_threads()
    assert _train(argv) == 0
    assert torch.get_num_threads() == threads  # process-wide settings restored
    from clusterlm.plan import Plan

    plan = Plan.load(out / "plan")
    assert plan.config["method"] == "random" and plan.n_selected == N_TRAIN // 2
    assert len(_records(out, "train")) == 3
    ckpt = torch.load(out / CKPT_DIR / "step_0000003.pt", weights_only=False)
    assert ckpt["model"] and all("lora_" in k for k in ckpt["model"])  # only the adapter is trained and saved
    assert (out / "model" / "adapter_config.json").is_file()

    capfd.readouterr()
    assert _train(argv) == 2  # an earlier run is there
    assert "--resume" in capfd.readouterr().err
    other = [*argv, "--resume"]
    other[other.index("--max-steps") + 1] = "4"
    changed = [*other, "--micro-batch-size", "2"]
    assert _train(changed) == 2
    assert "micro_batch_size" in capfd.readouterr().err
    assert _train(other) == 0  # continue to step 4
    assert [r["step"] for r in _records(out, "train")] == [1, 2, 3, 4]


# ---------------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------------


def test_config_round_trip_and_torchrun_commands(tmp_path):
    parser = cli.train_parser()
    argv = ["--plan", "p", "--model", "m", "--data", "d.jsonl", "--out", "o", "--nproc", "2", "--lr", "0.0003",
            "--resume", "--no-progress", "--lora-r", "8", "--bf16", "off", "--max-steps", "7"]
    config = cli.train_config(parse_config(parser, argv))
    # the CLI spellings (--no-progress, --resume alone) parse into the TrainConfig fields
    assert config == TrainConfig(plan="p", model="m", data="d.jsonl", out="o", nproc=2, lr=3e-4, resume=LATEST,
                                 progress=False, lora_r=8, bf16="off", max_steps=7)
    # the config file round-trips: TrainConfig.load and `clusterlm train --config FILE` read back the same config
    path = tmp_path / TRAIN_CONFIG
    sha = config.save(path)
    assert sha == checksum(path.read_text(encoding="utf-8"))
    assert TrainConfig.load(path) == config
    assert cli.train_config(parse_config(parser, ["--config", str(path)])) == config
    assert cli.train_config(parse_config(parser, ["--config", str(path), "--lr", "0.001"])).lr == 1e-3  # options win
    # the ranks get the file, not a rebuilt command line: no launcher option reaches them
    cmd = torchrun_command(["train", "--config", str(path)], 2)
    ranks = cmd[cmd.index("-m", 2) + 1:]
    assert ranks == [PACKAGE_ENTRY, "train", "--config", str(path)] and "--nproc" not in ranks
    assert cli.train_config(parse_config(parser, ranks[2:])).lr == 3e-4

    cmd = torchrun_command(["train", "--plan", "p"], 4)
    assert cmd[1:] == ["-m", "torch.distributed.run", "--nproc-per-node", "4", "--signals-to-handle",
                       FORWARDED_SIGNALS, "--standalone", "-m", "clusterlm", "train", "--plan", "p"]
    cmd = torchrun_command([], 8, nnodes=2, rdzv_endpoint="node0:29500", rdzv_id="run1")
    assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--rdzv-endpoint") + 1] == "node0:29500"
    assert "--standalone" not in cmd and cmd[cmd.index("--rdzv-backend") + 1] == "c10d"
    with pytest.raises(ValueError, match="rdzv-endpoint"):
        torchrun_command([], 8, nnodes=2)
