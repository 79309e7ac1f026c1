"""Start a run: ``python -m runtime.up [--config run.toml] [--set key=value ...] [--resume RUN]``.

Starts the bus (an embedded nats-server, or a cluster of ``bus.embedded_servers``, in the run directory
unless ``bus.url`` names servers), creates
its streams and buckets, starts the supervisor and the actors the configuration lists, and shows
progress until the run finishes, fails, or is stopped (Ctrl-C or SIGTERM: every actor drains first).

The run files name everything the run starts (``actors.<kind>.entry = "package.module:Class"``): the
runtime knows no application. An application's launcher passes its default run file through
``main(default_config=...)`` (``python -m actors`` is the RL trainer's), used when no ``--config`` is given.

A run is named by its id (``<time>-<name>-<hex>``, the run directory's name by default). Its record and
resolved configuration go to the bus and the blob store (``runtime.run_state``); the run directory is
this machine's cache and log folder. ``--resume RUN`` takes the run directory, or, on any machine, the
run id with the bus and storage URLs: ``--resume ID --set bus.url=nats://... --set storage.url=s3://...``.
Exit status: 0 finished or stopped cleanly, 1 failed, 2 bad configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import msgpack
import structlog
import uvloop

from runtime import config as config_mod
from runtime.blob import open_store
from runtime.bus import Bus, Inbound, server_urls
from runtime.bus_auth import (
    SUPERVISOR,
    Permissions,
    RunCredentials,
    actor_permissions,
    generate_credentials,
    tls_context,
)
from runtime.errors import BusError, ConfigError, RevisionMismatch
from runtime.events import EventLog
from runtime.kv_lease import KVLease
from runtime.natsserver import NatsCluster, NatsServer, NatsServerConfig
from runtime.placement import PlacementError
from runtime.run_config import (
    RunConfig,
    RuntimeConfig,
    annotated_toml,
    dump_toml,
    import_entry,
    load_run_config,
    runtime_from_overrides,
)
from runtime.run_state import (
    RUN_BUCKET,
    Outcome,
    RunConflict,
    RunRecord,
    RunState,
    check_run_id,
    find_run,
    new_run_id,
    publish_run,
    publish_run_state,
    storage_url_of,
    withdraw_run,
)
from runtime.rundir import CONFIG_FILE, SUPERVISOR_LOG, RunInfo, new_run_dir
from runtime.store_probe import probe_store
from runtime.supervisor import Supervisor, open_backend
from runtime.watchdog import Watchdog

log = structlog.get_logger(__name__)

PROGRESS_SUBJECT = "progress"
BUS_END_TIMEOUT_S = 5.0  # recording the run's end; a bus that does not take it by then is down


def parse_args(argv: list[str] | None, prog: str = "python -m runtime.up") -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", type=Path, default=[], metavar="FILE",
                   help="TOML run file; repeat to layer files (later wins). Default: the launcher's run, if any")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="override one key, e.g. --set rollout.temperature=0.7 (value read as TOML)")
    p.add_argument("--resume", metavar="RUN",
                   help="continue a run with its saved configuration and state: its run directory, or its id "
                        "with its bus and storage (--set bus.url=... --set storage.url=...), from any machine")
    p.add_argument("--run-dir", type=Path, help="use this (new) directory for the run (or for the resumed run's "
                                                "cache and logs, when resumed by id)")
    p.add_argument("--steps", type=int, help="shorthand for --set run.steps=N: stop after N steps")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved configuration, each key's range and live mark beside it, and exit")
    p.add_argument("--quiet", action="store_true", help="no progress display on the terminal")
    return p.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class Resumed:
    """A run to continue: its id, and its directory when it is resumed from one (else a fresh one)."""

    run_id: str
    run_dir: Path | None


def resolve_config(args: argparse.Namespace, default_config: Sequence[Path] = ()) -> tuple[RunConfig, Resumed | None]:
    """The run's configuration: the resumed run's saved one, else ``--config`` files, else ``default_config``.

    A run resumed by its id reads its configuration from its blob store, found through its bus. Only printed
    (``--print-config``), it is resolved without importing the actor classes where ``run.config_schema`` names
    the schema (`load_run_config`): they would bring torch for nothing.

    Raises:
        ConfigError: a file is missing or invalid, there is no run file at all, or the run is not found.
    """
    overrides = list(args.overrides)
    import_actors = not args.print_config
    if args.steps is not None:
        overrides.append(f"run.steps={args.steps}")
    if args.resume and Path(args.resume).is_dir():
        run_dir = Path(args.resume).resolve()
        resumed = Resumed(RunInfo.read(run_dir).run, run_dir)
        return load_run_config([run_dir / CONFIG_FILE], overrides, import_actors=import_actors), resumed
    if args.resume:
        run_id = check_run_id(str(args.resume))
        text = uvloop.run(fetch_run_config(run_id, overrides))
        with tempfile.TemporaryDirectory() as tmp:
            saved = Path(tmp) / CONFIG_FILE
            saved.write_text(text)
            return load_run_config([saved], overrides, import_actors=import_actors), Resumed(run_id, None)
    files = list(args.config or default_config)
    if not files:
        raise ConfigError("no run file: pass --config FILE (a TOML file whose [actors.<kind>] sections name the "
                          "entry points), or start the application's launcher, e.g. python -m actors")
    return load_run_config(files, overrides, import_actors=import_actors), None


async def fetch_run_config(run_id: str, overrides: Sequence[str]) -> str:
    """The saved configuration of run ``run_id``, found through its bus (``bus.url``) and store.

    Raises:
        ConfigError: no bus URL, the bus or its store holds no such run, or the bus is unreachable.
    """
    rt = runtime_from_overrides(overrides)
    _, text, _ = await find_run(run_id, rt.bus, rt.storage, SUPERVISOR)
    return text


async def serve(cfg: RunConfig, run_dir: Path, run_id: str, resumed: bool, event_log: EventLog,
                terminal: IO[str] | None) -> Outcome:
    rt = cfg.runtime
    server: NatsServer | NatsCluster | None = None
    async with contextlib.AsyncExitStack() as stack:
        credentials_dir = rt.bus.credentials_dir
        credentials = RunCredentials.read(credentials_dir, [SUPERVISOR, *rt.actors]) if credentials_dir else None
        if rt.bus.url:
            url = ",".join(server_urls(rt.bus.url))
        else:
            users = generate_credentials(run_dir / "credentials", bus_roles(rt)) if rt.bus.auth else []
            credentials_dir = str(run_dir / "credentials") if users else ""
            credentials = RunCredentials(Path(credentials_dir), {u.credentials.user: u.credentials for u in users},
                                         owned=True) if users else None
            server_config = NatsServerConfig(store_dir=run_dir / "nats", max_payload_bytes=rt.bus.max_payload_bytes,
                                             max_restarts=rt.bus.server_max_restarts,
                                             restart_window_s=rt.bus.server_restart_window_s, users=tuple(users))
            server = NatsCluster(server_config, rt.bus.embedded_servers) if rt.bus.embedded_servers > 1 \
                else NatsServer(server_config)
            url = await server.start()
            stack.push_async_callback(server.stop)
        storage_url = rt.storage.url or (run_dir / "blobs").as_uri()
        info = RunInfo(str(run_dir), url, storage_url, rt.storage.s3_endpoint, os.getpid(), time.time(),
                       credentials_dir, rt.bus.tls_ca_file, rt.bus.tls_cert_file, rt.bus.tls_key_file, run_id)
        bus = await Bus.connect(url, name="supervisor", limits=rt.bus.limits(),
                                credentials=credentials.for_role(SUPERVISOR) if credentials else None,
                                tls=tls_context(rt.bus.tls_ca_file, rt.bus.tls_cert_file, rt.bus.tls_key_file))
        stack.push_async_callback(bus.close)
        await bus.ensure_base(lease_max_s=max((spec.lease_s for spec in rt.actors.values()), default=0.0))
        await provision_streams(bus, rt)
        lease = await _hold_run(bus, run_id, run_dir, rt.supervisor.lease_s)
        stack.push_async_callback(lease.release)
        # Every check before the run claims its bus and store: a start refused here leaves both as they were,
        # so the same command works once the cause is fixed.
        await check_store_access(storage_url, rt.storage.s3_endpoint)
        store = open_store(storage_url, s3_endpoint=rt.storage.s3_endpoint or None)
        stack.push_async_callback(store.close)
        backend = open_backend(rt, run_dir)  # a Ray head or cluster connection (blocking: nothing runs yet)
        stack.push_async_callback(backend.close)
        backend.check(rt)  # before the run is announced: a cluster that cannot hold it starts nothing
        record = RunRecord(run_id, rt.run.name, storage_url, rt.storage.s3_endpoint, time.time())
        await publish_run(bus, store, record, dump_toml(cfg.to_toml_tree()), resumed=resumed)
        try:
            await publish_run_state(bus, RunState(Outcome.RUNNING, at=time.time()))
            await _publish_live_defaults(bus, cfg, resumed)
            info.write()
        except BaseException:  # nothing ran: a new run leaves its bus and store free for the same command again
            if not resumed:
                await _quietly(lambda: withdraw_run(bus, store, record))  # a bus that is down keeps the claim
            raise
        if credentials is None:  # said once the run starts on it: a refused start's one line stays one line
            _warn_unauthenticated(url, bool(rt.bus.url), terminal)
        supervisor = Supervisor(rt, run_dir, bus, info.address(), backend, credentials, blob=store, app=cfg.app)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, supervisor.request_stop)
        _announce(terminal, run_dir, run_id, url, storage_url, resumed, credentials_dir)
        progress = await bus.subscribe(f"{PROGRESS_SUBJECT}.>", _progress_printer(terminal))
        stack.push_async_callback(progress.unsubscribe)  # bounded, and quiet on a closed connection
        async with asyncio.TaskGroup() as tg:
            forwarder = tg.create_task(event_log.forward(bus))
            leased = tg.create_task(_keep_run(lease, supervisor))
            guard = tg.create_task(_guard_bus(supervisor, bus, server, url, rt.bus.max_outage_s, terminal))
            watchdog = tg.create_task(Watchdog(bus, rt.supervisor.stall_s, sys.stderr).run()) \
                if rt.supervisor.stall_s else None
            try:
                outcome = await supervisor.run()
            finally:
                forwarder.cancel()
                leased.cancel()
                guard.cancel()
                if watchdog is not None:
                    watchdog.cancel()
        # after the forwarder's last flush: a follower that sees the end has had every event before it sent
        await _record_end(bus, RunState(outcome, supervisor.failure or "", time.time()))
        if outcome is Outcome.FAILED and supervisor.num_placed == 0 and not resumed:
            # no actor process ever started: the same command, once the cause is fixed, finds bus and store free
            await _quietly(lambda: withdraw_run(bus, store, record))
        if supervisor.failure:
            print(f"run failed: {supervisor.failure}", file=sys.stderr, flush=True)
        elif terminal is not None:
            print(f"\nrun {outcome.value}", file=terminal, flush=True)
        if supervisor.unclean_exits:
            print(f"{len(supervisor.unclean_exits)} actor(s) did not stop cleanly: "
                  + "; ".join(supervisor.unclean_exits), file=sys.stderr, flush=True)
        return outcome
    raise AssertionError("unreachable")


SUPERVISOR_LEASE_KEY = "supervisor"


async def check_store_access(url: str, s3_endpoint: str) -> None:
    """Refuses a start whose store this process cannot reach, naming the setting to fix (runtime.store_probe).

    Raises:
        ConfigError: the store's credentials, endpoint or bucket are missing or refused.
    """
    if problem := await asyncio.to_thread(probe_store, url, s3_endpoint):
        raise ConfigError(f"storage.url={url} cannot be reached from runtime.up on {socket.gethostname()}: "
                          f"{problem}; every actor process needs the same on its node")


async def _hold_run(bus: Bus, run_id: str, run_dir: Path, lease_s: float) -> KVLease:
    """The run's supervisor lease, so that one runtime.up at a time runs it: taken at once when free,
    after ``lease_s`` without renewal when its holder was killed.

    Raises:
        RunConflict: a live runtime.up (it renews the lease) runs the bus's run.
    """
    holder = {"run_id": run_id, "host": socket.gethostname(), "pid": os.getpid(), "run_dir": str(run_dir)}
    lease = KVLease(bus, RUN_BUCKET, SUPERVISOR_LEASE_KEY, json.dumps(holder).encode(), lease_s)
    async with asyncio.timeout(4 * lease_s):  # a lease released meanwhile is tried again, a few times at most
        while not await lease.acquire():
            current = await lease.holder()
            if current is not None:
                raise RunConflict(f"the bus's run is being run by another runtime.up ({current.value.decode()}), "
                                  "which renews its lease: stop it first (ctl.supervisor.stop or Ctrl-C there)")
    return lease


async def _keep_run(lease: KVLease, supervisor: Supervisor) -> None:
    """Renews the run's lease; one lost (this process was frozen or cut off longer than the lease, and
    another runtime.up took the run over) stops this one, failed, so that two never run the run."""
    await lease.keep()
    log.error("run_lease_lost", lease_s=lease.lease_s)
    supervisor.request_stop(Outcome.FAILED, "another runtime.up took the run over: this one lost its lease")


async def _guard_bus(supervisor: Supervisor, bus: Bus, server: NatsServer | NatsCluster | None, url: str,
                     max_outage_s: float, terminal: IO[str] | None) -> None:
    """Keeps the bus up for the run: restarts the embedded server when it dies (on its port and store:
    clients reconnect and carry on), and fails the run, saying why, when the bus stays unreachable
    for longer than ``bus.max_outage_s`` or the server cannot be restarted."""
    try:
        async with asyncio.TaskGroup() as tg:
            if server is not None:
                tg.create_task(server.supervise())
            tg.create_task(bus.health.fail_after_outage(url, max_outage_s))
    except* BusError as group:
        reason = str(group.exceptions[0])
        log.error("bus_lost", url=url, reason=reason)
        if terminal is not None:
            print(f"\nbus lost: {reason}", file=terminal, flush=True)
        supervisor.request_stop(Outcome.FAILED, reason)


async def _record_end(bus: Bus, state: RunState) -> None:
    """Records how the run ended, for whoever follows it (ops.tail ends with it); a bus that is down (a run
    failed for losing it) gets BUS_END_TIMEOUT_S, and the run's exit says the outcome all the same."""
    try:
        async with asyncio.timeout(BUS_END_TIMEOUT_S):
            await publish_run_state(bus, state)
    except (OSError, TimeoutError) as e:  # BusError included
        log.warning("run_end_not_recorded", outcome=state.outcome.value, error=repr(e),
                    consequence="a follower of the run (ops.tail) does not end by itself")


