"""Model ids: one id for one model, however it was loaded (built-in name, directory, cache, GGUF, Python object).

:func:`compute_model_id` is ``"<label>@<model_hash>"``: :func:`model_hash` hashes the config (without the keys that
describe the library or the load call) and a strided bfloat16 sample of every tensor; :func:`model_label` is
informative only. :func:`check_model_id` refuses to train a model on a plan selected with other weights.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch

from clusterlm.plan import same_model

__all__ = ["INFO_FILE", "check_model_id", "compute_model_id", "model_hash", "model_label"]

# Written last into a directory clusterlm built (a built-in, a converted GGUF file): its presence means complete;
# it records the name model_label reports.
INFO_FILE = "clusterlm_model.json"

# Config keys that describe the library, the load call, or the special tokens and switches that load_model and
# TRL set on a loaded model's config; none of them changes what the network computes.
_VOLATILE_CONFIG_KEYS = frozenset({
    "transformers_version", "_name_or_path", "dtype", "torch_dtype", "architectures", "pad_token_id",
    "bos_token_id", "eos_token_id", "use_cache", "attn_implementation", "_attn_implementation",
    "_attn_implementation_autoset", "output_attentions", "output_hidden_states", "return_dict",
    "output_router_logits", "router_aux_loss_coef", "_commit_hash",
})
_HASH_SAMPLE = 1 << 16  # values per tensor that enter the hash (a strided sample of larger tensors)
_HASH_HEX = re.compile(r"[0-9a-f]{12}")


def _stable(config: Any) -> Any:
    if isinstance(config, dict):
        return {k: _stable(v) for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    return config


def _plain_model(model: Any) -> Any:
    """The network itself: without DDP/Accelerate wrappers, and the base model of a PEFT model."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _base_weight_name(name: str) -> str | None:
    """A PEFT-injected layer's name as in the base model; None for adapter weights."""
    if "lora_" in name or ".modules_to_save." in name:
        return None
    return name.replace(".base_layer.", ".").replace(".original_module.", ".")


def model_hash(model: Any) -> str | None:
    """12 hex digits identifying a model's weights and config (see the module docstring).

    Args:
        model: a ``transformers`` causal LM (also wrapped in DDP / Accelerate, or a PEFT model: its base
            weights count, the adapters do not).

    Returns:
        The hash, or None when the weights are not materialised in this process (meta tensors, DeepSpeed
        ZeRO-3 partitions).
    """
    net = _plain_model(model)
    config = getattr(net, "config", None)
    config_dict = _stable(config.to_dict()) if hasattr(config, "to_dict") else {}
    digest = hashlib.sha256(json.dumps(config_dict, sort_keys=True, default=str).encode())
    weights = {}
    for name, tensor in net.state_dict().items():
        base = _base_weight_name(name)
        if base is not None and tensor.is_floating_point():
            weights[base] = tensor
    for name, tensor in sorted(weights.items()):
        if tensor.is_meta or getattr(tensor, "ds_numel", None) is not None:
            return None
        flat = tensor.detach().reshape(-1)
        stride = max(1, -(-flat.numel() // _HASH_SAMPLE))
        # bfloat16 bits: a float32 and a bfloat16 load of the same checkpoint hash alike
        sample = flat[::stride].to(torch.bfloat16).view(torch.int16).cpu().numpy()
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(sample.tobytes())
    return digest.hexdigest()[:12]


def _cache_repo_id(path: Path) -> str | None:
    """``org/name`` of a snapshot directory in the Hugging Face cache layout, else None."""
    parts = path.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    return None


def model_label(model: Any) -> str:
    """A readable name for a loaded model: the built-in/GGUF name of a directory clusterlm built, ``org/name``
    for a Hugging Face cache snapshot or a hub id, the absolute path of another directory, else the model type."""
    net = _plain_model(model)
    config = getattr(net, "config", None)
    source = str(getattr(config, "_name_or_path", "") or "")
    if source:
        path = Path(source)
        try:
            return str(json.loads((path / INFO_FILE).read_text(encoding="utf-8"))["name"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        repo = _cache_repo_id(path)
        if repo is not None:
            return repo
        return str(path.resolve()) if path.is_dir() else source
    return str(getattr(config, "model_type", "") or type(net).__name__)


def compute_model_id(model: Any, name: str | None = None) -> str:
    """The model id ``"<label>@<model_hash>"`` that plans record (``label`` = ``name`` or :func:`model_label`).

    Raises:
        ValueError: the weights are not materialised in this process (see :func:`model_hash`).
    """
    digest = model_hash(model)
    if digest is None:
        raise ValueError(
            "compute_model_id: the model's weights are not materialised in this process (meta tensors or DeepSpeed "
            "ZeRO-3 partitions); compute the id before partitioning, e.g. on the model from from_pretrained."
        )
    return f"{name or model_label(model)}@{digest}"


def check_model_id(expected: str, model: Any, *, who: str, allow_other_model: bool = False) -> bool:
    """Refuse to train ``model`` on a plan selected with another model.

    Args:
        expected: the plan's ``model_id``.
        model: the model about to be trained.
        who: the caller, for the message (e.g. ``"ClusterTrainer"``).
        allow_other_model: train anyway (the check still runs; nothing is raised).

    Returns:
        True when both ids could be compared and agree (or ``allow_other_model``); False when the plan's id
        carries no weights hash (e.g. ``""`` for a random plan) or the weights are not materialised here.

    Raises:
        ValueError: the hashes differ and ``allow_other_model`` is False; one line naming both ids and the fixes.
    """
    want = expected.rpartition("@")[2] if isinstance(expected, str) else ""
    if not _HASH_HEX.fullmatch(want):
        return False
    got = model_hash(model)
    if got is None:
        return False
    if not same_model(expected, f"{model_label(model)}@{got}") and not allow_other_model:
        raise ValueError(
            f"{who}: the plan was selected with model {expected}, but the model being trained is "
            f"{model_label(model)}@{got} (other weights or config). Train the model the plan was made with, make a "
            "new plan with this model (clusterlm select), or pass allow_other_model=True (--allow-other-model) to "
            "train on it anyway."
        )
    return True
