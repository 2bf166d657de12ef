"""enqueue / enqueue_many: the producer side, inside the caller's transaction."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox_relay
from outbox_relay import (
    InvalidMessage,
    NewMessage,
    OperationKeyConflict,
    OutboxTable,
    enqueue,
    enqueue_many,
    store,
)

LEASE = timedelta(seconds=30)


def db_now(conn: psycopg.Connection[Any]) -> datetime:
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]


def count(conn: psycopg.Connection[Any], table: str = "outbox") -> int:
    row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()
    assert row is not None
    return int(row[0])


def rows(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT id, aggregate_type, aggregate_id, event_type, payload, headers, operation_key,"
        " status FROM outbox ORDER BY id"
    ).fetchall()


def order_created(conn: psycopg.Connection[Any], **kw: Any) -> int:
    fields: dict[str, Any] = {
        "aggregate_type": "order",
        "aggregate_id": "42",
        "event_type": "order.created",
        "payload": {"total": 10},
    }
    fields.update(kw)
    return enqueue(conn, **fields)


def backend_waits_on(monitor: psycopg.Connection[Any], pid: int, lock: str) -> bool:
    """Whether backend ``pid`` is blocked on a heavyweight lock of type ``lock``."""
    row = monitor.execute(
        "SELECT wait_event_type, wait_event FROM pg_stat_activity WHERE pid = %s", (pid,)
    ).fetchone()
    return row == ("Lock", lock)


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.01)  # polling another backend's state: nothing to wait on


# ---------------------------------------------------------------- transactions
def test_enqueue_rolled_back_with_the_callers_transaction_leaves_no_row(dsn: str) -> None:
    with psycopg.connect(dsn) as producer, psycopg.connect(dsn, autocommit=True) as observer:
        producer.execute("CREATE TABLE orders (id int PRIMARY KEY)")
        producer.commit()
        producer.execute("INSERT INTO orders VALUES (1)")
        message_id = order_created(producer)
        assert message_id > 0
        # Not visible to anyone before the business transaction commits.
        assert count(observer) == 0
        producer.rollback()
        assert count(observer) == 0
        assert observer.execute("SELECT count(*) FROM orders").fetchone() == (0,)


def test_enqueue_as_the_first_statement_still_joins_the_callers_transaction(dsn: str) -> None:
    # The natural order "record the event, then write the order" on a fresh
    # (idle, non-autocommit) connection: enqueue must not commit by itself.
    with psycopg.connect(dsn) as producer, psycopg.connect(dsn, autocommit=True) as observer:
        producer.execute("CREATE TABLE orders (id int PRIMARY KEY)")
        producer.commit()
        assert producer.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        order_created(producer)
        assert producer.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        producer.execute("INSERT INTO orders VALUES (1)")
        assert count(observer) == 0
        producer.rollback()
        assert count(observer) == 0

        enqueue_many(producer, [NewMessage("order", "1", "order.created", {})])
        producer.execute("INSERT INTO orders VALUES (1)")
        producer.commit()
        assert count(observer) == 1


def test_enqueue_committed_with_the_callers_transaction_is_pending(dsn: str) -> None:
    with psycopg.connect(dsn) as producer, psycopg.connect(dsn, autocommit=True) as observer:
        producer.execute("CREATE TABLE orders (id int PRIMARY KEY)")
        producer.commit()
        with producer.transaction():
            producer.execute("INSERT INTO orders VALUES (1)")
            message_id = order_created(producer, headers={"trace": "abc"})
            assert count(observer) == 0
        row = store.get_row(observer, message_id)
        assert row is not None
        assert row["status"] == "pending"
        assert row["attempts"] == 0
        assert row["lease_version"] == 0
        assert row["lease_until"] is None
        assert row["payload"] == {"total": 10}
        assert row["headers"] == {"trace": "abc"}
        assert row["aggregate_id"] == "42"
        assert row["available_at"] == row["created_at"]
        assert observer.execute("SELECT count(*) FROM orders").fetchone() == (1,)


def test_enqueue_many_returns_ids_in_order_and_integer_aggregate_ids_become_text(
    conn: psycopg.Connection[Any],
) -> None:
    ids = enqueue_many(
        conn,
        [
            NewMessage("order", 7, "order.created", {"n": 0}),
            NewMessage("order", "7", "order.paid", [1, 2, 3]),
            NewMessage("user", "u1", "user.created", "text payload"),
        ],
    )
    assert ids == sorted(ids) and len(set(ids)) == 3
    assert [(r[2], r[4]) for r in rows(conn)] == [
        ("7", {"n": 0}),
        ("7", [1, 2, 3]),
        ("u1", "text payload"),
    ]
    assert enqueue_many(conn, []) == []


# ---------------------------------------------------------------- operation keys
def test_operation_key_with_same_content_returns_the_existing_id(
    conn: psycopg.Connection[Any],
) -> None:
    first = order_created(conn, operation_key="refund:42", payload={"a": 1, "b": [1, 2]})
    # Same meaning, JSON keys in another order: the same operation.
    again = order_created(conn, operation_key="refund:42", payload={"b": [1, 2], "a": 1})
    assert again == first
    # Inside a batch too, next to a new message.
    ids = enqueue_many(
        conn,
        [
            NewMessage("order", "42", "order.created", {"a": 1, "b": [1, 2]}, "refund:42"),
            NewMessage("order", "42", "order.created", {"x": 1}, "refund:43"),
        ],
    )
    assert ids[0] == first and ids[1] != first
    assert count(conn) == 2


def test_a_batch_maps_each_message_to_its_own_row_around_repeated_keys(
    conn: psycopg.Connection[Any],
) -> None:
    """enqueue_many inserts a batch in one statement: each returned id must
    still be its own message's row, with keys that repeat in the batch or
    exist already, and each message's own delay."""
    existing = order_created(conn, operation_key="k-old", payload={"old": 1})
    ids = enqueue_many(
        conn,
        [
            NewMessage("order", "1", "order.created", {"n": 1}, delay=60),
            NewMessage("order", "42", "order.created", {"old": 1}, "k-old"),
            NewMessage("order", "2", "order.created", {"n": 2}, "k-new"),
            NewMessage("order", "3", "order.created", {"n": 3}),
            NewMessage("order", "2", "order.created", {"n": 2}, "k-new"),
            NewMessage("order", "4", "order.created", {"n": 4}, "k-4", delay=5),
        ],
    )
    assert ids[1] == existing and ids[4] == ids[2]
    assert len({ids[0], ids[2], ids[3], ids[5], existing}) == 5
    found = {
        r[0]: (r[1], r[2], r[3])
        for r in conn.execute(
            "SELECT id, payload, operation_key,"
            " round(extract(epoch FROM available_at - created_at)) FROM outbox"
        ).fetchall()
    }
    assert [found[i] for i in ids] == [
        ({"n": 1}, None, 60),
        ({"old": 1}, "k-old", 0),
        ({"n": 2}, "k-new", 0),
        ({"n": 3}, None, 0),
        ({"n": 2}, "k-new", 0),
        ({"n": 4}, "k-4", 5),
    ]
    assert count(conn) == 5
    # A key repeated in one batch with another content is a conflict with the
    # batch's own first row, and nothing of the batch is written.
    with pytest.raises(OperationKeyConflict, match="k-twice"):
        enqueue_many(
            conn,
            [
                NewMessage("order", "5", "order.created", {"n": 5}, "k-twice"),
                NewMessage("order", "5", "order.created", {"n": 6}, "k-twice"),
            ],
        )
    assert count(conn) == 5


