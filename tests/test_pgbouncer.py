"""The relay behind PgBouncer in transaction mode (``pool_mode = transaction``).

A pooler in transaction mode gives a client a server session for one
transaction at a time: an autocommit statement, or the next transaction, may
run in another server session than the one before it. Two things the relay
did per session went wrong there (a new user's walkthrough, PgBouncer 1.18):

* psycopg prepares a statement on the server after five runs; the sixth run
  through the pooler could reach a server session without it ("prepared
  statement "_pg3_1" does not exist"), one with another client's statement
  of that name, or one that had it already ("already exists"): deliveries
  failed and their rows waited out their leases, and a metrics scrape now
  and then reported the database down;
* the session settings of a relay connection (statement_timeout 10 s, jit
  off ...) stayed with the server session and reached the pooler's other
  clients, the application's among them.

``Settings.transaction_pooling`` turns both off. Each test makes the server
session change deterministic: PgBouncer hands out the server session used
last, so a client that holds a transaction open there sends the next client
to another one. Skipped, with the reason, where the ``pgbouncer`` binary is
absent (Debian: ``apt-get install pgbouncer``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import outbox_relay
from outbox_relay import store
from outbox_relay.celery.listener import NotifyListener
from outbox_relay.celery.runtime import session_advice
from outbox_relay.config import Settings
from outbox_relay.db import PoolDatabase
from outbox_relay.errors import ConfigError
from outbox_relay.metrics import OutboxCollector
from outbox_relay.table import OutboxTable

from .faults.servers import free_port

PGBOUNCER = shutil.which("pgbouncer") or (
    "/usr/sbin/pgbouncer" if os.path.exists("/usr/sbin/pgbouncer") else None
)
needs_pgbouncer = pytest.mark.skipif(
    PGBOUNCER is None, reason="the pgbouncer binary is absent (apt-get install pgbouncer)"
)


class Bouncer:
    """A PgBouncer in transaction mode in front of the test server."""

    def __init__(self, admin_dsn: str) -> None:
        assert PGBOUNCER is not None
        params = conninfo_to_dict(admin_dsn)
        host = str(params.get("host") or "127.0.0.1")
        port = str(params.get("port") or 5432)
        user = str(params.get("user") or "postgres")
        password = str(params.get("password") or "")
        self.folder = Path(tempfile.mkdtemp(prefix="outbox-pgbouncer-"))
        self.folder.chmod(0o755)
        self.port = free_port()
        (self.folder / "users.txt").write_text(f'"{user}" "{password}"\n')
        (self.folder / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={host} port={port}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {self.folder / 'users.txt'}\n"
            "pool_mode = transaction\ndefault_pool_size = 4\n"
            f"admin_users = {user}\n"
        )
        for name in ("users.txt", "pgbouncer.ini"):
            (self.folder / name).chmod(0o644)
        # PgBouncer refuses to run as root; -u drops to another user.
        as_user = ["-u", "nobody"] if os.geteuid() == 0 else []
        self.process = subprocess.Popen(
            [PGBOUNCER, *as_user, str(self.folder / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self._admin = admin_dsn
        deadline = time.monotonic() + 10
        while True:
            try:
                with psycopg.connect(self.dsn_for(admin_dsn), connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                break
            except psycopg.OperationalError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    err = self.process.stderr.read().decode() if self.process.stderr else ""
                    self.close()
                    pytest.fail(f"pgbouncer did not start: {err[-500:]}")
                time.sleep(0.1)

    def admin_dsn(self) -> str:
        """PgBouncer's admin console (SHOW, RECONNECT ...)."""
        return make_conninfo(self._admin, host="127.0.0.1", port=str(self.port), dbname="pgbouncer")

    def dsn_for(self, dsn: str) -> str:
        """``dsn`` (a database of the test server) through this pooler."""
        return make_conninfo(dsn, host="127.0.0.1", port=str(self.port))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stderr:
            self.process.stderr.close()
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(scope="module")
def bouncer(pg_admin_dsn: str) -> Iterator[Bouncer]:
    if PGBOUNCER is None:
        pytest.skip("the pgbouncer binary is absent (apt-get install pgbouncer)")
    server = Bouncer(pg_admin_dsn)
    try:
        yield server
    finally:
        server.close()


def hold_server_session(dsn: str) -> psycopg.Connection[Any]:
    """A client inside an open transaction: it keeps the server session used
    last, so the next client's statement runs in another one."""
    holder = psycopg.connect(dsn, prepare_threshold=None)
    holder.execute("SELECT 1")  # psycopg opens the transaction here
    return holder


def pool(dsn: str, *, transaction_pooling: bool) -> PoolDatabase:
    return PoolDatabase(dsn, size=1, name="test-pgbouncer", transaction_pooling=transaction_pooling)


