"""runtime.up knows no application: the run file names what runs, and the launcher names the default run."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_runtime_up_without_a_run_file_is_a_configuration_error_naming_the_fix() -> None:
    done = run("-m", "runtime.up", "--print-config")
    assert done.returncode == 2, done.stderr
    assert "no run file: pass --config FILE" in done.stderr


def test_the_rl_launcher_runs_its_default_run_file() -> None:
    done = run("-m", "actors", "--print-config")
    assert done.returncode == 0, done.stderr
    for kind in ("reconciler", "rollout", "reward", "grouping", "trainer", "evaluator"):
        assert f"[actors.{kind}]" in done.stdout
    assert 'entry = "actors.stages.rollout:RolloutActor"' in done.stdout
    # each key with what it accepts and whether it is live, beside a pointer to what it means; TOML all the same
    assert "temperature = 1.0  # live, [0, 4]\n" in done.stdout and "steps = 70  # [0, 100000000]\n" in done.stdout
    assert "docs/reference/configuration.md" in done.stdout
    assert tomllib.loads(done.stdout)["rollout"]["temperature"] == 1.0


def test_an_explicit_run_file_replaces_the_launchers_default(tmp_path: Path) -> None:
    run_file = tmp_path / "run.toml"
    run_file.write_text('[actors.counter]\nentry = "tests.integration.workers:CounterActor"\n')
    done = run("-m", "actors", "--config", str(run_file), "--print-config")
    assert done.returncode == 0, done.stderr
    assert "[actors.counter]" in done.stdout
    assert "[actors.rollout]" not in done.stdout


def test_print_config_imports_no_actor_code() -> None:
    """The default run file names its schema (run.config_schema): printing it imports actors.config, not the actor
    classes, whose torch took 2 s of CPU on a quiet machine and 4 to 14 s on a loaded one (issue 30)."""
    probe = ("import io, sys, contextlib\n"
             "from actors.__main__ import DEFAULT_RUN_FILE\n"
             "from runtime.up import main\n"
             "from tests.test_import_graph import HEAVY\n"
             "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
             "    assert main(['--print-config'], default_config=[DEFAULT_RUN_FILE]) == 0\n"
             "assert '[actors.rollout]' in out.getvalue()\n"
             "print(sorted(m for m in HEAVY if m in sys.modules))\n")
    done = run("-c", probe)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"--print-config imported {done.stdout.strip()}"
