"""A stateful property test: random interleavings of workers against one outbox.

Hypothesis drives several simulated workers through enqueue, claim, publish
and finalize (done / retryable / defer / permanent), crashes, lease renewals,
stale writes from workers whose lease was taken over, a rescuer freeing
expired leases on its own, and a clock that jumps forward. Time is the
machine's own ``now``, passed to every store call.

Two modes: the articles' claim (it rescues first and counts the attempt),
and the Celery relay's (the rescuer is its own actor, the claim respects an
in-flight cap, and a delivery counts its attempt when it begins).

After every step the database must satisfy the outbox's invariants:

* no two workers both hold a valid lease on one row (at most one worker has
  an unexpired lease on it, and only one worker ever holds its current
  ``lease_version``), and the row agrees with that worker;
* a stale finalize or renewal changes no row at all;
* ``attempts`` never exceeds ``max_attempts``; ``lease_version`` counts every
  claim, so it is never below ``attempts``;
* ``status = 'processing'`` exactly when ``lease_until`` is set;
* with ordered rows, an aggregate's rows after its first unfinished one
  were never claimed;
* in relay mode, live leases never exceed the in-flight cap.

At teardown, once failures stop (publishing always succeeds, time jumps far
ahead), draining with claims leaves every row ``done`` or ``dead`` (or, with
ordered claims, pending behind a dead head of its aggregate).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta

import psycopg
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from outbox_relay import (
    Claimed,
    Defer,
    NewMessage,
    PermanentError,
    RetryableError,
    RetryPolicy,
    classify,
    enqueue_many,
    store,
)
from outbox_relay.model import Outcome

WORKERS = ("w0", "w1", "w2")
LEASE_SECONDS = 30
LEASE = timedelta(seconds=LEASE_SECONDS)
MAX_ATTEMPTS = 3
CAP = 5
POLICY = RetryPolicy(
    max_attempts=MAX_ATTEMPTS,
    backoff_base=1.0,
    backoff_cap=20.0,
    max_defer=timedelta(hours=1),
)
DEFER = timedelta(seconds=15)
OUTCOMES = ("done", "retryable", "defer", "permanent")
# A parked row's available_at is at least this far ahead (queries.sql, frag_parked).
PARKED = timedelta(days=365 * 1000)
COLUMNS = (
    "id, aggregate_type, aggregate_id, event_type, status, available_at, attempts,"
    " lease_owner, lease_until, lease_version, last_error, done_at"
)


@dataclass(frozen=True)
class Row:
    id: int
    aggregate_type: str
    aggregate_id: str
    event_type: str
    status: str
    available_at: datetime
    attempts: int
    lease_owner: str | None
    lease_until: datetime | None
    lease_version: int
    last_error: str | None
    done_at: datetime | None


@dataclass
class Held:
    """What a worker believes about one lease it was given."""

    claimed: Claimed
    lease_until: datetime
    begun: bool = False
    started: bool = False


def failure(kind: str) -> BaseException | None:
    return {
        "done": None,
        "retryable": RetryableError("503"),
        "defer": Defer(DEFER, "not yet"),
        "permanent": PermanentError("422"),
    }[kind]


def test_outbox_state_machine(dsn: str) -> None:
    conn = psycopg.connect(dsn, autocommit=True)

    def table() -> dict[int, Row]:
        rows = conn.execute(f"SELECT {COLUMNS} FROM outbox ORDER BY id").fetchall()
        return {r[0]: Row(*r) for r in rows}

    class OutboxMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            conn.execute("TRUNCATE outbox RESTART IDENTITY")
            row = conn.execute("SELECT now()").fetchone()
            assert row is not None
            self.now: datetime = row[0]
            self.held: dict[str, dict[tuple[int, int], Held]] = {w: {} for w in WORKERS}
            self.enqueued = 0
            self.ordered = False
            self.relay = False
            self.parked = 0

        # ------------------------------------------------------------ helpers
        def claim(self, worker: str, batch: int) -> list[Claimed]:
            # The relay's claim: ordering from the rows, a cap on live leases,
            # no rescue (the rescuer's job), no attempt counted (the delivery
            # counts it when it begins). The articles' claim: the defaults.
            # The relay's also parks the ordered rows it finds waiting (their
            # number in self.parked); a finalize's promote makes them due.
            mode: dict[str, object] = (
                {
                    "max_in_flight": CAP,
                    "rescue_first": False,
                    "count_attempt": False,
                    "park": True,
                }
                if self.relay
                else {"ordered": self.ordered}
            )
            result = store.claim_batch(
                conn,
                owner=worker,
                batch=batch,
                lease=LEASE,
                max_attempts=MAX_ATTEMPTS,
                now=self.now,
                **mode,  # type: ignore[arg-type]
            )
            self.parked = result.parked
            return result.claimed

        def rescue_now(self) -> None:
            store.rescue(conn, max_attempts=MAX_ATTEMPTS, now=self.now)

        def holding(self) -> list[tuple[str, tuple[int, int]]]:
            return [(w, key) for w in WORKERS for key in sorted(self.held[w])]

        def pick(self, index: int) -> tuple[str, tuple[int, int], Held]:
            entries = self.holding()
            worker, key = entries[index % len(entries)]
            return worker, key, self.held[worker][key]

        def stale_entries(self) -> list[tuple[str, tuple[int, int]]]:
            rows = table()
            return [
                (worker, key)
                for worker in WORKERS
                for key in sorted(self.held[worker])
                if rows[key[0]].lease_version != key[1]
            ]

        # ------------------------------------------------------------ rules
        @initialize(ordered=st.booleans(), relay=st.booleans())
        def choose_claim_mode(self, ordered: bool, relay: bool) -> None:
            self.ordered = ordered
            self.relay = relay

        @rule(
            aggregates=st.lists(st.sampled_from("ABC"), min_size=1, max_size=4),
            delay=st.sampled_from([0, 0, 0, 5, 60]),
        )
        def enqueue(self, aggregates: list[str], delay: int) -> None:
            enqueue_many(
                conn,
                [NewMessage("order", a, "order.event", {"a": a}, delay=delay) for a in aggregates],
                # The relay mode orders by the producer's mark on the row;
                # the articles' mode by the claim's ``ordered`` argument.
                ordered=self.ordered and self.relay,
                now=self.now,
            )
            self.enqueued += len(aggregates)

        @rule(
            worker=st.sampled_from(WORKERS),
            batch=st.integers(1, 4),
            elapsed=st.integers(0, LEASE_SECONDS + 1),
        )
        def claim_batch(self, worker: str, batch: int, elapsed: int = 0) -> None:
            # Workers claim at their own pace: some seconds after the last step.
            self.now += timedelta(seconds=elapsed)
            valid = {
                key[0]
                for entries in self.held.values()
                for key, held in entries.items()
                if held.lease_until >= self.now
            }
            before = table()
            got = self.claim(worker, batch)
            assert len(got) <= batch
            assert [m.id for m in got] == sorted(m.id for m in got)
            for m in got:
                # Never a row someone still holds an unexpired lease on.
                assert m.id not in valid, f"claimed {m.id} while its lease was valid"
                assert m.lease_version == before[m.id].lease_version + 1
                assert m.lease_until == self.now + LEASE
                self.held[worker][(m.id, m.lease_version)] = Held(m, self.now + LEASE)

        @precondition(lambda self: bool(self.holding()))
        @rule(worker=st.sampled_from(WORKERS), batch=st.integers(1, 4))
        def take_over_after_expiry(self, worker: str, batch: int) -> None:
            # The common road to a stale worker: leases run out (the holder
            # stalled), and another worker claims the rows.
            self.now += LEASE + timedelta(seconds=1)
            if self.relay:
                self.rescue_now()
            self.claim_batch(worker, batch)

        @rule()
        def rescuer(self) -> None:
            # The rescuer as its own actor, at any moment: it frees expired
            # leases only, whatever the in-flight room.
            before = table()
            result = store.rescue(conn, max_attempts=MAX_ATTEMPTS, now=self.now)
            after = table()
            expired = {
                i
                for i, r in before.items()
                if r.status == "processing"
                and r.lease_until is not None
                and r.lease_until < self.now
            }
            assert set(result.released) | set(result.dead) == expired
            for i, r in after.items():
                if i not in expired:
                    assert r == before[i], "the rescuer touched a live or finished row"
                    continue
                assert (r.lease_until, r.lease_owner) == (None, None)
                assert r.lease_version == before[i].lease_version
                if before[i].attempts >= MAX_ATTEMPTS:
                    assert i in result.dead and r.status == "dead" and r.last_error
                else:
                    assert i in result.released and r.status == "pending"
                    assert r.available_at <= self.now

        @precondition(lambda self: bool(self.holding()))
        @rule(index=st.integers(0, 50), kind=st.sampled_from(OUTCOMES))
        def publish_and_finalize(self, index: int, kind: str) -> None:
            worker, key, held = self.pick(index)
            del self.held[worker][key]
            if self.relay and not held.begun:
                self.begin(held)
            if self.relay and not held.started:
                # The delivery did not start (its lease had run out): the
                # deliverer gives the row back unpublished.
                kind = "release"
            before = table()
            current = before[key[0]]
            mine = current.lease_version == key[1] and current.status == "processing"
            if kind == "release":
                outcome = Outcome.release(held.claimed, reason="too little lease left")
            else:
                outcome = classify(failure(kind), held.claimed, POLICY)
            changed = store.finalize(conn, [outcome], now=self.now)
            after = table()
            if not mine:
                assert changed == set()
                assert after == before, "a stale finalize changed the table"
                return
            assert changed == {key[0]}
            row = after[key[0]]
            assert (row.lease_until, row.lease_owner) == (None, None)
            assert row.lease_version == current.lease_version
            # Nothing else changes, but for one: a done ordered row makes the
            # next row of its aggregate due if a claim had parked it (promote).
            others = [i for i in after if i != key[0] and after[i] != before[i]]
            assert len(others) <= 1, others
            for i in others:
                was, now = before[i], after[i]
                assert kind == "done" and self.relay and self.ordered, (was, now)
                assert (now.aggregate_type, now.aggregate_id) == (
                    row.aggregate_type,
                    row.aggregate_id,
                )
                assert was.available_at > self.now + PARKED and now.available_at <= self.now
                assert replace(now, available_at=was.available_at) == was
            if kind == "release":
                assert (row.status, row.available_at) == ("pending", self.now)
                assert row.attempts == current.attempts
            elif kind == "done":
                assert (row.status, row.done_at) == ("done", self.now)
            elif kind == "permanent" or (kind == "retryable" and current.attempts >= MAX_ATTEMPTS):
                assert row.status == "dead" and row.last_error
                assert row.attempts == current.attempts
            elif kind == "retryable":
                ceiling = timedelta(seconds=min(20.0, 2.0**current.attempts))
                assert row.status == "pending"
                assert self.now <= row.available_at <= self.now + ceiling
                assert row.attempts == current.attempts
            else:
                assert row.status == "pending"
                assert row.available_at == self.now + DEFER
                assert row.attempts == current.attempts - 1

        @precondition(lambda self: self.relay and bool(self.holding()))
        @rule(index=st.integers(0, 50))
        def done_then_follow(self, index: int) -> None:
            """A delivery task's done and its lease of the next message of that
            row's aggregate, in one transaction (store.finalize_and_take, the
            Celery task's follow): the take leases a parked row as it is, and
            a promote runs only for an aggregate it did not follow."""
            worker, key, held = self.pick(index)
            if not held.begun:
                self.begin(held)
            if not held.started:
                self.publish_and_finalize(index, "done")  # given back unpublished
                return
            del self.held[worker][key]
            before = table()
            current = before[key[0]]
            mine = current.lease_version == key[1] and current.status == "processing"
            changed, taken = store.finalize_and_take(
                conn,
                [Outcome.done(held.claimed)],
                owner=worker,
                lease=LEASE,
                max_attempts=MAX_ATTEMPTS,
                max_in_flight=CAP,
                now=self.now,
            )
            after = table()
            if not mine:
                assert (changed, taken) == (set(), [])
                assert after == before, "a stale finish changed the table"
                return
            done = after[key[0]]
            assert changed == {key[0]} and (done.status, done.done_at) == ("done", self.now)
            assert len(taken) <= 1
            if not self.ordered:
                assert taken == []
            for began in taken:
                m = began.claimed
                was = before[m.id]
                assert (was.aggregate_type, was.aggregate_id) == (
                    done.aggregate_type,
                    done.aggregate_id,
                )
                # Due, or parked behind the row just done.
                assert was.status == "pending", was
                assert was.available_at <= self.now or was.available_at > self.now + PARKED
                assert m.lease_version == was.lease_version + 1
                # Its aggregate's first unfinished row: nothing before it waits.
                assert not any(
                    r.id < m.id
                    and (r.aggregate_type, r.aggregate_id) == (was.aggregate_type, was.aggregate_id)
                    and r.status in ("pending", "processing", "dead")
                    for r in after.values()
                ), m
                # Begun as well: the attempt counted (the task publishes it at once).
                assert began.started and m.attempts == was.attempts + 1
                self.held[worker][(m.id, m.lease_version)] = Held(
                    m, self.now + LEASE, begun=True, started=True
                )

        @precondition(lambda self: self.relay)
        @rule(worker=st.sampled_from(WORKERS), batch=st.integers(1, 4))
        def take_chunk(self, worker: str, batch: int) -> None:
            """A delivery task's own claim and begin of its next chunk
            (store.take_chunk, with a publisher that waits): due plain rows
            only, in the claim's order, never one with a live lease, never
            past the cap; each leased and begun (the attempt counted)."""
            before = table()
            live = sum(
                1
                for r in before.values()
                if r.status == "processing" and r.lease_until and r.lease_until >= self.now
            )
            taken = store.take_chunk(
                conn,
                batch=batch,
                owner=worker,
                lease=LEASE,
                max_attempts=MAX_ATTEMPTS,
                max_in_flight=CAP,
                budget=1 << 20,
                now=self.now,
            )
            assert len(taken) <= min(batch, max(0, CAP - live))
            ids = [b.claimed.id for b in taken]
            assert ids == sorted(ids)
            for began in taken:
                m = began.claimed
                was = before[m.id]
                assert was.status == "pending" and was.available_at <= self.now, was
                assert not m.ordered, "an ordered row is the claim's, never taken"
                assert m.lease_version == was.lease_version + 1
                assert began.started and m.attempts == was.attempts + 1
                self.held[worker][(m.id, m.lease_version)] = Held(
                    m, self.now + LEASE, begun=True, started=True
                )

        def begin(self, held: Held) -> None:
            """The delivery task begins: fence check, attempt counted."""
            before = table()
            ref = held.claimed.ref
            row = before[ref.id]
            mine = row.lease_version == ref.lease_version and row.status == "processing"
            began = store.begin(conn, [ref], needed=timedelta(0), now=self.now)
            after = table()
            held.begun = True
            if not mine:
                assert began == {} and after == before, "a stale begin changed the table"
                return
            assert row.lease_until is not None
            if row.lease_until < self.now:
                # Expired (not yet rescued): returned unstarted, nothing counted.
                assert not began[ref.id].started and after == before
                return
            assert began[ref.id].started
            held.started = True
            assert began[ref.id].claimed.attempts == row.attempts + 1
            assert after[ref.id].attempts == row.attempts + 1
            held.claimed = began[ref.id].claimed

        @precondition(lambda self: self.relay and bool(self.holding()))
        @rule(index=st.integers(0, 50))
        def begin_delivery(self, index: int) -> None:
            _, _, held = self.pick(index)
            if not held.begun:
                self.begin(held)

        @precondition(lambda self: bool(self.stale_entries()))
        @rule(index=st.integers(0, 50), kind=st.sampled_from((*OUTCOMES, "renew")))
        def stale_write(self, index: int, kind: str) -> None:
            entries = self.stale_entries()
            worker, key = entries[index % len(entries)]
            held = self.held[worker].pop(key)
            before = table()
            if kind == "renew":
                assert store.extend_lease(conn, held.claimed, lease=LEASE, now=self.now) is False
            else:
                outcome = classify(failure(kind), held.claimed, POLICY)
                assert store.finalize(conn, [outcome], now=self.now) == set()
            assert table() == before, "a stale write changed the table"

        @precondition(lambda self: bool(self.holding()))
        @rule(index=st.integers(0, 50))
        def renew(self, index: int) -> None:
            worker, key, held = self.pick(index)
            before = table()
            current = before[key[0]]
            mine = current.lease_version == key[1] and current.status == "processing"
            # Only a live lease is renewed; an expired one is the rescuer's.
            mine = mine and current.lease_until is not None and current.lease_until >= self.now
            kept = store.extend_lease(conn, held.claimed, lease=LEASE, now=self.now)
            after = table()
            assert kept is mine
            if mine:
                held.lease_until = self.now + LEASE
                assert after[key[0]].lease_until == self.now + LEASE
            else:
                del self.held[worker][key]
                assert after == before, "a stale renewal changed the table"

        @precondition(lambda self: bool(self.holding()))
        @rule(worker=st.sampled_from(WORKERS))
        def crash(self, worker: str) -> None:
            # The worker dies: it forgets its leases; its rows stay processing.
            self.held[worker].clear()

        @rule(
            seconds=st.one_of(
                st.sampled_from([1, LEASE_SECONDS - 1, LEASE_SECONDS, LEASE_SECONDS + 1]),
                st.integers(1, 4 * LEASE_SECONDS),
            )
        )
        def advance_time(self, seconds: int) -> None:
            self.now += timedelta(seconds=seconds)

        # ------------------------------------------------------------ invariants
        @invariant()
        def database_agrees_with_the_workers(self) -> None:
            rows = table()
            assert sorted(rows) == list(range(1, self.enqueued + 1))
            unexpired: dict[int, list[str]] = {}
            current: dict[int, list[str]] = {}
            for worker, entries in self.held.items():
                for (message_id, version), held in entries.items():
                    row = rows[message_id]
                    if held.lease_until >= self.now:
                        unexpired.setdefault(message_id, []).append(worker)
                        # A lease the worker may rely on is the row's lease.
                        assert row.status == "processing"
                        assert row.lease_version == version
                        assert row.lease_until == held.lease_until
                        assert row.lease_owner == worker
                    if row.status == "processing" and row.lease_version == version:
                        current.setdefault(message_id, []).append(worker)
            assert all(len(ws) == 1 for ws in unexpired.values()), unexpired
            assert all(len(ws) == 1 for ws in current.values()), current

        @invariant()
        def rows_are_well_formed(self) -> None:
            for row in table().values():
                assert 0 <= row.attempts <= MAX_ATTEMPTS, row
                assert row.lease_version >= row.attempts, row
                assert (row.status == "processing") == (row.lease_until is not None), row
                assert (row.status == "processing") == (row.lease_owner is not None), row
                assert (row.status == "done") == (row.done_at is not None), row
                if row.status == "dead":
                    assert row.last_error, row

        @invariant()
        def a_parked_row_waits_behind_an_unfinished_one(self) -> None:
            # Parked (far past any due time): set aside by a claim because an
            # earlier row of its aggregate was unfinished. It must still be,
            # or nothing makes the row due again (promote keeps this true).
            rows = sorted(table().values(), key=lambda r: r.id)
            for row in rows:
                if row.available_at < self.now + PARKED:
                    continue
                assert self.relay and self.ordered and row.status == "pending", row
                assert any(
                    r.id < row.id
                    and (r.aggregate_type, r.aggregate_id) == (row.aggregate_type, row.aggregate_id)
                    and r.status in ("pending", "processing", "dead")
                    for r in rows
                ), f"row {row.id} is parked behind no unfinished row"

        @invariant()
        def live_leases_stay_under_the_cap(self) -> None:
            if not self.relay:
                return
            live = [
                r
                for r in table().values()
                if r.status == "processing"
                and r.lease_until is not None
                and r.lease_until >= self.now
            ]
            assert len(live) <= CAP, live

        @invariant()
        def ordered_aggregates_were_claimed_in_order(self) -> None:
            if not self.ordered:
                return
            by_aggregate: dict[tuple[str, str], list[Row]] = {}
            for row in table().values():
                by_aggregate.setdefault((row.aggregate_type, row.aggregate_id), []).append(row)
            for rows in by_aggregate.values():
                unfinished = [r for r in rows if r.status != "done"]
                if not unfinished:
                    continue
                head = unfinished[0]
                for later in rows:
                    if later.id > head.id:
                        assert (later.status, later.lease_version) == ("pending", 0), (
                            head,
                            later,
                        )

        # ------------------------------------------------------------ teardown
        def teardown(self) -> None:
            # Failures stop: every publish succeeds from now on, and time jumps
            # past every lease, backoff and defer.
            self.now += timedelta(days=1)
            self.rescue_now()
            for _ in range(self.enqueued + 2):
                claimed = self.claim("drain", 50)
                if not claimed and not self.parked:
                    break
                done = store.finalize(conn, [Outcome.done(m) for m in claimed], now=self.now)
                assert done == {m.id for m in claimed}
            assert self.claim("drain", 50) == []
            rows = table()
            dead_heads = {
                (r.aggregate_type, r.aggregate_id): r.id
                for r in sorted(rows.values(), key=lambda r: -r.id)
                if r.status == "dead"
            }
            for row in rows.values():
                if row.status in ("done", "dead"):
                    continue
                # Only an ordered aggregate stopped behind its dead head waits.
                assert self.ordered, row
                assert row.status == "pending", row
                head = dead_heads.get((row.aggregate_type, row.aggregate_id))
                assert head is not None and head < row.id, row

    try:
        run_state_machine_as_test(
            OutboxMachine,
            settings=settings(
                max_examples=60,
                stateful_step_count=50,
                deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture],
            ),
        )
    finally:
        conn.close()
