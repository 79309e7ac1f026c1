"""The runtime's own configuration sections, and the split between them and the application's.

A run file has the runtime's tables (``run``, ``bus``, ``storage``, ``supervisor``, ``log``,
``actors.<kind>``) and the application's sections (everything else), which the actor classes'
shared ``Config`` dataclass validates. All actor kinds of one run share that one schema.
"""

from __future__ import annotations

import dataclasses
import importlib
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from runtime import config as config_mod
from runtime.backoff import doubling
from runtime.bus import BusLimits, server_urls
from runtime.config import Range, check_ranges, fixed
from runtime.errors import ConfigError
from runtime.events import EventLogConfig

RUNTIME_SECTIONS = ("run", "runtime", "bus", "storage", "supervisor", "health", "log", "dashboard", "actors")
BACKENDS = ("local", "ray")
STRATEGIES = ("default", "spread", "pack")


@dataclass(frozen=True)
class RunSection:
    name: str = "run"
    runs_dir: Path = Path("runs")
    seed: int = fixed(0, within=Range(0, 2**63 - 1))
    # 0: until stopped; the application decides what a step is and reports finish
    steps: int = fixed(0, within=Range(0, 100_000_000))
    # The application's configuration class (the Config its actor classes share) as package.module:Class; empty:
    # found by importing every actor class. A run's start imports them all and checks they agree with it; the
    # configuration saved with the run names it, so that what only reads a configuration (ops.config, --print-config
    # of a run file that names it) imports that one module, not every actor's code (torch: seconds of CPU).
    config_schema: str = ""

    def __post_init__(self) -> None:
        check_ranges(self, "run")


@dataclass(frozen=True)
class BackendSection:
    """The ``[runtime]`` table: where the supervisor places actor processes (runtime.placement)."""

    backend: str = "local"  # "local": subprocesses of runtime.up; "ray": Ray actors on a Ray cluster
    ray_address: str = ""  # a running cluster ("auto", "host:6379"); empty: start a local Ray head
    # code on a cluster's nodes: empty, the nodes see the supervisor's code at its paths (one image or a
    # shared filesystem); a directory, shipped to every node as Ray's runtime_env working_dir at each start
    # (content-addressed: a hot swap after the code changed ships the new code, unchanged code is not sent)
    ray_working_dir: str = ""
    # a Ray actor not started within this (no node with its resources free) is a failed start
    ray_place_timeout_s: float = fixed(120.0, within=Range(1.0, 86_400.0))
    ray_head_num_cpus: int = fixed(0, within=Range(0, 4096))  # the local head's CPUs; 0: the machine's
    # the local head declares a Ray node dead after this many missed health checks, one a second
    ray_head_node_lost_checks: int = fixed(5, within=Range(1, 1000))

    def __post_init__(self) -> None:
        check_ranges(self, "runtime")
        if self.backend not in BACKENDS:
            raise ValueError(f"runtime.backend={self.backend!r} must be one of {BACKENDS}")
        if self.backend == "local" and self.ray_address:
            raise ValueError(f"runtime.ray_address={self.ray_address!r} is set but runtime.backend is 'local': "
                             "set runtime.backend = \"ray\" to place actors on that cluster")


@dataclass(frozen=True)
class PlacementSpec:
    """Where one actor kind's processes may run: ``[actors.<kind>.placement]``, read by the Ray backend
    (the local backend runs every process on its own machine and checks nothing of it)."""

    num_cpus: float = fixed(0.0, within=Range(0.0, 4096.0))  # reserved on its node; 0: none (Ray's default)
    num_gpus: float = fixed(0.0, within=Range(0.0, 1024.0))
    resources: dict[str, float] = field(default_factory=dict)  # custom node resources, e.g. {sandbox = 1}
    node_labels: dict[str, str] = field(default_factory=dict)  # only nodes carrying these labels (hard)
    # "spread": across nodes; "pack": onto as few nodes as fit; "default": Ray's (pack to 50%, then spread)
    strategy: str = "default"

    def __post_init__(self) -> None:
        check_ranges(self, "actors.<kind>.placement")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"placement strategy {self.strategy!r} must be one of {STRATEGIES}")
        bad = {k: v for k, v in self.resources.items() if not 0 <= v <= 1_000_000 or k in ("CPU", "GPU")}
        if bad:
            raise ValueError(f"placement resources {bad} must be custom resources (not CPU/GPU: use num_cpus, "
                             "num_gpus) with amounts in [0, 1e6]")


