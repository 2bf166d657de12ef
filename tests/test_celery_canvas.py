"""``outbox_relay.apply_async``: a Celery canvas written in the business transaction.

Real ``celery worker`` and ``celery beat`` processes of a user's app
(tests/apps/canvas.py, which installs the relay with no publisher setting)
on a real broker. The test process is the web process: it writes canvases
with ``apply_async`` inside its transactions and checks that each runs once,
after the commit, with the task ids ``apply_async`` returned, through a
broker outage and a re-send; and that bad input is refused before anything
is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery, chain, chord, group

import outbox_relay
from outbox_relay.celery.canvas import CANVAS_EVENT_TYPE, CanvasPublisher, prepare_canvas
from outbox_relay.errors import InvalidMessage

from . import services

# The web process's app (imported below) reads its result backend and its
# default queue from here: the results apply_async returns are read from the
# workers' backend, and apply_async routes each task as this app does (a
# queue of this test process's own: the broker is shared).
os.environ.setdefault("CANVAS_BACKEND_URL", services.redis_url())
os.environ.setdefault("CANVAS_QUEUE", f"cv-{uuid.uuid4().hex[:10]}")

from .apps import canvas as user
from .apps import kit
from .celery_procs import ROOT, CeleryProcs, EventTap, pool_pids, wait_for

pytestmark = pytest.mark.celery

QUEUE = os.environ["CANVAS_QUEUE"]


# ------------------------------------------------------------------ helpers
def _queue() -> str:
    # The broker is shared with other suites: queues of this test's own.
    return f"cv-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def canvas_dsn(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(user.DDL)
    return dsn


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[Any]:
    """``relay(dsn, broker)``: a worker and a beat of the user's app, relay installed."""
    made: list[CeleryProcs] = []

    def start(
        dsn: str,
        broker: str,
        *,
        backend: str | None = None,
        beat: bool = True,
        events: bool = False,
        settings: dict[str, str] | None = None,
    ) -> Any:
        env = {
            "CANVAS_DSN": dsn,
            "CANVAS_BROKER_URL": broker,
            # Results in Redis (chords need them; the producer's results read them).
            "CANVAS_BACKEND_URL": backend or services.redis_url(),
            "CANVAS_QUEUE": QUEUE,
            "OUTBOX_QUEUE": _queue(),
            # Faster ticks for the test's sake; nothing else is set (no publisher).
            "OUTBOX_CLAIM_INTERVAL_SECONDS": "1",
            **(settings or {}),
        }
        procs = CeleryProcs(env, tmp_path, app="tests.apps.canvas")
        procs.env.pop("OUTBOX_PUBLISHER", None)
        made.append(procs)
        procs.worker(events=events)
        if beat:
            procs.beat()
        return procs

    yield start
    for procs in made:
        procs.stop_all()


