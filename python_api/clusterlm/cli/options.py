"""Command-line options generated from the config dataclasses, with the public API of :mod:`argparse` only.

Every option of ``clusterlm select``, ``train``, ``compare``, ``export`` and ``demo`` is a field of a config
dataclass (:class:`clusterlm.config.selection.SelectJob` with :class:`clusterlm.SelectConfig`,
:class:`clusterlm.TrainConfig`, :class:`clusterlm.CompareConfig`, :class:`clusterlm.config.export.ExportJob` with
:class:`clusterlm.config.export.ExportConfig`, :class:`clusterlm.config.demo.DemoConfig`); nothing is written down
a second time. Each field becomes ``--name-with-dashes`` (``--name_with_underscores`` kept as an alias); its type
comes from the annotation (``int``, ``float``, ``str``, a ``Literal`` of choices, ``bool``; ``X | None`` is ``X``).
A ``bool`` option reads ``--flag`` (true), ``--flag false`` and ``--no-flag``. A field's ``metadata`` may add:

* ``parse``: the function that reads the option's text (a validator with a one-line error, e.g. a fraction in
  (0, 1]); the field's own type then only documents the value;
* ``choices``, ``action`` (``append``), ``metavar``, ``nargs``, ``const``: as argparse's;
* ``aliases``: older spellings that keep working (``--model-dtype`` for ``--dtype``);
* ``group``: the ``--help`` section;
* ``cli=False``: not an option (a nested config, or a setting only Python callers have);
* ``low``, ``bounds``, ``per_run``: read by the config's ``check()`` and by compare, not here.

The help text of each option is the field's entry in its class docstring (:func:`clusterlm.config.files.field_help`),
followed by its default. ``--config FILE`` (YAML or JSON) gives the fields' values; options on the command line
override them (:func:`parse_config`). No option is ``required`` to argparse, so that a file can give it; the
config's ``check()`` names what is missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal, NoReturn

from clusterlm.config.files import check_keys, field_help, field_value, read_config_file

__all__ = ["ConfigArgumentParser", "option_fields", "parse_config", "text_to_bool"]

# Field-metadata keys passed on to argparse's add_argument as they are.
ARGPARSE_KEYS = ("choices", "action", "metavar", "nargs", "const")


def text_to_bool(value: str | bool) -> bool:
    """``true``/``yes``/``on``/``1`` -> True, ``false``/``no``/``off``/``0`` -> False (a bool option's text).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    if isinstance(value, bool):
        return value
    text = value.strip().lower()
    if text in ("true", "yes", "on", "1", "y", "t"):
        return True
    if text in ("false", "no", "off", "0", "n", "f"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def _plain_type(hint: Any) -> Any:
    """``X | None`` -> ``X`` (a union of several types stays a union)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else hint
    return hint


class ConfigArgumentParser(argparse.ArgumentParser):
    """An argument parser that adds the fields of config dataclasses as options, one class at a time, and whose
    errors are one line (``<prog>: error: <message> (see <prog> --help)``, exit status 2)."""

    def __init__(self, prog: str, description: str = "") -> None:
        super().__init__(prog=prog, description=description)
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
            ValueError: two classes with one field name (an option would have two meanings); a field whose type
                has no reader (give it ``parse`` metadata).
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
            default = defaults[f.name] if f.name in defaults else field_default(f)
            self.add_field(group, f, hints[f.name], helps.get(f.name, ""), default)

    def add_field(self, group: Any, f: dataclasses.Field, hint: Any, help_text: str, default: Any) -> None:
        """Add the option(s) of one field to ``group`` (see the module docstring for what the metadata adds)."""
        meta = f.metadata
        dashed = f.name.replace("_", "-")
        names = [f"--{dashed}"] + ([f"--{f.name}"] if "_" in f.name else []) + list(meta.get("aliases", ()))
        kwargs: dict[str, Any] = {k: meta[k] for k in ARGPARSE_KEYS if k in meta}
        plain = _plain_type(hint)
        is_bool = plain is bool and "parse" not in meta
        if "parse" in meta:
            kwargs["type"] = meta["parse"]
        elif typing.get_origin(plain) is Literal:
            kwargs.setdefault("choices", typing.get_args(plain))
        elif is_bool:
            kwargs.update(type=text_to_bool, nargs="?", const=True, metavar="BOOL")
        elif plain in (int, float, str):
            kwargs["type"] = plain
        else:
            raise ValueError(f"option --{dashed}: no reader for the type {hint}; give the field a parse function")
        shown = "" if default is None or default == () else f" (default: {_shown(default)})"
        group.add_argument(*names, dest=f.name, default=default,
                           help=(help_text + meta.get("help_suffix", "") + shown).replace("%", "%%"), **kwargs)
        if is_bool:  # --no-flag: the false spelling, whatever the default
            group.add_argument(f"--no-{dashed}", action="store_false", dest=f.name, default=argparse.SUPPRESS,
                               help=f"--{dashed} false")

    def parse_into(self, argv: list[str]) -> tuple[dict[str, Any], list[str]]:
        """``(values, unknown)``: every field's value (file first, the command line over it) and unknown options.

        Raises:
            FileNotFoundError / ValueError: the ``--config`` file is missing, not YAML/JSON, has a key written
                twice or an unknown key.
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

        def add(section: Mapping[str, Any]) -> None:
            for key, value in section.items():
                if isinstance(value, Mapping) and key not in self.fields:
                    add(value)  # a nested config's section: compare's ``train:``, its ``tasks:``
                else:
                    flat[key] = value

        add(values)
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


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    return str(value)


def field_default(f: dataclasses.Field) -> Any:
    """A field's default as an option's (a factory called; None when it has none: no option is required)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


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
