"""Messages validated against the state they claim: weight announcements, data exhaustion, registry entries.

Each test sends what a client on the bus could send (well-typed, decodable, false) and checks that the
receiver refuses it with a reason, counts it, and still acts on the true message that follows.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
from structlog.testing import capture_logs

from actors import Lifecycle, ListTaskSource
from actors.agent.weights_follower import WeightsFollower
from actors.messages import DataExhausted, WeightsPublished
from actors.reconciler.data_exhaustion import why_not_exhausted
from actors.weights_announcements import weights_subject
from model.engine import GenerationEngine
from model.weight_sync import manifest_key
from runtime.blob import open_store
from runtime.codec import Codec
from runtime.registry import decode_registration, parse_registration_key, registration_key
from tests.actors.agent.test_weights_follower import CONFIG, RUN, FakeBus, publish, versions_of_model
from tests.actors.lifecycle_world import World
from tests.actors.test_lifecycle import config
from tests.model.helpers import seeded_model


async def _signal(bus: FakeBus, msg: WeightsPublished) -> None:
    data = await Codec([WeightsPublished]).encode(msg)
    await bus.callbacks[weights_subject(RUN)](SimpleNamespace(data=data))


async def test_weights_announcement_of_a_version_the_store_lacks_is_rejected(tmp_path: Path) -> None:
    """A spoof: ``weights.<run>`` announcing version 10^9 must not stall the run for good."""
    states = versions_of_model(3)
    bus = FakeBus()
    async with open_store(f"file://{tmp_path}") as store, contextlib.AsyncExitStack() as stack:
        await publish(store, states, range(2))
        engine = GenerationEngine(seeded_model(CONFIG, seed=0))
        await engine.start()
        stack.push_async_callback(engine.stop)
        follower = WeightsFollower(bus, store, RUN, engine)
        await follower.start(stack)
        assert follower.latest == 1
        far = 10**9
        spoofs = [
            WeightsPublished(RUN, far, manifest_key("weights", RUN, far), 1),  # never published
            WeightsPublished(RUN, 2, manifest_key("weights", RUN, 2), 1),  # not (yet) in the store
            WeightsPublished(RUN, 5, manifest_key("weights", RUN, 1), 1),  # a real manifest of another version
            WeightsPublished(RUN, 5, "weights/follow1/v0000000005/rank-00000-of-00001/shard-00000.bin", 1),
            WeightsPublished("other", 5, manifest_key("weights", "other", 5), 1),  # another run
        ]
        with capture_logs() as logs:
            for spoof in spoofs:
                await _signal(bus, spoof)
        assert follower.latest == 1 and follower.num_rejected == len(spoofs)
        reasons = [e["reason"] for e in logs if e["event"] == "weights_signal_rejected"]
        assert len(reasons) == len(spoofs) and "not in the store" in reasons[0] and "another run" not in reasons[0]
        assert await follower.load_latest() == 1, "nothing is fetched for a rejected announcement"
        # the trainer's real announcement of a published version is still followed
        await publish(store, states, range(2, 3))
        await _signal(bus, WeightsPublished(RUN, 2, manifest_key("weights", RUN, 2), 1))
        assert follower.latest == 2 and await follower.load_latest() == 2 and follower.num_rejected == len(spoofs)


async def test_data_exhausted_is_believed_only_as_the_reconcilers_table_says() -> None:
    """A spoof: ``data_exhausted.<run>`` naming version 2 must not end a 15-step run as finished."""
    more = ListTaskSource.numbered(40)
    fresh = await Lifecycle.resume(early := _store(), more, config(), 0.0, num_rollout_actors=4)
    assert fresh.orders
    reason = await why_not_exhausted(DataExhausted("r1", 0), run="r1", store=early, source=more, num_epochs=1)
    assert "prompts remain" in (reason or "")
    source = ListTaskSource.numbered(4)
    resumed = await Lifecycle.resume(store := _store(), source, config(), 0.0, num_rollout_actors=4)
    core, world = resumed.lifecycle, World()
    world.add(resumed.orders, 1)

    async def check(run: str, version: int) -> str | None:
        return await why_not_exhausted(DataExhausted(run, version), run="r1", store=store, source=source,
                                       num_epochs=1)

    assert "in flight" in (await check("r1", 0) or "")  # every prompt admitted, none trained yet
    assert "not this run" in (await check("r2", 0) or "")
    while world.pending:
        order = world.pending.pop(0)
        world.add(await core.on_completion(world.complete(order), 1.0), 1)
    assert core.is_finished and core.trainer_version == 2
    assert "not the reconciler's version 2" in (await check("r1", 1) or "")
    assert await check("r1", 2) is None  # the reconciler's own claim is confirmed


def _store():
    from actors.testing import InMemorySlotStore

    return InMemorySlotStore()


def _entry(**changes) -> bytes:
    info = {"kind": "rollout", "id": "rollout-1-abcd", "pid": 4242, "host": "h", "code_hash": "c",
            "state": "running", "num_inflight": 0, "num_handled": 3, "num_failed": 0, "num_dead_lettered": 0,
            "uptime_s": 1.5, **changes}
    return msgpack.packb({k: v for k, v in info.items() if v is not None}, use_bin_type=True)


def test_registry_entries_must_be_complete_and_their_own() -> None:
    """A spoof: an entry shaped like a registration must not count as a rollout actor."""
    key = registration_key("rollout", "rollout-1-abcd")
    assert decode_registration(key, _entry())["state"] == "running"
    bad = {
        "shaped like one": msgpack.packb({"kind": "rollout", "state": "running"}),
        "not msgpack": b"\xc1\xff",
        "a list": msgpack.packb(["rollout", "running"]),
        "pid missing": _entry(pid=None),
        "pid a string": _entry(pid="4242"),
        "pid a bool": _entry(pid=True),
        "another id": _entry(id="rollout-2-ffff"),
        "unknown state": _entry(state="sprinting"),
        "negative count": _entry(num_handled=-1),
        "another kind": _entry(kind="trainer"),
    }
    for what, raw in bad.items():
        with pytest.raises(ValueError):
            decode_registration(key, raw)
        assert what
    with pytest.raises(ValueError, match="kind"):  # id says fake, kind says rollout
        decode_registration(registration_key("rollout", "fake-1-abcd"), _entry(id="fake-1-abcd"))
    with pytest.raises(ValueError, match="another actor"):  # the old key, the actor id alone
        decode_registration("rollout-1-abcd", _entry())


def test_registry_keys_name_their_actor_s_kind() -> None:
    """A role writes only keys under its own kind (the bus enforces it); a key under one kind that
    names an actor of another is nobody's lease (the reconciler follows no removal of it)."""
    assert parse_registration_key(registration_key("trainer", "trainer-1-ab")) == ("trainer", "trainer-1-ab")
    for key in ("reg.rollout.trainer-1-ab", "trainer-1-ab", "handover.trainer", "reg.trainer",
                "reg.trainer.trainer-1.ab", "x.trainer.trainer-1-ab", "reg.trainer.trainer"):
        assert parse_registration_key(key) is None, key


