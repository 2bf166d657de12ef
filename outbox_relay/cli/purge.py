"""``outbox-relay purge --older-than 7d``: delete old done rows in bounded batches."""

from __future__ import annotations

import time
from datetime import timedelta

import click

from .. import operations
from .common import CliState, Duration, command_options, pass_state

__all__ = ["purge_command"]


@click.command("purge")
@click.option(
    "--older-than",
    type=Duration(),
    required=True,
    help="Delete done messages finished longer ago than this (7d, 12h, 30m, 45s).",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=5000, show_default=True)
@click.option(
    "--max-batches",
    type=click.IntRange(min=1),
    default=None,
    help="Stop after this many batches (the rest waits for the next run).",
)
@command_options()
@pass_state
def purge_command(
    state: CliState, older_than: timedelta, batch_size: int, max_batches: int | None
) -> None:
    """Delete old done messages in bounded batches, each committed on its own.

    Prints how many went, in how many batches and how long it took. Dead,
    pending and processing messages are never deleted.
    """
    started = time.monotonic()
    with state.connect() as conn:
        result = operations.purge(
            conn,
            older_than=older_than,
            batch_size=batch_size,
            max_batches=max_batches,
            table=state.table,
        )
    click.echo(
        f"purged {result.deleted} done message(s) from {state.table.qualified} finished before "
        f"{result.cutoff.isoformat(timespec='seconds')} "
        f"in {result.batches} batch(es) of at most {batch_size}, "
        f"{time.monotonic() - started:.2f}s"
        + ("; stopped at --max-batches, more are left (run it again)" if result.more_left else "")
    )
