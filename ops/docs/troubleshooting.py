"""The troubleshooting page's generated part: every event the code emits at level error or critical, what it
means and what to do about it, grouped by area.

The advice is written in ops/docs/troubleshooting.toml, one table per event (``area``, ``means``, ``do``, in the
order the page shows them within their area); which events are errors, their levels and the modules that emit
them come from the event scan (`ops.docs.event_reference`). tests/docs fails when an error event has no entry (a
new ``log.error(...)`` comes with its advice) and when an entry names an event the code no longer emits at error
level. An error event without an entry is still listed, under "Not explained yet", so the page never omits one.

In the advice, a code span that is an event's name becomes a link: to its section here if it is an error event,
else to its row in the event reference.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ops.docs import event_reference
from ops.docs.event_reference import SEVERITY, Emit, anchor
from ops.docs.markdown import code, escape

__all__ = ["ADVICE_FILE", "AREAS", "PAGE", "REGION", "SEVERE", "Advice", "Coverage", "coverage", "load", "render",
           "severe_events"]

ADVICE_FILE = Path(__file__).with_name("troubleshooting.toml")
PAGE = "troubleshooting.md"  # the region's home
REGION = "error events"  # <!-- generated: error events -->
SEVERE = ("error", "critical")  # the levels whose events the page explains
AREAS = {  # an entry's area -> its section's heading, in the page's order
    "supervision": "Actors and supervision",
    "bus": "The bus",
    "reconciler": "The reconciler and its slot table",
    "trainer": "The trainer",
    "weights": "Weights and engines (rollout, evaluation)",
    "sandbox": "The sandbox",
    "run": "Starting and ending a run",
}
UNEXPLAINED = "Not explained yet"  # the section of error events without an entry
FIELDS = ("area", "means", "do")
_CODE_SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")


@dataclass(frozen=True)
class Advice:
    """One error event explained: ``means`` (what happened, in an operator's words) and ``do`` (what to do)."""

    event: str
    area: str
    means: str
    do: str


@dataclass(frozen=True)
class Coverage:
    """How the advice matches the events the code emits at error level."""

    missing: list[str]  # error events without an entry
    not_emitted: list[str]  # entries for events the code does not emit at all (removed or renamed)
    not_severe: list[str]  # entries for events the code emits only below error (lowered)


def load(path: Path = ADVICE_FILE) -> dict[str, Advice]:
    """Event name -> its advice, in the file's order.

    Raises:
        ValueError: an entry lacks a field or has another, names no known area, or has empty text.
    """
    with path.open("rb") as f:
        tables = tomllib.load(f)
    advice = {}
    for event, entry in tables.items():
        where = f"{path.name}: [{event}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} is not a table: each event is a table with {', '.join(FIELDS)}")
        if sorted(entry) != sorted(FIELDS):
            raise ValueError(f"{where} has fields {sorted(entry)}; expected exactly {list(FIELDS)}")
        if entry["area"] not in AREAS:
            raise ValueError(f"{where}: area {entry['area']!r} is none of {list(AREAS)}")
        for field in ("means", "do"):
            if not isinstance(entry[field], str) or not entry[field].strip():
                raise ValueError(f"{where}: {field} must be text, not empty")
        advice[event] = Advice(event, entry["area"], entry["means"], entry["do"])
    return advice


def severe_events(found: list[Emit]) -> dict[str, list[Emit]]:
    """Each event that some call emits at error or critical level -> every call that emits it (any level)."""
    by_event: dict[str, list[Emit]] = defaultdict(list)
    for emit in found:
        by_event[emit.event].append(emit)
    return {event: sites for event, sites in sorted(by_event.items()) if any(e.level in SEVERE for e in sites)}


def coverage(advice: Mapping[str, Advice], found: list[Emit]) -> Coverage:
    severe = severe_events(found)
    emitted = {e.event for e in found}
    return Coverage(missing=sorted(set(severe) - set(advice)),
                    not_emitted=sorted(set(advice) - emitted),
                    not_severe=sorted((set(advice) & emitted) - set(severe)))


def render(page: str = PAGE, found: list[Emit] | None = None, advice: Mapping[str, Advice] | None = None) -> str:
    """The region's text for the page at ``page`` (relative to docs/: its links are relative to it)."""
    found = event_reference.emits() if found is None else found
    advice = load() if advice is None else advice
    severe = severe_events(found)
    emitted = {e.event for e in found}
    reference = os.path.relpath(event_reference.PAGE, os.path.dirname(page) or ".")
    config = os.path.relpath("reference/configuration.md", os.path.dirname(page) or ".")

    def link(event: str) -> str:
        return f"#{anchor(event)}" if event in severe else f"{reference}#{anchor(event)}"

    def prose(text: str) -> str:
        return _CODE_SPAN.sub(lambda m: f"[{m.group(0)}]({link(m.group(1))})" if m.group(1) in emitted
                              else m.group(0), escape(text))

    out = [
        f"Every event the code emits at level error or critical: {len(severe)} events, by area. Each says what "
        "happened and what to do; its fields (and every other event) are in the "
        f"[event reference]({reference}). To follow one: `python -m ops.tail RUN_DIR --event NAME` (`--files` "
        "once the run's bus is gone). A key marked live in the "
        f"[configuration reference]({config}) changes while the run goes on (`python -m ops.config set KEY "
        "VALUE`); the others on a resumed run (`python -m actors --resume RUN_DIR --set KEY=VALUE`). "
        "`RUN_DIR/logs/` holds each actor's events (`<actor id>.jsonl`) and its output (`<actor id>.out`).\n",
        "<!-- The advice is ops/docs/troubleshooting.toml: edit it there, then run python -m ops.docs. -->\n",
    ]
    sections: dict[str, list[str]] = {area: [] for area in (*AREAS, UNEXPLAINED)}
    for event, entry in advice.items():
        if event in severe:
            sections[entry.area].append(event)
    sections[UNEXPLAINED] = [event for event in severe if event not in advice]
    for area, events in sections.items():
        if not events:
            continue
        out.append(f"## {AREAS.get(area, area)}\n")
        for event in events:
            sites = severe[event]
            levels = sorted({e.level for e in sites}, key=SEVERITY.index)
            modules = sorted({e.module for e in sites})
            out.append(f"### {code(event)} {{ #{anchor(event)} }}\n")
            out.append(f"{', '.join(levels)} · {', '.join(code(m) for m in modules)} · "
                       f"[fields]({reference}#{anchor(event)})\n")
            entry = advice.get(event)
            if entry is None:
                out.append(f"No advice yet: add a `[{event}]` table to `ops/docs/troubleshooting.toml`.\n")
                continue
            out.append(f"**What it means.** {prose(entry.means)}\n")
            out.append(f"**What to do.** {prose(entry.do)}\n")
    return "\n".join(out)
