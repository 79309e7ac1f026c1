"""Benchmark: delta weight sync against full safetensors uploads on a >= 100M-parameter model.

A stack of Linear layers (fp32 master weights, Adam) trains on random batches; after every step the
bf16 cast of its weights is published through ``WeightPublisher`` into a file:// blob store while
the next step runs. For lr 1e-6 and 1e-5 it measures, in the same process:

- bytes per step of a delta version against two full uploads of the same bf16 weights:
  ``safetensors.torch.save`` (raw) and that zstd-compressed (``full_zstd``: the same zstd level and
  thread count as the delta codec), and the amortised ratio with one full anchor every K versions.
  The peers send the whole bf16 state every step: verl's checkpoint engines (``verl/checkpoint_engine``:
  NCCL/NIXL/Mooncake buckets of raw bytes) and slime's full paths (``update_weight_from_distributed``:
  NCCL broadcast of bf16 buckets; ``update_weight_from_disk``: an HF safetensors checkpoint) compress
  nothing; slime zstd-compresses only the delta artifacts it optionally writes
  (``delta_weight_update.py``), so ``full_zstd`` is the stronger of the two full baselines;
- seconds per weight sync through the project's blob store (``sync_<store>``: ``file`` by default,
  ``moto`` for a local moto S3 server over HTTP with ``--sync-stores file moto``), each way as a sync
  really goes, encode + upload + download + decode to tensors checked bit for bit: the delta through
  ``WeightPublisher`` and ``WeightSubscriber`` (manifests, checksums, chain replay), the full uploads as
  one object per step; rounds alternate the three ways and medians are reported, with the phases;
- encode and decode throughput in GB/s of bf16 weights (standalone, ``workers`` threads);
- the training-step slowdown caused by publishing: over adjacent pairs of steps, (bf16 snapshot +
  a step run while that version is encoded and uploaded) / (a step with nothing in the background),
  median over pairs (``step_slowdown``); the same ratio of process CPU seconds
  (``step_cpu_overhead``: what the slowdown converges to when training saturates every core); the
  steady state, every step published (``steady_step_slowdown``, against the clean steps: noisier);
- where publishing runs: the caller's share (snapshot + submit, the only part the training loop
  waits for) as a fraction of a step; the step thread's own CPU, busy / clean (publishing adds
  nothing to it); and a GIL probe, the slowdown of pure-Python work on another thread while one
  worker encodes (near 0: numpy, zstd and xxhash release the GIL).

The encoding threads run at ``--worker-nice`` (default: the publisher's, 10) and optionally under
SCHED_IDLE (``--sched-idle``), so they take CPU the step leaves idle first. Under ``nice -n 19`` the
whole process is already at 19 and only ``--sched-idle`` still lowers the workers.

Prints ONE JSON line, with the 1-minute load average at start and end. Goals: ratio >= 30
at lr 1e-6 (against raw safetensors), encode >= 1 GB/s on 2 cores, slowdown <= 5%.

    .venv/bin/python -m tests.bench.weight_sync            # ~100.7M params, ~5 minutes on 2 quiet cores
    .venv/bin/python -m tests.bench.weight_sync --pairs 5 --steps 5    # tighter medians
    .venv/bin/python -m tests.bench.weight_sync --layers 4 --steps 3   # quick smoke run

(Run it with -m from the repository root: as a file, tests/bench/ would shadow the packages.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import safetensors.torch
import structlog
import torch
import zstandard

from model.weight_sync.codec import CodecConfig
from model.weight_sync.publisher import PublisherConfig, WeightPublisher
from model.weight_sync.subscriber import SubscriberConfig, WeightSubscriber
from model.weight_sync.version import decode_version, encode_version
from runtime.blob import BlobStore, open_store

State = dict[str, torch.Tensor]


def build_model(num_layers: int, width: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(num_layers):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def make_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: int) -> Callable[[], None]:
    width = model[0].in_features
    target_W = torch.randn(width, width) / width**0.5

    def step() -> None:
        x_BD = torch.randn(batch, width)
        loss = torch.nn.functional.mse_loss(model(x_BD), x_BD @ target_W)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def on_thread_cpu(step: Callable[[], None]) -> Callable[[], float]:
    """``step`` that returns the CPU seconds of the thread it ran on (the step's own thread)."""

    def run() -> float:
        started = time.thread_time()
        step()
        return time.thread_time() - started

    return run


async def timed_steps(step: Callable[[], None], count: int) -> list[tuple[float, float, float]]:
    """(wall s, process CPU s, step-thread CPU s) per step; process CPU includes background threads."""
    times = []
    for _ in range(count):
        wall, cpu = time.perf_counter(), time.process_time()
        thread_cpu = await asyncio.to_thread(on_thread_cpu(step))
        times.append((time.perf_counter() - wall, time.process_time() - cpu, thread_cpu))
    return times


@dataclasses.dataclass(frozen=True)
class Pair:
    clean_s: float
    clean_cpu_s: float
    clean_thread_cpu_s: float
    busy_s: float  # the bf16 snapshot + the next step, which runs while that version is encoded
    busy_cpu_s: float
    busy_thread_cpu_s: float  # the step thread's own CPU: publishing must add nothing here
    caller_s: float  # snapshot + submit: the only part of publishing the training loop waits for


async def paired_steps(
    step: Callable[[], None], count: int, publish: Callable[[], None], publisher: WeightPublisher
) -> list[Pair]:
    """Adjacent clean/busy step pairs, so load drift on a shared machine cancels within each pair.

    A clean step runs with nothing in the background; then a version is published and the next
    step runs while it is encoded and uploaded. Each busy delta spans two optimizer steps (the
    step before the clean one was not published), which makes its encode work larger, not smaller.
    """
    pairs = []
    for _ in range(count):
        await publisher.flush()
        ((clean_s, clean_cpu_s, clean_thread_s),) = await timed_steps(step, 1)
        wall, cpu = time.perf_counter(), time.process_time()
        publish()
        caller_s = time.perf_counter() - wall
        ((busy_s, busy_cpu_s, busy_thread_s),) = await timed_steps(step, 1)
        wall, cpu = time.perf_counter() - wall - busy_s, time.process_time() - cpu - busy_cpu_s
        pairs.append(Pair(clean_s, clean_cpu_s, clean_thread_s, busy_s + wall, busy_cpu_s + cpu, busy_thread_s,
                          caller_s))  # fmt: skip
    await publisher.flush()
    return pairs


async def run_lr(args: argparse.Namespace, lr: float, blob_root: str) -> dict[str, float | str]:
    model = build_model(args.layers, args.width, args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    step = make_step(model, optimizer, args.batch)
    await timed_steps(step, args.warmup)

    codec = CodecConfig(anchor_every=args.anchor_every, zstd_level=args.zstd_level, workers=args.workers)
    config = PublisherConfig(run=f"bench-lr{lr:g}", codec=codec, retain_versions=4, max_pending=2,
                             worker_nice=args.worker_nice, worker_idle=args.sched_idle)  # fmt: skip
    snapshots: list[State] = []
    async with open_store(f"file://{blob_root}") as store, WeightPublisher(store, config) as publisher:
        version = 0
        params = dict(model.named_parameters())
        anchor = await publisher.submit(version, publisher.snapshot(params))  # first anchor, untimed
        futures = []

        def publish() -> None:
            nonlocal version
            version += 1
            futures.append(publisher.submit(version, publisher.snapshot(params)))  # bf16 copy, recycled buffers

        steady = []
        for _ in range(args.steps):  # consecutive published steps: bytes per step of a one-step delta
            ((wall, _, _),) = await timed_steps(step, 1)
            started = time.perf_counter()
            publish()
            steady.append(wall + time.perf_counter() - started)
            snapshots[:] = [*snapshots[-1:], {name: t.detach().to(torch.bfloat16) for name, t in params.items()}]
        await publisher.flush()
        pairs = await paired_steps(step, args.pairs, publish, publisher)
    published = [f.result() for f in futures if f.exception() is None]
    deltas = [p for p in published[: args.steps] if p.base_version is not None]

    full_bytes = len(safetensors.torch.save(snapshots[-1]))
    full_zstd_bytes = len(encode_full(snapshots[-1], codec))
    delta_bytes = statistics.median(p.num_encoded_bytes for p in deltas)
    k = args.anchor_every
    amortised = (anchor.num_encoded_bytes + (k - 1) * delta_bytes) / k
    sync = {}
    for kind in args.sync_stores:
        async with bench_store(kind, f"{blob_root}/sync-{kind}-lr{lr:g}") as store:
            sync[f"sync_{kind}"] = await measure_sync(store, snapshots, codec, args.sync_rounds, f"sync-lr{lr:g}")
    return {
        "delta_bytes_per_step": delta_bytes,
        "anchor_bytes": anchor.num_encoded_bytes,
        "full_safetensors_bytes": full_bytes,
        "full_zstd_bytes": full_zstd_bytes,
        "bytes_ratio": full_bytes / delta_bytes,
        "bytes_ratio_vs_full_zstd": full_zstd_bytes / delta_bytes,
        f"bytes_ratio_amortised_k{k}": full_bytes / amortised,
        f"bytes_ratio_vs_full_zstd_amortised_k{k}": full_zstd_bytes / amortised,
        **sync,
        **measure_codec(snapshots, codec, args.reps),
        **gil_probe(snapshots, codec, args.reps),
        "step_s_clean_median": statistics.median(p.clean_s for p in pairs),
        "step_slowdown": statistics.median(p.busy_s / p.clean_s for p in pairs) - 1.0,
        "steady_step_slowdown": statistics.median(steady[1:] or steady) / statistics.median(p.clean_s for p in pairs)
        - 1.0,
        "step_cpu_overhead": statistics.median(p.busy_cpu_s / p.clean_cpu_s for p in pairs) - 1.0,
        "step_thread_cpu_ratio": statistics.median(p.busy_thread_cpu_s / p.clean_thread_cpu_s for p in pairs),
        "caller_share_s_median": statistics.median(p.caller_s for p in pairs),
        "caller_share_of_step": statistics.median(p.caller_s / p.clean_s for p in pairs),
        "num_published": len(published),
        "num_failed_or_superseded": len(futures) - len(published),
        "publisher_encode_s_median": statistics.median(p.encode_s for p in deltas),
    }


def encode_full(state: State, codec: CodecConfig, compress: bool = True) -> bytes:
    """The whole state as one safetensors blob, zstd-compressed at the codec's level and threads."""
    raw = safetensors.torch.save(state)
    if not compress:
        return raw
    return zstandard.ZstdCompressor(level=codec.zstd_level, threads=codec.workers).compress(raw)


def decode_full(blob: bytes, compress: bool = True) -> State:
    return safetensors.torch.load(zstandard.ZstdDecompressor().decompress(blob) if compress else blob)


def _same_bits(got: State, want: State) -> None:
    if got.keys() != want.keys():
        raise AssertionError(f"synced state has tensors {sorted(got)}, expected {sorted(want)}")
    for name, tensor in want.items():
        if not torch.equal(got[name].view(torch.int16), tensor.view(torch.int16)):
            raise AssertionError(f"synced {name} is not bit exact")


@contextlib.asynccontextmanager
async def bench_store(kind: str, root: str) -> AsyncIterator[BlobStore]:
    """``file``: a file:// store under ``root``; ``moto``: a fresh local moto S3 server over HTTP."""
    if kind == "file":
        async with open_store(f"file://{root}") as store:
            yield store
        return
    import boto3

    from runtime.blob.testing import MotoServer

    for name, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():  # fmt: skip
        os.environ.setdefault(name, value)  # moto accepts any; nothing here reaches a real S3
    with MotoServer() as moto:
        boto3.client("s3", endpoint_url=moto.endpoint).create_bucket(Bucket="bench")
        async with open_store("s3://bench/weights", s3_endpoint=moto.endpoint) as store:
            yield store


async def measure_sync(store: BlobStore, snapshots: list[State], codec: CodecConfig, rounds: int,
                       run: str) -> dict[str, float]:  # fmt: skip
    """Seconds per weight sync, encode to decoded tensors, three ways through ``store``; medians.

    The delta way is the project's: ``WeightPublisher.submit`` (encode + upload, at the step's
    priority here so that the three ways compete alike) then ``WeightSubscriber.fetch`` by a reader
    holding the previous version (list, manifest, download, verify, decode). Versions alternate the
    last two published states, so every round syncs a one-step delta. The full ways put and get
    one object per round.
    """
    times: dict[str, list[float]] = {}

    def note(**phases: float) -> None:
        for key, value in phases.items():
            times.setdefault(key, []).append(value)

    async def full(way: str, state: State, version: int, compress: bool) -> None:
        key = f"{way}/{run}/v{version:010d}.safetensors" + (".zst" if compress else "")
        t0 = time.perf_counter()
        blob = await asyncio.to_thread(encode_full, state, codec, compress)
        t1 = time.perf_counter()
        await store.put(key, blob)
        t2 = time.perf_counter()
        fetched = await store.get(key)
        t3 = time.perf_counter()
        rebuilt = await asyncio.to_thread(decode_full, fetched, compress)
        t4 = time.perf_counter()
        _same_bits(rebuilt, state)
        await store.delete(key)
        note(**{f"{way}_s": t4 - t0, f"{way}_encode_s": t1 - t0, f"{way}_upload_s": t2 - t1,
                f"{way}_download_s": t3 - t2, f"{way}_decode_s": t4 - t3})  # fmt: skip

    config = PublisherConfig(run=run, codec=codec, retain_versions=4, worker_nice=0)
    async with WeightPublisher(store, config) as publisher:
        with WeightSubscriber(store, SubscriberConfig(run=run, workers=codec.workers)) as subscriber:
            await publisher.submit(0, publisher.snapshot(snapshots[0]))  # the anchor both hold
            await subscriber.fetch(0)
            for version in range(1, rounds + 1):
                state = snapshots[version % 2]
                copy = publisher.snapshot(state)  # the training loop's share, the same for every way
                t0 = time.perf_counter()
                published = await publisher.submit(version, copy)
                t1 = time.perf_counter()
                rebuilt = await subscriber.fetch(version)
                t2 = time.perf_counter()
                if published.base_version != version - 1:
                    raise AssertionError(f"version {version} was not a one-step delta: {published}")
                _same_bits(rebuilt, state)
                note(delta_s=t2 - t0, delta_encode_s=published.encode_s, delta_upload_s=published.upload_s,
                     delta_fetch_s=t2 - t1, delta_bytes=published.num_encoded_bytes)  # fmt: skip
                await full("full_zstd", state, version, compress=True)
                await full("full_raw", state, version, compress=False)
    result = {key: statistics.median(values) for key, values in times.items()}
    result["speedup_vs_full_zstd"] = result["full_zstd_s"] / result["delta_s"]
    result["speedup_vs_full_raw"] = result["full_raw_s"] / result["delta_s"]
    return result


def _timed(fn: Callable[[], object]) -> tuple[object, float, float]:
    """(result, wall seconds, CPU seconds of the whole process: all worker threads)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def measure_codec(snapshots: list[State], codec: CodecConfig, reps: int) -> dict[str, float]:
    """Standalone codec timings on the last two published states (no training running)."""
    previous, latest = snapshots
    weight_gb = sum(t.nbytes for t in latest.values()) / 1e9
    with ThreadPoolExecutor(codec.workers) as pool:
        anchor, anchor_enc_s, anchor_enc_cpu = _timed(
            lambda: encode_version(previous, None, run="bench", version=0, config=codec, executor=pool)
        )
        base, anchor_dec_s, _ = _timed(lambda: decode_version(anchor.manifest, anchor.shards, None, executor=pool))
        enc, dec = [], []
        for _ in range(reps):
            delta, wall, cpu = _timed(
                lambda: encode_version(latest, base, run="bench", version=1, config=codec, executor=pool)
            )
            enc.append((wall, cpu))
            rebuilt, wall, cpu = _timed(lambda d=delta: decode_version(d.manifest, d.shards, base, executor=pool))
            dec.append((wall, cpu))
    for name, tensor in latest.items():  # only correct rebuilds count
        if not torch.equal(rebuilt.tensors[name].view(torch.int16), tensor.view(torch.int16)):
            raise AssertionError(f"decode of {name} is not bit exact")
    encodings = sorted({t.encoding for t in delta.manifest.tensors})
    return {
        "encode_gbps": weight_gb / statistics.median(w for w, _ in enc),
        "encode_gbps_per_cpu_s": weight_gb / statistics.median(c for _, c in enc),
        "decode_gbps": weight_gb / statistics.median(w for w, _ in dec),
        "decode_gbps_per_cpu_s": weight_gb / statistics.median(c for _, c in dec),
        "anchor_encode_gbps": weight_gb / anchor_enc_s,
        "anchor_encode_gbps_per_cpu_s": weight_gb / anchor_enc_cpu,
        "anchor_decode_gbps": weight_gb / anchor_dec_s,
        "delta_encodings": "+".join(encodings),
    }


def _python_work(n: int = 4_000_000) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


def gil_probe(snapshots: list[State], codec: CodecConfig, rounds: int) -> dict[str, float]:
    """How much pure-Python work on another thread slows while a version is encoded in the background.

    One encode worker (plus its driver) beside one Python thread: on 2 cores they need not share
    a CPU, so a slowdown near 0 says encoding leaves the GIL free (numpy, zstd and xxhash release
    it); an encoder holding the GIL would slow the Python thread towards 2x. Rounds alternate
    alone / beside, medians compared.
    """
    previous, latest = snapshots
    one = dataclasses.replace(codec, workers=1)
    base = encode_version(previous, None, run="bench", version=0, config=one).state
    alone, beside, num_encodes = [], [], 0
    with ThreadPoolExecutor(1) as pool, ThreadPoolExecutor(1) as driver:
        for _ in range(rounds):
            _, wall, _ = _timed(_python_work)
            alone.append(wall)
            stop = threading.Event()

            def encode_until_stopped(stop: threading.Event = stop) -> int:
                count = 0
                while not stop.is_set():
                    encode_version(latest, base, run="bench", version=1, config=one, executor=pool)
                    count += 1
                return count

            running = driver.submit(encode_until_stopped)
            _, wall, _ = _timed(_python_work)
            beside.append(wall)
            stop.set()
            num_encodes += running.result()
    return {
        "python_thread_slowdown_while_encoding": statistics.median(beside) / statistics.median(alone) - 1.0,
        "gil_probe_encodes": num_encodes,
    }


async def main(args: argparse.Namespace) -> dict[str, object]:
    num_params = sum(p.numel() for p in build_model(args.layers, args.width, args.seed).parameters())
    result: dict[str, object] = {
        "bench": "weight_sync",
        "num_params": num_params,
        "torch_threads": torch.get_num_threads(),
        "cpus": len(os.sched_getaffinity(0)),
        "load_avg_1m_start": round(os.getloadavg()[0], 2),
        "config": {k: v for k, v in vars(args).items()},
    }
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="weight-sync-bench-") as root:
        for lr in args.lrs:
            measured = await run_lr(args, lr, root)
            result[f"lr_{lr:g}"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in measured.items()}
    result["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    low = result[f"lr_{args.lrs[0]:g}"]
    assert isinstance(low, dict)
    result["goals"] = {
        "bytes_ratio_at_lowest_lr>=30": low["bytes_ratio"] >= 30,
        "encode_gbps>=1": min(result[f"lr_{lr:g}"]["encode_gbps"] for lr in args.lrs) >= 1.0,  # type: ignore[index]
        "step_slowdown<=0.05": max(result[f"lr_{lr:g}"]["step_slowdown"] for lr in args.lrs) <= 0.05,  # type: ignore[index]
    }
    return result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24, help="Linear layers (24 x 2048^2 = 100.7M params)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1024, help="rows (tokens) of the random batch per step")
    parser.add_argument("--steps", type=int, default=3, help="consecutive published steps (bytes, codec)")
    parser.add_argument("--pairs", type=int, default=3, help="clean/busy step pairs (slowdown)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3, help="repetitions of the standalone codec timing")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--anchor-every", type=int, default=10)
    parser.add_argument("--zstd-level", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--worker-nice",
        type=int,
        default=PublisherConfig.worker_nice,
        help="nice value of the publisher's encoding threads (0 = the step's priority)",
    )
    parser.add_argument("--sched-idle", action="store_true", help="encoding threads under SCHED_IDLE")
    parser.add_argument(
        "--sync-stores",
        nargs="+",
        choices=("file", "moto"),
        default=["file"],
        help="blob stores the seconds-per-sync rounds go through (moto: a local S3 server)",
    )
    parser.add_argument("--sync-rounds", type=int, default=3, help="rounds of delta / full_zstd / full_raw sync")
    return parser.parse_args()


if __name__ == "__main__":
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout: one JSON line
    print(json.dumps(asyncio.run(main(parse_args()))))
