"""Where a model spec that is no built-in or GGUF file lives: a local directory, or the Hugging Face cache.

:func:`model_directory` resolves a local ``save_pretrained`` directory, or the cached snapshot of a hub id
(``org/name``; :func:`hf_hub_cache`, read as ``HF_HUB_OFFLINE=1`` would: nothing is downloaded), and refuses anything
else in one line naming the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

from clusterlm.models.builtin import BUILTIN_MODELS
from clusterlm.models.gguf import GGUF_MODELS

__all__ = ["hf_hub_cache", "model_directory"]


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache directory, read from the environment now: ``$HF_HUB_CACHE``, else
    ``$HF_HOME/hub``, else ``huggingface_hub``'s default (``~/.cache/huggingface/hub``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _cached_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot directory of hub model ``repo_id`` (offline: nothing is downloaded), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        found = Path(snapshot_download(repo_id, cache_dir=str(hf_hub_cache()), local_files_only=True))
    except (HFValidationError, OSError, ValueError):
        return None
    return found if (found / "config.json").is_file() else None


def model_directory(name: str) -> Path:
    """A local Hugging Face model directory, or the cached snapshot of hub id ``name``; else one-line errors."""
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return path.resolve()
    known = ", ".join(sorted([*BUILTIN_MODELS, *GGUF_MODELS]))
    if (path / "adapter_config.json").is_file():
        raise ValueError(
            f"load_model: {name!r} holds a PEFT adapter (adapter_config.json), not a whole model; load its base model, "
            "apply the adapter and merge it (PeftModel.from_pretrained(base, dir).merge_and_unload()), then "
            "save_pretrained the merged model and its tokenizer into a directory and pass that."
        )
    if path.exists():
        why = "no config.json in it" if path.is_dir() else "not a directory"
        raise ValueError(
            f"load_model: spec={name!r} is neither a built-in model ({known}), a .gguf file, nor a local Hugging Face "
            f"model directory ({why}). Save one with model.save_pretrained(dir) and tokenizer.save_pretrained(dir)."
        )
    if name.startswith(("/", ".", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name):  # a path
        raise ValueError(
            f"load_model: no such model directory {name!r}, and it is no built-in model ({known}) or hub id "
            "('org/name'); check the path, or save a model there with model.save_pretrained(dir) and "
            "tokenizer.save_pretrained(dir)."
        )
    snapshot = _cached_snapshot(name)
    if snapshot is not None:
        return snapshot
    raise ValueError(
        f"load_model: {name!r} is not a built-in model ({known}), a .gguf file or a local directory (no such "
        f"directory), and the Hugging Face cache {str(hf_hub_cache())!r} holds no snapshot of it (models are never "
        "downloaded here); fetch it "
        f"once with `hf download {name}` (or point HF_HUB_CACHE / HF_HOME at the cache that has it), or pass a "
        "directory written by save_pretrained."
    )
