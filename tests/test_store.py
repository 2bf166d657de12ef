"""The outbox core against real PostgreSQL: claims, leases, fencing, failures.

Time moves through the ``now=`` parameter every store call takes, never by
sleeping: ``now`` stands for the database clock at the moment of the call.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

from outbox_relay import (
    Claimed,
    Defer,
    Deliverer,
    DirectDatabase,
    LeaseRef,
    Message,
    NewMessage,
    PermanentError,
    RetryableError,
    RetryPolicy,
    classify,
    dispatch_once,
    enqueue,
    enqueue_many,
    store,
)
from outbox_relay.model import Outcome

LEASE = timedelta(seconds=30)
SECOND = timedelta(seconds=1)


# ---------------------------------------------------------------- helpers
def db_now(conn: psycopg.Connection[Any]) -> datetime:
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]


def seed(
    conn: psycopg.Connection[Any],
    n: int,
    *,
    aggregate: str = "1",
    event_type: str = "order.paid",
    aggregate_type: str = "order",
) -> list[int]:
    return enqueue_many(
        conn,
        [NewMessage(aggregate_type, aggregate, event_type, {"n": i}) for i in range(n)],
    )


def row(conn: psycopg.Connection[Any], message_id: int) -> dict[str, Any]:
    found = store.get_row(conn, message_id)
    assert found is not None, f"outbox row {message_id} vanished"
    return found


def all_rows(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return conn.execute("SELECT * FROM outbox ORDER BY id").fetchall()


def statuses(conn: psycopg.Connection[Any]) -> dict[int, str]:
    return dict(conn.execute("SELECT id, status FROM outbox ORDER BY id").fetchall())


def claim(
    conn: psycopg.Connection[Any],
    now: datetime | None,
    *,
    owner: str = "w",
    batch: int = 100,
    lease: timedelta = LEASE,
    **kw: Any,
) -> list[Claimed]:
    return store.claim(conn, owner=owner, batch=batch, lease=lease, now=now, **kw)


def deliverer(conn: psycopg.Connection[Any], publisher: Any, **kw: Any) -> Deliverer:
    """A Deliverer on ``conn`` for rows claimed with store.claim (attempt counted there)."""
    return Deliverer(publisher, db=DirectDatabase(conn), **kw)


def run_threads(n: int, target: Callable[[int], None], timeout: float = 60.0) -> None:
    """Run ``target(i)`` in ``n`` threads; re-raise the first failure."""
    errors: list[BaseException] = []

    def wrapped(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    if errors:
        raise errors[0]


class Recorder:
    """A plain callable publisher: records every message; optionally fails some."""

    def __init__(self, fail: Callable[[Message], BaseException | None] | None = None) -> None:
        self.messages: list[Message] = []
        self.fail = fail
        self.lock = threading.Lock()

    def __call__(self, message: Message) -> None:
        with self.lock:
            self.messages.append(message)
        if self.fail is not None:
            exc = self.fail(message)
            if exc is not None:
                raise exc

    @property
    def ids(self) -> list[int]:
        return [m.id for m in self.messages]


# ---------------------------------------------------------------- concurrency
def test_four_concurrent_workers_claim_disjoint_batches_until_all_200_are_leased(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    ids = seed(conn, 200)
    start = threading.Barrier(4)
    claims: dict[int, list[list[Claimed]]] = {i: [] for i in range(4)}

    def worker(i: int) -> None:
        with psycopg.connect(dsn, autocommit=True) as c:
            start.wait(timeout=10)
            while batch := claim(c, None, owner=f"w{i}", batch=7, lease=timedelta(minutes=5)):
                assert len(batch) <= 7
                assert [m.id for m in batch] == sorted(m.id for m in batch)
                claims[i].append(batch)

    run_threads(4, worker)
    got = [m for batches in claims.values() for batch in batches for m in batch]
    # Every row leased exactly once: nothing was claimed twice while leased.
    assert len(got) == 200
    assert sorted(m.id for m in got) == ids
    owners = dict(conn.execute("SELECT id, lease_owner FROM outbox").fetchall())
    for i, batches in claims.items():
        for m in (m for batch in batches for m in batch):
            assert (m.lease_version, m.attempts) == (1, 1)
            assert owners[m.id] == f"w{i}"
    assert set(statuses(conn).values()) == {"processing"}


def test_four_concurrent_workers_claiming_and_finalizing_deliver_each_row_once(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    ids = seed(conn, 200)
    start = threading.Barrier(4)
    lock = threading.Lock()
    held: dict[int, int] = {}  # id -> worker holding its lease right now
    delivered: list[int] = []

    def worker(i: int) -> None:
        with psycopg.connect(dsn, autocommit=True) as c:
            start.wait(timeout=10)
            while batch := claim(c, None, owner=f"w{i}", batch=7, lease=timedelta(minutes=5)):
                with lock:
                    for m in batch:
                        assert m.id not in held, f"{m.id}: w{i} took it from w{held[m.id]}"
                        held[m.id] = i
                for m in batch:
                    assert store.mark_done(c, m) is True
                    with lock:
                        del held[m.id]
                        delivered.append(m.id)

    run_threads(4, worker)
    assert len(delivered) == 200
    assert sorted(delivered) == ids
    assert held == {}
    summary = conn.execute(
        "SELECT status, min(attempts), max(attempts), max(lease_version), count(*),"
        " count(done_at), count(lease_until) FROM outbox GROUP BY status"
    ).fetchall()
    assert summary == [("done", 1, 1, 1, 200, 200, 0)]


def test_an_open_claim_transaction_makes_others_skip_its_rows(dsn: str) -> None:
    with (
        psycopg.connect(dsn) as holder,
        psycopg.connect(dsn, autocommit=True) as other,
    ):
        ids = seed(other, 10)
        holder.execute("SELECT 1")  # a transaction that stays open
        held = claim(holder, None, owner="A", batch=4)
        assert [m.id for m in held] == ids[:4]
        # The rows are locked, not yet committed as leased: the other worker
        # must skip them at once rather than wait for the lock.
        other.execute("SET lock_timeout = '5s'")
        got = claim(other, None, owner="B", batch=10)
        assert [m.id for m in got] == ids[4:]
        holder.rollback()
        # The claim never happened: the rows are pending, first lease version.
        again = claim(other, None, owner="B", batch=10)
        assert [(m.id, m.lease_version, m.attempts) for m in again] == [(i, 1, 1) for i in ids[:4]]


# ---------------------------------------------------------------- crash and expiry
def test_crashed_worker_lease_expires_and_its_late_finalize_is_fenced(dsn: str) -> None:
    with (
        psycopg.connect(dsn, autocommit=True) as ca,
        psycopg.connect(dsn, autocommit=True) as cb,
    ):
        [message_id] = seed(ca, 1)
        lease = timedelta(seconds=5)
        t0 = db_now(ca)
        [a] = claim(ca, t0, owner="A", batch=10, lease=lease)
        assert (a.id, a.lease_version, a.attempts) == (message_id, 1, 1)
        assert a.lease_until == t0 + lease
        # A "crashes": it never finalizes. During the lease nobody else gets it.
        assert claim(cb, t0 + SECOND, owner="B", batch=10) == []
        assert claim(cb, t0 + lease, owner="B", batch=10) == []  # expiry is strict
        # After the lease, B re-claims it under a new fencing token.
        later = t0 + lease + SECOND
        [b] = claim(cb, later, owner="B", batch=10)
        assert (b.id, b.lease_version, b.attempts) == (a.id, a.lease_version + 1, a.attempts + 1)
        assert row(cb, a.id)["lease_owner"] == "B"
        # A wakes up: every fenced write it tries changes nothing.
        before = all_rows(cb)
        assert store.mark_done(ca, a, now=later) is False
        assert store.extend_lease(ca, a, lease=lease, now=later) is False
        assert store.mark_dead(ca, a, error="late", now=later) is False
        assert all_rows(cb) == before
        assert store.mark_done(cb, b, now=later) is True
        final = row(cb, a.id)
        assert final["status"] == "done"
        assert final["done_at"] == later
        assert (final["lease_owner"], final["lease_until"]) == (None, None)
        assert (final["attempts"], final["lease_version"]) == (2, 2)


def test_expired_lease_nobody_took_over_still_finalizes(conn: psycopg.Connection[Any]) -> None:
    # Correctness rests on the fencing token, not the clock: a slow worker
    # whose lease ran out but was not taken over keeps its successful work.
    [message_id] = seed(conn, 1)
    t0 = db_now(conn)
    [m] = claim(conn, t0)
    assert store.mark_done(conn, m, now=t0 + 10 * LEASE) is True
    assert row(conn, message_id)["status"] == "done"


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"lease": timedelta(0)}, "lease must be more than 0s"),
        ({"lease": -10}, "lease must be more than 0s"),
        ({"lease": "30s"}, "lease must be a timedelta or seconds, not str"),
        ({"batch": -1}, "batch must be a number of rows, 0 or more"),
    ],
    ids=repr,
)
def test_claim_refuses_a_lease_that_ends_at_once_and_a_negative_batch(
    conn: psycopg.Connection[Any], kwargs: dict[str, Any], expected: str
) -> None:
    """A lease of 0 s (or less) was granted already expired: the next claim
    took the same row again and burned a second attempt."""
    [message_id] = seed(conn, 1)
    args: dict[str, Any] = {"owner": "w", "batch": 1, "lease": LEASE, **kwargs}
    with pytest.raises(ValueError, match=expected):
        store.claim(conn, **args)
    assert row(conn, message_id)["status"] == "pending"
    assert row(conn, message_id)["attempts"] == 0


@pytest.mark.parametrize(
    "call",
    [
        lambda c: store.claim(c, owner="w", batch=1, lease=30),
        lambda c: store.stats(c),
        lambda c: store.rescue(c, max_attempts=3),
        lambda c: store.mark_dead(c, LeaseRef(1, 1), error="x"),
    ],
    ids=["claim", "stats", "rescue", "mark_dead"],
)
def test_store_functions_name_a_dsn_given_for_a_connection(
    dsn: str, call: Callable[[Any], Any]
) -> None:
    """A DSN passed where the connection belongs failed with "'str' object
    has no attribute 'autocommit'"."""
    with pytest.raises(
        TypeError, match=r"take a psycopg 3 connection, not str: open one with psycopg.connect"
    ):
        call(dsn)
    with pytest.raises(TypeError, match=r"not int$"):
        call(42)


