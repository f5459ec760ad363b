"""A plan verified against data tokenised differently says how, not only "content hash differs" (issue 15, class 7)."""

from __future__ import annotations

import numpy as np
import pytest

from clusterlm.data import load_data
from clusterlm.selection.select import select_from_features


@pytest.fixture()
def records():
    return [{"prompt": f"question {i}", "response": f"answer {i} " * (8 + i % 5)} for i in range(40)]


def _plan_for(data, max_length):
    x = np.random.default_rng(0).standard_normal((len(data), 8)).astype(np.float32)
    plan = select_from_features(x, world_size=2, ratio=0.5, lengths=data.lengths, fingerprint=data.fingerprint())
    plan.config["data"] = {"max_length": max_length, "rendering": data.rendering}
    return plan


def test_another_max_length_is_named(records, demo_tokenizer):
    plan = _plan_for(load_data(records, demo_tokenizer, max_length=40, progress=False), 40)
    other = load_data(records, demo_tokenizer, max_length=32, progress=False)
    with pytest.raises(ValueError, match=r"--max-length 40, this data with 32: pass --max-length 40"):
        plan.verify(other, 2)


def test_another_rendering_is_named(records, demo_tokenizer):
    plan = _plan_for(load_data(records, demo_tokenizer, max_length=None, progress=False, chat_template=True), None)
    other = load_data(records, demo_tokenizer, max_length=None, progress=False, chat_template=False)
    with pytest.raises(ValueError, match="rendered 'chat-template', this data 'plain'"):
        plan.verify(other, 2)


def test_same_tokenisation_other_content_keeps_the_hash_message(records, demo_tokenizer):
    plan = _plan_for(load_data(records, demo_tokenizer, max_length=None, progress=False), None)
    changed = [dict(r, response=r["response"] + " more") if i == 3 else r for i, r in enumerate(records)]
    with pytest.raises(ValueError, match="content hash differs"):
        plan.verify(load_data(changed, demo_tokenizer, max_length=None, progress=False), 2)
