"""A delivery task that waits on a slow publisher takes the next chunk itself.

``store.take_chunk`` leases and begins due plain rows in one statement (a
claim and a begin); ``Deliverer.deliver`` with a ``Follow`` publishes such a
chunk while the one before it is still publishing (``_pipeline``), so a pool
process keeps two chunks in flight instead of idling through the wait. The
Celery side is exercised in tests/test_celery_relay.py.
"""

from __future__ import annotations

import signal
import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from celery.exceptions import SoftTimeLimitExceeded

from outbox_relay import Message, NewMessage, enqueue_many, store
from outbox_relay.db import DirectDatabase
from outbox_relay.model import Outcome
from outbox_relay.services import Deliverer
from outbox_relay.services.deliverer import BUSY_SHARE
from outbox_relay.store.relay import Began

LEASE = timedelta(seconds=30)
BUDGET = 1 << 20


def _seed(conn: psycopg.Connection[Any], n: int, **payload: Any) -> list[int]:
    return enqueue_many(
        conn, [NewMessage("order", str(i), "order.paid", {"n": i, **payload}) for i in range(n)]
    )


def _take(
    conn: psycopg.Connection[Any], batch: int, cap: int | None = 1000, budget: int = BUDGET
) -> list[int]:
    taken = store.take_chunk(
        conn,
        batch=batch,
        owner="w",
        lease=LEASE,
        max_attempts=3,
        max_in_flight=cap,
        budget=budget,
    )
    assert all(b.started and b.lease_left_seconds > 29 for b in taken)
    return [b.claimed.id for b in taken]


def _state(conn: psycopg.Connection[Any]) -> dict[int, tuple[Any, ...]]:
    rows = conn.execute(
        "SELECT id, status, attempts, began_version = lease_version, last_error FROM outbox"
    ).fetchall()
    return {r[0]: tuple(r[1:]) for r in rows}


# ---------------------------------------------------------------- take_chunk
def test_a_take_leases_and_begins_only_the_plain_due_rows(conn: psycopg.Connection[Any]) -> None:
    """What the claim handles itself is left to it: an ordered row, a durable
    task's row, a row whose last delivery was interrupted, one not due, one a
    claim in progress holds. A row out of attempts goes dead, as a claim
    would send it. The rows taken are leased and begun (attempt counted)."""
    ids = _seed(conn, 9)
    plain = [ids[0], ids[6]]
    ordered, durable, interrupted, later, locked, spent = ids[1:6] + ids[7:8]
    conn.execute("UPDATE outbox SET ordered = true WHERE id = %s", (ordered,))
    conn.execute("UPDATE outbox SET event_type = 'celery.durable' WHERE id = %s", (durable,))
    conn.execute("UPDATE outbox SET began_version = lease_version WHERE id = %s", (interrupted,))
    conn.execute(
        "UPDATE outbox SET available_at = now() + interval '1 hour' WHERE id = %s", (later,)
    )
    conn.execute("UPDATE outbox SET attempts = 3 WHERE id = %s", (spent,))
    with psycopg.connect(conn.info.dsn) as other, other.transaction():
        other.execute("SELECT 1 FROM outbox WHERE id = %s FOR UPDATE", (locked,))
        assert _take(conn, 50) == [*plain, ids[8]]
    state = _state(conn)
    for message_id in [*plain, ids[8]]:
        assert state[message_id][:3] == ("processing", 1, True)
    assert state[spent][0] == "dead" and "retries exhausted" in state[spent][3]
    for message_id in (ordered, durable, interrupted, later, locked):
        assert state[message_id][:2] == ("pending", 0)
    # Unlocked now: the row the claim in progress held is taken next.
    assert _take(conn, 50) == [locked]


def test_a_take_stays_within_the_batch_the_cap_and_the_payload_budget(
    conn: psycopg.Connection[Any],
) -> None:
    ids = _seed(conn, 12, pad="x" * 3000)
    # A claim holds two live leases: a cap of 5 leaves room for 3.
    store.claim(conn, owner="c", batch=2, lease=LEASE)
    assert _take(conn, 50, cap=5) == ids[2:5]
    assert _take(conn, 50, cap=5) == []
    # In the claim's order; at most the batch.
    assert _take(conn, 2, cap=None) == ids[5:7]
    # A budget smaller than one row's payload still takes one row (no row
    # is ever too big to be taken); one of a row's size and a byte, two.
    assert _take(conn, 50, cap=None, budget=1) == [ids[7]]
    size = conn.execute("SELECT pg_column_size(payload) FROM outbox WHERE id = %s", (ids[8],))
    row = size.fetchone()
    assert row is not None
    assert _take(conn, 50, cap=None, budget=int(row[0]) + 1) == ids[8:10]


