"""The RL trainer's launcher: ``python -m actors [--config run.toml] [--set key=value ...] [--resume RUN_DIR]``.

It is ``python -m runtime.up`` with the project's default run, actors/run.toml (every RL actor and its
entry point), as the run file when no ``--config`` is given; every other argument means what it means there.
"""

from __future__ import annotations

import sys
from pathlib import Path

from runtime.up import main

DEFAULT_RUN_FILE = Path(__file__).resolve().with_name("run.toml")

if __name__ == "__main__":
    sys.exit(main(default_config=[DEFAULT_RUN_FILE], prog="python -m actors"))
