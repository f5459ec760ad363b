"""GradientFeaturizer: its settings, its description (``config()``), and the loop over a data set's windows.

The per-batch work (hooks, forward, backward) is :class:`clusterlm.selection.features.gradients.BatchGradients`'s; the
layer
choice :mod:`clusterlm.selection.features.layers`'; the windows and batches
:mod:`clusterlm.selection.features.batching`'. Here: the
constructor's checks, :meth:`GradientFeaturizer.config` (what a store is keyed by), the batch size that fits the
device, and the one shard loop (:meth:`GradientFeaturizer._shard_loop`) under :meth:`~GradientFeaturizer.featurize`
and :meth:`~GradientFeaturizer.featurize_shards`, with its store: a shard stored for exactly these examples is skipped.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from cluster_kernels.projection import PROJECTION_KINDS
from clusterlm.data import fingerprint
from clusterlm.selection.features.batching import (
    DEFAULT_BATCH_TOKENS,
    DEFAULT_SHARD_SIZE,
    check_batch_tokens,
    check_example,
    example_windows,
    iter_examples,
    known_length,
    progress_bar,
    token_batches,
)
from clusterlm.selection.features.gradients import BatchGradients
from clusterlm.selection.features.layers import find_lm_head, resolve_layers, split_dim, warn_if_lora_b_zero
from clusterlm.selection.signals import ExampleSignals
from clusterlm.selection.store import FeatureStore

__all__ = ["GradientFeaturizer"]


def _renamed(old: str, old_value: Any, new: str, new_value: Any, default: Any) -> Any:
    """``new_value``, or ``old_value`` given under the deprecated name ``old`` (warns; both given: refused)."""
    if old_value is None:
        return default if new_value is None else new_value
    if new_value is not None:
        raise TypeError(f"GradientFeaturizer: give {new}= only ({old}= is its former name), got both.")
    warnings.warn(f"GradientFeaturizer: {old}= is now called {new}=; the old name goes in the next release.",
                  DeprecationWarning, stacklevel=3)
    return old_value


class GradientFeaturizer(BatchGradients):
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
            little prompt context; the :mod:`clusterlm.selection.features` docstring), or None for whole examples. Must
            be >= 2.
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
        layers = features
        if not isinstance(model, nn.Module):
            raise TypeError(f"GradientFeaturizer: model must be a torch.nn.Module, got {type(model).__name__}.")
        if projection not in PROJECTION_KINDS:
            raise ValueError(f"GradientFeaturizer: projection must be one of {PROJECTION_KINDS}, got {projection!r}.")
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise TypeError(f"GradientFeaturizer: dtype must be None or a floating torch.dtype, got {dtype!r}.")
        if feature_tokens is not None and (isinstance(feature_tokens, bool) or not isinstance(feature_tokens, int)
                                       or feature_tokens < 2):
            raise ValueError(
                f"GradientFeaturizer: feature_tokens must be None (whole examples) or an int >= 2 (the feature "
                f"window), got {feature_tokens!r}."
            )
        self.model = model
        self.feature_tokens = feature_tokens
        self.seed = int(seed)
        self.dtype = dtype
        self.normalize = bool(normalize)
        self.projection = projection
        self.backend = backend
        self.max_chunk_elems = int(max_chunk_elems)
        self._lm_head, self._lm_head_name = find_lm_head(model)
        self._embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        self.mode = "paper" if (isinstance(layers, str) and layers == "paper") else "projected"
        if self.mode == "paper" and dim is not None:
            raise ValueError(
                "GradientFeaturizer: layers='paper' reproduces the authors' proxy, whose dimension is "
                "the hidden size; drop dim, or use layers='lm_head' for a projected feature of chosen "
                "dimension."
            )
        self._layers, self._include_head = resolve_layers(model, layers, self._lm_head_name)
        warn_if_lora_b_zero(model, self._layers)
        self.k_o, self.k_i = split_dim(dim) if self.mode == "projected" else (1, self._lm_head.in_features)
        self._projections: dict[tuple[str, str, str], torch.Tensor] = {}

    # ---- configuration ----------------------------------------------------------------------------

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
            "max_tokens": self.feature_tokens,  # the stored key keeps its name (file format)
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
            return self._run_batch(batch).features

    def _check_example(self, example: Mapping[str, Any], index: int) -> tuple[np.ndarray, np.ndarray]:
        vocab_in = self._embeddings.num_embeddings if isinstance(self._embeddings, nn.Embedding) else None
        return check_example(example, index, vocab_in=vocab_in, vocab=self._lm_head.out_features,
                             feature_tokens=self.feature_tokens)

    # ---- data sets ----------------------------------------------------------------------------------

    def featurize(
        self,
        data: Iterable[Mapping[str, Any]],
        *,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
        store: FeatureStore | str | None = None,
        shard_size: int | None = None,
        progress: bool = True,
        return_signals: bool = False,
    ) -> np.ndarray | tuple[np.ndarray, ExampleSignals | None]:
        """Features of every example of ``data``, in order (and, on request, each example's gradient norm and loss).

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
            return_signals: also return the per-example signals computed with the features
                (:class:`clusterlm.selection.signals.ExampleSignals`: the norm of each feature before its
                normalisation, the example's mean answer-token loss in its window); with a store, the store's (None
                for a store whose shards an older clusterlm wrote). A store gets them either way.

        Returns:
            ``(N, feature_dim)`` float32: a numpy array, or the store's read-only ``np.memmap`` when ``store``
            is given; with ``return_signals``, ``(features, signals)``.

        Raises:
            ValueError / TypeError: malformed examples (the message names the example's index), an example
                without answer tokens, a store written by another configuration or other data.
        """
        check_batch_tokens(batch_tokens)
        store = _as_store(store, shard_size)
        window = store.shard_size if store is not None else (shard_size or DEFAULT_SHARD_SIZE)
        total = known_length(data)
        if isinstance(data, Sequence) or (total is not None and not isinstance(data, torch.utils.data.DataLoader)):
            # Sized, re-iterable data: check every example before anything is computed or written.
            for i, ex in enumerate(iter_examples(data)):
                self._check_example(ex, i)
        if store is not None:
            store.begin(dim=self.feature_dim, config=self.config())  # completed shards are skipped below
        windows = ((w, w * window, examples) for w, examples in enumerate(example_windows(iter_examples(data), window)))
        results: list[np.ndarray] = []
        signals: list[ExampleSignals] = []
        n_seen = 0
        with progress_bar(total, progress) as bar:
            for _, n_rows, feats, sig in self._shard_loop(windows, store, batch_tokens, bar):
                n_seen += n_rows
                if store is None:
                    results.append(feats)
                    signals.append(sig)
        if store is not None:
            out = store.finalize(n_seen)
            return (out, store.signals()) if return_signals else out
        out = np.concatenate(results) if results else np.zeros((0, self.feature_dim), dtype=np.float32)
        return (out, ExampleSignals.concat(signals)) if return_signals else out

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
        (:func:`clusterlm.selection.distributed.featurize_sharded` does it once every rank is done).

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
        check_batch_tokens(batch_tokens)
        n, size = len(data), store.shard_size
        store.begin(dim=self.feature_dim, config=self.config())
        windows = ((w, w * size, [data[i] for i in range(w * size, min(n, (w + 1) * size))]) for w in shards)
        rows = sum(max(0, min(n, (w + 1) * size) - w * size) for w in shards)
        computed: list[int] = []
        with progress_bar(rows, progress) as bar:
            for w, _, feats, _ in self._shard_loop(windows, store, batch_tokens, bar):
                if feats is not None:
                    computed.append(w)
                if on_shard is not None:
                    on_shard(w)
        return computed

    def _shard_loop(
        self, windows: Iterable[tuple[int, int, list[Mapping[str, Any]]]], store: FeatureStore | None,
        batch_tokens: int, bar: Any,
    ) -> Iterator[tuple[int, int, np.ndarray | None, ExampleSignals | None]]:
        """The one shard loop: for each ``(index, first row, examples)`` window, check the examples, skip a shard
        the store holds for exactly them, else compute it in token-bounded batches and store it (with its signals).
        Yields ``(index, rows, features, signals)``, the last two None when it was stored already."""
        n_computed, n_tokens, t0 = 0, 0, time.perf_counter()
        with self._extraction_state():
            for w_index, start, window_examples in windows:
                checked = [self._check_example(ex, start + i) for i, ex in enumerate(window_examples)]
                data_hash = _data_sha256(checked)
                if store is not None and _already_stored(store, w_index, start, checked, data_hash):
                    bar.update(len(checked))
                    yield w_index, len(checked), None, None
                    continue
                feats = np.zeros((len(checked), self.feature_dim), dtype=np.float32)
                sig = np.zeros((len(checked), 2), dtype=np.float64)  # gradient norm, loss (ExampleSignals' columns)
                for idx in token_batches([len(ids) for ids, _ in checked], batch_tokens):
                    out = self._run_batch([checked[i] for i in idx])
                    feats[idx] = out.features.float().cpu().numpy()
                    sig[idx] = torch.stack([out.norms, out.losses], dim=1).double().cpu().numpy()
                    n_tokens += int(sum(len(checked[i][0]) for i in idx))
                    n_computed += len(idx)  # rates count only computed examples, not resumed ones
                    bar.update(len(idx))
                    elapsed = max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix({"ex/s": f"{n_computed / elapsed:.1f}", "tok/s": f"{n_tokens / elapsed:.0f}"})
                if store is not None:
                    store.write_shard(w_index, feats, data_sha256=data_hash, signals=sig)
                yield w_index, len(checked), feats, ExampleSignals.from_array(sig)


def _data_sha256(examples: list[tuple[np.ndarray, np.ndarray]]) -> str:
    return fingerprint(examples)["sha256"]


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
