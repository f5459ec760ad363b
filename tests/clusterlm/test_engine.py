"""The training engine (clusterlm.engine.step) on one process: micro-batches, answer losses, the weighted step, the
optimizer and schedule, evaluation, generators and checkpoints. A toy causal LM keeps every test under a second;
the DDP gradient over ranks is tested in test_train.py."""

from __future__ import annotations

import math
import random
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from clusterlm.engine.loss import per_example_loss
from clusterlm.engine.step import (
    CKPT_DIR,
    LATEST,
    answer_losses,
    build_optimizer,
    build_scheduler,
    evaluate,
    find_checkpoint,
    forward_backward,
    lr_factor,
    make_micro_batches,
    optimizer_step,
    resume,
    rng_state,
    save_checkpoint,
    seed_everything,
    set_rng_state,
    train_step,
    trainable_state,
)
from clusterlm.launch.launcher import DistInfo

Out = namedtuple("Out", "logits")
VOCAB = 23
CPU = DistInfo(0, 1, 0, None, torch.device("cpu"))


class _ToyLM(torch.nn.Module):
    """Token and previous token -> logits; float64 so that gradients compare to 1e-12."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.mix = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, VOCAB)
        self.double()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Out:
        e = self.emb(input_ids)
        prev = torch.nn.functional.pad(e, (0, 0, 1, 0))[:, :-1]
        return Out(self.head(torch.tanh(e + self.mix(prev))))


def _examples(n: int = 10, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = int(rng.integers(4, 12))
        ids = rng.integers(0, VOCAB, size=t).astype(np.int64)
        labels = ids.copy()
        labels[: int(rng.integers(1, t - 1))] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


# ---- schedule ---------------------------------------------------------------------------------------------


def test_lr_schedule():
    f = lr_factor
    assert [f(s, 10, 2, "cosine", 0.0) for s in (0, 1)] == [0.5, 1.0]
    assert f(2, 10, 2, "cosine", 0.0) == pytest.approx(1.0)
    assert f(10, 10, 2, "cosine", 0.1) == pytest.approx(0.1)
    assert f(6, 10, 2, "cosine", 0.0) == pytest.approx(0.5)
    assert f(6, 10, 2, "linear", 0.0) == pytest.approx(0.5)
    assert f(9, 10, 0, "constant", 0.0) == 1.0


@settings(max_examples=100, deadline=None)
@given(total=st.integers(1, 500), warm_frac=st.floats(0, 0.5), min_ratio=st.floats(0, 1),
       schedule=st.sampled_from(["cosine", "linear", "constant"]))
def test_lr_factor_warms_up_linearly_then_decays_monotonically_to_min_ratio(total, warm_frac, min_ratio, schedule):
    warmup = int(warm_frac * total)
    values = [lr_factor(s, total, warmup, schedule, min_ratio) for s in range(total + 3)]
    assert values[:warmup] == pytest.approx([(s + 1) / warmup for s in range(warmup)])
    after = values[warmup:]
    assert after[0] == pytest.approx(1.0)
    assert all(b <= a + 1e-12 for a, b in zip(after, after[1:], strict=False))  # never rises again
    end = 1.0 if schedule == "constant" else min_ratio
    assert all(end - 1e-12 <= v <= 1.0 + 1e-12 for v in after)
    if total > warmup:
        assert values[total] == pytest.approx(end) and values[-1] == pytest.approx(end)  # flat past the end


def test_build_scheduler_follows_lr_factor():
    model = _ToyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    scheduler = build_scheduler(optimizer, total_steps=8, warmup=3, schedule="linear", min_ratio=0.25)
    seen = []
    for _ in range(10):
        seen.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.2 * lr_factor(s, 8, 3, "linear", 0.25) for s in range(10)])


# ---- optimizer --------------------------------------------------------------------------------------------


def test_build_optimizer_decays_matrices_only_and_skips_frozen_parameters():
    model = _ToyLM()
    model.emb.weight.requires_grad_(False)
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.8, 0.9))
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model.mix.weight), id(model.head.weight)}
    assert {id(p) for p in no_decay["params"]} == {id(model.mix.bias), id(model.head.bias)}
    assert decay["betas"] == (0.8, 0.9) and decay["lr"] == 1e-3
    assert isinstance(build_optimizer(model, lr=1e-3, kind="adafactor"), torch.optim.Adafactor)


def test_build_optimizer_refuses_a_model_without_trainable_parameters():
    model = _ToyLM().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(model, lr=1e-3)


# ---- batches and losses -----------------------------------------------------------------------------------


def test_make_micro_batches_splits_pads_and_attaches_the_weights():
    examples = _examples()
    weights = np.linspace(0.5, 1.5, len(examples))
    indices = [9, 0, 3, 4, 7, 1, 2, 8, 5, 6]
    batches = make_micro_batches(examples, indices, weights, 4, 0, torch.device("cpu"))
    assert [mb["input_ids"].shape[0] for mb in batches] == [4, 4, 2]
    for s, mb in zip(range(0, 10, 4), batches, strict=True):
        idx = indices[s : s + 4]
        assert mb["weights"].dtype == torch.float32
        np.testing.assert_allclose(mb["weights"].numpy(), weights[idx].astype(np.float32))
        for row, i in enumerate(idx):
            t = len(examples[i]["input_ids"])
            assert mb["input_ids"][row, :t].tolist() == examples[i]["input_ids"].tolist()
            assert mb["attention_mask"][row].sum().item() == t
            assert (mb["labels"][row, t:] == -100).all() and (mb["input_ids"][row, t:] == 0).all()


def test_answer_losses_are_zero_without_gradient_for_rows_without_an_answer():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, VOCAB, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, VOCAB, (3, 5))
    labels[1, 1:] = -100  # only the first position: nothing to predict after the shift
    got = answer_losses(logits, labels)
    keep = [0, 2]
    torch.testing.assert_close(got[keep], per_example_loss(logits[keep], labels[keep]))
    assert got[1].item() == 0.0
    got.sum().backward()
    assert (logits.grad[1] == 0).all() and logits.grad[0].abs().sum() > 0
    torch.testing.assert_close(answer_losses(logits[keep], labels[keep]), per_example_loss(logits[keep], labels[keep]))


# ---- the step ---------------------------------------------------------------------------------------------


def test_forward_backward_accumulates_the_gradient_of_the_weighted_mean():
    examples = _examples()
    weights = np.random.default_rng(3).uniform(0.2, 2.0, len(examples))
    indices = list(range(len(examples)))
    model = _ToyLM()
    stats = forward_backward(model, make_micro_batches(examples, indices, weights, 3, 0, torch.device("cpu")),
                             n_step=len(indices))
    got = _grads(model)
    reference = _ToyLM()  # one example at a time: mean_b(w_b * loss_b) over the whole step
    losses = []
    for i in indices:
        ex = examples[i]
        loss = per_example_loss(reference(torch.as_tensor(ex["input_ids"])[None]).logits,
                                torch.as_tensor(ex["labels"])[None])[0]
        losses.append(loss.item())
        (float(np.float32(weights[i])) * loss / len(indices)).backward()
    torch.testing.assert_close(got, _grads(reference), rtol=1e-6, atol=1e-9)
    w32 = weights.astype(np.float32).astype(np.float64)
    assert stats["loss"] == pytest.approx(float(np.mean(w32 * losses)), rel=1e-6)
    assert stats["loss_unweighted"] == pytest.approx(float(np.mean(losses)), rel=1e-9)
    assert stats["examples"] == 10 and stats["tokens"] == sum(len(e["input_ids"]) for e in examples)
    widths = [max(len(examples[i]["input_ids"]) for i in indices[s : s + 3]) for s in range(0, 10, 3)]
    assert stats["padded_tokens"] == sum(w * len(indices[s : s + 3]) for w, s in zip(widths, range(0, 10, 3),
                                                                                      strict=True))


def test_optimizer_step_clips_steps_schedules_and_zeroes():
    model = _ToyLM()
    examples = _examples()
    forward_backward(model, make_micro_batches(examples, range(10), np.ones(10), 10, 0, torch.device("cpu")),
                     n_step=10)
    grad = _grads(model).clone()
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = build_scheduler(optimizer, total_steps=4, warmup=2)
    max_norm = 0.1 * grad.norm().item()
    lr, norm = optimizer_step(model, optimizer, scheduler, max_grad_norm=max_norm)
    assert lr == pytest.approx(0.25)  # warm-up step 0 of 2: half the peak
    assert norm == pytest.approx(grad.norm().item())  # the norm before clipping
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(before - after, 0.25 * grad * (max_norm / norm), rtol=1e-5, atol=1e-12)
    assert all(p.grad is None for p in model.parameters())
    assert scheduler.get_last_lr()[0] == pytest.approx(0.5)
    forward_backward(model, make_micro_batches(examples, range(2), np.ones(10), 2, 0, torch.device("cpu")), n_step=2)
    assert math.isnan(optimizer_step(model, optimizer, scheduler, max_grad_norm=0.0)[1])  # no clipping: no norm


def test_train_step_is_forward_backward_then_optimizer_step():
    examples = _examples()
    batches = make_micro_batches(examples, range(6), np.ones(10), 3, 0, torch.device("cpu"))
    a, b = _ToyLM(), _ToyLM()
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    sch_a, sch_b = build_scheduler(opt_a, total_steps=3, warmup=0), build_scheduler(opt_b, total_steps=3, warmup=0)
    stats = train_step(a, opt_a, sch_a, batches, n_step=6, max_grad_norm=1.0)
    expected = forward_backward(b, batches, n_step=6)
    lr, norm = optimizer_step(b, opt_b, sch_b, max_grad_norm=1.0)
    assert stats == pytest.approx({**expected, "lr": lr, "grad_norm": norm})
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


# ---- evaluation -------------------------------------------------------------------------------------------


def test_evaluate_is_the_token_weighted_answer_loss():
    examples = _examples(7)
    model = _ToyLM().train()
    per_example = torch.zeros(2, len(examples), dtype=torch.float64)
    loss, tokens = evaluate(model, examples, CPU, batch_size=3, pad_id=0, per_example=per_example)
    assert model.training  # the mode is restored
    sums, counts = [], []
    with torch.no_grad():
        for ex in examples:
            labels = torch.as_tensor(ex["labels"])[None]
            count = int((labels[:, 1:] != -100).sum())
            logits = model(torch.as_tensor(ex["input_ids"])[None]).logits
            sums.append(per_example_loss(logits, labels)[0].item() * count)
            counts.append(count)
    assert tokens == sum(counts)
    assert loss == pytest.approx(sum(sums) / sum(counts), rel=1e-9)
    np.testing.assert_allclose(per_example.numpy(), [sums, counts], rtol=1e-9)
    nothing = [{"input_ids": np.array([1, 2]), "labels": np.array([-100, -100])}]
    got, n = evaluate(model, nothing, CPU, batch_size=1, pad_id=0)
    assert math.isnan(got) and n == 0


# ---- generators and checkpoints ----------------------------------------------------------------------------


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_seed_everything_and_rng_state_reproduce_every_generator():
    seed_everything(123)
    first = _draws()
    seed_everything(123)
    assert _draws() == first
    seed_everything(2**33 + 5)  # larger than numpy's 32-bit seeds: reduced, not refused
    state = rng_state(torch.device("cpu"))
    ahead = [_draws() for _ in range(3)]
    set_rng_state(state, torch.device("cpu"))
    assert [_draws() for _ in range(3)] == ahead


def test_trainable_state_keeps_only_trainable_entries_on_request():
    model = _ToyLM()
    model.emb.requires_grad_(False)
    assert set(trainable_state(model, only_trainable=False)) == set(model.state_dict())
    assert set(trainable_state(model, only_trainable=True)) == {"mix.weight", "mix.bias", "head.weight", "head.bias"}


def test_save_checkpoint_keeps_the_newest_and_find_checkpoint_follows_latest(tmp_path: Path):
    assert find_checkpoint(tmp_path) is None
    paths = [save_checkpoint(tmp_path, {"step": s}, s, keep=2) for s in (5, 10, 15)]
    ckpt = tmp_path / CKPT_DIR
    assert sorted(p.name for p in ckpt.glob("step_*.pt")) == ["step_0000010.pt", "step_0000015.pt"]
    assert paths[-1] == ckpt / "step_0000015.pt" and (ckpt / LATEST).read_text().strip() == paths[-1].name
    assert find_checkpoint(tmp_path) == paths[-1]
    assert torch.load(find_checkpoint(tmp_path), weights_only=False) == {"step": 15}
    assert find_checkpoint(tmp_path, str(paths[1])) == paths[1]  # an explicit file
    (ckpt / LATEST).write_text("step_0000099.pt\n")  # latest names a file that is gone: the newest one
    assert find_checkpoint(tmp_path) == paths[-1]
    assert not list(ckpt.glob("*.tmp*")) and not list(ckpt.glob(".*"))  # nothing half-written left
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        find_checkpoint(tmp_path, str(tmp_path / "missing.pt"))


class _Sampler:
    def __init__(self) -> None:
        self.state: dict = {}

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def _trained(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    model = _ToyLM()
    optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.1)
    scheduler = build_scheduler(optimizer, total_steps=10, warmup=2)
    examples = _examples()
    for s in range(steps):
        train_step(model, optimizer, scheduler, make_micro_batches(examples, [s, s + 1], np.ones(10), 2, 0,
                                                                   torch.device("cpu")), n_step=2, max_grad_norm=1.0)
    return model, optimizer, scheduler


def test_resume_restores_model_optimizer_schedule_sampler_and_generators(tmp_path: Path):
    model, optimizer, scheduler = _trained(3)
    setup = {"world_size": 1, "seed": 0}
    seed_everything(7)
    state = {"setup": setup, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "sampler": {"epoch": 2, "position": 6},
             "rng": [rng_state(torch.device("cpu"))], "step": 3}
    expected_draws = _draws()
    path = save_checkpoint(tmp_path, state, 3, keep=1)
    fresh, fresh_opt, fresh_sched = _trained(0)
    sampler = _Sampler()
    ckpt = resume(path, setup=setup, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched, sampler=sampler,
                  rank=0, device=torch.device("cpu"))
    assert ckpt["step"] == 3 and sampler.state == {"epoch": 2, "position": 6}
    assert _draws() == expected_draws
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert fresh_sched.get_last_lr() == scheduler.get_last_lr()
    assert fresh_opt.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]

    with pytest.raises(ValueError, match=r"other settings \(seed: checkpoint 0, now 1\).*--overwrite"):
        resume(path, setup={**setup, "seed": 1}, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched,
               sampler=sampler, rank=0, device=torch.device("cpu"))
    partial = {**state, "model": {k: v for k, v in state["model"].items() if not k.startswith("head.")}}
    path = save_checkpoint(tmp_path, partial, 4, keep=1)
    with pytest.raises(ValueError, match=r"lacks trainable parameters of this model, e\.g\. \['head\.bias'"):
        resume(path, setup=setup, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched, sampler=sampler, rank=0,
               device=torch.device("cpu"))