def test_leases_and_delays_take_seconds_as_enqueue_does(conn: psycopg.Connection[Any]) -> None:
    """enqueue(delay=1.5) took seconds; claim(lease=30), extend_lease(lease=60)
    and reschedule(delay=1.5) failed in the driver (cannot cast smallint)."""
    [message_id] = seed(conn, 1)
    [m] = store.claim(conn, owner="w", batch=1, lease=30)
    assert store.extend_lease(conn, m, lease=60) is True
    before = db_now(conn)
    assert store.reschedule(conn, m, delay=90.5, error="busy", refund_attempt=False) is True
    due = row(conn, message_id)["available_at"]
    assert timedelta(seconds=90) < due - before < timedelta(seconds=95)


def test_poison_message_ends_dead_after_max_attempts_and_is_never_claimed_again(
    conn: psycopg.Connection[Any],
) -> None:
    [poison] = seed(conn, 1)
    max_attempts = 3
    now = db_now(conn)
    for attempt in range(1, max_attempts + 1):
        [m] = claim(conn, now, max_attempts=max_attempts)
        assert (m.id, m.attempts, m.lease_version) == (poison, attempt, attempt)
        now += LEASE + SECOND  # the worker died before any except branch ran
    # The claim that follows reaps it instead of handing it out again.
    assert claim(conn, now, max_attempts=max_attempts) == []
    dead = row(conn, poison)
    assert dead["status"] == "dead"
    assert dead["attempts"] == max_attempts
    assert "lease" in dead["last_error"]
    assert (dead["lease_until"], dead["lease_owner"]) == (None, None)
    for _ in range(3):
        now += timedelta(days=1)
        assert claim(conn, now, max_attempts=max_attempts) == []
        assert claim(conn, now, max_attempts=max_attempts, ordered=True) == []
    assert row(conn, poison) == dead
    # The last worker's late finalize is fenced too (the row is no longer processing).
    assert store.mark_done(conn, m, now=now) is False


def test_rescue_kills_only_expired_leases_with_no_attempts_left(
    conn: psycopg.Connection[Any],
) -> None:
    exhausted, fresh, leased = seed(conn, 3)
    t0 = db_now(conn)
    claim(conn, t0, batch=1)
    t1 = t0 + LEASE + SECOND
    [e] = claim(conn, t1, batch=1)  # expired leases come first: attempt 2
    [f] = claim(conn, t1, batch=1)
    [g] = claim(conn, t1, batch=1, lease=10 * LEASE)
    assert [(m.id, m.attempts) for m in (e, f, g)] == [(exhausted, 2), (fresh, 1), (leased, 1)]
    t2 = t1 + LEASE + SECOND
    # max_attempts=2: only the expired lease that used its second attempt dies;
    # the other expired one goes back to pending; the live lease is left alone.
    assert store.reap(conn, max_attempts=2, now=t2) == [exhausted]
    assert statuses(conn) == {exhausted: "dead", fresh: "pending", leased: "processing"}
    assert "2 of 2" in row(conn, exhausted)["last_error"]
    # The expired one with attempts left is handed out again instead.
    [again] = claim(conn, t2, max_attempts=2)
    assert (again.id, again.attempts) == (fresh, 2)


