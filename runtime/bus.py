"""The NATS bus: connection, JetStream streams and consumers, KV buckets, all created idempotently.

The only module that talks to nats-py: the rest of the project uses `Bus`'s typed API (KV records,
core messages, work-queue messages, stream follows) and the runtime's errors. The subjects, streams and
buckets it carries are in docs/ARCHITECTURE.md ("Subjects", "Buckets"); its API in "Bus API".
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import heapq
import itertools
import json
import math
import re
import secrets
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal
from urllib.parse import urlsplit

import nats
import nats.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    Header,
    KeyValueConfig,
    RePublish,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import (
    APIError,
    BadRequestError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoKeysError,
    NoStreamResponseError,
    NotFoundError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue

from runtime.backoff import doubling
from runtime.bus_auth import BusCredentials, follow_subject, inbox_prefix, kv_watch_subject
from runtime.cancellation import cancellation_kept
from runtime.errors import BusError, BusTimeout, NoResponders, RevisionMismatch
from runtime.gather import gather_or_cancel
from runtime.kv_watch import Admission, KVEntry, WatchCursor, entry_of, subject_matches
from runtime.nats_headers import parse_header_lines

log = structlog.get_logger(__name__)

KV_BUCKETS = ("slots", "config", "actors", "run")  # run: the run's record and state (runtime.run_state)
# Buckets whose keys are leases: each write may carry a TTL (`Bus.kv_put`'s ``ttl_s``), and the server
# removes a key whose TTL ran out, leaving a delete marker that watchers see (nats-server >= 2.11).
LEASE_BUCKETS = frozenset({"actors"})
_LEASE_MARKER_TTL_S = 60.0  # how long the server keeps the marker of an expired lease (watchers see it live)
_NEVER = "never"  # a record's TTL that exempts it from its stream's max age (nats-server >= 2.11)
_TTL_UNSUPPORTED = (10166,)  # JSMessageTTLDisabledErr: the bucket's stream takes no per-message TTL
# a replicated bus's reads give up on one server after this and ask again (until `BusLimits.election_wait_s`):
# one asked while its stream elects a leader is never answered, and 5 s would add 5 s to every election
_READ_PROBE_S = 1.0
_NOT_PLACED_YET = (10005, 10008)  # no suitable peers for placement (yet); JetStream cluster not available (yet)


async def through_election(what: str, make: Callable[[], Awaitable[Any]], wait_s: float) -> Any:
    """A JetStream API request (create a stream or a consumer, read a stream's state or a key) made
    again, for at most ``wait_s``, while a cluster cannot serve it yet: one just formed, whose meta
    leader has not yet heard from every peer ("no suitable peers"), or one electing a leader after a
    server was lost (no answer in time, "unavailable", no responders). Past the bound the last error
    is raised; with ``wait_s`` = 0 (one server: no election to wait for) the first."""
    deadline = time.monotonic() + wait_s
    for attempt in itertools.count():
        try:
            return await make()
        except (ServiceUnavailableError, NoStreamResponseError, BadRequestError, nats.errors.TimeoutError,
                nats.errors.NoRespondersError, _BehindLeader) as e:
            transient = not isinstance(e, BadRequestError) or getattr(e, "err_code", None) in _NOT_PLACED_YET
            delay = election_backoff_s(attempt)
            if not transient or time.monotonic() + delay > deadline:
                raise
            log.info("jetstream_request_retried", what=what, error=repr(e), retry_in_s=delay)
        await asyncio.sleep(delay)


def election_backoff_s(attempt: int) -> float:
    """The wait before the next try of something a cluster electing a leader refused (``attempt`` 0 first):
    0.1 s doubling to 1 s, as an election ends within seconds and is then noticed at once."""
    return doubling(0.1, 1.0, attempt)


def server_urls(url: str | Sequence[str]) -> list[str]:
    """The servers a connection may use: a list of URLs, or one string of comma-separated URLs (as NATS
    tools take them), e.g. ``nats://a:4222,nats://b:4222``.

    Raises:
        ValueError: no URL, or one that is not ``nats://`` or ``tls://`` HOST:PORT.
    """
    urls = [u.strip() for u in (url.split(",") if isinstance(url, str) else url)]
    if not urls or not all(urls):
        raise ValueError(f"bus URL {url!r}: expected one or more nats://HOST:PORT (a list, or comma-separated)")
    for u in urls:
        parsed = urlsplit(u)
        if parsed.scheme not in ("nats", "tls") or not parsed.hostname:
            raise ValueError(f"bus URL {u!r} (in {url!r}): expected nats://HOST:PORT or tls://HOST:PORT")
    return urls


class BusClient(NatsClient):
    """nats-py's client with `runtime.nats_headers.parse_header_lines` for each message's headers: the same
    result as nats-py's own parse, at about a third of its cost (a resume of 10^5 slots reads 10^5 records of
    ten headers each). nats-py calls it through the instance, for plain header blocks and for those after an
    inline status; each client remembers the header names it has checked."""

    def __init__(self) -> None:
        super().__init__()
        self._header_names: dict[bytes, str] = {}

    def _parse_header_lines(self, raw: bytes) -> dict[str, str]:  # type: ignore[override]  # nats-py's is static
        return parse_header_lines(raw, self._header_names)


@dataclass(frozen=True)
class Queue:
    """A JetStream work-queue stream and the durable pull consumer all actors of one kind share."""

    name: str
    subjects: tuple[str, ...]

    @property
    def stream(self) -> str:
        return f"Q_{self.name.upper()}"

    @property
    def durable(self) -> str:
        return self.name


def work_queue(stage: str) -> Queue:
    return Queue(f"work_{stage}", (f"work.{stage}",))


DONE_QUEUE = Queue("done", ("done.>",))


@dataclass(frozen=True)
class Inbound:
    """A core NATS message a subscription received; `Bus.respond` answers it when it has a ``reply`` subject."""

    subject: str
    data: bytes
    reply: str = ""


@dataclass(frozen=True)
class StreamMessage:
    """A message of a stream read by `Bus.follow`; ``num_pending``: how many the stream held after it then."""

    subject: str
    data: bytes
    stream_sequence: int
    num_pending: int


@dataclass(frozen=True)
class StreamState:
    """A stream's counters: ``last_sequence - num_messages`` messages have left it (acknowledged, for a work queue)."""

    name: str
    subjects: tuple[str, ...]
    num_messages: int
    last_sequence: int


class Subscription:
    """A core subscription made by `Bus.subscribe`; `unsubscribe` is bounded and quiet on a closed connection."""

    def __init__(self, sub: Any) -> None:
        self._sub = sub

    async def unsubscribe(self) -> None:
        with contextlib.suppress(OSError), _translated("unsubscribe"):  # closed or reconnecting: nothing to undo
            async with asyncio.timeout(5.0):
                await self._sub.unsubscribe()


async def _held(subscribing: Awaitable[Any]) -> Any:
    """The subscription nats-py makes (``subscribing``); or, when the caller's cancellation comes instead (raised
    again by `cancellation_kept`: nats-py may swallow it while subscribing), none: it is undone, as one that
    nobody holds would go on receiving, and the connection's drain would wait for it."""
    sub = None
    try:
        with cancellation_kept():
            sub = await subscribing
    except asyncio.CancelledError:
        if sub is not None:
            await Subscription(sub).unsubscribe()
        raise
    return sub


class WorkMessage:
    """A message of a work queue, from `PullConsumer.fetch`; settled once with `ack` or `nak`, kept alive
    meanwhile with `in_progress` (each one core write: no round trip)."""

    __slots__ = ("_msg",)

    def __init__(self, msg: Msg) -> None:
        self._msg = msg

    @property
    def subject(self) -> str:
        return self._msg.subject

    @property
    def data(self) -> bytes:
        return self._msg.data

    @property
    def stream_sequence(self) -> int:
        return self._msg.metadata.sequence.stream

    @property
    def num_delivered(self) -> int:
        """1 on the first delivery, more on a redelivery (after a nak, or an ack wait that ran out)."""
        return self._msg.metadata.num_delivered

    @property
    def msg_id(self) -> str | None:
        """The publisher's ``Nats-Msg-Id`` (the stream's dedup key), if it gave one."""
        return (self._msg.headers or {}).get("Nats-Msg-Id")

    async def ack(self) -> None:
        with _translated(f"ack on {self.subject}"):
            await self._msg.ack()

    async def nak(self, delay: float | None = None) -> None:
        """Redeliver it, after ``delay`` seconds if given."""
        with _translated(f"nak on {self.subject}"):
            await self._msg.nak(delay=delay)

    async def in_progress(self) -> None:
        """Restart its ack wait: the handler is still at work."""
        with _translated(f"in_progress on {self.subject}"):
            await self._msg.in_progress()


class PullConsumer:
    """A queue's durable pull consumer, shared by every actor of its kind (`Bus.pull_consumer`)."""

    def __init__(self, sub: Any, name: str = "") -> None:
        self._sub = sub
        self.name = name
        self._unavailable_since: float | None = None  # its consumer has had no leader since (a cluster's election)

    async def fetch(self, batch: int, timeout_s: float) -> list[WorkMessage]:
        """Up to ``batch`` messages; waits at most ``timeout_s`` for the first (none came: an empty list).

        On a cluster, a consumer whose leader is lost answers "unavailable" until its peers elect
        another: that is no message either, after the same wait (no busy loop), and said once per
        election (``consumer_unavailable``, then ``consumer_available`` with how long it lasted).
        """
        try:
            with _translated("fetch"):
                try:
                    msgs = await self._sub.fetch(batch=batch, timeout=timeout_s)
                except ServiceUnavailableError:
                    msgs = None
        except BusTimeout:  # nothing came in time
            msgs = []
        if msgs is None:
            if self._unavailable_since is None:
                self._unavailable_since = time.monotonic()
                log.warning("consumer_unavailable", consumer=self.name, reason="no leader (a cluster's election)")
            await asyncio.sleep(timeout_s)
            return []
        if self._unavailable_since is not None:
            log.info("consumer_available", consumer=self.name,
                     unavailable_s=round(time.monotonic() - self._unavailable_since, 3))
            self._unavailable_since = None
        return [WorkMessage(m) for m in msgs]

    async def unsubscribe(self) -> None:
        with _translated("unsubscribe"):
            await self._sub.unsubscribe()


FollowStart = Literal["all", "new"] | datetime  # where `Bus.follow` starts: everything kept, new ones, or a time


@contextlib.contextmanager
def _translated(what: str) -> Iterator[None]:
    """Where this module awaits nats-py: its errors as the runtime's (callers never import nats:
    docs/ARCHITECTURE.md, "Layers"), and a cancellation it swallowed raised again (`cancellation_kept`), so
    that no method returns, and no iterator yields or waits on, after its task was cancelled."""
    with cancellation_kept(), _errors_translated(what):
        yield


