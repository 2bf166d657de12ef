"""The Celery relay end to end: real worker and beat processes, real brokers.

Every test enqueues messages in business transactions, runs real
``celery -A outbox_relay.app worker``/``beat`` processes, and reads what the
publisher really did from the ``published`` table (tests/apps/recording.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import psycopg
import pytest

import outbox_relay
from outbox_relay import NewMessage

from . import services
from .apps import kit
from .apps.recording import DDL
from .celery_procs import CeleryProcs, counts, pool_pids, wait_for

pytestmark = pytest.mark.celery


@pytest.fixture
def redis_broker() -> Iterator[str]:
    """A Redis server of this test's own: a clean queue, and free to flush."""
    from .faults.servers import OwnedRedis

    server = OwnedRedis()
    try:
        yield server.url
    finally:
        server.close()


@pytest.fixture
def amqp_broker() -> Iterator[str]:
    url = services.amqp_url()
    if url is None:
        pytest.skip("RabbitMQ not configured: set OUTBOX_TEST_AMQP_URL to run the AMQP tests")
    from kombu import Connection

    with Connection(url, connect_timeout=5) as conn:
        try:
            conn.ensure_connection(max_retries=1)
        except Exception as exc:  # pragma: no cover - depends on the machine
            pytest.skip(f"RabbitMQ at {url} unreachable: {exc}")
        channel = conn.channel()
        # Start from an empty queue: tasks from an earlier run are not ours.
        with contextlib.suppress(Exception):
            channel.queue_purge("outbox")
    yield url


