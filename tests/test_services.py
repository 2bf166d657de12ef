"""The services' edge cases, against real PostgreSQL: each was a way the relay
lost progress, spent attempts it never used, or wrote state it should not."""

from __future__ import annotations

import asyncio
import functools
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from celery.exceptions import SoftTimeLimitExceeded

from outbox_relay import (
    Claimer,
    Deliverer,
    DirectDatabase,
    Message,
    NewMessage,
    OutboxTable,
    PermanentError,
    Rescuer,
    RetryableError,
    RetryPolicy,
    classify,
    enqueue,
    enqueue_many,
    store,
)
from outbox_relay.db import PoolDatabase
from outbox_relay.model import Outcome
from outbox_relay.publishers.routing import Router
from outbox_relay.services.deliverer import RAMP_SECONDS, threads_at_once
from outbox_relay.store._base import queries

LEASE = timedelta(seconds=30)


def seed(conn: psycopg.Connection[Any], n: int) -> list[int]:
    return enqueue_many(
        conn, [NewMessage("order", str(i), "order.paid", {"n": i}) for i in range(n)]
    )


def rows(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT id, status, attempts, last_error FROM outbox ORDER BY id"
    ).fetchall()


def expire_leases(conn: psycopg.Connection[Any]) -> None:
    """Every lease ends now, as when its holder died or its task was lost."""
    conn.execute(
        "UPDATE outbox SET lease_until = now() - interval '1 second' WHERE status = 'processing'"
    )


def relay_claimer(conn: psycopg.Connection[Any], **kw: Any) -> Claimer:
    options: dict[str, Any] = {
        "table": OutboxTable(),
        "owner": lambda: "claimer",
        "batch_size": 100,
        "max_in_flight": 1000,
        "lease": LEASE,
        "max_attempts": 3,
    }
    options.update(kw)
    return Claimer(DirectDatabase(conn), **options)


def test_a_delivery_task_that_never_ran_costs_no_attempt(conn: psycopg.Connection[Any]) -> None:
    seed(conn, 3)
    claimed = relay_claimer(conn).run_once().claimed
    assert [m.attempts for m in claimed] == [0, 0, 0]
    # Every fan-out task expires in the broker (or is lost); the leases lapse
    # and the rescuer frees them, over and over: never an attempt spent.
    for _ in range(5):
        expire_leases(conn)
        rescued = Rescuer(DirectDatabase(conn), table=OutboxTable(), max_attempts=3).run_once()
        assert len(rescued.released) == 3 and rescued.dead == []
        relay_claimer(conn).run_once()
    assert [r[1:3] for r in rows(conn)] == [("processing", 0)] * 3


def test_an_attempt_is_counted_when_a_delivery_begins(conn: psycopg.Connection[Any]) -> None:
    [message_id] = seed(conn, 1)
    rescuer = Rescuer(DirectDatabase(conn), table=OutboxTable(), max_attempts=2)
    for attempt in (1, 2):
        [m] = relay_claimer(conn, max_attempts=2).run_once().claimed
        began = store.begin(conn, [m.ref], needed=timedelta(seconds=1))
        assert began[message_id].started and began[message_id].claimed.attempts == attempt
        # The worker dies mid-publish: the lease lapses.
        expire_leases(conn)
        result = rescuer.run_once()
    # Its last attempt began and never finished: a poison message, now dead.
    assert result.dead == [message_id]
    [(_, status, attempts, error)] = rows(conn)
    assert (status, attempts) == ("dead", 2)
    assert "lease expired on the last attempt (2 of 2)" in error


