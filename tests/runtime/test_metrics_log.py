"""metrics.jsonl rows: a line a killed writer left unfinished costs only itself."""

from __future__ import annotations

from pathlib import Path

from runtime.metrics_log import append_metrics, read_metrics


def test_a_row_after_a_line_cut_by_a_kill_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    append_metrics(path, {"kind": "train", "version": 1})
    with open(path, "a", encoding="utf-8") as fh:
        fh.write('{"kind": "eval", "vers')  # the evaluator was killed mid-write
    append_metrics(path, {"kind": "train", "version": 2})
    append_metrics(path, {"kind": "eval", "version": 2})
    assert [(r["kind"], r["version"]) for r in read_metrics(path)] == [("train", 1), ("train", 2), ("eval", 2)]
