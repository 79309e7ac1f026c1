"""The troubleshooting page's advice (ops.docs.troubleshooting): every error event the code emits has an entry,
every entry an error event, the keys it names exist, and the region is rendered as the page shows it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from ops.docs import config_reference, troubleshooting
from ops.docs.event_reference import Emit, emits
from ops.docs.pages import DOCS, Region, generate, region_names
from ops.docs.troubleshooting import ADVICE_FILE, Advice, coverage, load, render

CODE_SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")
DOTTED = re.compile(r"(?P<name>[a-z_]+(?:\.[a-z0-9_<>]+)+)(?:\s*=.*)?")


@pytest.fixture(scope="module")
def found() -> list[Emit]:
    return emits()


def test_every_error_event_the_code_emits_has_advice(found: list[Emit]) -> None:
    missing = coverage(load(), found).missing
    assert missing == [], (f"error or critical events without advice: {missing}; add a table for each to "
                           f"{ADVICE_FILE.relative_to(ADVICE_FILE.parents[2])} (area, means, do), then run "
                           "python -m ops.docs")


def test_every_entry_names_an_event_the_code_emits_at_error_level(found: list[Emit]) -> None:
    result = coverage(load(), found)
    assert result.not_emitted == [], f"advice for events the code no longer emits (removed or renamed?): " \
                                     f"{result.not_emitted}"
    assert result.not_severe == [], f"advice for events the code emits only below error level: {result.not_severe}"


def test_the_dotted_names_the_advice_gives_are_keys_or_modules() -> None:
    """A code span such as `health.stuck_s` or `trainer.checkpoint_every = 1` names a configuration key (as the
    reference lists it, ``<kind>`` for an actor kind) or, like `runtime.bus`, a module: a typo is neither."""
    keys = config_reference.documented_keys((DOCS / config_reference.PAGE).read_text(encoding="utf-8"))
    sections = {key.split(".")[0] for key in keys}
    wrong = []
    for event, entry in load().items():
        for span in CODE_SPAN.findall(f"{entry.means} {entry.do}"):
            m = DOTTED.fullmatch(span)
            if m is None or m.group("name").split(".")[0] not in sections:
                continue
            name = m.group("name")
            if config_reference.page_key(name) not in keys and not _is_module(name):
                wrong.append(f"{event}: {name}")
    assert wrong == [], f"names in the advice that are no configuration key nor module: {wrong}"


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent that is no package
        return False


def emit(event: str, level: str, module: str = "pkg.mod") -> Emit:
    return Emit(event, level, module, 1, ())


FOUND = [emit("b_failed", "error"), emit("b_failed", "warning", "pkg.other"), emit("a_crashed", "critical"),
         emit("c_broken", "error"), emit("d_noted", "info"), emit("e_new", "error")]
ADVICE = {
    "c_broken": Advice("c_broken", "sandbox", "The `x.y` broke.", "See `a_crashed` and `d_noted`; `b_failed | 2`."),
    "b_failed": Advice("b_failed", "bus", "Failed.", "Nothing."),
    "a_crashed": Advice("a_crashed", "bus", "Crashed <here>.", "Restart."),
    "d_noted": Advice("d_noted", "bus", "Only info.", "Not shown."),
}


def test_events_are_grouped_by_area_in_the_advice_order_with_levels_links_and_the_unexplained_last() -> None:
    text = render("troubleshooting.md", FOUND, ADVICE)
    headings = [line for line in text.splitlines() if line.startswith("#")]
    assert headings == ["## The bus", "### `b_failed` { #b_failed }", "### `a_crashed` { #a_crashed }",
                        "## The sandbox", "### `c_broken` { #c_broken }",
                        f"## {troubleshooting.UNEXPLAINED}", "### `e_new` { #e_new }"]
    assert "3 events" not in text and "4 events" in text  # every error or critical one, explained or not
    assert "warning, error · `pkg.mod`, `pkg.other` · [fields](reference/events.md#b_failed)" in text
    assert "**What it means.** Crashed &lt;here&gt;." in text
    # an event's name links to its section here, or to the reference when it is no error event
    assert "See [`a_crashed`](#a_crashed) and [`d_noted`](reference/events.md#d_noted); `b_failed | 2`." in text
    assert "No advice yet: add a `[e_new]` table" in text
    assert "Only info." not in text


def test_links_are_relative_to_the_page_that_holds_the_region() -> None:
    text = render("guide/help.md", FOUND, ADVICE)
    assert "[fields](../reference/events.md#a_crashed)" in text
    assert "[`d_noted`](../reference/events.md#d_noted)" in text
    assert "(../reference/configuration.md)" in text


def test_coverage_names_missing_gone_and_lowered_entries() -> None:
    result = coverage({**ADVICE, "z_gone": Advice("z_gone", "bus", "m", "d")}, FOUND)
    assert (result.missing, result.not_emitted, result.not_severe) == (["e_new"], ["z_gone"], ["d_noted"])


@pytest.mark.parametrize(("entry", "error"), [
    ('area = "nowhere"\nmeans = "m"\ndo = "d"', "area 'nowhere'"),
    ('area = "bus"\nmeans = "m"', "expected exactly"),
    ('area = "bus"\nmeans = "m"\ndo = "d"\nsee = "x"', "expected exactly"),
    ('area = "bus"\nmeans = " "\ndo = "d"', "means must be text"),
])
def test_a_malformed_entry_is_refused_naming_it(tmp_path: Path, entry: str, error: str) -> None:
    path = tmp_path / "advice.toml"
    path.write_text(f"[ok_event]\narea = \"bus\"\nmeans = \"m\"\ndo = \"d\"\n\n[bad_event]\n{entry}\n")
    with pytest.raises(ValueError, match=rf"\[bad_event\].*{re.escape(error)}"):
        load(path)


def test_the_region_goes_to_its_home_page_until_a_page_holds_it(tmp_path: Path) -> None:
    (tmp_path / "troubleshooting.md").write_text("# Troubleshooting\n\nIntro.\n")
    regions = {troubleshooting.REGION: Region(troubleshooting.PAGE, lambda page: f"advice for {page}")}
    assert generate(tmp_path, check=True, whole_pages={}, regions=regions).stale == [
        "troubleshooting.md: no region for error events"]
    generate(tmp_path, whole_pages={}, regions=regions)
    text = (tmp_path / "troubleshooting.md").read_text()
    assert text.startswith("# Troubleshooting\n\nIntro.\n") and region_names(text) == ["error events"]
    assert "advice for troubleshooting.md" in text and text.endswith("-->\n")
    assert generate(tmp_path, check=True, whole_pages={}, regions=regions).stale == []
