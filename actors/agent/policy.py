"""Where a run's policy comes from: a checkpoint directory, or the built-in starting policy (built once
and cached); the trainer's copy computes its experts in ``policy.experts_precision``."""

from __future__ import annotations

from pathlib import Path

import structlog

from actors.config import PolicySection
from kernels.experts import ExpertsPrecision, make_experts_fn
from model.checkpoint import load_checkpoint
from model.device import resolve_device
from model.transformer import MoETransformer

log = structlog.get_logger(__name__)

__all__ = ["checkpoint_dir", "load_policy", "use_training_precision", "weights_run_name"]

_PRECISION = {"reference": ExpertsPrecision.REFERENCE, "emulated": ExpertsPrecision.EMULATED,
              "triton": ExpertsPrecision.TRITON}


def checkpoint_dir(section: PolicySection) -> Path:
    if section.checkpoint:
        return Path(section.checkpoint)
    from actors.training.starting_policy import ensure_starting_policy  # builds it on the first run only

    return ensure_starting_policy(section.cache_dir)


def load_policy(section: PolicySection, *, training: bool = False) -> MoETransformer:
    """The run's policy. Only the trainer's copy (``training``) computes its experts in
    ``policy.experts_precision``; rollout and evaluation decode with the plain model, as an inference
    engine would, and router replay carries the rollout's expert choices into the quantized forward."""
    path = checkpoint_dir(section)
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


def weights_run_name(run_dir: Path) -> str:
    """The weight tree's run name: the run directory's name, unique per run and stable across resumes."""
    return Path(run_dir).name
