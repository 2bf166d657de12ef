"""Prometheus metrics over real HTTP: database gauges against the rows, worker
counters after real deliveries, in-process and from forked processes through
``PROMETHEUS_MULTIPROC_DIR`` with the ``outbox-relay metrics`` exporter."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from psycopg.conninfo import make_conninfo

import outbox_relay
from outbox_relay import (
    Deliverer,
    DirectDatabase,
    Message,
    PermanentError,
    RetryableError,
    enqueue,
    operations,
    store,
)
from outbox_relay.metrics import MetricsObserver, MetricsServer, serve

from .opsdata import EXPECTED, LEASE, add, backdate, db_now, scenario

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def fetch(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        return str(response.read().decode())


def parse(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def start() -> Iterator[Any]:
    servers: list[MetricsServer] = []

    def start(**kw: Any) -> MetricsServer:
        kw.setdefault("registry", CollectorRegistry())
        server = serve(0, addr="127.0.0.1", **kw)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


# ---------------------------------------------------------------- database gauges
def test_gauges_match_the_database(dsn: str, conn: psycopg.Connection[Any], start: Any) -> None:
    rows = scenario(conn)
    server = start(dsn=dsn)
    text = fetch(server.port)
    samples = parse(text)
    for status in ("pending", "processing", "done", "dead"):
        assert value(samples, "outbox_messages", status=status) == EXPECTED[status]
    assert value(samples, "outbox_expired_leases") == 1
    age = value(samples, "outbox_oldest_pending_age_seconds")
    assert age is not None and 10800 <= age < 10860
    assert value(samples, "outbox_database_up") == 1
    assert "pg_class.reltuples" in text  # the HELP text says how done is counted
    # Computed at scrape time: the next scrape sees the operator's retry.
    operations.dead_retry(conn, [rows.dead])
    samples = parse(fetch(server.port))
    assert value(samples, "outbox_messages", status="dead") == 0
    assert value(samples, "outbox_messages", status="pending") == 4


def test_done_is_estimated_on_large_tables(conn: psycopg.Connection[Any]) -> None:
    # Autovacuum would refresh the estimate under the test's feet.
    conn.execute("ALTER TABLE outbox SET (autovacuum_enabled = false)")
    t0 = db_now(conn) - timedelta(days=10)
    add(conn, at=t0, n=30)
    for c in store.claim(conn, owner="t", batch=100, lease=LEASE, now=t0):
        assert store.mark_done(conn, c, now=t0)
    add(conn, at=t0, n=2)  # pending
    conn.execute("ANALYZE outbox")
    # Five rows go after ANALYZE: the planner's estimate has not seen it yet.
    assert operations.purge(conn, older_than=timedelta(0), batch_size=5, max_batches=1).deleted == 5
    estimated = operations.gauges(conn, exact_done_below=10)
    assert estimated.done_estimated and estimated.done == 30  # reltuples 32 - 2 pending
    exact = operations.gauges(conn)
    assert not exact.done_estimated and exact.done == 25
    assert exact.pending == estimated.pending == 2


def test_database_down_still_serves(dsn: str, start: Any) -> None:
    server = start(dsn=make_conninfo(dsn, port=1, connect_timeout=2))
    samples = parse(fetch(server.port))
    assert value(samples, "outbox_database_up") == 0
    assert value(samples, "outbox_messages", status="pending") is None


def test_a_scrape_blocked_by_a_lock_ends_at_its_timeout_once(dsn: str) -> None:
    """The scrape's statement timeout (QueryCanceled, an OperationalError)
    was taken for a broken connection and the scrape ran again: 10 s under a
    held lock, Prometheus's whole scrape_timeout in the shipped config."""
    import time

    from outbox_relay.metrics import OutboxCollector

    collector = OutboxCollector(dsn, timeout_seconds=2.0)
    registry = CollectorRegistry()
    registry.register(collector)
    with psycopg.connect(dsn) as holder:
        holder.execute("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
        started = time.monotonic()
        blocked = registry.get_sample_value("outbox_database_up")
        took = time.monotonic() - started
        holder.rollback()
    assert blocked == 0
    # Once: a second try would take as long again (4 s and more).
    assert 1.9 < took < 3.6, f"the scrape took {took:.2f}s with a 2 s timeout"
    assert registry.get_sample_value("outbox_database_up") == 1  # the same connection, fine


def test_a_table_behind_this_version_says_to_migrate(
    fresh_database: str, start: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # A new release's exporter before `outbox-relay migrate` (an upgrade):
    # the gauges are down and the log names the command, with its --table.
    with psycopg.connect(fresh_database, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app")
        outbox_relay.migrate(conn, table="app.outbox")
        conn.execute("ALTER TABLE app.outbox DROP COLUMN waiting_since")
    server = start(dsn=fresh_database, table="app.outbox")
    with caplog.at_level(logging.WARNING, logger="outbox_relay"):
        samples = parse(fetch(server.port))
    assert value(samples, "outbox_database_up") == 0
    assert (
        "the outbox table app.outbox is missing or not migrated to this version "
        '(column "waiting_since" does not exist): run `outbox-relay migrate --table app.outbox`'
    ) in caplog.text


# ---------------------------------------------------------------- worker counters
def test_worker_counters_after_real_deliveries(
    dsn: str, conn: psycopg.Connection[Any], start: Any
) -> None:
    registry = CollectorRegistry()
    observer = MetricsObserver(registry)
    ok = [add(conn, at=db_now(conn), event_type="ok", aggregate_id=f"o{i}")[0] for i in range(2)]
    backdate(conn, ok[0], timedelta(hours=1))  # its delivery latency is an hour
    add(conn, at=db_now(conn), event_type="flaky")
    add(conn, at=db_now(conn), event_type="bad")

    def publish(message: Message) -> None:
        if message.event_type == "flaky":
            raise RetryableError("503 from the receiver")
        if message.event_type == "bad":
            raise PermanentError("422 from the receiver")

    db = DirectDatabase(conn)
    relay = Deliverer(publish, db=db, observer=observer, concurrency=1)
    claimed = store.claim(conn, owner="w1", batch=10, lease=LEASE)
    report = relay.deliver([c.ref for c in claimed])
    assert (report.done, report.retried, report.dead) == (2, 1, 1)

    # A lease lost mid-publish: another worker re-claims the row (its lease
    # "expired" at a later database time) while this one is publishing.
    stolen_id = enqueue(conn, aggregate_type="order", aggregate_id="s", event_type="slow",
                        payload={})  # fmt: skip
    [mine] = store.claim(conn, owner="w1", batch=10, lease=LEASE)
    assert mine.id == stolen_id

    def steal(message: Message) -> None:
        with psycopg.connect(dsn, autocommit=True) as other:
            later = db_now(other) + LEASE * 2
            assert [c.id for c in store.claim(other, owner="w2", batch=10, lease=LEASE,
                                              now=later)] == [stolen_id]  # fmt: skip

    lost = Deliverer(steal, db=db, observer=observer, concurrency=1).deliver([mine.ref])
    assert lost.lost == 1
    # A late duplicate task for the old lease is turned away before publishing.
    assert Deliverer(publish, db=db, observer=observer).deliver([mine.ref]).stale == 1

    server = start(dsn=dsn, registry=registry)
    samples = parse(fetch(server.port))
    published = "outbox_published_total"
    assert value(samples, published, event_type="ok", outcome="done") == 2
    assert value(samples, published, event_type="flaky", outcome="retry") == 1
    assert value(samples, published, event_type="bad", outcome="dead") == 1
    assert value(samples, published, event_type="slow", outcome="done") is None  # lost, not done
    assert value(samples, "outbox_lost_leases_total") == 1
    assert value(samples, "outbox_stale_deliveries_total") == 1
    assert value(samples, "outbox_publish_duration_seconds_count") == 5
    latency = "outbox_delivery_latency_seconds_bucket"
    assert value(samples, "outbox_delivery_latency_seconds_count") == 2
    assert value(samples, latency, le="1800.0") == 1
    assert value(samples, latency, le="10800.0") == 2
    # The database gauges share the endpoint.
    assert value(samples, "outbox_messages", status="done") == 2


def test_multiprocess_counters_from_forked_workers(
    dsn: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    for i in range(6):
        add(conn, at=db_now(conn), event_type="ok", aggregate_id=f"o{i}")
    for i in range(2):
        add(conn, at=db_now(conn), event_type="bad", aggregate_id=f"b{i}")
    folder = tmp_path / "prometheus"
    folder.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update({"PROMETHEUS_MULTIPROC_DIR": str(folder), "PYTHONPATH": str(ROOT)})
    worker = subprocess.run(
        [sys.executable, "-m", "tests.metrics_worker", dsn, "2"],
        cwd=str(ROOT),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert worker.returncode == 0, worker.stdout + worker.stderr
    # The parent and both children wrote files of their own.
    pids = {m.group(1) for f in folder.iterdir() if (m := re.match(r"\w+_(\d+)\.db$", f.name))}
    assert len(pids) >= 3, sorted(f.name for f in folder.iterdir())

    exporter = subprocess.Popen(
        [str(BIN / "outbox-relay"), "metrics", "--port", "0", "--addr", "127.0.0.1", "--dsn", dsn],
        cwd=str(tmp_path),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert exporter.stdout is not None
        first = exporter.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", first)
        assert found, first + (exporter.stderr.read() if exporter.poll() is not None else "")
        samples = parse(fetch(int(found.group(1))))
    finally:
        exporter.terminate()
        exporter.wait(10)
    published = "outbox_published_total"
    assert value(samples, published, event_type="ok", outcome="done") == 6
    assert value(samples, published, event_type="bad", outcome="dead") == 2
    assert value(samples, "outbox_publish_duration_seconds_count") == 8
    assert value(samples, "outbox_delivery_latency_seconds_count") == 6
    assert value(samples, "outbox_lost_leases_total") == 0
    assert value(samples, "outbox_messages", status="done") == 6
    assert value(samples, "outbox_messages", status="dead") == 2


# ---------------------------------------------------------------- where it listens
def _other_local_address() -> str | None:
    """An address of this machine that is not loopback, if it has one."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent (UDP, no write)
        address = str(probe.getsockname()[0])
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


@pytest.mark.security
def test_the_exporter_listens_on_loopback_by_default() -> None:
    """/metrics is unauthenticated: other hosts reach it only when asked for."""
    server = serve(0, dsn=None, registry=CollectorRegistry())
    try:
        assert server.httpd.server_address[0] == "127.0.0.1"
        assert server.httpd.socket.getsockname()[0] == "127.0.0.1"
        fetch(server.port)  # reachable on 127.0.0.1
        other = _other_local_address()
        if other is not None:
            with pytest.raises(OSError):
                socket.create_connection((other, server.port), timeout=2).close()
    finally:
        server.close()
    opened = serve(0, dsn=None, registry=CollectorRegistry(), addr="0.0.0.0")
    try:
        assert opened.httpd.socket.getsockname()[0] == "0.0.0.0"
        fetch(opened.port)
    finally:
        opened.close()


@pytest.mark.security
def test_the_metrics_command_listens_on_loopback_unless_told(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    for extra, shown in (([], "127.0.0.1"), (["--addr", "0.0.0.0"], "0.0.0.0")):
        exporter = subprocess.Popen(
            [str(BIN / "outbox-relay"), "metrics", "--no-database", "--port", "0", *extra],
            cwd=str(tmp_path),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert exporter.stdout is not None
            first = exporter.stdout.readline()
            found = re.search(r"serving http://([\d.]+):(\d+)/metrics", first)
            assert found, first + (exporter.stderr.read() if exporter.poll() is not None else "")
            assert found.group(1) == shown
            fetch(int(found.group(2)))
        finally:
            exporter.terminate()
            code = exporter.wait(10)
        # SIGTERM handled, not the default action (-15): as a container's
        # PID 1 an unhandled SIGTERM is ignored, and docker stop waits out
        # its grace period before it kills the exporter.
        assert code == 0, exporter.stderr.read() if exporter.stderr else code
