"""Two relays on one broker queue: each sends the other's tasks back.

Two services with databases of their own, one Redis database and the default
queue name: the most likely way to get this wrong. The relay's tasks carry
only ``(id, lease_version)``, so a delivery that landed on the other relay
matched no lease there and was skipped as stale; its row waited out its
lease and was sent again, maybe to the wrong relay again (seen: nine leases).
Every relay task now carries the relay's identity in a header, and a worker
sends another relay's task back to the queue without running it, and logs
an error naming the fix.

Here the lease (60 s) is longer than the test's deadline: a delivery skipped
by the wrong relay would leave its row waiting past it. Every row must be
delivered under its first lease, exactly once, and each relay's log must
say what to change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

import outbox_relay

from . import services
from .apps import kit
from .celery_procs import CeleryProcs, standalone_relay

pytestmark = [pytest.mark.celery, pytest.mark.slow]

MESSAGES = 40
LEASE = 60.0


def _relay(dsn: str, tmp_path: Path, broker: str, queue: str, **env: str) -> CeleryProcs:
    folder = tmp_path / kit.unique("relay")
    folder.mkdir()
    return standalone_relay(dsn, folder, broker, queue, OUTBOX_LEASE_SECONDS=str(LEASE), **env)


@pytest.fixture(params=["redis", "rabbitmq"])
def broker(request: pytest.FixtureRequest) -> Iterator[str]:
    """Redis, and RabbitMQ as most Celery teams run it (where the walkthrough
    that found this saw it)."""
    if request.param == "redis":
        yield services.redis_url()
        return
    url = services.amqp_url()
    if url is None:
        pytest.skip("RabbitMQ not configured: set OUTBOX_TEST_AMQP_URL to run the AMQP tests")
    yield url


def _drop_queue(url: str, queue: str) -> None:
    if url.startswith("amqp"):
        from kombu import Connection

        with Connection(url, connect_timeout=5) as conn, contextlib.suppress(Exception):
            conn.channel().queue_delete(queue)


def _leases(dsn: str) -> dict[int, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return dict(conn.execute("SELECT id, lease_version FROM outbox").fetchall())


def _publishes(dsn: str) -> dict[int, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT message_id, count(*) FROM received GROUP BY message_id")
        return {int(i): int(n) for i, n in rows.fetchall()}


def test_two_relays_on_one_queue_deliver_every_row_under_its_first_lease(
    dsn: str, fresh_database: str, broker: str, tmp_path: Path
) -> None:
    other = fresh_database
    with psycopg.connect(other, autocommit=True) as conn:
        outbox_relay.migrate(conn)
    for db in (dsn, other):
        kit.prepare_receiver(db)
    queue = kit.unique("outbox-shared")
    # One relay per message, the other in chunks: time limits and the
    # drain's marker travel with a task that is sent back.
    first = _relay(dsn, tmp_path, broker, queue)
    second = _relay(other, tmp_path, broker, queue, OUTBOX_CHUNK_SIZE="10")
    try:
        for procs in (first, second):
            procs.worker(concurrency=2)
            procs.beat()
        ids = {db: kit.enqueue(db, MESSAGES) for db in (dsn, other)}
        kit.wait_until(
            lambda: (
                kit.status_counts(dsn) == {"done": MESSAGES}
                and kit.status_counts(other) == {"done": MESSAGES}
            ),
            timeout=LEASE - 8,
            describe=lambda: (kit.status_counts(dsn), kit.status_counts(other)),
            what="both relays' rows delivered within their first lease",
        )
        for db in (dsn, other):
            assert set(_leases(db).values()) == {1}, _leases(db)  # never leased again
            assert _publishes(db) == {i: 1 for i in ids[db]}  # each published once
        # Relay tasks went round-robin to both relays' workers; whoever took
        # the other's says which relay it was and what to change.
        logs = "".join(p.text() for p in [*first.procs, *second.procs])
        assert "task(s) of another relay" in logs, logs[-3000:]
        assert "Give each relay a queue of its own (OUTBOX_QUEUE" in logs
    finally:
        first.stop_all()
        second.stop_all()
        _drop_queue(broker, queue)


def test_the_identity_is_the_databases_not_the_dsns(dsn: str, fresh_database: str) -> None:
    """Every worker of one relay must agree whatever DSN it was given (a host
    name or an address, a pooler): they would send each other's tasks back.
    Another database, even with the same table, differs."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    from outbox_relay import store
    from outbox_relay.celery.identity import identity_of
    from outbox_relay.table import OutboxTable

    with psycopg.connect(fresh_database, autocommit=True) as conn:
        outbox_relay.migrate(conn)
    host = conninfo_to_dict(dsn).get("host")
    other_name = "localhost" if host == "127.0.0.1" else host
    table = OutboxTable.parse(None)
    seen = []
    aliased = make_conninfo(dsn, host=other_name, application_name="x")
    for conninfo in (dsn, aliased, fresh_database):
        with psycopg.connect(conninfo, autocommit=True) as conn:
            found = store.relay_identity(conn)
        assert found is not None
        seen.append(identity_of(found[0], table, found[1]))
    assert seen[0] == seen[1]
    assert seen[0] != seen[2]
    assert seen[0].startswith(f"{conninfo_to_dict(dsn)['dbname']}/public.outbox/")
