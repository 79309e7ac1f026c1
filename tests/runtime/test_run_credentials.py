"""The credentials an actor process starts with (`actor_env` from the supervisor's `RunCredentials`): a directory
given for a remote bus is its owner's, who may rotate its files mid-run; each process started reads them again
(the copy held since the run started would be refused, and every restarted actor crash-loop), and falls back to
that copy, saying so, only where they cannot be read. The run's own generated credentials are as held."""

from __future__ import annotations

import json
from pathlib import Path

from structlog.testing import capture_logs

from runtime.actor_launch import CREDENTIALS_ENV, RunAddress, actor_env
from runtime.bus_auth import BusCredentials, RunCredentials


def _write(directory: Path, role: str, password: str) -> None:
    directory.mkdir(exist_ok=True)
    (directory / f"{role}.json").write_text(json.dumps({"user": role, "password": password}))


def _started_with(directory: Path, held: RunCredentials) -> str:
    env = actor_env(RunAddress("nats://127.0.0.1:4222", "run-1", str(directory)), "rollout", {}, held)
    return json.loads(env[CREDENTIALS_ENV])["password"]


def test_a_remote_bus_s_rotated_credentials_reach_the_next_process(tmp_path: Path) -> None:
    directory = tmp_path / "credentials"
    _write(directory, "rollout", "before")
    held = RunCredentials.read(directory, ["rollout"])  # as runtime.up reads them at the start
    _write(directory, "rollout", "rotated")  # the bus's owner rotates them mid-run
    assert _started_with(directory, held) == "rotated"


def test_unreadable_credentials_fall_back_to_the_held_copy_and_say_so(tmp_path: Path) -> None:
    directory = tmp_path / "credentials"
    _write(directory, "rollout", "before")
    held = RunCredentials.read(directory, ["rollout"])
    (directory / "rollout.json").write_text("{not json")
    with capture_logs() as logs:
        assert _started_with(directory, held) == "before"
    (event,) = [e for e in logs if e["event"] == "credentials_reread_failed"]
    assert event["role"] == "rollout" and "malformed" in event["error"] and str(directory) in event["fix"]


def test_the_run_s_own_credentials_are_used_as_held(tmp_path: Path) -> None:
    directory = tmp_path / "credentials"
    _write(directory, "rollout", "edited by hand")  # the supervisor writes its own back (`restore`)
    held = RunCredentials(directory, {"rollout": BusCredentials("rollout", "generated")}, owned=True)
    assert _started_with(directory, held) == "generated"
