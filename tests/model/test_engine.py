"""Generation engine: KV cache vs full recompute, batch independence, router capture, stops, lifecycle."""

from __future__ import annotations

import asyncio

import pytest
import torch

from model.attention import AttentionBatch
from model.engine import EngineConfig, EngineStatus, FinishReason, GenerationEngine, SamplingParams
from model.errors import CheckpointError, EngineError, EngineStateError
from model.kv_cache import KVCache
from model.tokenizer import ByteTokenizer
from tests.model.helpers import random_prompts, seeded_model, small_config

CONFIG = small_config(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2)


def reference_logprobs(model, prompt, completion, temperature=1.0, top_p=1.0):
    """Hand-written: one full forward over prompt + completion, softmax(logits / T), nucleus by hand.

    Each token must lie in its nucleus; its recorded log-prob is that of softmax(logits / T) before the
    nucleus truncation (model.sampling's rule: the trainer scores it at the same T).
    """
    full = torch.tensor(list(prompt) + list(completion))
    with torch.no_grad():
        out = model(full[:-1])
    logits = out.logits[len(prompt) - 1 :].double() / temperature
    rows = []
    for row, token in zip(logits, completion, strict=True):
        probs = torch.softmax(row, -1)
        order = sorted(range(len(probs)), key=lambda i: -float(probs[i]))
        kept, mass = [], 0.0
        for i in order:
            kept.append(i)
            mass += float(probs[i])
            if mass >= top_p:
                break
        assert token in kept
        rows.append(float(torch.log(probs[token])))
    return torch.tensor(rows, dtype=torch.float64), out.topk_ids_TLK


async def _generate_all(model, prompts, params_list, config=None, **kw):
    engine = GenerationEngine(model, config or EngineConfig(max_batch_size=8), **kw)
    await engine.start()
    try:
        return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params_list, strict=True)))
    finally:
        await engine.stop()


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_kv_cache_generation_equals_full_recompute(temperature: float, top_p: float) -> None:
    model = seeded_model(CONFIG, seed=1)
    prompts = random_prompts(10, CONFIG.vocab_size, 1, 30, seed=4)
    params = [SamplingParams(max_new_tokens=25, temperature=temperature, top_p=top_p, seed=i) for i in range(10)]
    gens = asyncio.run(_generate_all(model, prompts, params, EngineConfig(max_batch_size=4)))
    for prompt, gen in zip(prompts, gens, strict=True):
        assert gen.prompt_ids == tuple(prompt) and len(gen.token_ids) == 25
        ref, ref_topk = reference_logprobs(model, prompt, gen.token_ids, temperature or 1.0, top_p)
        got = torch.tensor(gen.logprobs, dtype=torch.float64)
        assert torch.allclose(got, ref, atol=1e-5, rtol=0), float((got - ref).abs().max())
        # router capture: every fed position equals the full forward's router choices; last never fed
        assert torch.equal(gen.topk_ids_TLK[:-1].long(), ref_topk)
        assert (gen.topk_ids_TLK[-1] == -1).all()
        assert gen.versions == (0,) * 25 and gen.finish_reason is FinishReason.LENGTH


def test_equal_prompts_prefill_together_and_decode_unmasked_as_full_recompute() -> None:
    """Equal-length prompts share one cache write and one attention call per layer, and their equal-length
    decode steps attend without a mask: the numbers must still be each sequence's own full forward."""
    model = seeded_model(CONFIG, seed=6)
    prompts = random_prompts(5, CONFIG.vocab_size, 11, 11, seed=9)
    params = [SamplingParams(max_new_tokens=12, temperature=0.8, seed=i) for i in range(5)]
    gens = asyncio.run(_generate_all(model, prompts, params))
    for prompt, gen in zip(prompts, gens, strict=True):
        ref, ref_topk = reference_logprobs(model, prompt, gen.token_ids, 0.8)
        assert torch.allclose(torch.tensor(gen.logprobs, dtype=torch.float64), ref, atol=1e-5, rtol=0)
        assert torch.equal(gen.topk_ids_TLK[:-1].long(), ref_topk)


