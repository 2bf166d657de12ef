"""The ``celery:`` publisher and the inbox task, tried as a user would.

Real ``celery worker`` processes of a user's app (tests/apps/pipeline.py,
which installs the relay into itself) on a real broker: the relay runs with
its default timeouts, sends the user's own tasks (by name, as a ``Task``,
as a ``Signature``), refuses a misspelled task name at start, shows which
outbox row a task came from instead of its payload, and reports dead
letters as failures. The inbox task applies an effect once per task id
through re-sends, a worker killed mid-body, and a body that raises.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery.exceptions import AlwaysEagerIgnored

import outbox_relay
from outbox_relay import Message
from outbox_relay.celery.events import TaskEvents
from outbox_relay.errors import ConfigError
from outbox_relay.inbox import InboxTask
from outbox_relay.model import Claimed, LeaseRef, Outcome
from outbox_relay.publishers import CeleryTaskPublisher, resolve_publisher

from . import services
from .celery_procs import CeleryProcs, EventTap, pool_pids, wait_for

pytestmark = pytest.mark.celery

TABLES = """
CREATE TABLE runs (
    n int, tag text, task_id text, pid int, hostname text, is_eager bool, routing_key text,
    argsrepr text, kwargsrepr text, outbox_id bigint, lease_version bigint
);
CREATE TABLE attempts (key text NOT NULL, pid int NOT NULL);
CREATE TABLE effects (key text NOT NULL, amount int NOT NULL, pid int NOT NULL);
"""


@pytest.fixture
def pipeline_dsn(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(TABLES)
    return dsn


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Any]:
    made: list[CeleryProcs] = []

    def factory(dsn: str, broker: str, app: str = "tests.apps.pipeline", **env: str) -> CeleryProcs:
        # The broker may be shared with other suites' workers: queues of our own,
        # or they would take (and skip) our tasks.
        base = {
            "PIPELINE_DSN": dsn,
            "PIPELINE_BROKER_URL": broker,
            "PIPELINE_DEFAULT_QUEUE": _queue(),
            "OUTBOX_QUEUE": _queue(),
        }
        if app == "outbox_relay.app":
            base.update(OUTBOX_DSN=dsn, CELERY_BROKER_URL=broker)
        p = CeleryProcs({**base, **env}, tmp_path, app=app)
        made.append(p)
        return p

    yield factory
    for p in made:
        p.stop_all()


def _queue() -> str:
    # The broker is shared: names of this test's own.
    return f"pl-{uuid.uuid4().hex[:10]}"


def _client(broker: str) -> Celery:
    app = Celery("pipeline-client", broker=broker, set_as_current=False)
    app.conf.update(task_serializer="json", accept_content=["json"])
    return app


def _enqueue(dsn: str, n: int, payload: dict[str, Any] | None = None) -> int:
    with psycopg.connect(dsn) as conn, conn.transaction():
        return outbox_relay.enqueue(
            conn,
            aggregate_type="order",
            aggregate_id=str(n),
            event_type="order.paid",
            payload=payload if payload is not None else {"n": n, "email": f"buyer{n}@example.com"},
        )


def _rows(dsn: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


def _status(dsn: str, message_id: int) -> str:
    return str(_rows(dsn, "SELECT status FROM outbox WHERE id = %s", (message_id,))[0][0])


def _relay_env(**extra: str) -> dict[str, str]:
    """Only what a new user sets: no OUTBOX_PUBLISH_TIMEOUT_SECONDS, no broker of
    the publisher's own. Faster claim ticks only for the test's sake."""
    return {"OUTBOX_CLAIM_INTERVAL_SECONDS": "1", **extra}


def _noop(payload: Any) -> None:
    """A task body for apps that are only checked, never run."""


# ------------------------------------------------------------------- item 5a
def test_default_timeouts_start_and_deliver_to_a_real_task(pipeline_dsn, procs) -> None:
    """OUTBOX_PUBLISHER=celery:task without OUTBOX_CELERY_BROKER_URL, all defaults."""
    p = procs(
        pipeline_dsn,
        services.redis_url(),
        PIPELINE_PUBLISHER="celery:pipeline.record",
        PIPELINE_APPLY_QUEUE=_queue(),
        **_relay_env(),
    )
    for name in ("OUTBOX_PUBLISH_TIMEOUT_SECONDS", "OUTBOX_CELERY_PUBLISH_TIMEOUT"):
        p.env.pop(name, None)
    worker = p.worker(events=False)  # starts: the default timeouts fit the default budget
    ids = [_enqueue(pipeline_dsn, n) for n in range(3)]
    wait_for(
        lambda: len(_rows(pipeline_dsn, "SELECT 1 FROM runs")) >= 3,
        timeout=60,
        what=f"three runs\n{worker.text()[-3000:]}",
    )
    wait_for(lambda: all(_status(pipeline_dsn, i) == "done" for i in ids), timeout=30, what="done")
    runs = _rows(pipeline_dsn, "SELECT n, task_id, is_eager FROM runs ORDER BY n")
    assert runs == [(n, f"outbox-{i}", False) for n, i in zip(range(3), ids)]


def test_the_timeout_error_says_which_setting_to_change_and_to_what(dsn: str) -> None:
    app = Celery("timeouts", broker="memory://", set_as_current=False)
    app.task(name="shop.charge_invoice", shared=False)(_noop)
    inst = outbox_relay.install(
        app,
        dsn=dsn,
        publisher="celery:shop.charge_invoice",
        celery_publish_timeout=4,
        beat=False,
    )
    with pytest.raises(ConfigError) as raised:
        inst.validate()
    text = str(raised.value)
    assert "may take 12s per publish" in text
    assert (
        "the Celery app's broker_connection_timeout 4 + 2 x OUTBOX_CELERY_PUBLISH_TIMEOUT 4" in text
    )
    assert "raise OUTBOX_PUBLISH_TIMEOUT_SECONDS to at least 12" in text
    assert "lower OUTBOX_CELERY_PUBLISH_TIMEOUT to at most 3" in text
    # And the advice works: either change alone starts.
    for fix in ({"celery_publish_timeout": 3}, {"publish_timeout_seconds": 12}):
        fixed = Celery("timeouts-fixed", broker="memory://", set_as_current=False)
        fixed.task(name="shop.charge_invoice", shared=False)(_noop)
        settings = {"celery_publish_timeout": 4, **fix}
        outbox_relay.install(
            fixed, dsn=dsn, publisher="celery:shop.charge_invoice", beat=False, **settings
        ).validate()


def test_own_broker_timeouts_are_carved_from_the_budget_and_checked() -> None:
    p = resolve_publisher(
        "celery:billing.charge",
        publish_timeout_seconds=10.0,
        celery_broker_url="redis://127.0.0.1:1/0",
    )
    assert isinstance(p, CeleryTaskPublisher)
    assert p.timeout_seconds == pytest.approx(10.0)
    with pytest.raises(ConfigError, match=r"add up to 12s .*OUTBOX_CELERY_CONNECT_TIMEOUT 4"):
        resolve_publisher(
            "celery:billing.charge",
            publish_timeout_seconds=10.0,
            celery_broker_url="redis://127.0.0.1:1/0",
            celery_connect_timeout="4",
            celery_publish_timeout="4",
        )
    with pytest.raises(ConfigError, match="celery_connect_timeout applies only"):
        resolve_publisher("celery:billing.charge", celery_connect_timeout=2)


# ------------------------------------------------------------------- item 5b
@pytest.mark.parametrize("given", ["task", "signature"])
def test_a_task_or_signature_publisher_is_sent_not_run_inline(pipeline_dsn, procs, given) -> None:
    """The relay worker and the task's worker are different processes; the task
    arrives through the broker, on its own queue, with the message's id."""
    queue = _queue()
    p = procs(
        pipeline_dsn,
        services.redis_url(),
        PIPELINE_PUBLISHER=given,
        PIPELINE_RECORD_QUEUE=queue,
        PIPELINE_APPLY_QUEUE=_queue(),
        **_relay_env(),
    )
    relay = p.worker(events=False)  # consumes the outbox queue, not the task's
    consumer = p.worker(events=False, args=("-Q", queue))
    relay_pids = pool_pids(relay)
    message_id = _enqueue(pipeline_dsn, 7)
    wait_for(
        lambda: _rows(pipeline_dsn, "SELECT 1 FROM runs"),
        timeout=60,
        what=lambda: f"the task ran\n{p.logs()}",
    )
    wait_for(lambda: _status(pipeline_dsn, message_id) == "done", timeout=30, what="done")
    [(n, tag, task_id, pid, hostname, is_eager, routing_key)] = _rows(
        pipeline_dsn, "SELECT n, tag, task_id, pid, hostname, is_eager, routing_key FROM runs"
    )
    assert (n, task_id, is_eager) == (7, f"outbox-{message_id}", False)
    assert routing_key == queue, "it came through the broker, on the task's own queue"
    assert hostname.startswith(f"w2-{p.tag}@"), "run by the task's worker, not the relay's"
    assert pid not in relay_pids and pid != relay.popen.pid
    assert tag == ("from-signature" if given == "signature" else None)
    assert "Task pipeline.record" in consumer.text()
    assert "pipeline.record" not in relay.text().split(" ready.", 1)[1]


