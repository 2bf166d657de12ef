"""The consumer-side inbox: turn at-least-once delivery into one effect.

The relay may deliver a message more than once (a lost lease, a timeout
after the receiver already acted, a broker redelivery), always with the same
idempotency key. A receiver records ``(consumer, message_id)`` in its inbox
table *in the same transaction* as the message's effect::

    with inbox.receive(conn, consumer="billing", message_id=key) as fresh:
        if fresh:
            charge(conn, payload)          # same transaction as the inbox row

The first delivery inserts the row and its effect commits with it; a later
duplicate finds the row and skips. A *concurrent* duplicate's INSERT waits on
the first one's uncommitted row: when that commits, the duplicate sees the
conflict and skips; when it rolls back (the effect failed), the duplicate
goes ahead. So exactly one effect lands, under READ COMMITTED (the default);
under REPEATABLE READ or SERIALIZABLE the waiting duplicate gets a
serialization failure instead, which the caller retries.

Effects outside the database (an e-mail, an HTTP call) are not covered: the
inbox only narrows their duplicate window to a failed commit after the effect.

Also here: ``@once`` for plain functions, ``InboxTask`` / ``inbox_task`` for
Celery consumer tasks, ``purge_inbox`` for retention and ``ensure_inbox``
for a consumer database that has no outbox.
"""

from __future__ import annotations

from .celery import InboxTask, inbox_task, message_id_from_request
from .core import (
    INBOX_MIGRATION,
    InboxError,
    InboxTable,
    current_connection,
    ensure_inbox,
    once,
    purge_inbox,
    receive,
    record,
    seen,
)

__all__ = [
    "INBOX_MIGRATION",
    "InboxError",
    "InboxTable",
    "InboxTask",
    "current_connection",
    "ensure_inbox",
    "inbox_task",
    "message_id_from_request",
    "once",
    "purge_inbox",
    "receive",
    "record",
    "seen",
]