@contextlib.contextmanager
def _errors_translated(what: str) -> Iterator[None]:
    try:
        yield
    except KeyWrongLastSequenceError as e:
        raise RevisionMismatch(f"{what}: {e.description or e}") from e
    except nats.errors.NoRespondersError as e:
        raise NoResponders(f"{what}: no responder") from e
    except TimeoutError as e:  # nats-py's own, or asyncio's that some of its calls raise (a pull fetch)
        raise BusTimeout(f"{what}: no answer in time") from e
    except nats.errors.Error as e:
        raise BusError(f"{what}: {e!r}") from e


@dataclass(frozen=True)
class BusLimits:
    """Stream and consumer limits, chosen deliberately (see each comment)."""

    ack_wait_s: float = 30.0  # unacked work is redelivered after this; handlers heartbeat well within it
    max_deliver: int = 50  # the reconciler bounds attempts itself; this only stops poison loops
    max_ack_pending: int = 10_000
    duplicate_window_s: float = 120.0  # Nats-Msg-Id dedup window for publishes
    work_max_bytes: int = 2 * 1024**3
    log_max_age_s: float = 7 * 24 * 3600.0
    log_max_bytes: int = 1024**3
    dlq_max_age_s: float = 30 * 24 * 3600.0
    dlq_max_bytes: int = 256 * 1024**2
    kv_history: int = 1
    reconnect_wait_s: float = 0.5  # between reconnect attempts (forever: an outage is bounded above)
    ping_interval_s: int = 10  # a silent dead peer is found after ping_interval_s * max_outstanding_pings
    max_outstanding_pings: int = 3
    # copies of every stream and bucket the bus creates: 1 on a single server, 3 on a JetStream cluster
    # (a lost server loses nothing, and its streams elect a new leader among the others)
    replicas: int = 1
    # creating a stream or a consumer waits this long for a cluster to place it or to elect a leader
    # (measured on loopback under load: elections end 6 to 7 s after a server is lost)
    election_wait_s: float = 20.0
    # a follow or KV watch whose reads time out while the connection stays up (a server starved of CPU or disk:
    # a run beside other work) reads again from where it stopped for this long before it fails: as long as a run
    # waits out an unreachable bus (bus.max_outage_s' default), so that a server that is only slow never ends a
    # long-lived reader sooner than one that is gone would (the dashboard and the evaluator did, under load 20+)
    max_slow_read_s: float = 60.0

    def __post_init__(self) -> None:
        if self.ack_wait_s < 1.0:
            raise ValueError(f"ack_wait_s={self.ack_wait_s} is too small for in_progress heartbeats; use >= 1")
        if not 1 <= self.replicas <= 5:
            raise ValueError(f"replicas={self.replicas}: JetStream keeps 1 to 5 copies of a stream")
        if self.max_slow_read_s <= 0:
            raise ValueError(f"max_slow_read_s={self.max_slow_read_s}: a follow needs some time to read again; use > 0")


_MAX_MULTI_LAST = 1024  # the most keys whose last records one direct get reads (nats-server's limit)
_FOLLOW_BATCH = 256  # records per direct get while a follow catches up
# a bulk read's direct gets in flight at once: enough to keep the server reading while this process takes in
# records (one at a time left either idle half the time), few enough that a read holds a bounded share of
# the server and of this process's memory beyond the records themselves
_READS_IN_FLIGHT = 4


async def direct_get(nc: NatsClient, stream: str, request: dict[str, Any], timeout_s: float) -> tuple[list[Msg], Msg]:
    """One batched direct get of ``stream`` (``multi_last`` or ``batch``: any replica answers): the records
    it sends (each with the ``Nats-Sequence`` the server sets) and the message that ends it, a status (204
    the batch's end, with ``Nats-Num-Pending``; 404 none; 413 too many). Every reply is waited for at most
    ``timeout_s`` (nats-py's ``TimeoutError``)."""
    # received by a callback, not one `next_msg` (a timed wait, a task) per record: a read of 10^5 records
    # would spend more on the waits than on the records
    records: list[Msg] = []
    end: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()

    async def received(msg: Msg) -> None:
        if "Nats-Sequence" in (msg.headers or {}):
            records.append(msg)  # a record (the server sets this header); anything else is the answer's end
        elif not end.done():
            end.set_result(msg)

    # held even when the caller is cancelled while subscribing: a bulk read cancels its other batches on an error
    sub = await _held(nc.subscribe(nc.new_inbox(), cb=received, pending_msgs_limit=0, pending_bytes_limit=0))
    try:
        await nc.publish(f"$JS.API.DIRECT.GET.{stream}", json.dumps(request).encode(), reply=sub.subject)
        while True:
            num = len(records)
            done, _ = await asyncio.wait([end], timeout=timeout_s)
            if done:
                return records, end.result()
            if len(records) == num:  # nothing came within the timeout
                raise nats.errors.TimeoutError
    finally:
        await Subscription(sub).unsubscribe()


class _TooManyKeys(Exception):  # a signal between two of Bucket's methods, never raised out of it
    """More keys match than one direct get reads."""


class _BehindLeader(nats.errors.Error):
    """A replica answered a bucket's read before it had the newest record its leader holds."""


async def leader_newest(js: JetStreamContext, stream: str, subjects: str) -> int:
    """The sequence of the newest message of ``subjects`` (wildcards allowed) that the leader of ``stream``
    holds (a leader's get), 0 if none."""
    try:
        return (await js.get_msg(stream, subject=subjects)).seq or 0
    except NotFoundError:
        return 0


def watch_republish(bucket: str) -> RePublish:
    """The republish rule of a bucket's stream that its watches read (`runtime.kv_watch`)."""
    return RePublish(src=f"$KV.{bucket}.>", dest=kv_watch_subject(bucket))


class Bucket(KeyValue):
    """A JetStream KV bucket whose `keys` lists every live key.

    nats-py's ``KeyValue.keys`` replays the bucket through a watcher and stops at the first message
    that reports nothing pending, or at once if its setup saw no deliveries yet; under concurrent
    writes either comes early, and the listing is short, empty or repeats a key (nats-io/nats.py#842,
    #995; measured here: 43 of 300 listings of a 200-key bucket wrong while one writer updated it).
    This one asks the server for the stream's subjects (one snapshot per page) and drops the keys
    whose last record is a delete or purge marker.
    """

    def __init__(self, nc: NatsClient, js: JetStreamContext, name: str, direct: bool,
                 election_wait_s: float = 0.0) -> None:
        self.bucket = name
        self._election_wait_s = election_wait_s  # a replicated bucket's reads wait out its leader's election
        self._js_quick = nc.jetstream(timeout=_READ_PROBE_S)
        self._read_timeout_s = _READ_PROBE_S if election_wait_s else 5.0
        self._prefix = f"$KV.{name}."  # a key's subject is prefix + key
        stream = f"KV_{name}"
        super().__init__(name=name, stream=stream, pre=self._prefix, js=js, direct=direct)
        self._nc = nc
        self._stream_info_subject = f"$JS.API.STREAM.INFO.{stream}"

    @property
    def stream(self) -> str:
        """The bucket's stream, ``KV_<bucket>``."""
        return self._stream

    @property
    def prefix(self) -> str:
        """What a key's subject starts with, ``$KV.<bucket>.``."""
        return self._prefix

    async def keys(self, filters: list[str] | None = None, **kwargs: Any) -> list[str]:
        """The live keys (containing one of `filters`, if given); raises ``NoKeysError`` if none, as nats-py does."""
        keys = [k for k in (await self._stored_keys())[0] if not filters or any(f in k for f in filters)]
        live = await gather_or_cancel(*(self._is_live(k) for k in keys))
        keys = [k for k, alive in zip(keys, live, strict=True) if alive]
        if not keys:
            raise NoKeysError
        return keys

    async def _stored_keys(self, keys: str = ">") -> tuple[list[str], int]:
        """Every key matching ``keys`` with a record in the stream, deleted and purged ones included, and the
        stream's last sequence when the listing began."""
        listed: list[str] = []
        last_sequence = -1
        while True:
            request = {"subjects_filter": f"{self._prefix}{keys}", "offset": len(listed)}
            reply = await through_election(f"list {self.bucket}", lambda request=request: self._nc.request(
                self._stream_info_subject, json.dumps(request).encode(), self._read_timeout_s), self._election_wait_s)
            info = json.loads(reply.data)
            if "error" in info:
                raise BusError(f"cannot list the keys of bucket {self.bucket!r}: {info['error']}")
            if last_sequence < 0:
                last_sequence = int(info["state"].get("last_seq", 0))
            page = list((info["state"].get("subjects") or {}).keys())
            listed += [s[len(self._prefix) :] for s in page]
            if not page or len(listed) >= info.get("total", 0):
                return listed, last_sequence

    async def current(self, keys: str) -> tuple[WatchCursor, list[KVEntry]]:
        """The last record of every key matching ``keys`` (delete and purge markers included), in stream
        order, read at one sequence of the stream, and the cursor a watch goes on from (`runtime.kv_watch`),
        read after the watch subscribed to the stream's republished records.

        Raises:
            BusError: the bucket's stream does not republish its records for watches (a bucket made by an
                older version or by hand: the supervisor's `Bus.ensure_bucket` makes it so), or the
                server refused the read.
        """
        info = await (self._js_quick if self._election_wait_s else self._js).stream_info(self._stream)
        republish, wanted = info.config.republish, watch_republish(self.bucket)
        if republish is None or (republish.src, republish.dest) != (wanted.src, wanted.dest) \
                or republish.headers_only or not info.config.allow_direct:
            raise BusError(f"bucket {self.bucket!r} cannot be watched: its stream {self._stream} does not republish "
                           f"its records to {kv_watch_subject(self.bucket)} with direct gets allowed (made by an "
                           "older version, or not by the supervisor); the supervisor's ensure_base and "
                           "provision_streams (runtime.up) set that on every bucket of the run")
        matching = f"{self._prefix}{keys}"
        try:
            records, up_to = await self._last_records([matching])
        except _TooManyKeys:  # the server reads at most 1024 keys' last records per request: list them, then read
            listed, up_to = await self._stored_keys(keys)
            records = await self._read_batches(listed, up_to)
        if (info.config.num_replicas or 1) > 1:
            await self._check_caught_up(matching, up_to)
        entries = [entry_of(m.headers["Nats-Subject"][len(self._prefix) :], m.data, int(m.headers["Nats-Sequence"]),
                            m.headers) for m in records]
        # the cut: where the read was made, or (none matched then) the stream's last sequence before it, after
        # which every record was republished to the subscription made before
        return WatchCursor(max(up_to, info.state.last_seq)), [e for e in entries if e is not None]

    async def _read_batches(self, listed: list[str], up_to: int) -> list[Msg]:
        """The last record at or before stream sequence ``up_to`` of each of the keys `listed`, in stream order:
        ``_MAX_MULTI_LAST`` keys a direct get, ``_READS_IN_FLIGHT`` of them at once (the server reads one batch
        while this process takes in another's records). All read at ``up_to``, so a write landing meanwhile is
        in none of them (nor is the key it rewrote: a bucket keeping one record a key has dropped the record at
        ``up_to``; a watch gets the new one after its cursor). The first to fail fails the read; the others are
        cancelled (each unsubscribes).

        Raises:
            BusError: the server refused a batch.
            nats.errors.TimeoutError: a batch's server went silent for the read's timeout.
        """
        subjects = [self._prefix + k for k in listed]
        starts = range(0, len(subjects), _MAX_MULTI_LAST)
        batches = iter(starts)
        read: list[list[Msg]] = []

        async def reader() -> None:  # takes the next batch until none is left (one shared iterator)
            for first in batches:
                read.append((await self._last_records(subjects[first : first + _MAX_MULTI_LAST], up_to))[0])

        await gather_or_cancel(*(reader() for _ in range(min(_READS_IN_FLIGHT, len(starts)))))
        records = [m for got in read for m in got]
        records.sort(key=lambda m: int(m.headers["Nats-Sequence"]))
        return records

    async def _last_records(self, subjects: list[str], up_to: int = 0) -> tuple[list[Msg], int]:
        """The last record at or before stream sequence ``up_to`` (0: the stream's last when the server reads)
        of each subject matching ``subjects``, by direct gets (one request, continued while the server's
        byte limit per answer cuts it short); and the sequence they were read at (0: none matched then).

        Raises:
            _TooManyKeys: more subjects match than the server reads in one request.
        """
        records: list[Msg] = []
        start = 0
        while True:
            request = {"multi_last": subjects} | ({"up_to_seq": up_to} if up_to else {}) | (
                {"seq": start} if start else {})
            got, end = await direct_get(self._nc, self._stream, request, self._read_timeout_s)
            records += got
            headers = end.headers or {}
            status = headers.get("Status")
            if status == "404":  # none (left) at or before the sequence read at
                return records, up_to
            if status == "413":
                raise _TooManyKeys
            if status != "204":
                raise BusError(f"reading the records of bucket {self.bucket!r}: the server answered {status} "
                               f"{headers.get(Header.DESCRIPTION, '')!r}")
            up_to = int(headers["Nats-UpTo-Sequence"])
            if int(headers.get("Nats-Num-Pending", "0")) == 0:
                return records, up_to
            start = int(headers["Nats-Last-Sequence"]) + 1  # the rest: after the last record this answer held

    async def _check_caught_up(self, matching: str, up_to: int) -> None:
        """That a direct get of a replicated bucket, which any replica answers, saw the newest record the
        stream's leader holds of ``matching`` (a replica catching up after a restart would miss some).

        Raises:
            _BehindLeader: it did not (`through_election` reads again, for a while).
        """
        newest = await leader_newest(self._js_quick, self._stream, matching)
        if newest > up_to:
            raise _BehindLeader(f"the replica that answered for {self.bucket!r} had read up to {up_to}, "
                                f"its leader holds {newest}")

    async def _get(self, key: str, revision: int | None = None) -> KeyValue.Entry:
        """nats-py's read of a key, except that a delete marker the server placed (a TTL that ran out,
        `LEASE_BUCKETS`; nats-py's ``get`` takes it for a value) is a deleted key too."""
        subject = f"{self._prefix}{key}"
        try:
            js = self._js_quick if self._election_wait_s else self._js
            msg = await through_election(f"get {self.bucket}/{key}", lambda: js.get_msg(
                self._stream, subject=None if revision else subject, seq=revision, direct=self._direct),
                self._election_wait_s)
        except NotFoundError:
            raise KeyNotFoundError from None
        if msg.subject != subject:
            raise KeyNotFoundError(message=f"expected {subject!r}, but got {msg.subject!r}")
        entry = KeyValue.Entry(bucket=self.bucket, key=key, value=msg.data, revision=msg.seq, delta=None,
                               created=None, operation=None)
        headers = msg.headers or {}
        operation = headers.get("KV-Operation")
        if operation in ("DEL", "PURGE") or "Nats-Marker-Reason" in headers:
            raise KeyDeletedError(entry, operation or "PURGE")
        return entry

    async def _is_live(self, key: str) -> bool:
        try:
            await self.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            return False
        return True