def test_rescue_says_whether_the_delivery_of_an_expired_lease_ever_began(
    conn: psycopg.Connection[Any],
) -> None:
    """An unregistered durable task (or one the broker lost) never begins: no
    attempt is counted, its row goes round lease after lease and never dead.
    Its last_error said "before delivery finished", as for a worker that
    died mid-publish; it says the task never began instead."""
    lost, begun = seed(conn, 2)
    t0 = db_now(conn)
    leased = store.claim_batch(
        conn, owner="w", batch=2, lease=LEASE, count_attempt=False, rescue_first=False, now=t0
    ).claimed
    store.begin(conn, [m.ref for m in leased if m.id == begun], needed=SECOND, now=t0)
    store.rescue(conn, max_attempts=3, now=t0 + LEASE + SECOND)
    assert row(conn, lost)["last_error"].startswith(
        "lease expired before its delivery task began: lost or expired in the broker"
    )
    assert row(conn, begun)["last_error"] == "lease expired before delivery finished"
    assert row(conn, lost)["attempts"] == 0 and row(conn, begun)["attempts"] == 1


# ---------------------------------------------------------------- failure classes
def test_retryable_failures_back_off_with_full_jitter_then_go_dead(
    conn: psycopg.Connection[Any],
) -> None:
    ids = seed(conn, 40)
    policy = RetryPolicy(max_attempts=8, backoff_base=1.0, backoff_cap=10.0)
    now = db_now(conn)
    for attempt in range(1, policy.max_attempts):
        claimed = claim(conn, now, max_attempts=policy.max_attempts)
        assert [(m.id, m.attempts) for m in claimed] == [(i, attempt) for i in ids]
        outcomes = [classify(RetryableError("503"), m, policy) for m in claimed]
        assert store.finalize(conn, outcomes, now=now) == set(ids)
        ceiling = timedelta(seconds=min(policy.backoff_cap, policy.backoff_base * 2**attempt))
        rows = [row(conn, i) for i in ids]
        delays = [r["available_at"] - now for r in rows]
        assert all(timedelta(0) <= d <= ceiling for d in delays), (attempt, ceiling, delays)
        # Full jitter spreads the retries over the whole window (2**-40 odds
        # of a false alarm per check), rather than one synchronized instant.
        assert any(d < ceiling / 2 for d in delays)
        assert any(d > ceiling / 2 for d in delays)
        for r in rows:
            assert r["status"] == "pending"
            assert r["attempts"] == attempt
            assert r["last_error"] == "retryable: RetryableError: 503"
            assert (r["lease_until"], r["lease_owner"]) == (None, None)
        # Not claimable before its time; every one is once the window passed.
        earliest = min(r["available_at"] for r in rows)
        assert claim(conn, earliest - timedelta(microseconds=1)) == []
        now += ceiling
    # The last attempt's failure exhausts the retries.
    claimed = claim(conn, now, max_attempts=policy.max_attempts)
    assert {m.attempts for m in claimed} == {policy.max_attempts}
    outcomes = [classify(RetryableError("503"), m, policy) for m in claimed]
    assert {o.status for o in outcomes} == {"dead"}
    assert store.finalize(conn, outcomes, now=now) == set(ids)
    for i in ids:
        r = row(conn, i)
        assert r["status"] == "dead"
        assert r["attempts"] == policy.max_attempts
        assert r["last_error"].startswith("retries exhausted after 8 attempts")
        assert "503" in r["last_error"]
    assert claim(conn, now + timedelta(days=1)) == []


def test_retry_after_is_a_minimum_delay(conn: psycopg.Connection[Any]) -> None:
    ids = seed(conn, 20)
    now = db_now(conn)
    claimed = claim(conn, now)
    # retry_after above the backoff window: exactly retry_after.
    small = RetryPolicy(backoff_base=1.0, backoff_cap=300.0)  # attempt 1: at most 2 s
    exc = RetryableError("429", retry_after=120)
    assert store.finalize(conn, [classify(exc, claimed[0], small)], now=now) == {ids[0]}
    assert row(conn, ids[0])["available_at"] == now + timedelta(seconds=120)
    # retry_after below the window: the jittered delay, but never below it.
    wide = RetryPolicy(backoff_base=100.0, backoff_cap=300.0)  # attempt 1: up to 200 s
    exc = RetryableError("429", retry_after=timedelta(seconds=30))
    outcomes = [classify(exc, m, wide) for m in claimed[1:]]
    store.finalize(conn, outcomes, now=now)
    delays = [row(conn, i)["available_at"] - now for i in ids[1:]]
    assert all(timedelta(seconds=30) <= d <= timedelta(seconds=200) for d in delays), delays
    assert any(d > timedelta(seconds=30) for d in delays)


def test_retryable_error_through_dispatch_once_lands_in_the_backoff_window(
    conn: psycopg.Connection[Any],
) -> None:
    ids = seed(conn, 30)
    policy = RetryPolicy(max_attempts=5, backoff_base=4.0, backoff_cap=5.0)
    publisher = Recorder(lambda m: RetryableError("timeout"))
    before = db_now(conn)
    assert dispatch_once(conn, publisher, owner="d", batch=50, policy=policy) == 30
    after = db_now(conn)
    ceiling = timedelta(seconds=min(5.0, 4.0 * 2**1))
    assert sorted(publisher.ids) == ids
    for i in ids:
        r = row(conn, i)
        assert r["status"] == "pending"
        assert r["attempts"] == 1
        assert before <= r["available_at"] <= after + ceiling
        assert r["last_error"] == "retryable: RetryableError: timeout"
    # Not before available_at; at it, yes.
    first = min(ids, key=lambda i: row(conn, i)["available_at"])
    due = row(conn, first)["available_at"]
    assert claim(conn, due - timedelta(microseconds=1)) == []
    assert [m.id for m in claim(conn, due, batch=1)] == [first]


def test_exhausted_retries_through_dispatch_once_go_dead(conn: psycopg.Connection[Any]) -> None:
    [message_id] = seed(conn, 1)
    policy = RetryPolicy(max_attempts=3, backoff_cap=0.0)  # due again at once
    publisher = Recorder(lambda m: RetryableError("503"))
    for _ in range(3):
        assert dispatch_once(conn, publisher, owner="d", policy=policy) == 1
    assert dispatch_once(conn, publisher, owner="d", policy=policy) == 0
    r = row(conn, message_id)
    assert (r["status"], r["attempts"]) == ("dead", 3)
    assert r["last_error"] == (
        "retries exhausted after 3 attempts; last: retryable: RetryableError: 503"
    )
    assert [m.attempts for m in publisher.messages] == [1, 2, 3]


