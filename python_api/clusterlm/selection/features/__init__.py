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

Feature window (``feature_tokens``). A selection feature needs the direction of an example's gradient, not
every token of it, and the forward pass over all tokens is the whole cost of featurization. With
``feature_tokens=T`` each example is cut, before anything runs, to a window of at most ``T`` tokens: its
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

Modules: :mod:`~clusterlm.selection.features.featurizer` (``GradientFeaturizer``: settings, ``config()``, the shard
loop),
:mod:`~clusterlm.selection.features.gradients` (one batch: hooks, forward, lm-head gradient, backward),
:mod:`~clusterlm.selection.features.layers` (the presets, the lm head, the layers, the feature size) and
:mod:`~clusterlm.selection.features.batching` (examples, the feature window, windows, token-bounded batches, packing).
"""

from clusterlm.selection.features.batching import (
    DEFAULT_BATCH_TOKENS,
    DEFAULT_FEATURE_TOKENS,
    DEFAULT_SHARD_SIZE,
    PackedBatch,
    feature_window,
    pack_batch,
    progress_bar,
)
from clusterlm.selection.features.featurizer import GradientFeaturizer
from clusterlm.selection.features.layers import DEFAULT_DIM, LAYER_PRESETS

__all__ = [
    "DEFAULT_BATCH_TOKENS", "DEFAULT_DIM", "DEFAULT_FEATURE_TOKENS", "DEFAULT_SHARD_SIZE", "LAYER_PRESETS",
    "GradientFeaturizer", "PackedBatch", "feature_window", "pack_batch", "progress_bar",
]
