"""How a claim is cut into delivery tasks, and where a drain's next claim goes.

The drain end to end, with real workers and no beat:
tests/test_celery_relay.py::test_a_drain_under_the_cap_goes_on_without_beat.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import psycopg

from outbox_relay.celery.fanout import DrainPlan, chunk_size_for, drain_plan


def test_a_round_longer_than_the_prefetch_queues_its_claim_halfway() -> None:
    # 200 tasks, a worker of 4 processes prefetching 16: the claim is reached
    # when half the round has been taken.
    assert drain_plan(200, prefetched=16, tight=False) == DrainPlan(queued_at=100)


def test_a_round_the_worker_prefetches_whole_lets_its_middle_task_send_the_claim() -> None:
    # 10 chunks of 50 from a batch of 500: a claim queued among them would run
    # at once and find the cap still held by this very round.
    assert drain_plan(10, prefetched=16, tight=False) == DrainPlan(marked=5, when="start")
    assert drain_plan(32, prefetched=16, tight=False) == DrainPlan(marked=16, when="start")
    assert drain_plan(33, prefetched=16, tight=False) == DrainPlan(queued_at=16)


def test_under_a_tight_cap_the_claim_waits_for_finished_rows() -> None:
    # Only finished rows make room: the middle task claims once it is done,
    # however long the round.
    assert drain_plan(2, prefetched=16, tight=True) == DrainPlan(marked=1, when="end")
    assert drain_plan(200, prefetched=16, tight=True) == DrainPlan(marked=100, when="end")
    assert drain_plan(1, prefetched=16, tight=True) == DrainPlan(marked=0, when="end")


def test_a_round_of_durable_tasks_only_queues_its_claim_among_them() -> None:
    # A durable task is the user's: it cannot send the claim. Durable tasks
    # are sent after the delivery tasks, so a mixed round's claim still rides
    # on a delivery task; the end-to-end drain is in tests/test_durable.py.
    assert drain_plan(0, prefetched=16, tight=False, durable=200) == DrainPlan(queued_at=100)
    assert drain_plan(0, prefetched=16, tight=True, durable=1) == DrainPlan(queued_at=0)
    assert drain_plan(4, prefetched=16, tight=False, durable=200) == DrainPlan(marked=2)
    assert drain_plan(0, prefetched=16, tight=False) == DrainPlan()


def test_a_chunk_is_small_enough_for_every_pool_process_to_hold_one() -> None:
    # OUTBOX_CHUNK_SIZE is the most a task takes: chunks of 500 under the
    # default cap of 1,000 would let two of four processes work and two idle.
    assert chunk_size_for(500, 1000, 4) == 250
    assert chunk_size_for(300, 1000, 4) == 250
    assert chunk_size_for(500, 1000, 8) == 125
    assert chunk_size_for(200, 1000, 4) == 200  # fits: the setting stands
    assert chunk_size_for(50, 1000, 4) == 50
    assert chunk_size_for(50, 10, 16) == 1
    # Unknown concurrency, one process, no cap, or one message per task: unchanged.
    assert chunk_size_for(500, 1000, 0) == 500
    assert chunk_size_for(500, 1000, 1) == 500
    assert chunk_size_for(500, None, 4) == 500
    assert chunk_size_for(1, 1000, 4) == 1


def test_a_worker_says_when_it_cuts_the_chunks() -> None:
    """Tasks of 300 and 200 rows under OUTBOX_CHUNK_SIZE=500 came with no word
    why; the worker now says so at start (one INFO line)."""
    from outbox_relay import Settings
    from outbox_relay.celery.listener import chunk_cut

    cut = Settings(chunk_size=500, batch_size=500, max_in_flight=600)
    assert chunk_cut(cut, 2) == (
        "delivery tasks carry at most 300 rows here, not OUTBOX_CHUNK_SIZE 500: "
        "OUTBOX_MAX_IN_FLIGHT 600 shared by 2 pool processes (raise it to keep whole chunks)"
    )
    assert chunk_cut(cut, 1) is None  # one process holds a whole chunk
    assert chunk_cut(Settings(chunk_size=200), 4) is None  # the defaults' cap fits


def _relay(dsn: str, name: str, **settings: Any) -> tuple[Any, Any, str]:
    """A Celery app with the relay installed on a queue of its own, on the
    test broker: (app, installation, queue). Its tasks run in this process
    when called; what they send stays in the queue for the test to read."""
    from celery import Celery

    import outbox_relay

    from . import services

    app = Celery(name, broker=services.redis_url())
    queue = f"outbox-{name}-{uuid.uuid4().hex[:8]}"
    inst = outbox_relay.install(
        app, dsn=dsn, publisher="tests.apps.recording:publish", queue=queue, **settings
    )
    return app, inst, queue


def _backlog(dsn: str, n: int) -> None:
    import outbox_relay
    from outbox_relay import NewMessage

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM outbox")
        outbox_relay.enqueue_many(
            conn, [NewMessage("order", str(i), "order.created", {"n": i}) for i in range(n)]
        )


def _taken(app: Any, queue: str) -> list[dict[str, Any]]:
    """The messages sent to ``queue``, which is emptied."""
    with app.connection_for_write() as connection:
        client = connection.default_channel.client
        bodies = [json.loads(raw) for raw in client.lrange(queue, 0, -1)]
        client.delete(queue)
    return bodies


def _body(message: dict[str, object]) -> str:
    import base64

    return base64.b64decode(str(message["body"])).decode()


def test_the_claim_task_sends_a_chunk_for_every_pool_process(dsn: str) -> None:
    """The claim task's own body, on a real broker: how many delivery tasks,
    of how many rows, it sends for a backlog of 1,000 in chunks of 500."""
    sent: dict[int, list[int]] = {}
    for concurrency in (0, 4):
        app, inst, queue = _relay(dsn, f"spread{concurrency}", chunk_size=500, batch_size=1000)
        inst.concurrency = concurrency  # what a worker records at start
        _backlog(dsn, 1000)
        app.tasks["outbox_relay.claim"]()  # the task's body, as a worker runs it
        bodies = _taken(app, queue)
        deliveries = [b for b in bodies if b["headers"]["task"] == "outbox_relay.deliver_batch"]
        sent[concurrency] = sorted(len(json.loads(_body(b))[0][0]) for b in deliveries)
        inst.close()
    assert sent == {0: [500, 500], 4: [250, 250, 250, 250]}


def test_a_hint_that_finds_a_claim_in_progress_leaves_the_rows_to_it(dsn: str) -> None:
    """A drain's claim hint (contend=False) returns at once while another
    claim holds the table's claim lock, and sends nothing: no delivery, and
    no held-back round (the claim in progress drains on if it must). A
    claim that contends (beat's, the listener's) waits and takes the rows."""
    app, inst, queue = _relay(dsn, "hint-busy", chunk_size=50)
    claim = app.tasks["outbox_relay.claim"]
    try:
        _backlog(dsn, 100)
        with psycopg.connect(dsn) as holder:
            # Another claim in progress: the lock claims take under the cap.
            key = f"{inst.settings.outbox_table.lock_key}:claim"
            holder.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (key,))
            started = time.monotonic()
            assert claim(0, 10, False) == {"claimed": 0}
            assert time.monotonic() - started < 5
            assert _taken(app, queue) == []
            holder.rollback()
        assert claim(0, 10, True) == {"claimed": 100}
        assert len(_taken(app, queue)) == 2  # two chunks of 50
    finally:
        inst.close()


def test_a_claim_the_cap_cut_short_has_one_successor(dsn: str) -> None:
    """A round the in-flight cap cut short carries the drain's next claim in
    its marked delivery task; a held-back claim (a look at the cap a moment
    later) is sent only by a claim that took nothing, and not while one this
    process sent is still to run. Both at once gave every capped round two
    successors: 3,212 empty claims beside 802 deliveries in a benchmark
    whose first attempts all failed (docs/benchmarks-changes.md, item 34)."""
    app, inst, queue = _relay(
        dsn, "capped-successor", chunk_size=10, batch_size=50, max_in_flight=60
    )
    claim = app.tasks["outbox_relay.claim"]

    def sent() -> list[tuple[str, bool]]:
        """The tasks sent: (name, sent with a countdown)."""
        return [
            (b["headers"]["task"], b["headers"].get("eta") is not None) for b in _taken(app, queue)
        ]

    try:
        _backlog(dsn, 200)
        # A full batch: five chunks, the next claim riding on the third.
        assert claim() == {"claimed": 50}
        assert sent() == [("outbox_relay.deliver_batch", False)] * 5
        # 10 of the cap's 60 left: cut short. Its one chunk carries the
        # next claim (sent once its rows are finished), nothing else.
        assert claim() == {"claimed": 10}
        assert sent() == [("outbox_relay.deliver_batch", False)]
        # No room: nothing to carry the drain on, so a look a moment later.
        assert claim() == {"claimed": 0}
        assert sent() == [("outbox_relay.claim", True)]
        # Still no room, and that look is yet to run: it serves this one too.
        assert claim() == {"claimed": 0}
        assert sent() == []
    finally:
        inst.close()
