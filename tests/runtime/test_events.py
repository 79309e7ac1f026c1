"""EventLog (JSON lines, forwarding, log storms) and ops.tail's pure parts (parsing, filters, format)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

from ops import tail
from runtime.events import LEVELS, EventLog, EventLogConfig, parse_event

NOW = datetime(2026, 3, 4, 12, 0, 0, tzinfo=UTC)


class FakePublisher:
    """Records what the forwarder publishes; ``gate`` (when cleared) holds every publish."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.entered = asyncio.Event()  # a publish has begun (and waits at the gate if it is cleared)

    async def publish(self, subject: str, payload: bytes = b"") -> None:
        self.entered.set()
        await self.gate.wait()
        self.sent.append((subject, json.loads(payload)))

    def events(self, name: str) -> list[dict]:
        return [e for _, e in self.sent if e["event"] == name]


class BrokenPublisher:
    async def publish(self, subject: str, payload: bytes = b"") -> None:
        raise ConnectionError("bus gone")


@pytest.fixture
def make_log(tmp_path: Path) -> Iterator:
    made: list[EventLog] = []

    def make(**config) -> EventLog:
        log = EventLog(tmp_path / "logs" / "worker-1.jsonl", "worker", "worker-1", EventLogConfig(**config))
        log.install()
        made.append(log)
        return log

    yield make
    for log in made:
        log.close()
    structlog.reset_defaults()


def file_events(log: EventLog) -> list[dict]:
    return [json.loads(line) for line in log.path.read_text().splitlines()]


async def start_forwarding(log: EventLog, pub) -> asyncio.Task:
    task = asyncio.create_task(log.forward(pub))
    await asyncio.sleep(0)  # let it take the loop
    return task


async def stop_forwarding(task: asyncio.Task) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def settle(predicate, timeout_s: float = 5.0) -> None:
    """Waits until the forwarder task has made ``predicate`` true (it signals nothing to wait on)."""
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - observes another task's counters from outside
            await asyncio.sleep(0.01)


# --- EventLog ----------------------------------------------------------------------------------------
async def test_events_are_json_lines_with_identity_in_the_file_and_on_the_bus(make_log) -> None:
    log = make_log()
    pub = FakePublisher()
    task = await start_forwarding(log, pub)
    before = datetime.now(UTC)
    structlog.get_logger("x").info("sample_finished", sample_id="s1", num_tokens=7, path=Path("/a"))
    structlog.get_logger("x").warning("slow_step", step=3)
    await settle(lambda: len(pub.sent) == 2)
    await stop_forwarding(task)
    lines = file_events(log)
    assert [e["event"] for e in lines] == ["sample_finished", "slow_step"]
    first = lines[0]
    assert first["kind"] == "worker" and first["actor"] == "worker-1" and first["level"] == "info"
    assert first["sample_id"] == "s1" and first["num_tokens"] == 7 and first["path"] == "/a"
    when = datetime.fromisoformat(first["time"])
    assert when.tzinfo is not None and abs(when - before) < timedelta(seconds=5)
    assert pub.sent == [("log.worker.info", lines[0]), ("log.worker.warning", lines[1])]


async def test_level_below_the_configured_minimum_is_not_written(make_log) -> None:
    log = make_log(level="warning")
    structlog.get_logger("x").info("chatter")
    structlog.get_logger("x").error("broken", what="disk")
    assert [e["event"] for e in file_events(log)] == ["broken"]
    assert file_events(log)[0]["level"] == "error"


async def test_exceptions_are_rendered_into_the_event(make_log) -> None:
    log = make_log()
    try:
        raise KeyError("missing")
    except KeyError:
        structlog.get_logger("x").exception("handler_crashed")
    (event,) = file_events(log)
    assert event["level"] == "error" and "KeyError: 'missing'" in event["exception"]


