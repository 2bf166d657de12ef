"""The start-up check of a relay worker or beat rides out a session lost midway.

A beat whose check lost its session to ``pg_terminate_backend`` (or a
failover) used to exit, and with it every claim and rescue tick: the fault
suite's terminated-backends scenario left rows leased for good. Real
PostgreSQL: the check is made to wait on a lock, its backend terminated
there, and the check must retry and pass.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery
from psycopg.conninfo import make_conninfo

import outbox_relay
from outbox_relay.celery.runtime import Installation
from outbox_relay.errors import ConfigError

from .celery_procs import wait_for


def _installation(dsn: str) -> Installation:
    app = Celery(f"check-{uuid.uuid4().hex[:6]}", broker="memory://")
    return outbox_relay.install(app, dsn=dsn, publisher="tests.apps.recording:publish")


def test_a_check_whose_session_is_terminated_retries_and_passes(dsn: str) -> None:
    inst = _installation(dsn)
    outcome: list[BaseException | None] = []

    def check() -> None:
        try:
            inst.check_database(wait_seconds=20)
            outcome.append(None)
        except BaseException as exc:  # reported below
            outcome.append(exc)

    with psycopg.connect(dsn) as holder:
        # The check reads the migrations table: hold it, so the check waits there.
        holder.execute("LOCK TABLE outbox_migrations IN ACCESS EXCLUSIVE MODE")
        thread = threading.Thread(target=check, daemon=True)
        thread.start()
        with psycopg.connect(dsn, autocommit=True) as admin:

            def waiting_pids() -> list[int]:
                rows = admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
                ).fetchall()
                return [r[0] for r in rows]

            [pid] = wait_for(waiting_pids, timeout=20, what="the check waiting on the lock")
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            time.sleep(0.2)
        holder.rollback()  # the lock goes; the retried check can read the table
    thread.join(30)
    assert outcome == [None], f"the check gave up: {outcome}"


def test_a_missing_database_still_fails_at_once(dsn: str) -> None:
    # Only a lost session is retried: a refusal is a setting to fix.
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = conninfo_to_dict(dsn)
    bad = make_conninfo(dsn, dbname=f"{params['dbname']}_missing")
    inst = _installation(bad)
    started = time.monotonic()
    with pytest.raises(ConfigError, match="cannot connect to OUTBOX_DSN"):
        inst.check_database(wait_seconds=20)
    assert time.monotonic() - started < 10


@contextlib.contextmanager
def login_role(dsn: str, prefix: str, kind: Any) -> Iterator[str]:
    """A role of its own that may log in, with ``kind``'s grants (or none);
    dropped with whatever it owns afterwards."""
    from psycopg import sql

    from outbox_relay import operations

    role = f"{prefix}_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(role)
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(ident))
        if kind is not None:
            admin.execute(operations.grants(role, kind))
    try:
        yield role
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(ident))
            admin.execute(sql.SQL("DROP ROLE {}").format(ident))


def grant_relay(dsn: str, role: str) -> None:
    from outbox_relay import operations

    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(operations.grants(role, "relay"))


def test_a_role_without_the_relays_grants_is_told_which_to_run(dsn: str) -> None:
    """Connected, but refused the table: the error names the grant command,
    not "cannot connect" (which sent a new user to the DSN)."""
    with login_role(dsn, "outbox_nogrant", None) as role:
        inst = _installation(make_conninfo(dsn, user=role))
        with pytest.raises(ConfigError) as refused:
            inst.check_database()
        message = str(refused.value)
        assert "cannot connect" not in message
        assert f"role '{role}' may not use the outbox table public.outbox" in message
        assert "permission denied" in message
        assert f"`outbox-relay grant --role {role} --kind relay`" in message
        grant_relay(dsn, role)
        inst.check_database()  # the grants it named are enough


def test_an_operators_role_is_refused_at_start_not_at_every_claim(dsn: str) -> None:
    """An operator's grants read the table and its migrations, so the check
    passed, and every claim then failed with "permission denied for table
    outbox" (InsufficientPrivilege, every 5 s, no hint)."""
    with login_role(dsn, "outbox_operator", "operator") as role:
        inst = _installation(make_conninfo(dsn, user=role))
        with pytest.raises(ConfigError) as refused:
            inst.check_database()
        message = str(refused.value)
        assert f"role '{role}' lacks UPDATE (" in message
        assert "UPDATE (lease_owner)" in message and "UPDATE (lease_until)" in message
        assert "UPDATE (status)" not in message  # an operator moves dead rows back
        assert "SELECT" in message  # an operator never reads the payload
        assert f"`outbox-relay grant --role {role} --kind relay`" in message
        grant_relay(dsn, role)
        inst.check_database()  # the grants it named are enough