@pytest.mark.parametrize(
    "change",
    [
        {"payload": {"total": 11}},
        {"event_type": "order.cancelled"},
        {"aggregate_id": "43"},
        {"aggregate_type": "invoice"},
        {"headers": {"h": "1"}},
    ],
    ids=lambda c: next(iter(c)),
)
def test_operation_key_with_different_content_raises_and_writes_nothing(
    conn: psycopg.Connection[Any], change: dict[str, Any]
) -> None:
    first = order_created(conn, operation_key="op-7")
    before = rows(conn)
    with pytest.raises(OperationKeyConflict, match="op-7") as info:
        order_created(conn, operation_key="op-7", **change)
    assert info.value.operation_key == "op-7"
    assert info.value.existing_id == first
    assert str(first) in str(info.value)
    assert rows(conn) == before


def test_operation_key_conflict_in_a_batch_rolls_back_the_whole_batch_only(dsn: str) -> None:
    with psycopg.connect(dsn) as producer:
        order_created(producer, operation_key="op-1")
        producer.commit()
        before = rows(producer)
        producer.commit()
        producer.execute("SELECT 1")  # the caller's transaction is open
        kept = order_created(producer, aggregate_id="kept")
        with pytest.raises(OperationKeyConflict, match="op-1"):
            enqueue_many(
                producer,
                [
                    NewMessage("order", "1", "order.created", {"new": True}),
                    NewMessage("order", "42", "order.created", {"total": 99}, "op-1"),
                ],
            )
        # The caller's transaction survives the error (a savepoint was rolled
        # back), keeps its own earlier message and can commit.
        producer.commit()
        after = rows(producer)
    assert [r[0] for r in after] == [*(r[0] for r in before), kept]
    assert after[:-1] == before


