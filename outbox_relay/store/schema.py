"""Migrations and the start-up checks that read the schema."""

from __future__ import annotations

from typing import Any

import psycopg

from ..sql.queries import migrations_for, queries_for
from ..table import OutboxTable
from ._base import TableLike, statement_tx

__all__ = [
    "MIGRATE_LOCK",
    "applied_migrations",
    "listen",
    "migrate",
    "missing_migrations",
    "table_exists",
]

MIGRATE_LOCK = "outbox_relay:migrate"


def migrate(conn: psycopg.Connection[Any], *, table: TableLike = None) -> list[int]:
    """Apply the migrations this table lacks; return the versions applied.

    Idempotent, and safe when several processes run it at once: they queue on
    one advisory lock, and each applies what is still missing when it gets it.
    """
    outbox = OutboxTable.parse(table)
    q = queries_for(outbox)
    applied: list[int] = []
    with conn.transaction():
        conn.execute(q.advisory_lock, {"key": MIGRATE_LOCK})
        conn.execute(q.create_schema)
        conn.execute(q.create_migrations_table)
        done = {row[0] for row in conn.execute(q.applied_migrations)}
        for migration in migrations_for(outbox):
            if migration.version in done:
                continue
            conn.execute(migration.sql.encode())
            conn.execute(q.record_migration, {"version": migration.version, "name": migration.name})
            applied.append(migration.version)
    return applied


def table_exists(conn: psycopg.Connection[Any], *, table: TableLike = None) -> bool:
    outbox = OutboxTable.parse(table)
    params = {"schema": outbox.schema, "name": outbox.name}
    with statement_tx(conn):
        row = conn.execute(queries_for(outbox).table_exists, params).fetchone()
    return bool(row and row[0])


def applied_migrations(conn: psycopg.Connection[Any], *, table: TableLike = None) -> set[int]:
    """Versions applied to ``table`` (empty when it has no migrations table)."""
    outbox = OutboxTable.parse(table)
    # The migrations table sits beside the outbox (OutboxTable.related).
    params = {"schema": outbox.schema, "name": f"{outbox.name}_migrations"}
    q = queries_for(outbox)
    with statement_tx(conn):
        row = conn.execute(q.table_exists, params).fetchone()
        if not (row and row[0]):
            return set()
        return {r[0] for r in conn.execute(q.applied_migrations)}


def missing_migrations(conn: psycopg.Connection[Any], *, table: TableLike = None) -> list[int]:
    """Versions this package has that ``table`` lacks (what `outbox-relay migrate` would apply)."""
    outbox = OutboxTable.parse(table)
    applied = applied_migrations(conn, table=outbox)
    return [m.version for m in migrations_for(outbox) if m.version not in applied]


def listen(conn: psycopg.Connection[Any], *, table: TableLike = None) -> None:
    """LISTEN on the table's notification channel (an autocommit connection)."""
    conn.execute(queries_for(OutboxTable.parse(table)).listen)
