"""Ordered rows that wait behind an unfinished one are parked, once.

A claim walks the due rows in order; an ordered row queued behind an
unfinished row of its aggregate cannot be leased, and was walked and probed
again by every claim: one aggregate with 20,000 rows queued made every claim
of the table take 265 ms, whatever else was due. The relay's claim parks
such a row (queries.sql, claim_parking) and the done of the row before it
makes it due again (promote); the rescuer looks again at rows parked for long
(reprobe_parked). These tests hold the relay's claim to that: each waiting row
is walked once, delivered in order, never left parked behind a finished row.
"""

from __future__ import annotations

import re
import threading
import time
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from rich.console import Console

from outbox_relay import NewMessage, enqueue_many, operations, store
from outbox_relay.model import Claimed, Outcome
from outbox_relay.operations import dead_skip

LEASE = timedelta(seconds=30)
# A parked row's available_at is at least this far ahead (queries.sql, frag_parked).
PARKED = timedelta(days=365 * 1000)


def _enqueue(conn: psycopg.Connection[Any], aggregates: str, *, ordered: bool = True) -> list[int]:
    return enqueue_many(
        conn, [NewMessage("account", a, "moved", {"a": a}) for a in aggregates], ordered=ordered
    )


def _claim(conn: psycopg.Connection[Any], batch: int = 50) -> store.ClaimBatch:
    """The relay's claim (services.Claimer): under the cap, parking."""
    return store.claim_batch(
        conn,
        owner="w",
        batch=batch,
        lease=LEASE,
        max_in_flight=1000,
        count_attempt=False,
        rescue_first=False,
        park=True,
    )


def _done(conn: psycopg.Connection[Any], claimed: list[Claimed]) -> None:
    assert store.finalize(conn, [Outcome.done(m) for m in claimed]) == {m.id for m in claimed}


def _due(conn: psycopg.Connection[Any], message_id: int) -> datetime:
    row = store.get_row(conn, message_id)
    assert row is not None and row["status"] == "pending", row
    return row["available_at"]


def _is_parked(conn: psycopg.Connection[Any], message_id: int) -> bool:
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    return _due(conn, message_id) > row[0] + PARKED


def test_a_deep_aggregate_is_walked_once_and_delivered_in_order(
    conn: psycopg.Connection[Any],
) -> None:
    deep = _enqueue(conn, "A" * 200)
    others = _enqueue(conn, "BCDEFGHIJK" * 10, ordered=False)
    delivered: list[int] = []
    parked = claims = 0
    while True:
        result = _claim(conn)
        claims += 1
        if not result.taken:
            break
        parked += result.parked
        delivered += [m.id for m in result.claimed]
        _done(conn, result.claimed)
        assert claims < 1000, "the drain does not end"
    assert sorted(delivered) == sorted(deep + others)
    assert [i for i in delivered if i in set(deep)] == deep
    # Each row behind the head was walked past once and parked once; without
    # parking every claim walked all of them that were due (as many as 199).
    assert parked == len(deep) - 1
    # Nothing is left parked or due.
    assert store.stats(conn)["pending"] == 0


def test_a_parked_row_keeps_its_place_and_waits_for_the_row_before_it(
    conn: psycopg.Connection[Any],
) -> None:
    first, second, third = _enqueue(conn, "AAA")
    written = _due(conn, second)
    result = _claim(conn)
    assert [m.id for m in result.claimed] == [first]
    assert result.parked == 2 and _is_parked(conn, second) and _is_parked(conn, third)
    # Retried, dead: still unfinished, and the rows behind stay parked.
    store.finalize(conn, [Outcome.retry(result.claimed[0], delay=timedelta(0), error="503")])
    assert _is_parked(conn, second)
    head = _claim(conn).claimed
    assert [m.id for m in head] == [first]
    store.finalize(conn, [Outcome.dead(head[0], error="422")])
    assert _is_parked(conn, second) and _claim(conn).taken == 0
    # An operator skips the dead head: the next row is due at the time it was
    # written (its place in the queue), the one after it stays parked.
    assert dead_skip(conn, [first]) == [first]
    assert _due(conn, second) == written and _is_parked(conn, third)
    assert [m.id for m in _claim(conn).claimed] == [second]
    # A row the claim found already free is never parked.
    assert store.stats(conn)["pending"] == 1


