"""The Ray placement backend: each actor process started by a Ray actor on a node of a Ray cluster.

``[runtime] backend = "ray"`` (``ray_address``: a running cluster; empty: a local head started here).
Each actor process is placed by a `runtime.ray_host.ActorHost` Ray actor reserving the kind's
``[actors.<kind>.placement]`` (``num_cpus``, ``num_gpus``, custom ``resources``, ``node_labels`` as a
hard label selector, ``strategy``); the host starts the same command the local backend starts
(runtime.placement.actor_launch) as its child, in its own session, killed with it: one OS process per
actor, its output in ``<run dir>/logs/<id>.out`` on its node and the end of it returned on exit. Starts
overlap (the supervisor asks for a run's processes together; each waits for its own Ray worker, at most
``ray_place_timeout_s``), except those of a "pack" kind, placed in turn so that each sees where the last went.

Ray restarts nothing (``max_restarts=0``, ``max_task_retries=0``): the supervisor's policy is the only
one. A host that dies is classified by its node: the node dead or gone (Ray's node health checks,
bounded by the cluster's ``health_check_period_ms × health_check_failure_threshold``; a local head
started here checks once a second, ``runtime.ray_head_node_lost_checks`` times) makes the process
`lost` (re-placed at once on the nodes that remain), any other death is a crash (counted).

Code on the nodes (what a hot swap changes): with ``ray_working_dir`` empty, the nodes run the code at
the supervisor's own paths (one image on every node, or a shared filesystem: the working directory and
``PYTHONPATH`` of ``runtime.up`` are the process's); with ``ray_working_dir`` set, that directory is
shipped with Ray's ``runtime_env`` ``working_dir`` on each start (Ray uploads it content-addressed, so a
swap after the code changed ships the new code and an unchanged tree is not sent again) and the process
runs from the node's copy. The run directory is each node's own local cache and log folder
(`runtime.rundir`, made where missing): an actor finds its run through the bus's run record and the blob
store (`runtime.run_state`), and its events reach ``ops.tail`` through the bus's log stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import ray.cloudpickle
import structlog
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from runtime import ray_host, store_probe
from runtime.placement import ActorLaunch, PlacementError
from runtime.ready_samples import holder_namespace, kill_holder
from runtime.run_config import ActorSpec, BackendSection, PlacementSpec, RuntimeConfig

log = structlog.get_logger(__name__)

__all__ = ["RayBackend", "RayProcess"]

KILL_TIMEOUT_S = 10.0  # a host that does not answer a kill within this is killed through Ray
UNAVAILABLE_RETRY_S = 1.0  # a host briefly unreachable (not dead): asked again after this ...
MAX_UNAVAILABLE = 60  # ... this many times, then its process is taken as lost
ADMISSION_CONNECT_TIMEOUT_S = 5.0  # the head's port answers within this, or ray.init judges the address
AUTH_MODE_ENV = "RAY_AUTH_MODE"  # Ray's switch for token authentication ("token"), read by every ray process
WORKING_DIR_EXCLUDES = [".git", "runs", "__pycache__", "*.pyc", ".venv"]


class RayProcess:
    """An actor process run by a Ray actor (runtime.placement.PlacedProcess)."""

    def __init__(self, host: Any, info: dict[str, Any], launch: ActorLaunch,
                 on_exit: Callable[[RayProcess], None] = lambda _: None) -> None:
        self._host = host
        self._on_exit = on_exit
        self.pid: int = info["pid"]
        self.node_id: str = info["node_id"]
        self.node = f"{info['hostname']}/{self.node_id[:8]}"
        self.returncode: int | None = None
        self.lost: str | None = None
        self._output_path = launch.output_path
        self._tail = ""
        self._killed = False
        self._exit: asyncio.Future[int] | None = None

    async def wait(self) -> int:
        if self._exit is None:
            self._exit = asyncio.ensure_future(self._await_exit())
        return await asyncio.shield(self._exit)

    async def _await_exit(self) -> int:
        rc = -signal.SIGKILL
        for _ in range(MAX_UNAVAILABLE):
            try:
                result = await self._host.wait.remote()
                rc, self._tail = result["returncode"], result["output_tail"]
                break
            except ray.exceptions.ActorUnavailableError:  # unreachable for now (not dead): ask again
                await asyncio.sleep(UNAVAILABLE_RETRY_S)
            except ray.exceptions.RayActorError as e:
                if not self._killed and not await asyncio.to_thread(_node_alive, self.node_id):
                    self.lost = f"node {self.node} is gone: {_first_line(e)}"
                elif not self._killed:  # its host died on a live node (e.g. Ray's memory monitor): a crash
                    self._tail = f"its Ray actor died: {_first_line(e)}"
                break
        else:
            self.lost = f"node {self.node} unreachable for {MAX_UNAVAILABLE * UNAVAILABLE_RETRY_S:.0f}s"
        self.returncode = rc
        self._on_exit(self)
        with contextlib.suppress(Exception):  # frees its resources now; a dead one is gone already
            ray.kill(self._host, no_restart=True)
        return rc

    def send_signal(self, sig: signal.Signals) -> None:
        if self.returncode is not None:
            raise ProcessLookupError(f"actor process {self.pid} on {self.node} has exited")
        self._host.signal.remote(int(sig))  # fire and forget, as a local signal is: its exit is what counts

    async def kill(self) -> None:
        self._killed = True
        try:
            await asyncio.wait_for(self._host.kill_session.remote(), KILL_TIMEOUT_S)
        except (TimeoutError, ray.exceptions.RayError):  # unreachable or dead: Ray kills its worker, the
            with contextlib.suppress(Exception):  # process dies with it (parent-death signal)
                ray.kill(self._host, no_restart=True)
        await self.wait()

    def output_tail(self) -> str:
        where = f"{self._output_path} on {self.node}"
        return f"{where}; it ended: {self._tail[-1500:]}" if self._tail.strip() else where


class RayBackend:
    """Places actor processes on a Ray cluster (runtime.placement.PlacementBackend)."""

    def __init__(self, section: BackendSection, started_head: bool, namespace: str) -> None:
        self.section = section
        self.started_head = started_head
        self.namespace = namespace  # the run's: its ready-samples holder lives there
        self.address = ray.get_runtime_context().gcs_address
        self._nodes_of_run: dict[str, int] = {}  # node id -> processes placed there ("pack")
        self._host_class = ray.remote(ray_host.ActorHost)  # one class for every start: exported to the cluster once
        self._packing = asyncio.Lock()

    @classmethod
    def connect(cls, section: BackendSection, run_dir: Path) -> RayBackend:
        """Connects to ``section.ray_address``, or starts a local head when it is empty, for the run in ``run_dir``.

        Raises:
            PlacementError: the cluster cannot be reached.
        """
        ray.cloudpickle.register_pickle_by_value(ray_host)  # a node needs no copy of the project to host
        ray.cloudpickle.register_pickle_by_value(store_probe)  # ... nor to probe the store
        namespace = holder_namespace(str(run_dir))
        common: dict[str, Any] = {"namespace": namespace, "log_to_driver": False, "include_dashboard": False,
                                  "logging_level": logging.WARNING, "configure_logging": False}
        if section.ray_address:
            _check_admission(section.ray_address)
        try:
            if section.ray_address:
                ray.init(address=section.ray_address, **common)
            else:
                checks = {"health_check_period_ms": 1000,
                          "health_check_failure_threshold": section.ray_head_node_lost_checks}
                # "local": a new head, always; no address would join the cluster RAY_ADDRESS names, or the last
                # one `ray start` left on this machine (another run's, another user's), not start one
                ray.init(address="local", num_cpus=section.ray_head_num_cpus or None, _system_config=checks,
                         **common)
        except (ConnectionError, RuntimeError, ValueError, ray.exceptions.AuthenticationError) as e:
            raise PlacementError(f"cannot reach the Ray cluster at {section.ray_address or 'a new local head'}: "
                                 f"{e}; fix runtime.ray_address (e.g. 'auto' or 'HOST:6379')") from e
        backend = cls(section, not section.ray_address, namespace)
        log.info("ray_connected", address=backend.address, started_head=backend.started_head,
                 nodes=[_describe(n) for n in _alive_nodes()])
        return backend

    def check(self, config: RuntimeConfig) -> None:
        """Refuses a run the cluster cannot hold: a kind no node can take, a node that cannot reach the store.

        Raises:
            PlacementError: naming the kind and the nodes, or the node and the missing setting.
        """
        nodes = _alive_nodes()
        for kind, spec in config.actors.items():
            if spec.count + spec.standby == 0:
                continue
            if not any(_fits(n, spec.placement) for n in nodes):
                raise PlacementError(
                    f"actors.{kind}.placement asks for {_demand(spec.placement)} on nodes labelled "
                    f"{spec.placement.node_labels or 'anything'}, but no node of the Ray cluster at {self.address} "
                    f"has it: {[_describe(n) for n in nodes]}; start a node with it or change the placement")
        self._check_store_on(nodes, config.storage.url, config.storage.s3_endpoint)

    def _check_store_on(self, nodes: list[dict[str, Any]], url: str, s3_endpoint: str) -> None:
        """Probes the store from every node, with the node's own credentials (an actor process there has
        those, not runtime.up's), so that a node without them fails the start once instead of crash-looping
        every actor placed on it."""
        if not url.startswith("s3://"):
            return
        probe = ray.remote(num_cpus=0, max_retries=0)(store_probe.probe_store)
        pending = {_describe(n)["node"] + f" ({n.get('NodeManagerHostname', '?')})": probe.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(url, s3_endpoint)
            for n in nodes}
        problems: list[str] = []
        timeout = self.section.ray_place_timeout_s
        for node, ref in pending.items():
            try:
                problem = ray.get(ref, timeout=timeout)
            except ray.exceptions.GetTimeoutError:
                problem = f"its probe did not answer within runtime.ray_place_timeout_s={timeout}s"
            except ray.exceptions.RayError as e:
                problem = f"its probe failed: {_first_line(e)}"
            if problem:
                problems.append(f"node {node}: {problem}")
        if problems:
            raise PlacementError(f"storage.url={url} cannot be reached from every Ray node, and every actor process "
                                 f"reads it with its own node's credentials: {'; '.join(problems)}; set it on those "
                                 "nodes (in the environment `ray start` runs with) and start them again")

    async def start(self, launch: ActorLaunch, spec: ActorSpec) -> RayProcess:
        """Places one process; starts run together (the supervisor asks for many at once), except "pack"
        ones, placed one after another so that each goes where the last one landed."""
        if spec.placement.strategy != "pack":
            return await self._place(launch, spec)
        async with self._packing:  # each holder waits at most ray_place_timeout_s
            return await self._place(launch, spec)

    async def _place(self, launch: ActorLaunch, spec: ActorSpec) -> RayProcess:
        placement = spec.placement
        options: dict[str, Any] = {
            "num_cpus": placement.num_cpus, "num_gpus": placement.num_gpus, "resources": dict(placement.resources),
            "max_restarts": 0, "max_task_retries": 0, "name": None}
        if placement.node_labels:
            options["label_selector"] = dict(placement.node_labels)
        if placement.strategy == "spread":
            options["scheduling_strategy"] = "SPREAD"
        elif placement.strategy == "pack" and self._nodes_of_run:  # soft: elsewhere when that node is full
            busiest = max(self._nodes_of_run, key=lambda n: self._nodes_of_run[n])
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(busiest, soft=True)
        if self.section.ray_working_dir:
            options["runtime_env"] = await asyncio.to_thread(_ship, self.section.ray_working_dir)
            cwd, pythonpath = "", ["."]  # the node's copy of the working dir, where the host runs
        else:
            cwd = os.getcwd()
            pythonpath = [cwd, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
        env = {**launch.env, "RAY_ADDRESS": self.address}
        host = self._host_class.options(**options).remote()
        timeout = self.section.ray_place_timeout_s
        try:
            info = await asyncio.wait_for(host.start.remote(list(launch.args), env, cwd, pythonpath,
                                                            str(launch.output_path)), timeout)
        except (TimeoutError, ray.exceptions.RayError) as e:
            _kill_host(host)
            why = f"not started within {timeout}s" if isinstance(e, TimeoutError) else _first_line(e)
            raise PlacementError(f"{launch.actor_id} ({_demand(placement)}, labels {placement.node_labels}): "
                                 f"{why}") from None
        except BaseException:  # cancelled (a start beside it failed, or the run stops): its host goes too
            _kill_host(host)
            raise
        process = RayProcess(host, info, launch, on_exit=self._forget)
        self._nodes_of_run[process.node_id] = self._nodes_of_run.get(process.node_id, 0) + 1
        log.info("actor_placed", actor_id=launch.actor_id, node=process.node, node_id=process.node_id,
                 pid=process.pid, resources=_demand(placement))
        return process

    def _forget(self, process: RayProcess) -> None:
        count = self._nodes_of_run.get(process.node_id, 0) - 1
        if count > 0:
            self._nodes_of_run[process.node_id] = count
        else:
            self._nodes_of_run.pop(process.node_id, None)

    async def close(self) -> None:
        """Ends the run's ready-samples holder (the run is over: nothing will read them), disconnects; a head
        started here stops with it."""
        if await asyncio.to_thread(kill_holder, self.namespace):
            log.info("ready_samples_released", namespace=self.namespace)
        await asyncio.to_thread(ray.shutdown)


def _ship(working_dir: str) -> dict[str, Any]:
    """The runtime_env that carries ``working_dir`` as it is now on this machine to the node.

    A per-actor runtime_env takes only a package URI, so the directory is packaged and uploaded here as
    ``ray.init`` does for a job's working_dir (Ray's own function, private API: ray 2.60), at every start:
    the package is named by its content's hash, so unchanged code is hashed, not sent again."""
    from ray._private.runtime_env.working_dir import upload_working_dir_if_needed

    env = {"working_dir": working_dir, "excludes": WORKING_DIR_EXCLUDES}
    try:
        return upload_working_dir_if_needed(env, include_gitignore=True, logger=logging.getLogger("ray_ship"))
    except (OSError, ValueError, TypeError) as e:
        raise PlacementError(f"runtime.ray_working_dir={working_dir!r} cannot be shipped to the nodes: {e}") from e


