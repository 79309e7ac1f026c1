"""The runtime's acceptance tests, on a real nats-server and real actor processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import msgpack
import pytest
from nats.js.errors import NoKeysError

from runtime.bus_auth import control_subject
from runtime.codec import Codec
from tests.integration.harness import REPO, LiveRun, alive, descendants, write_config
from tests.integration.workers import CountRequest
from tests.waiting import until

COUNTER_RUN = """
[supervisor]
max_restarts = 10
backoff_base_s = 0.2

[actors.counter]
entry = "tests.integration.workers:CounterActor"
count = {count}
max_concurrency = {concurrency}
heartbeat_s = 1.0
"""

pytestmark = pytest.mark.timeout(240)


async def _publish(run: LiveRun, keys: list[str], sleep_s: float = 0.0) -> None:
    assert run.bus is not None
    codec = Codec([CountRequest])
    for key in keys:
        await run.bus.publish_durable("work.count", await codec.encode(CountRequest(key, sleep_s)), msg_id=key)


async def _collect(run: LiveRun, subject: str, sink: list[dict]) -> object:
    assert run.bus is not None

    async def on_msg(raw) -> None:
        sink.append(msgpack.unpackb(raw.data, raw=False))

    return await run.bus.nc.subscribe(subject, cb=on_msg)


async def _effects(run: LiveRun) -> dict[str, dict]:
    assert run.bus is not None
    kv = await run.bus.kv("effects")
    try:
        keys = await kv.keys()
    except NoKeysError:
        return {}
    return {k: msgpack.unpackb((await kv.get(k)).value, raw=False) for k in keys}


@pytest.fixture
def counter_config(tmp_path: Path):
    def make(count: int = 2, concurrency: int = 8) -> Path:
        return write_config(tmp_path / "run.toml", COUNTER_RUN.format(count=count, concurrency=concurrency))

    return make


async def test_kill_9_during_handling_loses_nothing(tmp_path: Path, counter_config) -> None:
    run = await LiveRun(tmp_path / "run", counter_config(count=2), "--set", "bus.ack_wait_s=3.0").start()
    try:
        victims = await run.wait_actors("counter", 2)
        handled: list[dict] = []
        started: list[dict] = []
        await _collect(run, "test.handled", handled)
        await _collect(run, "test.started", started)
        keys = [f"k{i}" for i in range(400)]
        await _publish(run, keys, sleep_s=0.05)
        # mid-flight: killed once it holds work (a fixed delay under load could kill it before it fetched any)
        await until(lambda: any(s["actor"] == victims[0]["id"] for s in started), 60, "the victim's first handling")
        os.kill(victims[0]["pid"], signal.SIGKILL)

        effects: dict[str, dict] = {}

        async def all_done() -> bool:
            effects.update(await _effects(run))
            return len(effects) == len(keys)

        await until(all_done, 90, "every message's effect")
        assert sorted(effects) == sorted(keys)
        # Exactly once in effect: each key's effect was created once; redeliveries were recognised.
        created = Counter(h["key"] for h in handled if not h["duplicate"])
        assert all(created[k] <= 1 for k in keys)
        assert any(s["n"] > 1 for s in started), "the kill interrupted work that was then redelivered"
        actors = await run.actors()
        assert victims[0]["id"] not in {a["id"] for a in actors}, "the killed actor was restarted under a new id"
    finally:
        assert await run.stop() == 0


async def test_hot_swap_under_load_loses_and_duplicates_nothing(tmp_path: Path, counter_config) -> None:
    code_dir = tmp_path / "code"
    code_dir.mkdir()
    (code_dir / "swapped_worker.py").write_text("from tests.integration.workers import CounterActor\nVERSION = 1\n")
    cfg = write_config(tmp_path / "run.toml", COUNTER_RUN.format(count=2, concurrency=16).replace(
        "tests.integration.workers:CounterActor", "swapped_worker:CounterActor"))
    run = await LiveRun(tmp_path / "run", cfg, pythonpath=(code_dir,)).start()
    try:
        old = await run.wait_actors("counter", 2)
        started: list[dict] = []
        handled: list[dict] = []
        await _collect(run, "test.started", started)
        await _collect(run, "test.handled", handled)
        keys = [f"s{i}" for i in range(1000)]

        # messages flow while the swap runs (~3 s quiet, far longer on a loaded machine); the last 100 go
        # out once it has returned, so the new generation always has work of its own
        during, after = keys[:900], keys[900:]

        async def paced() -> None:
            for i in range(0, len(during), 50):
                await _publish(run, during[i:i + 50], sleep_s=0.02)
                await asyncio.sleep(0.15)

        publisher = asyncio.create_task(paced())
        await asyncio.sleep(0.3)
        (code_dir / "swapped_worker.py").write_text(
            "from tests.integration.workers import CounterActor\nVERSION = 2  # new code on disk\n")
        swap = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "ops.swap", "counter",
                                                       str(run.run_dir)], cwd=REPO, capture_output=True,
                                       text=True, timeout=120)
        assert swap.returncode == 0, swap.stderr
        await publisher
        await _publish(run, after, sleep_s=0.02)
        report = __import__("json").loads(swap.stdout)

        async def all_done() -> bool:
            return len(await _effects(run)) == len(keys)

        await until(all_done, 90, "all 1000 effects")
        starts = Counter(s["key"] for s in started)
        assert set(starts) == set(keys), "zero lost"
        assert max(starts.values()) == 1, "zero handled twice (graceful drain never redelivers)"
        assert not any(h["duplicate"] for h in handled)
        old_hashes = {o["code_hash"] for o in report["old"]}
        new_hashes = {n["code_hash"] for n in report["new"]}
        assert old_hashes == {a["code_hash"] for a in old}
        assert old_hashes.isdisjoint(new_hashes), report
        assert {h["code_hash"] for h in handled} == old_hashes | new_hashes, "both generations consumed"
        for o in old:
            assert not alive(o["pid"]), f"old process {o['pid']} still alive"
    finally:
        assert await run.stop() == 0


async def test_bad_messages_are_dead_lettered_and_actor_keeps_serving(tmp_path: Path, counter_config) -> None:
    run = await LiveRun(tmp_path / "run", counter_config(count=1)).start()
    try:
        await run.wait_actors("counter", 1)
        assert run.bus is not None
        js = run.bus.js
        await js.publish("work.count", b"\xc1not msgpack")
        await js.publish("work.count", msgpack.packb({"schema": 1, "type": "no.such", "v": 1, "body": b""}))
        await js.publish("work.count", b"\x00" * (2 * 1024 * 1024))  # over the 1 MiB inline limit
        await js.publish("work.count", msgpack.packb(
            {"schema": 1, "type": "test.count", "v": 1, "body": msgpack.packb({"key": 5})}))  # wrong field type
        await _publish(run, ["after"])

        async def served() -> bool:
            return "after" in await _effects(run)

        await until(served, 30, "the actor to keep serving")
        sub = await js.subscribe("dlq.>", ordered_consumer=True, deliver_policy=None)
        reasons = []
        for _ in range(4):
            m = await sub.next_msg(timeout=5)
            reasons.append(m.headers["Reason"])
        assert sorted(reasons) == ["invalid", "malformed", "oversized", "unknown_type"]
        events = [line for f in (run.run_dir / "logs").glob("counter-*.jsonl") for line in f.read_text().splitlines()]
        assert sum('"message_dead_lettered"' in e for e in events) == 4
    finally:
        assert await run.stop() == 0


async def test_sigterm_leaves_no_process_behind(tmp_path: Path, counter_config) -> None:
    run = await LiveRun(tmp_path / "run", counter_config(count=3)).start()
    assert run.proc is not None
    await run.wait_actors("counter", 3)
    tree = descendants(run.proc.pid)
    assert len(tree) >= 4, f"expected nats-server and 3 actors, saw {tree}"
    assert await run.stop() == 0
    await asyncio.sleep(0.2)
    assert [p for p in tree if alive(p)] == []


async def test_an_actor_with_nice_gives_way_on_the_cpu(tmp_path: Path) -> None:
    config = write_config(tmp_path / "run.toml", COUNTER_RUN.format(count=1, concurrency=1) + "nice = 7\n")
    run = await LiveRun(tmp_path / "run", config).start()
    try:
        (actor,) = await run.wait_actors("counter", 1)
        assert os.getpriority(os.PRIO_PROCESS, actor["pid"]) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 7)
        autogroup = Path(f"/proc/{actor['pid']}/autogroup")
        if autogroup.exists():  # its session's scheduling group gives way too
            assert autogroup.read_text().split()[-1] == "7", autogroup.read_text()
    finally:
        assert await run.stop() == 0


def _environment(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(e.split("=", 1) for e in entries if "=" in e)


async def test_an_actor_kind_s_threads_are_the_one_setting_of_its_compute_threads(tmp_path: Path) -> None:
    """``actors.<kind>.threads`` (default 1) is set in the process's environment, which torch follows."""
    for threads, expected in (("", "1"), ("threads = 3\n", "3")):
        config = write_config(tmp_path / "run.toml", COUNTER_RUN.format(count=1, concurrency=1) + threads)
        run = await LiveRun(tmp_path / f"run{expected}", config).start()
        try:
            (actor,) = await run.wait_actors("counter", 1)
            env = _environment(actor["pid"])
            assert (env.get("OMP_NUM_THREADS"), env.get("MKL_NUM_THREADS")) == (expected, expected), threads
        finally:
            assert await run.stop() == 0
    torch_threads = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert torch_threads.stdout.strip() == "1", torch_threads.stderr  # (torch caps it at the cores: not 3)