@dataclass(frozen=True)
class BusSection:
    # empty: start an embedded nats-server (or `embedded_servers` of them) in the run directory; else the
    # bus's servers: a list of URLs, or one string of comma-separated URLs (the members of a NATS cluster)
    url: str | tuple[str, ...] = ""
    # embedded: 1 server, or a JetStream cluster of 3 (5, 7) servers on loopback (runtime.natsserver.NatsCluster)
    embedded_servers: int = fixed(1, within=Range(1, 7))
    # copies of each stream and bucket (1..5); 0: 1 on one server, 3 on a cluster (embedded of 3 or more
    # servers, or a url naming 3 or more); set it for a cluster reached through one URL
    replicas: int = fixed(0, within=Range(0, 5))
    max_payload_bytes: int = fixed(8 * 1024 * 1024, within=Range(1024, 64 * 1024 * 1024))
    ack_wait_s: float = fixed(30.0, within=Range(1.0, 3600.0))
    # the bus unreachable for longer than this fails the run, saying so
    max_outage_s: float = fixed(60.0, within=Range(1.0, 86_400.0))
    # the embedded server, died on its own, is restarted at most this often within the window
    # (on its port and JetStream store)
    server_max_restarts: int = fixed(5, within=Range(0, 10_000))
    server_restart_window_s: float = fixed(60.0, within=Range(0.0, 86_400.0, lo_open=True))
    auth: bool = True  # embedded: a user per role with per-subject permissions, fresh passwords per start
    # a remote bus: per role, <role>.json (user and password), <role>.nk (an NKEY seed) or <role>.creds
    # (a JWT and seed of decentralised auth) of its users (runtime.bus_auth); empty: none
    credentials_dir: str = ""
    tls_ca_file: str = ""  # a remote bus over TLS: the CA that signed its certificate ...
    tls_cert_file: str = ""  # ... and the client's certificate and key, if it asks for one
    tls_key_file: str = ""

    def __post_init__(self) -> None:
        check_ranges(self, "bus")
        if self.url or isinstance(self.url, tuple):  # an empty list is a mistake, not "embedded"
            try:
                server_urls(self.url)
            except ValueError as e:
                raise ValueError(f"bus.url: {e}") from None
        if self.embedded_servers > 1 and self.embedded_servers % 2 == 0:
            raise ValueError(f"bus.embedded_servers={self.embedded_servers}: a JetStream cluster needs an odd "
                             "number of servers (3, 5 or 7) to keep a quorum when one is lost; or 1")
        if self.embedded_servers > 1 and self.url:
            raise ValueError(f"bus.embedded_servers={self.embedded_servers} starts servers, bus.url names "
                             f"servers ({self.url!r}): set one of them")
        if not self.url and self.replicas > self.embedded_servers:
            raise ValueError(f"bus.replicas={self.replicas} is more than the {self.embedded_servers} embedded "
                             "server(s) can keep: raise bus.embedded_servers, or lower bus.replicas")

    @property
    def num_servers(self) -> int:
        """How many servers the run starts, or its url names (a cluster behind one URL counts one)."""
        return len(server_urls(self.url)) if self.url else self.embedded_servers

    @property
    def num_replicas(self) -> int:
        """Copies of each stream and bucket: `replicas`, or by default 1 on one server and 3 on a cluster."""
        return self.replicas or (3 if self.num_servers >= 3 else 1)

    def limits(self) -> BusLimits:
        """What every process of the run creates streams and consumers with."""
        return BusLimits(ack_wait_s=self.ack_wait_s, replicas=self.num_replicas)


