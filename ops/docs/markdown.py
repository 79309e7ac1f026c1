"""Markdown the generated pages are written in: tables whose cells hold any text, and code spans.

Python-Markdown (what MkDocs renders with) reads a ``|`` inside a code span as text, but one outside as a
cell boundary, and ``<kind>`` outside a code span as an HTML tag that shows nothing: cell text is escaped
outside its code spans only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

__all__ = ["code", "escape", "table"]

_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)


def escape(text: str) -> str:
    """``text`` as one line of Markdown: ``|``, ``<``, ``>`` escaped outside code spans, line breaks as spaces.

    reStructuredText's double backticks (the docstrings' ````name````) become Markdown's single ones.
    """
    text = " ".join(text.replace("``", "`").split())
    out, at = [], 0
    for span in _CODE_SPAN.finditer(text):
        out.append(_escape_prose(text[at:span.start()]))
        out.append(span.group(0))
        at = span.end()
    out.append(_escape_prose(text[at:]))
    return "".join(out)


def _escape_prose(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def code(text: str) -> str:
    """``text`` as a code span; a backtick inside gets a longer fence, as CommonMark and Python-Markdown read it."""
    if not text:
        return ""
    fence = "`" * (max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A pipe table; cells are Markdown already (escape prose with `escape`, values with `code`)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell or " " for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
