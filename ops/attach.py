"""Attach this machine to a run it did not start:
``python -m ops.attach RUN_ID --set bus.url=nats://... [--set bus.credentials_dir=DIR] [--run-dir DIR]``.

Writes DIR (default ``runs/<run id>``) as this machine's cache of the run, from the run's bus and blob
store (``runtime.run_state``): its address (``run.json``) and resolved configuration (``config.toml``).
Every ops command then takes DIR: ``ops.status DIR``, ``ops.tail DIR``, ``ops.config set ... DIR``,
``ops.swap``, ``ops.plot DIR``, ``ops.dashboard DIR``. The bus is reached as the operator
(``operator.json`` of the credentials directory, if the bus takes credentials).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from ops._client import fail
from runtime.bus_auth import OPERATOR
from runtime.errors import ConfigError
from runtime.run_config import runtime_from_overrides
from runtime.run_state import check_run_id, find_run
from runtime.rundir import CONFIG_FILE, RunInfo


def attach(run_id: str, overrides: list[str], run_dir: Path | None) -> Path:
    """Writes this machine's cache of run ``run_id`` and returns its directory.

    Raises:
        ConfigError: the run cannot be found (no bus URL, unreachable, not the bus's or the store's run).
    """
    check_run_id(run_id)
    rt = runtime_from_overrides(overrides)
    record, config_text, storage_url = asyncio.run(find_run(run_id, rt.bus, rt.storage, OPERATOR))
    directory = (run_dir or Path("runs") / run_id).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(config_text)
    RunInfo(str(directory), rt.bus.url, storage_url, rt.storage.s3_endpoint or record.s3_endpoint, 0,
            record.created_at, rt.bus.credentials_dir, rt.bus.tls_ca_file, rt.bus.tls_cert_file, rt.bus.tls_key_file,
            run_id).write()
    return directory


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ops.attach", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_id")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="bus.url (required), bus.credentials_dir, bus.tls_*, storage.url, storage.s3_endpoint")
    p.add_argument("--run-dir", type=Path, help="this machine's folder for the run (default: runs/<run id>)")
    args = p.parse_args(argv)
    try:
        directory = attach(args.run_id, args.overrides, args.run_dir)
    except ConfigError as e:
        return fail(str(e))
    print(f"attached run {args.run_id} in {directory}: python -m ops.status {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
