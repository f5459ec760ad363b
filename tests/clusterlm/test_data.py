"""clusterlm.data: formats, masking, truncation, errors, file round trips, fingerprint, collate."""

from __future__ import annotations

import hashlib
import json
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clusterlm.data import IGNORE_INDEX, SFTDataset, collate, fingerprint, load_data

RECORDS = [
    {"prompt": "Write a function that adds two numbers.", "response": "def add(a, b):\n    return a + b\n"},
    {"prompt": "Say hi.", "response": "hi"},
    {"prompt": "Ünïcode prompt ✓", "response": "print('ünïcode ✓')\n"},
]


def _enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_prompt_response_exact_layout(demo_tokenizer):
    tok = demo_tokenizer
    ds = load_data(RECORDS, tok, chat_template=False)
    assert ds.format == "prompt-response" and len(ds) == 3 and ds.n_truncated == 0 and ds.rendering == "plain"
    for i, rec in enumerate(RECORDS):
        p, r = _enc(tok, rec["prompt"]), _enc(tok, rec["response"])
        ex = ds[i]
        assert ex["input_ids"].dtype == np.int64 and ex["labels"].dtype == np.int64
        expected_ids = [tok.bos_token_id] + p + r + [tok.eos_token_id]
        expected_labels = [IGNORE_INDEX] * (1 + len(p)) + r + [tok.eos_token_id]
        assert ex["input_ids"].tolist() == expected_ids
        assert ex["labels"].tolist() == expected_labels
        assert ds.lengths[i] == len(expected_ids)
        assert ds.n_answer_tokens[i] == len(r) + 1
        assert tok.decode(ex["input_ids"][ex["labels"] != IGNORE_INDEX]) == rec["response"] + "</s>"


def test_tokenizer_without_bos(demo_tokenizer):
    tok = demo_tokenizer.__class__.from_pretrained(demo_tokenizer.name_or_path, local_files_only=True)
    tok.bos_token = None
    ex = load_data([{"prompt": "a", "response": "b"}], tok, chat_template=False)[0]
    p, r = _enc(tok, "a"), _enc(tok, "b")
    assert ex["input_ids"].tolist() == p + r + [tok.eos_token_id]
    assert ex["labels"].tolist() == [IGNORE_INDEX] * len(p) + r + [tok.eos_token_id]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# Any answer with text: a blank one (only white space) is refused or skipped since issue 25 (test_empty_answers.py).
@given(prompt=st.text(max_size=60), response=st.text(min_size=1, max_size=60).filter(str.strip))
def test_masking_boundary_is_exact_for_any_text(demo_tokenizer, prompt, response):
    ex = load_data([{"prompt": prompt, "response": response}], demo_tokenizer, chat_template=False)[0]
    answer = ex["labels"] != IGNORE_INDEX
    # The answer is a suffix: once labels start, they continue to the end and equal the input ids.
    first = int(np.argmax(answer))
    assert answer[first:].all() and not answer[:first].any()
    assert (ex["labels"][answer] == ex["input_ids"][answer]).all()
    assert demo_tokenizer.decode(ex["input_ids"][:first]) == "<s>" + prompt
    assert demo_tokenizer.decode(ex["input_ids"][first:]) == response + "</s>"


def test_prompt_response_is_rendered_through_the_chat_template_by_default(demo_tokenizer):
    tok = demo_tokenizer
    assert tok.chat_template is not None
    ds = load_data(RECORDS, tok)
    assert ds.rendering == "chat-template" and ds.format == "prompt-response"
    as_chat = load_data([{"messages": [{"role": "user", "content": r["prompt"]},
                                       {"role": "assistant", "content": r["response"]}]} for r in RECORDS], tok)
    assert ds.fingerprint() == as_chat.fingerprint()  # exactly the user/assistant conversation
    for i, rec in enumerate(RECORDS):
        ex = ds[i]
        answer = ex["labels"] != IGNORE_INDEX
        first = int(np.argmax(answer))
        assert answer[first:].all() and not answer[:first].any()
        # the demo template: "<s><|user|>\n{prompt}\n<|assistant|>\n{response}</s>"
        assert tok.decode(ex["input_ids"][:first]) == f"<s><|user|>\n{rec['prompt']}\n<|assistant|>\n"
        assert tok.decode(ex["input_ids"][first:]) == rec["response"] + "</s>"
    assert load_data(RECORDS, tok, chat_template=True).fingerprint() == ds.fingerprint()
    plain = load_data(RECORDS, tok, chat_template=False)
    assert plain.rendering == "plain" and plain.fingerprint()["sha256"] != ds.fingerprint()["sha256"]


