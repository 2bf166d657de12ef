"""Publishers used by the benchmarks: a no-op, and one that waits like a network call."""

from __future__ import annotations

import os
import time
from typing import Any

from outbox_relay import Message


def noop(message: Message) -> None:
    """Publish nowhere: measures the relay's own cost."""


def wait20ms(message: Message) -> None:
    """Stand-in for a receiver that answers in 20 ms."""
    time.sleep(0.02)


_conn: Any = None
_pid: int | None = None


def record_latency(message: Message) -> None:
    """Record commit-to-publish latency (row created_at is the producer's transaction time)."""
    global _conn, _pid
    if _conn is None or _pid != os.getpid():
        import psycopg

        _conn = psycopg.connect(os.environ["BENCH_DSN"], autocommit=True)
        _pid = os.getpid()
    assert message.created_at is not None
    latency = time.time() - message.created_at.timestamp()
    _conn.execute(
        "INSERT INTO bench_latency (id, seconds) VALUES (%s, %s) ON CONFLICT DO NOTHING",
        (message.id, latency),
    )
