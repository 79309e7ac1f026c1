"""The run directory: one machine's local cache and log folder of a run.

It holds the logs of the processes that ran here, a copy of the resolved configuration and of the
run's address (``run.json``: bus URL, run id, storage URL, credentials), the trainer's checkpoint
cache and, for an embedded run, the bus's JetStream store, its credentials and the default
``file://`` blob store. What a run needs lives on the bus and in the blob store (`runtime.run_state`):
a run can be resumed from another directory, on another machine, with its bus and storage URLs.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runtime.actor_launch import RunAddress
from runtime.bus_auth import read_credentials, tls_context
from runtime.errors import ConfigError

RUN_INFO = "run.json"
CONFIG_FILE = "config.toml"
SUPERVISOR_LOG = "logs/supervisor.jsonl"  # runtime.up's events: how each start of the run here ended


@dataclass(frozen=True)
class RunInfo:
    """Written by runtime.up when the bus is up; read by actor processes and ops commands."""

    run_dir: str
    nats_url: str
    storage_url: str
    s3_endpoint: str
    supervisor_pid: int
    started_at: float
    credentials_dir: str = ""  # empty: the bus takes no credentials (runtime.bus_auth)
    tls_ca_file: str = ""  # a remote bus over TLS: the CA, and the client's certificate and key
    tls_cert_file: str = ""
    tls_key_file: str = ""
    run_id: str = ""  # empty in a run.json from before run ids: the directory's name was the run's

    @property
    def run(self) -> str:
        """The run's id (a run directory from before run ids: its name, which named its weights then)."""
        return self.run_id or Path(self.run_dir).name

    def address(self) -> RunAddress:
        return RunAddress(self.nats_url, self.run, self.credentials_dir, self.tls_ca_file, self.tls_cert_file,
                          self.tls_key_file)

    def bus_options(self, role: str) -> dict[str, Any]:
        """``Bus.connect`` keywords for a process of `role`: its credentials and TLS, if the run has them."""
        credentials = read_credentials(self.credentials_dir, role) if self.credentials_dir else None
        return {"credentials": credentials, "tls": tls_context(self.tls_ca_file, self.tls_cert_file, self.tls_key_file)}

    def write(self) -> None:
        path = Path(self.run_dir) / RUN_INFO
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)

    @classmethod
    def read(cls, run_dir: Path) -> RunInfo:
        path = Path(run_dir) / RUN_INFO
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            raise ConfigError(f"{path} does not exist: is {run_dir} a run directory "
                              "(made by python -m runtime.up)?") from None
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{path} is corrupt ({e}); restart the run with --resume") from None


def new_run_dir(runs_dir: Path, run_id: str) -> Path:
    """``runs_dir/<run_id>``, made now (a run id is fresh: the folder must not exist yet)."""
    candidate = runs_dir / run_id
    try:
        candidate.mkdir(parents=True)
    except FileExistsError:
        raise ConfigError(f"{candidate} exists already: pass --run-dir for a new folder, or --resume it") from None
    return candidate.resolve()


def latest_run_dir(runs_dir: Path) -> Path | None:
    runs = sorted(p for p in runs_dir.glob("*") if (p / RUN_INFO).exists())
    return runs[-1] if runs else None
