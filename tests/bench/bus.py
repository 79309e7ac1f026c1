"""Benchmark: one durable actor stage on NATS JetStream vs the same stage as a local Ray actor.

    .venv/bin/python -m tests.bench.bus [--messages 3000] [--concurrency 32] [--trials 3]

NATS side: a real run (``python -m runtime.up``, embedded nats-server) whose supervisor runs one
``EchoActor`` process consuming ``work.echo`` through the kind's durable pull consumer; the driver
here publishes each request durably (JetStream, acknowledged by the server, with a message id) and the
handler replies on core NATS, then the base acks the work message. Ray side: an async Ray actor with
the same handler, called from the same driver. Both sides run with the same bounded number of
requests in flight (throughput, and latency under load), then with one in flight (latency alone).
Trials alternate between the two; the JSON line has the medians over trials.

Latency = publish (or ``.remote()``) to the end of the handler, both read from CLOCK_MONOTONIC, which
is shared by every process on the machine. Throughput = messages / (first send to last reply).
Prints ONE JSON line on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import structlog

from runtime.actor import Actor, Delivery
from runtime.bus import Bus, work_queue
from runtime.bus_auth import SUPERVISOR, BusAccess
from runtime.codec import Codec, message
from runtime.rundir import RunInfo

REPO = Path(__file__).resolve().parents[2]
REPLY_SUBJECT = "bench.done"


@message("bench.echo")
class EchoRequest:
    seq: int
    sent_at: float  # CLOCK_MONOTONIC of the driver, just before sending


def echo(seq: int, sent_at: float) -> tuple[int, float, float]:
    """The stage's handler on both sides: trivial work, then (seq, sent_at, completed_at)."""
    return seq, sent_at, time.monotonic()


class EchoActor(Actor):
    kind = "echo"
    queues = (work_queue("echo"),)
    messages = (EchoRequest,)
    bus_access = BusAccess(publish=(REPLY_SUBJECT,))

    async def handle(self, msg: EchoRequest, delivery: Delivery) -> None:  # type: ignore[override]
        await self.bus.nc.publish(REPLY_SUBJECT, msgpack.packb(echo(msg.seq, msg.sent_at)))


class RayEcho:
    """The Ray side's actor class (wrapped with ray.remote at run time: no Ray import here)."""

    async def handle(self, seq: int, sent_at: float) -> tuple[int, float, float]:
        return echo(seq, sent_at)


@dataclass(frozen=True)
class Trial:
    msgs_per_s: float
    p50_ms: float
    p99_ms: float


def summarize(n: int, elapsed_s: float, latencies_s: list[float]) -> Trial:
    q = statistics.quantiles(latencies_s, n=100, method="inclusive")
    return Trial(n / elapsed_s, 1000 * statistics.median(latencies_s), 1000 * q[98])


# --- drivers -----------------------------------------------------------------------------------------
async def drive(
    n: int, concurrency: int, send: Callable[[int], Awaitable[None]], replies: asyncio.Queue[tuple[int, float, float]]
) -> Trial:
    """Keeps ``concurrency`` requests in flight until n replies came back."""
    slots = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def collect() -> None:
        seen: set[int] = set()
        while len(latencies) < n:
            seq, sent_at, done_at = await replies.get()
            if seq in seen:  # a redelivered request (at-least-once): its first reply already counted
                continue
            seen.add(seq)
            latencies.append(done_at - sent_at)
            slots.release()

    started = time.monotonic()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(collect())
        for seq in range(n):
            await slots.acquire()
            tg.create_task(send(seq))
    return summarize(n, time.monotonic() - started, latencies)