def test_a_task_object_given_in_code_is_never_called(conn) -> None:
    ran: list[Any] = []
    app = Celery("inline-check", broker="memory://", set_as_current=False)
    app.conf.task_always_eager = True  # even then: sent, not run

    @app.task(name="inline.check", shared=False)
    def check(payload: Any) -> None:
        ran.append(payload)

    publisher = resolve_publisher(check, publish_timeout_seconds=10)
    assert isinstance(publisher, CeleryTaskPublisher) and publisher.task_name == "inline.check"
    with pytest.raises(ConfigError, match="canvas"):
        resolve_publisher(check.s() | check.s())
    message = Message(1, "outbox-1", "o", "1", "e", {"n": 1}, {}, 1, 1, None)
    with app.connection_for_write() as connection:
        queue = connection.SimpleQueue("celery")
        with pytest.warns(AlwaysEagerIgnored):  # Celery's own note: sent regardless
            publisher(message)
        got = queue.get(timeout=5)
        assert got.headers["id"] == "outbox-1" and got.headers["task"] == "inline.check"
        got.ack()
        queue.close()
    assert ran == []


# ------------------------------------------------------------------- item 5c
def test_a_misspelled_task_name_stops_the_worker_at_start(pipeline_dsn, procs) -> None:
    p = procs(
        pipeline_dsn,
        services.redis_url(),
        PIPELINE_PUBLISHER="celery:pipeline.recrod",
        PIPELINE_APPLY_QUEUE=_queue(),
    )
    worker = p.worker(ready=False, events=False)
    worker.popen.wait(60)
    assert worker.popen.returncode != 0
    text = worker.text()
    assert "OUTBOX_PUBLISHER: no task named 'pipeline.recrod' is registered" in text
    assert "did you mean 'pipeline.record'?" in text