async def _quietly(step: Any) -> None:
    """An exit step that has nothing to undo on a connection that is closed or down."""
    with contextlib.suppress(OSError):  # BusError included
        async with asyncio.timeout(5.0):
            await step()


async def provision_streams(bus: Bus, rt: RuntimeConfig) -> None:
    """Every work queue (stream and durable pull consumer) the run's actor kinds consume or publish into,
    and every bucket they declare, made by the supervisor before it starts them: actor roles may bind to a
    queue's consumer and use a bucket, not create or change either (runtime.bus_auth)."""
    for spec in rt.actors.values():
        cls = import_entry(spec.entry)
        for queue in cls.provisioned_queues():
            await bus.ensure_queue(queue)
        access = cls.required_access()
        for bucket in dict.fromkeys((*access.kv_read, *access.kv_write, *(b for b, _ in access.kv_keys))):
            await bus.ensure_bucket(bucket)  # with the republish rule its watches read (runtime.kv_watch)


def bus_roles(rt: RuntimeConfig) -> dict[str, Permissions]:
    """Each actor kind's permissions on the bus, from what its class declares (runtime.bus_auth)."""
    return {kind: actor_permissions(kind, import_entry(spec.entry).required_access())
            for kind, spec in rt.actors.items()}


async def _publish_live_defaults(bus: Bus, cfg: RunConfig, resumed: bool) -> None:
    """Seeds the config bucket with live keys; a resumed run keeps what operators changed."""
    if cfg.app is None:
        return
    for key, value in config_mod.live_items(cfg.app):
        if resumed:
            with contextlib.suppress(RevisionMismatch):  # set before: keep the operator's value
                await bus.kv_create("config", key, msgpack.packb(value, use_bin_type=True))
        else:
            await bus.kv_put("config", key, msgpack.packb(value, use_bin_type=True))