def test_a_take_walks_past_a_backlog_it_leaves_to_the_claim_only_so_far(
    conn: psycopg.Connection[Any],
) -> None:
    """The walk is bounded (four batches deep): behind a long run of ordered
    rows it takes nothing rather than read the whole backlog."""
    ordered = enqueue_many(
        conn, [NewMessage("ledger", "1", "posted", {"n": i}) for i in range(40)], ordered=True
    )
    plain = _seed(conn, 3)
    assert _take(conn, 5) == []
    assert _take(conn, 11) == plain
    assert store.in_flight(conn) == 3 and len(ordered) == 40


# ------------------------------------------------------------------ pipeline
class _Takes:
    """A Follow that takes chunks with store.take_chunk (the Celery relay's
    _Follow does, through its claimer), ``chunks`` times at most."""

    def __init__(self, conn: psycopg.Connection[Any], size: int, chunks: int) -> None:
        self.conn = conn
        self.size = size
        self.left = chunks
        self.limits: list[int] = []

    def wants(self, rows: int) -> bool:
        return self.left > 0

    def finish(
        self, conn: psycopg.Connection[Any], writes: list[Outcome]
    ) -> tuple[set[int], list[Began]]:
        return store.finalize(conn, writes), []

    def take(self, limit: int) -> list[Began]:
        self.left -= 1
        self.limits.append(limit)
        return store.take_chunk(
            self.conn,
            batch=min(self.size, limit),
            owner="w",
            lease=LEASE,
            max_attempts=3,
            max_in_flight=1000,
            budget=BUDGET,
        )


class _Recorder:
    """A publisher that waits ``seconds`` and records when each publish ran."""

    def __init__(self, seconds: float, hang_from: int | None = None) -> None:
        self.seconds = seconds
        self.hang_from = hang_from
        self.release = threading.Event()
        self.spans: dict[int, tuple[float, float]] = {}
        self.calls: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, message: Message) -> None:
        start = time.monotonic()
        with self.lock:
            self.calls.append(int(message.id))
        if self.hang_from is not None and message.payload["n"] >= self.hang_from:
            self.release.wait(10)  # still publishing when the soft time limit fires
        time.sleep(self.seconds)
        with self.lock:
            self.spans[int(message.id)] = (start, time.monotonic())


def _deliverer(conn: psycopg.Connection[Any], publish: Any, concurrency: int) -> Deliverer:
    deliverer = Deliverer(
        publish,
        db=DirectDatabase(conn),
        count_attempt=True,
        tracer=None,
        concurrency=concurrency,
        publish_timeout=2,
    )
    # The machine's idle CPU is not these tests' business (a test run keeps
    # both CPUs busy): no /proc/stat, no opinion. Its own test sets one.
    deliverer._cpu_idle.PATH = "/nonexistent/stat"
    return deliverer


def test_a_slow_publisher_keeps_two_chunks_in_flight(conn: psycopg.Connection[Any]) -> None:
    """Once the publisher is known to wait (the first chunk tells), a
    delivery takes the next chunk while its own publishes, and so on: every
    row published once and done, two chunks publishing at once."""
    ids = _seed(conn, 20)
    publish = _Recorder(0.05)
    deliverer = _deliverer(conn, publish, concurrency=8)
    try:
        first = store.claim(conn, owner="w", batch=4, lease=LEASE, count_attempt=False)
        report = deliverer.deliver([m.ref for m in first], _Takes(conn, 4, chunks=10))
        # The publisher's pace is not known yet: this chunk went alone.
        assert (report.done, report.took) == (4, 0)
        assert deliverer.publish_seconds is not None and deliverer.publish_seconds >= 0.05
        second = store.claim(conn, owner="w", batch=4, lease=LEASE, count_attempt=False)
        report = deliverer.deliver([m.ref for m in second], _Takes(conn, 4, chunks=10))
    finally:
        deliverer.close()
    assert deliverer.busy_share is not None and deliverer.busy_share < 0.5
    assert (report.done, report.took) == (16, 12)
    assert sorted(publish.calls) == ids  # each once
    state = _state(conn)
    assert {i: state[i][:2] for i in ids} == {i: ("done", 1) for i in ids}
    # Two chunks in flight: at some moment more publishes were under way
    # than one chunk holds.
    assert _most_at_once(publish.spans.values()) > 4


