"""The placement configuration ([runtime] and [actors.<kind>.placement]) and the one actor launch."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.actor_launch import RunAddress
from runtime.errors import ConfigError
from runtime.placement import actor_launch
from runtime.run_config import ActorSpec, dump_toml, load_run_config

_RUN = '''
[actors.sandbox]
entry = "tests.integration.workers:CounterActor"
count = 2
threads = 3
[actors.sandbox.placement]
num_cpus = 0.5
num_gpus = 0
resources = {sandbox = 1}
node_labels = {zone = "a"}
strategy = "spread"
'''


def test_placement_and_backend_round_trip_through_the_run_file(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(_RUN)
    cfg = load_run_config([tmp_path / "run.toml"], ['runtime.backend="ray"', 'runtime.ray_address="auto"'])
    placement = cfg.runtime.actors["sandbox"].placement
    assert (placement.num_cpus, placement.resources, placement.node_labels, placement.strategy) == (
        0.5, {"sandbox": 1.0}, {"zone": "a"}, "spread")
    assert (cfg.runtime.runtime.backend, cfg.runtime.runtime.ray_address) == ("ray", "auto")
    (tmp_path / "config.toml").write_text(dump_toml(cfg.to_toml_tree()))
    assert load_run_config([tmp_path / "config.toml"]) == cfg


def test_the_local_backend_is_the_default(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(_RUN)
    assert load_run_config([tmp_path / "run.toml"]).runtime.runtime.backend == "local"


@pytest.mark.parametrize(("override", "message"), [
    ('runtime.backend="kubernetes"', "must be one of ('local', 'ray')"),
    ('runtime.ray_address="auto"', "runtime.backend is 'local'"),
    ('actors.sandbox.placement.strategy="scatter"', "must be one of ('default', 'spread', 'pack')"),
    ("actors.sandbox.placement.num_cpus=-1", "outside its range"),
    ("actors.sandbox.placement.resources={CPU = 2}", "not CPU/GPU: use num_cpus"),
    ("actors.sandbox.placement.resources={sandbox = -1}", "amounts in [0, 1e6]"),
    ("runtime.ray_place_timeout_s=0", "outside its range"),
])
def test_bad_placement_is_refused_naming_the_key(tmp_path: Path, override: str, message: str) -> None:
    (tmp_path / "run.toml").write_text(_RUN)
    with pytest.raises((ConfigError, ValueError), match=None) as caught:
        load_run_config([tmp_path / "run.toml"], [override])
    assert message in str(caught.value)


def test_one_launch_for_every_backend(tmp_path: Path) -> None:
    address = RunAddress("nats://127.0.0.1:4222", "20261201-000000-r-ab12")
    spec = ActorSpec(entry="m:C", threads=3)
    launch = actor_launch(address, tmp_path, "sandbox", "sandbox-1-ab12", spec, standby=True)
    assert launch.args == ("-m", "runtime.actor_process", "--bus", address.nats_url, "--run", address.run_id,
                           "--run-dir", str(tmp_path), "--kind", "sandbox", "--id", "sandbox-1-ab12", "--standby")
    assert launch.env == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3"}
    assert launch.output_path == tmp_path / "logs" / "sandbox-1-ab12.out"
    assert actor_launch(address, tmp_path, "k", "k-1-00", ActorSpec(entry="m:C", threads=0)).env == {}
    ranked = actor_launch(address, tmp_path, "trainer", "trainer-1-00", ActorSpec(entry="m:C", ranks=2, threads=0),
                          rank=1)
    assert ranked.env == {"ASYNCRL_RANK": "1", "ASYNCRL_WORLD_SIZE": "2"}
