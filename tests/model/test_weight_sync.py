"""Weight delta codec, publisher and subscriber against file:// and s3:// (a real moto server)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import boto3
import pytest
import torch
from structlog.testing import capture_logs

from model.weight_sync import (
    FORMAT,
    BaseMismatch,
    CorruptVersion,
    IncompleteVersion,
    Manifest,
    PublishFailed,
    VersionUnavailable,
    manifest_key,
    partition,
    rank_part,
)
from model.weight_sync._priority import lower_thread_priority
from model.weight_sync.codec import CodecConfig
from model.weight_sync.publisher import PublisherConfig, WeightPublisher
from model.weight_sync.subscriber import SubscriberConfig, WeightSubscriber
from model.weight_sync.version import WeightState, decode_version, encode_version
from runtime.blob import BlobStore, open_store
from runtime.blob.testing import FaultProxy, MotoServer

NUM_STEPS = 50
State = dict[str, torch.Tensor]


# -- a small model really trained: fp32 masters, Adam, bf16 published -----------------------------


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(32, 64)
        self.norm = torch.nn.BatchNorm1d(64)  # fp32 running stats + an int64 step counter
        self.hidden = torch.nn.Linear(64, 64)
        self.out = torch.nn.Linear(64, 8)

    def forward(self, x_BD: torch.Tensor) -> torch.Tensor:
        h_BH = torch.nn.functional.gelu(self.norm(self.inp(x_BD)))
        return self.out(torch.nn.functional.gelu(self.hidden(h_BH)))


def published_state(model: torch.nn.Module) -> State:
    """What the trainer publishes: floating tensors cast to bf16, integer buffers as they are."""
    return {
        name: (t.detach().to(torch.bfloat16) if t.is_floating_point() else t.detach().clone())
        for name, t in model.state_dict().items()
    }


@functools.cache
def training_chain(lr: float) -> tuple[State, ...]:
    """Published states of versions 0..NUM_STEPS of a real Adam run at ``lr``."""
    torch.manual_seed(1234)
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    target_W = torch.randn(32, 8)
    states = [published_state(model)]
    for _ in range(NUM_STEPS):
        x_BD = torch.randn(64, 32)
        loss = torch.nn.functional.mse_loss(model(x_BD), x_BD @ target_W)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        states.append(published_state(model))
    return tuple(states)


def assert_bit_exact(got: State, want: State) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)), name


def bits_changed(a: State, b: State) -> int:
    return sum(int((a[n].view(-1).view(torch.uint8) != b[n].view(-1).view(torch.uint8)).sum()) for n in a)


# -- stores --------------------------------------------------------------------------------------


pytestmark = pytest.mark.usefixtures("aws_env")  # moto and proxy come from tests/s3_fixtures.py


@pytest.fixture(params=["file", "s3"])
async def store(
    request: pytest.FixtureRequest, tmp_path: Path, moto: MotoServer, proxy: FaultProxy
) -> AsyncIterator[BlobStore]:
    if request.param == "file":
        blob_store = open_store(f"file://{tmp_path}/blobs")
    else:
        bucket = f"weights-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=moto.endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        blob_store = open_store(f"s3://{bucket}/ckpt", s3_endpoint=proxy.endpoint, backoff_base_s=0.01)
    proxy.clear()
    async with blob_store:
        yield blob_store
    proxy.clear()


async def publish_all(
    store: BlobStore, states: tuple[State, ...], *, anchor_every: int, run: str = "run1", retain: int = 1000
) -> list[int | None]:
    """Publish every state as versions 0..n-1; returns each version's base version."""
    config = PublisherConfig(
        run=run,
        codec=CodecConfig(anchor_every=anchor_every),
        retain_versions=retain,
        max_pending=len(states),
        backoff_base_s=0.01,
    )
    async with WeightPublisher(store, config) as publisher:
        futures = [publisher.submit(v, dict(state)) for v, state in enumerate(states)]
        results = await asyncio.gather(*futures)
    return [result.base_version for result in results]


