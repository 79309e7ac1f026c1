"""Where `Bus.respond` answers (`runtime.bus.is_reply_inbox`): a role's inbox, the requester's when known."""

from __future__ import annotations

import pytest

from runtime.bus import is_reply_inbox


@pytest.mark.parametrize(("reply", "requester", "answered"), [
    ("_INBOX_rollout.nuid.1", None, True),
    ("_INBOX_rollout.nuid.1", "rollout", True),
    ("_INBOX_supervisor.nuid.1", "rollout", False),  # another role's inbox: a heartbeat spoofing its reply-to
    ("_INBOX.nuid.1", "rollout", True),  # a bus without authentication: no role to tell
    ("ctl.supervisor.stop", None, False),  # a control subject, under allow_responses
    ("$KV.slots.meta", None, False),
    ("_INBOX_rollout.>", None, False),  # no wildcard
    ("_INBOX_rollout", None, False),
    ("_INBOXrollout.a", None, False),
    ("", None, False),
])
def test_a_reply_goes_to_an_inbox_only(reply: str, requester: str | None, answered: bool) -> None:
    assert is_reply_inbox(reply, requester) is answered
