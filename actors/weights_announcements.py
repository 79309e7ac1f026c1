"""The trainer's weights announcements: the run name its weight tree is under, the subject each published
version is announced on, and whether an announcement names a version the store holds.

Apart from their follower (`actors.agent.weights_follower`, which loads versions into an engine) and the
policy's loading (`actors.agent.policy`), both of which need torch: the reconciler follows the trainer's
version from these announcements and runs no model, and imports none (its replacement must start within
its lease).
"""

from __future__ import annotations

from actors.messages import WeightsPublished
from model.weight_sync import BlobStoreLike, Manifest, WeightSyncError
from model.weight_sync.manifest import parse_key, run_prefix
from runtime.actor import ActorContext
from runtime.errors import ConfigError

__all__ = ["weights_run_name", "weights_subject", "why_not_published"]


def weights_run_name(ctx: ActorContext) -> str:
    """The weight tree's run name: the run's id, unique per run and the same on every machine and resume.

    Raises:
        ConfigError: the actor's context names no run (an actor built outside runtime.actor_process).
    """
    if not ctx.run_id:
        raise ConfigError("the actor's context has no run id: start it through runtime.actor_process")
    return ctx.run_id


def weights_subject(run: str) -> str:
    """The subject on which the trainer announces each published version of ``run``."""
    return f"weights.{run}"


async def why_not_published(msg: WeightsPublished, *, run: str, store: BlobStoreLike,
                            key_prefix: str = "weights") -> str | None:
    """Why announcement `msg` is not a version the store holds for `run` (None: it is). Anyone acting on
    ``weights.<run>`` (followers, the reconciler's trainer version) checks this first."""
    if msg.run != run:
        return f"run {msg.run!r} is not this run {run!r}"
    parsed = parse_key(msg.key)
    prefix = run_prefix(key_prefix, run)
    if parsed is None or not parsed.is_manifest or parsed.version != msg.version or not msg.key.startswith(prefix):
        return f"key {msg.key!r} is not a manifest of version {msg.version} under {prefix!r}"
    try:
        manifest = Manifest.from_json(await store.get(msg.key), where=msg.key)
    except KeyError:
        return f"version {msg.version} is not in the store (no manifest at {msg.key!r})"
    except (OSError, WeightSyncError) as e:
        return f"manifest {msg.key!r} unreadable: {e}"
    if (manifest.run, manifest.version) != (run, msg.version):
        return f"manifest {msg.key!r} is of run {manifest.run!r} version {manifest.version}"
    return None
