"""Rollout checkpoints: an episode interrupted after any turn and resumed from its checkpoint (transcript and
environment rebuilt from the blob store) ends token for token as the uninterrupted one; broken, stale or
missing checkpoints are skipped with the reason and lose nothing.

The policy here is scripted, a pure function of (context tokens, seed, weights version) that draws its
text, log-probs and router choices from a generator seeded by a hash of them, and that reads back files
it wrote in earlier turns: so the continuation depends on every token of the transcript, on the seed and
on the rebuilt workspace (a real bubblewrap sandbox), and a resume that got any of them wrong diverges.
A real tiny policy does not call tools before training, so it could not reach a second turn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zstandard

from actors.agent.config import AgentConfig
from actors.agent.dialect import Dialect
from actors.agent.episode import reference_episode_text, run_episode
from actors.agent.trajectory import EpisodeEnd, Segment, Trajectory
from actors.blob_collector import BlobCollector
from actors.config import TasksSection
from actors.rollout_checkpoint import RolloutCheckpoint, RolloutCheckpoints, checkpoint_key, num_policy_tokens
from actors.task_catalog import TaskCatalog
from model.chat import ToolCall, render_tool_call
from model.engine import EngineConfig, GenerationEngine
from model.generation import FinishReason, Generation
from model.sampling import SamplingParams
from model.tokenizer import ByteTokenizer
from runtime.blob import open_store
from sandbox import Environment, LayerStore, ToolBox
from sandbox.tasks import Task
from tests.model.helpers import seeded_model, small_config
from tests.sandbox.conftest import TEST_CONFIG
from tests.sandbox_store import open_layer_store_or_skip

TOKENIZER = ByteTokenizer()
NUM_LAYERS, TOP_K = 2, 2
CONFIG = AgentConfig(max_turns=6, max_new_tokens_per_turn=200, max_total_tokens=4000, tool_output_max_chars=200)


class ScriptedPolicy:
    """Turn i writes ``f<i>.txt`` (even i) or reads the file the turn before wrote (odd i); after five tool
    turns it answers. Every choice comes from a generator seeded by (context, seed, version)."""

    def __init__(self, version: int = 3) -> None:
        self.version = version
        self.num_calls = 0

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        self.num_calls += 1
        digest = hashlib.sha256(f"{list(prompt_ids)}/{params.seed}/{self.version}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "big"))
        turn = TOKENIZER.decode(list(prompt_ids)).count("<tool>")
        thought = "".join(chr(97 + int(c)) for c in torch.randint(0, 26, (int(torch.randint(3, 12, (), generator=g)),),
                                                                generator=g))
        if turn >= 5:
            ids = [*TOKENIZER.encode(f"{thought} done"), TOKENIZER.end_token_id]
        elif turn % 2 == 0:
            content = "".join(str(int(d)) for d in torch.randint(0, 10, (20,), generator=g))
            ids = TOKENIZER.encode(thought + render_tool_call(ToolCall("write_file", {"path": f"f{turn}.txt",
                                                                                      "content": content})))
        else:
            ids = TOKENIZER.encode(thought + render_tool_call(ToolCall("read_file", {"path": f"f{turn - 1}.txt"})))
        ids = ids[: params.max_new_tokens]
        n = len(ids)
        return Generation(
            prompt_ids=tuple(prompt_ids), token_ids=tuple(ids),
            logprobs=tuple((-torch.rand(n, generator=g, dtype=torch.float64) * 3).tolist()),
            versions=(self.version,) * n,
            topk_ids_TLK=torch.randint(0, 8, (len(prompt_ids) + n, NUM_LAYERS, TOP_K), generator=g, dtype=torch.int16),
            finish_reason=FinishReason.STOP_STRING, logprob_temperature=1.0)


class Interrupted(Exception):
    """The rollout's process died after writing a checkpoint."""


@pytest.fixture
def layer_store() -> Iterator[LayerStore]:
    store = open_layer_store_or_skip(TEST_CONFIG)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def task() -> Task:
    return TaskCatalog.build(TasksSection(num_train=1, num_heldout=1)).train[0]


def _tool_caller(env: Environment) -> Any:
    toolbox = ToolBox(env)

    async def call_tool(name: str, args: dict[str, Any]) -> tuple[bool, str]:
        result = await toolbox.call(name, args)
        return result.ok, result.text

    return call_tool


