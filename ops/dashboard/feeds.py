"""Where the dashboard's view of a run comes from.

Live (the run's bus answers): the event log replayed from its start and then followed (``log.>``, through
`runtime.bus.Bus.follow`, which survives bus outages), the live configuration watched in its KV bucket, and a
status sample (registry, reconciler and trainer status) every ``sample_s``: the slot table and the
actors are state, not events, so a chart of them over time is a series of samples. Offline (a finished
run, or one whose bus does not answer): the event files under RUN_DIR/logs, read once; a run whose supervisor
said it stopped (`run_end`) is not asked for its bus at all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import msgpack
import structlog

from ops import config as ops_config
from ops import status as ops_status
from ops.dashboard.model import RunView
from ops.dashboard.rollouts import RolloutShelf, SampleView, ShelfLimits
from ops.tail import event_time, read_files
from runtime.blob import BlobStore
from runtime.bus import Bus
from runtime.errors import BusError
from runtime.events import parse_event
from runtime.run_config import DashboardSection, import_entry
from runtime.rundir import SUPERVISOR_LOG

log = structlog.get_logger()

SampleViews = Callable[[str, bytes], list[SampleView]]
# the application's ``dashboard.sample_views`` entry, given its configuration, returns this:
# ``load(blob=, bus=, owner=, waiting=)`` gives its views, maybe after a wait for the run (its policy's build),
# first saying what for through ``waiting(what)``
ViewsLoader = Callable[..., Awaitable[SampleViews]]


def load_event_files(run_dir: Path, view: RunView, samples: SampleFetcher | None = None) -> int:
    """Every event in RUN_DIR/logs, merged by time, into ``view`` (and the groups they name to
    ``samples``, whose ``run`` then reads them); returns how many."""
    paths = sorted((run_dir / "logs").glob("*.jsonl"))
    count = 0
    for _, event in read_files(paths):
        view.add_event(event)
        if samples is not None:
            samples.notice(event)
        count += 1
    return count


@dataclass(frozen=True)
class RunEnd:
    """How a run's start ended, as its supervisor said (``supervisor_stopped``)."""

    outcome: str  # finished, stopped or failed (runtime.supervisor.Outcome)
    at: datetime


def run_end(run_dir: Path, started_at: float) -> RunEnd | None:
    """How the run's latest start from ``run_dir`` (at ``started_at``, from its run.json) ended, read from its
    supervisor's events; None while it has not said so (it runs, or it was killed). A stop before ``started_at``
    is an earlier start's: the run was resumed here since."""
    path = run_dir / SUPERVISOR_LOG
    end = None
    for _, event in read_files([path]) if path.is_file() else ():
        if (event.get("event") == "supervisor_stopped" and (at := event_time(event)) is not None
                and at.timestamp() >= started_at):
            end = RunEnd(str(event.get("outcome")), at)
    return end


def sample_fetcher(settings: DashboardSection, blob: BlobStore | None, app_config: object, *, bus: Bus | None = None,
                   owner: str = "dashboard") -> SampleFetcher | None:
    """The rollout viewer's feed, if the run names the application's ``dashboard.sample_views`` (called with the
    run's application configuration ``app_config``; it gives how to get the views, which may wait for the run:
    `ViewsLoader`). ``bus``: the live run's, for what the views wait for (None: a finished run's files)."""
    if not settings.sample_views or blob is None:
        return None
    load: ViewsLoader = import_entry(settings.sample_views)(app_config)  # type: ignore[operator]
    limits = ShelfLimits(settings.keep_last_groups, settings.groups_per_version, settings.max_versions)
    return SampleFetcher(blob, None, RolloutShelf(limits), load=load, bus=bus, owner=owner)