@dataclass(frozen=True)
class StorageSection:
    url: str = ""  # empty: file://<run dir>/blobs; or s3://bucket/prefix; "{run_id}" in it: the run's id
    s3_endpoint: str = ""  # for any S3-compatible endpoint (moto, MinIO); empty: AWS default


@dataclass(frozen=True)
class SupervisorSection:
    # OTP intensity: more than max_restarts restarts within restart_window_s fails the run
    max_restarts: int = fixed(5, within=Range(0, 10_000))
    restart_window_s: float = fixed(60.0, within=Range(0.0, 86_400.0, lo_open=True))
    backoff_base_s: float = fixed(0.5, within=Range(0.0, 3600.0))
    backoff_max_s: float = fixed(10.0, within=Range(0.0, 3600.0))
    drain_timeout_s: float = fixed(60.0, within=Range(0.0, 86_400.0))
    term_timeout_s: float = fixed(10.0, within=Range(0.0, 3600.0))
    # a replacement must be consuming within this during a hot swap
    ready_timeout_s: float = fixed(120.0, within=Range(0.0, 86_400.0, lo_open=True))
    # nothing acknowledged on any queue for this long: say so, naming the stage (0: off)
    stall_s: float = fixed(600.0, within=Range(0.0, 7 * 24 * 3600.0))
    # runtime.up holds the run's lease (one supervisor per run), renewed every third of this: a resume
    # elsewhere waits this long for a killed supervisor's lease to lapse, and is refused by a live one
    lease_s: float = fixed(15.0, within=Range(1.0, 3600.0))

    def __post_init__(self) -> None:
        check_ranges(self, "supervisor")
        if 0 < self.stall_s < 1.0:
            raise ValueError(f"supervisor.stall_s={self.stall_s} must be 0 (off) or within 1..604800 seconds")

    def backoff(self, num_recent_restarts: int) -> float:
        return doubling(self.backoff_base_s, self.backoff_max_s, num_recent_restarts - 1)


@dataclass(frozen=True)
class HealthSection:
    """Health checks of every supervised actor (runtime.health): liveness, the kind's probe, progress."""

    interval_s: float = fixed(5.0, within=Range(0.0, 3600.0))  # 0: no health checks
    ping_timeout_s: float = fixed(5.0, within=Range(0.1, 600.0))
    probe_every: int = fixed(6, within=Range(0, 1_000_000))  # every Nth check is the kind's probe; 0: none
    probe_timeout_s: float = fixed(60.0, within=Range(0.1, 3600.0))
    max_failures: int = fixed(3, within=Range(1, 1000))  # failed checks in a row that make an actor unhealthy
    # work in hand and nothing finished for this long: stuck (0: not checked); above the longest step
    stuck_s: float = fixed(900.0, within=Range(0.0, 7 * 24 * 3600.0))
    start_grace_s: float = fixed(600.0, within=Range(1.0, 86_400.0))  # to be running after it is started
    # passive: the share of handlings that failed over the last error_window checks (0 checks: not checked),
    # once at least min_outcomes ended in that window (a few failing deliveries are a message's fault)
    error_window: int = fixed(12, within=Range(0, 100_000))
    max_error_rate: float = fixed(0.9, within=Range(0.0, 1.0))
    min_outcomes: int = fixed(20, within=Range(1, 1_000_000))
    # passive: a handling in hand for outlier_factor x the p99 of the kind's recent ones (and at least
    # outlier_min_s, and once outlier_min_samples ended) is stuck far outside its distribution (0: off)
    outlier_factor: float = fixed(20.0, within=Range(0.0, 1e6))
    outlier_min_s: float = fixed(120.0, within=Range(0.0, 7 * 24 * 3600.0))
    outlier_min_samples: int = fixed(20, within=Range(1, 1_000_000))

    def __post_init__(self) -> None:
        check_ranges(self, "health")


