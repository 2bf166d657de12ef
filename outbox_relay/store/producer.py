"""The producer's statements: insert, the ordering lock, NOTIFY."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from ..errors import ConfigError, OperationKeyConflict
from ..sql.queries import Queries
from ..table import OutboxTable
from ._base import queries

__all__ = ["insert_messages"]


def insert_messages(
    conn: psycopg.Connection[Any],
    rows: Sequence[dict[str, Any]],
    *,
    table: OutboxTable,
    lock_keys: Sequence[str],
    notify: bool,
) -> list[int]:
    """Insert validated rows in one (nested) transaction; return their ids in order.

    ``lock_keys`` are the ordered aggregates' advisory-lock keys, taken first
    and in sorted order: two transactions that write aggregates A, B and B, A
    then queue instead of deadlocking.
    """
    q = queries(table)
    try:
        with conn.transaction(), conn.cursor() as cur:
            ids = _insert(cur, q, rows, table, lock_keys, notify)
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn) as exc:
        # The savepoint was rolled back: the caller's transaction is usable.
        raise ConfigError(
            f"the outbox table {table.qualified} is missing or not migrated to this version "
            f"({exc.diag.message_primary}): run `outbox-relay migrate` "
            "(or outbox_relay.migrate(conn))"
        ) from None
    return ids


def _insert(
    cur: psycopg.Cursor[Any],
    q: Queries,
    rows: Sequence[dict[str, Any]],
    table: OutboxTable,
    lock_keys: Sequence[str],
    notify: bool,
) -> list[int]:
    ids: list[int] = []
    for key in sorted(set(lock_keys)):
        cur.execute(q.advisory_lock, {"key": key})
    for params in rows:
        cur.execute(q.insert, params)
        row = cur.fetchone()
        if row is not None:
            ids.append(int(row[0]))
            continue
        # The operation key exists: the same content is the same operation
        # (return its id); anything else is a mistake. The digests are
        # compared, not the payloads, so a producer role needs no right to
        # read other messages (operations.grants).
        cur.execute(q.insert_conflict, params)
        existing = cur.fetchone()
        if existing is None:  # pragma: no cover - the key's row vanished meanwhile
            raise OperationKeyConflict(params["operation_key"], -1)
        if existing[1] is None:
            # Written by an older producer without a digest (a rolling
            # upgrade): only the full comparison can tell.
            cur.execute(q.insert_conflict_full, params)
            existing = cur.fetchone()
            if existing is None:  # pragma: no cover - as above
                raise OperationKeyConflict(params["operation_key"], -1)
        if not existing[1]:
            raise OperationKeyConflict(params["operation_key"], int(existing[0]))
        ids.append(int(existing[0]))
    if notify:
        cur.execute(q.notify, {"channel": table.channel})
    return ids
