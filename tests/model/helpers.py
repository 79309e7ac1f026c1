"""Shared fixtures-as-functions for the model tests: small configs and seeded models."""

from __future__ import annotations

import asyncio

import torch

from model.config import ModelConfig
from model.engine import EngineConfig, GenerationEngine, SamplingParams
from model.generation import Generation
from model.transformer import MoETransformer


def small_config(**overrides: object) -> ModelConfig:
    """A fast config with peaked logits (larger init) so greedy decoding has clear winners."""
    base: dict[str, object] = dict(
        vocab_size=96,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=6,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


def seeded_model(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> MoETransformer:
    return MoETransformer(config).init_weights(seed).to(dtype).eval()


def random_prompts(num: int, vocab: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (num,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


def hf_dense_model(kind: str, seed: int, **overrides: object):
    """A transformers LlamaForCausalLM ("llama") or Qwen3ForCausalLM ("qwen3") at random init, small sizes."""
    import transformers

    torch.manual_seed(seed)
    fields: dict[str, object] = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     max_position_embeddings=256, initializer_range=0.05)
    fields.update(overrides)
    if fields.get("head_dim") is None:
        fields.pop("head_dim")
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields)).eval()


def hf_greedy(hf: torch.nn.Module, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, exactly ``num_new`` tokens long."""
    out = []
    for p in prompts:
        with torch.no_grad():
            seq = hf.generate(torch.tensor([p]), max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False)
        out.append(seq[0, len(p):].tolist())
    return out


def engine_greedy(model: MoETransformer, prompts: list[list[int]], num_new: int) -> list[Generation]:
    """The engine's greedy generations of ``prompts`` side by side (prefill, then batched one-token decode)."""

    async def run() -> list[Generation]:
        engine = GenerationEngine(model, EngineConfig(max_batch_size=4))
        await engine.start()
        try:
            params = SamplingParams(max_new_tokens=num_new, temperature=0.0)
            return list(await asyncio.gather(*(engine.generate(p, params) for p in prompts)))
        finally:
            await engine.stop()

    return asyncio.run(run())
