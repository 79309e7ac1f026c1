"""What a rollout checkpoint costs per turn: bytes, milliseconds and share of the turn's time.

Episodes on the default tasks (the built-in difficulty-1 families the default run trains on) or, with
``--family long_context``, on the long-context family (notes to read one by one, more than one window: its
agent settings, `LONG_CONTEXT_AGENT`, summaries on), run as the rollout actor runs them: ``--batch`` episodes
at once on one `GenerationEngine` of the default policy's architecture (`model.config.tiny`, random weights),
each in its own bubblewrap sandbox, with the product's checkpoint after each turn: the workspace's snapshot
and a copy of the transcript while the episode waits (`RolloutCheckpoints.capture`), then beside it the
snapshot's export and the record's encoding (in a thread) and a put to a ``file://`` blob store
(`CapturedCheckpoint.write`). An untrained policy never calls a tool, so each turn decodes as many tokens as
the reference agent's turn holds and then says the reference agent's text (the perfect episode: on the default
tasks one ``write_file`` call, then ``done``; on the long-context family `ReferencePolicy`'s reads, summaries,
write and ``done``): the engine's time, log-probs, versions and router choices are real, the text is the
reference's, the tools' answers the sandbox's. A turn's time is the wall time from the episode's previous turn
end to this turn's end (decoding in a shared batch, the tool call, the capture). ``ms`` is the checkpoint's
whole cost (capture to put done), ``blocking_ms`` the part the episode waited for.

The same episodes run again without checkpoints (alternating order over ``--trials``) to give the wall
time they add to a batch of episodes (the snapshots run in the event loop, so a batch's episodes wait for
each other's; the writes compete for the CPU).

Usage (as root, bubblewrap installed):
    python -m tests.bench.rollout_checkpoint [--batch 64] [--trials 2] [--family generated|long_context]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: this file's folder would shadow the `sandbox` package
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import structlog
import torch

from actors.agent.config import AgentConfig
from actors.agent.dialect import Dialect
from actors.agent.episode import reference_episode_text, run_episode
from actors.agent.trajectory import Trajectory
from actors.config import TasksSection
from actors.rollout_checkpoint import CapturedCheckpoint, RolloutCheckpoints
from actors.task_catalog import TaskCatalog
from actors.training.reference_chains import LONG_CONTEXT_AGENT, ReferencePolicy
from model.config import tiny
from model.engine import EngineConfig, GenerationEngine
from model.generation import Generation
from model.sampling import SamplingParams
from model.tokenizer import ByteTokenizer
from model.transformer import MoETransformer
from runtime.blob import open_store
from sandbox import Environment, LayerStore, SandboxConfig, ToolBox
from sandbox.tasks import Task

TOKENIZER = ByteTokenizer()


def _reference(task: Task, agent: AgentConfig) -> Callable[[Sequence[int], SamplingParams], list[int]]:
    """What the reference agent says next in a context: its turn's tokens."""
    if agent.summarize_at_tokens:  # the long-context family's settings
        policy = ReferencePolicy(task, agent)
        return lambda prompt_ids, params: TOKENIZER.encode(policy.reply(TOKENIZER.decode(list(prompt_ids))))[
            : params.max_new_tokens]
    turns = [TOKENIZER.encode(text) for text, trained in reference_episode_text(task) if trained]
    return lambda prompt_ids, params: turns[TOKENIZER.decode(list(prompt_ids)).count("<tool>")]


@dataclasses.dataclass
class _Episode:
    task: Task
    turn_ends: list[float] = dataclasses.field(default_factory=list)
    checkpoints: list[tuple[int, float, float]] = dataclasses.field(default_factory=list)  # bytes, s, blocking s
    num_summaries: int = 0


