"""Who may say what on the bus: one NATS user per role, each allowed exactly the subjects it needs.

Roles:
    supervisor  the run's owner (runtime.up): creates streams and buckets, spawns, stops; everything.
    operator    ops commands: control requests (ctl.>), live configuration (writes to ``config``),
                reading the registry, the event log and progress; nothing else.
    <kind>      each actor kind of the run (reconciler, rollout, trainer, ...): what every actor does
                (fetching from and acknowledging on its own work queues' consumers, which the
                supervisor makes: no role but the supervisor creates, changes or deletes a stream or a
                consumer; a KV watch and a stream's follow are reads and the stream's republished
                records, `runtime.kv_watch`); its own kind's registry entries and
                handover record, the ``config`` watch, events, dead letters, its own kind's control
                subjects and their replies) plus what its class declares in ``Actor.bus_access``
                (subjects it publishes and subscribes to, buckets it reads and writes, keys of other
                buckets it writes). A kind that does not declare a subject cannot use it: the server
                refuses.

Registry keys and control subjects name the kind (``reg.<kind>.<id>``, ``handover.<kind>``,
``ctl.<kind>.<id>.<verb>``: `runtime.registry`, `control_subject`), so that a rollout actor can
neither overwrite a trainer's lease nor listen to (and answer for) a trainer's control requests.

Replies go to inboxes under ``_INBOX_<role>.``, which only that role may subscribe to, and a role
may publish to a reply subject only in answer to a request it received (``allow_responses``).

An embedded run generates one random password per role at every start and writes them, with the
server's configuration, into ``<run dir>/credentials/`` (directory 0700, files 0600): nothing to set
up, and nobody but the run's user can read them. A remote bus (``bus.url``) takes a credentials
directory of the same layout (``bus.credentials_dir``) and TLS files (``bus.tls_*``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import ssl
from collections.abc import Iterable, Mapping
from pathlib import Path

import structlog

from runtime.errors import ConfigError
from runtime.registry import handover_key, registration_key

log = structlog.get_logger(__name__)

__all__ = [
    "OPERATOR",
    "SUPERVISOR",
    "BusAccess",
    "BusCredentials",
    "BusUser",
    "Permissions",
    "RunCredentials",
    "actor_permissions",
    "authorization_conf",
    "control_subject",
    "follow_subject",
    "generate_credentials",
    "inbox_prefix",
    "kv_watch_subject",
    "operator_permissions",
    "read_credentials",
    "tls_context",
]

_ROLE_RE = re.compile(r"^[A-Za-z0-9_-]+$")  # a role names an inbox prefix and a credentials file
SUPERVISOR = "supervisor"
OPERATOR = "operator"
_API = "$JS.API"
KV_WATCH = "kvwatch"  # the root of every bucket's republished records (`kv_watch_subject`)
FOLLOW = "follow"  # the root of the messages a followed stream republishes (`follow_subject`)


@dataclasses.dataclass(frozen=True)
class BusAccess:
    """What an actor kind says on the bus beyond what every actor says (see the module docstring).

    Attributes:
        publish: subjects it publishes (wildcards allowed), e.g. ``("done.rollout",)``.
        subscribe: subjects it subscribes to.
        kv_read: buckets it reads or watches.
        kv_write: buckets it writes (reading them included).
        streams: work-queue streams and their durable consumers, ``(stream, durable)``, it consumes
            beyond the queues it declares (bound, fetched, acknowledged: the supervisor makes them).
        kv_keys: keys it writes or deletes in a bucket it may only read, ``(bucket, key pattern)``
            (NATS wildcards over the key's dot-separated tokens), e.g. ``("actors", "reg.>")``.
    """

    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    kv_read: tuple[str, ...] = ()
    kv_write: tuple[str, ...] = ()
    streams: tuple[tuple[str, str], ...] = ()
    kv_keys: tuple[tuple[str, str], ...] = ()

    def __or__(self, other: BusAccess) -> BusAccess:
        return BusAccess(*(tuple(dict.fromkeys(getattr(self, f.name) + getattr(other, f.name)))
                           for f in dataclasses.fields(self)))


@dataclasses.dataclass(frozen=True)
class Permissions:
    """A server user's allow-lists (NATS subjects, wildcards allowed); everything else is refused."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    subscribe_deny: tuple[str, ...] = ()
    publish_deny: tuple[str, ...] = ()
    allow_responses: bool = True


@dataclasses.dataclass(frozen=True)
class BusCredentials:
    """How one role signs in: a user name and password (``<credentials dir>/<role>.json``), an NKEY
    (``<role>.nk``: the user's seed, which signs the server's challenge; the password never travels),
    or a JWT user of decentralised auth (``<role>.creds``, as ``nsc`` writes it). ``user``: the role,
    whose inbox prefix its replies use."""

    user: str
    password: str = ""
    nkey_seed_file: str = ""
    creds_file: str = ""

    def connect_options(self) -> dict[str, str]:
        options = {"inbox_prefix": inbox_prefix(self.user)}
        if self.creds_file:
            options["user_credentials"] = self.creds_file
        elif self.nkey_seed_file:
            options["nkeys_seed"] = self.nkey_seed_file
        else:
            options.update(user=self.user, password=self.password)
        return options


@dataclasses.dataclass(frozen=True)
class BusUser:
    """One user of the server's ``authorization`` block: who (credentials) and what (permissions).
    ``nkey``: an NKEY user's public key (``U...``), which the server checks signatures with."""

    credentials: BusCredentials
    permissions: Permissions
    nkey: str = ""


def inbox_prefix(role: str) -> str:
    return f"_INBOX_{role}"


def kv_watch_subject(bucket: str, keys: str = ">") -> str:
    """Where the stream of ``bucket`` republishes each record of ``keys`` (its republish rule, made by the
    supervisor: `runtime.bus.Bus.ensure_bucket`): a KV watch without a consumer subscribes here
    (`runtime.kv_watch`). The bucket's readers may subscribe; no role may publish (the server's
    republish is subject to no user's permissions)."""
    return f"{KV_WATCH}.{bucket}.{keys}"


def follow_subject(subject: str) -> str:
    """Where a followed stream (LOG) republishes its messages of ``subject`` (its republish rule, made by the
    supervisor: `runtime.bus.Bus.ensure_base`): `runtime.bus.Bus.follow` subscribes here. A reader of the
    stream (`stream_reader`) may subscribe; no role may publish."""
    return f"{FOLLOW}.{subject}"


def control_subject(kind: str, actor_id: str, verb: str = "*") -> str:
    """Where actor ``actor_id`` of ``kind`` takes control requests (ping, status, drain): under its
    kind, so that a role may listen to its own actors' control and no other's."""
    return f"ctl.{kind}.{actor_id}.{verb}"


def _stream_api(stream: str, durable: str) -> list[str]:
    """A work queue's durable pull consumer, made by the supervisor (`runtime.up`): read its state, fetch,
    acknowledge. Nothing that creates or changes a stream or a consumer: a role that could would redirect
    the stream's subjects (capture other roles' messages), have the server republish into subjects it may
    not publish to, or deliver into any subject through a push consumer."""
    return [
        f"{_API}.CONSUMER.INFO.{stream}.{durable}", f"{_API}.CONSUMER.MSG.NEXT.{stream}.{durable}",
        f"$JS.ACK.{stream}.{durable}.>",
        f"$JS.ACK.*.*.{stream}.{durable}.>",  # the ack subject with a domain and an account hash
    ]


def _stream_reads(stream: str) -> list[str]:
    """Read a stream without a consumer: its state, direct gets of its messages, and its leader's newest
    message (a replicated stream's replica may answer a direct get behind its leader)."""
    return [f"{_API}.STREAM.INFO.{stream}", f"{_API}.DIRECT.GET.{stream}", f"{_API}.STREAM.MSG.GET.{stream}"]


def _kv_read(bucket: str) -> list[str]:
    """Get, list and snapshot a bucket: stream info (its keys), the leader's get and direct gets (a key's last
    record; every key's, for a watch's snapshot). No consumer: a role that may create one on the bucket's
    stream may give it any deliver subject, which the server does not check against the role's
    permissions; a watch is this snapshot and the stream's republished records (`runtime.kv_watch`,
    subscribed to with `_kv_watch`)."""
    stream = f"KV_{bucket}"
    return [*_stream_reads(stream), f"{_API}.DIRECT.GET.{stream}.>"]


def _kv_watch(buckets: Iterable[str]) -> list[str]:
    """Subscribe to the records the streams of ``buckets`` republish (a watch's changes)."""
    return [kv_watch_subject(bucket) for bucket in buckets]


def _kv_write(bucket: str) -> list[str]:
    """Read and write a bucket's keys."""
    return _kv_keys(bucket, (">",))


def _kv_keys(bucket: str, keys: Iterable[str]) -> list[str]:
    """Read a bucket and write (put, delete, purge: each a publish to ``$KV.<bucket>.<key>``) the
    keys matching ``keys``; the bucket itself is the supervisor's (`runtime.bus.Bus.ensure_base`)."""
    return [*_kv_read(bucket), *(f"$KV.{bucket}.{key}" for key in keys)]


def stream_reader(stream: str, subject: str) -> BusAccess:
    """Read a stream's ``subject`` from any point on (``Bus.follow``): find the stream by subject, read its
    state and its messages by direct gets, ask the leader for its newest message (a replicated stream's
    replica may answer a direct get behind it), and subscribe to what it republishes. No consumer: a role that
    may create one may give it any deliver subject, which the server does not check against its permissions."""
    return BusAccess(publish=(f"{_API}.STREAM.NAMES", *_stream_reads(stream)), subscribe=(follow_subject(subject),))


def actor_permissions(role: str, access: BusAccess) -> Permissions:
    """An actor kind's permissions: what every actor does, plus its declared `access`."""
    # its own events (log.<kind>.<level>) and dead letters of its own queues only: no one writes
    # another kind's events into the log ops.tail shows; in the registry, its own kind's leases and
    # handover record only
    own_keys = (registration_key(role, "*"), handover_key(role))
    # the run bucket: the run's record (runtime.run_state), which every process reads to find its run, and
    # the claims of the run's one-time builds (runtime.build_once), which any process may make
    publish = [f"log.{role}.*", *_kv_keys("actors", own_keys), *_kv_read("config"), *_kv_keys("run", ("build.>",)),
               *access.publish]
    for bucket in access.kv_read:
        publish += _kv_read(bucket)
    for bucket in access.kv_write:
        publish += _kv_write(bucket)
    for bucket, pattern in access.kv_keys:
        publish += _kv_keys(bucket, (pattern,))
    for stream, durable in access.streams:
        publish += [*_stream_api(stream, durable), f"dlq.{durable}"]
    buckets = ("actors", "config", "run", *access.kv_read, *access.kv_write, *(b for b, _ in access.kv_keys))
    subscribe = [f"{inbox_prefix(role)}.>", control_subject(role, "*"), *_kv_watch(buckets), *access.subscribe]
    return Permissions(tuple(dict.fromkeys(publish)), tuple(dict.fromkeys(subscribe)))


def operator_permissions() -> Permissions:
    """ops commands: control requests, live configuration, the registry, the event log, progress."""
    log_reader = stream_reader("LOG", "log.>")
    publish = ["ctl.>", *_kv_write("config"), *_kv_read("actors"), *_kv_read("run"), *log_reader.publish]
    subscribe = (f"{inbox_prefix(OPERATOR)}.>", "log.>", "progress.>", *_kv_watch(("config", "actors", "run")),
                 *log_reader.subscribe)
    return Permissions(tuple(publish), subscribe, allow_responses=False)


def _supervisor_permissions() -> Permissions:
    # everything but publishing where streams republish, which only they write: a watcher or follower
    # takes what arrives there for the stream's own (`runtime.kv_watch`)
    return Permissions((">",), (">",), publish_deny=(f"{KV_WATCH}.>", f"{FOLLOW}.>"))


def generate_credentials(directory: Path, roles: Mapping[str, Permissions]) -> list[BusUser]:
    """Fresh random passwords for `roles` plus the supervisor and the operator, written to
    ``directory/<role>.json`` readable by the run's user only; returns the server's users."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)
    if reserved := {SUPERVISOR, OPERATOR} & set(roles):
        raise ConfigError(f"actor kinds {sorted(reserved)} are bus roles of the runtime: name the kinds otherwise")
    everyone = {SUPERVISOR: _supervisor_permissions(), OPERATOR: operator_permissions(), **roles}
    for role in everyone:
        if not _ROLE_RE.match(role):
            raise ConfigError(f"actor kind {role!r} cannot be a bus role: use letters, digits, '_' and '-' only")
    users = [BusUser(BusCredentials(role, secrets.token_urlsafe(24)), permissions)
             for role, permissions in everyone.items()]
    RunCredentials(directory, {u.credentials.user: u.credentials for u in users}, owned=True).restore()
    return users


@dataclasses.dataclass(frozen=True)
class RunCredentials:
    """The run's credentials as its supervisor holds them: in memory from the start, so that a directory
    deleted or emptied mid-run neither keeps an actor from signing in nor loses the run's passwords.

    ``owned``: the supervisor made them (an embedded bus: `generate_credentials`), and writes the
    directory again whenever a file is missing or changed (`restore`); a directory given for a remote bus
    (``bus.credentials_dir``) is its owner's, never written, and read again for each process started
    (`for_spawn`): its owner may rotate them.
    """

    directory: Path
    roles: Mapping[str, BusCredentials]
    owned: bool = False

    @classmethod
    def read(cls, directory: Path | str, roles: Iterable[str]) -> RunCredentials:
        """Every role's credentials from a directory given for the bus (`read_credentials`)."""
        return cls(Path(directory), {role: read_credentials(directory, role) for role in roles})

    def for_role(self, role: str) -> BusCredentials:
        try:
            return self.roles[role]
        except KeyError:
            raise ConfigError(f"the run has no bus credentials for role {role!r}; it has {sorted(self.roles)}") \
                from None

    def for_spawn(self, role: str) -> BusCredentials:
        """The credentials a process of ``role`` starts with. The run's own: as held. A directory the run does
        not own: read again now, as its owner may have rotated them since the run started (the copy held
        since then would be refused, and every restarted actor crash-loop); the held copy only if it cannot
        be read (said: the process may then be refused)."""
        if self.owned:
            return self.for_role(role)
        try:
            return read_credentials(self.directory, role)
        except (ConfigError, OSError) as e:
            held = self.for_role(role)
            log.warning("credentials_reread_failed", directory=str(self.directory), role=role, error=str(e),
                        consequence="the process starts with the credentials read when the run started; if they "
                                    "were rotated since, the bus refuses it",
                        fix=f"make {self.directory} hold {role}'s current credentials, readable by the run's user")
            return held

    def restore(self) -> list[str]:
        """Writes again the files of the directory that are missing or differ (the directory too, 0700);
        the roles whose file was written. Nothing for a directory the run does not own.

        Raises:
            OSError: the directory cannot be written.
        """
        if not self.owned:
            return []
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.directory.chmod(0o700)
        written = []
        for role, credentials in self.roles.items():
            path = self.directory / f"{role}.json"
            text = json.dumps({"user": credentials.user, "password": credentials.password})
            try:
                if path.read_text() == text:
                    continue
            except (FileNotFoundError, UnicodeDecodeError):
                pass
            _write_private(path, text)
            written.append(role)
        return written


_CREDENTIAL_FILES = (".json", ".nk", ".creds")  # a role's file, in this order of preference


def read_credentials(directory: Path | str, role: str) -> BusCredentials:
    """The credentials of `role` from a credentials directory: ``<role>.json`` (user and password, as
    `generate_credentials` writes them), ``<role>.nk`` (an NKEY user's seed) or ``<role>.creds`` (a JWT
    user's credentials file), the first that exists."""
    paths = [Path(directory) / f"{role}{suffix}" for suffix in _CREDENTIAL_FILES]
    try:
        path = next(p for p in paths if p.exists())
    except StopIteration:
        state = "does not exist" if not Path(directory).is_dir() else "has none of them"
        raise ConfigError(f"no bus credentials for role {role!r}: the credentials directory {directory} {state} "
                          f"({', '.join(p.name for p in paths)}). A run started by runtime.up keeps them in "
                          "<run dir>/credentials, and its supervisor writes them again when it next starts an "
                          "actor; for a bus given by URL, pass --set bus.credentials_dir=DIR, the directory "
                          f"holding {role}.json (or .nk, .creds)") from None
    try:
        text = path.read_text()
        if path.suffix == ".nk":
            if not text.strip().startswith("SU"):
                raise ValueError("an NKEY user seed starts with 'SU'")
            return BusCredentials(role, nkey_seed_file=str(path))
        if path.suffix == ".creds":
            if "BEGIN NATS USER JWT" not in text or "BEGIN USER NKEY SEED" not in text:
                raise ValueError("a .creds file holds a user JWT and its NKEY seed")
            return BusCredentials(role, creds_file=str(path))
        data = json.loads(text)
        return BusCredentials(str(data["user"]), str(data["password"]))
    except PermissionError:
        raise ConfigError(f"bus credentials {path} are readable by the run's user only; run as that user") from None
    except (ValueError, KeyError, TypeError) as e:
        expected = {".json": "{'user', 'password'}", ".nk": "an NKEY user seed", ".creds": "nsc's user credentials"}
        raise ConfigError(f"bus credentials {path} are malformed ({e!r}); expected {expected[path.suffix]}") from None


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    path.chmod(0o600)


def authorization_conf(users: Iterable[BusUser]) -> str:
    """The nats-server ``authorization`` block for `users` (JSON is valid NATS configuration)."""
    entries = []
    for u in users:
        p = u.permissions
        subscribe: dict[str, list[str]] = {"allow": list(p.subscribe)}
        if p.subscribe_deny:
            subscribe["deny"] = list(p.subscribe_deny)
        publish: dict[str, list[str]] = {"allow": list(p.publish)}
        if p.publish_deny:
            publish["deny"] = list(p.publish_deny)
        permissions: dict[str, object] = {"publish": publish, "subscribe": subscribe}
        if p.allow_responses:
            permissions["allow_responses"] = True
        who = {"nkey": u.nkey} if u.nkey else {"user": u.credentials.user, "password": u.credentials.password}
        entries.append({**who, "permissions": permissions})
    return f"authorization {json.dumps({'users': entries}, indent=1)}\n"


def tls_context(ca_file: str, cert_file: str = "", key_file: str = "") -> ssl.SSLContext | None:
    """A client TLS context for a remote bus (None without a CA file: plain TCP, loopback only)."""
    if not ca_file:
        return None
    context = ssl.create_default_context(cafile=ca_file)
    if cert_file:
        context.load_cert_chain(cert_file, key_file or None)
    return context
