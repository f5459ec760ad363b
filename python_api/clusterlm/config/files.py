"""Config objects as files: YAML or JSON in, YAML out, and the help text of every field.

Every job of the library is one frozen dataclass (:class:`clusterlm.SelectConfig` with
:class:`clusterlm.selection.pipeline.SelectJob`, :class:`clusterlm.TrainConfig`, :class:`clusterlm.CompareConfig`). This
module turns such an object into a file and back, so a run can be described in a file (as TRL, axolotl and
torchtune users keep theirs) and the resolved settings are written next to the outputs:

* :func:`read_config_file` reads ``run.yaml`` / ``run.json`` into a mapping, refusing an unknown key with the
  closest field's name (:func:`check_keys`);
* :func:`to_dict` / :func:`from_dict` convert between an object and plain data (nested configs as mappings,
  tuples as lists);
* :func:`write_config` writes the YAML file atomically, with a sha256 of its content in :func:`checksum`'s form;
* :func:`field_help` is each field's documentation, read from the class docstring's ``Attributes:`` section
  (the one text the API reference and ``--help`` both show).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import inspect
import json
import os
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from clusterlm.fileio import atomic_write_text

__all__ = ["check_keys", "checksum", "field_help", "field_value", "from_dict", "read_config_file",
           "to_dict", "write_config"]

T = TypeVar("T")
_ATTR = re.compile(r"^(?P<names>[a-z_][a-z0-9_]*(?:\s*/\s*[a-z_][a-z0-9_]*)*):\s*(?P<text>.*)$")


def field_help(cls: type) -> dict[str, str]:
    """``{field: help}`` from the ``Attributes:`` section of ``cls``'s docstring (Google style).

    A line ``name: text`` (or ``a / b: text`` for several fields) starts an entry; deeper-indented lines continue it.
    """
    doc = inspect.getdoc(cls) or ""
    out: dict[str, str] = {}
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return out
    current: list[str] = []
    indent = None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent:
            break
        m = _ATTR.match(line.strip()) if depth == indent else None
        if m:
            current = [n.strip() for n in m["names"].split("/")]
            for name in current:
                out[name] = m["text"].strip()
        elif current:
            for name in current:
                out[name] += " " + line.strip()
    return out


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def to_dict(obj: Any) -> Any:
    """Plain data of a config object: nested dataclasses as dicts, tuples as lists, paths as strings."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {str(k): to_dict(v) for k, v in obj.items()}
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return obj


def check_keys(data: Mapping[str, Any], cls: type, where: str) -> None:
    """Refuse keys of ``data`` that are not fields of ``cls``.

    Raises:
        ValueError: one line naming the unknown key, the closest field and ``where`` (the file).
    """
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key).replace("-", "_"), names, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else f"; the fields are: {', '.join(names)}"
            raise ValueError(f"{where}: unknown setting {key!r} for {cls.__name__}{hint}")


def from_dict(cls: type[T], data: Mapping[str, Any], where: str = "config") -> T:
    """``cls(**data)`` with nested config fields built from mappings and lists made tuples where the field is one.

    Raises:
        ValueError: an unknown key (:func:`check_keys`).
    """
    check_keys(data, cls, where)
    hints = _hints(cls)
    kwargs = {}
    for key, value in data.items():
        kind = hints[key]
        if dataclasses.is_dataclass(kind) and isinstance(value, Mapping):
            value = from_dict(kind, value, f"{where} ({key})")
        kwargs[key] = field_value(kind, value)
    return cls(**kwargs)


def field_value(hint: Any, value: Any) -> Any:
    """A file's value for a field annotated ``hint``: YAML and JSON have lists, a tuple field keeps a tuple (the
    config stays frozen and comparable)."""
    return tuple(value) if isinstance(value, list) and "tuple" in str(hint) else value


def _duplicate_key(path: str | os.PathLike, key: Any, line: int | None = None) -> ValueError:
    where = f" (line {line})" if line else ""
    return ValueError(f"--config {path}: the key {key!r} is written twice{where}; a setting is given once (keep the "
                      "value you mean and delete the other).")


def _unique_json(pairs: list[tuple[str, Any]], path: str | os.PathLike) -> dict[str, Any]:
    """A JSON object's pairs as a dict, refusing a key written twice (json keeps the last one silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _duplicate_key(path, key)
        out[key] = value
    return out


def _load_yaml(text: str, path: str | os.PathLike) -> Any:
    """``yaml.safe_load`` that refuses a mapping key written twice (PyYAML keeps the last one silently), naming
    the key and its second line."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, (str, int, float, bool)) or key is None:
                    if key in seen:
                        raise _duplicate_key(path, key, key_node.start_mark.line + 1)
                    seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """The mapping in a ``.yaml`` / ``.yml`` / ``.json`` file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not YAML/JSON, unreadable, not a mapping at the top, or a key written twice (named, with its
            line in a YAML file).
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"--config {path}: no such file.")
    text = p.read_text(encoding="utf-8")
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(text, object_pairs_hook=lambda pairs: _unique_json(pairs, path))
        elif p.suffix.lower() in (".yaml", ".yml"):
            data = _load_yaml(text, path)
        else:
            raise ValueError(f"--config {path}: expected a .yaml, .yml or .json file, got {p.suffix or 'no suffix'!r}.")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {path}: not valid JSON ({e}).") from None
    except Exception as e:  # yaml.YAMLError without importing yaml at module level
        if type(e).__module__.startswith("yaml"):
            raise ValueError(f"--config {path}: not valid YAML ({' '.join(str(e).split())}).") from None
        raise
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of setting: value at the top, got "
                         f"{type(data).__name__}.")
    return data


def checksum(text: str) -> str:
    """sha256 hex digest of a config file's text (what a rank checks before it trusts the file)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def write_config(obj: Any, path: str | os.PathLike, *, header: str = "") -> str:
    """Write ``obj`` (a config dataclass or its plain data) as YAML to ``path`` atomically; returns the sha256 of
    the text written.

    Raises:
        StorageError: the disk is full (from :func:`clusterlm.fileio.atomic_write_text`).
    """
    import yaml

    body = yaml.safe_dump(to_dict(obj), sort_keys=False, default_flow_style=None)
    text = "".join(f"# {line}\n" for line in header.splitlines()) + body
    atomic_write_text(Path(path), text)
    return checksum(text)