async def _attempt(checkpoints: RolloutCheckpoints, store: LayerStore, task: Task, *, attempt: int, seed: int,
                   stop_after_turns: int | None = None, start: Trajectory | None = None,
                   env: Environment | None = None) -> tuple[Trajectory | None, dict[str, str]]:
    """One attempt as the rollout actor runs it: a checkpoint after each turn; ``stop_after_turns`` kills it
    right after that turn's checkpoint. Returns the trajectory (None when killed) and the final files."""
    env = env or Environment.create(store, task.files, task.limits)
    try:
        async def on_turn(traj: Trajectory) -> None:
            written = await checkpoints.save(sample_id="e0-p0-s0", prompt_id=task.id, attempt=attempt, seed=seed,
                                             trajectory=traj, env=env)
            assert written is not None and written.num_bytes > 0
            if traj.num_turns == stop_after_turns:
                raise Interrupted

        sampling = SamplingParams(temperature=1.0, seed=seed)
        try:
            traj = await run_episode(task, ScriptedPolicy().generate, _tool_caller(env), Dialect.compact(), CONFIG,
                                     sampling, start=start, on_turn=on_turn)
        except Interrupted:
            return None, {}
        files = {}
        for i in range(0, 6, 2):
            ok, text = await _tool_caller(env)("read_file", {"path": f"f{i}.txt"})
            files[f"f{i}.txt"] = text if ok else ""
        return traj, files
    finally:
        env.close()


def _tokens(t: Trajectory) -> list[list[int]]:
    return [seg.token_ids for seg in t.segments]


def _same(a: Trajectory, b: Trajectory) -> None:
    assert len(a.segments) == len(b.segments)
    for x, y in zip(a.segments, b.segments, strict=True):
        assert x.token_ids == y.token_ids
        assert x.loss_mask == y.loss_mask and x.versions == y.versions
        assert x.behaviour_logprobs == y.behaviour_logprobs and x.logprob_temperatures == y.logprob_temperatures
        assert x.topk_ids_TLK is not None and y.topk_ids_TLK is not None and np.array_equal(x.topk_ids_TLK,
                                                                                           y.topk_ids_TLK)
        assert (x.prompt_len, x.summary_len) == (y.prompt_len, y.summary_len)
    assert (a.end, a.num_turns, a.tool_uses) == (b.end, b.num_turns, b.tool_uses)
    assert (a.num_tool_call_tokens, a.num_tool_output_tokens, a.num_final_tokens, a.num_thinking_tokens,
            a.num_summary_tokens) == (b.num_tool_call_tokens, b.num_tool_output_tokens, b.num_final_tokens,
                                      b.num_thinking_tokens, b.num_summary_tokens)


@pytest.mark.parametrize("killed_after", [1, 2, 3, 4])
def test_a_resumed_episode_is_token_for_token_the_uninterrupted_one(
        tmp_path: Path, layer_store: LayerStore, task: Task, killed_after: int) -> None:
    async def main() -> None:
        checkpoints = RolloutCheckpoints(open_store(f"file://{tmp_path}/blobs"))
        whole, whole_files = await _attempt(checkpoints, layer_store, task, attempt=0, seed=17)
        assert whole is not None and whole.num_turns == 6 and whole.end.value == "final_answer"
        assert whole_files["f4.txt"], "the episode left files in its workspace"

        fresh = RolloutCheckpoints(open_store(f"file://{tmp_path}/blobs2"))  # another run's store
        killed, _ = await _attempt(fresh, layer_store, task, attempt=0, seed=17, stop_after_turns=killed_after)
        assert killed is None
        resume = await fresh.newest("e0-p0-s0", task.id, 1, version_floor=3, eta=0)
        assert resume.checkpoint is not None and resume.num_turns == killed_after and resume.checkpoint.seed == 17
        env = RolloutCheckpoints.rebuild(layer_store, resume.checkpoint, task.limits)  # on a "new host"
        resumed, resumed_files = await _attempt(fresh, layer_store, task, attempt=1, seed=resume.checkpoint.seed,
                                                start=resume.checkpoint.trajectory, env=env)
        assert resumed is not None
        _same(whole, resumed)
        assert resumed_files == whole_files, "the rebuilt workspace went on as the uninterrupted one"
        newest = await fresh.newest("e0-p0-s0", task.id, 2, version_floor=3, eta=0)
        assert (newest.checkpoint.attempt, newest.num_turns) == (1, 5), "the resumed attempt checkpoints on"

    asyncio.run(main())


