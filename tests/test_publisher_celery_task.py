"""The Celery-task publisher feeding a REAL consumer worker that uses the inbox.

The relay sends ``consumer.record_effect`` with task_id = idempotency key;
a ``celery -A tests.apps.consumer worker`` subprocess (prefork, two
processes) runs it on InboxTask. Every message is delivered, one of them
twice on purpose (a lease lost mid-publish), and the consumer's effect
happens exactly once per message.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

import outbox_relay
from outbox_relay import RetryPolicy, dispatch_once, store
from outbox_relay.publishers import CeleryTaskPublisher, resolve_publisher

from . import services

ROOT = Path(__file__).resolve().parent.parent
CONSUMER_TABLES = """
CREATE TABLE effects (
    message_id text NOT NULL,
    task_id    text NOT NULL,
    amount     int  NOT NULL,
    event_type text
);
CREATE TABLE arrivals (task_id text NOT NULL, task text NOT NULL);
"""


@dataclass
class Consumer:
    broker_url: str
    queue: str
    dsn: str


def _wait_ready(proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the consumer worker exited early:\n{log.read_text()[-3000:]}")
        if " ready." in log.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise RuntimeError(f"the consumer worker did not get ready:\n{log.read_text()[-3000:]}")


@pytest.fixture
def consumer(dsn: str, tmp_path: Path) -> Iterator[Consumer]:
    """A real consumer worker on its own queue; its database is this test's database."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(CONSUMER_TABLES)
    broker_url = services.redis_url()
    queue = f"consumer-{uuid.uuid4().hex[:10]}"
    log = tmp_path / "worker.log"
    env = {
        **os.environ,
        "CONSUMER_BROKER_URL": broker_url,
        "CONSUMER_DSN": dsn,
        "CONSUMER_QUEUE": queue,
        "PYTHONPATH": str(ROOT),
    }
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "tests.apps.consumer",
        "worker",
        "--pool",
        "prefork",
        "--concurrency",
        "2",
        "--queues",
        queue,
        "--hostname",
        f"{queue}@%h",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "--loglevel",
        "INFO",
    ]
    with log.open("wb") as out:
        # A session of its own, so the finalizer can stop the worker and its
        # pool children (and nothing else) by process group.
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_ready(proc, log)
        yield Consumer(broker_url, queue, dsn)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)


