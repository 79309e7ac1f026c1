"""The RL trainer's launcher: ``python -m actors [--preset NAME] [--config FILE] [--set key=value ...]``.

It is ``python -m runtime.up`` with the project's default run, actors/run.toml (every RL actor and its
entry point), as the run file when no ``--config`` is given; every other argument means what it means there.
``--preset NAME`` runs actors/run.toml with actors/runs/NAME.toml over it (``smollm2``: a pretrained policy on
HumanEval-shaped tasks, HumanEval held out), and any ``--config`` files over both.
"""

from __future__ import annotations

import sys
from pathlib import Path

from runtime.up import main

DEFAULT_RUN_FILE = Path(__file__).resolve().with_name("run.toml")
PRESETS_DIR = DEFAULT_RUN_FILE.with_name("runs")


def with_preset(argv: list[str]) -> list[str]:
    """``argv`` with ``--preset NAME`` replaced by the run files it stands for.

    Raises:
        SystemExit: an unknown preset (the known ones are named).
    """
    if "--preset" not in argv:
        return argv
    at = argv.index("--preset")
    known = sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))
    name = argv[at + 1] if at + 1 < len(argv) else ""
    if name not in known:
        raise SystemExit(f"python -m actors: --preset {name!r} is not a preset; use one of {known}")
    files = ["--config", str(DEFAULT_RUN_FILE), "--config", str(PRESETS_DIR / f"{name}.toml")]
    return argv[:at] + files + argv[at + 2:]


if __name__ == "__main__":
    sys.exit(main(with_preset(sys.argv[1:]), default_config=[DEFAULT_RUN_FILE], prog="python -m actors"))
