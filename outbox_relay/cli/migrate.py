"""``outbox-relay migrate [--sql]``: apply the schema migrations, or print them for review."""

from __future__ import annotations

import click
import psycopg

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
        try:
            versions = schema.migrate(conn, table=table)
        except psycopg.errors.InsufficientPrivilege as exc:
            # Its transaction rolled back; the session is usable. A role that
            # may read the table but not create in its schema (the relay's or
            # an operator's) has nothing to do when nothing is pending.
            try:
                missing: list[int] | None = schema.missing_migrations(conn, table=table)
            except psycopg.errors.InsufficientPrivilege:
                # Nor may it read which were applied. Still the owner's job,
                # not a grant's (the hint connect() would give).
                missing = None
            if missing == []:
                click.echo(f"{table.qualified} is up to date; no migration applied")
                return
            first_line = str(exc).strip().splitlines()[0]
            what = (
                f"migration(s) {', '.join(map(str, missing))} of {table.qualified} need"
                if missing
                else f"migrating {table.qualified} needs"
            )
            raise click.ClickException(
                f"{first_line}: {what} the role that owns it (the one that ran the first "
                "migration) or a superuser; run it as that role, or review "
                "`outbox-relay migrate --sql` for a DBA to apply"
            ) from None
    if versions:
        noun = "migration" if len(versions) == 1 else "migrations"
        click.echo(f"applied {noun} {', '.join(map(str, versions))} to {table.qualified}")
    else:
        click.echo(f"{table.qualified} is up to date; no migration applied")
