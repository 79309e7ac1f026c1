"""A run's identity and resolved configuration, kept on the bus and in the blob store, not on one disk.

When a run starts, ``runtime.up`` writes its record (run id, name, storage URL) to the ``run`` KV
bucket under ``record`` and to the blob store as ``run/record.json``, with the resolved configuration
as ``run/config.toml`` (blobs first, the bus record last: a record on the bus always has its
configuration in the store). Whoever holds the bus address and the run id finds the rest: the record
names the storage, the storage holds the configuration. An actor process starts from exactly that
(``runtime.actor_process --bus URL --run ID``), and ``runtime.up --resume RUN`` on another machine
from the bus and storage URLs.

One bus carries one run (its streams and buckets are not named per run): a run started on a bus that
already holds another run's record is refused, so two runs never share a slot table.

How the run stands is beside its record, under ``state``: ``runtime.up`` writes ``running`` when it starts (or
resumes) the run and how it ended (finished, stopped, failed) once every actor has stopped and their events
are on the bus. A follower of the run (``ops.tail``) watches that key to end with the run (`run_ended`).
"""

from __future__ import annotations

import enum
import json
import os
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

import structlog

from runtime.blob import BlobNotFound, BlobStore, open_store
from runtime.bus import Bus
from runtime.bus_auth import read_credentials, tls_context
from runtime.errors import BusError, ConfigError, RevisionMismatch

__all__ = [
    "CONFIG_BLOB",
    "RECORD_BLOB",
    "RECORD_KEY",
    "RUN_BUCKET",
    "STATE_KEY",
    "Outcome",
    "RunConflict",
    "RunNotFound",
    "RunRecord",
    "RunState",
    "check_run_id",
    "find_run",
    "new_run_id",
    "publish_run",
    "publish_run_state",
    "read_run_config",
    "read_run_record",
    "run_ended",
    "storage_url_of",
    "verify_store",
    "withdraw_run",
]

log = structlog.get_logger(__name__)

RUN_BUCKET = "run"
RECORD_KEY = "record"
STATE_KEY = "state"
RECORD_BLOB = "run/record.json"
CONFIG_BLOB = "run/config.toml"
RECORD_SCHEMA = 1
RUN_ID_FIELD = "{run_id}"  # in storage.url: the run's id (`storage_url_of`)
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")  # a subject token (weights.<run>) and a blob key segment


class RunNotFound(ConfigError):
    """The bus or the store holds no record of the run asked for."""


class RunConflict(ConfigError):
    """The bus or the store already belongs to another run."""


def check_run_id(run_id: str) -> str:
    """``run_id`` if it can name a subject token and a blob key segment, else ConfigError naming it."""
    if not _RUN_ID_RE.match(run_id):
        raise ConfigError(f"run id {run_id!r} must be 1-128 letters, digits, '-' or '_' "
                          "(it names the subject weights.<run> and blob keys)")
    return run_id


def storage_url_of(url: str, run_id: str) -> str:
    """``url`` with `RUN_ID_FIELD` filled in: ``s3://bucket/runs/{run_id}`` gives every run a store of its own,
    so one command starts run after run (a store holds one run)."""
    return url.replace(RUN_ID_FIELD, run_id)


def new_run_id(name: str) -> str:
    """A fresh run id: ``<yyyymmdd-hhmmss>-<name>-<6 hex>``; the name's other characters become '-'."""
    safe = re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-")[:64] or "run"
    return check_run_id(f"{time.strftime('%Y%m%d-%H%M%S')}-{safe}-{os.urandom(3).hex()}")


@dataclass(frozen=True)
class RunRecord:
    """What identifies a run wherever it is resumed or joined from."""

    run_id: str
    name: str
    storage_url: str
    s3_endpoint: str  # empty: AWS's default (or a file:// store)
    created_at: float
    schema: int = RECORD_SCHEMA

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> RunRecord:
        try:
            fields: dict[str, Any] = json.loads(data)
            record = cls(**fields)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"the run record in {where} is corrupt ({e})") from None
        if record.schema != RECORD_SCHEMA:
            raise ConfigError(f"the run record in {where} has schema {record.schema}; this code reads "
                              f"{RECORD_SCHEMA}: resume with the code that started the run")
        return record


class Outcome(enum.Enum):
    """How a run stands: running, or how it ended (`runtime.supervisor.Supervisor.run`'s result)."""

    RUNNING = "running"
    FINISHED = "finished"  # the application said the run is done
    STOPPED = "stopped"  # an operator stopped it (signal or ctl)
    FAILED = "failed"  # restart intensity exceeded, a start failed, the bus or the run's lease lost