def test_a_row_dead_at_the_claim_keeps_what_the_receiver_said(
    conn: psycopg.Connection[Any],
) -> None:
    """A row past a lowered OUTBOX_MAX_ATTEMPTS goes dead at the claim; its
    last_error was replaced by the count alone, and `dead list` could no
    longer say what the receiver had answered."""
    [message_id] = seed(conn, 1)
    conn.execute(
        "UPDATE outbox SET attempts = 5, last_error = 'retryable: HTTP 503' WHERE id = %s",
        (message_id,),
    )
    assert claim(conn, None, max_attempts=3) == []
    r = row(conn, message_id)
    assert r["status"] == "dead"
    assert r["last_error"] == "retries exhausted: 5 attempts used of 3; last: retryable: HTTP 503"


def test_defer_refunds_the_attempt(conn: psycopg.Connection[Any]) -> None:
    [message_id] = seed(conn, 1)
    policy = RetryPolicy(max_attempts=2)
    now = db_now(conn)
    # Deferring many more times than max_attempts never uses an attempt up.
    for version in range(1, 6):
        [m] = claim(conn, now, max_attempts=policy.max_attempts)
        assert (m.attempts, m.lease_version) == (1, version)
        outcome = classify(Defer(45, "stock not ready"), m, policy)
        assert store.finalize(conn, [outcome], now=now) == {message_id}
        r = row(conn, message_id)
        assert (r["status"], r["attempts"]) == ("pending", 0)
        assert r["available_at"] == now + timedelta(seconds=45)
        assert r["last_error"] == "deferred: stock not ready"
        assert claim(conn, now + timedelta(seconds=44)) == []
        now += timedelta(seconds=45)


def test_defer_beyond_max_defer_goes_dead(conn: psycopg.Connection[Any]) -> None:
    a, b, c = seed(conn, 3)
    now = db_now(conn)
    policy = RetryPolicy(max_defer=timedelta(hours=1))
    ma, mb, mc = claim(conn, now)
    outcomes = [
        classify(Defer(timedelta(hours=2), "too far"), ma, policy),
        # Already 50 minutes old: a 15-minute defer would pass the hour.
        classify(Defer(timedelta(minutes=15), "late"), mb, policy, age_seconds=50 * 60),
        classify(Defer(timedelta(minutes=5), "fine"), mc, policy, age_seconds=50 * 60),
    ]
    assert store.finalize(conn, outcomes, now=now) == {a, b, c}
    assert statuses(conn) == {a: "dead", b: "dead", c: "pending"}
    assert "maximum defer" in row(conn, a)["last_error"]
    assert "too far" in row(conn, a)["last_error"]
    assert "late" in row(conn, b)["last_error"]
    assert row(conn, c)["attempts"] == 0


def test_defer_through_dispatch_once(conn: psycopg.Connection[Any]) -> None:
    ok, too_far = seed(conn, 2)
    publisher = Recorder(
        lambda m: Defer(timedelta(days=2), "next week") if m.id == too_far else Defer(60, "soon")
    )
    before = db_now(conn)
    assert dispatch_once(conn, publisher, owner="d") == 2
    after = db_now(conn)
    assert statuses(conn) == {ok: "pending", too_far: "dead"}
    r = row(conn, ok)
    assert r["attempts"] == 0
    assert before + timedelta(seconds=60) <= r["available_at"] <= after + timedelta(seconds=60)


def test_permanent_error_goes_dead_at_once(conn: psycopg.Connection[Any]) -> None:
    [message_id] = seed(conn, 1)
    publisher = Recorder(lambda m: PermanentError("422 invalid address"))
    assert dispatch_once(conn, publisher, owner="d", max_attempts=12) == 1
    r = row(conn, message_id)
    assert (r["status"], r["attempts"]) == ("dead", 1)
    assert r["last_error"] == "permanent: PermanentError: 422 invalid address"
    assert (r["lease_until"], r["done_at"]) == (None, None)
    assert claim(conn, db_now(conn) + timedelta(days=1)) == []
    assert len(publisher.messages) == 1


def test_unclassified_exception_is_retried_as_unexpected(conn: psycopg.Connection[Any]) -> None:
    [message_id] = seed(conn, 1)
    publisher = Recorder(lambda m: KeyError("oops"))
    assert dispatch_once(conn, publisher, owner="d") == 1
    r = row(conn, message_id)
    assert (r["status"], r["attempts"]) == ("pending", 1)
    assert r["last_error"] == "unexpected: KeyError: 'oops'"


def test_long_errors_are_clipped(conn: psycopg.Connection[Any]) -> None:
    [message_id] = seed(conn, 1)
    [m] = claim(conn, None)
    assert store.mark_dead(conn, m, error="x" * 10_000)
    error = row(conn, message_id)["last_error"]
    assert len(error) == store.MAX_ERROR_LENGTH and error.endswith("...")


# ---------------------------------------------------------------- ordering
ORDERED_FORMS = [pytest.param(True, id="all-types"), pytest.param(["order.paid"], id="listed")]


@pytest.mark.parametrize("ordered", ORDERED_FORMS)
def test_ordered_claim_finalizes_one_aggregate_in_id_order_across_4_workers(
    dsn: str, conn: psycopg.Connection[Any], ordered: Any
) -> None:
    messages = []
    for i in range(30):
        messages.append(NewMessage("order", "A", "order.paid", {"n": i}))
        if ordered is not True and i % 3 == 0:
            messages.append(NewMessage("order", "A", "order.note", {"n": i}))  # unordered
    ids = enqueue_many(conn, messages)
    paid = [i for i, m in zip(ids, messages) if m.event_type == "order.paid"]
    start = threading.Barrier(4)
    lock = threading.Lock()
    finalized: list[int] = []
    out: set[int] = set()  # ordered messages leased and not yet finalized

    def worker(w: int) -> None:
        deadline = time.monotonic() + 30
        with psycopg.connect(dsn, autocommit=True) as c:
            start.wait(timeout=10)
            while time.monotonic() < deadline:
                with lock:
                    if len(finalized) == len(ids):
                        return
                batch = claim(c, None, owner=f"w{w}", batch=5, ordered=ordered)
                with lock:
                    out.update(m.id for m in batch if m.event_type == "order.paid")
                    # At most one ordered message of the aggregate is ever out.
                    assert len(out) <= 1, sorted(out)
                for m in batch:
                    # Finalize and record under the lock: the list is the commit order.
                    with lock:
                        assert store.mark_done(c, m) is True
                        finalized.append(m.id)
                        out.discard(m.id)
                if not batch:
                    time.sleep(0.001)  # another worker holds the head; let it finish

    run_threads(4, worker)
    assert sorted(finalized) == ids
    assert [i for i in finalized if i in set(paid)] == paid


