"""The receiver: responses lost, answers past the timeout, transient errors,
permanent rejections, and a receiver that is down for a while."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import psycopg
import pytest

from .harness import LEASE_LOST, LOST_RESPONSE, PER_MESSAGE, Run
from .servers import OwnedRedis

pytestmark = [pytest.mark.faults, pytest.mark.celery]


def test_lost_slow_failing_and_rejecting_receiver(
    dsn: str, fresh_database: str, tmp_path: Path, owned_redis: OwnedRedis
) -> None:
    run = Run(
        "receiver-faults", dsn, fresh_database, tmp_path, broker=owned_redis.url, env=PER_MESSAGE
    )
    try:
        plan = run.receiver.behaviour
        plan.lose_every = 10  # applied, connection dropped before the answer
        plan.slow_every = 13  # applied, answered after the publisher's read timeout
        plan.slow_seconds = 2.5
        plan.fail_every = 7  # 503 on the first attempt
        plan.reject_every = 101  # 400: dead, never applied
        run.workers(1)
        run.beat()
        run.enqueue(800)
        run.faults.append(
            "receiver: every 10th response lost, every 13th 2.5 s late,"
            " every 7th 503 once, every 101st 400"
        )
        with run.fault("receiver faults"):  # on for the whole run
            run.wait_finished(120)
        ledger = run.ledger(allow={LOST_RESPONSE, LEASE_LOST})
        # The lost and late answers are where the duplicates come from.
        assert ledger.explained.get(LOST_RESPONSE, 0) >= 800 // 10 // 2
    finally:
        run.close()


def test_receiver_down_then_back_without_a_thundering_herd(
    dsn: str, fresh_database: str, tmp_path: Path, owned_redis: OwnedRedis
) -> None:
    """Down 20 s: every message retried with full-jitter backoff. When it
    returns, the retries arrive spread over the backoff window, not at once."""
    run = Run(
        "receiver-down",
        dsn,
        fresh_database,
        tmp_path,
        broker=owned_redis.url,
        # Attempts enough to outlast the outage: full jitter can draw eleven
        # short delays in a row, and with 12 attempts one message in about
        # 340 had used them all within 20 s (a simulation of the delays
        # alone; one of 400 went dead in a CI run of 2026-12-05). With 20,
        # fewer than one in a million do.
        env={"OUTBOX_MAX_ATTEMPTS": "20", "OUTBOX_BACKOFF_CAP_SECONDS": "8"},
    )
    try:
        run.workers(1)
        run.beat()
        run.receiver.down()
        run.enqueue(400)
        time.sleep(20)
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM outbox WHERE status <> 'done'").fetchone()
        waiting = int(row[0]) if row else 0
        back = time.time()
        run.receiver.up()
        run.faults.append("receiver refusing connections for 20 s")
        run.wait_finished(120)
        run.ledger(allow=set())
        with psycopg.connect(fresh_database, autocommit=True) as conn:
            arrivals = [
                r[0]
                for r in conn.execute(
                    "SELECT extract(epoch FROM at) FROM deliveries WHERE attempt > 1 ORDER BY at"
                )
            ]
        per_second = Counter(int(float(t) - back) for t in arrivals)
        assert waiting > 300 and arrivals
        # Full jitter over a window of up to 8 s: no one second takes most of them.
        assert max(per_second.values()) < 0.5 * waiting, sorted(per_second.items())
        print("retries per second after the receiver came back:", sorted(per_second.items()))
    finally:
        run.close()
