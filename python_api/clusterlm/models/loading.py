"""load_model: a causal LM and its tokenizer by name (built-in, GGUF, directory, cached hub id), on a device."""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from clusterlm.models.builtin import BUILTIN_MODELS, ensure_builtin
from clusterlm.models.checks import UNREADABLE, check_directory, check_vocab, config_rows, one_line, weight_files
from clusterlm.models.devices import as_dtype, resolve_device, resolve_dtype
from clusterlm.models.gguf import GGUF_MODELS, convert_gguf, find_gguf
from clusterlm.models.hub import model_directory
from clusterlm.models.ids import compute_model_id

__all__ = ["load_model"]


def load_model(
    spec: str | os.PathLike[str], *, dtype: Any = None, root: str | os.PathLike[str] | None = None,
    device: Any = None,
) -> tuple[Any, Any, str]:
    """Load a causal LM and its tokenizer by built-in name or local directory.

    Args:
        spec: a name in :data:`BUILTIN_MODELS` (e.g. ``"tiny-llama"``) or :data:`GGUF_MODELS`
            (``"smollm2-135m-instruct"``), a ``.gguf`` file, a local Hugging Face model directory
            (``config.json``, weights, tokenizer files), or a hub id (``"org/name"``) already in the local
            Hugging Face cache (:func:`hf_hub_cache`; never downloaded).
        dtype: parameter dtype (``torch.float32``, ``torch.bfloat16`` or its name), ``"auto"`` (bfloat16 on a CUDA
            device that supports it, else float32: :func:`resolve_dtype`); None keeps the saved dtype.
        device: where the weights load, straight from the files in ``dtype`` (no float32 host copy):
            ``"cpu"``, ``"cuda"`` / ``"cuda:N"``, a ``torch.device``, or ``"auto"`` (CUDA when present: this
            process's ``LOCAL_RANK`` under torchrun; :func:`resolve_device`); None: the CPU.
        root: demo directory for the tiny built-ins (default :func:`clusterlm.data.demo.default_root`); GGUF files
            are converted into ``$CLUSTERLM_HOME/gguf`` (:func:`convert_gguf`).

    Returns:
        ``(model, tokenizer, model_id)``: the model in eval mode on ``device``, the tokenizer (pad token set to
        eos when it had none), and :func:`compute_model_id` of the model (see the module docstring).

    Raises:
        ValueError: ``spec`` is neither a built-in name, a directory with ``config.json`` nor a cached hub
            model (one line: the built-in names and the command that fetches a hub model); the directory is no
            causal LM (:func:`causal_lm_problem`: checked on its config before any weights load), has no weights,
            weights files that are unreadable (a damaged header or a cut-short file, named), no tokenizer files,
            or a tokenizer whose ids do not fit the embedding; or it cannot be loaded.
            Every message is one line naming the fix.
        TypeError: ``spec`` is not a string/path, or a bad ``dtype``.
        ValueError: ``device`` names CUDA and no CUDA device is visible.
    """
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(
            f"load_model: spec must be a built-in model name or a directory path, got {type(spec).__name__}."
        )
    target = torch.device("cpu") if device is None else resolve_device(device)
    torch_dtype = resolve_dtype(dtype, target) if dtype == "auto" else as_dtype(dtype)
    name = os.fspath(spec)
    # Directories we built (built-ins, converted GGUF files) load without progress bars.
    built = name in BUILTIN_MODELS or name in GGUF_MODELS or name.lower().endswith(".gguf")
    if name in BUILTIN_MODELS:
        with _quiet_progress(True):
            path = ensure_builtin(name, root)
    elif name in GGUF_MODELS:
        path = convert_gguf(find_gguf(name), name=name)
    elif name.lower().endswith(".gguf"):
        if not Path(name).expanduser().is_file():
            raise ValueError(f"load_model: spec={name!r} names a GGUF file that does not exist.")
        path = convert_gguf(name)
    else:
        path = model_directory(name)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    if target.type != "cpu":
        kwargs["device_map"] = {"": target}  # tensors go from the files to the device, no host copy of the model
    model, tokenizer = _load_checked(path, kwargs, built)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(model.config, "pad_token_id", None) is None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    return model, tokenizer, compute_model_id(model)


def _load_checked(path: Path, kwargs: dict[str, Any], quiet: bool) -> tuple[Any, Any]:
    """Model and tokenizer of directory ``path``, checked before the weights load and after."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = check_directory(path)
    try:
        with _quiet_progress(quiet):
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            check_vocab(tokenizer, config_rows(config), path)
            model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    except OSError as err:
        raise ValueError(f"load_model: could not load a causal LM and tokenizer from {str(path)!r}: {one_line(err)}"
                         ) from err
    except (SafetensorError, pickle.UnpicklingError, EOFError) as err:  # damage the header checks cannot see
        names = ", ".join(f.name for f in weight_files(path)) or "its weights files"
        raise ValueError(f"load_model: the weights of {str(path)!r} ({names}) are unreadable "
                         f"({one_line(err) or type(err).__name__}); {UNREADABLE}.") from err
    except ValueError as err:
        if str(err).startswith("load_model:"):
            raise
        raise ValueError(f"load_model: could not load a causal LM and tokenizer from {str(path)!r}: {one_line(err)}"
                         ) from err
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    check_vocab(tokenizer, getattr(embedding, "num_embeddings", None), path)
    return model, tokenizer


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