@pytest.fixture
def recorded_dsn(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(DDL)
    return dsn


def make_procs(dsn: str, broker: str, tmp_path: Path, **settings: Any) -> CeleryProcs:
    env = {
        "OUTBOX_DSN": dsn,
        "RECORDING_DSN": dsn,
        "CELERY_BROKER_URL": broker,
        "OUTBOX_PUBLISHER": "tests.apps.recording:publish",
        "OUTBOX_LEASE_SECONDS": "20",
        "OUTBOX_PUBLISH_TIMEOUT_SECONDS": "5",
        "OUTBOX_CLAIM_INTERVAL_SECONDS": "1",
        "OUTBOX_BACKOFF_BASE_SECONDS": "0.05",
        "OUTBOX_BACKOFF_CAP_SECONDS": "0.5",
    }
    env.update({f"OUTBOX_{k.upper()}": str(v) for k, v in settings.items()})
    return CeleryProcs(env, tmp_path)


@pytest.fixture
def procs_factory(tmp_path: Path) -> Iterator[Any]:
    made: list[CeleryProcs] = []

    def factory(dsn: str, broker: str, **settings: Any) -> CeleryProcs:
        procs = make_procs(dsn, broker, tmp_path, **settings)
        made.append(procs)
        return procs

    yield factory
    for procs in made:
        procs.stop_all()


def enqueue_orders(dsn: str, n: int, *, threads: int = 4, payload: Any = None) -> list[int]:
    """Business transactions: each writes an order row and its outbox event together."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS orders (id bigint PRIMARY KEY, total int)")
    ids: list[int] = []
    lock = threading.Lock()

    def produce(start: int) -> None:
        with psycopg.connect(dsn) as conn:
            for i in range(start, n, threads):
                with conn.transaction():
                    conn.execute("INSERT INTO orders VALUES (%s, %s)", (i, i * 10))
                    message_id = outbox_relay.enqueue(
                        conn,
                        aggregate_type="order",
                        aggregate_id=i,
                        event_type="order.created",
                        payload=payload if payload is not None else {"order": i},
                    )
                with lock:
                    ids.append(message_id)

    workers = [threading.Thread(target=produce, args=(t,)) for t in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return sorted(ids)


def published(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            "SELECT message_id, idempotency_key, lease_version, aggregate_id, seq"
            " FROM published ORDER BY seq"
        ).fetchall()


def all_done(dsn: str, n: int) -> Any:
    c = counts(dsn)
    return c if c.get("done", 0) + c.get("dead", 0) == n and not c.get("pending") else None


# --------------------------------------------------------------------------- scenarios
def test_thousands_delivered_with_two_workers_and_beat(recorded_dsn, redis_broker, procs_factory):
    procs = procs_factory(recorded_dsn, redis_broker)
    procs.worker(concurrency=2)
    procs.worker(concurrency=2)
    procs.beat()
    ids = enqueue_orders(recorded_dsn, 3000)
    wait_for(lambda: all_done(recorded_dsn, 3000), timeout=120, what="3000 messages done")
    assert counts(recorded_dsn) == {"done": 3000}
    rows = published(recorded_dsn)
    seen = {r[0] for r in rows}
    assert seen == set(ids)
    # Each message's stable idempotency key reached the publisher.
    keys = {r[0]: r[1] for r in rows}
    assert all(keys[i] == f"outbox-{i}" for i in ids)
    # No lease expired in this run, so the fence leaves no room for duplicates.
    assert len(rows) == len(seen), procs.logs()


def test_chunked_mode_over_rabbitmq(recorded_dsn, amqp_broker, procs_factory):
    # A queue of its own: the next test uses the default "outbox" on the same
    # vhost, and tasks a stopping worker had prefetched go back to the queue
    # when its connection closes, after that test's purge (CI, 2026-12-06:
    # 2000 messages, a loaded machine; the next test's deliveries waited
    # behind this one's stale chunks until their leases ran out).
    queue = kit.unique("outbox-chunked")
    procs = procs_factory(recorded_dsn, amqp_broker, chunk_size=50, batch_size=200, queue=queue)
    procs.worker(concurrency=2)
    procs.beat()
    ids = enqueue_orders(recorded_dsn, 2000)
    wait_for(lambda: all_done(recorded_dsn, 2000), timeout=120, what="2000 messages done")
    assert counts(recorded_dsn) == {"done": 2000}
    assert {r[0] for r in published(recorded_dsn)} == set(ids)
    assert "outbox_relay.deliver_batch" in procs.procs[0].text()


def test_the_broker_publisher_with_defaults_publishes_to_the_relays_own_rabbitmq(
    recorded_dsn, amqp_broker, procs_factory
):
    # A team whose Celery broker is RabbitMQ points OUTBOX_PUBLISHER at the
    # same vhost and changes nothing else: the relay's queue is "outbox", the
    # publisher's exchange is "outbox" (topic). When Celery named the queue's
    # exchange after the queue (direct), one of the two declarations was
    # refused (PRECONDITION_FAILED) and nothing was ever published.
    from kombu import Connection, Exchange, Queue

    events = Exchange("outbox", type="topic", durable=True)
    billing = Queue("test-defaults-billing", events, routing_key="order.#", durable=False)

    def delete_entities() -> None:
        with Connection(amqp_broker, connect_timeout=5) as conn:
            for delete in (
                lambda ch: ch.queue_delete(billing.name),
                lambda ch: ch.exchange_delete("outbox"),  # an older relay declared it direct
            ):
                with contextlib.suppress(Exception):
                    delete(conn.channel())

    delete_entities()
    try:
        # The consumer is there first, as it would be; then the relay starts.
        with Connection(amqp_broker, connect_timeout=5) as conn:
            billing(conn.channel()).declare()
        procs = procs_factory(recorded_dsn, amqp_broker, publisher=amqp_broker)
        procs.worker(concurrency=2)
        procs.worker(concurrency=2, args=("-Q", "outbox"))  # the operator names the queue
        procs.beat()
        ids = enqueue_orders(recorded_dsn, 200)
        wait_for(
            lambda: all_done(recorded_dsn, 200),
            timeout=60,
            what=lambda: f"200 messages done: {counts(recorded_dsn)}\n{procs.logs()}",
        )
        assert counts(recorded_dsn) == {"done": 200}
        received: list[str] = []
        with Connection(amqp_broker, connect_timeout=5) as conn:
            channel = conn.channel()
            while (message := billing(channel).get(no_ack=True)) is not None:
                received.append(message.properties["message_id"])
        assert sorted(received) == sorted(f"outbox-{i}" for i in ids)
    finally:
        delete_entities()


@pytest.mark.slow
def test_a_quiet_worker_closes_its_publishers_connections(
    recorded_dsn, redis_broker, procs_factory
):
    # The broker publisher keeps the links a chunk gave back, for the next
    # chunk; once the relay goes quiet, each pool process's sweeper closes
    # those idle for 60 s. Before it, nothing closed them until another
    # chunk came: a quiet relay held every connection of its last burst.
    # Celery's broker here is Redis, so every AMQP connection of the worker
    # is the publisher's; an exchange of its own keeps this test apart from
    # the RabbitMQ tests.
    url = services.amqp_url()
    if url is None:
        pytest.skip("RabbitMQ not configured: set OUTBOX_TEST_AMQP_URL")
    from kombu import Connection

    exchange = f"test-quiet-{os.getpid()}"
    port = urlsplit(url).port or 5672
    procs = procs_factory(
        recorded_dsn,
        redis_broker,
        publisher=url,
        kombu_exchange=exchange,
        kombu_unroutable="drop",
        chunk_size=50,
        batch_size=200,
    )
    worker = procs.worker(concurrency=2)
    procs.beat()

    def publisher_links() -> int:
        links = 0
        for pid in pool_pids(worker):
            with contextlib.suppress(psutil.Error):
                for c in psutil.Process(pid).net_connections(kind="tcp"):
                    if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED:
                        links += 1
        return links

    try:
        enqueue_orders(recorded_dsn, 600)
        wait_for(lambda: all_done(recorded_dsn, 600), timeout=60, what="600 messages done")
        after_burst = publisher_links()
        assert after_burst >= 1, "the pool processes kept no link for the next chunk"
        quiet = time.monotonic()
        wait_for(
            lambda: publisher_links() == 0,
            timeout=100,
            interval=1,
            what=lambda: f"the idle links closed ({publisher_links()} open)\n{procs.logs()}",
        )
        took = time.monotonic() - quiet
        print(f"{after_burst} link(s) after the burst; closed {took:.0f}s later")
        assert worker.alive()
    finally:
        with Connection(url, connect_timeout=5) as conn, contextlib.suppress(Exception):
            conn.channel().exchange_delete(exchange)


def test_a_coroutine_publisher_delivers_chunks_in_a_real_worker(
    recorded_dsn, redis_broker, procs_factory
):
    # OUTBOX_PUBLISHER naming an ``async def``: each chunk's publishes are
    # awaited together on the pool process's event loop.
    procs = procs_factory(
        recorded_dsn,
        redis_broker,
        publisher="tests.apps.recording:publish_async",
        chunk_size=50,
        batch_size=200,
    )
    procs.worker(concurrency=2)
    procs.beat()
    ids = enqueue_orders(recorded_dsn, 1000, payload={"await": 0.02})
    wait_for(lambda: all_done(recorded_dsn, 1000), timeout=120, what="1000 messages done")
    assert counts(recorded_dsn) == {"done": 1000}
    rows = published(recorded_dsn)
    assert sorted(r[0] for r in rows) == sorted(ids)  # each once
    assert "outbox_relay.deliver_batch" in procs.procs[0].text()


def test_worker_sigkilled_mid_publish_loses_nothing(recorded_dsn, redis_broker, procs_factory):
    procs = procs_factory(recorded_dsn, redis_broker, lease_seconds=6, publish_timeout_seconds=3)
    victim = procs.worker(concurrency=2)
    procs.beat()
    ids = enqueue_orders(recorded_dsn, 40, payload={"sleep": 0.5})

    def some_but_not_all_published() -> bool:
        return 0 < len(published(recorded_dsn)) < 30

    wait_for(some_but_not_all_published, timeout=60, what="publishing under way")
    victim.kill(signal.SIGKILL)  # the worker and its pool children, mid-publish
    victim.popen.wait(10)
    stuck = counts(recorded_dsn)
    assert stuck.get("processing", 0) > 0, stuck  # leases held by the dead worker
    procs.worker(concurrency=2)
    wait_for(lambda: all_done(recorded_dsn, 40), timeout=90, what="all delivered after kill")
    assert counts(recorded_dsn) == {"done": 40}
    rows = published(recorded_dsn)
    assert {r[0] for r in rows} == set(ids)
    # A duplicate is explainable: the same message published under two lease
    # versions (the killed worker's publish landed, its finalize never ran).
    by_id: dict[int, list[int]] = {}
    for message_id, _key, version, _agg, _seq in rows:
        by_id.setdefault(message_id, []).append(version)
    for versions in by_id.values():
        assert len(versions) == len(set(versions))


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_warm_shutdown_writes_the_done_its_processes_gathered(
    recorded_dsn, redis_broker, procs_factory, pool
):
    """Per-message deliveries hand their done to their process's completer;
    a worker stopped the way Celery stops (SIGTERM to its main process: it
    finishes its tasks, then ends its pool processes) writes them before it
    exits, instead of leaving them leased for a lease (20 s here). Under
    ``-P threads`` the deliveries run in the main process, which writes them
    at exit."""
    procs = procs_factory(recorded_dsn, redis_broker, finalize_window_seconds=1)
    worker = procs.worker(concurrency=2, pool=pool)
    ids = enqueue_orders(recorded_dsn, 30)
    procs.beat()
    wait_for(lambda: len(published(recorded_dsn)) == 30, timeout=60, what="all published")
    gathered = counts(recorded_dsn)
    # Published, handed over, not yet written (the window is a second long).
    assert gathered.get("processing", 0) > 0, gathered
    os.kill(worker.popen.pid, signal.SIGTERM)  # the main process only: a warm shutdown
    worker.popen.wait(30)
    assert counts(recorded_dsn) == {"done": 30}, procs.logs()
    assert sorted(r[0] for r in published(recorded_dsn)) == ids  # each once


def test_standalone_app_keeps_no_unacked_copies_in_redis(
    recorded_dsn, redis_broker, procs_factory, tmp_path
):
    # outbox_relay.app turns kombu's emulated acks off: its tasks are hints
    # and a lost one costs a lease (the SIGKILL test above). With them on,
    # every task message sat in Redis's ``unacked`` hash until acknowledged:
    # two Redis transactions per task in the worker's main process.
    procs = procs_factory(recorded_dsn, redis_broker)
    procs.worker(concurrency=2)
    # And beat, as the docs start it: a NOTIFY's claim that waited a tick's
    # interval behind the deliveries expires (the tick claims instead), and
    # without ticks the last rows of a busy host's drain would wait for ever.
    procs.beat()
    ids = enqueue_orders(recorded_dsn, 300)
    client = services.redis_client(redis_broker)
    seen_unacked = False
    deadline = time.monotonic() + 90
    while all_done(recorded_dsn, 300) is None:
        assert time.monotonic() < deadline, (counts(recorded_dsn), procs.logs())
        seen_unacked = seen_unacked or bool(client.exists("unacked", "unacked_index"))
        time.sleep(0.01)
    assert not seen_unacked
    assert {r[0] for r in published(recorded_dsn)} == set(ids)
    # A celeryconfig of the user's own still decides.
    shown = _standalone_app_shows(
        tmp_path,
        "broker_transport_options = {'ack_emulation': True}\n",
        "app.conf.broker_transport_options['ack_emulation']",
        broker=redis_broker,
        dsn=recorded_dsn,
    )
    assert shown == "True"


def _standalone_app_shows(
    tmp_path: Path,
    config: str,
    expression: str,
    *,
    broker: str | None = "redis://127.0.0.1:1/0",
    dsn: str = "postgresql://relay@127.0.0.1:1/outbox",
) -> str:
    """What ``expression`` prints in a fresh process that imports
    ``outbox_relay.app`` with ``config`` as its celeryconfig module
    (``broker`` None: no CELERY_BROKER_URL in its environment)."""
    (tmp_path / "userconfig.py").write_text(config)
    environ = {k: v for k, v in os.environ.items() if k != "CELERY_BROKER_URL"}
    shown = subprocess.run(
        [sys.executable, "-c", f"from outbox_relay.app import app; print({expression})"],
        env={
            **environ,
            **({"CELERY_BROKER_URL": broker} if broker is not None else {}),
            "OUTBOX_DSN": dsn,
            "OUTBOX_PUBLISHER": "tests.apps.recording:publish",
            "CELERY_CONFIG_MODULE": "userconfig",
            "PYTHONPATH": f"{tmp_path}{os.pathsep}{Path(__file__).resolve().parent.parent}",
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    lines = shown.stdout.strip().splitlines()
    assert lines, shown.stderr
    return lines[-1]


def test_the_standalone_app_takes_its_broker_from_a_celeryconfig(tmp_path: Path) -> None:
    """A celeryconfig's broker_url was ignored without a word: the app set
    its own with conf.update(), which wins over a config module, and the
    worker went to redis://127.0.0.1:6379/0 (found by a walkthrough whose
    worker and Flower joined a Redis database it never named).
    CELERY_BROKER_URL still wins, and JSON stays the only content."""
    config = (
        "broker_url = 'amqp://relay:pw@rabbit.example:5672/relay'\n"
        "accept_content = ['pickle', 'json']\n"
    )
    expression = "(app.conf.broker_url, app.conf.accept_content)"
    shown = _standalone_app_shows(tmp_path, config, expression, broker=None)
    assert shown == "('amqp://relay:pw@rabbit.example:5672/relay', ['json'])"
    shown = _standalone_app_shows(tmp_path, config, expression, broker="redis://127.0.0.1:1/3")
    assert shown == "('redis://127.0.0.1:1/3', ['json'])"
    shown = _standalone_app_shows(tmp_path, "", expression, broker=None)
    assert shown == "('redis://127.0.0.1:6379/0', ['json'])"


def test_purge_keeps_up_past_one_runs_bound(recorded_dsn, redis_broker, procs_factory):
    """One purge task stops at 100 batches (500,000 rows by default) and the
    rest waited for the next hour: a relay finishing more than that saw its
    table grow run after run. While more are due, another purge follows."""
    procs = procs_factory(recorded_dsn, redis_broker, purge_batch_size=10)  # 1,000 a run
    with psycopg.connect(recorded_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status,"
            " done_at, created_at)"
            " SELECT 'o', g::text, 'e', '{}', 'done', now() - interval '30 days',"
            " now() - interval '30 days' FROM generate_series(1, 2500) AS g"
        )
    worker = procs.worker(concurrency=1)
    kit.client_app(redis_broker).send_task("outbox_relay.purge", queue="outbox")
    wait_for(lambda: not counts(recorded_dsn).get("done"), timeout=60, what="every old row purged")
    wait_for(
        lambda: worker.text().count("another purge task follows") == 2,
        timeout=10,
        what="two follow-up purges (1,000 + 1,000 + 500 rows)",
    )


def test_broker_forgets_its_queue(recorded_dsn, redis_broker, procs_factory):
    # A lease of 12 s: the tasks expire (lease minus the worst delivery) well
    # after the check below. With 4 s they expired after about a second and
    # the worker discarded the whole queue before the test looked at it.
    procs = procs_factory(recorded_dsn, redis_broker, lease_seconds=12, publish_timeout_seconds=2)
    ids = enqueue_orders(recorded_dsn, 60, payload={"sleep": 0.3})
    procs.worker(concurrency=1)
    # Beat is not running yet: the claim the listener sends as it starts
    # fans out all 60 tasks at once, and one slow worker leaves most of them
    # waiting in Redis (0.3 s each: 18 s of work, so a busy machine that
    # starves this test process for a few seconds still finds them queued;
    # at 0.1 s it once did not). Enqueued while the worker already ran, the
    # rows came in one NOTIFY-triggered claim after another, each queued
    # behind the deliveries before it, and under CI's load fewer than 40
    # were ever leased at the same moment.
    wait_for(lambda: counts(recorded_dsn).get("processing", 0) >= 40, timeout=30, what="claimed")
    client = services.redis_client(redis_broker)
    # The claim commits its leases before it sends their tasks.
    wait_for(lambda: client.llen("outbox") >= 20, timeout=30, what="tasks waiting in Redis")
    client.flushdb()  # the broker loses every queued task (same as FLUSHALL for this db)
    assert client.llen("outbox") == 0
    procs.beat()
    wait_for(lambda: all_done(recorded_dsn, 60), timeout=90, what="all delivered after flush")
    assert counts(recorded_dsn) == {"done": 60}
    assert {r[0] for r in published(recorded_dsn)} == set(ids)


def test_a_later_releases_tasks_with_more_arguments_still_run(
    recorded_dsn, redis_broker, procs_factory
):
    """In a rolling upgrade this release's workers take the next release's
    tasks from the same queue: arguments added by then are ignored, not a
    TypeError (an earlier release failed every newer claim task that way)."""
    procs = procs_factory(recorded_dsn, redis_broker, listen="false", claim_interval_seconds=3600)
    worker = procs.worker(concurrency=1)
    ids = enqueue_orders(recorded_dsn, 5)
    app = _client_app(redis_broker)
    app.send_task(
        "outbox_relay.claim", args=(0, 0, True, "added later"), kwargs={"hint": 1}, queue="outbox"
    )
    app.send_task("outbox_relay.rescue", args=("added later",), queue="outbox")
    wait_for(lambda: all_done(recorded_dsn, 5), timeout=30, what=lambda: worker.text()[-3000:])
    assert {r[0] for r in published(recorded_dsn)} == set(ids)
    assert "TypeError" not in worker.text()


def test_stale_task_does_not_publish(recorded_dsn, redis_broker, procs_factory):
    procs = procs_factory(recorded_dsn, redis_broker, listen="false")
    worker = procs.worker(concurrency=1)
    with psycopg.connect(recorded_dsn, autocommit=True) as conn:
        [message_id] = outbox_relay.enqueue_many(
            conn, [NewMessage("order", "1", "order.created", {"n": 1})]
        )
        from datetime import timedelta

        [first] = outbox_relay.claim(conn, owner="a", batch=1, lease=timedelta(seconds=30))
        # The lease "expires" and another relay takes the row over.
        conn.execute("UPDATE outbox SET lease_until = now() - interval '1 second'")
        [second] = outbox_relay.claim(conn, owner="b", batch=1, lease=timedelta(seconds=30))
    assert second.lease_version == first.lease_version + 1
    app = _client_app(redis_broker)
    app.send_task("outbox_relay.deliver", args=(message_id, first.lease_version), queue="outbox")
    wait_for(
        lambda: "outbox_relay.deliver" in worker.text() and "succeeded" in worker.text(),
        timeout=30,
        what="stale task ran",
    )
    assert published(recorded_dsn) == []
    row = _row(recorded_dsn, message_id)
    assert row["status"] == "processing" and row["lease_version"] == second.lease_version
    assert "lease no longer ours" in worker.text()


def test_stale_publish_finalize_is_fenced_and_logged(recorded_dsn, redis_broker, procs_factory):
    procs = procs_factory(recorded_dsn, redis_broker, listen="false", lease_seconds=20)
    worker = procs.worker(concurrency=1)
    with psycopg.connect(recorded_dsn, autocommit=True) as conn:
        [message_id] = outbox_relay.enqueue_many(
            conn, [NewMessage("order", "1", "order.created", {"sleep": 3})]
        )
    app = _client_app(redis_broker)
    app.send_task("outbox_relay.claim", queue="outbox")
    wait_for(lambda: "outbox_relay.deliver[" in worker.text(), timeout=30, what="delivery start")
    time.sleep(0.5)  # the publish is now sleeping inside the worker
    with psycopg.connect(recorded_dsn, autocommit=True) as conn:
        from datetime import timedelta

        conn.execute("UPDATE outbox SET lease_until = now() - interval '1 second'")
        [taken] = outbox_relay.claim(conn, owner="other", batch=1, lease=timedelta(seconds=60))
    wait_for(lambda: "lost lease on outbox message" in worker.text(), timeout=30, what="log")
    # The stale publish went out (that is the duplicate the receiver absorbs),
    # but its finalize changed nothing: the row is still held by the new lease.
    assert [r[0] for r in published(recorded_dsn)] == [message_id]
    row = _row(recorded_dsn, message_id)
    assert row["status"] == "processing" and row["lease_version"] == taken.lease_version


def test_ordered_event_types_publish_in_id_order(recorded_dsn, redis_broker, procs_factory):
    # Ordering is configured once, on the producers' Outbox, and written on
    # each row: the relay's workers are given no ordering setting at all and
    # still publish every aggregate in id order.
    outbox = outbox_relay.Outbox(ordered_event_types="order.step")
    procs = procs_factory(recorded_dsn, redis_broker)
    procs.worker(concurrency=2)
    procs.worker(concurrency=2)
    procs.beat()
    with psycopg.connect(recorded_dsn) as conn:
        for i in range(40):
            with conn.transaction():
                outbox.enqueue_many(
                    conn,
                    [NewMessage("order", f"agg-{a}", "order.step", {"i": i}) for a in range(5)],
                )
    wait_for(lambda: all_done(recorded_dsn, 200), timeout=120, what="ordered messages done")
    rows = published(recorded_dsn)
    assert len(rows) == 200
    per_aggregate: dict[str, list[int]] = {}
    for message_id, _key, _v, aggregate_id, _seq in rows:
        per_aggregate.setdefault(aggregate_id, []).append(message_id)
    for aggregate_id, sequence in per_aggregate.items():
        assert sequence == sorted(sequence), aggregate_id


def test_one_busy_aggregate_moves_on_without_a_claim_per_message(
    recorded_dsn, redis_broker, procs_factory
):
    """A delivery task that finishes an ordered message leases and delivers
    the next one of its aggregate itself (tasks.follow): one aggregate's 400
    messages take a handful of tasks, not 400 claims and 400 deliveries each
    crossing the broker, and still go out in order, each once."""
    procs = procs_factory(recorded_dsn, redis_broker, claim_interval_seconds=3600)
    worker = procs.worker(concurrency=2)
    wait_for(lambda: "outbox_relay.claim" in worker.text(), timeout=20, what="startup claim")
    with psycopg.connect(recorded_dsn) as conn:
        ids = outbox_relay.enqueue_many(
            conn, [NewMessage("ledger", "1", "posted", {"n": i}) for i in range(400)], ordered=True
        )
        conn.commit()
    wait_for(lambda: all_done(recorded_dsn, 400), timeout=120, what="the aggregate delivered")
    assert [r[0] for r in published(recorded_dsn)] == ids
    tasks = len(re.findall(r"Task outbox_relay\.deliver(?:_batch)?\[\S+\] received", worker.text()))
    assert 0 < tasks < 40, f"{tasks} delivery tasks for one aggregate's 400 messages"


def test_a_slow_publisher_drains_without_beat_each_row_once(
    recorded_dsn, redis_broker, procs_factory
):
    """With a publisher that waits (20 ms a message), a delivery task may
    claim and publish the next chunk while its own publishes
    (tasks._Follow.take; whether it does depends on the machine's idle CPU,
    which a test run does not control: Deliverer's tests in test_pipeline.py
    pin it). Either way each row is published once, and with no beat the
    drain carries itself to the end, although a drain's next claim that
    finds a task's own take holding the claim lock gives way to it (before
    each such task sent a claim as it ended, a benchmark's drain stopped
    there, now and then, until beat's tick)."""
    procs = procs_factory(
        recorded_dsn, redis_broker, claim_interval_seconds=3600, chunk_size=20, batch_size=200
    )
    worker = procs.worker(concurrency=2)
    wait_for(lambda: "outbox_relay.claim" in worker.text(), timeout=20, what="startup claim")
    with psycopg.connect(recorded_dsn) as conn:
        ids = outbox_relay.enqueue_many(
            conn, [NewMessage("order", str(i), "order.paid", {"sleep": 0.02}) for i in range(1000)]
        )
        conn.commit()
    wait_for(lambda: all_done(recorded_dsn, 1000), timeout=120, what="1000 slow messages done")
    assert counts(recorded_dsn) == {"done": 1000}
    assert sorted(r[0] for r in published(recorded_dsn)) == ids  # each once


