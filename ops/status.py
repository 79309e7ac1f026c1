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

from ops._client import connect, fail, request, resolve_run_dir
from runtime.bus import Bus
from runtime.bus_auth import control_subject
from runtime.errors import BusError, ConfigError
from runtime.registry import decode_registration, is_registration_key


async def collect(run_dir: Path) -> dict[str, Any]:
    bus = await connect(run_dir, "ops-status")
    try:
        return await snapshot(bus)
    finally:
        await bus.close()


async def snapshot(bus: Bus) -> dict[str, Any]:
    """The actors (registry entries, each marked live or not) and the reconciler's and trainer's status."""
    actors, malformed = await registered(bus)
    live = await _live_ids(bus)
    for actor in actors:
        # A process killed with SIGKILL never deregisters: trust the supervisor's process list.
        actor["live"] = live is None or actor["id"] in live
    status: dict[str, Any] = {"actors": sorted(actors, key=lambda a: (a["kind"], a["id"]))}
    if malformed:
        status["malformed_entries"] = malformed
    for actor in actors:
        if actor["kind"] in ("reconciler", "trainer") and actor["live"] and actor.get("state") == "running":
            try:
                status[actor["kind"]] = await request(bus, control_subject(actor["kind"], actor["id"], "status"))
            except BusError as e:  # restarting, or wedged: say so, keep the rest of the picture
                status.setdefault("unanswered", []).append({"id": actor["id"], "error": str(e)})
    return status


async def registered(bus: Bus) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """The registered actors, and the entries that are not actor records (each with what is wrong):
    one malformed entry is reported beside the others, never a traceback instead of all of them."""
    actors, malformed = [], []
    for entry in await bus.kv_items("actors"):  # one bulk read: a request per key would cost a scrape of 10^3
        if not is_registration_key(entry.key):  # actors 10^3 round trips; state a stopped process left for
            continue  # its replacement
        try:
            actors.append(decode_registration(entry.key, entry.value))
        except ValueError as e:
            malformed.append({"key": entry.key, "error": str(e)})
    return actors, malformed


async def _live_ids(bus: Bus) -> set[str] | None:
    """Ids of the processes the supervisor runs now; None if it does not answer."""
    try:
        reply = await request(bus, "ctl.supervisor.status", timeout_s=2.0)
    except BusError:
        return None
    return {a["id"] for a in reply.get("actors", [])}


def render(status: dict[str, Any]) -> str:
    lines = ["actors:"]
    for a in status["actors"]:
        lines.append(
            f"  {a['kind']:<11} {a['id']:<22} pid={a['pid']:<7} code={a['code_hash']} "
            f"state={a['state'] if a.get('live', True) else 'gone':<9} handled={a['num_handled']} "
            f"failed={a['num_failed']} inflight={a['num_inflight']}"
        )
    for missing in status.get("unanswered", []):
        lines.append(f"  no status from {missing['id']}: {missing['error']}")
    for bad in status.get("malformed_entries", []):
        lines.append(f"  malformed {bad['error']}")  # the error names the entry: "registry entry 'k' ..."
    rec = status.get("reconciler")
    if rec:
        lines.extend(_render_lifecycle(rec))
    trainer = status.get("trainer")
    if trainer:
        lines.append(f"trainer: version={trainer.get('version')} trained_batches={trainer.get('num_trained_batches')}")
    return "\n".join(lines)


def _render_lifecycle(rec: dict[str, Any]) -> list[str]:
    lc = rec["lifecycle"]
    latency = (
        " | ".join(
            f"{stage} p50={v['p50_s'] * 1e3:.1f}ms p99={v['p99_s'] * 1e3:.1f}ms n={v['count']}"
            for stage, v in lc["stage_latency"].items()
        )
        or "-"
    )
    return [
        f"reconciler: trainer_version={rec['trainer_version']} finished={rec['finished']} "
        f"eta={rec['scheduling']['eta']} cursor={lc['cursor_epoch']}:{lc['cursor_position']}",
        f"  slots       {_pairs(lc['slots_per_state'])} (total {sum(lc['slots_per_state'].values())})",
        f"  latency     {latency}",
        f"  admission   {_pairs(lc['admissions'])}",
        f"  batch waits {_pairs(lc['batch_waits'])}",
        f"  lag         {_pairs(lc['lag_histogram'])} (trainer version - token version: samples)",
        f"  throughput  {lc['samples_per_s']:.2f} samples/s  {lc['groups_per_s']:.2f} groups/s",
        f"  counters    {_pairs(lc['counters'])}",
    ]


def _pairs(values: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in values.items()) or "-"


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
