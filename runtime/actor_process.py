"""Entry point of one actor process: ``python -m runtime.actor_process --bus URL --run RUN --kind K --id ID``.

A placement backend starts it (`runtime.actor_launch` builds its command and environment). It finds
its run from the bus address and the run id alone (the bus's run record names the blob store, the
store holds the resolved configuration: `runtime.run_state`), imports the actor class, runs the actor
until drained (ctl drain or SIGTERM), and exits 0. ``--run-dir`` is its local cache and log folder
(default ``runs/<run id>``); nothing in it is read.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

import structlog
import uvloop

from runtime.actor import ActorContext, ActorIdentity, ActorSettings
from runtime.actor_launch import bus_options_from_env
from runtime.blob import BlobStore, open_store
from runtime.bus import Bus
from runtime.codehash import code_hash
from runtime.errors import ConfigError
from runtime.events import EventLog
from runtime.procutil import lower_priority
from runtime.ready_samples import ReadySamples
from runtime.run_config import RunConfig, import_entry, load_kind_config
from runtime.run_state import RunNotFound, check_run_id, read_run_config, read_run_record
from runtime.rundir import CONFIG_FILE

CONNECT_TIMEOUT_S = 30.0  # the bus of a run being resumed may still be electing its leaders


async def find_run(bus: Bus, run_id: str, run_dir: Path, kind: str) -> tuple[RunConfig, BlobStore]:
    """The run's configuration as a process of ``kind`` needs it (cached in ``run_dir``) and blob store, from the
    bus's run record.

    Raises:
        RunNotFound, RunConflict: the bus or its store carries no run, or another one.
        ConfigError: the run has no actor kind ``kind``.
    """
    record = await read_run_record(bus)
    if record is None or record.run_id != run_id:
        held = "no run" if record is None else f"run {record.run_id!r}"
        raise RunNotFound(f"the bus carries {held}, not run {run_id!r}")
    blob = open_store(record.storage_url, s3_endpoint=record.s3_endpoint or None)
    try:
        text = await read_run_config(blob, run_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        cached = run_dir / CONFIG_FILE
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, cached)
        return load_kind_config([cached], kind), blob
    except BaseException:
        await blob.close()
        raise


async def _serve(args: argparse.Namespace) -> None:
    bus_options = bus_options_from_env(os.environ)
    async with asyncio.timeout(CONNECT_TIMEOUT_S):
        bus = await Bus.connect(args.bus, name=args.actor_id, **bus_options)
    try:
        cfg, blob = await find_run(bus, args.run, args.run_dir, args.kind)
    except BaseException:
        await bus.close()
        raise
    spec = cfg.runtime.actors[args.kind]
    lower_priority(spec.nice)
    event_log = EventLog(args.run_dir / "logs" / f"{args.actor_id}.jsonl", args.kind, args.actor_id, cfg.runtime.log)
    event_log.install()
    log = structlog.get_logger("runtime.actor_process")
    try:
        # the run's ack wait, for the consumers the actor makes (what the connection used is the same default)
        bus.limits = cfg.runtime.bus.limits()
        cls = import_entry(spec.entry)
        module_file = Path(sys.modules[spec.entry.partition(":")[0]].__file__ or ".").resolve()
        identity = ActorIdentity.here(args.kind, args.actor_id, code_hash(extra_roots=(module_file.parent,)))
        settings = ActorSettings(max_concurrency=spec.max_concurrency, heartbeat_s=spec.heartbeat_s,
                                 drain_timeout_s=spec.drain_timeout_s, max_deliveries=spec.max_deliveries,
                                 lease_s=spec.lease_s)
        actor = cls(ActorContext(identity, bus, settings, cfg.app, blob, args.run_dir, cfg.runtime.run, args.run,
                                 ReadySamples.from_environment(str(args.run_dir))))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, actor.request_drain)
        async with asyncio.TaskGroup() as tg:
            forwarder = tg.create_task(event_log.forward(bus))
            try:
                await actor.start()
                if args.standby:
                    await actor.stand_by()
                await actor.run()
            finally:
                forwarder.cancel()
    except BaseException as e:
        log.error("actor_crashed", error=repr(e), exc_info=True)
        raise
    finally:
        await bus.close()
        await blob.close()
        event_log.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bus", required=True, help="the run's bus URL (nats://host:port)")
    parser.add_argument("--run", required=True, help="the run's id")
    parser.add_argument("--run-dir", type=Path, help="local cache and log folder (default: runs/<run id>)")
    parser.add_argument("--kind", required=True)
    parser.add_argument("--id", required=True, dest="actor_id")
    parser.add_argument("--standby", action="store_true", help="set up, then wait to be activated (a warm spare)")
    args = parser.parse_args(argv)
    try:
        check_run_id(args.run)
    except ConfigError as e:
        parser.error(str(e))
    args.run_dir = (args.run_dir or Path("runs") / args.run).resolve()
    uvloop.run(_serve(args))


if __name__ == "__main__":
    main()
