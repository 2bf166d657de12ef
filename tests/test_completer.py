"""The completer: a published first attempt's done, written by its process in
a batch after the delivery returned, fenced as the delivery's own would be."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import psycopg.sql
import pytest

from outbox_relay import (
    Claimer,
    Deliverer,
    DirectDatabase,
    Message,
    NewMessage,
    OutboxTable,
    Rescuer,
    RetryableError,
    enqueue_many,
    store,
)
from outbox_relay.db import PoolDatabase
from outbox_relay.model import Claimed, LeaseRef, Outcome
from outbox_relay.services import Completer
from outbox_relay.services.completer import FULL_ROWS

from .celery_procs import wait_for


class _Observer:
    """An observer that keeps what it was told."""

    def __init__(self) -> None:
        self.finalized_rows: list[tuple[int, str]] = []
        self.lost: list[int] = []

    def published(self, msg: Claimed, outcome: Outcome, seconds: float) -> None:
        pass

    def finalized(self, msg: Claimed, outcome: Outcome, age_seconds: float) -> None:
        self.finalized_rows.append((msg.id, outcome.status))

    def lost_lease(self, ref: LeaseRef, where: str) -> None:
        self.lost.append(ref.id)

    def stale(self, ref: LeaseRef, reason: str) -> None:
        pass


@pytest.fixture
def db(dsn: str) -> Iterator[PoolDatabase]:
    pool = PoolDatabase(dsn, size=2, name="test-completer")
    yield pool
    pool.close()


def status(conn: psycopg.Connection[Any], message_id: int) -> tuple[str, int]:
    row = conn.execute(
        "SELECT status, lease_version FROM outbox WHERE id = %s", (message_id,)
    ).fetchone()
    assert row is not None
    return row[0], row[1]


def claim(
    conn: psycopg.Connection[Any], lease: timedelta = timedelta(seconds=30)
) -> list[LeaseRef]:
    claimer = Claimer(
        DirectDatabase(conn),
        table=OutboxTable(),
        owner=lambda: "test",
        batch_size=100,
        max_in_flight=None,
        lease=lease,
        max_attempts=5,
    )
    return [m.ref for m in claimer.run_once().claimed]


def relay(db: PoolDatabase, window: float, publish: Any = None) -> tuple[Deliverer, _Observer]:
    observer = _Observer()
    completer = Completer(db, table=OutboxTable(), observer=observer, window=window)
    deliverer = Deliverer(
        publish or (lambda message: None),
        db=db,
        observer=observer,
        count_attempt=True,
        completer=completer,
        tracer=None,
        # A chunk of FULL_ROWS in one wave: within the claim's 30 s lease.
        concurrency=FULL_ROWS,
    )
    return deliverer, observer


def test_a_published_message_is_marked_done_by_its_process_after_the_task(
    conn: psycopg.Connection[Any], db: PoolDatabase
) -> None:
    [message_id] = enqueue_many(conn, [NewMessage("order", "1", "order.paid", {"n": 1})])
    deliverer, observer = relay(db, window=0.5)
    report = deliverer.deliver(claim(conn))
    assert report.done == 1
    # Handed over, not yet written: the task could return at once.
    assert status(conn, message_id)[0] == "processing"
    assert observer.finalized_rows == []
    wait_for(lambda: status(conn, message_id)[0] == "done", timeout=5, what="done")
    assert observer.finalized_rows == [(message_id, "done")]
    deliverer.close()


def test_the_messages_of_one_window_are_written_by_one_statement(
    conn: psycopg.Connection[Any], db: PoolDatabase
) -> None:
    ids = enqueue_many(conn, [NewMessage("order", str(i), "order.paid", {}) for i in range(5)])
    deliverer, observer = relay(db, window=0.5)
    for ref in claim(conn):
        deliverer.deliver([ref])  # five per-message tasks, one after the other
    wait_for(lambda: len(observer.finalized_rows) == 5, timeout=5, what="five done")
    rows = conn.execute("SELECT status, done_at FROM outbox ORDER BY id").fetchall()
    assert {r[0] for r in rows} == {"done"}
    # One transaction stamped them all (now() is the transaction's clock).
    assert len({r[1] for r in rows}) == 1, rows
    assert sorted(i for i, _ in observer.finalized_rows) == ids
    deliverer.close()


def test_a_window_opens_again_for_a_message_handed_over_after_a_write(
    conn: psycopg.Connection[Any], db: PoolDatabase
) -> None:
    """The thread sleeps between windows (it is not woken for every hand-over):
    the first hand-over after a write wakes it, and that message is written a
    window later, not when 100 more have gathered or at shutdown."""
    deliverer, observer = relay(db, window=0.2)
    for n in range(3):
        [message_id] = enqueue_many(conn, [NewMessage("order", f"again-{n}", "order.paid", {})])
        deliverer.deliver(claim(conn))
        wait_for(lambda i=message_id: status(conn, i)[0] == "done", timeout=5, what=f"window {n}")
    assert len(observer.finalized_rows) == 3
    deliverer.close()


def test_a_row_claimed_again_before_the_write_is_left_to_its_new_holder(
    conn: psycopg.Connection[Any], db: PoolDatabase
) -> None:
    [message_id] = enqueue_many(conn, [NewMessage("order", "1", "order.paid", {})])
    deliverer, observer = relay(db, window=1.0)
    [ref] = claim(conn)
    deliverer.deliver([ref])
    # Before the completer writes, the lease lapses and another worker claims it.
    conn.execute("UPDATE outbox SET lease_until = now() - interval '1 second'")
    Rescuer(DirectDatabase(conn), table=OutboxTable(), max_attempts=5).run_once()
    [again] = claim(conn)
    assert again.lease_version == ref.lease_version + 1
    deliverer.flush()
    assert status(conn, message_id) == ("processing", again.lease_version)
    assert observer.lost == [message_id]
    assert observer.finalized_rows == []
    deliverer.close()


def test_retries_and_ordered_messages_are_written_by_the_task(
    conn: psycopg.Connection[Any], db: PoolDatabase
) -> None:
    failing = enqueue_many(conn, [NewMessage("order", "f", "order.fail", {})])
    ordered = enqueue_many(conn, [NewMessage("order", "o", "order.paid", {})], ordered=True)

    def publish(message: Message) -> None:
        if message.event_type == "order.fail":
            raise RetryableError("receiver down")

    deliverer, _ = relay(db, window=30.0, publish=publish)
    refs = {r.id: r for r in claim(conn)}
    deliverer.deliver([refs[failing[0]]])
    deliverer.deliver([refs[ordered[0]]])
    # No wait: each was finalized before deliver() returned.
    assert status(conn, failing[0])[0] == "pending"
    assert status(conn, ordered[0])[0] == "done"
    deliverer.close()


def test_a_chunk_leaves_its_first_attempts_done_and_writes_the_rest_itself(
    conn: psycopg.Connection[Any], db: PoolDatabase
) -> None:
    """A chunk's published first attempts wait for the completer with the
    rest of the window; its retry is written before its task returns."""
    paid = enqueue_many(conn, [NewMessage("order", f"c{i}", "order.paid", {}) for i in range(3)])
    [failing] = enqueue_many(conn, [NewMessage("order", "f", "order.fail", {})])

    def publish(message: Message) -> None:
        if message.event_type == "order.fail":
            raise RetryableError("receiver down")

    deliverer, observer = relay(db, window=30.0, publish=publish)
    report = deliverer.deliver(claim(conn))
    assert (report.done, report.retried) == (3, 1)
    assert status(conn, failing)[0] == "pending"
    assert [status(conn, i)[0] for i in paid] == ["processing"] * 3
    deliverer.flush()
    assert [status(conn, i)[0] for i in paid] == ["done"] * 3
    assert sorted(i for i, s in observer.finalized_rows if s == "done") == paid
    deliverer.close()


def test_chunks_that_fill_a_statement_are_written_without_waiting_for_the_window(
    conn: psycopg.Connection[Any], db: PoolDatabase
) -> None:
    """Finished rows still count against the in-flight cap: two half chunks
    that gather FULL_ROWS are written at once, not a window later, and a
    chunk that fills a statement by itself is written by its own task."""
    half = FULL_ROWS // 2
    ids = enqueue_many(
        conn, [NewMessage("order", str(i), "order.paid", {}) for i in range(2 * half)]
    )
    deliverer, _ = relay(db, window=30.0)
    refs = claim(conn)
    deliverer.deliver(refs[:half])
    assert status(conn, ids[0])[0] == "processing"  # waiting for more
    deliverer.deliver(refs[half:])

    def done() -> int:
        row = conn.execute(
            "SELECT count(*) FROM outbox WHERE status = 'done' AND id = ANY(%s)", (ids,)
        ).fetchone()
        return 0 if row is None else int(row[0])

    wait_for(lambda: done() == 2 * half, timeout=5, what="both halves, well before 30 s")
    whole = enqueue_many(
        conn, [NewMessage("order", f"w{i}", "order.paid", {}) for i in range(FULL_ROWS)]
    )
    deliverer.deliver(claim(conn))
    assert {status(conn, i)[0] for i in whole} == {"done"}  # no wait
    deliverer.close()


def test_close_writes_what_was_gathered(conn: psycopg.Connection[Any], db: PoolDatabase) -> None:
    [message_id] = enqueue_many(conn, [NewMessage("order", "1", "order.paid", {})])
    deliverer, observer = relay(db, window=30.0)
    deliverer.deliver(claim(conn))
    assert status(conn, message_id)[0] == "processing"
    started = time.monotonic()
    deliverer.close()  # a pool process shutting down: not 30 s later
    assert time.monotonic() - started < 5
    assert status(conn, message_id)[0] == "done"
    assert observer.finalized_rows == [(message_id, "done")]


def test_a_row_tried_before_is_finished_by_its_task_after_the_gathered_ones(
    conn: psycopg.Connection[Any], db: PoolDatabase
) -> None:
    """A row on its second attempt may be the message that kills its process
    (poison): what the process gathered is written before it is published,
    and its own done is written by its task, so a crash never turns a lost
    done into a dead letter (the fault suite's poison scenario found it)."""
    first, again = enqueue_many(
        conn, [NewMessage("order", str(i), "order.paid", {}) for i in (1, 2)]
    )
    deliverer, observer = relay(db, window=30.0)
    refs = {r.id: r for r in claim(conn)}
    # The second row's first attempt: begun, then its worker died mid-publish.
    deliverer_refs = [refs[again]]

    store.begin(conn, deliverer_refs, needed=timedelta(seconds=1))
    conn.execute(
        "UPDATE outbox SET lease_until = now() - interval '1 second' WHERE id = %s", (again,)
    )
    Rescuer(DirectDatabase(conn), table=OutboxTable(), max_attempts=5).run_once()
    deliverer.deliver([refs[first]])  # a first attempt: handed over
    assert status(conn, first)[0] == "processing"
    [retry] = claim(conn)
    deliverer.deliver([retry])  # its second attempt
    assert status(conn, first)[0] == "done"  # written before the retry's publish
    assert status(conn, again)[0] == "done"  # written by its own task
    assert sorted(i for i, _ in observer.finalized_rows) == [first, again]
    deliverer.close()


def _read_only(conn: psycopg.Connection[Any], on: bool) -> None:
    """The database refuses writes in every new session (as during a
    failover to a standby), and the relay's sessions are cut so that their
    next connections are new ones."""
    db = psycopg.sql.Identifier(conn.info.dbname)
    setting = (
        "SET default_transaction_read_only = on" if on else "RESET default_transaction_read_only"
    )
    conn.execute(psycopg.sql.SQL("ALTER DATABASE {} " + setting).format(db))
    conn.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )


def test_a_write_that_fails_is_tried_again_until_it_succeeds(
    conn: psycopg.Connection[Any], db: PoolDatabase
) -> None:
    """A failed write no longer costs its rows a second delivery: they still
    hold their leases, and the completer's thread writes them again (the
    fault suite's terminate scenario had 11 duplicates from such writes)."""
    [message_id] = enqueue_many(conn, [NewMessage("order", "1", "order.paid", {})])
    deliverer, observer = relay(db, window=30.0)
    deliverer.deliver(claim(conn))
    _read_only(conn, True)
    try:
        deliverer.flush()  # refused by the database; the thread tries again
        assert status(conn, message_id)[0] == "processing"
    finally:
        _read_only(conn, False)
    # No flush here: the thread's next write, not the 30 s window.
    wait_for(lambda: status(conn, message_id)[0] == "done", timeout=10, what="written again")
    assert observer.finalized_rows == [(message_id, "done")]
    assert observer.lost == []
    deliverer.close()


def test_a_write_is_given_up_once_its_lease_has_ended(
    conn: psycopg.Connection[Any], db: PoolDatabase
) -> None:
    """Bounded by the lease: past it the row is the rescuer's to free and
    another worker's to deliver, so the write is given up."""
    [message_id] = enqueue_many(conn, [NewMessage("order", "1", "order.paid", {})])
    deliverer, observer = relay(db, window=30.0)
    deliverer.publish_timeout = 0.5  # fits the short lease below
    deliverer.deliver(claim(conn, lease=timedelta(seconds=2)))
    _read_only(conn, True)
    try:
        deliverer.flush()
        time.sleep(2.5)  # the thread tries every RETRY_SECONDS; the lease ends
    finally:
        _read_only(conn, False)
    deliverer.flush()  # nothing left to write
    assert status(conn, message_id)[0] == "processing"
    assert observer.finalized_rows == []
    # Published, and delivered again once rescued: a duplicate the receiver
    # sees, counted as one (outbox_lost_leases_total counted none).
    assert observer.lost == [message_id]
    deliverer.close()