def subscriber(store: BlobStore, run: str = "run1") -> WeightSubscriber:
    return WeightSubscriber(store, SubscriberConfig(run=run, backoff_base_s=0.01))


def planned(logs: list[dict], target: int) -> dict:
    return next(e for e in logs if e["event"] == "weights_fetch_planned" and e["target"] == target)


# -- reconstruction across a real training chain -------------------------------------------------


# Both learning rates on one store: the rate shapes the deltas, the store only carries them.
@pytest.mark.parametrize(("store", "lr"), [("file", 1e-6), ("file", 1e-5), ("s3", 1e-6)], indirect=["store"])
async def test_chain_of_50_steps_rebuilds_bit_exact(store: BlobStore, lr: float) -> None:
    states = training_chain(lr)
    assert bits_changed(states[0], states[NUM_STEPS]) > 0, "training must really move bf16 weights"
    bases = await publish_all(store, states, anchor_every=10)
    assert bases == [None if v % 10 == 0 else v - 1 for v in range(NUM_STEPS + 1)]

    with subscriber(store) as reader, capture_logs() as logs:  # from the first anchor, every step
        for version in range(NUM_STEPS + 1):
            assert_bit_exact(await reader.fetch(version), states[version])
        assert planned(logs, 9)["start"] == 0 or planned(logs, 9)["num_steps"] == 1

    with subscriber(store) as reader, capture_logs() as logs:  # cold starts from mid-chain anchors
        assert_bit_exact(await reader.fetch(27), states[27])
        assert planned(logs, 27) | {"held": None, "start": 20, "from_anchor": True, "num_steps": 8} == planned(logs, 27)
        assert_bit_exact(await reader.fetch(29), states[29])  # replays 28, 29 from what it holds
        assert planned(logs, 29)["start"] == 28 and not planned(logs, 29)["from_anchor"]
        assert_bit_exact(await reader.fetch(43), states[43])  # fell behind: jumps to anchor 40
        assert planned(logs, 43)["start"] == 40 and planned(logs, 43)["from_anchor"]
        assert_bit_exact(await reader.fetch(50), states[50])
        assert planned(logs, 50)["num_steps"] == 1


async def test_delta_is_much_smaller_than_anchor_at_rl_learning_rate(tmp_path: Path) -> None:
    states = training_chain(1e-6)
    async with open_store(f"file://{tmp_path}") as store:
        config = PublisherConfig(run="r", codec=CodecConfig(anchor_every=100), max_pending=100)
        async with WeightPublisher(store, config) as publisher:
            results = await asyncio.gather(*(publisher.submit(v, s) for v, s in enumerate(states[:6])))
    anchor, deltas = results[0], results[1:]
    assert all(d.num_encoded_bytes * 5 < anchor.num_encoded_bytes for d in deltas)


# -- codec units ---------------------------------------------------------------------------------


def _states_with_every_encoding() -> tuple[State, State]:
    torch.manual_seed(0)
    base: State = {
        "same_bf16": torch.randn(64, 32).bfloat16(),
        "sparse_bf16": torch.randn(128, 64).bfloat16(),
        "dense_f32": torch.randn(1000),
        "new_values_f16": torch.randn(50, 3).half(),
        "steps_i64": torch.tensor(7),
        "mask_bool": torch.rand(33) > 0.5,
        "bytes_u8": torch.randint(0, 255, (17,), dtype=torch.uint8),
        "cplx": torch.randn(5, dtype=torch.complex128),
        "empty": torch.empty(0, 4),
    }
    new = {name: t.clone() for name, t in base.items()}
    new["sparse_bf16"].view(-1)[::97] += 1
    new["dense_f32"] += 1e-3 * torch.randn(1000)
    new["new_values_f16"] = torch.randn(50, 3).half()
    new["steps_i64"] += 1
    new["mask_bool"] = ~new["mask_bool"]
    new["cplx"][2] = 1j
    new["added"] = torch.arange(6, dtype=torch.int32)
    return base, new


