"""From examples to batches: reading examples, the feature window, windows of examples, token-bounded batches.

Examples are taken in order in windows of ``shard_size`` (:func:`example_windows`; one window is one store shard);
inside a window they are sorted by length and grouped so that ``batch_size * longest <= batch_tokens``
(:func:`token_batches`).
:func:`check_example` checks an example and cuts it to its feature window (:func:`feature_window`); :func:`pack_batch`
right-pads a batch and builds its packed view (:class:`PackedBatch`), the layout the kernels take.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cluster_kernels.lm_head_features import IGNORE_INDEX
from clusterlm.config.defaults import DEFAULT_BATCH_TOKENS, DEFAULT_FEATURE_TOKENS, DEFAULT_SHARD_SIZE

__all__ = [
    "DEFAULT_BATCH_TOKENS", "DEFAULT_FEATURE_TOKENS", "DEFAULT_SHARD_SIZE", "PackedBatch", "check_batch_tokens",
    "check_example", "example_windows", "feature_window", "iter_examples", "known_length", "pack_batch",
    "progress_bar", "token_batches",
]



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


def iter_examples(data: Any) -> Iterator[dict[str, Any]]:
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


def known_length(data: Any) -> int | None:
    if isinstance(data, torch.utils.data.DataLoader):
        ds = data.dataset
        return len(ds) if hasattr(ds, "__len__") and not isinstance(ds, torch.utils.data.IterableDataset) else None
    try:
        return len(data)
    except TypeError:
        return None


def feature_window(labels: np.ndarray, feature_tokens: int) -> tuple[int, int]:
    """The ``[lo, hi)`` token window that a ``feature_tokens`` feature looks at (the :mod:`clusterlm.selection.features`
    docstring).

    Args:
        labels: (T,) int labels, -100 on prompt tokens, with at least one answer label after position 0.
        feature_tokens: window length, >= 2.

    Returns:
        ``(lo, hi)`` with ``hi - lo == min(T, feature_tokens)`` and at least one answer label in
        ``labels[lo + 1:hi]`` (position ``lo`` predicts nothing once the window starts there).
    """
    t = len(labels)
    if t <= feature_tokens:
        return 0, t
    first = 1 + int(np.argmax(labels[1:] != IGNORE_INDEX))  # the first answer token
    lo = max(0, first - max(1, feature_tokens // 4))
    hi = min(t, lo + feature_tokens)
    return max(0, hi - feature_tokens), hi  # a short answer leaves room for more prompt


def check_example(
    example: Mapping[str, Any], index: int, *, vocab_in: int | None, vocab: int, feature_tokens: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Example ``index`` as checked ``(input_ids, labels)`` int64 arrays, cut to its feature window.

    Args:
        example: a dict with ``input_ids`` and ``labels``.
        index: its position in the data (for messages).
        vocab_in: rows of the input embedding (None: not checked); vocab: the lm head's outputs.
        feature_tokens: the feature window (:func:`feature_window`), or None for the whole example.

    Raises:
        TypeError / ValueError: not such a dict, misaligned or out-of-range ids or labels, no answer token.
    """
    if not isinstance(example, Mapping) or "input_ids" not in example or "labels" not in example:
        raise TypeError(f"GradientFeaturizer: example {index} must be a dict with 'input_ids' and 'labels'.")
    ids = _as_int_array(example["input_ids"], "input_ids", index)
    labels = _as_int_array(example["labels"], "labels", index)
    if len(ids) != len(labels):
        raise ValueError(
            f"GradientFeaturizer: example {index}: input_ids has {len(ids)} tokens but labels has "
            f"{len(labels)}; they must align position by position."
        )
    if len(ids) and (ids.min() < 0 or (vocab_in is not None and ids.max() >= vocab_in)):
        raise ValueError(
            f"GradientFeaturizer: example {index}: input_ids must be in [0, {vocab_in}), got values "
            f"in [{ids.min()}, {ids.max()}]."
        )
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
    if feature_tokens is not None and len(ids) > feature_tokens:
        lo, hi = feature_window(labels, feature_tokens)
        ids, labels = ids[lo:hi], labels[lo:hi]
    return ids, labels


def example_windows(examples: Iterator[Mapping[str, Any]], size: int) -> Iterator[list[Mapping[str, Any]]]:
    buf: list[Mapping[str, Any]] = []
    for ex in examples:
        buf.append(ex)
        if len(buf) == size:
            yield buf
            buf = []
    if buf:
        yield buf


def token_batches(lengths: list[int], batch_tokens: int) -> Iterator[list[int]]:
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


def check_batch_tokens(batch_tokens: Any) -> None:
    if isinstance(batch_tokens, bool) or not isinstance(batch_tokens, int) or batch_tokens < 1:
        raise ValueError(f"GradientFeaturizer.featurize: batch_tokens must be a positive int, got {batch_tokens!r}.")


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


def progress_bar(total: int | None, enabled: bool, desc: str = "featurize") -> Any:
    """The featurization progress bar (examples; a no-op bar when not ``enabled``)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="ex", desc=desc, disable=not enabled, dynamic_ncols=True)
