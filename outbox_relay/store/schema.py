"""Migrations and the start-up checks that read the schema."""

from __future__ import annotations

import re
from typing import Any

import psycopg
from psycopg import sql

from ..sql.queries import Migration, migrations_for, queries_for
from ..table import OutboxTable
from ._base import TableLike, statement_tx, tableless
from ._plan import Plan, Statement, run

__all__ = [
    "MIGRATE_LOCK",
    "applied_migrations",
    "listen",
    "migrate",
    "migrate_plan",
    "missing_migrations",
    "relay_identity",
    "relay_lacks",
    "session_defaults",
    "table_exists",
]

MIGRATE_LOCK = "outbox_relay:migrate"


Step = tuple[str, "dict[str, Any] | None"]


def _setup_steps(table: OutboxTable) -> list[Step]:
    q = queries_for(table)
    return [
        # Several processes migrating at once queue here, and so does a
        # script run by hand.
        (q.advisory_lock, {"key": MIGRATE_LOCK}),
        (q.create_schema, None),
        (q.create_migrations_table, None),
    ]


def _migration_steps(table: OutboxTable, m: Migration) -> list[Step]:
    record = queries_for(table).record_migration
    return [(m.sql, None), (record, {"version": m.version, "name": m.name})]


def migrate_plan(table: OutboxTable) -> Plan[list[int]]:
    """The statements of ``migrate``, for any driver (sync here, asyncio in store/aio.py)."""
    for query, params in _setup_steps(table):
        yield Statement(query, params)
    applied = yield Statement(queries_for(table).applied_migrations, {}, fetch="all")
    done = {row[0] for row in applied}
    pending = [m for m in migrations_for(table) if m.version not in done]
    for m in pending:
        for query, params in _migration_steps(table, m):
            yield Statement(query, params)
    return [m.version for m in pending]


def migrate(conn: psycopg.Connection[Any], *, table: TableLike = None) -> list[int]:
    """Apply the migrations this table lacks; return the versions applied.

    Idempotent, and safe when several processes run it at once: they queue on
    one advisory lock, and each applies what is still missing when it gets it.
    The steps are the ones ``migration_script`` prints, so the two agree.
    """
    outbox = OutboxTable.parse(table)  # a bad name fails before the connection is touched
    with conn.transaction():
        return run(conn, migrate_plan(outbox))


def _code(query: str) -> str:
    """A named query without its leading comment lines (written for the code's readers)."""
    lines = query.splitlines()
    while lines and lines[0].lstrip().startswith("--"):
        lines.pop(0)
    return "\n".join(lines).strip()


def _inline(query: str, params: dict[str, Any]) -> str:
    """A query with its parameters written in as quoted literals, for a script a
    person reviews and runs. Only our own values (versions, migration names
    from file names, the lock key) go through here."""

    def literal(match: re.Match[str]) -> str:
        return sql.Literal(params[match.group(1)]).as_string()

    return re.sub(r"%\((\w+)\)s", literal, _code(query)).replace("%%", "%")


def _script_line(query: str, params: dict[str, Any] | None) -> str:
    if params is None:
        return _code(query).rstrip(";") + ";"
    return _inline(query, params) + ";"


def migration_script(table: OutboxTable, applied: set[int]) -> str:
    """The statements ``migrate`` would run for ``table``, as one SQL script.

    Rendered, never executed: a DBA reviews it and runs it (``psql -f``).
    """
    pending = [m for m in migrations_for(table) if m.version not in applied]
    if not pending:
        return f"-- {table.qualified} is up to date: no migration to apply\n"
    versions = ", ".join(f"{m.version:04d}_{m.name}" for m in pending)
    lines = [
        f"-- outbox-relay migrations for {table.qualified}: {versions}",
        "-- The same statements `outbox-relay migrate` runs, in one transaction.",
        "BEGIN;",
    ]
    lines += [_script_line(query, params) for query, params in _setup_steps(table)]
    for m in pending:
        lines += ["", f"-- migration {m.version:04d}_{m.name}"]
        lines += [_script_line(query, params) for query, params in _migration_steps(table, m)]
    lines += ["", "COMMIT;", ""]
    return "\n".join(lines)


def table_exists(conn: psycopg.Connection[Any], *, table: TableLike = None) -> bool:
    outbox = OutboxTable.parse(table)
    params = {"schema": outbox.schema, "name": outbox.name}
    with statement_tx(conn):
        row = conn.execute(queries_for(outbox).table_exists, params).fetchone()
    return bool(row and row[0])


def may_insert(conn: psycopg.Connection[Any], *, table: TableLike = None) -> bool:
    """Whether this session's role may insert into ``table`` (which must exist)."""
    outbox = OutboxTable.parse(table)
    params = {"schema": outbox.schema, "name": outbox.name}
    with statement_tx(conn):
        row = conn.execute(queries_for(outbox).may_insert, params).fetchone()
    return bool(row and row[0])


def relay_lacks(conn: psycopg.Connection[Any], *, table: TableLike = None) -> list[str]:
    """The privileges on ``table`` (which must exist) that the relay's claims
    and finalizes need and this session's role lacks, as GRANT names them."""
    outbox = OutboxTable.parse(table)
    params = {"schema": outbox.schema, "name": outbox.name}
    with statement_tx(conn):
        rows = conn.execute(queries_for(outbox).relay_lacks, params).fetchall()
    return [str(r[0]) for r in rows]


def session_defaults(conn: psycopg.Connection[Any]) -> dict[str, str]:
    """The relay's session settings as this role's sessions start with them
    (``pg_settings.reset_val``): timeouts in milliseconds, ``jit`` and
    ``enable_bitmapscan`` as ``on``/``off``."""
    with statement_tx(conn):
        rows = conn.execute(tableless().session_defaults).fetchall()
    return {str(name): str(value) for name, value in rows}


def relay_identity(
    conn: psycopg.Connection[Any], *, table: TableLike = None
) -> tuple[str, str] | None:
    """The database's name and when ``table``'s first migration was applied
    (ISO 8601); None when the table has no record of it."""
    with statement_tx(conn):
        row = conn.execute(queries_for(OutboxTable.parse(table)).relay_identity).fetchone()
    if row is None or row[1] is None:
        return None
    return str(row[0]), row[1].isoformat()


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