async def _episode(engine: GenerationEngine, store: LayerStore, blob: Any, record: _Episode, index: int,
                   checkpointed: bool, agent: AgentConfig, writes: asyncio.TaskGroup) -> Trajectory:
    reference = _reference(record.task, agent)

    async def generate(prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        ids = reference(prompt_ids, params)
        real = await engine.generate(prompt_ids, dataclasses.replace(
            params, max_new_tokens=len(ids), stop_token_ids=(), stop_strings=()))
        return dataclasses.replace(real, token_ids=tuple(ids))  # the engine's work, the reference's words

    env = Environment.create(store, record.task.files, record.task.limits)
    checkpoints = RolloutCheckpoints(blob)
    try:
        toolbox = ToolBox(env)

        async def call_tool(name: str, args: dict[str, Any]) -> tuple[bool, str]:
            result = await toolbox.call(name, args)
            return result.ok, result.text

        async def write(captured: CapturedCheckpoint) -> None:
            written = await captured.write()
            assert written is not None, "a checkpoint failed (see the event)"
            record.checkpoints.append((written.num_bytes, written.seconds, written.blocking_s))

        async def on_turn(traj: Trajectory) -> None:  # as the rollout actor: capture, write beside the episode
            if checkpointed:
                captured = checkpoints.capture(sample_id=f"bench-s{index}", prompt_id=record.task.id, attempt=0,
                                               seed=index, trajectory=traj, env=env)
                assert captured is not None, "a checkpoint failed (see the event)"
                writes.create_task(write(captured))
            record.turn_ends.append(time.perf_counter())

        record.turn_ends.append(time.perf_counter())
        traj = await run_episode(record.task, generate, call_tool, Dialect.compact(), agent,
                                 SamplingParams(temperature=1.0, seed=index), on_turn=on_turn)
        record.turn_ends.append(time.perf_counter())
        record.num_summaries = traj.num_summaries
        return traj
    finally:
        env.close()


async def _batch(model: MoETransformer, store: LayerStore, tasks: list[Task], checkpointed: bool,
                 agent: AgentConfig, blob_dir: str) -> tuple[float, list[_Episode]]:
    engine = GenerationEngine(model, EngineConfig(max_batch_size=len(tasks)), detokenize=TOKENIZER.decode)
    await engine.start()
    try:
        blob = open_store(f"file://{blob_dir}")
        records = [_Episode(t) for t in tasks]
        started = time.perf_counter()
        async with asyncio.TaskGroup() as writes:
            await asyncio.gather(*(_episode(engine, store, blob, r, i, checkpointed, agent, writes)
                                   for i, r in enumerate(records)))
        return time.perf_counter() - started, records
    finally:
        await engine.stop()


def _summary(records: list[_Episode]) -> dict[str, float]:
    sizes = [b for r in records for b, _, _ in r.checkpoints]
    costs = [s for r in records for _, s, _ in r.checkpoints]
    blocking = [s for r in records for _, _, s in r.checkpoints]
    # the turn a checkpoint follows: from the previous turn's end (or the episode's start) to its end
    turns = [r.turn_ends[i + 1] - r.turn_ends[i] for r in records for i in range(len(r.checkpoints))]
    return {
        "num_checkpoints": len(sizes),
        "checkpoints_per_episode_median": statistics.median(len(r.checkpoints) for r in records),
        "summaries_per_episode_mean": round(statistics.mean(r.num_summaries for r in records), 2),
        "bytes_median": statistics.median(sizes),
        "bytes_max": max(sizes),
        "ms_median": round(1e3 * statistics.median(costs), 2),  # capture, export, encode, put
        "ms_p90": round(1e3 * statistics.quantiles(costs, n=10)[-1], 2),
        "blocking_ms_median": round(1e3 * statistics.median(blocking), 2),  # what the episode waited for
        "turn_ms_median": round(1e3 * statistics.median(turns), 1),
        "share_median": round(statistics.median(c / t for c, t in zip(costs, turns, strict=True)), 4),
        "blocking_share_median": round(statistics.median(c / t for c, t in zip(blocking, turns, strict=True)), 4),
    }


async def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="episodes decoded together (rollout.max_batch_size)")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--family", choices=("generated", "long_context"), default="generated",
                        help="the default tasks (difficulty 1) or the long-context family")
    args = parser.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    model = MoETransformer(tiny()).init_weights(0).eval()
    section = TasksSection(num_train=args.batch, num_heldout=1, family=args.family)
    tasks = list(TaskCatalog.build(section).train)
    agent = LONG_CONTEXT_AGENT if args.family == "long_context" else AgentConfig()
    store = LayerStore(SandboxConfig(root_dir="/var/tmp/asyncrl-bench-rollout-checkpoint"))
    walls: dict[bool, list[float]] = {True: [], False: []}
    summaries = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for trial in range(args.trials):
                for checkpointed in ((True, False) if trial % 2 == 0 else (False, True)):
                    wall, records = await _batch(model, store, tasks, checkpointed, agent, f"{tmp}/t{trial}")
                    walls[checkpointed].append(wall)
                    if checkpointed:
                        summaries.append(_summary(records))
    finally:
        store.close()
    load = os.getloadavg()[0]
    print(json.dumps({
        "tasks": "long-context family" if args.family == "long_context" else "default (difficulty 1)",
        "batch": args.batch, "trials": args.trials, "load_1m": round(load, 1),
        "per_trial": summaries,
        "wall_s_with": [round(w, 2) for w in walls[True]], "wall_s_without": [round(w, 2) for w in walls[False]],
        "wall_added": round(statistics.median(walls[True]) / statistics.median(walls[False]) - 1, 4),
    }))


if __name__ == "__main__":
    asyncio.run(main())
