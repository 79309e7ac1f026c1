from __future__ import annotations

import dataclasses
import enum
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.config import RLConfig
from runtime import config
from runtime.errors import ConfigError
from runtime.run_config import load_run_config


class Mode(enum.Enum):
    FAST = "fast"
    SAFE = "safe"


@dataclass(frozen=True)
class Rollout:
    temperature: float = config.live(1.0)
    max_tokens: int = 256
    mode: Mode = Mode.SAFE

    def __post_init__(self) -> None:
        if not 0.0 < self.temperature <= 2.0:
            raise ValueError(f"temperature={self.temperature} must be in (0, 2]")


@dataclass(frozen=True)
class App:
    rollout: Rollout = Rollout()
    name: str = "x"


def test_defaults_file_then_overrides(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text('[rollout]\nmax_tokens = 64\nmode = "fast"\n')
    cfg = config.load(App, [f], ["rollout.temperature=0.7"])
    assert cfg == App(Rollout(0.7, 64, Mode.FAST))


@pytest.mark.parametrize(("override", "message"), [
    # the suggestion in full, as --set and ops.config set take it; a mistyped section mended too
    ("rollout.temprature=0.7", "config key 'rollout.temprature' is unknown; did you mean 'rollout.temperature'?"),
    ("rolout.temperature=0.7", "config key 'rolout.temperature' is unknown; did you mean 'rollout.temperature'?"),
    ("rollout.max_tokens=abc", "expects int"),
    ("rollout.temperature=9.0", "must be in (0, 2]"),
    ("rollout.mode=turbo", "must be one of 'fast', 'safe'"),
    ("nonsense", "must look like section.key=value"),
])
def test_errors_name_the_key_and_the_problem(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        config.load(App, [], [override])


def test_live_keys_and_apply_value() -> None:
    cfg = App()
    assert config.is_live(App, "rollout.temperature") and not config.is_live(App, "rollout.max_tokens")
    assert config.live_items(cfg) == [("rollout.temperature", 1.0)]
    assert config.apply_value(cfg, "rollout.temperature", 0.5).rollout.temperature == 0.5
    with pytest.raises(ConfigError):
        config.apply_value(cfg, "rollout.temperature", -1.0)


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(App, [tmp_path / "nope.toml"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[rollout\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(App, [bad])


def test_run_config_splits_runtime_and_app_sections(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text('[actors.counter]\nentry = "tests.integration.workers:CounterActor"\ncount = 2\n'
                 '[counter]\ndelay_scale = 2.0\n')
    cfg = load_run_config([f], ["supervisor.max_restarts=3", "counter.note=\"n\""])
    assert cfg.runtime.actors["counter"].count == 2 and cfg.runtime.supervisor.max_restarts == 3
    assert cfg.app.counter.delay_scale == 2.0 and cfg.app.counter.note == "n"
    with pytest.raises(ConfigError, match="unknown"):
        load_run_config([f], ["counter.nope=1"])
    with pytest.raises(ConfigError, match="cannot be imported"):
        load_run_config([f], ['actors.counter.entry="no.such:Thing"'])


@pytest.mark.parametrize(("override", "message"), [
    # the key as the user writes it (not msgspec's `$.rollout.max_tokens`), what was given, what to write
    ("rollout.max_tokens=abc",
     "config key 'rollout.max_tokens' expects int, got 'abc' (str); e.g. rollout.max_tokens=256 (its default)"),
    ("rollout.max_tokens=true",
     "config key 'rollout.max_tokens' expects int, got True (bool); e.g. rollout.max_tokens=256 (its default)"),
    ("name=[1]", "config key 'name' expects str, got [1] (list); e.g. name=\"x\" (its default)"),
    ("rollout=3", "config section 'rollout' must be a table, got 3"),
    ("rollout.temperature=9.0", "config section 'rollout': temperature=9.0 must be in (0, 2]"),
])
def test_a_refused_value_is_said_with_its_key_as_written(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        config.load(App, [], [override])
    assert str(e.value) == message
    assert "$" not in str(e.value)


def test_the_actor_tables_name_their_kind_in_every_error(tmp_path: Path) -> None:
    """msgspec alone says `$.actors[...].count`: every error here names the kind."""
    f = tmp_path / "run.toml"
    f.write_text('[actors.counter]\nentry = "tests.integration.workers:CounterActor"\n')
    cases = {
        'actors.counter.count="two"': "config key 'actors.counter.count' expects int, got 'two' (str)",
        "actors.counter.cuont=2": "config key 'actors.counter.cuont' is unknown; did you mean 'actors.counter.count'?",
        "actors.other.count=2": "config key 'actors.other.entry' is required",
        "run.runs_dir=3": "config key 'run.runs_dir' expects a path string, got 3 (int)",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as e:
            load_run_config([f], [override])
        assert message in str(e.value), override


def _dotted_keys(schema: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(schema)
    out = []
    for f in dataclasses.fields(schema):
        is_section = dataclasses.is_dataclass(hints[f.name])
        out += _dotted_keys(hints[f.name], f"{prefix}{f.name}.") if is_section else [prefix + f.name]
    return out


_ANY_VALUE = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=5)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=2)),
    max_leaves=5)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([*_dotted_keys(RLConfig), "rollout", "rollout.agent", "bogus.key"]),
                       _ANY_VALUE, max_size=4))
def test_any_tree_of_values_is_the_config_or_a_config_error(items: dict[str, Any]) -> None:
    """Whatever a run file or a live change holds: a config, or a ConfigError naming a key or section."""
    tree: dict[str, Any] = {}
    try:
        for key, value in items.items():
            config.set_path(tree, key, value)
    except ConfigError:
        return
    try:
        assert isinstance(config.build(RLConfig, tree), RLConfig)
    except ConfigError as e:
        assert "config key" in str(e) or "config section" in str(e)