class NatsStage:
    """Sends to the EchoActor of a live run; replies come back on core NATS."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.codec = Codec([EchoRequest])
        self.replies: asyncio.Queue[tuple[int, float, float]] = asyncio.Queue()
        self.num_sent = 0

    async def start(self) -> None:
        async def on_reply(raw: Any) -> None:
            self.replies.put_nowait(tuple(msgpack.unpackb(raw.data)))

        await self.bus.nc.subscribe(REPLY_SUBJECT, cb=on_reply)

    async def send(self, seq: int) -> None:
        self.num_sent += 1
        data = await self.codec.encode(EchoRequest(seq, time.monotonic()))
        await self.bus.publish_durable("work.echo", data, msg_id=f"echo-{self.num_sent}")

    async def trial(self, n: int, concurrency: int) -> Trial:
        return await drive(n, concurrency, self.send, self.replies)


class RayStage:
    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.replies: asyncio.Queue[tuple[int, float, float]] = asyncio.Queue()

    async def send(self, seq: int) -> None:
        self.replies.put_nowait(await self.handle.handle.remote(seq, time.monotonic()))

    async def trial(self, n: int, concurrency: int) -> Trial:
        return await drive(n, concurrency, self.send, self.replies)


# --- set-up ------------------------------------------------------------------------------------------
async def start_run(run_dir: Path, concurrency: int, auth: bool) -> tuple[subprocess.Popen[bytes], Bus]:
    config = run_dir.parent / "bench.toml"
    config.write_text(
        f'[log]\nlevel = "info"\n\n[actors.echo]\nentry = "tests.bench.bus:EchoActor"\n'
        f"count = 1\nmax_concurrency = {concurrency}\n\n[bus]\nauth = {'true' if auth else 'false'}\n"
    )
    out = open(run_dir.parent / "up.out", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once, before timing
        [sys.executable, "-m", "runtime.up", "--config", str(config), "--run-dir", str(run_dir), "--quiet"],
        cwd=REPO,
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    out.close()
    async with asyncio.timeout(60):
        while not (run_dir / "run.json").exists():
            if proc.poll() is not None:
                raise RuntimeError(f"runtime.up exited {proc.returncode}: {(run_dir.parent / 'up.out').read_text()}")
            await asyncio.sleep(0.05)
    info = RunInfo.read(run_dir)
    bus = await Bus.connect(info.nats_url, name="bench", **info.bus_options(SUPERVISOR))
    await bus.ensure_queue(work_queue("echo"))
    return proc, bus


async def start_ray(concurrency: int) -> Any:
    import ray  # only the driver needs Ray; the actor process imports this module too

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    handle = ray.remote(max_concurrency=concurrency)(RayEcho).remote()
    await handle.handle.remote(0, time.monotonic())  # the worker process is up
    return handle


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-bus-") as tmp:
        proc, bus = await start_run(Path(tmp) / "run", args.concurrency, args.auth == "on")
        try:
            t0 = time.monotonic()
            ray_handle = await start_ray(args.concurrency)
            ray_init_s = time.monotonic() - t0
            stages = {"nats": NatsStage(bus), "ray": RayStage(ray_handle)}
            await stages["nats"].start()
            loaded: dict[str, list[Trial]] = {"nats": [], "ray": []}
            single: dict[str, list[Trial]] = {"nats": [], "ray": []}
            for stage in stages.values():  # warm-up: connections, consumers, code paths
                await stage.trial(args.warmup, args.concurrency)
            for trial in range(args.trials):
                for name, stage in stages.items():
                    loaded[name].append(await stage.trial(args.messages, args.concurrency))
                    single[name].append(await stage.trial(args.single_messages, 1))
                    print(
                        f"trial {trial} {name}: {loaded[name][-1]} one in flight: {single[name][-1]}", file=sys.stderr
                    )
        finally:
            await bus.close()
            proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(proc.wait, 60)
            import ray

            ray.shutdown()
    return report(args, loaded, single, ray_init_s)


def _median(trials: list[Trial], key: str) -> float:
    return round(statistics.median(getattr(t, key) for t in trials), 3)


def report(
    args: argparse.Namespace, loaded: dict[str, list[Trial]], single: dict[str, list[Trial]], ray_init_s: float
) -> dict[str, Any]:
    med = {
        name: {
            "msgs_per_s": _median(loaded[name], "msgs_per_s"),
            "p50_ms": _median(loaded[name], "p50_ms"),
            "p99_ms": _median(loaded[name], "p99_ms"),
            "p50_ms_one_in_flight": _median(single[name], "p50_ms"),
            "p99_ms_one_in_flight": _median(single[name], "p99_ms"),
        }
        for name in loaded
    }
    return {
        "bench": "bus",
        "stage": "one durable work-queue stage, trivial handler",
        "nats_actor": "subprocess under the runtime.up supervisor",
        "messages": args.messages,
        "auth": args.auth,
        "concurrency": args.concurrency,
        "trials": args.trials,
        "cpus": os.cpu_count(),
        "nats": med["nats"],
        "ray": med["ray"],
        "ratio_msgs_per_s_nats_over_ray": round(med["nats"]["msgs_per_s"] / med["ray"]["msgs_per_s"], 3),
        "ratio_p50_nats_over_ray": round(med["nats"]["p50_ms"] / med["ray"]["p50_ms"], 3),
        "ratio_p99_nats_over_ray": round(med["nats"]["p99_ms"] / med["ray"]["p99_ms"], 3),
        "ratio_p50_one_in_flight_nats_over_ray": round(
            med["nats"]["p50_ms_one_in_flight"] / med["ray"]["p50_ms_one_in_flight"], 3
        ),
        "ray_init_s": round(ray_init_s, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=3000, help="messages per trial and side")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (and handler slots)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--single-messages", type=int, default=500, help="messages per trial with one in flight")
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--auth", choices=["on", "off"], default="on",
                   help="the NATS side's bus authentication and per-role permissions (runtime.bus_auth)")
    args = p.parse_args()
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    import uvloop

    print(json.dumps(uvloop.run(main_async(args))), flush=True)


if __name__ == "__main__":
    main()
