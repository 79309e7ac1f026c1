"""A run's metrics: rows of a ``kind`` ("train", "eval") in the run's blob store, one object per row.

A row is stored as ``metrics/<kind>/<name>.json``, where its writer names it (the trainer and the
evaluator: by policy version, ``v<10 digits>``). Whoever writes them, on whatever machine, the rows
land in one place; a row written again (a restarted writer repeating its step) replaces itself and is
never counted twice; a writer killed mid-write leaves nothing (every store's put is atomic). The
evaluator reads back which versions it evaluated, ``ops.plot`` draws the learning curves.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

from runtime.blob import BlobNotFound, BlobStore, open_store
from runtime.gather import gather_or_cancel
from runtime.rundir import RunInfo

__all__ = ["METRICS_PREFIX", "metrics_key", "numbered", "read_metrics", "read_run_metrics", "write_metrics"]

METRICS_PREFIX = "metrics/"
LEGACY_FILE = "metrics.jsonl"  # where a run directory kept its rows before they were stored (read, never written)
READ_CONCURRENCY = 16  # rows fetched at once (one request each on S3)
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


def numbered(n: int) -> str:
    """A row name that sorts as its number does (``v0000000042``): rows of a step or a version."""
    return f"v{n:010d}"


def metrics_key(kind: str, name: str) -> str:
    """The store key of row ``name`` of ``kind``.

    Raises:
        ValueError: the kind or the name is not made of letters, digits, '-', '_' or '.'.
    """
    for what, value in (("kind", kind), ("name", name)):
        if not _NAME_RE.match(value) or value in (".", ".."):
            raise ValueError(f"metrics {what} {value!r} must be letters, digits, '-', '_' or '.'")
    return f"{METRICS_PREFIX}{kind}/{name}.json"


async def write_metrics(store: BlobStore, kind: str, name: str, row: dict[str, Any]) -> None:
    """Stores ``row`` (with its ``kind``) as row ``name`` of ``kind``, replacing a row of that name."""
    await store.put(metrics_key(kind, name), json.dumps({**row, "kind": kind}).encode())


async def read_metrics(store: BlobStore, *, kind: str | None = None) -> list[dict[str, Any]]:
    """The rows of ``kind`` (every kind if None), by kind then by name. A row deleted or unreadable
    while it is read is left out (the rows are the run's record, not its state: nothing waits on one)."""
    keys = await store.list(METRICS_PREFIX + (f"{kind}/" if kind else ""))
    limit = asyncio.Semaphore(READ_CONCURRENCY)

    async def one(key: str) -> dict[str, Any] | None:
        async with limit:
            try:
                row = json.loads(await store.get(key))
            except (BlobNotFound, ValueError):
                return None
        return row if isinstance(row, dict) else None

    rows = await gather_or_cancel(*(one(k) for k in keys if k.endswith(".json")))
    return [r for r in rows if r is not None]


async def read_run_metrics(run_dir: Path, *, kind: str | None = None) -> list[dict[str, Any]]:
    """The rows of the run whose directory (on this machine) is ``run_dir``, from the run's store.

    Raises:
        ConfigError: ``run_dir`` is not a run directory (it has no run.json).
    """
    info = RunInfo.read(run_dir)
    async with open_store(info.storage_url, s3_endpoint=info.s3_endpoint or None) as store:
        rows = await read_metrics(store, kind=kind)
    legacy = Path(run_dir) / LEGACY_FILE
    if not rows and legacy.is_file():  # a run from before the rows were stored
        rows = [r for line in legacy.read_text(encoding="utf-8").splitlines() if (r := _row(line)) is not None
                and (kind is None or r.get("kind") == kind)]
    return rows


def _row(line: str) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except ValueError:  # a line cut by a crash
        return None
    return row if isinstance(row, dict) else None