def test_two_beats_cause_no_double_delivery(recorded_dsn, redis_broker, procs_factory):
    procs = procs_factory(recorded_dsn, redis_broker, claim_interval_seconds="0.3", listen="false")
    procs.worker(concurrency=2)
    procs.beat()
    procs.beat()
    ids = enqueue_orders(recorded_dsn, 1000)
    wait_for(lambda: all_done(recorded_dsn, 1000), timeout=120, what="done with two beats")
    rows = published(recorded_dsn)
    assert sorted(r[0] for r in rows) == ids  # each exactly once
    beats = [p for p in procs.procs if p.name.startswith("beat")]
    assert all("Sending due task outbox-relay-claim" in b.text() for b in beats)


def test_transient_failures_retry_in_the_database(recorded_dsn, redis_broker, procs_factory):
    procs = procs_factory(recorded_dsn, redis_broker, max_attempts=4)
    worker = procs.worker(concurrency=2)
    procs.beat()
    with psycopg.connect(recorded_dsn) as conn, conn.transaction():
        flaky = outbox_relay.enqueue(
            conn, aggregate_type="o", aggregate_id="1", event_type="e", payload={"fail_times": 2}
        )
        broken = outbox_relay.enqueue(
            conn,
            aggregate_type="o",
            aggregate_id="2",
            event_type="e",
            payload={"fail": "retryable"},
        )
        rejected = outbox_relay.enqueue(
            conn,
            aggregate_type="o",
            aggregate_id="3",
            event_type="e",
            payload={"fail": "permanent"},
        )
    wait_for(lambda: all_done(recorded_dsn, 3), timeout=60, what="all finished")
    flaky_row, broken_row, rejected_row = (_row(recorded_dsn, i) for i in (flaky, broken, rejected))
    assert flaky_row["status"] == "done" and flaky_row["attempts"] == 3
    assert broken_row["status"] == "dead" and broken_row["attempts"] == 4
    assert "retries exhausted" in broken_row["last_error"]
    assert rejected_row["status"] == "dead" and rejected_row["attempts"] == 1
    assert "permanent" in rejected_row["last_error"]
    assert [r[0] for r in published(recorded_dsn)] == [flaky]
    # Retries never went through the broker: no task was retried or scheduled
    # with an ETA; every delivery task simply succeeded.
    log = worker.text()
    assert not re.search(r"Task outbox_relay\.\w+\[[^\]]+\] retry", log)
    assert "ETA:[" not in log  # the worker logs "ETA:[...]" for a task held until later