def test_one_operation_key_twice_in_a_batch_is_named_as_such(conn: psycopg.Connection[Any]) -> None:
    """The error named "outbox message 36", a row of the batch that the
    error itself rolled back: it never existed."""
    before = rows(conn)
    with pytest.raises(OperationKeyConflict) as info:
        enqueue_many(
            conn,
            [
                NewMessage("order", "1", "order.created", {"total": 1}, "op-twice"),
                NewMessage("order", "1", "order.created", {"total": 2}, "op-twice"),
            ],
        )
    assert "'op-twice' is given twice in this enqueue_many with different content" in str(
        info.value
    )
    assert "outbox message" not in str(info.value)
    assert rows(conn) == before
    # The same content twice is one operation: one row, its id twice.
    same = NewMessage("order", "1", "order.created", {"total": 1}, "op-twice")
    first, again = enqueue_many(conn, [same, same])
    assert first == again


def test_concurrent_producers_of_one_operation_key_get_one_row(dsn: str) -> None:
    with (
        psycopg.connect(dsn) as first,
        psycopg.connect(dsn) as second,
        psycopg.connect(dsn, autocommit=True) as monitor,
    ):
        first.execute("SELECT 1")
        first_id = order_created(first, operation_key="op-race")
        second_pid = second.info.backend_pid
        outcome: list[Any] = []

        def run() -> None:
            try:
                outcome.append(order_created(second, operation_key="op-race"))
                second.commit()
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        # The second insert waits on the unique index until the first commits...
        wait_until(
            lambda: backend_waits_on(monitor, second_pid, "transactionid"),
            "the second producer waits on the first one's key",
        )
        first.commit()
        thread.join(timeout=10)
        # ...then finds the same operation and returns its id.
        assert outcome == [first_id]
        assert count(monitor) == 1


# ---------------------------------------------------------------- bad messages
NOT_JSON = [
    pytest.param({"tags": {1, 2}}, id="set"),
    pytest.param(object(), id="object"),
    pytest.param({"x": float("nan")}, id="nan"),
    pytest.param([float("inf")], id="inf"),
    pytest.param({"when": datetime(2026, 1, 1)}, id="datetime"),
    pytest.param(b"bytes", id="bytes"),
]


@pytest.mark.parametrize("payload", NOT_JSON)
def test_non_json_payload_raises_invalid_message_and_writes_nothing(
    conn: psycopg.Connection[Any], payload: Any
) -> None:
    with pytest.raises(InvalidMessage, match="payload"):
        order_created(conn, payload=payload)
    assert count(conn) == 0


@pytest.mark.parametrize("payload", NOT_JSON)
def test_one_bad_message_in_enqueue_many_writes_none(
    conn: psycopg.Connection[Any], payload: Any
) -> None:
    good = NewMessage("order", "1", "order.created", {"ok": True})
    with pytest.raises(InvalidMessage):
        enqueue_many(conn, [good, good, NewMessage("order", "1", "x", payload), good])
    assert count(conn) == 0


def test_oversize_payload_raises_and_writes_nothing(conn: psycopg.Connection[Any]) -> None:
    # The limit counts UTF-8 bytes of the compact JSON text.
    fits = {"s": "x" * 92}  # {"s":"xx..."} is 100 bytes
    too_big = {"s": "é" * 47}  # 2 bytes per character: 102 bytes
    assert order_created(conn, payload=fits, max_payload_bytes=100) > 0
    with pytest.raises(InvalidMessage, match="100") as info:
        order_created(conn, payload=too_big, max_payload_bytes=100)
    assert "102 bytes" in str(info.value)
    assert count(conn) == 1
    with pytest.raises(InvalidMessage):
        enqueue_many(
            conn,
            [
                NewMessage("order", "1", "order.created", {"ok": 1}),
                NewMessage("order", "1", "order.created", too_big),
            ],
            max_payload_bytes=100,
        )
    assert count(conn) == 1


