"""ToolBox: each tool's behaviour and its strict validation (errors as results, never raised)."""

from __future__ import annotations

import pytest

from sandbox import Environment, LayerStore, ToolBox, ToolResult


@pytest.fixture
async def tools(store: LayerStore):
    env = Environment.create(store, {"src/app.py": "a = 1\nb = 2\nc = 3\n", "README": "hello\n"})
    try:
        yield ToolBox(env)
    finally:
        env.close()


async def test_read_file_with_line_ranges(tools: ToolBox) -> None:
    assert await tools.call("read_file", {"path": "src/app.py"}) == ToolResult(True, "a = 1\nb = 2\nc = 3\n")
    assert (await tools.call("read_file", {"path": "src/app.py", "start_line": 2})).text == "b = 2\nc = 3\n"
    assert (
        await tools.call("read_file", {"path": "/workspace/src/app.py", "start_line": 2, "end_line": 2})
    ).text == "b = 2\n"
    bad = await tools.call("read_file", {"path": "src/app.py", "start_line": 3, "end_line": 1})
    assert not bad.ok and "start_line" in bad.text


async def test_write_file_creates_parents_visible_to_commands(tools: ToolBox) -> None:
    assert (await tools.call("write_file", {"path": "new/dir/x.py", "content": "print(41 + 1)\n"})).ok
    result = await tools.env.run("python3 new/dir/x.py && echo extra >> new/dir/x.py && stat -c %U new/dir/x.py")
    assert result.stdout.split() == ["42", "sandbox"]


async def test_edit_requires_exactly_one_match(tools: ToolBox) -> None:
    assert (await tools.call("edit", {"path": "src/app.py", "old": "b = 2", "new": "b = 20"})).ok
    assert (await tools.call("read_file", {"path": "src/app.py"})).text == "a = 1\nb = 20\nc = 3\n"
    missing = await tools.call("edit", {"path": "src/app.py", "old": "zzz", "new": "y"})
    assert not missing.ok and "not found" in missing.text
    many = await tools.call("edit", {"path": "src/app.py", "old": " = ", "new": "="})
    assert not many.ok and "3 times" in many.text
    empty = await tools.call("edit", {"path": "src/app.py", "old": "", "new": "y"})
    assert not empty.ok


async def test_list_dir_and_grep(tools: ToolBox) -> None:
    await tools.env.run("ln -s README link")
    listing = await tools.call("list_dir", {})
    assert listing.text.split("\n") == ["README", "link@", "src/"]
    assert (await tools.call("list_dir", {"path": "src"})).text == "app.py"
    found = await tools.call("grep", {"pattern": "^[bc] =", "path": "src"})
    assert found.ok and found.text.splitlines() == ["./src/app.py:2:b = 2", "./src/app.py:3:c = 3"]
    filtered = await tools.call("grep", {"pattern": "hello", "include": "*.py"})
    assert filtered == ToolResult(True, "(no matches)")
    bad = await tools.call("grep", {"pattern": "(unclosed"})
    assert not bad.ok and "grep failed" in bad.text


async def test_run_reports_exit_code_output_and_timeout(tools: ToolBox) -> None:
    ok = await tools.call("run", {"command": "echo out; echo err >&2"})
    assert ok.ok and ok.text.startswith("[exit code 0]") and "out" in ok.text and "err" in ok.text
    failed = await tools.call("run", {"command": "exit 3"})
    assert not failed.ok and "[exit code 3]" in failed.text
    slow = await tools.call("run", {"command": "sleep 5", "timeout_s": 0.3})
    assert not slow.ok and "timed out" in slow.text
    too_long = await tools.call("run", {"command": "true", "timeout_s": 10_000})
    assert not too_long.ok and "timeout_s" in too_long.text


@pytest.mark.parametrize(
    ("name", "args", "needle"),
    [
        ("nope", {}, "unknown tool"),
        ("read_file", {}, "missing required argument 'path'"),
        ("read_file", {"path": 3}, "must be str"),
        ("read_file", {"path": "x", "start_line": True}, "must be int"),
        ("read_file", {"path": "x", "bogus": 1}, "unknown argument"),
        ("read_file", ["x"], "must be an object"),
        ("read_file", {"path": "missing.txt"}, "no such file"),
        ("read_file", {"path": "src"}, "is a directory"),
        ("read_file", {"path": "a\x00b"}, "NUL"),
        ("write_file", {"path": "", "content": "x"}, "workspace root"),
        ("write_file", {"path": "src", "content": "x"}, "is a directory"),
        ("write_file", {"path": "big", "content": "x" * (2 << 20)}, "limit"),
        ("run", {"command": "true", "timeout_s": -1}, "timeout_s"),
        ("list_dir", {"path": "README"}, "failed"),
    ],
)
async def test_bad_calls_return_errors(tools: ToolBox, name: str, args: object, needle: str) -> None:
    result = await tools.call(name, args)  # type: ignore[arg-type]
    assert not result.ok
    assert needle in result.text


async def test_binary_and_full_disk_are_reported(store: LayerStore) -> None:
    from sandbox import SandboxLimits

    with Environment.create(store, {}, SandboxLimits(disk_bytes=1 << 20)) as env:
        tools = ToolBox(env)
        await env.run("head -c 100 /dev/urandom > bin; printf '\\xff' >> bin")
        binary = await tools.call("read_file", {"path": "bin"})
        assert not binary.ok and "UTF-8" in binary.text
        full = await tools.call("write_file", {"path": "f", "content": "x" * 1_000_000})
        full2 = await tools.call("write_file", {"path": "g", "content": "x" * 1_000_000})
        assert not (full.ok and full2.ok)
        assert "No space left" in (full2.text if full.ok else full.text)
