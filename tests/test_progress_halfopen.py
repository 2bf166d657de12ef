"""Progress after a database failover that leaves half-open sockets.

The relay reaches PostgreSQL through a proxy. Mid-run, every connection open
at that moment goes silent (bytes swallowed both ways, no FIN, no RST: what a
client sees when the database host vanishes or fails over) while new
connections pass. Before every database call had a bound, the relay never
recovered (pooled connections and the claim task waited forever). Now the
watchdog cuts the silent calls, the pool reconnects, leases that lapsed are
rescued, and every message is delivered.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from . import services
from .apps import kit
from .celery_procs import CeleryProcs
from .tcp_proxy import SilencingProxy

pytestmark = [pytest.mark.celery, pytest.mark.slow]

MESSAGES = 600
LEASE = 6.0


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_relay_recovers_from_half_open_database_connections(
    dsn: str, tmp_path: Path, pool: str
) -> None:
    proxy = SilencingProxy(dsn)
    broker = services.redis_url()
    kit.prepare_receiver(dsn)
    procs = CeleryProcs(
        {
            "OUTBOX_DSN": proxy.dsn,  # the relay's every connection goes through the proxy
            "CELERY_BROKER_URL": broker,
            "OUTBOX_QUEUE": kit.unique("outbox-halfopen"),
            "OUTBOX_PUBLISHER": "tests.apps.receiver:record",
            "RECEIVER_DSN": dsn,  # the receiver's own connection does not
            "RECEIVER_DELAY_SECONDS": "0.01",
            "OUTBOX_LEASE_SECONDS": str(LEASE),
            "OUTBOX_PUBLISH_TIMEOUT_SECONDS": "1",
            "OUTBOX_CLAIM_INTERVAL_SECONDS": "1",
            "OUTBOX_BATCH_SIZE": "50",
            "OUTBOX_MAX_IN_FLIGHT": "200",
        },
        tmp_path,
    )
    try:
        procs.worker(concurrency=2, pool=pool)
        procs.beat()
        ids = kit.enqueue(dsn, MESSAGES)
        kit.wait_until(
            lambda: kit.status_counts(dsn).get("done", 0) >= MESSAGES // 4,
            timeout=60,
            interval=0.1,
            describe=lambda: kit.status_counts(dsn),
            what="a quarter delivered",
        )
        proxy.silence()
        at_silence = kit.status_counts(dsn)
        try:
            took = kit.wait_until(
                lambda: kit.status_counts(dsn).get("done", 0) == MESSAGES,
                timeout=90,
                interval=0.5,
                describe=lambda: kit.status_counts(dsn),
                what="all delivered after the connections went silent",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nat silence: {at_silence}\n{procs.logs()}") from None
        logs = "\n".join(p.text() for p in procs.procs)
    finally:
        procs.stop_all()
        proxy.close()
    print(f"\n{pool}: at silence {at_silence}; all done {took:.1f}s later")
    assert kit.status_counts(dsn) == {"done": MESSAGES}
    assert kit.delivered_ids(dsn) == set(ids)
    if pool == "threads":
        # No Celery time limit on the threads pool: only the database calls'
        # own bound (the watchdog cutting the silent calls) gets it moving.
        assert "outlived its deadline" in logs
