"""Hot-swap an actor kind: ``python -m ops.swap KIND [RUN_DIR]``.

The supervisor starts replacement processes of KIND from the code now on disk, waits until they
consume, drains the old ones (they finish and ack their in-flight work), and reports both code hashes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from ops._client import connect, fail, request, resolve_run_dir
from runtime.errors import BusError, ConfigError
from runtime.supervisor import SUPERVISOR_SUBJECT


async def swap(run_dir: Path, kind: str, timeout_s: float) -> dict:
    bus = await connect(run_dir, "ops-swap")
    try:
        return await request(bus, f"{SUPERVISOR_SUBJECT}.swap", {"kind": kind}, timeout_s)
    finally:
        await bus.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ops.swap", description=__doc__)
    p.add_argument("kind")
    p.add_argument("run_dir", nargs="?", type=Path)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the swap")
    args = p.parse_args(argv)
    try:
        report = asyncio.run(swap(resolve_run_dir(args.run_dir), args.kind, args.timeout))
    except (ConfigError, BusError) as e:
        return fail(str(e))
    if not report.get("ok"):
        return fail(f"swap of {args.kind} failed: {report.get('error')}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