def test_notify_wakes_an_idle_relay_without_beat(recorded_dsn, redis_broker, procs_factory):
    # No beat at all: only the NOTIFY listener can trigger this claim.
    procs = procs_factory(recorded_dsn, redis_broker, claim_interval_seconds=60)
    worker = procs.worker(concurrency=1)
    wait_for(lambda: "outbox_relay.claim" in worker.text(), timeout=20, what="startup claim")
    time.sleep(1.0)  # idle
    started = time.monotonic()
    enqueue_orders(recorded_dsn, 1, threads=1)
    wait_for(lambda: published(recorded_dsn), timeout=6, interval=0.02, what="publish via NOTIFY")
    elapsed = time.monotonic() - started
    # Well before a 60 s polling interval would have noticed it.
    assert elapsed < 6.0


def test_retries_and_delayed_messages_go_out_when_due_not_at_the_next_tick(
    recorded_dsn, redis_broker, procs_factory
):
    """A retry due in half a second, and a message enqueued with a delay of
    two, waited for beat's next tick (here a minute away; 5 s by default):
    the docs' backoff was the tick. A claim is now sent for when they fall due."""
    procs = procs_factory(
        recorded_dsn,
        redis_broker,
        claim_interval_seconds=60,
        backoff_base_seconds=0.25,
        backoff_cap_seconds=0.5,
    )
    worker = procs.worker(concurrency=1)
    wait_for(lambda: "outbox_relay.claim" in worker.text(), timeout=20, what="startup claim")
    time.sleep(0.5)  # idle: only NOTIFY and what the relay schedules can claim now
    with psycopg.connect(recorded_dsn) as conn:
        with conn.transaction():
            flaky = outbox_relay.enqueue(
                conn,
                aggregate_type="o",
                aggregate_id="1",
                event_type="e",
                payload={"fail_times": 1},
            )
        with conn.transaction():
            later = outbox_relay.enqueue(
                conn, aggregate_type="o", aggregate_id="2", event_type="e", payload={}, delay=2.0
            )
    wait_for(lambda: all_done(recorded_dsn, 2), timeout=20, what="both done, long before a tick")
    flaky_row, later_row = _row(recorded_dsn, flaky), _row(recorded_dsn, later)
    assert flaky_row["attempts"] == 2
    # The retry waited its backoff (at most 0.5 s) and little more.
    assert (flaky_row["done_at"] - flaky_row["created_at"]).total_seconds() < 3.0, flaky_row
    taken = (later_row["done_at"] - later_row["created_at"]).total_seconds()
    assert 2.0 <= taken < 4.0, later_row
    assert [r[0] for r in published(recorded_dsn)] == [flaky, later]
    # Deliveries still never wait in the broker: only claims were held for later.
    assert not re.search(r"Received task: outbox_relay\.deliver\w*\[[^\]]+\]\s+ETA:", worker.text())