def _wait_for(conn: psycopg.Connection, query: str, expected: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    count = -1
    while time.monotonic() < deadline:
        row = conn.execute(query).fetchone()
        count = int(row[0]) if row else 0
        if count >= expected:
            return
        time.sleep(0.1)
    raise AssertionError(f"{query!r} reached {count}, expected {expected}")


def _enqueue(conn: psycopg.Connection, amount: int, **extra: Any) -> int:
    return outbox_relay.enqueue(
        conn,
        aggregate_type="invoice",
        aggregate_id=f"inv-{amount}",
        event_type="invoice.paid",
        payload={"amount": amount},
        **extra,
    )


@pytest.mark.celery
def test_each_message_has_exactly_one_effect_even_when_delivered_twice(
    consumer: Consumer,
) -> None:
    publisher = CeleryTaskPublisher(
        "consumer.record_effect", broker_url=consumer.broker_url, queue=consumer.queue
    )
    policy = RetryPolicy(max_attempts=5, backoff_base=0.0)
    with psycopg.connect(consumer.dsn, autocommit=True) as conn:
        ids = [_enqueue(conn, 10), _enqueue(conn, 20), _enqueue(conn, 30, operation_key="pay-30")]
        assert (
            dispatch_once(
                conn, publisher, owner="relay-1", lease=timedelta(seconds=30), policy=policy
            )
            == 3
        )

        # Message 4 is delivered twice: worker A publishes, stalls past its
        # lease, worker B re-claims and publishes again, A's finalize is fenced off.
        twice = _enqueue(conn, 40)
        [held_by_a] = store.claim(conn, owner="A", batch=1, lease=timedelta(seconds=30))
        assert held_by_a.id == twice
        publisher(held_by_a.to_message())
        later = conn.execute("SELECT now() + interval '31 seconds'").fetchone()[0]
        [held_by_b] = store.claim(conn, owner="B", batch=1, lease=timedelta(seconds=60), now=later)
        assert (held_by_b.id, held_by_b.lease_version) == (twice, held_by_a.lease_version + 1)
        relay = outbox_relay.Deliverer(
            publisher, db=outbox_relay.DirectDatabase(conn), policy=policy, publish_timeout=5.0
        )
        report = relay.deliver([held_by_b.ref])
        assert report.done == 1
        assert store.mark_done(conn, held_by_a) is False  # A's lease is lost

        # Message 5: the same task twice *at once*, so both worker processes
        # may run it concurrently; the inbox still lets one through.
        racing = _enqueue(conn, 50)
        [msg] = store.claim(conn, owner="C", batch=1, lease=timedelta(seconds=30))
        publisher(msg.to_message())
        publisher(msg.to_message())
        assert store.mark_done(conn, msg)

        all_ids = [*ids, twice, racing]
        for message_id in all_ids:
            assert store.get_row(conn, message_id)["status"] == "done"  # type: ignore[index]

        # 5 messages, 7 task deliveries: every one arrives, 5 have an effect.
        _wait_for(conn, "SELECT count(*) FROM arrivals", 7)
        _wait_for(conn, "SELECT count(*) FROM outbox_inbox WHERE consumer = 'billing'", 5)
        time.sleep(0.5)  # let any (wrong) extra effect land before counting
        effects = conn.execute(
            "SELECT message_id, task_id, amount, event_type FROM effects ORDER BY amount"
        ).fetchall()
        keys = [f"outbox-{ids[0]}", f"outbox-{ids[1]}", "pay-30", f"outbox-{twice}"]
        keys.append(f"outbox-{racing}")
        assert [row[0] for row in effects] == keys
        assert [row[1] for row in effects] == keys, "task_id is the idempotency key"
        assert [row[2] for row in effects] == [10, 20, 30, 40, 50]
        assert {row[3] for row in effects} == {"invoice.paid"}, "outbox headers reach the task"
        arrivals = conn.execute(
            "SELECT task_id, count(*) FROM arrivals GROUP BY task_id ORDER BY task_id"
        ).fetchall()
        assert dict(arrivals)[f"outbox-{twice}"] == 2
        assert dict(arrivals)[f"outbox-{racing}"] == 2


@pytest.mark.celery
def test_whole_message_as_keyword_arguments(consumer: Consumer) -> None:
    publisher = resolve_publisher(
        {"task": "consumer.record_message", "broker_url": consumer.broker_url},
        celery_queue=consumer.queue,
        celery_args_from="message",
        publish_timeout_seconds=6.0,
    )
    assert isinstance(publisher, CeleryTaskPublisher)
    assert publisher.args_from == "message" and publisher.timeout_seconds <= 6.0
    with psycopg.connect(consumer.dsn, autocommit=True) as conn:
        message_id = _enqueue(conn, 7, operation_key="audit-7")
        dispatch_once(conn, publisher, owner="relay", lease=timedelta(seconds=30))
        _wait_for(conn, "SELECT count(*) FROM effects", 1)
        row = conn.execute("SELECT message_id, task_id, event_type FROM effects").fetchone()
        assert row == ("audit-7", str(message_id), "invoice.paid")


def test_broker_down_is_retryable(conn: psycopg.Connection) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    publisher = CeleryTaskPublisher(
        "consumer.record_effect", broker_url=f"redis://127.0.0.1:{port}/0", publish_timeout=1.0
    )
    message_id = _enqueue(conn, 1)
    started = time.monotonic()
    dispatch_once(conn, publisher, owner="relay", lease=timedelta(seconds=30), publish_timeout=3)
    assert time.monotonic() - started < 10
    row = store.get_row(conn, message_id)
    assert row is not None
    assert (row["status"], row["attempts"]) == ("pending", 1)
    assert row["last_error"].startswith("retryable: RetryableError: task consumer.record_effect")


def test_its_broker_url_wins_over_the_relays_broker_in_the_environment(
    conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Celery reads CELERY_BROKER_URL (and CELERY_BROKER_WRITE_URL) from the
    environment before any app's own broker, and the relay's worker is
    started with it (the README's standalone app): a task meant for another
    service's broker went, without a word, to the relay's own."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        relay_broker = f"redis://127.0.0.1:{s.getsockname()[1]}/0"  # nobody listens
    monkeypatch.setenv("CELERY_BROKER_URL", relay_broker)
    monkeypatch.setenv("CELERY_BROKER_WRITE_URL", relay_broker)
    url = services.redis_url()
    queue = f"their-broker-{uuid.uuid4().hex[:8]}"
    publisher = CeleryTaskPublisher("consumer.record_effect", broker_url=url, queue=queue)
    message_id = _enqueue(conn, 7)
    dispatch_once(conn, publisher, owner="relay", lease=timedelta(seconds=30), publish_timeout=3)
    row = store.get_row(conn, message_id)
    assert row is not None
    assert row["status"] == "done", row["last_error"]
    # Read with kombu itself, which no Celery environment variable redirects.
    import kombu

    with kombu.Connection(url) as there:
        channel = there.default_channel
        assert channel.queue_declare(queue=queue, passive=True).message_count == 1
        channel.queue_purge(queue)


def test_an_app_of_its_own_keeps_the_worker_apps_pool_limit() -> None:
    """kombu keeps one connection-pool limit per process, reset by each app's
    first use of its pool; a pool in use that the reset would shrink raises
    ("Can't shrink pool when in use"). With a broker_url the publisher sends
    through an app of its own: it takes the process app's limit (a worker's
    own app, here with broker_pool_limit=3), so neither first use resizes
    the other's pool."""
    from celery import Celery, current_app

    url = services.redis_url()
    queue = f"pool-limit-{uuid.uuid4().hex[:8]}"
    previous = current_app._get_current_object()
    worker_app = Celery("worker-limit", broker=url, set_as_current=True)
    worker_app.conf.broker_pool_limit = 3
    publisher = CeleryTaskPublisher("consumer.record_effect", broker_url=url, queue=queue)
    try:
        assert publisher.app.conf.broker_pool_limit == 3
        with publisher.app.connection_or_acquire():  # a publish under way
            # The worker app's first send in this process.
            worker_app.send_task("consumer.record_effect", args=(1,), queue=queue)
        assert services.queued(worker_app, queue) == 1
    finally:
        services.queued(worker_app, queue, purge=True)
        previous.set_current()
        worker_app.close()


def test_rabbitmq_queue_declared_with_other_arguments_says_what_to_do() -> None:
    """A consumer queue with a dead-letter exchange in its queue arguments (as
    the Celery consumer tasks section suggests) and a publisher that sends to
    it by name through another service's broker: RabbitMQ refuses the send's
    declaration. Retried (the message goes through once they agree), and
    last_error says what to change, not only RabbitMQ's PRECONDITION_FAILED."""
    from kombu import Connection, Exchange, Queue

    url = services.amqp_url()
    if url is None:
        pytest.skip("RabbitMQ is not available: set OUTBOX_TEST_AMQP_URL=amqp://user:pass@host//")
    queue = f"consumer-dlx-{uuid.uuid4().hex[:10]}"
    with Connection(url, connect_timeout=5) as broker:
        Queue(
            queue,
            Exchange(queue, type="direct"),
            routing_key=queue,
            queue_arguments={"x-dead-letter-exchange": f"{queue}.dlx"},
        )(broker.channel()).declare()
    publisher = CeleryTaskPublisher("consumer.record_effect", broker_url=url, queue=queue)
    message = outbox_relay.Message(
        id=1,
        idempotency_key="outbox-1",
        aggregate_type="invoice",
        aggregate_id="inv-1",
        event_type="invoice.paid",
        payload={"amount": 1},
        headers={},
        attempts=1,
        lease_version=1,
        created_at=None,
    )
    try:
        with pytest.raises(outbox_relay.RetryableError) as raised:
            publisher(message)
        text = str(raised.value)
        assert "PRECONDITION_FAILED" in text
        assert f"queue '{queue}' exists with another x-dead-letter-exchange" in text
        assert "RabbitMQ policy" in text
        assert "celery_app" in text
    finally:
        publisher.app.close()
        with Connection(url, connect_timeout=5) as broker:
            broker.channel().queue_delete(queue)