@pytest.mark.parametrize("ordered", ORDERED_FORMS)
def test_dead_head_blocks_its_aggregate_while_other_aggregates_flow(
    conn: psycopg.Connection[Any], ordered: Any
) -> None:
    a1, a2, a3 = seed(conn, 3, aggregate="A")
    b1, b2 = seed(conn, 2, aggregate="B")
    c1, c2 = seed(conn, 2, aggregate="A", aggregate_type="invoice")  # another aggregate type
    now = db_now(conn)
    got = claim(conn, now, ordered=ordered)
    assert [m.id for m in got] == [a1, b1, c1]
    head = {m.id: m for m in got}
    assert store.mark_dead(conn, head[a1], error="permanent: bad", now=now)
    assert store.mark_done(conn, head[b1], now=now)
    assert store.mark_done(conn, head[c1], now=now)
    rest = claim(conn, now, ordered=ordered)
    assert [m.id for m in rest] == [b2, c2]
    assert store.finalize(conn, [Outcome.done(m) for m in rest], now=now) == {b2, c2}
    for _ in range(2):
        now += timedelta(days=1)
        assert claim(conn, now, ordered=ordered) == []
    assert statuses(conn) == {
        a1: "dead",
        a2: "pending",
        a3: "pending",
        b1: "done",
        b2: "done",
        c1: "done",
        c2: "done",
    }


def test_unordered_event_types_are_not_blocked_by_an_ordered_head(
    conn: psycopg.Connection[Any],
) -> None:
    paid1, note1, paid2, note2 = enqueue_many(
        conn,
        [
            NewMessage("order", "A", "order.paid", {}),
            NewMessage("order", "A", "order.note", {}),
            NewMessage("order", "A", "order.paid", {}),
            NewMessage("order", "A", "order.note", {}),
        ],
    )
    now = db_now(conn)
    ordered = ["order.paid"]
    got = claim(conn, now, ordered=ordered)
    assert [m.id for m in got] == [paid1, note1, note2]
    head = got[0]
    assert store.finalize(conn, [Outcome.done(m) for m in got[1:]], now=now) == {note1, note2}
    assert claim(conn, now, ordered=ordered) == []
    # The head fails and waits for its retry: the next paid still waits.
    store.finalize(conn, [classify(RetryableError("x"), head, RetryPolicy())], now=now)
    assert claim(conn, now, ordered=ordered) == []
    [again] = claim(conn, now + timedelta(minutes=10), ordered=ordered)
    assert again.id == paid1
    assert store.mark_done(conn, again, now=now)
    assert [m.id for m in claim(conn, now, ordered=ordered)] == [paid2]


def test_ordered_expired_head_is_reclaimed_before_its_successors(
    conn: psycopg.Connection[Any],
) -> None:
    first, second = seed(conn, 2)
    now = db_now(conn)
    [crashed] = claim(conn, now, ordered=True)
    assert crashed.id == first
    now += LEASE + SECOND
    [retaken] = claim(conn, now, ordered=True, owner="B")
    assert (retaken.id, retaken.lease_version) == (first, 2)
    assert store.mark_done(conn, retaken, now=now)
    assert [m.id for m in claim(conn, now, ordered=True)] == [second]


@pytest.mark.parametrize(
    "ordered",
    [
        pytest.param(lambda: iter(["order.paid"]), id="iterator"),
        pytest.param(lambda: (t for t in ["order.paid"]), id="generator"),
        pytest.param(lambda: "order.paid", id="string"),
        pytest.param(lambda: {"order.paid", "order.other"}, id="set"),
    ],
)
def test_ordered_event_types_accept_any_iterable_or_a_single_name(
    conn: psycopg.Connection[Any], ordered: Callable[[], Iterable[str]]
) -> None:
    first, _second = seed(conn, 2)
    assert [m.id for m in claim(conn, None, ordered=ordered())] == [first]
    assert claim(conn, None, ordered=ordered()) == []


# ---------------------------------------------------------------- lease renewal
def test_lease_renewal_is_fenced_on_the_lease_version(conn: psycopg.Connection[Any]) -> None:
    [message_id] = seed(conn, 1)
    t0 = db_now(conn)
    [a] = claim(conn, t0, owner="A")
    # Renewal with the current version pushes lease_until from "now".
    assert store.extend_lease(conn, a, lease=timedelta(minutes=2), now=t0 + 20 * SECOND)
    assert row(conn, message_id)["lease_until"] == t0 + 20 * SECOND + timedelta(minutes=2)
    # So a claim after the original lease, inside the renewed one, gets nothing.
    assert claim(conn, t0 + LEASE + SECOND, owner="B") == []
    # Once the renewed lease expires, B takes over; A's renewal is now stale.
    later = t0 + timedelta(minutes=3)
    [b] = claim(conn, later, owner="B")
    before = all_rows(conn)
    assert store.extend_lease(conn, a, lease=timedelta(hours=1), now=later) is False
    assert (
        set(store.extend_leases(conn, [a.ref, LeaseRef(a.id, 99)], lease=LEASE, now=later)) == set()
    )
    assert all_rows(conn) == before
    assert set(store.extend_leases(conn, [a, b], lease=LEASE, now=later)) == {b.id}
    assert row(conn, message_id)["lease_until"] == later + LEASE
    # A finished row cannot be renewed.
    assert store.mark_done(conn, b, now=later)
    done = all_rows(conn)
    assert store.extend_lease(conn, b, lease=LEASE, now=later) is False
    assert all_rows(conn) == done


# ---------------------------------------------------------------- batched finalize
def test_batched_finalize_changes_exactly_the_current_leases(
    conn: psycopg.Connection[Any],
) -> None:
    ids = seed(conn, 8)
    t0 = db_now(conn)
    mine = claim(conn, t0, owner="A", lease=timedelta(seconds=10))
    later = t0 + timedelta(seconds=11)
    # A keeps ids[0:4] alive; ids[4:8] expire and B takes them over.
    assert set(store.extend_leases(conn, mine[:4], lease=LEASE, now=t0 + 5 * SECOND)) == set(
        ids[:4]
    )
    theirs = claim(conn, later, owner="B")
    assert [m.id for m in theirs] == ids[4:]
    policy = RetryPolicy(backoff_cap=0.0)
    outcomes = [
        Outcome.done(mine[0]),
        classify(RetryableError("flaky"), mine[1], policy),
        Outcome.dead(mine[2], error="permanent: no"),
        classify(Defer(60, "later"), mine[3], policy),
        Outcome.done(mine[4]),  # stale
        classify(RetryableError("flaky"), mine[5], policy),  # stale
        Outcome.dead(mine[6], error="permanent: no"),  # stale
        classify(Defer(60, "later"), mine[7], policy),  # stale
    ]
    before = {i: row(conn, i) for i in ids[4:]}
    assert store.finalize(conn, outcomes, now=later) == set(ids[:4])
    assert statuses(conn) == {
        ids[0]: "done",
        ids[1]: "pending",
        ids[2]: "dead",
        ids[3]: "pending",
        **{i: "processing" for i in ids[4:]},
    }
    assert row(conn, ids[0])["done_at"] == later
    assert row(conn, ids[1])["attempts"] == 1 and row(conn, ids[1])["available_at"] == later
    assert row(conn, ids[2])["last_error"] == "permanent: no"
    assert row(conn, ids[3])["attempts"] == 0
    assert row(conn, ids[3])["available_at"] == later + timedelta(seconds=60)
    for i in ids[4:]:
        assert row(conn, i) == before[i]
        assert row(conn, i)["lease_owner"] == "B"
    # B's own batch goes through, and a replay of A's batch changes nothing.
    assert store.finalize(conn, [Outcome.done(m) for m in theirs], now=later) == set(ids[4:])
    snapshot = all_rows(conn)
    assert store.finalize(conn, outcomes, now=later) == set()
    assert all_rows(conn) == snapshot
    assert store.finalize(conn, []) == set()