def test_an_unknown_name_on_another_app_is_a_warning(dsn, caplog) -> None:
    app = Celery("relay-only", broker="memory://", set_as_current=False)
    app.task(name="billing.charge_invoice", shared=False)(_noop)
    inst = outbox_relay.install(
        app,
        dsn=dsn,
        publisher="celery:billing.charge_invoce",
        celery_broker_url="redis://127.0.0.1:6379/0",
        beat=False,
    )
    with caplog.at_level(logging.WARNING, logger="outbox_relay.celery"):
        inst.validate()
    assert "task 'billing.charge_invoce' is not registered in this process" in caplog.text
    assert "did you mean 'billing.charge_invoice'?" in caplog.text


# ------------------------------------------------------------------- item 5d
def test_flower_sees_the_outbox_row_never_the_payload(pipeline_dsn, procs) -> None:
    broker = services.redis_url()
    p = procs(
        pipeline_dsn,
        broker,
        PIPELINE_PUBLISHER="celery:pipeline.record",
        PIPELINE_APPLY_QUEUE=_queue(),
        **_relay_env(),
    )
    worker = p.worker()  # -E: sends task events, as for Flower
    ours = pool_pids(worker)  # the broker is shared: only our worker's events
    with EventTap(_client(broker)) as tap:
        message_id = _enqueue(pipeline_dsn, 3)
        wait_for(lambda: _rows(pipeline_dsn, "SELECT 1 FROM runs"), timeout=60, what="ran")
        task_id = f"outbox-{message_id}"
        received = wait_for(
            lambda: [
                e
                for e in tap.of_type("task-received")
                if e.get("uuid") == task_id and e.get("pid") in ours
            ],
            timeout=20,
            what="task-received",
        )
    assert received[0]["name"] == "pipeline.record"
    assert received[0]["args"] == f"(outbox #{message_id} v1)"
    assert received[0]["kwargs"] == "{}"
    assert "buyer3@example.com" not in repr(tap.events)
    [(argsrepr, outbox_id, version)] = _rows(
        pipeline_dsn, "SELECT argsrepr, outbox_id, lease_version FROM runs"
    )
    assert (argsrepr, outbox_id, version) == (f"(outbox #{message_id} v1)", message_id, 1)


