"""Live configuration: ``python -m ops.config set KEY VALUE [RUN_DIR]`` or ``get KEY`` or ``list``.

Only keys marked live in the run's schema can change while it runs; the value is validated against
the schema here first, so a typo or a wrong type is refused before any actor sees it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import msgpack

from ops._client import connect, fail, resolve_run_dir
from runtime import config as config_mod
from runtime.bus import Bus
from runtime.errors import BusError, ConfigError
from runtime.run_config import load_run_config
from runtime.rundir import CONFIG_FILE


def validate(run_dir: Path, key: str, raw_value: str) -> Any:
    cfg = load_run_config([run_dir / CONFIG_FILE], import_actors=False)  # the schema alone, no actor's torch
    if cfg.app is None:
        raise ConfigError("this run has no live configuration (no actor declares a Config)")
    _, value = config_mod.parse_override(f"{key}={raw_value}")
    if not config_mod.is_live(cfg.app_schema, key):
        live = ", ".join(k for k, _ in config_mod.live_items(cfg.app))
        raise ConfigError(f"config key {key!r} is not live (it is fixed at start); live keys: {live}")
    new = config_mod.apply_value(cfg.app, key, value)  # validates type and range
    return dict(config_mod.live_items(new))[key]


class Malformed(str):
    """A stored value that does not decode; printed as what is wrong with it."""

    def __repr__(self) -> str:
        return f"<malformed: {self}>"


async def _set(run_dir: Path, key: str, value: Any) -> None:
    bus = await connect(run_dir, "ops-config")
    try:
        await put_value(bus, key, value)
    finally:
        await bus.close()


async def put_value(bus: Bus, key: str, value: Any) -> None:
    """Write a live key (already validated by `validate`): every actor watching the bucket applies it."""
    await bus.kv_put("config", key, msgpack.packb(value, use_bin_type=True))


async def _items(run_dir: Path) -> dict[str, Any]:
    bus = await connect(run_dir, "ops-config")
    try:
        out: dict[str, Any] = {}
        for key in await bus.kv_keys("config"):  # none set: a run without live keys
            entry = await bus.kv_get("config", key)
            if entry is None:  # deleted since the listing
                continue
            try:
                out[key] = msgpack.unpackb(entry.value, raw=False)
            except (ValueError, TypeError) as e:  # one bad value is shown as such, beside the others
                out[key] = Malformed(f"not msgpack: {e}")
        return out
    finally:
        await bus.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ops.config", description=__doc__)
    sub = p.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("set", help="change a live key")
    s.add_argument("key")
    s.add_argument("value", help="read as a TOML value: 0.7, true, \"text\"")
    s.add_argument("run_dir", nargs="?", type=Path)
    g = sub.add_parser("list", help="the live keys and their current values")
    g.add_argument("run_dir", nargs="?", type=Path)
    args = p.parse_args(argv)
    try:
        run_dir = resolve_run_dir(args.run_dir)
        if args.verb == "set":
            value = validate(run_dir, args.key, args.value)
            asyncio.run(_set(run_dir, args.key, value))
            print(f"{args.key} = {value!r}")
        else:
            for key, value in sorted(asyncio.run(_items(run_dir)).items()):
                print(f"{key} = {value!r}")
    except (ConfigError, BusError) as e:
        return fail(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