# ---------------------------------------------------------------- Deliverer.deliver
def test_deliver_skips_stale_refs_without_publishing(dsn: str) -> None:
    with (
        psycopg.connect(dsn, autocommit=True) as ca,
        psycopg.connect(dsn, autocommit=True) as cb,
    ):
        ids = seed(ca, 3)
        mine = claim(ca, None, owner="A", lease=timedelta(minutes=5))
        # B takes one row over: its lease expired (A froze, say), the rescuer
        # gave it back, and B claimed it.
        ca.execute(
            "UPDATE outbox SET lease_until = now() - interval '1 second' WHERE id = %s",
            (ids[0],),
        )
        [theirs] = claim(cb, None, owner="B", batch=1)
        assert theirs.id == ids[0]
        kept = [i for i in ids if i != theirs.id]
        publisher = Recorder()
        relay = deliverer(ca, publisher, concurrency=1)
        # A's chunk: its stale ref, its two current ones, and one for no row at all.
        refs = [m.ref for m in mine] + [LeaseRef(ids[-1] + 1000, 1)]
        report = relay.deliver(refs)
        assert publisher.ids == kept
        assert (report.done, report.stale, report.lost) == (2, 2, 0)
        r = row(ca, theirs.id)
        assert (r["status"], r["lease_owner"], r["lease_version"]) == ("processing", "B", 2)
        assert [statuses(ca)[i] for i in kept] == ["done", "done"]


def test_deliver_releases_rows_with_too_little_lease_left(conn: psycopg.Connection[Any]) -> None:
    ids = seed(conn, 3)
    short = claim(conn, None, lease=timedelta(seconds=5))
    publisher = Recorder()
    relay = deliverer(conn, publisher, publish_timeout=10.0, concurrency=1)
    before = db_now(conn)
    report = relay.deliver([m.ref for m in short])
    assert publisher.messages == []
    assert (report.released, report.done, report.stale) == (3, 0, 0)
    for i in ids:
        r = row(conn, i)
        assert (r["status"], r["attempts"], r["lease_version"]) == ("pending", 0, 1)
        assert r["available_at"] >= before
        assert "too little lease left" in r["last_error"]
    # Released rows are due again at once, with a fresh lease and no attempt lost.
    again = claim(conn, None, lease=timedelta(minutes=5))
    assert [(m.id, m.attempts, m.lease_version) for m in again] == [(i, 1, 2) for i in ids]
    report = relay.deliver([m.ref for m in again])
    assert report.done == 3 and publisher.ids == ids


def test_an_all_done_chunk_writes_what_the_general_finalize_writes(
    conn: psycopg.Connection[Any],
) -> None:
    # store.finalize writes a chunk whose every row is plainly done with a
    # statement of its own (two arrays instead of seven): the same fence and
    # the same row as the general statement, which a mixed chunk still uses.
    ids = seed(conn, 6)
    t0 = db_now(conn)
    mine = claim(conn, t0, owner="A", lease=timedelta(seconds=10))
    conn.execute("UPDATE outbox SET last_error = 'an earlier attempt failed'")
    later = t0 + timedelta(seconds=11)
    # A keeps ids[0:4]; ids[4:6] expire and B takes them over.
    store.extend_leases(conn, mine[:4], lease=LEASE, now=t0 + 5 * SECOND)
    theirs = claim(conn, later, owner="B")
    assert [m.id for m in theirs] == ids[4:]
    before = {i: row(conn, i) for i in ids[4:]}
    short = [Outcome.done(m) for m in (mine[0], mine[1], mine[4])]
    assert all(o.plainly_done for o in short)
    assert store.finalize(conn, short, now=later) == {ids[0], ids[1]}
    mixed = [Outcome.done(mine[2]), Outcome.dead(mine[3], error="permanent: no")]
    assert not all(o.plainly_done for o in mixed)
    assert store.finalize(conn, mixed, now=later) == {ids[2], ids[3]}
    by_short, by_general = row(conn, ids[0]), row(conn, ids[2])
    for key in ("status", "done_at", "last_error", "lease_owner", "lease_until", "attempts"):
        assert by_short[key] == by_general[key], key
    assert by_short["status"] == "done" and by_short["done_at"] == later
    assert by_short["last_error"] is None and by_short["lease_until"] is None
    for i in ids[4:]:
        assert row(conn, i) == before[i], "a stale done changed B's row"


def test_deliver_publishes_a_chunk_concurrently_and_finalizes_it(
    conn: psycopg.Connection[Any],
) -> None:
    ids = seed(conn, 8)
    # Four publishes must be in flight at once to get past the barrier: a
    # relay that published one at a time would break it (then retry).
    together = threading.Barrier(4, timeout=10)
    threads: set[str] = set()

    def publish(message: Message) -> None:
        threads.add(threading.current_thread().name)
        together.wait()
        return None

    publisher = Recorder(publish)
    relay = deliverer(conn, publisher, concurrency=4)
    try:
        claimed = claim(conn, None, lease=timedelta(minutes=5))
        report = relay.deliver([m.ref for m in claimed])
    finally:
        relay.close()
    assert (report.done, report.retried, report.dead, report.stale) == (8, 0, 0, 0)
    assert sorted(publisher.ids) == ids
    assert len(threads) == 4
    assert set(statuses(conn).values()) == {"done"}
    assert sorted(o.id for o in report.outcomes) == ids


def test_deliver_counts_a_lease_lost_during_publish(dsn: str) -> None:
    with (
        psycopg.connect(dsn, autocommit=True) as ca,
        psycopg.connect(dsn, autocommit=True) as cb,
    ):
        [message_id] = seed(ca, 1)
        [a] = claim(ca, None, owner="A", lease=timedelta(minutes=1))

        def slow_publish(message: Message) -> None:
            # While A publishes, its lease "expires" and B re-claims and finishes.
            later = db_now(cb) + timedelta(minutes=2)
            [b] = claim(cb, later, owner="B")
            assert store.mark_done(cb, b, now=later)
            return None

        publisher = Recorder(slow_publish)
        report = deliverer(ca, publisher, concurrency=1).deliver([a.ref])
        assert (report.done, report.lost) == (0, 1)
        r = row(ca, message_id)
        assert (r["status"], r["lease_version"], r["attempts"]) == ("done", 2, 2)


