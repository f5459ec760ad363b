"""``report_to``: the scalars of ``metrics.jsonl`` also to TensorBoard and/or Weights & Biases (rank 0).

As in Hugging Face's ``TrainingArguments.report_to``: ``"tensorboard"`` writes event files to ``OUT/tensorboard``
with :class:`torch.utils.tensorboard.SummaryWriter`; ``"wandb"`` logs to a W&B run named after OUT (``WANDB_MODE``,
``WANDB_PROJECT`` and the other ``WANDB_*`` variables apply: ``WANDB_MODE=offline`` needs no network). Both
packages are optional extras; asking for one that is missing is one line naming the pip command, before any model
loads (:meth:`clusterlm.TrainConfig.check`).

Scalars, under the names metrics.jsonl uses: ``train/loss``, ``train/loss_unweighted``, ``train/lr``,
``train/grad_norm``, ``train/tokens_per_s``, ``train/tokens``; ``eval/eval_loss``. The step is the optimizer step.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["EVAL_SCALARS", "TENSORBOARD_DIR", "TRAIN_SCALARS", "Reporters"]

TENSORBOARD_DIR = "tensorboard"
TRAIN_SCALARS = ("loss", "loss_unweighted", "lr", "grad_norm", "tokens_per_s", "tokens")
EVAL_SCALARS = ("eval_loss",)


class Reporters:
    """The writers of one run (rank 0 only; an empty ``report_to`` or ``("none",)`` makes it a no-op)."""

    def __init__(self, report_to: Sequence[str], out: Path, config: dict[str, Any], enabled: bool,
                 resumed_at: int = 0) -> None:
        self.writers: list[Any] = []
        self.run: Any = None
        if not enabled:
            return
        if "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            # a run resumed at step s drops the events after s, as metrics.jsonl is rewritten from the checkpoint
            self.writers.append(SummaryWriter(log_dir=str(out / TENSORBOARD_DIR),
                                              purge_step=resumed_at + 1 if resumed_at else None))
        if "wandb" in report_to:
            import wandb

            self.run = wandb.init(name=Path(out).name, dir=str(out), config=config,
                                  resume="allow" if resumed_at else None,
                                  project=os.environ.get("WANDB_PROJECT", "clusterlm"))

    def log(self, record: dict[str, Any]) -> None:
        """Log one metrics.jsonl record (``kind`` train, eval or task) at its step."""
        if not self.writers and self.run is None:
            return
        kind = record.get("kind", "train")
        if kind == "task":  # task metrics: task/humaneval/pass@1, ...
            scalars = {f"task/{k}": float(v) for k, v in record.get("metrics", {}).items() if v is not None}
        else:
            names = EVAL_SCALARS if kind == "eval" else TRAIN_SCALARS
            scalars = {f"{kind}/{k}": float(record[k]) for k in names if record.get(k) is not None}
        for w in self.writers:
            for tag, value in scalars.items():
                w.add_scalar(tag, value, global_step=int(record["step"]))
            w.flush()
        if self.run is not None and scalars:
            self.run.log(scalars, step=int(record["step"]))

    def close(self) -> None:
        for w in self.writers:
            w.close()
        if self.run is not None:
            self.run.finish()
        self.writers, self.run = [], None
