"""``outbox-relay status``: queue depth, oldest waiting message, leases, attempts."""

from __future__ import annotations

import json
import time

import click

from .. import operations
from .._redact import mask_dsn
from ..config import Settings
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
@click.option(
    "--max-age",
    type=click.FloatRange(min=0),
    default=None,
    metavar="SECONDS",
    help=(
        "Exit with status 1 when the oldest waiting message has waited longer than "
        "SECONDS (a probe for an orchestrator or a cron check)."
    ),
)
@click.option(
    "--max-in-flight",
    type=click.IntRange(min=1),
    envvar="OUTBOX_MAX_IN_FLIGHT",
    show_envvar=True,
    default=None,
    metavar="N",
    help="The workers' in-flight cap, to show the live leases against (under celery -A APP "
    "outbox: the app's setting; else 1000, the default).",
)
@command_options()
@pass_state
@click.pass_context
def status_command(
    ctx: click.Context,
    state: CliState,
    as_json: bool,
    watch: float | None,
    count: int | None,
    max_age: float | None,
    max_in_flight: int | None,
) -> None:
    """Queue depth per status, oldest waiting message, expired leases, attempts,
    live leases against the in-flight cap, messages done in the last minute."""
    table = state.table
    cap, cap_known = _cap(ctx, state, max_in_flight)
    title = f"outbox {table.qualified} at {mask_dsn(state.dsn)}"
    out = console()
    shown = 0
    try:
        while True:
            # A connection per refresh: a --watch left running for days
            # survives a database restart.
            with state.connect() as conn:
                snapshot = operations.status(conn, table=table)
            snapshot["max_in_flight"] = cap  # status() cannot know it
            if as_json:
                click.echo(json.dumps(snapshot))
            else:
                if watch is not None and out.is_terminal:
                    out.clear()
                out.print(title, soft_wrap=True)
                out.print(operations.status_table(snapshot))
                if not cap_known:
                    out.print(
                        f"(cap: the default {cap}; give --max-in-flight or OUTBOX_MAX_IN_FLIGHT "
                        "if the workers run with another)"
                    )
            shown += 1
            if watch is None or (count is not None and shown >= count):
                _check_age(snapshot.get("oldest_pending_age_seconds"), max_age)
                return
            time.sleep(watch)
    except KeyboardInterrupt:
        return


def _cap(ctx: click.Context, state: CliState, given: int | None) -> tuple[int, bool]:
    """The in-flight cap to show, and whether it was configured rather than assumed.

    Only the workers' settings know it: --max-in-flight, then the Celery
    app's (which read OUTBOX_MAX_IN_FLIGHT themselves), then the environment.
    """
    source = ctx.get_parameter_source("max_in_flight")
    if given is not None and source == click.core.ParameterSource.COMMANDLINE:
        return given, True
    from_app = state.relay_max_in_flight()
    if from_app is not None:
        return from_app, True
    if given is not None:
        return given, True
    return Settings().max_in_flight, False


def _check_age(oldest: float | None, max_age: float | None) -> None:
    """Status 1, and a line on stderr that says why, past ``--max-age``."""
    if max_age is None or oldest is None or oldest <= max_age:
        return
    click.echo(
        f"the oldest waiting message has waited {oldest:.1f}s, more than --max-age {max_age:g}s",
        err=True,
    )
    raise SystemExit(1)
