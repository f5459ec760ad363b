"""Supervised fine-tuning data: load, tokenise, mask prompt tokens, fingerprint, collate.

An *example* is ``{"input_ids": int64 (T,), "labels": int64 (T,)}`` with ``labels == -100`` on every
token that is not trained (prompt, chat turns other than the assistant's) and ``labels[t] ==
input_ids[t]`` on answer tokens (the Hugging Face causal-LM convention: the model shifts internally).

Accepted sources (:func:`load_data`): a local ``.jsonl`` / ``.json`` / ``.parquet`` file (JSON read with the
standard library, so an error names the file and the 1-based line; Parquet with ``pyarrow``; nothing touches the
network or the user's HF cache), a directory written by ``Dataset.save_to_disk`` /
``DatasetDict.save_to_disk``, a list of dicts, a ``datasets.Dataset`` (or a ``DatasetDict`` with ``split``),
or already-tokenised example dicts. Record formats, detected from the columns:

- ``prompt`` / ``response`` ("prompt-response");
- ``prompt`` / ``completion`` ("prompt-completion", TRL's format): strings are read like prompt/response;
  conversational ones (lists of ``{"role", "content"}``) are the conversation ``prompt + completion``
  rendered like chat data, with only the completion's assistant turns trained;
- ``instruction`` / ``input`` (optional) / ``output`` ("alpaca"): prompt = instruction, plus
  ``"\\n\\n" + input`` when the input is non-empty;
- ``messages`` ("chat"): a list of ``{"role", "content"}`` rendered with the tokenizer's chat template;
  only assistant turns are trained;
- ``input_ids`` / ``labels`` ("tokenized"): used as given (truncated to ``max_length``).

Rendering. When the tokenizer has a chat template (an instruct model's), prompt/response and Alpaca
records are rendered through it by default, as the conversation ``[{"role": "user", "content": prompt},
{"role": "assistant", "content": response}]`` (so an instruct model is fine-tuned on the format it is used
with; only the assistant turn is trained, exactly like chat data). ``chat_template=False`` turns this off
(plain concatenation below); ``True`` requires a template. :attr:`SFTDataset.rendering` records which ran
(``"chat-template"`` or ``"plain"``).

How text is tokenised. Without a chat template, prompt and response are tokenised *separately*
(``add_special_tokens=False``) and concatenated as ``[bos] + prompt + response + [eos]`` (bos only if the
tokenizer has one, eos likewise), so the prompt/answer boundary is exact whatever the tokenizer merges across
it. The answer is ``response + [eos]``. Chat examples are cut into segments at the turn boundaries of the
rendered template: for assistant turn ``i`` the text added by ``messages[:i+1]`` over the generation prompt of
``messages[:i]`` (the content plus the template's end-of-turn marker, e.g. ``</s>``) is the answer, every
other segment (system/user turns, role headers, generation prompts) is masked. Each segment is tokenised on
its own, again for exact boundaries. Calls to the tokenizer are batched (thousands of examples per second with
a fast tokenizer).

Truncation. Sequences longer than ``max_length`` keep their head (so the prompt's beginning) and are
counted in ``SFTDataset.n_truncated``; nothing is dropped silently: an example left without an answer
token (after the causal shift, i.e. in ``labels[1:]``) raises a ``ValueError`` naming its index.

Empty answers. An example whose answer text is empty or only whitespace (the ``response``, ``completion`` or
``output``; every trained assistant turn of a conversation) has nothing to featurize or train on but an end-of-turn
token. When every example is such, :func:`read_data` refuses the data (naming the count and the first lines);
when some are, :func:`load_data` skips them with one ``UserWarning`` naming how many and where, and records them
in ``SFTDataset.n_empty`` / ``SFTDataset.empty_indices`` (their positions in the source). The data set, and so a
plan's indices and fingerprint, holds the other examples in source order; ``clusterlm train`` loads the file the
same way, so it trains exactly the plan's examples. ``SFTDataset.source_indices`` maps back to the source.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cluster_kernels.lm_head_features import IGNORE_INDEX

__all__ = [
    "DEFAULT_MAX_LENGTH",
    "CHAT_TEMPLATE_MODES",
    "FORMATS",
    "IGNORE_INDEX",
    "RawData",
    "SFTDataset",
    "collate",
    "fingerprint",
    "lengths_of",
    "load_data",
    "read_columns",
    "read_data",
]

DEFAULT_MAX_LENGTH = 1024  # tokens per example (select, train and compare truncate to this by default)
FORMATS = ("prompt-response", "prompt-completion", "alpaca", "chat", "tokenized")
# The command lines' --chat-template values -> load_data(chat_template=...).
CHAT_TEMPLATE_MODES: dict[str, bool | None] = {"auto": None, "on": True, "off": False}
FILE_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_ACCEPTED = (
    "'prompt'/'response'; TRL's 'prompt'/'completion' (strings or conversations); Alpaca "
    "'instruction'/'input'(optional)/'output'; chat 'messages' (a list of {'role', 'content'}); or already "
    "tokenised 'input_ids'/'labels'"
)
_CHUNK = 1024  # texts per tokenizer call: large enough to batch well, small enough for a smooth progress bar
_PROGRESS_MIN = 2000  # no bar below this many examples (it would only flicker)


class SFTDataset(torch.utils.data.Dataset):
    """Tokenised supervised fine-tuning examples (a ``torch`` map-style dataset).

    Stores all tokens in two flat int64 arrays with offsets; ``ds[i]`` returns fresh copies.

    Attributes:
        lengths: ``(N,)`` int64 tokens per example.
        n_truncated: examples cut to ``max_length``.
        n_empty: examples of the source skipped for an empty answer (see the module docstring).
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
        ids, labels = _pair(item, i, "fingerprint")
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


