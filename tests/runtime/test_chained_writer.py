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

    def new_inbox(self) -> str:
        return "_INBOX.test"

    async def publish(self, subject: str, payload: bytes, reply: str = "", headers: Any = None) -> None:
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


def replicated_writer(ack_timeout_s: float = 5.0) -> tuple[ChainedKVWriter, RecordingConnection]:
    nc = RecordingConnection()
    writer = ChainedKVWriter(nc, "slots", last_sequence=10, ack_timeout_s=ack_timeout_s,  # type: ignore[arg-type]
                             ack_every_write=True)
    return writer, nc


async def test_a_refusal_outrunning_the_acknowledgement_before_it_waits_for_it_and_is_a_conflict() -> None:
    writer, nc = replicated_writer()
    writer.write("slot.1", b"e", 5)
    writer.write("slot.1", b"f", 9)  # stale
    flush = asyncio.create_task(writer.flush())
    e, f = await sent_writes(nc, 2)
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
    writer.write("slot.1", b"e", 5)
    writer.write("slot.1", b"f", 11)
    flush = asyncio.create_task(writer.flush())
    e, f = await sent_writes(nc, 2)
    await writer._on_ack(wrong_last_sequence(f, 10))  # type: ignore[arg-type]
    await writer._on_ack(no_stream(e))  # type: ignore[arg-type]  # the earlier write was the one lost
    with pytest.raises(KVWriteFailed, match=r"no JetStream stream answered the write of 'slot\.1'"):
        await flush
    assert writer._durable == 10


async def test_writes_before_the_refused_one_never_answered_are_dropped_not_another_writer() -> None:
    writer, nc = replicated_writer(ack_timeout_s=0.3)
    writer.write("slot.1", b"e", 5)
    writer.write("slot.2", b"g", None)
    flush = asyncio.create_task(writer.flush())
    _, g = await sent_writes(nc, 2)
    await writer._on_ack(wrong_last_sequence(g, 10))  # type: ignore[arg-type]  # the stream ends before e
    with pytest.raises(KVWriteFailed, match="were not stored") as failed:
        await flush
    assert not isinstance(failed.value, ChainedWriteConflict)


async def test_another_writer_in_the_chain_is_a_conflict_once_the_writes_before_are_stored() -> None:
    writer, nc = replicated_writer()
    writer.write("slot.1", b"e", 5)
    writer.write("slot.2", b"g", None)
    flush = asyncio.create_task(writer.flush())
    e, g = await sent_writes(nc, 2)
    await writer._on_ack(stored(e, 11))  # type: ignore[arg-type]
    await writer._on_ack(wrong_last_sequence(g, 12))  # type: ignore[arg-type]  # someone wrote 12
    with pytest.raises(ChainedWriteConflict):
        await flush