async def test_restart_intensity_limit_fails_the_run(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "run.toml", """
[supervisor]
max_restarts = 2
restart_window_s = 60.0
backoff_base_s = 0.1

[actors.crasher]
entry = "tests.integration.workers:CrashingActor"
""")
    run = await LiveRun(tmp_path / "run", cfg).start()
    assert run.proc is not None
    rc = await asyncio.to_thread(run.proc.wait, 60)
    out = run.proc.stdout.read().decode() if run.proc.stdout else ""
    assert rc == 1, out
    events = (run.run_dir / "logs" / "supervisor.jsonl").read_text()
    assert '"restart_intensity_exceeded"' in events
    assert events.count('"actor_crashed"') == 3
    await run.stop()
    assert "crashed 3 times" in out


async def test_live_config_reaches_every_actor_within_a_second(tmp_path: Path, counter_config) -> None:
    run = await LiveRun(tmp_path / "run", counter_config(count=3)).start()
    try:
        actors = await run.wait_actors("counter", 3)
        done = await asyncio.to_thread(subprocess.run, [sys.executable, "-X", "importtime", "-m", "ops.config", "set",
                                                        "counter.delay_scale", "0.25", str(run.run_dir)],
                                       cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        t_set = time.monotonic()
        # the operator's answer comes at once: it imports neither torch nor boto3 (a file:// store), the seconds
        # of a process start that would be (every module it imported, from -X importtime)
        imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in done.stderr.splitlines()
                    if line.startswith("import time:")}
        assert imported and not imported & {"torch", "boto3", "botocore"}, sorted(imported & {"torch", "boto3"})
        seen: dict[str, float] = {}
        while len(seen) < 3 and time.monotonic() - t_set < 5:
            for a in actors:
                if a["id"] not in seen:
                    status = await run.request(control_subject(a["kind"], a["id"], "status"))
                    if status["delay_scale"] == 0.25:
                        seen[a["id"]] = time.monotonic() - t_set
            await asyncio.sleep(0.02)
        assert len(seen) == 3 and max(seen.values()) < 1.0, seen
        assert {a["pid"] for a in await run.wait_actors("counter", 3)} == {a["pid"] for a in actors}, "no restart"
        got = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "ops.config", "get",
                                                       "counter.delay_scale", str(run.run_dir)],
                                      cwd=REPO, capture_output=True, text=True)
        assert (got.returncode, got.stdout, got.stderr) == (0, "counter.delay_scale = 0.25  # live\n", ""), got
        bad = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "ops.config", "set",
                                                       "counter.note", '"x"', str(run.run_dir)],
                                      cwd=REPO, capture_output=True, text=True)
        assert bad.returncode == 2 and "not live" in bad.stderr
    finally:
        assert await run.stop() == 0