def test_a_duplicate_delivery_reuses_the_task_id(pipeline_dsn, procs) -> None:
    """The same row sent under two leases: one task id, both versions visible."""
    broker = services.redis_url()
    queue = _queue()
    p = procs(pipeline_dsn, broker, PIPELINE_RECORD_QUEUE=queue, PIPELINE_APPLY_QUEUE=_queue())
    p.worker(events=False, args=("-Q", queue))
    publisher = CeleryTaskPublisher("pipeline.record", broker_url=broker, queue=queue)
    for version in (1, 2):
        publisher(
            Message(41, "order-41-paid", "o", "41", "e", {"n": 41}, {}, version, version, None)
        )
    wait_for(lambda: len(_rows(pipeline_dsn, "SELECT 1 FROM runs")) == 2, timeout=60, what="2")
    rows = _rows(pipeline_dsn, "SELECT task_id, argsrepr FROM runs ORDER BY lease_version")
    assert rows == [("order-41-paid", "(outbox #41 v1)"), ("order-41-paid", "(outbox #41 v2)")]


# ------------------------------------------------------------------- item 5e
def _recording_worker(dsn: str, procs: Any, broker: str, **env: str) -> Any:
    """The standalone app's worker publishing to tests.apps.recording."""
    from .apps.recording import DDL

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(DDL)
    p = procs(
        dsn,
        broker,
        app="outbox_relay.app",
        RECORDING_DSN=dsn,
        OUTBOX_PUBLISHER="tests.apps.recording:publish",
        OUTBOX_CLAIM_INTERVAL_SECONDS="1",
        **env,
    )
    return p.worker()


def _our_events(tap: EventTap, worker: Any, kind: str, message_id: int) -> list[dict[str, Any]]:
    """Wait for ``kind`` events about ``message_id`` from this worker's pool
    (the broker is shared: another test's worker may send the same kind)."""
    ours = pool_pids(worker)
    return wait_for(
        lambda: [
            e
            for e in tap.of_type(kind)
            if e.get("outbox_id") == message_id and e.get("pid") in ours
        ],
        timeout=60,
        what=f"{kind}\n{worker.text()[-3000:]}",
    )


def test_a_dead_letter_is_logged_and_sent_as_an_event(dsn, procs) -> None:
    broker = services.redis_url()
    worker = _recording_worker(dsn, procs, broker)
    with EventTap(_client(broker)) as tap:
        message_id = _enqueue(dsn, 9, {"fail": "permanent", "email": "x@example.com"})
        dead = _our_events(tap, worker, "task-outbox-dead", message_id)
    assert _status(dsn, message_id) == "dead"
    event = dead[0]
    assert event["lease_version"] == 1 and event["event_type"] == "order.paid"
    assert event["reason"].startswith("permanent: ")
    assert "receiver rejected the message (test)" in event["reason"]
    assert event["uuid"], "sent on behalf of the deliver task"
    line = next(x for x in worker.text().splitlines() if f"outbox message {message_id} " in x)
    # It names the outbox: two services' dead letters on one log stream.
    assert "ERROR" in line and "is dead after 1 attempt(s) in public.outbox: permanent:" in line
    assert "receiver rejected the message (test)" in line