@pytest.mark.parametrize(
    ("n", "settings"),
    [
        # 10 tasks a round: 4 processes prefetch 16, a whole round at once.
        (6000, {"chunk_size": 20, "batch_size": 200, "max_in_flight": 400}),
        # 100 tasks a round: longer than the worker prefetches.
        (1000, {"chunk_size": 1, "batch_size": 100, "max_in_flight": 150}),
    ],
    ids=["short-rounds", "long-rounds"],
)
def test_a_drain_under_the_cap_goes_on_without_beat(
    recorded_dsn, redis_broker, procs_factory, n, settings
):
    # No beat: the NOTIFY at commit starts one claim, and the drain must
    # carry itself to the end through the in-flight cap.
    procs = procs_factory(recorded_dsn, redis_broker, claim_interval_seconds=3600, **settings)
    worker = procs.worker(concurrency=4)
    wait_for(lambda: "outbox_relay.claim" in worker.text(), timeout=20, what="startup claim")
    ids = commit_at_once(recorded_dsn, n)
    wait_for(lambda: all_done(recorded_dsn, n), timeout=180, what=f"{n} messages done")
    assert counts(recorded_dsn) == {"done": n}
    assert {r[0] for r in published(recorded_dsn)} == set(ids)


def test_rows_behind_an_aggregate_stopped_by_a_dead_message_slow_nothing_else(
    recorded_dsn, redis_broker, procs_factory
):
    """A dead ordered message with 3,000 rows of its aggregate queued behind
    it: every claim walked past all of them (the relay slowed for everyone),
    until the claims parked them. Claims that only park have no delivery to
    carry the drain on; with no beat, the NOTIFY's claim must still reach
    the rows after them, and the parked rows stay where they are."""
    procs = procs_factory(recorded_dsn, redis_broker, claim_interval_seconds=3600)
    worker = procs.worker(concurrency=2)
    wait_for(lambda: "outbox_relay.claim" in worker.text(), timeout=20, what="startup claim")
    with psycopg.connect(recorded_dsn) as conn:
        conn.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, ordered,"
            " status, last_error) VALUES ('ledger', '1', 'posted', '{}', true, 'dead', '422')"
        )
        stuck = outbox_relay.enqueue_many(
            conn, [NewMessage("ledger", "1", "posted", {"n": i}) for i in range(3000)], ordered=True
        )
        others = outbox_relay.enqueue_many(
            conn, [NewMessage("order", str(i), "order.created", {"n": i}) for i in range(300)]
        )
        conn.commit()
    wait_for(
        lambda: counts(recorded_dsn).get("done") == len(others),
        timeout=60,
        what=lambda: f"the 300 rows after the stopped aggregate done:\n{worker.text()[-3000:]}",
    )
    assert {r[0] for r in published(recorded_dsn)} == set(others)
    with psycopg.connect(recorded_dsn, autocommit=True) as conn:
        waiting = conn.execute(
            "SELECT count(*) FROM outbox WHERE status = 'pending' AND id = ANY(%s)"
            " AND available_at > now() + interval '1000 years'",
            (stuck,),
        ).fetchone()
    assert waiting == (len(stuck),)  # parked, each walked once


