"""Progress after the Celery broker's connections go half-open (Redis).

The standalone app reaches Redis through a proxy; mid-run every connection
open at that moment goes silent while new ones pass. Celery workers hang on a
silent broker socket unless the transport bounds its socket operations: the
standalone app sets Redis socket timeouts and health checks, so the worker
reconnects, and the leases of tasks lost on the way are rescued.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import pytest

from . import services
from .apps import kit
from .celery_procs import CeleryProcs
from .tcp_proxy import SilencingProxy

pytestmark = [pytest.mark.celery, pytest.mark.slow]

MESSAGES = 400


def test_relay_recovers_from_half_open_broker_connections(dsn: str, tmp_path: Path) -> None:
    broker = services.redis_url()
    parts = urlsplit(broker)
    if parts.scheme != "redis":
        pytest.skip("needs Redis over TCP (OUTBOX_TEST_REDIS_URL), not a Unix socket")
    proxy = SilencingProxy(target=(parts.hostname or "127.0.0.1", parts.port or 6379))
    proxied = f"redis://127.0.0.1:{proxy.port}{parts.path}"
    kit.prepare_receiver(dsn)
    procs = CeleryProcs(
        {
            "OUTBOX_DSN": dsn,
            "CELERY_BROKER_URL": proxied,
            "OUTBOX_QUEUE": kit.unique("outbox-broker-halfopen"),
            "OUTBOX_PUBLISHER": "tests.apps.receiver:record",
            "RECEIVER_DSN": dsn,
            "RECEIVER_DELAY_SECONDS": "0.01",
            "OUTBOX_LEASE_SECONDS": "6",
            "OUTBOX_PUBLISH_TIMEOUT_SECONDS": "1",
            "OUTBOX_CLAIM_INTERVAL_SECONDS": "1",
            "OUTBOX_BATCH_SIZE": "50",
            "OUTBOX_MAX_IN_FLIGHT": "200",
        },
        tmp_path,
    )
    try:
        procs.worker(concurrency=2)
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
                timeout=120,
                interval=0.5,
                describe=lambda: kit.status_counts(dsn),
                what="all delivered after the broker's connections went silent",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nat silence: {at_silence}\n{procs.logs()}") from None
    finally:
        procs.stop_all()
        proxy.close()
    print(f"\nat silence {at_silence}; all done {took:.1f}s later")
    assert kit.status_counts(dsn) == {"done": MESSAGES}
    assert kit.delivered_ids(dsn) == set(ids)