def test_chat_template_switch_errors_and_tokenizers_without_template(demo_tokenizer):
    tok = demo_tokenizer.__class__.from_pretrained(demo_tokenizer.name_or_path, local_files_only=True)
    tok.chat_template = None
    ds = load_data(RECORDS, tok)  # no template: plain concatenation, as before
    assert ds.rendering == "plain"
    assert ds.fingerprint() == load_data(RECORDS, demo_tokenizer, chat_template=False).fingerprint()
    with pytest.raises(ValueError, match="chat_template=True, but the tokenizer has no chat template"):
        load_data(RECORDS, tok, chat_template=True)
    with pytest.raises(TypeError, match="chat_template must be None, True or False"):
        load_data(RECORDS, demo_tokenizer, chat_template="yes")
    tokenized = load_data([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}])
    assert tokenized.rendering == "tokenized"


def test_alpaca_prompt_joins_input(demo_tokenizer):
    alpaca = [
        {"instruction": "Sort the list.", "input": "[3, 1, 2]", "output": "[1, 2, 3]"},
        {"instruction": "Name a colour.", "input": "", "output": "red"},
        {"instruction": "Name a fruit.", "output": "apple"},  # no 'input' key at all
    ]
    same = [
        {"prompt": "Sort the list.\n\n[3, 1, 2]", "response": "[1, 2, 3]"},
        {"prompt": "Name a colour.", "response": "red"},
        {"prompt": "Name a fruit.", "response": "apple"},
    ]
    ds = load_data(alpaca, demo_tokenizer)
    assert ds.format == "alpaca"
    assert ds.fingerprint() == load_data(same, demo_tokenizer).fingerprint()


def test_chat_trains_only_assistant_turns(demo_tokenizer):
    tok = demo_tokenizer
    conv = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Add two numbers."},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
        {"role": "user", "content": "Now subtract."},
        {"role": "assistant", "content": "def sub(a, b):\n    return a - b"},
    ]
    ds = load_data([{"messages": conv}, {"messages": conv[1:3]}], tok)
    assert ds.format == "chat"
    ex = ds[0]
    full = tok.apply_chat_template(conv, tokenize=False)
    assert tok.decode(ex["input_ids"]) == full
    answer = ex["labels"] != IGNORE_INDEX
    assert (ex["labels"][answer] == ex["input_ids"][answer]).all()
    # The trained tokens are exactly the two assistant contents, each with its end-of-turn eos.
    runs = np.split(np.flatnonzero(answer), np.flatnonzero(np.diff(np.flatnonzero(answer)) > 1) + 1)
    assert [tok.decode(ex["input_ids"][run]) for run in runs] == [
        "def add(a, b):\n    return a + b</s>",
        "def sub(a, b):\n    return a - b</s>",
    ]
    masked = tok.decode(ex["input_ids"][~answer])
    assert "You write Python." in masked and "Now subtract." in masked and "return" not in masked
    assert tok.decode(ds[1]["input_ids"][ds[1]["labels"] != IGNORE_INDEX]) == "def add(a, b):\n    return a + b</s>"


