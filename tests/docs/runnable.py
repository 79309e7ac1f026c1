"""Blocks of the documentation marked runnable: an HTML comment on the line before a bash fence, which a rendered
page does not show::

    <!-- runnable -->              each command runs to completion, in order, and must succeed
    <!-- runnable: background -->  each command keeps running (a server, a run) until its test stops it
    <!-- runnable: environment --> the variables the other blocks use (``export NAME=VALUE``): a test gives them
                                   its own values (ports, directories) and runs nothing else of it

A page's runnable blocks are run as written by a test of their own (`RUN_BY`).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))  # the hand-written pages
RUN_BY = {  # page -> the test that runs it
    REPO / "README.md": "tests/integration/test_readme_tour.py",
    REPO / "docs" / "cluster.md": "tests/integration/test_cluster_guide.py",
}
MARK = re.compile(r"^<!-- runnable(?:: (?P<kind>[a-z]+))? -->$")
KINDS = ("environment", "run", "background")


@dataclass(frozen=True)
class Block:
    """A runnable block of a page: its kind (`KINDS`), its commands (continued lines joined, comments kept, blank
    and comment-only lines left out) and the line of the page its fence opens on."""

    kind: str
    commands: tuple[str, ...]
    line: int

    @property
    def script(self) -> str:
        return "\n".join(self.commands)

    def exported(self) -> dict[str, str]:
        """What an environment block's ``export NAME=VALUE ...`` lines set."""
        names: dict[str, str] = {}
        for command in self.commands:
            words = shlex.split(command, comments=True)
            assert words[0] == "export", f"line {self.line}: an environment block only exports: {command!r}"
            names.update(word.split("=", 1) for word in words[1:])
        return names


def runnable_blocks(page: Path) -> list[Block]:
    """Every block of ``page`` marked runnable: an HTML comment ``<!-- runnable -->`` (or ``<!-- runnable: KIND -->``)
    on the line before a ```` ```bash ```` fence, which a rendered page does not show.

    Raises:
        AssertionError: a mark of an unknown kind, or not right before a bash fence.
    """
    lines = page.read_text().splitlines()
    blocks = []
    for at, line in enumerate(lines):
        if (mark := MARK.match(line.strip())) is None:
            continue
        kind = mark["kind"] or "run"
        assert kind in KINDS, f"{page.name}:{at + 1}: runnable block of unknown kind {kind!r}; one of {KINDS}"
        assert lines[at + 1].strip() == "```bash", f"{page.name}:{at + 1}: the mark must come right before a bash fence"
        body = lines[at + 2:lines.index("```", at + 2)]
        commands, pending = [], ""
        for text in body:
            if not pending and (not text.strip() or text.lstrip().startswith("#")):
                continue
            if text.endswith("\\"):
                pending += text[:-1] + " "
                continue
            commands.append(pending + text)
            pending = ""
        blocks.append(Block(kind, tuple(commands), at + 2))
    return blocks
