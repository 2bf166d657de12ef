"""outbox_relay.operations against real PostgreSQL: the grants really are
enough (and no more), purge keeps an index-backed plan, argument checks."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import errors, sql

from outbox_relay import OperationKeyConflict, OutboxTable, enqueue, operations, store
from outbox_relay.sql.queries import migrations_for, queries_for

from .opsdata import LEASE, add, claim_all, db_now, make_dead


@pytest.fixture
def role(conn: psycopg.Connection[Any]) -> Iterator[str]:
    """A throwaway role. Roles are cluster-wide: drop it, and what it was
    granted in this database, before the database goes."""
    name = f"outbox_role_{uuid.uuid4().hex[:8]}"
    conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(name)))
    try:
        yield name
    finally:
        conn.execute("RESET ROLE")
        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def act_as(conn: psycopg.Connection[Any], role: str) -> None:
    conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(role)))


def test_producer_grants_allow_enqueue_and_nothing_else(
    conn: psycopg.Connection[Any], role: str
) -> None:
    conn.execute(operations.grants(role, "producer"))
    act_as(conn, role)
    first = enqueue(conn, aggregate_type="order", aggregate_id=1, event_type="order.created",
                    payload={"total": 10}, operation_key="order-1-created")  # fmt: skip
    # The operation-key check reads the existing row: same content, same id ...
    again = enqueue(conn, aggregate_type="order", aggregate_id=1, event_type="order.created",
                    payload={"total": 10}, operation_key="order-1-created")  # fmt: skip
    assert again == first
    # ... different content, a clear error.
    with pytest.raises(OperationKeyConflict):
        enqueue(conn, aggregate_type="order", aggregate_id=1, event_type="order.created",
                payload={"total": 99}, operation_key="order-1-created")  # fmt: skip
    enqueue(conn, aggregate_type="order", aggregate_id=1, event_type="order.paid", payload={},
            ordered=True, delay=timedelta(seconds=5))  # fmt: skip
    for forbidden in (
        "SELECT status, last_error FROM outbox",
        "UPDATE outbox SET status = 'done'",
        "DELETE FROM outbox",
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status)"
        " VALUES ('a', 'b', 'c', '{}', 'done')",
    ):
        with pytest.raises(errors.InsufficientPrivilege):
            conn.execute(forbidden)


def test_relay_grants_cover_delivery_and_operations(
    conn: psycopg.Connection[Any], role: str
) -> None:
    t0 = db_now(conn) - timedelta(days=10)
    ids = add(conn, at=t0, n=3)
    make_dead(conn, [ids[2]], t0, "boom")
    conn.execute(operations.grants(role, "relay"))
    act_as(conn, role)
    claimed = claim_all(conn, t0)
    assert set(claimed) == set(ids[:2])
    assert store.mark_done(conn, claimed[ids[0]], now=t0)
    assert store.extend_lease(conn, claimed[ids[1]], lease=LEASE, now=t0)
    assert store.mark_dead(conn, claimed[ids[1]], error="x", now=t0)
    assert operations.status(conn)["dead"] == 2
    assert [r.id for r in operations.dead_list(conn)] == ids[1:]
    assert operations.dead_retry(conn, [ids[1]]) == [ids[1]]
    assert operations.dead_skip(conn, [ids[2]]) == [ids[2]]
    assert operations.purge(conn, older_than=timedelta(days=7)).deleted == 1
    latest = max(m.version for m in migrations_for(OutboxTable()))
    assert conn.execute("SELECT max(version) FROM outbox_migrations").fetchone() == (latest,)
    with pytest.raises(errors.InsufficientPrivilege):
        enqueue(conn, aggregate_type="a", aggregate_id="b", event_type="c", payload={})


def test_purge_plan_probes_the_primary_key(conn: psycopg.Connection[Any]) -> None:
    """With ``id IN (subquery)`` the planner hashed the batch and scanned the
    whole table for it; the batch must reach rows through the primary key."""
    conn.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status, done_at)"
        " SELECT 'a', g::text, 'e', '{}', 'done', now() - g * interval '1 second'"
        " FROM generate_series(1, 20000) AS g"
    )
    conn.execute("ANALYZE outbox")
    query = queries_for(OutboxTable()).op_purge_done
    plan = conn.execute(
        "EXPLAIN (FORMAT JSON) " + query, {"cutoff": db_now(conn), "batch": 5000}
    ).fetchone()
    assert plan is not None
    text = json.dumps(plan[0])
    assert "Seq Scan" not in text, text
    assert '"Index Name": "outbox_pkey"' in text and '"Index Name": "outbox_done"' in text


def test_argument_checks(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(ValueError, match="ids to retry"):
        operations.dead_retry(conn)
    with pytest.raises(ValueError, match="not both"):
        operations.dead_retry(conn, [1], all_dead=True)
    assert operations.dead_retry(conn, []) == []
    assert operations.dead_skip(conn, []) == []
    with pytest.raises(ValueError, match="batch_size"):
        operations.purge(conn, older_than=timedelta(days=1), batch_size=0)
    with conn.transaction(), pytest.raises(ValueError, match="outside a transaction"):
        operations.purge(conn, older_than=timedelta(days=1))
    with pytest.raises(ValueError, match="kind"):
        operations.grants("x", "admin")  # type: ignore[arg-type]


def oldest_at(conn: psycopg.Connection[Any], at: Any) -> float:
    return float(store.stats(conn, now=at)["oldest_pending_age_seconds"])


def test_the_oldest_wait_counts_a_scheduled_message_from_when_it_is_due(
    conn: psycopg.Connection[Any],
) -> None:
    """``oldest_pending_age_seconds`` (status, and the gauge the delivery
    alerts watch) is how long a message has waited for its delivery: one
    enqueued with a delay is on time until it is due, and late from then on,
    its failures and backoff included; one an operator sent back from dead
    waits from then (migration 0008, waiting_since)."""

    def oldest(at: Any) -> float:
        return oldest_at(conn, at)

    start = db_now(conn)
    message = enqueue(
        conn,
        aggregate_type="order",
        aggregate_id="o1",
        event_type="order.remind",
        payload={},
        delay=timedelta(minutes=15),
    )
    assert oldest(start + timedelta(minutes=1)) == 0  # scheduled: nobody is late
    assert oldest(start + timedelta(minutes=14)) == 0
    assert 295 <= oldest(start + timedelta(minutes=20)) <= 305  # due 5 minutes ago
    # Claimed, its first attempt under way: still counted from when it was due.
    at = start + timedelta(minutes=20)
    claimed = claim_all(conn, at)
    assert 295 <= oldest(at) <= 305
    # The receiver failed; back off for 10 minutes: it goes on counting from
    # when it was due, backoff and all, never from when it was written (the
    # 15 minutes of its delay would have paged at once).
    assert store.reschedule(
        conn,
        claimed[message],
        delay=timedelta(minutes=10),
        error="retryable: HTTP 503",
        refund_attempt=False,
        now=at,
    )
    assert 595 <= oldest(start + timedelta(minutes=25)) <= 605
    # Dead for two days, then retried by an operator: it waits from the retry,
    # and keeps doing so when that attempt fails too.
    later = start + timedelta(minutes=30)
    make_dead(conn, [message], later, "permanent: HTTP 400")
    retried_at = later + timedelta(days=2)
    assert operations.dead_retry(conn, [message], now=retried_at) == [message]
    assert 0 <= oldest(retried_at + timedelta(minutes=1)) - 60 <= 5
    again = claim_all(conn, retried_at)
    assert store.reschedule(
        conn, again[message], delay=timedelta(minutes=1), error="retryable: HTTP 503",
        refund_attempt=False, now=retried_at,
    )  # fmt: skip
    assert 0 <= oldest(retried_at + timedelta(minutes=3)) - 180 <= 5


def test_the_oldest_wait_of_a_row_written_before_migration_8(
    conn: psycopg.Connection[Any],
) -> None:
    # Rows from before waiting_since count as they did: from their due time
    # until tried, from created_at after.
    start = db_now(conn)
    message = enqueue(
        conn, aggregate_type="order", aggregate_id="o1", event_type="order.remind",
        payload={}, delay=timedelta(minutes=15),
    )  # fmt: skip
    conn.execute("UPDATE outbox SET waiting_since = NULL WHERE id = %s", (message,))
    assert oldest_at(conn, start + timedelta(minutes=14)) == 0
    assert 295 <= oldest_at(conn, start + timedelta(minutes=20)) <= 305
    at = start + timedelta(minutes=20)
    claimed = claim_all(conn, at)
    assert store.reschedule(
        conn, claimed[message], delay=timedelta(minutes=10), error="retryable: HTTP 503",
        refund_attempt=False, now=at,
    )  # fmt: skip
    assert 1495 <= oldest_at(conn, start + timedelta(minutes=25)) <= 1505


def test_dead_retry_limit_and_spread(conn: psycopg.Connection[Any]) -> None:
    # The oldest `limit` matches, due evenly over `spread` in id order, each
    # waiting from its own due time (the oldest-wait alert never counts the
    # spread); the rest stay dead.
    at = db_now(conn)
    ids = add(conn, at=at, n=5)
    make_dead(conn, ids, at, "retryable: HTTP 503")
    where = operations.DeadFilter(event_type="order.created")
    assert operations.dead_count(conn, where=where) == 5
    assert operations.dead_count(conn, where=operations.DeadFilter(event_type="x")) == 0
    retried = operations.dead_retry(
        conn, all_dead=True, where=where, limit=4, spread=timedelta(minutes=4), now=at
    )
    assert retried == ids[:4]
    rows = [store.get_row(conn, i) for i in ids]
    assert rows[4] is not None and rows[4]["status"] == "dead"
    due = [r["available_at"] for r in rows[:4] if r is not None]
    assert due == [at + timedelta(minutes=m) for m in range(4)]
    assert [r["waiting_since"] for r in rows[:4] if r is not None] == due
    assert operations.dead_count(conn) == 1
    with pytest.raises(ValueError, match="limit"):
        operations.dead_retry(conn, all_dead=True, limit=0)
    with pytest.raises(ValueError, match="spread"):
        operations.dead_retry(conn, all_dead=True, spread=timedelta(seconds=-1))


def test_dead_skip_all_and_done_recently(conn: psycopg.Connection[Any]) -> None:
    at = db_now(conn)
    paid = add(conn, at=at, event_type="order.paid", n=3)
    sent = add(conn, at=at, event_type="invoice.sent")
    make_dead(conn, [*paid, *sent], at, "permanent: HTTP 400")
    with pytest.raises(ValueError, match="ids to skip"):
        operations.dead_skip(conn)
    where = operations.DeadFilter(event_type="order.paid")
    assert operations.dead_skip(conn, all_dead=True, where=where, limit=2, now=at) == paid[:2]
    assert operations.dead_skip(conn, all_dead=True, where=where, now=at) == paid[2:]
    assert operations.dead_count(conn) == 1  # invoice.sent is left
    # A skip is a done: it counts in the last minute's rate, and leaves it after.
    assert operations.done_recently(conn, now=at + timedelta(seconds=30)) == 3
    assert operations.done_recently(conn, now=at + timedelta(minutes=2)) == 0
    status = operations.status(conn, now=at + timedelta(seconds=30))
    assert status["done_last_minute"] == 3 and status["in_flight"] == 0
