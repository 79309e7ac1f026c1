"""A bus of the run's own on an operator's machines: ``python -m runtime.bus_recipe``.

    python -m runtime.bus_recipe --config RUN.toml --servers n1:4222:6222,n2:4222:6222,n3:4222:6222 \\
        --store-dir /var/lib/asyncrl/nats --out /etc/asyncrl

writes, under ``--out``:

- ``nats/<name>.conf``, one nats-server configuration per server (``n1``, ``n2``, ... in the order given):
  JetStream with its store in ``<store dir>/<name>``, clients on the server's port, and, for three or more
  servers, a JetStream cluster whose members reach each other on their route ports with a route password of
  their own. Every configuration carries the same users: the supervisor, the operator and one per actor kind of
  the run, each allowed exactly the subjects its role needs (`runtime.bus_auth`: the table the embedded bus
  uses, taken from what each kind's class declares, so the run files must be the run's).
- ``bus/<role>.json``, the credentials directory a run takes as ``bus.credentials_dir`` (user and password per
  role; the directory 0700, its files 0600).

A server's configuration goes to that server (``nats-server -c <name>.conf``); the credentials directory to
every machine that starts a run or its actors (``runtime.up``, the Ray nodes) and ``operator.json`` alone to
where operators run ``ops`` commands. Passwords are fresh on every call: the recipe refuses an ``--out``
that already holds one (servers and runs would disagree); a new recipe means new configurations on every
server. No TLS: the passwords cross the network in clear text unless each configuration gets a ``tls`` block
(nats-server's) and the run ``bus.tls_ca_file``. Exit status: 0 written, 2 a bad argument or run file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from runtime.bus_auth import Permissions, generate_credentials
from runtime.errors import ConfigError
from runtime.natsserver import NatsServerConfig, server_conf
from runtime.run_config import load_run_config
from runtime.up import bus_roles

__all__ = ["ServerAddress", "main", "parse_servers", "write_recipe"]

CREDENTIALS = "bus"  # under --out: the credentials directory (bus.credentials_dir)
SERVERS = "nats"  # under --out: one configuration per server
ROUTE_USER = "route"  # the user a cluster member signs in to its peers as
DEFAULT_ROUTE_PORT = 6222  # nats-server's own default for routes


@dataclasses.dataclass(frozen=True)
class ServerAddress:
    """Where one server of the bus is reached: ``host:client_port:route_port``."""

    host: str
    client_port: int
    route_port: int

    @classmethod
    def parse(cls, text: str) -> ServerAddress:
        """``n1:4222:6222``; ``n1:4222`` takes the route port `DEFAULT_ROUTE_PORT`.

        Raises:
            ConfigError: not ``host:port[:route port]`` with ports in 1..65535.
        """
        host, *ports = text.strip().split(":")
        if len(ports) == 1:
            ports.append(str(DEFAULT_ROUTE_PORT))
        try:
            client, route = (int(p) for p in ports)
        except ValueError:  # not a number, or not one or two ports
            client = route = 0
        if not host or not 0 < client < 65536 or not 0 < route < 65536:
            raise ConfigError(f"server {text!r} must be host:client_port[:route_port], e.g. n1:4222:6222")
        return cls(host, client, route)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.client_port}"


def parse_servers(text: str) -> list[ServerAddress]:
    """The servers of ``n1:4222:6222,n2:4222:6222,...``: one, or an odd number of three or more (a JetStream
    cluster keeps a quorum when one is lost only with an odd number).

    Raises:
        ConfigError: a malformed server, two the same, or an even number of them.
    """
    servers = [ServerAddress.parse(part) for part in text.split(",") if part.strip()]
    if len(servers) != 1 and (len(servers) < 3 or len(servers) % 2 == 0):
        raise ConfigError(f"--servers names {len(servers)} server(s): give 1, or 3, 5 or 7 for a JetStream cluster "
                          "that keeps a quorum when one is lost")
    taken = [(s.host, port) for s in servers for port in (s.client_port, s.route_port)]
    if len(set(taken)) != len(taken):
        raise ConfigError(f"--servers {text!r} gives one host and port twice: each server needs its own client and "
                          "route ports on its host")
    return servers


def write_recipe(roles: Mapping[str, Permissions], servers: Sequence[ServerAddress], out: Path, store_dir: Path,
                 listen_host: str = "0.0.0.0", cluster_name: str = "asyncrl") -> list[Path]:
    """Writes the credentials directory of `roles` and one configuration per server under `out`; returns the
    servers' configuration files, in the order of `servers`.

    Raises:
        ConfigError: `out` already holds a recipe, or a role cannot be a bus role.
    """
    for part in (CREDENTIALS, SERVERS):
        if (out / part).exists() and any((out / part).iterdir()):
            raise ConfigError(f"{out / part} already holds a recipe: its passwords are what servers and runs use. "
                              "Remove it to make new ones (then give every server its new configuration), or pass "
                              "another --out")
    users = tuple(generate_credentials(out / CREDENTIALS, roles))
    route_password = secrets.token_urlsafe(24)
    clustered = len(servers) > 1
    (out / SERVERS).mkdir(mode=0o700, parents=True, exist_ok=True)
    written = []
    for i, server in enumerate(servers):
        name = f"n{i + 1}"
        peers = tuple(f"nats://{ROUTE_USER}:{route_password}@{s.host}:{s.route_port}" for s in servers if s != server)
        config = NatsServerConfig(store_dir=store_dir / name, host=listen_host, port=server.client_port, users=users,
                                  server_name=name if clustered else "", cluster_name=cluster_name if clustered else "",
                                  cluster_port=server.route_port, routes=peers, route_user=ROUTE_USER,
                                  route_password=route_password)
        path = out / SERVERS / f"{name}.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds every role's password
        with os.fdopen(fd, "w") as fh:
            fh.write(server_conf(config, server.client_port, server.route_port))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.bus_recipe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", type=Path, required=True, metavar="FILE",
                   help="the run's TOML run file(s), layered as runtime.up layers them: its actor kinds are the roles")
    p.add_argument("--servers", required=True, metavar="HOST:PORT[:ROUTE_PORT],...",
                   help="the bus's servers: one, or 3, 5 or 7 for a JetStream cluster (route port default 6222)")
    p.add_argument("--store-dir", type=Path, required=True,
                   help="where each server keeps its JetStream store (a directory per server under it)")
    p.add_argument("--out", type=Path, required=True, help="where to write nats/<server>.conf and bus/<role>.json")
    p.add_argument("--listen-host", default="0.0.0.0", help="the address each server listens on (default: all)")
    args = p.parse_args(argv)
    try:
        servers = parse_servers(args.servers)
        roles = bus_roles(load_run_config(args.config, []).runtime)
        confs = write_recipe(roles, servers, args.out.resolve(), args.store_dir.resolve(), args.listen_host)
    except ConfigError as e:
        print(f"configuration error: {e}", file=sys.stderr)
        return 2
    credentials = args.out.resolve() / CREDENTIALS
    print(f"users: supervisor, operator, {', '.join(roles)}; their credentials in {credentials}")
    for server, conf in zip(servers, confs, strict=True):
        print(f"on {server.host}: nats-server -c {conf}")
    print(f"a run: --set bus.url={','.join(s.url for s in servers)} --set bus.credentials_dir={credentials}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
