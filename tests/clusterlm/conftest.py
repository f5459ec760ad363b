"""Fixtures of the data/demo/model tests: the demo (tests/conftest.py: one build per test session, in a temporary
home), its tokenizer and subsets, and the tiny Llama of the baseline tests (one per module).

``CLUSTERLM_HOME`` points at a session temporary directory while these fixtures are in use, so nothing is
written to ``~/.cache/clusterlm`` and the default-root code path (no ``root`` argument) is what builds it.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

pytest.register_assert_rewrite("tiny_cases")  # its helpers assert: keep pytest's explanations

SMALL_MAX_LENGTH = 96  # tokens: short examples keep the 2-rank runs of the API tests fast


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    """A 2-layer Llama (hidden 32, vocabulary 97) in eval mode, seeded without touching the global RNG (the
    baseline tests: S2L, IFD, LESS and their token budgets)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                         tie_word_embeddings=False, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def demo_tokenizer(demo: Any) -> Any:
    """The demo tokenizer (``PreTrainedTokenizerFast``)."""
    return demo.load_tokenizer()


@pytest.fixture(scope="session")
def small_sft(demo, tmp_path_factory):
    """60 short training examples and 16 held-out ones of the demo splits, and a 2-rank plan on them."""
    from clusterlm.data import load_data
    from clusterlm.models import load_model
    from clusterlm.selection.select import select_from_features

    root = tmp_path_factory.mktemp("small_sft")
    _, tokenizer, model_id = load_model("tiny-llama")
    files = {}
    for split, n in (("train", 60), ("heldout", 16)):
        records = demo.records(split)
        full = load_data(records[:400], tokenizer, max_length=None, progress=False)
        short = [r for r, length in zip(records, full.lengths, strict=False) if length <= SMALL_MAX_LENGTH][:n]
        files[split] = root / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(r) + "\n" for r in short), encoding="utf-8")
    data = load_data(files["train"], tokenizer, max_length=SMALL_MAX_LENGTH, progress=False)
    feats = np.random.default_rng(0).standard_normal((len(data), 8)).astype(np.float32)
    plan = select_from_features(feats, world_size=2, ratio=0.5, lengths=data.lengths, fingerprint=data.fingerprint(),
                                model_id=model_id, seed=0)
    return SimpleNamespace(root=root, train=files["train"], heldout=files["heldout"], plan=plan,
                           max_length=SMALL_MAX_LENGTH)