async def follow_events(bus: Bus, view: RunView, samples: SampleFetcher | None = None) -> None:
    """The run's whole event log, then every new event, into ``view`` (and the groups it names to
    ``samples``). Runs until cancelled."""
    messages = aiter(bus.follow("log.>", "all"))
    try:
        async for msg in messages:
            line = msg.data.decode(errors="replace")
            view.add_line(line, msg.subject.rsplit(".", 1)[-1])  # log.<kind>.<level>
            if (samples is not None and any(name in line for name in SampleFetcher.EVENTS)
                    and (event := parse_event(line)) is not None):
                samples.notice(event)
    finally:
        await messages.aclose()  # type: ignore[attr-defined]


class SampleFetcher:
    """Reads the group records the event log names (``group_checkpointed`` with its ``key``) from the
    blob store, turns them into sample views with the application's ``views`` function (in a thread:
    decompressing and decoding is CPU work) and offers them to the shelf; and, once a sample is trained,
    the records of the trainer's log-probs the log names (``trainer_logprobs_stored`` with ``keys``, sample
    id -> key) of the samples the shelf still keeps, whose partial views it merges into theirs. At most
    ``max_pending`` events wait: a burst beyond that is skipped and counted (the viewer samples; it never
    holds the run up).

    Given ``load`` instead of ``views``, `run` first gets the views from it: meanwhile the page says what the
    viewer waits for (``dashboard_viewer_waiting``, then ``dashboard_viewer_ready``) and the events noticed wait,
    within the same bound; one that cannot be had (``dashboard_viewer_failed``) leaves the viewer off, said on the
    page, and the rest of the dashboard up."""

    EVENT = "group_checkpointed"  # the event that names a stored group record (with its key)
    AMEND_EVENT = "trainer_logprobs_stored"  # names later records of samples ({sample id: key}) that add to views
    EVENTS = (EVENT, AMEND_EVENT)

    def __init__(self, blob: BlobStore, views: SampleViews | None, shelf: RolloutShelf, max_pending: int = 256, *,
                 load: ViewsLoader | None = None, bus: Bus | None = None, owner: str = "dashboard") -> None:
        if (views is None) == (load is None):
            raise ValueError("SampleFetcher: pass views (ready) or load (to get them), one of the two")
        self.shelf = shelf
        self._blob, self._views, self._load = blob, views, load
        self._bus, self._owner = bus, owner
        # a group record's key, or a step's {sample id: key} of records that amend kept views
        self._pending: asyncio.Queue[str | dict[str, str]] = asyncio.Queue(max_pending)
        self.num_skipped = 0
        self.num_unreadable = 0
        self.state = "ready" if views is not None else "loading"  # then waiting, ready, or failed
        self._idle = asyncio.Event()  # everything noticed so far is on the shelf (or skipped)
        self._idle.set()

    async def wait_idle(self) -> None:
        """Until every event noticed so far is handled (`run` must be running)."""
        await self._idle.wait()

    def notice(self, event: dict[str, object]) -> None:
        name, key, keys = event.get("event"), event.get("key"), event.get("keys")
        if name == self.EVENT and isinstance(key, str):
            item: str | dict[str, str] = key
        elif name == self.AMEND_EVENT and isinstance(keys, dict):
            item = {str(k): v for k, v in keys.items() if isinstance(v, str)}
        else:
            return
        try:
            self._pending.put_nowait(item)
            self._idle.clear()
        except asyncio.QueueFull:
            self.num_skipped += 1

    async def run(self) -> None:
        views = self._views if self._views is not None else await self._load_views()
        while True:
            item = await self._pending.get()  # in the log's order: a group is offered before its samples train
            if views is None:  # the viewer is off (said): what is noticed is skipped, and counted
                self.num_skipped += 1
            elif isinstance(item, str):
                if found := await self._read(views, item):
                    self.shelf.offer(found)
            else:
                for sample_id, key in item.items():
                    if self.shelf.has(sample_id):  # only what the shelf keeps is read: its retention bounds this
                        for partial in await self._read(views, key):
                            self.shelf.amend(partial)
            if self._pending.empty():
                self._idle.set()

    async def _load_views(self) -> SampleViews | None:
        """The views from ``load``; None when they cannot be had (said, on the page too)."""
        assert self._load is not None
        started = time.monotonic()
        self.shelf.note = "the rollout viewer is getting ready"

        def waiting(what: str) -> None:
            self.state = "waiting"
            self.shelf.note = (f"the rollout viewer is waiting for {what}: the groups stored meanwhile show once it "
                               f"is ready (up to {self._pending.maxsize}; more are skipped and counted)")
            log.info("dashboard_viewer_waiting", waiting_for=what)

        try:
            views = await self._load(blob=self._blob, bus=self._bus, owner=self._owner, waiting=waiting)
        except Exception as e:  # the viewer's fault, not the dashboard's: the page stays up and says why
            self.state = "failed"
            self.shelf.note = f"the rollout viewer is off: {e}"
            log.error("dashboard_viewer_failed", error=str(e), error_type=type(e).__name__,
                      fix="see the error; restart the dashboard (ops.swap dashboard) once its cause is gone")
            return None
        if self.state == "waiting":
            log.info("dashboard_viewer_ready", wait_s=round(time.monotonic() - started, 2),
                     num_pending=self._pending.qsize(), num_skipped=self.num_skipped)
        self.state, self.shelf.note = "ready", ""
        return views

    async def _read(self, views: SampleViews, key: str) -> list[SampleView]:
        """The views of the record at ``key``; none when it is gone or unreadable (said, and counted)."""
        try:
            stored = await self._blob.get(key)  # bounded by the store's timeouts and attempts
            return await asyncio.to_thread(views, key, stored)
        except KeyError:
            return []  # collected since (a replayed log names groups long trained): nothing to show
        except (ValueError, OSError) as e:  # unreadable or the store failing: skip it, say so
            self.num_unreadable += 1
            log.warning("dashboard_sample_unreadable", key=key, error=str(e))
            return []