def next_due(conn: psycopg.Connection[Any]) -> Any:
    return store.next_due(conn)


def run_across_sessions(
    db: PoolDatabase, fn: Callable[[psycopg.Connection[Any]], Any], dsn: str
) -> Any:
    """``fn`` six times (prepared on the server after five), then again while
    that server session is held by another client."""
    for _ in range(6):
        db.run(fn)
    holder = hold_server_session(dsn)
    try:
        return db.run(fn, retry=False)
    finally:
        holder.close()


# ------------------------------------------------------------------ settings
def test_transaction_pooling_refuses_what_needs_a_session_of_its_own() -> None:
    with pytest.raises(ConfigError, match="OUTBOX_LISTEN_DSN"):
        Settings.load(environ={"OUTBOX_TRANSACTION_POOLING": "true"})
    with pytest.raises(ConfigError, match="OUTBOX_SYNCHRONOUS_FINALIZE"):
        Settings.load(
            environ={
                "OUTBOX_TRANSACTION_POOLING": "true",
                "OUTBOX_LISTEN": "false",
                "OUTBOX_SYNCHRONOUS_FINALIZE": "false",
            }
        )
    off = Settings.load(environ={"OUTBOX_TRANSACTION_POOLING": "true", "OUTBOX_LISTEN": "false"})
    assert off.transaction_pooling and not off.listen


def test_the_listener_may_connect_elsewhere_and_its_password_is_masked() -> None:
    s = Settings.load(
        environ={
            "OUTBOX_DSN": "postgresql://relay:pw1@pgbouncer:6432/app",
            "OUTBOX_LISTEN_DSN": "postgresql://relay:pw2@db:5432/app",
            "OUTBOX_TRANSACTION_POOLING": "true",
        }
    )
    assert s.listen_connection_dsn() == "postgresql://relay:pw2@db:5432/app"
    assert "pw2" not in repr(s) and "pw1" not in repr(s)
    assert Settings.load(environ={"OUTBOX_DSN": "host=db"}).listen_connection_dsn() == "host=db"


def test_session_advice_names_what_the_role_lacks() -> None:
    bounded = {
        "statement_timeout": "10000",
        "idle_in_transaction_session_timeout": "5000",
        "jit": "off",
        "enable_bitmapscan": "off",
    }
    assert session_advice(bounded, 10.0, "relay", "app") == ""
    assert session_advice({}, 10.0, "relay", "app") == ""  # not behind a pooler
    advice = session_advice(
        {**bounded, "statement_timeout": "0", "jit": "on"}, 10.0, "relay", "app"
    )
    assert "statement_timeout 0 (none), jit on" in advice
    assert 'ALTER ROLE "relay" IN DATABASE "app" SET statement_timeout = \'10000ms\'' in advice
    assert 'ALTER ROLE "relay" IN DATABASE "app" SET jit = \'off\'' in advice
    assert "idle_in_transaction" not in advice and "bitmapscan" not in advice


# ------------------------------------------------------------------ through PgBouncer
@needs_pgbouncer
def test_prepared_statements_break_through_the_pooler(bouncer: Bouncer, dsn: str) -> None:
    """What the relay's connections did before transaction_pooling (and still
    do without it): the sixth run of a query is prepared in one server
    session and executed in another."""
    through = bouncer.dsn_for(dsn)
    db = pool(through, transaction_pooling=False)
    try:
        with pytest.raises(psycopg.errors.InvalidSqlStatementName, match="_pg3_"):
            run_across_sessions(db, next_due, through)
    finally:
        db.close()


@needs_pgbouncer
def test_the_relay_pool_prepares_nothing_with_transaction_pooling(
    bouncer: Bouncer, dsn: str
) -> None:
    through = bouncer.dsn_for(dsn)
    db = pool(through, transaction_pooling=True)
    try:
        assert run_across_sessions(db, next_due, through) is None
        # Claims and finalizes, more than five of each, across server sessions.
        table = OutboxTable()
        for round_ in range(8):
            with psycopg.connect(through, prepare_threshold=None) as app:
                outbox_relay.enqueue(
                    app, aggregate_type="a", aggregate_id=round_, event_type="e", payload={}
                )
            holder = hold_server_session(through) if round_ % 2 else None
            try:
                batch = db.run(
                    lambda c: store.claim(c, owner="t", batch=10, lease=60, table=table),
                    retry=False,
                )
                assert [m.aggregate_id for m in batch] == [str(round_)]
                assert db.run(partial(store.mark_done, msg=batch[0], table=table))
            finally:
                if holder is not None:
                    holder.close()
    finally:
        db.close()


