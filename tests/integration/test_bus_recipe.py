"""The recipe for a bus of the run's own (`runtime.bus_recipe`): three nats-servers started from the configurations
it writes form a JetStream cluster that signs in the run's roles only, each confined to its subjects, and a run
given its credentials directory works on it; a run on a bus that signs in nobody says so, loudly."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.js.errors import KeyNotFoundError

from runtime.bus import Bus, BusLimits
from runtime.bus_auth import SUPERVISOR, read_credentials
from runtime.bus_recipe import ServerAddress, write_recipe
from runtime.codec import Codec
from runtime.natsserver import NatsServer, NatsServerConfig, _free_loopback_ports
from runtime.run_config import load_run_config
from runtime.rundir import RunInfo
from runtime.up import bus_roles
from tests.integration.bus_clients import connect_anonymously, connect_as
from tests.integration.harness import REPO, LiveRun, run_events, write_config
from tests.integration.test_bus_auth import COUNTER_RUN
from tests.integration.workers import CountRequest
from tests.waiting import until

pytestmark = pytest.mark.timeout(180)


class RecipeServer(NatsServer):
    """A nats-server run from a configuration file the recipe wrote, as its operator runs it
    (``nats-server -c FILE``), watched like the embedded one (its port and meta leader read from its log)."""

    def __init__(self, conf: Path, store_dir: Path) -> None:
        super().__init__(NatsServerConfig(store_dir=store_dir, cluster_name="from the file"))
        self.conf = conf

    def _conf_text(self) -> str:
        return self.conf.read_text()


@contextlib.asynccontextmanager
async def recipe_cluster(tmp_path: Path, config: Path) -> AsyncIterator[list[str]]:
    """Three servers from `runtime.bus_recipe`'s configurations for the run of `config`; their client URLs."""
    ports = _free_loopback_ports(6, "127.0.0.1")
    servers = [ServerAddress("127.0.0.1", ports[i], ports[i + 3]) for i in range(3)]
    confs = write_recipe(bus_roles(load_run_config([config]).runtime), servers, tmp_path / "etc", tmp_path / "store",
                         listen_host="127.0.0.1")
    members = [RecipeServer(conf, tmp_path / "store" / conf.stem) for conf in confs]
    async with contextlib.AsyncExitStack() as stack:
        for member in members:
            await member.start()
            stack.push_async_callback(member.stop)
        async with asyncio.timeout(30):
            for member in members:
                await member.meta_leader_known.wait()
        yield [s.url for s in servers]


async def test_the_recipes_servers_form_a_cluster_that_signs_in_the_runs_roles_only(tmp_path: Path) -> None:
    config = write_config(tmp_path / "run.toml", COUNTER_RUN)
    async with recipe_cluster(tmp_path, config) as urls:
        credentials = tmp_path / "etc" / "bus"
        assert sorted(p.stem for p in credentials.iterdir()) == ["counter", "operator", SUPERVISOR]
        with pytest.raises(Exception, match=r"(?i)authorization"):
            await connect_anonymously(urls[0])
        admin = await Bus.connect(",".join(urls), "admin", credentials=read_credentials(credentials, SUPERVISOR),
                                  limits=BusLimits(replicas=3))
        try:
            await admin.ensure_base()
            # three replicas of a stream need three servers of one cluster: placed, not refused
            assert (await admin.js.stream_info("LOG")).config.num_replicas == 3
        finally:
            await admin.close()
        async with connect_as(RunInfo("", urls[1], "", "", 0, 0.0, str(credentials)), "counter") as counter:
            await counter.publish("weights.r1", b"x")
            assert await counter.refused("weights.r1"), "a role says only what the run's table allows it"

        run = await LiveRun(tmp_path / "run", config, "--set", f"bus.url={','.join(urls)}",
                            "--set", f"bus.credentials_dir={credentials}").start()
        try:
            assert run.bus is not None
            await run.wait_actors("counter", 1)
            await run.bus.publish_durable("work.count", await Codec([CountRequest]).encode(CountRequest("k1")))

            async def handled() -> bool:
                assert run.bus is not None
                try:
                    return await (await run.bus.kv("effects")).get("k1") is not None
                except KeyNotFoundError:
                    return False

            await until(handled, 30, "the counter's effect, written as its own role on the recipe's bus")
            assert not run_events(tmp_path / "run", "bus_unauthenticated")
        finally:
            assert await run.stop() == 0


def test_the_recipe_refuses_to_overwrite_the_passwords_servers_use(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "runtime.bus_recipe", "--config", str(write_config(tmp_path / "run.toml",
                                                                                         COUNTER_RUN)),
               "--servers", "n1:4222:6222,n2:4222:6222,n3:4222:6222", "--store-dir", str(tmp_path / "store"),
               "--out", str(tmp_path / "etc")]
    first = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert first.returncode == 0, first.stderr
    assert "nats-server -c" in first.stdout and f"bus.credentials_dir={tmp_path / 'etc' / 'bus'}" in first.stdout
    before = (tmp_path / "etc" / "bus" / "counter.json").read_text()
    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert again.returncode == 2 and "already holds a recipe" in again.stderr, again.stderr
    assert (tmp_path / "etc" / "bus" / "counter.json").read_text() == before


async def test_a_run_on_a_bus_without_authentication_says_so_loudly(tmp_path: Path) -> None:
    config = write_config(tmp_path / "run.toml", COUNTER_RUN)
    async with NatsServer(NatsServerConfig(store_dir=tmp_path / "open-bus")) as server:
        run = await LiveRun(tmp_path / "run", config, "--set", f"bus.url={server.url}").start()
        try:
            await run.wait_actors("counter", 1)
        finally:
            assert await run.stop() == 0
    (warning,) = run_events(tmp_path / "run", "bus_unauthenticated")
    assert warning["level"] == "warning" and warning["url"] == server.url and "bus_recipe" in warning["fix"]
    assert f"WARNING: the run's bus at {server.url} has no authentication" in run.output()
