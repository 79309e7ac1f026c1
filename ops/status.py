"""A live run at a glance: ``python -m ops.status [RUN_DIR] [--json] [--watch SECONDS]``.

Prints the actors (kind, id, pid, code hash, state), the reconciler's slot table (slots per state,
per-stage latency p50/p99, admission decisions, lag histogram, samples and groups per second) and
the trainer's version.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import msgpack

from ops._client import connect, fail, request, resolve_run_dir
from runtime.errors import BusError, ConfigError


async def collect(run_dir: Path) -> dict[str, Any]:
    bus = await connect(run_dir, "ops-status")
    try:
        kv = await bus.kv("actors")
        actors = []
        try:
            keys = await kv.keys()
        except Exception:
            keys = []
        for key in keys:
            entry = await kv.get(key)
            info = msgpack.unpackb(entry.value, raw=False) if entry.value else {}
            if "kind" in info:
                actors.append(info)
        status: dict[str, Any] = {"actors": sorted(actors, key=lambda a: (a["kind"], a["id"]))}
        for actor in actors:
            if actor["kind"] in ("reconciler", "trainer") and actor.get("state") == "running":
                status[actor["kind"]] = await request(bus, f"ctl.{actor['id']}.status")
        return status
    finally:
        await bus.close()


def render(status: dict[str, Any]) -> str:
    lines = ["actors:"]
    for a in status["actors"]:
        lines.append(f"  {a['kind']:<11} {a['id']:<22} pid={a['pid']:<7} code={a['code_hash']} "
                     f"state={a['state']:<9} handled={a['num_handled']} failed={a['num_failed']} "
                     f"inflight={a['num_inflight']}")
    rec = status.get("reconciler")
    if rec:
        lc = rec["lifecycle"]
        lines.append(f"reconciler: trainer_version={rec['trainer_version']} finished={rec['finished']} "
                     f"eta={rec['scheduling']['eta']}")
        for key, value in lc.items():
            lines.append(f"  {key}: {json.dumps(value)}")
    trainer = status.get("trainer")
    if trainer:
        lines.append(f"trainer: version={trainer.get('version')} trained_batches={trainer.get('num_trained_batches')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ops.status", description=__doc__)
    p.add_argument("run_dir", nargs="?", type=Path)
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    p.add_argument("--watch", type=float, default=0.0, metavar="SECONDS", help="refresh every SECONDS")
    args = p.parse_args(argv)
    try:
        run_dir = resolve_run_dir(args.run_dir)
        while True:
            status = asyncio.run(collect(run_dir))
            print(json.dumps(status) if args.json else render(status), flush=True)
            if not args.watch:
                return 0
            asyncio.run(asyncio.sleep(args.watch))
    except (ConfigError, BusError) as e:
        return fail(str(e))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
