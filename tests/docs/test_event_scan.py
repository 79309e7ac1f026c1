"""The event scan of ops.docs.event_reference: what counts as an emitted event, and what it refuses to guess."""

from __future__ import annotations

import ast
import textwrap

import pytest

from ops.docs.event_reference import Emit, UnreadableEvent, render, scan_module

MODULE = textwrap.dedent('''
    import structlog

    log = structlog.get_logger(__name__)


    class Watcher:
        def __init__(self, run):
            self._log = log.bind(run=run)

        def ok(self, extra):
            self._log.info("watch_started", subject="a.b")
            log.exception("watch_failed", **extra)
            log.warning("watch_slow", exc_info=True, kind="x")
            parser.error("not an event: parser is no logger")

        def _follow(self, cursor, gap_event="gap_default"):
            log.warning(gap_event, cursor=cursor)

        def follow(self):
            self._follow(1, "kv_gap")
            self._follow(cursor=2, gap_event="stream_gap")
''')


def scan(source: str) -> list[Emit]:
    tree = ast.parse(source)
    return scan_module(tree, "pkg.mod", {"log", "self._log"})


def test_events_levels_and_fields_are_read_from_the_calls() -> None:
    found = {(e.event, e.level, e.fields) for e in scan(MODULE)}
    assert found == {
        ("watch_started", "info", ("run", "subject")),  # the bound field too
        ("watch_failed", "error", ("**extra", "exception")),  # exception(): error, with the traceback
        ("watch_slow", "warning", ("exception",)),  # kind is on every line: not listed
        ("gap_default", "warning", ("cursor",)),
        ("kv_gap", "warning", ("cursor",)),
        ("stream_gap", "warning", ("cursor",)),
    }


@pytest.mark.parametrize("name", ['f"gap_{kind}"', "EVENTS[0]", "event"])
def test_an_event_name_the_scan_cannot_read_is_an_error_naming_the_line(name: str) -> None:
    source = f"import structlog\nlog = structlog.get_logger()\n\ndef f(event):\n    log.info({name})\n\nf(make())\n"
    with pytest.raises(UnreadableEvent, match=r"pkg\.mod:5"):
        scan(source)


def test_the_page_has_one_sorted_row_per_event_each_with_its_anchor() -> None:
    page = render([Emit("b_event", "info", "pkg.b", 3, ("x",)), Emit("a_event", "error", "pkg.a", 9, ()),
                   Emit("b_event", "warning", "pkg.a", 4, ("y",))])
    rows = [line for line in page.splitlines() if line.startswith('| <span id="')]
    assert rows == ['| <span id="a_event"></span>`a_event` | error | `pkg.a` |   |',
                    '| <span id="b_event"></span>`b_event` | info, warning | `pkg.a`, `pkg.b` | `x`, `y` |']
