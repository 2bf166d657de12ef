"""``outbox-relay inbox purge --older-than 30d``: the inbox's retention.

Nothing deletes inbox rows by itself (a consumer's process may run no relay
and no beat): a receiving service schedules this command, or calls
``outbox_relay.inbox.purge_inbox``, as it would any retention job.
"""

from __future__ import annotations

import time
from datetime import timedelta

import click
from psycopg import errors as pg_errors

from ..inbox import purge_inbox
from ..operations import human_duration
from ..table import InboxTable
from .common import CliState, Duration, command_options, pass_state

__all__ = ["inbox_group"]


@click.group("inbox")
def inbox_group() -> None:
    """The inbox of a receiving service (outbox_relay.inbox)."""


@inbox_group.command("purge")
@click.option(
    "--older-than",
    type=Duration(),
    required=True,
    help="Delete rows received longer ago than this (30d, 12h). Keep them longer than a "
    "message can still arrive: a duplicate that comes after its row went runs again.",
)
@click.option("--consumer", default=None, help="Only this consumer's rows (default: every one).")
@click.option(
    "--inbox-table",
    default=None,
    metavar="[SCHEMA.]TABLE",
    help="The inbox table (default: beside --table, e.g. public.outbox_inbox).",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=5000, show_default=True)
@command_options()
@pass_state
def inbox_purge_command(
    state: CliState,
    older_than: timedelta,
    consumer: str | None,
    inbox_table: str | None,
    batch_size: int,
) -> None:
    """Delete old inbox rows in batches, each committed on its own."""
    try:
        table = InboxTable.parse(inbox_table) if inbox_table else InboxTable.beside(state.table)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--inbox-table") from None
    started = time.monotonic()
    with state.connect() as conn:
        try:
            deleted = purge_inbox(
                conn, older_than=older_than, consumer=consumer, batch=batch_size, table=table
            )
        except pg_errors.UndefinedTable:
            raise click.ClickException(
                f"there is no inbox table {table.qualified} in this database (name it with "
                "--inbox-table; outbox-relay migrate or outbox_relay.inbox.ensure_inbox "
                "creates one)"
            ) from None
    whose = f" of consumer {consumer!r}" if consumer else ""
    click.echo(
        f"purged {deleted} inbox row(s){whose} from {table.qualified} received over "
        f"{human_duration(older_than.total_seconds())} ago, {time.monotonic() - started:.2f}s"
    )
