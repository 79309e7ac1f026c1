"""The run's metrics rows in its blob store: one object per row, a rewrite replaces, a bad row costs only itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.blob import open_store
from runtime.metrics_log import metrics_key, numbered, read_metrics, read_run_metrics, write_metrics
from runtime.rundir import RunInfo


async def test_rows_are_read_back_by_kind_then_number(tmp_path: Path) -> None:
    async with open_store((tmp_path / "blobs").as_uri()) as store:
        for version in (10, 2, 1):
            await write_metrics(store, "train", numbered(version), {"version": version})
        await write_metrics(store, "eval", numbered(2), {"version": 2})
        assert [(r["kind"], r["version"]) for r in await read_metrics(store)] == [
            ("eval", 2), ("train", 1), ("train", 2), ("train", 10)]
        assert [r["version"] for r in await read_metrics(store, kind="eval")] == [2]


async def test_a_row_written_again_replaces_itself(tmp_path: Path) -> None:
    """A restarted trainer that repeats a step (or recovers its pending row) never counts it twice."""
    async with open_store((tmp_path / "blobs").as_uri()) as store:
        await write_metrics(store, "train", numbered(3), {"version": 3, "loss": 1.0})
        await write_metrics(store, "train", numbered(3), {"version": 3, "loss": 0.5})
        assert await read_metrics(store, kind="train") == [{"kind": "train", "version": 3, "loss": 0.5}]


async def test_an_unreadable_row_costs_only_itself(tmp_path: Path) -> None:
    async with open_store((tmp_path / "blobs").as_uri()) as store:
        await write_metrics(store, "eval", numbered(1), {"version": 1})
        await store.put(metrics_key("eval", numbered(2)), b'{"kind": "eval", "vers')
        await store.put(metrics_key("eval", numbered(3)), b"[1, 2]")
        assert [r["version"] for r in await read_metrics(store, kind="eval")] == [1]


@pytest.mark.parametrize(("kind", "name"), [("train/x", "v1"), ("train", "../v1"), ("", "v1"), ("eval", "..")])
def test_names_that_would_escape_their_folder_are_refused(kind: str, name: str) -> None:
    with pytest.raises(ValueError, match="must be letters"):
        metrics_key(kind, name)


async def test_a_run_directory_from_before_stored_rows_is_read_from_its_file(tmp_path: Path) -> None:
    RunInfo(str(tmp_path), "nats://127.0.0.1:1", (tmp_path / "blobs").as_uri(), "", 0, 0.0).write()
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "version": 1}\n{"kind": "eval", "version": 1}\n{"ki')
    assert await read_run_metrics(tmp_path, kind="eval") == [{"kind": "eval", "version": 1}]
    async with open_store((tmp_path / "blobs").as_uri()) as store:
        await write_metrics(store, "train", numbered(2), {"version": 2})
    assert await read_run_metrics(tmp_path) == [{"kind": "train", "version": 2}], "the store, once it has rows"