async def watch_config(bus: Bus, view: RunView) -> None:
    """The live configuration (the ``config`` bucket) into ``view``: its values now, then each change."""
    items: dict[str, object] = {}
    caught_up = False
    async for entry in bus.kv_watch("config"):
        if entry is None:  # the current values are all in: show them at once, then each change
            caught_up = True
        elif entry.deleted or not entry.value:
            items.pop(entry.key, None)
        else:
            try:
                items[entry.key] = msgpack.unpackb(entry.value, raw=False)
            except (ValueError, TypeError) as e:  # shown as what it is, beside the good values
                items[entry.key] = f"<malformed: {e}>"
        if caught_up:
            view.set_config(dict(items))


async def sample_status(bus: Bus, view: RunView, sample_s: float) -> None:
    """A status sample every ``sample_s`` (the slot table and actors over time). A run that does not
    answer one sample is shown as such (``unanswered``) and sampled again at the next tick."""
    while True:
        started = time.monotonic()
        try:
            status = await ops_status.snapshot(bus)
        except BusError as e:
            status = {"actors": [], "unanswered": [{"id": "registry", "error": str(e)}]}
        view.set_status(status, time.time())
        # a sampling clock, not a wait for a condition: the next sample is due sample_s after this one
        await asyncio.sleep(max(0.0, sample_s - (time.monotonic() - started)))


async def set_live_key(bus: Bus, run_dir: Path, key: str, raw_value: str) -> object:
    """Validate ``key=raw_value`` against the run's schema (as ``ops.config set`` does) and write it;
    returns the value as stored. Raises ConfigError with the reason when it is refused."""
    value = ops_config.validate(run_dir, key, raw_value)
    await ops_config.put_value(bus, key, value)
    log.info("dashboard_config_set", key=key, value=value)
    return value


async def feed_live(bus: Bus, view: RunView, sample_s: float, samples: SampleFetcher | None = None) -> None:
    """All live feeds into ``view`` until cancelled; one failing feed ends them all, with its error."""
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(follow_events(bus, view, samples), name="dashboard-events")
        if samples is not None:
            tasks.create_task(samples.run(), name="dashboard-samples")
        tasks.create_task(watch_config(bus, view), name="dashboard-config")
        tasks.create_task(sample_status(bus, view, sample_s), name="dashboard-status")
