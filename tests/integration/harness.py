"""Starts a real run (``python -m runtime.up``) as a subprocess and talks to it over its real bus."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from ops.tail import read_files
from runtime.bus import Bus
from runtime.bus_auth import SUPERVISOR
from runtime.events import parse_event
from runtime.natsserver import NatsServer, NatsServerConfig
from runtime.rundir import RunInfo
from tests.waiting import until

REPO = Path(__file__).resolve().parents[2]


@contextlib.asynccontextmanager
async def nats_bus(tmp_path: Path) -> AsyncIterator[Bus]:
    """A real nats-server in `tmp_path` and a connected bus with the base streams and buckets."""
    async with NatsServer(NatsServerConfig(store_dir=tmp_path / "nats")) as server:
        bus = await Bus.connect(server.url, name="test")
        try:
            await bus.ensure_base()
            yield bus
        finally:
            await bus.close()


def run_events(run_dir: Path, name: str) -> list[dict[str, Any]]:
    """Every structured event called ``name`` in a run's logs (every process's JSONL file)."""
    rows = []
    for f in (run_dir / "logs").glob("*.jsonl"):  # a live run's last line may be half written: not yet an event
        rows += [r for line in f.read_text().splitlines() if (r := parse_event(line)) and r.get("event") == name]
    return rows


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


class LiveRun:
    def __init__(self, run_dir: Path, config: Path | Sequence[Path], *extra: str,
                 pythonpath: tuple[Path, ...] = ()) -> None:
        """``config``: a run file, or several layered in order (later files win, as runtime.up does)."""
        self.pythonpath = ":".join(str(p) for p in (REPO, *pythonpath))
        self.run_dir = run_dir
        self.configs = [config] if isinstance(config, Path) else list(config)
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.bus: Bus | None = None
        self.info: RunInfo | None = None

    async def start(self, timeout_s: float = 60.0) -> LiveRun:
        self.proc = subprocess.Popen(  # noqa: ASYNC220 - a plain Popen is what the test inspects
            [sys.executable, "-m", "runtime.up", *(a for c in self.configs for a in ("--config", str(c))),
             "--run-dir", str(self.run_dir), "--quiet", *self.extra],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONPATH": self.pythonpath})
        deadline = time.monotonic() + timeout_s
        while not (self.run_dir / "run.json").exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"runtime.up exited {self.proc.returncode}: {self.output()}")
            if time.monotonic() > deadline:
                raise TimeoutError("runtime.up did not write run.json")
            await asyncio.sleep(0.05)
        self.info = RunInfo.read(self.run_dir)
        self.bus = await Bus.connect(self.info.nats_url, name="test", **self.info.bus_options(SUPERVISOR))
        return self

    async def wait_exit(self, timeout_s: float) -> int:
        """runtime.up's exit status once it ends; past ``timeout_s``, a failure that says where the run stood
        (its last events and its warnings and errors), not a bare timeout."""
        assert self.proc is not None
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.proc.wait), timeout_s)
        except TimeoutError:
            raise AssertionError(f"the run did not end within {timeout_s}s; where it stood:\n"
                                 f"{self.where_it_stands()}") from None

    def where_it_stands(self, last: int = 25) -> str:
        """The run's last ``last`` events and its last ``last`` warnings and errors, one line each, in time
        order, read from its event logs."""
        events = [e for _, e in read_files(sorted((self.run_dir / "logs").glob("*.jsonl")))]
        worrying = [e for e in events if e.get("level") in ("warning", "error", "critical")]

        def line(e: dict[str, Any]) -> str:
            return " ".join(f"{k}={v}" for k, v in e.items())[:300]

        return "\n".join(["warnings and errors:", *map(line, worrying[-last:]), "last events:",
                           *map(line, events[-last:])])

    def output(self) -> str:
        if self.proc is None or self.proc.stdout is None or self.proc.poll() is None:
            return ""
        return self.proc.stdout.read().decode(errors="replace")

    async def request(self, subject: str, body: dict[str, Any] | None = None, timeout: float = 5.0) -> Any:
        assert self.bus is not None
        reply = await self.bus.request(subject, msgpack.packb(body or {}), timeout_s=timeout)
        return msgpack.unpackb(reply, raw=False)

    async def actors(self) -> list[dict[str, Any]]:
        return (await self.request("ctl.supervisor.status"))["actors"]

    async def wait_actors(self, kind: str, n: int, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Waits until n actors of kind are registered as running (consuming)."""
        return await self.wait_actors_in(kind, "running", n, timeout_s)

    async def wait_actors_in(self, kind: str, state: str, n: int, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Waits until n actors of kind are registered in ``state``."""
        bus = self.bus
        assert bus is not None

        async def in_state() -> list[dict[str, Any]] | None:
            found = []
            for key in await bus.kv_keys("actors"):
                entry = await bus.kv_get("actors", key)
                info = msgpack.unpackb(entry.value, raw=False) if entry is not None and entry.value else {}
                if info.get("kind") == kind and info.get("state") == state:  # None: deregistered since the listing
                    found.append(info)
            return found if len(found) >= n else None

        try:
            return await until(in_state, timeout_s, f"{n} {kind} actors {state}")
        except AssertionError as e:
            raise TimeoutError(str(e)) from None

    async def stop(self, timeout_s: float = 60.0) -> int:
        if self.bus is not None:
            await self.bus.close()
            self.bus = None
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # every subject and bucket a run's own actors use must be one their role declares (runtime.bus_auth):
        # the server refuses the others, and the actor waits for what never comes
        denied = run_events(self.run_dir, "bus_permission_denied")
        assert not denied, f"the bus refused the run's own actors: {[(d.get('role'), d['error']) for d in denied]}"
        return self.proc.returncode


def descendants(pid: int) -> set[int]:
    """Every live process whose ancestry includes pid (read from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        p = frontier.pop()
        for child, parent in parents.items():
            if parent == p and child not in found:
                found.add(child)
                frontier.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@dataclass
class Machine:
    """The processes a documented step left running (servers, a run, followers), each in its own session, its
    output in ``logs/NAME.log``: ended by its id."""

    logs: Path
    processes: list[subprocess.Popen[bytes]]

    def start(self, command: str, env: dict[str, str], cwd: Path, name: str) -> subprocess.Popen[bytes]:
        out = (self.logs / f"{name}.log").open("wb")
        proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        self.processes.append(proc)
        return proc

    def output(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for proc in reversed(self.processes):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
