"""[bus]: one server or several (a list, or comma-separated), an embedded cluster, replicas by default."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.errors import ConfigError
from runtime.run_config import BusSection, dump_toml, load_run_config

_COUNTER = '[actors.counter]\nentry = "tests.integration.workers:CounterActor"\n'
_URLS = ("nats://a:4222", "nats://b:4222", "tls://c:4222")


def _load(tmp_path: Path, *overrides: str) -> BusSection:
    source = tmp_path / "run.toml"
    source.write_text(_COUNTER)
    return load_run_config([source], overrides).runtime.bus


def test_a_url_list_or_a_comma_separated_string_names_a_cluster_and_gets_three_replicas(tmp_path: Path) -> None:
    listed = _load(tmp_path, f"bus.url={list(_URLS)!r}".replace("'", '"'))
    joined = _load(tmp_path, f'bus.url="{",".join(_URLS)}"')
    assert listed.url == _URLS and listed.num_servers == joined.num_servers == 3
    assert listed.num_replicas == joined.num_replicas == 3 and listed.limits().replicas == 3
    one = _load(tmp_path, 'bus.url="nats://a:4222"')
    assert one.num_replicas == 1
    assert _load(tmp_path, 'bus.url="nats://a:4222"', "bus.replicas=3").num_replicas == 3  # a cluster behind one URL


def test_the_embedded_bus_is_one_server_with_one_replica_or_a_cluster_with_three(tmp_path: Path) -> None:
    assert (_load(tmp_path).num_servers, _load(tmp_path).num_replicas) == (1, 1)
    cluster = _load(tmp_path, "bus.embedded_servers=3")
    assert (cluster.num_servers, cluster.num_replicas) == (3, 3)
    assert _load(tmp_path, "bus.embedded_servers=5", "bus.replicas=5").num_replicas == 5


@pytest.mark.parametrize(("overrides", "message"), [
    (('bus.url="http://a:4222"',), r"bus URL 'http://a:4222'.*nats://HOST:PORT"),
    (('bus.url="nats://a:4222,,nats://b:4222"',), r"expected one or more nats://HOST:PORT"),
    (("bus.url=[]",), r"expected one or more"),
    (("bus.embedded_servers=2",), r"odd number of servers"),
    (("bus.embedded_servers=9",), r"'bus.embedded_servers'"),
    (("bus.embedded_servers=3", 'bus.url="nats://a:4222"'), r"set one of them"),
    (("bus.replicas=3",), r"more than the 1 embedded server"),
])
def test_a_bus_that_cannot_be_is_refused_naming_the_key(tmp_path: Path, overrides: tuple[str, ...],
                                                        message: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=message):
        _load(tmp_path, *overrides)


def test_a_url_list_round_trips_through_the_run_file(tmp_path: Path) -> None:
    source = tmp_path / "run.toml"
    source.write_text(_COUNTER + "[bus]\nurl = " + str(list(_URLS)).replace("'", '"') + "\n")
    cfg = load_run_config([source])
    written = tmp_path / "config.toml"
    written.write_text(dump_toml(cfg.to_toml_tree()))
    assert load_run_config([written]).runtime.bus.url == _URLS