class _AnswerLost(PoolDatabase):
    """A real database whose answer to one write never arrives: the write
    commits, then the call fails as a connection cut after COMMIT does."""

    lose_next = False

    def run(self, fn: Any, *, retry: bool = True) -> Any:
        result = super().run(fn, retry=retry)
        if self.lose_next:
            self.lose_next = False
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return result


def test_a_write_that_committed_but_lost_its_answer_is_not_a_lost_lease(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    """The second write finds the row done already; done under its own lease
    version it was ours (the first write committed), not another worker's."""
    [message_id] = enqueue_many(conn, [NewMessage("order", "1", "order.paid", {})])
    db = _AnswerLost(dsn, size=2, name="test-completer-answer-lost")
    try:
        deliverer, observer = relay(db, window=30.0)
        deliverer.deliver(claim(conn))
        db.lose_next = True
        deliverer.flush()  # commits; its answer is lost, so it is tried again
        assert status(conn, message_id) == ("done", 1)
        wait_for(lambda: observer.finalized_rows, timeout=10, what="the second write")
        assert observer.finalized_rows == [(message_id, "done")]
        assert observer.lost == []
        # A row re-claimed by another worker and finished there is still a lost lease.
        [other] = enqueue_many(conn, [NewMessage("order", "2", "order.paid", {})])
        deliverer.deliver(claim(conn))
        conn.execute("UPDATE outbox SET lease_version = lease_version + 1 WHERE id = %s", (other,))
        db.lose_next = True
        deliverer.flush()  # changes nothing (fenced); then it is tried again
        wait_for(lambda: observer.lost, timeout=10, what="the lost lease")
        assert observer.lost == [other]
        deliverer.close()
    finally:
        db.close()
