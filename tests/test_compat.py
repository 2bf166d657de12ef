"""The work-arounds in outbox_relay/celery/compat.py, on a real Redis server.

Each test replays, step by step, what Celery's worker does, so that it fails
with the defect when the work-around is off, and says so when upstream has
fixed it (then the work-around can go).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import kombu
import pytest
import redis.exceptions
from kombu.transport import redis as redis_transport

from outbox_relay.celery.compat import harden_redis_transport


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