def test_a_lease_lost_after_the_task_returned_is_sent_as_its_event(dsn, procs) -> None:
    """A single message's done is written by its process's completer after
    the deliver task returned; a lease found lost then is still reported in
    Flower, on behalf of that task."""
    broker = services.redis_url()
    # The task returns long before the completer's write.
    worker = _recording_worker(dsn, procs, broker, OUTBOX_FINALIZE_WINDOW_SECONDS="0.5")
    with EventTap(_client(broker)) as tap:
        message_id = _enqueue(dsn, 12, {"steal": True})
        lost = _our_events(tap, worker, "task-outbox-lost-lease", message_id)
        succeeded = [e for e in tap.of_type("task-succeeded") if e.get("uuid") == lost[0]["uuid"]]
    assert lost[0]["lease_version"] == 1
    assert lost[0]["uuid"], "sent on behalf of the deliver task"
    # The deliver task it names had returned before the completer wrote.
    assert succeeded and succeeded[0]["timestamp"] < lost[0]["timestamp"]
    # Not finished under the lost lease: the row waits for its new holder.
    assert _status(dsn, message_id) == "processing"
    assert "lost lease on outbox message" in worker.text()


def test_task_events_outside_a_task_are_only_logged(caplog) -> None:
    """The relay's observers in code that runs no task (the deliverer called
    directly, a shell): a dead letter is logged, no event is sent, nothing
    raises. Celery's ``current_task`` is a proxy there, never None."""
    events = TaskEvents()
    assert events.bound() is events  # nothing to bind to
    dead = Outcome.dead(LeaseRef(7, 2), error="HTTP 400")
    msg = Claimed(7, 2, 3, "order", "o-7", "order.created", {}, {})
    with caplog.at_level(logging.ERROR, logger="outbox_relay.celery"):
        events.finalized(msg, dead, 1.0)
        events.lost_lease(LeaseRef(7, 2), "finalize")
    assert "outbox message 7 v2 (order.created) is dead after 3 attempt(s)" in caplog.text


# -------------------------------------------------------------------- item 2
def test_inbox_task_defaults_are_the_safe_ones() -> None:
    app = Celery("inbox-defaults", broker="memory://", set_as_current=False)
    # The app's lossy settings do not reach an inbox task...
    app.conf.update(task_acks_late=False, task_reject_on_worker_lost=False)

    @app.task(base=InboxTask, name="d.safe", shared=False)
    def safe() -> None: ...

    # ...but the task's own options do.
    @app.task(base=InboxTask, name="d.mine", shared=False, acks_late=False)
    def mine() -> None: ...

    assert (safe.acks_late, safe.reject_on_worker_lost) == (True, True)
    assert safe.acks_on_failure_or_timeout is False
    assert getattr(safe, "acks_on_failure", False) is False  # Celery >= 5.5 reads this
    assert mine.acks_late is False


def _send_apply(
    broker: str, queue: str, task_id: str, declare: list[Any] | None = None, **kwargs: Any
) -> None:
    """A fresh broker message for ``pipeline.apply`` (``declare=[]``: leave the
    queue to the worker, which declares it with its dead-letter arguments)."""
    with contextlib.closing(_client(broker)) as client:
        client.send_task(
            "pipeline.apply", kwargs=kwargs, task_id=task_id, queue=queue, declare=declare
        )


def _count(dsn: str, table: str, key: str) -> int:
    return int(_rows(dsn, f"SELECT count(*) FROM {table} WHERE key = %s", (key,))[0][0])


def test_a_fresh_send_with_the_same_task_id_is_applied_once(pipeline_dsn, procs) -> None:
    broker = services.redis_url()
    queue = _queue()
    p = procs(pipeline_dsn, broker, PIPELINE_APPLY_QUEUE=queue)
    p.worker(events=False, args=("-Q", queue))
    for _ in range(2):  # two separate broker messages, one task id
        _send_apply(broker, queue, "pay-1", key="pay-1", amount=10)
    wait_for(lambda: _count(pipeline_dsn, "attempts", "pay-1") == 1, timeout=30, what="ran")
    time.sleep(2)  # the second message arrives and is skipped
    assert _count(pipeline_dsn, "effects", "pay-1") == 1
    inbox = _rows(pipeline_dsn, "SELECT message_id FROM outbox_inbox WHERE consumer = 'pipeline'")
    assert inbox == [("pay-1",)]
    # The body did not even start the second time: the inbox check comes first.
    assert _count(pipeline_dsn, "attempts", "pay-1") == 1


