"""The consumer-side inbox against a real PostgreSQL: one effect per message id."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest

import outbox_relay
from outbox_relay import inbox
from outbox_relay.inbox import InboxError, InboxTable

EFFECTS = "CREATE TABLE effects (message_id text NOT NULL, amount int NOT NULL)"


def _effects(conn: psycopg.Connection) -> list[tuple[str, int]]:
    return conn.execute("SELECT message_id, amount FROM effects ORDER BY message_id").fetchall()


def test_migration_creates_the_inbox_beside_the_outbox(conn: psycopg.Connection) -> None:
    row = conn.execute("SELECT to_regclass('public.outbox_inbox')::text").fetchone()
    assert row == ("outbox_inbox",)
    index = conn.execute("SELECT to_regclass('public.outbox_inbox_received')::text").fetchone()
    assert index == ("outbox_inbox_received",)
    assert InboxTable.parse(None) == InboxTable("outbox_inbox", "public")
    assert InboxTable.beside("app.events") == InboxTable("events_inbox", "app")


def test_a_duplicate_is_skipped_and_a_failed_attempt_runs_again(
    conn: psycopg.Connection,
) -> None:
    conn.execute(EFFECTS)

    def deliver(amount: int, fail: bool = False) -> bool:
        with inbox.receive(conn, consumer="billing", message_id="outbox-1") as fresh:
            if fresh:
                conn.execute("INSERT INTO effects VALUES ('outbox-1', %s)", (amount,))
                if fail:
                    raise RuntimeError("the effect failed after its write")
            return fresh

    with pytest.raises(RuntimeError):
        deliver(1, fail=True)
    # The failure rolled back the effect *and* the inbox row: not a duplicate.
    assert _effects(conn) == []
    assert not inbox.seen(conn, consumer="billing", message_id="outbox-1")

    assert deliver(2) is True
    assert deliver(3) is False
    assert _effects(conn) == [("outbox-1", 2)]
    # Another consumer of the same message is independent.
    with inbox.receive(conn, consumer="shipping", message_id="outbox-1") as fresh:
        assert fresh


def test_record_refuses_to_run_outside_a_transaction(conn: psycopg.Connection) -> None:
    with pytest.raises(InboxError, match="inside the transaction"):
        inbox.record(conn, consumer="billing", message_id="outbox-1")
    with (
        pytest.raises(InboxError, match="non-empty"),
        inbox.receive(conn, consumer="billing", message_id=""),
    ):
        pass


def test_receive_inside_the_callers_transaction_commits_with_it(dsn: str) -> None:
    with psycopg.connect(dsn) as setup:
        setup.execute(EFFECTS)
    with psycopg.connect(dsn) as conn:  # not autocommit: the caller owns the transaction
        conn.execute("INSERT INTO effects VALUES ('before', 0)")
        with inbox.receive(conn, consumer="billing", message_id="outbox-9") as fresh:
            assert fresh
            conn.execute("INSERT INTO effects VALUES ('outbox-9', 9)")
        conn.rollback()  # the caller changes its mind: the inbox row goes too
        with inbox.receive(conn, consumer="billing", message_id="outbox-9") as fresh:
            assert fresh
        conn.commit()
        assert inbox.seen(conn, consumer="billing", message_id="outbox-9")


def _race(dsn: str, workers: int, body: Any) -> tuple[list[bool], list[BaseException]]:
    """Run ``body(conn, index)`` in ``workers`` threads, each on its own connection,
    released together so their inbox inserts overlap."""
    barrier = threading.Barrier(workers)
    results: list[bool] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(index: int) -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                barrier.wait(timeout=10)
                outcome = body(conn, index)
            with lock:
                results.append(outcome)
        except BaseException as exc:
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results, errors


def test_eight_concurrent_duplicates_make_exactly_one_effect(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(EFFECTS)

    def deliver(conn: psycopg.Connection, index: int) -> bool:
        with inbox.receive(conn, consumer="billing", message_id="order-42-paid") as fresh:
            if fresh:
                conn.execute("INSERT INTO effects VALUES ('order-42-paid', %s)", (index,))
                # Hold the uncommitted inbox row so the others queue behind it.
                time.sleep(0.3)
            return fresh

    results, errors = _race(dsn, 8, deliver)
    assert errors == []
    assert sorted(results) == [False] * 7 + [True]
    with psycopg.connect(dsn) as conn:
        rows = _effects(conn)
        assert len(rows) == 1
        count = conn.execute("SELECT count(*) FROM outbox_inbox").fetchone()
        assert count == (1,)


def test_a_waiting_duplicate_goes_ahead_when_the_first_attempt_rolls_back(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(EFFECTS)
    first_inserted = threading.Event()

    def first(conn: psycopg.Connection) -> None:
        with inbox.receive(conn, consumer="billing", message_id="m-1") as fresh:
            assert fresh
            conn.execute("INSERT INTO effects VALUES ('m-1', 1)")
            first_inserted.set()
            time.sleep(0.5)  # the second delivery is now blocked on our row
            raise RuntimeError("crash before commit")

    def second(conn: psycopg.Connection) -> bool:
        assert first_inserted.wait(5)
        with inbox.receive(conn, consumer="billing", message_id="m-1") as fresh:
            if fresh:
                conn.execute("INSERT INTO effects VALUES ('m-1', 2)")
            return fresh

    outcome: dict[str, Any] = {}

    def run(name: str, fn: Any) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            try:
                outcome[name] = fn(conn)
            except RuntimeError as exc:
                outcome[name] = exc

    threads = [
        threading.Thread(target=run, args=("first", first)),
        threading.Thread(target=run, args=("second", second)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=15)
    assert isinstance(outcome["first"], RuntimeError)
    assert outcome["second"] is True
    with psycopg.connect(dsn) as conn:
        assert _effects(conn) == [("m-1", 2)]


def test_once_runs_a_function_once_per_message_even_concurrently(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(EFFECTS)
    calls: list[str] = []

    @inbox.once(consumer="mailer", dsn=dsn)
    def handle(message_id: str, amount: int, *, conn: psycopg.Connection) -> str:
        calls.append(message_id)
        conn.execute("INSERT INTO effects VALUES (%s, %s)", (message_id, amount))
        time.sleep(0.2)
        return "sent"

    results, errors = _race(dsn, 8, lambda _conn, i: handle("outbox-7", i) == "sent")
    assert errors == []
    assert sorted(results) == [False] * 7 + [True]
    assert handle("outbox-8", 8) == "sent"
    assert handle(message_id="outbox-8", amount=9) is None
    assert calls == ["outbox-7", "outbox-8"]

    # A Message argument counts by its idempotency key; current_connection()
    # serves functions without a conn parameter.
    message = outbox_relay.Message(
        id=5,
        idempotency_key="order-5",
        aggregate_type="order",
        aggregate_id="5",
        event_type="order.paid",
        payload={"amount": 5},
        headers={},
        attempts=1,
        lease_version=1,
        created_at=None,
    )

    @inbox.once(consumer="mailer", conn_factory=lambda: psycopg.connect(dsn), key="message")
    def on_message(message: outbox_relay.Message) -> int:
        inbox.current_connection().execute(
            "INSERT INTO effects VALUES (%s, %s)",
            (message.idempotency_key, message.payload["amount"]),
        )
        return 1

    assert on_message(message) == 1
    assert on_message(message) is None
    with psycopg.connect(dsn) as conn:
        rows = _effects(conn)
        assert [r[0] for r in rows] == ["order-5", "outbox-7", "outbox-8"]
        assert rows[0][1] == 5 and rows[2][1] == 8


def test_once_checks_its_configuration(dsn: str) -> None:
    with pytest.raises(outbox_relay.ConfigError, match="exactly one"):
        inbox.once(consumer="x")
    with pytest.raises(outbox_relay.ConfigError, match="no parameter 'message_id'"):

        @inbox.once(consumer="x", dsn=dsn)
        def handler(event_id: str) -> None:
            pass


def test_purge_inbox_deletes_old_rows_in_batches(conn: psycopg.Connection) -> None:
    start = datetime(2024, 1, 1, tzinfo=timezone.utc)
    with conn.transaction():
        for day in range(10):
            inbox.record(
                conn, consumer="billing", message_id=f"m-{day}", now=start + timedelta(days=day)
            )
        inbox.record(conn, consumer="shipping", message_id="m-0", now=start)
    now = start + timedelta(days=10)

    # Only one consumer's rows when asked.
    assert inbox.purge_inbox(conn, older_than=timedelta(days=8), consumer="shipping", now=now) == 1
    # Rows received before day 3 (days 0, 1 and 2), two per batch.
    deleted = inbox.purge_inbox(conn, older_than=timedelta(days=7), batch=2, now=now)
    assert deleted == 3
    left = conn.execute("SELECT message_id FROM outbox_inbox ORDER BY received_at").fetchall()
    assert [r[0] for r in left] == [f"m-{d}" for d in range(3, 10)]
    # A purged id is no longer a duplicate: retention must outlast redeliveries.
    with inbox.receive(conn, consumer="billing", message_id="m-0", now=now) as fresh:
        assert fresh
    assert inbox.purge_inbox(conn, older_than=timedelta(days=30), now=now) == 0
    with pytest.raises(ValueError):
        inbox.purge_inbox(conn, older_than=timedelta(days=-1))


def test_ensure_inbox_in_a_consumer_database_without_an_outbox(fresh_database: str) -> None:
    results, errors = _race(
        fresh_database,
        4,
        lambda conn, _i: inbox.ensure_inbox(conn, table="consumer.processed") is not None,
    )
    assert errors == [] and results == [True] * 4
    with psycopg.connect(fresh_database, autocommit=True) as conn:
        with inbox.receive(conn, consumer="c", message_id="k", table="consumer.processed") as f:
            assert f
        with inbox.receive(conn, consumer="c", message_id="k", table="consumer.processed") as f:
            assert not f
        assert conn.execute("SELECT to_regclass('consumer.processed_received')").fetchone()[0]
        # The default inbox made by ensure_inbox does not trip the outbox migrations later.
        inbox.ensure_inbox(conn)
        assert 2 in outbox_relay.migrate(conn)
    with pytest.raises(outbox_relay.InvalidIdentifier):
        InboxTable.parse("bad name; drop table x")


def test_message_id_from_a_celery_request() -> None:
    request = SimpleNamespace(id="task-1", headers={"idempotency-key": "order-1-paid"})
    assert inbox.message_id_from_request(request) == "order-1-paid"
    assert inbox.message_id_from_request(SimpleNamespace(id="task-1", headers=None)) == "task-1"
    assert (
        inbox.message_id_from_request(SimpleNamespace(id=None, headers={"outbox-id": 12})) == "12"
    )
    assert inbox.message_id_from_request(SimpleNamespace(id=None, headers={})) is None


def _record(message: outbox_relay.Message) -> None:
    """A publisher for the install() below; never called (no worker runs)."""


def test_inbox_task_finds_the_dsn_of_an_installed_app(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``install(app, dsn=...)`` is enough: the consumer's inbox uses that database,
    ahead of OUTBOX_DSN in the environment (which install() overrides for the relay too)."""
    from celery import Celery

    for name in ("OUTBOX_DSN", "OUTBOX_INBOX_DSN", "OUTBOX_TABLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OUTBOX_DSN", "postgresql://nobody@127.0.0.1:1/elsewhere")
    app = Celery("inbox_install", broker="memory://", set_as_current=False)
    outbox_relay.install(app, dsn=dsn, publisher=_record, beat=False)
    assert app.outbox_relay.dsn == dsn

    @inbox.inbox_task(app, consumer="billing", name="tests.inbox.charge")
    def charge(amount: int) -> int:
        inbox.current_connection().execute(
            "INSERT INTO effects VALUES (%s, %s)", (charge.request.id, amount)
        )
        return amount

    assert charge._inbox_dsn() == dsn
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(EFFECTS)
    # Called as the worker would, with a request carrying the message id: the
    # body runs once, through the installed app's database.
    charge.push_request(id="order-7-paid", headers={})
    try:
        assert charge(7) == 7
        assert charge(7) is None
    finally:
        charge.pop_request()
    with psycopg.connect(dsn) as conn:
        assert _effects(conn) == [("order-7-paid", 7)]
        assert inbox.seen(conn, consumer="billing", message_id="order-7-paid")
