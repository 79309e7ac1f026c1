"""The runtime's own configuration sections, and the split between them and the application's.

A run file has the runtime's tables (``run``, ``bus``, ``storage``, ``supervisor``, ``log``,
``actors.<kind>``) and the application's sections (everything else), which the actor classes'
shared ``Config`` dataclass validates. All actor kinds of one run share that one schema.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from runtime import config as config_mod
from runtime.bus import BusLimits
from runtime.errors import ConfigError
from runtime.events import EventLogConfig

RUNTIME_SECTIONS = ("run", "bus", "storage", "supervisor", "log", "actors")


@dataclass(frozen=True)
class RunSection:
    name: str = "run"
    runs_dir: Path = Path("runs")
    seed: int = 0
    steps: int = 0  # 0: until stopped; the application decides what a step is and reports finish

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"run.steps={self.steps} must be >= 0")


@dataclass(frozen=True)
class BusSection:
    url: str = ""  # empty: start an embedded nats-server in the run directory
    max_payload_bytes: int = 8 * 1024 * 1024
    ack_wait_s: float = 30.0
    max_outage_s: float = 60.0  # the bus unreachable for longer than this fails the run, saying so
    server_max_restarts: int = 5  # the embedded server, died on its own, is restarted at most this often ...
    server_restart_window_s: float = 60.0  # ... within this window (on its port and JetStream store)

    def __post_init__(self) -> None:
        if not 1.0 <= self.max_outage_s <= 24 * 3600:
            raise ValueError(f"bus.max_outage_s={self.max_outage_s} must be within 1..86400 seconds")
        if self.server_max_restarts < 0 or self.server_restart_window_s <= 0:
            raise ValueError(f"bus.server_max_restarts={self.server_max_restarts} must be >= 0 and "
                             f"bus.server_restart_window_s={self.server_restart_window_s} > 0")


@dataclass(frozen=True)
class StorageSection:
    url: str = ""  # empty: file://<run dir>/blobs; or s3://bucket/prefix
    s3_endpoint: str = ""  # for any S3-compatible endpoint (moto, MinIO); empty: AWS default


@dataclass(frozen=True)
class SupervisorSection:
    max_restarts: int = 5  # OTP intensity: more than this many restarts ...
    restart_window_s: float = 60.0  # ... within this window fails the run
    backoff_base_s: float = 0.5
    backoff_max_s: float = 10.0
    drain_timeout_s: float = 60.0
    term_timeout_s: float = 10.0
    ready_timeout_s: float = 120.0  # a replacement must be consuming within this during a hot swap
    stall_s: float = 600.0  # nothing acknowledged on any queue for this long: say so, naming the stage (0: off)

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.restart_window_s <= 0:
            raise ValueError("supervisor.max_restarts must be >= 0 and restart_window_s > 0")
        if self.stall_s != 0 and not 1.0 <= self.stall_s <= 7 * 24 * 3600:
            raise ValueError(f"supervisor.stall_s={self.stall_s} must be 0 (off) or within 1..604800 seconds")

    def backoff(self, num_recent_restarts: int) -> float:
        return min(self.backoff_max_s, self.backoff_base_s * 2 ** max(0, num_recent_restarts - 1))


@dataclass(frozen=True)
class ActorSpec:
    """One actor kind: its class as ``module:Class`` (as gunicorn or uvicorn name apps), how many."""

    entry: str
    count: int = 1
    max_concurrency: int = 8
    heartbeat_s: float = 5.0
    drain_timeout_s: float = 60.0
    threads: int = 0  # torch intra-op threads in the process; 0 leaves the default
    nice: int = 0  # CPU priority below the others' (0 to 19): a side job gives way to the pipeline
    max_deliveries: int = 5  # handlings of one message before it is dead-lettered with its last error

    def __post_init__(self) -> None:
        if ":" not in self.entry:
            raise ValueError(f"entry {self.entry!r} must look like package.module:ClassName")
        if self.count < 0:
            raise ValueError(f"count={self.count} must be >= 0")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"nice={self.nice} must be in 0..19 (0: the same priority as every other actor)")
        if not 1 <= self.max_deliveries < BusLimits().max_deliver:
            raise ValueError(f"max_deliveries={self.max_deliveries} must be in 1..{BusLimits().max_deliver - 1} "
                             "(below the consumer's max_deliver, where the server stops delivering silently)")


@dataclass(frozen=True)
class RuntimeConfig:
    run: RunSection = RunSection()
    bus: BusSection = BusSection()
    storage: StorageSection = StorageSection()
    supervisor: SupervisorSection = SupervisorSection()
    log: EventLogConfig = EventLogConfig()
    actors: dict[str, ActorSpec] = field(default_factory=dict)


@dataclass(frozen=True)
class RunConfig:
    """The whole configuration of a run: the runtime's part and the application's (or None)."""

    runtime: RuntimeConfig
    app: Any
    app_schema: type | None

    def to_toml_tree(self) -> dict[str, Any]:
        tree = config_mod.to_dict(self.runtime)
        if self.app is not None:
            tree.update(config_mod.to_dict(self.app))
        return tree


def import_entry(entry: str) -> type:
    module_name, _, attr = entry.partition(":")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"actor entry {entry!r} cannot be imported: {e}") from e


def app_schema_of(specs: dict[str, ActorSpec]) -> type | None:
    schemas = {cls.Config for spec in specs.values() if (cls := import_entry(spec.entry)).Config}
    if len(schemas) > 1:
        names = ", ".join(sorted(s.__qualname__ for s in schemas))
        raise ConfigError(f"the actor kinds of one run must share one Config schema; found {names}")
    return next(iter(schemas), None)


def load_run_config(files: Iterable[Path] = (), overrides: Iterable[str] = ()) -> RunConfig:
    tree = config_mod.read_files(files)
    runtime_tree = {k: v for k, v in tree.items() if k in RUNTIME_SECTIONS}
    app_tree = {k: v for k, v in tree.items() if k not in RUNTIME_SECTIONS}
    app_overrides = []
    for text in overrides:
        key, value = config_mod.parse_override(text)
        if key.split(".", 1)[0] in RUNTIME_SECTIONS:
            if not key.startswith("actors."):
                config_mod.field_at(RuntimeConfig, key)
            config_mod.set_path(runtime_tree, key, value)
        else:
            app_overrides.append((key, value))
    runtime = config_mod.build(RuntimeConfig, runtime_tree)
    schema = app_schema_of(runtime.actors)
    if schema is None:
        if app_tree or app_overrides:
            keys = sorted(app_tree) + [k for k, _ in app_overrides]
            raise ConfigError(f"config sections {keys} are unknown: no actor of this run has a Config")
        return RunConfig(runtime, None, None)
    for key, value in app_overrides:
        config_mod.field_at(schema, key)
        config_mod.set_path(app_tree, key, value)
    return RunConfig(runtime, config_mod.build(schema, app_tree), schema)


def dump_toml(tree: dict[str, Any]) -> str:
    """The TOML text of a resolved config (tomli-w: strings with newlines, quotes or control characters,
    keys that need quoting and arrays of tables are written as TOML reads them back). TOML has no null:
    keys whose value is None are left out, so reading the file back gives their defaults."""
    return tomli_w.dumps(_without_none(tree))


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        if any(v is None for v in value):
            raise TypeError(f"cannot write {value!r} as TOML: arrays may not hold None")
        return [_without_none(v) for v in value]
    return value
