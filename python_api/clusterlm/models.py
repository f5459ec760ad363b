"""Models by name: the built-in demo models and local Hugging Face model directories, never downloaded.

``load_model("tiny-llama")`` gives a small ``LlamaForCausalLM`` (hidden 128, 4 layers, 4 heads, MLP 344,
untied output embeddings, RoPE, 2048 positions) over the demo tokenizer (:mod:`clusterlm.demo`). Its
weights are initialised once from a fixed seed and saved (safetensors) in the demo directory under
``tiny-llama/``; every later call, in any process, loads those files, so all processes of a run (and
all runs on a machine) use identical weights. Built-ins live in :data:`BUILTIN_MODELS`, name ->
:class:`BuiltinModel` (a builder writing a ``save_pretrained`` directory), so more (e.g. a pre-trained
variant) can be registered.

``load_model("<directory>")`` loads ``AutoModelForCausalLM`` / ``AutoTokenizer`` from a local directory
with ``local_files_only=True``. Built-in names take precedence over a directory of the same name
(write ``./tiny-llama`` to mean the directory).

The returned ``model_id`` is stable across processes: ``"<name>@<sha256 of config + weights, 12 hex>"``
for built-ins, ``"<absolute path>@<sha256 of config.json, 12 hex>"`` for directories (hashing the
weights of a large model would take too long; the path and config identify it in practice).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clusterlm.demo import DemoData, demo_data

__all__ = ["BUILTIN_MODELS", "BuiltinModel", "load_model", "tiny_llama_config"]

_INFO = "clusterlm_model.json"  # written last into a built-in's directory: its presence means complete
_SEED = 0


@dataclass(frozen=True)
class BuiltinModel:
    """A model :func:`load_model` can build locally by name.

    Attributes:
        description: one line for listings and error messages.
        build: ``build(out_dir, demo)`` writes a complete ``save_pretrained`` directory (model and
            tokenizer) into ``out_dir`` (an empty temporary directory); ``demo`` is the demo data set.
            It must be deterministic: every process relies on the saved files, not on rebuilding.
        version: bump to rebuild directories written by an older builder.
    """

    description: str
    build: Callable[[Path, DemoData], None]
    version: int = 1


def tiny_llama_config(vocab_size: int, bos_token_id: int, eos_token_id: int, pad_token_id: int) -> Any:
    """The ``LlamaConfig`` of ``"tiny-llama"`` for a tokenizer with these ids."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )


def _build_tiny_llama(out_dir: Path, demo: DemoData) -> None:
    from transformers import LlamaForCausalLM

    tokenizer = demo.load_tokenizer()
    config = tiny_llama_config(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    # A private RNG stream: the weights depend on the seed only, and the caller's RNG state is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = LlamaForCausalLM(config)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "tiny-llama": BuiltinModel(
        description="LlamaForCausalLM, hidden 128, 4 layers, demo tokenizer (4096 tokens), random weights (seed 0)",
        build=_build_tiny_llama,
    ),
    "tiny-llama-pretrained": BuiltinModel(
        description="tiny-llama after a short causal-LM pre-training on the demo's pretrain.txt (clusterlm.pretrain)",
        build=lambda out_dir, demo: __import__("clusterlm.pretrain", fromlist=["build"]).build(out_dir, demo),
    ),
}


def _state_hash(model: torch.nn.Module, config: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to(torch.float32).cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:12]


def _stable_config(model: torch.nn.Module) -> dict[str, Any]:
    config = model.config.to_dict()
    for key in ("transformers_version", "_name_or_path", "dtype", "torch_dtype"):
        config.pop(key, None)  # describe the library or the load call, not the model
    return config


