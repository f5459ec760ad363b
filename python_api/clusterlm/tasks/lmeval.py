"""lm-evaluation-harness tasks on the model in memory: :func:`evaluate_lm_eval_task`.

The model and tokenizer are wrapped in lm-eval's ``HFLM`` (no copy, no reload) and
``lm_eval.simple_evaluate`` runs one task: the task ``NAME`` of a local directory of YAML task files
(``TaskManager(include_path=DIR, include_defaults=False)``), or a task of lm-eval's own registry by name. Nothing is
downloaded: ``HF_HUB_OFFLINE`` and ``HF_DATASETS_OFFLINE`` are set for the call (when unset), so a task's data must
be a local file (``dataset_path: json`` with ``data_files``) or already in the Hugging Face datasets cache.

Metrics are ``NAME/METRIC`` (``mytask/acc``; a filter other than ``none`` is appended, ``gsm8k/exact_match_flexible-
extract``; a group's subtasks are ``NAME/SUBTASK/METRIC``); standard errors are not computed (``bootstrap_iters=0``).
Per-sample records keep lm-eval's ``doc_id`` (``task_id`` is ``SUBTASK/doc_id``), the target, the filtered
response and each sample's metrics. lm-eval seeds Python, NumPy and torch: their states are restored afterwards, so
a training run that evaluates between steps draws the same random numbers as one that does not.

Install: ``pip install "lm-eval[hf]==0.4.13"`` (or ``pip install 'cluster-kernels[eval]'``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from clusterlm.config.tasks import TaskConfig, TaskSpec
from clusterlm.tasks.generation import model_device, preserved_rng

__all__ = ["LM_EVAL_INSTALL", "evaluate_lm_eval_task", "offline"]

LM_EVAL_INSTALL = "pip install 'lm-eval[hf]==0.4.13'  (or: pip install 'cluster-kernels[eval]')"
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """``HF_HUB_OFFLINE=1`` and ``HF_DATASETS_OFFLINE=1`` for the block where unset, also in the constants that
    ``huggingface_hub`` and ``datasets`` read at import; all restored afterwards."""
    saved_env = {name: os.environ.get(name) for name in OFFLINE_VARIABLES}
    patched: list[tuple[Any, str, Any]] = []
    for module, names in (("huggingface_hub.constants", ("HF_HUB_OFFLINE",)),
                          ("datasets.config", ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))):
        mod = sys.modules.get(module)
        for name in names:
            if mod is not None and hasattr(mod, name) and saved_env.get(name) is None:
                patched.append((mod, name, getattr(mod, name)))
                setattr(mod, name, True)
    for name, value in saved_env.items():
        if value is None:
            os.environ[name] = "1"
    try:
        yield
    finally:
        for mod, name, value in patched:
            setattr(mod, name, value)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)


def _import_lm_eval() -> tuple[Any, Any, Any]:
    try:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise ImportError(f"tasks: lm-eval tasks need the lm-eval package ({e}); install it with: "
                          f"{LM_EVAL_INSTALL}") from None
    return simple_evaluate, HFLM, TaskManager


def _task_manager(task_manager_cls: Any, spec: TaskSpec) -> Any:
    if spec.path is None:
        return task_manager_cls()
    path = Path(spec.path).expanduser()
    if path.is_file() and path.suffix.lower() in (".yaml", ".yml"):
        path = path.parent
    if not path.is_dir():
        raise FileNotFoundError(f"tasks: --eval-task {spec.name}={spec.path}: no such directory (an lm-eval task "
                                "directory of YAML files; code problems are a .jsonl file).")
    return task_manager_cls(include_path=str(path), include_defaults=False)


def _plain(value: Any) -> Any:
    """JSON-safe data: tuples as lists, numbers as Python numbers, anything else as its text."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def _metrics(results: dict[str, Any], name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for task, values in results.items():
        prefix = name if task == name else f"{name}/{task}"
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            if "_stderr" in metric or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if metric in ("sample_len", "sample_count"):
                continue
            out[f"{prefix}/{metric if filt in ('', 'none') else f'{metric}_{filt}'}"] = float(value)
    return out


def _records(samples: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for task, rows in samples.items():
        for row in rows:
            record = {"task_id": f"{task}/{row.get('doc_id')}", "task": task, "doc_id": row.get("doc_id"),
                      "target": _plain(row.get("target")), "filter": row.get("filter"),
                      "response": _plain(row.get("filtered_resps"))}
            for metric in row.get("metrics", ()):
                if metric in row:
                    record[metric] = _plain(row[metric])
            out.append(record)
    return out


def _missing_task(spec: TaskSpec, error: Exception) -> Exception:
    where = f"the directory {spec.path}" if spec.path else "lm-eval's task registry"
    data = "" if spec.path else (" A registry task reads its data set from the Hugging Face datasets cache, "
                                 "offline: it must have been downloaded before.")
    return ValueError(f"tasks: --eval-task {spec.name}: lm-eval could not load the task {spec.name!r} from {where} "
                      f"({' '.join(str(error).split())[:300]}).{data}")


def evaluate_lm_eval_task(model: Any, tokenizer: Any, spec: TaskSpec, config: TaskConfig, *,
                          device: torch.device | None = None, progress: bool = True,
                          ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Run one lm-eval task on the model in memory (see the module docstring).

    Args:
        model / tokenizer: the model (a Hugging Face causal LM, on its device) and its tokenizer.
        spec: the task (``kind == "lm-eval"``).
        config: ``task_batch_size`` and ``task_limit`` are used.
        device: the model's device (default: where its parameters are).
        progress: lm-eval's own progress bars and log lines (off: its log level is raised to WARNING).

    Returns:
        ``(metrics, records)``: ``{"NAME/METRIC": value}`` and one record per lm-eval sample.

    Raises:
        ImportError: lm-eval is not installed (the message names the install).
        FileNotFoundError: the task directory does not exist.
        ValueError: lm-eval cannot find or load the task (e.g. its data is not available offline).
    """
    simple_evaluate, hflm_cls, task_manager_cls = _import_lm_eval()
    device = model_device(model) if device is None else device
    lm_logger = logging.getLogger("lm_eval")
    level = lm_logger.level
    if not progress:
        lm_logger.setLevel(logging.WARNING)
    was_training = model.training
    model.eval()
    try:
        with offline(), preserved_rng(device):
            manager = _task_manager(task_manager_cls, spec)
            lm = hflm_cls(pretrained=model, tokenizer=tokenizer, batch_size=config.task_batch_size)
            try:
                out = simple_evaluate(model=lm, tasks=[spec.name], task_manager=manager, limit=config.task_limit,
                                      log_samples=True, bootstrap_iters=0)
            except (KeyError, ValueError, FileNotFoundError, ConnectionError, OSError) as e:
                raise _missing_task(spec, e) from e
    finally:
        model.train(was_training)
        lm_logger.setLevel(level)
    if out is None:  # lm-eval answers on its rank 0 only
        return {}, []
    return _metrics(out.get("results", {}), spec.name), _records(out.get("samples", {}))
