"""Chunks delivered the way a delivery task does, for the publishers' tests."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg

import outbox_relay
from outbox_relay import RetryPolicy


def deliver_chunks(
    conn: psycopg.Connection[Any], publisher: Any, *, rows: int, chunks: int, close: bool = True
) -> int:
    """Claim and deliver ``chunks`` chunks of ``rows`` from as many threads
    as rows; return how many are done. ``close``: close the publisher too
    (the deliverer always; the publisher keeps its connections otherwise)."""
    relay = outbox_relay.Deliverer(
        publisher,
        db=outbox_relay.DirectDatabase(conn),
        policy=RetryPolicy(max_attempts=4, backoff_base=0.0),
        publish_timeout=publisher.timeout_seconds,
        concurrency=rows,
    )
    done = 0
    try:
        for _ in range(chunks):
            claimed = outbox_relay.claim(conn, owner="w1", batch=rows, lease=timedelta(seconds=30))
            done += relay.deliver([c.ref for c in claimed]).done
    finally:
        relay.close()
        if close:
            publisher.close()
    return done
