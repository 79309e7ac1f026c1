"""Partial tables merge over their field's default; every numeric key has a range, checked at load and live."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest
from structlog.testing import capture_logs

from actors.config import RLConfig
from runtime import config
from runtime.actor import Actor, ActorContext, ActorIdentity, ActorSettings
from runtime.errors import ConfigError
from runtime.run_config import ActorSpec, RuntimeConfig, dump_toml, load_run_config

REPO = Path(__file__).resolve().parents[2]
DEFAULT_RUN = REPO / "actors" / "run.toml"


# --- partial tables ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Inner:
    a: int = config.fixed(1, within=config.Range(0, 100))
    b: int = config.fixed(2, within=config.Range(0, 100))


@dataclass(frozen=True)
class Middle:
    inner: Inner = field(default_factory=lambda: Inner(a=10, b=20))  # a field default that is not the class's
    c: float = config.fixed(0.5, within=config.Range(0.0, 1.0))


@dataclass(frozen=True)
class Outer:
    middle: Middle = field(default_factory=lambda: Middle(inner=Inner(a=30, b=40), c=0.25))


@pytest.mark.parametrize(("overrides", "expected"), [
    ([], Middle(Inner(30, 40), 0.25)),
    (["middle.c=0.75"], Middle(Inner(30, 40), 0.75)),
    (["middle.inner.a=31"], Middle(Inner(31, 40), 0.25)),
    (["middle.inner.b=41", "middle.c=0.5"], Middle(Inner(30, 41), 0.5)),
])
def test_a_partial_table_merges_over_its_fields_default_at_every_depth(overrides: list[str], expected: Middle) -> None:
    assert config.load(Outer, [], overrides).middle == expected


def test_a_partial_table_in_a_file_merges_over_its_fields_default(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text("[middle.inner]\nb = 42\n")
    assert config.load(Outer, [f]).middle == Middle(Inner(30, 42), 0.25)


@pytest.mark.parametrize("override", [
    "reconciler.scheduling.eta=2",  # its default: it must change nothing
    "reconciler.scheduling.max_retries=3",
])
def test_setting_one_scheduling_key_keeps_the_sections_inflight_default(override: str) -> None:
    default = load_run_config([DEFAULT_RUN]).app.reconciler.scheduling
    changed = load_run_config([DEFAULT_RUN], [override]).app.reconciler.scheduling
    assert default.max_inflight_per_rollout_actor == changed.max_inflight_per_rollout_actor == 64
    key, value = config.parse_override(override)
    assert dataclasses.replace(default, **{key.rsplit(".", 1)[1]: value}) == changed


def test_every_nested_table_given_empty_is_its_fields_default(tmp_path: Path) -> None:
    """Each nested table of the real schemas, given as an empty table, resolves to exactly its default."""
    paths = {schema: _table_paths(schema) for schema in (RLConfig, RuntimeConfig)}
    assert "reconciler.scheduling" in paths[RLConfig] and "rollout.agent" in paths[RLConfig]
    for schema, tables in paths.items():
        for path in tables:
            f = tmp_path / "partial.toml"
            f.write_text(f"[{path}]\n")
            assert config.to_dict(config.load(schema, [f])) == config.to_dict(schema()), path


def _table_paths(schema: type, prefix: str = "") -> list[str]:
    paths = []
    for f in dataclasses.fields(schema):
        hint = typing.get_type_hints(schema)[f.name]
        if dataclasses.is_dataclass(hint):
            paths.append(prefix + f.name)
            paths += _table_paths(hint, f"{prefix}{f.name}.")  # type: ignore[arg-type]
    return paths


# --- ranges ---------------------------------------------------------------------------------------
def _numeric(hint: Any) -> bool:
    if typing.get_origin(hint) in (typing.Union, types.UnionType, tuple, list):
        return any(_numeric(a) for a in typing.get_args(hint) if a is not type(None) and a is not Ellipsis)
    return hint in (int, float)


def _leaves(schema: type, prefix: str = "") -> list[tuple[str, dataclasses.Field[Any], Any]]:
    out = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += _leaves(hint, f"{prefix}{f.name}.")  # type: ignore[arg-type]
        elif typing.get_origin(hint) is dict and dataclasses.is_dataclass(typing.get_args(hint)[1]):
            out += _leaves(typing.get_args(hint)[1], f"{prefix}{f.name}.<name>.")
        else:
            out.append((prefix + f.name, f, hint))
    return out


ALL_LEAVES = _leaves(RLConfig) + _leaves(RuntimeConfig)


def test_every_numeric_key_declares_its_range() -> None:
    numeric = [(key, f) for key, f, hint in ALL_LEAVES if _numeric(hint)]
    assert len(numeric) > 60
    missing = [key for key, f in numeric if f.metadata.get("range") is None]
    assert not missing, f"numeric config keys without a range: {missing}"


def test_every_default_lies_in_its_range() -> None:
    for key, f, _ in ALL_LEAVES:
        if (within := f.metadata.get("range")) is not None:
            within.check(key, config._field_default(f))


@pytest.mark.parametrize(("override", "message"), [
    ("trainer.lr=126", "'trainer.lr' = 126.0 is outside its range (0, 1]"),
    ("trainer.lr=0", "'trainer.lr' = 0.0 is outside its range (0, 1]"),
    ("reward.length_coef=-1", "'reward.length_coef' = -1.0 is outside its range [0, 1]"),
    ("reward.length_coef=nan", "'reward.length_coef' = nan: a finite number is required"),
    ("trainer.kl_coef=inf", "'trainer.kl_coef' = inf: a finite number is required"),
    ("trainer.betas=[0.9, 1.0]", "'trainer.betas' = (0.9, 1.0) is outside its range [0, 1)"),
    ("reconciler.scheduling.eta=-1", "'reconciler.scheduling.eta' = -1 is outside its range [0, 1000]"),
    ("reconciler.scheduling.max_ready_groups=0", "'reconciler.scheduling.max_ready_groups' = 0 is outside"),
    ("rollout.agent.max_turns=0", "'rollout.agent.max_turns' = 0 is outside"),
    ("supervisor.max_restarts=-1", "'supervisor.max_restarts' = -1 is outside"),
    ("actors.rollout.nice=20", "'actors.rollout.nice' = 20 is outside its range [0, 19]"),
    ("log.queue_size=0", "'log.queue_size' = 0 is outside"),
])
def test_a_value_outside_its_range_is_refused_at_load_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_run_config([DEFAULT_RUN], [override])
    assert message in str(e.value)


def test_a_section_built_in_code_is_range_checked_too() -> None:
    from actors.config import TrainerSection
    from actors.reconciler.scheduling import SchedulingConfig

    with pytest.raises(ConfigError, match=r"'trainer.lr' = 126"):
        TrainerSection(lr=126.0)
    with pytest.raises(ConfigError, match=r"'scheduling.rollout_timeout_s' = 0.0"):
        SchedulingConfig(rollout_timeout_s=0.0)
    with pytest.raises(ConfigError, match=r"'actors.<kind>.lease_s'"):
        ActorSpec("a:B", lease_s=0.1)


@pytest.mark.parametrize(("key", "value"), [
    ("trainer.lr", 126.0), ("reward.length_coef", -1.0), ("reward.length_coef", math.nan),
    ("reward.malformed_call_penalty", math.inf), ("rollout.temperature", 9.0), ("eval.every_versions", 0),
    ("reconciler.scheduling.max_inflight_per_rollout_actor", 0),
])
def test_a_live_value_outside_its_range_is_refused_with_an_event(key: str, value: Any) -> None:
    actor = Actor(ActorContext(ActorIdentity("k", "k-1", 1, "h", "c"), None, ActorSettings(), RLConfig()))
    actor.Config = RLConfig  # type: ignore[misc]
    before = actor.config
    with capture_logs() as events:
        import asyncio

        asyncio.run(actor._apply_config(key, msgpack.packb(value)))
    assert actor.config is before
    rejected = [e for e in events if e["event"] == "config_change_rejected"]
    assert len(rejected) == 1 and rejected[0]["key"] == key and rejected[0]["log_level"] == "error"
    assert key in rejected[0]["error"]


def test_ops_config_refuses_a_live_value_outside_its_range(tmp_path: Path) -> None:
    from ops.config import validate
    from runtime.rundir import CONFIG_FILE

    (tmp_path / CONFIG_FILE).write_text(dump_toml(load_run_config([DEFAULT_RUN]).to_toml_tree()))
    assert validate(tmp_path, "trainer.lr", "1e-4") == 1e-4
    for key, raw in (("trainer.lr", "126"), ("reward.length_coef", "nan"), ("reward.length_coef", "-1")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate(tmp_path, key, raw)
