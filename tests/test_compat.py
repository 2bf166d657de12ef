"""The work-arounds in outbox_relay/celery/compat.py, on a real Redis server.

Each test replays, step by step, what Celery's worker does, so that it fails
with the defect when the work-around is off, and says so when upstream has
fixed it (then the work-around can go).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import kombu
import pytest
import redis.exceptions
from kombu.transport import redis as redis_transport

from outbox_relay.celery.compat import harden_redis_transport, reuse_redis_clients

from . import services
from .apps import kit
from .celery_procs import CeleryProcs, pool_pids


@contextmanager
def _original_transport() -> Iterator[None]:
    """The transport as kombu ships it, for the duration of the block."""
    current = redis_transport.Channel._connparams
    redis_transport.Channel._connparams = getattr(current, "__wrapped__", current)
    try:
        yield
    finally:
        redis_transport.Channel._connparams = current


def _recover_after_broker_died_in_brpop(url: str, owned_redis: Any) -> None:
    """What the worker does when Redis dies under it: its connection has the
    consumer's channel waiting in BRPOP and another channel (the remote-control
    one, say) holding an unacknowledged message. Celery's consumer
    (``on_connection_error_after_connected``) then runs collect(), then close()."""
    connection = kombu.Connection(url, transport_options={"socket_timeout": 5})
    tasks = kombu.Queue("compat-tasks", routing_key="compat-tasks")
    other = kombu.Queue("compat-other", routing_key="compat-other")
    with connection.Producer() as producer:
        producer.publish({"n": 1}, routing_key="compat-tasks", declare=[tasks, other])
        producer.publish({"n": 2}, routing_key="compat-other")
    channel = connection.default_channel
    received: list[Any] = []
    kombu.Consumer(channel, [tasks], callbacks=[lambda b, m: received.append(m)]).consume()
    connection.drain_events(timeout=5)
    assert received, "the consumer holds an unacknowledged message"
    second = connection.channel()
    assert second.basic_get("compat-other", no_ack=False) is not None
    channel._brpop_start()  # what the event loop leaves pending between messages
    owned_redis.stop()
    with suppress(Exception):  # Celery ignores any error here
        connection.collect()
    # Celery then closes the connection, ignoring connection errors only.
    with suppress(*connection.connection_errors):
        connection.close()


def test_a_redis_outage_in_brpop_is_a_connection_error_not_a_crash(owned_redis: Any) -> None:
    harden_redis_transport()
    # Hardened: nothing but connection errors, so Celery reconnects.
    _recover_after_broker_died_in_brpop(owned_redis.url, owned_redis)

    owned_redis.start()
    with _original_transport():
        try:
            _recover_after_broker_died_in_brpop(owned_redis.url, owned_redis)
        except AttributeError as exc:
            # The defect the work-around answers: with it, the worker would
            # have logged "Unrecoverable error" and exited.
            assert "hostname" in str(exc)
        else:
            pytest.fail(
                "kombu no longer crashes closing a collected Redis connection: "
                "harden_redis_transport can be removed"
            )


def test_hardening_is_idempotent_and_keeps_live_connections_working(owned_redis: Any) -> None:
    harden_redis_transport()
    assert harden_redis_transport() is False  # already in place
    with kombu.Connection(owned_redis.url) as connection:
        queue = connection.SimpleQueue("compat-live")
        queue.put({"ok": True})
        message = queue.get(timeout=5)
        assert message.payload == {"ok": True}
        message.ack()
        queue.close()
    with pytest.raises(redis.exceptions.ConnectionError):
        channel: Any = redis_transport.Channel.__new__(redis_transport.Channel)
        channel.connection = type("Detached", (), {"client": None})()
        channel._connparams()


@contextmanager
def _counting_redis_clients() -> Iterator[list[int]]:
    """Counts every ``redis.Redis`` built inside the block."""
    built = [0]
    original = redis.Redis.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        built[0] += 1
        original(self, *args, **kwargs)

    redis.Redis.__init__ = counting  # type: ignore[method-assign]
    try:
        yield built
    finally:
        redis.Redis.__init__ = original  # type: ignore[method-assign]


def _take_and_ack(url: str, queue_name: str, n: int) -> tuple[int, int]:
    """Publish ``n`` messages, take and acknowledge each the way a worker does
    (unacked bookkeeping on); return (Redis clients built, messages left unacked)."""
    with kombu.Connection(url) as connection:
        queue = kombu.Queue(queue_name, routing_key=queue_name)
        with connection.Producer() as producer:
            for i in range(n):
                producer.publish({"n": i}, routing_key=queue_name, declare=[queue])
        taken: list[Any] = []
        consumer = kombu.Consumer(
            connection.default_channel, [queue], callbacks=[lambda b, m: taken.append(m)]
        )
        consumer.qos(prefetch_count=1)
        consumer.consume()
        with _counting_redis_clients() as built:
            while len(taken) < n:
                connection.drain_events(timeout=5)
                taken[-1].ack()
        unacked = connection.default_channel.client.hlen("unacked")
        consumer.cancel()
    return built[0], int(unacked)


def test_a_channel_reuses_its_redis_client_for_every_ack(owned_redis: Any) -> None:
    with _original_reuse():
        built, unacked = _take_and_ack(owned_redis.url, "compat-acks-before", 20)
    # kombu as shipped: a new client to record each message unacked and to ack it.
    assert built >= 20, "kombu no longer builds a client per ack: reuse_redis_clients can go"
    assert unacked == 0
    reuse_redis_clients()
    assert reuse_redis_clients() is False  # already in place
    built, unacked = _take_and_ack(owned_redis.url, "compat-acks-after", 20)
    assert built <= 1
    assert unacked == 0, "every acknowledged message left the unacked hash"


def test_a_reused_client_follows_its_channel_to_a_new_pool(owned_redis: Any) -> None:
    reuse_redis_clients()
    with kombu.Connection(owned_redis.url) as connection:
        channel: Any = connection.default_channel
        first = channel._create_client()
        assert channel._create_client() is first
        channel._pool = None  # what kombu does when the channel reconnects
        second = channel._create_client()
        assert second is not first and second.connection_pool is channel.pool
        assert second.ping()


@contextmanager
def _original_reuse() -> Iterator[None]:
    current = redis_transport.Channel._create_client
    redis_transport.Channel._create_client = getattr(current, "__wrapped__", current)
    try:
        yield
    finally:
        redis_transport.Channel._create_client = current


@pytest.mark.celery
def test_a_late_soft_time_limit_leaves_an_idle_pool_process_alone(dsn: str, tmp_path: Path) -> None:
    """A soft time limit that fires after its task ended (the worker's event
    loop was blocked by a cut broker link) reaches a pool process between
    tasks. billiard raised it there: an idle process died, one writing to
    its pipe left the main process a torn message ("Unrecoverable error:
    UnpicklingError"), and the worker exited. It is ignored there now, and a
    soft limit that fires during a task still interrupts it."""
    kit.prepare_receiver(dsn)
    procs = CeleryProcs(
        {
            "OUTBOX_DSN": dsn,
            "CELERY_BROKER_URL": services.redis_url(),
            "OUTBOX_QUEUE": kit.unique("outbox-late-soft-limit"),
            "OUTBOX_PUBLISHER": "tests.apps.receiver:hang_once",
            "RECEIVER_DSN": dsn,
            "OUTBOX_LEASE_SECONDS": "6",
            "OUTBOX_PUBLISH_TIMEOUT_SECONDS": "1",
            "OUTBOX_CLAIM_INTERVAL_SECONDS": "1",
        },
        tmp_path,
    )
    try:
        worker = procs.worker(concurrency=1)
        # Idle: the claim a starting worker sends itself has run.
        kit.wait_until(
            lambda: "outbox_relay.claim" in worker.text() and "succeeded" in worker.text(),
            timeout=15,
            what="the start-up claim",
        )
        (child,) = pool_pids(worker) - {worker.popen.pid}
        for _ in range(20):
            os.kill(child, signal.SIGUSR1)
            time.sleep(0.02)
        time.sleep(1.0)
        assert child in pool_pids(worker), worker.text()[-3000:]
        assert "SoftTimeLimitExceeded" not in worker.text(), worker.text()[-3000:]

        procs.beat()
        (message_id,) = kit.enqueue(dsn, 1, threads=1, per_transaction=1)
        # hang_once sleeps for an hour in the first publish: the delivery's
        # soft time limit interrupts it, and a later lease delivers the row.
        kit.wait_until(
            lambda: message_id in kit.delivered_ids(dsn), timeout=60, what="the delivery"
        )
        assert "SoftTimeLimitExceeded" in worker.text(), worker.text()[-3000:]
        assert "Pool process" not in worker.text(), worker.text()[-3000:]
        assert worker.alive()
    finally:
        procs.stop_all()
