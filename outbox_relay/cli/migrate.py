"""``outbox-relay migrate [--sql]``: apply the schema migrations, or print them for review."""

from __future__ import annotations

import re
from typing import Any

import click
from psycopg import sql

from ..sql.queries import migrations_for, queries_for
from ..store import schema
from ..table import OutboxTable
from .common import CliState, command_options, pass_state

__all__ = ["migrate_command", "migration_script"]


def _code(query: str) -> str:
    """A named query without its leading comment lines (written for the code's readers)."""
    lines = query.splitlines()
    while lines and lines[0].lstrip().startswith("--"):
        lines.pop(0)
    return "\n".join(lines)


def _inline(query: str, params: dict[str, Any]) -> str:
    """A named query with its parameters written in as quoted literals, for a
    script a person reviews and runs. Only our own values (versions, migration
    names from file names, a lock key) go through here."""

    def literal(match: re.Match[str]) -> str:
        return sql.Literal(params[match.group(1)]).as_string()

    return re.sub(r"%\((\w+)\)s", literal, _code(query)).replace("%%", "%")


def migration_script(table: OutboxTable, applied: set[int]) -> str:
    """The statements ``store.migrate`` would run for ``table``, as one SQL script.

    Rendered, never executed: a DBA reviews it and runs it (``psql -f``).
    """
    q = queries_for(table)
    pending = [m for m in migrations_for(table) if m.version not in applied]
    if not pending:
        return f"-- {table.qualified} is up to date: no migration to apply\n"
    versions = ", ".join(f"{m.version:04d}_{m.name}" for m in pending)
    lines = [
        f"-- outbox-relay migrations for {table.qualified}: {versions}",
        "-- The same statements `outbox-relay migrate` runs, in one transaction.",
        "BEGIN;",
        # The lock store.migrate() takes, so a script run by hand and a
        # concurrent `outbox-relay migrate` queue behind each other.
        _inline(q.advisory_lock, {"key": schema.MIGRATE_LOCK}) + ";",
        _code(q.create_schema) + ";",
        _code(q.create_migrations_table) + ";",
    ]
    for m in pending:
        lines += [
            "",
            f"-- migration {m.version:04d}_{m.name}",
            m.sql.strip(),
            _inline(q.record_migration, {"version": m.version, "name": m.name}) + ";",
        ]
    lines += ["", "COMMIT;", ""]
    return "\n".join(lines)


@click.command("migrate")
@click.option(
    "--sql",
    "show_sql",
    is_flag=True,
    help="Print the DDL instead of applying it: the migrations the database lacks "
    "when a DSN is given, else all of them.",
)
@command_options()
@pass_state
def migrate_command(state: CliState, show_sql: bool) -> None:
    """Apply the schema migrations (idempotent, safe to run concurrently)."""
    table = state.table
    if show_sql:
        applied: set[int] = set()
        if state.maybe_dsn():
            with state.connect() as conn:
                applied = schema.applied_migrations(conn, table=table)
        click.echo(migration_script(table, applied), nl=False)
        return
    with state.connect() as conn:
        versions = schema.migrate(conn, table=table)
    if versions:
        click.echo(f"applied migrations {', '.join(map(str, versions))} to {table.qualified}")
    else:
        click.echo(f"{table.qualified} is up to date; no migration applied")
