"""A NATS message's header block parsed as nats-py parses it, only cheaper: what the bus's client
(`runtime.bus.BusClient`) parses each message's headers with.

nats-py parses every message's header block line by line and checks each header name for whitespace
character by character, in a generator: at 10 headers a record, a bulk read of 10^5 KV records (a
reconciler's resume, `runtime.bus.Bucket.current`) spent about 1.3 of its 4.6 CPU-seconds there. Header
names are few and repeat on every message (``Nats-Sequence``, ``Nats-Subject``, ...), so this parse checks
each distinct name once (remembered by the caller, a bounded number of them) and gives the same result as
nats-py for every block: the same names kept and dropped, the same values, the last of a repeated name winning.
Pure bytes to strings: only `runtime.bus` imports nats-py.
"""

from __future__ import annotations

__all__ = ["MAX_NAMES", "header_name", "parse_header_lines"]

_CRLF = b"\r\n"
MAX_NAMES = 1024  # distinct names a client remembers: a peer sending ever new ones costs a check each, no memory


def header_name(raw: bytes) -> str | None:
    """The header name `raw` (the line before its colon) stands for, or None where nats-py drops the line: a
    name that is not ASCII or holds whitespace."""
    try:
        name = raw.strip().decode("ascii")
    except UnicodeDecodeError:
        return None
    return None if any(c.isspace() for c in name) else name


def parse_header_lines(raw: bytes, names: dict[bytes, str]) -> dict[str, str]:
    """A NATS header block (``Name: Value`` per CRLF-ended line, after the ``NATS/1.0`` line) as nats-py's
    ``Client._parse_header_lines`` reads it: lines without a colon and malformed names are skipped,
    values stripped and decoded as UTF-8 (malformed bytes replaced). `names` remembers the names already
    checked (`header_name`), up to ``MAX_NAMES`` of them."""
    out: dict[str, str] = {}
    for line in raw.split(_CRLF):
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        key = names.get(name)
        if key is None:
            if (key := header_name(name)) is None:
                continue
            if len(names) < MAX_NAMES:
                names[name] = key
        out[key] = value.strip().decode("utf-8", "replace")
    return out
