"""The bus's client parses each message's header block as nats-py does, only cheaper (runtime.nats_headers)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NatsPyClient

from runtime.bus import BusClient
from runtime.nats_headers import MAX_NAMES, parse_header_lines

# names and values from what a direct get of a KV record carries, and the malformed ones nats-py drops or mends
NAMES = st.sampled_from([b"Nats-Sequence", b"Nats-Subject", b"KV-Operation", b" Nats-Stream ", b"bad name",
                         b"tab\tname", b"\x1cname", b"caf\xc3\xa9", b"", b"Status", b"x"]) | st.binary(max_size=12)
VALUES = st.sampled_from([b" 12345", b"$KV.slots.slot.000001", b" DEL ", b"\xff\xfe", b"a:b", b""]) \
    | st.binary(max_size=20)
LINES = st.tuples(NAMES, st.sampled_from([b":", b": ", b""]), VALUES).map(lambda t: t[0] + t[1] + t[2])


@settings(max_examples=500, deadline=None)
@given(st.lists(LINES, max_size=12), st.sampled_from([b"\r\n", b"\r\n\r\n"]))
def test_a_header_block_parses_as_nats_py_parses_it(lines: list[bytes], end: bytes) -> None:
    raw = b"\r\n".join(lines) + end
    want = NatsPyClient._parse_header_lines(raw)
    names: dict[bytes, str] = {}
    assert parse_header_lines(raw, names) == want
    assert parse_header_lines(raw, names) == want  # the names remembered from the first parse
    assert len(names) <= MAX_NAMES


def test_a_direct_gets_headers_parse_to_the_same_dict_twice() -> None:
    """A name seen before (cached) parses as the first time; the last of a repeated name wins, as in nats-py."""
    raw = (b"Nats-Stream: KV_slots\r\nNats-Subject: $KV.slots.slot.000000001\r\nNats-Sequence: 7\r\n"
           b"KV-Operation: DEL\r\nNats-Sequence: 8\r\n\r\n")
    want = {"Nats-Stream": "KV_slots", "Nats-Subject": "$KV.slots.slot.000000001", "Nats-Sequence": "8",
            "KV-Operation": "DEL"}
    names: dict[bytes, str] = {}
    assert parse_header_lines(raw, names) == parse_header_lines(raw, names) == want
    assert want == NatsPyClient._parse_header_lines(raw)
    assert set(names.values()) == set(want)


def test_the_bus_client_parses_headers_with_it_and_remembers_a_bounded_number_of_names() -> None:
    """nats-py calls the parse through the instance, for plain blocks and those after an inline status; a peer
    sending ever new names grows no client's memory past the bound, and each still parses right."""
    client = BusClient()
    raw = b"".join(b"Name-%d: v\r\n" % i for i in range(MAX_NAMES + 50))
    assert client._parse_header_lines(raw) == NatsPyClient._parse_header_lines(raw)
    assert len(client._header_names) == MAX_NAMES
    assert client._parse_header_lines(b"Nats-Sequence: 3\r\n\r\n") == {"Nats-Sequence": "3"}