def test_two_chunks_in_flight_stay_within_the_publish_concurrency(
    conn: psycopg.Connection[Any],
) -> None:
    """OUTBOX_PUBLISH_CONCURRENCY bounds a task's publishes at once with two
    chunks as with one: a chunk takes a second only when one as large fits
    beside it, and at most what it leaves."""
    ids = _seed(conn, 17)
    publish = _Recorder(0.05)
    deliverer = _deliverer(conn, publish, concurrency=6)
    takes = _Takes(conn, 4, chunks=10)
    try:
        first = store.claim(conn, owner="w", batch=2, lease=LEASE, count_attempt=False)
        assert deliverer.deliver([m.ref for m in first]).done == 2
        # 4 + 4 > 6: alone.
        second = store.claim(conn, owner="w", batch=4, lease=LEASE, count_attempt=False)
        assert (deliverer.deliver([m.ref for m in second], takes).took, takes.limits) == (0, [])
        # 3 + 3 = 6: two chunks of 3 at a time.
        third = store.claim(conn, owner="w", batch=3, lease=LEASE, count_attempt=False)
        report = deliverer.deliver([m.ref for m in third], takes)
    finally:
        deliverer.close()
    assert report.done == 11 and sorted(publish.calls) == ids
    # 6 - 3 beside each chunk of 3.
    assert takes.limits[:3] == [3, 3, 3]
    assert 3 < _most_at_once(publish.spans.values()) <= 6


def _most_at_once(spans: Any) -> int:
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


def test_a_fast_publisher_takes_nothing(conn: psycopg.Connection[Any]) -> None:
    """A publisher that does not wait keeps the pool busy by itself: the
    delivery finishes its own chunk and leaves the rest to the claims."""
    _seed(conn, 12)
    deliverer = _deliverer(conn, lambda message: None, concurrency=8)
    takes = _Takes(conn, 4, chunks=10)
    try:
        for _ in range(2):
            claimed = store.claim(conn, owner="w", batch=4, lease=LEASE, count_attempt=False)
            report = deliverer.deliver([m.ref for m in claimed], takes)
            assert (report.done, report.took) == (4, 0)
    finally:
        deliverer.close()
    assert takes.left == 10
    assert store.in_flight(conn) == 0


def _compute(message: Message) -> None:
    until = time.thread_time() + 0.01
    while time.thread_time() < until:  # 10 ms of CPU, holding the GIL
        pass


def test_the_busy_share_tells_a_computing_publisher_from_a_waiting_one(
    conn: psycopg.Connection[Any],
) -> None:
    """The share of a chunk's wave its publishes kept the interpreter busy:
    high for a publisher that computes (an HTTP client's parsing and TLS),
    near nothing for one that waits. (Compared, not pinned: on a loaded
    machine the computing threads get less of a CPU and their share drops.)"""
    _seed(conn, 8)
    shares = []
    for publish in (_compute, _Recorder(0.02)):
        deliverer = _deliverer(conn, publish, concurrency=8)
        try:
            claimed = store.claim(conn, owner="w", batch=4, lease=LEASE, count_attempt=False)
            assert deliverer.deliver([m.ref for m in claimed]).done == 4
        finally:
            deliverer.close()
        assert deliverer.publish_seconds is not None and deliverer.publish_seconds >= 0.01
        shares.append(deliverer.busy_share)
    computing, waiting = shares
    assert computing is not None and waiting is not None
    assert waiting < 0.2 and computing > 3 * waiting, shares


def test_a_publisher_that_keeps_the_interpreter_busy_takes_nothing(
    conn: psycopg.Connection[Any],
) -> None:
    """At a busy share of BUSY_SHARE or more a second chunk would only queue
    behind the first for the GIL: the delivery keeps to its own chunk. (The
    share the first chunk measured is set here: measured, it depends on how
    busy the machine running the test is, see the test above.)"""
    _seed(conn, 8)
    deliverer = _deliverer(conn, _compute, concurrency=8)
    takes = _Takes(conn, 4, chunks=10)
    try:
        claimed = store.claim(conn, owner="w", batch=4, lease=LEASE, count_attempt=False)
        assert deliverer.deliver([m.ref for m in claimed], takes).took == 0
        deliverer._busy_share = BUSY_SHARE
        claimed = store.claim(conn, owner="w", batch=4, lease=LEASE, count_attempt=False)
        assert deliverer.deliver([m.ref for m in claimed], takes).took == 0
    finally:
        deliverer.close()
    assert takes.left == 10


def test_busy_cpus_keep_a_delivery_to_its_own_chunk(
    conn: psycopg.Connection[Any], tmp_path: Any
) -> None:
    """A second chunk in flight only pays while the machine's CPUs have time
    to spare: where they were all taken since the delivery before (read from
    /proc/stat), a delivery keeps to its own chunk; once they idle again, it
    takes the next one."""
    _seed(conn, 16)
    stat = tmp_path / "stat"
    deliverer = _deliverer(conn, _Recorder(0.03), concurrency=8)
    probe = deliverer._cpu_idle
    probe.PATH = str(stat)
    probe.LOOK_SECONDS = 0.0
    ticks = {"busy": 0, "idle": 0}

    def advance(busy: int, idle: int) -> None:
        ticks["busy"] += busy
        ticks["idle"] += idle
        # cpu user nice system idle iowait irq softirq steal guest guest_nice
        stat.write_text(f"cpu  {ticks['busy']} 0 0 {ticks['idle']} 0 0 0 0 0 0\ncpu0 ...\n")

    takes = _Takes(conn, 4, chunks=10)
    try:
        advance(0, 0)
        claimed = store.claim(conn, owner="w", batch=4, lease=LEASE, count_attempt=False)
        assert deliverer.deliver([m.ref for m in claimed], takes).took == 0  # the pace learned
        assert probe.share() is None  # the first look: the counters to compare with
        advance(95, 5)  # 5% idle
        claimed = store.claim(conn, owner="w", batch=4, lease=LEASE, count_attempt=False)
        assert deliverer.deliver([m.ref for m in claimed], takes).took == 0
        advance(50, 50)
        claimed = store.claim(conn, owner="w", batch=4, lease=LEASE, count_attempt=False)
        assert deliverer.deliver([m.ref for m in claimed], takes).took > 0
    finally:
        deliverer.close()