def _pair(item: Any, index: int, caller: str) -> tuple[np.ndarray, np.ndarray]:
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
    pairs = [_pair(ex, i, "collate") for i, ex in enumerate(examples)]
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


# --------------------------------------------------------------------------------------------------
# Loading


def load_data(
    source: Any,
    tokenizer: Any = None,
    *,
    max_length: int | None = DEFAULT_MAX_LENGTH,
    split: str | None = None,
    progress: bool = True,
    chat_template: bool | None = None,
) -> SFTDataset:
    """Load, tokenise and mask a supervised fine-tuning data set.

    Args:
        source: a path to a local ``.jsonl`` / ``.json`` (list of records) / ``.parquet`` file or to a
            ``save_to_disk`` directory, a list of dicts, a ``datasets.Dataset`` / ``DatasetDict``, or already
            tokenised example dicts (``input_ids`` and ``labels``; a list or an :class:`SFTDataset`), or what
            :func:`read_data` read from any of these. Record formats: see the module docstring.
        tokenizer: a Hugging Face tokenizer (fast ones are much quicker); may be None for tokenised data.
            Chat data needs its ``chat_template``.
        max_length: longest sequence kept (the head is kept and the example counted in ``n_truncated``);
            None disables truncation.
        split: which split of a ``DatasetDict`` (required when it has several); for files, the split name
            ``datasets`` gives them (default ``"train"``).
        progress: show a tqdm bar while tokenising (only for more than 2000 examples).
        chat_template: render prompt/response and Alpaca records through the tokenizer's chat template
            (user turn = prompt, assistant turn = response). None (default): when the tokenizer has one;
            False: plain concatenation; True: required (an error when the tokenizer has none). Chat data
            (``messages``) always uses the template.

    Returns:
        :class:`SFTDataset`: the examples in source order, without those whose answer text is empty (counted in
        ``n_empty``, listed in ``empty_indices``, and named in one ``UserWarning``).

    Raises:
        FileNotFoundError: ``source`` is a path that does not exist.
        ValueError: unknown file extension, missing columns (the message lists the columns found and the
            accepted formats), an example without an answer token (possibly after truncation; the message
            names its index and the fix), a bad ``max_length`` or ``split``, no examples, only examples with an
            empty answer, ``chat_template=True`` with a tokenizer that has no template.
        TypeError: an unsupported ``source`` type, non-string text fields, a missing tokenizer.
    """
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2):
        raise ValueError(
            f"load_data: max_length must be an int >= 2 (a prompt token and an answer token) or None, got "
            f"{max_length!r}."
        )
    raw = source if isinstance(source, RawData) else read_data(source, split)
    columns, description, fmt, n = raw.columns, raw.description, raw.format, len(raw)
    empty = _refuse_all_empty(raw)
    if fmt == "tokenized":
        input_ids, labels = [], []
        for i in range(n):
            ids, lab = _pair({"input_ids": columns["input_ids"][i], "labels": columns["labels"][i]}, i, "load_data")
            input_ids.append(ids)
            labels.append(lab)
    else:
        if tokenizer is None:
            raise TypeError(
                f"load_data: {description} holds text in the {fmt!r} format, so a tokenizer is required "
                "(e.g. transformers.AutoTokenizer.from_pretrained(<model dir>)); got tokenizer=None."
            )
        input_ids, labels, use_template = _tokenize_text(raw, tokenizer, chat_template, progress)
    n_truncated = 0
    skip = set(empty)
    for i in range(n):
        if i in skip:
            continue
        if max_length is not None and len(input_ids[i]) > max_length:
            input_ids[i], labels[i] = input_ids[i][:max_length], labels[i][:max_length]
            n_truncated += 1
            if not (labels[i][1:] != IGNORE_INDEX).any():
                raise ValueError(
                    f"load_data: example {i} of {_where(description, i)} has no answer token left after truncation to "
                    f"max_length={max_length} (its prompt fills the first {max_length} tokens). Raise max_length "
                    "or shorten that prompt; examples are never dropped silently."
                )
        elif not (labels[i][1:] != IGNORE_INDEX).any():
            raise ValueError(
                f"load_data: example {i} of {_where(description, i)} has no answer token (all labels after the first "
                "position are -100: an empty response without an eos token, a chat without an assistant turn, "
                "or fully masked labels); its loss would be undefined. Fix or remove that example."
            )
    if empty:
        _warn_skipped(raw, empty)
        input_ids = [x for i, x in enumerate(input_ids) if i not in skip]
        labels = [x for i, x in enumerate(labels) if i not in skip]
    return SFTDataset(
        input_ids, labels, n_truncated=n_truncated, max_length=max_length, source=description, format=fmt,
        rendering="tokenized" if fmt == "tokenized" else ("chat-template" if use_template else "plain"),
        empty_indices=empty,
    )


