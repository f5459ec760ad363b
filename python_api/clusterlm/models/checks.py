"""A model directory checked before any weights load: a causal-LM config, whole weights files, a real tokenizer.

:func:`check_directory` reads ``config.json`` (:func:`causal_lm_problem`: is it a decoder-only LM?), checks the
weights files from their headers and lengths only, and that tokenizer files are there; :func:`check_vocab` checks a
loaded tokenizer against the embedding's rows. Every refusal is one line naming the file and the fix.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

__all__ = ["UNREADABLE", "causal_lm_problem", "check_directory", "check_vocab", "config_rows", "one_line",
           "weight_files"]

# Files that hold a tokenizer's vocabulary (tokenizer_config.json alone does not: transformers then builds a
# tokenizer of only its special tokens).
_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                "sentencepiece.bpe.model", "tekken.json")
_VOCAB_GLOBS = ("*.tiktoken", "*.spm", "*sentencepiece*.model")
_WEIGHT_GLOBS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel", "WithLMHead")
_CAUSAL_HINT = ("clusterlm fine-tunes causal (decoder-only) language models, as AutoModelForCausalLM loads them: pass "
                "such a model (e.g. Llama, Qwen, SmolLM, GPT-2)")


def one_line(text: Any) -> str:
    return " ".join(str(text).split())


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"load_model: cannot read {str(path / 'config.json')!r}: {one_line(err)}.") from err
    except json.JSONDecodeError as err:
        raise ValueError(
            f"load_model: {str(path / 'config.json')!r} is not valid JSON (line {err.lineno}, column {err.colno}: "
            f"{err.msg}); write it again with model.save_pretrained(dir)."
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"load_model: {str(path / 'config.json')!r} holds no JSON object; not a model's config.")
    return config


def causal_lm_problem(config: dict[str, Any]) -> str | None:
    """Why a model with this ``config.json`` content is not a causal LM (None: it is one).

    Checked against transformers' causal-LM mapping: an encoder-decoder, a model type without a causal-LM
    class, ``architectures`` that name no causal-LM class (a masked LM, a classifier, a base model without its
    head), or an encoder type (BERT, RoBERTa, ...) whose causal class would run with ``is_decoder=False``, i.e.
    attending both ways.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES as known
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal,
    )
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_MASKED_LM_MAPPING_NAMES as masked,
    )

    model_type = config.get("model_type")
    archs = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    named = f" ({', '.join(archs)})" if archs else ""
    if config.get("is_encoder_decoder"):
        return f"it is an encoder-decoder (seq2seq) model{named or f' of type {model_type!r}'}, not a decoder-only LM"
    if not isinstance(model_type, str):
        return "its config.json has no model_type"
    if model_type not in known:
        return (f"model type {model_type!r}{named} is unknown to this transformers (a newer version may know it; "
                "models that need trust_remote_code are not run)")
    if model_type not in causal:
        return f"model type {model_type!r}{named} has no causal-LM class in transformers (AutoModelForCausalLM)"
    classes = set(causal.values())
    if archs and not any(a in classes or a.endswith(_CAUSAL_SUFFIXES) for a in archs):
        return (f"its architecture is {', '.join(archs)}, not a causal-LM head (AutoModelForCausalLM would build "
                f"{causal[model_type]} around it, with an untrained head)")
    if model_type in masked and not (config.get("is_decoder") or config.get("causal")):
        return (f"model type {model_type!r}{named} with is_decoder=False attends in both directions (a masked "
                f"LM); only a {causal[model_type]} saved with is_decoder=True is causal")
    return None


# The weights files transformers loads, in its order of preference: one file, or the shards an index names.
_WEIGHT_FILES = (("model.safetensors", "model.safetensors.index.json"),
                 ("pytorch_model.bin", "pytorch_model.bin.index.json"))
UNREADABLE = ("it is damaged or was cut short (e.g. an interrupted download or copy): download the model again, or "
               "save it again with model.save_pretrained(dir)")


def weight_files(path: Path) -> list[Path]:
    """The weights files of directory ``path`` that ``from_pretrained`` would read (empty: other names)."""
    for single, index in _WEIGHT_FILES:
        if (path / single).is_file():
            return [path / single]
        if (path / index).is_file():
            try:
                weight_map = json.loads((path / index).read_text(encoding="utf-8"))["weight_map"]
                return [path / name for name in sorted(set(weight_map.values()))]
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
                raise ValueError(f"load_model: the weights index {str(path / index)!r} is unreadable "
                                 f"({one_line(err) or type(err).__name__}); {UNREADABLE}.") from None
    return []


