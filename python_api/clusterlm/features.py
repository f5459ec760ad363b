"""Per-example gradient features of a causal LM: GradientFeaturizer.

What a feature is. The loss of a batch is ``sum_b mean_{t in answer(b)} CE_t`` (each example's mean
answer-token loss, summed over examples), so the gradient w.r.t. any weight splits into independent
per-example gradients that do not depend on which other examples share the batch. Example ``b``'s
feature is

- ``layers="paper"``: the authors' proxy ``mean_t (p_t(y_t) - 1) h_t`` (dimension = hidden size), from
  one forward pass and :func:`cluster_kernels.lm_head_features` (no backward, no logits tensor);
- otherwise: ``sum_layers P_out^T dW_b P_in`` flattened to ``k_o * k_i``, the Kronecker projections of
  the chosen layers' weight gradients summed into one space (a block Johnson-Lindenstrauss projection
  of the concatenated gradient). Projections come from
  :func:`cluster_kernels.projection.random_projection` keyed by ``(seed, layer name)``.
  ``"lm_head"`` needs no backward (one vocabulary pass, :func:`cluster_kernels.lm_head_features`);
  other layers use one *activation-only* backward (all weights ``requires_grad=False``, so no weight
  gradient is computed) with forward hooks capturing each layer's input and tensor hooks its output
  gradient, projected per layer by :func:`cluster_kernels.project_linear_grads` as soon as it arrives.

How batches are formed. Examples are taken in order in windows of ``shard_size``; inside a window they
are sorted by length and grouped so that ``batch_size * longest <= batch_tokens``. Each batch is
right-padded to its longest example with an attention mask (correct with eager and sdpa attention on
every architecture; padded positions get exactly zero gradient), and the real tokens are gathered into
the packed ``(N_tok, d)`` + ``cu_seqlens`` layout the kernels take, so no kernel work is spent on
padding. The lm head is never run on the full sequence: a pre-hook hands it an empty slice and the
loss gradient ``W^T (p_t - e_{y_t}) / n_b`` w.r.t. the last hidden state is computed in token chunks
(``(chunk, V)`` logits at most), so no ``(B, T, V)`` logits tensor exists.

Feature window (``max_tokens``). A selection feature needs the direction of an example's gradient, not
every token of it, and the forward pass over all tokens is the whole cost of featurization. With
``max_tokens=T`` each example is cut, before anything runs, to a window of at most ``T`` tokens: its
first answer tokens, preceded by up to ``T // 4`` (at least 1) prompt tokens just before the answer (more
when the answer is shorter than the rest of the window); the feature is the gradient of the mean
answer loss inside the window. ``None`` featurizes whole examples (the paper's proxy does).

Tied embeddings. When the lm head shares its weight with the input embedding, every mode featurizes the
gradient of the head's *output* use only (``logits = h W^T``): the shared parameter's full gradient would
add the input-embedding rows of the example's tokens, which no feature includes.

LoRA. A freshly initialised adapter has ``lora_B = 0``, so the gradient of every ``lora_A`` is exactly zero
and only the ``lora_B`` half of a ``"lora"`` feature carries anything; the featurizer warns then
(featurize after a short warm-up of the adapter, or use ``"lm_head"`` / ``"all-linear"``).

Examples whose labels (after the causal shift) are all ``-100`` are refused with a ``ValueError``
naming the example's index (their mean loss is undefined); nothing of their shard is written.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from cluster_kernels.lm_head_features import IGNORE_INDEX, lm_head_features
from cluster_kernels.project_linear_grads import project_linear_grads
from cluster_kernels.projection import PROJECTION_KINDS, random_projection
from clusterlm.data import fingerprint
from clusterlm.store import FeatureStore

__all__ = [
    "DEFAULT_BATCH_TOKENS", "DEFAULT_DIM", "DEFAULT_FEATURE_TOKENS", "DEFAULT_SHARD_SIZE", "LAYER_PRESETS",
    "GradientFeaturizer", "progress_bar",
]

LAYER_PRESETS = ("paper", "lm_head", "all-linear", "lora")
# One default for every caller (select, the CLI, the featurizer used directly):
DEFAULT_DIM = (32, 32)  # projected feature size k_o x k_i
DEFAULT_FEATURE_TOKENS = 64  # the default feature window: settled by `make bench-real` (README, BENCHMARKS.md)
DEFAULT_SHARD_SIZE = 1024  # examples per window / store shard (batches never cross one)
DEFAULT_BATCH_TOKENS = 8192  # padded tokens per featurization forward


def _renamed(old: str, old_value: Any, new: str, new_value: Any, default: Any) -> Any:
    """``new_value``, or ``old_value`` given under the deprecated name ``old`` (warns; both given: refused)."""
    if old_value is None:
        return default if new_value is None else new_value
    if new_value is not None:
        raise TypeError(f"GradientFeaturizer: give {new}= only ({old}= is its former name), got both.")
    warnings.warn(f"GradientFeaturizer: {old}= is now called {new}=; the old name goes in the next release.",
                  DeprecationWarning, stacklevel=3)
    return old_value


@functools.cache
def _linear_types() -> tuple[type, ...]:
    """nn.Linear, and transformers' Conv1D of GPT-2 style models (y = x W + b, W of shape (d_in, d_out)).

    Imported on first use so that ``import clusterlm`` does not pull in transformers.
    """
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # noqa: BLE001 - without transformers there is no Conv1D to support
        return (nn.Linear,)
    return (nn.Linear, Conv1D)


# Config fields that change how logits are made from the last hidden state; the lm-head maths assumes
# plain ``h W^T + b``, so such models are refused instead of silently mis-featurised.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


@dataclass
class _Layer:
    name: str
    module: nn.Module
    d_in: int
    d_out: int


def _layer_dims(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return int(module.weight.shape[0]), int(module.weight.shape[1])  # Conv1D


def _split_dim(dim: int | tuple[int, int] | Sequence[int] | None) -> tuple[int, int]:
    if dim is None:
        return DEFAULT_DIM
    if isinstance(dim, bool):
        raise TypeError("GradientFeaturizer: dim must be an int or a (k_o, k_i) pair, got a bool.")
    if isinstance(dim, (int, np.integer)):
        total = int(dim)
        if total < 1:
            raise ValueError(f"GradientFeaturizer: dim must be >= 1, got {dim}.")
        # The most square factorisation k_o * k_i = dim keeps both projections informative.
        k_o = max(f for f in range(1, math.isqrt(total) + 1) if total % f == 0)
        return k_o, total // k_o
    if isinstance(dim, Sequence) and len(dim) == 2 and all(isinstance(v, (int, np.integer)) for v in dim):
        k_o, k_i = int(dim[0]), int(dim[1])
        if k_o < 1 or k_i < 1:
            raise ValueError(f"GradientFeaturizer: dim=(k_o, k_i) must be positive, got {tuple(dim)}.")
        return k_o, k_i
    raise TypeError(f"GradientFeaturizer: dim must be None, an int (total size) or a (k_o, k_i) pair, got {dim!r}.")


def _as_int_array(value: Any, what: str, index: int) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise ValueError(
            f"GradientFeaturizer: example {index}: {what} must be a 1-D sequence of ints, "
            f"got shape {arr.shape} and dtype {arr.dtype}."
        )
    return arr.astype(np.int64, copy=False)


def _examples_from_batch(batch: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Split a collated DataLoader batch (2-D tensors, optional attention_mask) into examples."""
    ids, labels = batch["input_ids"], batch["labels"]
    mask = batch.get("attention_mask")
    for r in range(len(ids)):
        keep = slice(None) if mask is None else (np.asarray(mask[r]) != 0)
        yield {"input_ids": np.asarray(ids[r])[keep], "labels": np.asarray(labels[r])[keep]}


