"""Where a run's policy comes from: a checkpoint directory, or the built-in starting policy (built once
for the whole run, whichever process on whichever machine needs it first: ``runtime.build_once``);
the trainer's copy computes its experts in ``policy.experts_precision``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import structlog

from actors.agent.dialect import Dialect, load_dialect
from actors.config import PolicySection
from actors.pretrained_policy import build_pretrained, ensure_pretrained, find_pretrained
from low_precision.experts import ExpertsPrecision, make_experts_fn
from model.checkpoint import load_checkpoint
from model.device import resolve_device
from model.transformer import MoETransformer
from runtime.actor import ActorContext
from runtime.build_once import build_once, share_build

log = structlog.get_logger(__name__)

__all__ = ["checkpoint_dir", "load_policy", "load_run_policy", "load_run_policy_and_dialect", "run_checkpoint_dir",
           "use_training_precision"]

_PRECISION = {"reference": ExpertsPrecision.REFERENCE, "emulated": ExpertsPrecision.EMULATED,
              "triton": ExpertsPrecision.TRITON}


def checkpoint_dir(section: PolicySection) -> Path:
    """The policy's checkpoint outside a run (benchmarks, scripts): built into ``cache_dir`` if missing."""
    if section.checkpoint:
        return Path(section.checkpoint)
    if section.pretrained:
        return ensure_pretrained(section.cache_dir, section.pretrained_recipe())
    from actors.training.starting_policy import ensure_starting_policy  # builds it on the first run only

    return ensure_starting_policy(section.cache_dir)


async def run_checkpoint_dir(ctx: ActorContext, section: PolicySection) -> Path:
    """The run's starting checkpoint for an actor: ``policy.checkpoint``; else ``policy.pretrained`` (from this
    machine's cache, else from the run's blob store, else built now once for the whole run); else the built-in
    starting policy from this machine (its cache, or the copy shipped with the code), else from the run's blob
    store, else built now, once for the whole run (the other processes wait for it)."""
    if section.checkpoint:
        return Path(section.checkpoint)
    cache = Path(section.cache_dir)
    if section.pretrained:
        pretrained = section.pretrained_recipe()
        return await _built_for_the_run(ctx, find_pretrained(cache, pretrained), pretrained.build_name(),
                                        lambda out: build_pretrained(out, pretrained, cache), cache)
    from actors.training.starting_policy import build_starting_policy, default_recipe, find_starting_policy

    recipe = default_recipe()
    found, name = find_starting_policy(cache, recipe)
    return await _built_for_the_run(ctx, found, name, lambda out: build_starting_policy(out, recipe), cache)


async def _built_for_the_run(ctx: ActorContext, found: Path | None, name: str, build: Callable[[Path], object],
                             cache: Path) -> Path:
    """``found`` (a build on this machine; one in ``cache`` is also stored for the other machines to fetch,
    under the build's lease: `runtime.build_once.share_build`), else the run's build ``name``, fetched or built
    once (`runtime.build_once`)."""
    if found is None:
        return await build_once(ctx.bus, ctx.blob, name, build, cache, owner=ctx.identity.actor_id)
    if found.parent == cache:  # built here before: other machines, and readers waiting for it, fetch it
        await share_build(ctx.bus, ctx.blob, name, found, owner=ctx.identity.actor_id)
    return found


async def load_run_policy(ctx: ActorContext, section: PolicySection, *, training: bool = False) -> MoETransformer:
    """`load_policy` of the run's starting checkpoint (`run_checkpoint_dir`), for an actor."""
    path = await run_checkpoint_dir(ctx, section)
    return await asyncio.to_thread(load_policy, section, training=training, path=path)


async def load_run_policy_and_dialect(ctx: ActorContext, section: PolicySection) -> tuple[MoETransformer, Dialect]:
    """The run's policy for generation (`load_run_policy`) and how episodes speak to it
    (`actors.agent.dialect.load_dialect`), both from the one starting checkpoint, found once."""
    path = await run_checkpoint_dir(ctx, section)
    model = await asyncio.to_thread(load_policy, section, path=path)
    return model, await asyncio.to_thread(load_dialect, path)


def load_policy(section: PolicySection, *, training: bool = False, path: Path | None = None) -> MoETransformer:
    """The policy at ``path`` (default: `checkpoint_dir`). Only the trainer's copy (``training``) computes
    its experts in ``policy.experts_precision``; rollout and evaluation decode with the plain model, as an
    inference engine would, and router replay carries the rollout's expert choices into the quantized forward."""
    path = path or checkpoint_dir(section)
    device = resolve_device(section.device)
    _, model = load_checkpoint(path)
    model = model.to(device)
    if training:
        use_training_precision(model, section)
    log.info("policy_loaded", path=str(path), training=training, device=str(device))
    return model


def use_training_precision(model: MoETransformer, section: PolicySection) -> MoETransformer:
    """Compute ``model``'s experts in ``policy.experts_precision`` (also for a trainer resumed from a checkpoint)."""
    if section.experts_precision != "reference":
        model.set_experts_fn(make_experts_fn(_PRECISION[section.experts_precision]))
    log.info("experts_precision_set", experts_precision=section.experts_precision)
    return model