class BusAuthRefused(BusError):
    """The bus refused to sign the client in: no credentials, or not the bus's."""


class KVWriteFailed(BusError):
    """A chained KV write was refused or not acknowledged in time; the bucket holds a prefix of the chain."""


class ChainedWriteConflict(RevisionMismatch):
    """A chained write's expected revision was not its key's (or another writer broke the chain)."""

    def __init__(self, bucket: str, key: str, expected: int | None) -> None:
        super().__init__(f"compare-and-set on {bucket}/{key} expected revision {expected}; another writer wrote it")
        self.key = key
        self.expected = expected


class ChainedKVWriter:
    """Writes to one KV bucket sent back to back, each conditional on the one before (group commit).

    (nats-py's ``publish_async`` is not used: its futures never resolve when the server refuses a
    write, nats-py 2.16 raising inside its reply handler instead.)

    Every write carries two conditions the server checks: the key's last revision (the
    compare-and-set) and the bucket stream's last sequence (the previous write of this writer). So
    the writes apply in the order they were made, each only if all before it applied: the bucket
    always holds a prefix of them, as if the writer had crashed there. A write's revision is known
    before it is sent (the stream's last sequence + 1, this writer being the bucket's only writer),
    so the caller runs on without a round trip per write.

    The sequence alone does not say whose write the previous one was: a writer overtaken by one
    other write (a successor's fence) would find its second pending write expecting exactly that
    write's sequence, and land. So each write also carries a message id of this writer's own and
    expects the stream's last message to be this writer's previous write (the first write of a
    writer expects only the sequence it read when it opened): once any other writer wrote, no
    write of this one lands, whatever the sequences.

    Because of that chain, only the last write of each `flush` asks for an acknowledgement: the
    server stores it only if every write before it was stored, so its acknowledgement confirms them
    all, and its refusal (its own conflict, or the broken chain of an earlier one) reports theirs.
    After any failed write the writer is broken: every later call raises the first error's kind.

    A replicated stream refuses a write at once, yet stores the writes before it a raft round
    later. So once a write is refused, a failing `flush` and `close` return only when the writes
    sent before it are answered (or `ack_timeout_s` after the refusal, when they are taken for
    dropped): the bucket's prefix is then final for whoever reads it next (a resume), and the error
    is that of the first write that failed, the same for every caller.
    """

    def __init__(self, nc: NatsClient, bucket: str, last_sequence: int, ack_timeout_s: float,
                 ack_every_write: bool = False) -> None:
        self._nc = nc
        self.bucket = bucket
        # A replicated stream electing a leader drops a write it cannot take, which says nothing when
        # no reply was asked: the next acknowledged write would then find the chain broken, as if
        # another writer had written. So there each write asks for its acknowledgement, and the first
        # refusal ("no stream answered") is the error the writer reports.
        self._ack_every_write = ack_every_write
        self._subject_prefix = f"$KV.{bucket}."
        self._opened_at = last_sequence  # the stream's last sequence when opened: the first write's condition
        self._id_prefix = f"{secrets.token_hex(8)}."  # this writer's message ids: <prefix><sequence>
        self._last = last_sequence  # sequence of the newest write made (buffered or sent)
        self._sent = last_sequence  # sequence of the newest write sent
        self._durable = last_sequence  # every write up to this one is acknowledged
        self._ack_timeout_s = ack_timeout_s
        self._order = asyncio.Lock()  # FIFO: buffers reach the connection in the order of their sequence
        self._buffer: list[tuple[str, bytes, int | None]] = []  # (key, value, expected revision), not sent
        self._sent_of: dict[str, int] = {}  # key -> sequence of this writer's newest write of it sent
        self._writes: dict[int, tuple[str, int | None]] = {}  # acknowledgement asked: sequence -> (key, expected)
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []  # heap of (sequence, id, future)
        self.broken: Exception | None = None
        self._refused_at: int | None = None  # sequence of the first write refused (the chain's end)
        self._refused_when = 0.0  # loop time of the first refusal: `_settle`'s deadline counts from it
        self._dropped_before: int | None = None  # ... when refused as if writes before it were dropped
        self._answered = asyncio.Event()  # set by each acknowledgement or refusal
        self._settled = False  # the failure is final: no later answer changes `broken`
        self._inbox = f"{nc.new_inbox()}."
        self._sub: Any = None

    @classmethod
    async def open(cls, bus: Bus, bucket: str, ack_timeout_s: float = 10.0) -> ChainedKVWriter:
        await bus.kv(bucket)
        with _translated(f"open a writer of {bucket}"):  # before subscribing: a cancelled open makes no subscription
            info = await bus._through_election(f"open {bucket}", lambda: bus.js_reads.stream_info(f"KV_{bucket}"))
        writer = cls(bus.nc, bucket, info.state.last_seq, ack_timeout_s,
                     ack_every_write=(info.config.num_replicas or 1) > 1)
        with _translated(f"open a writer of {bucket}"):
            writer._sub = await _held(bus.nc.subscribe(f"{writer._inbox}*", cb=writer._on_ack))
        return writer

    async def close(self) -> None:
        """Stop listening for acknowledgements; writes not yet flushed stay unconfirmed (or unsent).
        A writer with a refused write first waits for the answers to the writes before it (`_settle`)."""
        await self._settle()
        self._fail(KVWriteFailed(f"the writer of bucket {self.bucket!r} was closed"))
        if self._sub is not None:
            with contextlib.suppress(Exception), cancellation_kept():
                await self._sub.unsubscribe()

    def write(self, key: str, value: bytes, expected_revision: int | None) -> int:
        """Buffer a write (`expected_revision` None: create); the revision it will have once flushed."""
        self._check()
        self._buffer.append((key, value, expected_revision))
        self._last += 1
        return self._last

    @property
    def pending(self) -> bool:
        """Some write made is not acknowledged yet."""
        return self._last > self._durable

    async def _send(self) -> None:
        # nats-py's publish may swallow a cancellation: raised once the lock is left, the writes all sent
        with cancellation_kept():
            async with self._order:
                buffer, self._buffer = self._buffer, []
                if not buffer or self.broken is not None:
                    return  # broken: never sent (the caller's flush reports the failure)
                try:
                    await self._send_buffer(buffer)
                except Exception as e:  # the connection refused one (too large, its buffer full): the chain ends
                    self._refuse(self._sent + 1, KVWriteFailed(f"sending the write to {self.bucket!r} at sequence "
                                                               f"{self._sent + 1} failed: {e!r}"))
                except BaseException:  # cancelled partway: the revisions handed out after it will never be
                    self._refuse(self._sent + 1, KVWriteFailed(f"sending the writes to {self.bucket!r} was "
                                                               f"cancelled at sequence {self._sent + 1}"))
                    raise

    async def _send_buffer(self, buffer: list[tuple[str, bytes, int | None]]) -> None:
        last = len(buffer) - 1
        for i, (key, value, expected) in enumerate(buffer):
            sequence = self._sent + 1
            headers = {Header.EXPECTED_LAST_SEQUENCE: str(self._sent), Header.MSG_ID: f"{self._id_prefix}{sequence}"}
            if self._sent > self._opened_at:  # the stream's last message must be this writer's previous write
                headers[Header.EXPECTED_LAST_MSG_ID] = f"{self._id_prefix}{self._sent}"
            previous = self._sent_unacknowledged(key)
            # A replicated stream refuses a write whose subject has another write in flight
            # ("wrong last sequence": its leader checks against what it has applied, not
            # proposed). Expecting exactly this writer's own write in flight is implied by the
            # chain (every write before this one stored, none between them), so that check is
            # left to the chain; any other expectation is the server's to refuse.
            if previous is None or expected != previous:
                headers[Header.EXPECTED_LAST_SUBJECT_SEQUENCE] = str(expected or 0)
            self._sent_of[key] = sequence
            reply = ""
            if i == last or self._ack_every_write:
                self._writes[sequence] = (key, expected)
                reply = f"{self._inbox}{sequence}"
            await self._nc.publish(self._subject_prefix + key, value, reply=reply, headers=headers)
            self._sent = sequence

    def _sent_unacknowledged(self, key: str) -> int | None:
        """The sequence of this writer's newest write of ``key`` already sent, if not acknowledged yet."""
        sequence = self._sent_of.get(key)
        if sequence is not None and sequence <= self._durable:
            del self._sent_of[key]  # stored: the server checks against it as usual
            return None
        return sequence

    async def flush(self) -> None:
        """Send the buffered writes and wait until every write made so far is acknowledged.

        Raises:
            ChainedWriteConflict: a write found another revision (or the chain was broken by another writer).
            KVWriteFailed: an earlier write failed, the connection failed, or no acknowledgement came
                within the timeout.
        """
        if self.broken is not None:
            await self._settle()
            self._check()
        target = self._last
        if target <= self._durable:
            return
        await asyncio.sleep(0)  # let the other ready callers buffer their writes: one send, one reply for all
        await self._send()
        if target <= self._durable:
            return
        waiter = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (target, id(waiter), waiter))
        if self.broken is not None:  # refused while this call was sending
            self._fail(self.broken)
        try:  # asyncio.timeout, not 3.11's wait_for: that one swallows a cancellation that meets the last ack
            async with asyncio.timeout(self._ack_timeout_s):
                await asyncio.shield(waiter)
        except TimeoutError:
            self._fail(KVWriteFailed(f"writes to {self.bucket!r} up to sequence {target} not acknowledged "
                                     f"within {self._ack_timeout_s}s"))
            self._check()
        except (KVWriteFailed, ChainedWriteConflict):
            await self._settle()
            raise self.broken from None

    async def _settle(self) -> None:
        """After a refusal: wait, until `ack_timeout_s` after it, for the answers to the writes sent
        before the refused one; then name the failure by what they show, once for every caller."""
        if self._refused_at is None or self._settled:
            return
        loop = asyncio.get_running_loop()
        deadline = self._refused_when + self._ack_timeout_s
        while not self._settled and any(s < self._refused_at for s in self._writes):
            self._answered.clear()
            try:
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    await self._answered.wait()
            except TimeoutError:
                break  # never answered: dropped with a lost leader, as the verdict below says
        if self._settled:
            return
        self._settled = True
        self._answered.set()  # other callers settling see the verdict
        if self._dropped_before is not None and self._durable < self._dropped_before - 1:
            # an earlier write of the chain was not stored and the bucket ends before it: dropped (a
            # replicated stream losing its leader with it in flight), not overtaken by another writer
            self.broken = KVWriteFailed(f"the writes to {self.bucket!r} before sequence {self._dropped_before} "
                                        "were not stored: the stream ends before them")

    async def _on_ack(self, msg: Msg) -> None:
        sequence = int(msg.subject[len(self._inbox) :])
        key, expected = self._writes.pop(sequence, ("?", None))
        self._answered.set()
        if msg.headers and msg.headers.get("Status") == "503":
            self._refuse(sequence, KVWriteFailed(f"no JetStream stream answered the write of {key!r}"))
            return
        try:
            reply = json.loads(msg.data)
        except ValueError as e:
            self._refuse(sequence, KVWriteFailed(f"unreadable acknowledgement of the write of {key!r}: {e}"))
            return
        error = reply.get("error")
        if error and error.get("err_code") in (10070, 10071, 10164):  # wrong last message id, (subject) sequence
            found = re.search(r"wrong last sequence: (\d+)", error.get("description") or "")
            if self._refuse(sequence, ChainedWriteConflict(self.bucket, key, expected)) and self._ack_every_write \
                    and found and int(found.group(1)) < sequence - 1:
                self._dropped_before = sequence  # if the writes before it turn out not stored (`_settle`)
        elif error:
            self._refuse(sequence, KVWriteFailed(f"write of {key!r} failed: {error}"))
        elif reply.get("seq") != sequence:
            self._refuse(sequence, KVWriteFailed(f"write of {key!r} landed at sequence {reply.get('seq')}, "
                                                 f"not {sequence}: another writer is using this bucket"))
        else:  # the chain: every write up to this one is stored
            self._durable = max(self._durable, sequence)
            while self._waiters and self._waiters[0][0] <= self._durable:
                done = heapq.heappop(self._waiters)[2]
                if not done.done():
                    done.set_result(None)

    def _refuse(self, sequence: int, error: Exception) -> bool:
        """Record a refused write; the first one in the chain's order names the failure. True if it is."""
        if self._settled or (self._refused_at is not None and self._refused_at < sequence):
            return False  # refused because an earlier write was (the chain), or the verdict is given
        if self.broken is None or self._refused_at is not None:  # not broken, or by a later write's refusal
            self.broken = error
        if self._refused_at is None:
            self._refused_when = asyncio.get_running_loop().time()
        self._refused_at, self._dropped_before = sequence, None
        self._fail(error)
        return True

    def _fail(self, error: Exception) -> None:
        self.broken = self.broken or error
        for _, _, waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(self.broken)
                waiter.exception()  # retrieved: a waiter that timed out meanwhile must not warn
        self._waiters.clear()

    def _check(self) -> None:
        if self.broken is not None:
            raise KVWriteFailed(f"an earlier write to {self.bucket!r} failed ({self.broken!r}); open a new writer")