def test_idempotency_key_is_stable_across_retries_and_reclaims(
    conn: psycopg.Connection[Any],
) -> None:
    keyed = enqueue(
        conn,
        aggregate_type="order",
        aggregate_id="1",
        event_type="order.refunded",
        payload={},
        operation_key="refund:order-1",
    )
    plain = enqueue(
        conn, aggregate_type="order", aggregate_id="1", event_type="order.paid", payload={}
    )

    class Crash(BaseException):
        """The process dies right after the receiver accepted the message."""

    attempt = {"n": 0}

    def fail(message: Message) -> BaseException | None:
        if attempt["n"] == 0:
            return RetryableError("timeout")  # first delivery: the receiver timed out
        if attempt["n"] == 1:
            return Crash()  # second: accepted, but the response was lost
        return None

    publisher = Recorder(fail)
    relay = deliverer(conn, publisher, concurrency=1, policy=RetryPolicy(backoff_cap=1.0))
    now = db_now(conn)
    for n in range(3):
        attempt["n"] = n
        now += timedelta(hours=1, seconds=1)  # past any backoff and any lease
        claimed = claim(conn, now, lease=timedelta(hours=1))
        assert [m.id for m in claimed] == [keyed, plain]
        for m in claimed:
            with contextlib.suppress(Crash):
                relay.deliver([m.ref])
    keys: dict[int, set[str]] = {}
    for m in publisher.messages:
        keys.setdefault(m.id, set()).add(m.idempotency_key)
    assert keys == {keyed: {"refund:order-1"}, plain: {f"outbox-{plain}"}}
    assert [m.attempts for m in publisher.messages if m.id == plain] == [1, 2, 3]
    assert [m.lease_version for m in publisher.messages if m.id == plain] == [1, 2, 3]
    assert statuses(conn) == {keyed: "done", plain: "done"}

    # The prefix is configurable, and dispatch_once derives the same keys.
    other = enqueue(conn, aggregate_type="o", aggregate_id="2", event_type="e", payload={})
    recorder = Recorder()
    dispatch_once(conn, recorder, owner="d", idempotency_key_prefix="shop-")
    assert [m.idempotency_key for m in recorder.messages] == [f"shop-{other}"]


def test_deliver_with_an_aged_message_applies_max_defer(conn: psycopg.Connection[Any]) -> None:
    old, young = seed(conn, 2)
    conn.execute(
        "UPDATE outbox SET created_at = created_at - interval '50 minutes' WHERE id = %s", (old,)
    )
    claimed = claim(conn, None, lease=timedelta(minutes=5))
    publisher = Recorder(lambda m: Defer(timedelta(minutes=15), "wait"))
    policy = RetryPolicy(max_defer=timedelta(hours=1))
    relay = deliverer(conn, publisher, policy=policy, concurrency=1)
    report = relay.deliver([m.ref for m in claimed])
    assert (report.dead, report.retried) == (1, 1)
    assert statuses(conn) == {old: "dead", young: "pending"}
    assert row(conn, young)["attempts"] == 0


# ---------------------------------------------------------------- dispatch_once
def test_dispatch_once_end_to_end_with_a_publisher_that_fails_some(
    conn: psycopg.Connection[Any],
) -> None:
    ids = enqueue_many(
        conn, [NewMessage("order", str(n % 4), "order.paid", {"n": n}) for n in range(24)]
    )
    by_n = dict(zip(range(24), ids))
    calls: dict[int, int] = {}
    deferred: set[int] = set()

    def fail(message: Message) -> BaseException | None:
        n = message.payload["n"]
        calls[n] = calls.get(n, 0) + 1
        if n % 6 == 0:
            return PermanentError("rejected")
        if n % 5 == 2 and n not in deferred:
            deferred.add(n)
            return Defer(0, "not yet")
        if n % 4 == 1 and message.attempts < 3:
            return RetryableError("503", retry_after=0)
        return None

    publisher = Recorder(fail)
    policy = RetryPolicy(max_attempts=5, backoff_cap=0.0)
    claimed_total = 0
    for _ in range(10):
        claimed = dispatch_once(conn, publisher, owner="d", batch=10, policy=policy)
        if claimed == 0:
            break
        claimed_total += claimed
    assert dispatch_once(conn, publisher, owner="d", batch=10, policy=policy) == 0
    assert claimed_total == len(publisher.messages)
    for n, message_id in by_n.items():
        r = row(conn, message_id)
        if n % 6 == 0:
            assert (r["status"], r["attempts"]) == ("dead", 1), n
            assert r["last_error"] == "permanent: PermanentError: rejected"
            assert calls[n] == 1
        else:
            assert r["status"] == "done", n
            assert r["done_at"] is not None
            retries = 2 if n % 4 == 1 else 0
            # A defer refunds its attempt; retries do not.
            assert r["attempts"] == 1 + retries, n
            assert calls[n] == 1 + retries + (1 if n % 5 == 2 else 0), n
    assert store.stats(conn)["processing"] == 0
    assert store.in_flight(conn) == 0


def test_dispatch_once_releases_rather_than_publish_into_a_short_lease(
    conn: psycopg.Connection[Any],
) -> None:
    ids = seed(conn, 2)
    publisher = Recorder()
    assert (
        dispatch_once(conn, publisher, owner="d", lease=timedelta(seconds=5), publish_timeout=10)
        == 2
    )
    assert publisher.messages == []
    for i in ids:
        r = row(conn, i)
        assert (r["status"], r["attempts"]) == ("pending", 0)


def test_dispatch_once_on_an_empty_queue_claims_nothing(conn: psycopg.Connection[Any]) -> None:
    publisher = Recorder()
    assert dispatch_once(conn, publisher, owner="d") == 0
    assert publisher.messages == []


def test_a_claim_says_whether_the_cap_or_the_due_rows_ended_it(
    conn: psycopg.Connection[Any],
) -> None:
    # The drain goes on after a claim the in-flight cap cut short, not after
    # one that found no more due rows (store.claim_batch): under a steady
    # stream of new rows, the second kind started a drain each.
    seed(conn, 10)
    kwargs: dict[str, Any] = {"owner": "A", "lease": LEASE, "max_in_flight": 6}
    first = store.claim_batch(conn, batch=4, **kwargs)
    assert (len(first.claimed), first.limit, first.capped) == (4, 4, False)  # a full batch
    second = store.claim_batch(conn, batch=4, **kwargs)
    # Room for 2 under the cap of 6, both taken: the cap cut it short.
    assert (len(second.claimed), second.limit, second.capped) == (2, 2, True)
    third = store.claim_batch(conn, batch=4, **kwargs)
    assert (third.claimed, third.limit, third.capped) == ([], 0, True)
    store.finalize(conn, [Outcome.done(m) for m in first.claimed + second.claimed])
    # Room for 6 again, 4 rows left: the due rows ended it.
    last = store.claim_batch(conn, batch=8, **kwargs)
    assert (len(last.claimed), last.limit, last.capped) == (4, 6, False)
    assert store.in_flight(conn) == 4