def test_resuming_with_another_seed_or_a_fresh_workspace_diverges(
        tmp_path: Path, layer_store: LayerStore, task: Task) -> None:
    """The equality above is not vacuous: the continuation depends on the seed and on the workspace."""
    async def main() -> None:
        whole, _ = await _attempt(RolloutCheckpoints(open_store(f"file://{tmp_path}/whole")), layer_store, task,
                                  attempt=0, seed=17)
        checkpoints = RolloutCheckpoints(open_store(f"file://{tmp_path}/blobs"))
        await _attempt(checkpoints, layer_store, task, attempt=0, seed=17, stop_after_turns=3)
        resume = await checkpoints.newest("e0-p0-s0", task.id, 1, version_floor=3, eta=0)
        assert resume.checkpoint is not None and resume.num_turns == 3
        env = RolloutCheckpoints.rebuild(layer_store, resume.checkpoint, task.limits)
        other_seed, _ = await _attempt(checkpoints, layer_store, task, attempt=1, seed=18, env=env,
                                       start=resume.checkpoint.trajectory)
        assert other_seed is not None and _tokens(other_seed) != _tokens(whole)
        resume = await checkpoints.newest("e0-p0-s0", task.id, 0, version_floor=3, eta=0)  # attempt 0's turn 3
        assert resume.checkpoint is not None and resume.num_turns == 3
        blank, _ = await _attempt(checkpoints, layer_store, task, attempt=2, seed=17,
                                  start=resume.checkpoint.trajectory)  # a fresh environment: f2.txt missing
        assert blank is not None and _tokens(blank) != _tokens(whole), "turn 4 reads what turn 3 wrote"

    asyncio.run(main())


def test_corrupt_stale_and_foreign_checkpoints_are_skipped_with_the_reason(
        tmp_path: Path, layer_store: LayerStore, task: Task) -> None:
    async def main() -> None:
        blob = open_store(f"file://{tmp_path}/blobs")
        checkpoints = RolloutCheckpoints(blob)
        none = await checkpoints.newest("e0-p0-s0", task.id, 1, version_floor=0, eta=2)
        assert none.checkpoint is None and none.reason == "no checkpoint"
        await _attempt(checkpoints, layer_store, task, attempt=0, seed=17, stop_after_turns=3)
        await blob.put(checkpoint_key("e0-p0-s0", 0, 3), b"\x28\xb5\x2f\xfd garbage")  # torn / corrupt
        raw = await blob.get(checkpoint_key("e0-p0-s0", 0, 2))
        data = zstandard.ZstdDecompressor().decompress(raw).replace(b"e0-p0-s0", b"e0-p9-s0")
        await blob.put(checkpoint_key("e0-p0-s0", 0, 2), zstandard.ZstdCompressor().compress(data))  # misfiled
        await blob.put(checkpoint_key("e0-p0-s0", 7, 9), b"of a later attempt")  # never read by attempt 1
        resume = await checkpoints.newest("e0-p0-s0", task.id, 1, version_floor=3, eta=0)
        assert resume.checkpoint is not None and resume.num_turns == 1, "the newest readable one"
        stale = await checkpoints.newest("e0-p0-s0", task.id, 1, version_floor=6, eta=2)
        assert stale.checkpoint is None
        assert "corrupt" in stale.reason and "sample 'e0-p9-s0'" in stale.reason and "3 versions below" in stale.reason
        foreign = await checkpoints.newest("e0-p0-s0", "another-prompt", 1, version_floor=3, eta=0)
        assert foreign.checkpoint is None and "prompt" in foreign.reason, "a checkpoint of another task is no start"

    asyncio.run(main())


def test_checkpoints_of_finished_samples_are_collected_with_their_group(
        tmp_path: Path, layer_store: LayerStore, task: Task) -> None:
    """The blob collector (reused as it is) deletes a trained group's checkpoints with its other blobs, and a
    live group's never."""
    async def main() -> None:
        blob = open_store(f"file://{tmp_path}/blobs")
        await _attempt(RolloutCheckpoints(blob), layer_store, task, attempt=0, seed=17, stop_after_turns=2)
        await blob.put("samples/e0-p1-s0/a0/checkpoints/t00001", b"a live group's")
        assert len(await blob.list("samples/e0-p0-s0/a0/checkpoints/")) == 2
        live = {"e0-p1"}
        collector = BlobCollector(blob, group_size=2, retention_versions=0, is_live=live.__contains__)
        async with asyncio.TaskGroup() as tg:
            task_ = tg.create_task(collector.run())
            await collector.sweep(version=1)  # a restarted reconciler finds what the table no longer holds
            collector.advance(1)
            await asyncio.wait_for(collector.wait_idle(), timeout=30)
            task_.cancel()
        assert await blob.list("samples/e0-p0-") == [] and await blob.list("samples/e0-p1-") != []

    asyncio.run(main())


