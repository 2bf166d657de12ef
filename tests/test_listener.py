"""The NOTIFY listener with the broker away: it keeps listening, and says so
once a minute, not once per committed row.

Real PostgreSQL NOTIFYs (``enqueue`` sends them); the claim task is sent
with a real Celery app whose broker port refuses connections, as a broker
outage looks to the listener. A walkthrough on RabbitMQ saw one warning
with a traceback per committed row while the broker was away.
"""

from __future__ import annotations

import logging
import threading

import pytest
from celery import Celery

from outbox_relay.celery.listener import NotifyListener
from outbox_relay.table import OutboxTable

from .apps import kit
from .faults.servers import free_port


def test_a_broker_outage_is_one_line_a_minute_not_one_per_row(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    away = Celery("away", broker=f"redis://127.0.0.1:{free_port()}/0")
    away.conf.broker_connection_retry_on_startup = False
    # Refused at once, not after kombu's reconnect loop (seconds per send).
    away.conf.broker_transport_options = {
        "max_retries": 1,
        "interval_start": 0,
        "interval_step": 0,
        "interval_max": 0,
    }
    up = threading.Event()
    fired = threading.Event()

    def trigger() -> None:
        fired.set()
        if not up.is_set():
            # What the listener's claim hint does, against a broker that is away.
            away.send_task("outbox_relay.claim", retry=False)

    listener = NotifyListener(dsn, OutboxTable(), trigger, debounce=0.0)
    caplog.set_level(logging.INFO, logger="outbox_relay.celery")
    listener.start()
    try:
        kit.wait_until(fired.is_set, timeout=10, what="the listener's first claim")
        for _ in range(20):
            fired.clear()
            kit.enqueue(dsn, 1, threads=1)
            kit.wait_until(fired.is_set, timeout=10, what="a claim after NOTIFY")
        warned = [r for r in caplog.records if "could not send a claim task" in r.getMessage()]
        assert len(warned) == 1, [r.getMessage() for r in warned]
        assert warned[0].exc_info is not None  # the first one says why
        up.set()
        fired.clear()
        kit.enqueue(dsn, 1, threads=1)
        kit.wait_until(
            lambda: any("sent again" in r.getMessage() for r in caplog.records),
            timeout=10,
            what="the line that says claims are sent again",
        )
    finally:
        listener.stop()
        away.close()
