"""The performance tables: one section per measurement kept in docs/measurements/*.json.

A kept measurement is one JSON document: a bench's result line (``python -m tests.bench.NAME`` prints one)
or a merged result, ideally with the ``command`` that made it, the ``commit`` it ran at, its ``date`` and the
``machine``. Its section says that provenance ("not recorded" where the file does not say it) and shows its
figures by the shape of the data, not by bench, so a new file needs no code:

- numbers, short strings and nested tables of them: a two-column table of figures (dotted keys);
- a list of records (``runs``): a table, one row per record; a long one (a training curve) as a summary of
  each numeric column (first, last, min, median, max);
- a table of records (``per_seed``: seed -> mode -> figures): a table, one row per record, keyed by its path;
- a table of lists of records (``train_by_seed``): one summary per list;
- long strings (settings, notes): a list below the figures.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ops.docs.markdown import code, escape, table

__all__ = ["MEASUREMENTS_DIR", "Measurement", "load", "render"]

MEASUREMENTS_DIR = "measurements"  # under docs/
PROVENANCE = ("command", "commit", "date", "machine")
DESCRIPTION = ("what", "label")  # said in prose above the figures
NOT_RECORDED = "not recorded"
LONG_TEXT = 80  # characters: a longer string is a note below the table, not a cell
SERIES = 12  # rows: a longer list of records is summarised per column
TRANSPOSE_COLUMNS = 6  # a table of at most TRANSPOSE_ROWS records with more columns than this is shown turned
TRANSPOSE_ROWS = 4


@dataclass(frozen=True)
class Measurement:
    """One kept measurement: its name (the file's stem) and its data."""

    name: str
    data: dict[str, Any]


def load(docs: Path) -> list[Measurement]:
    """Every kept measurement under ``docs``, by name.

    Raises:
        ValueError: a file is not one JSON object.
    """
    found = []
    for path in sorted((docs / MEASUREMENTS_DIR).glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a measurement is one JSON object, found {type(data).__name__}")
        found.append(Measurement(path.stem, data))
    return found


def render(measurement: Measurement, page: str) -> str:
    """The measurement's section, for the page at ``page`` (relative to docs/: the link to the file is relative)."""
    data = measurement.data
    link = os.path.relpath(f"{MEASUREMENTS_DIR}/{measurement.name}.json", os.path.dirname(page) or ".")
    out = [f"### {measurement.name}\n"]
    out += [f"{escape(str(data[k]))}\n" for k in DESCRIPTION if isinstance(data.get(k), str)]
    provenance = [["bench", code(str(data["bench"]))]] if "bench" in data else []
    provenance += [[k, _provenance(data, k)] for k in PROVENANCE]
    provenance.append(["data", f"[{MEASUREMENTS_DIR}/{measurement.name}.json]({link})"])
    out.append(table(["provenance", ""], provenance))
    body = {k: v for k, v in data.items() if k not in (*PROVENANCE, *DESCRIPTION, "bench")}
    figures: list[list[str]] = []
    notes: list[str] = []
    blocks: list[str] = []
    _collect(body, "", figures, notes, blocks)
    if figures:
        out.append(table(["figure", "value"], figures))
    out += blocks
    if notes:
        out.append("\n".join(notes) + "\n")
    return "\n".join(out)


def _provenance(data: dict[str, Any], key: str) -> str:
    if isinstance(data.get(key), str | int | float) and str(data[key]):
        text = str(data[key])
        return code(text) if key == "command" else escape(text)
    # A file that compares commits says each record's: runs[i].commit
    per_record = [(k, [str(r[key]) for r in v if isinstance(r, dict) and key in r]) for k, v in data.items()
                  if isinstance(v, list)]
    for where, values in per_record:
        if values:
            return f"per record of {code(where)}: " + ", ".join(escape(v) for v in values)
    return NOT_RECORDED


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _is_records(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _is_record_map(value: Any) -> bool:
    """A table whose every value is a table: a record, or again a table of them (seed -> mode -> figures)."""
    return isinstance(value, dict) and bool(value) and all(isinstance(v, dict) and v for v in value.values())


def _collect(tree: dict[str, Any], prefix: str, figures: list[list[str]], notes: list[str],
             blocks: list[str]) -> None:
    for key, value in tree.items():
        name = prefix + key
        if isinstance(value, str) and len(value) > LONG_TEXT:
            notes.append(f"- **{escape(name)}**: {escape(value)}")
        elif _is_scalar(value) or (isinstance(value, list) and all(_is_scalar(v) for v in value)):
            figures.append([code(name), escape(_text(value))])
        elif _is_records(value):
            blocks.append(_records_block(name, value))
        elif isinstance(value, dict) and value and all(_is_records(v) for v in value.values()):
            blocks += [_records_block(f"{name}.{k}", v) for k, v in value.items()]
        elif _is_record_map(value):
            blocks.append(_record_map_block(name, value))
        elif isinstance(value, dict):
            _collect(value, name + ".", figures, notes, blocks)
        else:  # a list mixing records and values: shown as JSON
            figures.append([code(name), code(json.dumps(value))])


def _records_block(name: str, records: list[dict[str, Any]]) -> str:
    if len(records) > SERIES:
        return _series_block(name, records)
    rows = [_flat(r) for r in records]
    return f"{code(name)}:\n\n" + _table_of(["#"], [[str(i)] for i in range(len(rows))], rows)


def _record_map_block(name: str, tree: dict[str, Any]) -> str:
    keyed = list(_record_rows(tree, ()))
    depth = max(len(path) for path, _ in keyed)
    header = [name.rsplit(".", 1)[-1], *(["" for _ in range(depth - 1)])]
    keys = [[*(code(p) for p in path), *["" for _ in range(depth - len(path))]] for path, _ in keyed]
    return f"{code(name)}:\n\n" + _table_of(header, keys, [row for _, row in keyed])


def _record_rows(tree: dict[str, Any], path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    """(key path, flattened record) of each record in a table of records, depth first in the file's order."""
    for key, value in tree.items():
        if _is_record_map(value):
            yield from _record_rows(value, (*path, key))
        else:
            yield (*path, key), _flat(value)


def _flat(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _table_of(key_header: list[str], keys: list[list[str]], rows: list[dict[str, Any]]) -> str:
    """Records as a table (a few records of many columns turned, one column per record)."""
    columns = list(dict.fromkeys(c for row in rows for c in row))
    if len(columns) > TRANSPOSE_COLUMNS and len(rows) <= TRANSPOSE_ROWS:
        header = ["", *(" / ".join(k for k in key if k) for key in keys)]
        return table(header, [[code(c), *(_cell(row, c) for row in rows)] for c in columns])
    return table([*key_header, *(code(c) for c in columns)],
                 [[*key, *(_cell(row, c) for c in columns)] for key, row in zip(keys, rows, strict=True)])


def _cell(row: dict[str, Any], column: str) -> str:
    return escape(_text(row[column])) if column in row else ""


def _series_block(name: str, records: list[dict[str, Any]]) -> str:
    """A long list of records (a training curve): each numeric column's first, last, min, median and max."""
    rows = [_flat(r) for r in records]
    columns = list(dict.fromkeys(c for row in rows for c in row))
    summary = []
    for column in columns:
        values = [row[column] for row in rows if column in row]
        numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        if len(numbers) != len(values):
            continue
        summary.append([code(column), str(len(numbers)), *(_text(v) for v in (
            numbers[0], numbers[-1], min(numbers), statistics.median(numbers), max(numbers)))])
    return (f"{code(name)}: {len(records)} records, each numeric field summarised:\n\n"
            + table(["field", "n", "first", "last", "min", "median", "max"], summary))


def _text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        text = format(value, ".6g")
        return f"{value:.1f}" if "e" in text and abs(value) >= 1 else text
    if isinstance(value, list):
        return ", ".join(_text(v) for v in value)
    return str(value)
