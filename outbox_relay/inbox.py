"""The consumer-side inbox: turn at-least-once delivery into one effect.

The relay may deliver a message more than once (a lost lease, a timeout
after the receiver already acted, a broker redelivery), always with the same
idempotency key. A receiver records ``(consumer, message_id)`` in its inbox
table *in the same transaction* as the message's effect::

    with inbox.receive(conn, consumer="billing", message_id=key) as fresh:
        if fresh:
            charge(conn, payload)          # same transaction as the inbox row

The first delivery inserts the row and its effect commits with it; a later
duplicate finds the row and skips. A *concurrent* duplicate's INSERT waits on
the first one's uncommitted row: when that commits, the duplicate sees the
conflict and skips; when it rolls back (the effect failed), the duplicate
goes ahead. So exactly one effect lands, under READ COMMITTED (the default);
under REPEATABLE READ or SERIALIZABLE the waiting duplicate gets a
serialization failure instead, which the caller retries.

Effects outside the database (an e-mail, an HTTP call) are not covered: the
inbox only narrows their duplicate window to a failed commit after the effect.

Also here: ``@once`` for plain functions, ``InboxTask`` / ``inbox_task`` for
Celery consumer tasks, ``purge_inbox`` for retention and ``ensure_inbox``
for a consumer database that has no outbox.
"""

from __future__ import annotations

import atexit
import contextvars
import functools
import inspect
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from typing import Any, TypeVar

import psycopg
from celery import Task
from psycopg import sql
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool

from .errors import ConfigError, InvalidIdentifier, OutboxError
from .model import Message
from .sql.queries import raw_migration, raw_queries
from .table import OutboxTable

__all__ = [
    "InboxError",
    "InboxTable",
    "InboxTask",
    "current_connection",
    "ensure_inbox",
    "inbox_task",
    "message_id_from_request",
    "once",
    "purge_inbox",
    "receive",
    "record",
    "seen",
]

log = logging.getLogger("outbox_relay.inbox")

R = TypeVar("R")
ConnectionFactory = Callable[[], AbstractContextManager[psycopg.Connection[Any]]]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# The retention index is the table name plus "_received", within
# PostgreSQL's 63-byte identifier limit.
_MAX_NAME = 63 - len("_received")
# Keys land in a btree primary key; PostgreSQL rejects index rows over ~2.7 kB.
_MAX_KEY_BYTES = 1024


class InboxError(OutboxError):
    """The inbox was used in a way that cannot de-duplicate (no transaction, no id)."""


# ------------------------------------------------------------------- table
@dataclass(frozen=True)
class InboxTable:
    """Where an inbox lives. By default beside the outbox: ``public.outbox_inbox``."""

    name: str = "outbox_inbox"
    schema: str = "public"

    def __post_init__(self) -> None:
        for kind, value, limit in (("table", self.name, _MAX_NAME), ("schema", self.schema, 63)):
            if not isinstance(value, str) or not _NAME.fullmatch(value) or len(value) > limit:
                raise InvalidIdentifier(
                    f"invalid inbox {kind} name {value!r}: use up to {limit} letters, digits "
                    "and underscores, not starting with a digit"
                )

    @classmethod
    def beside(cls, outbox: OutboxTable | str | None = None) -> InboxTable:
        """The inbox of an outbox table (``schema.<outbox>_inbox``)."""
        table = OutboxTable.parse(outbox)
        return cls(name=f"{table.name}_inbox", schema=table.schema)

    @classmethod
    def parse(cls, value: InboxTable | str | None) -> InboxTable:
        """None: beside ``OUTBOX_TABLE`` (default ``outbox``); ``"[schema.]table"``: that table."""
        if value is None:
            return cls.beside(os.environ.get("OUTBOX_TABLE") or None)
        if isinstance(value, InboxTable):
            return value
        if not isinstance(value, str):
            raise InvalidIdentifier(f"inbox table must be a string, not {type(value).__name__}")
        schema, dot, name = value.rpartition(".")
        return cls(name=name, schema=schema) if dot else cls(name=name)

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"


TableLike = InboxTable | str | None
# sql/migrations/0002_inbox.sql creates the inbox beside the outbox.
INBOX_MIGRATION = 2