def _iter_examples(data: Any) -> Iterator[dict[str, Any]]:
    if isinstance(data, Mapping):
        raise TypeError(
            "GradientFeaturizer.featurize: data must be a sequence of examples (a list of dicts, a "
            "datasets.Dataset or a DataLoader), got a single dict."
        )
    for item in data:
        if not isinstance(item, Mapping) or "input_ids" not in item or "labels" not in item:
            raise TypeError(
                "GradientFeaturizer.featurize: every example must be a dict with 'input_ids' and "
                "'labels' (labels -100 on prompt tokens); got "
                f"{type(item).__name__} with keys {list(item)[:5] if isinstance(item, Mapping) else '-'}."
            )
        ids = item["input_ids"]
        if (isinstance(ids, torch.Tensor) and ids.dim() == 2) or (isinstance(ids, np.ndarray) and ids.ndim == 2):
            yield from _examples_from_batch(item)
        else:
            yield item


def _known_length(data: Any) -> int | None:
    if isinstance(data, torch.utils.data.DataLoader):
        ds = data.dataset
        return len(ds) if hasattr(ds, "__len__") and not isinstance(ds, torch.utils.data.IterableDataset) else None
    try:
        return len(data)
    except TypeError:
        return None


def feature_window(labels: np.ndarray, max_tokens: int) -> tuple[int, int]:
    """The ``[lo, hi)`` token window that a ``max_tokens`` feature looks at (module docstring).

    Args:
        labels: (T,) int labels, -100 on prompt tokens, with at least one answer label after position 0.
        max_tokens: window length, >= 2.

    Returns:
        ``(lo, hi)`` with ``hi - lo == min(T, max_tokens)`` and at least one answer label in
        ``labels[lo + 1:hi]`` (position ``lo`` predicts nothing once the window starts there).
    """
    t = len(labels)
    if t <= max_tokens:
        return 0, t
    first = 1 + int(np.argmax(labels[1:] != IGNORE_INDEX))  # the first answer token
    lo = max(0, first - max(1, max_tokens // 4))
    hi = min(t, lo + max_tokens)
    return max(0, hi - max_tokens), hi  # a short answer leaves room for more prompt


def _data_sha256(examples: list[tuple[np.ndarray, np.ndarray]]) -> str:
    return fingerprint(examples)["sha256"]


@dataclass
class PackedBatch:
    """A padded batch and its packed view (the real tokens of every example, in order), on one device.

    ``input_ids`` / ``attention_mask``: (B, T) int64; ``flat_idx``: positions of the real tokens in the
    flattened (B * T) batch; ``cu``: (B + 1,) cumulative lengths; ``targets``: the next-token label of every
    real token (-100 where there is none); ``token_weights``: ``1 / n_b`` on answer tokens (the per-example
    mean loss), 0 elsewhere.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    flat_idx: torch.Tensor
    cu: torch.Tensor
    targets: torch.Tensor
    token_weights: torch.Tensor


def pack_batch(batch: Sequence[tuple[np.ndarray, np.ndarray]], device: torch.device) -> PackedBatch:
    """Pad ``(input_ids, labels)`` pairs to a batch and build its packed view (:class:`PackedBatch`)."""
    n_ex = len(batch)
    lengths = np.array([len(ids) for ids, _ in batch], dtype=np.int64)
    max_len = int(lengths.max())
    input_ids = np.zeros((n_ex, max_len), dtype=np.int64)
    attention = np.zeros((n_ex, max_len), dtype=np.int64)
    targets = np.full((n_ex, max_len), IGNORE_INDEX, dtype=np.int64)
    for b, (ids, labels) in enumerate(batch):
        input_ids[b, : len(ids)] = ids
        attention[b, : len(ids)] = 1
        targets[b, : len(ids) - 1] = labels[1:]  # position t predicts token t + 1
    real = attention.reshape(-1).astype(bool)
    tgt = torch.from_numpy(targets.reshape(-1)[real]).to(device)
    counts = np.array([(t != IGNORE_INDEX).sum() for t in targets], dtype=np.int64)
    token_w = torch.from_numpy(np.repeat(1.0 / counts, lengths)).to(device, torch.float32)
    token_w = torch.where(tgt != IGNORE_INDEX, token_w, torch.zeros_like(token_w))  # the loss's 1/n_b
    return PackedBatch(
        input_ids=torch.from_numpy(input_ids).to(device),
        attention_mask=torch.from_numpy(attention).to(device),
        flat_idx=torch.from_numpy(np.nonzero(real)[0]).to(device),
        cu=torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)])).to(device),
        targets=tgt,
        token_weights=token_w,
    )


class GradientFeaturizer:
    """Per-example (projected) gradient features of a Hugging Face causal LM, optionally with LoRA.

    Args:
        model: a causal LM (``transformers`` ``*ForCausalLM`` or a PEFT model wrapping one) whose
            ``get_output_embeddings()`` is an ``nn.Linear`` computing ``logits = h W^T (+ b)``.
        features: ``"paper"`` (authors' proxy, dim = hidden size, forward only), ``"lm_head"`` (projected
            full last-layer gradient, forward only), ``"all-linear"`` (every ``nn.Linear``/GPT-2
            ``Conv1D`` including the lm head), ``"lora"`` (the LoRA A and B matrices of a PEFT model), or a
            list of module names (the lm head's name is allowed).
        dim: ``(k_o, k_i)``, or an int total ``k_o * k_i`` (factored as squarely as possible); default
            ``(32, 32)`` (:data:`DEFAULT_DIM`, the same as :func:`clusterlm.select`'s). Not allowed with
            ``"paper"`` (its dimension is the hidden size).
        seed: seed of the random projections (keyed by ``(seed, layer name)``).
        dtype: optional autocast dtype for the model's forward/backward (e.g. ``torch.bfloat16``); None runs
            the model in its own dtype. Features are float32 either way.
        normalize: L2-normalise each example's feature vector (zero vectors stay zero).
        projection: ``"rademacher"`` or ``"gaussian"`` entries.
        backend: kernel backend passed to the ``cluster_kernels`` ops (``"auto"`` picks Triton on CUDA).
        max_chunk_elems: logits alive at once when computing the lm-head gradient (memory bound).
        feature_tokens: feature window: at most this many tokens per example (the answer's start with a
            little prompt context; module docstring), or None for whole examples. Must be >= 2.
        layers / max_tokens: the former names of ``features`` / ``feature_tokens`` (deprecated; warn).

    Tied embeddings: with an lm head tied to the input embedding, the feature is the gradient of the head's
    output use (``logits = h W^T``) only, not of the shared parameter (which adds input-embedding rows).

    Warns:
        UserWarning: only LoRA layers are selected and every ``lora_B`` of the selected ``lora_A`` layers is
            zero (a fresh adapter), so the ``lora_A`` part of the feature is exactly zero.

    Raises:
        TypeError / ValueError: no usable lm head, unknown layer names (the message lists the available
            ones), no LoRA layers for ``"lora"``, bad ``dim``/``projection``, gradient checkpointing on.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        features: str | Sequence[str] | None = None,
        dim: int | tuple[int, int] | None = None,
        seed: int = 0,
        dtype: torch.dtype | None = None,
        normalize: bool = True,
        projection: str = "rademacher",
        backend: str = "auto",
        max_chunk_elems: int = 1 << 22,
        feature_tokens: int | None = None,
        layers: str | Sequence[str] | None = None,
        max_tokens: int | None = None,
    ) -> None:
        features = _renamed("layers", layers, "features", features, "paper")
        feature_tokens = _renamed("max_tokens", max_tokens, "feature_tokens", feature_tokens, None)
        layers, max_tokens = features, feature_tokens
        if not isinstance(model, nn.Module):
            raise TypeError(f"GradientFeaturizer: model must be a torch.nn.Module, got {type(model).__name__}.")
        if projection not in PROJECTION_KINDS:
            raise ValueError(f"GradientFeaturizer: projection must be one of {PROJECTION_KINDS}, got {projection!r}.")
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise TypeError(f"GradientFeaturizer: dtype must be None or a floating torch.dtype, got {dtype!r}.")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 2):
            raise ValueError(
                f"GradientFeaturizer: feature_tokens must be None (whole examples) or an int >= 2 (the feature "
                f"window), got {max_tokens!r}."
            )
        self.model = model
        self.max_tokens = max_tokens
        self.seed = int(seed)
        self.dtype = dtype
        self.normalize = bool(normalize)
        self.projection = projection
        self.backend = backend
        self.max_chunk_elems = int(max_chunk_elems)
        self._lm_head, self._lm_head_name = self._find_lm_head(model)
        self._embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        self.mode = "paper" if (isinstance(layers, str) and layers == "paper") else "projected"
        if self.mode == "paper" and dim is not None:
            raise ValueError(
                "GradientFeaturizer: layers='paper' reproduces the authors' proxy, whose dimension is "
                "the hidden size; drop dim, or use layers='lm_head' for a projected feature of chosen "
                "dimension."
            )
        self._layers, self._include_head = self._resolve_layers(model, layers)
        self._warn_if_lora_b_zero(model)
        self.k_o, self.k_i = _split_dim(dim) if self.mode == "projected" else (1, self._lm_head.in_features)
        self._projections: dict[tuple[str, str, str], torch.Tensor] = {}

    # ---- configuration ----------------------------------------------------------------------------

    @staticmethod
    def _find_lm_head(model: nn.Module) -> tuple[nn.Linear, str]:
        head = None
        if hasattr(model, "get_output_embeddings"):
            try:
                head = model.get_output_embeddings()
            except (NotImplementedError, AttributeError):
                head = None
        if head is None:
            raise ValueError(
                f"GradientFeaturizer: {type(model).__name__} has no lm head (get_output_embeddings() "
                "returned nothing); pass a causal language model, e.g. AutoModelForCausalLM."
            )
        if not isinstance(head, nn.Linear):
            raise TypeError(
                f"GradientFeaturizer: the lm head must be an nn.Linear (logits = h W^T + b), got "
                f"{type(head).__name__}; a LoRA-wrapped or quantised lm head is not supported."
            )
        config = getattr(model, "config", None)
        for field in _LOGIT_TRANSFORMS:
            value = getattr(config, field, None)
            if value not in (None, 1, 1.0):
                raise ValueError(
                    f"GradientFeaturizer: the model's config sets {field}={value!r}, so its logits are "
                    "not h W^T + b; such models are not supported."
                )
        name = next((n for n, m in model.named_modules() if m is head), None)
        assert name is not None, "get_output_embeddings() returned a module outside the model"
        return head, name

    def _resolve_layers(self, model: nn.Module, layers: str | Sequence[str]) -> tuple[list[_Layer], bool]:
        linear = {n: m for n, m in model.named_modules() if isinstance(m, _linear_types()) and n != self._lm_head_name}
        if isinstance(layers, str):
            if layers in ("paper", "lm_head"):
                return [], True
            if layers == "all-linear":
                return [_Layer(n, m, *_layer_dims(m)) for n, m in linear.items()], True
            if layers == "lora":
                lora = [_Layer(n, m, *_layer_dims(m)) for n, m in linear.items() if ".lora_A." in n or ".lora_B." in n]
                if not lora:
                    raise ValueError(
                        "GradientFeaturizer: layers='lora' but the model has no LoRA layers; wrap it "
                        "with peft.get_peft_model(model, LoraConfig(...)) or use layers='all-linear'."
                    )
                return lora, False
            raise ValueError(
                f"GradientFeaturizer: layers must be one of {LAYER_PRESETS} or a list of module names, got {layers!r}."
            )
        if not isinstance(layers, Sequence) or not layers or not all(isinstance(n, str) for n in layers):
            raise TypeError(
                f"GradientFeaturizer: layers must be a preset {LAYER_PRESETS} or a non-empty list of "
                f"module names, got {layers!r}."
            )
        unknown = [n for n in layers if n not in linear and n != self._lm_head_name]
        if unknown:
            available = [self._lm_head_name, *linear]
            shown = ", ".join(available[:40]) + (f", ... ({len(available)} in all)" if len(available) > 40 else "")
            raise ValueError(
                f"GradientFeaturizer: no linear layer named {unknown[0]!r} in the model "
                f"(unknown: {unknown[:5]}). Available layers: {shown}."
            )
        if len(set(layers)) != len(layers):
            raise ValueError(f"GradientFeaturizer: layers lists a name twice: {list(layers)}.")
        return [_Layer(n, linear[n], *_layer_dims(linear[n])) for n in layers if n != self._lm_head_name], (
            self._lm_head_name in layers
        )

    def _warn_if_lora_b_zero(self, model: nn.Module) -> None:
        """Warn when the feature is LoRA-only and every selected lora_A's lora_B is zero (no lora_A gradient)."""
        if not self._layers or not all(".lora_A." in x.name or ".lora_B." in x.name for x in self._layers):
            return  # other layers carry signal; a zero lora_A part is then a small share of the feature
        a_names = [x.name for x in self._layers if ".lora_A." in x.name]
        modules = dict(model.named_modules())
        b_modules = [modules.get(n.replace(".lora_A.", ".lora_B.", 1)) for n in a_names]
        weights = [getattr(b, "weight", None) for b in b_modules]
        if not a_names or any(not isinstance(w, torch.Tensor) or w.is_meta for w in weights):
            return
        if any(bool(w.detach().any()) for w in weights):
            return
        warnings.warn(
            f"GradientFeaturizer: every lora_B weight of the selected LoRA layers is zero (a freshly initialised "
            f"adapter), so the gradients of their {len(a_names)} lora_A matrices are exactly zero and that part of "
            "the feature carries nothing; featurize after a short warm-up of the adapter (a few training steps), or "
            "use layers='lm_head' or 'all-linear'.",
            UserWarning,
            stacklevel=3,
        )

    @property
    def feature_dim(self) -> int:
        """Length D of each feature vector."""
        return self.k_i if self.mode == "paper" else self.k_o * self.k_i

    @property
    def layer_names(self) -> list[str]:
        """Names of the layers whose gradients enter the feature (the lm head last)."""
        return [layer.name for layer in self._layers] + ([self._lm_head_name] if self._include_head else [])

    @property
    def needs_backward(self) -> bool:
        """True when a (activation-only) backward pass is needed: layers other than the lm head."""
        return bool(self._layers)

    def auto_batch_tokens(self, free_bytes: int | None = None) -> int:
        """Padded tokens per forward that fit the free memory of the model's device.

        On the CPU (and without a CUDA device) this is :data:`DEFAULT_BATCH_TOKENS`. On CUDA, half of the free
        memory (``torch.cuda.mem_get_info``, or ``free_bytes``) after the lm-head logits chunk
        (``max_chunk_elems`` float32) is divided by an estimate of the bytes one token keeps alive: the
        residual stream and one layer's attention and MLP activations (``hidden * 16 + intermediate * 3``
        elements) for a forward-only feature (lm_head, paper), plus every layer's saved inputs
        (``layers * (hidden * 12 + intermediate * 3)``) when an activation backward runs (all-linear, lora).
        Rounded down to a multiple of 256, at least 256 and at most 262 144.

        Args:
            free_bytes: free device memory to plan for (default: measured on the model's CUDA device).

        Returns:
            Padded tokens per forward.
        """
        device = next(self.model.parameters()).device
        if free_bytes is None:
            if device.type != "cuda":
                return DEFAULT_BATCH_TOKENS
            free_bytes = torch.cuda.mem_get_info(device)[0]
        cfg = getattr(self.model, "config", None)
        hidden = int(getattr(cfg, "hidden_size", self._lm_head.in_features))
        inter = int(getattr(cfg, "intermediate_size", 4 * hidden) or 4 * hidden)
        layers = int(getattr(cfg, "num_hidden_layers", 1) or 1)
        elem = next(self.model.parameters()).element_size()
        per_token = hidden * 16 + inter * 3 + (layers * (hidden * 12 + inter * 3) if self.needs_backward else 0)
        budget = free_bytes // 2 - self.max_chunk_elems * 4
        tokens = int(budget // max(per_token * elem, 1))
        return int(min(262_144, max(256, tokens // 256 * 256)))

    def config(self) -> dict[str, Any]:
        """JSON-serialisable description of everything that determines the features (stored in manifests)."""
        return {
            "mode": self.mode,
            "layers": self.layer_names,
            "dim": [self.k_o, self.k_i],
            "seed": self.seed,
            "projection": self.projection,
            "normalize": self.normalize,
            "dtype": str(self.dtype),
            "max_tokens": self.max_tokens,
            "model": self._model_fingerprint(),
        }

    def _model_fingerprint(self) -> str:
        digest = hashlib.sha256(type(self.model).__name__.encode())
        config = getattr(self.model, "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            digest.update(config.to_json_string(use_diff=False).encode())
        for name, p in self.model.named_parameters():
            flat = p.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 64)][:64].to("cpu", torch.float64).numpy()
            digest.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
            digest.update(sample.tobytes())
        return digest.hexdigest()[:32]

    def _projection(self, name: str, side: str, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        key = (name, side, str(device))
        if key not in self._projections:
            self._projections[key] = random_projection(
                rows, cols, seed=self.seed, name=f"{name}/{side}", kind=self.projection, device=device
            )
        return self._projections[key]

    # ---- model state --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _extraction_state(self) -> Iterator[None]:
        """Eval mode and frozen weights during extraction; the model's own state restored afterwards."""
        model = self.model
        if any(
            getattr(m, attr, False) is True
            for m in model.modules()
            for attr in ("gradient_checkpointing", "activation_checkpointing")
        ):
            raise ValueError(
                "GradientFeaturizer: gradient checkpointing is enabled; it re-runs forwards during "
                "backward, which the layer hooks cannot follow. Call "
                "model.gradient_checkpointing_disable() before featurizing."
            )
        training = {m: m.training for m in model.modules()}
        requires = {p: p.requires_grad for p in model.parameters()}
        try:
            model.eval()
            for p in requires:
                p.requires_grad_(False)  # activation-only backward: no weight-gradient GEMMs
            yield
        finally:
            for p, flag in requires.items():
                p.requires_grad_(flag)
            for m, flag in training.items():
                m.training = flag

    # ---- one batch ----------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Where the features are computed: the model's device (the CPU for a model without parameters)."""
        p = next(self.model.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def featurize_batch(self, examples: Sequence[Mapping[str, Any]]) -> torch.Tensor:
        """Features of one batch of tokenised examples (no store, no batching by tokens).

        Args:
            examples: dicts with ``input_ids`` and ``labels`` (same length; labels -100 on tokens that do not
                count, as for Hugging Face causal-LM training).

        Returns:
            ``(len(examples), feature_dim)`` float32 tensor on the model's device.

        Raises:
            ValueError: an example without counted tokens (the message names its index), bad token ids.
        """
        batch = [self._check_example(ex, i) for i, ex in enumerate(examples)]
        if not batch:
            return torch.zeros(0, self.feature_dim, dtype=torch.float32, device=self.device)
        with self._extraction_state():
            return self._run_batch(batch)

    def _check_example(self, example: Mapping[str, Any], index: int) -> tuple[np.ndarray, np.ndarray]:
        if not isinstance(example, Mapping) or "input_ids" not in example or "labels" not in example:
            raise TypeError(f"GradientFeaturizer: example {index} must be a dict with 'input_ids' and 'labels'.")
        ids = _as_int_array(example["input_ids"], "input_ids", index)
        labels = _as_int_array(example["labels"], "labels", index)
        if len(ids) != len(labels):
            raise ValueError(
                f"GradientFeaturizer: example {index}: input_ids has {len(ids)} tokens but labels has "
                f"{len(labels)}; they must align position by position."
            )
        vocab_in = self._embeddings.num_embeddings if isinstance(self._embeddings, nn.Embedding) else None
        if len(ids) and (ids.min() < 0 or (vocab_in is not None and ids.max() >= vocab_in)):
            raise ValueError(
                f"GradientFeaturizer: example {index}: input_ids must be in [0, {vocab_in}), got values "
                f"in [{ids.min()}, {ids.max()}]."
            )
        vocab = self._lm_head.out_features
        targets = labels[1:]
        bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= vocab))
        if bad.any():
            raise ValueError(
                f"GradientFeaturizer: example {index}: labels must be in [0, {vocab}) or -100, got "
                f"{int(targets[bad][0])}."
            )
        if not (targets != IGNORE_INDEX).any():
            raise ValueError(
                f"GradientFeaturizer: example {index} has no answer token: all its labels after the first position "
                "are -100 (labels[0] predicts nothing in a causal LM), so its mean loss and gradient are undefined. "
                "Drop the example or unmask at least one answer token."
            )
        if self.max_tokens is not None and len(ids) > self.max_tokens:
            lo, hi = feature_window(labels, self.max_tokens)
            ids, labels = ids[lo:hi], labels[lo:hi]
        return ids, labels

    def _run_batch(self, batch: list[tuple[np.ndarray, np.ndarray]]) -> torch.Tensor:
        """Features of checked examples; must run inside ``_extraction_state``."""
        if self.needs_backward and self._embeddings is None:
            raise ValueError(
                "GradientFeaturizer: the model has no get_input_embeddings(); the backward pass needs it "
                "to start gradients at the embeddings."
            )
        device = self.device
        batch_t = pack_batch(batch, device)
        n_ex, max_len = batch_t.input_ids.shape
        feats = torch.zeros(n_ex, self.k_o, self.k_i, dtype=torch.float32, device=device)
        ctx = {"flat_idx": batch_t.flat_idx, "cu": batch_t.cu, "out": feats, "shape": (n_ex, max_len), "seen": set()}
        handles = []
        try:
            captured = self._capture_head_input(handles)
            if self.needs_backward:
                # Weights are frozen, so gradients must start at the embeddings' output.
                handles.append(self._embeddings.register_forward_hook(lambda m, a, out: out.requires_grad_(True)))
                for layer in self._layers:
                    handles.append(layer.module.register_forward_hook(self._make_layer_hook(layer, ctx, device)))
            with torch.enable_grad() if self.needs_backward else torch.no_grad():
                h = self._forward_hidden(batch_t, captured)
                h_packed = h.detach().reshape(-1, h.shape[-1]).index_select(0, batch_t.flat_idx)
                if self.needs_backward:
                    self._backward(h, h_packed, batch_t.flat_idx, batch_t.targets, batch_t.token_weights, batch_t.cu,
                                   feats, device)
                else:
                    self._head_only(h_packed, batch_t.targets, batch_t.token_weights, batch_t.cu, feats, device)
        finally:
            for hd in handles:
                hd.remove()
        missing = [layer.name for layer in self._layers if layer.name not in ctx["seen"]]
        if missing:
            warnings.warn(
                f"GradientFeaturizer: no gradient reached layers {missing[:5]} (not on the path to the "
                "loss); they contribute zero.",
                RuntimeWarning,
                stacklevel=3,
            )
        out = feats.reshape(n_ex, -1)
        if self.normalize:
            out = out / out.norm(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        return out

    def _capture_head_input(self, handles: list[Any]) -> dict[str, torch.Tensor]:
        """Hook the lm head: keep its input hidden states and hand the model empty logits instead."""
        captured: dict[str, torch.Tensor] = {}

        def head_pre_hook(module: nn.Module, args: tuple) -> tuple:
            if not args:
                raise RuntimeError("GradientFeaturizer: the lm head was called without positional hidden states.")
            captured["h"] = args[0]
            return (args[0][..., :0, :], *args[1:])  # the model gets empty logits: no (B, T, V) tensor

        handles.append(self._lm_head.register_forward_pre_hook(head_pre_hook))
        return captured

    def _forward_hidden(self, batch_t: PackedBatch, captured: dict[str, torch.Tensor]) -> torch.Tensor:
        """Run the model; the (B, T, d) hidden states its lm head received."""
        autocast = (
            torch.autocast(device_type=batch_t.input_ids.device.type, dtype=self.dtype)
            if self.dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            self.model(input_ids=batch_t.input_ids, attention_mask=batch_t.attention_mask, use_cache=False)
        if "h" not in captured:
            raise RuntimeError(
                f"GradientFeaturizer: the lm head {self._lm_head_name!r} was not called during "
                "the forward pass; this model computes its logits another way."
            )
        h = captured.pop("h")
        if h.dim() != 3 or tuple(h.shape[:2]) != tuple(batch_t.input_ids.shape):
            raise RuntimeError(
                f"GradientFeaturizer: the lm head received hidden states of shape "
                f"{tuple(h.shape)}, expected (batch, seq, hidden)=({', '.join(map(str, batch_t.input_ids.shape))}, d)."
            )
        return h

    def _make_layer_hook(self, layer: _Layer, ctx: dict[str, Any], device: torch.device) -> Any:
        p_in = self._projection(layer.name, "in", layer.d_in, self.k_i, device)
        p_out = self._projection(layer.name, "out", layer.d_out, self.k_o, device)

        def forward_hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not isinstance(output, torch.Tensor) or not output.requires_grad or not args:
                return
            x = args[0]
            if tuple(x.shape[:-1]) != ctx["shape"]:
                raise RuntimeError(
                    f"GradientFeaturizer: layer {layer.name!r} received inputs of shape "
                    f"{tuple(x.shape)}, not (batch, seq, features)={ctx['shape'] + ('d',)}; layers "
                    "that reshuffle tokens (e.g. MoE experts) are not supported."
                )

            def grad_hook(grad: torch.Tensor) -> None:
                xs = x.detach().reshape(-1, layer.d_in).index_select(0, ctx["flat_idx"])
                gs = grad.reshape(-1, layer.d_out).index_select(0, ctx["flat_idx"]).to(xs.dtype)
                project_linear_grads(xs, gs, ctx["cu"], p_in, p_out, out=ctx["out"], backend=self.backend)
                ctx["seen"].add(layer.name)

            output.register_hook(grad_hook)

        return forward_hook

    def _head_only(
        self,
        h_packed: torch.Tensor,
        tgt: torch.Tensor,
        token_w: torch.Tensor,
        cu: torch.Tensor,
        feats: torch.Tensor,
        device: torch.device,
    ) -> None:
        """The lm head's feature from one vocabulary pass (no backward)."""
        weight, bias = self._lm_head.weight.detach(), self._lm_head.bias
        bias = bias.detach() if bias is not None else None
        if self.mode == "paper":
            res = lm_head_features(
                h_packed,
                weight,
                tgt,
                cu,
                mode="paper",
                bias=bias,
                backend=self.backend,
                max_chunk_elems=self.max_chunk_elems,
            )
            feats[:, 0, :] = res
            return
        p_in = self._projection(self._lm_head_name, "in", weight.shape[1], self.k_i, device)
        p_out = self._projection(self._lm_head_name, "out", weight.shape[0], self.k_o, device)
        lm_head_features(
            h_packed,
            weight,
            tgt,
            cu,
            p_in=p_in,
            p_out=p_out,
            mode="projected",
            bias=bias,
            token_weights=token_w,
            out=feats,
            backend=self.backend,
            max_chunk_elems=self.max_chunk_elems,
        )

    def _backward(
        self,
        h: torch.Tensor,
        h_packed: torch.Tensor,
        flat_idx: torch.Tensor,
        tgt: torch.Tensor,
        token_w: torch.Tensor,
        cu: torch.Tensor,
        feats: torch.Tensor,
        device: torch.device,
    ) -> None:
        """dL/dh from the lm head in token chunks, the head's own feature, then the activation-only backward."""
        weight, bias = self._lm_head.weight.detach(), self._lm_head.bias
        bias = bias.detach() if bias is not None else None
        valid = (tgt != IGNORE_INDEX).nonzero().squeeze(1)
        hv, yv, wv = h_packed.index_select(0, valid), tgt.index_select(0, valid), token_w.index_select(0, valid)
        p_out = None
        if self._include_head:
            p_out = self._projection(self._lm_head_name, "out", weight.shape[0], self.k_o, device)
        grad_hv, g_proj = _lm_head_backward(hv, weight, bias, yv, wv, p_out, self.max_chunk_elems)
        if self._include_head:
            counts = torch.bincount(torch.searchsorted(cu[1:], valid, right=True), minlength=len(cu) - 1)
            cu_v = torch.cat([cu.new_zeros(1), torch.cumsum(counts, 0)])
            p_in = self._projection(self._lm_head_name, "in", weight.shape[1], self.k_i, device)
            eye = torch.eye(self.k_o, dtype=torch.float32, device=device)
            project_linear_grads(hv.float(), g_proj, cu_v, p_in, eye, out=feats, backend=self.backend)
        grad_h = torch.zeros(h.shape[0] * h.shape[1], h.shape[2], dtype=h.dtype, device=device)
        grad_h.index_copy_(0, flat_idx.index_select(0, valid), grad_hv.to(h.dtype))
        torch.autograd.backward(h, grad_h.view_as(h))

    # ---- data sets ----------------------------------------------------------------------------------

    def featurize(
        self,
        data: Iterable[Mapping[str, Any]],
        *,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
        store: FeatureStore | str | None = None,
        shard_size: int | None = None,
        progress: bool = True,
    ) -> np.ndarray:
        """Features of every example of ``data``, in order.

        Args:
            data: a list of dicts, a ``datasets.Dataset`` or a ``DataLoader`` yielding dicts with ``input_ids``
                and ``labels`` (one example each, or collated 2-D batches; ``attention_mask`` trims padding).
            batch_tokens: padded tokens per forward (``batch size * longest example``); a longer example runs
                alone.
            store: a ``FeatureStore`` or a directory: features are written shard by shard and a rerun resumes
                where a killed run stopped, producing identical features.
            shard_size: examples per window/shard (default: the store's, else :data:`DEFAULT_SHARD_SIZE`).
                Batches never cross a window, so results do not depend on whether a store is used.
            progress: show a tqdm bar with examples/s and tokens/s.

        Returns:
            ``(N, feature_dim)`` float32: a numpy array, or the store's read-only ``np.memmap`` when ``store``
            is given.

        Raises:
            ValueError / TypeError: malformed examples (the message names the example's index), an example
                without answer tokens, a store written by another configuration or other data.
        """
        _check_batch_tokens(batch_tokens)
        store = _as_store(store, shard_size)
        window = store.shard_size if store is not None else (shard_size or DEFAULT_SHARD_SIZE)
        total = _known_length(data)
        if isinstance(data, Sequence) or (total is not None and not isinstance(data, torch.utils.data.DataLoader)):
            # Sized, re-iterable data: check every example before anything is computed or written.
            for i, ex in enumerate(_iter_examples(data)):
                self._check_example(ex, i)
        if store is not None:
            store.begin(dim=self.feature_dim, config=self.config())  # completed shards are skipped below
        windows = ((w, w * window, examples) for w, examples in enumerate(_windows(_iter_examples(data), window)))
        results: list[np.ndarray] = []
        n_seen = 0
        with progress_bar(total, progress) as bar:
            for _, n_rows, feats in self._shard_loop(windows, store, batch_tokens, bar):
                n_seen += n_rows
                if store is None:
                    results.append(feats)
        if store is not None:
            return store.finalize(n_seen)
        if not results:
            return np.zeros((0, self.feature_dim), dtype=np.float32)
        return np.concatenate(results)

    def featurize_shards(
        self,
        data: Any,
        store: FeatureStore,
        shards: range,
        *,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
        progress: bool = True,
        on_shard: Callable[[int], None] | None = None,
    ) -> list[int]:
        """Featurize only the store shards ``shards`` of indexable ``data`` (one rank of a sharded run).

        The same loop as :meth:`featurize` (same windows, batches, checks and shard records), so the features
        are identical to a single-process run with the same store; the store is not finalized here
        (:func:`clusterlm.distributed.featurize_sharded` does it once every rank is done).

        Args:
            data: indexable examples (``len`` and ``data[i]``).
            store: the shared :class:`FeatureStore` (its ``shard_size`` sets the windows).
            shards: the shard indices to compute; those already stored are checked against the data and skipped.
            batch_tokens: padded tokens per forward.
            progress: a bar over these shards' examples.
            on_shard: called with each shard index once it is stored (e.g. to update a bar over all ranks).

        Returns:
            The shard indices this call computed (the others were stored already).

        Raises:
            ValueError / TypeError: as :meth:`featurize`.
        """
        _check_batch_tokens(batch_tokens)
        n, size = len(data), store.shard_size
        store.begin(dim=self.feature_dim, config=self.config())
        windows = ((w, w * size, [data[i] for i in range(w * size, min(n, (w + 1) * size))]) for w in shards)
        rows = sum(max(0, min(n, (w + 1) * size) - w * size) for w in shards)
        computed: list[int] = []
        with progress_bar(rows, progress) as bar:
            for w, _, feats in self._shard_loop(windows, store, batch_tokens, bar):
                if feats is not None:
                    computed.append(w)
                if on_shard is not None:
                    on_shard(w)
        return computed

    def _shard_loop(
        self, windows: Iterable[tuple[int, int, list[Mapping[str, Any]]]], store: FeatureStore | None,
        batch_tokens: int, bar: Any,
    ) -> Iterator[tuple[int, int, np.ndarray | None]]:
        """The one shard loop: for each ``(index, first row, examples)`` window, check the examples, skip a shard
        the store holds for exactly them, else compute it in token-bounded batches and store it. Yields
        ``(index, rows, features or None when it was stored already)``."""
        n_computed, n_tokens, t0 = 0, 0, time.perf_counter()
        with self._extraction_state():
            for w_index, start, window_examples in windows:
                checked = [self._check_example(ex, start + i) for i, ex in enumerate(window_examples)]
                data_hash = _data_sha256(checked)
                if store is not None and _already_stored(store, w_index, start, checked, data_hash):
                    bar.update(len(checked))
                    yield w_index, len(checked), None
                    continue
                feats = np.zeros((len(checked), self.feature_dim), dtype=np.float32)
                for idx in _token_batches([len(ids) for ids, _ in checked], batch_tokens):
                    feats[idx] = self._run_batch([checked[i] for i in idx]).float().cpu().numpy()
                    n_tokens += int(sum(len(checked[i][0]) for i in idx))
                    n_computed += len(idx)  # rates count only computed examples, not resumed ones
                    bar.update(len(idx))
                    elapsed = max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix({"ex/s": f"{n_computed / elapsed:.1f}", "tok/s": f"{n_tokens / elapsed:.0f}"})
                if store is not None:
                    store.write_shard(w_index, feats, data_sha256=data_hash)
                yield w_index, len(checked), feats


def _check_batch_tokens(batch_tokens: Any) -> None:
    if isinstance(batch_tokens, bool) or not isinstance(batch_tokens, int) or batch_tokens < 1:
        raise ValueError(f"GradientFeaturizer.featurize: batch_tokens must be a positive int, got {batch_tokens!r}.")


def _as_store(store: Any, shard_size: int | None) -> FeatureStore | None:
    """``store`` as a :class:`FeatureStore` (a path opens one), checked against ``shard_size``."""
    if isinstance(store, (str, bytes)) or hasattr(store, "__fspath__"):
        store = FeatureStore(store, shard_size=shard_size or DEFAULT_SHARD_SIZE)
    if store is not None and not isinstance(store, FeatureStore):
        raise TypeError(
            f"GradientFeaturizer.featurize: store must be a FeatureStore, a path or None, got {type(store).__name__}."
        )
    if store is not None and shard_size is not None and shard_size != store.shard_size:
        raise ValueError(
            f"GradientFeaturizer.featurize: shard_size={shard_size} differs from the store's "
            f"shard_size={store.shard_size}."
        )
    return store


def _already_stored(
    store: FeatureStore, w_index: int, start: int, checked: list[tuple[np.ndarray, np.ndarray]], data_hash: str
) -> bool:
    """True when shard ``w_index`` is stored for exactly these examples; raises if the data changed."""
    record = store.shard_record(w_index)
    if record is None:
        if store.complete:
            raise ValueError(
                f"GradientFeaturizer.featurize: {store.path} is complete with {store.n_examples} "
                f"examples but the data has more (example {start} onward); the data changed since that "
                "run. Use a new store directory."
            )
        return False
    if record["data_sha256"] != data_hash or record["rows"] != len(checked):
        raise ValueError(
            f"GradientFeaturizer.featurize: examples {start}..{start + len(checked) - 1} differ from "
            f"those stored in shard {w_index} of {store.path}; the data changed since that run. Use a "
            "new store directory."
        )
    return True


def _windows(examples: Iterator[Mapping[str, Any]], size: int) -> Iterator[list[Mapping[str, Any]]]:
    buf: list[Mapping[str, Any]] = []
    for ex in examples:
        buf.append(ex)
        if len(buf) == size:
            yield buf
            buf = []
    if buf:
        yield buf


def _token_batches(lengths: list[int], batch_tokens: int) -> Iterator[list[int]]:
    """Group indices, longest first (stable), so that ``len(group) * longest <= batch_tokens``."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    group: list[int] = []
    for i in order:
        longest = lengths[group[0]] if group else lengths[i]
        if group and (len(group) + 1) * longest > batch_tokens:
            yield group
            group = []
        group.append(i)
    if group:
        yield group


def progress_bar(total: int | None, enabled: bool, desc: str = "featurize") -> Any:
    """The featurization progress bar (examples; a no-op bar when not ``enabled``)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="ex", desc=desc, disable=not enabled, dynamic_ncols=True)


def _lm_head_backward(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    token_w: torch.Tensor,
    p_out: torch.Tensor | None,
    max_chunk_elems: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``dL/dh_t = w_t W^T (p_t - e_{y_t})`` and, with ``p_out``, ``w_t P_out^T (p_t - e_{y_t})``, float32.

    Logits exist only for ``max_chunk_elems // V`` tokens at a time. Low-precision weights are multiplied
    in their own dtype (fp32 accumulation inside the GEMM) rather than copied to fp32.
    """
    n_tok, vocab = h.shape[0], weight.shape[0]
    chunk = max(1, max_chunk_elems // vocab)
    grad_h = torch.empty(n_tok, h.shape[1], dtype=torch.float32, device=h.device)
    g_proj = torch.empty(n_tok, p_out.shape[1], dtype=torch.float32, device=h.device) if p_out is not None else None
    for s in range(0, n_tok, chunk):
        e = min(n_tok, s + chunk)
        logits = (h[s:e].to(weight.dtype) @ weight.T).float()
        if bias is not None:
            logits += bias.float()
        d_logits = torch.softmax(logits, dim=-1)
        d_logits[torch.arange(e - s, device=h.device), targets[s:e]] -= 1.0
        d_logits *= token_w[s:e, None]
        grad_h[s:e] = (d_logits.to(weight.dtype) @ weight).float()
        if g_proj is not None:
            g_proj[s:e] = d_logits @ p_out
    return grad_h, g_proj
