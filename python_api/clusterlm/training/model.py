"""The model a training rank trains: weights' dtype, LoRA, gradient checkpointing, and bf16 on the CPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from clusterlm.config.training import TrainConfig
from clusterlm.launch.launcher import DistInfo
from clusterlm.models import load_model, resolve_dtype
from clusterlm.training.checks import uses_fsdp

__all__ = ["CPUINFO", "bf16_cpu_warning", "build_model", "add_lora", "cpu_has_native_bf16", "use_bf16",
           "weights_dtype"]

CPUINFO = "/proc/cpuinfo"
# x86 flags of native bf16 arithmetic (AVX512-BF16, AMX), and aarch64's BF16 extension ("Features" line).
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def weights_dtype(dtype: str, lora: bool, device: torch.device) -> torch.dtype:
    """The dtype training loads the weights in: ``--dtype`` as given, and for ``"auto"`` float32 when the weights
    themselves train (full fine-tuning) and the frozen LoRA base in :func:`clusterlm.models.resolve_dtype`'s choice
    (bfloat16 on a CUDA device that supports it, else float32)."""
    return resolve_dtype(dtype, device) if dtype != "auto" or lora else torch.float32


def build_model(config: TrainConfig, di: DistInfo) -> tuple[torch.nn.Module, Any, str]:
    """Load the model (optionally with LoRA) on this rank's device; ``(model, tokenizer, model_id)``.

    The weights go straight from the files to ``di.device`` in :func:`weights_dtype` (no float32 host copy); under
    FSDP they load on the host and each shard moves to the device as it is sharded
    (:func:`clusterlm.engine.fsdp.shard_model`).
    """
    dtype = weights_dtype(config.dtype, config.lora_r > 0, di.device)
    torch.manual_seed(config.seed)  # the same LoRA initialisation on every rank (DDP broadcasts rank 0's anyway)
    model, tokenizer, model_id = load_model(config.model, dtype=dtype, device=None if uses_fsdp(config) else di.device)
    if config.gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs (LoRA) and DDP. transformers 5 renamed the call.
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.config.use_cache = False
    if config.lora_r > 0:
        model = add_lora(model, config)
    if not uses_fsdp(config):  # FSDP moves each shard to the device as it shards (shard_model)
        model.to(di.device)
    model.train()
    return model, tokenizer, model_id


def add_lora(model: torch.nn.Module, config: TrainConfig) -> torch.nn.Module:
    """The PEFT LoRA model of --lora-r/--lora-alpha/--lora-dropout/--lora-targets.

    Raises:
        ValueError: peft made the adapters low-precision (they would barely learn).
    """
    from peft import LoraConfig, get_peft_model

    targets: str | list[str] = config.lora_targets
    if targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    lora_config = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha or 2 * config.lora_r,
                             lora_dropout=config.lora_dropout, target_modules=targets, task_type="CAUSAL_LM")
    model = get_peft_model(model, lora_config)
    low = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad and p.dtype != torch.float32})
    if low:  # TrainConfig.check allowed the low-precision base on the promise of float32 adapters
        raise ValueError(
            f"train: peft made the LoRA adapters {', '.join(low)} (--dtype {config.dtype}); they "
            "would barely learn. Use --dtype float32 (with --bf16 on), or a peft that keeps adapters in "
            "float32 (autocast_adapter_dtype)."
        )
    return model


def cpu_has_native_bf16(cpuinfo: str | os.PathLike = CPUINFO) -> bool | None:
    """Whether this CPU does bf16 arithmetic natively, from the flags in ``/proc/cpuinfo``.

    Args:
        cpuinfo: the file to read (``/proc/cpuinfo``).

    Returns:
        True / False from the ``flags`` (x86) or ``Features`` (aarch64) lines; None when unknown (not
        Linux, the file is unreadable or has no flags line).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            flags.update(value.split())
    if not flags:
        return None
    return not flags.isdisjoint(_NATIVE_BF16_FLAGS)


def use_bf16(mode: str, device: torch.device) -> bool:
    """--bf16: ``on``, ``off``, or ``auto`` = on for CUDA devices with bf16 (never on CPU)."""
    if mode == "auto":
        return device.type == "cuda" and torch.cuda.is_bf16_supported()
    return mode == "on"


def bf16_cpu_warning(use_bf16: bool, device: torch.device, cpuinfo: str | os.PathLike = CPUINFO) -> str | None:
    """The warning for bf16 autocast on a CPU without native bf16 (None when it does not apply)."""
    if not use_bf16 or device.type != "cpu" or cpu_has_native_bf16(cpuinfo) is not False:
        return None
    return (
        "train: warning: --bf16 on autocasts to bfloat16 on a CPU without native bf16 (no avx512_bf16 / amx_bf16 "
        f"in {cpuinfo}), where bf16 is emulated and training is about an order of magnitude slower than float32 "
        "(measured: 12x for SmolLM2-135M on AVX2); use --bf16 off."
    )

