"""The settings of ``clusterlm demo``: :class:`DemoConfig` (select on the built-in data, then train)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from clusterlm.config.base import Config
from clusterlm.config.readers import fraction_arg, non_negative_int_arg, positive_int_arg

__all__ = ["DEMO_OUT", "DemoConfig"]

DEMO_OUT = "runs/demo"


@dataclass(frozen=True)
class DemoConfig(Config):
    """Every setting of ``clusterlm demo`` (:func:`clusterlm.training.demo.run_demo`).

    Attributes:
        world_size: ranks the plan is made for, and CPU processes of the demo training.
        ratio: fraction of the built-in training data kept.
        seed: seeds the selection and the training.
        out: output directory (OUT/plan: the plan and its report; OUT/train: the training run).
        train_steps: optimizer steps of the demo training (0: skip the training).
        progress: progress bars (--no-progress: log lines).
    """

    world_size: int = field(default=2, metadata={"parse": positive_int_arg})
    ratio: float = field(default=0.31, metadata={"parse": fraction_arg})
    seed: int = field(default=0, metadata={"parse": non_negative_int_arg})
    out: str = DEMO_OUT
    train_steps: int = field(default=40, metadata={"parse": non_negative_int_arg})
    progress: bool = True

    COMMAND: ClassVar[str] = "demo"
