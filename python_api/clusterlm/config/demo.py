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

    def check(self) -> None:
        """Refuse settings the demo cannot run with.

        Raises:
            ValueError: a world size or train_steps out of range, a ratio outside (0, 1], a negative seed.
        """
        for name, low in (("world_size", 1), ("seed", 0), ("train_steps", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"demo: --{name.replace('_', '-')} must be an int >= {low}, got {value!r}.")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 < self.ratio <= 1:
            raise ValueError(f"demo: --ratio must be a fraction in (0, 1], got {self.ratio!r}.")