@dataclass
class _Unconfirmed:
    subject: str
    data: bytes
    msg_id: str
    deadline: float  # monotonic; not acknowledged by then: published again
    num_sent: int
    first_sent_at: float  # monotonic


class ConfirmingPublisher:
    """Publishes into streams without waiting for each acknowledgement, and sees that each message is stored.

    A sender on a hot path (the reconciler's orders) pays no round trip per message, yet loses none: a
    message whose acknowledgement does not come within ``confirm_within_s``, or comes as a refusal (a
    replicated stream electing its leader answers "no responders" or nothing; a full queue refuses), is
    published again under the same message id (the stream drops a copy it already stored) after a
    backoff, until it is stored. Without this, a message lost in a leader election waited for its stage's
    timeout to be re-issued: a stall of that timeout (20-120 s), not of the election (~6 s).

    Each message asks its acknowledgement on an inbox of this publisher's (one subscription; an
    acknowledgement costs a dictionary lookup, its JSON read only when it is a refusal); `run` (a task of
    the owner's TaskGroup) wakes for refusals and for the oldest message's deadline, not per message.
    Messages not confirmed when `run` is cancelled stay unconfirmed: the owner's successor re-issues from
    its durable state, as after a crash.
    """

    def __init__(self, nc: NatsClient, confirm_within_s: float = 2.0, give_up_after_s: float = 60.0) -> None:
        if not 0 < confirm_within_s < give_up_after_s:
            raise ValueError(f"confirm_within_s={confirm_within_s}, give_up_after_s={give_up_after_s}: "
                             "expected 0 < confirm_within_s < give_up_after_s")
        self._nc = nc
        self._confirm_within_s = confirm_within_s
        self._give_up_after_s = give_up_after_s
        self._inbox = f"{nc.new_inbox()}."
        self._sub: Any = None
        self._next_id = 0
        self._unconfirmed: dict[int, _Unconfirmed] = {}  # by reply id; in the order sent, so of deadline
        self._refused: list[tuple[_Unconfirmed, str]] = []  # (message, why), to be sent again
        self._backing_off: collections.deque[_Unconfirmed] = collections.deque()
        self._attention = asyncio.Event()  # a refusal came, or the first unconfirmed message was sent
        self._settled = asyncio.Event()  # some were confirmed or sent again (for `wait_confirmed`)
        self.num_published = 0
        self.num_republished = 0
        self.num_abandoned = 0

    async def open(self) -> ConfirmingPublisher:
        with _translated("subscribe to the acknowledgements' inbox"):
            self._sub = await _held(self._nc.subscribe(f"{self._inbox}*", cb=self._on_acknowledgement))
        return self

    async def close(self) -> None:
        if self._sub is not None:
            await Subscription(self._sub).unsubscribe()

    @property
    def num_unconfirmed(self) -> int:
        return len(self._unconfirmed) + len(self._refused) + len(self._backing_off)

    async def publish(self, subject: str, data: bytes, msg_id: str) -> None:
        """Sends the message (no round trip); `run` publishes it again until it is stored, or for
        ``give_up_after_s`` (then ``publish_abandoned``: the owner's own recovery, e.g. a stage's timeout,
        takes over)."""
        await self._send(_Unconfirmed(subject, data, msg_id, 0.0, 0, time.monotonic()))
        self.num_published += 1

    async def _send(self, message: _Unconfirmed) -> None:
        """Sends (again) and follows the message; a send that fails (a closed connection, the reconnect
        buffer full) is said and left to its deadline, like a message sent and lost."""
        if self._sub is None:
            raise RuntimeError("ConfirmingPublisher.open() first: its acknowledgements have no inbox yet")
        self._next_id += 1
        message.deadline = time.monotonic() + self._confirm_within_s
        message.num_sent += 1
        if not self.num_unconfirmed:
            self._attention.set()  # `run` was idle: it now has a deadline to keep
        self._unconfirmed[self._next_id] = message
        try:
            with _translated(f"publish on {message.subject}"):
                await self._nc.publish(message.subject, message.data, reply=f"{self._inbox}{self._next_id}",
                                       headers=_msg_id_headers(message.msg_id))
        except BusError as e:
            log.warning("publish_send_failed", subject=message.subject, msg_id=message.msg_id, error=str(e))

    async def _on_acknowledgement(self, msg: Msg) -> None:
        message = self._unconfirmed.pop(int(msg.subject[len(self._inbox):]), None)
        if message is None:  # late: it was sent again meanwhile, and that copy is followed
            return
        if (refusal := acknowledgement_refusal(msg)) is not None:
            self._refused.append((message, refusal))
            self._attention.set()
        else:
            self._settled.set()

    async def wait_confirmed(self, timeout_s: float) -> None:
        """Until every message published so far is stored (`run` going meanwhile).

        Raises:
            BusTimeout: some are not within ``timeout_s``.
        """
        try:
            async with asyncio.timeout(timeout_s):
                while self.num_unconfirmed:
                    self._settled.clear()
                    await self._settled.wait()
        except TimeoutError as e:
            raise BusTimeout(f"{self.num_unconfirmed} messages not stored within {timeout_s}s") from e

    async def run(self) -> None:
        """Publishes again the messages refused, and those whose acknowledgement is overdue."""
        while True:
            if self._unconfirmed:
                oldest = next(iter(self._unconfirmed.values()))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, oldest.deadline - time.monotonic())):
                        await self._attention.wait()
            else:
                await self._attention.wait()  # idle until something is sent: no work, nothing to bound
            self._attention.clear()
            again, self._refused = self._refused, []
            now = time.monotonic()
            while self._unconfirmed:
                reply_id, oldest = next(iter(self._unconfirmed.items()))
                if oldest.deadline > now:
                    break
                del self._unconfirmed[reply_id]
                again.append((oldest, "no acknowledgement"))
            if again:
                await self._publish_again(again)
            self._settled.set()

    async def _publish_again(self, again: list[tuple[_Unconfirmed, str]]) -> None:
        now = time.monotonic()
        abandoned = [m for m, _ in again if now - m.first_sent_at >= self._give_up_after_s]
        if abandoned:
            self.num_abandoned += len(abandoned)
            log.error("publish_abandoned", num_messages=len(abandoned), msg_ids=[m.msg_id for m in abandoned][:20],
                      reason=again[0][1], after_s=self._give_up_after_s,
                      fix="the bus stored none of them: see its servers' logs (a stream lost or full)")
        again = [(m, why) for m, why in again if now - m.first_sent_at < self._give_up_after_s]
        if not again:
            return
        num_sent = max(m.num_sent for m, _ in again)
        backoff_s = election_backoff_s(num_sent)
        log.warning("publish_not_confirmed", num_messages=len(again), subjects=sorted({m.subject for m, _ in again}),
                    reason=again[0][1], num_sent=num_sent, again_in_s=backoff_s)
        self._backing_off.extend(m for m, _ in again)
        await asyncio.sleep(backoff_s)  # a stream electing its leader refuses at once: not a busy loop
        while self._backing_off:
            await self._send(self._backing_off.popleft())
            self.num_republished += 1