def _safetensors_problem(file: Path, size: int) -> str | None:
    """Why a safetensors file cannot be read (its header, or data past its end); None when it looks whole."""
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than a safetensors header"
        n = int.from_bytes(head, "little")
        if n > size - 8:
            return f"its header claims {n} bytes, more than the file's {size}"
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError):
            return "its header is not JSON"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
            and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2]
    if not all(isinstance(e, int) for e in ends):
        return "its header holds offsets that are not integers"
    if ends and 8 + n + max(ends) > size:
        return f"it is cut short: {size} bytes, its header describes {8 + n + max(ends)}"
    return None


def _weights_problem(file: Path) -> str | None:
    """Why a weights file cannot be read, from its header and length only (no tensor is read); None: it looks
    whole (safetensors: header and data length; ``.bin``: a zip archive as torch.save writes, or a pickle)."""
    try:
        size = file.stat().st_size
        if file.name.endswith(".safetensors"):
            return _safetensors_problem(file, size)
        if zipfile.is_zipfile(file):
            return None
        with file.open("rb") as f:
            return None if f.read(1) == b"\x80" else "neither a zip archive (torch.save) nor a pickle"
    except FileNotFoundError:
        return "it is missing (its index names it)"
    except OSError as err:
        return err.strerror or one_line(err)


def _check_weights(path: Path) -> None:
    """Refuse, naming the file, weights that cannot be read (a corrupt or cut-short download)."""
    for file in weight_files(path):
        problem = _weights_problem(file)
        if problem is not None:
            raise ValueError(f"load_model: the weights file {str(file)!r} is unreadable ({problem}); {UNREADABLE}.")


def check_directory(path: Path) -> dict[str, Any]:
    """Before any weights load: a causal-LM config, readable weights files and a tokenizer with a vocabulary."""
    config = _read_config(path)
    problem = causal_lm_problem(config)
    if problem is not None:
        raise ValueError(f"load_model: {str(path)!r} is not a causal language model: {problem}. {_CAUSAL_HINT}.")
    if not any(next(path.glob(g), None) for g in _WEIGHT_GLOBS):
        raise ValueError(
            f"load_model: {str(path)!r} has a config.json but no weights (model.safetensors or pytorch_model.bin); "
            "save them there with model.save_pretrained(dir)."
        )
    _check_weights(path)
    if not any((path / f).is_file() for f in _VOCAB_FILES) and not any(next(path.glob(g), None) for g in _VOCAB_GLOBS):
        raise ValueError(
            f"load_model: {str(path)!r} has no tokenizer files ({', '.join(_VOCAB_FILES[:4])}, ...), so its text "
            f"cannot be tokenised; save the model's tokenizer there with tokenizer.save_pretrained({str(path)!r})."
        )
    return config


def config_rows(config: dict[str, Any]) -> int | None:
    """The embedding rows a config declares (``vocab_size``, or its text config's), if any."""
    for section in (config, config.get("text_config") or {}):
        if isinstance(section, dict) and isinstance(section.get("vocab_size"), int):
            return int(section["vocab_size"])
    return None


def check_vocab(tokenizer: Any, rows: int | None, path: Path) -> None:
    """Refuse a tokenizer of only special tokens, or one whose ids reach past the embedding's ``rows``."""
    size = len(tokenizer)
    specials = set(getattr(tokenizer, "all_special_ids", []) or [])
    if size <= len(specials):
        raise ValueError(
            f"load_model: the tokenizer of {str(path)!r} holds only its {size} special tokens, no vocabulary (its "
            f"vocabulary files are missing); save the model's tokenizer there with tokenizer.save_pretrained(dir)."
        )
    top = max(size, max(tokenizer.get_vocab().values(), default=-1) + 1, max(specials, default=-1) + 1)
    if rows is not None and top > rows:
        raise ValueError(
            f"load_model: the tokenizer of {str(path)!r} has {top} tokens but the model's embedding has {rows} rows, "
            f"so token ids {rows}..{top - 1} would index past it: save the tokenizer the model was trained with "
            "there, or grow the embedding first (model.resize_token_embeddings(len(tokenizer)), then save_pretrained)."
        )