def test_only_a_delivery_that_died_under_its_row_marks_it_interrupted(
    conn: psycopg.Connection[Any],
) -> None:
    """The chunked fan-out sends an interrupted row alone (it may be a poison
    message that kills its process) and chunks every other retry: a
    classified failure, a release, a lost task or a retry from dead is not
    the mark of a message that kills its worker."""
    failed, died, lost, released = seed(conn, 4)
    claimer = relay_claimer(conn, max_attempts=5)
    rescuer = Rescuer(DirectDatabase(conn), table=OutboxTable(), max_attempts=5)
    needed = timedelta(seconds=1)
    first = {m.id: m for m in claimer.run_once().claimed}
    assert not any(m.interrupted for m in first.values())
    store.begin(conn, [first[i].ref for i in (failed, died, released)], needed=needed)
    store.finalize(
        conn,
        [
            Outcome(failed, first[failed].lease_version, "pending", error="503"),
            Outcome(released, first[released].lease_version, "pending", refund_attempt=True),
        ],
    )
    # `died`'s worker dies mid-publish; `lost`'s task never reached a worker.
    expire_leases(conn)
    rescuer.run_once()
    second = {m.id: m for m in claimer.run_once().claimed}
    assert {i: m.interrupted for i, m in second.items()} == {
        failed: False,
        died: True,
        lost: False,
        released: False,
    }
    # The interrupted row's next delivery ends with an outcome: no longer marked.
    store.begin(conn, [second[died].ref], needed=needed)
    store.finalize(conn, [Outcome(died, second[died].lease_version, "pending", error="503")])
    [third] = claimer.run_once().claimed
    assert third.id == died and not third.interrupted
    # A row that died on its last attempt and that a person retries from
    # dead keeps the mark: it may still kill its worker.
    store.begin(conn, [third.ref], needed=needed)
    expire_leases(conn)
    Rescuer(DirectDatabase(conn), table=OutboxTable(), max_attempts=3).run_once()
    [(status,)] = conn.execute("SELECT status FROM outbox WHERE id = %s", (died,)).fetchall()
    assert status == "dead"
    conn.execute("UPDATE outbox SET status = 'pending', attempts = 0 WHERE id = %s", (died,))
    assert [m.interrupted for m in claimer.run_once().claimed if m.id == died] == [True]


def test_a_duplicated_delivery_task_counts_one_attempt(conn: psycopg.Connection[Any]) -> None:
    """The broker may deliver a task twice: both copies pass the fence (same
    id and lease version), but only the first begin counts an attempt (found
    by the protocol model: duplicates pushed attempts past max_attempts)."""
    ids = seed(conn, 2)
    claimed = relay_claimer(conn, max_attempts=2).run_once().claimed
    needed = timedelta(seconds=1)
    for _ in range(3):  # a chunk task delivered three times (begin's unnest path)
        began = store.begin(conn, [m.ref for m in claimed], needed=needed)
        assert [began[i].claimed.attempts for i in ids] == [1, 1]
        assert all(began[i].started for i in ids)
    # The next lease counts again; and its duplicates (begin_one's path) do not.
    expire_leases(conn)
    Rescuer(DirectDatabase(conn), table=OutboxTable(), max_attempts=2).run_once()
    again = relay_claimer(conn, max_attempts=2).run_once().claimed
    for _ in range(2):
        one = store.begin(conn, [again[0].ref], needed=needed)[again[0].id]
        assert one.started and one.claimed.attempts == 2


def test_a_release_never_takes_a_row_from_the_delivery_that_began_it(
    conn: psycopg.Connection[Any],
) -> None:
    """Fan-out failed after one task reached a worker and began publishing:
    the fan-out's release gives back only the row nobody began; the begun one
    stays leased, and its delivery's own finalize still counts (found by the
    protocol model, docs/model.md finding 2: the release used to end that
    lease mid-publish and force a duplicate)."""
    begun_id, idle_id = seed(conn, 2)
    claimed = {m.id: m for m in relay_claimer(conn).run_once().claimed}
    store.begin(conn, [claimed[begun_id].ref], needed=timedelta(seconds=1))
    # fanout.release and a duplicated task's "too little lease" both say unless_begun.
    released = store.finalize(
        conn,
        [Outcome.release(m, reason="fan-out failed", unless_begun=True) for m in claimed.values()],
    )
    assert released == {idle_id}
    by_id = {r[0]: r for r in rows(conn)}
    assert by_id[idle_id][1] == "pending" and by_id[begun_id][1] == "processing"
    # The same for the one-row statement (finalize_one).
    assert not store.finalize(
        conn, [Outcome.release(claimed[begun_id], reason="dup", unless_begun=True)]
    )
    # The delivery that began it finishes under its lease as usual...
    assert store.mark_done(conn, claimed[begun_id])
    # ...and the delivery itself may still give back a row it began
    # (unless_begun=False: published nothing, e.g. its hold was lost).
    again = relay_claimer(conn).run_once().claimed
    assert [m.id for m in again] == [idle_id]
    store.begin(conn, [again[0].ref], needed=timedelta(seconds=1))
    assert store.finalize(conn, [Outcome.release(again[0], reason="hold lost")]) == {idle_id}