def test_oversize_payload_in_enqueue_many_names_the_message_and_the_setting(
    conn: psycopg.Connection[Any],
) -> None:
    # In a bulk import of thousands, "payload is 102 bytes" alone does not
    # say which row to look at.
    good = NewMessage("order", "1", "order.created", {"ok": 1})
    too_big = NewMessage("order", "2", "order.created", {"s": "x" * 200})
    with pytest.raises(InvalidMessage) as info:
        enqueue_many(conn, [good, good, too_big, good], max_payload_bytes=100)
    text = str(info.value)
    assert text.startswith("message 2 of 4: payload is 208 bytes (JSON), over the limit of 100")
    assert "max_payload_bytes" in text and "OUTBOX_MAX_PAYLOAD_BYTES" in text
    assert count(conn) == 0


# JSON text that a text-format array would have to escape: quotes, backslashes,
# braces and commas (array syntax), an escaped NUL that is only text, newlines
# and non-ASCII.
TRICKY = {
    "quote": 'she said "hi"',
    "backslash": "C:\\temp\\",
    "escape": "\\u0000 is six characters",
    "array": "{1,2}",
    "comma": "a, b",
    "lines": "a\nb\tc",
    "unicode": "é€😀",
    "null": None,
}


def test_enqueue_many_stores_every_payload_exactly(conn: psycopg.Connection[Any]) -> None:
    # insert_many sends its text arrays in binary (queries.sql): in text,
    # psycopg escaped every quote of every payload in Python, 4 to 5 times
    # the time of the whole enqueue_many for large or many payloads.
    big = {"items": [{"sku": f"SKU-{i:06d}", "note": 'x"y\\z'} for i in range(20_000)]}
    messages = [
        NewMessage("order", 'id "1"', "order.created", TRICKY, headers={"X-Note": 'a "b"'}),
        NewMessage("order", "2", "order.created", big),
        NewMessage("order", "3", "order.created", [TRICKY, "plain", 1.5, None]),
        NewMessage("order", "4", "order.created", "a string payload"),
    ]
    ids = enqueue_many(conn, messages)
    stored = {r[0]: r for r in rows(conn)}
    assert [stored[i][4] for i in ids] == [m.payload for m in messages]
    assert stored[ids[0]][2] == 'id "1"'
    assert stored[ids[0]][5] == {"X-Note": 'a "b"'}


@pytest.mark.parametrize(
    "bad",
    [
        {"aggregate_type": ""},
        {"aggregate_id": None},
        {"aggregate_id": True},
        {"event_type": 5.0},
        {"headers": {"h": {1}}},
        {"headers": {1: "x"}},
        {"operation_key": ""},
        {"delay": -1},
        {"delay": float("nan")},
        {"delay": "soon"},
        # What PostgreSQL would refuse: a raw driver error (or an overflow)
        # after the savepoint, not a message naming the field.
        {"delay": timedelta.max},
        {"delay": 1e12},
        {"payload": {"note": "a\x00b"}},
        {"payload": {"a\x00": 1}},
        {"payload": {"note": "\udcff"}},
        {"headers": {"h": "\x00"}},
        {"aggregate_id": "a\x00"},
        {"event_type": "\ud800"},
        # Read as a stored canvas by the relay: every attempt failed.
        {"event_type": "celery.apply_async"},
        {"event_type": "celery.durable"},
    ],
    ids=repr,
)
def test_invalid_fields_raise_invalid_message_and_write_nothing(
    dsn: str, bad: dict[str, Any]
) -> None:
    field = next(iter(bad))
    with psycopg.connect(dsn) as producer:
        producer.execute("SELECT 1")  # inside the caller's transaction
        kept = order_created(producer)
        with pytest.raises(InvalidMessage, match=field):
            order_created(producer, **bad)
        producer.commit()
        assert [r[0] for r in rows(producer)] == [kept]


