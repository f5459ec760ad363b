"""clusterlm.data.demo (the built-in stdlib code-instruction set) and clusterlm.models (load_model)."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from clusterlm.data import collate, load_data
from clusterlm.data import demo as demo_mod
from clusterlm.models import BUILTIN_MODELS, load_model

_CHILD = """
import json, sys
from clusterlm.data.demo import demo_data
from clusterlm.models import load_model
d = demo_data(sys.argv[1])
_, _, model_id = load_model("tiny-llama", root=sys.argv[1])
print(json.dumps({"model_id": model_id}))
"""


def _files(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` except manifests (they hold timings) and lock files."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".") and p.name not in ("manifest.json", "clusterlm_model.json")
    }


def test_default_root_and_reuse(demo, monkeypatch):
    assert demo.root == Path(os.environ["CLUSTERLM_HOME"]) / "demo-v1" == demo_mod.default_root()
    manifest = json.loads((demo.root / "manifest.json").read_text())
    # ~9 s on an idle 2-core machine; the loose bound only catches a pathological slowdown, not load noise.
    assert manifest["version"] == demo_mod.DEMO_VERSION and 0 < manifest["build_seconds"]["total"] < 300

    def no_rebuild(*args, **kwargs):
        raise AssertionError("demo_data rebuilt a complete demo directory")

    monkeypatch.setattr(demo_mod, "_build", no_rebuild)
    assert demo_mod.demo_data() == demo
    assert demo_mod._manifest_ok(demo.root)
    monkeypatch.setattr(demo_mod, "_python_id", lambda: "cpython-0.0.0")  # another interpreter must rebuild
    assert not demo_mod._manifest_ok(demo.root)


def test_records_sizes_and_uniqueness(demo):
    stats = demo.read_stats()
    train, heldout = demo.records("train"), demo.records("heldout")
    assert 2000 <= len(train) <= demo_mod.MAX_TRAIN and 100 <= len(heldout) <= demo_mod.MAX_HELDOUT
    assert 0.05 <= len(heldout) / (len(train) + len(heldout)) <= 0.12
    assert stats["train"]["examples"] == len(train) and stats["heldout"]["examples"] == len(heldout)
    assert stats["vocab_size"] == demo_mod.VOCAB_SIZE
    keys, prompts = set(), set()
    for rec in train + heldout:
        assert set(rec) == {"prompt", "response"}
        assert rec["prompt"].startswith("Write a Python ")
        assert demo_mod.MIN_RESPONSE_CHARS <= len(rec["response"]) <= demo_mod.MAX_RESPONSE_CHARS
        tree = ast.parse(rec["response"])
        (fn,) = tree.body
        assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        assert ast.get_docstring(fn) is None, "the answer must not repeat the docstring"
        assert f"`{fn.name}(" in rec["prompt"]
        keys.add(ast.dump(tree))
        prompts.add(rec["prompt"])
    assert len(keys) == len(prompts) == len(train) + len(heldout), "duplicates across or within the splits"


def test_splits_come_from_disjoint_files(demo):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    splits = demo.read_splits()
    train_files = {path for path, _, _ in splits["train"]}
    heldout_files = {path for path, _, _ in splits["heldout"]}
    pretrain_files = set(splits["pretrain"])
    assert not train_files & heldout_files and not pretrain_files & (train_files | heldout_files)
    assert len(heldout_files) >= 5
    for part in (train_files | heldout_files | pretrain_files):
        assert not set(Path(part).parts[:-1]) & demo_mod.SKIP_DIRS
    # Provenance is real: the named function is defined at that line of that file.
    for path, qualname, line in splits["train"][:50] + splits["heldout"][:50]:
        lines = (stdlib / path).read_text(encoding="utf-8").splitlines()
        name = qualname.rsplit(".", 1)[-1]
        window = "\n".join(lines[line - 1 : line + 30])
        assert f"def {name}(" in window, (path, qualname, line)
    records = demo.records("train")
    assert len(records) == len(splits["train"])
    for rec, (_, qualname, _) in zip(records[:200], splits["train"][:200], strict=True):  # entries line up
        assert f"def {qualname.rsplit('.', 1)[-1]}(" in rec["response"]
    pretrain = demo.pretrain.read_text(encoding="utf-8")
    headers = [line[len("# file: ") :] for line in pretrain.splitlines() if line.startswith("# file: ")]
    assert set(headers) >= pretrain_files and len(pretrain) <= demo_mod.PRETRAIN_MAX_CHARS + len(pretrain_files)
    assert demo.read_stats()["pretrain"]["chars"] == len(pretrain) > 200_000
    for rec in records[:200]:  # no training answer hides in the pre-training text
        assert rec["response"] not in pretrain


def test_tokenizer_round_trips_and_chat_template(demo, demo_tokenizer):
    tok = demo_tokenizer
    assert len(tok) == demo_mod.VOCAB_SIZE
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}) == 4
    texts = [r["response"] for r in demo.records("heldout")[:20]]
    texts += ["héllo wörld ✓ 漢字 \t\r\n  trailing  ", "def f(x):\n\treturn x ** 2  # tab"]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    code = demo.records("train")[0]["response"]
    assert len(tok(code, add_special_tokens=False)["input_ids"]) < len(code) / 2.0  # it learned code merges
    rendered = tok.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<s><|user|>\nq\n<|assistant|>\n"


def test_rebuild_racing_another_process_is_identical_and_locked(demo, tmp_path, capsys):
    """This process and a child race to build the same fresh root: one builds, the files equal ours."""
    root = tmp_path / "race"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    try:
        raced = demo_mod.demo_data(root)
        _, _, raced_id = load_model("tiny-llama", root=root)
    finally:
        out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err
    assert raced == demo_mod.DemoData.at(root)
    messages = err + capsys.readouterr().err
    assert messages.count("building the demo data set") == 1, messages
    demo_files = {k: v for k, v in _files(demo.root).items() if not k.startswith("tiny-llama/")}
    race_files = {k: v for k, v in _files(root).items() if not k.startswith("tiny-llama/")}
    assert race_files == demo_files and "tokenizer/tokenizer.json" in race_files
    _, _, model_id = load_model("tiny-llama")
    child_id = json.loads(out.strip().splitlines()[-1])["model_id"]
    assert child_id == raced_id == model_id, "processes loaded different tiny-llama weights"
    assert not list(tmp_path.glob(".race.tmp-*")) and not list(root.glob(".tiny-llama.tmp-*"))


def test_tiny_llama_identical_weights_and_forward(demo):
    model, tok, model_id = load_model("tiny-llama")
    again, _, again_id = load_model("tiny-llama")
    assert model_id == again_id and model_id.startswith("tiny-llama@")
    sd, sd2 = model.state_dict(), again.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size) == (128, 4, len(tok))
    assert 2 <= cfg.num_hidden_layers <= 4 and cfg.max_position_embeddings >= 1024
    assert not cfg.tie_word_embeddings and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert (demo.root / "tiny-llama" / "model.safetensors").is_file()
    ds = load_data(demo.records("heldout")[:4], tok)
    batch = collate([ds[i] for i in range(len(ds))], pad_id=tok.pad_token_id)
    with torch.no_grad():
        out = model(**batch)
    assert out.logits.shape == (*batch["input_ids"].shape, len(tok))
    assert torch.isfinite(out.loss) and abs(out.loss.item() - torch.log(torch.tensor(len(tok))).item()) < 1.0
    bf16, _, bf16_id = load_model("tiny-llama", dtype="bfloat16")
    assert next(bf16.parameters()).dtype == torch.bfloat16 and bf16_id == model_id


def test_local_directory_and_errors(tmp_path):
    model, tok, _ = load_model("tiny-llama")
    local = tmp_path / "my-model"
    model.save_pretrained(str(local))
    tok.pad_token = None  # a tokenizer without pad token gets eos
    tok.save_pretrained(str(local))
    loaded, loaded_tok, local_id = load_model(str(local))
    sd, loaded_sd = model.state_dict(), loaded.state_dict()
    assert sd.keys() == loaded_sd.keys() and all(torch.equal(sd[k], loaded_sd[k]) for k in sd)
    assert loaded_tok.pad_token == loaded_tok.eos_token == "</s>"
    assert local_id.startswith(str(local.resolve()) + "@") and load_model(local)[2] == local_id
    with pytest.raises(ValueError, match=r"'no-such-model'.*tiny-llama.*no such directory"):
        load_model("no-such-model")
    with pytest.raises(ValueError, match="no config.json"):
        load_model(str(tmp_path))
    with pytest.raises(TypeError, match="dtype"):
        load_model("tiny-llama", dtype="float99")
    with pytest.raises(TypeError, match="spec"):
        load_model(3)
    assert "tiny-llama" in BUILTIN_MODELS