def _pid_of_first_attempt(dsn: str, key: str) -> int:
    rows = wait_for(
        lambda: _rows(dsn, "SELECT pid FROM attempts WHERE key = %s", (key,)),
        timeout=30,
        what=f"{key} started",
    )
    return int(rows[0][0])


def test_a_pool_process_killed_mid_body_is_redelivered_and_applied_once(
    pipeline_dsn, procs
) -> None:
    """Redis: reject_on_worker_lost gives the message back at once."""
    broker = services.redis_url()
    queue = _queue()
    p = procs(pipeline_dsn, broker, PIPELINE_APPLY_QUEUE=queue)
    worker = p.worker(events=False, args=("-Q", queue))
    _send_apply(broker, queue, "pay-2", key="pay-2", amount=20, sleep=30)
    pid = _pid_of_first_attempt(pipeline_dsn, "pay-2")
    time.sleep(0.5)  # inside the body, its effect written but not committed
    os.kill(pid, signal.SIGKILL)  # the pool child only, as the OOM killer would
    wait_for(
        lambda: _count(pipeline_dsn, "effects", "pay-2") == 1,
        timeout=60,
        what=f"redelivered\n{worker.text()[-3000:]}",
    )
    time.sleep(1)
    assert _count(pipeline_dsn, "attempts", "pay-2") == 2
    assert _count(pipeline_dsn, "effects", "pay-2") == 1
    [(effect_pid,)] = _rows(pipeline_dsn, "SELECT pid FROM effects WHERE key = 'pay-2'")
    assert effect_pid != pid


def test_a_whole_worker_killed_mid_body_is_redelivered_after_visibility_timeout(
    pipeline_dsn, procs
) -> None:
    """Redis: the unacked message comes back after the visibility timeout."""
    broker = services.redis_url()
    queue = _queue()
    p = procs(pipeline_dsn, broker, PIPELINE_APPLY_QUEUE=queue, PIPELINE_VISIBILITY_TIMEOUT="5")
    first = p.worker(events=False, args=("-Q", queue))
    _send_apply(broker, queue, "pay-3", key="pay-3", amount=30, sleep=60)
    _pid_of_first_attempt(pipeline_dsn, "pay-3")
    first.kill()  # the main process and its children at once: nobody rejects
    first.popen.wait(10)
    p.worker(events=False, args=("-Q", queue))
    wait_for(lambda: _count(pipeline_dsn, "effects", "pay-3") == 1, timeout=90, what="redelivered")
    time.sleep(1)
    assert _count(pipeline_dsn, "attempts", "pay-3") == 2
    assert _count(pipeline_dsn, "effects", "pay-3") == 1


@pytest.fixture
def amqp_url() -> str:
    url = services.amqp_url()
    if url is None:
        pytest.skip("RabbitMQ not configured: set OUTBOX_TEST_AMQP_URL")
    return url


def test_a_whole_worker_killed_mid_body_over_rabbitmq(pipeline_dsn, procs, amqp_url) -> None:
    """RabbitMQ gives an unacked message back when the connection drops."""
    queue = _queue()
    p = procs(pipeline_dsn, amqp_url, PIPELINE_APPLY_QUEUE=queue)
    first = p.worker(events=False, args=("-Q", queue))
    try:
        _send_apply(amqp_url, queue, "pay-4", key="pay-4", amount=40, sleep=60)
        _pid_of_first_attempt(pipeline_dsn, "pay-4")
        first.kill()
        first.popen.wait(10)
        p.worker(events=False, args=("-Q", queue))
        wait_for(
            lambda: _count(pipeline_dsn, "effects", "pay-4") == 1, timeout=60, what="redelivered"
        )
        time.sleep(1)
        assert _count(pipeline_dsn, "attempts", "pay-4") == 2
        assert _count(pipeline_dsn, "effects", "pay-4") == 1
    finally:
        _delete_queues(amqp_url, queue)


def _delete_queues(url: str, *names: str) -> None:
    from kombu import Connection

    with Connection(url, connect_timeout=5) as conn:
        channel = conn.channel()
        for name in names:
            with contextlib.suppress(Exception):
                channel.queue_delete(name)


