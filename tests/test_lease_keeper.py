"""Leases measured by the database and bounded.

The keeper renews from the lease the database reported, stops after the
delivery's worst case (a hung publisher lets its row go), notices a lost
lease, and a chunk never publishes past its lease.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import psycopg

import outbox_relay
from outbox_relay import Deliverer, DirectDatabase, LeaseKeeper, Message, NewMessage, OutboxTable


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lease_left(conn: psycopg.Connection[Any], message_id: int) -> float:
    row = conn.execute(
        "SELECT extract(epoch FROM lease_until - now())::float8 FROM outbox WHERE id = %s",
        (message_id,),
    ).fetchone()
    assert row is not None
    return float(row[0])


def test_keeper_renews_from_the_database_lease_and_stops_after_the_worst_case(
    conn: psycopg.Connection[Any],
) -> None:
    lease = timedelta(seconds=30)
    outbox_relay.enqueue_many(conn, [NewMessage("o", "1", "e", {"n": 1})])
    [claimed] = outbox_relay.claim(conn, owner="a", batch=1, lease=lease)
    clock = FakeClock()
    keeper = LeaseKeeper(
        DirectDatabase(conn), lease, table=OutboxTable(), clock=clock, background=False
    )
    # The database said 20 s are left: more than half, nothing to do yet.
    hold = keeper.hold([(claimed.ref, 20.0)], max_hold=12.0)
    assert keeper.renew_due() == 0
    # 6 s later only 14 s are left by the database's word: renew.
    clock.now += 6.0
    assert keeper.renew_due() == 1
    assert keeper.renewed == 1
    assert _lease_left(conn, claimed.id) > 25.0  # now() + the full lease
    assert hold.alive(claimed.ref, 25.0)  # the keeper took the database's answer
    # Past the worst case (12 s after hold) it never renews again, even when due.
    clock.now += 20.0
    assert not hold.alive(claimed.ref, 15.0)
    assert keeper.renew_due() == 0
    assert keeper.renewed == 1
    hold.release()


def test_keeper_notices_a_lost_lease_and_leaves_the_new_holder_alone(
    conn: psycopg.Connection[Any],
) -> None:
    lease = timedelta(seconds=30)
    outbox_relay.enqueue_many(conn, [NewMessage("o", "1", "e", {"n": 1})])
    [claimed] = outbox_relay.claim(conn, owner="a", batch=1, lease=lease)
    keeper = LeaseKeeper(DirectDatabase(conn), lease, table=OutboxTable(), background=False)
    hold = keeper.hold([(claimed.ref, 1.0)], max_hold=10.0)  # under half: due now
    # Another relay takes the row over (its lease expired, the rescuer freed it).
    conn.execute("UPDATE outbox SET lease_until = now() - interval '1 second'")
    [taken] = outbox_relay.claim(conn, owner="b", batch=1, lease=timedelta(seconds=30))
    assert keeper.renew_due() == 1
    assert hold.lost == {claimed.ref}
    assert not hold.alive(claimed.ref, 0.0)
    row = conn.execute("SELECT lease_until, lease_owner FROM outbox").fetchone()
    assert row == (taken.lease_until, "b")
    hold.release()


def test_a_hung_publisher_lets_its_row_go_within_lease_plus_worst_case(dsn: str) -> None:
    lease = timedelta(seconds=1.5)
    with (
        psycopg.connect(dsn, autocommit=True) as conn,
        psycopg.connect(dsn, autocommit=True) as keeper_conn,
    ):
        [message_id] = outbox_relay.enqueue_many(conn, [NewMessage("o", "1", "e", {"n": 1})])
        [claimed] = outbox_relay.claim(conn, owner="hung", batch=1, lease=lease)
        keeper = LeaseKeeper(DirectDatabase(keeper_conn), lease, table=OutboxTable())
        release = threading.Event()

        def hang(message: Message) -> None:
            release.wait(20)  # ignores its own 0.5 s timeout, as a plain callable may

        deliverer = Deliverer(
            hang, db=DirectDatabase(conn), publish_timeout=0.5, keeper=keeper, concurrency=1
        )
        report: list[Any] = []
        worker = threading.Thread(target=lambda: report.append(deliverer.deliver([claimed.ref])))
        started = time.monotonic()
        worker.start()
        taken: list[Any] = []
        with psycopg.connect(dsn, autocommit=True) as rival:
            while not taken and time.monotonic() - started < 10:
                # Rescue then claim, as the relay's tasks do.
                taken = outbox_relay.claim(rival, owner="rival", batch=1, lease=lease * 10)
                time.sleep(0.05)
            waited = time.monotonic() - started
            release.set()
            worker.join(10)
            assert [m.id for m in taken] == [message_id]
            # lease (1.5 s) + worst case (0.5 s) + polling slack
            assert waited < 1.5 + 0.5 + 1.0, waited
            assert report and report[0].lost == 1  # the hung worker's finalize was fenced off
            row = rival.execute(
                "SELECT status, lease_owner, attempts FROM outbox WHERE id = %s", (message_id,)
            ).fetchone()
            assert row == ("processing", "rival", 2)


def test_a_chunk_with_more_waves_than_fit_is_not_published(conn: psycopg.Connection[Any]) -> None:
    ids = outbox_relay.enqueue_many(
        conn, [NewMessage("o", str(n), "e", {"n": n}) for n in range(4)]
    )
    claimed = outbox_relay.claim(conn, owner="a", batch=4, lease=timedelta(seconds=1.5))
    published: list[int] = []
    deliverer = Deliverer(
        lambda m: published.append(m.id),
        db=DirectDatabase(conn),
        publish_timeout=0.5,
        concurrency=1,  # 4 waves x 0.5 s = 2 s of worst case > 1.5 s of lease
    )
    report = deliverer.deliver([m.ref for m in claimed])
    assert published == []
    assert report.released == 4
    rows = conn.execute("SELECT status, attempts FROM outbox ORDER BY id").fetchall()
    assert rows == [("pending", 0)] * 4  # given back with the claim's attempt refunded
    assert [m.id for m in claimed] == ids


def test_the_rest_of_a_chunk_is_not_published_once_its_lease_runs_short(
    conn: psycopg.Connection[Any],
) -> None:
    outbox_relay.enqueue_many(conn, [NewMessage("o", str(n), "e", {"n": n}) for n in range(4)])
    claimed = outbox_relay.claim(conn, owner="a", batch=4, lease=timedelta(seconds=3))
    published: list[tuple[int, float]] = []

    def slow(message: Message) -> None:
        # Each publish overruns the 0.5 s timeout: the chunk falls behind its lease.
        published.append((message.id, _lease_left(conn_probe, message.id)))
        time.sleep(0.9)

    keeper = LeaseKeeper(
        DirectDatabase(conn), timedelta(seconds=3), table=OutboxTable(), background=False
    )
    with psycopg.connect(conn.info.dsn, autocommit=True) as conn_probe:
        deliverer = Deliverer(
            slow, db=DirectDatabase(conn), publish_timeout=0.5, keeper=keeper, concurrency=1
        )
        report = deliverer.deliver([m.ref for m in claimed])
    # 4 waves x 0.5 s = 2 s fit in 3 s, but at 0.9 s each the fourth would
    # start with 0.3 s left: it is given back instead of published late.
    assert len(published) == 3
    assert all(left >= 0.5 for _, left in published)
    assert (report.done, report.released) == (3, 1)
    statuses = [r[0] for r in conn.execute("SELECT status FROM outbox ORDER BY id")]
    assert statuses == ["done", "done", "done", "pending"]
