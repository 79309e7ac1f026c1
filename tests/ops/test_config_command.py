"""``python -m ops.config`` without a live run: ``get`` says a key's value, range and liveness; a mistyped key is
answered with the nearest key in full; reading the run's configuration imports no actor code (issue 30: torch made
every call take 10 to 15 s on a loaded machine). The live path (set, then get from the bus) is in
tests/integration/test_actor_runtime.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ops import config as ops_config
from runtime.run_config import dump_toml, load_run_config
from runtime.rundir import CONFIG_FILE

REPO = Path(__file__).resolve().parents[2]
DEFAULT_RUN = REPO / "actors" / "run.toml"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run directory as far as its configuration goes: the default run's, saved as runtime.up saves it (no
    run.json: its bus is nowhere)."""
    cfg = load_run_config([DEFAULT_RUN], ["run.steps=8"], import_actors=False)
    (tmp_path / CONFIG_FILE).write_text(dump_toml(cfg.to_toml_tree()))
    return tmp_path


def test_get_says_a_fixed_keys_value_and_range(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ops_config.main(["get", "run.steps", str(run_dir)]) == 0
    assert capsys.readouterr().out == "run.steps = 8  # fixed, [0, 100000000]\n"
    assert ops_config.main(["get", "actors.rollout.count", str(run_dir)]) == 0
    assert capsys.readouterr().out == "actors.rollout.count = 1  # fixed, [0, 10000]\n"


def test_get_of_a_live_key_without_its_bus_says_the_value_it_started_with(
        run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ops_config.main(["get", "rollout.temperature", str(run_dir)]) == 0
    done = capsys.readouterr()
    assert done.out == "rollout.temperature = 1.0  # live, [0, 4]\n"
    assert "run.json does not exist" in done.err and "its value when the run started" in done.err


def test_a_mistyped_key_is_answered_with_the_nearest_in_full(run_dir: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["set", "rollout.temprature", "0.7"], ["get", "rolout.temperature"]):
        assert ops_config.main([*argv, str(run_dir)]) == 2
        assert "did you mean 'rollout.temperature'?" in capsys.readouterr().err
    assert ops_config.main(["get", "rollout", str(run_dir)]) == 2
    assert "is a section, not a value" in capsys.readouterr().err
    assert ops_config.main(["get", "actors.nope.count", str(run_dir)]) == 2
    assert "the run has no 'actors.nope'" in capsys.readouterr().err


def test_reading_the_runs_configuration_imports_no_actor_code(run_dir: Path) -> None:
    """What ops.config set does before it writes (validate the value against the run's schema), and get, in a
    fresh interpreter: the schema's module alone, none of the actors' heavy libraries."""
    probe = ("import sys\n"
             "from pathlib import Path\n"
             "from ops import config\n"
             "from tests.test_import_graph import HEAVY\n"
             f"run_dir = Path({str(run_dir)!r})\n"
             "assert config.validate(run_dir, 'rollout.temperature', '0.7') == 0.7\n"
             "assert config.main(['get', 'trainer.lr', str(run_dir)]) == 0\n"
             "print(sorted(m for m in HEAVY if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]", f"ops.config imported {done.stdout.splitlines()[-1]}"
