"""Live configuration: ``python -m ops.config set KEY VALUE [RUN_DIR]``, ``get KEY [RUN_DIR]`` or ``list [RUN_DIR]``.

Only keys marked live in the run's schema can change while it runs; the value is validated against
the schema here first, so a typo or a wrong type is refused before any actor sees it. ``get`` says a key's
value now (a live key's from the run's bus; a fixed key's as the run started), the values it accepts and
whether it is live. The schema comes from the run's saved configuration, which names it
(``run.config_schema``): no actor's code is imported (the RL actors' torch took seconds of every call).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from ops._client import connect, connect_or_none, fail, resolve_run_dir
from runtime import config as config_mod
from runtime.bus import Bus
from runtime.errors import BusError, ConfigError
from runtime.run_config import RunConfig, load_run_config
from runtime.rundir import CONFIG_FILE

CONNECT_TIMEOUT_S = 3.0  # get: a run whose bus does not answer within this is read from its saved configuration
CONFIG_BUCKET = "config"  # the live keys' current values, which every actor watches


def saved_config(run_dir: Path) -> RunConfig:
    """The run's configuration as it started (its saved file), built with the schema it names alone."""
    return load_run_config([run_dir / CONFIG_FILE], import_actors=False)


def validate(run_dir: Path, key: str, raw_value: str) -> Any:
    cfg = saved_config(run_dir)
    if cfg.app is None:
        raise ConfigError("this run has no live configuration (no actor declares a Config)")
    _, value = config_mod.parse_override(f"{key}={raw_value}")
    if not config_mod.field_is_live(cfg.field(key)):  # an unknown key is refused there, naming the nearest
        live = ", ".join(k for k, _ in config_mod.live_items(cfg.app))
        raise ConfigError(f"config key {key!r} is not live (it is fixed at start); live keys: {live}")
    new = config_mod.apply_value(cfg.app, key, value)  # validates type and range
    return dict(config_mod.live_items(new))[key]


class Malformed(str):
    """A stored value that does not decode; printed as what is wrong with it."""

    def __repr__(self) -> str:
        return f"<malformed: {self}>"


@dataclass(frozen=True)
class Reading:
    """One key as ``get`` says it: its value and what it accepts."""

    key: str
    value: Any  # None: unset (TOML has no null: the saved configuration leaves it out)
    live: bool
    note: str  # runtime.config.key_note: "live, [0, 4]", "[1, 10]" or ""

    def line(self) -> str:
        """``rollout.temperature = 0.7  # live, [0, 4]``; a fixed key says so (``# fixed, [1, 10]``)."""
        note = self.note if self.live else ", ".join(n for n in ("fixed", self.note) if n)
        return f"{self.key} = {'unset' if self.value is None else repr(self.value)}  # {note}"


def started_value(cfg: RunConfig, key: str) -> Any:
    """``key``'s value in the configuration the run started with (None: unset).

    Raises:
        ConfigError: no such key (naming the nearest), or it names a section, not a value.
    """
    cfg.field(key)
    node: Any = cfg.to_toml_tree()  # every field, unset ones as None: a part not in it is a table the run lacks
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"config key {key!r}: the run has no {'.'.join(parts[:i + 1])!r}")
        node = node[part]
    if isinstance(node, dict):
        raise ConfigError(f"config key {key!r} is a section, not a value: name one of its keys "
                          "(python -m actors --print-config shows them)")
    return node


async def read_key(run_dir: Path, key: str) -> tuple[Reading, str]:
    """``key`` as the run has it now, and why its value was not read from the bus ("" when it was): a live key's
    value is the config bucket's, which operators change; a fixed key's is the saved configuration's.

    Raises:
        ConfigError: no such key (naming the nearest), or it names a section.
    """
    cfg = saved_config(run_dir)
    f = cfg.field(key)
    reading = Reading(key, started_value(cfg, key), config_mod.field_is_live(f), config_mod.key_note(f))
    if not reading.live:
        return reading, ""
    bus, why = await connect_or_none(run_dir, "ops-config", CONNECT_TIMEOUT_S)
    if bus is None:
        return reading, why
    try:
        entry = await bus.kv_get(CONFIG_BUCKET, key)
    finally:
        await bus.close()
    if entry is None:  # never written to the bucket: the run seeds every live key at start, so not yet
        return reading, f"the run's bus holds no value of {key} yet"
    return Reading(key, _decoded(entry.value), True, reading.note), ""


async def _set(run_dir: Path, key: str, value: Any) -> None:
    bus = await connect(run_dir, "ops-config")
    try:
        await put_value(bus, key, value)
    finally:
        await bus.close()


async def put_value(bus: Bus, key: str, value: Any) -> None:
    """Write a live key (already validated by `validate`): every actor watching the bucket applies it."""
    await bus.kv_put(CONFIG_BUCKET, key, msgpack.packb(value, use_bin_type=True))


def _decoded(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False)
    except (ValueError, TypeError) as e:  # one bad value is shown as such
        return Malformed(f"not msgpack: {e}")


async def _items(run_dir: Path) -> dict[str, Any]:
    bus = await connect(run_dir, "ops-config")
    try:
        out: dict[str, Any] = {}
        for key in await bus.kv_keys(CONFIG_BUCKET):  # none set: a run without live keys
            entry = await bus.kv_get(CONFIG_BUCKET, key)
            if entry is None:  # deleted since the listing
                continue
            out[key] = _decoded(entry.value)
        return out
    finally:
        await bus.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ops.config", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("set", help="change a live key")
    s.add_argument("key")
    s.add_argument("value", help="read as a TOML value: 0.7, true, \"text\"")
    s.add_argument("run_dir", nargs="?", type=Path)
    g = sub.add_parser("get", help="a key's value now, the values it accepts, and whether it is live")
    g.add_argument("key")
    g.add_argument("run_dir", nargs="?", type=Path)
    ls = sub.add_parser("list", help="the live keys and their current values")
    ls.add_argument("run_dir", nargs="?", type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run_dir = resolve_run_dir(args.run_dir)
        if args.verb == "set":
            value = validate(run_dir, args.key, args.value)
            asyncio.run(_set(run_dir, args.key, value))
            print(f"{args.key} = {value!r}")
        elif args.verb == "get":
            reading, why = asyncio.run(read_key(run_dir, args.key))
            print(reading.line())
            if why:
                print(f"ops.config: {why}: this is its value when the run started", file=sys.stderr)
        else:
            for key, value in sorted(asyncio.run(_items(run_dir)).items()):
                print(f"{key} = {value!r}")
    except (ConfigError, BusError) as e:
        return fail(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
