"""Shared helpers of the TRL / export / model-id tests: a tiny tokenizer with a chat template, a tiny Llama,
SFT records, a two-cluster plan, and a 2-process torchrun runner. Everything is built locally in seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

WORDS = ("the a cat dog sat ran on under mat tree why how what is are red blue green big small one two three "
         "four five fox owl bee sun moon").split()
# Assistant turns inside {% generation %} so TRL's assistant_only_loss finds them; the end-of-turn </s> is trained.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}{{ m['content'] }}</s>"
    "{% endgeneration %}{% else %}<|user|>{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tokenizer() -> Any:
    """A byte-level BPE tokenizer (~300 tokens) with bos/eos/pad and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = np.random.default_rng(0)
    corpus = [" ".join(rng.choice(WORDS, 8)) for _ in range(200)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    out.chat_template = CHAT_TEMPLATE
    return out


def model(vocab_size: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> Any:
    """A 2-layer Llama (hidden 32) with sharp initial logits, so the plan weights visibly change the loss."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    net = LlamaForCausalLM(cfg)
    with torch.no_grad():
        net.lm_head.weight.mul_(30)
    return net.to(dtype)


def records(kind: str, n: int = 16, seed: int = 0) -> list[dict]:
    """``n`` distinct SFT records: ``"messages"`` (conversations) or ``"prompt-completion"`` (TRL's strings)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = f"{WORDS[i % len(WORDS)]} " + " ".join(rng.choice(WORDS, int(rng.integers(2, 5))))
        answer = " ".join(rng.choice(WORDS, int(rng.integers(2, 6))))
        if kind == "messages":
            out.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]})
        else:
            out.append({"prompt": prompt, "completion": " " + answer})
    return out


def token_examples(n: int = 16, vocab: int = 128, seed: int = 0) -> list[dict]:
    """Random tokenised examples (``input_ids`` lists, ``labels`` with a masked prompt), all distinct."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t = int(rng.integers(6, 15))
        ids = rng.integers(1, vocab, size=t)
        ids[0] = i + 1
        labels = ids.copy()
        labels[: int(rng.integers(2, 5))] = -100
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def two_cluster_plan(examples: Any, world_size: int = 2, model_id: str = "", seed: int = 0) -> Any:
    """N examples in clusters of 3N/4 and N/4; N/4 selected from each; with 2 ranks rank k holds cluster k.

    The weights are ``K n_k / N`` (1.5 and 0.5 for two ranks), so a weighted average differs from a plain one.
    """
    from clusterlm.data import fingerprint, lengths_of
    from clusterlm.plan import Plan
    from clusterlm.selection.allocation import selection_weights

    n = len(examples)
    rng = np.random.default_rng(seed)
    labels = np.zeros(n, dtype=np.int64)
    labels[rng.permutation(n)[: n // 4]] = 1
    picks = [rng.permutation(np.flatnonzero(labels == c))[: n // 4] for c in (0, 1)]
    sel = np.concatenate(picks)
    if world_size == 2:
        ranks = picks
    else:
        sel = rng.permutation(sel)
        per = len(sel) // world_size
        ranks = [sel[r * per:(r + 1) * per] for r in range(world_size)]
    return Plan(world_size=world_size, rank_indices=ranks, weights=selection_weights(labels, sel, 2),
                cluster_labels=labels, distances=np.zeros(n), cluster_sizes=np.bincount(labels, minlength=2),
                lengths=lengths_of(examples), fingerprint=fingerprint(examples), model_id=model_id,
                config={"method": "test"})


def equal_size_plan(plan: Any) -> Any:
    """The same rank lists with equal cluster sizes (what an unweighted DDP average estimates)."""
    from clusterlm.plan import Plan

    labels = plan.cluster_labels.copy()
    selected = np.concatenate(plan.rank_indices)
    rest = np.setdiff1d(np.arange(plan.n_examples), selected)
    labels[rest] = np.resize([0, 1], len(rest))  # N/4 selected per cluster + the rest split evenly
    weights = np.zeros(plan.n_examples)
    weights[selected] = 1.0
    return Plan(world_size=plan.world_size, rank_indices=plan.rank_indices, weights=weights, cluster_labels=labels,
                distances=plan.distances, cluster_sizes=np.bincount(labels, minlength=2), lengths=plan.lengths,
                fingerprint=plan.fingerprint, model_id="")


def clusterlm_loss(net: Any, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One example's mean cross entropy over its trained tokens, from the full logits (clusterlm.engine.loss)."""
    from clusterlm.engine.loss import per_example_loss

    return per_example_loss(net(input_ids=ids).logits, labels)[0]


def trl_loss(net: Any, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The same through TRL's fused LM head (what TRL trains with; its vocabulary matmul runs in float32)."""
    out = net(input_ids=ids, labels=labels, fused_lm_head=True)
    return -out.log_probs.sum() / out.label_mask.sum()


def expected_gradient(net: Any, examples: Any, plan: Any, loss: Any = clusterlm_loss) -> torch.Tensor:
    """``sum_k (n_k / N) g_k``: g_k the plain mean gradient of rank k's (= cluster k's) examples, one at a time."""
    n = plan.n_examples
    expected = None
    for rank in range(plan.world_size):
        idx = plan.indices(rank)
        (cluster,) = np.unique(plan.cluster_labels[idx])
        n_k = int((plan.cluster_labels == cluster).sum())
        net.zero_grad()
        for i in idx:
            ex = examples[int(i)]
            ids, labels = torch.as_tensor(ex["input_ids"])[None], torch.as_tensor(ex["labels"])[None]
            (loss(net, ids, labels) / len(idx)).backward()
        g_k = torch.cat([p.grad.flatten() for p in net.parameters()])
        expected = (n_k / n) * g_k if expected is None else expected + (n_k / n) * g_k
    return expected


def run_two_ranks(script: str, tmp_path: Path, *args: str, timeout: int = 300) -> str:
    """Run ``script`` under ``torchrun --nproc-per-node 2`` (gloo on CPU); returns the log; fails on an error."""
    import pytest

    path = tmp_path / "ranks_script.py"
    path.write_text(script)
    # PYTHONFAULTHANDLER: a rank that dies of a signal (a segfault in a collective) prints every thread's stack
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_DATASETS_DISABLE_PROGRESS_BARS="1",
               PYTHONFAULTHANDLER="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    # own session: on a timeout the launcher and both workers are killed together, no orphans
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", str(path),
         str(tmp_path), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail("2-process run timed out:\n" + log[-4000:])
    fatal = log.find("Fatal Python error")  # the dead rank's stacks come before the survivor's long traceback
    assert proc.returncode == 0, (log[fatal: fatal + 4000] + "\n[...]\n" if fatal >= 0 else "") + log[-6000:]
    return log
