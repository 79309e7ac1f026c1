"""What the dashboard knows about a run: training curves, the latest status, event history.

A pure fold: events (the run's structured log) and status snapshots go in, a JSON-ready view comes
out, and every change is also handed to the live subscribers as one small update. Every buffer is
bounded, so a dashboard left open on a week-long run holds the same memory as on a short one.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# train_step fields the curves plot (the event carries more; the rest stay in the event stream)
TRAIN_FIELDS = (
    "version", "time", "reward_mean", "pass_rate", "loss", "pg_loss", "kl", "entropy", "lr", "grad_norm",
    "clip_fraction", "ratio_mean", "ratio_median", "ratio_min", "ratio_max", "samples_per_s", "tokens_per_s",
    "trainer_utilisation", "lag_min", "lag_max", "num_versions_in_batch", "step_s", "skipped",
)
EVAL_FIELDS = ("version", "time", "pass_at_1", "mean_reward", "num_tasks", "duration_s")
# what the supervisor says of an actor's health and its replacements (the actors table's health, restarts)
HEALTH_EVENTS = ("health_check_failed", "health_check_recovered", "actor_unhealthy", "actor_crashed",
                 "actor_restarted", "actor_replaced", "standby_promoted")
# the events folded into curves and the actors table (a substring test first: most events are neither)
FOLDED = ('"train_step"', '"heldout_evaluated"', *(f'"{name}"' for name in HEALTH_EVENTS))


@dataclass(frozen=True)
class Limits:
    """How much history the dashboard keeps (older points are dropped, oldest first)."""

    train_rows: int = 20_000
    eval_rows: int = 2_000
    events: int = 2_000
    status_history: int = 3_600  # status samples kept for the slot-table-over-time chart
    actors: int = 1_000  # actors whose health is remembered (the oldest forgotten first)
    subscriber_queue: int = 10_000  # updates a slow browser may fall behind before it is cut off


class Subscriber:
    """One live browser connection: a bounded queue of updates. A browser that falls behind by more
    than the queue holds is cut off (it reconnects and starts again from a snapshot) rather than
    making the dashboard hold an unbounded backlog for it."""

    def __init__(self, size: int) -> None:
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(size)
        self.overflowed = asyncio.Event()
        self.closing = asyncio.Event()

    def offer(self, update: dict[str, Any]) -> None:
        try:
            self.queue.put_nowait(update)
        except asyncio.QueueFull:
            self.overflowed.set()


class RunView:
    """The dashboard's state of one run, folded from its events and status samples."""

    def __init__(self, run_name: str, limits: Limits = Limits()) -> None:
        self.run_name = run_name
        self.limits = limits
        self.live = True  # fed by the run's bus; False: read from its files
        self.ended: str | None = None  # read from its files: how it ended (finished, stopped, failed), if it said
        self.train: collections.deque[dict[str, Any]] = collections.deque(maxlen=limits.train_rows)
        self.eval: collections.deque[dict[str, Any]] = collections.deque(maxlen=limits.eval_rows)
        # events as their JSON lines: the page parses them; the dashboard parses only those it folds
        self.events: collections.deque[str] = collections.deque(maxlen=limits.events)
        self.slots_history: collections.deque[dict[str, Any]] = collections.deque(maxlen=limits.status_history)
        self.status: dict[str, Any] = {}
        self.config: dict[str, Any] = {}
        self.event_counts: collections.Counter[str] = collections.Counter()  # by level, whole run
        # actor id -> what the health checks and the supervisor said of it, and how many processes held its
        # place before it (its restarts: each replacement is a new process with a new id)
        self.actor_health: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._seq = itertools.count(1)
        self._subscribers: set[Subscriber] = set()

    # --- what goes in ---------------------------------------------------------------------------
    def add_line(self, line: str, level: str) -> None:
        """One event as its JSON line (as the log stream carries it) at ``level`` (its subject says which).
        A run logs thousands of events a second; only the few that make curves are parsed here."""
        self.events.append(line)
        self.event_counts[level] += 1
        self._publish("event", line)
        if any(name in line for name in FOLDED):
            try:
                event = json.loads(line)
            except ValueError:
                return
            self._fold(event)

    def add_event(self, event: dict[str, Any]) -> None:
        """One event already parsed (an event file's line)."""
        self.add_line(json.dumps(event, default=str), str(event.get("level", "info")))

    def _fold(self, event: dict[str, Any]) -> None:
        name = event.get("event")
        if name == "train_step":
            row = {k: event[k] for k in TRAIN_FIELDS if k in event}
            self.train.append(row)
            self._publish("train", row)
        elif name == "heldout_evaluated":
            row = {k: event[k] for k in EVAL_FIELDS if k in event}
            self.eval.append(row)
            self._publish("eval", row)
        elif name in HEALTH_EVENTS:
            self._fold_health(name, event)

    def _fold_health(self, name: str, event: dict[str, Any]) -> None:
        old_id = str(event.get("old_id") or event.get("replaces") or event.get("actor_id") or "")
        new_id = str(event.get("new_id") or (event.get("actor_id") if name == "standby_promoted" else "") or "")
        if not old_id:
            return
        changed = {old_id: self._health_of(old_id)}
        old = changed[old_id]
        if name == "health_check_failed":
            old.update(health="failing", checks_failed=old["checks_failed"] + 1,
                       last_failure=f"{event.get('check')}: {event.get('error')}")
        elif name == "health_check_recovered":
            old.update(health="ok")
        elif name == "actor_unhealthy":
            old.update(health="unhealthy", last_failure=f"{event.get('check')}: {event.get('reason')}")
        elif name == "actor_crashed":
            old.update(health="crashed", last_failure=f"exit {event.get('returncode')}")
        elif new_id and new_id != old_id:  # restarted, replaced or a spare promoted in its place
            changed[new_id] = successor = self._health_of(new_id)
            successor["restarts"] = old["restarts"] + 1
            successor["replaces"] = old_id
        for actor_id, health in changed.items():
            self._publish("actor_health", {"id": actor_id, **health})

    def _health_of(self, actor_id: str) -> dict[str, Any]:
        health = self.actor_health.get(actor_id)
        if health is None:
            health = self.actor_health[actor_id] = {"health": "ok", "checks_failed": 0, "last_failure": "",
                                                    "restarts": 0, "replaces": ""}
            while len(self.actor_health) > self.limits.actors:
                self.actor_health.popitem(last=False)
        return health

    def add_events(self, events: Iterable[dict[str, Any]]) -> None:
        for event in events:
            self.add_event(event)

    def set_status(self, status: dict[str, Any], now: float) -> None:
        self.status = status
        lifecycle = (status.get("reconciler") or {}).get("lifecycle")
        if lifecycle is not None:
            point = {"time": now, **lifecycle["slots_per_state"]}
            self.slots_history.append(point)
            self._publish("slots", point)
        self._publish("status", status)

    def set_config(self, items: dict[str, Any]) -> None:
        self.config = items
        self._publish("config", items)

    # --- what goes out --------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Everything a freshly opened page needs, JSON-ready."""
        return {
            "run": self.run_name,
            "live": self.live,
            "ended": self.ended,
            "train": list(self.train),
            "eval": list(self.eval),
            "events": list(self.events),
            "slots": list(self.slots_history),
            "status": self.status,
            "config": self.config,
            "event_counts": dict(self.event_counts),
            "actor_health": dict(self.actor_health),
        }

    def subscribe(self) -> Subscriber:
        sub = Subscriber(self.limits.subscriber_queue)
        self._subscribers.add(sub)
        return sub

    def close_subscribers(self) -> None:
        """The server is stopping: every live stream ends with a ``closing`` update (the page says so)."""
        for sub in self._subscribers:
            sub.closing.set()

    def unsubscribe(self, sub: Subscriber) -> None:
        self._subscribers.discard(sub)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def _publish(self, kind: str, data: Any) -> None:
        if not self._subscribers:
            return
        update = {"seq": next(self._seq), "kind": kind, "data": data}
        for sub in self._subscribers:
            sub.offer(update)
