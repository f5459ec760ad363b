"""Command-line options generated from the config dataclasses, with transformers' ``HfArgumentParser``.

Every option of ``clusterlm select``, ``train`` and ``compare`` is a field of a config dataclass
(:class:`clusterlm.SelectConfig` / :class:`clusterlm.selection.pipeline.SelectJob`, :class:`clusterlm.TrainConfig`,
:class:`clusterlm.CompareConfig`); nothing is written down a second time. For each field
``HfArgumentParser`` (what TRL's own command line builds on) makes ``--name`` and ``--name-with-dashes``, the
type, default and choices (a ``Literal`` annotation). A field's ``metadata`` may add:

* ``parse``: the function that reads the option's text (a validator with a one-line error, e.g. a fraction in
  (0, 1]); the field's own type then only documents the value;
* ``aliases``: older spellings that keep working (``--model-dtype`` for ``--dtype``);
* ``group``: the ``--help`` section; ``metavar``, ``nargs``, ``const``: as argparse's;
* ``cli=False``: not an option (a nested config, or a setting only Python callers have);
* ``low``: the least value of an int setting (its config's ``check()`` reads it).

The help text of each option is the field's entry in its class docstring (:func:`clusterlm.config.files.field_help`).

``--config FILE`` (YAML or JSON) gives the fields' values; options on the command line override them
(:func:`parse_config`). No option is ``required`` to argparse, so that a file can give it; the config's
``check()`` names what is missing.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn

from transformers import HfArgumentParser

from clusterlm.config.files import check_keys, field_help, field_value, read_config_file

__all__ = ["CUSTOM_KEYS", "ConfigArgumentParser", "option_fields", "parse_config"]

# Field-metadata keys that are ours, not argparse's: taken out before HfArgumentParser sees the field.
CUSTOM_KEYS = ("parse", "group", "cli", "nargs", "const", "metavar", "help_suffix", "low")


class ConfigArgumentParser(HfArgumentParser):
    """An ``HfArgumentParser`` that adds dataclass fields one class at a time, with :data:`CUSTOM_KEYS` honoured,
    and whose errors are one line (``<prog>: error: <message> (see <prog> --help)``, exit status 2)."""

    def __init__(self, prog: str, description: str = "") -> None:
        super().__init__(dataclass_types=[], prog=prog, description=description)
        self.fields: dict[str, tuple[type, dataclasses.Field]] = {}  # dest -> (owner class, field)
        self.add_argument("--config", default=None, metavar="FILE",
                          help="YAML or JSON file of settings (the field names); options given here override it")

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")

    def add_config(self, cls: type, *, exclude: Iterable[str] = (), defaults: Mapping[str, Any] | None = None,
                   title: str | None = None) -> None:
        """Add an option for every field of ``cls`` (but ``exclude`` and ``cli=False`` ones), defaults from
        ``defaults`` where given (a nested config's own defaults), in ``--help`` groups by the ``group`` metadata.

        Raises:
            ValueError: two classes with one field name (an option would have two meanings).
        """
        defaults = dict(defaults or {})
        hints = typing.get_type_hints(cls)
        helps = field_help(cls)
        groups: dict[str, Any] = {}
        for f in option_fields(cls, exclude):
            if f.name in self.fields:
                raise ValueError(f"option --{f.name} is a field of both {self.fields[f.name][0].__name__} and "
                                 f"{cls.__name__}")
            self.fields[f.name] = (cls, f)
            title_f = f.metadata.get("group", title)
            group = self if title_f is None else groups.setdefault(title_f, self.add_argument_group(title_f))
            self._add_field(group, f, hints[f.name], helps.get(f.name, ""), defaults)

    def _add_field(self, group: Any, f: dataclasses.Field, hint: Any, help_text: str,
                   defaults: Mapping[str, Any]) -> None:
        meta = dict(f.metadata)
        parse: Callable[[str], Any] | None = meta.get("parse")
        plain = copy.copy(f)
        plain.metadata = types.MappingProxyType({k: v for k, v in meta.items() if k not in CUSTOM_KEYS})
        # A field with its own reader is a plain string to HfArgumentParser (whose Union support is narrow).
        plain.type = str if parse is not None else hint
        if f.name in defaults:
            plain.default, plain.default_factory = defaults[f.name], dataclasses.MISSING
        elif f.default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            plain.default, plain.default_factory = f.default_factory(), dataclasses.MISSING
        if plain.default is dataclasses.MISSING:
            plain.default = None  # never required to argparse: a --config file may give it; check() names it
        plain.metadata = types.MappingProxyType({**plain.metadata, "help": help_text + meta.get("help_suffix", "")})
        before = len(group._group_actions) if hasattr(group, "_group_actions") else len(self._actions)
        self._parse_dataclass_field(group, plain)
        actions = group._group_actions if hasattr(group, "_group_actions") else self._actions
        for action in actions[before:]:
            # --name-with-dashes first (what --help shows), --name_with_underscores kept as an alias
            action.option_strings.sort(key=lambda o: "_" in o)
            if action.dest != f.name or isinstance(action, argparse._StoreFalseAction):
                continue
            if action.nargs == "?" and action.const is True:
                action.metavar = "BOOL"  # --flag alone is true; --flag false turns a file's true off
            if parse is not None:
                action.type = parse
            for key in ("nargs", "const", "metavar"):
                if key in meta:
                    setattr(action, key, meta[key])
        dashed = f.name.replace("_", "-")
        if plain.type in (bool, bool | None) and f"--no-{dashed}" not in self._option_string_actions:
            # HfArgumentParser adds --no-x only for a default of True; a flag whose default is False (here, or in a
            # nested config's defaults) keeps its --no-x spelling too
            group.add_argument(f"--no-{dashed}", action="store_false", dest=f.name, default=argparse.SUPPRESS,
                               help=f"--{dashed} false")

    def parse_into(self, argv: list[str]) -> tuple[dict[str, Any], list[str]]:
        """``(values, unknown)``: every field's value (file first, the command line over it) and unknown options.

        Raises:
            FileNotFoundError / ValueError: the ``--config`` file is missing, not YAML/JSON, or has an unknown key.
        """
        pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        pre.add_argument("--config", default=None)
        known, _ = pre.parse_known_args(argv)
        if known.config:
            self.apply_file(read_config_file(known.config), known.config)
        ns, unknown = self.parse_known_args(argv)
        return {k: v for k, v in vars(ns).items() if k in self.fields}, unknown

    def apply_file(self, values: Mapping[str, Any], where: str) -> None:
        """Make a config file's values the defaults (nested mappings of ``cli=False`` configs are flattened)."""
        flat: dict[str, Any] = {}
        for key, value in values.items():
            if isinstance(value, Mapping) and key not in self.fields:
                flat.update(value)  # e.g. compare's ``train:`` section
            else:
                flat[key] = value
        unknown = [k for k in flat if k not in self.fields]
        if unknown:
            owners = {cls for cls, _ in self.fields.values()}
            probe = dataclasses.make_dataclass("settings", [(n, Any) for n in self.fields])
            probe.__name__ = " / ".join(sorted(c.__name__ for c in owners))
            check_keys({unknown[0]: None}, probe, f"--config {where}")
        for key, value in flat.items():  # YAML has lists; a tuple field keeps its tuples
            cls, f = self.fields[key]
            flat[key] = field_value(typing.get_type_hints(cls)[f.name], value)
        self.set_defaults(**flat)


def option_fields(cls: type, exclude: Iterable[str] = ()) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are command-line options (not ``cli=False``, not in ``exclude``)."""
    skip = set(exclude)
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True) and f.name not in skip]


def parse_config(parser: ConfigArgumentParser, argv: list[str]) -> dict[str, Any]:
    """:meth:`ConfigArgumentParser.parse_into` that refuses unknown options (one line, exit status 2)."""
    values, unknown = parser.parse_into(argv)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return values
