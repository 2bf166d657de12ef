"""Progress past a publish that never returns.

A publisher stuck for good (a socket with no timeout) must not hold its row
for good. The threads and solo pools enforce no Celery time limit, so only
the lease can free the row: the lease keeper renews a publish at most until
its worst-case publish time has passed, then lets the lease run out. The row
is then re-claimable, within the lease plus the worst-case publish after it
was claimed, and another thread (threads pool) or another worker (solo, whose
only thread is the stuck one) delivers it.

The publisher (tests/apps/receiver.py:hang_once) sleeps for an hour on the
first call for a message and returns at once on later calls; it records each
call in the test database with the database clock.
"""

from __future__ import annotations

import signal
import time
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest

import outbox_relay

from . import services
from .apps import kit
from .celery_procs import CeleryProcs

pytestmark = [pytest.mark.celery, pytest.mark.faults]

LEASE = 6.0
PUBLISH_TIMEOUT = 1.0  # the worst-case publish: one message per task
CLAIM_INTERVAL = 1.0


@pytest.mark.parametrize(
    ("pool", "workers", "concurrency"),
    [("threads", 1, 2), ("solo", 2, 1)],
    ids=["threads", "solo"],
)
def test_hung_publish_is_claimed_again_and_delivered(
    dsn: str, tmp_path: Path, pool: str, workers: int, concurrency: int
) -> None:
    kit.prepare_receiver(dsn)
    procs = CeleryProcs(
        {
            "OUTBOX_DSN": dsn,
            "CELERY_BROKER_URL": services.redis_url(),
            "OUTBOX_QUEUE": kit.unique(f"outbox-hung-{pool}"),
            "OUTBOX_PUBLISHER": "tests.apps.receiver:hang_once",
            "RECEIVER_DSN": dsn,
            "OUTBOX_LEASE_SECONDS": str(LEASE),
            "OUTBOX_PUBLISH_TIMEOUT_SECONDS": str(PUBLISH_TIMEOUT),
            "OUTBOX_CLAIM_INTERVAL_SECONDS": str(CLAIM_INTERVAL),
        },
        tmp_path,
    )
    try:
        for _ in range(workers):
            procs.worker(pool=pool, concurrency=concurrency)
        procs.beat()
        enqueued = time.monotonic()
        with psycopg.connect(dsn) as conn, conn.transaction():
            message_id = outbox_relay.enqueue(
                conn,
                aggregate_type="order",
                aggregate_id="1",
                event_type="order.created",
                payload={"order": 1},
            )

        kit.wait_until(
            lambda: kit.calls(dsn, message_id),
            timeout=15,
            what="the first publish to start",
        )
        # Until the row is done, watch how far the first lease is pushed out.
        first_lease_until: list = []

        def finished() -> bool:
            r = kit.row(dsn, message_id)
            if r["lease_version"] == 1 and r["lease_until"] is not None:
                first_lease_until.append(r["lease_until"])
            return r["status"] == "done"

        try:
            kit.wait_until(
                finished,
                timeout=3 * LEASE - (time.monotonic() - enqueued),
                describe=lambda: (kit.row(dsn, message_id), kit.calls(dsn, message_id)),
                what=f"the hung message to be delivered again ({pool} pool)",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{procs.logs()}") from None
        took = time.monotonic() - enqueued
        final = kit.row(dsn, message_id)
        seen = kit.calls(dsn, message_id)
    finally:
        # The stuck publish would hold a warm shutdown for an hour.
        for proc in procs.procs:
            proc.kill(signal.SIGKILL)
        procs.stop_all()

    print(f"\n{pool}: done {took:.1f}s after enqueue; calls {seen}")
    assert final["status"] == "done"
    assert final["attempts"] == 2, final
    first, second = seen[0], seen[-1]
    assert len(seen) == 2, seen
    assert not first["delivered"] and first["attempts"] == 1
    assert second["delivered"] and second["attempts"] == 2
    assert second["lease_version"] == first["lease_version"] + 1
    # The first lease was never held past lease + worst-case publish (with
    # half a second for the claim-to-publish gap and clock rounding) ...
    latest = max(first_lease_until, default=None)
    assert latest is not None, "never saw the first lease"
    assert latest <= first["at"] + timedelta(seconds=LEASE + PUBLISH_TIMEOUT + 0.5), (
        f"first lease pushed out to {latest}, publish began at {first['at']}"
    )
    # ... and the row was taken again soon after that lease ran out.
    gap = (second["at"] - first["at"]).total_seconds()
    assert gap <= LEASE + PUBLISH_TIMEOUT + 2 * CLAIM_INTERVAL + 1.5, gap