def test_encode_decode_every_dtype_and_encoding() -> None:
    base_state, new_state = _states_with_every_encoding()
    config = CodecConfig(anchor_every=4)
    anchor = encode_version(base_state, None, run="r", version=3, config=config)
    assert anchor.manifest.is_anchor and {t.encoding for t in anchor.manifest.tensors} == {"raw"}
    rebuilt_base = decode_version(anchor.manifest, anchor.shards, None)
    assert_bit_exact(rebuilt_base.tensors, base_state)

    delta = encode_version(new_state, anchor.state, run="r", version=5, config=config)
    encodings = {t.name: t.encoding for t in delta.manifest.tensors}
    assert encodings["same_bf16"] == "same" and encodings["empty"] == "same"
    assert encodings["sparse_bf16"] == "xor_sparse"
    assert encodings["dense_f32"] == "xor"
    assert encodings["new_values_f16"] in ("raw", "xor")
    assert encodings["added"] == "raw"
    assert delta.manifest.base_version == 3
    manifest = Manifest.from_json(delta.manifest.to_json(), where="roundtrip")
    assert manifest == delta.manifest
    assert_bit_exact(decode_version(manifest, delta.shards, rebuilt_base).tensors, new_state)


def test_anchor_every_k_versions() -> None:
    config = CodecConfig(anchor_every=3)
    state: State = {"w": torch.zeros(4, dtype=torch.bfloat16)}
    base: WeightState | None = None
    kinds = []
    for version in range(7):
        state = {"w": state["w"] + 1}
        encoded = encode_version(state, base, run="r", version=version, config=config)
        kinds.append(encoded.manifest.base_version)
        base = encoded.state
    assert kinds == [None, 0, 1, None, 3, 4, None]


def test_decode_refuses_a_delta_whose_base_does_not_match() -> None:
    base_state, new_state = _states_with_every_encoding()
    config = CodecConfig()
    v1 = encode_version(base_state, None, run="r", version=1, config=config)
    v2 = encode_version(new_state, v1.state, run="r", version=2, config=config)
    v3 = encode_version(base_state, v2.state, run="r", version=3, config=config)
    with pytest.raises(BaseMismatch, match="delta against version 2"):
        decode_version(v3.manifest, v3.shards, v1.state)  # skips version 2: out of order
    with pytest.raises(BaseMismatch, match="base offered is version None"):
        decode_version(v2.manifest, v2.shards, None)
    tampered = dataclasses.replace(v1.state, tensors=dict(v1.state.tensors), checksums=dict(v1.state.checksums))
    tampered.tensors["same_bf16"] = tampered.tensors["same_bf16"].clone()
    tampered.tensors["same_bf16"][0, 0] += 1  # a base modified in place keeps its recorded checksums
    with pytest.raises(BaseMismatch, match="same_bf16"):
        decode_version(v2.manifest, v2.shards, tampered)


def test_decode_detects_damaged_and_truncated_shards() -> None:
    base_state, new_state = _states_with_every_encoding()
    v1 = encode_version(base_state, None, run="r", version=1, config=CodecConfig())
    v2 = encode_version(new_state, v1.state, run="r", version=2, config=CodecConfig())
    shard = v2.shards[0]
    flipped = bytearray(shard)
    flipped[len(shard) // 2] ^= 0x10
    with pytest.raises(CorruptVersion, match="checksum"):
        decode_version(v2.manifest, [bytes(flipped)], v1.state)
    with pytest.raises(CorruptVersion, match="truncated"):
        decode_version(v2.manifest, [shard[:-3]], v1.state)
    lying = dataclasses.replace(v2.manifest.tensors[0], checksum="0" * 32)
    manifest = dataclasses.replace(v2.manifest, tensors=(lying, *v2.manifest.tensors[1:]))
    with pytest.raises(CorruptVersion, match="rebuilt bits fail checksum"):
        decode_version(manifest, v2.shards, v1.state)
    with pytest.raises(CorruptVersion, match="malformed"):
        Manifest.from_json(json.dumps({"format": FORMAT, "run": 3}).encode(), where="x")
    raw = json.loads(v2.manifest.to_json())
    for field, value in [("version", "2"), ("base_version", 7)]:
        with pytest.raises(CorruptVersion, match=r"non-integer|not older"):
            Manifest.from_json(json.dumps({**raw, field: value}).encode(), where="x")
    raw["tensors"][0]["frames"][0][1] = -5
    with pytest.raises(CorruptVersion, match="negative"):
        Manifest.from_json(json.dumps(raw).encode(), where="x")


def test_shards_split_by_size_and_config_validation() -> None:
    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(5)}
    encoded = encode_version(state, None, run="r", version=0, config=CodecConfig(shard_bytes=8192))
    assert len(encoded.manifest.shards) == 3
    assert_bit_exact(decode_version(encoded.manifest, encoded.shards, None).tensors, state)
    with pytest.raises(ValueError, match="anchor_every=0"):
        CodecConfig(anchor_every=0)
    with pytest.raises(ValueError, match="run='a/b'"):
        PublisherConfig(run="a/b")
    with pytest.raises(ValueError, match="retain_versions=0"):
        PublisherConfig(run="r", retain_versions=0)