def test_a_body_that_raises_is_dead_lettered_not_acked_over_rabbitmq(
    pipeline_dsn, procs, amqp_url
) -> None:
    """acks_on_failure_or_timeout=False: the failed message is rejected
    (requeue=False), so RabbitMQ moves it to the queue's dead-letter queue;
    nothing of the failed run remains, and replaying it applies it once."""
    from kombu import Connection

    queue = _queue()
    dead = f"{queue}.dead"
    with Connection(amqp_url, connect_timeout=5) as conn:
        conn.SimpleQueue(dead).close()  # declared before anything can be routed there
    p = procs(pipeline_dsn, amqp_url, PIPELINE_APPLY_QUEUE=queue, PIPELINE_DEAD_LETTER=dead)
    worker = p.worker(events=False, args=("-Q", queue))
    try:
        _send_apply(amqp_url, queue, "pay-5", declare=[], key="pay-5", amount=50, fail_first=True)
        with Connection(amqp_url, connect_timeout=5) as conn:
            dlq = conn.SimpleQueue(dead)
            message = dlq.get(timeout=30)
            assert message.headers["id"] == "pay-5"
            assert _count(pipeline_dsn, "effects", "pay-5") == 0, "rolled back with the run"
            assert _count(pipeline_dsn, "attempts", "pay-5") == 1, "not requeued in a loop"
            assert "the first run of pay-5 fails" in worker.text()
            # An operator replays it: same task id, now applied once.
            producer = conn.Producer()
            producer.publish(
                message.body,
                routing_key=queue,
                headers=message.headers,
                content_type=message.content_type,
                content_encoding=message.content_encoding,
            )
            message.ack()
            dlq.close()
        wait_for(lambda: _count(pipeline_dsn, "effects", "pay-5") == 1, timeout=30, what="replay")
        assert _count(pipeline_dsn, "attempts", "pay-5") == 2
    finally:
        _delete_queues(amqp_url, queue, dead)


def test_a_body_that_raises_over_redis_is_dropped_and_a_resend_applies(pipeline_dsn, procs) -> None:
    """Redis has no dead-lettering: a rejected message is gone (as if acked),
    but its run left nothing behind, so a re-send with the same id applies."""
    broker = services.redis_url()
    queue = _queue()
    p = procs(pipeline_dsn, broker, PIPELINE_APPLY_QUEUE=queue, PIPELINE_VISIBILITY_TIMEOUT="3")
    worker = p.worker(events=False, args=("-Q", queue))
    _send_apply(broker, queue, "pay-6", key="pay-6", amount=60, fail_first=True)
    wait_for(lambda: "the first run of pay-6 fails" in worker.text(), timeout=30, what="failed")
    time.sleep(5)  # past the visibility timeout: not redelivered
    assert _count(pipeline_dsn, "attempts", "pay-6") == 1
    assert _count(pipeline_dsn, "effects", "pay-6") == 0
    _send_apply(broker, queue, "pay-6", key="pay-6", amount=60, fail_first=True)
    wait_for(lambda: _count(pipeline_dsn, "effects", "pay-6") == 1, timeout=30, what="re-sent")
    assert _count(pipeline_dsn, "attempts", "pay-6") == 2


# ---------------------------------------------------------------------- docs
DOCS = Path(__file__).resolve().parent.parent / "docs" / "publishers.md"


@pytest.mark.parametrize(
    "section", ["## A task of your own Celery pipeline", "### Celery consumer tasks"]
)
def test_the_python_examples_of_the_docs_run_as_written(section: str, tmp_path: Path) -> None:
    text = DOCS.read_text()
    body = text[text.index(section) + len(section) :]
    nxt = min(i for i in (body.find("\n## "), body.find("\n### ")) if i >= 0)
    blocks = [b.split("```", 1)[0] for b in body[:nxt].split("```python\n")[1:]]
    assert blocks, f"no Python example under {section!r}"
    for n, block in enumerate(blocks):
        # In a fresh interpreter, as a reader runs it: the examples' tasks are
        # shared Celery tasks, and run in this process they were registered
        # into every app the later tests made (DuplicateTaskNameWarning).
        script = tmp_path / f"example_{n}.py"
        script.write_text(block)
        done = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, f"{section}, example {n}:\n{done.stderr}"