def _check_admission(address: str) -> None:
    """Refuses, naming Ray's token authentication, a cluster whose head takes no connection without its token.

    ``ray.init`` says only "Failed to connect" after retrying for 20 s; the cluster's GCS says at once that the
    token is missing or wrong. Nothing is decided for an address nothing answers at (``ray.init`` says so).

    Raises:
        PlacementError: the head requires a token this process does not present.
    """
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=ADMISSION_CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError):  # "auto", a ray:// client address, or nothing listening: ray.init's to judge
        return
    from ray._raylet import GcsClient  # ray 2.60: the cluster's own client, which raises AuthenticationError

    try:
        GcsClient(address=address)
    except ray.exceptions.AuthenticationError as e:
        mode = os.environ.get(AUTH_MODE_ENV, "")
        if mode.lower() != "token":
            raise PlacementError(
                f"the Ray cluster at {address} requires token authentication ({e.message}) and this runtime.up runs "
                f"with {AUTH_MODE_ENV}={mode or '(unset)'}: set {AUTH_MODE_ENV}=token with the head's token "
                "(its ~/.ray/auth_token copied here, or RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH) for runtime.up and "
                "for `ray start` on every node (a head started by `ray start --head` turns token authentication "
                "on by itself where ~/.ray/auth_token exists)") from None
        raise PlacementError(
            f"the Ray cluster at {address} refused this runtime.up's token ({e.message}; {AUTH_MODE_ENV}=token): "
            "give runtime.up and every node the head's token (its ~/.ray/auth_token, or RAY_AUTH_TOKEN / "
            "RAY_AUTH_TOKEN_PATH)") from None
    except Exception:  # any other answer is ray.init's to report, in its own words
        return


