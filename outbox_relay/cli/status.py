"""``outbox-relay status``: queue depth, oldest waiting message, leases, attempts."""

from __future__ import annotations

import json
import time

import click

from .. import operations
from .._redact import mask_dsn
from .common import CliState, command_options, console, pass_state

__all__ = ["status_command"]


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line, for scripts.")
@click.option(
    "--watch",
    type=click.FloatRange(min=0.1),
    default=None,
    metavar="SECONDS",
    help="Refresh every SECONDS until Ctrl-C.",
)
@click.option(
    "--count",
    type=click.IntRange(min=1),
    default=None,
    help="With --watch: stop after this many refreshes.",
)
@command_options()
@pass_state
def status_command(state: CliState, as_json: bool, watch: float | None, count: int | None) -> None:
    """Queue depth per status, oldest waiting message, expired leases, attempts."""
    table = state.table
    title = f"outbox {table.qualified} at {mask_dsn(state.dsn)}"
    out = console()
    shown = 0
    try:
        while True:
            # A connection per refresh: a --watch left running for days
            # survives a database restart.
            with state.connect() as conn:
                snapshot = operations.status(conn, table=table)
            if as_json:
                click.echo(json.dumps(snapshot))
            else:
                if watch is not None and out.is_terminal:
                    out.clear()
                out.print(title, soft_wrap=True)
                out.print(operations.status_table(snapshot))
            shown += 1
            if watch is None or (count is not None and shown >= count):
                return
            time.sleep(watch)
    except KeyboardInterrupt:
        return
