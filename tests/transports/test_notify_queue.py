# SPDX-License-Identifier: Apache-2.0
"""The notification queue is bounded (issue #20 item 6): a peer sending 1 MiB messages
faster than they are read gets a typed refusal once 64 MiB are queued, the receiver
counts the drops, and its memory stops growing. Reading the queue makes room again."""
from __future__ import annotations

import pytest

import mooncake_te as mte


def test_full_notification_queue_refuses_and_counts(engine_pair):
    a, b = engine_pair
    msg = b"n" * (1 << 20)
    refused = 0
    for i in range(80):
        try:
            a.send_notification(b.name, msg)
        except mte.TransferError as e:
            assert "notification queue is full" in str(e) and b.name in str(e)
            refused += 1
    assert refused == 80 - 64, f"{refused} of 80 refused"
    assert b.stats()["notifications_dropped"] == refused
    got = b.notifications()
    assert len(got) == 64 and all(n.message == msg for n in got)
    a.send_notification(b.name, b"room again")
    assert [n.message for n in b.notifications()] == [b"room again"]
