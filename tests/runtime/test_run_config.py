"""dump_toml writes what TOML reads back: config.toml is read by every actor and by --resume."""

from __future__ import annotations

import tomllib
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.run_config import dump_toml, load_run_config

_COUNTER = '[actors.counter]\nentry = "tests.integration.workers:CounterActor"\n'

_TRICKY = [
    "two\nlines", 'a "quoted" word', "back\\slash", "tab\there", "cr\r\nlf", "bell\x07", "del\x7f",
    "'''", '"""', "ünïcødé ✓", "", "# not a comment", "[not.a.table]", "key = value",
]


def test_tricky_strings_round_trip_through_the_run_file(tmp_path: Path) -> None:
    for text in _TRICKY:
        source = tmp_path / "run.toml"
        source.write_text(_COUNTER + f"[counter]\nnote = {_basic(text)}\n")
        cfg = load_run_config([source])
        assert cfg.app.counter.note == text
        written = tmp_path / "config.toml"
        written.write_text(dump_toml(cfg.to_toml_tree()))
        again = load_run_config([written])
        assert again == cfg, text


def _basic(text: str) -> str:
    """A TOML basic string by escapes only, independent of the writer under test."""
    return '"' + "".join(c if c.isalnum() or c in " _-" else f"\\U{ord(c):08X}" for c in text) + '"'


_keys = st.text(min_size=1, max_size=8)
_scalars = st.one_of(
    st.text(max_size=20), st.integers(-(2**63), 2**63 - 1), st.booleans(),
    st.floats(allow_nan=False), st.lists(st.text(max_size=5), max_size=3),
)
_trees = st.recursive(st.dictionaries(_keys, _scalars, max_size=4),
                      lambda inner: st.dictionaries(_keys, st.one_of(_scalars, inner), max_size=4), max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(_trees)
def test_any_tree_of_plain_values_round_trips(tree: dict) -> None:
    assert tomllib.loads(dump_toml(tree)) == tree


def test_none_values_are_left_out() -> None:
    assert tomllib.loads(dump_toml({"a": None, "t": {"b": None, "c": 1}})) == {"t": {"c": 1}}


def test_the_fault_handling_settings_are_range_checked(tmp_path: Path) -> None:
    import pytest

    from runtime.errors import ConfigError

    source = tmp_path / "run.toml"
    source.write_text(_COUNTER)
    for override, named in (("bus.max_outage_s=0.5", "max_outage_s"),
                            ("bus.server_max_restarts=-1", "server_max_restarts"),
                            ("supervisor.stall_s=0.5", "stall_s"),
                            ("actors.counter.max_deliveries=0", "max_deliveries"),
                            ("actors.counter.max_deliveries=50", "max_deliveries")):
        with pytest.raises((ConfigError, ValueError), match=named):
            load_run_config([source], [override])
    cfg = load_run_config([source], ["supervisor.stall_s=0", "bus.max_outage_s=5", "actors.counter.max_deliveries=3"])
    assert cfg.runtime.supervisor.stall_s == 0 and cfg.runtime.bus.max_outage_s == 5


_CRASHING = '[actors.crashing]\nentry = "tests.integration.workers:CrashingActor"\n'  # a kind without a Config


def test_a_process_of_one_kind_imports_no_other_kinds_code(tmp_path: Path) -> None:
    """An actor process reads the run's configuration with its own kind's class alone (or the reconciler
    would import torch for the trainer's sake): another kind's entry, here one that cannot be imported at all, is
    never imported; the whole run file was checked when the run started (load_run_config refuses it)."""
    import pytest

    from runtime.errors import ConfigError
    from runtime.run_config import load_kind_config

    source = tmp_path / "config.toml"
    source.write_text(_COUNTER + '[actors.other]\nentry = "tests.no_such_module:Thing"\n[counter]\nnote = "n"\n')
    with pytest.raises(ConfigError, match="no_such_module"):
        load_run_config([source])
    cfg = load_kind_config([source], "counter")
    assert cfg.app.counter.note == "n" and cfg.app_schema.__name__ == "CounterConfig"
    assert sorted(cfg.runtime.actors) == ["counter", "other"]
    with pytest.raises(ConfigError, match="no actor kind 'nope'"):
        load_kind_config([source], "nope")


def test_a_kind_without_a_config_gets_the_runs_shared_one(tmp_path: Path) -> None:
    from runtime.run_config import load_kind_config

    source = tmp_path / "config.toml"
    source.write_text(_COUNTER + _CRASHING + '[counter]\nnote = "n"\n')
    assert load_kind_config([source], "crashing") == load_run_config([source]) == load_kind_config([source], "counter")


def test_a_reader_of_a_configuration_imports_the_schema_alone(tmp_path: Path) -> None:
    """--print-config and ops.config read a configuration without importing the actor classes (the RL ones bring
    torch: seconds of CPU per call, issue 30): the schema ``run.config_schema`` names is imported alone, here beside
    a kind whose entry cannot be imported at all; a run's start imports every class (and refuses that one)."""
    import pytest

    from runtime.errors import ConfigError

    source = tmp_path / "run.toml"
    source.write_text(_COUNTER + '[actors.other]\nentry = "tests.no_such_module:Thing"\n[counter]\nnote = "n"\n'
                      '[run]\nconfig_schema = "tests.integration.workers:CounterConfig"\n')
    with pytest.raises(ConfigError, match="no_such_module"):
        load_run_config([source])
    cfg = load_run_config([source], import_actors=False)
    assert cfg.app.counter.note == "n" and cfg.app_schema.__name__ == "CounterConfig"


def test_the_saved_configuration_names_its_schema_and_a_wrong_name_is_refused(tmp_path: Path) -> None:
    import re

    import pytest

    from runtime.errors import ConfigError
    from runtime.run_config import load_kind_config

    source = tmp_path / "run.toml"
    source.write_text(_COUNTER + _CRASHING)
    cfg = load_run_config([source])
    assert cfg.runtime.run.config_schema == "tests.integration.workers:CounterConfig"
    saved = tmp_path / "config.toml"
    saved.write_text(dump_toml(cfg.to_toml_tree()))
    assert load_run_config([saved], import_actors=False) == cfg == load_kind_config([saved], "crashing")
    source.write_text(_COUNTER + '[run]\nconfig_schema = "runtime.run_config:RunSection"\n')
    with pytest.raises(ConfigError, match=re.escape("the run's actor classes share tests.integration.workers:Counter")):
        load_run_config([source])


def test_the_printed_configuration_marks_each_keys_range_and_liveness(tmp_path: Path) -> None:
    """--print-config's text: each key's range and live mark at the end of its line, TOML read back as dump_toml's."""
    from runtime.run_config import annotated_toml

    source = tmp_path / "run.toml"
    source.write_text(_COUNTER + "[actors.counter.placement.resources]\nsandbox = 1.0\n")
    cfg = load_run_config([source])
    text = annotated_toml(cfg)
    assert tomllib.loads(text) == tomllib.loads(dump_toml(cfg.to_toml_tree()))
    lines = text.splitlines()
    assert "delay_scale = 1.0  # live" in lines  # live, no range
    assert 'note = "fixed"' in lines  # fixed, no range: nothing to say
    assert "count = 1  # [0, 10000]" in lines and "server_restart_window_s = 60.0  # (0, 86400]" in lines
    assert "sandbox = 1.0" in lines  # a key of a table of values has no field of its own
