"""A code task end to end: :func:`evaluate_code_task` (generate, run in the sandbox, score pass@k).

For each problem (:mod:`clusterlm.tasks.problems`) the model writes ``task_samples`` completions
(:mod:`clusterlm.tasks.generation`; sample ``s`` is drawn with seed ``s``). Each completion becomes a program
(:func:`build_program`) that :func:`clusterlm.tasks.sandbox.execute_program` runs with the problem's test and
``check(entry_point)``, several at a time. The metrics are the unbiased ``pass@k`` (:mod:`clusterlm.tasks.passk`)
for each k and, when the problems carry canonical solutions, ``reference_loss``: the model's mean answer-token
loss of those solutions given their prompts (token-weighted, as the held-out loss of training), rendered as
training renders prompt/response data.

Stops: a plain prompt is completed until a top-level ``def``/``class``/``if``/``print``/``#`` line (the Codex
convention, :data:`CODE_STOPS`) or a ``--task-stop`` string; a chat answer until its end-of-turn token or a
``--task-stop`` string, and its code is taken from its fenced block.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cluster_kernels.lm_head_features import IGNORE_INDEX
from clusterlm.config.tasks import TaskConfig, TaskSpec
from clusterlm.data import collate, load_data
from clusterlm.engine.loss import per_example_loss
from clusterlm.engine.step import autocast
from clusterlm.tasks.generation import GenerationSettings, extract_code, generate, model_device, uses_chat_template
from clusterlm.tasks.passk import mean_pass_at_k
from clusterlm.tasks.problems import Problem, load_problems
from clusterlm.tasks.sandbox import ExecutionResult, execute_program

__all__ = ["CODE_STOPS", "build_program", "evaluate_code_task", "reference_loss", "run_programs"]

CODE_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")
_DEFINES = "def {name}("


def _compiles(source: str) -> bool:
    try:
        compile(source, "<prompt>", "exec")
    except (SyntaxError, ValueError):
        return False
    return True


def build_program(problem: Problem, completion: str, chat: bool) -> str:
    """The program a completion makes: ``prompt + completion``. A chat answer gives the code of its fenced block
    (or the whole answer); when that code defines the entry point itself it follows the prompt (a stub with its
    docstring: the prompt's imports and helpers stay, the answer's function replaces the stub), or only the
    prompt's import lines when the prompt alone is not Python; otherwise it is the body after the prompt."""
    if not chat:
        return problem.prompt + completion
    code = extract_code(completion)
    code = completion if code is None else code
    if not re.search(rf"^\s*(async\s+)?def\s+{re.escape(problem.entry_point)}\s*\(", code, re.MULTILINE):
        return problem.prompt + code
    if _compiles(problem.prompt):
        return problem.prompt.rstrip() + "\n\n\n" + code
    imports = [line for line in problem.prompt.splitlines() if re.match(r"(import|from)\s+\w", line)]
    return "\n".join([*imports, "", code])