def test_a_drain_with_beat_does_not_wait_for_its_ticks(recorded_dsn, redis_broker, procs_factory):
    # The configuration, with beat as the docs run it. Beat's tick
    # starts a second claim chain beside the drain's own; before, both then
    # found the cap reached, used up their held-back rounds in milliseconds
    # and stopped until the next tick: nothing was delivered for most of each
    # interval (4 s of every 5 s). A pause is measured between consecutive
    # done_at by the database clock; 3 s is a third of the tick used here,
    # far above the pauses of a working drain (under 1 s in make bench with
    # the machine's load average at 20).
    n = 20000
    procs = procs_factory(
        recorded_dsn,
        redis_broker,
        claim_interval_seconds=10,
        chunk_size=50,
        batch_size=500,
        max_in_flight=1000,
    )
    worker = procs.worker(concurrency=4)
    procs.beat()
    wait_for(lambda: "outbox_relay.claim" in worker.text(), timeout=20, what="startup claim")
    ids = commit_at_once(recorded_dsn, n)
    wait_for(lambda: all_done(recorded_dsn, n), timeout=240, what=f"{n} messages done")
    assert counts(recorded_dsn) == {"done": n}
    assert {r[0] for r in published(recorded_dsn)} == set(ids)
    with psycopg.connect(recorded_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM max(gap))::float8 FROM ("
            " SELECT done_at - lag(done_at) OVER (ORDER BY done_at) AS gap FROM outbox) AS g"
        ).fetchone()
    assert row is not None and row[0] < 3.0, f"the drain paused {row}s:\n{procs.logs()}"


