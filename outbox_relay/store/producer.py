"""The producer's statements: insert, the ordering lock, NOTIFY.

The sequence of statements is written once, as a plan (``insert_plan``): a
generator that yields each statement and is sent back its first row. The
sync driver here and the asyncio drivers (``store/aio.py``: psycopg
``AsyncConnection`` and asyncpg) run the same plan, so the three cannot drift
apart in what they lock, insert or compare.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from ..errors import ConfigError, OperationKeyConflict
from ..table import OutboxTable
from ._base import queries
from ._plan import Plan, Statement, run

__all__ = ["insert_messages", "insert_plan", "missing_table"]


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
    try:
        with conn.transaction():
            return run(conn, insert_plan(rows, table=table, lock_keys=lock_keys, notify=notify))
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn) as exc:
        # The savepoint was rolled back: the caller's transaction is usable.
        raise missing_table(table, exc.diag.message_primary) from None


def missing_table(table: OutboxTable, detail: str | None) -> ConfigError:
    """The error for an outbox table that is absent or behind this version."""
    return ConfigError(
        f"the outbox table {table.qualified} is missing or not migrated to this version "
        f"({detail}): run `{table.migrate_command}` (or {table.migrate_call})"
    )


def insert_plan(
    rows: Sequence[dict[str, Any]],
    *,
    table: OutboxTable,
    lock_keys: Sequence[str],
    notify: bool,
) -> Plan[list[int]]:
    """The statements of one insert, run by any driver (see ``_plan``)."""
    q = queries(table)
    keys = sorted(set(lock_keys))
    if len(keys) == 1:
        yield Statement(q.advisory_lock, {"key": keys[0]})
    elif keys:
        yield Statement(q.advisory_locks, {"keys": keys})
    inserted: list[int | None]
    if len(rows) == 1:
        row = yield Statement(q.insert, rows[0], fetch="one")
        inserted = [None if row is None else int(row[0])]
    else:
        returned = yield Statement(q.insert_many, _columns(rows), fetch="all")
        inserted = _in_order(rows, returned)
    ids: list[int] = []
    for params, new_id in zip(rows, inserted, strict=True):
        if new_id is not None:
            ids.append(new_id)
            continue
        # The operation key exists: the same content is the same operation
        # (return its id); anything else is a mistake. The digests are
        # compared, not the payloads, so a producer role needs no right to
        # read other messages (operations.grants).
        existing = yield Statement(q.insert_conflict, params, fetch="one")
        if existing is None:  # pragma: no cover - the key's row vanished meanwhile
            raise OperationKeyConflict(params["operation_key"], -1)
        if existing[1] is None:
            # Written by an older producer without a digest (a rolling
            # upgrade): only the full comparison can tell.
            existing = yield Statement(q.insert_conflict_full, params, fetch="one")
            if existing is None:  # pragma: no cover - as above
                raise OperationKeyConflict(params["operation_key"], -1)
        if not existing[1]:
            first = int(existing[0])
            raise OperationKeyConflict(params["operation_key"], first, same_batch=first in ids)
        ids.append(int(existing[0]))
    if notify:
        yield Statement(q.notify, {"channel": table.channel})
    return ids


def _columns(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """insert_many's parameters: one array per column, in the rows' order."""
    first = rows[0]
    return {
        "aggregate_types": [r["aggregate_type"] for r in rows],
        "aggregate_ids": [r["aggregate_id"] for r in rows],
        "event_types": [r["event_type"] for r in rows],
        "payloads": [r["payload"] for r in rows],
        "headers": [r["headers"] for r in rows],
        "operation_keys": [r["operation_key"] for r in rows],
        "ordered": [bool(r["ordered"]) for r in rows],
        "delays": [r["delay"] for r in rows],
        # The same for every row of a batch (producer.prepare).
        "now": first["now"],
        "trace_keys": first["trace_keys"],
    }


def _in_order(rows: Sequence[dict[str, Any]], returned: Sequence[Any]) -> list[int | None]:
    """Each row's new id, or None where its operation key kept it out.

    insert_many took ids from the sequence in the rows' order, so the
    returned ids sorted are the inserted rows in order; a keyed row was
    inserted if its key came back (the first row of the batch with that key).
    """
    got = sorted((int(r[0]), r[1]) for r in returned)
    keys = {key for _, key in got if key is not None}
    ids = iter(i for i, _ in got)
    inserted: list[int | None] = []
    for r in rows:
        key = r["operation_key"]
        if key is None or key in keys:
            inserted.append(next(ids))
            keys.discard(key)
        else:
            inserted.append(None)
    return inserted