async def test_log_storm_never_blocks_and_drops_are_counted_and_reported(make_log) -> None:
    log = make_log(queue_size=100)
    pub = FakePublisher()
    pub.gate.clear()  # the bus is stuck: nothing leaves the queue
    task = await start_forwarding(log, pub)
    structlog.get_logger("x").info("first")
    await asyncio.wait_for(pub.entered.wait(), 10)  # the forwarder now waits inside publish
    started = time.perf_counter()
    for i in range(5000):
        structlog.get_logger("x").info("storm", i=i)
    assert time.perf_counter() - started < 5.0, "emitting must never wait for the bus"
    assert log.num_emitted == 5001
    assert log.num_dropped == 5000 - 100, "the queue holds queue_size events; the rest are dropped"
    assert len(file_events(log)) == 5001, "the file keeps every event"
    pub.gate.set()
    await settle(lambda: bool(pub.events("log_events_dropped")))
    await stop_forwarding(task)
    (report,) = pub.events("log_events_dropped")
    assert report["num_dropped"] == report["num_dropped_total"] == 4900
    assert report["level"] == "warning" and report["kind"] == "worker"
    assert len(pub.events("storm")) == 100


async def test_drop_reports_are_rate_limited_and_flushed_on_stop(make_log) -> None:
    log = make_log(queue_size=10, drop_report_interval_s=3600.0)
    pub = FakePublisher()
    task = await start_forwarding(log, pub)
    for burst in range(3):
        for i in range(50):
            structlog.get_logger("x").info("burst", burst=burst, i=i)
        await settle(lambda: not log._queue)
    await asyncio.sleep(0.05)
    assert len(pub.events("log_events_dropped")) == 1, "one report per interval, not one per burst"
    await stop_forwarding(task)
    reports = pub.events("log_events_dropped")
    assert len(reports) == 2, "what was dropped since the last report is reported when forwarding stops"
    assert sum(r["num_dropped"] for r in reports) == log.num_dropped == reports[-1]["num_dropped_total"]
    assert log.num_dropped == 3 * (50 - 10)


async def test_a_due_report_is_sent_without_further_events(make_log) -> None:
    log = make_log(queue_size=5, drop_report_interval_s=0.2)
    pub = FakePublisher()
    task = await start_forwarding(log, pub)
    for i in range(20):
        structlog.get_logger("x").info("a", i=i)
    await settle(lambda: len(pub.events("log_events_dropped")) == 1)
    for i in range(20):
        structlog.get_logger("x").info("b", i=i)
    # Nothing else is logged: the second report must come from the interval timer alone.
    await settle(lambda: len(pub.events("log_events_dropped")) == 2, timeout_s=3.0)
    await stop_forwarding(task)
    assert [r["num_dropped"] for r in pub.events("log_events_dropped")] == [15, 15]


async def test_events_from_other_threads_are_forwarded(make_log) -> None:
    log = make_log()
    pub = FakePublisher()
    task = await start_forwarding(log, pub)
    threads = [
        threading.Thread(target=lambda n=n: [structlog.get_logger("t").info("tick", thread=n, i=i) for i in range(200)])
        for n in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    await settle(lambda: len(pub.sent) == 800)
    await stop_forwarding(task)
    assert log.num_dropped == 0 and len(file_events(log)) == 800


async def test_a_dead_bus_drops_to_the_file_only(make_log) -> None:
    log = make_log()
    task = await start_forwarding(log, BrokenPublisher())
    for i in range(10):
        structlog.get_logger("x").info("lost_on_bus", i=i)
    await settle(lambda: log.num_dropped >= 10)
    await stop_forwarding(task)
    assert [e["event"] for e in file_events(log)][:10] == ["lost_on_bus"] * 10
    assert any(e["event"] == "log_events_dropped" for e in file_events(log))


def test_parse_event_accepts_objects_only() -> None:
    assert parse_event('{"event": "x"}') == {"event": "x"}
    assert parse_event(b'{"event": "x"}') == {"event": "x"}
    assert parse_event("[1, 2]") is None
    assert parse_event('{"event": ') is None


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="verbose"):
        EventLogConfig(level="verbose")
    with pytest.raises(ValueError, match=r"'log\.queue_size' = 0 is outside its range"):
        EventLogConfig(queue_size=0)


# --- ops.tail: parsing --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "ago"),
    [
        ("30s", timedelta(seconds=30)),
        ("10m", timedelta(minutes=10)),
        ("2h", timedelta(hours=2)),
        ("1d", timedelta(days=1)),
        ("1h30m", timedelta(minutes=90)),
        ("1.5h", timedelta(minutes=90)),
    ],
)
def test_relative_times(text: str, ago: timedelta) -> None:
    assert tail.parse_time(text, NOW) == NOW - ago


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-03-04T11:00:00Z", datetime(2026, 3, 4, 11, tzinfo=UTC)),
        ("2026-03-04T11:00:00.250000+00:00", datetime(2026, 3, 4, 11, 0, 0, 250000, tzinfo=UTC)),
        ("2026-03-04T13:00:00+02:00", datetime(2026, 3, 4, 11, tzinfo=UTC)),
        ("2026-03-04T11:00:00", datetime(2026, 3, 4, 11, tzinfo=UTC)),  # no zone: UTC, like the logs
        ("2026-03-04", datetime(2026, 3, 4, tzinfo=UTC)),
    ],
)
def test_absolute_times(text: str, expected: datetime) -> None:
    assert tail.parse_time(text, NOW) == expected


