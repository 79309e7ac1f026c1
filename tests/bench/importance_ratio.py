"""Benchmark: the trainer's importance ratio on-policy, on real generations of the shipped starting policy.

The generation engine (KV cache, continuous batching) decodes the first 16 training prompts at each
(temperature, top-p); the trainer's packed forward then scores every sampled token, once at the
temperature the rollout recorded (what the learner does) and once at temperature 1 (what the trainer
did before it recorded temperatures). On-policy the first ratio is 1 up to the fp32 rounding of the
KV-cache forward against the packed one (~1e-5); the second is what a run at that temperature trained
with before. Prints ONE JSON line: ratio mean / median / min / max / clipped fraction per setting.

    .venv/bin/python -m tests.bench.importance_ratio                  # ~1 minute on 2 cores
    .venv/bin/python -m tests.bench.importance_ratio --prompts 64 --new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from actors.agent.episode import task_prompt_text
from actors.agent.policy import checkpoint_dir
from actors.config import PolicySection, TasksSection
from actors.task_catalog import TaskCatalog
from model._engine_core import EngineCore
from model.checkpoint import load_checkpoint
from model.generation import EngineConfig, Generation
from model.loss import PolicyLossConfig, PolicyLossMetrics, packed_logprobs, policy_loss
from model.packing import pack_sequences
from model.sampling import SamplingParams
from model.tokenizer import ByteTokenizer
from model.transformer import MoETransformer

SETTINGS = ((0.8, 1.0), (0.8, 0.9), (1.0, 1.0), (1.3, 0.9))


def _generate(model: MoETransformer, prompts: list[list[int]], params: list[SamplingParams]) -> list[Generation]:
    engine = EngineCore(model, EngineConfig(max_batch_size=len(prompts)), version=0, detokenize=None)
    for p, sp in zip(prompts, params, strict=True):
        engine.add(engine.make_request(p, sp))
    return [g for _, g in sorted(engine.run_until_done())]


def _ratios(model: MoETransformer, gens: list[Generation], at_recorded_temperature: bool) -> PolicyLossMetrics:
    batch = pack_sequences([list(g.prompt_ids) + list(g.token_ids) for g in gens])
    temps: list[float] = []
    behaviour: list[float] = []
    mask: list[bool] = []
    for g in gens:
        num_prompt = len(g.prompt_ids)
        temps += [1.0] * (num_prompt - 1) + [g.logprob_temperature] * len(g.token_ids) + [1.0]
        behaviour += [0.0] * (num_prompt - 1) + list(g.logprobs) + [0.0]
        mask += [False] * (num_prompt - 1) + [True] * len(g.token_ids) + [False]
    with torch.no_grad():
        logp, _ = packed_logprobs(model, batch, temperatures_T=torch.tensor(temps) if at_recorded_temperature else None)
    ones = torch.ones(len(mask))
    return policy_loss(logp, torch.tensor(behaviour), ones, torch.tensor(mask), PolicyLossConfig())[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _, model = load_checkpoint(checkpoint_dir(PolicySection()))
    model.eval()
    tokenizer = ByteTokenizer()
    catalog = TaskCatalog.build(TasksSection())
    prompts = [tokenizer.encode(task_prompt_text(catalog.task(catalog.prompt_id(i)))) for i in range(args.prompts)]
    started = time.perf_counter()
    rows = []
    for temperature, top_p in SETTINGS:
        params = [SamplingParams(max_new_tokens=args.new_tokens, temperature=temperature, top_p=top_p, seed=i)
                  for i in range(len(prompts))]
        gens = _generate(model, prompts, params)
        for scored_at, at_recorded in (("recorded", True), ("one", False)):
            m = _ratios(model, gens, at_recorded)
            rows.append({"temperature": temperature, "top_p": top_p, "scored_at_temperature": scored_at,
                         "num_tokens": m.num_tokens, "ratio_mean": m.ratio_mean, "ratio_median": m.ratio_median,
                         "ratio_min": m.ratio_min, "ratio_max": m.ratio_max, "clip_fraction": m.clip_fraction})
    wall_s = round(time.perf_counter() - started, 1)
    print(json.dumps({"bench": "importance_ratio", "settings": rows, "wall_s": wall_s}))


if __name__ == "__main__":
    main()
