"""The one base of every job's config: :class:`Config`.

Every job of the library takes one frozen dataclass of settings (select: :class:`clusterlm.SelectConfig` inside
:class:`clusterlm.config.selection.SelectJob`; train: :class:`clusterlm.TrainConfig`; compare:
:class:`clusterlm.CompareConfig`; export, demo and the baselines: the classes of :mod:`clusterlm.config`). They
share what this class gives, written once:

* fields with plain defaults, their help in the class docstring's ``Attributes:`` section (what ``--help`` and the
  API reference both show), command-line details in the field's ``metadata`` (:mod:`clusterlm.cli.options`);
* :meth:`Config.replace` and :meth:`Config.merged` (a call's keyword overrides over a config), refusing a name that
  is not a setting;
* :meth:`Config.to_dict` / :meth:`Config.from_dict`, :meth:`Config.load` / :meth:`Config.save` (YAML or JSON);
* :meth:`Config.check`: every rule of that config, called once where the job starts.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from clusterlm.config.files import from_dict, read_config_file, to_dict, write_config
from clusterlm.config.readers import non_negative_int_arg, positive_int_arg

__all__ = ["Config", "meta"]

C = TypeVar("C", bound="Config")


def meta(group: str, *, low: int | None = None, bounds: tuple | None = None, per_run: bool = False,
         **cli: Any) -> dict[str, Any]:
    """A field's metadata: its ``--help`` section, the least value of an int (read by its option's reader and by
    the config's ``check()``), the range of a float, whether it names one run rather than how to train
    (``per_run``: compare sets it per unit), and argparse details (``aliases``, ``nargs``, ``const``,
    ``metavar``, ``parse``)."""
    out: dict[str, Any] = {"group": group, **cli}
    if low is not None:
        out.update(low=low, parse=positive_int_arg if low == 1 else non_negative_int_arg)
    if bounds is not None:
        out["bounds"] = bounds
    if per_run:
        out["per_run"] = True
    return out


class Config:
    """What every job's config does: replace, dict and file round trips, and its checks.

    Subclasses are frozen dataclasses. :attr:`COMMAND` names the command whose ``--config`` reads the file;
    :attr:`OWNER` names the function the settings are for in error messages (default: the command).
    """

    COMMAND: ClassVar[str] = ""
    OWNER: ClassVar[str] = ""

    @classmethod
    def owner(cls) -> str:
        """The name errors about these settings start with (``train``, ``select``, ``s2l_plan``, ...)."""
        return cls.OWNER or cls.COMMAND or cls.__name__

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The names of the settings, in order."""
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def check_names(cls, names: Any) -> None:
        """Refuse names that are not settings of this config.

        Raises:
            TypeError: the unknown names and the list of settings.
        """
        unknown = sorted(set(names) - set(cls.field_names()))
        if unknown:
            raise TypeError(f"{cls.owner()}: unknown setting(s) {', '.join(unknown)}; the settings are "
                            f"{', '.join(cls.field_names())} ({cls.__name__}).")

    def replace(self: C, **changes: Any) -> C:
        """A copy with ``changes`` applied.

        Raises:
            TypeError: a name that is not a setting (the message lists the settings).
        """
        type(self).check_names(changes)
        return dataclasses.replace(self, **changes) if changes else self  # type: ignore[type-var]

    @classmethod
    def merged(cls: type[C], config: C | None, overrides: Mapping[str, Any]) -> C:
        """The settings of one call: ``config`` (None: the defaults) with keyword ``overrides`` over it.

        Raises:
            TypeError: ``config`` is not a ``cls``; an unknown name in ``overrides``; a required setting given
                neither by ``config`` nor by ``overrides``.
        """
        owner = cls.owner()
        if config is not None and not isinstance(config, cls):
            article = "an" if cls.__name__[0] in "AEIOU" else "a"
            raise TypeError(f"{owner}: config must be {article} {cls.__name__} or None, got "
                            f"{type(config).__name__} {config!r}; pass settings by keyword ({owner}(..., name=value)).")
        cls.check_names(overrides)
        if config is not None:
            return config.replace(**overrides)
        missing = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING  # type: ignore[arg-type]
                   and f.default_factory is dataclasses.MISSING and f.name not in overrides]
        if missing:
            raise TypeError(f"{owner}: missing required setting(s) {', '.join(missing)} ({cls.__name__}).")
        return cls(**overrides)

    @classmethod
    def coerce(cls: type[C], value: Any, example: str) -> C:
        """``value`` as this config: the config itself, or a mapping of its settings through :meth:`from_dict`
        (an unknown name is refused).

        Raises:
            TypeError: anything else (the message names the expected type and shows ``example``).
        """
        if isinstance(value, Mapping):
            return cls.from_dict(value, f"{cls.owner()}(config)")
        if not isinstance(value, cls):
            raise TypeError(f"{cls.owner()}: config must be a clusterlm.{cls.__name__} (or a mapping of its settings), "
                            f"got {type(value).__name__}; e.g. {example}.")
        return value

    def check(self) -> None:
        """Every rule of this config that needs no data; the job calls it once before it loads anything.

        Raises:
            ValueError / TypeError: the first bad setting, named, with the fix.
        """

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists for tuples, nested configs as mappings): what the config file holds."""
        return to_dict(self)

    @classmethod
    def from_dict(cls: type[C], data: Mapping[str, Any], where: str = "") -> C:
        """The config of a mapping of field names (an unknown name is refused, naming the closest field)."""
        return from_dict(cls, data, where or cls.__name__)

    @classmethod
    def load(cls: type[C], path: str | os.PathLike) -> C:
        """Read a YAML/JSON config file (e.g. the resolved one written next to a run's outputs).

        Raises:
            FileNotFoundError / ValueError: no such file, not YAML/JSON, a key written twice, an unknown key.
        """
        return cls.from_dict(read_config_file(path), f"--config {path}")

    def save(self, path: str | os.PathLike) -> str:
        """Write the YAML file (atomically); the sha256 of its text."""
        header = f"clusterlm {self.COMMAND} --config FILE ({type(self).__name__})"
        return write_config(self.to_dict(), Path(path), header=header)