async def test_the_evaluator_ends_the_run_only_on_a_confirmed_claim() -> None:
    """The evaluator's own handler: a false claim leaves the run's last version unknown; a true one sets it."""
    from actors.config import RLConfig
    from actors.stages.evaluator import EvaluatorActor

    source = ListTaskSource.numbered(4)
    resumed = await Lifecycle.resume(store := _store(), source, config(), 0.0, num_rollout_actors=4)
    core, world = resumed.lifecycle, World()
    world.add(resumed.orders, 1)
    rechecks: list[bool] = []
    defaults = RLConfig()
    single_epoch = dataclasses.replace(defaults, reconciler=dataclasses.replace(defaults.reconciler, num_epochs=1))
    evaluator = SimpleNamespace(
        exhausted_codec=Codec([DataExhausted]), exhausted_at=None, run_name="r1", slot_store=store,
        train_source=source, config=single_epoch, num_rejected_claims=0, ctx=SimpleNamespace(run_steps=15),
        weights=SimpleNamespace(recheck=lambda: rechecks.append(True)))

    async def hear(version: int) -> None:
        raw = SimpleNamespace(data=await Codec([DataExhausted]).encode(DataExhausted("r1", version)))
        await EvaluatorActor._on_data_exhausted(evaluator, raw)  # type: ignore[arg-type]

    with capture_logs() as logs:
        await hear(2)
    assert evaluator.exhausted_at is None and evaluator.num_rejected_claims == 1 and not rechecks
    assert [e["reason"] for e in logs if e["event"] == "data_exhausted_rejected"]
    while world.pending:
        order = world.pending.pop(0)
        world.add(await core.on_completion(world.complete(order), 1.0), 1)
    await hear(core.trainer_version)
    assert evaluator.exhausted_at == core.trainer_version == 2 and rechecks == [True]