@pytest.mark.parametrize("text", ["yesterday", "10x", "m10", "", "10 m"])
def test_bad_times_are_refused_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match="duration such as 30s"):
        tail.parse_time(text, NOW)


def test_where_parsing() -> None:
    assert tail.parse_where("queue=work_count") == ("queue", "work_count")
    assert tail.parse_where("expr=a=b") == ("expr", "a=b")
    assert tail.parse_where("note=") == ("note", "")
    for bad in ("queue", "=x"):
        with pytest.raises(ValueError, match="key=value"):
            tail.parse_where(bad)


# --- ops.tail: filters ----------------------------------------------------------------------------------
def ev(
    event: str = "step",
    level: str = "info",
    kind: str = "trainer",
    actor: str = "trainer-1-ab",
    time_: str = "2026-03-04T11:00:00.000001Z",
    **fields,
) -> tuple[str, dict]:
    e = {"time": time_, "level": level, "event": event, "kind": kind, "actor": actor, **fields}
    return json.dumps(e), e


def test_empty_filter_matches_everything() -> None:
    assert tail.EventFilter().matches(*ev())


def test_actor_filter_takes_kinds_and_ids() -> None:
    f = tail.EventFilter(actors=("rollout", "trainer-1-ab"))
    assert f.matches(*ev(kind="rollout", actor="rollout-3-ff"))
    assert f.matches(*ev(kind="trainer", actor="trainer-1-ab"))
    assert not f.matches(*ev(kind="trainer", actor="trainer-2-cd"))


def test_level_filter_is_a_minimum() -> None:
    f = tail.EventFilter(min_level="warning")
    assert [lv for lv in LEVELS if f.matches(*ev(level=lv))] == ["warning", "error", "critical"]
    assert f.matches(*ev(level="custom")), "an unknown level is never hidden"
    with pytest.raises(ValueError, match="loud"):
        tail.EventFilter(min_level="loud")


def test_event_globs() -> None:
    f = tail.EventFilter(events=("actor_*", "config_changed"))
    assert f.matches(*ev("actor_running")) and f.matches(*ev("config_changed"))
    assert not f.matches(*ev("config_change_rejected")) and not f.matches(*ev("my_actor_x"))


def test_where_compares_field_values_as_typed() -> None:
    assert tail.EventFilter(where=(("queue", "work_count"),)).matches(*ev(queue="work_count"))
    assert tail.EventFilter(where=(("n", "5"),)).matches(*ev(n=5))
    assert tail.EventFilter(where=(("ok", "true"),)).matches(*ev(ok=True))
    assert tail.EventFilter(where=(("x", "null"),)).matches(*ev(x=None))
    assert not tail.EventFilter(where=(("n", "5"),)).matches(*ev(n=6))
    assert not tail.EventFilter(where=(("n", "5"),)).matches(*ev()), "a missing field never matches"
    both = tail.EventFilter(where=(("a", "1"), ("b", "2")))
    assert both.matches(*ev(a=1, b=2)) and not both.matches(*ev(a=1, b=3))


def test_grep_searches_the_raw_line() -> None:
    f = tail.EventFilter(grep=re.compile(r'"sample_id": "s-4\d"'))
    assert f.matches(*ev(sample_id="s-42")) and not f.matches(*ev(sample_id="s-5"))


def test_since_uses_the_events_own_time() -> None:
    f = tail.EventFilter(since=datetime(2026, 3, 4, 11, 0, 0, tzinfo=UTC))
    assert f.matches(*ev(time_="2026-03-04T11:00:00Z"))
    assert f.matches(*ev(time_="2026-03-04T11:00:00.000001Z"))
    assert not f.matches(*ev(time_="2026-03-04T10:59:59.999999Z"))
    assert not f.matches(*ev(time_="garbage"))


