"""Reading a source into columns (name -> list of values), before any tokenizer: files and data set objects.

:func:`read_source` reads a local ``.jsonl`` / ``.json`` (the standard library: an error names the file and the
1-based line) or ``.parquet`` file (``pyarrow``), a ``save_to_disk`` directory, a ``datasets.Dataset`` /
``DatasetDict``, an :class:`~clusterlm.data.SFTDataset` or a list of records; nothing touches the network.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from clusterlm.data.dataset import SFTDataset

__all__ = ["FILE_SUFFIXES", "read_columns", "read_source"]

FILE_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def read_source(source: Any, split: str | None) -> tuple[dict[str, list[Any]], str]:
    """Columns (name -> list of values) and a description of ``source``."""
    if isinstance(source, (str, os.PathLike)):
        return _read_file(Path(source).expanduser(), split)
    if isinstance(source, SFTDataset):  # re-truncate / re-check an existing data set
        return {"input_ids": [ex["input_ids"] for ex in source], "labels": [ex["labels"] for ex in source]}, (
            source.source
        )
    datasets_mod = sys.modules.get("datasets")  # a datasets object implies the module is already imported
    if datasets_mod is not None and isinstance(source, datasets_mod.DatasetDict):
        names = list(source.keys())
        if split is None and len(names) == 1:
            split = names[0]
        if split not in source:
            raise ValueError(
                f"load_data: split must name one of the DatasetDict's splits {names}, got split={split!r}."
            )
        return _dataset_columns(source[split]), f"datasets.DatasetDict[{split!r}]"
    if datasets_mod is not None and isinstance(source, datasets_mod.Dataset):
        return _dataset_columns(source), f"datasets.Dataset({source.num_rows} rows)"
    if isinstance(source, Sequence) and not isinstance(source, (bytes, Mapping)):
        return _records_columns(source), f"list of {len(source)} records"
    raise TypeError(
        "load_data: source must be a path to a .jsonl/.json/.parquet file, a list of dicts, a datasets.Dataset or "
        f"a list of tokenised examples, got {type(source).__name__}."
    )


def read_columns(source: Any, split: str | None = None) -> dict[str, list[Any]]:
    """The raw columns of ``source`` as :func:`load_data` reads them before tokenising (name -> list of values).

    Args:
        source: any source :func:`load_data` accepts (a file, a ``save_to_disk`` directory, a list of dicts, a
            ``datasets.Dataset`` / ``DatasetDict``, an :class:`SFTDataset`).
        split: the split of a ``DatasetDict`` (required when it has several).

    Raises:
        FileNotFoundError, ValueError, TypeError: as :func:`load_data` for the same source.
    """
    return read_source(source, split)[0]


# Files that Dataset.save_to_disk / DatasetDict.save_to_disk write into their directory.
_SAVED_DATASET_FILES = ("dataset_dict.json", "state.json", "dataset_info.json")


def _read_saved_dataset(path: Path, split: str | None) -> tuple[dict[str, list[Any]], str]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as err:  # FileNotFoundError is an OSError
        raise ValueError(f"load_data: {str(path)!r} could not be read with datasets.load_from_disk: {err}") from err
    columns, description = read_source(ds, split)
    return columns, f"{path} ({description})"


def _read_file(path: Path, split: str | None) -> tuple[dict[str, list[Any]], str]:
    if not path.exists():
        raise FileNotFoundError(f"load_data: no such file {str(path)!r}; give the path of a local data file.")
    if path.is_dir() and any((path / name).is_file() for name in _SAVED_DATASET_FILES):
        return _read_saved_dataset(path, split)
    if not path.is_file():
        inside = sorted(p.name for p in path.iterdir() if p.suffix.lower() in FILE_SUFFIXES) if path.is_dir() else []
        held = f" (it holds {', '.join(inside[:5])}: pass one of them)" if inside else ""
        raise ValueError(
            f"load_data: {str(path)!r} is a directory but not one written by datasets' save_to_disk{held}; give the "
            "path of one data file or of a save_to_disk directory."
        )
    suffix = path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise ValueError(
            f"load_data: unknown file extension {suffix or '(none)'!r} of {str(path)!r}; accepted: "
            f"{', '.join(FILE_SUFFIXES)} (convert other formats, or pass a list of dicts)."
        )
    if FILE_SUFFIXES[suffix] == "parquet":
        return _read_parquet(path), str(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ValueError(f"load_data: cannot read {str(path)!r}: {err.strerror or err}.") from err
    lines = _text_lines(path, raw)
    if not any(line.strip() for line in lines):
        what = "the file is empty" if not raw.strip(b"\xef\xbb\xbf") else "it has only blank lines"
        raise ValueError(f"load_data: {str(path)} holds no examples: {what}. Give a file with one record per line.")
    records = _json_document(path, lines) if suffix == ".json" else None
    if records is None:  # .jsonl, or JSON Lines in a .json file (as datasets reads them)
        first = next(line for line in lines if line.strip())
        if suffix == ".jsonl" and first.strip() in ("[", "{"):
            raise ValueError(
                f"load_data: {str(path)} holds one JSON document over several lines, not JSON Lines (one record per "
                "line); rename it to .json, or write each record on a line of its own."
            )
        records = [_json_record(path, line, number) for number, line in enumerate(lines, 1) if line.strip()]
    return _records_columns(records), str(path)


def _text_lines(path: Path, raw: bytes) -> list[str]:
    """The lines of a UTF-8 file (a BOM and CRLF line ends allowed); a non-UTF-8 byte is named by its line."""
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ValueError(
            f"load_data: {str(path)} is UTF-16 text (as a Windows shell writes with >); save it as UTF-8, e.g. "
            "iconv -f utf-16 -t utf-8."
        )
    body = raw[3:] if raw.startswith(b"\xef\xbb\xbf") else raw
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        line = body.count(b"\n", 0, err.start) + 1
        column = err.start - (body.rfind(b"\n", 0, err.start) + 1) + 1
        raise ValueError(
            f"load_data: {str(path)}, line {line}: not UTF-8 text (byte 0x{body[err.start]:02x} at column {column}); "
            "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)."
        ) from None
    return [line.removesuffix("\r") for line in text.split("\n")]


_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


def _json_record(path: Path, line: str, number: int) -> dict[str, Any]:
    """One line of a JSON Lines file: a JSON object, else a one-line error naming the file and the line."""
    try:
        value = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"load_data: {str(path)}, line {number}: invalid JSON: {err.msg} (column {err.colno}); every line of a "
            "JSON Lines file must be one complete JSON object."
        ) from None
    if not isinstance(value, dict):
        raise ValueError(
            f"load_data: {str(path)}, line {number}: {_JSON_KINDS.get(type(value), type(value).__name__)}, not a JSON "
            'object; every line must be one record such as {"prompt": ..., "response": ...}.'
        )
    return value


def _json_document(path: Path, lines: list[str]) -> list[dict[str, Any]] | None:
    """The records of a ``.json`` file: a list of objects (or one object); None when it holds JSON Lines."""
    try:
        value = json.loads("\n".join(lines))
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":  # several JSON values: JSON Lines
            return None
        raise ValueError(
            f"load_data: {str(path)}, line {err.lineno}: invalid JSON: {err.msg} (column {err.colno}); a .json file "
            "must hold a list of records (or JSON Lines: one record per line)."
        ) from None
    if isinstance(value, dict):
        return [value]
    if not isinstance(value, list):
        raise ValueError(
            f"load_data: {str(path)} holds {_JSON_KINDS.get(type(value), type(value).__name__)}, not a list of "
            "records; write a JSON array of objects, or one object per line (.jsonl)."
        )
    if not value:
        raise ValueError(f"load_data: {str(path)} holds no examples: the JSON array is empty.")
    bad = next((i for i, v in enumerate(value) if not isinstance(v, dict)), None)
    if bad is not None:
        raise ValueError(
            f"load_data: {str(path)}: element {bad} of the array is "
            f"{_JSON_KINDS.get(type(value[bad]), type(value[bad]).__name__)}, not an object; every element must be "
            'one record such as {"prompt": ..., "response": ...}.'
        )
    return value


def _read_parquet(path: Path) -> dict[str, list[Any]]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(str(path)).to_pydict()
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"load_data: {str(path)} could not be read as Parquet: {' '.join(str(err).split())}") from err


def _dataset_columns(ds: Any) -> dict[str, list[Any]]:
    # Plain lists (``ds[name]`` is a lazy Column in datasets >= 4 that would outlive the temporary cache).
    return {name: list(values) for name, values in ds.to_dict().items()}


def _records_columns(records: Sequence[Any]) -> dict[str, list[Any]]:
    if not records:
        return {}
    names: dict[str, None] = {}  # union of the keys, in first-seen order
    for i, record in enumerate(records):
        if not isinstance(record, Mapping):
            raise TypeError(f"load_data: records must be dicts, got {type(record).__name__} at index {i}.")
        names.update(dict.fromkeys(record))
    # A key absent from a record reads as None: fine for Alpaca's optional 'input'; detect_format names the
    # first record lacking a required column.
    return {name: [record.get(name) for record in records] for name in names}
