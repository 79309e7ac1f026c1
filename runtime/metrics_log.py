"""A run's ``metrics.jsonl``: one JSON object per line, each with a ``kind`` ("train", "eval").

The trainer and the evaluator append rows; the evaluator reads back which versions it evaluated
(so a restarted evaluator does not repeat them) and ``ops.plot`` draws learning curves. A line cut
short by a crash is skipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["append_metrics", "read_metrics"]


def append_metrics(path: Path, row: dict[str, Any]) -> None:
    """One JSON line; a line a killed writer left unfinished is ended first, so it loses only itself."""
    with open(path, "a+b") as fh:
        fh.seek(0, 2)
        cut = fh.tell() > 0 and (fh.seek(-1, 2), fh.read(1))[1] != b"\n"
        fh.write(("\n" if cut else "").encode() + json.dumps(row).encode() + b"\n")


def read_metrics(path: Path, *, kind: str | None = None, missing_ok: bool = True) -> list[dict[str, Any]]:
    """The rows of the metrics file at ``path`` (only those of ``kind`` if given), in file order.

    Raises:
        FileNotFoundError: the file does not exist and ``missing_ok`` is false.
    """
    path = Path(path)
    if not path.exists():
        if missing_ok:
            return []
        raise FileNotFoundError(f"{path} does not exist: is {path.parent} a run directory with metrics?")
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if isinstance(row, dict) and (kind is None or row.get("kind") == kind):
            rows.append(row)
    return rows
