"""load_data's inputs users have: save_to_disk directories (Dataset and DatasetDict), datasets objects, and TRL's
prompt/completion columns (strings, and conversations where only the completion is trained)."""

from __future__ import annotations

import pytest

datasets = pytest.importorskip("datasets")

import tiny_sft  # noqa: E402

from clusterlm.data import load_data, read_columns  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return tiny_sft.tokenizer()


def test_save_to_disk_directories_and_objects(tmp_path, tok):
    rows = [{"prompt": f"why {w}", "response": f" the {w}"} for w in tiny_sft.WORDS[:6]]
    direct = load_data(rows, tok, progress=False).fingerprint()
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0, 1])}).save_to_disk(str(tmp_path / "two"))
    assert load_data(str(tmp_path / "one"), tok, progress=False).fingerprint() == direct
    assert load_data(tmp_path / "two", tok, split="train", progress=False).fingerprint() == direct
    assert len(load_data(tmp_path / "two", tok, split="test", progress=False)) == 2
    assert load_data(ds, tok, progress=False).fingerprint() == direct
    with pytest.raises(ValueError, match="split must name one of"):
        load_data(tmp_path / "two", tok, progress=False)
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not one written by datasets' save_to_disk"):
        load_data(tmp_path / "plain", tok, progress=False)
    assert read_columns(tmp_path / "one")["prompt"] == [r["prompt"] for r in rows]


def test_trl_prompt_completion_columns(tok):
    strings = [{"prompt": f"why {w}", "completion": f" the {w}"} for w in tiny_sft.WORDS[:4]]
    as_response = [{"prompt": r["prompt"], "response": r["completion"]} for r in strings]
    for template in (True, False):
        got = load_data(strings, tok, chat_template=template, progress=False)
        assert got.format == "prompt-completion"
        assert got.fingerprint() == load_data(as_response, tok, chat_template=template, progress=False).fingerprint()
    # conversational: prompt + completion is the conversation, only the completion's assistant turn is trained
    chats = [{"prompt": [{"role": "user", "content": "why red"}, {"role": "assistant", "content": "the sun"},
                         {"role": "user", "content": "and blue"}],
              "completion": [{"role": "assistant", "content": "the moon"}]}]
    ex = load_data(chats, tok, progress=False)[0]
    assert tok.decode(ex["input_ids"][ex["labels"] != -100]) == "the moon</s>"
    whole = load_data([{"messages": chats[0]["prompt"] + chats[0]["completion"]}], tok, progress=False)[0]
    assert whole["input_ids"].tolist() == ex["input_ids"].tolist()
    assert tok.decode(whole["input_ids"][whole["labels"] != -100]) == "the sun</s>the moon</s>"