_REPLY_INBOX_RE = re.compile(r"^_INBOX(?:_([A-Za-z0-9_-]+))?\.[^.*>\s]+(\.[^.*>\s]+)*$")


def is_reply_inbox(reply: str, requester: str | None = None) -> bool:
    """Whether ``reply`` is a role's inbox (``_INBOX_<role>.<token>...``, no wildcard), ``requester``'s if
    given; or an inbox of no role (``_INBOX.``: a bus without authentication, where no role can be told,
    and with it one that only the supervisor's catch-all could read, and none of its requests uses)."""
    m = _REPLY_INBOX_RE.match(reply)
    return m is not None and (requester is None or m.group(1) in (None, requester))


def stream_delivery(msg: Msg) -> str | None:
    """The stream a core message came from, if a stream delivered it (a push consumer's delivery carries
    its ``$JS.ACK.`` reply subject, a republished one its ``Nats-Stream`` header); None for a publisher's."""
    if (msg.reply or "").startswith("$JS.ACK."):
        return msg.reply.split(".")[2] if msg.reply.count(".") >= 2 else msg.reply
    if msg.headers and (stream := msg.headers.get("Nats-Stream")):
        return stream
    return None


def acknowledgement_refusal(msg: Msg) -> str | None:
    """Why JetStream refused a publish, from its acknowledgement; None if it stored it."""
    status = (msg.headers or {}).get("Status")
    if status == "503":
        return "no stream answered (no leader, or no such stream)"
    if status:
        return f"status {status}: {(msg.headers or {}).get('Description', '')}"
    try:
        reply = json.loads(msg.data)
    except ValueError:
        return f"unreadable acknowledgement {msg.data[:200]!r}"
    error = reply.get("error") if isinstance(reply, dict) else "not an acknowledgement"
    return None if error is None else str(error)


class ConnectionHealth:
    """Whether a client is connected now, fed by nats-py's disconnect/reconnect callbacks, so that an
    outage is a state one can wait on (event-driven) instead of a flood of reconnect warnings."""

    def __init__(self, client: str) -> None:
        self.client = client
        self.up = asyncio.Event()
        self.down = asyncio.Event()
        self.up.set()
        self.down_since: float | None = None
        self.num_outages = 0
        self.closing = False  # the client closes on purpose: its disconnect is no outage

    async def on_disconnected(self) -> None:
        if self.closing:
            return
        if self.down_since is None:
            self.down_since = time.monotonic()
            self.num_outages += 1
            log.warning("bus_disconnected", client=self.client)
        self.up.clear()
        self.down.set()

    async def on_reconnected(self, server: str = "") -> None:
        """``server``: the one it is connected to now (on a cluster, maybe another than before)."""
        outage_s = time.monotonic() - self.down_since if self.down_since is not None else 0.0
        self.down_since = None
        self.down.clear()
        self.up.set()
        log.info("bus_reconnected", client=self.client, outage_s=round(outage_s, 3), server=server)

    async def fail_after_outage(self, url: str, max_outage_s: float) -> None:
        """Returns never: raises BusError once one outage lasts longer than ``max_outage_s``."""
        while True:
            await self.down.wait()
            try:
                async with asyncio.timeout(max_outage_s):
                    await self.up.wait()
            except TimeoutError:
                raise BusError(f"the bus at {url} has been unreachable for more than {max_outage_s:g}s "
                               "(bus.max_outage_s): is its nats-server up and reachable?") from None


class _SlowReads:
    """How long the reads of one follow or KV watch have been timing out with the connection up (the server is
    there but starved: nothing to reconnect to). Each timeout is a warning and the reader reads again from where
    it stopped; one past ``bound_s`` since the first of a row without progress is a `BusTimeout`."""

    def __init__(self, what: str, client: str, bound_s: float) -> None:
        self.what, self.client, self.bound_s = what, client, bound_s
        self.since: float | None = None  # when the first read of the current row timed out
        self.num_timeouts = 0

    def timed_out(self, event: str, error: BusTimeout) -> None:
        """Noted (a warning ``event``), or (past the bound) raised.

        Raises:
            BusTimeout: reads have timed out for longer than ``bound_s`` with nothing delivered meanwhile.
        """
        now = time.monotonic()
        self.since = now if self.since is None else self.since
        self.num_timeouts += 1
        slow_s = now - self.since
        if slow_s > self.bound_s:
            raise BusTimeout(f"{self.what}: the bus answered none of {self.num_timeouts} reads for {slow_s:.0f}s "
                             f"while connected (BusLimits.max_slow_read_s={self.bound_s:g}): its nats-server is up "
                             "but starved; check the load of its host (CPU, disk) and its log "
                             "(RUN_DIR/nats/server.log for the embedded server)") from error
        log.warning(event, what=self.what, client=self.client, slow_s=round(slow_s, 3),
                    num_timeouts=self.num_timeouts, bound_s=self.bound_s, error=str(error),
                    consequence="reads again from where it stopped")

    def progressed(self) -> None:
        """The bus answered: a row of timeouts (if any) ended."""
        self.since, self.num_timeouts = None, 0


