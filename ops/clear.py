"""Free the bus of a run that has ended, for a new run:
``python -m ops.clear RUN_ID --set bus.url=nats://... [--set bus.credentials_dir=DIR] [--force]``.

One bus carries one run: its streams and buckets (the slot table, the work queues, the registry, the event
log) are not named per run, so a second run on them would take the first one's slots and orders for its own.
A new run therefore starts on an empty bus, and this command empties one: it deletes every stream and bucket
of the bus's account, connected as the supervisor (``supervisor.json`` of the credentials directory, if the
bus takes credentials).

The run's store is left as it is: its checkpoints, metrics, samples and record stay (``ops.plot``,
``ops.dashboard`` read them), and a new run takes a store of its own (``storage.url=s3://bucket/runs/{run_id}``
fills in each run's id). The cleared run can no longer be resumed: its slot table is gone.

Refused unless the bus carries RUN_ID (named, so that a slip clears nothing), no runtime.up holds the run's
lease, and the run has ended (finished, stopped or failed); ``--force`` also clears a run whose runtime.up was
killed (it recorded no end).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from ops._client import fail
from runtime.bus import Bus
from runtime.bus_auth import SUPERVISOR, read_credentials, tls_context
from runtime.errors import BusError, ConfigError
from runtime.run_config import BusSection, runtime_from_overrides
from runtime.run_state import RUN_BUCKET, STATE_KEY, RunConflict, RunState, check_run_id, read_run_record
from runtime.up import SUPERVISOR_LEASE_KEY


async def clear(run_id: str, section: BusSection, *, force: bool = False) -> list[str]:
    """Deletes every stream and bucket of the bus that carries ``run_id``; returns their names.

    Raises:
        ConfigError: no bus URL, the bus unreachable, or it carries another run, a live one, or (without
            ``force``) one that recorded no end.
    """
    check_run_id(run_id)
    if not section.url:
        raise ConfigError("clearing a bus needs its address: --set bus.url=nats://host:4222")
    credentials = read_credentials(section.credentials_dir, SUPERVISOR) if section.credentials_dir else None
    try:
        bus = await Bus.connect(section.url, name="ops-clear", credentials=credentials,
                                tls=tls_context(section.tls_ca_file, section.tls_cert_file, section.tls_key_file))
    except BusError as e:
        raise ConfigError(f"cannot reach the bus {section.url}: {e}") from None
    try:
        record = await read_run_record(bus)
        if record is None or record.run_id != run_id:
            held = "no run" if record is None else f"run {record.run_id!r}"
            raise RunConflict(f"the bus {section.url} carries {held}, not {run_id!r}: nothing cleared")
        if (holder := await bus.kv_get(RUN_BUCKET, SUPERVISOR_LEASE_KEY)) is not None:
            raise RunConflict(f"run {run_id!r} is being run ({holder.value.decode()}): stop it first "
                              "(Ctrl-C there, or ctl.supervisor.stop); nothing cleared")
        entry = await bus.kv_get(RUN_BUCKET, STATE_KEY)
        state = None if entry is None else RunState.from_bytes(entry.value, f"the bus bucket {RUN_BUCKET!r}")
        if (state is None or not state.ended) and not force:
            raise RunConflict(f"run {run_id!r} recorded no end (its runtime.up was killed?): resume it with "
                              f"--resume {run_id}, or pass --force to clear it all the same; nothing cleared")
        return await bus.delete_streams()
    finally:
        await bus.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ops.clear", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_id", help="the run the bus carries (ops.status shows it; so does a refused start)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="bus.url (required), bus.credentials_dir, bus.tls_*")
    p.add_argument("--force", action="store_true", help="also clear a run that recorded no end")
    args = p.parse_args(argv)
    try:
        names = asyncio.run(clear(args.run_id, runtime_from_overrides(args.overrides).bus, force=args.force))
    except (ConfigError, BusError) as e:
        return fail(str(e))
    print(f"cleared run {args.run_id} from its bus: {len(names)} streams and buckets deleted ({', '.join(names)}); "
          "its store is kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
