"""save_model_dir: a built model directory is complete whichever rank of a process group builds it.

transformers' ``save_pretrained`` writes no model files on a rank other than 0 once torch.distributed is initialised;
a built-in model built by rank 1 (whichever rank takes the build lock first builds it) came out without config.json
and weights. torch's "fake" process group (one process that believes it is rank 1 of 2) stands in for a real one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from clusterlm.models.builtin import build_once
from clusterlm.models.directory import save_model_dir
from clusterlm.models.ids import INFO_FILE


class _Tokenizer:
    """What save_model_dir needs of a tokenizer: ``save_pretrained(dir)``."""

    def save_pretrained(self, out_dir: str) -> None:
        Path(out_dir, "tokenizer.json").write_text("{}", encoding="utf-8")


def _model() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config)


@contextmanager
def _rank_1_of_2() -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_rank_1_writes_the_whole_directory(tmp_path: Path) -> None:
    model = _model()
    with _rank_1_of_2():
        save_model_dir(model, _Tokenizer(), tmp_path)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(tmp_path))
    assert "should_save_on_this_rank" not in vars(model)  # the model is left as it was
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values(),
                                                  strict=True))


def test_build_once_on_rank_1_gives_the_model_built_without_a_process_group(tmp_path: Path) -> None:
    def build(out: Path) -> None:
        save_model_dir(_model(), _Tokenizer(), out)

    alone = build_once(tmp_path / "alone", "tiny", {"name": "tiny"}, build)
    with _rank_1_of_2():
        on_rank_1 = build_once(tmp_path / "rank1", "tiny", {"name": "tiny"}, build)
    # build_once records the id of the directory as loaded back (its info file is written last)
    ids = [json.loads((d / INFO_FILE).read_text(encoding="utf-8"))["model_id"] for d in (alone, on_rank_1)]
    assert ids[0] == ids[1]


def test_a_directory_left_without_weights_is_an_error_naming_it(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    monkeypatch.setattr(type(model), "save_pretrained", lambda self, out, **kw: None)  # a release that skips it
    with pytest.raises(RuntimeError, match=r"wrote no config.json or weights into .*tokenizer.json"):
        save_model_dir(model, _Tokenizer(), tmp_path)