def _conversational(values: list[Any]) -> bool:
    """TRL's conversational prompt/completion: the first non-empty value is a list of messages."""
    first = next((v for v in values if v is not None), None)
    return isinstance(first, (list, tuple))


def _tokenize_text(
    raw: RawData, tokenizer: Any, chat_template: bool | None, progress: bool
) -> tuple[list[np.ndarray], list[np.ndarray], bool]:
    """Tokenise text records; returns ``(input_ids, labels, rendered through the template)``."""
    columns, fmt, where = raw.columns, raw.format, raw.description
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if chat_template not in (None, True, False):
        raise TypeError(f"load_data: chat_template must be None, True or False, got {chat_template!r}.")
    if chat_template is True and not has_template:
        raise ValueError(
            "load_data: chat_template=True, but the tokenizer has no chat template. Set "
            "tokenizer.chat_template, or pass chat_template=False (plain prompt + response)."
        )
    conversational = fmt == "chat" or (fmt == "prompt-completion" and _conversational(columns["prompt"]))
    use_template = conversational or (has_template if chat_template is None else chat_template)
    bar = _progress(len(raw), progress)
    try:
        if fmt == "chat":
            return (*_tokenize_chat(columns["messages"], tokenizer, bar, where=where), True)
        if conversational:  # TRL's conversational prompt/completion: only the completion's turns are trained
            conversations, starts = [], []
            for i, (p, c) in enumerate(zip(columns["prompt"], columns["completion"], strict=True)):
                if not isinstance(p, (list, tuple)) or not isinstance(c, (list, tuple)):
                    raise TypeError(
                        f"load_data: example {i}: conversational 'prompt'/'completion' must both be lists of "
                        f"{{'role', 'content'}} messages, got {type(p).__name__} and {type(c).__name__} "
                        f"({_where(where, i)})."
                    )
                conversations.append([*p, *c])
                starts.append(len(p))
            return (*_tokenize_chat(conversations, tokenizer, bar, starts, where=where), True)
        prompts, responses = _prompts_responses(columns, fmt, where)
        if use_template:
            conversations = [[{"role": "user", "content": p}, {"role": "assistant", "content": r}]
                             for p, r in zip(prompts, responses, strict=True)]
            return (*_tokenize_chat(conversations, tokenizer, bar, where=where), True)
        return (*_tokenize_pairs(prompts, responses, tokenizer, bar), False)
    finally:
        bar.close()


