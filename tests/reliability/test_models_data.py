"""Models and data files as a careless user hands them to ``clusterlm select`` (issue 15, classes 3 and 7).

Models: a masked LM, a seq2seq model, a classifier, a base model without a head, a directory without tokenizer
files, a tokenizer whose ids do not fit the embedding, things that are no model at all. Each is refused in one
line on stderr naming the fix, with exit status 2, before any weights are loaded (``from_pretrained`` of the
model is a trap here) and without writing a plan.

Weights that cannot be read (random bytes, a cut-short file, a missing shard, a damaged ``pytorch_model.bin``): one
line naming the file and the fix (download or save again), exit status 2, before any weights load (issue 25).

Data files: invalid JSON, a non-UTF-8 byte, empty files, missing or mistyped columns, non-datasets directories,
every answer empty: one line naming the file (and the 1-based line for JSON), exit status 2.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from cli_helpers import run_cli

from clusterlm.data import load_data
from clusterlm.data.demo import demo_data
from clusterlm.models import load_model

transformers = pytest.importorskip("transformers")

RECORDS = [{"prompt": f"def add_{i}(x):", "response": f"    return x + {i}\n"} for i in range(8)]


_run = run_cli


def _select(model: str | Path, data: str | Path, out: Path) -> list[str]:
    return ["select", "--model", str(model), "--data", str(data), "--world-size", "2", "--ratio", "0.5",
            "--out", str(out), "--no-progress"]


def _one_line(rc: int, err: str, *needles: str, command: str = "select") -> str:
    """The single stderr line of a refused command (exit 2, no traceback), which contains every needle."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, (rc, err)
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith(f"clusterlm {command}: error: "), line
    for needle in needles:
        assert needle.lower() in line.lower(), (needle, line)
    return line


