"""Router replay narrows the train-inference log-prob gap (engine in bf16, trainer in fp32)."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from model.engine import EngineConfig, GenerationEngine, SamplingParams
from model.loss import packed_logprobs
from model.packing import pack_sequences
from model.router import RouterReplayConfig
from tests.model.helpers import random_prompts, seeded_model, small_config

CONFIG = small_config(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, hidden_size=96)


def test_replay_reduces_logprob_mismatch(record_property: pytest.RecordProperty) -> None:
    trainer = seeded_model(CONFIG, seed=21)
    engine_model = copy.deepcopy(trainer).to(torch.bfloat16)
    prompts = random_prompts(8, CONFIG.vocab_size, 4, 16, seed=22)

    async def rollouts():
        engine = GenerationEngine(engine_model, EngineConfig(max_batch_size=8))
        await engine.start()
        try:
            params = [SamplingParams(max_new_tokens=40, seed=i) for i in range(len(prompts))]
            return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params, strict=True)))
        finally:
            await engine.stop()

    gens = asyncio.run(rollouts())
    batch = pack_sequences([list(g.prompt_ids + g.token_ids) for g in gens])
    replay_TLK = torch.cat([g.topk_ids_TLK for g in gens]).long()
    # completion tokens are predicted from positions P-1 .. P+N-2 of each sequence
    rows = torch.cat(
        [
            torch.arange(len(g.prompt_ids) - 1, len(g.prompt_ids) + len(g.token_ids) - 1) + start
            for g, start in zip(gens, batch.cu_seqlens[:-1].tolist(), strict=True)
        ]
    )
    engine_lp = torch.tensor([lp for g in gens for lp in g.logprobs], dtype=torch.float64)
    with torch.no_grad():
        live, live_out = packed_logprobs(trainer, batch)
        replayed, out = packed_logprobs(trainer, batch, replay_TLK, RouterReplayConfig(plausibility_factor=0.1))
    recorded = (replay_TLK != -1).all(-1)
    d_live = (live[rows].double() - engine_lp).abs()
    d_replay = (replayed[rows].double() - engine_lp).abs()
    stats = {
        "live_p50": float(d_live.quantile(0.5)),
        "live_p99": float(d_live.quantile(0.99)),
        "replay_p50": float(d_replay.quantile(0.5)),
        "replay_p99": float(d_replay.quantile(0.99)),
        "replaced_fraction": out.routing_stats.replaced_fraction,
        "live_routing_differs": float((live_out.topk_ids_TLK != replay_TLK).any(-1)[recorded].float().mean()),
    }
    record_property("replay_mismatch", stats)
    print(f"|trainer fp32 - engine bf16| logprob: {stats}")
    assert stats["replay_p99"] < stats["live_p99"]
    assert d_replay.mean() < d_live.mean()