def test_a_claim_that_does_not_wait_leaves_the_rows_to_the_claim_in_progress(dsn: str) -> None:
    # A drain's claim hint (contend=False) must not queue behind another claim
    # of the table only to find the rows it took; it says "busy", which is
    # neither a claim cut short by the cap (no held-back rounds follow) nor
    # an empty queue. A waiting claim still takes what is left afterwards.
    kwargs: dict[str, Any] = {"lease": LEASE, "max_in_flight": 100}
    with (
        psycopg.connect(dsn) as holder,
        psycopg.connect(dsn) as hint,
        psycopg.connect(dsn, autocommit=True) as other,
    ):
        ids = seed(other, 10)
        holder.execute("SELECT 1")  # its claim's transaction stays open
        held = store.claim_batch(holder, owner="A", batch=4, **kwargs)
        assert [m.id for m in held.claimed] == ids[:4]
        started = time.monotonic()
        busy = store.claim_batch(hint, owner="B", batch=10, contend=False, **kwargs)
        assert time.monotonic() - started < 2
        assert (busy.claimed, busy.busy, busy.capped) == ([], True, False)
        assert store.in_flight(other) == 0  # the holder has not committed
        holder.commit()
        after = store.claim_batch(hint, owner="B", batch=10, contend=False, **kwargs)
        hint.commit()
        assert [m.id for m in after.claimed] == ids[4:]
        assert not after.busy and store.in_flight(other) == 10


def test_a_durable_run_begins_with_its_chain_only(conn: psycopg.Connection[Any]) -> None:
    # begin(chain_only=True), a durable task's run: the fence and the attempt
    # as ever, but of the payload only the chain (its arguments come with its
    # Celery message); the multi-row statement does the same.
    def durable(payload: dict[str, Any]) -> int:
        [row] = enqueue_many(
            conn,
            [NewMessage("celery", "t", "celery.durable", payload)],
            allow_reserved=True,
        )
        return row

    def begin_run(ref: LeaseRef, needed: timedelta = SECOND) -> store.Began | None:
        return store.begin(conn, [ref], needed=needed, chain_only=True).get(ref.id)

    step = {"task": "next", "args": [1]}
    alone = durable({"task": "t", "args": ["big"] * 100, "chain": []})
    chained = durable({"task": "t", "args": [], "chain": [step]})
    full = durable({"task": "t", "args": [2], "chain": [step]})
    conn.commit()
    claimed = {
        c.id: c
        for c in store.claim_batch(
            conn, owner="A", batch=10, lease=LEASE, count_attempt=False, content=False
        ).claimed
    }
    conn.commit()
    conn.autocommit = True
    began = begin_run(claimed[alone].ref)
    assert began is not None and began.started
    assert (began.claimed.payload, began.claimed.attempts) == ({"chain": []}, 1)
    assert began.claimed.event_type == "celery.durable" and began.lease_left_seconds > 20
    # The same lease again (a duplicated message) counts nothing more.
    again = begin_run(claimed[alone].ref)
    assert again is not None and again.claimed.attempts == 1
    # Another lease version is not this run's row.
    assert begin_run(LeaseRef(alone, claimed[alone].lease_version + 1)) is None
    assert begin_run(LeaseRef(10**12, 1)) is None
    # Too little lease left: returned unstarted, no attempt counted.
    short = begin_run(claimed[chained].ref, needed=timedelta(minutes=5))
    assert short is not None and not short.started and short.claimed.attempts == 0
    began = begin_run(claimed[chained].ref)
    assert began is not None and began.claimed.payload == {"chain": [step]}
    assert began.claimed.attempts == 1
    # Two rows in one statement (the unnest form): chains only as well.
    both = store.begin(
        conn, [claimed[alone].ref, claimed[chained].ref], needed=SECOND, chain_only=True
    )
    assert {i: b.claimed.payload for i, b in both.items()} == {
        alone: {"chain": []},
        chained: {"chain": [step]},
    }
    # Without chain_only the whole payload, as every delivery task reads it.
    whole = store.begin(conn, [claimed[full].ref], needed=SECOND)[full]
    assert whole.claimed.payload == {"task": "t", "args": [2], "chain": [step]}


def test_a_claim_without_content_leaves_payloads_to_begin(conn: psycopg.Connection[Any]) -> None:
    # The Celery relay's claim (content=False) carries leases only: the
    # delivery task reads each row as it begins. A durable task's row keeps
    # its content: the fan-out sends it as the task itself.
    plain = enqueue(
        conn,
        aggregate_type="order",
        aggregate_id="1",
        event_type="order.paid",
        payload={"n": 1},
        headers={"trace": "x"},
    )
    bare = enqueue(
        conn, aggregate_type="order", aggregate_id="2", event_type="order.paid", payload=[2]
    )
    [durable] = enqueue_many(
        conn,
        [
            NewMessage(
                "celery",
                "t",
                "celery.durable",
                {"task": "t", "id": "t-1"},
                headers={"lease_seconds": 30},
            )
        ],
        allow_reserved=True,
    )
    conn.commit()
    claimed = store.claim_batch(
        conn, owner="A", batch=10, lease=LEASE, count_attempt=False, content=False
    ).claimed
    by_id = {c.id: c for c in claimed}
    assert [(c.id, c.event_type, c.payload, c.headers) for c in claimed] == [
        (plain, "order.paid", None, {}),
        (bare, "order.paid", None, {}),
        (durable, "celery.durable", {"task": "t", "id": "t-1"}, {"lease_seconds": 30}),
    ]
    # Nor its timestamps (begin reads created_at, for the message).
    assert [(c.created_at, c.lease_until) for c in claimed[:2]] == [(None, None)] * 2
    assert by_id[durable].created_at is not None and by_id[durable].lease_until is not None
    began = store.begin(conn, [by_id[plain].ref, by_id[bare].ref], needed=SECOND)
    conn.commit()
    assert began[plain].claimed.created_at is not None
    assert began[plain].claimed.to_message().created_at == began[plain].claimed.created_at
    assert began[plain].claimed.payload == {"n": 1}
    assert began[plain].claimed.headers == {"trace": "x"}
    # Empty headers come back NULL from begin, and as an empty dict here.
    assert began[bare].claimed.payload == [2]
    assert began[bare].claimed.headers == {}
    assert began[bare].claimed.to_message().headers == {}