def test_a_string_holding_backslash_u0000_is_no_nul(conn: psycopg.Connection[Any]) -> None:
    """The NUL check reads the JSON text: an escaped backslash before "u0000"
    is six plain characters, which jsonb stores."""
    message_id = order_created(conn, payload={"path": "C:\\u0000"})
    row = conn.execute("SELECT payload FROM outbox WHERE id = %s", (message_id,)).fetchone()
    assert row == ({"path": "C:\\u0000"},)


def test_enqueue_in_a_failed_transaction_says_so_and_writes_nothing(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """psycopg refused the savepoint, then logged "savepoint does not exist"
    on the way out, which hid the statement that failed first."""
    with psycopg.connect(dsn) as producer:
        with pytest.raises(psycopg.errors.DivisionByZero):
            producer.execute("SELECT 1 / 0")
        with pytest.raises(psycopg.errors.InFailedSqlTransaction, match="already failed"):
            order_created(producer)
        producer.rollback()
        assert "savepoint" not in caplog.text
        assert rows(producer) == []


def test_enqueue_many_names_an_item_that_is_not_a_new_message_and_writes_nothing(
    dsn: str,
) -> None:
    with psycopg.connect(dsn) as producer:
        kept = order_created(producer)
        good = outbox_relay.NewMessage("order", "1", "order.created", {"n": 1})
        as_dict = {"aggregate_type": "order", "aggregate_id": "2", "event_type": "e", "payload": {}}
        with pytest.raises(
            InvalidMessage, match=r"message 1 is a dict, not an outbox_relay\.NewMessage"
        ):
            outbox_relay.enqueue_many(producer, [good, as_dict])  # type: ignore[list-item]
        producer.commit()
        assert [r[0] for r in rows(producer)] == [kept]


# ---------------------------------------------------------------- delay
@pytest.mark.parametrize("delay", [timedelta(seconds=60), 60, 60.0])
def test_delay_keeps_the_row_unclaimable_until_it_passes(
    conn: psycopg.Connection[Any], delay: Any
) -> None:
    message_id = order_created(conn, delay=delay)
    row = store.get_row(conn, message_id)
    assert row is not None
    due = row["available_at"]
    assert due == row["created_at"] + timedelta(seconds=60)
    early = due - timedelta(microseconds=1)
    assert store.claim(conn, owner="w", batch=10, lease=LEASE, now=early) == []
    assert store.claim(conn, owner="w", batch=10, lease=LEASE, now=due - LEASE) == []
    [claimed] = store.claim(conn, owner="w", batch=10, lease=LEASE, now=due)
    assert claimed.id == message_id


def test_delay_with_explicit_now(conn: psycopg.Connection[Any]) -> None:
    t0 = db_now(conn) + timedelta(days=3)
    message_id = order_created(conn, delay=timedelta(minutes=5), now=t0)
    assert store.claim(conn, owner="w", batch=1, lease=LEASE, now=t0) == []
    [claimed] = store.claim(conn, owner="w", batch=1, lease=LEASE, now=t0 + timedelta(minutes=5))
    assert claimed.id == message_id


# ---------------------------------------------------------------- notify
def listen(conn: psycopg.Connection[Any], channel: str) -> None:
    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))


def test_notify_arrives_on_the_tables_channel_only_after_commit(dsn: str) -> None:
    channel = OutboxTable().channel
    with (
        psycopg.connect(dsn, autocommit=True) as listener,
        psycopg.connect(dsn) as producer,
    ):
        listen(listener, channel)
        producer.execute("SELECT 1")
        order_created(producer)
        order_created(producer, aggregate_id="43")
        assert list(listener.notifies(timeout=0.3, stop_after=1)) == []
        producer.commit()
        got = list(listener.notifies(timeout=10, stop_after=1))
        assert [n.channel for n in got] == [channel]
        assert got[0].pid == producer.info.backend_pid

        # A rolled-back enqueue announces nothing.
        order_created(producer, aggregate_id="44")
        producer.rollback()
        assert list(listener.notifies(timeout=0.3, stop_after=1)) == []

        # notify=False stays silent even when committed.
        order_created(producer, aggregate_id="45", notify=False)
        producer.commit()
        assert list(listener.notifies(timeout=0.3, stop_after=1)) == []


