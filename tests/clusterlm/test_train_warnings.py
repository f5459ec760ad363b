"""Precision warnings and refusals of the trainer, the zero-lora_B feature warning and the paper preset's
shortfall line in Plan.summary: all without a training run. (The windowed loss summary: test_metrics.py.)"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from clusterlm.cli import commands as cli
from clusterlm.cli.options import parse_config
from clusterlm.config.training import TrainConfig
from clusterlm.launch.launcher import DistInfo
from clusterlm.selection.features import GradientFeaturizer
from clusterlm.training import loop as train_loop
from clusterlm.training import model as train_model

AVX2_ONLY = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme sse sse2 avx avx2 fma bmi2 adx sha_ni
"""
SAPPHIRE_RAPIDS = AVX2_ONLY.replace("sha_ni", "sha_ni avx512f avx512bw avx512_bf16 amx_bf16 amx_tile")
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes sve bf16 i8mm\n"


def _cpuinfo(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------------
# bf16 autocast on a CPU without native bf16
# ---------------------------------------------------------------------------------------------------


def test_cpu_native_bf16_read_from_cpuinfo_flags(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    assert train_model.cpu_has_native_bf16(_cpuinfo(tmp_path, AVX2_ONLY)) is False
    assert train_model.cpu_has_native_bf16(_cpuinfo(tmp_path, SAPPHIRE_RAPIDS)) is True
    assert train_model.cpu_has_native_bf16(_cpuinfo(tmp_path, ARM_BF16)) is True
    assert train_model.cpu_has_native_bf16(_cpuinfo(tmp_path, "processor\t: 0\n")) is None  # no flags line: unknown
    assert train_model.cpu_has_native_bf16(tmp_path / "missing") is None
    monkeypatch.setattr(sys, "platform", "darwin")  # not Linux: no check
    assert train_model.cpu_has_native_bf16(_cpuinfo(tmp_path, AVX2_ONLY)) is None


def test_bf16_cpu_warning_only_for_bf16_on_a_cpu_without_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    avx2 = _cpuinfo(tmp_path, AVX2_ONLY)
    msg = train_model.bf16_cpu_warning(True, cpu, avx2)
    assert msg is not None and "order of magnitude slower" in msg and "--bf16 off" in msg
    assert train_model.bf16_cpu_warning(False, cpu, avx2) is None
    assert train_model.bf16_cpu_warning(True, cuda, avx2) is None
    assert train_model.bf16_cpu_warning(True, cpu, _cpuinfo(tmp_path, SAPPHIRE_RAPIDS)) is None


def test_bf16_auto_is_on_only_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert train_model.use_bf16("auto", torch.device("cpu")) is False
    assert train_model.use_bf16("auto", torch.device("cuda", 0)) is True
    assert train_model.use_bf16("on", torch.device("cpu")) is True
    assert train_model.use_bf16("off", torch.device("cuda", 0)) is False
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert train_model.use_bf16("auto", torch.device("cuda", 0)) is False


# ---------------------------------------------------------------------------------------------------
# Pure low-precision weights
# ---------------------------------------------------------------------------------------------------


def _args(*extra: str) -> TrainConfig:
    return cli.train_config(parse_config(cli.train_parser(), ["--plan", "full", "--model", "tiny-llama", "--data",
                                                           "d.jsonl", "--out", "o", *extra]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_pure_low_precision_weights_refused_without_lora(dtype):
    with pytest.raises(ValueError, match=f"--dtype {dtype}") as info:
        _args("--dtype", dtype).check()
    msg = str(info.value)
    assert "\n" not in msg and "--bf16 on" in msg and "float32" in msg and "LoRA" in msg
    _args("--model-dtype", dtype, "--lora-r", "4").check()  # frozen low-precision base: allowed
    _args("--model-dtype", "float32").check()
    _args().check()


def test_pure_bf16_refused_by_the_cli_before_anything_is_loaded(tmp_path, monkeypatch, capfd):
    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the arguments were validated")

    monkeypatch.setattr(train_loop, "build_model", no_model)
    monkeypatch.setattr(train_loop, "setup_distributed", no_model)
    argv = ["--plan", str(tmp_path / "no-plan"), "--model", "tiny-llama", "--data", str(tmp_path / "none.jsonl"),
            "--out", str(tmp_path / "out"), "--model-dtype", "bfloat16", "--nproc", "2"]
    assert cli.main(["train", *argv]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("clusterlm train: error: train: --dtype bfloat16")
    assert not (tmp_path / "out").exists()


def test_lora_adapters_on_a_bf16_base_are_float32():
    """What TrainConfig.check relies on: peft keeps the trainable adapters float32 over a bf16 base."""
    args = _args("--model-dtype", "bfloat16", "--lora-r", "2", "--lora-targets", "q_proj,v_proj")
    di = DistInfo(0, 1, 0, None, torch.device("cpu"))
    model, _, _ = train_model.build_model(args, di)
    trainable = {p.dtype for p in model.parameters() if p.requires_grad}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert trainable == {torch.float32} and frozen == {torch.bfloat16}


# ---------------------------------------------------------------------------------------------------
# features="lora" on a fresh adapter
# ---------------------------------------------------------------------------------------------------


def _tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg)


def _lora(init_lora_weights: bool) -> torch.nn.Module:
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=init_lora_weights)
    return peft.get_peft_model(_tiny_llama(), cfg)


def test_lora_features_warn_when_every_lora_b_is_zero():
    model = _lora(True)  # peft's default: lora_B = 0
    with pytest.warns(UserWarning, match="every lora_B weight .* is zero") as record:
        GradientFeaturizer(model, features="lora", dim=(4, 4))
    assert "warm-up" in str(record[0].message) and "lm_head" in str(record[0].message)
    assert record[0].filename == __file__  # stacklevel points at the caller
    a_only = [n for n, _ in model.named_modules() if n.endswith(".lora_A.default")]
    with pytest.warns(UserWarning, match="lora_B"):
        GradientFeaturizer(model, features=a_only, dim=(4, 4))

    nonzero_b = _lora(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        GradientFeaturizer(model, features="all-linear", dim=(4, 4))  # base layers carry the signal
        GradientFeaturizer(nonzero_b, features="lora", dim=(4, 4))  # B != 0


def test_zero_lora_b_really_zeroes_the_lora_a_part():
    """The fact behind the warning: with lora_B = 0 the lora_A-only feature is exactly zero."""
    model = _lora(True)
    a_only = [n for n, _ in model.named_modules() if n.endswith(".lora_A.default")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        feat = GradientFeaturizer(model, features=a_only, dim=(4, 4), normalize=False)
    rng = np.random.default_rng(0)
    examples = [{"input_ids": rng.integers(0, 61, 12), "labels": np.r_[np.full(6, -100), rng.integers(0, 61, 6)]}
                for _ in range(3)]
    assert not feat.featurize(examples, progress=False).any()


# ---------------------------------------------------------------------------------------------------
# Plan.summary: the paper preset's shortfall
# ---------------------------------------------------------------------------------------------------


def test_paper_plan_summary_states_the_shortfall():
    from clusterlm.selection.select import select_from_features

    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(c, 1.0, (n, 8)) for c, n in ((0, 220), (6, 120), (-6, 60))]).astype(np.float32)
    plan = select_from_features(x, world_size=4, ratio=0.31, preset="paper", seed=0)
    n, s = plan.n_examples, plan.n_selected
    assert plan.stats["requested"] == round(0.31 * n) and s < plan.stats["requested"]
    first = plan.summary().splitlines()[0]
    assert (f"{s} of {n} examples selected ({100 * s / n:.1f} % of N; {round(0.31 * n)} = 31.0 % requested: the "
            "paper preset keeps smallest cluster x pct // 100 per cluster)") in first

    default = select_from_features(x, world_size=4, ratio=0.31, seed=0)  # meets the request (up to rounding)
    first = default.summary().splitlines()[0]
    assert "requested" not in first and f"({100 * default.n_selected / n:.1f} %)" in first


def test_weights_dtype_auto_is_float32_for_full_fine_tuning_and_bf16_lora_base_on_cuda(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert train_model.weights_dtype("auto", False, cpu) is torch.float32
    assert train_model.weights_dtype("auto", True, cpu) is torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert train_model.weights_dtype("auto", False, cuda) is torch.float32  # the weights themselves train: never bf16
    assert train_model.weights_dtype("auto", True, cuda) is torch.bfloat16  # frozen base
    assert train_model.weights_dtype("float16", True, cpu) is torch.float16
    assert _args().dtype == "auto" and _args("--model-dtype", "float32").dtype == "float32"  # older name


@pytest.mark.parametrize("fsdp", [False, True])
def test_build_model_loads_straight_onto_the_rank_device(monkeypatch, fsdp):
    """No host copy then .to(device): load_model gets the rank's device (FSDP: the host, shards move later)."""
    seen = {}

    class Stop(Exception):
        pass

    def fake_load(spec, *, dtype=None, device=None, root=None):
        seen.update(dtype=dtype, device=device)
        raise Stop

    monkeypatch.setattr(train_model, "load_model", fake_load)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    extra = ("--lora-r", "4") + (("--fsdp",) if fsdp else ())
    di = DistInfo(1, 2, 1, None, torch.device("cuda", 1))
    with pytest.raises(Stop):
        train_model.build_model(_args(*extra), di)
    assert seen["dtype"] is torch.bfloat16
    assert seen["device"] == (None if fsdp else torch.device("cuda", 1))