@dataclass(frozen=True)
class RunState:
    """The run's state as its ``runtime.up`` last recorded it (`STATE_KEY` in `RUN_BUCKET`)."""

    outcome: Outcome
    failure: str = ""  # why it failed
    at: float = 0.0  # when it was recorded (time.time())
    schema: int = RECORD_SCHEMA

    @property
    def ended(self) -> bool:
        return self.outcome is not Outcome.RUNNING

    def to_bytes(self) -> bytes:
        return json.dumps({**asdict(self), "outcome": self.outcome.value}, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> RunState:
        try:
            fields: dict[str, Any] = json.loads(data)
            state = cls(**{**fields, "outcome": Outcome(fields["outcome"])})
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigError(f"the run state in {where} is corrupt ({e!r})") from None
        if state.schema != RECORD_SCHEMA:
            raise ConfigError(f"the run state in {where} has schema {state.schema}; this code reads {RECORD_SCHEMA}")
        return state


async def publish_run_state(bus: Bus, state: RunState) -> None:
    """Records how the run stands (runtime.up: running at its start, its outcome at its end)."""
    await bus.kv_put(RUN_BUCKET, STATE_KEY, state.to_bytes())


async def run_ended(bus: Bus) -> RunState:
    """The run's end, once its ``runtime.up`` records it (at once if it has): a watch of the state key, no polling.
    A run started by a version that recorded no state never ends here; nor does one whose ``runtime.up`` was
    killed (nothing records its end)."""
    where = f"the bus bucket {RUN_BUCKET!r}"
    watch = aiter(bus.kv_watch(RUN_BUCKET, STATE_KEY))
    try:
        async for entry in watch:
            if entry is None or entry.deleted:  # the end of what is stored, or a removed key: wait on
                continue
            try:
                state = RunState.from_bytes(entry.value, where)
            except ConfigError as e:  # a later record may be readable: say so and wait on
                log.error("run_state_unreadable", error=str(e), revision=entry.revision)
                continue
            if state.ended:
                return state
    finally:
        await watch.aclose()  # type: ignore[attr-defined]
    raise AssertionError("unreachable: a KV watch never ends")


async def read_run_record(bus: Bus) -> RunRecord | None:
    """The record of the run this bus carries, or None when it carries none yet."""
    entry = await bus.kv_get(RUN_BUCKET, RECORD_KEY)
    return None if entry is None else RunRecord.from_bytes(entry.value, f"the bus bucket {RUN_BUCKET!r}")


async def publish_run(bus: Bus, store: BlobStore, record: RunRecord, config_toml: str, *, resumed: bool) -> None:
    """Writes the run's configuration and record to the store, then the record to the bus.

    A new run claims the bus (create-if-absent); a resumed one must find its own record there (a run
    from before records were kept gets one) and updates the storage URL it is reached at now.

    Raises:
        RunConflict: the bus or the store holds another run.
    """
    had_store = await verify_store(store, record.run_id, missing_ok=True) is not None
    _refuse_held(await read_run_record(bus), record.run_id)  # before the store is written: a refusal claims nothing
    await store.put(CONFIG_BLOB, config_toml.encode())
    await store.put(RECORD_BLOB, record.to_bytes())
    try:
        await _claim_bus(bus, record, resumed=resumed)
    except BaseException:  # another run claimed the bus meanwhile, or the bus failed: the store is left as found
        if not had_store:
            await _withdraw_store(store, record.run_id)
        raise


async def _claim_bus(bus: Bus, record: RunRecord, *, resumed: bool) -> None:
    if not resumed:
        try:
            await bus.kv_create(RUN_BUCKET, RECORD_KEY, record.to_bytes())
            return
        except RevisionMismatch:
            pass
    held = await read_run_record(bus)
    _refuse_held(held, record.run_id)
    if held is None and not resumed:  # deleted between the create and the read: claim it again
        await bus.kv_create(RUN_BUCKET, RECORD_KEY, record.to_bytes())
        return
    await bus.kv_put(RUN_BUCKET, RECORD_KEY, record.to_bytes())


def _refuse_held(held: RunRecord | None, run_id: str) -> None:
    if held is not None and held.run_id != run_id:
        raise RunConflict(f"the bus already carries run {held.run_id!r} (one bus, one run: its streams and buckets "
                          f"are not named per run): resume it with --resume {held.run_id}, clear it with "
                          f"python -m ops.clear {held.run_id} --set bus.url=... once it has ended, or give run "
                          f"{run_id!r} a bus of its own")


async def withdraw_run(bus: Bus, store: BlobStore, record: RunRecord) -> None:
    """Undoes `publish_run` of a new run that then did not start: its record leaves the bus and its record and
    configuration the store, each only where it is still this run's, so the bus and the store are free again."""
    held = await read_run_record(bus)
    if held is not None and held.run_id == record.run_id:
        await bus.kv_delete(RUN_BUCKET, RECORD_KEY)
    await _withdraw_store(store, record.run_id)
    log.info("run_withdrawn", run_id=record.run_id, storage_url=record.storage_url)


async def _withdraw_store(store: BlobStore, run_id: str) -> None:
    try:
        held = RunRecord.from_bytes(await store.get(RECORD_BLOB), f"{store.url}/{RECORD_BLOB}")
    except BlobNotFound:
        return
    if held.run_id == run_id:
        await store.delete(RECORD_BLOB)  # the record first: a store without one is free, whatever else it holds
        await store.delete(CONFIG_BLOB)


async def verify_store(store: BlobStore, run_id: str, *, missing_ok: bool = False) -> RunRecord | None:
    """The store's own run record, checked to be ``run_id``'s.

    Raises:
        RunConflict: the store holds another run.
        RunNotFound: it holds none and ``missing_ok`` is false.
    """
    try:
        data = await store.get(RECORD_BLOB)
    except BlobNotFound:
        if missing_ok:
            return None
        raise RunNotFound(f"{store.url} holds no run ({RECORD_BLOB} is missing): is it the storage URL of "
                          f"run {run_id!r}?") from None
    held = RunRecord.from_bytes(data, f"{store.url}/{RECORD_BLOB}")
    if held.run_id != run_id:
        raise RunConflict(f"{store.url} holds run {held.run_id!r}, not {run_id!r}: give each run a storage "
                          "URL of its own (storage.url=s3://bucket/runs/{run_id}: each run's id fills it in)")
    return held


async def read_run_config(store: BlobStore, run_id: str) -> str:
    """The resolved configuration (TOML text) ``run_id`` was started with, from its store.

    Raises:
        RunNotFound, RunConflict: as `verify_store`.
    """
    await verify_store(store, run_id)
    try:
        return (await store.get(CONFIG_BLOB)).decode()
    except BlobNotFound:
        raise RunNotFound(f"{store.url} has the record of run {run_id!r} but not its {CONFIG_BLOB}") from None


async def find_run(run_id: str, bus_section: Any, storage_section: Any, role: str) -> tuple[RunRecord, str, str]:
    """Run ``run_id``'s record, its saved configuration (TOML text) and the storage URL that reaches its
    store from here, through its bus, connected to as ``role``.

    Args:
        bus_section: ``runtime.run_config.BusSection``: ``url`` (required), credentials directory, TLS files.
        storage_section: ``StorageSection``: where this machine reaches the store (a shared folder may be
            mounted elsewhere than where the run started), empty for the record's.

    Raises:
        ConfigError: no bus URL, the bus unreachable, or it or its store holds no such run.
    """
    if not bus_section.url:
        raise ConfigError(f"finding run {run_id!r} by its id needs the bus that carries it: "
                          "--set bus.url=nats://host:4222")
    credentials = read_credentials(bus_section.credentials_dir, role) if bus_section.credentials_dir else None
    tls = tls_context(bus_section.tls_ca_file, bus_section.tls_cert_file, bus_section.tls_key_file)
    try:
        bus = await Bus.connect(bus_section.url, name=f"{role}-find-run", credentials=credentials, tls=tls)
    except BusError as e:
        raise ConfigError(f"cannot reach the bus {bus_section.url} of run {run_id!r}: {e}") from None
    try:
        record = await read_run_record(bus)
    finally:
        await bus.close()
    if record is None or record.run_id != run_id:
        held = "no run" if record is None else f"run {record.run_id!r}"
        raise RunNotFound(f"the bus {bus_section.url} carries {held}, not {run_id!r}")
    storage_url = storage_url_of(storage_section.url or record.storage_url, run_id)
    async with open_store(storage_url, s3_endpoint=(storage_section.s3_endpoint or record.s3_endpoint) or None) as st:
        return record, await read_run_config(st, run_id), storage_url