def test_notify_channel_belongs_to_the_table(dsn: str) -> None:
    other = OutboxTable.parse("app.events")
    assert other.channel != OutboxTable().channel
    with (
        psycopg.connect(dsn, autocommit=True) as listener,
        psycopg.connect(dsn, autocommit=True) as producer,
    ):
        outbox_relay.migrate(producer, table=other)
        listen(listener, OutboxTable().channel)
        order_created(producer, table=other)
        assert list(listener.notifies(timeout=0.3, stop_after=1)) == []
        order_created(producer)
        assert [n.channel for n in listener.notifies(timeout=10, stop_after=1)] == [
            OutboxTable().channel
        ]


# ---------------------------------------------------------------- ordered producers
def test_ordered_producers_of_one_aggregate_serialize_until_commit(dsn: str) -> None:
    with (
        psycopg.connect(dsn) as first,
        psycopg.connect(dsn) as second,
        psycopg.connect(dsn, autocommit=True) as monitor,
    ):
        first.execute("SELECT 1")
        first_id = order_created(first, event_type="order.paid", ordered=True)
        second_pid = second.info.backend_pid
        result: list[Any] = []

        def run() -> None:
            try:
                result.append(order_created(second, event_type="order.shipped", ordered=True))
                second.commit()
            except BaseException as exc:
                result.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        wait_until(
            lambda: backend_waits_on(monitor, second_pid, "advisory"),
            "the second producer waits for the first",
        )
        assert thread.is_alive() and result == []

        # Other aggregates, and unordered messages of the same aggregate, do not wait.
        monitor.execute("SET lock_timeout = '5s'")
        other = order_created(monitor, aggregate_id="other", ordered=True)
        unordered = order_created(monitor, ordered=False)

        first.commit()
        thread.join(timeout=10)
        assert not thread.is_alive()
        [second_id] = result
        # Commit order equals id order within the ordered aggregate.
        assert first_id < second_id
        assert other < second_id and unordered < second_id
        assert count(monitor) == 4


