"""The one capped exponential backoff of the runtime: every retry delay that doubles goes through it.

``base * 2 ** n`` overflows for an unbounded count ``n``: from n = 1024 the int power is too large to
become a float (OverflowError), so a retry loop bounded by time rather than by a count (the blob store's
full-disk wait, ``runtime.blob._space``) raised that instead of its own error after an hour or so.
(``model`` may not import ``runtime``: ``model.weight_sync.store.Retry`` doubles its delay in its loop.)
"""

from __future__ import annotations

__all__ = ["doubling"]

_MAX_DOUBLINGS = 1023
"""2.0 ** 1023 is the largest power of two a float holds; a float product past it is inf, not an error."""


def doubling(base_s: float, max_s: float, doublings: int) -> float:
    """``base_s`` doubled ``doublings`` times (none for a count <= 0), at most ``max_s``; for any count.

    Past 1023 doublings any positive base of a normal float has long reached any cap: the exponent stops
    there, and a product too large for a float is inf, which the cap replaces.
    """
    return min(max_s, base_s * 2.0 ** min(max(0, doublings), _MAX_DOUBLINGS))
