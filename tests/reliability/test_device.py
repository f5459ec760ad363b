"""The GPU reachable from every entry point (issue 21, item 1), checked without a GPU.

Device and dtype resolution with CUDA availability patched, the one-line refusal of ``--device cuda`` on a
machine without CUDA (before any model loads), the options in ``--help``, weights loaded in the asked dtype, and
the featurization batch size taken from the free device memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_helpers import nonblank_lines, run_cli

from clusterlm.config.selection import SelectConfig
from clusterlm.models import load_model, resolve_device, resolve_dtype
from clusterlm.selection import pipeline
from clusterlm.selection.features import DEFAULT_BATCH_TOKENS, GradientFeaturizer


def test_auto_is_the_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32


def test_auto_is_this_ranks_gpu_under_torchrun(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("auto") == torch.device("cuda", 3)
    monkeypatch.delenv("LOCAL_RANK")
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="only 4 CUDA device"):
        resolve_device("cuda:7")


@pytest.mark.parametrize("bf16, want", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_is_bfloat16_where_the_gpu_has_it(monkeypatch, bf16, want):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert resolve_dtype("auto", torch.device("cuda", 0)) == want
    assert resolve_dtype("float16", torch.device("cuda", 0)) == torch.float16
    assert resolve_dtype(None, torch.device("cpu")) is None  # keep the checkpoint's


def test_cuda_without_cuda_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"--device cuda: no CUDA device is visible.*--device cpu"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="device must be one of"):
        resolve_device("tpu-ish")


def test_select_refuses_cuda_here_before_the_model_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(pipeline, "load_model", no_model)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"p{i}", "response": f"r{i}"}) for i in range(8)))
    rc = run_cli(["select", "--model", "tiny-llama", "--data", str(data), "--world-size", "2", "--ratio", "0.5",
                  "--out", str(tmp_path / "out"), "--device", "cuda"])
    lines = nonblank_lines(capsys.readouterr().err)
    assert rc == 2 and len(lines) == 1, lines
    assert "--device cuda" in lines[0] and "no CUDA device" in lines[0] and "Traceback" not in lines[0]


def test_help_shows_device_and_dtype(capsys):
    assert run_cli(["select", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--device" in text and "--dtype" in text and "bfloat16" in text


def test_weights_load_in_the_asked_dtype_on_the_asked_device():
    model, _, _ = load_model("tiny-llama", device="cpu", dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    model, _, _ = load_model("tiny-llama", device="auto", dtype="auto")  # no CUDA here: CPU, float32
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def _featurizer(features: str) -> GradientFeaturizer:
    model, _, _ = load_model("tiny-llama")
    return GradientFeaturizer(model, features=features, dim=(4, 4))


def test_batch_tokens_follow_the_free_memory():
    head, every = _featurizer("lm_head"), _featurizer("all-linear")
    assert head.auto_batch_tokens() == DEFAULT_BATCH_TOKENS  # the model is on the CPU
    small, large = head.auto_batch_tokens(free_bytes=2 << 30), head.auto_batch_tokens(free_bytes=40 << 30)
    assert 256 <= small < large <= 262_144 and small % 256 == 0 and large % 256 == 0
    assert every.auto_batch_tokens(free_bytes=2 << 30) < small  # a backward keeps every layer's inputs
    assert head.auto_batch_tokens(free_bytes=0) == 256  # never below one small batch


def test_pipeline_runs_the_model_on_the_resolved_device(tmp_path, monkeypatch):
    """The pipeline hands --device / --dtype to load_model (which puts the weights there)."""
    seen = {}

    def record(name, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop after loading")

    monkeypatch.setattr(pipeline, "load_model", record)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"p{i}", "response": f"r{i}"}) for i in range(8)))
    job = pipeline.SelectJob(model="tiny-llama", data=str(data), out=Path(tmp_path / "o"), device="cpu",
                             dtype="bfloat16", progress=False,
                             config=SelectConfig(world_size=2, ratio=0.5))
    with pytest.raises(RuntimeError, match="stop after loading"):
        pipeline.run_select(job)
    assert seen == {"device": "cpu", "dtype": "bfloat16"}
