"""The inbox itself: record a message id in the effect's transaction, and
``@once`` for plain functions. Celery tasks are in ``inbox/celery.py``."""

from __future__ import annotations

import atexit
import contextvars
import functools
import inspect
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime, timedelta
from typing import Any, TypeVar

import psycopg
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool

from ..errors import ConfigError, OutboxError
from ..model import Message
from ..store import inbox as inbox_store
from ..store.inbox import INBOX_MIGRATION, InboxLike
from ..table import InboxTable

__all__ = [
    "INBOX_MIGRATION",
    "ConnectionFactory",
    "InboxError",
    "InboxTable",
    "TableLike",
    "connection_from_pool",
    "current_connection",
    "ensure_inbox",
    "once",
    "purge_inbox",
    "receive",
    "record",
    "running",
    "seen",
]

log = logging.getLogger("outbox_relay.inbox")

R = TypeVar("R")
ConnectionFactory = Callable[[], AbstractContextManager[psycopg.Connection[Any]]]
TableLike = InboxLike

# Keys land in a btree primary key; PostgreSQL rejects index rows over ~2.7 kB.
_MAX_KEY_BYTES = 1024


class InboxError(OutboxError):
    """The inbox was used in a way that cannot de-duplicate (no transaction, no id)."""


def _check_ids(consumer: str, message_id: str) -> None:
    for what, value in (("consumer", consumer), ("message_id", message_id)):
        if not isinstance(value, str) or not value:
            raise InboxError(f"inbox {what} must be a non-empty string, got {value!r}")
        if len(value.encode("utf-8")) > _MAX_KEY_BYTES:
            raise InboxError(f"inbox {what} is longer than {_MAX_KEY_BYTES} bytes")


# --------------------------------------------------------------- core API
def record(
    conn: psycopg.Connection[Any],
    *,
    consumer: str,
    message_id: str,
    table: TableLike = None,
    now: datetime | None = None,
) -> bool:
    """Record ``message_id`` for ``consumer`` in the current transaction; True if new.

    Must run inside the transaction that makes the message's effect: in
    autocommit mode outside a transaction block, the row would commit on its
    own, and a crash before the effect would lose the message.
    """
    _check_ids(consumer, message_id)
    if conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        raise InboxError(
            "inbox.record() must run inside the transaction that makes the effect "
            "(use inbox.receive(), or conn.transaction())"
        )
    return inbox_store.record(conn, consumer=consumer, message_id=message_id, table=table, now=now)


@contextmanager
def receive(
    conn: psycopg.Connection[Any],
    *,
    consumer: str,
    message_id: str,
    table: TableLike = None,
    now: datetime | None = None,
) -> Iterator[bool]:
    """A transaction that holds the inbox row; yields False for a duplicate.

    The block's database writes commit together with the inbox row, or (on
    an exception) roll back with it, so a failed attempt can run again.
    Inside a transaction the caller already opened, this is a savepoint and
    the caller's commit decides.
    """
    with conn.transaction():
        fresh = record(conn, consumer=consumer, message_id=message_id, table=table, now=now)
        if not fresh:
            log.info("inbox %s: skipping duplicate message %s", consumer, message_id)
        yield fresh


def seen(
    conn: psycopg.Connection[Any], *, consumer: str, message_id: str, table: TableLike = None
) -> bool:
    """Whether ``consumer`` already recorded ``message_id`` (committed, or in this transaction)."""
    _check_ids(consumer, message_id)
    return inbox_store.seen(conn, consumer=consumer, message_id=message_id, table=table)


def purge_inbox(
    conn: psycopg.Connection[Any],
    *,
    older_than: timedelta,
    consumer: str | None = None,
    batch: int = 5000,
    table: TableLike = None,
    now: datetime | None = None,
) -> int:
    """Delete inbox rows received more than ``older_than`` ago; return how many.

    Deletes in batches, each its own short transaction, so a large purge
    never holds many locks or one long transaction. Keep ``older_than``
    longer than a message can still arrive (the relay's whole retry span,
    plus the time an operator may take to retry a dead message): a
    duplicate that comes after its row was purged runs again.
    """
    if older_than < timedelta(0):
        raise ValueError("older_than must not be negative")
    if batch <= 0:
        raise ValueError("batch must be positive")
    total = 0
    while True:
        deleted = inbox_store.purge_batch(
            conn, older_than=older_than, consumer=consumer, batch=batch, table=table, now=now
        )
        total += deleted
        if deleted < batch:
            return total


def ensure_inbox(conn: psycopg.Connection[Any], *, table: TableLike = None) -> InboxTable:
    """Create the inbox table if it is missing (idempotent; safe concurrently).

    ``outbox_relay.migrate`` already creates the inbox beside the outbox;
    this is for a consumer's database that has no outbox, or an inbox with a
    name of its own.
    """
    return inbox_store.create(conn, table=table)


