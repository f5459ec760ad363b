"""What a training run of :mod:`clusterlm.train` records: ``metrics.jsonl``, ``summary.json``, ``training.png``.

- :class:`MetricsLog`: one JSON record per line (rank 0 writes), every record kept for checkpoints and the
  summary; a resumed run rewrites the file up to its checkpoint.
- :func:`step_record`: a step's record from every rank's numbers (one all-gather).
- :func:`summarize` / :func:`summary_text`: the summary and its printed lines (first/last train loss as
  single steps and as window means, :func:`loss_windows`; held-out loss before/after; token balance).
- :func:`plot_training`: loss curve (train and held-out) and throughput.

Every file is written through :mod:`clusterlm.fileio`: a full disk is one :class:`~clusterlm.fileio.StorageError`
naming the file, and never leaves half a record or a temporary file.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from clusterlm.config.defaults import CKPT_DIR
from clusterlm.fileio import append_text, atomic_write, atomic_write_text
from clusterlm.launch.launcher import DistInfo, all_gather_floats

__all__ = ["CURVE", "METRICS", "SUMMARY", "MetricsLog", "loss_windows", "plot_training", "step_record",
           "summarize", "summary_text"]

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
CURVE = "training.png"
LOSS_WINDOW_MAX = 10


class MetricsLog:
    """``metrics.jsonl`` (rank 0 only): every record is also kept, for checkpoints and the summary."""

    def __init__(self, path: Path, enabled: bool, records: list[dict[str, Any]] | None = None,
                 sink: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.path = path
        self.enabled = enabled
        self.sink = sink  # also sends each new record elsewhere (TensorBoard, W&B: clusterlm.training.reporting)
        self.records: list[dict[str, Any]] = list(records or [])
        if enabled:  # (re)write what the run holds so far: a resumed run drops steps after its checkpoint
            atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in self.records))

    def append(self, record: dict[str, Any]) -> None:
        """Keep ``record`` and append it to the file (a disk that fills mid-record leaves no cut-off line).

        Raises:
            StorageError: the disk is full (or a quota, an I/O error); the file ends with the previous record.
        """
        self.records.append(record)
        if self.enabled:
            append_text(self.path, json.dumps(record) + "\n")
            if self.sink is not None:
                self.sink(record)


def step_record(stats: dict[str, float], dt: float, cpu: float, di: DistInfo, step: int, epoch: float,
                counters: dict[str, Any]) -> dict[str, Any]:
    """The metrics record of a step, from every rank's ``stats`` (:func:`clusterlm.engine.step.train_step`, one
    all-gather), its wall and CPU seconds; updates ``counters`` (tokens and training seconds so far)."""
    ranks = all_gather_floats([stats["loss"], stats["loss_unweighted"], stats["tokens"], stats["padded_tokens"], dt,
                               cpu], di)
    step_tokens = int(ranks[:, 2].sum())
    slowest = max(float(ranks[:, 4].max()), 1e-9)  # the step ends when the slowest rank ends
    counters["tokens"] += step_tokens
    counters["train_time"] += slowest
    return {"kind": "train", "step": step, "epoch": epoch, "loss": float(ranks[:, 0].mean()),
            "loss_unweighted": float(ranks[:, 1].mean()), "lr": stats["lr"], "grad_norm": stats["grad_norm"],
            "tokens": counters["tokens"], "step_tokens": ranks[:, 2].astype(int).tolist(),
            "step_padded_tokens": ranks[:, 3].astype(int).tolist(), "step_time": ranks[:, 4].tolist(),
            "step_cpu_time": ranks[:, 5].tolist(),
            "tokens_per_s": step_tokens / slowest, "elapsed": counters["train_time"]}


def loss_windows(losses: Sequence[float]) -> tuple[float, float, int] | None:
    """Means of the first and the last ``w = min(10, max(1, steps // 5))`` step losses, and ``w``.

    Single steps are noisy (one micro-batch mix each); window means compare like with like.

    Returns:
        ``(first_mean, last_mean, w)``, or None without steps.
    """
    n = len(losses)
    if not n:
        return None
    w = min(LOSS_WINDOW_MAX, max(1, n // 5))
    values = np.asarray(losses, dtype=np.float64)
    return float(values[:w].mean()), float(values[-w:].mean()), w


def _max_over_mean(x: np.ndarray) -> float | None:
    if not len(x):
        return None
    return float(np.mean(x.max(1) / np.maximum(x.mean(1), 1e-9)))


def summarize(records: list[dict[str, Any]], counters: dict[str, Any], config: Any, di: DistInfo, plan: Any,
              total_steps: int, wall: float, resumed_from: str | None) -> dict[str, Any]:
    """``summary.json``: from the run's records, counters, options (``plan``, ``micro_batch_size``,
    ``grad_accum``), ranks and plan."""
    train_recs = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    windows = loss_windows([r["loss"] for r in train_recs])
    tokens, padded, times = (  # (steps, ranks); a run without a train step gives (0, 0), not numpy's reshape error
        np.array([r[key] for r in train_recs], dtype=np.float64).reshape(len(train_recs), -1 if train_recs else 0)
        for key in ("step_tokens", "step_padded_tokens", "step_time"))
    return {
        "steps": len(train_recs),
        "total_steps": total_steps,
        "world_size": di.world_size,
        "device": di.device.type,
        "plan": config.plan,
        "plan_method": plan.config.get("method"),
        "examples_per_rank": plan.per_rank,
        "examples_per_step": config.micro_batch_size * config.grad_accum * di.world_size,
        "tokens": int(counters["tokens"]),
        "train_time_s": float(counters["train_time"]),
        "wall_time_s": wall,
        "tokens_per_s": counters["tokens"] / max(counters["train_time"], 1e-9),
        "mean_step_time_s": float(times.max(1).mean()) if len(times) else None,
        "step_token_max_over_mean": _max_over_mean(tokens),
        "step_padded_token_max_over_mean": _max_over_mean(padded),
        "first_train_loss": train_recs[0]["loss"] if train_recs else None,
        "final_train_loss": train_recs[-1]["loss"] if train_recs else None,
        "train_loss_window": windows[2] if windows else None,
        "train_loss_first_window": windows[0] if windows else None,
        "train_loss_last_window": windows[1] if windows else None,
        "initial_eval_loss": evals[0]["eval_loss"] if evals and evals[0]["step"] == 0 else None,
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "resumed_from": resumed_from,
        **task_summary([r for r in records if r["kind"] == "task"], train_recs),
    }


def task_summary(tasks: list[dict[str, Any]], train_recs: list[dict[str, Any]]) -> dict[str, Any]:
    """``task_metrics`` (after the last step), ``initial_task_metrics`` (before the first, with initial_task_eval)
    and ``task_eval_time_s`` (all task evaluations) of a run's ``task`` records; empty without tasks."""
    if not tasks:
        return {}
    last_step = train_recs[-1]["step"] if train_recs else 0
    return {"task_metrics": tasks[-1]["metrics"] if tasks[-1]["step"] >= last_step else None,
            "initial_task_metrics": tasks[0]["metrics"] if tasks[0]["step"] == 0 else None,
            "task_eval_time_s": float(sum(r.get("task_time", 0.0) for r in tasks))}


def summary_text(s: dict[str, Any], out: Path) -> str:
    """The lines the trainer prints at the end."""
    lines = [
        "",
        f"trained {s['steps']} steps on {s['world_size']} rank(s) ({s['examples_per_step']} examples per step) in "
        f"{s['train_time_s']:.1f} s of steps, {s['wall_time_s']:.1f} s wall: {s['tokens']:,} tokens, "
        f"{s['tokens_per_s']:,.0f} tokens/s",
    ]
    if s.get("train_loss_window"):
        w = s["train_loss_window"]
        which = "first/last step" if w == 1 else f"mean of first/last {w} steps"
        lines.append(f"train loss (weighted, {which}): {s['train_loss_first_window']:.4f} -> "
                     f"{s['train_loss_last_window']:.4f}")
    if s["final_eval_loss"] is not None:
        before = f"{s['initial_eval_loss']:.4f} -> " if s["initial_eval_loss"] is not None else ""
        lines.append(f"held-out loss (answer tokens): {before}{s['final_eval_loss']:.4f}")
    for name, value in (s.get("task_metrics") or {}).items():
        before = (s.get("initial_task_metrics") or {}).get(name)
        lines.append(f"{name}: {'' if before is None else f'{before:.4f} -> '}{value:.4f}")
    if s.get("task_eval_time_s"):
        lines.append(f"task evaluation: {s['task_eval_time_s']:.1f} s (apart from the training time)")
    if s["step_token_max_over_mean"] is not None:
        lines.append(f"per-step tokens across ranks, max/mean: {s['step_token_max_over_mean']:.3f} "
                     f"(padded {s['step_padded_token_max_over_mean']:.3f})")
    lines.append(f"metrics: {out / METRICS}\nsummary: {out / SUMMARY}\ncurve:   {out / CURVE}\n"
                 f"ckpt:    {out / CKPT_DIR}")
    return "\n".join(lines)


def plot_training(records: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """``training.png``: training loss (raw and smoothed) with held-out loss, and tokens/s per step."""
    train_recs = [r for r in records if r.get("kind") == "train"]
    eval_recs = [r for r in records if r.get("kind") == "eval"]
    if not train_recs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.array([r["step"] for r in train_recs])
    loss = np.array([r["loss"] for r in train_recs])
    # Trailing mean over 4 % of the run: smooths micro-batch noise while lagging only 2 % behind.
    window = max(1, len(loss) // 25)
    csum = np.concatenate([[0.0], np.cumsum(loss)])
    starts = np.maximum(np.arange(1, len(loss) + 1) - window, 0)
    smooth = (csum[1:] - csum[starts]) / (np.arange(1, len(loss) + 1) - starts)
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4))
    if window > 1:
        ax0.plot(steps, loss, color="tab:blue", alpha=0.3, lw=0.8, label="train (weighted objective)")
        ax0.plot(steps, smooth, color="tab:blue", lw=1.6, label=f"train, mean of {window} steps")
    else:
        ax0.plot(steps, loss, color="tab:blue", lw=1.2, label="train (weighted objective)")
    if eval_recs:
        ax0.plot([r["step"] for r in eval_recs], [r["eval_loss"] for r in eval_recs], "o-", color="tab:red",
                 label="held-out (answer tokens)")
    ax0.set_xlabel("optimizer step")
    ax0.set_ylabel("loss")
    ax0.set_title("loss")
    ax0.grid(alpha=0.3)
    ax0.legend()
    ax1.plot(steps, [r["tokens_per_s"] for r in train_recs], color="tab:green", lw=0.8)
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("tokens / s (all ranks)")
    ax1.set_title("throughput")
    ax1.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    finally:
        plt.close(fig)
    return path
