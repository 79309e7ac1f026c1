"""ChainedKVWriter's verdict when answers come out of order: a replicated stream refuses a write at
once but stores the writes before it a raft round later, so a failed flush waits for those answers
and reports the first write that failed. The connection is a stand-in that records what is sent;
the answers are the server's JSON, fed in the order a test chooses. (The real server's side is
tests/integration/test_nats_cluster.py.)"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from runtime.bus import ChainedKVWriter, ChainedWriteConflict, KVWriteFailed


@dataclass
class Sent:
    subject: str
    reply: str
    headers: dict[str, str]


@dataclass
class RecordingConnection:
    sent: list[Sent] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    refuse_from: int | None = None  # publishing the write with this index (and after) raises, as nats-py can

    def new_inbox(self) -> str:
        return "_INBOX.test"

    async def publish(self, subject: str, payload: bytes, reply: str = "", headers: Any = None) -> None:
        if self.refuse_from is not None and len(self.sent) >= self.refuse_from:
            raise OSError("the connection's pending buffer is full")
        self.sent.append(Sent(subject, reply, dict(headers or {})))
        self.changed.set()


@dataclass
class Answer:
    subject: str
    data: bytes
    headers: dict[str, str] | None = None


def stored(sent: Sent, sequence: int) -> Answer:
    return Answer(sent.reply, json.dumps({"stream": "KV_slots", "seq": sequence}).encode())


def wrong_last_sequence(sent: Sent, last: int) -> Answer:
    error = {"code": 400, "err_code": 10071, "description": f"wrong last sequence: {last}"}
    return Answer(sent.reply, json.dumps({"error": error}).encode())


def no_stream(sent: Sent) -> Answer:
    return Answer(sent.reply, b"", {"Status": "503"})


async def sent_writes(nc: RecordingConnection, count: int) -> list[Sent]:
    async with asyncio.timeout(5):
        while len(nc.sent) < count:
            nc.changed.clear()
            await nc.changed.wait()
    return nc.sent


async def flushing(writer: ChainedKVWriter, nc: RecordingConnection,
                   *writes: tuple[str, bytes, int | None]) -> tuple[asyncio.Task[None], list[Sent]]:
    """The writes made and a flush of them started; returned once they are all sent."""
    for key, value, expected in writes:
        writer.write(key, value, expected)
    flush = asyncio.create_task(writer.flush())
    return flush, await sent_writes(nc, len(writes))


def replicated_writer(ack_timeout_s: float = 5.0) -> tuple[ChainedKVWriter, RecordingConnection]:
    nc = RecordingConnection()
    writer = ChainedKVWriter(nc, "slots", last_sequence=10, ack_timeout_s=ack_timeout_s,  # type: ignore[arg-type]
                             ack_every_write=True)
    return writer, nc


async def test_a_refusal_outrunning_the_acknowledgement_before_it_waits_for_it_and_is_a_conflict() -> None:
    writer, nc = replicated_writer()
    flush, (e, f) = await flushing(writer, nc, ("slot.1", b"e", 5), ("slot.1", b"f", 9))  # stale
    await writer._on_ack(wrong_last_sequence(f, 5))  # type: ignore[arg-type]  # refused at proposal
    await asyncio.sleep(0.05)
    assert not flush.done(), "the flush waits for the write before the refused one"
    await writer._on_ack(stored(e, 11))  # type: ignore[arg-type]
    with pytest.raises(ChainedWriteConflict):
        await flush
    assert writer._durable == 11, "the stored prefix is known when the flush fails"
    with pytest.raises(KVWriteFailed, match="open a new writer"):
        writer.write("slot.2", b"x", None)


async def test_the_first_write_refused_names_the_failure_whatever_order_the_answers_come_in() -> None:
    writer, nc = replicated_writer()
    flush, (e, f) = await flushing(writer, nc, ("slot.1", b"e", 5), ("slot.1", b"f", 11))
    await writer._on_ack(wrong_last_sequence(f, 10))  # type: ignore[arg-type]
    await writer._on_ack(no_stream(e))  # type: ignore[arg-type]  # the earlier write was the one lost
    with pytest.raises(KVWriteFailed, match=r"no JetStream stream answered the write of 'slot\.1'"):
        await flush
    assert writer._durable == 10


async def test_writes_before_the_refused_one_never_answered_are_dropped_not_another_writer() -> None:
    writer, nc = replicated_writer(ack_timeout_s=0.3)
    flush, (_, g) = await flushing(writer, nc, ("slot.1", b"e", 5), ("slot.2", b"g", None))
    await writer._on_ack(wrong_last_sequence(g, 10))  # type: ignore[arg-type]  # the stream ends before e
    with pytest.raises(KVWriteFailed, match="were not stored") as failed:
        await flush
    assert not isinstance(failed.value, ChainedWriteConflict)


async def test_another_writer_in_the_chain_is_a_conflict_once_the_writes_before_are_stored() -> None:
    writer, nc = replicated_writer()
    flush, (e, g) = await flushing(writer, nc, ("slot.1", b"e", 5), ("slot.2", b"g", None))
    await writer._on_ack(stored(e, 11))  # type: ignore[arg-type]
    await writer._on_ack(wrong_last_sequence(g, 12))  # type: ignore[arg-type]  # someone wrote 12
    with pytest.raises(ChainedWriteConflict):
        await flush


async def test_closing_after_a_refusal_waits_for_the_writes_before_it_so_a_resume_reads_them() -> None:
    """The reconciler's next call fails at once on a broken writer and resumes: it closes the writer,
    then reads the bucket. The close is what must wait, not only the flush that saw the refusal."""
    writer, nc = replicated_writer()
    flush, (e, f) = await flushing(writer, nc, ("slot.1", b"e", 5), ("slot.1", b"f", 9))
    await writer._on_ack(wrong_last_sequence(f, 5))  # type: ignore[arg-type]
    with pytest.raises(KVWriteFailed, match="open a new writer"):
        writer.write("slot.2", b"x", None)  # another caller: refused at once, its resume closes the writer
    close = asyncio.create_task(writer.close())
    later_flush = asyncio.create_task(writer.flush())
    await asyncio.sleep(0.05)
    assert not close.done() and not later_flush.done(), "both wait for the write before the refused one"
    await writer._on_ack(stored(e, 11))  # type: ignore[arg-type]
    await close
    assert writer._durable == 11
    with pytest.raises(ChainedWriteConflict):  # not "dropped": the close did not cut the answer off
        await flush
    with pytest.raises(KVWriteFailed, match="ChainedWriteConflict"):
        await later_flush


async def test_writes_never_answered_after_a_refusal_are_waited_for_until_the_timeout_after_it() -> None:
    writer, nc = replicated_writer(ack_timeout_s=0.3)
    flush, (_, g) = await flushing(writer, nc, ("slot.1", b"e", 5), ("slot.2", b"g", None))
    await writer._on_ack(wrong_last_sequence(g, 10))  # type: ignore[arg-type]
    started = asyncio.get_running_loop().time()
    await asyncio.wait_for(writer.close(), 5)
    assert asyncio.get_running_loop().time() - started < 1.0, "bounded by the timeout after the refusal"
    with pytest.raises(KVWriteFailed, match="were not stored"):
        await flush


async def test_a_connection_refusing_a_write_partway_breaks_the_writer_with_its_own_error() -> None:
    writer, nc = replicated_writer()
    nc.refuse_from = 1
    first = writer.write("slot.1", b"e", 5)
    writer.write("slot.2", b"g", None)
    flush = asyncio.create_task(writer.flush())
    (e,) = await sent_writes(nc, 1)
    await writer._on_ack(stored(e, first))  # type: ignore[arg-type]
    with pytest.raises(KVWriteFailed, match="sending the write to 'slots' at sequence 12 failed"):
        await flush
    assert writer._durable == 11
    with pytest.raises(KVWriteFailed, match="open a new writer"):
        writer.write("slot.3", b"h", None)


async def test_a_send_cancelled_partway_breaks_the_writer() -> None:
    """The revisions handed out after the cancelled send would never be stored: no later write may
    chain on them."""
    writer, nc = replicated_writer()
    blocked = asyncio.Event()

    async def stalls(subject: str, payload: bytes, reply: str = "", headers: Any = None) -> None:
        blocked.set()
        await asyncio.Event().wait()  # a publish waiting on the connection's flow control

    nc.publish = stalls  # type: ignore[method-assign]
    writer.write("slot.1", b"e", 5)
    flush = asyncio.create_task(writer.flush())
    await asyncio.wait_for(blocked.wait(), 5)
    flush.cancel()
    with pytest.raises(asyncio.CancelledError):
        await flush
    with pytest.raises(KVWriteFailed, match="was cancelled at sequence 11"):
        writer.write("slot.2", b"g", None)
