"""The agent's tools over an `Environment`, with strict validation and errors returned as text.

``await ToolBox(env).call(name, args)`` never raises for bad input or a failed operation: it
returns ``ToolResult(ok=False, text=<what went wrong and how to fix it>)``. File tools run on the
host through `sandbox._safepath` (no ``..``, no symlink is followed, no mount crossing, writes
replace the entry so hard links are never written through); ``grep`` and ``run`` execute inside
the sandbox, so hostile regexes or commands only burn the sandbox's own limits.
"""

from __future__ import annotations

import os
import shlex
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from sandbox import _safepath
from sandbox.env import Environment
from sandbox.errors import SandboxError

__all__ = ["TOOL_NAMES", "ToolBox", "ToolResult", "tool_schemas"]

log = structlog.get_logger(__name__)

MAX_READ_BYTES = 1 << 20
MAX_WRITE_BYTES = 1 << 20
MAX_TEXT_CHARS = 16 * 1024
MAX_LIST_ENTRIES = 500


@dataclass(frozen=True)
class ToolResult:
    ok: bool
    text: str


class _ArgError(ValueError):
    pass


# name -> {arg: (types, required)}
_SCHEMAS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "read_file": {"path": ((str,), True), "start_line": ((int,), False), "end_line": ((int,), False)},
    "write_file": {"path": ((str,), True), "content": ((str,), True)},
    "edit": {"path": ((str,), True), "old": ((str,), True), "new": ((str,), True)},
    "list_dir": {"path": ((str,), False)},
    "grep": {"pattern": ((str,), True), "path": ((str,), False), "include": ((str,), False)},
    "run": {"command": ((str,), True), "timeout_s": ((int, float), False)},
}
TOOL_NAMES = tuple(_SCHEMAS)

# what a pretrained policy is told about each tool (the tiny policy learns them from examples)
_DESCRIPTIONS: dict[str, tuple[str, dict[str, str]]] = {
    "read_file": ("Read a text file of the workspace, optionally only lines start_line..end_line (1-based).",
                  {"path": "file path relative to the workspace", "start_line": "first line", "end_line": "last line"}),
    "write_file": ("Create or replace a file of the workspace with the given content.",
                   {"path": "file path relative to the workspace", "content": "the whole new text of the file"}),
    "edit": ("Replace the one occurrence of `old` in a file by `new`.",
             {"path": "file path relative to the workspace", "old": "text to find (exactly once)",
              "new": "replacement text"}),
    "list_dir": ("List a directory of the workspace.", {"path": "directory path (default: the workspace root)"}),
    "grep": ("Search files for a regular expression.",
             {"pattern": "the regular expression", "path": "where to search", "include": "file glob to search"}),
    "run": ("Run a shell command in the workspace and return its output and exit code.",
            {"command": "the shell command", "timeout_s": "seconds before it is killed"}),
}
_JSON_TYPES = {str: "string", int: "integer", float: "number"}


def tool_schemas() -> list[dict[str, Any]]:
    """The tools as JSON schemas in the function-calling form chat templates read (``{"type": "function",
    "function": {"name", "description", "parameters"}}``)."""
    schemas = []
    for name, args in _SCHEMAS.items():
        description, arg_descriptions = _DESCRIPTIONS[name]
        properties: dict[str, Any] = {}
        for arg, (types, _) in args.items():
            kinds = [_JSON_TYPES[t] for t in types]
            properties[arg] = {"type": kinds[0] if len(kinds) == 1 else kinds, "description": arg_descriptions[arg]}
        required = [arg for arg, (_, needed) in args.items() if needed]
        schemas.append({"type": "function", "function": {"name": name, "description": description, "parameters": {
            "type": "object", "properties": properties, "required": required}}})
    return schemas


def _validate(name: str, args: Any) -> dict[str, Any]:
    if name not in _SCHEMAS:
        raise _ArgError(f"unknown tool {name!r}; available tools: {', '.join(TOOL_NAMES)}")
    if not isinstance(args, dict):
        raise _ArgError(f"{name}: arguments must be an object, got {type(args).__name__}")
    schema = _SCHEMAS[name]
    unknown = sorted(set(args) - set(schema))
    if unknown:
        raise _ArgError(f"{name}: unknown argument(s) {unknown}; expected {sorted(schema)}")
    for arg, (types, required) in schema.items():
        if arg not in args:
            if required:
                raise _ArgError(f"{name}: missing required argument {arg!r}")
            continue
        value = args[arg]
        if isinstance(value, bool) or not isinstance(value, types):
            want = " or ".join(t.__name__ for t in types)
            raise _ArgError(f"{name}: argument {arg!r} must be {want}, got {type(value).__name__}")
    return args


def _clip(text: str) -> str:
    if len(text) <= MAX_TEXT_CHARS:
        return text
    return text[:MAX_TEXT_CHARS] + f"\n[... {len(text) - MAX_TEXT_CHARS} more characters truncated]"


