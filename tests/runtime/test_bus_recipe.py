"""`runtime.bus_recipe` without servers: which servers it takes, and what each configuration says."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from runtime.bus_auth import BusAccess, actor_permissions, read_credentials
from runtime.bus_recipe import ServerAddress, parse_servers, write_recipe
from runtime.errors import ConfigError


def test_servers_are_host_client_port_and_route_port() -> None:
    assert parse_servers("n1:4222:6222, n2:4223:6223,n3:4222") == [
        ServerAddress("n1", 4222, 6222), ServerAddress("n2", 4223, 6223), ServerAddress("n3", 4222, 6222)]
    assert parse_servers("solo:4222") == [ServerAddress("solo", 4222, 6222)]


@pytest.mark.parametrize(("servers", "says"), [
    ("n1:4222,n2:4222", "give 1, or 3, 5 or 7"),
    ("n1:4222,n2:4222,n3:4222,n4:4222", "give 1, or 3, 5 or 7"),
    ("n1", "host:client_port"),
    ("n1:http", "host:client_port"),
    ("n1:4222:70000", "host:client_port"),
    (":4222", "host:client_port"),
    ("h:4222:6222,h:4223:6223,h:4222:6224", "one host and port twice"),
    ("h:4222:6222,h:6222:6223,h:4224:6224", "one host and port twice"),
])
def test_servers_that_cannot_make_a_bus_are_refused_saying_why(servers: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        parse_servers(servers)


def test_each_server_has_its_peers_as_authenticated_routes_and_every_role_as_a_user(tmp_path: Path) -> None:
    roles = {"counter": actor_permissions("counter", BusAccess(publish=("test.>",)))}
    servers = parse_servers("n1:4222:6222,n2:4222:6222,n3:4222:6222")
    confs = write_recipe(roles, servers, tmp_path / "etc", Path("/var/lib/nats"))
    assert [c.name for c in confs] == ["n1.conf", "n2.conf", "n3.conf"]
    n1 = confs[0].read_text()
    assert 'listen: "0.0.0.0:4222"' in n1 and 'store_dir: "/var/lib/nats/n1"' in n1 and 'server_name: "n1"' in n1
    assert "@n2:6222" in n1 and "@n3:6222" in n1 and "@n1:6222" not in n1, "routes to its peers, not to itself"
    assert '"user": "route"' in n1, "routes sign in"
    for role in ("supervisor", "operator", "counter"):
        assert read_credentials(tmp_path / "etc" / "bus", role).password in n1
    assert all(stat.S_IMODE(c.stat().st_mode) == 0o600 for c in confs), "they hold every role's password"
    assert stat.S_IMODE((tmp_path / "etc" / "bus").stat().st_mode) == 0o700


def test_one_server_is_no_cluster(tmp_path: Path) -> None:
    (conf,) = write_recipe({}, parse_servers("bus:4222"), tmp_path / "etc", tmp_path / "store")
    assert "cluster {" not in conf.read_text() and "authorization" in conf.read_text()