def run_programs(jobs: Sequence[tuple[str, Problem]], timeout: float, *, workers: int | None = None,
                 progress: bool = True, desc: str = "run") -> list[ExecutionResult]:
    """:func:`execute_program` on each ``(program, problem)`` with the problem's test and entry point, ``workers``
    at a time (default: half the CPUs, at most 8), in order."""
    from tqdm.auto import tqdm

    workers = workers or max(1, min(8, (os.cpu_count() or 2) // 2))

    def one(job: tuple[str, Problem]) -> ExecutionResult:
        program, problem = job
        return execute_program(program, timeout, test=problem.test, entry_point=problem.entry_point)

    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        bar = tqdm(total=len(jobs), desc=desc, unit="program", disable=not progress, leave=False)
        try:
            futures = [pool.submit(one, job) for job in jobs]
            for future in concurrent.futures.as_completed(futures):
                future.result()
                bar.update(1)
        finally:
            bar.close()
    return [f.result() for f in futures]


@torch.no_grad()
def reference_loss(model: Any, tokenizer: Any, problems: Sequence[Problem], *, batch_size: int = 8,
                   device: torch.device | None = None, chat_template: bool | None = None) -> float | None:
    """The token-weighted mean answer-token loss of the canonical solutions given their prompts, rendered as
    :func:`clusterlm.data.load_data` renders prompt/response data (``chat_template`` as there); None: no problem
    has one."""
    records = [{"prompt": p.prompt, "response": p.canonical_solution} for p in problems if p.canonical_solution]
    if not records:
        return None
    max_length = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    data = load_data(records, tokenizer, max_length=max_length if isinstance(max_length, int) else None,
                     progress=False, chat_template=chat_template)
    device = model_device(model) if device is None else device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    was_training = model.training
    model.eval()
    total = tokens = 0.0
    try:
        for s in range(0, len(data), batch_size):
            batch = {k: v.to(device) for k, v in collate([data[i] for i in range(s, min(s + batch_size,
                                                                                            len(data)))],
                                                          pad_id=int(pad)).items()}
            with autocast(device.type, torch.bfloat16 if device.type == "cuda" else None):
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            counts = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1)
            total += float((per_example_loss(logits, batch["labels"]).double() * counts.double()).sum())
            tokens += float(counts.sum())
    finally:
        model.train(was_training)
    return total / tokens if tokens else math.nan


def _records(problems: Sequence[Problem], completions: list[list[str]],
             results: list[ExecutionResult]) -> list[dict[str, Any]]:
    out, k = [], 0
    for sample, texts in enumerate(completions):
        for problem, text in zip(problems, texts, strict=True):
            r = results[k]
            out.append({"task_id": problem.task_id, "sample": sample, "status": r.status,
                        "seconds": round(r.seconds, 4), "completion": text, "detail": r.detail})
            k += 1
    return out


def evaluate_code_task(model: Any, tokenizer: Any, spec: TaskSpec, config: TaskConfig, *,
                       device: torch.device | None = None, progress: bool = True, chat_template: bool | None = None,
                       programs: Callable[[list[tuple[str, Problem]]], list[ExecutionResult]] | None = None,
                       ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Generate, run and score one code task (see the module docstring).

    Args:
        model / tokenizer: the model in memory and its tokenizer.
        spec: the task (its problems file, or a built-in name).
        config: the task settings (samples, temperature, stops, k, limit, batch size, timeout).
        device: where generation runs (default: the model's device).
        progress: tqdm bars.
        chat_template: render the prompts through the tokenizer's chat template (None: when it has one), as the
            training data was (``TrainConfig.chat_template``).
        programs: runs the ``(program, problem)`` jobs (default: :func:`run_programs` in the sandbox); a test may
            substitute its own.

    Returns:
        ``(metrics, records)``: ``{"pass@k": ..., "reference_loss": ...}`` and one record per problem and sample
        (``task_id``, ``sample``, ``status``, ``seconds``, ``completion``, ``detail``).

    Raises:
        ValueError: ``config.allow_code_execution`` is False (the message names --allow-code-execution).
    """
    if not config.allow_code_execution:
        raise ValueError(f"tasks: {spec.name} is a code task: running its generated programs needs "
                         "--allow-code-execution (allow_code_execution=True); they run in a sandbox, but they are "
                         "untrusted code on this machine.")
    problems = load_problems(spec.path or spec.name, limit=config.task_limit)
    chat = uses_chat_template(tokenizer, chat_template)
    settings = GenerationSettings(max_new_tokens=config.task_max_new_tokens, temperature=config.task_temperature,
                                  stop=tuple(config.task_stop) + (() if chat else CODE_STOPS),
                                  batch_size=config.task_batch_size, chat_template=chat)
    completions = []
    for sample in range(config.task_samples):
        completions.append(generate(model, tokenizer, [p.prompt for p in problems],
                                    dataclasses.replace(settings, seed=sample), device=device,
                                    progress=progress, desc=f"{spec.name} generate {sample + 1}/{config.task_samples}"))
    jobs = [(build_program(p, text, chat), p) for texts in completions for p, text in zip(problems, texts,
                                                                                          strict=True)]
    run = programs or (lambda js: run_programs(js, config.task_timeout, progress=progress, desc=f"{spec.name} run"))
    results = run(jobs)
    records = _records(problems, completions, results)
    passed: dict[str, int] = {}
    for rec in records:
        passed[rec["task_id"]] = passed.get(rec["task_id"], 0) + (rec["status"] == "passed")
    scores = mean_pass_at_k([(config.task_samples, passed[p.task_id]) for p in problems], config.task_pass_k)
    metrics = {f"pass@{k}": v for k, v in scores.items()}
    loss = reference_loss(model, tokenizer, problems, batch_size=config.task_batch_size, device=device,
                          chat_template=chat)
    if loss is not None:
        metrics["reference_loss"] = loss
    return metrics, records