def commit_at_once(dsn: str, n: int) -> list[int]:
    """``n`` messages in one business transaction (one NOTIFY at its commit)."""
    with psycopg.connect(dsn) as conn:
        ids = outbox_relay.enqueue_many(
            conn, [NewMessage("order", str(i), "order.created", {"n": i}) for i in range(n)]
        )
        conn.commit()
    return ids


def test_bad_configuration_fails_at_start(recorded_dsn, redis_broker, procs_factory):
    procs = procs_factory(recorded_dsn, redis_broker, publish_timeout_seconds=30, lease_seconds=20)
    worker = procs.worker(ready=False)
    worker.popen.wait(60)
    assert worker.popen.returncode != 0
    assert "OUTBOX_PUBLISH_TIMEOUT_SECONDS (30) must be less than OUTBOX_LEASE_SECONDS" in (
        worker.text()
    )
    # One line naming the setting, not a traceback.
    assert "outbox-relay cannot start: " in worker.text()
    assert "Traceback" not in worker.text(), worker.text()[-3000:]


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        (
            {"table": "not_migrated"},
            # With its --table: without it the command would migrate public.outbox.
            "public.not_migrated does not exist: run "
            "`outbox-relay migrate --table public.not_migrated`",
        ),
        ({"lease_second": "5"}, "OUTBOX_LEASE_SECOND (did you mean OUTBOX_LEASE_SECONDS?)"),
        ({"publisher": "tests.apps.no_such_module:publish"}, "cannot import"),
    ],
    ids=["no-migration", "misspelled", "bad-publisher"],
)
def test_beat_refuses_to_start_instead_of_running_an_empty_schedule(
    recorded_dsn, redis_broker, procs_factory, settings, said
):
    procs = procs_factory(recorded_dsn, redis_broker, **settings)
    beat = procs.beat()
    beat.popen.wait(60)
    assert beat.popen.returncode != 0, beat.text()
    assert said in beat.text()
    assert "beat cannot start" in beat.text()
    # Said once (it was also logged again as a WARNING, from SystemExit's message).
    assert beat.text().count(said) == 1, beat.text()