def _warn_unauthenticated(url: str, remote: bool, terminal: IO[str] | None) -> None:
    """Says, as a warning event and on the terminal, that the run's bus signs in nobody: whoever reaches it may
    read every message, rewrite the slot table, stop actors and publish weights."""
    fix = ("generate a user per role and the servers' configuration with python -m runtime.bus_recipe, then pass "
           "--set bus.credentials_dir=DIR" if remote else "leave bus.auth on (the default)")
    log.warning("bus_unauthenticated", url=url, remote=remote,
                consequence="anyone who reaches the bus can read and change the run: its slots, orders, weights "
                            "announcements and control requests", fix=fix)
    print(f"WARNING: the run's bus at {url} has no authentication: anyone who reaches it can read and change the "
          f"run. To secure it: {fix}.", file=terminal or sys.stderr, flush=True)


def _announce(out: IO[str] | None, run_dir: Path, run_id: str, url: str, storage: str, resumed: bool,
              credentials_dir: str) -> None:
    if out is None:
        return
    access = f"one user per role in {credentials_dir} (ops: operator.json)" if credentials_dir else "no auth"
    print(f"{'resumed' if resumed else 'started'} run  {run_id}  in {run_dir}\n"
          f"  bus        {url}, {access}\n"
          "  control    ctl.supervisor.{status,swap,stop}, ctl.<kind>.<actor-id>.{ping,status,drain}\n"
          f"  storage    {storage}\n"
          f"  event log  {run_dir / 'logs'}  (follow: python -m ops.tail {run_dir})\n"
          f"  status     python -m ops.status {run_dir}\n"
          "  Ctrl-C drains every actor and stops the run.", file=out, flush=True)