def test_the_idle_cpu_share_is_read_from_proc_stat_where_there_is_one(tmp_path: Any) -> None:
    from outbox_relay.services.deliverer import _CpuIdle

    probe = _CpuIdle()
    probe.LOOK_SECONDS = 0.0
    probe.PATH = str(tmp_path / "absent")
    assert probe.share() is None  # not Linux: no opinion, nothing refused
    probe.PATH = str(tmp_path / "stat")
    (tmp_path / "stat").write_text("cpu  100 0 50 800 50 0 0 0 0 0\n")
    assert probe.share() is None  # a first look has nothing to compare with
    (tmp_path / "stat").write_text("cpu  160 0 70 900 70 0 0 0 0 0\n")
    # 120 idle (idle + iowait) of 200 ticks.
    assert probe.share() == pytest.approx(0.6)


def test_a_soft_time_limit_mid_pipeline_finalizes_both_chunks(
    conn: psycopg.Connection[Any],
) -> None:
    """Interrupted while two chunks publish: the first chunk's rows, which
    were published, are done; the taken chunk's rows, still publishing,
    keep their leases (the rescuer frees them, attempt counted: given back
    now, each would be published again beside its first publish). Nothing
    starts afterwards."""
    ids = _seed(conn, 8)
    publish = _Recorder(0.02, hang_from=4)
    deliverer = _deliverer(conn, publish, concurrency=6)
    # The pace learned from a first chunk of two (rows 0 and 1).
    claimed = store.claim(conn, owner="w", batch=2, lease=LEASE, count_attempt=False)
    assert deliverer.deliver([m.ref for m in claimed]).done == 2
    # Chunk A: rows 2 and 3 (published); chunk B, taken beside it (6 - 2 =
    # 4 rows): rows 4 to 7, whose publishes hang.
    claimed = store.claim(conn, owner="w", batch=2, lease=LEASE, count_attempt=False)

    def soft_limit(signum: int, frame: Any) -> None:
        raise SoftTimeLimitExceeded()

    takes = _Takes(conn, 4, chunks=1)
    previous = signal.signal(signal.SIGALRM, soft_limit)
    signal.setitimer(signal.ITIMER_REAL, 0.8)
    try:
        with pytest.raises(SoftTimeLimitExceeded):
            deliverer.deliver([m.ref for m in claimed], takes)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        publish.release.set()
        time.sleep(0.1)
        deliverer.close()
    assert takes.limits == [4]
    state = _state(conn)
    assert [state[i][:2] for i in ids[:4]] == [("done", 1)] * 4
    assert [state[i][:2] for i in ids[4:]] == [("processing", 1)] * 4
    time.sleep(0.2)
    assert sorted(publish.calls) == ids


def test_a_take_the_database_refuses_leaves_the_chunk_under_way_to_finish(
    conn: psycopg.Connection[Any],
) -> None:
    """The next chunk is optional: a take that fails (the database away for
    a moment) stops the taking, and the chunk already publishing is
    finalized as it would have been."""
    ids = _seed(conn, 6)
    publish = _Recorder(0.02)
    deliverer = _deliverer(conn, publish, concurrency=8)

    class Refused(_Takes):
        def take(self, limit: int) -> list[Began]:
            self.left -= 1
            raise psycopg.OperationalError("server closed the connection unexpectedly")

    refused = Refused(conn, 2, chunks=5)
    try:
        claimed = store.claim(conn, owner="w", batch=2, lease=LEASE, count_attempt=False)
        assert deliverer.deliver([m.ref for m in claimed]).done == 2
        claimed = store.claim(conn, owner="w", batch=4, lease=LEASE, count_attempt=False)
        report = deliverer.deliver([m.ref for m in claimed], refused)
    finally:
        deliverer.close()
    assert (report.done, report.took, refused.left) == (4, 0, 4)
    state = _state(conn)
    assert [state[i][:2] for i in ids] == [("done", 1)] * 6
