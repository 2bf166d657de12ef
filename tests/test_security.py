"""Security defaults, tested against the real thing.

* The least-privilege roles of ``outbox-relay grant``: real roles in a real
  database, each connecting as itself and running the real code paths
  (enqueue, the relay's services, the operator commands), and being refused
  everything else.
* The webhook publisher: TLS verification, warnings for credentials over
  plain HTTP, no credential or token in any log line, and producer headers
  forwarded only through an allowlist, all over real HTTP on loopback.
* The broker publisher verifies TLS (certificate and host name) by default.
* The metrics exporter listens on loopback unless told otherwise.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result
from psycopg import errors, sql
from psycopg.conninfo import make_conninfo

from outbox_relay import (
    DirectDatabase,
    Message,
    OperationKeyConflict,
    OutboxTable,
    PermanentError,
    RetryableError,
    enqueue,
    operations,
    store,
)
from outbox_relay.cli import main
from outbox_relay.metrics import OutboxCollector
from outbox_relay.services.claimer import Claimer
from outbox_relay.services.deliverer import Deliverer
from outbox_relay.services.purger import Purger
from outbox_relay.services.rescuer import Rescuer
from outbox_relay.sql.queries import migrations_for

from .opsdata import LEASE, add, claim_all, db_now, make_dead

pytestmark = pytest.mark.security


# ================================================================ roles
Connect = Callable[[str], psycopg.Connection[Any]]


@pytest.fixture
def roles(conn: psycopg.Connection[Any], dsn: str) -> Iterator[Callable[[str], tuple[str, str]]]:
    """``make(kind)`` creates a login role with ``operations.grants(role, kind)``
    applied and returns ``(role, dsn as that role)``. Roles are cluster-wide:
    unique names, dropped (with what they were granted) after the test."""
    made: list[str] = []

    def make(kind: str) -> tuple[str, str]:
        name = f"outbox_sec_{kind}_{uuid.uuid4().hex[:8]}"
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
        made.append(name)
        conn.execute(operations.grants(name, kind))  # type: ignore[arg-type]
        return name, make_conninfo(dsn, user=name)

    try:
        yield make
    finally:
        for name in made:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


@contextmanager
def connected(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as c:
        yield c


def refused(c: psycopg.Connection[Any], statement: str, params: Any = None) -> None:
    with pytest.raises(errors.InsufficientPrivilege):
        c.execute(statement, params)


def test_producer_enqueues_but_reads_no_payload(
    conn: psycopg.Connection[Any], dsn: str, roles: Callable[[str], tuple[str, str]]
) -> None:
    _, producer_dsn = roles("producer")
    channel = OutboxTable().channel
    store.listen(conn)  # enqueue's NOTIFY must arrive
    # A message written by someone else, with a payload that is none of the producer's business.
    secret_id = enqueue(conn, aggregate_type="user", aggregate_id="7", event_type="user.created",
                        payload={"ssn": "078-05-1120"}, operation_key="user-7")  # fmt: skip
    list(conn.notifies(timeout=1, stop_after=1))
    with connected(producer_dsn) as c:
        with c.transaction():
            first = enqueue(c, aggregate_type="order", aggregate_id=1, event_type="order.created",
                            payload={"total": 10}, operation_key="order-1-created",
                            headers={"traceparent": "00-1-2-01"})  # fmt: skip
        # Delivered at commit: the producer may NOTIFY without any grant.
        assert [n.channel for n in conn.notifies(timeout=5, stop_after=1)] == [channel]
        # The operation-key check: same content, same id; other content, a clear
        # error; both without reading the stored payload.
        again = enqueue(c, aggregate_type="order", aggregate_id=1, event_type="order.created",
                        payload={"total": 10}, operation_key="order-1-created",
                        headers={"traceparent": "00-1-2-01"})  # fmt: skip
        assert again == first
        with pytest.raises(OperationKeyConflict):
            enqueue(c, aggregate_type="order", aggregate_id=1, event_type="order.created",
                    payload={"total": 99}, operation_key="order-1-created")  # fmt: skip
        # A key someone else used is a conflict too, and tells nothing of its content.
        with pytest.raises(OperationKeyConflict):
            enqueue(c, aggregate_type="user", aggregate_id="7", event_type="user.created",
                    payload={"ssn": "guess"}, operation_key="user-7")  # fmt: skip
        # An ordered message takes its aggregate's advisory lock.
        with c.transaction():
            enqueue(c, aggregate_type="order", aggregate_id=1, event_type="order.paid",
                    payload={}, ordered=True, delay=timedelta(seconds=5))  # fmt: skip
            locks = conn.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            ).fetchone()
            assert locks == (1,)
        # What it may read: ids, keys and digests.
        assert c.execute("SELECT count(*) FROM outbox WHERE operation_key IS NOT NULL").fetchone()
        for statement in (
            "SELECT payload FROM outbox",
            "SELECT headers FROM outbox",
            "SELECT * FROM outbox",
            "SELECT id FROM outbox WHERE payload ->> 'ssn' LIKE '0%%'",  # no oracle either
            "SELECT status, last_error FROM outbox",
            "UPDATE outbox SET status = 'done'",
            "UPDATE outbox SET payload = '{}'",
            "DELETE FROM outbox",
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status)"
            " VALUES ('a', 'b', 'c', '{}', 'done')",
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, lease_version)"
            " VALUES ('a', 'b', 'c', '{}', 99)",
            "SELECT * FROM outbox_migrations",
        ):
            refused(c, statement)
        # It cannot act as the relay.
        with pytest.raises(errors.InsufficientPrivilege):
            store.claim(c, owner="producer", batch=10, lease=LEASE)
        with pytest.raises(errors.InsufficientPrivilege):
            store.rescue(c, max_attempts=3)
    assert store.get_row(conn, secret_id)["status"] == "pending"  # type: ignore[index]


def test_the_digest_is_the_same_in_the_insert_and_the_migration(
    conn: psycopg.Connection[Any],
) -> None:
    """The content digest is computed in three places (insert, insert_conflict,
    migration 0004's backfill); they must agree, or keys written before the
    migration would conflict with themselves."""
    for payload, headers in (({"a": [1, "é", None]}, {"traceparent": "x"}), ([], {})):
        enqueue(conn, aggregate_type="t", aggregate_id="ä", event_type="e", payload=payload,
                headers=headers, operation_key=f"k-{len(payload)}")  # fmt: skip
    migration = next(m for m in migrations_for(OutboxTable()) if m.name == "content_hash")
    backfill = migration.sql[migration.sql.index("UPDATE") :]
    before = conn.execute("SELECT id, content_hash FROM outbox ORDER BY id").fetchall()
    assert all(h is not None for _, h in before)
    conn.execute(backfill)
    assert conn.execute("SELECT id, content_hash FROM outbox ORDER BY id").fetchall() == before
    # Rows without a key carry no digest: nothing ever compares them.
    enqueue(conn, aggregate_type="t", aggregate_id="1", event_type="e", payload={})
    assert conn.execute("SELECT count(*) FROM outbox WHERE content_hash IS NULL").fetchone() == (1,)


def test_a_keyed_row_without_digest_is_compared_in_full(conn: psycopg.Connection[Any]) -> None:
    """A row written by a producer of an older version (rolling upgrade) has no
    digest; a role that may read payloads still gets the right answer."""
    first = enqueue(conn, aggregate_type="o", aggregate_id="1", event_type="e",
                    payload={"x": 1}, operation_key="legacy")  # fmt: skip
    conn.execute("UPDATE outbox SET content_hash = NULL")
    assert enqueue(conn, aggregate_type="o", aggregate_id="1", event_type="e",
                   payload={"x": 1}, operation_key="legacy") == first  # fmt: skip
    with pytest.raises(OperationKeyConflict):
        enqueue(conn, aggregate_type="o", aggregate_id="1", event_type="e",
                payload={"x": 2}, operation_key="legacy")  # fmt: skip


def test_relay_runs_its_services_and_changes_only_dispatch_columns(
    conn: psycopg.Connection[Any], roles: Callable[[str], tuple[str, str]]
) -> None:
    t0 = db_now(conn) - timedelta(days=10)
    ok, retry, dead, expired, old_done = add(conn, at=t0, n=5)
    _, relay_dsn = roles("relay")
    with connected(relay_dsn) as c:
        table = OutboxTable()
        # The worker's start-up checks and its LISTEN connection.
        assert store.table_exists(c, table=table)
        assert store.missing_migrations(c, table=table) == []
        store.listen(c, table=table)
        # An old delivery, done ten days ago: for the purge below.
        held = claim_all(c, t0)
        assert store.mark_done(c, held[old_done], now=t0)
        # One whose worker died: its lease (from ten days ago) has expired.
        for i in (ok, retry, dead):
            store.reschedule(c, held[i], delay=timedelta(0), error=None, refund_attempt=True,
                             now=t0)  # fmt: skip
        assert held[expired].lease_version >= 1
        freed = Rescuer(DirectDatabase(c), table=table, max_attempts=5).run_once()
        assert freed.released == [expired]

        # The Celery path: claim (fan-out), then begin, publish, finalize.
        claimed = Claimer(DirectDatabase(c), table=table, owner=lambda: "w1", batch_size=10,
                          max_in_flight=100, lease=LEASE, max_attempts=5).run_once()  # fmt: skip
        assert sorted(m.id for m in claimed.claimed) == sorted([ok, retry, dead, expired])
        assert store.in_flight(c, table=table) == 4

        def publish(message: Message) -> None:
            if message.id == retry:
                raise RetryableError("503")
            if message.id == dead:
                raise PermanentError("400")

        deliverer = Deliverer(publish, db=DirectDatabase(c), table=table, count_attempt=True)
        report = deliverer.deliver([m.ref for m in claimed.claimed])
        deliverer.close()
        assert report.lost == 0
        purged = Purger(DirectDatabase(c), table=table, older_than=timedelta(days=7)).run_once()
        assert purged.deleted == 1
        # A long publish's lease renewal.
        again = store.claim(c, owner="w2", batch=10, lease=LEASE, now=db_now(conn) + LEASE * 10)
        assert [m.id for m in again] == [retry]
        assert store.extend_lease(c, again[0], lease=LEASE, now=db_now(conn) + LEASE * 10)

        # What a message says is not the relay's to change, and it writes none.
        for column, value in (
            ("payload", "'{}'"),
            ("headers", "'{}'"),
            ("event_type", "'x'"),
            ("aggregate_id", "'x'"),
            ("operation_key", "'x'"),
            ("content_hash", "NULL"),
            ("created_at", "now()"),
        ):
            refused(c, f"UPDATE outbox SET {column} = {value} WHERE id = {ok}")
        with pytest.raises(errors.InsufficientPrivilege):
            enqueue(c, aggregate_type="a", aggregate_id="b", event_type="c", payload={})
        refused(c, "DELETE FROM outbox_migrations")
        refused(c, "CREATE TABLE outbox_evil (id int)")
    states = {i: store.get_row(conn, i)["status"] for i in (ok, dead, expired)}  # type: ignore[index]
    assert states == {ok: "done", dead: "dead", expired: "done"}


def operator_cli(dsn: str, *args: str) -> Result:
    return CliRunner().invoke(main, ["--dsn", dsn, *args], env={"OUTBOX_DSN": None})


def test_operator_does_dead_letter_work_without_reading_or_writing_messages(
    conn: psycopg.Connection[Any], roles: Callable[[str], tuple[str, str]]
) -> None:
    t0 = db_now(conn) - timedelta(days=10)
    ids = add(conn, at=t0, n=4)
    make_dead(conn, ids[:3], t0, "HTTP 400")
    done = claim_all(conn, t0)
    assert store.mark_done(conn, done[ids[3]], now=t0)
    role, operator_dsn = roles("operator")

    def run(*args: str) -> str:
        result = operator_cli(operator_dsn, *args)
        assert result.exit_code == 0, (result.output, result.exception)
        return result.output

    status = json.loads(run("status", "--json"))
    assert (status["dead"], status["done"]) == (3, 1)
    listed = json.loads(run("dead", "list", "--json"))
    assert [r["id"] for r in listed] == ids[:3]
    run("dead", "retry", str(ids[0]))
    run("dead", "skip", str(ids[1]))
    run("dead", "retry", "--all")
    assert "purged 1 done message(s)" in run("purge", "--older-than", "7d")
    gauges = OutboxCollector(operator_dsn).read()  # the metrics exporter
    assert (gauges.pending, gauges.dead) == (2, 0)

    with connected(operator_dsn) as c:
        for statement in (
            "SELECT payload FROM outbox",
            "SELECT headers FROM outbox",
            "UPDATE outbox SET lease_version = lease_version + 1",
            "UPDATE outbox SET lease_until = now()",
            "UPDATE outbox SET payload = '{}'",
            "CREATE TABLE outbox_evil (id int)",
        ):
            refused(c, statement)
        with pytest.raises(errors.InsufficientPrivilege):
            enqueue(c, aggregate_type="a", aggregate_id="b", event_type="c", payload={})
        with pytest.raises(errors.InsufficientPrivilege):
            store.claim(c, owner="operator", batch=10, lease=LEASE)
    assert role


def test_grant_kinds_are_checked() -> None:
    with pytest.raises(ValueError, match="producer, relay, operator"):
        operations.grants("x", "admin")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        operations.grants("", "operator")
    text = operations.grants('we"ird', "operator", table="app.events")
    assert 'TO "we""ird";' in text and '"app"."events"' in text
    statements = "\n".join(line for line in text.splitlines() if not line.startswith("--"))
    assert "INSERT" not in statements and "payload" not in statements