# -- failures in the store: detected, never applied, recovered from the next anchor ------------


async def _corrupt(store: BlobStore, key: str, how: str) -> None:
    data = await store.get(key)
    if how == "flip":
        damaged = bytearray(data)
        damaged[len(data) // 3] ^= 0xFF
        await store.put(key, bytes(damaged))
    elif how == "truncate":
        await store.put(key, data[: len(data) // 2])
    else:
        await store.delete(key)


def _shard(version: int) -> str:
    return f"weights/run1/v{version:010d}/rank-00000-of-00001/shard-00000.bin"


async def test_bad_deltas_are_never_applied_and_reader_recovers(store: BlobStore) -> None:
    states = training_chain(1e-5)[:25]
    await publish_all(store, states, anchor_every=5)  # anchors 0, 5, 10, 15, 20
    await _corrupt(store, _shard(8), "flip")
    await _corrupt(store, _shard(12), "truncate")
    await _corrupt(store, _shard(17), "delete")
    await store.delete(manifest_key("weights", "run1", 18))
    await store.put(manifest_key("weights", "run1", 22), await store.get(manifest_key("weights", "run1", 23)))

    with subscriber(store) as reader, capture_logs() as logs:
        assert_bit_exact(await reader.fetch(7), states[7])
        for target, error in [(8, CorruptVersion), (9, CorruptVersion)]:
            with pytest.raises(error, match="shard 0"):
                await reader.fetch(target)
            assert reader.version == 7
            assert_bit_exact(reader.tensors, states[7])  # nothing applied
        assert_bit_exact(await reader.fetch(11), states[11])  # recovers from anchor 10
        with pytest.raises(CorruptVersion, match="truncated"):
            await reader.fetch(12)
        assert reader.version == 11
        assert_bit_exact(await reader.fetch(16), states[16])  # recovers from anchor 15
        with pytest.raises(VersionUnavailable, match="missing"):
            await reader.fetch(17)
        with pytest.raises(VersionUnavailable, match="version 18"):
            await reader.fetch(19)
        assert reader.version == 16
        assert_bit_exact(await reader.fetch(21), states[21])
        with pytest.raises(CorruptVersion, match="out of order"):
            await reader.fetch(22)  # the manifest under v22's key describes version 23
        with pytest.raises(CorruptVersion, match="out of order"):
            await reader.fetch(23)  # its chain needs the mislabelled v22
        assert_bit_exact(reader.tensors, states[21])
    rejected = [e for e in logs if e["event"] in ("weights_version_rejected", "weights_chain_broken")]
    assert len(rejected) == 7  # 8, 9, 12, 17 rejected on apply; 19, 22, 23 on planning


async def test_delta_from_another_branch_is_refused(store: BlobStore) -> None:
    states = training_chain(1e-5)[:4]
    await publish_all(store, states, anchor_every=10)
    # Another writer put a v3 encoded against its own v2, which differs from the published v2.
    forked = {name: t.clone() for name, t in states[2].items()}
    forked["out.bias"][0] += 1
    fork_base = encode_version(forked, None, run="run1", version=2, config=CodecConfig()).state
    fork_base = dataclasses.replace(fork_base, anchor_version=0, num_since_anchor=2)
    fake = encode_version(states[3], fork_base, run="run1", version=3, config=CodecConfig())
    for entry, blob in zip(fake.manifest.shards, fake.shards, strict=True):
        await store.put(entry.key, blob)
    await store.put(fake.manifest_key, fake.manifest.to_json())
    with subscriber(store) as reader:
        await reader.fetch(2)
        with pytest.raises(BaseMismatch, match="state checksum"):
            await reader.fetch(3)
        assert_bit_exact(reader.tensors, states[2])


# -- publisher: background work, retries, failures, GC -------------------------------------------


async def test_publisher_retries_transient_errors_and_reanchors_after_failure(tmp_path: Path) -> None:
    class FlakyStore:
        """A file store whose puts fail with ConnectionError while ``failures`` lasts."""

        def __init__(self, inner: BlobStore) -> None:
            self.inner, self.failures, self.num_failed = inner, 0, 0

        async def put(self, key: str, data: bytes) -> None:
            if self.failures:
                self.failures -= 1
                self.num_failed += 1
                raise ConnectionError("injected transient failure")
            await self.inner.put(key, data)

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

    states = training_chain(1e-5)[:6]
    async with open_store(f"file://{tmp_path}") as inner:
        store = FlakyStore(inner)
        config = PublisherConfig(run="run1", max_attempts=3, backoff_base_s=0.001, backoff_max_s=0.01)
        async with WeightPublisher(store, config) as publisher:
            store.failures = 2
            assert (await publisher.submit(0, states[0])).version == 0
            assert (await publisher.submit(1, states[1])).base_version == 0
            store.failures = 3  # more than max_attempts: version 2 fails for good
            with pytest.raises(PublishFailed, match="uploading version 2"):
                await publisher.submit(2, states[2])
            v3 = await publisher.submit(3, states[3])
            assert v3.base_version is None  # version 2 never existed for readers: start an anchor
            assert (await publisher.submit(4, states[4])).base_version == 3
        assert store.num_failed == 5
        with subscriber(inner) as reader:
            assert_bit_exact(await reader.fetch(4), states[4])
            with pytest.raises(VersionUnavailable):
                await reader.fetch(2)


async def test_a_failed_shard_upload_cancels_the_others_before_the_version_fails(tmp_path: Path) -> None:
    """No upload of a failed version runs on past its failure (outside the upload limit, beside the
    next version's): the shards still in flight are cancelled and awaited first."""

    class OneShardRefused:
        def __init__(self, inner: BlobStore) -> None:
            self.inner, self.in_flight, self.num_cancelled = inner, 0, 0
            self.others_started = asyncio.Event()

        async def put(self, key: str, data: bytes) -> None:
            if "/shard-" not in key:
                return await self.inner.put(key, data)
            self.in_flight += 1
            try:
                if key.endswith("shard-00000.bin"):
                    await self.others_started.wait()
                    raise PermissionError("injected: this shard's key is not writable")
                self.others_started.set()
                await asyncio.Event().wait()  # a slow upload, still running when the first one fails
            except asyncio.CancelledError:
                self.num_cancelled += 1
                raise
            finally:
                self.in_flight -= 1

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(5)}
    async with open_store(f"file://{tmp_path}") as inner:
        store = OneShardRefused(inner)
        config = PublisherConfig(run="run1", codec=CodecConfig(shard_bytes=8192), max_attempts=1)
        async with WeightPublisher(store, config) as publisher:
            with pytest.raises(PublishFailed, match="not writable"):
                await asyncio.wait_for(publisher.submit(0, state), 30)
            assert store.in_flight == 0 and store.num_cancelled >= 1


async def test_publisher_retries_through_s3_faults(moto: MotoServer, proxy: FaultProxy) -> None:
    bucket = f"faults-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=moto.endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    states = training_chain(1e-6)[:3]
    async with open_store(f"s3://{bucket}", s3_endpoint=proxy.endpoint, backoff_base_s=0.01) as store:
        config = PublisherConfig(run="run1", backoff_base_s=0.01)
        async with WeightPublisher(store, config) as publisher:
            for version, state in enumerate(states):
                proxy.fail_next(2)
                proxy.reset_next(1)
                await publisher.submit(version, state)
        with subscriber(store) as reader:
            assert_bit_exact(await reader.fetch(2), states[2])
    assert proxy.num_faults >= 9


async def test_retention_keeps_the_anchor_retained_versions_need(store: BlobStore) -> None:
    states = training_chain(1e-5)[:14]
    await publish_all(store, states, anchor_every=4, retain=3)  # anchors 0, 4, 8, 12
    with subscriber(store) as reader:
        assert await reader.versions() == [8, 9, 10, 11, 12, 13]  # 11 needs anchor 8 and 9, 10
        stored = {int(key.split("/v")[1][:10]) for key in await store.list("weights/run1/")}
        assert stored == {8, 9, 10, 11, 12, 13}  # shards of deleted versions are gone too
        assert_bit_exact(await reader.fetch(11), states[11])
        with pytest.raises(VersionUnavailable):
            await reader.fetch(7)


async def test_submit_never_waits_and_supersedes_when_behind(tmp_path: Path) -> None:
    states = training_chain(1e-5)[:8]
    async with open_store(f"file://{tmp_path}") as store:
        config = PublisherConfig(run="run1", max_pending=2)
        async with WeightPublisher(store, config) as publisher:
            futures = [publisher.submit(v, s) for v, s in enumerate(states)]  # no await in between
            with pytest.raises(ValueError, match="greater than the last"):
                publisher.submit(3, states[3])
        outcomes = [f.exception() is None for f in futures]
        assert outcomes[-2:] == [True, True] and not all(outcomes)
        published = [f.result() for f in futures if f.exception() is None]
        with subscriber(store) as reader:
            assert_bit_exact(await reader.fetch(7), states[7])
            assert await reader.versions() == [p.version for p in published]
        with pytest.raises(RuntimeError, match="closed"):
            publisher.submit(9, states[0])


async def test_snapshot_buffers_are_recycled_without_corrupting_bases(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    expected: list[State] = []
    pointers: list[set[int]] = []
    async with open_store(f"file://{tmp_path}") as store:
        config = PublisherConfig(run="run1", codec=CodecConfig(anchor_every=4))
        async with WeightPublisher(store, config) as publisher:
            for version in range(8):
                state = publisher.snapshot(model.state_dict())
                assert all(state[n].dtype == torch.bfloat16 for n in state if n != "norm.num_batches_tracked")
                expected.append({name: t.clone() for name, t in state.items()})
                pointers.append({t.data_ptr() for t in state.values()})
                await publisher.submit(version, state)
                x_BD = torch.randn(16, 32)
                model(x_BD).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
        with subscriber(store) as reader:
            for version in range(8):
                assert_bit_exact(await reader.fetch(version), expected[version])
    assert any(pointers[v] == pointers[u] for v in range(8) for u in range(v))  # buffers were reused


# -- ranks: each publishes its part, readers assemble complete versions -------------------------


async def publish_ranks(store: BlobStore, states: tuple[State, ...], versions: range, world_size: int, **kw) -> None:
    """Versions published by ``world_size`` publishers (ranks of one process), each its own part."""
    async with contextlib.AsyncExitStack() as stack:
        publishers = [
            await stack.enter_async_context(
                WeightPublisher(store, PublisherConfig(run="run1", rank=rank, world_size=world_size,
                                                       max_pending=len(states), backoff_base_s=0.01, **kw))
            )
            for rank in range(world_size)
        ]  # fmt: skip
        futures = [
            publisher.submit(v, rank_part(states[v], rank, world_size))
            for v in versions
            for rank, publisher in enumerate(publishers)
        ]
        results = await asyncio.gather(*futures)
    assert {(r.rank, r.world_size) for r in results} == {(rank, world_size) for rank in range(world_size)}


def test_partition_is_deterministic_disjoint_and_balanced() -> None:
    sizes = {f"w{i}": (i % 7 + 1) * 1000 for i in range(40)}
    parts = partition(sizes, 3)
    assert parts == partition(dict(reversed(sizes.items())), 3)  # insertion order does not matter
    assert set().union(*parts) == set(sizes) and sum(map(len, parts)) == len(sizes)
    loads = [sum(sizes[n] for n in part) for part in parts]
    assert max(loads) - min(loads) <= max(sizes.values())
    with pytest.raises(ValueError, match="rank=2"):
        rank_part({"a": torch.zeros(1)}, 2, 2)


async def test_two_ranks_publish_parts_and_the_reader_assembles_them(store: BlobStore) -> None:
    states = training_chain(1e-5)[:12]
    await publish_ranks(store, states, range(11), world_size=2)  # version 11 comes later, from rank 0 only
    with subscriber(store) as reader, capture_logs() as logs:
        assert await reader.versions() == list(range(11))
        for version in (0, 3, 7, 10):
            assert_bit_exact(await reader.fetch(version), states[version])
        assert len(reader.parts) == 2 and all(part.version == 10 for part in reader.parts)
        assert {planned(logs, 10)["num_steps"]} == {e["num_steps"] for e in logs if e.get("target") == 10
                                                    and e["event"] == "weights_fetch_planned"} == {1}  # fmt: skip

        async with WeightPublisher(store, PublisherConfig(run="run1", rank=0, world_size=2)) as rank0:
            await rank0.submit(11, rank_part(states[11], 0, 2))
        assert await reader.versions() == list(range(11))  # incomplete: not a version yet
        with pytest.raises(IncompleteVersion, match=r"ranks \{2: \[1\]\}"):
            await reader.fetch(11)
        assert reader.version == 10
        assert_bit_exact(reader.tensors, states[10])  # nothing applied
    with subscriber(store) as cold:  # a reader starting mid-chain replays each rank from its anchor
        assert_bit_exact(await cold.fetch(9), states[9])


async def test_ranks_publishing_the_same_tensor_are_refused(tmp_path: Path) -> None:
    states = training_chain(1e-5)[:2]
    async with open_store(f"file://{tmp_path}") as store:
        for rank in range(2):
            async with WeightPublisher(store, PublisherConfig(run="run1", rank=rank, world_size=2)) as publisher:
                await publisher.submit(0, states[0])  # the whole state from both ranks
        with subscriber(store) as reader, pytest.raises(CorruptVersion, match="another rank has"):
            await reader.fetch(0)
        assert reader.version is None


async def test_retention_with_two_ranks_deletes_each_ranks_old_parts(tmp_path: Path) -> None:
    states = training_chain(1e-5)[:10]
    async with open_store(f"file://{tmp_path}") as store:
        await publish_ranks(store, states, range(10), world_size=2, retain_versions=2,
                            codec=CodecConfig(anchor_every=4))  # fmt: skip
        stored = {key.split("/")[2:4][0] + "/" + key.split("/")[3] for key in await store.list("weights/run1/")}
        assert stored == {f"v{v:010d}/rank-0000{r}-of-00002" for v in (8, 9) for r in (0, 1)}
        with subscriber(store) as reader:
            assert await reader.versions() == [8, 9]
            assert_bit_exact(await reader.fetch(9), states[9])


def test_worker_priority_is_lowered_in_the_worker_thread_only() -> None:
    import os
    import threading

    def in_thread(nice: int) -> int:
        result: list[int] = []

        def work() -> None:
            lower_thread_priority(nice, idle=False)
            result.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        return result[0]

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert in_thread(19) == 19
    assert in_thread(0) == before  # never raised back above what the process has
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
    with pytest.raises(ValueError, match="worker_nice=20"):
        PublisherConfig(run="r", worker_nice=20)
    with pytest.raises(ValueError, match="rank=2"):
        PublisherConfig(run="r", rank=2, world_size=2)