def _rows(dsn: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


def _steps(dsn: str, *tags: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(
            "SELECT seq, tag, prev, task_id, name, root_id, parent_id, group_id, argsrepr,"
            " outbox_id FROM steps WHERE tag = ANY(%s) ORDER BY seq",
            (list(tags),),
        )
        names = [d.name for d in cur.description or []]
        return [dict(zip(names, row)) for row in cur.fetchall()]


def _wait_steps(dsn: str, count: int, *tags: str, procs: Any, timeout: float = 90) -> list[Any]:
    wait_for(
        lambda: len(_steps(dsn, *tags)) >= count,
        timeout=timeout,
        what=lambda: f"{count} run(s) of {tags}\n{procs.logs()}",
    )
    time.sleep(1.5)  # anything that would run twice has had time to
    return _steps(dsn, *tags)


def _canvas_rows(dsn: str) -> list[tuple[Any, ...]]:
    return _rows(
        dsn,
        "SELECT id, status, aggregate_type, aggregate_id, payload FROM outbox"
        " WHERE event_type = %s ORDER BY id",
        (CANVAS_EVENT_TYPE,),
    )


def _ids(result: Any) -> list[str]:
    """The task ids of a result tree, first sent first (a chain's parents first)."""
    found: list[str] = []
    node = result
    while node is not None:
        members = getattr(node, "results", None)
        found[:0] = [r.id for r in members] if members is not None else [node.id]
        node = node.parent
    return found


# ------------------------------------------------------- runs after commit
def test_a_chain_runs_once_after_commit_in_order_with_the_returned_ids(
    canvas_dsn: str, relay: Any
) -> None:
    procs = relay(canvas_dsn, services.redis_url())
    with psycopg.connect(canvas_dsn) as conn:
        with conn.transaction():
            conn.execute("INSERT INTO orders (id) VALUES (1)")
            result = outbox_relay.apply_async(
                conn, chain(user.step.s(tag="a"), user.step.s(tag="b"))
            )
            # Returned at once, ids fixed, nothing sent yet.
            assert [result.parent.id, result.id] == _ids(result) and len(set(_ids(result))) == 2
            time.sleep(3)  # the relay is running: still nothing before the commit
            assert _steps(canvas_dsn, "a", "b") == []
        with pytest.raises(RuntimeError), conn.transaction():
            rolled_back = outbox_relay.apply_async(conn, user.step.s(tag="rolled-back"))
            raise RuntimeError("the business change fails")
    runs = _wait_steps(canvas_dsn, 2, "a", "b", procs=procs)
    assert [(r["tag"], r["task_id"]) for r in runs] == [("a", result.parent.id), ("b", result.id)]
    assert runs[1]["prev"] == "a", "the second task got the first one's result"
    [(row_id, status, aggregate_type, aggregate_id, _payload)] = _canvas_rows(canvas_dsn)
    assert (status, aggregate_type, aggregate_id) == ("done", "celery", result.parent.id)
    # Flower and the worker log show the row, never the arguments.
    assert {r["argsrepr"] for r in runs} == {f"(outbox #{row_id} v1)"}
    assert {r["outbox_id"] for r in runs} == {row_id}
    assert {r["root_id"] for r in runs} == {result.parent.id}
    time.sleep(2)
    assert _steps(canvas_dsn, "rolled-back") == []
    assert rolled_back.id not in {str(r[3]) for r in _canvas_rows(canvas_dsn)}


def test_without_a_publisher_other_rows_end_dead_naming_the_setting(
    canvas_dsn: str, relay: Any
) -> None:
    procs = relay(canvas_dsn, services.redis_url())
    with psycopg.connect(canvas_dsn) as conn, conn.transaction():
        event = outbox_relay.enqueue(
            conn, aggregate_type="order", aggregate_id="1", event_type="order.paid", payload={}
        )
        outbox_relay.apply_async(conn, user.step.s(tag="beside"))
    _wait_steps(canvas_dsn, 1, "beside", procs=procs)
    wait_for(
        lambda: (
            _rows(canvas_dsn, "SELECT status FROM outbox WHERE id = %s", (event,)) == [("dead",)]
        ),
        timeout=60,
        what="the event row dead",
    )
    [(error,)] = _rows(canvas_dsn, "SELECT last_error FROM outbox WHERE id = %s", (event,))
    assert "OUTBOX_PUBLISHER is not set" in error and "order.paid" in error
    assert "OUTBOX_PUBLISHER is not set" in procs.procs[0].text()  # said at start, too


def test_a_group_and_a_chord_run_with_the_returned_ids(canvas_dsn: str, relay: Any) -> None:
    broker = services.redis_url()
    procs = relay(canvas_dsn, broker)
    with psycopg.connect(canvas_dsn) as conn, conn.transaction():
        grouped = outbox_relay.apply_async(
            conn, group(user.step.s(tag="g1"), user.step.s(tag="g2"))
        )
        chorded = outbox_relay.apply_async(
            conn,
            chord([user.step.s(tag="h1"), user.step.s(tag="h2")], user.collect.s(tag="body")),
        )
    assert type(grouped).__name__ == "GroupResult"
    header = chorded.parent
    assert type(chorded).__name__ == "AsyncResult" and type(header).__name__ == "GroupResult"

    runs = _wait_steps(canvas_dsn, 2, "g1", "g2", procs=procs)
    assert sorted((r["tag"], r["task_id"]) for r in runs) == [
        ("g1", grouped.results[0].id),
        ("g2", grouped.results[1].id),
    ]
    assert {r["group_id"] for r in runs} == {grouped.id}

    runs = _wait_steps(canvas_dsn, 3, "h1", "h2", "body", procs=procs)
    by_tag = {r["tag"]: r for r in runs}
    assert sorted(by_tag) == ["body", "h1", "h2"] and len(runs) == 3
    assert by_tag["h1"]["task_id"] == header.results[0].id
    assert by_tag["h2"]["task_id"] == header.results[1].id
    assert {by_tag["h1"]["group_id"], by_tag["h2"]["group_id"]} == {header.id}
    assert by_tag["body"]["task_id"] == chorded.id
    assert by_tag["body"]["prev"] == ["h1", "h2"]
    assert runs[-1]["tag"] == "body", "the callback ran after its header"
    # The returned results are live: the result backend answers for them.
    assert chorded.get(timeout=30) == ["h1", "h2"]
    assert grouped.get(timeout=30) == ["g1", "g2"]


def test_a_link_callback_keeps_its_fixed_id(canvas_dsn: str, relay: Any) -> None:
    procs = relay(canvas_dsn, services.redis_url())
    mine = user.step.s(tag="cb-mine")
    mine_id = mine.freeze().id  # frozen by the caller: kept
    with psycopg.connect(canvas_dsn) as conn, conn.transaction():
        first = outbox_relay.apply_async(conn, user.step.s(tag="m1"), link=mine)
        second = outbox_relay.apply_async(
            conn, user.step.s(tag="m2").set(link=user.step.s(tag="cb-ours"))
        )
    rows = {str(r[3]): r[4] for r in _canvas_rows(canvas_dsn)}
    # Not frozen by the caller: frozen by apply_async, and the id is in the row.
    ours_id = rows[second.id]["options"]["link"][0]["options"]["task_id"]
    runs = _wait_steps(canvas_dsn, 4, "m1", "m2", "cb-mine", "cb-ours", procs=procs)
    got = {r["tag"]: r for r in runs}
    assert len(runs) == 4
    assert (got["m1"]["task_id"], got["cb-mine"]["task_id"]) == (first.id, mine_id)
    assert (got["m2"]["task_id"], got["cb-ours"]["task_id"]) == (second.id, ours_id)
    assert got["cb-mine"]["prev"] == "m1" and got["cb-mine"]["parent_id"] == first.id


def test_flower_sees_the_outbox_row_never_the_arguments(canvas_dsn: str, relay: Any) -> None:
    broker = services.redis_url()
    procs = relay(canvas_dsn, broker, events=True)  # -E: task events, as for Flower
    ours = pool_pids(procs.procs[0])  # the broker is shared: only our worker's events
    with EventTap(kit.client_app(broker)) as tap:
        with psycopg.connect(canvas_dsn) as conn, conn.transaction():
            result = outbox_relay.apply_async(
                conn, user.step.s("buyer@example.com", tag="f1") | user.step.s(tag="f2")
            )
        received = wait_for(
            lambda: (
                [
                    e
                    for e in tap.of_type("task-received")
                    if e.get("uuid") in (result.id, result.parent.id) and e.get("pid") in ours
                ]
                if len(_steps(canvas_dsn, "f1", "f2")) == 2
                else []
            ),
            timeout=90,
            what=lambda: f"both tasks received\n{procs.logs()}",
        )
    [(row_id, *_rest)] = _canvas_rows(canvas_dsn)
    assert sorted(e["name"] for e in received) == ["canvas.step", "canvas.step"]
    assert {e["args"] for e in received} == {f"(outbox #{row_id} v1)"}
    assert {e["kwargs"] for e in received} == {"{'tag': ...}"}
    assert "buyer@example.com" not in repr(received)


def test_the_standalone_relay_sends_to_the_queue_the_producer_s_app_routes_to(
    canvas_dsn: str, tmp_path: Path
) -> None:
    """Relayed by ``celery -A outbox_relay.app`` (which knows none of the tasks,
    and whose default queue is its own): each task still goes to the queue the
    web process's app routes it to, where the app's own worker runs it."""
    broker = services.redis_url()
    relay_queue = _queue()
    (tmp_path / "relay").mkdir()
    (tmp_path / "app").mkdir()
    standalone = CeleryProcs(
        {
            "OUTBOX_DSN": canvas_dsn,
            "CELERY_BROKER_URL": broker,
            "OUTBOX_QUEUE": relay_queue,
            "OUTBOX_CLAIM_INTERVAL_SECONDS": "1",
        },
        tmp_path / "relay",
    )
    standalone.env.pop("OUTBOX_PUBLISHER", None)
    consumer = CeleryProcs(
        {"CANVAS_DSN": canvas_dsn, "CANVAS_BROKER_URL": broker, "CANVAS_QUEUE": QUEUE},
        tmp_path / "app",
        app="tests.apps.canvas",
    )
    try:
        standalone.worker(events=False)
        standalone.beat()
        consumer.worker(events=False, args=("-Q", QUEUE))  # the app's tasks only
        with psycopg.connect(canvas_dsn) as conn, conn.transaction():
            result = outbox_relay.apply_async(conn, user.step.s(tag="s1") | user.step.s(tag="s2"))
        runs = _wait_steps(canvas_dsn, 2, "s1", "s2", procs=standalone)
        assert [(r["tag"], r["task_id"]) for r in runs] == [
            ("s1", result.parent.id),
            ("s2", result.id),
        ]
        assert "canvas.step" not in standalone.procs[0].text()
    finally:
        consumer.stop_all()
        standalone.stop_all()


# --------------------------------------------------------- broker outage
def test_the_broker_down_at_commit_loses_nothing(
    canvas_dsn: str, relay: Any, owned_redis: Any
) -> None:
    procs = relay(canvas_dsn, owned_redis.url)
    owned_redis.stop()
    results = []
    with psycopg.connect(canvas_dsn) as conn:
        for n in range(3):
            with conn.transaction():  # commits while the broker is down
                conn.execute("INSERT INTO orders (id) VALUES (%s)", (n,))
                results.append(
                    outbox_relay.apply_async(
                        conn, user.step.s(tag=f"o{n}a") | user.step.s(tag=f"o{n}b")
                    )
                )
    time.sleep(8)  # the relay tries, and reschedules in the database
    assert _steps(canvas_dsn, *[f"o{n}{x}" for n in range(3) for x in "ab"]) == []
    owned_redis.start()  # empty: nothing survived in the broker
    tags = [f"o{n}{x}" for n in range(3) for x in "ab"]
    runs = _wait_steps(canvas_dsn, 6, *tags, procs=procs, timeout=180)
    assert len(runs) == 6, "each task ran exactly once"
    got = {r["tag"]: r["task_id"] for r in runs}
    for n, result in enumerate(results):
        assert (got[f"o{n}a"], got[f"o{n}b"]) == (result.parent.id, result.id)
    wait_for(lambda: {r[1] for r in _canvas_rows(canvas_dsn)} == {"done"}, timeout=30, what="done")


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0", "amqp://guest:guest@127.0.0.1:1//"])
def test_a_broker_that_refuses_is_a_retry_within_the_budget(url: str) -> None:
    from outbox_relay import Message
    from outbox_relay.errors import RetryableError

    publisher = CanvasPublisher(Celery("down", broker=url, set_as_current=False), budget=3.0)
    row, _ = prepare_canvas(user.step.s(tag="x"), {})
    message = Message(
        1, "k", "celery", row.aggregate_id, row.event_type, row.payload, {}, 1, 1, None
    )
    started = time.monotonic()
    try:
        with pytest.raises(RetryableError, match="canvas of outbox message 1"):
            publisher(message)
    finally:
        publisher.close()
    assert time.monotonic() - started < 3.0 + 1.0, "no retry loop inside the send"


def test_the_publishers_app_and_the_relay_app_share_kombus_pool_limit() -> None:
    """kombu keeps one connection-pool limit per process; each app's first use
    of its pool sets it and resizes every pool, and shrinking one in use
    raises. The publisher's app once had a larger limit (its chunk's
    concurrency): the relay app's first send in a pool process then failed
    the canvas being published ("Can't shrink pool when in use: was=200
    now=10", seen in CI's bench-quick)."""
    from outbox_relay import Message

    url = services.redis_url()
    queue = f"pool-limit-{uuid.uuid4().hex[:8]}"
    relay_app = Celery("relay-limit", broker=url, set_as_current=False)
    relay_app.conf.broker_pool_limit = 3
    publisher = CanvasPublisher(relay_app, budget=3.0, concurrency=200)
    assert publisher.app.conf.broker_pool_limit == 3
    row, _ = prepare_canvas(user.step.s(tag="limit"), {"queue": queue})
    message = Message(
        5, "k", "celery", row.aggregate_id, row.event_type, row.payload, {}, 1, 1, None
    )
    try:
        with publisher.app.connection_or_acquire():  # a send of a chunk, under way
            # The relay app's first send in this process (a claim hint, say).
            relay_app.send_task("canvas.step", kwargs={"tag": "hint"}, queue=queue)
            publisher(message)
        assert services.queued(relay_app, queue) == 2
    finally:
        services.queued(relay_app, queue, purge=True)
        publisher.close()
        relay_app.close()


def test_chunks_of_canvases_are_sent_once_each_by_a_chunked_relay(
    canvas_dsn: str, relay: Any
) -> None:
    """The relay in chunks (deliver_batch, concurrent sends through the
    publisher's app beside the relay app's own claim hints, in every pool
    process): each canvas sent with its ids at the first attempt."""
    procs = relay(
        canvas_dsn,
        services.redis_url(),
        settings={"OUTBOX_CHUNK_SIZE": "25", "OUTBOX_BATCH_SIZE": "100"},
    )
    tags = [f"c{n}" for n in range(200)]
    with psycopg.connect(canvas_dsn) as conn, conn.transaction():
        results = [outbox_relay.apply_async(conn, user.step.s(tag=tag)) for tag in tags]
    runs = _wait_steps(canvas_dsn, len(tags), *tags, procs=procs)
    assert sorted((r["tag"], r["task_id"]) for r in runs) == sorted(
        zip(tags, (r.id for r in results))
    )
    rows = _rows(
        canvas_dsn,
        "SELECT status, attempts, last_error FROM outbox WHERE event_type = %s",
        (CANVAS_EVENT_TYPE,),
    )
    assert sorted(set(rows)) == [("done", 1, None)], rows[:5]


def test_headers_given_to_a_whole_canvas_still_carry_the_row() -> None:
    from outbox_relay import Message

    publisher = CanvasPublisher(user.app, budget=3.0)
    for canvas in (user.step.s() | user.step.s(), group(user.step.s(), user.step.s())):
        row, _ = prepare_canvas(canvas, {"headers": {"traceparent": "00-abc-01"}})
        message = Message(
            9, "k", "celery", row.aggregate_id, row.event_type, row.payload, {}, 1, 3, None
        )
        rebuilt = publisher.signature(message)
        # Celery lets the outer headers replace a task's own when it sends it.
        assert rebuilt.options["headers"] == {
            "traceparent": "00-abc-01",
            "outbox-id": 9,
            "outbox-lease-version": 3,
        }
        for task in rebuilt.tasks:
            assert task.options["headers"]["outbox-id"] == 9
            assert task.options["argsrepr"] == "(outbox #9 v3)"


def test_what_celery_would_refuse_in_the_caller_is_refused_in_the_caller() -> None:
    """A chord without a result backend (Celery raises NotImplementedError in
    sig.apply_async()) and an empty chain (IndexError deep inside) were
    written, or failed, only to fail at every send from the relay."""
    bare = Celery("no-backend", broker="memory://", set_as_current=False)

    @bare.task(name="bare.a", shared=False)
    def a(x: int = 0) -> int:
        return x

    for canvas in (chord([a.s(1)], a.s()), chain(a.s(1), group(a.s(), a.s()), a.s())):
        with pytest.raises(InvalidMessage, match=r"needs a result backend.*'no-backend' has none"):
            prepare_canvas(canvas, {})
    prepare_canvas(chain(a.s(1), group(a.s(), a.s())), {})  # no chord: no backend needed
    with pytest.raises(InvalidMessage, match="the chain is empty"):
        prepare_canvas(chain(), {})


def test_a_queue_celery_would_refuse_is_refused_at_write_and_at_send() -> None:
    """With task_create_missing_queues off, Celery's own apply_async raises
    QueueNotFound; through the outbox the row was written, then retried as
    a broker outage (QueueNotFound is a KeyError, which kombu's Redis
    transport counts as a connection error) until it went dead."""
    from kombu import Queue

    from outbox_relay import Message
    from outbox_relay.errors import PermanentError

    strict = Celery("strict", broker="memory://", set_as_current=False)
    strict.conf.update(task_queues=[Queue("default")], task_create_missing_queues=False)

    @strict.task(name="strict.a", shared=False)
    def a(x: int = 0) -> int:
        return x

    with pytest.raises(InvalidMessage, match="'typo' missing from task_queues"):
        prepare_canvas(a.s(1), {"queue": "typo"})
    with pytest.raises(InvalidMessage, match="'typo' missing from task_queues"):
        prepare_canvas(group(a.s(1), a.s(2)).set(queue="typo"), {})
    row, _ = prepare_canvas(a.s(1), {"queue": "default"})
    # The relay's app declares fewer queues than the producer's did.
    stricter = Celery("stricter", broker="memory://", set_as_current=False)
    stricter.conf.update(task_queues=[Queue("other")], task_create_missing_queues=False)
    publisher = CanvasPublisher(stricter, budget=3.0)
    message = Message(
        7, "k", "celery", row.aggregate_id, row.event_type, row.payload, {}, 1, 1, None
    )
    try:
        with pytest.raises(PermanentError, match="add the queue to task_queues"):
            publisher(message)
    finally:
        publisher.close()


def test_the_relays_canvas_app_has_the_settings_config_from_object_loaded() -> None:
    """conf.changes holds only what was assigned or updated: from a settings
    module (or Django's, namespace CELERY) the canvas app had no broker and
    sent to amqp://localhost, no result backend and no queues."""
    from kombu import Queue

    class Settings:
        CELERY_BROKER_URL = "redis://127.0.0.1:1/9"
        CELERY_RESULT_BACKEND = "redis://127.0.0.1:1/10"
        CELERY_TASK_QUEUES = (Queue("team"),)
        CELERY_TASK_DEFAULT_QUEUE = "team"

    team = Celery("team", set_as_current=False)
    team.config_from_object(Settings, namespace="CELERY")
    publisher = CanvasPublisher(team, budget=3.0)
    try:
        conf = publisher.app.conf
        assert conf.broker_url == "redis://127.0.0.1:1/9"
        assert conf.result_backend == "redis://127.0.0.1:1/10"
        assert conf.task_default_queue == "team"
        assert [q.name for q in conf.task_queues] == ["team"]
    finally:
        publisher.close()


def test_a_row_that_is_no_canvas_goes_dead_at_once() -> None:
    """A canvas row Celery cannot read (edited by hand, or written by enqueue
    before the event type was reserved) failed every attempt as unexpected."""
    from outbox_relay import Message
    from outbox_relay.errors import PermanentError

    publisher = CanvasPublisher(user.app, budget=3.0)
    try:
        for payload in ({"hello": 1}, {"task": "canvas.step", "options": "not a dict"}):
            message = Message(5, "k", "celery", "x", CANVAS_EVENT_TYPE, payload, {}, 1, 1, None)
            with pytest.raises(PermanentError, match="not a canvas Celery can read"):
                publisher(message)
    finally:
        publisher.close()


# ------------------------------------------------------------------ re-send
def test_a_resend_sends_the_same_ids_and_the_inbox_applies_once(
    canvas_dsn: str, relay: Any
) -> None:
    procs = relay(canvas_dsn, services.redis_url())
    with psycopg.connect(canvas_dsn) as conn, conn.transaction():
        result = outbox_relay.apply_async(
            conn, group(user.step.s(tag="again"), user.once.s("effect"))
        )
    step_id, once_id = (r.id for r in result.results)
    _wait_steps(canvas_dsn, 1, "again", procs=procs)
    [(row_id, *_rest)] = wait_for(
        lambda: [r for r in _canvas_rows(canvas_dsn) if r[1] == "done"], timeout=30, what="done"
    )
    # As after a lost lease or a relay that crashed after sending: the row is due again.
    _rows(
        canvas_dsn,
        "UPDATE outbox SET status = 'pending', available_at = now() WHERE id = %s RETURNING id",
        (row_id,),
    )
    runs = _wait_steps(canvas_dsn, 2, "again", procs=procs)
    assert [r["task_id"] for r in runs] == [step_id, step_id]
    assert [r["argsrepr"] for r in runs] == [f"(outbox #{row_id} v1)", f"(outbox #{row_id} v2)"]
    wait_for(
        lambda: procs.procs[0].text().count(f"canvas.once[{once_id}] received") == 2,
        timeout=30,
        what="the inbox task delivered twice",
    )
    time.sleep(1)
    assert _rows(canvas_dsn, "SELECT tag, task_id FROM effects") == [("effect", once_id)]


# ---------------------------------------------------------------- RabbitMQ
def test_a_chain_over_rabbitmq_with_publisher_confirms(canvas_dsn: str, relay: Any) -> None:
    url = services.amqp_url()
    if url is None:
        pytest.skip("RabbitMQ not configured: set OUTBOX_TEST_AMQP_URL")
    procs = relay(canvas_dsn, url)
    with psycopg.connect(canvas_dsn) as conn, conn.transaction():
        result = outbox_relay.apply_async(
            conn, user.step.s(tag="r1") | user.step.s(tag="r2"), queue=procs.env["CANVAS_QUEUE"]
        )
    runs = _wait_steps(canvas_dsn, 2, "r1", "r2", procs=procs)
    assert [(r["tag"], r["task_id"]) for r in runs] == [("r1", result.parent.id), ("r2", result.id)]
    # The relay's sends go through a connection with confirms on (its app is
    # made from the relay app's configuration: here, one on this broker).
    publisher = CanvasPublisher(Celery("probe", broker=url, set_as_current=False), budget=10.0)
    try:
        with publisher.app.connection_for_write() as connection:
            assert connection.transport_options["confirm_publish"] is True
            # py-amqp publishes through basic_publish_confirm: it waits for the broker's ack.
            assert connection.default_channel.basic_publish.__name__ == "basic_publish_confirm"
    finally:
        publisher.close()


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: user.app.signature("canvas.stpe"), "no task named 'canvas.stpe' is registered"),
        (
            lambda: user.step.s(tag="x") | user.app.signature("canvas.nope"),
            "no task named 'canvas.nope'",
        ),
        (
            lambda: user.step.s(tag="x").set(link=user.app.signature("canvas.after")),
            "no task named 'canvas.after'",
        ),
        (lambda: user.step.s(Decimal("9.99")), "task 'canvas.step': its arguments are not JSON"),
        (
            lambda: group(user.step.s(), user.collect.s(tag=object())),
            "task 'canvas.collect': its keyword arguments are not JSON",
        ),
        (
            # Over OUTBOX_MAX_PAYLOAD_BYTES: said in the caller's terms (the
            # arguments), not as a "payload" apply_async's caller never wrote.
            lambda: user.step.s(tag="x" * 1_000_000),
            "the canvas as stored (its tasks' arguments and options) is ",
        ),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(
    canvas_dsn: str, make: Any, expected: str
) -> None:
    with psycopg.connect(canvas_dsn) as conn, conn.transaction():
        conn.execute("INSERT INTO orders (id) VALUES (7)")
        with pytest.raises(InvalidMessage) as raised:
            outbox_relay.apply_async(conn, make())
        # The caller's transaction is still usable and commits its own work.
        conn.execute("INSERT INTO orders (id) VALUES (8)")
    assert expected in str(raised.value)
    if "stpe" in expected:
        assert "did you mean 'canvas.step'?" in str(raised.value)
    assert _rows(canvas_dsn, "SELECT count(*) FROM outbox") == [(0,)]
    assert _rows(canvas_dsn, "SELECT id FROM orders ORDER BY id") == [(7,), (8,)]


def test_calls_go_to_the_table_the_apps_relay_reads(dsn: str) -> None:
    """With ``Outbox(table=...).install(app)``, the durable short form and the
    module-level ``apply_async`` wrote to public.outbox, which that relay
    never reads: the rows were never sent, and nothing said so (a new user's
    walkthrough of the public API). They follow the signature's app now,
    and that outbox becomes the process's default for ``enqueue``."""
    from outbox_relay import _defaults
    from outbox_relay.celery import DurableTask

    _defaults.reset()
    try:
        app = Celery("billing-app", broker="memory://", set_as_current=False)
        outbox = outbox_relay.Outbox(table="billing.events")
        outbox.install(app, dsn=dsn, beat=False)

        @app.task(name="billing.charge", base=DurableTask, shared=False)
        def charge(order_id: int) -> None: ...

        @app.task(name="billing.notify", shared=False)
        def notify(order_id: int) -> None: ...

        with psycopg.connect(dsn) as conn:
            conn.execute("CREATE SCHEMA billing")
            outbox.migrate(conn)
            conn.commit()
            with conn.transaction():
                charge.enqueue(conn, 1)
                outbox_relay.apply_async(conn, notify.s(2))
                outbox_relay.enqueue(
                    conn, aggregate_type="invoice", aggregate_id="3", event_type="e", payload={}
                )
        assert _rows(dsn, "SELECT event_type FROM billing.events ORDER BY id") == [
            ("celery.durable",),
            (CANVAS_EVENT_TYPE,),
            ("e",),
        ]
        assert _rows(dsn, "SELECT count(*) FROM outbox") == [(0,)]
    finally:
        _defaults.reset()


def test_options_that_cannot_go_through_the_outbox_are_refused() -> None:
    sig = user.step.s(tag="x")
    for options, expected in [
        ({"retry": True}, "the relay retries a failed send"),
        ({"producer": object()}, "belongs to the sending process"),
        ({"countdown": "soon"}, "countdown must be a finite number"),
        ({"eta": "tomorrow"}, "eta='tomorrow' is not an ISO 8601 time"),
        ({"headers": {"x": object()}}, "option 'headers' is not JSON-serializable"),
    ]:
        with pytest.raises(InvalidMessage, match=expected):
            prepare_canvas(sig, options)
    with pytest.raises(InvalidMessage, match="a group takes no link"):
        prepare_canvas(group(sig, sig), {"link": sig})
    # This call's own callbacks are checked like the canvas's (they were
    # Celery's NotRegistered, without a "did you mean").
    for key in ("link", "link_error"):
        with pytest.raises(
            InvalidMessage, match=r"no task named 'canvas\.stpe'.*did you mean 'canvas\.step'"
        ):
            prepare_canvas(sig, {key: user.app.signature("canvas.stpe")})
    with pytest.raises(InvalidMessage, match=r"task 'canvas\.step': its arguments are not JSON"):
        prepare_canvas(sig, {"link": user.step.s(Decimal("1"))})
    with pytest.raises(InvalidMessage, match="needs a Celery signature"):
        prepare_canvas(user.step, {})
    with pytest.raises(InvalidMessage, match="needs a psycopg 3 connection, a SQLAlchemy"):
        outbox_relay.apply_async(object(), sig)


def test_countdown_eta_and_expires_become_the_row_s_times() -> None:
    from datetime import datetime, timedelta, timezone

    now = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
    sig = user.step.s(tag="later")
    message, result = prepare_canvas(sig, {"countdown": 30, "expires": 120}, now=now)
    assert message.delay == timedelta(seconds=30)
    options = message.payload["options"]
    assert "countdown" not in options, "no broker ETA: the row is due later instead"
    assert options["expires"] == (now + timedelta(seconds=120)).isoformat()
    assert (message.event_type, message.aggregate_type) == (CANVAS_EVENT_TYPE, "celery")
    assert message.aggregate_id == result.id == options["task_id"]
    # A canvas expired by the time it is due would be sent and discarded by
    # every worker (its row done, nothing run): refused instead.
    for timing in (
        {"countdown": 10, "expires": 5},
        {"countdown": 10, "expires": 10},
        {"eta": now + timedelta(seconds=30), "expires": now + timedelta(seconds=20)},
        {"expires": now - timedelta(seconds=1)},
    ):
        with pytest.raises(InvalidMessage, match=r"expires \(.*\) is not after the time"):
            prepare_canvas(sig, timing, now=now)
    with pytest.raises(InvalidMessage, match="is not after the time the canvas is due"):
        prepare_canvas(user.step.s(tag="x").set(countdown=60, expires=30), {}, now=now)
    message, _ = prepare_canvas(sig.set(eta=now + timedelta(minutes=5)), {}, now=now)
    assert message.delay == timedelta(minutes=5) and "eta" not in message.payload["options"]
    assert "task_id" not in sig.options, "the caller's signature is not frozen"
    # task_id= as Celery's apply_async takes it: the task's, the group's, a chain's last.
    one = user.step.s(tag="again")
    for canvas, kind in [(one, "AsyncResult"), (group(one, one), "GroupResult"), (one | one, "")]:
        message, result = prepare_canvas(canvas, {"task_id": "given-id"}, now=now)
        assert result.id == "given-id" and (not kind or type(result).__name__ == kind)
        assert "given-id" in json.dumps(message.payload)


def test_partial_arguments_go_where_celery_puts_them() -> None:
    """apply_async(args=, kwargs=): the task, a chain's first task, each task
    of a group or of a chord's header, prepended as Celery does."""
    from celery.canvas import Signature

    partial = {"args": ("p",), "kwargs": {"tag": "k"}}
    cases = [
        (user.step.s(), lambda s: [s]),
        (user.step.s() | user.step.s(9), lambda s: s.tasks),
        (group(user.step.s(), user.step.s(9)), lambda s: s.tasks),
        (chord([user.step.s(), user.step.s(9)], user.collect.s()), lambda s: s.tasks),
    ]
    expected = {
        0: [(["p"], {"tag": "k"})],
        1: [(["p"], {"tag": "k"}), ([9], {})],
        2: [(["p"], {"tag": "k"}), (["p", 9], {"tag": "k"})],
        3: [(["p"], {"tag": "k"}), (["p", 9], {"tag": "k"})],
    }
    for n, (sig, tasks) in enumerate(cases):
        message, _ = prepare_canvas(sig, partial)
        stored = Signature.from_dict(message.payload, app=user.app)
        assert [(list(t["args"]), t["kwargs"]) for t in tasks(stored)] == expected[n]


# ------------------------------------------------ other connection forms
def test_a_sqlalchemy_session_commits_and_rolls_back_with_the_canvas(canvas_dsn: str) -> None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session

    # creator: the fixture's DSN may be a unix-socket conninfo, not a URL.
    engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(canvas_dsn))
    try:
        with Session(engine) as session, session.begin():
            session.execute(text("INSERT INTO orders (id) VALUES (1)"))
            kept = outbox_relay.apply_async(session, user.step.s(tag="kept"))
        with contextlib.suppress(RuntimeError), Session(engine) as session, session.begin():
            outbox_relay.apply_async(session, user.step.s(tag="dropped"))
            raise RuntimeError("rolled back")
    finally:
        engine.dispose()
    assert [str(r[3]) for r in _canvas_rows(canvas_dsn)] == [kept.id]


