"""What every store module shares: the query set for a table and the
transaction a single store call runs in."""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from ..sql.queries import Queries, queries_for
from ..table import OutboxTable

__all__ = [
    "MAX_ERROR_LENGTH",
    "TableLike",
    "begin_caller_transaction",
    "clip",
    "configure_relay_session",
    "duration",
    "failed_transaction",
    "queries",
    "relax_commit",
    "require_connection",
    "statement_tx",
    "tableless",
]

MAX_ERROR_LENGTH = 2000
TableLike = OutboxTable | str | None


def queries(table: TableLike) -> Queries:
    """Every named query rendered for ``table`` (cached per table; None: the
    table ``enqueue`` writes to, see ``OutboxTable.parse``)."""
    return queries_for(OutboxTable.parse(table))


def tableless() -> Queries:
    """The queries for statements that involve no table (session settings,
    ``SELECT 1``): rendered once, without looking up the producers' table,
    which a relay session or a durable run has no reason to read."""
    return queries_for(_ANY_TABLE)


_ANY_TABLE = OutboxTable()


def statement_tx(conn: psycopg.Connection[Any]) -> AbstractContextManager[Any]:
    """A transaction for one store call.

    On an autocommit connection outside any transaction a single statement is
    already atomic, and skipping BEGIN/COMMIT saves two round trips on the
    hot path. Otherwise use a (possibly nested) transaction block, so the
    call commits, or joins the caller's transaction as a savepoint.
    """
    if (
        require_connection(conn).autocommit
        and conn.info.transaction_status == TransactionStatus.IDLE
    ):
        return nullcontext()
    return conn.transaction()


def failed_transaction() -> psycopg.errors.InFailedSqlTransaction:
    """The error for an enqueue into a transaction that has already failed.

    psycopg would refuse the savepoint too, and log a second error on the way
    out ("savepoint does not exist") that hid the first."""
    return psycopg.errors.InFailedSqlTransaction(
        "the connection's transaction has already failed (a statement before this "
        "enqueue raised): nothing was written; roll the transaction back first"
    )


def require_connection(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """``conn``, or a TypeError that names the mistake (a DSN or a pool
    passed where a connection belongs failed with "'str' object has no
    attribute 'autocommit'")."""
    if isinstance(conn, psycopg.Connection):
        return conn
    kind = type(conn).__name__
    if isinstance(conn, str):
        kind, hint = "str", ": open one with psycopg.connect(dsn)"
    elif isinstance(conn, psycopg.AsyncConnection):
        hint = ": the store's functions are synchronous"
    else:
        hint = ""
    raise TypeError(f"outbox_relay's store functions take a psycopg 3 connection, not {kind}{hint}")


def duration(name: str, value: timedelta | float, *, positive: bool) -> timedelta:
    """``value`` (a timedelta, or seconds as ``enqueue``'s delay takes them) as
    a timedelta; ValueError naming ``name`` for anything else, or for a
    negative one (or zero, when it must be ``positive``: a lease of 0 s
    ends before the claim commits, and the same row is claimed again)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number of seconds, not {value}")
        value = timedelta(seconds=value)
    if not isinstance(value, timedelta):
        raise ValueError(f"{name} must be a timedelta or seconds, not {type(value).__name__}")
    if value < timedelta(0) or (positive and not value):
        least = "more than" if positive else "at least"
        raise ValueError(f"{name} must be {least} 0s, not {value}")
    return value


def clip(error: str | None) -> str | None:
    """An error text short enough for ``last_error``."""
    if error is None:
        return None
    return error if len(error) <= MAX_ERROR_LENGTH else error[: MAX_ERROR_LENGTH - 3] + "..."


def begin_caller_transaction(conn: psycopg.Connection[Any]) -> None:
    """Make psycopg open the caller's (not yet begun) transaction now."""
    conn.execute(tableless().begin_caller_transaction)


def relax_commit(conn: psycopg.Connection[Any]) -> None:
    """Let this session's commits stop waiting for the WAL flush (finalizes only)."""
    conn.execute(tableless().async_commit_session)


def configure_relay_session(conn: psycopg.Connection[Any], seconds: float) -> None:
    """Bound every statement, and every client wait inside a transaction, of
    this session on the server, and turn JIT off (queries.sql ``relay_session``)."""
    conn.execute(tableless().relay_session, {"value": f"{int(seconds * 1000)}ms"})
