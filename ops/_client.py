"""What every ops command does first: find the run, connect to its bus, ask and decode a reply."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import msgpack

from runtime.bus import Bus
from runtime.bus_auth import OPERATOR
from runtime.errors import BusError, ConfigError
from runtime.run_state import read_run_record
from runtime.rundir import RunInfo, latest_run_dir


def resolve_run_dir(run_dir: Path | None, runs_dir: Path = Path("runs")) -> Path:
    if run_dir is not None:
        return run_dir
    latest = latest_run_dir(runs_dir)
    if latest is None:
        raise ConfigError(f"no run directory given and none found under {runs_dir}/; pass RUN_DIR")
    return latest


async def connect(run_dir: Path, name: str) -> Bus:
    """The bus of the run in ``run_dir``, as the operator.

    Raises:
        BusError: no server answers at the run's address, or one does that carries another run (the run's
            own server is gone and another took its port): never a bus of the wrong run.
    """
    info = RunInfo.read(run_dir)
    bus = await Bus.connect(info.nats_url, name=name, **info.bus_options(OPERATOR))
    try:
        record = await read_run_record(bus)
    except BaseException:
        await bus.close()
        raise
    if record is None or record.run_id != info.run:
        await bus.close()
        held = "no run" if record is None else f"run {record.run_id!r}"
        raise BusError(f"the bus at {info.nats_url} carries {held}, not run {info.run!r}: the run's own server is "
                       "gone and another took its address")
    return bus


async def connect_or_none(run_dir: Path, name: str, timeout_s: float) -> tuple[Bus | None, str]:
    """The run's bus as the operator, or None and why when it does not answer within ``timeout_s``
    (a finished run, or one whose server is down): the caller then reads the run's files instead."""
    try:
        return await asyncio.wait_for(connect(run_dir, name), timeout_s), ""
    except (TimeoutError, BusError, ConfigError) as e:
        return None, str(e) or f"no answer within {timeout_s}s"


async def request(bus: Bus, subject: str, body: dict[str, Any] | None = None,
                  timeout_s: float = 5.0) -> dict[str, Any]:
    payload = msgpack.packb(body or {}, use_bin_type=True)
    try:
        reply = await bus.request(subject, payload, timeout_s=timeout_s)
    except OSError as e:  # BusError (no responder, timeout, refused) or the connection's own failure
        raise BusError(f"no reply on {subject} within {timeout_s}s ({e}); is the run still up?") from e
    return msgpack.unpackb(reply, raw=False)


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2