class Bus:
    """One NATS connection with JetStream; the only object in the project that talks to NATS.

    What callers use: KV buckets (`kv_get`, `kv_put`, `kv_create`, `kv_cas`, `kv_delete`, `kv_keys`,
    `kv_watch`), core messages (`publish`, `request`, `subscribe`, `respond`, `flush`), streams
    (`publish_durable`, `follow`, `stream_states`). Every wait is bounded (a request's or flush's own
    timeout, or a JetStream API request's 5 s), and nats-py's errors come out as the runtime's:
    `BusError` (and its `BusTimeout`, `NoResponders`), `RevisionMismatch`.
    """

    def __init__(self, nc: NatsClient, limits: BusLimits, health: ConnectionHealth | None = None) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.limits = limits
        self.health = health or ConnectionHealth("?")
        self._kv: dict[str, Bucket] = {}
        self._no_ttl: set[str] = set()  # buckets whose stream refused a TTL

    @classmethod
    async def connect(cls, url: str | Sequence[str], name: str, limits: BusLimits = BusLimits(),
                      connect_timeout_s: float = 5.0, credentials: BusCredentials | None = None,
                      tls: ssl.SSLContext | None = None) -> Bus:
        """Connects as `credentials`' role (replies under its own inbox prefix), over `tls` if given, to
        one of the servers `url` names (`server_urls`); on a cluster, it moves to another when its own
        is lost, and learns the cluster's other members from the server (`bus_server_discovered`)."""
        servers = server_urls(url)
        auth: dict[str, Any] = credentials.connect_options() if credentials else {}
        if tls is not None:
            auth["tls"] = tls

        refused = asyncio.Event()  # the server refused to sign this client in
        # what failed the first connect's attempts before it ended: a server refusing a client may reset the
        # connection before nats-py reads its 'Authorization Violation' (the attempt's PING unread when it
        # closes), so the refusal can come only on a later attempt; its outcome says what matters, once
        first_attempts: list[str] = []

        async def on_error(e: Exception) -> None:
            if "authorization violation" in str(e).lower() or "authentication" in str(e).lower():
                if not connecting.done():  # the first connect: said once, by the BusAuthRefused raised below
                    refused.set()
                    return
                # a reconnect refused (credentials rotated, a server restarted with others): it loops, so say so
                log.error("bus_sign_in_refused", error=str(e), client=name,
                          role=credentials.user if credentials else None,
                          reason="the bus refused this client's credentials on reconnecting: they were rotated, "
                                 "or the server restarted with other users",
                          fix="restart this process with the bus's current credentials (an actor's supervisor "
                              "starts it with those of bus.credentials_dir); it retries until then")
                return
            if "permissions violation" in str(e).lower():  # the server refused a subject to this role
                log.error("bus_permission_denied", error=str(e), client=name,
                          role=credentials.user if credentials else None,
                          fix="declare the subject or bucket in the actor class's bus_access (runtime.bus_auth)")
                return
            if not connecting.done():  # the first connect's failed attempts: said with its outcome, below
                first_attempts.append(str(e))
                return
            log.warning("nats_client_error", error=str(e), client=name)

        # Reconnect forever once connected (a restarted server comes back on its port; whoever owns
        # the run bounds an outage: ConnectionHealth.fail_after_outage), with pings that find a dead
        # peer within ping_interval * max_outstanding_pings; but bound the first connect: nats-py would
        # otherwise retry it forever and a command on a stopped run would hang.
        health = ConnectionHealth(name)
        nc = BusClient()

        async def on_reconnected() -> None:
            await health.on_reconnected(server=_netloc(nc.connected_url))

        async def on_discovered() -> None:
            log.info("bus_server_discovered", client=name, servers=[_netloc(u) for u in nc.discovered_servers])

        async def on_lame_duck() -> None:  # its server is shutting down: it moves to another one
            log.warning("bus_server_lame_duck", client=name, server=_netloc(nc.connected_url))

        connecting = asyncio.ensure_future(
            nc.connect(servers, name=name, error_cb=on_error, connect_timeout=connect_timeout_s,
                       max_reconnect_attempts=-1, reconnect_time_wait=limits.reconnect_wait_s,
                       allow_reconnect=True, ping_interval=limits.ping_interval_s,
                       max_outstanding_pings=limits.max_outstanding_pings,
                       disconnected_cb=health.on_disconnected, reconnected_cb=on_reconnected,
                       discovered_server_cb=on_discovered, lame_duck_mode_cb=on_lame_duck, **auth))
        signed_out = asyncio.ensure_future(refused.wait())
        try:
            await asyncio.wait({connecting, signed_out}, timeout=connect_timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled by the caller's own deadline: no client may go on connecting behind it
            await _abandon(connecting, nc)
            raise
        finally:
            signed_out.cancel()
        if refused.is_set():  # one error that says which credentials, not nats-py's reconnect loop of warnings
            await _abandon(connecting, nc)
            who = (f"the credentials of role {credentials.user!r}" if credentials else
                   "a client without credentials (none were given)")
            raise BusAuthRefused(f"cannot connect to NATS at {','.join(servers)}: it refused {who}; pass the "
                                 "run's credentials "
                                 "directory, --set bus.credentials_dir=DIR (a run started by runtime.up keeps it "
                                 "in <run dir>/credentials; it holds <role>.json for supervisor, operator and "
                                 "each actor kind)")
        if not connecting.done():
            await _abandon(connecting, nc)
            last = f" (last attempt: {first_attempts[-1]})" if first_attempts else ""
            raise BusError(f"cannot connect to NATS at {','.join(servers)}: no answer within {connect_timeout_s}s"
                           f"{last}; is the run up?")
        if (e := connecting.exception()) is not None:
            raise BusError(f"cannot connect to NATS at {','.join(servers)}: {e!r}; is the run up?") from e
        if first_attempts:
            log.info("bus_connect_retried", client=name, num_failed_attempts=len(first_attempts),
                     last_failure=first_attempts[-1])
        return cls(nc, limits, health)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Drains and closes the connection, each within ``timeout_s``; quiet on a bus that is already gone."""
        with cancellation_kept():  # nats-py's drain and close may swallow the caller's cancellation
            await self._close(timeout_s)

    async def _close(self, timeout_s: float) -> None:
        if self.nc.is_closed:
            return
        self.health.closing = True
        try:
            async with asyncio.timeout(timeout_s):
                await self.nc.drain()
        except (nats.errors.Error, OSError, RuntimeError) as e:  # RuntimeError: uvloop's closed transport
            log.info("bus_close_without_drain", client=self.health.client, error=repr(e))
        if self.nc.is_closed:
            return
        try:
            async with asyncio.timeout(timeout_s):  # it writes what is buffered into the socket and waits
                await self.nc.close()
        except TimeoutError:  # an OSError: before the one below
            log.warning("bus_close_timed_out", client=self.health.client, timeout_s=timeout_s)
        except (nats.errors.Error, OSError, RuntimeError) as e:
            # nats-py writes what it buffered during an outage into the dead transport (uvloop raises
            # RuntimeError) after it has cancelled its tasks and marked itself closed: nothing is left
            # running, only those unsent bytes are lost (the server redelivers unacked work).
            log.info("bus_closed_with_unsent_data", client=self.health.client, error=repr(e))

    # --- topology ----------------------------------------------------------------------------
    async def ensure_queue(self, q: Queue) -> None:
        with _translated(f"create the queue {q.stream}"):
            lim = self.limits
            await self._ensure_stream(StreamConfig(
                name=q.stream, subjects=list(q.subjects), retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE, max_bytes=lim.work_max_bytes, discard=DiscardPolicy.NEW,
                duplicate_window=lim.duplicate_window_s, num_replicas=lim.replicas))
            cc = ConsumerConfig(durable_name=q.durable, ack_policy=AckPolicy.EXPLICIT,
                                ack_wait=lim.ack_wait_s, max_deliver=lim.max_deliver,
                                max_ack_pending=lim.max_ack_pending, deliver_policy=DeliverPolicy.ALL)
            add = lambda: self.js.add_consumer(q.stream, cc)  # noqa: E731
            try:
                await self._through_election(f"consumer {q.durable}", add)
            except BadRequestError as e:  # exists with another config: update it
                log.info("consumer_update", stream=q.stream, durable=q.durable, reason=str(e))
                await self._through_election(f"consumer {q.durable}", add)

    async def check_queue(self, q: Queue) -> None:
        """That the queue's stream and durable consumer exist (an actor's start: the supervisor makes them).

        Raises:
            BusError: they do not (with the fix), or the bus cannot tell.
        """
        with _translated(f"check the queue {q.stream}/{q.durable}"):
            try:
                await self._through_election(f"consumer {q.durable}",
                                             lambda: self.js_reads.consumer_info(q.stream, q.durable))
            except NotFoundError:
                raise BusError(f"the work queue {q.stream} has no consumer {q.durable!r}: the supervisor makes "
                               "every queue of the run's actor kinds before it starts them (runtime.up; "
                               "runtime.up.provision_streams in a test)") from None

    async def pull_consumer(self, q: Queue) -> PullConsumer:
        """Binds to the queue's durable consumer (made by `ensure_queue`)."""
        with _translated(f"bind to {q.stream}/{q.durable}"):
            return PullConsumer(await _held(self.js.pull_subscribe_bind(durable=q.durable, stream=q.stream)),
                                q.durable)

    async def ensure_base(self, lease_max_s: float = 0.0) -> None:
        """Streams and buckets every run has: LOG, DLQ, and the KV buckets.

        ``lease_max_s`` (> 0): the longest lease of the run's actors, the age past which the server
        removes any record of a lease bucket (`LEASE_BUCKETS`) but one written to last (``Nats-TTL:
        never``: `kv_put` without a TTL, `kv_cas`): an entry written by hand without its lease's TTL,
        or with a longer one, is gone within that bound like an actor's own that stopped being renewed.
        """
        with _translated("create the base streams and buckets"):
            lim = self.limits
            await self._ensure_stream(StreamConfig(
                name="LOG", subjects=["log.>"], retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
                max_age=lim.log_max_age_s, max_bytes=lim.log_max_bytes, discard=DiscardPolicy.OLD,
                num_replicas=lim.replicas, allow_direct=True,  # followed without consumers (`Bus.follow`)
                republish=RePublish(src="log.>", dest=follow_subject("log.>"))))
            await self._ensure_stream(StreamConfig(
                name="DLQ", subjects=["dlq.>"], retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
                max_age=lim.dlq_max_age_s, max_bytes=lim.dlq_max_bytes, discard=DiscardPolicy.OLD,
                num_replicas=lim.replicas))
            for bucket in KV_BUCKETS:
                await self.ensure_bucket(bucket, lease_max_s)

    async def ensure_bucket(self, bucket: str, lease_max_s: float = 0.0) -> None:
        """The bucket, made or brought up to date (the supervisor's: actor roles only use it): its replicas,
        direct gets and the republish rule its watches read (`runtime.kv_watch`); for a lease bucket
        (`LEASE_BUCKETS`) TTLs, and ``lease_max_s`` as `ensure_base` says."""
        with _translated(f"create the bucket {bucket}"):
            await self.kv(bucket)
            await self._update_bucket(bucket, lease_max_s if bucket in LEASE_BUCKETS else 0.0)

    async def delete_streams(self) -> list[str]:
        """Deletes every stream (work queues, LOG, DLQ, KV buckets) this connection's account holds, and returns
        their names: a bus carries one run (``runtime.run_state``), and a new one starts on an empty bus.
        The supervisor's role may; an actor's or the operator's may not (``runtime.bus_auth``)."""
        with _translated("delete the run's streams and buckets"):
            names = sorted(info.config.name or "" for info in await self.js_reads.streams_info())
            for name in names:
                await self._through_election(f"delete {name}", lambda name=name: self.js.delete_stream(name))
            self._kv.clear()
            return names

    async def _ensure_stream(self, cfg: StreamConfig) -> None:
        try:
            await self._through_election(f"open {cfg.name}", lambda: self.js_reads.stream_info(cfg.name))  # type: ignore[arg-type]
            await self._through_election(cfg.name or "", lambda: self.js.update_stream(cfg))
        except NotFoundError:
            try:
                await self._through_election(cfg.name or "", lambda: self.js.add_stream(cfg))
            except BadRequestError as e:
                raise BusError(f"cannot create stream {cfg.name}: {e}") from e

    async def _through_election(self, what: str, make: Callable[[], Awaitable[Any]]) -> Any:
        return await through_election(what, make, self.election_wait_s)

    @property
    def js_reads(self) -> JetStreamContext:
        """The JetStream context for reads that `through_election` asks again: quick ones on a replicated bus."""
        return self.nc.jetstream(timeout=_READ_PROBE_S) if self.election_wait_s else self.js

    @property
    def election_wait_s(self) -> float:
        """How long a request waits out a leader's election: only a replicated stream has one."""
        return self.limits.election_wait_s if self.limits.replicas > 1 else 0.0

    async def kv(self, bucket: str) -> Bucket:
        """The bucket, created if it does not exist yet (with `limits`' replicas; a lease bucket with TTLs)."""
        with _translated(f"open the bucket {bucket}"):
            if bucket not in self._kv:
                try:
                    info = await self._through_election(f"open {bucket}",
                                                        lambda: self.js_reads.stream_info(f"KV_{bucket}"))
                except NotFoundError:
                    lease = bucket in LEASE_BUCKETS
                    config = KeyValueConfig(
                        bucket=bucket, history=self.limits.kv_history, storage=StorageType.FILE,
                        replicas=self.limits.replicas, limit_marker_ttl=_LEASE_MARKER_TTL_S if lease else None,
                        direct=True, republish=watch_republish(bucket))
                    await self._through_election(f"KV_{bucket}", lambda: self.js.create_key_value(config))
                    info = await self.js.stream_info(f"KV_{bucket}")
                # a replicated bucket is read from its leader: a direct get may be answered by any replica,
                # also one that is still catching up after a restart (the reconciler read keys as absent)
                direct = bool(info.config.allow_direct) and (info.config.num_replicas or 1) == 1
                self._kv[bucket] = Bucket(self.nc, self.js, bucket, direct=direct, election_wait_s=self.election_wait_s)
            return self._kv[bucket]

    async def _update_bucket(self, bucket: str, max_age_s: float = 0.0) -> None:
        """A bucket made before (a resumed run, another version): its replicas, its watches' republish rule and
        direct gets, TTLs for a lease bucket, and its records' longest life (``max_age_s``, 0: unbounded)."""
        info = await self.js.stream_info(f"KV_{bucket}")
        wanted = dataclasses.replace(info.config, num_replicas=self.limits.replicas, allow_direct=True,
                                     republish=watch_republish(bucket))
        if bucket in LEASE_BUCKETS and not info.config.subject_delete_marker_ttl:
            wanted = dataclasses.replace(wanted, allow_msg_ttl=True, subject_delete_marker_ttl=_LEASE_MARKER_TTL_S)
        if bucket in LEASE_BUCKETS and max_age_s > 0 and bucket not in self._no_ttl:
            max_age = float(math.ceil(max_age_s))  # the server takes no dedup window longer than it
            wanted = dataclasses.replace(wanted, max_age=max_age,
                                         duplicate_window=min(wanted.duplicate_window or max_age, max_age))
        if wanted != info.config:
            await self._through_election(f"KV_{bucket}", lambda: self.js.update_stream(wanted))
            log.info("bucket_updated", bucket=bucket, replicas=wanted.num_replicas,
                     ttl=bool(wanted.subject_delete_marker_ttl))

    async def kv_get(self, bucket: str, key: str) -> KVEntry | None:
        """The key's current record; None when there is none (never written, deleted or purged)."""
        with _translated(f"get {bucket}/{key}"):
            kv = await self.kv(bucket)
            try:
                entry = await kv.get(key)
            except (KeyNotFoundError, KeyDeletedError):
                return None
        return KVEntry(key, entry.value or b"", entry.revision or 0)

    async def kv_put(self, bucket: str, key: str, value: bytes, ttl_s: float | None = None) -> int:
        """Writes the key whatever it held; returns the new revision.

        ``ttl_s`` (a lease bucket's keys, `LEASE_BUCKETS`): the server removes the key that long
        (rounded up to whole seconds, its resolution) after this write unless it is written again,
        and watchers see the removal. A bucket whose stream takes no TTL (a server before 2.11) gets
        the write without one: its readers bound the lease themselves (said once, `kv_ttl_unsupported`).
        """
        with _translated(f"put {bucket}/{key}"):
            kv = await self.kv(bucket)
            if bucket in self._no_ttl or (ttl_s is None and bucket not in LEASE_BUCKETS):
                return await kv.put(key, value)
            try:
                # in a lease bucket, a record that is no lease (a handover) lasts past the bucket's max age
                ttl = {Header.MSG_TTL: _NEVER if ttl_s is None else str(math.ceil(ttl_s))}
                ack = await self.js.publish(f"$KV.{bucket}.{key}", value, headers=ttl)
            except APIError as e:
                if e.err_code not in _TTL_UNSUPPORTED:
                    raise
                self._no_ttl.add(bucket)
                log.warning("kv_ttl_unsupported", bucket=bucket, error=str(e),
                            consequence="its keys live until deleted; readers enforce the leases")
                return await kv.put(key, value)
            return ack.seq

    async def kv_create(self, bucket: str, key: str, value: bytes) -> int:
        """Writes the key only if it has no live value; returns the revision.

        Raises:
            RevisionMismatch: the key has a value.
        """
        with _translated(f"create {bucket}/{key}"):
            kv = await self.kv(bucket)
            return await kv.create(key, value)

    async def kv_cas(self, bucket: str, key: str, value: bytes, revision: int) -> int:
        """Writes the key only if its revision is still ``revision``; returns the new one.

        Raises:
            RevisionMismatch: the key changed since that revision was read.
        """
        with _translated(f"update {bucket}/{key}"):
            kv = await self.kv(bucket)
            if bucket not in LEASE_BUCKETS or bucket in self._no_ttl:
                return await kv.update(key, value, last=revision)
            headers = {Header.MSG_TTL: _NEVER, Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(revision)}
            try:
                return (await self.js.publish(f"$KV.{bucket}.{key}", value, headers=headers)).seq
            except APIError as e:
                if e.err_code in (10071, 10164):  # wrong last (subject) sequence
                    raise RevisionMismatch(f"update {bucket}/{key}: revision {revision} is not the key's") from e
                raise

    async def kv_delete(self, bucket: str, key: str) -> None:
        with _translated(f"delete {bucket}/{key}"):
            kv = await self.kv(bucket)
            await kv.delete(key)

    async def kv_max_age_s(self, bucket: str) -> float | None:
        """How long the server keeps a record of the bucket that is not written to last: its stream's max
        age (a lease bucket's is the run's longest lease, `ensure_base`); None: no bound."""
        with _translated(f"read the limits of bucket {bucket}"):
            info = await self._through_election(f"read {bucket}", lambda: self.js_reads.stream_info(f"KV_{bucket}"))
        return float(info.config.max_age) if info.config.max_age else None

    async def kv_keys(self, bucket: str) -> list[str]:
        """The bucket's live keys (none: an empty list)."""
        with _translated(f"list the keys of {bucket}"):
            kv = await self.kv(bucket)
            try:
                return await kv.keys()
            except NoKeysError:
                return []

    async def kv_items(self, bucket: str, keys: str = ">") -> list[KVEntry]:
        """The current record of every live key of ``bucket`` matching ``keys`` (NATS wildcards), in stream
        order: a few bulk reads (`Bucket.current`) instead of a listing and one request per key, so a
        bucket of 10^5 keys is read in seconds, not in 10^5 round trips."""
        with _translated(f"read the records of {bucket}/{keys}"):
            kv = await self.kv(bucket)
            _, entries = await self._through_election(f"read {bucket}", lambda: kv.current(keys))
        return [e for e in entries if not e.deleted]

    async def kv_watch(self, bucket: str, keys: str = ">") -> AsyncIterator[KVEntry | None]:
        """The records of the keys of ``bucket`` matching ``keys`` (NATS wildcards over the key's tokens): the
        current ones (delete and purge markers included), then None, then every change in the order the
        stream stored them; across outages and lost messages, after which the current ones come again,
        then None (what a follower of a bucket must see anyway to catch up).

        No consumer (no actor role may make one on a bucket's stream: docs/ARCHITECTURE.md, "Buckets"): a
        read of the current records at one stream sequence, and the records the stream republishes after
        it (`runtime.kv_watch`). A restarted server, or a record lost on the way (the next one received is
        not the next sequence: ``kv_watch_gap``), starts it again. A read that times out while the connection
        stays up (a starved server: ``kv_watch_slow``) reads the current records again, for at most
        `BusLimits.max_slow_read_s`, after which it raises `BusTimeout`.
        """
        slow = _SlowReads(f"watch {bucket}/{keys}", self.health.client, self.limits.max_slow_read_s)
        while True:
            await self.health.up.wait()
            generation = self.health.num_outages  # a drop at any point after this renews the watch
            try:
                kv = await self.kv(bucket)
                with _translated(f"watch {bucket}/{keys}"):
                    sub, cursor, current = await self._through_election(
                        f"watch {bucket}", lambda kv=kv: self._open_watch(kv, keys))
            except OSError as e:  # BusError included
                if self.health.num_outages != generation or self.health.down.is_set():
                    continue  # it failed because the connection dropped meanwhile: watch again once back
                if not isinstance(e, BusTimeout):
                    raise
                slow.timed_out("kv_watch_slow", e)  # connected but slow: read them again (raises past the bound)
                continue
            slow.progressed()
            try:
                for entry in current:
                    yield entry
                yield None
                async for key, sequence, msg in self._republished(sub, kv.stream, len(kv.prefix), cursor, generation,
                                                                  "kv_watch_gap"):
                    if subject_matches(keys, key) and (entry := entry_of(key, msg.data, sequence, msg.headers)):
                        yield entry
            finally:
                await Subscription(sub).unsubscribe()
            log.info("kv_watch_renewed", bucket=bucket, keys=keys, client=self.health.client)

    async def _open_watch(self, kv: Bucket, keys: str) -> tuple[Any, WatchCursor, list[KVEntry]]:
        """Subscribed to every record the bucket's stream republishes first (the keys are picked out here, so
        that a lost record of any key is noticed: `runtime.kv_watch`), then its current ones read: every
        record stored after the read's sequence arrives (and some before it, which `WatchCursor` tells
        apart). Nothing the subscription receives is dropped by the client (no pending limit): one that
        falls behind is a slow consumer for the server, which closes the connection, and that renews it."""
        sub = await _held(self.nc.subscribe(kv_watch_subject(kv.bucket), pending_msgs_limit=0, pending_bytes_limit=0))
        try:
            with cancellation_kept():  # here, while the subscription is still this method's to undo
                cursor, current = await kv.current(keys)
        except BaseException:
            await Subscription(sub).unsubscribe()
            raise
        return sub, cursor, current

    async def _republished(self, sub: Any, stream: str, strip: int, cursor: WatchCursor, generation: int,
                           gap_event: str) -> AsyncIterator[tuple[str, int, Msg]]:
        """The records ``stream`` republished after ``cursor``'s cut that ``sub`` receives, each as (its subject
        less its first ``strip`` characters, its sequence, the message), until the connection drops or a
        record turns out lost (``gap_event``: the caller reads again from the stream)."""
        while self.health.num_outages == generation:
            msg = await self._next_or_outage(sub.next_msg(timeout=None))
            if msg is _OUTAGE:
                return
            headers = msg.headers or {}
            if headers.get("Nats-Stream") != stream or "Nats-Sequence" not in headers:
                log.error("republished_message_refused", stream=stream, subject=msg.subject, client=self.health.client,
                          reason=f"not republished by the stream {stream}")
                continue
            sequence = int(headers["Nats-Sequence"])
            admission = cursor.admit(sequence)
            if admission is Admission.GAP:
                log.warning(gap_event, stream=stream, subject=headers.get("Nats-Subject"), sequence=sequence,
                            expected=cursor.sequence + 1, client=self.health.client,
                            consequence="read again from the stream")
                return
            if admission is Admission.NEW:
                yield headers.get("Nats-Subject", "")[strip:], sequence, msg

    async def follow(self, subject: str, start: FollowStart = "new") -> AsyncIterator[StreamMessage]:
        """The messages of a stream's ``subject`` from ``start`` (everything kept, new ones, or from a time), in
        the order the stream stored them, across outages and lost messages, none lost or repeated.

        No consumer (a role that may create one may give it any deliver subject, which the server does not
        check against its permissions): the stored messages by batched direct gets, then those the stream
        republishes into ``follow.<its subjects>`` (its republish rule, `runtime.bus_auth.follow_subject`:
        all of them, ``subject``'s picked out here), told apart by sequence as a KV watch does
        (`runtime.kv_watch`). Once the connection drops, or a republished message is not the next sequence
        (one was lost on the way: ``stream_follow_gap``), it reads the stream again after the last message
        it had; so does a read that times out while the connection stays up (a starved server:
        ``stream_follow_slow``), for at most `BusLimits.max_slow_read_s`, after which it raises `BusTimeout`.
        """
        if not isinstance(start, datetime) and start not in ("all", "new"):
            raise ValueError(f"start={start!r}: expected 'all', 'new' or a datetime")
        slow = _SlowReads(f"follow {subject}", self.health.client, self.limits.max_slow_read_s)
        stream: str | None = None
        next_seq: int | None = None  # the sequence after the last message delivered, once caught up or delivered
        while True:
            await self.health.up.wait()
            generation = self.health.num_outages
            try:
                if stream is None:
                    with _translated(f"find the stream of {subject}"):
                        stream = await self._through_election(
                            f"follow {subject}", lambda: self.js_reads.find_stream_name_by_subject(subject))
                with _translated(f"follow {subject}"):
                    sub, last_seq, replicated = await self._through_election(
                        f"follow {subject}", lambda stream=stream: self._open_follow(stream))
            except OSError as e:  # BusError included
                if self.health.num_outages != generation or self.health.down.is_set():
                    continue
                if not isinstance(e, BusTimeout):
                    raise
                slow.timed_out("stream_follow_slow", e)  # connected but slow: open it again (raises past the bound)
                continue
            if next_seq is None and start == "new":  # "new" is new as of the first open, not of one made again
                next_seq = last_seq + 1
            try:
                if next_seq is not None:
                    request: dict[str, Any] = {"seq": next_seq}
                elif isinstance(start, datetime):
                    request = {"start_time": start.isoformat()}
                else:
                    request = {"seq": 1 if start == "all" else last_seq + 1}
                caught_up = False
                try:
                    async for msg in self._catch_up(stream, subject, request, replicated):
                        slow.progressed()
                        next_seq = int(msg.headers["Nats-Sequence"]) + 1
                        yield StreamMessage(msg.headers["Nats-Subject"], msg.data, next_seq - 1,
                                            int(msg.headers.get("Nats-Num-Pending", 0)))
                    caught_up = True
                except OSError as e:  # BusError included
                    if self.health.num_outages == generation and not self.health.down.is_set():
                        if not isinstance(e, BusTimeout):
                            raise
                        slow.timed_out("stream_follow_slow", e)  # connected but slow: again from next_seq
                if caught_up:  # nothing of ``subject`` up to the stream's last sequence then is left to read
                    slow.progressed()
                    next_seq = max(next_seq or 0, last_seq + 1)
                    async for name, sequence, msg in self._republished(sub, stream, 0, WatchCursor(next_seq - 1),
                                                                       generation, "stream_follow_gap"):
                        next_seq = sequence + 1
                        if subject_matches(subject, name):
                            yield StreamMessage(name, msg.data, sequence, 0)
            finally:
                await Subscription(sub).unsubscribe()
            log.info("stream_follow_renewed", subject=subject, next_seq=next_seq, client=self.health.client)

    async def _open_follow(self, stream: str) -> tuple[Any, int, bool]:
        """Subscribed to every message ``stream`` republishes first (as `_open_watch`), then its state read:
        its last sequence then, and whether it is replicated.

        Raises:
            BusError: the stream republishes nothing for a follow (the supervisor's `ensure_base` makes LOG so).
        """
        with cancellation_kept():  # before subscribing: a cancelled follow makes no subscription
            info = await self.js_reads.stream_info(stream)
        republish = info.config.republish
        if republish is None or republish.dest != follow_subject(republish.src) or republish.headers_only \
                or not info.config.allow_direct:
            raise BusError(f"stream {stream} cannot be followed: it does not republish its messages into "
                           f"{follow_subject('<subject>')} with direct gets allowed (made by an older version); "
                           "the supervisor's ensure_base (runtime.up) sets that")
        sub = await _held(self.nc.subscribe(follow_subject(republish.src), pending_msgs_limit=0, pending_bytes_limit=0))
        try:
            with cancellation_kept():  # here, while the subscription is still this method's to undo
                info = await self.js_reads.stream_info(stream)
        except BaseException:
            await Subscription(sub).unsubscribe()
            raise
        return sub, info.state.last_seq, (info.config.num_replicas or 1) > 1

    async def _catch_up(self, stream: str, subject: str, request: dict[str, Any],
                        replicated: bool) -> AsyncIterator[Msg]:
        """The stored messages of ``subject`` from ``request``'s start (a sequence or a time), by batched direct
        gets, until one reports none left; on a replicated stream, until the leader holds none newer either
        (a replica that answered may be behind it: asked again while `BusLimits.election_wait_s` lasts)."""
        deadline = time.monotonic() + self.election_wait_s
        for attempt in itertools.count():
            batch = request | {"batch": _FOLLOW_BATCH, "next_by_subj": subject}
            with _translated(f"follow {subject}"):  # each read: no message is yielded after a swallowed cancel
                records, end = await self._through_election(f"follow {subject}", lambda batch=batch: direct_get(
                    self.nc, stream, batch, _READ_PROBE_S if self.election_wait_s else 5.0))
            for msg in records:
                yield msg
            if records:
                request = {"seq": int(records[-1].headers["Nats-Sequence"]) + 1}
            status = (end.headers or {}).get("Status")
            if status == "204" and int((end.headers or {}).get("Nats-Num-Pending", 0)) > 0:
                continue
            if status not in ("204", "404"):
                raise BusError(f"following {subject} in {stream}: the server answered {status} "
                               f"{(end.headers or {}).get(Header.DESCRIPTION, '')!r}")
            # a replica that answered "none left" may be behind its leader: the leader's newest message of
            # ``subject`` must be one delivered (from a time with none delivered, nothing tells: taken as is)
            if not replicated or "seq" not in request:
                return
            with _translated(f"follow {subject}"):
                newest = await leader_newest(self.js_reads, stream, subject)
            if newest < request["seq"]:
                return
            if time.monotonic() > deadline:
                raise BusError(f"following {subject} in {stream}: the replicas that answered stayed behind "
                               f"the leader for {self.election_wait_s}s")
            await asyncio.sleep(election_backoff_s(attempt))  # a replica catching up: seconds, then at once

    async def _next_or_outage(self, source: Any) -> Any:
        """The next item of ``source`` (an async iterator, or an awaitable for one item); ``_END`` when an
        iterator stopped, or ``_OUTAGE`` if the connection dropped first."""
        entry = asyncio.ensure_future(anext(source, _END) if hasattr(source, "__anext__") else source)
        lost = asyncio.ensure_future(self.health.down.wait())
        try:
            await asyncio.wait({entry, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (entry, lost):
                task.cancel()
        return entry.result() if entry.done() and not entry.cancelled() else _OUTAGE

    async def stream_states(self) -> list[StreamState]:
        """Every stream's counters (one JetStream API request)."""
        with _translated("list the streams"):
            streams = await self.js.streams_info()
        return [StreamState(s.config.name or "", tuple(s.config.subjects or ()), s.state.messages, s.state.last_seq)
                for s in streams]

    # --- core messages ----------------------------------------------------------------------
    async def publish(self, subject: str, data: bytes) -> None:
        """A core publish (no stream, no acknowledgement): signals and progress that nothing stores."""
        with _translated(f"publish on {subject}"):
            await self.nc.publish(subject, data)

    async def request(self, subject: str, data: bytes, timeout_s: float) -> bytes:
        """The reply's data.

        Raises:
            NoResponders: nobody subscribes to ``subject``.
            BusTimeout: no reply within ``timeout_s``.
        """
        with _translated(f"request on {subject}"):
            reply = await self.nc.request(subject, data, timeout_s)
        return reply.data

    async def subscribe(self, subject: str, handler: Callable[[Inbound], Awaitable[None]]) -> Subscription:
        """Calls ``handler`` with each message on ``subject`` (one at a time, in order of arrival)."""
        async def deliver(msg: Msg) -> None:
            if (origin := stream_delivery(msg)) is not None:
                log.error("bus_message_refused", subject=msg.subject, origin=origin, client=self.health.client,
                          reason="a stream delivered it (a consumer's deliver subject or a republish), not a "
                                 "publisher: the role that configured that consumer may not publish here")
                return
            await handler(Inbound(msg.subject, msg.data, msg.reply or ""))

        with _translated(f"subscribe to {subject}"):
            return Subscription(await _held(self.nc.subscribe(subject, cb=deliver)))

    async def respond(self, msg: Inbound, data: bytes, requester: str | None = None) -> bool:
        """Answers a request (nothing to answer without a reply subject) into the requester's inbox only:
        a reply subject outside every role's ``_INBOX_<role>.`` (or outside ``requester``'s, when the
        request says who sent it) would have this role publish, under its ``allow_responses``, wherever
        the requester wished (a control subject, a bucket's key, another role's inbox). Such a request
        is refused and said (``reply_refused``). Returns whether the answer was sent."""
        if not msg.reply:
            return False
        if not is_reply_inbox(msg.reply, requester):
            log.error("reply_refused", subject=msg.subject, reply=msg.reply[:200], requester=requester,
                      client=self.health.client,
                      reason=f"a reply goes to {inbox_prefix(requester) if requester else '_INBOX_<role>'}.<...> only")
            return False
        with _translated(f"reply to {msg.subject}"):
            await self.nc.publish(msg.reply, data)
        return True

    async def flush(self, timeout_s: float) -> None:
        """Waits until the server has everything published so far.

        Raises:
            BusTimeout: not within ``timeout_s``.
        """
        with _translated("flush"):
            await self.nc.flush(max(1, round(timeout_s)))  # nats-py takes whole seconds

    # --- publishing -------------------------------------------------------------------------
    async def publish_durable(self, subject: str, data: bytes, msg_id: str | None = None) -> None:
        """JetStream publish, acknowledged by the server; ``msg_id`` dedups within the window. With a
        ``msg_id`` (a copy that was stored after all is dropped), published again while a replicated
        stream elects its leader."""
        with _translated(f"publish on {subject}"):
            publish = lambda: self.js.publish(subject, data, headers=_msg_id_headers(msg_id))  # noqa: E731
            await (self._through_election(f"publish on {subject}", publish) if msg_id else publish())

    async def confirming_publisher(self, confirm_within_s: float = 2.0) -> ConfirmingPublisher:
        """A publisher into streams that pays no round trip per message and publishes again each one not
        stored (its `run` belongs in the caller's TaskGroup; `close` it when done)."""
        return await ConfirmingPublisher(self.nc, confirm_within_s).open()

    async def dead_letter(self, queue: str, reason: str, detail: str, data: bytes,
                          **context: Any) -> None:
        headers = {"Reason": reason, "Detail": detail[:1000]}
        headers.update({k: str(v) for k, v in context.items()})
        # An oversized message would be refused again: keep a bounded prefix for inspection.
        with _translated(f"dead-letter to dlq.{queue}"):
            await self.js.publish(f"dlq.{queue}", data[:64 * 1024], headers=headers)


_ABANDON_CLOSE_S = 2.0  # closing a client that never finished its first connect: nothing to drain
_END = object()  # a watcher that stopped
_OUTAGE = object()  # the connection dropped while waiting for a watcher's next entry


async def _abandon(connecting: asyncio.Future[None], nc: NatsClient) -> None:
    """Stops a first connect that will not be used: its attempt, and the client with whatever tasks it started
    (left running, nats-py retries for ever, and a process that ends its loop waits on them)."""
    connecting.cancel()
    with contextlib.suppress(BaseException):
        async with asyncio.timeout(_ABANDON_CLOSE_S):
            await nc.close()


def _netloc(url: Any) -> str:
    """HOST:PORT of a server URL as nats-py keeps it (a parsed URL; None when not connected)."""
    return getattr(url, "netloc", "") or ""


def _msg_id_headers(msg_id: str | None) -> dict[str, str] | None:
    return {"Nats-Msg-Id": msg_id} if msg_id else None
