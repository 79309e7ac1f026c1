"""The run directory: where a run keeps its config, logs, blobs, JetStream data and its address."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runtime.bus_auth import read_credentials, tls_context
from runtime.errors import ConfigError

RUN_INFO = "run.json"
CONFIG_FILE = "config.toml"


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


def new_run_dir(runs_dir: Path, name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        candidate = runs_dir / (f"{stamp}-{name}" + (f"-{n}" if n else ""))
        try:
            candidate.mkdir(parents=True)
            return candidate.resolve()
        except FileExistsError:
            continue
    raise ConfigError(f"cannot create a run directory under {runs_dir}")


def latest_run_dir(runs_dir: Path) -> Path | None:
    runs = sorted(p for p in runs_dir.glob("*") if (p / RUN_INFO).exists())
    return runs[-1] if runs else None
