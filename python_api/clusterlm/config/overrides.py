"""Settings objects: one call's settings laid over a frozen dataclass, with errors that name the setting.

Every settings object of the library (:class:`clusterlm.SelectConfig`, the baselines' ``LessConfig`` /
``S2LConfig`` / ``TrainLoopConfig``, ``ExportConfig``) is a frozen dataclass; a function takes one and keyword
overrides on top (``select(model, data, config, ratio=0.2)``), applied here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

__all__ = ["apply_settings"]

S = TypeVar("S")


def apply_settings(kind: type[S], config: S | None, overrides: Mapping[str, Any], owner: str) -> S:
    """The settings of one call: ``config`` (None: ``kind``'s defaults) with ``overrides`` applied.

    Args:
        kind: the settings dataclass (e.g. :class:`TrainLoopConfig`).
        config: an instance of ``kind``, or None.
        overrides: field name -> value.
        owner: the function the settings are for, named in the errors.

    Raises:
        TypeError: ``config`` is not a ``kind``; a name in ``overrides`` that is not a field (the message lists the
            fields); a required field given neither by ``config`` nor by ``overrides``.
    """
    if config is not None and not isinstance(config, kind):
        article = "an" if kind.__name__[0] in "AEIOU" else "a"
        raise TypeError(f"{owner}: config must be {article} {kind.__name__} or None, got {type(config).__name__} "
                        f"{config!r}; pass settings by keyword ({owner}(..., name=value)).")
    fields = dataclasses.fields(kind)  # type: ignore[arg-type]
    unknown = sorted(set(overrides) - {f.name for f in fields})
    if unknown:
        raise TypeError(f"{owner}: unknown setting(s) {', '.join(unknown)}; the settings are "
                        f"{', '.join(f.name for f in fields)} ({kind.__name__}).")
    if config is not None:
        return dataclasses.replace(config, **overrides) if overrides else config  # type: ignore[type-var]
    missing = [f.name for f in fields if f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING and f.name not in overrides]
    if missing:
        raise TypeError(f"{owner}: missing required setting(s) {', '.join(missing)} ({kind.__name__}).")
    return kind(**overrides)