def test_a_done_waits_for_the_claim_in_progress_before_it_promotes(dsn: str) -> None:
    """The claim that parks a row saw its head unfinished; the head's done may
    commit meanwhile. Its promote then runs after that claim has committed
    (both take the claim's lock), so the row is made due, not left parked."""
    with psycopg.connect(dsn, autocommit=True) as conn, psycopg.connect(dsn) as claiming:
        head, follower = _enqueue(conn, "AA")
        [leased] = _claim(conn, batch=1).claimed
        assert leased.id == head
        finished = threading.Event()

        def finish() -> None:
            with psycopg.connect(dsn, autocommit=True) as other:
                _done(other, [leased])
            finished.set()

        # A claim in progress: it parks the follower behind the unfinished
        # head, and has not committed yet.
        with claiming.transaction():
            assert _claim(claiming).parked == 1
            writer = threading.Thread(target=finish)
            writer.start()
            time.sleep(0.5)
            # The head's done waits for the claim's lock, not the other way round.
            assert not finished.is_set()
        writer.join(10)
        assert finished.is_set()
        assert not _is_parked(conn, follower)
        assert [m.id for m in _claim(conn).claimed] == [follower]


def test_the_rescuer_frees_a_row_no_promote_reached(conn: psycopg.Connection[Any]) -> None:
    """A row finished by a writer that does not promote (a worker of an
    earlier release in a rolling upgrade, a change by hand): the rescuer's
    second look makes its successor due; rows still waiting stay parked."""
    head, second, third = _enqueue(conn, "AAA")
    [leased] = _claim(conn).claimed
    conn.execute(
        "UPDATE outbox SET status = 'done', done_at = now(), lease_owner = NULL, "
        "lease_until = NULL WHERE id = %s",
        (head,),
    )
    # Not parked long enough yet.
    assert store.reprobe_parked(conn, after=timedelta(seconds=60)) == []
    assert _is_parked(conn, second)
    later = datetime.now().astimezone() + timedelta(seconds=61)
    again = timedelta(minutes=10)
    assert store.reprobe_parked(conn, after=timedelta(seconds=60), again=again, now=later) == [
        second
    ]
    assert not _is_parked(conn, second) and _is_parked(conn, third)
    assert leased.id == head
    # The one still waiting is looked at again 10 minutes later, not every
    # minute: each look rewrites it.
    before = _due(conn, third)
    for minutes in (2, 9):
        at = later + timedelta(minutes=minutes)
        assert store.reprobe_parked(conn, after=timedelta(seconds=60), again=again, now=at) == []
        assert _due(conn, third) == before
    at = later + timedelta(minutes=10, seconds=1)
    assert store.reprobe_parked(conn, after=timedelta(seconds=60), again=again, now=at) == []
    assert _due(conn, third) > before and _is_parked(conn, third)


def test_status_counts_parked_rows_and_no_wake_up_is_planned_for_them(
    conn: psycopg.Connection[Any],
) -> None:
    _enqueue(conn, "AAAA")
    _claim(conn)
    stats = store.stats(conn)
    assert (stats["pending"], stats["processing"]) == (3, 1)
    # The oldest waiting message counts from when it was written, parked or not.
    assert 0 <= stats["oldest_pending_age_seconds"] < 60
    # A parked row falls due by its predecessor's done, not by a time.
    assert store.next_due(conn) is None
    # `outbox-relay status` says how many of the pending wait behind another.
    snapshot = operations.status(conn)
    assert (snapshot["pending"], snapshot["parked"]) == (3, 3)
    table = Console(width=120, record=True)
    table.print(operations.status_table(snapshot))
    assert re.search(
        r"of which behind an earlier one of their aggregate\s+│\s+3", table.export_text()
    )