def test_ordered_event_types_from_settings_take_the_lock(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # OUTBOX_ORDERED_EVENT_TYPES decides when ordered= is not given.
    from outbox_relay import _defaults

    monkeypatch.setenv("OUTBOX_ORDERED_EVENT_TYPES", "order.paid")
    _defaults.reset()
    try:
        with (
            psycopg.connect(dsn) as first,
            psycopg.connect(dsn, autocommit=True) as second,
        ):
            first.execute("SELECT 1")
            order_created(first, event_type="order.paid")
            second.execute("SET lock_timeout = '200ms'")
            # An unordered type passes; an ordered one of the same aggregate waits.
            order_created(second, event_type="order.note")
            with pytest.raises(psycopg.errors.LockNotAvailable):
                order_created(second, event_type="order.paid")
            first.rollback()
    finally:
        _defaults.reset()


# ---------------------------------------------------------------- one configuration
def ordered_flags(conn: psycopg.Connection[Any]) -> dict[int, bool]:
    return dict(conn.execute("SELECT id, ordered FROM outbox ORDER BY id").fetchall())


def test_ordering_is_written_on_the_row_and_the_relay_follows_it(
    conn: psycopg.Connection[Any],
) -> None:
    outbox = outbox_relay.Outbox(ordered_event_types=["order.*"])
    first = outbox.enqueue(
        conn, aggregate_type="order", aggregate_id="7", event_type="order.paid", payload={}
    )
    second = outbox.enqueue(
        conn, aggregate_type="order", aggregate_id="7", event_type="order.shipped", payload={}
    )
    loose = outbox.enqueue(
        conn, aggregate_type="order", aggregate_id="7", event_type="note.added", payload={}
    )
    assert ordered_flags(conn) == {first: True, second: True, loose: False}
    # A relay configured with no ordering at all still claims the ordered rows
    # one at a time per aggregate: the row says so.
    lease = timedelta(seconds=30)
    claimed = outbox_relay.claim(conn, owner="relay", batch=10, lease=lease)
    assert [m.id for m in claimed] == [first, loose]
    assert outbox_relay.mark_done(conn, claimed[0])
    [nxt] = outbox_relay.claim(conn, owner="relay", batch=10, lease=lease)
    assert nxt.id == second and nxt.ordered


def test_install_shares_its_outbox_with_producers(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery import Celery

    from outbox_relay import _defaults

    _defaults.reset()
    try:
        app = Celery("shop", broker="memory://", set_as_current=False)
        app.conf.outbox_ordered_event_types = ["invoice.issued"]
        inst = outbox_relay.install(app, dsn=dsn, publisher=print)
        assert inst.settings.ordered_event_types == ("invoice.issued",)
        with psycopg.connect(dsn, autocommit=True) as conn:
            # The module-level enqueue uses the installed app's outbox.
            issued = enqueue(
                conn,
                aggregate_type="invoice",
                aggregate_id="1",
                event_type="invoice.issued",
                payload={},
            )
            assert ordered_flags(conn) == {issued: True}
    finally:
        _defaults.reset()


def test_an_outbox_given_to_install_decides_the_producer_settings() -> None:
    from celery import Celery

    from outbox_relay import _defaults

    _defaults.reset()
    try:
        outbox = outbox_relay.Outbox(table="shop.events", ordered_event_types="order.paid")
        app = Celery("shop", broker="memory://", set_as_current=False)
        inst = outbox.install(app, dsn="postgresql://db/app", publisher=print)
        assert (inst.settings.table, inst.settings.ordered_event_types) == (
            "shop.events",
            ("order.paid",),
        )
        other = Celery("billing", broker="memory://", set_as_current=False)
        with pytest.raises(outbox_relay.ConfigError, match="table"):
            outbox.install(other, table="other.outbox")
    finally:
        # The first install() made its outbox this process's default.
        _defaults.reset()


def test_migrate_prepares_the_table_enqueue_writes_to(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``outbox_relay.migrate(conn)`` and ``enqueue(conn, ...)`` with nothing
    given agree on the table: OUTBOX_TABLE here (it migrated public.outbox
    while enqueue wrote to OUTBOX_TABLE's, and failed)."""
    from outbox_relay import _defaults

    monkeypatch.setenv("OUTBOX_TABLE", "billing.events_outbox")
    _defaults.reset()
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE SCHEMA billing")
            assert outbox_relay.migrate(conn)
            assert outbox_relay.migrate(conn) == []
            with conn.transaction():
                message_id = enqueue(
                    conn, aggregate_type="invoice", aggregate_id="1", event_type="e", payload={}
                )
            row = conn.execute("SELECT id FROM billing.events_outbox").fetchone()
            assert row == (message_id,)
            # An Outbox migrates its own table.
            other = outbox_relay.Outbox(table="billing.other_outbox")
            assert other.migrate(conn) and other.migrate(conn) == []
            assert other.enqueue(
                conn, aggregate_type="invoice", aggregate_id="2", event_type="e", payload={}
            )
    finally:
        _defaults.reset()


def test_every_call_given_no_table_uses_the_table_enqueue_writes_to(dsn: str) -> None:
    """After configure(table=...), stats, claim and dispatch_once read
    public.outbox while enqueue wrote elsewhere (the API walkthrough: claim
    returned another table's rows)."""
    from outbox_relay import _defaults

    _defaults.reset()
    try:
        outbox_relay.configure(table="billing.events")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE SCHEMA billing")
            outbox_relay.migrate(conn)
            # A row in public.outbox, which the calls below must leave alone.
            outbox_relay.Outbox(table="outbox").enqueue(
                conn, aggregate_type="order", aggregate_id="9", event_type="e", payload={}
            )
            with conn.transaction():
                message_id = enqueue(
                    conn, aggregate_type="invoice", aggregate_id="1", event_type="e", payload={}
                )
            assert outbox_relay.stats(conn)["pending"] == 1
            [claimed] = outbox_relay.claim(conn, owner="me", batch=5, lease=30)
            assert claimed.id == message_id
            assert outbox_relay.rescue(conn, max_attempts=3).released == []
            published: list[int] = []
            conn.execute("UPDATE billing.events SET lease_until = now() - interval '1 s'")
            assert outbox_relay.dispatch_once(conn, lambda m: published.append(m.id), owner="me")
            assert published == [message_id]
            assert conn.execute("SELECT status FROM outbox").fetchall() == [("pending",)]
    finally:
        _defaults.reset()


def test_a_producer_refuses_a_misspelled_producer_setting(
    conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """OUTBOX_TABEL was ignored by producers: with a second team's public.outbox
    present, enqueue wrote there. Refused now; a misspelled relay setting in a
    shared .env is still the relay's to refuse."""
    from outbox_relay import _defaults

    monkeypatch.setenv("OUTBOX_TABEL", "billing.events_outbox")
    _defaults.reset()
    try:
        with pytest.raises(
            outbox_relay.ConfigError, match=r"OUTBOX_TABEL \(did you mean OUTBOX_TABLE\?\)"
        ):
            order_created(conn)
        with pytest.raises(outbox_relay.ConfigError, match="OUTBOX_TABEL"):
            outbox_relay.Outbox().enqueue(
                conn, aggregate_type="o", aggregate_id="1", event_type="e", payload={}
            )
        monkeypatch.delenv("OUTBOX_TABEL")
        monkeypatch.setenv("OUTBOX_LEASE_SECOND", "30")
        _defaults.reset()
        assert order_created(conn) > 0
    finally:
        _defaults.reset()


def test_a_missing_table_names_the_call_that_creates_it(dsn: str) -> None:
    with (
        psycopg.connect(dsn, autocommit=True) as conn,
        pytest.raises(outbox_relay.ConfigError) as raised,
    ):
        outbox_relay.Outbox(table="billing.nowhere").enqueue(
            conn, aggregate_type="a", aggregate_id="1", event_type="e", payload={}
        )
    assert "outbox-relay migrate --table billing.nowhere" in str(raised.value)
    assert "outbox_relay.migrate(conn, table='billing.nowhere')" in str(raised.value)


def test_a_producer_validates_only_producer_settings(
    conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from outbox_relay import _defaults

    # A shared .env with a lease too short for the relay's publish timeout.
    monkeypatch.setenv("OUTBOX_LEASE_SECONDS", "1")
    _defaults.reset()
    try:
        assert order_created(conn) > 0
        assert outbox_relay.Outbox().enqueue(
            conn, aggregate_type="o", aggregate_id="1", event_type="e", payload={}
        )
        with pytest.raises(outbox_relay.ConfigError, match="OUTBOX_LEASE_SECONDS"):
            outbox_relay.Settings.load()
    finally:
        _defaults.reset()


def test_producer_locks_are_taken_in_a_stable_order(dsn: str) -> None:
    # Two transactions writing aggregates A,B and B,A must queue, not deadlock:
    # every enqueue_many takes its ordered aggregates' locks sorted, before
    # writing. Shown precisely: while A is held, a batch "B then A" waits on A
    # without holding B, so a third producer writes B at once.
    def msg(aggregate: str) -> NewMessage:
        return NewMessage("order", aggregate, "order.paid", {"a": aggregate})

    with (
        psycopg.connect(dsn) as first,
        psycopg.connect(dsn) as second,
        psycopg.connect(dsn, autocommit=True) as third,
    ):
        first.execute("SELECT 1")
        outbox_relay.enqueue_many(first, [msg("A")], ordered=True)
        second_pid = second.info.backend_pid
        done: list[Any] = []

        def run() -> None:
            try:
                second.execute("SELECT 1")
                done.append(outbox_relay.enqueue_many(second, [msg("B"), msg("A")], ordered=True))
                second.commit()
            except BaseException as exc:
                done.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        wait_until(lambda: backend_waits_on(third, second_pid, "advisory"), "second waits on A")
        third.execute("SET lock_timeout = '2s'")
        outbox_relay.enqueue_many(third, [msg("B")], ordered=True)  # B is free
        first.commit()
        thread.join(10)
        assert len(done) == 1 and isinstance(done[0], list), done


def test_enqueue_without_the_migrations_says_to_migrate(fresh_database: str) -> None:
    with psycopg.connect(fresh_database) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY)")
        conn.execute("INSERT INTO orders VALUES (1)")
        with pytest.raises(outbox_relay.ConfigError, match="run `outbox-relay migrate`"):
            order_created(conn)
        # The caller's transaction is still usable and keeps its own work.
        conn.execute("INSERT INTO orders VALUES (2)")
        conn.commit()
        assert conn.execute("SELECT count(*) FROM orders").fetchone() == (2,)


def test_enqueue_on_a_table_from_before_migration_3_says_to_migrate(
    conn: psycopg.Connection[Any],
) -> None:
    # An upgrade of the package without `outbox-relay migrate`: no ordered column.
    conn.execute("ALTER TABLE outbox DROP COLUMN ordered")
    with pytest.raises(outbox_relay.ConfigError, match="not migrated to this version"):
        order_created(conn)