FAULTY_RUN = """
[supervisor]
max_restarts = 10
backoff_base_s = 0.2

[actors.faulty]
entry = "tests.integration.workers:FaultyActor"
max_deliveries = 3
heartbeat_s = 0.5
"""


async def test_poison_messages_are_dead_lettered_after_bounded_deliveries(tmp_path: Path) -> None:
    """Envelopes that cannot decode go to the DLQ at once (a list as type, a key escaping the blob store);
    a message whose handler always raises, or always kills its process, after max_deliveries with its
    last error; the actor keeps serving and the run stops cleanly."""
    from tests.integration.workers import FaultRequest

    run = await LiveRun(tmp_path / "run", write_config(tmp_path / "run.toml", FAULTY_RUN),
                        "--set", "bus.ack_wait_s=2.0").start()
    try:
        await run.wait_actors("faulty", 1)
        assert run.bus is not None
        handled: list[dict] = []
        await _collect(run, "test.handled", handled)
        js, codec = run.bus.js, Codec([FaultRequest])
        body = msgpack.packb({"key": "x"})
        await js.publish("work.fault", msgpack.packb({"schema": 1, "type": ["test.fault"], "v": 1, "body": body}))
        await js.publish("work.fault", msgpack.packb({"schema": 1, "type": "test.fault", "v": 1, "blob": "../../x"}))
        await js.publish("work.fault", await codec.encode(FaultRequest("always-raises", "raise")))
        sub = await js.subscribe("dlq.>", ordered_consumer=True, deliver_policy=None)
        letters: dict[str, list[dict]] = {}

        async def next_letter() -> None:
            m = await sub.next_msg(timeout=60)
            letters.setdefault(m.headers["Reason"], []).append(m.headers)

        for _ in range(3):
            await next_letter()
        # Then, alone (a crash would also interrupt the other's handling): the process killer, 3
        # deliveries of ack_wait 2 s each, with restarts.
        await js.publish("work.fault", await codec.encode(FaultRequest("kills-its-process", "exit")))
        await next_letter()
        assert sorted(letters) == ["invalid_blob_key", "max_deliveries", "unknown_type"], letters
        raised, crashed = (h["Detail"] for h in letters["max_deliveries"])
        assert "LookupError" in raised and "failed 3 deliveries" in raised, raised
        assert "delivered 4 times" in crashed and "crashed or hung" in crashed, crashed
        await js.publish("work.fault", await codec.encode(FaultRequest("after")))

        async def served() -> bool:
            return any(h["key"] == "after" for h in handled)

        await until(served, 30, "the actor to keep serving after the poison")

        async def queue_empty() -> bool:  # its handler reports before its ack reaches the server
            return (await js.stream_info("Q_WORK_FAULT")).state.messages == 0

        await until(queue_empty, 30, "every poison message (and the last one, acknowledged) to leave the work queue")
    finally:
        assert await run.stop() == 0


async def test_an_actor_that_does_not_stop_cleanly_is_named(tmp_path: Path, counter_config) -> None:
    cfg = write_config(tmp_path / "run.toml", COUNTER_RUN.format(count=1, concurrency=1)
                       + '\n[actors.stubborn]\nentry = "tests.integration.workers:StubbornActor"\n')
    run = await LiveRun(tmp_path / "run", cfg).start()
    (stubborn,) = await run.wait_actors("stubborn", 1)
    await run.wait_actors("counter", 1)
    assert await run.stop() == 0  # an operator's stop: the run is stopped, but not every actor cleanly
    output = run.output()
    assert f"1 actor(s) did not stop cleanly: {stubborn['id']} exited 1" in output, output
    events = (run.run_dir / "logs" / "supervisor.jsonl").read_text()
    assert '"actor_stopped_uncleanly"' in events
