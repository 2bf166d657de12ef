"""Every database call of the relay has a bound in time, also on half-open sockets."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import ClientCursor

from outbox_relay import NewMessage, enqueue_many, store
from outbox_relay.db import PoolDatabase
from outbox_relay.model import Outcome
from outbox_relay.sql.queries import queries_for
from outbox_relay.table import OutboxTable

from .tcp_proxy import SilencingProxy

TIMEOUT = 1.0  # the relay's OUTBOX_DATABASE_TIMEOUT_SECONDS in these tests
BOUND = TIMEOUT * 1.5 + 1.0 + 1.0  # the watchdog's deadline, plus its tick and slack


@pytest.fixture
def proxy(dsn: str) -> Iterator[SilencingProxy]:
    p = SilencingProxy(dsn)
    yield p
    p.close()


def test_a_call_on_a_silenced_connection_is_cut_and_retried(
    dsn: str, proxy: SilencingProxy
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        enqueue_many(conn, [NewMessage("o", "1", "e", {})])
        store.claim(conn, owner="w", batch=1, lease=timedelta(minutes=5))
    db = PoolDatabase(proxy.dsn, size=1, name="silenced", timeout=TIMEOUT)
    try:
        assert db.run(store.in_flight) == 1
        # The database host "fails over": the pooled connection goes silent,
        # new connections reach the server.
        proxy.silence()
        started = time.monotonic()
        assert db.run(store.in_flight) == 1  # cut, then retried on a new connection
        assert time.monotonic() - started < BOUND
        assert db.watchdog.severed == 1
    finally:
        db.close()


def test_a_claim_on_a_silenced_connection_fails_in_bounded_time(
    dsn: str, proxy: SilencingProxy
) -> None:
    db = PoolDatabase(proxy.dsn, size=1, name="silenced-claim", timeout=TIMEOUT)
    try:
        assert db.run(store.in_flight) == 0
        proxy.silence()
        started = time.monotonic()
        with pytest.raises(psycopg.OperationalError):
            # Not retried (its commit may have happened): it fails, and the
            # next claim runs on a fresh connection.
            db.run(
                lambda conn: store.claim(conn, owner="w", batch=5, lease=timedelta(seconds=30)),
                retry=False,
            )
        assert time.monotonic() - started < BOUND
        assert db.run(store.in_flight) == 0
    finally:
        db.close()


def test_a_slow_statement_is_cancelled_by_the_server_first(dsn: str) -> None:
    db = PoolDatabase(dsn, size=1, name="slow", timeout=TIMEOUT)
    try:
        with pytest.raises(psycopg.errors.QueryCanceled):
            db.run(lambda conn: conn.execute("SELECT pg_sleep(5)"))
        # The server's statement_timeout fired: the connection is intact.
        assert db.watchdog.severed == 0
        assert db.run(store.in_flight) == 0
    finally:
        db.close()


def test_a_client_that_vanishes_inside_a_transaction_releases_its_locks(dsn: str) -> None:
    """A relay host cut off the network inside a claim held the claim's
    advisory lock until the server's TCP keepalive (hours): every other
    claimer timed out behind it (the fault suite's link-cut scenario). The
    server now ends a relay session that waits inside a transaction for
    longer than the database timeout."""
    proxy = SilencingProxy(dsn)
    db = PoolDatabase(proxy.dsn, size=1, name="vanishing", timeout=TIMEOUT)

    def hold(c: psycopg.Connection[Any]) -> None:
        c.execute("SELECT pg_advisory_xact_lock(4242)")
        proxy.silence()  # the host vanishes while its transaction is open
        c.execute("SELECT 1")

    def run() -> None:
        with contextlib.suppress(Exception):  # the watchdog cuts it, client side
            db.run(hold, retry=False)

    holder = threading.Thread(target=run, daemon=True)
    try:
        holder.start()
        started = time.monotonic()
        with psycopg.connect(dsn, autocommit=True) as other:
            other.execute("SET lock_timeout = '20s'")
            other.execute("SELECT pg_advisory_lock(4242)")  # blocks until the server frees it
            other.execute("SELECT pg_advisory_unlock(4242)")
        assert time.monotonic() - started < TIMEOUT + 5
    finally:
        db.close()
        proxy.close()


def test_relay_sessions_never_jit_compile_their_statements(dsn: str) -> None:
    # With PostgreSQL's defaults (jit on, jit_above_cost 100000) the planner
    # priced the claim of a table of some thousand rows past the threshold,
    # and every claim spent half a second compiling itself (docs/benchmarks-changes.md item 5).
    params = {
        "owner": "w",
        "batch": 10,
        "lease": timedelta(seconds=60),
        "max_attempts": 12,
        "count_attempt": 0,
        "content": False,
        "now": None,
        "all_ordered": False,
        "ordered_types": [],
        "follow_queue": 16,
        "hold": timedelta(seconds=2),
    }
    claim = queries_for(OutboxTable.parse(None)).claim

    def explain(conn: psycopg.Connection[Any]) -> str:
        # As if every plan were worth compiling: the relay's session still does not.
        conn.execute("SET jit_above_cost = 0")
        with conn.transaction(force_rollback=True):
            rows = conn.execute("EXPLAIN (ANALYZE) " + claim, params).fetchall()
        return "\n".join(r[0] for r in rows)

    with psycopg.connect(dsn, autocommit=True) as conn:
        enqueue_many(conn, [NewMessage("order", str(i), "order.created", {}) for i in range(20)])
        jit_available = bool(conn.execute("SELECT pg_jit_available()").fetchone()[0])  # type: ignore[index]
        if jit_available:
            conn.execute("SET jit = on")
            # The control: this server does compile such a plan in a plain session.
            assert "JIT:" in explain(conn)
    db = PoolDatabase(dsn, size=1, name="nojit", timeout=TIMEOUT)
    try:
        assert db.run(lambda conn: conn.execute("SHOW jit").fetchone()) == ("off",)
        assert "JIT:" not in db.run(explain)
    finally:
        db.close()


def test_relay_sessions_count_live_leases_past_the_dead_entries_of_finished_ones(
    dsn: str,
) -> None:
    # A finished lease leaves a dead entry in the leased-rows index until
    # VACUUM. A bitmap scan visits the heap page of each one every time: under
    # a steady stream the in-flight count behind every claim walked 50,000
    # of them, 10 ms on average (docs/benchmarks-changes.md). A relay session scans
    # the index instead, and the btree marks what it found dead.
    with psycopg.connect(dsn, autocommit=True) as conn:
        # As between two autovacuum visits (one a minute at most).
        conn.execute("ALTER TABLE outbox SET (autovacuum_enabled = false)")
        enqueue_many(conn, [NewMessage("order", str(i), "order.created", {}) for i in range(3000)])
        claimed = store.claim_batch(
            conn, owner="w", batch=3000, lease=timedelta(seconds=60), count_attempt=False
        ).claimed
        store.finalize(conn, [Outcome.done(c) for c in claimed[10:]])
    in_flight = queries_for(OutboxTable.parse(None)).in_flight

    def plan(conn: psycopg.Connection[Any]) -> tuple[int, str, int]:
        # Bound client-side: EXPLAIN takes no bind parameters.
        cur = ClientCursor(conn)
        count = cur.execute(in_flight, {"now": None}).fetchone()
        explain = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + in_flight
        root = cur.execute(explain, {"now": None}).fetchone()[0][0]["Plan"]  # type: ignore[index]
        kinds = []
        node = root
        while node is not None:
            kinds.append(node["Node Type"])
            node = (node.get("Plans") or [None])[0]
        assert count is not None
        return (
            int(count[0]),
            " / ".join(kinds),
            int(root["Shared Hit Blocks"]) + int(root["Shared Read Blocks"]),
        )

    with psycopg.connect(dsn, autocommit=True) as conn:
        plain = plan(conn)
    db = PoolDatabase(dsn, size=1, name="counting", timeout=TIMEOUT)
    try:
        relay = db.run(plan)
    finally:
        db.close()
    # The control: a plain session walks every dead entry's heap page.
    assert plain[0] == 10 and "Bitmap Heap Scan" in plain[1], plain
    # An index scan: the only kind that marks dead entries (when no older
    # snapshot can still see them, which a busy server decides; so the pages
    # touched are reported, not asserted).
    assert relay[0] == 10 and "Bitmap" not in relay[1], relay
    print(f"pages touched: plain session {plain[2]}, relay session {relay[2]}")


def test_relay_sessions_say_whose_they_are_in_pg_stat_activity(dsn: str) -> None:
    """A worker's sessions had no application_name (the exporter's and the
    CLI's do): the pool's name, with the pid, unless the DSN names one."""
    from psycopg.conninfo import make_conninfo

    for conninfo, expected in (
        (dsn, "outbox-relay-4242"),
        (make_conninfo(dsn, application_name="shop"), "shop"),
    ):
        db = PoolDatabase(conninfo, size=1, name="outbox-relay-4242", timeout=TIMEOUT)
        try:
            row = db.run(lambda conn: conn.execute("SHOW application_name").fetchone())
            assert row == (expected,)
        finally:
            db.close()