@dataclass(frozen=True)
class DashboardSection:
    """Where the run's dashboard (an actor kind the run file may name, e.g. ops.dashboard) serves."""

    host: str = "127.0.0.1"  # loopback: open it to a network on purpose, never by default
    port: int = fixed(8321, within=Range(0, 65_535))  # taken already: any free port, said at start; 0: any
    sample_s: float = fixed(2.0, within=Range(0.1, 3600.0))  # status samples (slot table, actors) this often
    # the rollout viewer: the application's module:function that, given the run's application configuration,
    # returns how to get (an async function, which may wait for the run) its function from a stored record
    # (blob key, bytes) to sample views
    sample_views: str = ""
    keep_last_groups: int = fixed(64, within=Range(0, 100_000))  # the newest groups, kept whole
    groups_per_version: int = fixed(2, within=Range(0, 1_000))  # and a reservoir of this many per version ...
    max_versions: int = fixed(256, within=Range(1, 1_000_000))  # ... thinned past this many versions

    def __post_init__(self) -> None:
        check_ranges(self, "dashboard")


@dataclass(frozen=True)
class ActorSpec:
    """One actor kind: its class as ``module:Class`` (as gunicorn or uvicorn name apps), how many."""

    entry: str
    count: int = fixed(1, within=Range(0, 10_000))
    max_concurrency: int = fixed(8, within=Range(1, 100_000))
    heartbeat_s: float = fixed(5.0, within=Range(0.0, 3600.0, lo_open=True))
    drain_timeout_s: float = fixed(60.0, within=Range(0.0, 86_400.0))
    # warm spares: started and set up (model loaded) but consuming nothing; one takes a dead or
    # unhealthy actor's place at once, and a new spare is started behind it
    standby: int = fixed(0, within=Range(0, 1000))
    # The one setting of a process's compute threads (OMP_NUM_THREADS and MKL_NUM_THREADS in its environment, which
    # torch reads for its intra-op threads): one, as several actors share a few cores; 0 leaves torch's default.
    threads: int = fixed(1, within=Range(0, 1024))
    # CPU priority below the others' (0 to 19; 0: the same as every other actor): a side job gives way
    nice: int = fixed(0, within=Range(0, 19))
    # processes that form one group of ranks (e.g. one torch.distributed process group), started,
    # stopped and restarted together, each told its rank and the world size; only kinds that declare
    # ``supports_ranks`` accept more than 1
    ranks: int = fixed(1, within=Range(1, 4096))
    # handlings of one message before it is dead-lettered with its last error
    max_deliveries: int = fixed(5, within=Range(1, 49))  # below the bus consumer's max_deliver (50)
    # How long the actor's registry entry outlives its last renewal (renewed every third of it): a
    # killed or frozen actor is declared lost, and its work re-issued, this long after its last renewal.
    lease_s: float = fixed(10.0, within=Range(1.0, 3600.0))
    placement: PlacementSpec = PlacementSpec()  # its resources on a cluster (the Ray backend)

    def __post_init__(self) -> None:
        check_ranges(self, "actors.<kind>")
        if ":" not in self.entry:
            raise ValueError(f"entry {self.entry!r} must look like package.module:ClassName")
        if self.max_deliveries >= BusLimits().max_deliver:
            raise ValueError(f"max_deliveries={self.max_deliveries} must be below the consumer's max_deliver "
                             f"({BusLimits().max_deliver}), where the server stops delivering silently")


@dataclass(frozen=True)
class RuntimeConfig:
    run: RunSection = RunSection()
    runtime: BackendSection = BackendSection()
    bus: BusSection = BusSection()
    storage: StorageSection = StorageSection()
    supervisor: SupervisorSection = SupervisorSection()
    health: HealthSection = HealthSection()
    log: EventLogConfig = EventLogConfig()
    dashboard: DashboardSection = DashboardSection()
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

    def field(self, key: str) -> dataclasses.Field[Any]:
        """The field a dotted key names, in the runtime's sections or the application's.

        Raises:
            ConfigError: no such key (naming the nearest one).
        """
        if key.split(".", 1)[0] in RUNTIME_SECTIONS:
            return config_mod.field_at(RuntimeConfig, key)
        if self.app_schema is None:
            raise ConfigError(f"config key {key!r} is unknown: no actor of this run has a Config")
        return config_mod.field_at(self.app_schema, key)