def _ensure_builtin(name: str, root: str | os.PathLike[str] | None) -> Path:
    """The directory of built-in ``name``, built (under a file lock, moved into place atomically) if needed."""
    spec = BUILTIN_MODELS[name]
    demo = demo_data(root)
    out = demo.root / name

    def complete() -> bool:
        try:
            info = json.loads((out / _INFO).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return info.get("name") == name and info.get("version") == spec.version

    if complete():
        return out
    from filelock import FileLock
    from transformers import AutoModelForCausalLM

    with FileLock(str(demo.root / f".{name}.lock"), timeout=600):
        if complete():
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=demo.root))
        try:
            tmp.chmod(0o755)
            spec.build(tmp, demo)
            # The id is computed from the saved files as loaded, exactly what every later call gets.
            model = AutoModelForCausalLM.from_pretrained(str(tmp), local_files_only=True, dtype=torch.float32)
            model_id = f"{name}@{_state_hash(model, _stable_config(model))}"
            info = {"name": name, "version": spec.version, "model_id": model_id}
            (tmp / _INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            if out.exists():
                shutil.rmtree(out)  # an older version's files; we hold the lock
            os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


@contextlib.contextmanager
def _quiet_progress(enabled: bool) -> Iterator[None]:
    """Hide transformers' per-tensor loading/saving bars (noise for a model that loads in milliseconds)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    if enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled and was_on:
            hf_logging.enable_progress_bar()


def _as_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype.removeprefix("torch."), None), torch.dtype):
        return getattr(torch, dtype.removeprefix("torch."))
    raise TypeError(f"load_model: dtype must be None, a torch.dtype or its name (e.g. 'bfloat16'), got {dtype!r}.")


def load_model(
    spec: str | os.PathLike[str], *, dtype: Any = None, root: str | os.PathLike[str] | None = None
) -> tuple[Any, Any, str]:
    """Load a causal LM and its tokenizer by built-in name or local directory.

    Args:
        spec: a name in :data:`BUILTIN_MODELS` (e.g. ``"tiny-llama"``) or a local Hugging Face model
            directory (``config.json``, weights, tokenizer files).
        dtype: parameter dtype (``torch.float32``, ``torch.bfloat16`` or its name); None keeps the saved dtype.
        root: demo directory for built-ins (default :func:`clusterlm.demo.default_root`).

    Returns:
        ``(model, tokenizer, model_id)``: the model in eval mode on CPU, the tokenizer (pad token set to
        eos when it had none), and a stable identifier (see the module docstring).

    Raises:
        ValueError: ``spec`` is neither a built-in name nor a directory with ``config.json`` (the message
            lists the built-in names), or the directory cannot be loaded.
        TypeError: ``spec`` is not a string/path, or a bad ``dtype``.
    """
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(
            f"load_model: spec must be a built-in model name or a directory path, got {type(spec).__name__}."
        )
    torch_dtype = _as_dtype(dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = os.fspath(spec)
    builtin = name in BUILTIN_MODELS
    if builtin:
        with _quiet_progress(True):
            path = _ensure_builtin(name, root)
        model_id = json.loads((path / _INFO).read_text(encoding="utf-8"))["model_id"]
    else:
        path = Path(name).expanduser()
        if not (path / "config.json").is_file():
            if not path.exists():
                why = "no such directory"
            else:
                why = "no config.json in it" if path.is_dir() else "not a directory"
            raise ValueError(
                f"load_model: spec={name!r} is neither a built-in model ({', '.join(sorted(BUILTIN_MODELS))}) nor a "
                f"local Hugging Face model directory ({why}). Models are never downloaded: save one with "
                "model.save_pretrained(dir) and tokenizer.save_pretrained(dir), then pass dir."
            )
        path = path.resolve()
        config_hash = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()[:12]
        model_id = f"{path}@{config_hash}"
    kwargs: dict[str, Any] = {"local_files_only": True}
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    try:
        with _quiet_progress(builtin):
            model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"load_model: could not load a causal LM and tokenizer from {str(path)!r}: {err}") from err
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(model.config, "pad_token_id", None) is None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    return model, tokenizer, model_id
