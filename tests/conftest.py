"""Test infrastructure: real PostgreSQL, one fresh database per test.

The server comes from ``OUTBOX_TEST_DSN`` when set (CI points it at the
machine's PostgreSQL); otherwise from testcontainers when a Docker engine
answers; otherwise from ``pgserver``, an embedded PostgreSQL installed by pip,
so ``make test`` works on a machine with nothing installed.

Each test gets its own database, cloned from a template that already holds
the migrated schema (cloning is much faster than migrating every time).
"""

from __future__ import annotations

import difflib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import outbox_relay
from outbox_relay._redact import mask_dsn

from . import services

# The variables the tests read. A misspelled one (OUTBOX_TEST_DNS) would
# otherwise send the run to the embedded servers without a word.
TEST_VARIABLES = (
    "OUTBOX_TEST_DSN",
    "OUTBOX_TEST_REDIS_URL",
    "OUTBOX_TEST_AMQP_URL",
    "OUTBOX_TEST_NO_DOCKER",
    "OUTBOX_TEST_FAULTS_REPORT",
    "OUTBOX_TEST_SOAK_SECONDS",
    "OUTBOX_TEST_SOAK_CSV",
)


def pytest_configure(config: pytest.Config) -> None:
    unknown = sorted(
        k for k in os.environ if k.startswith("OUTBOX_TEST_") and k not in TEST_VARIABLES
    )
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, TEST_VARIABLES, n=1)
            hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
        raise pytest.UsageError(
            f"unknown test variable(s): {', '.join(hints)}; "
            f"the tests read {', '.join(TEST_VARIABLES)}"
        )


class MaskedDsn(str):
    """A DSN whose repr hides its password: pytest prints a failing test's
    arguments (``dsn = '...'``) in its traceback, and a run against a server
    with a password must not put it in the CI log."""

    __slots__ = ()

    def __repr__(self) -> str:
        return repr(mask_dsn(str(self)))


@pytest.fixture(scope="session")
def pg_admin_dsn() -> Iterator[str]:
    """A DSN for a superuser connection to a maintenance database."""
    explicit = os.environ.get("OUTBOX_TEST_DSN")
    if explicit:
        yield MaskedDsn(explicit)
        return
    if services.docker_available():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:16-alpine", driver=None) as pg:
            yield pg.get_connection_url()
        return
    import pgserver

    data = tempfile.mkdtemp(prefix="outbox-relay-pg-")
    server = pgserver.get_server(data, cleanup_mode="stop")
    try:
        yield server.get_uri()
    finally:
        server.cleanup()
        shutil.rmtree(data, ignore_errors=True)


def _admin(dsn: str) -> psycopg.Connection:
    return psycopg.connect(dsn, autocommit=True)


@pytest.fixture(scope="session")
def pg_template(pg_admin_dsn: str) -> Iterator[str]:
    """Name of a template database holding the migrated outbox schema."""
    name = f"outbox_tpl_{uuid.uuid4().hex[:10]}"
    with _admin(pg_admin_dsn) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    with psycopg.connect(make_conninfo(pg_admin_dsn, dbname=name), autocommit=True) as conn:
        outbox_relay.migrate(conn)
    try:
        yield name
    finally:
        with _admin(pg_admin_dsn) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def fresh_database(pg_admin_dsn: str) -> Iterator[str]:
    """A DSN to a new empty database (no outbox schema), dropped after the test."""
    name = f"outbox_t_{uuid.uuid4().hex[:12]}"
    with _admin(pg_admin_dsn) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield MaskedDsn(make_conninfo(pg_admin_dsn, dbname=name))
    finally:
        with _admin(pg_admin_dsn) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def dsn(pg_admin_dsn: str, pg_template: str) -> Iterator[str]:
    """A DSN to a new database with the outbox migrated, dropped after the test."""
    name = f"outbox_t_{uuid.uuid4().hex[:12]}"
    with _admin(pg_admin_dsn) as admin:
        admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"')
    try:
        yield MaskedDsn(make_conninfo(pg_admin_dsn, dbname=name))
    finally:
        with _admin(pg_admin_dsn) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection]:
    """An autocommit connection to this test's database."""
    with psycopg.connect(dsn, autocommit=True) as connection:
        yield connection


@pytest.fixture
def owned_redis() -> Iterator[Any]:
    """A Redis server this test alone uses, so it may flush, kill and restart it."""
    from .faults.servers import OwnedRedis

    server = OwnedRedis()
    try:
        yield server
    finally:
        server.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (make test), tests on the shared RabbitMQ run in one
    process, one at a time; everything else has a database, a Redis database
    or a server of its own and runs side by side."""
    for item in items:
        name = item.nodeid.lower()
        if "amqp" in name or "rabbit" in name or "amqp_broker" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("rabbitmq"))