def import_entry(entry: str, what: str = "actor entry") -> type:
    module_name, _, attr = entry.partition(":")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{what} {entry!r} cannot be imported: {e}") from e


def schema_entry(schema: type) -> str:
    """``schema`` as ``run.config_schema`` names it: package.module:Class."""
    return f"{schema.__module__}:{schema.__qualname__}"


def _named_schema(entry: str) -> type:
    schema = import_entry(entry, "run.config_schema")
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        raise ConfigError(f"run.config_schema = {entry!r} is not a configuration class (a dataclass)")
    return schema


def check_process_counts(specs: dict[str, ActorSpec]) -> None:
    """Refuses a count above what a kind allows (``Actor.max_count``) and ranks for a kind without them."""
    for kind, spec in specs.items():
        cls = import_entry(spec.entry)
        limit = getattr(cls, "max_count", None)
        if limit is not None and spec.count > limit:
            raise ConfigError(f"actors.{kind}.count={spec.count}: {cls.__qualname__} runs at most {limit} "
                              f"process(es): {cls.max_count_reason}")
        if spec.ranks > 1 and not getattr(cls, "supports_ranks", False):
            raise ConfigError(f"actors.{kind}.ranks={spec.ranks}: {cls.__qualname__} does not run as a group of "
                              "ranks; use count for more independent processes")


def app_schema_of(specs: dict[str, ActorSpec]) -> type | None:
    schemas = {cls.Config for spec in specs.values() if (cls := import_entry(spec.entry)).Config}
    if len(schemas) > 1:
        names = ", ".join(sorted(s.__qualname__ for s in schemas))
        raise ConfigError(f"the actor kinds of one run must share one Config schema; found {names}")
    return next(iter(schemas), None)


def load_run_config(files: Iterable[Path] = (), overrides: Iterable[str] = (), *,
                    import_actors: bool = True) -> RunConfig:
    """The run's configuration from its files and ``key=value`` overrides, every key validated.

    ``import_actors``: import every actor class, check the process counts they allow and that they share one
    ``Config`` (``run.config_schema``, when set, must be it); what starts or resumes a run does. False, for what
    only reads a configuration (--print-config, ops.config): the schema ``run.config_schema`` names is imported
    alone, when it names one (a run's saved configuration always does).

    Raises:
        ConfigError: a key is unknown or its value invalid, or an actor class or the schema does not import.
    """
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
    if import_actors:
        check_process_counts(runtime.actors)
    runtime, schema = _with_schema(runtime, None if import_actors else runtime.run.config_schema)
    if schema is None:
        if app_tree or app_overrides:
            keys = sorted(app_tree) + [k for k, _ in app_overrides]
            raise ConfigError(f"config sections {keys} are unknown: no actor of this run has a Config")
        return RunConfig(runtime, None, None)
    for key, value in app_overrides:
        config_mod.field_at(schema, key)
        config_mod.set_path(app_tree, key, value)
    return RunConfig(runtime, config_mod.build(schema, app_tree), schema)


def _with_schema(runtime: RuntimeConfig, known: type | str | None) -> tuple[RuntimeConfig, type | None]:
    """The application's schema, and ``runtime`` naming it in ``run.config_schema`` (saved so, a reader of the
    saved configuration imports the schema alone): ``known`` (a class, or one named as package.module:Class),
    else the ``Config`` the actor classes share, every one imported (a ``run.config_schema`` set must be it)."""
    if isinstance(known, str) and known:
        schema: type | None = _named_schema(known)
    elif isinstance(known, type):
        schema = known
    else:
        schema = app_schema_of(runtime.actors)
        named = runtime.run.config_schema
        if named and _named_schema(named) is not schema:
            found = "none" if schema is None else schema_entry(schema)
            raise ConfigError(f"run.config_schema = {named!r}, but the run's actor classes share {found}: "
                              "name theirs, or leave it empty")
    if schema is None:
        return runtime, None
    run = dataclasses.replace(runtime.run, config_schema=schema_entry(schema))
    return dataclasses.replace(runtime, run=run), schema