async def test_the_evaluator_shows_how_far_its_evaluation_is_on_the_progress_line() -> None:
    """Issue 30: the run's progress line sat at its last step for the 2.7 minutes of the final evaluation. Each
    progress report (actors.training.evaluation.progress_due) goes to ``progress.eval`` as ``eval=v8 120/344`` and
    to the log; a bus that refuses the line does not fail the evaluation it is about."""
    from actors.stages.evaluator import EvaluatorActor
    from runtime.errors import BusError

    published: list[tuple[str, dict]] = []

    async def publish(subject: str, data: bytes) -> None:
        published.append((subject, msgpack.unpackb(data, raw=False)))

    async def refuse(subject: str, data: bytes) -> None:
        raise BusError("publish on progress.eval: connection closed")

    showing: Any = SimpleNamespace(bus=SimpleNamespace(publish=publish))
    refused: Any = SimpleNamespace(bus=SimpleNamespace(publish=refuse))
    with capture_logs() as logs:
        await EvaluatorActor._publish_progress(showing, 8, 120, 344)
        await EvaluatorActor._publish_progress(refused, 8, 137, 344)
    assert published == [("progress.eval", {"eval": "v8 120/344"})]
    said = [(e["event"], e.get("num_graded")) for e in logs]
    assert said == [("evaluation_progress", 120), ("evaluation_progress", 137),
                    ("evaluation_progress_not_published", None)]


async def test_a_stage_refuses_an_order_whose_blob_key_leaves_the_store(tmp_path: Path) -> None:
    """An order naming a key outside the store is refused for good (reported), not retried until poisoned."""
    from actors._stage import StageActor, WorkRefused

    async with open_store(f"file://{tmp_path}") as store:
        stage = SimpleNamespace(ctx=SimpleNamespace(blob=store))
        with pytest.raises(WorkRefused, match="invalid"):
            await StageActor.get_record(stage, "../../etc/passwd", dict)  # type: ignore[arg-type]
        with pytest.raises(WorkRefused, match="missing"):
            await StageActor.get_record(stage, "groups/none/a0", dict)  # type: ignore[arg-type]


async def test_the_evaluator_asks_to_finish_naming_its_evaluated_last_version_and_asks_again_if_refused() -> None:
    """The supervisor believes a finish only for a named version the durable state confirms (actors.run_end): the
    evaluator names the evaluated version at or past the last, and a refusal leaves it asking again later."""
    from actors.stages.evaluator import EvaluatorActor

    sent: list[tuple[str, dict]] = []
    replies = [{"ok": False, "error": "the run is not finished: no evaluation of version 10 is stored"}, {"ok": True}]

    async def request(subject: str, data: bytes, timeout_s: float) -> bytes:
        sent.append((subject, msgpack.unpackb(data, raw=False)))
        return msgpack.packb(replies[len(sent) - 1])

    evaluator = SimpleNamespace(last_version=10, finish_requested=False, evaluated={0, 5, 10, 11},
                                ctx=SimpleNamespace(run_steps=10), identity=SimpleNamespace(actor_id="evaluator-1-ab"),
                                bus=SimpleNamespace(request=request), num_finish_requests=0,
                                finish_retry_first_s=1.0, finish_retry_max_s=60.0)
    with capture_logs() as logs:
        assert await EvaluatorActor._finish_if_last_evaluated(evaluator) == 1.0  # type: ignore[arg-type]
    assert sent == [("ctl.supervisor.finish", {"by": "evaluator-1-ab", "version": 11, "reason": "steps"})]
    assert not evaluator.finish_requested and [e["error"] for e in logs if e["event"] == "run_finish_refused"]
    assert await EvaluatorActor._finish_if_last_evaluated(evaluator) is None  # type: ignore[arg-type]
    assert evaluator.finish_requested and len(sent) == 2


