"""Record formats: their names, detection from the columns, the raw records, empty answers, source lines.

:func:`detect_format` names the format of a source's columns (:data:`FORMATS`); :class:`RawData` holds the records
read without a tokenizer, and knows which have an empty answer (:func:`refuse_all_empty` refuses a source where
every one has, :func:`warn_skipped` names the skipped ones). :func:`source_line` turns an example's index into its
line of a JSON Lines file, for messages.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from clusterlm.config.defaults import CHAT_TEMPLATE_MODES

__all__ = [
    "CHAT_TEMPLATE_MODES", "FORMATS", "RawData", "detect_format", "is_conversational", "refuse_all_empty",
    "source_line", "warn_skipped",
]

FORMATS = ("prompt-response", "prompt-completion", "alpaca", "chat", "tokenized")


_ACCEPTED = (
    "'prompt'/'response'; TRL's 'prompt'/'completion' (strings or conversations); Alpaca "
    "'instruction'/'input'(optional)/'output'; chat 'messages' (a list of {'role', 'content'}); or already "
    "tokenised 'input_ids'/'labels'"
)


def detect_format(columns: Mapping[str, list[Any]], description: str) -> str:
    """The format of :data:`FORMATS` that the columns hold; a ValueError naming the columns, or the first
    example that lacks a required one."""
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
                f"load_data: example {missing[0]} of {source_line(description, missing[0])} has no {name!r} (format "
                f"{fmt!r} needs {list(required)}); {len(missing)} example(s) lack it."
            )
    return fmt


def is_conversational(values: list[Any]) -> bool:
    """TRL's conversational prompt/completion: the first non-empty value is a list of messages."""
    first = next((v for v in values if v is not None), None)
    return isinstance(first, (list, tuple))


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
        """0-based indices of the examples whose answer text is empty or only whitespace (see :mod:`clusterlm.data`).

        The ``response`` / ``completion`` / ``output`` string, or every assistant turn that would be trained in a
        conversation (one with no assistant turn at all is not counted: it fails later as having no answer token).
        Values of the wrong type are not counted either (the tokeniser names them).
        """
        if self.format == "tokenized":
            return ()
        if self.format == "chat":
            return tuple(i for i, m in enumerate(self.columns["messages"]) if _blank_turns(m))
        answers = self.columns[_ANSWER_COLUMN[self.format]]
        if self.format == "prompt-completion" and is_conversational(self.columns["prompt"]):
            return tuple(i for i, m in enumerate(answers) if _blank_turns(m))
        return tuple(i for i, v in enumerate(answers) if isinstance(v, str) and not v.strip())


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


def refuse_all_empty(raw: RawData) -> tuple[int, ...]:
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


def warn_skipped(raw: RawData, empty: Sequence[int]) -> None:
    """One UserWarning naming how many examples were skipped for an empty answer, and where."""
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


def source_line(description: str, index: int) -> str:
    """``description``, with the 1-based line of example ``index`` when it names a JSON Lines file (for errors)."""
    lines = _record_lines(description)
    if lines is None or not 0 <= index < len(lines):
        return description
    return f"{description}, line {lines[index]}"
