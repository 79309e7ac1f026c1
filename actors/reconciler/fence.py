"""The reconciler's claim on the slot table (fencing): one writer at a time, whatever the processes believe.

A reconciler replaced while frozen (SIGSTOPped, say: found by its unanswered pings, and a new one started)
may wake up. Its next writes must not land, nor anything it does on its old view of the table. So each
reconciler takes the table over when it starts: the ``fence`` entry of the ``slots`` bucket, naming it and
one epoch more than its predecessor's, written with compare-and-set. That write moves the bucket's last
sequence, and every write of the old reconciler is chained on the sequence of its own previous write
(`runtime.bus.ChainedKVWriter`): its first write after the takeover is refused by the server, and so is every
one after. A store's first write expects the sequence the store read when it opened, so a reconciler opens its
store before it confirms its claim: a takeover before that reading is seen by the check, one after it refuses the
write. Where the old one would then rebuild its view (a refused write), and before each side effect
not covered by a write of its own (removing lost actors' leases), it reads the fence: another holder means
it is fenced: it writes nothing more and exits (`Fenced`).
"""

from __future__ import annotations

import dataclasses

import msgpack

from runtime.bus import Bus
from runtime.errors import BusTimeout, RevisionMismatch

__all__ = ["FENCE_KEY", "Fenced", "TableClaim", "check_claim", "take_table"]

FENCE_KEY = "fence"
MAX_TAKEOVER_RACES = 8  # two reconcilers starting at once: one wins each round; more rounds is a fault


class Fenced(RuntimeError):
    """Another reconciler took the table over: this one must write nothing more and exit."""


@dataclasses.dataclass(frozen=True)
class TableClaim:
    holder: str  # the reconciler's actor id
    epoch: int  # 1 for the first reconciler of the run, one more for each takeover
    revision: int  # of the fence entry this claim wrote: the claim holds while the entry is still this one
    previous_holder: str = ""


async def take_table(bus: Bus, bucket: str, holder: str) -> TableClaim:
    """Claims the table for `holder`, fencing off whoever held it.

    Raises:
        Fenced: other reconcilers kept taking the table in the meantime (more than one is running), or took it
            over while this one's write went unanswered (its outcome is read back from the fence).
    """
    for _ in range(MAX_TAKEOVER_RACES):
        entry = await bus.kv_get(bucket, FENCE_KEY)
        previous, epoch = _decode(entry.value) if entry is not None else ("", 0)
        value = msgpack.packb({"holder": holder, "epoch": epoch + 1}, use_bin_type=True)
        try:
            revision = (await bus.kv_cas(bucket, FENCE_KEY, value, entry.revision) if entry is not None
                        else await bus.kv_create(bucket, FENCE_KEY, value))
        except RevisionMismatch:
            continue  # another reconciler took it between the read and the write: read again
        except BusTimeout:  # unanswered, it may have landed (one frozen with its write in flight, woken later)
            now = await bus.kv_get(bucket, FENCE_KEY)
            held, now_epoch = _decode(now.value) if now is not None else ("", 0)
            if now is not None and (held, now_epoch) == (holder, epoch + 1):
                return TableClaim(holder, epoch + 1, now.revision, previous)  # it landed, and still holds
            if now_epoch > epoch + 1:  # it landed and was taken over since, or others took it twice: stale either way
                raise Fenced(f"the slot table was taken over by {held} (epoch {now_epoch}) while {holder}'s takeover "
                             f"(epoch {epoch + 1}) went unanswered: it writes nothing and exits") from None
            continue  # it did not land: read again (one that won meanwhile is taken over from, as on a conflict)
        return TableClaim(holder, epoch + 1, revision, previous)
    raise Fenced(f"the slot table's fence changed {MAX_TAKEOVER_RACES} times while {holder} took it: several "
                 "reconcilers are starting at once (actors.reconciler.count must be 1)")


async def check_claim(bus: Bus, bucket: str, claim: TableClaim) -> None:
    """Returns while `claim` still holds the table.

    Raises:
        Fenced: another reconciler took the table over (named in the message).
    """
    entry = await bus.kv_get(bucket, FENCE_KEY)
    if entry is not None and entry.revision == claim.revision:
        return
    holder, epoch = _decode(entry.value) if entry is not None else ("nobody (the fence was removed)", 0)
    raise Fenced(f"the slot table was taken over by {holder} (epoch {epoch}; this reconciler held epoch "
                 f"{claim.epoch}): it writes nothing more and exits")


def _decode(raw: bytes) -> tuple[str, int]:
    try:
        record = msgpack.unpackb(raw, raw=False)
        return str(record["holder"]), int(record["epoch"])
    except (ValueError, KeyError, TypeError) as e:  # msgpack's errors are ValueErrors
        raise ValueError(f"the slot table's fence entry is unreadable ({e}): only reconcilers write it") from None