@cache
def _queries(table: InboxTable) -> dict[str, str]:
    # The inbox queries come from sql/inbox.sql through the same loader as
    # every other query; rendered here so an inbox can have any name.
    identifiers = {
        "inbox": sql.Identifier(table.schema, table.name),
        "ix_inbox_received": sql.Identifier(f"{table.name}_received"),
        "schema": sql.Identifier(table.schema),
    }
    texts = {name: text for name, text in raw_queries().items() if name.startswith("inbox_")}
    # ensure_inbox() runs the inbox migration itself, under this inbox's names.
    texts["inbox_create"] = raw_migration(INBOX_MIGRATION)
    return {name: sql.SQL(text).format(**identifiers).as_string() for name, text in texts.items()}


def _q(table: TableLike, name: str) -> str:
    return _queries(InboxTable.parse(table))[name]


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
    row = conn.execute(
        _q(table, "inbox_record"), {"consumer": consumer, "message_id": message_id, "now": now}
    ).fetchone()
    return row is not None


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
    row = conn.execute(
        _q(table, "inbox_seen"), {"consumer": consumer, "message_id": message_id}
    ).fetchone()
    return bool(row and row[0])


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
    query = _q(table, "inbox_purge")
    params = {"older_than": older_than, "consumer": consumer, "batch": batch, "now": now}
    total = 0
    while True:
        with conn.transaction():
            deleted = conn.execute(query, params).rowcount
        total += max(deleted, 0)
        if deleted < batch:
            return total


def ensure_inbox(conn: psycopg.Connection[Any], *, table: TableLike = None) -> InboxTable:
    """Create the inbox table if it is missing (idempotent; safe concurrently).

    ``outbox_relay.migrate`` already creates the inbox beside the outbox;
    this is for a consumer's database that has no outbox, or an inbox with a
    name of its own.
    """
    inbox = InboxTable.parse(table)
    q = _queries(inbox)
    with conn.transaction():
        conn.execute(q["inbox_lock"], {"key": f"outbox_relay:inbox:{inbox.qualified}"})
        conn.execute(q["inbox_create_schema"])
        conn.execute(q["inbox_create"])
    return inbox


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


_pools: dict[tuple[int, str], ConnectionPool[psycopg.Connection[Any]]] = {}
_pools_lock = threading.Lock()


def _pool(dsn: str, size: int) -> ConnectionPool[psycopg.Connection[Any]]:
    """One pool per DSN per process, opened after fork (never inherited)."""
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


def _connection_source(
    dsn: str | None, conn_factory: ConnectionFactory | None, pool_size: int = 4
) -> ConnectionFactory:
    if (dsn is None) == (conn_factory is None):
        raise ConfigError("the inbox needs exactly one of dsn= or conn_factory=")
    if conn_factory is not None:
        return conn_factory
    assert dsn is not None
    return lambda: _pool(dsn, pool_size).connection()


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
                token = _current.set(conn)
                try:
                    if wants_conn:
                        kwargs["conn"] = conn
                    return func(*args, **kwargs)
                finally:
                    _current.reset(token)

        return wrapper

    return decorate


# ---------------------------------------------------------------- Celery
_ID_HEADERS = ("idempotency-key", "Idempotency-Key", "idempotency_key")


def message_id_from_request(request: Any) -> str | None:
    """The message id of a Celery task request.

    In order: an ``Idempotency-Key`` header (set by outbox-relay's task
    publisher, or by any producer that has one); the task id (outbox-relay
    sends its tasks with ``task_id`` = idempotency key, and a broker
    redelivery keeps the task id); the ``outbox-id`` header.
    """
    headers = getattr(request, "headers", None) or {}
    for name in _ID_HEADERS:
        value = headers.get(name) if isinstance(headers, dict) else None
        if value is None:
            value = getattr(request, name, None)
        if value:
            return str(value)
    task_id = getattr(request, "id", None)
    if task_id:
        return str(task_id)
    outbox_id = headers.get("outbox-id") if isinstance(headers, dict) else None
    outbox_id = outbox_id or getattr(request, "outbox-id", None)
    return str(outbox_id) if outbox_id else None