def test_a_django_connection_commits_and_rolls_back_with_the_canvas(canvas_dsn: str) -> None:
    # Django's settings are once per process: the scenario runs in its own.
    found = kit.module_json("tests.apps.django_canvas", canvas_dsn)
    assert [str(r[3]) for r in _canvas_rows(canvas_dsn)] == [found["kept"]]
    assert found["dropped"] != found["kept"]


# --------------------------------------------------------------------- docs
DOCS = ROOT / "docs" / "celery.md"


def _doc_block(text: str, first_line: str) -> str:
    """The fenced block of docs/celery.md that starts with ``first_line``."""
    for block in text.split("```")[1::2]:
        body = block.split("\n", 1)[1]
        if body.startswith(first_line):
            return body
    raise AssertionError(f"docs/celery.md has no block starting {first_line!r}")


def test_the_docs_example_runs_as_written(dsn: str, tmp_path: Path) -> None:
    """The files and commands of docs/celery.md, run as written in a fresh
    folder; only the exported addresses are this test's database and broker."""
    from .celery_procs import Proc

    text = DOCS.read_text()
    for name in ("shop.py", "place_order.py"):
        (tmp_path / name).write_text(_doc_block(text, f"# {name}\n"))
    commands = _doc_block(text, "export OUTBOX_DSN=").strip().splitlines()
    exported = [c for c in commands if c.startswith("export ")]
    assert [c.split("=", 1)[0] for c in exported] == [
        "export OUTBOX_DSN",
        "export CELERY_BROKER_URL",
    ]
    env = {
        **os.environ,
        "OUTBOX_DSN": dsn,
        "CELERY_BROKER_URL": services.redis_url(),
        # This checkout's outbox_relay, and its virtualenv's commands.
        "PYTHONPATH": str(ROOT),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    for name in ("OUTBOX_PUBLISHER", "CELERY_CONFIG_MODULE", "OUTBOX_QUEUE"):
        env.pop(name, None)
    procs: list[Proc] = []

    def run(command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )

    try:
        for command in commands[len(exported) :]:
            if command.startswith("celery "):
                log = tmp_path / f"{len(procs)}.log"
                with log.open("wb") as out:
                    popen = subprocess.Popen(
                        command,
                        shell=True,
                        cwd=tmp_path,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                procs.append(Proc(command.split()[3], popen, log))
                if " worker" in command:
                    procs[-1].wait_ready()
                continue
            done = run(command)
            assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"
        out = done.stdout.strip().splitlines()[-1]
        words = out.replace(",", " ").split()  # "reserve <id> then receipt <id>, sent ..."
        reserve, receipt = words[1], words[4]
        worker = procs[0]
        wait_for(
            lambda: f"shop.send_receipt[{receipt}] succeeded" in worker.text(),
            timeout=90,
            what=f"the receipt task\n{worker.text()[-3000:]}",
        )
        log = worker.text()
        assert f"shop.reserve_stock[{reserve}] succeeded" in log
        # In order: the bodies' own output (written by the pool process as each
        # runs). Not Celery's "succeeded"/"received" lines: the main process
        # may log the next task received before the first one's success.
        assert "receipt sent for order 42" in log
        assert log.index("stock reserved for order 42") < log.index("receipt sent for order 42")
        assert _rows(dsn, "SELECT receipt_task FROM orders") == [(receipt,)]
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_the_readme_example_writes_one_canvas_row(dsn: str, tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Celery tasks inside a transaction") :]
    block = _doc_block(section, "import psycopg\nfrom celery import chain\n")
    (tmp_path / "shop.py").write_text(_doc_block(DOCS.read_text(), "# shop.py\n"))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, total int)")
    # In a fresh interpreter, as a reader runs it (shop.py's tasks would
    # otherwise be registered into the apps later tests make in this process);
    # the reader's `dsn` is the one line put before it.
    script = tmp_path / "readme_example.py"
    script.write_text(f"dsn = {dsn!r}\n{block}")
    env = {
        **os.environ,
        "OUTBOX_DSN": dsn,
        "CELERY_BROKER_URL": services.redis_url(),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, f"README.md's example:\n{done.stderr}"
    first, last = done.stdout.split()
    [(_id, status, _type, root, payload)] = _canvas_rows(dsn)
    assert (status, root) == ("pending", first)
    assert payload["options"]["task_id"] == last  # a chain's own id is its last task's
    assert _rows(dsn, "SELECT id FROM orders") == [(7,)]