def _progress(total: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(
        total=total, unit="ex", desc="tokenize", disable=not enabled or total < _PROGRESS_MIN, dynamic_ncols=True
    )


def _read_source(source: Any, split: str | None) -> tuple[dict[str, list[Any]], str]:
    """Columns (name -> list of values) and a description of ``source``."""
    if isinstance(source, (str, os.PathLike)):
        return _read_file(Path(source).expanduser(), split)
    if isinstance(source, SFTDataset):  # re-truncate / re-check an existing data set
        return {"input_ids": [ex["input_ids"] for ex in source], "labels": [ex["labels"] for ex in source]}, (
            source.source
        )
    datasets_mod = sys.modules.get("datasets")  # a datasets object implies the module is already imported
    if datasets_mod is not None and isinstance(source, datasets_mod.DatasetDict):
        names = list(source.keys())
        if split is None and len(names) == 1:
            split = names[0]
        if split not in source:
            raise ValueError(
                f"load_data: split must name one of the DatasetDict's splits {names}, got split={split!r}."
            )
        return _dataset_columns(source[split]), f"datasets.DatasetDict[{split!r}]"
    if datasets_mod is not None and isinstance(source, datasets_mod.Dataset):
        return _dataset_columns(source), f"datasets.Dataset({source.num_rows} rows)"
    if isinstance(source, Sequence) and not isinstance(source, (bytes, Mapping)):
        return _records_columns(source), f"list of {len(source)} records"
    raise TypeError(
        "load_data: source must be a path to a .jsonl/.json/.parquet file, a list of dicts, a datasets.Dataset or "
        f"a list of tokenised examples, got {type(source).__name__}."
    )


@dataclass(frozen=True)
class RawData:
    """Records read and checked without a tokenizer (:func:`read_data`); :func:`load_data` tokenises them.

    Attributes:
        columns: name -> list of values, one per example.
        description: the file path or a description of the source (``SFTDataset.source``).
        format: one of :data:`FORMATS`, detected from the columns.
    """

    columns: dict[str, list[Any]]
    description: str
    format: str

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    @cached_property
    def empty_answers(self) -> tuple[int, ...]:
        """0-based indices of the examples whose answer text is empty or only whitespace (see the module docstring).

        The ``response`` / ``completion`` / ``output`` string, or every assistant turn that would be trained in a
        conversation (one with no assistant turn at all is not counted: it fails later as having no answer token).
        Values of the wrong type are not counted either (the tokeniser names them).
        """
        if self.format == "tokenized":
            return ()
        if self.format == "chat":
            return tuple(i for i, m in enumerate(self.columns["messages"]) if _blank_turns(m))
        answers = self.columns[_ANSWER_COLUMN[self.format]]
        if self.format == "prompt-completion" and _conversational(self.columns["prompt"]):
            return tuple(i for i, m in enumerate(answers) if _blank_turns(m))
        return tuple(i for i, v in enumerate(answers) if isinstance(v, str) and not v.strip())


def read_data(source: Any, split: str | None = None) -> RawData:
    """Read ``source`` and check what needs no tokenizer: the file (UTF-8, JSON syntax), examples, format.

    ``load_data(read_data(path), tokenizer)`` is ``load_data(path, tokenizer)``; a command line reads the data
    first, so that a bad file fails in seconds instead of after the model has loaded.

    Args:
        source / split: as :func:`load_data`.

    Raises:
        FileNotFoundError, ValueError, TypeError: as :func:`load_data` for the same source (a JSON error names
            the file and its 1-based line; a file without records, or whose every answer is empty, says so).
    """
    columns, description = _read_source(source, split)
    if not columns or not len(next(iter(columns.values()))):
        raise ValueError(f"load_data: {description} holds no examples.")
    raw = RawData(columns=columns, description=description, format=_detect_format(columns, description))
    _refuse_all_empty(raw)
    return raw


# The column that holds the answer text, per format (conversations: their assistant turns).
_ANSWER_COLUMN = {"prompt-response": "response", "prompt-completion": "completion", "alpaca": "output",
                  "chat": "messages"}
_SHOWN = 5  # positions named in a message about empty answers


def _blank_turns(messages: Any) -> bool:
    """A list of messages with at least one assistant turn, every one of whose contents is blank."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, Mapping) for m in messages):
        return False
    answers = [m.get("content") for m in messages if m.get("role") == "assistant"]
    return bool(answers) and all(isinstance(a, str) and not a.strip() for a in answers)


def _what_is_empty(fmt: str) -> str:
    return "only empty assistant turns" if fmt == "chat" else f"an empty {_ANSWER_COLUMN[fmt]!r}"


def _positions(description: str, indices: Sequence[int]) -> str:
    """``"lines 4, 9, ..."`` (1-based lines of a JSON Lines file) or ``"examples 3, 8, ..."`` (0-based)."""
    shown = list(indices[:_SHOWN])
    lines = _record_lines(description)
    if lines is not None and all(i < len(lines) for i in shown):
        text = "line" + "s" * (len(indices) > 1) + " " + ", ".join(str(lines[i]) for i in shown)
    else:
        text = "example" + "s" * (len(indices) > 1) + " " + ", ".join(str(i) for i in shown)
    return text + (", ..." if len(indices) > _SHOWN else "")


def _refuse_all_empty(raw: RawData) -> tuple[int, ...]:
    """The examples with an empty answer; a ValueError when that is every example."""
    empty = raw.empty_answers
    if empty and len(empty) == len(raw):
        what = "the only example has" if len(raw) == 1 else f"all {len(raw)} examples have"
        raise ValueError(
            f"load_data: {what} {_what_is_empty(raw.format)} in {raw.description} ({_positions(raw.description, empty)}"
            "): an example without answer text has nothing to featurize or train on. Fill in the answers "
            f"({_ANSWER_COLUMN[raw.format]!r}), or check that the file holds the data you meant."
        )
    return empty


def _warn_skipped(raw: RawData, empty: Sequence[int]) -> None:
    warnings.warn(
        f"load_data: skipped {len(empty)} of {len(raw)} examples with {_what_is_empty(raw.format)} in "
        f"{raw.description} ({_positions(raw.description, empty)}): an example without answer text has nothing to "
        "featurize or train on; fill in or remove them to silence this warning.",
        UserWarning,
        stacklevel=3,
    )


def _record_lines(description: str) -> list[int] | None:
    """The 1-based line of every record when ``description`` names a JSON Lines file (blank lines hold none)."""
    path = Path(description)
    if path.suffix.lower() != ".jsonl":
        return None
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError:
        return None
    return [number for number, line in enumerate(lines, 1) if line.strip()]


def _where(description: str, index: int) -> str:
    """``description``, with the 1-based line of example ``index`` when it names a JSON Lines file (for errors)."""
    lines = _record_lines(description)
    if lines is None or not 0 <= index < len(lines):
        return description
    return f"{description}, line {lines[index]}"


def read_columns(source: Any, split: str | None = None) -> dict[str, list[Any]]:
    """The raw columns of ``source`` as :func:`load_data` reads them before tokenising (name -> list of values).

    Args:
        source: any source :func:`load_data` accepts (a file, a ``save_to_disk`` directory, a list of dicts, a
            ``datasets.Dataset`` / ``DatasetDict``, an :class:`SFTDataset`).
        split: the split of a ``DatasetDict`` (required when it has several).

    Raises:
        FileNotFoundError, ValueError, TypeError: as :func:`load_data` for the same source.
    """
    return _read_source(source, split)[0]


# Files that Dataset.save_to_disk / DatasetDict.save_to_disk write into their directory.
_SAVED_DATASET_FILES = ("dataset_dict.json", "state.json", "dataset_info.json")


def _read_saved_dataset(path: Path, split: str | None) -> tuple[dict[str, list[Any]], str]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as err:  # FileNotFoundError is an OSError
        raise ValueError(f"load_data: {str(path)!r} could not be read with datasets.load_from_disk: {err}") from err
    columns, description = _read_source(ds, split)
    return columns, f"{path} ({description})"


def _read_file(path: Path, split: str | None) -> tuple[dict[str, list[Any]], str]:
    if not path.exists():
        raise FileNotFoundError(f"load_data: no such file {str(path)!r}; give the path of a local data file.")
    if path.is_dir() and any((path / name).is_file() for name in _SAVED_DATASET_FILES):
        return _read_saved_dataset(path, split)
    if not path.is_file():
        inside = sorted(p.name for p in path.iterdir() if p.suffix.lower() in FILE_SUFFIXES) if path.is_dir() else []
        held = f" (it holds {', '.join(inside[:5])}: pass one of them)" if inside else ""
        raise ValueError(
            f"load_data: {str(path)!r} is a directory but not one written by datasets' save_to_disk{held}; give the "
            "path of one data file or of a save_to_disk directory."
        )
    suffix = path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise ValueError(
            f"load_data: unknown file extension {suffix or '(none)'!r} of {str(path)!r}; accepted: "
            f"{', '.join(FILE_SUFFIXES)} (convert other formats, or pass a list of dicts)."
        )
    if FILE_SUFFIXES[suffix] == "parquet":
        return _read_parquet(path), str(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ValueError(f"load_data: cannot read {str(path)!r}: {err.strerror or err}.") from err
    lines = _text_lines(path, raw)
    if not any(line.strip() for line in lines):
        what = "the file is empty" if not raw.strip(b"\xef\xbb\xbf") else "it has only blank lines"
        raise ValueError(f"load_data: {str(path)} holds no examples: {what}. Give a file with one record per line.")
    records = _json_document(path, lines) if suffix == ".json" else None
    if records is None:  # .jsonl, or JSON Lines in a .json file (as datasets reads them)
        first = next(line for line in lines if line.strip())
        if suffix == ".jsonl" and first.strip() in ("[", "{"):
            raise ValueError(
                f"load_data: {str(path)} holds one JSON document over several lines, not JSON Lines (one record per "
                "line); rename it to .json, or write each record on a line of its own."
            )
        records = [_json_record(path, line, number) for number, line in enumerate(lines, 1) if line.strip()]
    return _records_columns(records), str(path)


def _text_lines(path: Path, raw: bytes) -> list[str]:
    """The lines of a UTF-8 file (a BOM and CRLF line ends allowed); a non-UTF-8 byte is named by its line."""
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ValueError(
            f"load_data: {str(path)} is UTF-16 text (as a Windows shell writes with >); save it as UTF-8, e.g. "
            "iconv -f utf-16 -t utf-8."
        )
    body = raw[3:] if raw.startswith(b"\xef\xbb\xbf") else raw
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        line = body.count(b"\n", 0, err.start) + 1
        column = err.start - (body.rfind(b"\n", 0, err.start) + 1) + 1
        raise ValueError(
            f"load_data: {str(path)}, line {line}: not UTF-8 text (byte 0x{body[err.start]:02x} at column {column}); "
            "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)."
        ) from None
    return [line.removesuffix("\r") for line in text.split("\n")]


_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


def _json_record(path: Path, line: str, number: int) -> dict[str, Any]:
    """One line of a JSON Lines file: a JSON object, else a one-line error naming the file and the line."""
    try:
        value = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"load_data: {str(path)}, line {number}: invalid JSON: {err.msg} (column {err.colno}); every line of a "
            "JSON Lines file must be one complete JSON object."
        ) from None
    if not isinstance(value, dict):
        raise ValueError(
            f"load_data: {str(path)}, line {number}: {_JSON_KINDS.get(type(value), type(value).__name__)}, not a JSON "
            'object; every line must be one record such as {"prompt": ..., "response": ...}.'
        )
    return value


def _json_document(path: Path, lines: list[str]) -> list[dict[str, Any]] | None:
    """The records of a ``.json`` file: a list of objects (or one object); None when it holds JSON Lines."""
    try:
        value = json.loads("\n".join(lines))
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":  # several JSON values: JSON Lines
            return None
        raise ValueError(
            f"load_data: {str(path)}, line {err.lineno}: invalid JSON: {err.msg} (column {err.colno}); a .json file "
            "must hold a list of records (or JSON Lines: one record per line)."
        ) from None
    if isinstance(value, dict):
        return [value]
    if not isinstance(value, list):
        raise ValueError(
            f"load_data: {str(path)} holds {_JSON_KINDS.get(type(value), type(value).__name__)}, not a list of "
            "records; write a JSON array of objects, or one object per line (.jsonl)."
        )
    if not value:
        raise ValueError(f"load_data: {str(path)} holds no examples: the JSON array is empty.")
    bad = next((i for i, v in enumerate(value) if not isinstance(v, dict)), None)
    if bad is not None:
        raise ValueError(
            f"load_data: {str(path)}: element {bad} of the array is "
            f"{_JSON_KINDS.get(type(value[bad]), type(value[bad]).__name__)}, not an object; every element must be "
            'one record such as {"prompt": ..., "response": ...}.'
        )
    return value


def _read_parquet(path: Path) -> dict[str, list[Any]]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(str(path)).to_pydict()
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"load_data: {str(path)} could not be read as Parquet: {' '.join(str(err).split())}") from err


def _dataset_columns(ds: Any) -> dict[str, list[Any]]:
    # Plain lists (``ds[name]`` is a lazy Column in datasets >= 4 that would outlive the temporary cache).
    return {name: list(values) for name, values in ds.to_dict().items()}


def _records_columns(records: Sequence[Any]) -> dict[str, list[Any]]:
    if not records:
        return {}
    names: dict[str, None] = {}  # union of the keys, in first-seen order
    for i, record in enumerate(records):
        if not isinstance(record, Mapping):
            raise TypeError(f"load_data: records must be dicts, got {type(record).__name__} at index {i}.")
        names.update(dict.fromkeys(record))
    # A key absent from a record reads as None: fine for Alpaca's optional 'input'; _detect_format names the
    # first record lacking a required column.
    return {name: [record.get(name) for record in records] for name in names}


def _detect_format(columns: Mapping[str, list[Any]], description: str) -> str:
    names = set(columns)
    if {"input_ids", "labels"} <= names:
        fmt, required = "tokenized", ("input_ids", "labels")
    elif "messages" in names:
        fmt, required = "chat", ("messages",)
    elif {"prompt", "response"} <= names:
        fmt, required = "prompt-response", ("prompt", "response")
    elif {"prompt", "completion"} <= names:
        fmt, required = "prompt-completion", ("prompt", "completion")
    elif {"instruction", "output"} <= names:
        fmt, required = "alpaca", ("instruction", "output")
    else:
        raise ValueError(
            f"load_data: {description} has columns {sorted(names)}, which match no accepted format: {_ACCEPTED}. "
            "Rename the columns (e.g. datasets.Dataset.rename_column) or tokenise the data yourself."
        )
    for name in required:
        missing = [i for i, v in enumerate(columns[name]) if v is None]
        if missing:
            raise ValueError(
                f"load_data: example {missing[0]} of {_where(description, missing[0])} has no {name!r} (format "
                f"{fmt!r} needs {list(required)}); {len(missing)} example(s) lack it."
            )
    return fmt


def _text(value: Any, column: str, index: int, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(
            f"load_data: example {index}: {column!r} must be a string, got {type(value).__name__} "
            f"({_where(where, index)})."
        )
    return value


def _prompts_responses(columns: Mapping[str, list[Any]], fmt: str, where: str) -> tuple[list[str], list[str]]:
    if fmt in ("prompt-response", "prompt-completion"):
        answer = "response" if fmt == "prompt-response" else "completion"
        prompts = [_text(v, "prompt", i, where) for i, v in enumerate(columns["prompt"])]
        responses = [_text(v, answer, i, where) for i, v in enumerate(columns[answer])]
        return prompts, responses
    inputs = columns.get("input") or [None] * len(columns["instruction"])
    prompts = []
    for i, (instruction, extra) in enumerate(zip(columns["instruction"], inputs, strict=True)):
        instruction = _text(instruction, "instruction", i, where)
        extra = "" if extra is None else _text(extra, "input", i, where)
        prompts.append(instruction + "\n\n" + extra if extra.strip() else instruction)
    responses = [_text(v, "output", i, where) for i, v in enumerate(columns["output"])]
    return prompts, responses


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    out = tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    return [list(x) for x in out]


def _special_id(tokenizer: Any, name: str) -> list[int]:
    value = getattr(tokenizer, f"{name}_token_id", None)
    return [] if value is None else [int(value)]


def _tokenize_pairs(
    prompts: list[str], responses: list[str], tokenizer: Any, bar: Any
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    bos, eos = _special_id(tokenizer, "bos"), _special_id(tokenizer, "eos")
    input_ids, labels = [], []
    for start in range(0, len(prompts), _CHUNK):
        p_ids = _encode(tokenizer, prompts[start : start + _CHUNK])
        r_ids = _encode(tokenizer, responses[start : start + _CHUNK])
        for p, r in zip(p_ids, r_ids, strict=True):
            head = bos + p
            answer = r + eos
            input_ids.append(np.asarray(head + answer, dtype=np.int64))
            labels.append(np.asarray([IGNORE_INDEX] * len(head) + answer, dtype=np.int64))
        bar.update(len(p_ids))
    return input_ids, labels


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert isinstance(text, str), type(text)
    return text


def _chat_segments(tokenizer: Any, messages: Any, index: int, trained_from: int = 0,
                   where: str = "") -> list[tuple[str, bool]]:
    """The rendered conversation cut into ``(text, is_answer)`` segments at assistant-turn boundaries; assistant
    turns before message ``trained_from`` are not answers."""
    if not isinstance(messages, (list, tuple)) or not all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise TypeError(
            f"load_data: example {index}: 'messages' must be a list of {{'role': str, 'content': str}} dicts, "
            f"got {json.dumps(messages, default=str)[:200]} ({_where(where, index)})."
        )
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    full = _render(tokenizer, messages, False)
    segments: list[tuple[str, bool]] = []
    pos = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < trained_from:
            continue
        before = _render(tokenizer, messages[:i], True)
        upto = _render(tokenizer, messages[: i + 1], False)
        if not (upto.startswith(before) and full.startswith(upto) and len(before) >= pos):
            raise ValueError(
                f"load_data: example {index}: the tokenizer's chat template does not render conversations "
                "prefix-consistently (the text of the first turns changes when later turns are added), so the "
                "assistant tokens cannot be located exactly. Use a template without such special cases, or "
                "convert the data to prompt/response."
            )
        segments.append((full[pos : len(before)], False))
        segments.append((upto[len(before) :], True))
        pos = len(upto)
    segments.append((full[pos:], False))
    return [(text, answer) for text, answer in segments if text]


def _tokenize_chat(
    conversations: list[Any], tokenizer: Any, bar: Any, trained_from: Sequence[int] | None = None, *, where: str = ""
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "load_data: chat data ('messages') needs a tokenizer with a chat_template; this tokenizer has none. "
            "Set tokenizer.chat_template, or convert the data to 'prompt'/'response' records."
        )
    input_ids, labels = [], []
    for start in range(0, len(conversations), _CHUNK):
        chunk = [_chat_segments(tokenizer, m, start + j, trained_from[start + j] if trained_from else 0, where)
                 for j, m in enumerate(conversations[start : start + _CHUNK])]
        flat = _encode(tokenizer, [text for segments in chunk for text, _ in segments])
        k = 0
        for segments in chunk:
            ids: list[int] = []
            lab: list[int] = []
            for _, is_answer in segments:
                ids += flat[k]
                lab += flat[k] if is_answer else [IGNORE_INDEX] * len(flat[k])
                k += 1
            input_ids.append(np.asarray(ids, dtype=np.int64))
            labels.append(np.asarray(lab, dtype=np.int64))
        bar.update(len(chunk))
    return input_ids, labels
