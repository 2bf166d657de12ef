"""``outbox-relay retrying``: messages waiting for another attempt, and why.

``status`` says how many messages wait and for how long; this says which
ones are late because their last attempt failed, what the receiver or the
publisher said (``last_error``), and when each is tried again.
"""

from __future__ import annotations

import json

import click

from .. import operations
from .common import CliState, command_options, console, pass_state, print_messages

__all__ = ["retrying_command"]


@click.command("retrying")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="A JSON array, for scripts.")
@command_options()
@pass_state
def retrying_command(state: CliState, limit: int, as_json: bool) -> None:
    """List messages waiting for another attempt after a failed one, the
    next due first, with their last error (payloads are not shown)."""
    with state.connect() as conn:
        rows = operations.retrying_list(conn, limit=limit, table=state.table)
    if as_json:
        click.echo(json.dumps([r.as_json() for r in rows], indent=2))
        return
    out = console()
    if not rows:
        out.print(f"no message in {state.table.qualified} waits for a retry")
        return
    print_messages(
        f"messages waiting for a retry in {state.table.qualified}",
        ("id", "event type", "aggregate", "attempts", "next attempt"),
        [
            (
                str(r.id),
                r.event_type,
                f"{r.aggregate_type}/{r.aggregate_id}",
                str(r.attempts),
                f"in {operations.human_duration(r.due_in_seconds)}"
                if r.due_in_seconds > 0
                else "due now",
                r.last_error or "",
            )
            for r in rows
        ],
    )
    if len(rows) == limit:
        out.print(f"(the first {limit}; raise --limit for more)")