# ---------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Tiny model directories of every kind a user may pass, next to the demo tokenizer (4096 tokens)."""
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        BertConfig,
        BertForMaskedLM,
        BertLMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
        LlamaModel,
        T5Config,
        T5ForConditionalGeneration,
    )

    root = tmp_path_factory.mktemp("zoo")
    tok = demo_data(verbose=False).load_tokenizer()
    vocab = len(tok)

    def save(name: str, model: Any, tokenizer: bool = True) -> Path:
        path = root / name
        model.save_pretrained(str(path))
        if tokenizer:
            tok.save_pretrained(str(path))
        return path

    def llama(vocab_size: int = vocab) -> LlamaConfig:
        return LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                           pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)

    bert = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=256)
    torch.manual_seed(0)
    z = SimpleNamespace(root=root)
    z.masked_lm = save("bert-mlm", BertForMaskedLM(BertConfig(**bert)))
    z.bert_decoder = save("bert-decoder", BertLMHeadModel(BertConfig(**bert, is_decoder=True)))
    z.t5 = save("t5", T5ForConditionalGeneration(T5Config(vocab_size=vocab, d_model=32, d_ff=64, d_kv=16,
                                                          num_layers=1, num_heads=2)))
    z.bart = save("bart", BartForConditionalGeneration(BartConfig(
        vocab_size=vocab, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=256)))
    z.classifier = save("llama-cls", LlamaForSequenceClassification(llama()))
    z.base = save("llama-base", LlamaModel(llama()))
    z.causal = save("llama-causal", LlamaForCausalLM(llama()))
    z.no_tokenizer = save("llama-no-tokenizer", LlamaForCausalLM(llama()), tokenizer=False)
    z.bert_no_tokenizer = save("bert-decoder-no-tokenizer", BertLMHeadModel(BertConfig(**bert, is_decoder=True)),
                               tokenizer=False)
    z.small_vocab = save("llama-vocab-1000", LlamaForCausalLM(llama(1000)))
    # The masked LM's config without "architectures": only model_type and is_decoder say what it is.
    z.no_architectures = root / "bert-no-architectures"
    z.no_architectures.mkdir()
    config = json.loads((z.masked_lm / "config.json").read_text())
    config.pop("architectures")
    for f in z.masked_lm.iterdir():
        (z.no_architectures / f.name).write_bytes(f.read_bytes())
    (z.no_architectures / "config.json").write_text(json.dumps(config))
    z.not_a_model = root / "notes"
    z.not_a_model.mkdir()
    (z.not_a_model / "README.md").write_text("my model will go here\n")
    z.empty = root / "empty"
    z.empty.mkdir()
    z.bad_config = root / "bad-config"
    z.bad_config.mkdir()
    (z.bad_config / "config.json").write_text('{"model_type": "llama", ')
    tok.save_pretrained(str(z.bad_config))
    z.no_weights = root / "no-weights"
    z.no_weights.mkdir()
    (z.no_weights / "config.json").write_text((z.causal / "config.json").read_text())
    tok.save_pretrained(str(z.no_weights))
    z.adapter = root / "lora-adapter"  # what a PEFT fine-tune saves: no config.json, no tokenizer
    z.adapter.mkdir()
    (z.adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (z.adapter / "adapter_model.safetensors").write_bytes(b"")
    z.unknown_type = root / "brand-new"  # a model type this transformers does not know (or remote code)
    z.unknown_type.mkdir()
    (z.unknown_type / "config.json").write_text(json.dumps({"model_type": "brand-new-lm", "vocab_size": vocab,
                                                            "architectures": ["BrandNewForCausalLM"]}))
    (z.unknown_type / "model.safetensors").write_bytes((z.causal / "model.safetensors").read_bytes())
    tok.save_pretrained(str(z.unknown_type))
    _damaged_weights(z)
    z.data = root / "train.jsonl"
    z.data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    return z


def _copy_model(z: SimpleNamespace, name: str, *, weights: bool = True) -> Path:
    """A copy of the causal Llama directory (without its weights when ``weights`` is False)."""
    path = z.root / name
    path.mkdir()
    for f in z.causal.iterdir():
        if weights or not f.name.endswith(".safetensors"):
            (path / f.name).write_bytes(f.read_bytes())
    return path


def _damaged_weights(z: SimpleNamespace) -> None:
    """Model directories whose weights files cannot be read."""
    whole = (z.causal / "model.safetensors").read_bytes()
    z.random_weights = _copy_model(z, "random-weights", weights=False)  # the fault probe's case
    (z.random_weights / "model.safetensors").write_bytes(os.urandom(len(whole)))
    z.cut_weights = _copy_model(z, "cut-weights", weights=False)  # an interrupted download
    (z.cut_weights / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    z.tiny_weights = _copy_model(z, "tiny-weights", weights=False)  # shorter than a header
    (z.tiny_weights / "model.safetensors").write_bytes(b"\x01\x02")
    z.missing_shard = _copy_model(z, "missing-shard", weights=False)
    (z.missing_shard / "model-00001-of-00002.safetensors").write_bytes(whole)
    shards = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
              "lm_head.weight": "model-00002-of-00002.safetensors"}
    (z.missing_shard / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    z.bad_index = _copy_model(z, "bad-index", weights=False)
    (z.bad_index / "model.safetensors.index.json").write_text('{"weight_map": ')
    z.random_bin = _copy_model(z, "random-bin", weights=False)  # the older torch.save format
    (z.random_bin / "pytorch_model.bin").write_bytes(os.urandom(4096))
    # A header whose length and offsets are right but whose dtype safetensors does not know: caught at load.
    z.bad_dtype = _copy_model(z, "bad-dtype", weights=False)
    header = json.dumps({"w": {"dtype": "X99", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (z.bad_dtype / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)


@pytest.fixture
def no_weights_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if any model's weights are loaded: the refusals must come from the config and tokenizer."""

    def trap(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"weights were loaded for {args[:1]} before the model was refused")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", trap)


MODEL_CASES = {
    # name: (fixture attribute, words the one line must contain)
    "masked-lm": ("masked_lm", ("BertForMaskedLM", "causal")),
    "masked-lm-without-architectures": ("no_architectures", ("bert", "is_decoder", "causal")),
    "seq2seq-t5": ("t5", ("encoder-decoder", "causal")),
    "seq2seq-bart": ("bart", ("BartForConditionalGeneration", "causal")),
    "sequence-classifier": ("classifier", ("LlamaForSequenceClassification", "causal")),
    "base-model-without-head": ("base", ("LlamaModel", "causal")),
    "unknown-model-type": ("unknown_type", ("brand-new-lm", "unknown")),
    "missing-tokenizer": ("no_tokenizer", ("tokenizer", "save_pretrained")),
    "missing-tokenizer-bert-decoder": ("bert_no_tokenizer", ("tokenizer", "save_pretrained")),
    "tokenizer-larger-than-embeddings": ("small_vocab", ("4096", "1000", "resize_token_embeddings")),
}


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_a_model_that_cannot_be_fine_tuned_as_a_causal_lm_is_refused_before_its_weights_load(
        case: str, zoo: SimpleNamespace, no_weights_loaded: None, tmp_path: Path,
        capsys: pytest.CaptureFixture) -> None:
    attr, needles = MODEL_CASES[case]
    out = tmp_path / "plan"
    rc = _run(_select(getattr(zoo, attr), zoo.data, out))
    _one_line(rc, capsys.readouterr().err, *needles)
    assert not (out / "plan.json").exists()


THING_CASES = {
    "directory-without-config": ("not_a_model", ("no config.json",)),
    "empty-directory": ("empty", ("no config.json",)),
    "a-data-file-as-model": ("data", ("not a directory",)),
    "config-not-json": ("bad_config", ("config.json",)),
    "config-and-tokenizer-but-no-weights": ("no_weights", ("weights",)),
    "peft-adapter-directory": ("adapter", ("adapter", "merge_and_unload")),
}


WEIGHTS_CASES = {
    # name: (fixture attribute, the file named, words the one line must contain)
    "random-bytes-safetensors": ("random_weights", "model.safetensors", ("unreadable", "header")),
    "cut-short-safetensors": ("cut_weights", "model.safetensors", ("unreadable", "cut short")),
    "two-byte-safetensors": ("tiny_weights", "model.safetensors", ("unreadable", "shorter than")),
    "missing-shard": ("missing_shard", "model-00002-of-00002.safetensors", ("unreadable", "missing")),
    "index-not-json": ("bad_index", "model.safetensors.index.json", ("unreadable",)),
    "random-bytes-pytorch-bin": ("random_bin", "pytorch_model.bin", ("unreadable", "zip")),
}


@pytest.mark.parametrize("case", list(WEIGHTS_CASES))
def test_unreadable_weights_are_one_line_naming_the_file(case: str, zoo: SimpleNamespace, no_weights_loaded: None,
                                                         tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Issue 25, item 1: was a traceback ending in ``SafetensorError: ... header too large``."""
    attr, name, needles = WEIGHTS_CASES[case]
    out = tmp_path / "plan"
    rc = _run(_select(getattr(zoo, attr), zoo.data, out))
    line = _one_line(rc, capsys.readouterr().err, str(getattr(zoo, attr) / name), *needles)
    assert "download the model again" in line and "save_pretrained" in line
    assert not (out / "plan.json").exists()


def test_weights_damage_found_only_while_loading_is_one_line(zoo: SimpleNamespace, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    """A header that parses but names a dtype safetensors does not know: its error at load is one line too."""
    rc = _run(_select(zoo.bad_dtype, zoo.data, tmp_path / "plan"))
    _one_line(rc, capsys.readouterr().err, str(zoo.bad_dtype), "model.safetensors", "unreadable", "download")


@pytest.mark.parametrize("case", list(THING_CASES))
def test_something_that_is_no_model_is_one_line(case: str, zoo: SimpleNamespace, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    attr, needles = THING_CASES[case]
    rc = _run(_select(getattr(zoo, attr), zoo.data, tmp_path / "plan"))
    _one_line(rc, capsys.readouterr().err, *needles)


def test_a_hub_id_that_is_not_cached_is_one_line(zoo: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc = _run(_select("some-org/some-model", zoo.data, tmp_path / "plan"))
    _one_line(rc, capsys.readouterr().err, "hf download some-org/some-model")


def test_real_causal_lms_still_load(zoo: SimpleNamespace) -> None:
    """The checks let through what is a causal LM: a Llama, and BERT built as a decoder (is_decoder=True)."""
    for path in (zoo.causal, zoo.bert_decoder):
        model, tokenizer, model_id = load_model(path)
        assert model.get_input_embeddings().num_embeddings >= len(tokenizer) and "@" in model_id
    assert type(load_model(zoo.bert_decoder)[0]).__name__ == "BertLMHeadModel"


def test_load_model_errors_are_single_line_value_errors(zoo: SimpleNamespace) -> None:
    for attr, _ in [*MODEL_CASES.values(), *THING_CASES.values()]:
        with pytest.raises(ValueError) as err:
            load_model(getattr(zoo, attr))
        assert "\n" not in str(err.value), (attr, str(err.value))


# ---------------------------------------------------------------------------------------------------
# Data files
# ---------------------------------------------------------------------------------------------------

GOOD = json.dumps(RECORDS[0])


def _lines_file(path: Path, *lines: str | bytes) -> Path:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


def _write(path: Path, content: str | bytes) -> Path:
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def _empty(i: int, response: str = "") -> str:
    return json.dumps({"prompt": f"def add_{i}(x):", "response": response})


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


DATA_CASES: dict[str, tuple[Any, tuple[str, ...]]] = {
    "invalid-json-line-3": (lambda p: _lines_file(p / "d.jsonl", GOOD, GOOD, '{"prompt": "x", "response": ', GOOD),
                            ("d.jsonl", "line 3", "JSON")),
    "non-utf8-byte-line-2": (lambda p: _lines_file(p / "d.jsonl", GOOD, b'{"prompt": "caf\xe9", "response": "x"}',
                                                   GOOD), ("d.jsonl", "line 2", "UTF-8")),
    "json-array-not-object-line-2": (lambda p: _lines_file(p / "d.jsonl", GOOD, '["prompt", "response"]'),
                                     ("d.jsonl", "line 2", "object")),
    "truncated-last-line": (lambda p: _write(p / "d.jsonl", GOOD + "\n" + GOOD[:20]), ("d.jsonl", "line 2")),
    "empty-file": (lambda p: _write(p / "d.jsonl", b""), ("d.jsonl", "no examples")),
    "only-blank-lines": (lambda p: _lines_file(p / "d.jsonl", "", "   ", ""), ("d.jsonl", "no examples")),
    "empty-json-list": (lambda p: _write(p / "d.json", "[]"), ("d.json", "no examples")),
    "invalid-json-document": (lambda p: _write(p / "d.json", '[\n {"prompt": "a", "response": "b"},\n {oops}\n]'),
                              ("d.json", "line 3")),
    "missing-columns": (lambda p: _lines_file(p / "d.jsonl", '{"question": "q", "answer": "a"}'),
                        ("d.jsonl", "['answer', 'question']", "'prompt'/'response'")),
    "one-record-without-response": (lambda p: _lines_file(p / "d.jsonl", GOOD, '{"prompt": "p"}'),
                                    ("d.jsonl", "'response'")),
    "wrong-column-type": (lambda p: _lines_file(p / "d.jsonl", GOOD, '{"prompt": 3, "response": "r"}'),
                          ("d.jsonl", "'prompt' must be a string")),
    "messages-not-a-list": (lambda p: _lines_file(p / "d.jsonl", '{"messages": "hello"}'),
                            ("d.jsonl", "'messages' must be a list")),
    "utf16-file": (lambda p: _write(p / "d.jsonl", (GOOD + "\n" + GOOD + "\n").encode("utf-16")),
                   ("d.jsonl", "UTF-16")),
    "pretty-json-array-in-jsonl": (lambda p: _write(p / "d.jsonl", json.dumps(RECORDS, indent=1)),
                                   ("d.jsonl", "rename it to .json")),
    "directory-not-a-dataset": (lambda p: _mkdir(p / "dir"), ("save_to_disk",)),
    "directory-of-data-files": (lambda p: _lines_file(_mkdir(p / "dir") / "train.jsonl", GOOD).parent,
                                ("train.jsonl", "pass one of them")),
    "unknown-extension": (lambda p: _write(p / "d.csv", "prompt,response\na,b\n"), ("'.csv'", ".jsonl")),
    "missing-file": (lambda p: p / "nope.jsonl", ("no such file", "nope.jsonl")),
    "corrupt-parquet": (lambda p: _write(p / "d.parquet", b"PAR1 this is not parquet at all"), ("d.parquet",)),
    # issue 25, item 2: every answer empty (was exit 0 and a plan of examples with nothing to learn)
    "every-response-empty": (lambda p: _lines_file(p / "d.jsonl", *(_empty(i) for i in range(7)), "", _empty(7)),
                             ("d.jsonl", "all 8 examples", "empty 'response'", "lines 1, 2, 3, 4, 5, ...")),
    "every-response-blank": (lambda p: _lines_file(p / "d.jsonl", _empty(0, " \n\t"), _empty(1, "\n")),
                             ("d.jsonl", "all 2 examples", "lines 1, 2)")),
    "only-example-empty": (lambda p: _lines_file(p / "d.jsonl", "", _empty(0)),
                           ("d.jsonl", "the only example", "line 2)")),
    "every-output-empty-alpaca": (
        lambda p: _write(p / "d.json", json.dumps([{"instruction": "add", "input": "1 2", "output": ""}] * 3)),
        ("d.json", "all 3 examples", "empty 'output'", "examples 0, 1, 2")),
    "every-completion-empty": (lambda p: _lines_file(p / "d.jsonl", '{"prompt": "p", "completion": ""}'),
                               ("d.jsonl", "empty 'completion'")),
    "every-assistant-turn-empty": (lambda p: _lines_file(p / "d.jsonl", *[json.dumps({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]})] * 2),
        ("d.jsonl", "all 2 examples", "only empty assistant turns")),
}


@pytest.fixture(scope="module")
def tiny_llama() -> None:
    load_model("tiny-llama")  # built once before the timed cases


@pytest.mark.parametrize("case", list(DATA_CASES))
def test_a_bad_data_file_is_one_line_naming_the_file(case: str, tiny_llama: None, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    make, needles = DATA_CASES[case]
    data = make(tmp_path)
    rc = _run(_select("tiny-llama", data, tmp_path / "plan"))
    _one_line(rc, capsys.readouterr().err, *needles)
    assert not (tmp_path / "plan" / "plan.json").exists()


def test_load_data_names_file_and_line(tmp_path: Path) -> None:
    tok = demo_data(verbose=False).load_tokenizer()
    bad = _lines_file(tmp_path / "d.jsonl", GOOD, "", GOOD, "{nope}")
    with pytest.raises(ValueError, match=r"d\.jsonl.*line 4"):  # blank lines count: the line a text editor shows
        load_data(bad, tok)
    # JSON Lines in a .json file, a BOM, CRLF line ends and blank lines are read as before
    ok = tmp_path / "d.json"
    ok.write_bytes(b"\xef\xbb\xbf" + b"\r\n".join(json.dumps(r).encode() for r in RECORDS) + b"\r\n\r\n")
    assert load_data(ok, tok).fingerprint() == load_data(RECORDS, tok).fingerprint()
    one = _write(tmp_path / "one.json", json.dumps(RECORDS[0], indent=2))  # one object: one record
    assert load_data(one, tok).fingerprint() == load_data(RECORDS[:1], tok).fingerprint()
    with pytest.raises(TypeError, match=r"example 1: 'prompt' must be a string, got int \(.*d2\.jsonl, line 3\)"):
        load_data(_lines_file(tmp_path / "d2.jsonl", GOOD, "", '{"prompt": 1, "response": "r"}'), tok)
