"""The local backend's zygote (runtime.zygote): its children are what a spawned process would be (session,
environment and command line as /proc shows them, output, exit status), its staleness after a change on disk,
and a new zygote when it is gone, or plain starts when none can start."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from runtime.local_backend import LocalBackend
from runtime.placement import ActorLaunch
from runtime.run_config import ActorSpec
from runtime.zygote import ROOM_ENV, Zygote, ZygoteUnavailable
from tests.waiting import until

CHILD = "tests.runtime.zygote_child"
SPEC = ActorSpec("runtime.actor:Actor")


def _report(output: Path) -> dict:
    return json.loads(output.read_text().splitlines()[0])


def _proc_strings(pid: int, name: str) -> list[str]:
    return [s for s in Path(f"/proc/{pid}/{name}").read_bytes().decode().split("\0") if s]


async def _report_of(path: Path) -> dict:
    async with asyncio.timeout(60):
        while not path.read_text():  # noqa: ASYNC110 (a few ms: the child's first print)
            await asyncio.sleep(0.05)
    return _report(path)


async def test_a_forked_child_is_what_a_spawned_process_would_be(tmp_path: Path) -> None:
    # torch, and triton (an extension that reports at exit the objects of its own left uncollected)
    zygote = await Zygote.start([CHILD, "torch", "low_precision.nvfp4_triton"], tmp_path / "zygote.out")
    try:
        env = {**os.environ, "ZYGOTE_TEST_MARKER": "m" * 3000, "OMP_NUM_THREADS": "1"}
        child = await zygote.fork(["-m", CHILD, "wait"], env, tmp_path / "wait.out")
        async with asyncio.timeout(60):
            while not (tmp_path / "wait.out").read_text():  # noqa: ASYNC110 (a few ms: the child's first print)
                await asyncio.sleep(0.05)
        report = _report(tmp_path / "wait.out")
        assert report["sid"] == child.pid and report["argv"] == ["wait"] and report["name"] == "__main__"
        assert report["marker"] == "m" * 3000 and report["threads"] == 1
        environ = _proc_strings(child.pid, "environ")  # what ops tools and the tests read
        assert f"ZYGOTE_TEST_MARKER={'m' * 3000}" in environ and not any(e.startswith(ROOM_ENV) for e in environ)
        assert _proc_strings(child.pid, "cmdline") == [sys.executable, "-m", CHILD, "wait"]
        child.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(child.wait(), 30) == -signal.SIGTERM
        with pytest.raises(ProcessLookupError):
            child.send_signal(signal.SIGTERM)
        exiting = await zygote.fork(["-m", CHILD, "3"], env, tmp_path / "exit.out")
        assert await asyncio.wait_for(exiting.wait(), 30) == 3
        assert _report(tmp_path / "exit.out")["ppid"] == report["ppid"]  # the same zygote forked both
        assert len((tmp_path / "exit.out").read_text().splitlines()) == 1, "nothing more written as it exits"
    finally:
        await zygote.close()


async def test_forks_asked_at_once_each_get_their_own_answer_and_exit_status(tmp_path: Path) -> None:
    """Children that exit at once: the zygote's report of an exit can follow its answer before the asker resumes."""
    zygote = await Zygote.start([CHILD], tmp_path / "zygote.out")
    try:
        async with asyncio.timeout(60):
            children = await asyncio.gather(*(zygote.fork(["-m", CHILD, str(code)], dict(os.environ),
                                                          tmp_path / f"{code}.out") for code in range(3, 9)))
            assert [await child.wait() for child in children] == list(range(3, 9))
    finally:
        await zygote.close()


async def test_a_forked_child_exits_as_the_interpreter_would_without_tearing_the_heap_down(tmp_path: Path) -> None:
    """Its threads finish (an idle pool's worker is told to end), its exit functions run, its output is flushed
    and ``sys.exit("message")`` prints it and exits 1; but the interpreter's teardown, which would collect every
    object the zygote imported (0.5 CPU-seconds an actor with torch), does not happen."""
    zygote = await Zygote.start([CHILD, "torch"], tmp_path / "zygote.out")
    try:
        child = await zygote.fork(["-m", CHILD, "leave"], dict(os.environ), tmp_path / "leave.out")
        assert await asyncio.wait_for(child.wait(), 30) == 1
        lines = (tmp_path / "leave.out").read_text().splitlines()[1:]
        assert sorted(lines) == sorted(["not flushed", "thread finished", "exit function ran", "a message"]), lines
    finally:
        await zygote.close()


async def test_a_zygote_whose_code_changed_on_disk_forks_nothing_more_and_ends_after_its_children(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "swapped_module.py").write_text("VERSION = 1\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    zygote = await Zygote.start(["swapped_module", CHILD], tmp_path / "zygote.out")
    try:
        old = await zygote.fork(["-m", CHILD, "wait"], dict(os.environ), tmp_path / "a.out")
        (tmp_path / "swapped_module.py").write_text("VERSION = 2  # a hot swap's new code\n")
        with pytest.raises(ZygoteUnavailable, match=r"swapped_module\.py changed"):
            await zygote.fork(["-m", CHILD, "0"], dict(os.environ), tmp_path / "b.out")
        assert zygote.stale and not zygote.alive
        # the old generation still serves (a swap drains it once the new one runs): it must not die with the zygote
        await _report_of(tmp_path / "a.out")
        assert old.returncode is None and zygote.running
        old.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(old.wait(), 30) == -signal.SIGTERM
        await until(lambda: not zygote.running, 30, "the retired zygote to end after its last child")
    finally:
        await zygote.close()


def _launch(tmp_path: Path, name: str, *args: str) -> ActorLaunch:
    return ActorLaunch("worker", name, ("-m", CHILD, *args), {"ZYGOTE_TEST_MARKER": name}, tmp_path / f"{name}.out")


async def test_the_children_of_a_zygote_that_died_die_with_it_and_a_new_one_forks_the_next(tmp_path: Path) -> None:
    backend = LocalBackend([CHILD], tmp_path / "zygote.out")
    try:
        first = await backend.start(_launch(tmp_path, "first", "wait"), SPEC)
        zygote_pid = (await _report_of(tmp_path / "first.out"))["ppid"]
        assert zygote_pid != os.getpid()
        os.kill(zygote_pid, signal.SIGKILL)
        # its children die with it, and say so: the supervisor replaces them as after any crash
        assert await asyncio.wait_for(first.wait(), 30) == -signal.SIGKILL
        again = await backend.start(_launch(tmp_path, "again", "5"), SPEC)
        assert await asyncio.wait_for(again.wait(), 60) == 5
        assert _report(tmp_path / "again.out")["ppid"] not in (os.getpid(), zygote_pid)
        assert _report(tmp_path / "again.out")["marker"] == "again"
    finally:
        await backend.close()


async def test_the_backend_starts_processes_plainly_when_no_zygote_can_start(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "fatal_module.py").write_text("import os\nos._exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    backend = LocalBackend(["fatal_module"], tmp_path / "zygote.out")
    try:
        with capture_logs() as logs:
            for name in ("one", "two"):
                proc = await backend.start(_launch(tmp_path, name, "4"), SPEC)
                assert await asyncio.wait_for(proc.wait(), 60) == 4
                assert _report(tmp_path / f"{name}.out")["ppid"] == os.getpid()
        assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["zygote_not_started"]  # tried once
    finally:
        await backend.close()
