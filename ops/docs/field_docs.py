"""What the source says about a dataclass and its fields: the class docstring, and each field's comment.

The configuration classes document a field with a comment: the comment lines right above it and the one
at the end of its line (``x: int = fixed(...)  # what x is``); a class may also list its fields in a
Google-style ``Attributes:`` section of its docstring (``actors.reconciler.scheduling.SchedulingConfig``).
Read from the module's source (`ast`, `tokenize`), since Python keeps no comment and a dataclass's
``__doc__`` is made up when it has no docstring.
"""

from __future__ import annotations

import ast
import functools
import inspect
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ClassDocs", "class_docs"]


@dataclass(frozen=True)
class ClassDocs:
    """A class's docstring (less its ``Attributes:`` section) and each documented field's text."""

    doc: str
    fields: dict[str, str]


def class_docs(cls: type) -> ClassDocs:
    """The docstring and field documentation of ``cls``, from its module's source.

    Raises:
        ValueError: the class is not found in its module's source (defined in a function, or made at run time).
    """
    path = inspect.getsourcefile(cls)
    if path is None:
        raise ValueError(f"{cls.__qualname__}: no source file to read its documentation from")
    return _class_docs(path, cls.__qualname__)


@functools.cache
def _class_docs(path: str, qualname: str) -> ClassDocs:
    source = Path(path).read_text(encoding="utf-8")
    node = _find_class(ast.parse(source), qualname.split("."))
    if node is None:
        raise ValueError(f"{qualname}: not found in {path}")
    comments = _comments(source)
    doc, listed = _split_attributes(ast.get_docstring(node) or "")
    fields: dict[str, str] = {}
    previous_end = node.body[0].end_lineno if _has_docstring(node) else node.lineno
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            name = stmt.target.id
            above = _comment_block_above(comments, stmt.lineno, previous_end or stmt.lineno)
            trailing = [comments[line][1] for line in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
                        if line in comments and not comments[line][0]]
            # A comment above and one after the field are two remarks: "what it is; a bound on it"
            text = listed.get(name) or "; ".join(p for p in (" ".join(above), " ".join(trailing)) if p)
            if text:
                fields[name] = text
        previous_end = stmt.end_lineno
    return ClassDocs(doc, fields)


def _find_class(tree: ast.Module, names: list[str]) -> ast.ClassDef | None:
    body: list[ast.stmt] = tree.body
    node = None
    for name in names:
        node = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == name), None)
        if node is None:
            return None
        body = node.body
    return node


def _has_docstring(node: ast.ClassDef) -> bool:
    first = node.body[0]
    return isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)


def _comments(source: str) -> dict[int, tuple[bool, str]]:
    """Line -> (whether the comment is the whole line, its text without ``#``)."""
    found: dict[int, tuple[bool, str]] = {}
    lines = source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            line = token.start[0]
            whole = not lines[line - 1][: token.start[1]].strip()
            found[line] = (whole, token.string.lstrip("#").strip())
    return found


def _comment_block_above(comments: dict[int, tuple[bool, str]], line: int, stop: int) -> list[str]:
    """The whole-line comments directly above ``line`` (no blank line between), not reaching ``stop``."""
    block: list[str] = []
    at = line - 1
    while at > stop and at in comments and comments[at][0]:
        block.insert(0, comments[at][1])
        at -= 1
    return [text for text in block if not text.startswith("noqa")]


_ENTRY = re.compile(r"^(\w+(?:\s*,\s*\w+)*):\s*(.*)$")


def _split_attributes(doc: str) -> tuple[str, dict[str, str]]:
    """A docstring's text before ``Attributes:``, and each attribute's entry (one entry may name several)."""
    head, sep, rest = doc.partition("\nAttributes:\n")
    if not sep:
        return doc.strip(), {}
    entries: dict[str, str] = {}
    names: list[str] = []
    for line in rest.splitlines():
        if line and not line.startswith(" "):  # the next section of the docstring
            break
        match = _ENTRY.match(line.strip()) if line.startswith("    ") and not line.startswith("     ") else None
        if match:
            names = [n.strip() for n in match.group(1).split(",")]
            for name in names:
                entries[name] = match.group(2)
        elif line.strip():
            for name in names:
                entries[name] += " " + line.strip()
    return head.strip(), entries