def test_a_resumed_episode_on_a_fresh_engine_samples_what_the_uninterrupted_one_did(
        tmp_path: Path, layer_store: LayerStore, task: Task) -> None:
    """The same with the real generation engine (a small random policy, seeded sampling at temperature 1):
    the first turn says the reference agent's tool call on the engine's work (an untrained policy calls no
    tool), every later turn is the engine's own sampling; the resumed attempt runs on a new engine with the
    same weights, as a replacement process would."""
    config = small_config(vocab_size=TOKENIZER.vocab_size, max_position_embeddings=2048)
    call = TOKENIZER.encode(reference_episode_text(task)[1][0])
    agent = dataclasses.replace(CONFIG, max_new_tokens_per_turn=24)

    def policy(engine: GenerationEngine) -> Any:
        async def generate(prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
            if "<tool>" in TOKENIZER.decode(list(prompt_ids)):
                return await engine.generate(prompt_ids, params)
            gen = await engine.generate(prompt_ids, dataclasses.replace(
                params, max_new_tokens=len(call), stop_token_ids=(), stop_strings=()))
            return dataclasses.replace(gen, token_ids=tuple(call))
        return generate

    async def attempt(checkpoints: RolloutCheckpoints, start: Trajectory | None, seed: int,
                      stop_after_turns: int | None) -> Trajectory | None:
        engine = GenerationEngine(seeded_model(config, seed=5), EngineConfig(max_batch_size=4),
                                  detokenize=TOKENIZER.decode)
        await engine.start()
        env = (RolloutCheckpoints.rebuild(layer_store, start_checkpoint[0], task.limits) if start is not None
               else Environment.create(layer_store, task.files, task.limits))
        try:
            async def on_turn(traj: Trajectory) -> None:
                await checkpoints.save(sample_id="e0-p0-s0", prompt_id=task.id, attempt=0 if start is None else 1,
                                       seed=seed, trajectory=traj, env=env)
                if traj.num_turns == stop_after_turns:
                    raise Interrupted
            try:
                return await run_episode(task, policy(engine), _tool_caller(env), Dialect.compact(), agent,
                                         SamplingParams(temperature=1.0, seed=seed), start=start, on_turn=on_turn)
            except Interrupted:
                return None
        finally:
            env.close()
            await engine.stop()

    start_checkpoint: list[Any] = []

    async def main() -> None:
        whole = await attempt(RolloutCheckpoints(open_store(f"file://{tmp_path}/whole")), None, 23, None)
        assert whole is not None and whole.num_turns >= 2, "the engine sampled at least one turn after the call"
        checkpoints = RolloutCheckpoints(open_store(f"file://{tmp_path}/killed"))
        assert await attempt(checkpoints, None, 23, 1) is None
        resume = await checkpoints.newest("e0-p0-s0", task.id, 1, version_floor=0, eta=0)
        assert resume.checkpoint is not None and resume.num_turns == 1
        start_checkpoint.append(resume.checkpoint)
        resumed = await attempt(checkpoints, resume.checkpoint.trajectory, resume.checkpoint.seed, None)
        assert resumed is not None
        _same(whole, resumed)

    asyncio.run(main())


def test_a_chain_of_segments_is_checkpointed_and_read_back_whole(tmp_path: Path) -> None:
    """A transcript past a summary (two segments, each with its own router choices) round-trips; a resumed
    chain goes on in its last segment."""
    def segment(n: int, version: int, summary_len: int) -> Segment:
        seg = Segment.of_prompt(list(range(4)))
        seg.token_ids += list(range(10, 10 + n))
        seg.loss_mask += [1] * n
        seg.behaviour_logprobs += [-0.5] * n
        seg.logprob_temperatures += [0.7] * n
        seg.versions += [version] * n
        seg.topk_ids_TLK = np.random.default_rng(n).integers(0, 8, (4 + n, 2, 2), dtype=np.int16)
        seg.summary_len = summary_len
        return seg

    chain = Trajectory([segment(6, 3, 6), segment(5, 4, 0)], EpisodeEnd.TURN_BUDGET, num_turns=3,
                       num_summary_tokens=6)

    async def main() -> None:
        checkpoints = RolloutCheckpoints(open_store(f"file://{tmp_path}/blobs"))
        await checkpoints.write(RolloutCheckpoint("e0-p0-s0", "t0", 0, 17, chain, b""))
        resume = await checkpoints.newest("e0-p0-s0", "t0", 1, version_floor=4, eta=1)
        assert resume.checkpoint is not None and resume.num_turns == 3
        _same(chain, resume.checkpoint.trajectory)
        assert num_policy_tokens(resume.checkpoint.trajectory) == 11, "every segment's sampled tokens"
        stale = await checkpoints.newest("e0-p0-s0", "t0", 1, version_floor=5, eta=1)
        assert stale.checkpoint is None, "the first segment's tokens (version 3) are past the bound"

    asyncio.run(main())