def test_a_row_out_of_attempts_goes_dead_at_the_claim(conn: psycopg.Connection[Any]) -> None:
    old, fresh = seed(conn, 2)
    # max_retries was lowered after this row had been tried 5 times.
    conn.execute("UPDATE outbox SET attempts = 5 WHERE id = %s", (old,))
    claimed = relay_claimer(conn, max_attempts=3).run_once().claimed
    assert [m.id for m in claimed] == [fresh]
    by_id = {r[0]: r for r in rows(conn)}
    assert by_id[old][1:3] == ("dead", 5)
    assert "retries exhausted" in by_id[old][3]


def test_the_cap_counts_live_leases_only(conn: psycopg.Connection[Any]) -> None:
    seed(conn, 30)
    claimer = relay_claimer(conn, batch_size=8, max_in_flight=10)
    first = claimer.run_once()
    assert (len(first.claimed), first.full, first.capped) == (8, True, False)
    second = claimer.run_once()
    assert (len(second.claimed), second.full, second.capped) == (2, False, True)
    assert claimer.run_once().claimed == []
    # Their tasks were lost: the leases expire. Expired leases hold no room,
    # and the rescuer frees them whatever the room.
    expire_leases(conn)
    assert store.in_flight(conn) == 0
    rescued = Rescuer(DirectDatabase(conn), table=OutboxTable(), max_attempts=3).run_once()
    assert len(rescued.released) == 10
    assert len(claimer.run_once().claimed) == 8