@needs_pgbouncer
@pytest.mark.parametrize("transaction_pooling", [False, True])
def test_relay_session_settings_and_other_clients(
    bouncer: Bouncer, dsn: str, transaction_pooling: bool
) -> None:
    """Without transaction_pooling the relay's SETs reach the next client of
    the server session (the application's web request, say); with it, none."""
    through = bouncer.dsn_for(dsn)
    with psycopg.connect(dsn) as direct:
        server_default = direct.execute("SHOW statement_timeout").fetchone()
    db = pool(through, transaction_pooling=transaction_pooling)
    try:
        db.run(lambda c: c.execute("SELECT 1"))
        with psycopg.connect(through, prepare_threshold=None) as app:
            seen = app.execute(
                "SELECT current_setting('statement_timeout'), current_setting('jit')"
            )
            timeout, jit = seen.fetchone() or ("", "")
    finally:
        db.close()
    if transaction_pooling:
        assert (timeout,) == server_default
    else:
        assert jit == "off"  # the relay's, leaked to the application
        assert (timeout,) != server_default


@needs_pgbouncer
def test_session_defaults_ignore_a_set_left_by_another_client(bouncer: Bouncer, dsn: str) -> None:
    through = bouncer.dsn_for(dsn)
    with psycopg.connect(dsn) as direct:
        row = direct.execute(
            "SELECT reset_val FROM pg_settings WHERE name = 'statement_timeout'"
        ).fetchone()
    assert row is not None
    with psycopg.connect(through, autocommit=True, prepare_threshold=None) as other:
        other.execute("SET statement_timeout = '3s'")  # stays with the server session
    with psycopg.connect(through, autocommit=True, prepare_threshold=None) as relay:
        assert relay.execute("SHOW statement_timeout").fetchone() == ("3s",)
        assert store.session_defaults(relay)["statement_timeout"] == row[0]


@needs_pgbouncer
def test_the_metrics_exporter_reads_through_the_pooler(bouncer: Bouncer, dsn: str) -> None:
    through = bouncer.dsn_for(dsn)
    collector = OutboxCollector(through)
    try:
        for _ in range(6):
            collector.read()
        holder = hold_server_session(through)
        try:
            assert collector.read() is not None
        finally:
            holder.close()
    finally:
        collector._close()


@needs_pgbouncer
def test_a_direct_listen_dsn_hears_rows_written_through_the_pooler(
    bouncer: Bouncer, dsn: str
) -> None:
    through = bouncer.dsn_for(dsn)
    fired = threading.Event()
    s = Settings.load(
        environ={
            "OUTBOX_DSN": through,
            "OUTBOX_LISTEN_DSN": dsn,
            "OUTBOX_TRANSACTION_POOLING": "true",
        }
    )
    listener = NotifyListener(s.listen_connection_dsn(), OutboxTable(), fired.set, debounce=0.0)
    listener.start()
    try:
        assert fired.wait(10), "the listener's first claim"
        for i in range(3):
            fired.clear()
            with psycopg.connect(through, prepare_threshold=None) as app:
                outbox_relay.enqueue(
                    app, aggregate_type="a", aggregate_id=i, event_type="e", payload={}
                )
            assert fired.wait(10), f"no claim after the NOTIFY of row {i}"
    finally:
        listener.stop()


@needs_pgbouncer
def test_the_start_check_names_the_role_settings_to_add(
    bouncer: Bouncer, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A relay that sets no session setting says which bounds its role lacks,
    and stops saying so once the role has them (and the pooler's sessions
    were made after that)."""
    through = bouncer.dsn_for(dsn)
    app = Celery(f"pgb-{uuid.uuid4().hex[:6]}", broker="memory://")
    inst = outbox_relay.install(
        app,
        dsn=through,
        publisher="tests.apps.recording:publish",
        transaction_pooling=True,
        listen_dsn=dsn,
        database_timeout_seconds=7,
    )
    caplog.set_level(logging.WARNING, logger="outbox_relay")
    inst.check_database(wait_seconds=5)
    warned = [r.getMessage() for r in caplog.records if "TRANSACTION_POOLING" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "SET statement_timeout = '7000ms'" in warned[0]
    with psycopg.connect(dsn, autocommit=True) as direct:
        role, database = direct.execute("SELECT current_user, current_database()").fetchone()  # type: ignore[misc]
        for statement in re.findall(r"ALTER ROLE [^;]*", warned[0]):
            assert f'"{role}" IN DATABASE "{database}"' in statement
            direct.execute(statement)
    # New server sessions: the pooler's own RECONNECT, as the warning says.
    with psycopg.connect(bouncer.admin_dsn(), autocommit=True) as console:
        console.execute(f"RECONNECT {database}")
    caplog.clear()
    inst.check_database(wait_seconds=5)
    assert not [r for r in caplog.records if "TRANSACTION_POOLING" in r.getMessage()]