def load_kind_config(files: Iterable[Path], kind: str) -> RunConfig:
    """A run's resolved configuration as a process of ``kind`` needs it (`runtime.actor_process`): the
    runtime's sections, and the application's built with ``kind``'s own ``Config``.

    Only that kind's class is imported when it has a ``Config``: the whole was checked by `load_run_config`
    when the run started (every kind's class, the process counts, one shared schema), and the files are
    that check's output. Importing every other kind's code would make each process load what the heaviest
    kind needs: the reconciler would import torch for the trainer's sake, and its replacement after a freeze
    would start seconds later for it. A kind without a ``Config`` gets the run's shared schema: the one
    ``run.config_schema`` names (as the saved configuration does), else found as `load_run_config` finds it.

    Raises:
        ConfigError: the run has no kind ``kind``, or the files do not read as a run's configuration.
    """
    tree = config_mod.read_files(files)
    runtime = config_mod.build(RuntimeConfig, {k: v for k, v in tree.items() if k in RUNTIME_SECTIONS})
    spec = runtime.actors.get(kind)
    if spec is None:
        raise ConfigError(f"the run has no actor kind {kind!r}; it has {sorted(runtime.actors)}")
    runtime, schema = _with_schema(runtime, import_entry(spec.entry).Config or runtime.run.config_schema)
    app_tree = {k: v for k, v in tree.items() if k not in RUNTIME_SECTIONS}
    return RunConfig(runtime, None if schema is None else config_mod.build(schema, app_tree), schema)


def runtime_from_overrides(overrides: Iterable[str]) -> RuntimeConfig:
    """The runtime sections that ``key=value`` overrides set (the rest default; application keys and
    ``actors.*`` ignored): how to reach a run (its bus, its store) before its configuration is read.

    Raises:
        ConfigError: a runtime key is unknown or its value invalid.
    """
    tree: dict[str, Any] = {}
    for text in overrides:
        key, value = config_mod.parse_override(text)
        if key.split(".", 1)[0] in RUNTIME_SECTIONS and not key.startswith("actors."):
            config_mod.field_at(RuntimeConfig, key)
            config_mod.set_path(tree, key, value)
    return config_mod.build(RuntimeConfig, tree)


ANNOTATION_HEADER = """\
# The run's resolved configuration. A key's comment says what it accepts: [a, b] includes its ends, (a, b) leaves
# them out; "live": it may change while the run goes on (python -m ops.config set KEY VALUE), every other key is
# fixed at start. What each key means: docs/reference/configuration.md (python -m ops.config get KEY on a run).

"""


def annotated_toml(cfg: RunConfig) -> str:
    """`dump_toml` of ``cfg`` (what --print-config prints) with each key's range and live mark as a comment at the
    end of its line (`runtime.config.key_note`): TOML all the same, read back as the plain text is."""
    lines = []
    table: list[str] = []
    for line in dump_toml(cfg.to_toml_tree()).splitlines():
        if line.startswith("["):
            table = _dotted(line)
        elif line and not line[0].isspace() and (note := _note(cfg, [*table, *_dotted(line.split(" = ", 1)[0])])):
            line = f"{line}  # {note}"  # after the value, or after the "[" of an array written over lines
        lines.append(line)
    return ANNOTATION_HEADER + "\n".join(lines) + "\n"


def _dotted(text: str) -> list[str]:
    """The parts of a TOML key or table header as tomli-w writes it (``actors.rollout``, ``"a b".c``); [] if not one."""
    try:
        node: Any = tomllib.loads(text if text.startswith("[") else f"{text} = 0")
    except tomllib.TOMLDecodeError:
        return []
    parts = []
    while isinstance(node, dict) and len(node) == 1:
        part, node = next(iter(node.items()))
        parts.append(part)
    return parts


def _note(cfg: RunConfig, parts: list[str]) -> str:
    if not parts:
        return ""
    try:
        return config_mod.key_note(cfg.field(".".join(parts)))
    except ConfigError:  # a key of a table of values (placement.resources): no field of its own
        return ""


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