class ToolBox:
    """Dispatches tool calls to one environment."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self._handlers: dict[str, Callable[[dict[str, Any]], Awaitable[ToolResult]]] = {
            "read_file": self._read_file,
            "write_file": self._write_file,
            "edit": self._edit,
            "list_dir": self._list_dir,
            "grep": self._grep,
            "run": self._run,
        }

    async def call(self, name: str, args: dict[str, Any]) -> ToolResult:
        """Run tool ``name``; every failure comes back as ``ToolResult(ok=False, ...)``."""
        try:
            checked = _validate(name, args)
            return await self._handlers[name](checked)
        except _ArgError as e:
            return ToolResult(False, str(e))
        except (SandboxError, OSError, ValueError, UnicodeError, TypeError) as e:
            return ToolResult(False, f"{name} failed: {_describe(e)}")

    # -- helpers -------------------------------------------------------------------------
    def _parts(self, path: str) -> tuple[str, ...]:
        return _safepath.split_relpath(path, self.env.store.config.workspace_dir)

    def _read_text(self, parts: tuple[str, ...]) -> str:
        data = _safepath.read_regular(self.env.workspace_path, parts, MAX_READ_BYTES)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{'/'.join(parts)} is not UTF-8 text") from e

    def _write_text(self, parts: tuple[str, ...], text: str) -> None:
        data = text.encode("utf-8")
        if len(data) > MAX_WRITE_BYTES:
            raise ValueError(f"content has {len(data)} bytes; the limit is {MAX_WRITE_BYTES}")
        _safepath.write_atomic(self.env.workspace_path, parts, data, uid=self.env.uid, gid=self.env.gid)

    # -- tools ---------------------------------------------------------------------------
    async def _read_file(self, args: dict[str, Any]) -> ToolResult:
        parts = self._parts(args["path"])
        lines = self._read_text(parts).splitlines(keepends=True)
        start = args.get("start_line", 1)
        end = args.get("end_line", max(len(lines), start))
        if start < 1 or end < start:
            raise _ArgError(f"read_file: need 1 <= start_line <= end_line, got start_line={start}, end_line={end}")
        return ToolResult(True, _clip("".join(lines[start - 1 : end])))

    async def _write_file(self, args: dict[str, Any]) -> ToolResult:
        parts = self._parts(args["path"])
        self._write_text(parts, args["content"])
        return ToolResult(True, f"wrote {len(args['content'].encode())} bytes to {'/'.join(parts)}")

    async def _edit(self, args: dict[str, Any]) -> ToolResult:
        parts = self._parts(args["path"])
        old, new = args["old"], args["new"]
        if not old:
            raise _ArgError("edit: 'old' must be a non-empty string")
        text = self._read_text(parts)
        count = text.count(old)
        if count != 1:
            hint = "not found" if count == 0 else f"found {count} times; include more context to make it unique"
            return ToolResult(False, f"edit: 'old' string {hint} in {'/'.join(parts)}")
        self._write_text(parts, text.replace(old, new, 1))
        return ToolResult(True, f"edited {'/'.join(parts)}")

    async def _list_dir(self, args: dict[str, Any]) -> ToolResult:
        parts = self._parts(args.get("path", "."))
        fd = _safepath.open_dir(self.env.workspace_path, parts)
        try:
            rows = []
            for name in sorted(os.listdir(fd))[:MAX_LIST_ENTRIES]:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                suffix = "/" if stat.S_ISDIR(st.st_mode) else "@" if stat.S_ISLNK(st.st_mode) else ""
                rows.append(name + suffix)
        finally:
            os.close(fd)
        return ToolResult(True, "\n".join(rows) if rows else "(empty)")

    async def _grep(self, args: dict[str, Any]) -> ToolResult:
        parts = self._parts(args.get("path", "."))
        target = "./" + "/".join(parts) if parts else "."
        cmd = ["grep", "-rnIE", "--color=never"]
        if "include" in args:
            cmd.append("--include=" + args["include"])
        cmd += ["-e", args["pattern"], "--", target]
        result = await self.env.run(
            " ".join(shlex.quote(c) for c in cmd), timeout_s=min(10.0, self.env.limits.wall_time_s)
        )
        if result.timed_out:
            return ToolResult(False, "grep timed out; use a simpler pattern or a narrower path")
        if result.exit_code == 1:
            return ToolResult(True, "(no matches)")
        if result.exit_code != 0:
            return ToolResult(False, f"grep failed: {result.stderr.strip() or f'exit code {result.exit_code}'}")
        return ToolResult(True, _clip(result.stdout))

    async def _run(self, args: dict[str, Any]) -> ToolResult:
        timeout = float(args.get("timeout_s", self.env.limits.wall_time_s))
        if not 0 < timeout <= self.env.limits.wall_time_s:
            raise _ArgError(
                f"run: timeout_s must be in (0, {self.env.limits.wall_time_s}], got {args.get('timeout_s')!r}"
            )
        result = await self.env.run(args["command"], timeout_s=timeout)
        status = "timed out" if result.timed_out else f"exit code {result.exit_code}"
        text = f"[{status}]\n{result.stdout}"
        if result.stderr:
            text += f"\n[stderr]\n{result.stderr}"
        if result.truncated:
            text += "\n[output truncated]"
        return ToolResult(result.exit_code == 0 and not result.timed_out, _clip(text))


def _describe(e: BaseException) -> str:
    if isinstance(e, FileNotFoundError):
        return f"no such file or directory{': ' + str(e.filename) if e.filename else ''} ({e.strerror or e})"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror + (f": {e.filename}" if e.filename else "")
    return str(e)
