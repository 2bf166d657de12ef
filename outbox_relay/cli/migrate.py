"""``outbox-relay migrate [--sql]``: apply the schema migrations, or print them for review."""

from __future__ import annotations

import click

from ..store import schema
from ..store.schema import migration_script
from .common import CliState, command_options, pass_state

__all__ = ["migrate_command"]


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
        noun = "migration" if len(versions) == 1 else "migrations"
        click.echo(f"applied {noun} {', '.join(map(str, versions))} to {table.qualified}")
    else:
        click.echo(f"{table.qualified} is up to date; no migration applied")
