"""Outbox states for the operator tests (CLI, metrics), built through the public API.

Time moves through ``now=``: rows are enqueued, claimed and finished "at"
a past instant, so leases have expired and done rows are old without any
sleeping. ``created_at`` is always the real insert time (enqueue does not
take it from ``now``); a test that needs an old message backdates it with SQL.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg

from outbox_relay import enqueue, store

LEASE = timedelta(minutes=5)


def db_now(conn: psycopg.Connection[Any]) -> datetime:
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]


def add(
    conn: psycopg.Connection[Any],
    *,
    at: datetime,
    aggregate_type: str = "order",
    aggregate_id: str = "o1",
    event_type: str = "order.created",
    n: int = 1,
) -> list[int]:
    return [
        enqueue(
            conn,
            aggregate_type=aggregate_type,
            aggregate_id=aggregate_id,
            event_type=event_type,
            payload={"i": i},
            ordered=False,
            now=at,
        )
        for i in range(n)
    ]


def claim_all(conn: psycopg.Connection[Any], at: datetime, **kw: Any) -> dict[int, Any]:
    return {c.id: c for c in store.claim(conn, owner="test", batch=1000, lease=LEASE, now=at, **kw)}


def make_dead(conn: psycopg.Connection[Any], ids: list[int], at: datetime, error: str) -> None:
    claimed = claim_all(conn, at)
    for i in ids:
        assert store.mark_dead(conn, claimed[i], error=error, now=at)
    for c in claimed.values():
        if c.id not in ids:  # give the others back untouched
            store.reschedule(conn, c, delay=timedelta(0), error=None, refund_attempt=True, now=at)


def backdate(conn: psycopg.Connection[Any], message_id: int, age: timedelta) -> None:
    """The message as if written (and due) ``age`` ago."""
    conn.execute(
        "UPDATE outbox SET created_at = now() - %(age)s, waiting_since = now() - %(age)s"
        " WHERE id = %(id)s",
        {"age": age, "id": message_id},
    )


# What ``status`` and the gauges must report for ``scenario()`` (besides the
# oldest age, about three hours).
EXPECTED = {
    "pending": 3,
    "processing": 1,
    "done": 1,
    "dead": 1,
    "expired_leases": 1,
    "attempts": {"0": 2, "1": 2},
}


@dataclass
class Scenario:
    """The ids of ``scenario()``'s rows, one per state."""

    done: int
    dead: int
    processing: int
    retried: int
    fresh: list[int]
    oldest: int


def scenario(conn: psycopg.Connection[Any]) -> Scenario:
    """pending x3 (one retried once, one three hours old), processing x1 with an
    expired lease, done x1, dead x1."""
    t0 = datetime.now(timezone.utc) - timedelta(hours=2)
    ids = [add(conn, at=t0, aggregate_id=f"o{i}")[0] for i in range(6)]
    claimed = claim_all(conn, t0)
    assert set(claimed) == set(ids)
    assert store.mark_done(conn, claimed[ids[0]], now=t0)
    assert store.mark_dead(conn, claimed[ids[1]], error="permanent: HTTP 400", now=t0)
    # ids[2] keeps its lease, which ended at t0 + 5 minutes: expired now.
    assert store.reschedule(
        conn, claimed[ids[3]], delay=timedelta(0), error="retryable: 503", refund_attempt=False,
        now=t0,
    )  # fmt: skip
    for i in ids[4:]:
        assert store.reschedule(
            conn, claimed[i], delay=timedelta(0), error=None, refund_attempt=True, now=t0
        )
    backdate(conn, ids[4], timedelta(hours=3))  # the others are due since t0, 2 hours ago
    return Scenario(
        done=ids[0], dead=ids[1], processing=ids[2], retried=ids[3], fresh=ids[4:], oldest=ids[4]
    )
