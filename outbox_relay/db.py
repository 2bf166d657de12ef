"""How services reach PostgreSQL: a ``Database`` runs a function with a connection.

``DirectDatabase`` wraps one connection the caller owns (tests, the plain
loop, a user's own script). ``PoolDatabase`` is a per-process pool that
retries an idempotent call once on a broken connection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import psycopg
from psycopg_pool import ConnectionPool

from .store._base import relax_commit

__all__ = ["Database", "DirectDatabase", "PoolDatabase", "as_database"]

log = logging.getLogger("outbox_relay.db")
T = TypeVar("T")


class Database(Protocol):
    def run(self, fn: Callable[[psycopg.Connection[Any]], T], *, retry: bool = True) -> T:
        """Call ``fn`` with a connection. ``retry=False`` for a call that must not
        repeat after its commit may have happened (a claim)."""
        ...


class DirectDatabase:
    """A ``Database`` over one connection the caller owns; never retries."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def run(self, fn: Callable[[psycopg.Connection[Any]], T], *, retry: bool = True) -> T:
        return fn(self.conn)


def as_database(db: psycopg.Connection[Any] | Database) -> Database:
    return DirectDatabase(db) if isinstance(db, psycopg.Connection) else db


class PoolDatabase:
    """A per-process connection pool that retries an idempotent call once.

    A terminated backend, a restarted server or a failover surfaces as
    ``OperationalError`` on the next statement. Reads and fenced writes are
    safe to repeat, so one retry on a fresh connection turns most of those
    into a blip. A claim is not: if the connection broke after its COMMIT
    reached the server, a retry would lease a second batch while the first
    one's rows sit leased with no task to deliver them (until the rescuer
    frees them a lease later). Such calls pass ``retry=False``.
    """

    def __init__(
        self, dsn: str, *, size: int, name: str, synchronous_finalize: bool = True
    ) -> None:
        def configure(conn: psycopg.Connection[Any]) -> None:
            if not synchronous_finalize:
                # Finalizes stop waiting for the WAL flush; claims still
                # commit durably (store.claim sets it back for its transaction).
                relax_commit(conn)

        self.pool = ConnectionPool(
            dsn,
            min_size=1,
            max_size=max(1, size),
            kwargs={"autocommit": True},
            configure=configure,
            name=name,
            open=True,
        )

    def run(self, fn: Callable[[psycopg.Connection[Any]], T], *, retry: bool = True) -> T:
        attempts = 2 if retry else 1
        for attempt in range(1, attempts + 1):
            with self.pool.connection() as conn:
                try:
                    return fn(conn)
                except psycopg.OperationalError:
                    if attempt == attempts or not conn.broken:
                        raise
                    log.warning("database connection lost; retrying on a new connection")
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        self.pool.close()
