"""The database under the relay: backends terminated, the server crashed and
restarted, rows locked by a long transaction, the database read-only."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import outbox_relay

from .harness import LEASE_LOST, LOST_RESPONSE, Run
from .servers import OwnedPostgres, OwnedRedis

pytestmark = [pytest.mark.faults, pytest.mark.celery]

ALLOW = {LEASE_LOST, LOST_RESPONSE}


def _terminate(dsn: str) -> int:
    """Terminate every other backend on this database; return how many."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
    return len(rows)


def test_backends_terminated_under_the_relay(
    dsn: str, fresh_database: str, tmp_path: Path, owned_redis: OwnedRedis
) -> None:
    run = Run("terminate", dsn, fresh_database, tmp_path, broker=owned_redis.url)
    try:
        run.workers(2)
        run.beat()
        run.enqueue(1000)
        killed = 0
        with run.producing():
            for _ in range(5):
                time.sleep(1.5)
                with run.fault("pg_terminate_backend"):
                    killed += _terminate(dsn)
        run.faults.append(
            f"pg_terminate_backend on every relay connection, 5 times ({killed} backends)"
        )
        run.wait_finished(120)
        run.ledger(allow=ALLOW)
        assert killed >= 5
    finally:
        run.close()


def test_database_server_crashed_and_restarted(
    fresh_database: str, tmp_path: Path, owned_redis: OwnedRedis
) -> None:
    """The outbox's server (one this test owns) stops at once, with no
    checkpoint, stays down 5 s, and comes back through crash recovery. The
    beat is started while it is down: it waits for its database at start."""
    server = OwnedPostgres()
    try:
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE faults")
        dsn = make_conninfo(server.admin_dsn, dbname="faults")
        with psycopg.connect(dsn, autocommit=True) as conn:
            outbox_relay.migrate(conn)
        run = Run("pg-restart", dsn, fresh_database, tmp_path, broker=owned_redis.url)
        try:
            run.workers(1)
            run.enqueue(800)
            with run.producing():
                time.sleep(2)
                with run.fault("PostgreSQL crash"):
                    server.crash()
                    beat = run.beat()
                    time.sleep(5)
                    server.start()
            run.faults.append(
                "PostgreSQL stopped with -m immediate mid-run, down 5 s, crash recovery;"
                " the beat started while it was down"
            )
            run.wait_finished(150)
            run.ledger(allow=ALLOW)
            assert "not reachable yet, retrying" in beat.text(), beat.text()[-3000:]
        finally:
            run.close()
    finally:
        server.close()


def test_rows_locked_by_a_long_transaction(
    dsn: str, fresh_database: str, tmp_path: Path, owned_redis: OwnedRedis
) -> None:
    """An application transaction holds the first 50 pending rows in claim
    order FOR UPDATE: the relay delivers every other message meanwhile (SKIP
    LOCKED: a claim that waited on them would deliver nothing), then those."""
    run = Run("row-locks", dsn, fresh_database, tmp_path, broker=owned_redis.url)
    locked: list[int] = []
    holding = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with psycopg.connect(dsn) as conn:
            rows = conn.execute(
                "SELECT id FROM outbox WHERE status = 'pending'"
                " ORDER BY available_at, id LIMIT 50 FOR UPDATE"
            ).fetchall()
            locked.extend(r[0] for r in rows)
            holding.set()
            release.wait(60)
            conn.rollback()

    try:
        run.enqueue(600)
        holder = threading.Thread(target=hold)
        holder.start()
        assert holding.wait(10)
        run.workers(1)
        run.beat()
        deadline = time.monotonic() + 45
        while True:
            with psycopg.connect(dsn, autocommit=True) as conn:
                left = {r[0] for r in conn.execute("SELECT id FROM outbox WHERE status <> 'done'")}
            if left <= set(locked):
                break
            assert time.monotonic() < deadline, (
                f"{len(left - set(locked))} messages nobody locked are still undelivered"
                " while 50 others are locked: does the claim wait on locked rows?"
            )
            time.sleep(0.5)
        assert left == set(locked) and len(locked) == 50  # locked: not claimable
        release.set()
        holder.join(10)
        run.faults.append(
            "the first 50 rows in claim order held FOR UPDATE by another transaction"
            " until every other message was delivered"
        )
        run.wait_finished(90)
        run.ledger(allow=set())
    finally:
        release.set()
        run.close()


def test_database_read_only_for_a_while(
    dsn: str, fresh_database: str, tmp_path: Path, owned_redis: OwnedRedis
) -> None:
    """The outbox's database turns read-only (as a demoted primary or a full
    disk guarded by ``default_transaction_read_only`` does) for 10 s."""
    name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    run = Run("read-only", dsn, fresh_database, tmp_path, broker=owned_redis.url)

    def read_only(on: bool) -> None:
        # This session must be writable to turn the setting off again.
        with psycopg.connect(
            dsn, autocommit=True, options="-c default_transaction_read_only=off"
        ) as conn:
            conn.execute(
                psycopg.sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = {}").format(
                    psycopg.sql.Identifier(str(name)), psycopg.sql.SQL("on" if on else "off")
                )
            )
        _terminate(dsn)  # sessions read the setting when they start

    try:
        run.workers(1)
        run.beat()
        run.enqueue(600)
        with run.producing():
            time.sleep(2)
            with run.fault("read-only"):
                read_only(True)
                time.sleep(10)
                read_only(False)
        run.faults.append(
            "database read-only for 10 s (default_transaction_read_only, sessions reset)"
        )
        run.wait_finished(120)
        run.ledger(allow=ALLOW)
    finally:
        run.close()