def _progress_printer(out: IO[str] | None) -> Any:
    """One line with the latest figures every publisher reported on ``progress.<source>``."""
    latest: dict[str, Any] = {}

    async def show(raw: Inbound) -> None:
        if out is None:
            return
        try:
            fields = msgpack.unpackb(raw.data, raw=False)
        except Exception:
            return
        if isinstance(fields, dict):
            latest.update(fields)
        text = "  ".join(f"{k}={_fmt(v)}" for k, v in latest.items())
        end = "\r" if out.isatty() else "\n"
        print(f"{text:<120}", end=end, file=out, flush=True)

    return show


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _run_dir_for(cfg: RunConfig, resumed: Resumed | None, given: Path | None) -> tuple[str, Path]:
    """The run's id and this machine's directory of it: the resumed one's, ``--run-dir``, or a new one."""
    if resumed is not None and resumed.run_dir is not None:
        return resumed.run_id, resumed.run_dir
    run_id = resumed.run_id if resumed is not None else new_run_id(cfg.runtime.run.name)
    if given is not None:
        run_dir = given.resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_id, run_dir
    return run_id, new_run_dir(cfg.runtime.run.runs_dir, run_id)


def main(argv: list[str] | None = None, *, default_config: Sequence[Path] = (),
         prog: str = "python -m runtime.up") -> int:
    """Run ``python -m runtime.up`` with ``argv``; ``default_config``: the run files used when none is given."""
    args = parse_args(argv, prog)
    try:
        cfg, resumed = resolve_config(args, default_config)
    except ConfigError as e:
        print(f"configuration error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(annotated_toml(cfg), end="")
        return 0
    try:
        run_id, run_dir = _run_dir_for(cfg, resumed, args.run_dir)
    except ConfigError as e:
        print(f"configuration error: {e}", file=sys.stderr)
        return 2
    # The storage resolved into the saved configuration: a run resumed from elsewhere finds its store
    # there, not under its new directory.
    storage = dataclasses.replace(cfg.runtime.storage, url=storage_url_of(cfg.runtime.storage.url, run_id)
                                  or (run_dir / "blobs").as_uri())
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, storage=storage))
    (run_dir / CONFIG_FILE).write_text(dump_toml(cfg.to_toml_tree()))  # this machine's copy
    event_log = EventLog(run_dir / SUPERVISOR_LOG, "supervisor", "supervisor", cfg.runtime.log)
    event_log.install()
    terminal = None if args.quiet else sys.stdout
    try:
        outcome = uvloop.run(serve(cfg, run_dir, run_id, resumed is not None, event_log, terminal))
    except ConfigError as e:  # the bus or the store belongs to another run, or another runtime.up runs this one
        print(f"configuration error: {e}", file=sys.stderr)
        return 2
    except PlacementError as e:  # before any actor started: a cluster that cannot hold the run
        print(f"placement error: {e}", file=sys.stderr)
        return 2
    finally:
        event_log.close()
    return 1 if outcome is Outcome.FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
