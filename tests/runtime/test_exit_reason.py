"""Why an actor process ended, as the supervisor says it (`runtime.supervisor.exit_reason`): never empty."""

from __future__ import annotations

from pathlib import Path

from runtime.placement import PlacementError, UnplacedProcess
from runtime.supervisor import exit_reason


class _Exited:
    def __init__(self, output: Path) -> None:
        self.output = output

    def output_tail(self) -> str:
        return str(self.output)


def test_an_exit_names_its_signal_its_status_and_its_last_words(tmp_path: Path) -> None:
    out = tmp_path / "actor.out"
    out.write_text("starting\nTraceback (most recent call last):\nConfigError: no bus credentials for role 'x'\n\n")
    assert exit_reason(-9, _Exited(out)) == "killed by SIGKILL"  # type: ignore[arg-type]
    assert exit_reason(1, _Exited(out)) == "exited 1: ConfigError: no bus credentials for role 'x'"  # type: ignore[arg-type]
    silent = exit_reason(1, _Exited(tmp_path / "never-written.out"))  # type: ignore[arg-type]
    assert silent == "exited 1 without a word (see its output file)"
    assert exit_reason(1, UnplacedProcess(PlacementError("no node has a GPU"))) == "not started: no node has a GPU"