def _kill_host(host: Any) -> None:
    """Ends a host that did not start its process (its worker and the resources it holds)."""
    with contextlib.suppress(Exception):  # dead already, or never placed: nothing held
        ray.kill(host, no_restart=True)


def _alive_nodes() -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n.get("Alive")]


def _node_alive(node_id: str) -> bool:
    return any(n["NodeID"] == node_id for n in _alive_nodes())


def _demand(placement: PlacementSpec) -> dict[str, float]:
    need = {"CPU": placement.num_cpus, "GPU": placement.num_gpus, **placement.resources}
    return {k: v for k, v in need.items() if v}


def _fits(node: dict[str, Any], placement: PlacementSpec) -> bool:
    resources, labels = node.get("Resources", {}), node.get("Labels", {})
    return (all(resources.get(k, 0.0) >= v for k, v in _demand(placement).items())
            and all(labels.get(k) == v for k, v in placement.node_labels.items()))


def _describe(node: dict[str, Any]) -> dict[str, Any]:
    resources = {k: v for k, v in node.get("Resources", {}).items()
                 if not k.startswith("node:") and k not in ("memory", "object_store_memory")}
    labels = {k: v for k, v in node.get("Labels", {}).items() if not k.startswith("ray.io/")}
    return {"node": node["NodeID"][:8], "resources": resources, "labels": labels}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    cause = next((line for line in lines if "died because" in line or "node" in line.lower()), None)
    return " ".join(filter(None, [lines[0] if lines else type(e).__name__, cause]))[:500]

