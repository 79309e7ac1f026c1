"""Only the trainer's copy of the policy computes its experts in the configured low precision."""

from __future__ import annotations

from pathlib import Path

from actors.agent.policy import load_policy, use_training_precision
from actors.config import PolicySection
from model.checkpoint import save_checkpoint
from model.experts import reference_experts_forward
from tests.model.helpers import seeded_model, small_config


def _experts_fns(model) -> set:
    return {layer.mlp.experts_fn for layer in model.model.layers}


def test_rollout_and_evaluation_decode_with_the_plain_experts(tmp_path: Path) -> None:
    save_checkpoint(seeded_model(small_config()), tmp_path / "ckpt")
    section = PolicySection(checkpoint=str(tmp_path / "ckpt"), experts_precision="emulated")
    assert _experts_fns(load_policy(section)) == {reference_experts_forward}
    trained = _experts_fns(load_policy(section, training=True))
    assert len(trained) == 1 and trained != {reference_experts_forward}


def test_a_resumed_trainer_gets_the_configured_precision_back(tmp_path: Path) -> None:
    model = seeded_model(small_config())
    use_training_precision(model, PolicySection(experts_precision="reference"))
    assert _experts_fns(model) == {reference_experts_forward}
    use_training_precision(model, PolicySection(experts_precision="emulated"))
    assert _experts_fns(model) != {reference_experts_forward}