def test_ticks_expire_when_the_scheduler_drops_the_entries_options(dsn, redis_broker):
    """django-celery-beat keeps only some of an entry's options and dropped
    the ticks' expiry: a day without workers left thousands of claim ticks
    in the broker. A tick from an entry with no options expires after its
    interval; the relay's own drain hint does not expire."""
    import json

    import redis
    from celery import Celery
    from celery.beat import ScheduleEntry, Scheduler

    app = Celery("ticks", broker=redis_broker, set_as_current=False)
    outbox_relay.install(app, dsn=dsn, publisher=print, claim_interval_seconds=7)
    scheduler = Scheduler(app, lazy=True)
    for task in ("outbox_relay.claim", "outbox_relay.rescue", "outbox_relay.purge"):
        # What such a scheduler rebuilds from its table: no "expires".
        scheduler.apply_async(ScheduleEntry(task, task=task, schedule=7.0, app=app))
    app.tasks["outbox_relay.claim"].apply_async((), serializer="json", expires=None)

    queued = redis.Redis.from_url(redis_broker).lrange("outbox", 0, -1)
    sent = [json.loads(raw)["headers"] for raw in reversed(queued)]
    assert [h["task"] for h in sent] == [
        "outbox_relay.claim",
        "outbox_relay.rescue",
        "outbox_relay.purge",
        "outbox_relay.claim",
    ]
    assert all(h["expires"] for h in sent[:3]), sent
    assert sent[3]["expires"] is None
    from outbox_relay.celery import tasks

    # The drain's own hint goes through tasks._send, which keeps it alive.
    tasks._send(app.tasks["outbox_relay.claim"], (0, 0, True))
    last = json.loads(redis.Redis.from_url(redis_broker).lindex("outbox", 0))["headers"]
    assert last["expires"] is None


# --------------------------------------------------------------------------- helpers
def _client_app(broker: str) -> Any:
    from celery import Celery

    app = Celery("test-client", broker=broker)
    app.conf.task_serializer = "json"
    return app


def _row(dsn: str, message_id: int) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = outbox_relay.store.get_row(conn, message_id)
    assert row is not None
    return row


def test_metrics_scrape_during_a_real_run(recorded_dsn, redis_broker, procs_factory, tmp_path):
    """Prefork workers write counters to PROMETHEUS_MULTIPROC_DIR; the exporter
    process aggregates them and reads the queue gauges from the database."""

    from .test_metrics import fetch, parse, value

    folder = tmp_path / "prometheus"
    folder.mkdir()
    procs = procs_factory(recorded_dsn, redis_broker, max_attempts=2)
    procs.env["PROMETHEUS_MULTIPROC_DIR"] = str(folder)
    procs.worker(concurrency=2)
    procs.beat()
    enqueue_orders(recorded_dsn, 30)
    with psycopg.connect(recorded_dsn) as conn, conn.transaction():
        outbox_relay.enqueue(
            conn,
            aggregate_type="o",
            aggregate_id="x",
            event_type="order.created",
            payload={"fail": "permanent"},
        )
    wait_for(lambda: all_done(recorded_dsn, 31), timeout=60, what="all finished")
    exporter = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "outbox-relay"),
            "metrics",
            "--port",
            "0",
            "--addr",
            "127.0.0.1",
            "--dsn",
            recorded_dsn,
        ],
        env={**procs.env, "PROMETHEUS_MULTIPROC_DIR": str(folder)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert exporter.stdout is not None
        first = exporter.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", first)
        assert found, first
        samples = parse(fetch(int(found.group(1))))
    finally:
        exporter.terminate()
        exporter.wait(10)
    published = "outbox_published_total"
    assert value(samples, published, event_type="order.created", outcome="done") == 30
    assert value(samples, published, event_type="order.created", outcome="dead") == 1
    assert value(samples, "outbox_lost_leases_total") == 0
    assert value(samples, "outbox_delivery_latency_seconds_count") == 30
    assert value(samples, "outbox_messages", status="done") == 30
    assert value(samples, "outbox_messages", status="dead") == 1
    assert value(samples, "outbox_messages", status="pending") == 0
    assert value(samples, "outbox_expired_leases") == 0


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ("", "UTC UTC"),
        ("timezone = 'Europe/Berlin'\n", "Europe/Berlin Europe/Berlin"),
        # Celery's local time then: the app leaves the zone unset.
        ("enable_utc = False\n", "None local"),
    ],
)
def test_standalone_app_names_its_time_zone(tmp_path, config, expected):
    # outbox_relay.app sets timezone = "UTC" where nothing else is set (the
    # zone Celery uses then anyway): Celery looks the setting up for every
    # task message with an expiry, and an unset one walks every
    # configuration source twice (31 against 5 us a message). A user's
    # own setting still decides.
    shown = _standalone_app_shows(
        tmp_path,
        config,
        "app.conf.timezone, 'local' if not app.conf.enable_utc else app.timezone",
    )
    assert shown == expected