def test_claims_that_skip_ordered_rows_park_nothing(conn: psycopg.Connection[Any]) -> None:
    _enqueue(conn, "AA")
    _enqueue(conn, "BB", ordered=False)
    # The articles' claim (no cap), and one ordering by event type: skipped, not parked.
    plain = store.claim_batch(conn, owner="w", batch=10, lease=LEASE, ordered=["moved"])
    assert plain.parked == 0 and len(plain.claimed) == 2
    with pytest.raises(ValueError, match="park=True needs max_in_flight"):
        store.claim_batch(conn, owner="w", batch=10, lease=LEASE, park=True)


def test_the_rescuer_says_when_it_freed_a_row_no_promote_reached(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rows made due by the second look mean a writer finished their
    predecessor without promoting them: the log names the table and ids."""
    from outbox_relay.celery.tasks import _report_rescued
    from outbox_relay.store.relay import Rescued

    with caplog.at_level("WARNING", logger="outbox_relay.celery"):
        _report_rescued(None, Rescued([], [], [7, 9]), "public.outbox")
    assert "2 ordered message(s) in public.outbox were parked behind a message that had" in (
        caplog.text
    )
    assert "(ids 7, 9)" in caplog.text


# ------------------------------------------------------------------ following
def _take_next(
    conn: psycopg.Connection[Any], finished: list[int], cap: int | None = 1000
) -> list[int]:
    """The delivery task's lease of its aggregates' next messages (tasks._Follow)."""
    taken = store.take_next(
        conn, finished, owner="w", lease=LEASE, max_attempts=3, max_in_flight=cap
    )
    assert all(b.started and b.lease_left_seconds > 29 for b in taken)
    return [b.claimed.id for b in taken]


def test_a_finished_ordered_row_hands_its_aggregate_on_to_its_task(
    conn: psycopg.Connection[Any],
) -> None:
    """The task that made an ordered row done leases the next row of its
    aggregate itself, instead of waiting for a claim to cross the broker;
    only ever the first unfinished row, and only once the row before is done."""
    a1, b1, a2, b2, a3 = _enqueue(conn, "ABABA")
    claimed = _claim(conn).claimed
    assert [m.id for m in claimed] == [a1, b1]
    # Not done yet: nothing follows.
    assert _take_next(conn, [a1, b1]) == []
    _done(conn, claimed)
    taken = _take_next(conn, [a1, b1])
    assert taken == [a2, b2]
    for message_id in taken:
        row = store.get_row(conn, message_id)
        assert row is not None
        # Leased as a claim leases (a new version), and begun: the attempt
        # counted, as the task publishes it at once.
        assert (row["status"], row["lease_version"], row["attempts"]) == ("processing", 1, 1)
        began = conn.execute("SELECT began_version FROM outbox WHERE id = %s", (message_id,))
        assert began.fetchone() == (1,)
    assert _is_parked(conn, a3)
    # Asked again for the same finished rows: their successors are taken.
    assert _take_next(conn, [a1, b1]) == []
    assert store.in_flight(conn) == 2


def test_following_leaves_to_the_claim_what_it_handles_itself(
    conn: psycopg.Connection[Any],
) -> None:
    """A durable task's row (the fan-out sends it as the task), a row whose
    last delivery was interrupted (delivered alone), one not due yet, one a
    claim in progress holds: not taken. One out of attempts goes dead, as a
    claim would send it. And never past the in-flight cap."""
    heads = _enqueue(conn, "ABCDE")
    nexts = _enqueue(conn, "ABCDE")
    conn.execute("UPDATE outbox SET event_type = 'celery.durable' WHERE id = %s", (nexts[0],))
    conn.execute("UPDATE outbox SET began_version = lease_version WHERE id = %s", (nexts[1],))
    conn.execute(
        "UPDATE outbox SET available_at = now() + interval '1 hour' WHERE id = %s", (nexts[2],)
    )
    conn.execute("UPDATE outbox SET attempts = 3 WHERE id = %s", (nexts[4],))
    claimed = _claim(conn, batch=50).claimed
    assert [m.id for m in claimed] == heads
    _done(conn, claimed)
    with psycopg.connect(conn.info.dsn) as other, other.transaction():
        other.execute("SELECT 1 FROM outbox WHERE id = %s FOR UPDATE", (nexts[3],))
        assert _take_next(conn, heads) == []
    row = store.get_row(conn, nexts[4])
    assert row is not None and row["status"] == "dead"
    assert "retries exhausted" in row["last_error"]
    # Unlocked: taken, but only as far as the cap leaves room.
    assert _take_next(conn, heads, cap=0) == []
    assert _take_next(conn, heads, cap=1) == [nexts[3]]


def test_a_delivery_follows_its_aggregate_round_after_round(
    conn: psycopg.Connection[Any],
) -> None:
    """Deliverer.deliver with a follow: each ordered row's done leases and
    begins the next of its aggregate in the same transaction, and the same
    call publishes it; the report counts every round (a row given back in
    the first round stays counted after the later ones)."""
    from outbox_relay.db import DirectDatabase
    from outbox_relay.services import Deliverer

    a1, b1, a2, a3 = _enqueue(conn, "ABAA")
    conn.execute("UPDATE outbox SET ordered = false WHERE id = %s", (b1,))
    claimed = _claim(conn).claimed
    assert [m.id for m in claimed] == [a1, b1]
    # Too little lease left for b1's delivery: given back unpublished.
    conn.execute("UPDATE outbox SET lease_until = now() + interval '1 second' WHERE id = %s", (b1,))

    class Follow:
        def __init__(self) -> None:
            self.asked: list[list[int]] = []

        def wants(self, rows: int) -> bool:
            return True

        def finish(
            self, conn: psycopg.Connection[Any], writes: list[Outcome]
        ) -> tuple[set[int], list[Any]]:
            self.asked.append([o.id for o in writes])
            return store.finalize_and_take(
                conn, writes, owner="w", lease=LEASE, max_attempts=3, max_in_flight=1000
            )

    published: list[int] = []
    deliverer = Deliverer(
        lambda message: published.append(int(message.id)),
        db=DirectDatabase(conn),
        count_attempt=True,
        tracer=None,
    )
    follow = Follow()
    report = deliverer.deliver([m.ref for m in claimed], follow)
    assert published == [a1, a2, a3]
    # Each round's writes: b1 given back with a1 in the first.
    assert follow.asked == [[a1, b1], [a2], [a3]]
    assert (report.done, report.followed, report.released) == (3, 2, 1)
    assert report.ordered_done == [a1, a2, a3]
    rows = conn.execute("SELECT id, status, attempts FROM outbox ORDER BY id").fetchall()
    assert rows == [(a1, "done", 1), (b1, "pending", 0), (a2, "done", 1), (a3, "done", 1)]
    deliverer.close()


def test_a_finish_that_takes_no_next_row_still_makes_it_due(
    conn: psycopg.Connection[Any],
) -> None:
    """finalize_and_take takes a parked next row as it is, and promotes only
    when it took none (here the in-flight cap left no room): either way no
    row stays parked behind a finished one."""
    a1, a2, b1, b2 = _enqueue(conn, "AABB")
    claimed = {m.id: m for m in _claim(conn).claimed}
    assert sorted(claimed) == [a1, b1] and _is_parked(conn, a2) and _is_parked(conn, b2)
    outcome = Outcome.done(claimed[a1])
    changed, taken = store.finalize_and_take(
        conn, [outcome], owner="w", lease=LEASE, max_attempts=3, max_in_flight=1
    )
    # b1 still holds the only lease the cap allows: a2 is made due, not taken.
    assert (changed, taken) == ({a1}, [])
    assert not _is_parked(conn, a2)
    changed, taken = store.finalize_and_take(
        conn, [Outcome.done(claimed[b1])], owner="w", lease=LEASE, max_attempts=3, max_in_flight=2
    )
    assert changed == {b1} and [b.claimed.id for b in taken] == [b2]
    row = store.get_row(conn, b2)
    assert row is not None and row["status"] == "processing"