@given(
    level=st.sampled_from(LEVELS),
    name=st.sampled_from(["a_1", "b_2", "a_3"]),
    n=st.integers(0, 3),
    use_level=st.booleans(),
    use_event=st.booleans(),
    use_where=st.booleans(),
)
def test_criteria_combine_with_and(
    level: str, name: str, n: int, use_level: bool, use_event: bool, use_where: bool
) -> None:
    parts = {
        "min_level": "warning" if use_level else None,
        "events": ("a_*",) if use_event else (),
        "where": (("n", "2"),) if use_where else (),
    }
    line, e = ev(name, level, n=n)
    singles = [tail.EventFilter(**{k: v}).matches(line, e) for k, v in parts.items()]
    assert tail.EventFilter(**parts).matches(line, e) == all(singles)


# --- ops.tail: formatting and files ------------------------------------------------------------------------
def test_readable_line() -> None:
    _, e = ev("rollout_finished", "warning", sample_id="s1", reward=0.5, note="two words", tags=["a"])
    text = tail.format_event(e)
    assert text == (
        '03-04 11:00:00.000 WARNING  trainer-1-ab rollout_finished sample_id=s1 reward=0.5 note="two words" tags=["a"]'
    )
    assert "\x1b[" not in text


def test_colour_marks_level_and_keeps_the_text() -> None:
    _, e = ev(level="error", k=1)
    text = tail.format_event(e, color=True)
    assert "\x1b[31m" in text
    assert re.sub(r"\x1b\[[0-9;]*m", "", text) == tail.format_event(e)


def test_traceback_goes_below_the_line() -> None:
    _, e = ev(level="error", exception="Traceback (most recent call last):\nKeyError: 'x'")
    first, *rest = tail.format_event(e).splitlines()
    assert "exception" not in first and rest == ["    Traceback (most recent call last):", "    KeyError: 'x'"]


def test_files_are_merged_by_time(tmp_path: Path) -> None:
    a = [ev("a1", time_="2026-03-04T11:00:01Z"), ev("a2", time_="2026-03-04T11:00:03.5Z")]
    b = [
        ev("b1", time_="2026-03-04T11:00:00.5Z"),
        ev("b2", time_="2026-03-04T11:00:02Z"),
        ev("b3", time_="2026-03-04T11:00:04Z"),
    ]
    (tmp_path / "a.jsonl").write_text("\n".join(line for line, _ in a) + "\n")
    (tmp_path / "b.jsonl").write_text("\n".join(line for line, _ in b) + '\nnot json\n{"event": "cut')
    merged = list(tail.read_files([tmp_path / "a.jsonl", tmp_path / "b.jsonl"]))
    assert [e["event"] for _, e in merged] == ["b1", "a1", "b2", "a2", "b3"]
    assert merged[0][0] == b[0][0]


@pytest.fixture
def restore_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()  # main() configures this process's own logging


def test_offline_command_filters_run_files(tmp_path: Path, capsys, restore_structlog) -> None:
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    (logs / "supervisor.jsonl").write_text(
        "\n".join(
            [
                ev("actor_spawned", kind="supervisor", actor="supervisor", time_="2026-03-04T11:00:00Z")[0],
                ev(
                    "restart_intensity_exceeded",
                    "error",
                    kind="supervisor",
                    actor="supervisor",
                    time_="2026-03-04T11:00:05Z",
                )[0],
            ]
        )
        + "\n"
    )
    (logs / "trainer-1-ab.jsonl").write_text(
        "\n".join(
            [ev("step", time_="2026-03-04T11:00:01Z", step=1)[0], ev("step", time_="2026-03-04T11:00:02Z", step=2)[0]]
        )
        + "\n"
    )
    argv = [str(tmp_path / "run"), "--files", "--json"]
    assert tail.main([*argv, "--actor", "trainer", "--where", "step=2"]) == 0
    assert [json.loads(x)["step"] for x in capsys.readouterr().out.splitlines()] == [2]
    assert tail.main([*argv, "--level", "error"]) == 0
    assert [json.loads(x)["event"] for x in capsys.readouterr().out.splitlines()] == ["restart_intensity_exceeded"]
    assert tail.main([*argv, "--since", "2026-03-04T11:00:01.5Z"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert tail.main([*argv, "--since", "soon"]) == 2
    assert "duration such as" in capsys.readouterr().err
