"""The performance tables of ops.docs.measurements, and the regions of ops.docs.pages that hold them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ops.docs.measurements import Measurement, render
from ops.docs.pages import PERFORMANCE_PAGE, generate, region_names


def test_provenance_the_file_lacks_is_said_not_recorded() -> None:
    text = render(Measurement("bare", {"tokens_per_s": 12.5}), "performance.md")
    for key in ("command", "commit", "date", "machine"):
        assert f"| {key} | not recorded |" in text
    assert "| `tokens_per_s` | 12.5 |" in text
    assert "[measurements/bare.json](measurements/bare.json)" in text


def test_the_link_to_the_file_is_relative_to_the_page() -> None:
    assert "(../measurements/x.json)" in render(Measurement("x", {}), "reference/x.md")


def test_records_become_rows_and_a_long_series_a_summary() -> None:
    data = {"bench": "b", "runs": [{"commit": "abc", "rate": 1.0}, {"commit": "def", "rate": 2.0, "note": "n"}],
            "curve": {"0": [{"step": i, "loss": 10.0 - i} for i in range(20)]},
            "per_seed": {"0": {"on": {"pass": 0.5}, "off": {"pass": 0.25}}}}
    text = render(Measurement("m", data), "performance.md")
    assert "| commit | per record of `runs`: abc, def |" in text
    assert "| 1 | def | 2 | n |" in text
    assert "`curve.0`: 20 records" in text
    assert "| `loss` | 20 | 10 | -9 | -9 | 0.5 | 10 |" in text
    assert "| `0` | `off` | 0.25 |" in text


def write_docs(docs: Path, page: str) -> None:
    (docs / "measurements").mkdir(parents=True)
    (docs / "measurements" / "one.json").write_text(json.dumps({"bench": "one", "rate": 3}))
    (docs / PERFORMANCE_PAGE).parent.mkdir(parents=True, exist_ok=True)
    (docs / PERFORMANCE_PAGE).write_text(page)


def test_a_new_measurement_makes_the_check_fail_until_written_then_it_passes(tmp_path: Path) -> None:
    write_docs(tmp_path, "# Performance\n\nProse.\n")
    assert generate(tmp_path, check=True, whole_pages={}, regions={}).stale != []
    assert (tmp_path / PERFORMANCE_PAGE).read_text() == "# Performance\n\nProse.\n"  # the check writes nothing
    generate(tmp_path, whole_pages={}, regions={})
    text = (tmp_path / PERFORMANCE_PAGE).read_text()
    assert region_names(text) == ["measurement one"] and text.startswith("# Performance\n\nProse.\n")
    assert generate(tmp_path, check=True, whole_pages={}, regions={}).stale == []
    # A region moved to another page, with prose around it, stays there and stays current
    (tmp_path / "other.md").write_text(f"Before.\n\n{text.split('Prose.')[1].strip()}\n\nAfter.\n")
    (tmp_path / PERFORMANCE_PAGE).write_text("# Performance\n")
    (tmp_path / "measurements" / "one.json").write_text(json.dumps({"bench": "one", "rate": 4}))
    assert generate(tmp_path, check=True, whole_pages={}, regions={}).stale == [
        "other.md: a generated region differs from what its generator writes"]
    generate(tmp_path, whole_pages={}, regions={})
    assert "| `rate` | 4 |" in (tmp_path / "other.md").read_text()
    assert (tmp_path / PERFORMANCE_PAGE).read_text() == "# Performance\n"


def test_a_region_naming_no_measurement_is_an_error(tmp_path: Path) -> None:
    write_docs(tmp_path, "<!-- generated: measurement gone -->\n\nold\n\n<!-- end generated: measurement gone -->\n")
    with pytest.raises(ValueError, match="measurement gone"):
        generate(tmp_path, check=True, whole_pages={}, regions={})


def test_a_whole_page_is_compared_and_written(tmp_path: Path) -> None:
    write_docs(tmp_path, "")
    generate(tmp_path, whole_pages={}, regions={})
    pages = {"reference/x.md": lambda: "# X\n"}
    assert generate(tmp_path, check=True, whole_pages=pages, regions={}).stale == [
        "reference/x.md: differs from what its generator writes"]
    generate(tmp_path, whole_pages=pages, regions={})
    assert (tmp_path / "reference" / "x.md").read_text() == "# X\n"
    assert generate(tmp_path, check=True, whole_pages=pages, regions={}).stale == []