def test_concurrent_claims_cannot_overshoot_the_cap(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        seed(conn, 400)
    got: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def claim() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            barrier.wait()
            for _ in range(5):
                n = len(relay_claimer(conn, batch_size=20, max_in_flight=50).run_once().claimed)
                with lock:
                    got.append(n)

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sum(got) == 50
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert store.in_flight(conn) == 50


def test_retry_after_is_honoured_but_capped(conn: psycopg.Connection[Any]) -> None:
    seed(conn, 1)
    [m] = store.claim(conn, owner="w", batch=1, lease=LEASE)
    policy = RetryPolicy(max_defer=timedelta(hours=2))
    outcome = classify(RetryableError("429", retry_after=10 * 365 * 86400), m, policy)
    assert outcome.delay == timedelta(hours=2)
    soon = classify(RetryableError("429", retry_after=600), m, policy)
    assert soon.delay == timedelta(seconds=600)


def _deliver_until_soft_limit(deliverer: Deliverer, refs: list[Any], after: float = 0.5) -> None:
    def soft_limit(signum: int, frame: Any) -> None:
        raise SoftTimeLimitExceeded()  # what billiard raises in the task's thread

    previous = signal.signal(signal.SIGALRM, soft_limit)
    signal.setitimer(signal.ITIMER_REAL, after)
    try:
        with pytest.raises(SoftTimeLimitExceeded):
            deliverer.deliver(refs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _interrupt(
    conn: psycopg.Connection[Any], n: int, hangs: Callable[[int], bool], **options: Any
) -> tuple[list[int], list[int]]:
    """Deliver ``n`` rows whose publishes of row numbers ``hangs`` picks never
    return, until the soft time limit; the rows' ids and the publishes made."""
    ids = seed(conn, n)
    claimed = store.claim(conn, owner="w", batch=n, lease=LEASE)
    hang = threading.Event()
    calls: list[int] = []

    def publish(message: Message) -> None:
        calls.append(message.payload["n"])
        if hangs(message.payload["n"]):
            hang.wait(10)  # still publishing when the soft time limit fires

    deliverer = Deliverer(publish, db=DirectDatabase(conn), publish_timeout=1, **options)
    try:
        _deliver_until_soft_limit(deliverer, [m.ref for m in claimed])
    finally:
        hang.set()
        deliverer.close()
    return ids, calls


def test_an_interrupted_chunk_finalizes_what_was_published(conn: psycopg.Connection[Any]) -> None:
    # Two publishing threads for five rows: row 0 is published, rows 1 and 2
    # are still publishing when the soft time limit fires, rows 3 and 4 were
    # never started.
    ids, calls = _interrupt(conn, 5, lambda n: n >= 1, concurrency=2)
    by_id = {r[0]: r for r in rows(conn)}
    assert sorted(calls) == [0, 1, 2]
    # The published one is done. The two still publishing keep their leases
    # (attempt counted): given back now, each would be claimed and published
    # again while its first publish may still reach the receiver, both under
    # attempt 1. The lease lapses and the rescuer frees them. The two never
    # started are given back at once, their attempt refunded.
    assert [by_id[i][1] for i in ids] == ["done", "processing", "processing", "pending", "pending"]
    assert [by_id[i][2] for i in ids] == [1, 1, 1, 0, 0]
    assert all("interrupted" in by_id[i][3] for i in ids[3:])
    # Nothing more is published once the task was interrupted.
    time.sleep(0.2)
    assert sorted(calls) == [0, 1, 2]


def test_a_soft_time_limit_inside_an_inline_publish_ends_the_chunk(
    conn: psycopg.Connection[Any],
) -> None:
    # Published inline (one at a time, in the task's own thread), the soft
    # time limit is raised inside the publisher. It ends the chunk, not just
    # that row's publish: the row under way may have reached the receiver,
    # so it is a failed attempt (counted, retried after the backoff); the
    # rows after it never started and get theirs back.
    ids, calls = _interrupt(
        conn, 3, lambda n: n == 1, concurrency=1, interruptions=(SoftTimeLimitExceeded,)
    )
    assert calls == [0, 1]
    by_id = {r[0]: r for r in rows(conn)}
    assert [by_id[i][1] for i in ids] == ["done", "pending", "pending"]
    assert [by_id[i][2] for i in ids] == [1, 1, 0]
    assert "interrupted while publishing" in by_id[ids[1]][3]
    assert "interrupted" in by_id[ids[2]][3]
    due = dict(conn.execute("SELECT id, available_at > now() FROM outbox").fetchall())
    assert (due[ids[1]], due[ids[2]]) == (True, False)  # backoff; due at once


def test_a_claim_is_never_repeated_after_a_broken_connection(dsn: str) -> None:
    db = PoolDatabase(dsn, size=1, name="claim-retry")
    calls: list[int] = []
    try:
        with psycopg.connect(dsn, autocommit=True) as admin:
            seed(admin, 10)

            def claim_then_lose_the_connection(conn: psycopg.Connection[Any]) -> int:
                calls.append(len(store.claim(conn, owner="w", batch=5, lease=LEASE)))
                # The connection dies after the claim committed (a failover,
                # a terminated backend): the caller cannot know it committed.
                admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
                conn.execute("SELECT 1")
                return 0

            with pytest.raises(psycopg.OperationalError):
                db.run(claim_then_lose_the_connection, retry=False)
            assert calls == [5]
            # An idempotent call is retried once on a fresh connection.
            seen: list[int] = []

            def read(conn: psycopg.Connection[Any]) -> int:
                seen.append(conn.info.backend_pid)
                if len(seen) == 1:
                    admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
                return store.in_flight(conn)

            assert db.run(read) == 5
            assert len(seen) == 2 and seen[0] != seen[1]
    finally:
        db.close()


def test_the_plain_loop_drives_the_same_services(conn: psycopg.Connection[Any]) -> None:
    from outbox_relay import Purger, RelayLoop

    ids = seed(conn, 25)
    # One row was left leased by a worker that died: the loop's rescuer frees it.
    store.claim(conn, owner="dead-worker", batch=1, lease=timedelta(seconds=30))
    expire_leases(conn)
    published: list[int] = []
    db = DirectDatabase(conn)
    loop = RelayLoop(
        claimer=relay_claimer(conn, batch_size=10, max_in_flight=20),
        deliverer=Deliverer(
            lambda m: published.append(m.id),
            db=db,
            count_attempt=True,
            concurrency=1,
            publish_timeout=1.0,  # 4 waves x 1 s fit the 30 s lease
        ),
        rescuer=Rescuer(db, table=OutboxTable(), max_attempts=3),
        purger=Purger(db, table=OutboxTable(), older_than=timedelta(days=7)),
        chunk_size=4,
    )
    rounds = 0
    while loop.run_once():
        rounds += 1
        assert rounds < 10, (rows(conn), loop.report)
    assert sorted(published) == ids
    assert loop.report.done == 25
    # Counts only: a loop that runs for weeks kept every outcome in memory.
    assert loop.report.outcomes == []
    assert {r[1] for r in rows(conn)} == {"done"}
    # Attempts: one each, counted as each delivery began (the dead worker's
    # claim had counted one for the first row).
    assert [r[2] for r in rows(conn)] == [2] + [1] * 24


def test_the_plain_loop_refuses_chunks_that_cannot_fit_the_lease(
    conn: psycopg.Connection[Any],
) -> None:
    from outbox_relay import ConfigError, RelayLoop

    db = DirectDatabase(conn)
    with pytest.raises(ConfigError, match="does not fit the claim's lease of 30s"):
        RelayLoop(
            claimer=relay_claimer(conn),
            deliverer=Deliverer(print, db=db, concurrency=1, publish_timeout=10),
            rescuer=Rescuer(db, table=OutboxTable(), max_attempts=3),
            chunk_size=4,
        )


def test_the_plain_loop_starts_with_the_defaults(conn: psycopg.Connection[Any]) -> None:
    """Its default chunk of 50 with a default deliverer (8 at a time, 10 s
    each: 70 s) did not fit the documented 60 s lease: the defaults refused
    to start. The default chunk is what fits."""
    from outbox_relay import Claimer, RelayLoop

    db = DirectDatabase(conn)
    loop = RelayLoop(
        claimer=Claimer(
            db,
            table=OutboxTable(),
            owner=lambda: "me",
            batch_size=100,
            max_in_flight=None,
            lease=timedelta(seconds=60),  # the documented lease
            max_attempts=12,
        ),
        deliverer=Deliverer(print, db=db),
        rescuer=Rescuer(db, table=OutboxTable(), max_attempts=3),
    )
    assert loop.chunk_size == 40  # 5 waves of 8 x 10 s = 50 s < 60 s


def test_the_plain_loop_wakes_when_a_waiting_row_falls_due(conn: psycopg.Connection[Any]) -> None:
    """A retry's backoff or a delayed message waited for the next round, up
    to a whole claim interval past its time."""
    from outbox_relay import RelayLoop

    db = DirectDatabase(conn)
    loop = RelayLoop(
        claimer=relay_claimer(conn),
        deliverer=Deliverer(print, db=db, concurrency=1, publish_timeout=1.0),
        rescuer=Rescuer(db, table=OutboxTable(), max_attempts=3),
        claim_interval=30.0,
    )
    assert loop.idle_wait() == 30.0  # nothing waits
    enqueue(conn, aggregate_type="o", aggregate_id="1", event_type="e", payload={}, delay=2.0)
    assert 1.5 < loop.idle_wait() < 2.1
    enqueue(conn, aggregate_type="o", aggregate_id="2", event_type="e", payload={}, delay=90.0)
    assert 1.5 < loop.idle_wait() < 2.1  # the first to fall due
    conn.execute("DELETE FROM outbox WHERE aggregate_id = '1'")
    assert loop.idle_wait() == 30.0  # due after the next round anyway


def test_relaxed_finalizes_keep_claims_durable(dsn: str) -> None:
    db = PoolDatabase(dsn, size=1, name="relaxed", synchronous_finalize=False)
    try:
        setting = db.run(lambda conn: conn.execute("SHOW synchronous_commit").fetchone())
        assert setting == ("off",)

        def claim_and_read(conn: psycopg.Connection[Any], first: str) -> Any:
            with conn.transaction():
                # What store.claim_batch runs first in its transaction, without
                # and with the in-flight cap: the claim commits durably on a
                # relaxed connection.
                conn.execute(getattr(queries(None), first), {"key": "test-relaxed"})
                return conn.execute("SHOW synchronous_commit").fetchone()

        for first in ("durable_commit", "claim_lock", "try_claim_lock"):
            assert db.run(functools.partial(claim_and_read, first=first)) == ("on",), first
        assert db.run(lambda conn: conn.execute("SHOW synchronous_commit").fetchone()) == ("off",)
    finally:
        db.close()


def test_a_coroutine_publisher_publishes_a_chunk_in_waves_and_its_failures_are_classified(
    conn: psycopg.Connection[Any],
) -> None:
    ids = seed(conn, 10)
    claimed = store.claim(conn, owner="w", batch=10, lease=LEASE)
    running: list[int] = []
    most = [0]
    threads: set[str] = set()

    async def publish(message: Message) -> None:
        threads.add(threading.current_thread().name)
        running.append(message.payload["n"])
        most[0] = max(most[0], len(running))
        try:
            await asyncio.sleep(0.05)
            if message.payload["n"] == 3:
                raise PermanentError("the receiver refused it")
            if message.payload["n"] == 5:
                raise RetryableError("the receiver is busy")
        finally:
            running.remove(message.payload["n"])

    deliverer = Deliverer(publish, db=DirectDatabase(conn), publish_timeout=1, concurrency=4)
    try:
        assert deliverer.is_async
        report = deliverer.deliver([m.ref for m in claimed])
    finally:
        deliverer.close()
    by_id = {r[0]: r for r in rows(conn)}
    assert (report.done, report.dead, report.retried) == (8, 1, 1)
    assert by_id[ids[3]][1] == "dead" and "refused" in by_id[ids[3]][3]
    assert by_id[ids[5]][1] == "pending" and "busy" in by_id[ids[5]][3]
    assert all(by_id[i][1] == "done" for n, i in enumerate(ids) if n not in (3, 5))
    # Up to the concurrency at once, all on the deliverer's one event loop.
    assert most[0] == 4
    assert threads == {"outbox-publish-loop"}


def test_dispatch_once_calls_share_one_event_loop_and_its_cached_client(
    conn: psycopg.Connection[Any],
) -> None:
    """publishers.md's coroutine publisher makes its client once, on the loop
    it first runs on. Each dispatch_once call made a loop and a thread of its
    own: the second call's publishes failed on the first call's client (bound
    to another loop), and every call left a thread behind."""
    from outbox_relay import dispatch_once

    seed(conn, 6)
    loops: set[int] = set()
    made: list[asyncio.Event] = []

    async def publish(message: Message) -> None:
        loops.add(id(asyncio.get_running_loop()))
        if not made:
            made.append(asyncio.Event())  # bound to the loop it is first used on
        made[0].set()
        await made[0].wait()  # RuntimeError on another loop

    before = threading.active_count()
    for _ in range(3):
        assert dispatch_once(conn, publish, owner="me", batch=2) == 2
    assert {r[1] for r in rows(conn)} == {"done"}
    assert len(loops) == 1
    assert threading.active_count() <= before + 1  # the one loop's thread at most


def test_an_interrupted_chunk_of_a_coroutine_publisher_leaves_running_publishes_leased(
    conn: psycopg.Connection[Any],
) -> None:
    ids = seed(conn, 5)
    claimed = store.claim(conn, owner="w", batch=5, lease=LEASE)
    release = threading.Event()
    calls: list[int] = []

    async def publish(message: Message) -> None:
        calls.append(message.payload["n"])
        while message.payload["n"] >= 1 and not release.is_set():
            await asyncio.sleep(0.01)  # still publishing when the soft time limit fires

    deliverer = Deliverer(publish, db=DirectDatabase(conn), publish_timeout=1, concurrency=2)
    try:
        _deliver_until_soft_limit(deliverer, [m.ref for m in claimed])
    finally:
        release.set()
        time.sleep(0.1)
        deliverer.close()
    by_id = {r[0]: r for r in rows(conn)}
    # As with threads: published is done, under way keeps its lease, never
    # started goes back with its attempt refunded; nothing starts afterwards.
    assert sorted(calls) == [0, 1, 2]
    assert [by_id[i][1] for i in ids] == ["done", "processing", "processing", "pending", "pending"]
    assert [by_id[i][2] for i in ids] == [1, 1, 1, 0, 0]


def test_a_routing_table_with_a_coroutine_route_is_awaited_and_its_plain_routes_run_in_threads(
    conn: psycopg.Connection[Any],
) -> None:
    ids = seed(conn, 2)
    conn.execute("UPDATE outbox SET event_type = 'user.created' WHERE id = %s", (ids[1],))
    claimed = store.claim(conn, owner="w", batch=2, lease=LEASE)
    where: dict[str, str] = {}

    async def awaited(message: Message) -> None:
        where[message.event_type] = threading.current_thread().name

    def plain(message: Message) -> None:
        where[message.event_type] = threading.current_thread().name

    router = Router({"order.*": awaited, "user.*": plain})
    assert router.is_async
    deliverer = Deliverer(router, db=DirectDatabase(conn), publish_timeout=1, concurrency=4)
    try:
        assert deliverer.deliver([m.ref for m in claimed]).done == 2
    finally:
        deliverer.close()
    assert where["order.paid"] == "outbox-publish-loop"
    assert where["user.created"] not in ("outbox-publish-loop", threading.current_thread().name)


def test_an_awaitable_returned_by_a_plain_publisher_is_awaited_not_dropped(
    conn: psycopg.Connection[Any],
) -> None:
    seed(conn, 3)
    claimed = store.claim(conn, owner="w", batch=3, lease=LEASE)
    published: list[int] = []

    async def send(message: Message) -> None:
        await asyncio.sleep(0.01)
        published.append(message.id)

    def wrapper(message: Message) -> Any:  # not declared async: returns the coroutine
        return send(message)

    deliverer = Deliverer(wrapper, db=DirectDatabase(conn), publish_timeout=1, concurrency=2)
    try:
        assert not deliverer.is_async
        assert deliverer.deliver([m.ref for m in claimed]).done == 3
    finally:
        deliverer.close()
    assert sorted(published) == sorted(m.id for m in claimed)


def test_a_chunk_starts_as_many_threads_as_the_publishers_pace_needs(
    conn: psycopg.Connection[Any],
) -> None:
    """Threads follow the publisher's pace: a few for a publisher of about a
    millisecond (each costs a hand-off, and a connection for one that holds
    them), and the rest as soon as it slows down."""
    pause = [0.001]
    publishing: set[str] = set()
    starts: list[float] = []

    def publish(message: Message) -> None:
        publishing.add(threading.current_thread().name)
        starts.append(time.perf_counter())
        time.sleep(pause[0])

    deliverer = Deliverer(publish, db=DirectDatabase(conn), publish_timeout=1, concurrency=64)

    def chunk(n: int) -> tuple[int, float]:
        """Publish a chunk of ``n``: how many threads published in it, and
        how long after the first publish the last one started."""
        publishing.clear()
        starts.clear()
        seed(conn, n)
        claimed = store.claim(conn, owner="w", batch=n, lease=LEASE)
        assert deliverer.deliver([m.ref for m in claimed]).done == n
        return len(publishing), max(starts) - min(starts)

    try:
        chunk(60)  # the pace unknown: every thread (30 to 33 published); the deliverer learns it
        # About 1 ms a publish: 60 rows are all under way within half of
        # RAMP_SECONDS from about 6 threads. How many exactly follows the
        # pace the deliverer learned, and sleeps overshoot on a busy host
        # (17 threads in one CI run); the rest join only when the rows were
        # not all taken within RAMP_SECONDS (29 in another, busier one).
        learned = deliverer.publish_seconds
        # The 1 ms sleeps, overshot by a busy host, and nowhere near 50 ms.
        assert learned is not None and 0.001 <= learned < 0.025
        threads, spread = chunk(60)
        assert threads <= threads_at_once(learned, 60, 60) or spread >= RAMP_SECONDS / 2
        assert threads < 30 or spread >= RAMP_SECONDS / 2
        # The receiver slows down to 50 ms: the rows are not all taken within
        # RAMP_SECONDS, and the rest of the threads join.
        pause[0] = 0.05
        assert chunk(60)[0] > 30
    finally:
        deliverer.close()


def test_threads_at_once_follow_the_pace() -> None:
    assert threads_at_once(None, 200, 200) == 200  # the pace unknown
    assert threads_at_once(0.00001, 50, 50) == 1  # a fast publisher: one thread
    assert threads_at_once(0.001, 200, 200) == 20  # under way within half the ramp
    assert threads_at_once(RAMP_SECONDS, 200, 200) == 200  # one wave
    assert threads_at_once(0.5, 500, 256) == 256  # capped by the concurrency
