"""docs/ARCHITECTURE.md stays true: the sections the code cites exist, and the names it lists are the code's."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from actors import SlotState
from runtime.bus import KV_BUCKETS, Bus, WorkMessage

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "ARCHITECTURE.md"
CITATION = re.compile(r"docs/ARCHITECTURE\.md,?\s*\(?((?:\"[^\"]+\"(?:,\s*|\s*and\s*)?)+)")


def sections() -> dict[str, str]:
    parts = re.split(r"^## (.+)$", DOC.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def test_every_section_the_code_cites_exists() -> None:
    titles = set(sections())
    cited = {}
    for package in ("runtime", "actors", "ops", "model", "low_precision", "sandbox", "tests"):
        for path in (REPO / package).rglob("*.py"):
            for match in CITATION.finditer(path.read_text(encoding="utf-8")):
                for name in re.findall(r"\"([^\"]+)\"", match.group(1)):
                    cited.setdefault(name, str(path.relative_to(REPO)))
    assert cited, "no citation found: the pattern no longer matches how the code cites the document"
    assert {name: where for name, where in cited.items() if name not in titles} == {}


def test_the_buckets_and_states_it_lists_are_the_codes() -> None:
    doc = sections()
    for bucket in KV_BUCKETS:
        assert f"- `{bucket}`:" in doc["Buckets"], bucket
    diagram = doc["Lifecycle states"]
    for state in SlotState:
        assert state.name in diagram, state


def test_the_bus_api_it_lists_is_the_bus() -> None:
    """Every coroutine of Bus is listed (connect, close and the raw bucket handle are plumbing), and every
    method named there exists (on Bus, or on the WorkMessage it hands out)."""
    listed = set(re.findall(r"`(\w+)(?:\(\w*\))?`", sections()["Bus API"]))
    coroutines = {name for name, fn in inspect.getmembers(Bus) if not name.startswith("_")
                  and (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn))}
    assert sorted(coroutines - listed - {"connect", "close", "kv", "ensure_base"}) == []
    named_methods = {name for name in listed if name.islower()}
    assert sorted(n for n in named_methods if not hasattr(Bus, n) and not hasattr(WorkMessage, n)) == []
