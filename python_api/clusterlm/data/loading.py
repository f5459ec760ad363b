"""The two entry points: :func:`read_data` (read and check a source, no tokenizer) and :func:`load_data`
(tokenise, mask, truncate, skip empty answers: an :class:`~clusterlm.data.SFTDataset`)."""

from __future__ import annotations

from typing import Any

from cluster_kernels.lm_head_features import IGNORE_INDEX
from clusterlm.config.defaults import DEFAULT_MAX_LENGTH
from clusterlm.data.dataset import SFTDataset, example_pair
from clusterlm.data.formats import RawData, detect_format, refuse_all_empty, source_line, warn_skipped
from clusterlm.data.sources import read_source
from clusterlm.data.tokens import tokenize_text

__all__ = ["DEFAULT_MAX_LENGTH", "load_data", "read_data"]



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
            :func:`read_data` read from any of these. Record formats: see the :mod:`clusterlm.data` docstring.
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
    empty = refuse_all_empty(raw)
    if fmt == "tokenized":
        input_ids, labels = [], []
        for i in range(n):
            item = {"input_ids": columns["input_ids"][i], "labels": columns["labels"][i]}
            ids, lab = example_pair(item, i, "load_data")
            input_ids.append(ids)
            labels.append(lab)
    else:
        if tokenizer is None:
            raise TypeError(
                f"load_data: {description} holds text in the {fmt!r} format, so a tokenizer is required "
                "(e.g. transformers.AutoTokenizer.from_pretrained(<model dir>)); got tokenizer=None."
            )
        input_ids, labels, use_template = tokenize_text(raw, tokenizer, chat_template, progress)
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
                    f"load_data: example {i} of {source_line(description, i)} has no answer token left after "
                    f"truncation to max_length={max_length} (its prompt fills the first {max_length} tokens). "
                    "Raise max_length or shorten that prompt; examples are never dropped silently."
                )
        elif not (labels[i][1:] != IGNORE_INDEX).any():
            raise ValueError(
                f"load_data: example {i} of {source_line(description, i)} has no answer token (all labels after the "
                "first position are -100: an empty response without an eos token, a chat without an assistant turn, "
                "or fully masked labels); its loss would be undefined. Fix or remove that example."
            )
    if empty:
        warn_skipped(raw, empty)
        input_ids = [x for i, x in enumerate(input_ids) if i not in skip]
        labels = [x for i, x in enumerate(labels) if i not in skip]
    return SFTDataset(
        input_ids, labels, n_truncated=n_truncated, max_length=max_length, source=description, format=fmt,
        rendering="tokenized" if fmt == "tokenized" else ("chat-template" if use_template else "plain"),
        empty_indices=empty,
    )


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
    columns, description = read_source(source, split)
    if not columns or not len(next(iter(columns.values()))):
        raise ValueError(f"load_data: {description} holds no examples.")
    raw = RawData(columns=columns, description=description, format=detect_format(columns, description))
    refuse_all_empty(raw)
    return raw
