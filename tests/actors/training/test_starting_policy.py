"""The starting policy: SFT data from the train split, the cached builder, and the shipped checkpoint."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors import safe_open

import actors.training.starting_policy as sp
from actors.agent.episode import reference_episode_text
from model.checkpoint import load_checkpoint
from model.config import ModelConfig
from model.pretrain import PretrainConfig
from tests.sandbox_store import open_layer_store_or_skip

SMALL = ModelConfig(
    hidden_size=32,
    moe_intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    num_experts=2,
    num_experts_per_tok=1,
)


@pytest.fixture(scope="module")
def sandbox_ok() -> Iterator[None]:
    open_layer_store_or_skip().close()
    yield


def _micro(seed: int = 0) -> sp.StartingPolicyRecipe:
    return sp.StartingPolicyRecipe(
        seed=seed,
        num_train_tasks=4,
        num_eval_tasks=2,
        pretrain=PretrainConfig(num_steps=3, batch_size=2, warmup_steps=1),
        model=SMALL,
        eval_greedy=False,
    )


def test_sft_data_is_reference_episodes_of_the_train_split() -> None:
    recipe = sp.default_recipe()
    train, held = recipe.train_tasks(), recipe.eval_tasks()
    assert len(train) > len(held) > 0
    assert not {t.id for t in train} & {t.id for t in held}
    assert {t.difficulty for t in train} == set(recipe.difficulties)
    assert {t.difficulty for t in held} == {1, 2, 3, 4}  # evaluated on every held-out task
    examples = sp.sft_examples(train[:3])
    assert examples == [reference_episode_text(t) for t in train[:3]]
    assert [flag for _, flag in examples[0]] == [False, True, False, True]


def test_recipe_hash_is_stable_and_names_the_recipe() -> None:
    assert sp.default_recipe().recipe_hash() == sp.default_recipe().recipe_hash()
    assert sp.default_recipe(seed=1).recipe_hash() != sp.default_recipe().recipe_hash()
    assert sp.default_recipe(num_steps=7).recipe_hash() != sp.default_recipe().recipe_hash()
    assert sp.default_recipe(num_steps=7).pretrain.num_steps == 7


def test_recipe_validation() -> None:
    with pytest.raises(ValueError, match="difficulties"):
        sp.StartingPolicyRecipe(difficulties=())
    with pytest.raises(ValueError, match="num_train_tasks"):
        sp.StartingPolicyRecipe(num_train_tasks=0)


def test_ensure_builds_once_then_uses_the_cache(
    tmp_path: Path, sandbox_ok: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = _micro()
    path = sp.ensure_starting_policy(tmp_path, recipe, shipped_dir=None)
    card = sp.StartingPolicyCard.read(path)
    assert card.recipe_hash == recipe.recipe_hash() and card.seed == 0
    assert card.num_steps == 3 and card.num_train_examples == 4
    assert card.heldout_sampled["num_tasks"] == 2 and card.heldout_greedy is None
    assert 0.0 <= card.heldout_pass_at_1 <= 1.0 and card.build_s > 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype.is_floating_point
        assert str(f.get_tensor("model.norm.weight").dtype) == "torch.bfloat16"
    config, _ = load_checkpoint(path)
    assert config == SMALL
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".building-")]

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("rebuilt although the cache matches")

    monkeypatch.setattr(sp, "build_starting_policy", no_build)
    assert sp.ensure_starting_policy(tmp_path, recipe, shipped_dir=None) == path


def test_ensure_rebuilds_on_a_stale_card_and_prefers_a_matching_shipped_copy(tmp_path: Path, sandbox_ok: None) -> None:
    recipe = _micro(seed=5)
    built = sp.ensure_starting_policy(tmp_path / "cache", recipe, shipped_dir=None)
    shipped = tmp_path / "shipped"
    shutil.copytree(built, shipped)
    assert sp.ensure_starting_policy(tmp_path / "empty", recipe, shipped_dir=shipped) == shipped

    card = json.loads((built / sp.CARD_NAME).read_text())
    card["recipe_hash"] = "0" * 64
    (built / sp.CARD_NAME).write_text(json.dumps(card))
    again = sp.ensure_starting_policy(tmp_path / "cache", recipe, shipped_dir=None)
    assert again == built and sp.StartingPolicyCard.read(again).recipe_hash == recipe.recipe_hash()


def test_builds_are_deterministic(tmp_path: Path, sandbox_ok: None) -> None:
    recipe = dataclasses.replace(_micro(seed=2), num_eval_tasks=1)
    a = sp.build_starting_policy(tmp_path / "a", recipe)
    b = sp.build_starting_policy(tmp_path / "b", recipe)
    assert a.final_loss == b.final_loss and a.heldout_sampled["pass_at_1"] == b.heldout_sampled["pass_at_1"]
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


@pytest.mark.skipif(not (sp.SHIPPED_DIR / sp.CARD_NAME).exists(), reason="no starting policy shipped")
def test_shipped_checkpoint_matches_the_default_recipe() -> None:
    """A stale shipped checkpoint would make every run rebuild it: rebuild and re-ship after recipe changes
    (python -m actors.training.starting_policy --out actors/training/assets/starting_policy)."""
    card = sp.StartingPolicyCard.read(sp.SHIPPED_DIR)
    assert card.recipe_hash == sp.default_recipe().recipe_hash()
    assert 0.15 <= card.heldout_pass_at_1 <= 0.40