# ------------------------------------------------------ connections
_current: contextvars.ContextVar[psycopg.Connection[Any] | None] = contextvars.ContextVar(
    "outbox_relay_inbox_connection", default=None
)


def current_connection() -> psycopg.Connection[Any]:
    """The connection of the inbox transaction running now (``@once``, ``InboxTask``).

    Write the message's effect through it, so it commits with the inbox row.
    """
    conn = _current.get()
    if conn is None:
        raise InboxError("no inbox transaction is running here")
    return conn


@contextmanager
def running(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """Make ``conn`` the ``current_connection()`` while a message's body runs."""
    token = _current.set(conn)
    try:
        yield
    finally:
        _current.reset(token)


_pools: dict[tuple[int, str], ConnectionPool[psycopg.Connection[Any]]] = {}
_pools_lock = threading.Lock()


def _pool(dsn: str, size: int) -> ConnectionPool[psycopg.Connection[Any]]:
    # One pool per DSN per process, opened after fork (never inherited): a
    # socket shared by a forked child and its parent interleaves their bytes.
    key = (os.getpid(), dsn)
    pool = _pools.get(key)
    if pool is None:
        with _pools_lock:
            pool = _pools.get(key)
            if pool is None:
                pool = ConnectionPool(
                    dsn,
                    min_size=1,
                    max_size=max(1, size),
                    check=ConnectionPool.check_connection,
                    name="outbox-relay-inbox",
                    open=True,
                )
                _pools[key] = pool
    return pool


@atexit.register
def _close_pools() -> None:
    pid = os.getpid()
    for (owner, _), pool in list(_pools.items()):
        if owner == pid:
            pool.close(timeout=1.0)


def connection_from_pool(
    dsn: str, size: int = 4
) -> AbstractContextManager[psycopg.Connection[Any]]:
    """A connection from this process's pool for ``dsn`` (made on first use)."""
    return _pool(dsn, size).connection()


def _connection_source(
    dsn: str | None, conn_factory: ConnectionFactory | None, pool_size: int = 4
) -> ConnectionFactory:
    if (dsn is None) == (conn_factory is None):
        raise ConfigError("the inbox needs exactly one of dsn= or conn_factory=")
    if conn_factory is not None:
        return conn_factory
    assert dsn is not None
    return lambda: connection_from_pool(dsn, pool_size)


# ----------------------------------------------------------------- @once
def _key_getter(func: Callable[..., Any], key: str | Callable[..., Any]) -> Callable[..., str]:
    if callable(key):
        return lambda *args, **kwargs: _as_id(key(*args, **kwargs))
    signature = inspect.signature(func)
    params = signature.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if key not in params and not takes_any:
        raise ConfigError(
            f"@once(key={key!r}): {func.__qualname__} has no parameter {key!r}; "
            "name the parameter that holds the message id, or pass a callable"
        )

    def get(*args: Any, **kwargs: Any) -> str:
        bound = signature.bind_partial(*args, **kwargs)
        if key in bound.arguments:
            return _as_id(bound.arguments[key])
        return _as_id(kwargs.get(key))

    return get


def _as_id(value: Any) -> str:
    if isinstance(value, Message):
        return value.idempotency_key
    if value is None or value == "":
        raise InboxError("no message id: the inbox cannot tell a duplicate from a new message")
    return str(value)


def once(
    *,
    consumer: str,
    dsn: str | None = None,
    conn_factory: ConnectionFactory | None = None,
    key: str | Callable[..., Any] = "message_id",
    table: TableLike = None,
    pool_size: int = 4,
) -> Callable[[Callable[..., R]], Callable[..., R | None]]:
    """Run the decorated function at most once per message id for ``consumer``.

    ``key`` names the parameter holding the message id (an ``outbox_relay.
    Message`` there counts by its idempotency key), or is a callable given the
    call's arguments. The function runs inside the inbox transaction: if it
    has a ``conn`` parameter it receives the connection (else use
    ``current_connection()``); its writes commit with the inbox row. A
    duplicate returns None without calling it. The connection comes from
    ``conn_factory()`` (e.g. ``pool.connection``) or a per-process pool on
    ``dsn``.
    """
    _check_ids(consumer, "-")
    source = _connection_source(dsn, conn_factory, pool_size)

    def decorate(func: Callable[..., R]) -> Callable[..., R | None]:
        get_id = _key_getter(func, key)
        wants_conn = "conn" in inspect.signature(func).parameters

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> R | None:
            message_id = get_id(*args, **kwargs)
            with (
                source() as conn,
                receive(conn, consumer=consumer, message_id=message_id, table=table) as fresh,
            ):
                if not fresh:
                    return None
                if wants_conn:
                    kwargs["conn"] = conn
                with running(conn):
                    return func(*args, **kwargs)

        return wrapper

    return decorate