class InboxTask(Task):  # type: ignore[misc]  # celery is untyped
    """A Celery task base whose body runs once per message, in one transaction with the inbox row.

    Use ``@app.task(base=InboxTask)`` or ``@inbox_task(app, ...)``. The body
    writes its effect through ``self.inbox_conn`` (or
    ``inbox.current_connection()``); a duplicate delivery returns
    ``on_duplicate(...)`` (None) without running the body. If the body
    raises, the inbox row rolls back with the effect, and a redelivery
    (``acks_late``) runs it again.

    Settings (task attributes, e.g. ``@app.task(base=InboxTask,
    inbox_consumer="billing")``): ``inbox_consumer`` (default: the task
    name), ``inbox_dsn`` (default: Celery setting ``outbox_inbox_dsn``, then
    ``OUTBOX_INBOX_DSN``, ``outbox_dsn``, ``OUTBOX_DSN``),
    ``inbox_conn_factory``, ``inbox_table``, ``inbox_pool_size``.
    """

    inbox_consumer: str | None = None
    inbox_dsn: str | None = None
    inbox_conn_factory: ConnectionFactory | None = None
    inbox_table: TableLike = None
    inbox_pool_size: int = 4

    @property
    def inbox_conn(self) -> psycopg.Connection[Any]:
        return current_connection()

    def inbox_message_id(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """Override to take the id from the arguments instead of the request."""
        message_id = message_id_from_request(self.request)
        if not message_id:
            raise InboxError(
                f"task {self.name}: no message id (no Idempotency-Key header and no task id); "
                "call it through a broker, or override inbox_message_id()"
            )
        return message_id

    def inbox_connection(self) -> AbstractContextManager[psycopg.Connection[Any]]:
        """A connection for one inbox transaction (from the per-process pool)."""
        if self.inbox_conn_factory is not None:
            return self.inbox_conn_factory()
        return _pool(self._inbox_dsn(), self.inbox_pool_size).connection()

    def _inbox_dsn(self) -> str:
        if self.inbox_dsn:
            return self.inbox_dsn
        conf = self.app.conf
        for found in (
            conf.get("outbox_inbox_dsn"),
            os.environ.get("OUTBOX_INBOX_DSN"),
            conf.get("outbox_dsn"),
            os.environ.get("OUTBOX_DSN"),
        ):
            if found:
                return str(found)
        raise ConfigError(
            f"task {self.name} has no inbox database: set inbox_dsn on the task, the Celery "
            "setting outbox_inbox_dsn, or OUTBOX_INBOX_DSN"
        )

    def on_duplicate(self, message_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """What a duplicate delivery returns (the body did not run)."""
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        message_id = self.inbox_message_id(args, kwargs)
        consumer = self.inbox_consumer or self.name
        with (
            self.inbox_connection() as conn,
            receive(
                conn, consumer=consumer, message_id=message_id, table=self.inbox_table
            ) as fresh,
        ):
            if not fresh:
                return self.on_duplicate(message_id, args, kwargs)
            token = _current.set(conn)
            try:
                return super().__call__(*args, **kwargs)
            finally:
                _current.reset(token)


def inbox_task(
    app: Any,
    *,
    consumer: str | None = None,
    dsn: str | None = None,
    conn_factory: ConnectionFactory | None = None,
    table: TableLike = None,
    base: type[InboxTask] = InboxTask,
    **options: Any,
) -> Callable[[Callable[..., Any]], Any]:
    """``@inbox_task(app, consumer="billing")``: ``app.task`` with the ``InboxTask`` base.

    Other keyword arguments go to ``app.task`` (``name``, ``queue``,
    ``acks_late`` ...). ``acks_late=True`` is the default here: a worker that
    dies mid-task then gets the message again, and the inbox absorbs it.
    """
    attrs: dict[str, Any] = {
        "inbox_consumer": consumer,
        "inbox_dsn": dsn,
        "inbox_table": table,
    }
    attrs = {k: v for k, v in attrs.items() if v is not None}
    if conn_factory is not None:
        # A plain function stored on the class would become a method.
        attrs["inbox_conn_factory"] = staticmethod(conn_factory)
    options.setdefault("acks_late", True)
    decorator: Callable[[Callable[..., Any]], Any] = app.task(base=base, **attrs, **options)
    return decorator
