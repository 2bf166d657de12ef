"""A claim whose fan-out cannot reach the broker gives its rows back at once."""

from __future__ import annotations

import socket
from typing import Any

import psycopg
import pytest
from celery import Celery
from kombu.exceptions import OperationalError

import outbox_relay
from outbox_relay import NewMessage


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens here once closed


def test_unreachable_broker_releases_the_claimed_rows(dsn: str) -> None:
    app = Celery("fan-out-failure", broker=f"redis://127.0.0.1:{_closed_port()}/0")
    app.conf.update(
        task_publish_retry=False,  # fail fast instead of retrying the publish
        broker_connection_retry=False,
        broker_connection_timeout=1,
    )
    inst = outbox_relay.install(app, dsn=dsn, publisher="tests.apps.recording:publish")
    claim: Any = app.tasks["outbox_relay.claim"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        outbox_relay.enqueue_many(
            conn, [NewMessage("order", str(i), "order.created", {"n": i}) for i in range(5)]
        )
    with pytest.raises(OperationalError):  # the task fails visibly, after releasing
        claim()  # the task's body, in this process, as a worker would run it
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT status, attempts, lease_version, last_error FROM outbox ORDER BY id"
        ).fetchall()
    # Back to pending at once, no attempt spent (a delivery counts its attempt
    # when it begins); the cleared lease fences off any task that did reach
    # the broker before the failure.
    assert [(status, attempts, version) for status, attempts, version, _ in rows] == [
        ("pending", 0, 1)
    ] * 5
    assert all("fan-out to the broker failed" in error for *_, error in rows)
    inst.close()


def test_rows_whose_delivery_was_interrupted_are_delivered_alone() -> None:
    """A poison message (its worker dies each time) must not take its chunk
    with it: a row whose last delivery died under it goes in a delivery task
    of its own; a retry after a classified failure is chunked as usual."""
    from outbox_relay.celery.fanout import chunked
    from outbox_relay.model import Claimed

    def row(i: int, attempts: int, interrupted: bool = False) -> Claimed:
        return Claimed(
            i, 1, attempts, "order", str(i), "order.created", {}, interrupted=interrupted
        )

    claimed = [row(1, 0), row(2, 1, True), row(3, 1), row(4, 0), row(5, 2, True), row(6, 3)]
    assert [[c.id for c in part] for part in chunked(claimed, 2)] == [[2], [1, 3], [5], [4, 6]]
    assert [[c.id for c in part] for part in chunked(claimed, 1)] == [[i] for i in range(1, 7)]


def test_a_chunk_holds_a_bounded_size_of_payload() -> None:
    """A delivery task decodes its chunk's payloads at once: rows with large
    payloads go in smaller chunks (CHUNK_PAYLOAD_BYTES of stored payload),
    rows of the usual size fill whole ones, and a row larger than the budget
    still goes, alone."""
    from outbox_relay.celery.fanout import CHUNK_PAYLOAD_BYTES, chunked
    from outbox_relay.model import Claimed

    def row(i: int, stored: int) -> Claimed:
        return Claimed(i, 1, 0, "order", str(i), "order.created", None, stored_bytes=stored)

    small = [row(i, 300) for i in range(1, 501)]
    assert [len(c) for c in chunked(small, 200)] == [200, 200, 100]
    third = CHUNK_PAYLOAD_BYTES // 3
    large = [row(i, third) for i in range(1, 8)]
    assert [[c.id for c in part] for part in chunked(large, 200)] == [
        [1, 2, 3],
        [4, 5, 6],
        [7],
    ]
    huge = [row(1, 300), row(2, 3 * CHUNK_PAYLOAD_BYTES), row(3, 300)]
    assert [[c.id for c in part] for part in chunked(huge, 200)] == [[1], [2], [3]]
