"""policy.device on a GPU: the rollout engine, the evaluator's engine and the learner put the model, the
KV cache and every batch on CUDA, and compute what the CPU computes (to fp32 rounding). Skipped without
CUDA; written to run unchanged where one exists (``python -m pytest tests/gpu``)."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest
import torch

from actors.agent.policy import load_policy
from actors.config import PolicySection, TrainerSection
from actors.training.learner import Learner
from model.checkpoint import save_checkpoint
from model.engine import EngineConfig, GenerationEngine, SamplingParams
from tests.actors.training.test_learner import _group
from tests.model.helpers import random_prompts, seeded_model, small_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU = torch.device("cuda")


@pytest.fixture(autouse=True)
def exact_fp32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # the comparisons below are against fp32 CPU results
    torch.backends.cudnn.allow_tf32 = False


def test_load_policy_places_the_model_on_the_device_it_is_given(tmp_path: Path) -> None:
    save_checkpoint(seeded_model(small_config(), seed=1), tmp_path / "ckpt")
    for spec, expected in (("auto", "cuda"), ("cuda", "cuda"), ("cuda:0", "cuda"), ("cpu", "cpu")):
        model = load_policy(PolicySection(checkpoint=str(tmp_path / "ckpt"), device=spec), training=True)
        assert {p.device.type for p in model.parameters()} == {expected}, spec


def test_the_engine_generates_on_the_gpu_what_the_cpu_scores() -> None:
    cpu_model = seeded_model(small_config(), seed=3)
    gpu_model = copy.deepcopy(cpu_model).to(GPU)  # the engine's KV cache follows the model's device
    prompts = random_prompts(6, cpu_model.config.vocab_size, 3, 20, seed=2)

    async def generate() -> list:
        engine = GenerationEngine(gpu_model, EngineConfig(max_batch_size=4))
        await engine.start()
        try:
            params = [SamplingParams(max_new_tokens=16, temperature=1.0, seed=i) for i in range(len(prompts))]
            return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params, strict=True)))
        finally:
            await engine.stop()

    for prompt, gen in zip(prompts, asyncio.run(generate()), strict=True):
        ids = torch.tensor([*prompt, *gen.token_ids])
        with torch.no_grad():
            logits = cpu_model(ids).logits[len(prompt) - 1:-1]
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(gen.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(gen.logprobs), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("replay", [True, False])
def test_a_learner_step_on_the_gpu_matches_the_cpu(replay: bool) -> None:
    model = seeded_model(small_config(), seed=1)
    groups = [_group(model, [1.0, 0.0, 0.5, 0.0], seed=2), _group(model, [0.0, 1.0, 1.0], seed=5)]
    config = TrainerSection(lr=1e-3, router_replay=replay)
    on_cpu = Learner(copy.deepcopy(model).train(), config)
    on_gpu = Learner(copy.deepcopy(model).to(GPU).train(), config)
    m_cpu, m_gpu = on_cpu.step(groups, "b0"), on_gpu.step(groups, "b0")
    assert m_gpu.skipped == "" and m_gpu.num_trained_tokens == m_cpu.num_trained_tokens
    assert abs(m_gpu.loss - m_cpu.loss) <= 1e-5 * max(abs(m_cpu.loss), 1e-3)
    for (name, p_cpu), p_gpu in zip(on_cpu.model.named_parameters(), on_gpu.model.parameters(), strict=True):
        assert p_gpu.device.type == "cuda"
        g_cpu, g_gpu = p_cpu.grad, p_gpu.grad.cpu()
        assert torch.allclose(g_gpu, g_cpu, atol=1e-4 * float(g_cpu.abs().max()) + 1e-12, rtol=0), name


def test_a_learner_saved_on_the_gpu_resumes_on_the_gpu(tmp_path: Path) -> None:
    model = seeded_model(small_config(), seed=1)
    learner = Learner(copy.deepcopy(model).to(GPU).train(), TrainerSection(lr=1e-3))
    learner.step([_group(model, [1.0, 0.0, 0.5], seed=4)], "b0")
    resumed = Learner.load(learner.save(tmp_path), TrainerSection(lr=1e-3), device=GPU)
    assert {p.device.type for p in resumed.model.parameters()} == {"cuda"}
    assert {s["exp_avg"].device.type for s in resumed.optimizer.state.values()} == {"cuda"}
    m = resumed.step([_group(model, [0.0, 1.0], seed=6)], "b1")
    assert m.skipped == "" and m.version == 2
