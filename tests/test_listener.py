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
import time
from pathlib import Path

import pytest
from celery import Celery

from outbox_relay.celery.listener import NotifyListener
from outbox_relay.table import OutboxTable

from . import services
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


OUTAGE = 35.0  # seconds without the database


def test_a_database_outage_is_one_warning_a_minute_from_claims_and_rescues(
    dsn: str, tmp_path: Path
) -> None:
    """While the database was away every claim and rescue tick raised, and
    Celery logged an ERROR with a traceback for each (8 in 20 s of an
    outage, a walkthrough found). One warning a minute now; and when the
    database is back the relay delivers within seconds, not after the
    connection pool's next retry, which grew with the outage."""
    from .celery_procs import standalone_relay
    from .tcp_proxy import SilencingProxy

    kit.prepare_receiver(dsn)
    proxy = SilencingProxy(dsn)
    broker = services.redis_url()
    queue = kit.unique("outbox-dbaway")
    procs = standalone_relay(
        proxy.dsn,
        tmp_path,
        broker,
        queue,
        RECEIVER_DSN=dsn,
        OUTBOX_LISTEN="false",
        OUTBOX_DATABASE_TIMEOUT_SECONDS="2",
    )
    try:
        worker = procs.worker(concurrency=1)  # no beat: the test sends the ticks
        client = kit.client_app(broker)
        proxy.cut()
        cut_at = time.monotonic()
        for name in ("outbox_relay.claim", "outbox_relay.rescue") * 3:
            client.send_task(name, queue=queue)
        kit.wait_until(
            lambda: worker.text().count("succeeded") >= 6,
            timeout=60,
            describe=lambda: worker.text()[-2000:],
            what="six claims and rescues to end while the database is away",
        )
        log = worker.text()
        assert log.count("the database is not reachable") == 1, log[-3000:]
        assert "raised unexpected" not in log, log[-3000:]
        # A failover's length: psycopg_pool's own retries, 1 s doubling, were
        # 15 and 31 s after the cut, then 63 s; the database back at 35 s
        # waited for the one at 63.
        time.sleep(max(0.0, OUTAGE - (time.monotonic() - cut_at)))
        proxy.restore()
        back_at = time.monotonic()
        ids = kit.enqueue(dsn, 3)

        def tick() -> bool:
            # What beat does; the worker's pool reconnects with a backoff
            # of its own (psycopg_pool's: 1 s, doubling).
            client.send_task("outbox_relay.claim", queue=queue)
            return kit.delivered_ids(dsn) == set(ids)

        kit.wait_until(
            tick,
            timeout=60,
            interval=1.0,
            describe=lambda: kit.status_counts(dsn),
            what="delivery once the database is back",
        )
        # Within a few seconds of the database (RECONNECT_SECONDS bounds the
        # pool's gaps), not half a minute later.
        assert time.monotonic() - back_at < 15.0
    finally:
        procs.stop_all()
        proxy.close()


def test_a_listen_connection_that_fails_says_why_without_its_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker with a wrong OUTBOX_LISTEN_DSN logged only "LISTEN connection
    failed; reconnecting", every 30 s for good, with no reason and no
    address (a walkthrough). Now the address, masked, and libpq's reason,
    scrubbed, as the start-up check gives them."""
    port = free_port()
    dsn = f"postgresql://relay:L1stenPw77@127.0.0.1:{port}/outbox?connect_timeout=2"
    listener = NotifyListener(dsn, OutboxTable(), lambda: None, debounce=0.0)
    caplog.set_level(logging.WARNING, logger="outbox_relay.celery")
    listener.start()
    try:
        kit.wait_until(
            lambda: any("LISTEN connection" in r.getMessage() for r in caplog.records),
            timeout=10,
            what="the listener's warning",
        )
    finally:
        listener.stop()
    line = next(r.getMessage() for r in caplog.records if "LISTEN connection" in r.getMessage())
    assert f"LISTEN connection to postgresql://relay:****@127.0.0.1:{port}/outbox" in line, line
    assert "Connection refused" in line, line
    assert "L1stenPw77" not in line
