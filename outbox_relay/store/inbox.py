"""The inbox table's statements (``sql/inbox.sql``).

An inbox may have any name a consumer picks, not only ``<outbox>_inbox``
beside an outbox, so its queries are rendered here for an ``InboxTable``
rather than through the outbox's query set. The rules of use (inside the
effect's transaction, ids of bounded size) live in ``outbox_relay.inbox``.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from functools import cache
from typing import Any

import psycopg
from psycopg import sql

from ..sql.queries import raw_migration, raw_queries
from ..table import InboxTable

__all__ = ["INBOX_MIGRATION", "InboxLike", "create", "purge_batch", "record", "seen"]

InboxLike = InboxTable | str | None
# sql/migrations/0002_inbox.sql creates the inbox beside the outbox; create()
# runs the same file under an inbox's own names.
INBOX_MIGRATION = 2


@cache
def _queries(table: InboxTable) -> dict[str, str]:
    identifiers = {
        "inbox": table.identifier,
        "ix_inbox_received": sql.Identifier(f"{table.name}_received"),
        "schema": sql.Identifier(table.schema),
    }
    texts = {name: text for name, text in raw_queries().items() if name.startswith("inbox_")}
    texts["inbox_create"] = raw_migration(INBOX_MIGRATION)
    return {name: sql.SQL(text).format(**identifiers).as_string() for name, text in texts.items()}


def _q(table: InboxLike, name: str) -> str:
    return _queries(InboxTable.parse(table))[name]


def record(
    conn: psycopg.Connection[Any],
    *,
    consumer: str,
    message_id: str,
    table: InboxLike = None,
    now: datetime | None = None,
) -> bool:
    """Insert the inbox row in the caller's transaction; False when it already exists."""
    params = {"consumer": consumer, "message_id": message_id, "now": now}
    row = conn.execute(_q(table, "inbox_record"), params).fetchone()
    return row is not None


def seen(
    conn: psycopg.Connection[Any], *, consumer: str, message_id: str, table: InboxLike = None
) -> bool:
    """Whether the row exists (committed, or written earlier in this transaction)."""
    params = {"consumer": consumer, "message_id": message_id}
    row = conn.execute(_q(table, "inbox_seen"), params).fetchone()
    return bool(row and row[0])


def purge_batch(
    conn: psycopg.Connection[Any],
    *,
    older_than: timedelta,
    consumer: str | None,
    batch: int,
    table: InboxLike = None,
    now: datetime | None = None,
) -> int:
    """Delete one batch of rows received more than ``older_than`` ago, in its own
    transaction (a savepoint inside a caller's); return how many went."""
    params = {"older_than": older_than, "consumer": consumer, "batch": batch, "now": now}
    with conn.transaction():
        deleted = conn.execute(_q(table, "inbox_purge"), params).rowcount
    return max(deleted, 0)


def create(conn: psycopg.Connection[Any], *, table: InboxLike = None) -> InboxTable:
    """Create the inbox (and its schema) if missing; idempotent and safe concurrently."""
    inbox = InboxTable.parse(table)
    q = _queries(inbox)
    with conn.transaction():
        conn.execute(q["inbox_lock"], {"key": inbox.lock_key})
        conn.execute(q["inbox_create_schema"])
        conn.execute(q["inbox_create"])
    return inbox
