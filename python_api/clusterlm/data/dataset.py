"""Tokenised examples: the SFTDataset container, the content fingerprint, token lengths, the collator.

An *example* is ``{"input_ids": int64 (T,), "labels": int64 (T,)}`` with ``labels == -100`` on every token that is
not trained. :class:`SFTDataset` stores them flat; :func:`fingerprint` hashes their content (what a plan records and
a trainer checks); :func:`collate` right-pads them into a batch; :func:`example_pair` reads one example (a dict or a
pair) as checked int64 arrays.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from cluster_kernels.lm_head_features import IGNORE_INDEX
from clusterlm.data.formats import FORMATS

__all__ = ["IGNORE_INDEX", "SFTDataset", "collate", "example_pair", "fingerprint", "lengths_of"]


class SFTDataset(torch.utils.data.Dataset):
    """Tokenised supervised fine-tuning examples (a ``torch`` map-style dataset).

    Stores all tokens in two flat int64 arrays with offsets; ``ds[i]`` returns fresh copies.

    Attributes:
        lengths: ``(N,)`` int64 tokens per example.
        n_truncated: examples cut to ``max_length``.
        n_empty: examples of the source skipped for an empty answer (see the :mod:`clusterlm.data` docstring).
        empty_indices: their 0-based positions among the source's records (``n_empty`` of them, ascending).
        max_length: the truncation length used (None: no truncation).
        source: the file path or a description of the source.
        format: one of :data:`FORMATS`.
        rendering: ``"chat-template"`` (text rendered through the tokenizer's chat template), ``"plain"``
            (prompt and response concatenated) or ``"tokenized"`` (given as token ids).
    """

    def __init__(
        self,
        input_ids: Sequence[np.ndarray],
        labels: Sequence[np.ndarray],
        *,
        n_truncated: int = 0,
        max_length: int | None = None,
        source: str = "<memory>",
        format: str = "tokenized",
        rendering: str = "tokenized",
        empty_indices: Sequence[int] = (),
    ) -> None:
        """Build from per-example int arrays (already checked and truncated by :func:`load_data`).

        Raises:
            ValueError: different numbers of ``input_ids`` and ``labels`` arrays, an example whose arrays
                differ in length, or an unknown ``format``.
        """
        if len(input_ids) != len(labels):
            raise ValueError(
                f"SFTDataset: got {len(input_ids)} input_ids arrays but {len(labels)} labels arrays; they must pair up."
            )
        if format not in FORMATS:
            raise ValueError(f"SFTDataset: format must be one of {FORMATS}, got {format!r}.")
        lengths = np.fromiter((len(x) for x in input_ids), dtype=np.int64, count=len(input_ids))
        label_lengths = np.fromiter((len(x) for x in labels), dtype=np.int64, count=len(labels))
        if (bad := np.flatnonzero(lengths != label_lengths)).size:
            i = int(bad[0])
            raise ValueError(
                f"SFTDataset: example {i} has {lengths[i]} input_ids but {label_lengths[i]} labels; they must align."
            )
        self._offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self._offsets[1:])
        empty = np.zeros(0, dtype=np.int64)
        self._ids = np.concatenate([np.asarray(x, dtype=np.int64) for x in input_ids]) if len(lengths) else empty
        self._labels = np.concatenate([np.asarray(x, dtype=np.int64) for x in labels]) if len(lengths) else empty
        self._ids.flags.writeable = False
        self._labels.flags.writeable = False
        self.lengths = lengths
        self.lengths.flags.writeable = False
        self.n_truncated = int(n_truncated)
        self.empty_indices = tuple(int(i) for i in empty_indices)
        self.n_empty = len(self.empty_indices)
        self.max_length = max_length
        self.source = source
        self.format = format
        self.rendering = rendering

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        """Example ``index`` (negative counts from the end): ``{"input_ids", "labels"}`` int64 ``(T,)`` copies.

        Raises:
            IndexError: ``index`` out of range.
            TypeError: ``index`` is not an int.
        """
        if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
            raise TypeError(f"SFTDataset: index must be an int, got {type(index).__name__}.")
        n = len(self)
        i = int(index) + n if index < 0 else int(index)
        if not 0 <= i < n:
            raise IndexError(f"SFTDataset: index {index} out of range for {n} examples.")
        a, b = self._offsets[i], self._offsets[i + 1]
        return {"input_ids": self._ids[a:b].copy(), "labels": self._labels[a:b].copy()}

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return (
            f"SFTDataset(n={len(self)}, format={self.format!r}, rendering={self.rendering!r}, "
            f"tokens={int(self.lengths.sum())}, "
            f"max_length={self.max_length}, n_truncated={self.n_truncated}, n_empty={self.n_empty}, "
            f"source={self.source!r})"
        )

    @property
    def source_indices(self) -> np.ndarray:
        """``(N,)`` int64: the position of every example among the source's records (skipped ones left out)."""
        return np.delete(np.arange(len(self) + self.n_empty, dtype=np.int64),
                         np.asarray(self.empty_indices, dtype=np.int64))

    @property
    def n_answer_tokens(self) -> np.ndarray:
        """``(N,)`` int64 trained tokens per example (labels != -100)."""
        trained = (self._labels != IGNORE_INDEX).astype(np.int64)
        sums = np.add.reduceat(trained, self._offsets[:-1]) if len(trained) else np.zeros(0, dtype=np.int64)
        sums[self.lengths == 0] = 0  # reduceat returns the next element for empty segments
        return sums

    def fingerprint(self) -> dict[str, Any]:
        """``{"size": N, "sha256": hex}`` of the tokenised content; see :func:`fingerprint`."""
        digest = hashlib.sha256()
        for i in range(len(self)):
            a, b = self._offsets[i], self._offsets[i + 1]
            digest.update(np.int64(b - a).tobytes())
            digest.update(self._ids[a:b])
            digest.update(self._labels[a:b])
        return {"size": len(self), "sha256": digest.hexdigest()}


def fingerprint(examples: Any) -> dict[str, Any]:
    """Content fingerprint of tokenised examples: ``{"size": N, "sha256": hex}``.

    The hash runs over the examples in order, each contributing ``int64(len)`` bytes, then its
    ``input_ids`` as int64 bytes, then its ``labels`` as int64 bytes (native byte order). Any change of a
    token, a label, the order or a length changes it; the tokenizer or file it came from does not matter.

    Args:
        examples: an :class:`SFTDataset` (or anything with a ``fingerprint()`` method), or a sequence of dicts
            with ``input_ids`` / ``labels`` (lists,
            numpy arrays or tensors), or of ``(input_ids, labels)`` pairs.

    Returns:
        ``{"size": int, "sha256": str}``.

    Raises:
        TypeError: an item is neither such a dict nor a pair.
        ValueError: an item's ``input_ids`` and ``labels`` differ in length or are not 1-D.
    """
    if isinstance(examples, SFTDataset) or callable(getattr(examples, "fingerprint", None)):
        return dict(examples.fingerprint())
    digest = hashlib.sha256()
    n = 0
    for i, item in enumerate(examples):
        ids, labels = example_pair(item, i, "fingerprint")
        digest.update(np.int64(len(ids)).tobytes())
        digest.update(ids.tobytes())
        digest.update(labels.tobytes())
        n += 1
    return {"size": n, "sha256": digest.hexdigest()}


def lengths_of(dataset: Any) -> np.ndarray:
    """Tokens per example, int64 (N,): ``dataset.lengths`` when it has them, else ``len(input_ids)`` of each item."""
    lengths = getattr(dataset, "lengths", None)
    if lengths is not None:
        return np.asarray(lengths, dtype=np.int64)
    return np.array([len(dataset[i]["input_ids"]) for i in range(len(dataset))], dtype=np.int64)


def _as_int64(value: Any, what: str, index: int, caller: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"{caller}: example {index}: {what} must be a 1-D sequence of ints, got shape {arr.shape} and dtype "
            f"{arr.dtype}."
        )
    return np.ascontiguousarray(arr, dtype=np.int64)


def example_pair(item: Any, index: int, caller: str) -> tuple[np.ndarray, np.ndarray]:
    """Example ``index`` (a dict with ``input_ids`` / ``labels``, or a pair) as aligned int64 arrays; errors
    name ``caller`` and the index."""
    if isinstance(item, Mapping):
        if "input_ids" not in item or "labels" not in item:
            raise TypeError(
                f"{caller}: example {index} must have 'input_ids' and 'labels', got keys {sorted(item)[:8]}."
            )
        ids, labels = item["input_ids"], item["labels"]
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        ids, labels = item
    else:
        raise TypeError(
            f"{caller}: example {index} must be a dict with 'input_ids' and 'labels' or an (input_ids, labels) "
            f"pair, got {type(item).__name__}."
        )
    ids, labels = _as_int64(ids, "input_ids", index, caller), _as_int64(labels, "labels", index, caller)
    if len(ids) != len(labels):
        raise ValueError(
            f"{caller}: example {index} has {len(ids)} input_ids but {len(labels)} labels; they must align "
            "position by position."
        )
    return ids, labels


def collate(examples: Sequence[Mapping[str, Any]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad examples into a batch.

    Args:
        examples: dicts with ``input_ids`` and ``labels`` (1-D int sequences, numpy arrays or tensors).
        pad_id: token id written into padded ``input_ids`` positions (masked out by ``attention_mask``).

    Returns:
        ``{"input_ids", "attention_mask", "labels"}``, int64 tensors of shape ``(B, T_max)``; padding has
        ``attention_mask == 0`` and ``labels == -100``.

    Raises:
        ValueError: no examples, mismatched lengths inside an example.
        TypeError: an example is not a dict with ``input_ids`` and ``labels``, or ``pad_id`` is not an int.
    """
    if isinstance(pad_id, bool) or not isinstance(pad_id, (int, np.integer)):
        raise TypeError(f"collate: pad_id must be an int token id, got {pad_id!r}.")
    pairs = [example_pair(ex, i, "collate") for i, ex in enumerate(examples)]
    if not pairs:
        raise ValueError("collate: got no examples; a batch needs at least one.")
    width = max(len(ids) for ids, _ in pairs)
    input_ids = np.full((len(pairs), width), int(pad_id), dtype=np.int64)
    labels = np.full((len(pairs), width), IGNORE_INDEX, dtype=np.int64)
    mask = np.zeros((len(pairs), width), dtype=np.int64)
    for row, (ids, lab) in enumerate(pairs):
        input_ids[row, : len(ids)] = ids
        labels[row, : len(lab)] = lab
        mask[row, : len(ids)] = 1
    return {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(mask),
        "labels": torch.from_numpy(labels),
    }
