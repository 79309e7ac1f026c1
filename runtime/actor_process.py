"""Entry point of one actor process: ``python -m runtime.actor_process --run-dir D --kind K --id ID``.

The supervisor starts it; it reads the run's address and configuration from the run directory,
imports the actor class, connects, runs the actor until drained (ctl drain or SIGTERM), and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

import structlog
import uvloop

from runtime.actor import ActorContext, ActorIdentity, ActorSettings
from runtime.blob import open_store
from runtime.bus import Bus, BusLimits
from runtime.codehash import code_hash
from runtime.events import EventLog
from runtime.procutil import lower_priority
from runtime.ready_samples import ReadySamples
from runtime.run_config import import_entry, load_run_config
from runtime.rundir import CONFIG_FILE, RunInfo


async def _serve(run_dir: Path, kind: str, actor_id: str, event_log: EventLog, standby: bool = False) -> None:
    log = structlog.get_logger("runtime.actor_process")
    info = RunInfo.read(run_dir)
    cfg = load_run_config([run_dir / CONFIG_FILE])
    spec = cfg.runtime.actors[kind]
    cls = import_entry(spec.entry)
    module_file = Path(sys.modules[spec.entry.partition(":")[0]].__file__ or ".").resolve()
    identity = ActorIdentity.here(kind, actor_id, code_hash(extra_roots=(module_file.parent,)))
    bus = await Bus.connect(info.nats_url, name=actor_id, limits=BusLimits(ack_wait_s=cfg.runtime.bus.ack_wait_s),
                            **info.bus_options(kind))
    blob = open_store(info.storage_url, s3_endpoint=info.s3_endpoint or None)
    settings = ActorSettings(max_concurrency=spec.max_concurrency, heartbeat_s=spec.heartbeat_s,
                             drain_timeout_s=spec.drain_timeout_s, max_deliveries=spec.max_deliveries,
                             lease_s=spec.lease_s)
    actor = cls(ActorContext(identity, bus, settings, cfg.app, blob, run_dir, cfg.runtime.run,
                             ReadySamples.from_environment(str(run_dir))))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, actor.request_drain)
    try:
        async with asyncio.TaskGroup() as tg:
            forwarder = tg.create_task(event_log.forward(bus))
            try:
                await actor.start()
                if standby:
                    await actor.stand_by()
                await actor.run()
            finally:
                forwarder.cancel()
    except BaseException as e:
        log.error("actor_crashed", error=repr(e), exc_info=True)
        raise
    finally:
        await bus.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--kind", required=True)
    parser.add_argument("--id", required=True, dest="actor_id")
    parser.add_argument("--standby", action="store_true", help="set up, then wait to be activated (a warm spare)")
    args = parser.parse_args(argv)
    cfg = load_run_config([args.run_dir / CONFIG_FILE])
    # Here, not in the spawn's preexec_fn: uvloop runs that before the child's setsid, where the
    # autogroup written would still be the supervisor's.
    lower_priority(cfg.runtime.actors[args.kind].nice)
    event_log = EventLog(args.run_dir / "logs" / f"{args.actor_id}.jsonl", args.kind, args.actor_id,
                         cfg.runtime.log)
    event_log.install()
    try:
        uvloop.run(_serve(args.run_dir, args.kind, args.actor_id, event_log, args.standby))
    finally:
        event_log.close()


if __name__ == "__main__":
    main()