def test_greedy_tokens_are_argmax_of_full_forward() -> None:
    model = seeded_model(CONFIG, seed=2)
    prompt = random_prompts(1, CONFIG.vocab_size, 9, 9, seed=5)[0]
    (gen,) = asyncio.run(_generate_all(model, [prompt], [SamplingParams(max_new_tokens=20, temperature=0)]))
    seq = list(prompt)
    for _ in range(20):
        with torch.no_grad():
            seq.append(int(model(torch.tensor(seq)).logits[-1].argmax()))
    assert list(gen.token_ids) == seq[len(prompt) :]


def test_output_independent_of_batch_companions() -> None:
    model = seeded_model(CONFIG, seed=3)
    target = random_prompts(1, CONFIG.vocab_size, 12, 12, seed=6)[0]
    params = SamplingParams(max_new_tokens=30, seed=123)
    (alone,) = asyncio.run(_generate_all(model, [target], [params], EngineConfig(max_batch_size=1)))
    others = random_prompts(9, CONFIG.vocab_size, 1, 40, seed=7)
    other_params = [SamplingParams(max_new_tokens=n, seed=i) for i, n in enumerate(range(3, 39, 4))]
    crowd = asyncio.run(
        _generate_all(model, [*others[:4], target, *others[4:]], [*other_params[:4], params, *other_params[4:]])
    )
    together = crowd[4]
    assert together.token_ids == alone.token_ids
    assert torch.allclose(torch.tensor(together.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
    assert torch.equal(together.topk_ids_TLK, alone.topk_ids_TLK)


def test_continuous_batching_serves_more_requests_than_slots() -> None:
    model = seeded_model(CONFIG, seed=4)
    prompts = random_prompts(13, CONFIG.vocab_size, 2, 20, seed=8)
    params = [SamplingParams(max_new_tokens=2 + 3 * i, seed=i) for i in range(13)]
    gens = asyncio.run(_generate_all(model, prompts, params, EngineConfig(max_batch_size=3, max_prefill_tokens=8)))
    assert [len(g.token_ids) for g in gens] == [2 + 3 * i for i in range(13)]
    for prompt, gen in zip(prompts, gens, strict=True):
        ref, _ = reference_logprobs(model, prompt, gen.token_ids)
        assert torch.allclose(torch.tensor(gen.logprobs, dtype=torch.float64), ref, atol=1e-5, rtol=0)


def test_same_seed_same_output_different_seed_differs() -> None:
    model = seeded_model(CONFIG, seed=5)
    prompt = random_prompts(1, CONFIG.vocab_size, 5, 5, seed=9)[0]
    params = [SamplingParams(max_new_tokens=30, seed=s) for s in (1, 1, 2)]
    a, b, c = asyncio.run(_generate_all(model, [prompt] * 3, params))
    assert a.token_ids == b.token_ids
    assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert a.token_ids != c.token_ids


def test_stop_token_stop_string_and_context_limit() -> None:
    tok = ByteTokenizer()
    config = small_config(vocab_size=tok.vocab_size, max_position_embeddings=64)
    model = seeded_model(config, seed=6)
    prompt = tok.encode("<|user|>hi<|end|><|assistant|>")
    (free,) = asyncio.run(_generate_all(model, [prompt], [SamplingParams(max_new_tokens=40, seed=0)]))
    stop_tok = free.token_ids[5]
    first = free.token_ids.index(stop_tok)
    text = tok.decode(free.token_ids)
    stop_str = text[len(tok.decode(free.token_ids[:10])) :][:2]
    runs = [
        SamplingParams(max_new_tokens=40, seed=0, stop_token_ids=(stop_tok,)),
        SamplingParams(max_new_tokens=40, seed=0, stop_strings=(stop_str,)),
        SamplingParams(max_new_tokens=500, seed=0),
    ]
    by_tok, by_str, ctx = asyncio.run(_generate_all(model, [prompt] * 3, runs, detokenize=tok.decode))
    assert by_tok.finish_reason is FinishReason.STOP_TOKEN and by_tok.token_ids == free.token_ids[: first + 1]
    assert by_str.finish_reason is FinishReason.STOP_STRING and stop_str in tok.decode(by_str.token_ids)
    assert stop_str not in tok.decode(by_str.token_ids[:-1])
    assert ctx.finish_reason is FinishReason.CONTEXT and len(prompt) + len(ctx.token_ids) == 64


def test_lifecycle_and_validation() -> None:
    model = seeded_model(CONFIG)

    async def run() -> None:
        engine = GenerationEngine(model)
        with pytest.raises(EngineStateError, match="created"):
            await engine.generate([1, 2])
        await engine.start()
        with pytest.raises(EngineStateError):
            await engine.start()
        with pytest.raises(ValueError, match="stop_strings"):
            await engine.generate([1], SamplingParams(stop_strings=("x",)))
        with pytest.raises(ValueError, match="token ids"):
            await engine.generate([CONFIG.vocab_size])
        with pytest.raises(ValueError, match="not newer"):
            await engine.update_weights(model.state_dict(), version=0)
        bad = dict(model.state_dict(), **{"lm_head.weight": torch.zeros(3, 3)})
        with pytest.raises(CheckpointError, match="lm_head"):
            await engine.update_weights(bad, version=1)
        assert engine.status is EngineStatus.RUNNING
        # a cancelled caller leaves the engine serving the others
        slow = asyncio.create_task(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=200)))
        await asyncio.sleep(0.01)
        slow.cancel()
        gen = await engine.generate([4, 5], SamplingParams(max_new_tokens=3))
        assert len(gen.token_ids) == 3
        with pytest.raises(asyncio.CancelledError):
            await slow
        pending = asyncio.create_task(engine.generate([1], SamplingParams(max_new_tokens=10_000)))
        await asyncio.sleep(0.01)
        await engine.stop()
        await engine.stop()
        assert engine.status is EngineStatus.STOPPED
        with pytest.raises(EngineStateError):
            await pending

    asyncio.run(run())


