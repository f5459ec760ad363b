"""The built-in demo models (:data:`BUILTIN_MODELS`), built once into the demo directory, and :func:`build_once`.

A built-in is a :class:`BuiltinModel`: a deterministic builder writing a ``save_pretrained`` directory. It is built
once under a file lock into a temporary directory, its model id computed from the saved files, and moved into place
atomically (:func:`build_once`, also used for converted GGUF files); every later call loads those files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clusterlm.data.demo import DemoData, demo_data
from clusterlm.models.directory import save_model_dir
from clusterlm.models.ids import INFO_FILE, compute_model_id
from clusterlm.models.pretrain import build as build_pretrained_tiny_llama
from clusterlm.models.pretrain import tiny_llama_config

__all__ = ["BUILTIN_MODELS", "BuiltinModel", "build_once", "ensure_builtin"]

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


def _build_tiny_llama(out_dir: Path, demo: DemoData) -> None:
    from transformers import LlamaForCausalLM

    tokenizer = demo.load_tokenizer()
    config = tiny_llama_config(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    # A private RNG stream: the weights depend on the seed only, and the caller's RNG state is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = LlamaForCausalLM(config)
    save_model_dir(model, tokenizer, out_dir)


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "tiny-llama": BuiltinModel(
        description="LlamaForCausalLM, hidden 128, 4 layers, demo tokenizer (4096 tokens), random weights (seed 0)",
        build=_build_tiny_llama,
    ),
    "tiny-llama-pretrained": BuiltinModel(
        description="tiny-llama after a short causal-LM pre-training on the demo's pretrain.txt "
                    "(clusterlm.models.pretrain)",
        build=build_pretrained_tiny_llama,
    ),
}


def build_once(out: Path, name: str, info: dict[str, Any], build: Callable[[Path], None]) -> Path:
    """``out``, built by ``build(tmp)`` if its info file does not match ``info`` (file lock, atomic move).

    The model id is computed from the saved files as loaded, exactly what every later call gets, and
    written with ``info`` into ``INFO_FILE`` last: its presence means the directory is complete.
    """

    def complete() -> bool:
        try:
            found = json.loads((out / INFO_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return all(found.get(k) == v for k, v in info.items())

    if complete():
        return out
    from filelock import FileLock
    from transformers import AutoModelForCausalLM

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.parent / f".{out.name}.lock"), timeout=1800):
        if complete():
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            tmp.chmod(0o755)
            build(tmp)
            model = AutoModelForCausalLM.from_pretrained(str(tmp), local_files_only=True, dtype=torch.float32)
            model_id = compute_model_id(model, name=name)
            del model
            record = {**info, "model_id": model_id}
            (tmp / INFO_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            if out.exists():
                shutil.rmtree(out)  # an older version's files; we hold the lock
            os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def ensure_builtin(name: str, root: str | os.PathLike[str] | None) -> Path:
    """The directory of built-in ``name``, built if needed."""
    spec = BUILTIN_MODELS[name]
    demo = demo_data(root)
    return build_once(demo.root / name, name, {"name": name, "version": spec.version},
                       lambda tmp: spec.build(tmp, demo))
