"""The settings of a plan export: :class:`ExportConfig` (the layout, for the Python functions of
:mod:`clusterlm.integrations.export`) and :class:`ExportJob` (``clusterlm export``: the files, the model and those
settings).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from clusterlm.config.base import Config
from clusterlm.config.readers import chat_template_arg, non_negative_int_arg, positive_int_arg

__all__ = ["ExportConfig", "ExportJob"]


@dataclass(frozen=True)
class ExportConfig(Config):
    """The settings of an export; :func:`~clusterlm.integrations.export.export_order`,
    :func:`~clusterlm.integrations.export.plan_to_dataset` and :func:`~clusterlm.integrations.export.save_export`
    read theirs, :func:`~clusterlm.integrations.export.export_files` (``clusterlm export``) reads them all.

    Attributes:
        batch_size: per-device batch size B of the consuming trainer (1 for DistributedSampler(shuffle=False)).
        epochs: epochs written back to back, each reshuffled.
        seed: the plan sampler's seed of the per-epoch order (PlanSampler(plan, r, seed=seed)).
        shuffle: reshuffle every epoch like the plan sampler (--no-shuffle: every epoch in plan order).
        drop_last: drop each rank's last (m mod batch_size) examples per epoch instead of refusing.
        weight_column: name of the weight column.
        split: the split of a DatasetDict source.
        max_length: with a model, truncate examples to this many tokens (default: the plan's, else 1024).
        chat_template: with a model, render prompt/response data through the tokenizer's chat template (None:
            when it has one; --chat-template auto/on/off).
    """

    batch_size: int = field(default=1, metadata={"parse": positive_int_arg})
    epochs: int = field(default=1, metadata={"parse": positive_int_arg})
    seed: int = field(default=0, metadata={"parse": non_negative_int_arg})
    shuffle: bool = True
    drop_last: bool = False
    weight_column: str = "weight"
    split: str | None = None
    max_length: int | None = field(default=None, metadata={"parse": positive_int_arg})
    chat_template: bool | None = field(default=None, metadata={"parse": chat_template_arg, "metavar": "{auto,on,off}"})

    COMMAND: ClassVar[str] = "export"
    OWNER: ClassVar[str] = "plan export"


@dataclass(frozen=True)
class ExportJob(Config):
    """``clusterlm export``: the plan, the data, where the files go, and the model that tokenises raw rows.

    Attributes:
        plan: plan directory (clusterlm select --out).
        data: the data the plan was made for: a file or save_to_disk directory.
        out: output directory: dataset/, train.jsonl, export.json.
        model: tokenise raw rows with this model's tokenizer and verify the plan against them.
        config: the export settings (their options are ExportConfig's fields).
    """

    plan: str | None = None
    data: str | None = None
    out: str | None = None
    model: str | None = None
    config: ExportConfig = field(default_factory=ExportConfig, metadata={"cli": False})

    COMMAND: ClassVar[str] = "export"
    OWNER: ClassVar[str] = "export"

    def check(self) -> None:
        """The required fields (--plan, --data, --out).

        Raises:
            ValueError: one missing.
        """
        missing = [f"--{n}" for n in ("plan", "data", "out") if getattr(self, n) is None]
        if missing:
            raise ValueError(f"export: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required (an "
                             "option, or a field of the --config file).")