def test_cached_multi_token_continuation_matches_full_forward() -> None:
    """A chunk of several tokens after a cached prefix (past > 0, n > 1) attends correctly."""
    model = seeded_model(CONFIG, seed=8)
    ids = torch.tensor(random_prompts(1, CONFIG.vocab_size, 12, 12, seed=10)[0])
    cache = KVCache(
        num_layers=CONFIG.num_hidden_layers,
        num_slots=3,
        num_kv_heads=CONFIG.num_key_value_heads,
        head_dim=CONFIG.head_dim,
        max_len=64,
        dtype=torch.float32,
        initial_capacity=4,  # forces growth
    )
    with torch.no_grad():
        full = model(ids).logits
        slot = 2
        a = model(ids[:5], batch=AttentionBatch.cached(cache, [slot], [0], [5])).logits
        b = model(ids[5:9], batch=AttentionBatch.cached(cache, [slot], [5], [4])).logits
        c = model(ids[9:10], batch=AttentionBatch.cached(cache, [slot], [9], [1])).logits
    got = torch.cat([a, b, c])
    assert torch.allclose(got, full[:10], atol=1e-5, rtol=0)
    assert cache.capacity >= 10


def test_bf16_engine_matches_bf16_full_forward() -> None:
    model = seeded_model(CONFIG, seed=9, dtype=torch.bfloat16)
    prompts = random_prompts(3, CONFIG.vocab_size, 4, 12, seed=11)
    params = [SamplingParams(max_new_tokens=12, seed=i) for i in range(3)]
    gens = asyncio.run(_generate_all(model, prompts, params))
    for prompt, gen in zip(prompts, gens, strict=True):
        ref, _ = reference_logprobs(model, prompt, gen.token_ids)
        # bf16 KV-cache and full forwards round differently; they must still agree to bf16 precision
        assert (torch.tensor(gen.logprobs, dtype=torch.float64) - ref).abs().max() < 0.1