def test_chat_errors(demo_tokenizer):
    with pytest.raises(ValueError, match=r"example 1 .*no answer token"):
        load_data(
            [
                {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
                {"messages": [{"role": "user", "content": "only a question"}]},
            ],
            demo_tokenizer,
        )
    with pytest.raises(TypeError, match="example 0: 'messages' must be a list"):
        load_data([{"messages": "hello"}], demo_tokenizer)
    no_template = demo_tokenizer.__class__.from_pretrained(demo_tokenizer.name_or_path, local_files_only=True)
    no_template.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        load_data([{"messages": [{"role": "assistant", "content": "b"}]}], no_template)


def test_truncation_counts_and_keeps_head(demo_tokenizer):
    long = {"prompt": "short prompt", "response": "x = 1\n" * 200}
    full = load_data([long, RECORDS[1]], demo_tokenizer, max_length=None)
    cut = load_data([long, RECORDS[1]], demo_tokenizer, max_length=32)
    assert cut.n_truncated == 1 and cut.max_length == 32
    assert cut.lengths.tolist() == [32, full.lengths[1]]
    assert (cut[0]["input_ids"] == full[0]["input_ids"][:32]).all()
    assert (cut[0]["labels"] == full[0]["labels"][:32]).all()
    assert (cut[1]["input_ids"] == full[1]["input_ids"]).all()
    huge_prompt = {"prompt": "word " * 100, "response": "ok"}
    with pytest.raises(ValueError, match=r"example 1 .*no answer token left after truncation.*max_length=16"):
        load_data([RECORDS[1], huge_prompt], demo_tokenizer, max_length=16, chat_template=False)
    with pytest.raises(ValueError, match="max_length"):
        load_data(RECORDS, demo_tokenizer, max_length=1)


def test_missing_columns_error_lists_found_and_accepted(demo_tokenizer):
    with pytest.raises(ValueError) as err:
        load_data([{"question": "q", "answer": "a"}], demo_tokenizer)
    msg = str(err.value)
    assert "['answer', 'question']" in msg
    for accepted in ("'prompt'/'response'", "'instruction'", "'messages'", "'input_ids'/'labels'"):
        assert accepted in msg
    with pytest.raises(ValueError, match=r"example 1 .* has no 'response'"):
        load_data([RECORDS[0], {"prompt": "p"}], demo_tokenizer)
    with pytest.raises(TypeError, match="example 0: 'prompt' must be a string"):
        load_data([{"prompt": 3, "response": "r"}], demo_tokenizer)
    with pytest.raises(TypeError, match="tokenizer is required"):
        load_data(RECORDS, None)
    with pytest.raises(ValueError, match="no examples"):
        load_data([], demo_tokenizer)
    with pytest.raises(TypeError, match="source must be"):
        load_data(42, demo_tokenizer)


def test_file_errors(tmp_path, demo_tokenizer):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_data(tmp_path / "missing.jsonl", demo_tokenizer)
    csv = tmp_path / "data.csv"
    csv.write_text("prompt,response\na,b\n")
    with pytest.raises(ValueError, match=r"unknown file extension '\.csv'.*\.jsonl, \.json, \.parquet"):
        load_data(csv, demo_tokenizer)
    with pytest.raises(ValueError, match="is a directory"):
        load_data(tmp_path, demo_tokenizer)


def test_files_round_trip_offline_without_hf_cache(tmp_path, demo_tokenizer, monkeypatch):
    import datasets

    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    (tmp_path / "d.json").write_text(json.dumps(RECORDS), encoding="utf-8")
    datasets.Dataset.from_list(RECORDS).to_parquet(str(tmp_path / "d.parquet"))
    cache = Path(datasets.config.HF_DATASETS_CACHE)
    before = sorted(p.as_posix() for p in cache.rglob("*")) if cache.exists() else []

    def no_network(*args, **kwargs):
        raise AssertionError("load_data tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    expected = load_data(RECORDS, demo_tokenizer).fingerprint()
    for name in ("d.jsonl", "d.json", "d.parquet"):
        ds = load_data(tmp_path / name, demo_tokenizer)
        assert ds.source == str(tmp_path / name)
        assert ds.fingerprint() == expected, name
    after = sorted(p.as_posix() for p in cache.rglob("*")) if cache.exists() else []
    assert after == before, "load_data wrote into the Hugging Face datasets cache"
    # Already-materialised datasets objects.
    hf = datasets.Dataset.from_list(RECORDS)
    assert load_data(hf, demo_tokenizer).fingerprint() == expected
    dd = datasets.DatasetDict({"train": hf, "test": hf.select([0])})
    first = load_data(RECORDS[:1], demo_tokenizer).fingerprint()
    assert load_data(dd, demo_tokenizer, split="test").fingerprint() == first
    with pytest.raises(ValueError, match=r"split must name one of.*\['train', 'test'\]"):
        load_data(dd, demo_tokenizer)


def test_tokenized_examples_pass_through():
    examples = [
        {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
        {"input_ids": np.array([1, 2, 3], dtype=np.int32), "labels": torch.tensor([-100, 2, 3])},
    ]
    ds = load_data(examples, max_length=3)
    assert ds.format == "tokenized" and ds.n_truncated == 1
    assert ds[0]["input_ids"].tolist() == [5, 6, 7] and ds[0]["labels"].tolist() == [-100, -100, 7]
    assert ds[1]["input_ids"].dtype == np.int64
    again = load_data(ds)  # an SFTDataset is a valid source too
    assert again.fingerprint() == ds.fingerprint() and again.format == "tokenized"
    with pytest.raises(ValueError, match=r"example 0 .*no answer token left after truncation to max_length=2"):
        load_data(ds, max_length=2)
    with pytest.raises(ValueError, match="example 0 has 2 input_ids but 1 labels"):
        load_data([{"input_ids": [1, 2], "labels": [1]}])
    with pytest.raises(ValueError, match="example 0 .*no answer token"):
        load_data([{"input_ids": [1, 2], "labels": [-100, -100]}])


def test_dataset_indexing_and_copies():
    ds = load_data([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4, 5], "labels": [-100, 5]}])
    assert ds[-1]["input_ids"].tolist() == [4, 5]
    assert [ex["input_ids"].tolist() for ex in ds] == [[1, 2, 3], [4, 5]]
    ex = ds[0]
    ex["input_ids"][0] = 99  # a copy: the data set is unchanged
    assert ds[0]["input_ids"][0] == 1
    with pytest.raises(IndexError):
        ds[2]
    with pytest.raises(TypeError):
        ds["0"]
    assert "n=2" in repr(ds)


def test_fingerprint_scheme_stability_and_sensitivity(demo_tokenizer):
    ds = load_data(RECORDS, demo_tokenizer)
    fp = ds.fingerprint()
    assert fp["size"] == 3
    digest = hashlib.sha256()
    for ex in ds:
        digest.update(np.int64(len(ex["input_ids"])).tobytes())
        digest.update(ex["input_ids"].astype(np.int64).tobytes())
        digest.update(ex["labels"].astype(np.int64).tobytes())
    assert fp["sha256"] == digest.hexdigest()
    examples = [ds[i] for i in range(len(ds))]
    assert fingerprint(examples) == fp == fingerprint(ds)
    assert fingerprint([(e["input_ids"].tolist(), e["labels"].tolist()) for e in examples]) == fp
    assert load_data(RECORDS, demo_tokenizer).fingerprint() == fp  # stable across loads
    changed = [dict(e) for e in examples]
    changed[1] = {"input_ids": changed[1]["input_ids"].copy(), "labels": changed[1]["labels"]}
    changed[1]["input_ids"][-2] += 1
    assert fingerprint(changed)["sha256"] != fp["sha256"]
    relabelled = [dict(e) for e in examples]
    relabelled[0] = {"input_ids": examples[0]["input_ids"], "labels": examples[0]["labels"].copy()}
    relabelled[0]["labels"][-1] = IGNORE_INDEX
    assert fingerprint(relabelled)["sha256"] != fp["sha256"]
    assert fingerprint(examples[::-1])["sha256"] != fp["sha256"]
    with pytest.raises(TypeError, match="example 0"):
        fingerprint([{"input_ids": [1]}])


def test_collate_pads_right():
    batch = collate(
        [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": np.array([4]), "labels": np.array([4])}],
        pad_id=9,
    )
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert all(t.dtype == torch.int64 and t.shape == (2, 3) for t in batch.values())
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 9, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 2, 3], [4, -100, -100]]
    with pytest.raises(ValueError, match="no examples"):
        collate([])
    with pytest.raises(TypeError, match="pad_id"):
        collate([{"input_ids": [1], "labels": [1]}], pad_id=None)


def test_demo_train_set_tokenises_in_batches_with_progress(demo, demo_tokenizer, capsys):
    calls = []

    class Counting:
        """Forwards to the tokenizer and counts its calls (batching check)."""

        def __getattr__(self, name):
            return getattr(demo_tokenizer, name)

        def __call__(self, texts, **kwargs):
            calls.append(len(texts))
            return demo_tokenizer(texts, **kwargs)

    ds = load_data(demo.train, Counting(), progress=True, chat_template=False)
    n = len(ds)
    assert n > 2000 and ds.n_truncated == 0 and isinstance(ds, SFTDataset)
    assert len(calls) == 2 * -(-n // 1024) and sum(calls) == 2 * n
    assert "tokenize" in capsys.readouterr().err
    load_data(demo.heldout, demo_tokenizer, progress=True)
    assert "tokenize" not in capsys.readouterr().err  # small sets get no bar
