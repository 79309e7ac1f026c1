"""How an actor process is started, on this machine or another: its command line and its environment.

    python -m runtime.actor_process --bus URL --run RUN_ID --kind K --id ID [--run-dir DIR] [--standby]

The bus address and the run id are all a process needs to find its run (``runtime.run_state``: the
bus's record names the blob store, the store holds the configuration). What it must not show on a
command line travels in its environment, which only its own user can read (``/proc/<pid>/environ``):

- ``RUNTIME_BUS_CREDENTIALS``: its role's ``{"user", "password"}`` (JSON) when the bus takes credentials;
- ``RUNTIME_BUS_TLS_CA_FILE``, ``RUNTIME_BUS_TLS_CERT_FILE``, ``RUNTIME_BUS_TLS_KEY_FILE``: TLS files,
  as paths on the machine the process runs on (a cluster provisions them on every node, as it does
  the S3 credentials that boto3 reads from its usual environment variables or files).

Every placement backend builds a process from `actor_argv` and `actor_env`, so a process started by
any of them finds its run the same way.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.bus_auth import BusCredentials, RunCredentials, read_credentials, tls_context
from runtime.errors import ConfigError

__all__ = ["CREDENTIALS_ENV", "TLS_ENV", "RunAddress", "actor_argv", "actor_env", "bus_options_from_env"]

CREDENTIALS_ENV = "RUNTIME_BUS_CREDENTIALS"
TLS_ENV = ("RUNTIME_BUS_TLS_CA_FILE", "RUNTIME_BUS_TLS_CERT_FILE", "RUNTIME_BUS_TLS_KEY_FILE")


# a process of a kind with ranks > 1: its rank and the group's size (the kind finds its peers through the bus)
RANK_ENV, WORLD_SIZE_ENV = "ASYNCRL_RANK", "ASYNCRL_WORLD_SIZE"

@dataclass(frozen=True)
class RunAddress:
    """Where a run is: its bus, its id, and how to reach the bus (credentials directory, TLS files)."""

    nats_url: str
    run_id: str
    credentials_dir: str = ""  # empty: the bus takes no credentials
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""


def actor_argv(address: RunAddress, run_dir: Path, kind: str, actor_id: str, *, standby: bool = False) -> list[str]:
    """The command line of one actor process; ``run_dir`` is its local cache and log folder."""
    return [sys.executable, "-m", "runtime.actor_process", "--bus", address.nats_url, "--run", address.run_id,
            "--run-dir", str(run_dir), "--kind", kind, "--id", actor_id, *(["--standby"] if standby else [])]


def actor_env(address: RunAddress, role: str, base: Mapping[str, str],
              held: RunCredentials | None = None) -> dict[str, str]:
    """``base`` with what a process of ``role`` needs to reach the bus (see the module docstring): its
    credentials from ``held`` (the supervisor's: `RunCredentials.for_spawn`) if given, else from the
    credentials directory.

    Raises:
        ConfigError: the credentials directory has no readable file for ``role``.
    """
    env = {k: v for k, v in base.items() if k != CREDENTIALS_ENV and k not in TLS_ENV}
    if address.credentials_dir:
        credentials = held.for_spawn(role) if held is not None else read_credentials(address.credentials_dir, role)
        # an NKEY seed or a .creds file travels as its path (present on every node, like TLS files)
        env[CREDENTIALS_ENV] = json.dumps({k: v for k, v in dataclasses.asdict(credentials).items() if v})
    for name, value in zip(TLS_ENV, (address.tls_ca_file, address.tls_cert_file, address.tls_key_file), strict=True):
        if value:
            env[name] = value
    return env


def bus_options_from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """``Bus.connect`` keywords (credentials, TLS) from an actor process's environment.

    Raises:
        ConfigError: ``RUNTIME_BUS_CREDENTIALS`` is not ``{"user", "password"}`` JSON.
    """
    credentials = None
    if raw := environ.get(CREDENTIALS_ENV):
        try:
            data = json.loads(raw)
            credentials = BusCredentials(**{k: str(v) for k, v in data.items()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{CREDENTIALS_ENV} is malformed ({e!r}); expected JSON {{'user', and 'password', "
                              "'nkey_seed_file' or 'creds_file'}}") from None
    ca, cert, key = (environ.get(name, "") for name in TLS_ENV)
    return {"credentials": credentials, "tls": tls_context(ca, cert, key)}