def test_update_weights_before_start_applies_immediately() -> None:
    v1, v2 = seeded_model(CONFIG, seed=1), seeded_model(CONFIG, seed=2)

    async def run() -> None:
        engine = GenerationEngine(v1, version=3)
        await engine.update_weights(v2.state_dict(), version=4)
        assert engine.version == 4
        assert torch.equal(engine.model.lm_head.weight, v2.lm_head.weight)

    asyncio.run(run())


def test_duplicate_update_is_refused_while_the_first_is_being_applied() -> None:
    """The engine, not its callers, guarantees a version is applied once (even mid-apply in the worker)."""
    import threading

    v1, v2 = seeded_model(CONFIG, seed=1), seeded_model(CONFIG, seed=2)
    engine = GenerationEngine(v1, version=1)
    applying, release = threading.Event(), threading.Event()
    applied: list[int] = []
    apply = engine._core.apply_update

    def slow_apply(state, version, policy) -> None:  # runs in the engine's worker thread
        applying.set()
        release.wait(timeout=10)
        applied.append(version)
        apply(state, version, policy)

    engine._core.apply_update = slow_apply

    async def run() -> None:
        await engine.start()
        try:
            first = asyncio.create_task(engine.update_weights(v2.state_dict(), version=2))
            await asyncio.to_thread(applying.wait, 10)  # taken from the inbox, not applied yet
            assert engine.version == 1
            with pytest.raises(ValueError, match="not newer"):
                await engine.update_weights(v2.state_dict(), version=2)
            with pytest.raises(ValueError, match="newest accepted 2"):
                await engine.update_weights(v2.state_dict(), version=1)
            release.set()
            await first
            assert engine.version == 2 and applied == [2]
            await engine.update_weights(v1.state_dict(), version=3)  # a newer one still goes through
            assert engine.version == 3 and applied == [2, 3]
        finally:
            release.set()
            await engine.stop()

    asyncio.run(run())


def test_check_alive_waits_for_a_step_when_busy_decodes_when_idle_and_fails_with_the_engine() -> None:
    model = seeded_model(CONFIG, seed=4)

    async def scenario() -> None:
        engine = GenerationEngine(model, EngineConfig(max_batch_size=2))
        await engine.start()
        try:
            steps = engine.stats().num_steps
            await engine.check_alive([1, 2, 3])  # idle: one token decoded, one step
            assert engine.stats().num_steps == steps + 1
            # busy, with more requests than slots: answered at the end of a step, not behind the queue
            work = [asyncio.ensure_future(engine.generate([5, 6, 7], SamplingParams(max_new_tokens=40, seed=i)))
                    for i in range(4)]
            await asyncio.sleep(0)
            before = engine.stats().num_steps
            await engine.check_alive([1, 2, 3])
            assert engine.stats().num_steps <= before + 2, "the step in progress, or the next one"
            assert not any(w.done() for w in work), "answered long before the queue behind it drained"
            await asyncio.gather(*work)

            def broken_step(*args: object) -> list:
                raise RuntimeError("device lost")

            engine._step = broken_step  # type: ignore[method-assign]
            failing = asyncio.ensure_future(engine.generate([5, 6], SamplingParams(max_new_tokens=4)))
            await asyncio.sleep(0)
            with pytest.raises(EngineError, match="failed"):
                await engine.check_alive([1, 2, 3])
            with pytest.raises(EngineError):
                await failing
        finally:
            await engine.stop()

    asyncio.run(scenario())
