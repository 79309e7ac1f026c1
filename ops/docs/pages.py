"""Which parts of the documentation site are generated, and writing or checking them.

Two kinds: whole pages (the configuration and event references), and regions of hand-written pages (one per
kept measurement, on the measurements page unless moved; the error events' advice, on the troubleshooting
page), between

    <!-- generated: NAME -->
    ...
    <!-- end generated: NAME -->

so prose can sit around them. A region found on no page gets one at the end of its home page (a measurement's:
docs/reference/measurements.md; the advice's: docs/troubleshooting.md) when the pages are written, and makes the check
fail until then.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ops.docs import config_reference, event_reference, measurements, troubleshooting

__all__ = ["DOCS", "PERFORMANCE_PAGE", "Outcome", "Region", "generate", "region_names"]

DOCS = Path(__file__).resolve().parents[2] / "docs"
PERFORMANCE_PAGE = "reference/measurements.md"  # where a measurement's region goes first
_REGION = re.compile(r"<!-- generated: (?P<name>[^>]+?) -->\n(?P<body>.*?)<!-- end generated: (?P=name) -->",
                     re.DOTALL)
_MEASUREMENT = "measurement "  # a region's name: "measurement lifecycle_bus_rules"


@dataclass(frozen=True)
class Region:
    """A generated region: the page it is added to when no page holds it, and its text for the page that does
    (relative to docs/: its links are relative to that page)."""

    home: str
    render: Callable[[str], str]


@dataclass(frozen=True)
class Outcome:
    """What generating found: the pages whose text differs from what they would be (written, unless checking)."""

    stale: list[str]  # paths relative to docs/, each with why


def region_names(text: str) -> list[str]:
    """The names of the generated regions in a page's text, in order."""
    return [m.group("name") for m in _REGION.finditer(text)]


def _whole_pages() -> dict[str, Callable[[], str]]:
    return {config_reference.PAGE: config_reference.render, event_reference.PAGE: event_reference.render}


def _named_regions() -> dict[str, Region]:
    return {troubleshooting.REGION: Region(troubleshooting.PAGE, troubleshooting.render)}


def generate(docs: Path = DOCS, *, check: bool = False,
             whole_pages: Mapping[str, Callable[[], str]] | None = None,
             regions: Mapping[str, Region] | None = None) -> Outcome:
    """Every generated page and region under ``docs``, written where it differs, or only compared (``check``).

    ``whole_pages``: page (relative to ``docs``) -> its generator; by default the configuration and event references.
    ``regions``: region name -> its generator, besides one per measurement under ``docs``; by default the
    troubleshooting page's advice on the error events.

    Raises:
        ValueError: a page has a region of no known name (a measurement file renamed or removed).
    """
    whole_pages = _whole_pages() if whole_pages is None else whole_pages
    stale: list[str] = []
    for page, render in whole_pages.items():
        path = docs / page
        text = render()
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            stale.append(f"{page}: differs from what its generator writes")
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
    fragments = dict(_named_regions() if regions is None else regions)
    fragments.update({f"{_MEASUREMENT}{m.name}": Region(PERFORMANCE_PAGE, functools.partial(measurements.render, m))
                      for m in measurements.load(docs)})
    placed: set[str] = set()
    generated = set(whole_pages)
    for path in sorted(docs.rglob("*.md")):
        page = path.relative_to(docs).as_posix()
        if page in generated:
            continue
        text = path.read_text(encoding="utf-8")
        unknown = sorted(set(region_names(text)) - set(fragments))
        if unknown:
            named = sorted(n for n in fragments if not n.startswith(_MEASUREMENT))
            raise ValueError(f"docs/{page}: generated regions {unknown} name no file under docs/"
                             f"{measurements.MEASUREMENTS_DIR}/ nor one of {named} (renamed or removed? remove "
                             "the region)")

        def body(match: re.Match[str], page: str = page) -> str:
            name = match.group("name")
            placed.add(name)
            return _region(name, fragments[name].render(page))

        new = _REGION.sub(body, text)
        if new != text:
            stale.append(f"{page}: a generated region differs from what its generator writes")
            if not check:
                path.write_text(new, encoding="utf-8")
    missing: dict[str, list[str]] = {}  # home page -> its regions that no page holds
    for name, region in fragments.items():
        if name not in placed:
            missing.setdefault(region.home, []).append(name)
    for home, names in missing.items():
        stale.append(f"{home}: no region for {', '.join(names)}")
        if not check:
            path = docs / home
            path.parent.mkdir(parents=True, exist_ok=True)
            text = path.read_text(encoding="utf-8") if path.is_file() else ""
            added = "".join("\n" + _region(name, fragments[name].render(home)) for name in names)
            path.write_text(text.rstrip("\n") + "\n" + added + "\n", encoding="utf-8")
    return Outcome(stale)


def _region(name: str, body: str) -> str:
    # Blank lines around the body: Markdown reads a comment line followed by text as one HTML block
    return f"<!-- generated: {name} -->\n\n{body.strip()}\n\n<!-- end generated: {name} -->"
