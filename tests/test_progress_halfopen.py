"""Progress after a failover that leaves half-open sockets.

The relay reaches PostgreSQL (or the Celery broker, Redis) through a proxy.
Mid-run, every connection open at that moment goes silent (bytes swallowed
both ways, no FIN, no RST: what a client sees when a host vanishes or fails
over) while new connections pass. Before every call had a bound, the relay
never recovered. Now the database watchdog (or, for the broker, the
transport's socket timeouts) cuts the silent calls, connections are made
anew, lapsed leases are rescued, and every message is delivered.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import pytest

from . import services
from .apps import kit
from .celery_procs import CeleryProcs
from .tcp_proxy import SilencingProxy

pytestmark = [pytest.mark.celery, pytest.mark.slow, pytest.mark.faults]


def _relay(dsn: str, relay_dsn: str, broker: str, tmp_path: Path) -> CeleryProcs:
    kit.prepare_receiver(dsn)
    return CeleryProcs(
        {
            "OUTBOX_DSN": relay_dsn,
            "CELERY_BROKER_URL": broker,
            "OUTBOX_QUEUE": kit.unique("outbox-halfopen"),
            "OUTBOX_PUBLISHER": "tests.apps.receiver:record",
            "RECEIVER_DSN": dsn,  # the receiver's own connection is never proxied
            "RECEIVER_DELAY_SECONDS": "0.01",
            "OUTBOX_LEASE_SECONDS": "6",
            "OUTBOX_PUBLISH_TIMEOUT_SECONDS": "1",
            "OUTBOX_CLAIM_INTERVAL_SECONDS": "1",
            "OUTBOX_BATCH_SIZE": "50",
            "OUTBOX_MAX_IN_FLIGHT": "200",
        },
        tmp_path,
    )


def _silence_mid_run(
    procs: CeleryProcs, proxy: SilencingProxy, dsn: str, messages: int, *, pool: str, wait: float
) -> str:
    """Run the relay, silence the proxy a quarter in, wait until all is done; return the logs."""
    try:
        procs.worker(concurrency=2, pool=pool)
        procs.beat()
        ids = kit.enqueue(dsn, messages)
        kit.wait_until(
            lambda: kit.status_counts(dsn).get("done", 0) >= messages // 4,
            timeout=60,
            interval=0.1,
            describe=lambda: kit.status_counts(dsn),
            what="a quarter delivered",
        )
        proxy.silence()
        at_silence = kit.status_counts(dsn)
        try:
            took = kit.wait_until(
                lambda: kit.status_counts(dsn).get("done", 0) == messages,
                timeout=wait,
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
    assert kit.status_counts(dsn) == {"done": messages}
    assert kit.delivered_ids(dsn) == set(ids)
    return logs


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_relay_recovers_from_half_open_database_connections(
    dsn: str, tmp_path: Path, pool: str
) -> None:
    proxy = SilencingProxy(dsn)
    procs = _relay(dsn, proxy.dsn, services.redis_url(), tmp_path)
    logs = _silence_mid_run(procs, proxy, dsn, 600, pool=pool, wait=90)
    if pool == "threads":
        # No Celery time limit on the threads pool: only the database calls'
        # own bound (the watchdog cutting the silent calls) gets it moving.
        assert "outlived its deadline" in logs


def test_relay_recovers_from_half_open_broker_connections(dsn: str, tmp_path: Path) -> None:
    broker = services.redis_url()
    parts = urlsplit(broker)
    if parts.scheme != "redis":
        pytest.skip("needs Redis over TCP (OUTBOX_TEST_REDIS_URL), not a Unix socket")
    proxy = SilencingProxy(target=(parts.hostname or "127.0.0.1", parts.port or 6379))
    proxied = f"redis://127.0.0.1:{proxy.port}{parts.path}"
    procs = _relay(dsn, dsn, proxied, tmp_path)
    # The standalone app's Redis socket timeouts (10 s) and health checks let
    # the worker reconnect; without them it waits on the silent socket forever.
    _silence_mid_run(procs, proxy, dsn, 400, pool="prefork", wait=120)
