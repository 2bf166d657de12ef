"""The lease heartbeat: a slow but healthy publish keeps its row; a lost one is noticed."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import psycopg

import outbox_relay
from outbox_relay import Message, NewMessage, OutboxTable, Relay
from outbox_relay.relay import DirectDatabase, LeaseKeeper


def _lease_until(conn: psycopg.Connection[Any], message_id: int) -> Any:
    row = conn.execute("SELECT lease_until FROM outbox WHERE id = %s", (message_id,)).fetchone()
    assert row is not None
    return row[0]


def test_keeper_renews_a_publish_that_outlives_its_lease(dsn: str) -> None:
    lease = timedelta(seconds=1.2)
    with (
        psycopg.connect(dsn, autocommit=True) as conn,
        psycopg.connect(dsn, autocommit=True) as keeper_conn,
    ):
        [message_id] = outbox_relay.enqueue_many(conn, [NewMessage("o", "1", "e", {"n": 1})])
        [claimed] = outbox_relay.claim(conn, owner="slow", batch=1, lease=lease)
        keeper = LeaseKeeper(DirectDatabase(keeper_conn), lease, table=OutboxTable())
        published: list[Message] = []

        def slow_publish(message: Message) -> None:
            time.sleep(3.0)  # two and a half leases
            published.append(message)

        relay = Relay(slow_publish, publish_timeout=0.1, keeper=keeper, concurrency=1)
        # Meanwhile another relay keeps trying to take the row over.
        stop = threading.Event()
        stolen: list[Any] = []

        def rival() -> None:
            with psycopg.connect(dsn, autocommit=True) as other:
                while not stop.is_set():
                    stolen.extend(outbox_relay.claim(other, owner="rival", batch=1, lease=lease))
                    time.sleep(0.1)

        thief = threading.Thread(target=rival)
        thief.start()
        try:
            report = relay.deliver(conn, [claimed.ref])
        finally:
            stop.set()
            thief.join()
    assert stolen == []  # the heartbeat kept the lease alive throughout
    assert keeper.renewed >= 2
    assert report.done == 1 and report.lost == 0
    assert [m.id for m in published] == [message_id]


def test_keeper_notices_a_lost_lease(dsn: str) -> None:
    lease = timedelta(seconds=0.6)
    with psycopg.connect(dsn, autocommit=True) as conn:
        outbox_relay.enqueue_many(conn, [NewMessage("o", "1", "e", {"n": 1})])
        [claimed] = outbox_relay.claim(conn, owner="a", batch=1, lease=lease)
        keeper = LeaseKeeper(DirectDatabase(conn), lease, table=OutboxTable())
        keeper.hold([claimed.ref])
        # Another relay takes the row over (as after an expired lease).
        conn.execute("UPDATE outbox SET lease_until = now() - interval '1 second'")
        [taken] = outbox_relay.claim(conn, owner="b", batch=1, lease=timedelta(seconds=30))
        time.sleep(0.25)  # past a third of the lease: the ref is due for renewal
        keeper.renew_due()
        assert claimed.ref in keeper.lost
        # The new holder's lease is untouched by the stale heartbeat.
        assert _lease_until(conn, taken.id) == taken.lease_until
        keeper.release([claimed.ref])