async def test_a_finish_short_of_the_step_budget_is_believed_only_once_the_dataset_cursor_ran_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run-end check (actors.run_end) below ``run.steps``: a table with no batch, no live slot and the version
    its own is not enough without the dataset cursor. A run's start looks just so (no meta record reads as
    version 0, whose eval row is written at once), and so does the end of an epoch that is not the last. So a
    finish short of the budget gets the ``data_exhausted`` claim's check."""
    from actors import run_end
    from actors.config import ReconcilerSection, RLConfig, TasksSection
    from actors.task_catalog import TaskCatalog
    from runtime.metrics_log import numbered, write_metrics
    from runtime.run_config import RunSection

    one_epoch = RLConfig(tasks=TasksSection(num_train=4, num_heldout=2), reconciler=ReconcilerSection(num_epochs=1))
    two_epochs = dataclasses.replace(one_epoch, reconciler=ReconcilerSection(num_epochs=2))
    store = _store()
    monkeypatch.setattr(run_end, "KVSlotStore", lambda bus, bucket: store)  # the reconciler's table, in memory
    async with open_store(f"file://{tmp_path}") as blob:
        for version in (0, 2):  # each evaluated: only the table may refuse
            await write_metrics(blob, "eval", numbered(version), {"version": version, "pass_at_1": 0.5})

        async def why(version: int, app: RLConfig = one_epoch) -> str | None:
            request = {"by": "evaluator-1-ab", "version": version, "reason": "data exhausted"}
            no_bus: Any = None  # the table is the in-memory store above
            return await run_end.why_not_finished(no_bus, blob, RunSection(steps=10), app, request)

        assert "no cursor or meta record" in (await why(0) or "")  # a run's start: before the first admission
        resumed = await Lifecycle.resume(store, TaskCatalog.build(one_epoch.tasks), config(), 0.0,
                                         num_rollout_actors=4)
        core, world = resumed.lifecycle, World()
        world.add(resumed.orders, 1)
        assert "in flight" in (await why(0) or "")
        while world.pending:
            order = world.pending.pop(0)
            world.add(await core.on_completion(world.complete(order), 1.0), 1)
        assert core.is_finished and core.trainer_version == 2
        # an empty table at the version the table's own, with a second epoch still to come: not the end
        assert "prompts remain" in (await why(2, two_epochs) or "")
        assert await why(2) is None  # the dataset's one epoch ran out: believed
        assert "not the reconciler's version 2" in (await why(0) or "")


async def test_a_refused_finish_at_the_last_version_is_asked_again_though_no_newer_version_comes() -> None:
    """Review: the evaluator's loop woke only for a newer version, and none comes after the last, so one refusal
    (the check out of time, a bus electing a leader) left the run running for good. The real loop, nothing announced
    after the last version: unanswered, refused, refused, and asked again each time, backing off, until believed."""
    from actors.config import RLConfig
    from actors.stages.evaluator import EvaluatorActor
    from runtime.actor import ActorContext, ActorIdentity, ActorSettings
    from runtime.errors import BusTimeout
    from runtime.run_config import RunSection
    from tests.waiting import until

    sent: list[dict] = []
    answers: list[object] = [BusTimeout("no reply within 35s"),
                             {"ok": False, "error": "the run's state could not be read (TimeoutError()); ask again"},
                             {"ok": False, "error": "the run is not finished: no evaluation of version 10 is stored"},
                             {"ok": True}]

    async def request(subject: str, data: bytes, timeout_s: float) -> bytes:
        sent.append(msgpack.unpackb(data, raw=False))
        answer = answers[len(sent) - 1]
        if isinstance(answer, Exception):
            raise answer
        return msgpack.packb(answer)

    no_newer_version = asyncio.Event()  # never set: the last version was announced, nothing follows it

    async def changed() -> int:
        await no_newer_version.wait()
        return 10

    bus: Any = SimpleNamespace(request=request)
    ctx = ActorContext(ActorIdentity.here("evaluator", "evaluator-1-ab", "h"), bus, ActorSettings(), RLConfig(),
                       run=RunSection(steps=10))
    evaluator = EvaluatorActor(ctx)
    # what setup() holds, without a model: every due version is evaluated, so the loop only asks to finish
    evaluator.weights, evaluator.engine = SimpleNamespace(latest=10, changed=changed), SimpleNamespace(version=10)
    evaluator.evaluated, evaluator.exhausted_at, evaluator.finish_requested = set(range(11)), None, False
    evaluator.num_finish_requests, evaluator.finish_retry_first_s = 0, 0.05
    with capture_logs() as logs:
        loop = asyncio.create_task(evaluator._evaluate_due_versions())
        try:
            await until(lambda: evaluator.finish_requested, 10, "the refused finish asked again until believed")
        finally:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop
    assert [body["version"] for body in sent] == [10] * 4
    refused = [e for e in logs if e["event"] == "run_finish_refused"]
    assert [e["retry_in_s"] for e in refused] == [0.05, 0.1, 0.2] and [e["attempt"] for e in refused] == [1, 2, 3]
    assert "did not answer" in refused[0]["error"] and "ask again" in refused[1]["error"]
