"""``--eval-data name=path`` values as evaluation sets: the names, the parsing and the checks that need no data.

A bare path is named after its file stem (the characters other than letters, digits, ``_`` and ``-`` become ``_``;
``eval`` when nothing is left); a name is letters, digits, ``_`` and ``-``, starting with a letter or ``_``; names
are distinct. The first set is the primary one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_SET_NAME", "EvalSet", "eval_sets_of", "parse_eval_set"]

DEFAULT_SET_NAME = "eval"  # a bare path whose stem leaves no usable name
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


@dataclass(frozen=True)
class EvalSet:
    """One ``--eval-data`` entry.

    Attributes:
        name: its name in every table (``name=path``, else the file stem).
        path: the file or ``save_to_disk`` directory.
        named: given as ``name=path`` (False: a bare path).
    """

    name: str
    path: str
    named: bool = True


def _stem_name(path: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", Path(path).stem)
    if stem and not _NAME.fullmatch(stem):
        stem = "_" + stem  # starts with a digit or '-'
    return stem if _NAME.fullmatch(stem) else DEFAULT_SET_NAME


def parse_eval_set(value: str) -> EvalSet:
    """``name=path`` or a bare ``path`` (named after its file stem) as an :class:`EvalSet`.

    A value whose part before the first ``=`` holds a path separator, or that names an existing file as a whole,
    is a bare path (paths may contain ``=``).

    Raises:
        ValueError: an empty value or path, or a name that is not letters, digits, ``_`` and ``-`` starting with a
            letter or ``_``.
    """
    text = value.strip()
    name, eq, path = text.partition("=")
    if not eq or "/" in name or "\\" in name or Path(text).exists():
        if not text:
            raise ValueError("compare: --eval-data needs a path or name=path, got an empty value.")
        return EvalSet(_stem_name(text), text, named=False)
    name, path = name.strip(), path.strip()
    if not _NAME.fullmatch(name):
        raise ValueError(f"compare: --eval-data {value!r}: the name {name!r} is not a simple name; use letters, "
                         "digits, _ and - starting with a letter or _, e.g. --eval-data code=heldout.jsonl.")
    if not path:
        raise ValueError(f"compare: --eval-data {value!r} names no file; write name=path, e.g. code=heldout.jsonl.")
    return EvalSet(name, path)


def eval_sets_of(value: Any, default_path: str) -> list[EvalSet]:
    """The evaluation sets of a ``--eval-data`` value: None (the demo held-out split, ``default_path``), a string,
    an :class:`EvalSet`, or a list of those; the first is primary.

    Raises:
        ValueError: a bad entry (:func:`parse_eval_set`) or a name given twice.
        FileNotFoundError: a path that does not exist.
        TypeError: another type.
    """
    if value is None:
        value = [default_path]
    items = [value] if isinstance(value, (str, EvalSet)) else list(value) if isinstance(value, Sequence) else None
    if items is None or not all(isinstance(v, (str, EvalSet)) for v in items):
        raise TypeError(f"compare: --eval-data must be paths or name=path strings, got {value!r}.")
    sets = [v if isinstance(v, EvalSet) else parse_eval_set(v) for v in items] or [parse_eval_set(default_path)]
    names = [s.name for s in sets]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"compare: --eval-data names {', '.join(repr(n) for n in twice)} more than once (a bare path "
                         "is named after its file stem); give each set its own name: --eval-data NAME=PATH.")
    for s in sets:
        if not Path(s.path).expanduser().exists():
            raise FileNotFoundError(f"compare: --eval-data {s.name}: no such file or directory: {s.path}")
    return sets
